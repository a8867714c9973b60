"""``python -m treeattn_lab bench tree-tune``: sweep the tree kernel's launch configs on this GPU.

Times the forward for every forward config, then forward+backward for every dK/dV config (with the
best forward) and every dQ config (with the best of both), over the research cases. A config is a
``LaunchConfig(block_m, block_n, num_warps, num_stages, tma)``: each tile shape runs with pointer loads and
with TMA tensor-descriptor loads (``tma=True``, sm_90+; ``--loads`` picks one), so one run compares the two
load paths; a summary gives the best of each per case and pass. ``--passes`` picks the sweeps. Every row
also records ``err``, the relative error of its output (forward) or of its gradients (forward+backward)
against the default launch's, so a fast but wrong variant shows. The winners belong in ``TREE`` of
``kernels/tuning.py``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..kernels.tuning import LaunchConfig
from ..trie import RolloutTrie
from .harness import add_out_argument, environment, positive_int, print_table, time_ms, write_results
from .tree import research_cases

# Tile shapes per kernel: (block_m, block_n, num_warps, num_stages). Left out after the first H200 sweep
# (bench/results/tree-tune__*.json): shapes over the 227 KB shared-memory limit at head dim 128
# (128x128 with 4 stages forward, 3 stages backward) and the slowest backward shapes.
FWD_SHAPES = [(64, 64, 4, 3), (128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 8, 4), (128, 32, 4, 3),
              (128, 32, 4, 4), (256, 64, 8, 3)]
DKDV_SHAPES = [(128, 128, 8, 2), (64, 128, 8, 2), (64, 64, 4, 2), (32, 128, 8, 3)]
DQ_SHAPES = [(128, 128, 8, 2), (128, 64, 8, 2), (128, 32, 4, 3), (64, 64, 4, 2), (128, 32, 8, 3)]
LOADS = {"both": (False, True), "pointer": (False,), "tma": (True,)}
PASSES = ("fwd", "dkdv", "dq")


def candidates(shapes, loads: str = "both") -> list[LaunchConfig]:
    """Every shape with each load path of ``loads``, pointer loads first (a TMA launch that faulted would
    leave the CUDA context unusable for what follows)."""
    return [LaunchConfig(*shape, tma=tma) for tma in LOADS[loads] for shape in shapes]


def relative_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """Largest ``||got - want|| / ||want||`` over matching tensors, in fp32."""
    return max(float((g.float() - w.float()).norm() / w.float().norm().clamp_min(1e-30))
               for g, w in zip(got, want, strict=True))


def _sweep(name, configs, step, result, want, grad_to_none, flops, tma_ok, device) -> list[dict]:
    rows = []
    for cfg in configs:
        if cfg.tma and not tma_ok:
            rows.append({"case": name, "config": cfg, "error": "TMA not usable here (sm_90+, aligned rows)"})
            continue
        try:
            ms = time_ms(lambda c=cfg: step(c), grad_to_none=grad_to_none, device=device)
            err = relative_error(result(cfg), want)
        except Exception as e:  # noqa: BLE001 - a config that does not fit (shared memory) is skipped
            rows.append({"case": name, "config": cfg, "error": str(e)[:80]})
            continue
        rows.append({"case": name, "config": cfg, "ms": ms, "tflops": flops / ms / 1e9, "err": err})
    return rows


def _fastest(rows: list[dict]) -> tuple:
    return min((r for r in rows if "ms" in r), key=lambda r: r["ms"])["config"]


def tune_case(case, heads: int, dim: int, loads: str = "both", device: str = "cuda",
              dtype: torch.dtype = torch.bfloat16, passes=PASSES) -> list[dict]:
    """Rows of one case; ``device`` / ``dtype`` other than the GPU's bf16 only for a CPU smoke run.

    ``passes``: which sweeps run (the others use the default launches): ``fwd``, ``dkdv``, ``dq``.
    """
    from ..kernels.attention_core import tma_usable
    from ..kernels.tree_attention import triton_tree_attention

    passes = tuple(passes.split(",")) if isinstance(passes, str) else tuple(passes)
    unknown = set(passes) - set(PASSES)
    if unknown:
        raise ValueError(f"unknown tune passes {sorted(unknown)}; choose from {PASSES}")
    pack = RolloutTrie.from_sequences(case.sequences).pack().to(device)
    flops = pack.attended_pairs() * 4 * heads * dim
    q, k, v = (torch.randn(pack.num_tokens, heads, dim, device=device, dtype=dtype, requires_grad=True)
               for _ in range(3))
    do = torch.randn_like(q)
    tma_ok = tma_usable(q, k, v, do)

    def forward(c):
        return triton_tree_attention(q, k, v, pack, fwd_config=c)

    def grads(step, c):  # taken out of q, k, v: later backward calls would accumulate into them
        for x in (q, k, v):
            x.grad = None
        step(c)
        out = [x.grad for x in (q, k, v)]
        for x in (q, k, v):
            x.grad = None
        return out

    want_out = [triton_tree_attention(q, k, v, pack).detach()]  # the default launch
    want_grads = grads(lambda c: triton_tree_attention(q, k, v, pack).backward(do), None)
    rows, best = [], {"fwd": None, "dkdv": None}

    def sweep(label, configs, step, result, want, grad_to_none, pass_flops):
        timed = _sweep(case.name, configs, step, result, want, grad_to_none, pass_flops, tma_ok, device)
        rows.extend({**r, "pass": label} for r in timed)
        return _fastest(timed) if any("ms" in r for r in timed) else None

    if "fwd" in passes:
        best["fwd"] = sweep("fwd", candidates(FWD_SHAPES, loads), forward, lambda c: [forward(c).detach()],
                            want_out, None, flops)

    def with_dkdv(c):
        triton_tree_attention(q, k, v, pack, fwd_config=best["fwd"], dkdv_config=c).backward(do)

    def with_dq(c):
        triton_tree_attention(q, k, v, pack, fwd_config=best["fwd"], dkdv_config=best["dkdv"],
                              dq_config=c).backward(do)

    if "dkdv" in passes:
        best["dkdv"] = sweep("fwd+bwd, dkdv", candidates(DKDV_SHAPES, loads), with_dkdv,
                             lambda c: grads(with_dkdv, c), want_grads, [q, k, v], 3.5 * flops)
    if "dq" in passes:
        sweep("fwd+bwd, dq", candidates(DQ_SHAPES, loads), with_dq, lambda c: grads(with_dq, c), want_grads,
              [q, k, v], 3.5 * flops)
    return rows


def load_path_summary(rows: list[dict]) -> list[dict]:
    """Per case and pass: the fastest pointer-load and TMA configs and TMA's speedup over pointers."""
    out = []
    for key in dict.fromkeys((r["case"], r["pass"]) for r in rows):
        timed = [r for r in rows if (r["case"], r["pass"]) == key and "ms" in r]
        best = {tma: min((r for r in timed if r["config"].tma == tma), key=lambda r: r["ms"], default=None)
                for tma in (False, True)}
        if best[False] is None or best[True] is None:
            continue
        out.append({"case": key[0], "pass": key[1], "pointer": _shape(best[False]["config"]),
                    "pointer_ms": best[False]["ms"], "tma": _shape(best[True]["config"]),
                    "tma_ms": best[True]["ms"], "tma_speedup": best[False]["ms"] / best[True]["ms"]})
    return out


def _shape(config: LaunchConfig) -> str:
    return str((config.block_m, config.block_n, config.num_warps, config.num_stages))


def _passes(text: str) -> tuple[str, ...]:
    passes = tuple(text.split(","))
    unknown = sorted(set(passes) - set(PASSES))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown tune passes {unknown}; choose from {','.join(PASSES)}")
    return passes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m treeattn_lab bench tree-tune", description=__doc__)
    parser.add_argument("--heads", type=positive_int, default=16)
    parser.add_argument("--dim", type=positive_int, default=128)
    parser.add_argument("--loads", choices=sorted(LOADS), default="both",
                        help="tile loads to sweep: pointer, tma (sm_90+) or both (default)")
    parser.add_argument("--passes", default=",".join(PASSES), type=_passes,
                        help=f"comma-separated sweeps to run, of {','.join(PASSES)} (default: all)")
    add_out_argument(parser)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench tree-tune needs a CUDA GPU (the interpreter cannot time kernels)")
    env = environment()
    rows = []

    def save():  # after every case, so a run cut short keeps what it measured
        listed = [{**r, "config": str(r["config"])} for r in rows]
        path = write_results("tree-tune", listed, env, directory=Path(args.out) if args.out else None,
                             extra={"load_paths": load_path_summary(rows)})
        return listed, path

    for case in tqdm(research_cases(), desc="tune", unit="case"):
        rows += tune_case(case, args.heads, args.dim, args.loads, passes=args.passes)
        listed, path = save()
    columns = [("case", "case"), ("pass", "pass"), ("config", "launch config"), ("ms", "ms"),
               ("tflops", "TFLOP/s"), ("err", "rel err"), ("error", "error")]
    print_table(f"tree kernel configs, {env['device']}", columns, listed)
    summary = load_path_summary(rows)
    if summary:
        print_table("pointer vs TMA loads, best of each", [
            ("case", "case"), ("pass", "pass"), ("pointer", "pointer config"), ("pointer_ms", "ms"),
            ("tma", "TMA config"), ("tma_ms", "ms"), ("tma_speedup", "TMA speedup")], summary)
    print(f"wrote {path}")
    return 0
