"""``python -m treeattn_lab bench dfs-kernels``: which attention kernel a DFS walk should run.

A DFS step runs every block's attention on one kernel for the whole walk (``engine/block_attention.py``):
FlashAttention-4 where it runs and the walk's mean block is at least ``FA4_MIN_WALK_WORK``, SDPA
otherwise. This bench measures both sides of that rule: for each bundled set, block size (the dfs
blocks of ``bench train``, and the longer ones of its ``dfs-ckpt`` row) and with and without the model's
layers checkpointed, one dfs training step (``tree_backward``, from zeroed gradients) with every block
forced onto SDPA, then onto FA4, beside the walk's mean block work, the kernel the rule picks and the
steps' peak memory. Without FA4 (a CPU, or no ``[hopper]`` extra) only the SDPA column is measured. The
model and sizes are those of ``bench train``.
"""

from __future__ import annotations

import argparse
import contextlib
import math

import torch
from tqdm.auto import tqdm

from ..engine import block_attention
from ..engine import dfs as engine_dfs
from ..ops.fa4_tree import fa4_takes
from ..reference import TinyLM
from . import harness
from .step_profile import timed_tree_backward
from .train import CHECKPOINTED_BLOCKS, SETS, bench_trie, layers_checkpointed, run_setup

KERNELS = ("sdpa", "fa4")


@contextlib.contextmanager
def forced_kernel(kind: str):
    """Every walk run inside on ``kind``: ``"fa4"`` wherever FA4 runs, ``"sdpa"`` everywhere (the rule's
    threshold set to 0 or to infinity, and restored afterwards)."""
    if kind not in KERNELS:
        raise ValueError(f"kind must be one of {KERNELS}, got {kind!r}")
    before = block_attention.FA4_MIN_WALK_WORK
    block_attention.FA4_MIN_WALK_WORK = 0 if kind == "fa4" else math.inf
    try:
        yield
    finally:
        block_attention.FA4_MIN_WALK_WORK = before


def mean_block_work(trie, *, block_tokens: int, heads: int, head_dim: int) -> int:
    """The mean block work ``queries x keys x heads x head_dim`` of a dfs step's walk (the whole trie,
    as the engine's dfs mode runs it): what the walk's kernel is chosen by
    (:func:`~treeattn_lab.engine.dfs.walk_kernel`)."""
    kernel = engine_dfs.walk_kernel(engine_dfs.walk(trie.pack(), block_tokens)[1])
    return kernel.mean_rectangle * heads * head_dim


def kernel_rows(model, sets, *, quick: bool, block_sizes, reps: int) -> list[dict]:
    """One row per (set, block size, checkpointed): the mean block work, the rule's pick, and the
    step time with every block on each kernel that runs here (the shortest of ``reps`` after a warm-up) and,
    on CUDA, the peak memory of those steps."""
    cfg, param = model.cfg, next(model.parameters())
    fa4 = fa4_takes(param.device, param.dtype, cfg.head_dim)
    cuda = param.device.type == "cuda"
    jobs = [(name, blocks, ckpt) for name in sets for blocks in block_sizes for ckpt in (False, True)]
    rows = []
    for name, blocks, checkpointed in tqdm(jobs, desc="bench dfs-kernels", unit="walk"):
        trie = bench_trie(name, quick)
        work = mean_block_work(trie, block_tokens=blocks, heads=cfg.n_heads, head_dim=cfg.head_dim)
        row = {"set": name, "block_tokens": blocks, "checkpointed": checkpointed,
               "mean_work_log2": round(math.log2(max(work, 1)), 2),
               "rule_pick": block_attention.WalkKernel.choose(work, fa4)}
        with layers_checkpointed(model, checkpointed):
            for kind in KERNELS if fa4 else ("sdpa",):
                if cuda:
                    torch.cuda.reset_peak_memory_stats(param.device)
                with forced_kernel(kind):
                    steps = [timed_tree_backward(model, trie, mode="dfs", block_tokens=blocks)
                             for _ in range(reps + 1)]
                row[f"{kind}_s"] = min(steps[1:])
                peak = torch.cuda.max_memory_allocated(param.device) / 2**30 if cuda else None
                row[f"{kind}_peak_gib"] = peak
        if "fa4_s" in row:
            row["faster"] = "fa4" if row["fa4_s"] < row["sdpa_s"] else "sdpa"
        rows.append(row)
    model.zero_grad(set_to_none=True)
    return rows


COLUMNS = [("set", "set"), ("block_tokens", "block"), ("checkpointed", "ckpt"),
           ("mean_work_log2", "log2 mean work"), ("rule_pick", "rule pick"), ("sdpa_s", "SDPA s"),
           ("fa4_s", "FA4 s"), ("faster", "faster"), ("sdpa_peak_gib", "SDPA peak GiB"),
           ("fa4_peak_gib", "FA4 peak GiB")]


def _parse(argv):
    parser = argparse.ArgumentParser(prog="python -m treeattn_lab bench dfs-kernels", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sets", type=harness.choice_list(SETS), default=["agentic", "low_sharing"])
    parser.add_argument("--block-tokens", type=harness.int_list, default=None,
                        help="comma list of block sizes (default: bench train's dfs and dfs-ckpt blocks)")
    parser.add_argument("--quick", action="store_true", help="tiny model, small subsets (default on a CPU)")
    parser.add_argument("--reps", type=harness.positive_int, default=1)
    harness.add_out_argument(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    setup = argparse.Namespace(quick=args.quick, block_tokens=None, token_budget=None)
    quick, device, dtype, cfg, engine = run_setup(setup)
    block_sizes = args.block_tokens or [engine["block_tokens"], engine["block_tokens"] * CHECKPOINTED_BLOCKS]
    torch.manual_seed(0)
    model = TinyLM(cfg).to(device, dtype)
    rows = kernel_rows(model, args.sets, quick=quick, block_sizes=block_sizes, reps=args.reps)
    env = harness.environment()
    precision = str(dtype).removeprefix("torch.")
    title = f"a dfs step with every block on one kernel, {env['device']}, {precision}"
    harness.print_table(title, COLUMNS, rows)
    extra = {"config": vars(cfg), "fa4_min_walk_work": block_attention.FA4_MIN_WALK_WORK}
    path = harness.write_results("dfs-kernels", rows, env, directory=args.out, extra=extra)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
