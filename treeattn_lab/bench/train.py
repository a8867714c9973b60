"""``python -m treeattn_lab bench train``: one training step on rollout tries, in every engine mode.

A step is ``zero_grad`` + :func:`treeattn_lab.engine.tree_backward` + ``AdamW.step`` on a Llama-style
TinyLM with random weights (on a GPU about 0.49B parameters, bf16: 24 layers, width 1024, 8 query heads
and 2 kv heads of 128, SwiGLU 4864, vocabulary 32000), over each bundled rollout set. Modes: ``flat``
(every rollout on its own, padded), ``packed`` (tree attention over the packed trie), ``dfs`` (path
materialization), ``dfs-ckpt`` (dfs with the model's layers checkpointed, in blocks eight times longer),
``dfs-budget`` (dfs in blocks as long as the token budget, layers not checkpointed: a packed
micro-batch's memory, no prefix carried over a cut) and ``auto`` (the cost model, calibrated on this
device first, picks per micro-batch among the first three, or the whole trie as one dfs walk).

Each (set, mode) runs one warm-up step, then times ``--reps`` steps on the same trie: what is built once
per trie (packs and their device copies, the micro-batch tries a plan runs) is built in the warm-up. An
RL step shares that work across its log-prob and training passes, not across steps.

Reported per (set, mode): step time, throughput in flat tokens per second (the tokens a flat trainer would
process, so modes compare directly), speed-up over flat, peak CUDA memory of the backward call (total, and
above what was allocated before it), and the modes ``auto`` chose. Beside the token ratio stands the *work
ratio*: the model's FLOPs over the flat rollouts (tokens and attended pairs, without padding) over its
FLOPs over the trie, the speed-up a tree mode reaches at flat's FLOP rate with nothing recomputed. A
precision check runs every mode in bf16 against fp32 flat gradients on a subset. At the end the run is
checked against its targets (:func:`targets`): auto against flat and against the best mode, DFS memory
against packed, and the bf16 gradient error. On a CPU a tiny model on small subsets runs the same code
(``--quick``).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
from tqdm.auto import tqdm

from ..datasets import load_rollouts
from ..engine import MODES, calibrate, compile_layers, tree_backward
from ..engine.time_fit import model_work
from ..reference import TinyLM, TinyLMConfig
from ..trie import RolloutTrie
from .harness import (
    add_out_argument,
    choice_list,
    environment,
    flat_gradient,
    positive_int,
    print_table,
    result_path,
    synchronize,
    write_results,
)
from .step_profile import profile_step

SETS = ("grpo_math", "agentic", "tree_search", "low_sharing")
# a row beside the engine's modes: dfs with the model's layers checkpointed (each layer keeps only its
# input for backward and recomputes the rest), so that blocks CHECKPOINTED_BLOCKS times longer fit in
# less memory than dfs's own blocks: fewer, larger calls, and less host work per token
CHECKPOINTED_DFS = "dfs-ckpt"
CHECKPOINTED_BLOCKS = 8
DFS_ROWS = ("dfs", CHECKPOINTED_DFS)
# a row beside them: dfs in blocks of the token budget, layers not checkpointed (what auto's whole-trie
# walk runs in): the memory of a packed micro-batch, and no prefix carried over the budget's cuts
BUDGET_DFS = "dfs-budget"
# run flat and auto only (one timed step each), auto under --memory-limit-gib (see rollout_set)
LARGE_SETS = ("agentic_x2", "agentic_x4")
LLAMA_05B = TinyLMConfig(vocab_size=32000, dim=1024, n_layers=24, n_heads=8, n_kv_heads=2, ffn_dim=4864)
TINY = TinyLMConfig(vocab_size=32000, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128)


def rollout_set(name: str, *, shrink: int = 1, first: int | None = None) -> list[list[int]]:
    """The first ``first`` (None: all) rollouts of bundled set ``name``, every trie node cut to
    ``ceil(len / shrink)`` tokens (the same trie shape, ``shrink`` times fewer tokens); ``"<set>_x4"``:
    four copies of them under four different first tokens (a trie four times as large that shares
    nothing across copies)."""
    base, _, copies = name.partition("_x")
    seqs = load_rollouts(base if copies.isdigit() else name)[:first]
    if shrink > 1:
        trie = RolloutTrie.from_sequences(seqs)
        cut = [n.tokens[: -(-len(n.tokens) // shrink)] for n in trie.nodes]
        seqs = [[t for n in trie.path(trie.seq_end_node[i]) for t in cut[n]] for i in range(len(seqs))]
    if copies.isdigit():
        seqs = [[1 + c] + s for c in range(int(copies)) for s in seqs]
    return seqs


def timed_steps(model, optimizer, trie, *, mode, reps, warmup, **kwargs) -> dict:
    """Median step time over ``reps`` steps after ``warmup``; memory and choices of the last step."""
    device = next(model.parameters()).device
    times, result, static = [], None, 0
    for i in range(warmup + reps):
        optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        static = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        t0 = time.perf_counter()
        result = tree_backward(model, trie, None, mode=mode, **kwargs)
        optimizer.step()
        synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    rep = result.report
    peak = rep.peak_memory_bytes
    return {
        "step_s": statistics.median(times),
        "peak_gib": None if peak is None else peak / 2**30,
        "activation_gib": None if peak is None else (peak - static) / 2**30,
        "choices": rep.choices,
        "recomputed_tokens": rep.recomputed_tokens,
        "loss": result.loss,
    }


def precision_check(model, seqs, *, block_tokens, token_budget) -> list[dict]:
    """Relative error of each mode's (and :data:`CHECKPOINTED_DFS`'s) bf16 (model dtype) gradient against
    the fp32 flat gradient."""
    trie = RolloutTrie.from_sequences(seqs)
    reference = TinyLM(model.cfg).to(next(model.parameters()).device)
    reference.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    tree_backward(reference, trie, None, mode="flat", token_budget=token_budget)
    want = flat_gradient(reference)
    del reference
    rows = []
    engine = {"block_tokens": block_tokens, "token_budget": token_budget}
    for row in (*MODES, CHECKPOINTED_DFS):
        model.zero_grad(set_to_none=True)
        with row_settings(model, row, engine) as (mode, settings):
            tree_backward(model, trie, None, mode=mode, **settings)
        rows.append({"mode": row, "grad_rel_err": float((flat_gradient(model) - want).norm() / want.norm())})
    model.zero_grad(set_to_none=True)
    return rows


def _target(name: str, value: float, goal: float, lower_is_better: bool = False) -> dict:
    met = value <= goal if lower_is_better else value >= goal
    return {"target": name, "value": value, "goal": goal, "lower_is_better": lower_is_better, "met": met}


def targets(rows: list[dict], precision: list[dict], profiles: list[dict] = ()) -> list[dict]:
    """The engine's targets on this run's rows: ``auto`` at least 0.8 x token ratio x flat where the trie
    shares (0.95 x flat where it does not) and 0.95 x the best mode; on a large set under a memory limit,
    auto choosing dfs and beating flat; for each dfs row (:func:`dfs_targets`) at least 0.8 x packed on
    the agentic set with at most a quarter of its peak memory, and 0.8 x flat on low_sharing; the GPU busy
    at least 85% of a profiled dfs step; and every mode's bf16 gradient within 2e-2 of fp32 flat."""
    by = {(r["set"], r["mode"]): r for r in rows}
    out = []
    for name in sorted({r["set"] for r in rows}):
        auto, flat = by.get((name, "auto")), by.get((name, "flat"))
        if not (auto and flat):
            continue
        best = max((by[(name, m)] for m in MODES if (name, m) in by), key=lambda r: r["tokens_per_s"])
        if name in LARGE_SETS:
            out.append(_target(f"{name}: auto ({auto['choices']}) >= 1.0 x flat", auto["speedup"], 1.0))
            out.append(_target(f"{name}: auto chose dfs", float("dfs" in auto["choices"]), 1.0))
            continue
        if name == "low_sharing":
            out.append(_target(f"{name}: auto >= 0.95 x flat", auto["speedup"], 0.95))
        else:
            out.append(
                _target(
                    f"{name}: auto >= 0.8 x token_ratio x flat", auto["speedup"], 0.8 * auto["token_ratio"]
                )
            )
        out.append(
            _target(
                f"{name}: auto >= 0.95 x best mode ({best['mode']})",
                auto["tokens_per_s"] / best["tokens_per_s"],
                0.95,
            )
        )
    for row in DFS_ROWS:
        out += dfs_targets(by, row)
    for p in profiles:
        if p["mode"] in DFS_ROWS and "busy_share" in p:
            name = f"{p['set']}: GPU busy (kernel time / wall) of a {p['mode']} step >= 0.85"
            out.append(_target(name, p["busy_share"], 0.85))
    for p in precision:
        out.append(_target(f"bf16 {p['mode']} grad vs fp32 flat <= 2e-2", p["grad_rel_err"], 2e-2, True))
    return out


def dfs_targets(by: dict, row: str) -> list[dict]:
    """The targets of dfs row ``row`` (``"dfs"`` or :data:`CHECKPOINTED_DFS`): at least 0.8 x packed on
    the agentic set with at most a quarter of its peak memory (total, and above the static), and 0.8 x
    flat on low_sharing."""
    out = []
    dfs, packed = by.get(("agentic", row)), by.get(("agentic", "packed"))
    if dfs and packed:
        speed = dfs["tokens_per_s"] / packed["tokens_per_s"]
        out.append(_target(f"agentic: {row} >= 0.8 x packed", speed, 0.8))
    if dfs and packed and dfs["peak_gib"] is not None:
        peaks = (("peak <= 0.25 x packed peak", "peak_gib"),
                 ("activation peak <= 0.25 x packed (above static)", "activation_gib"))
        for name, key in peaks:
            out.append(_target(f"agentic: {row} {name}", dfs[key] / packed[key], 0.25, True))
    dfs, flat = by.get(("low_sharing", row)), by.get(("low_sharing", "flat"))
    if dfs and flat:
        out.append(_target(f"low_sharing: {row} >= 0.8 x flat", dfs["speedup"], 0.8))
    return out


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m treeattn_lab bench train",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--sets", type=choice_list(SETS + LARGE_SETS), default=list(SETS), help="comma list of rollout sets"
    )
    parser.add_argument("--quick", action="store_true", help="tiny model, small subsets (default on a CPU)")
    parser.add_argument("--block-tokens", type=positive_int, default=None)
    parser.add_argument("--token-budget", type=positive_int, default=None)
    parser.add_argument("--reps", type=positive_int, default=2)
    parser.add_argument("--calibration-s", type=float, default=60.0)
    parser.add_argument(
        "--memory-limit-gib",
        type=float,
        default=None,
        help="the memory_limit of auto on the large sets (" + ", ".join(LARGE_SETS) + ")",
    )
    parser.add_argument(
        "--profile",
        type=choice_list(SETS),
        default=[],
        help="comma list of sets whose packed and dfs steps also run under torch.profiler",
    )
    parser.add_argument(
        "--compile-layers",
        action="store_true",
        help="torch.compile every TinyLM layer first (engine.compile_layers); writes train-compiled-layers",
    )
    add_out_argument(parser)
    return parser.parse_args(argv)


def measures_memory(cost_model) -> bool:
    """Whether ``cost_model`` can plan under a ``memory_limit``: calibrated, every mode's peak measured."""
    return cost_model.calibrated and all(
        cost_model.fit_info.get(m, {}).get("memory") != "prior" for m in MODES
    )


def bench_trie(name: str, quick: bool) -> RolloutTrie:
    """The trie of set ``name``; ``quick``: its first 12 rollouts, every node cut 32 times shorter."""
    return RolloutTrie.from_sequences(rollout_set(name, shrink=32, first=12) if quick else rollout_set(name))


@contextlib.contextmanager
def layers_checkpointed(model, checkpointed: bool = True):
    """TinyLM ``model``'s layers checkpointed (or not) inside the block, as they were after it."""
    before = model.gradient_checkpointing
    model.gradient_checkpointing = checkpointed
    try:
        yield
    finally:
        model.gradient_checkpointing = before


@contextlib.contextmanager
def row_settings(model, row: str, engine: dict):
    """``(engine mode, engine settings)`` of table row ``row``: an engine mode as it is;
    :data:`BUDGET_DFS`: mode dfs in blocks of the token budget; or :data:`CHECKPOINTED_DFS`: mode dfs in
    blocks :data:`CHECKPOINTED_BLOCKS` times longer, the model's layers checkpointed while it runs
    (:func:`layers_checkpointed`)."""
    if row == BUDGET_DFS:
        yield "dfs", {**engine, "block_tokens": engine["token_budget"]}
        return
    if row != CHECKPOINTED_DFS:
        yield row, engine
        return
    with layers_checkpointed(model):
        yield "dfs", {**engine, "block_tokens": engine["block_tokens"] * CHECKPOINTED_BLOCKS}


def train_rows(
    model, optimizer, cost_model, sets, *, quick: bool, reps: int, memory_limit=None, on_row=None, **engine
) -> list[dict]:
    """One row per (set, row): the step of :func:`timed_steps`, the trie's sizes, its work ratio
    (:func:`work_ratio`) and the speed-up; rows are the engine's modes, :data:`CHECKPOINTED_DFS`,
    :data:`BUDGET_DFS` and auto. A set of :data:`LARGE_SETS` runs flat, and auto under ``memory_limit``
    (bytes). Each row is printed as it completes, and ``on_row(rows)`` (where given) sees the rows so far,
    each with its speed-up (a set's flat row runs first)."""
    rows = []
    modes = {name: (("flat",) if name in LARGE_SETS else (*MODES, CHECKPOINTED_DFS, BUDGET_DFS)) + ("auto",)
             for name in sets}
    jobs = [(name, mode) for name in sets for mode in modes[name]]
    for name, mode in (bar := tqdm(jobs, desc="bench train", unit="step")):
        trie = bench_trie(name, quick)
        limit = memory_limit if name in LARGE_SETS and mode == "auto" else None
        stats = trie.stats()
        with row_settings(model, mode, engine) as (engine_mode, settings):
            checkpointed = model.gradient_checkpointing
            r = timed_steps(
                model,
                optimizer,
                trie,
                mode=engine_mode,
                reps=1 if quick or name in LARGE_SETS else reps,
                warmup=1,
                cost_model=cost_model,
                memory_limit=limit,
                **settings,
            )
        rows.append(
            {
                "set": name,
                "mode": mode,
                "memory_limit_gib": None if limit is None else limit / 2**30,
                "block_tokens": settings["block_tokens"],
                "checkpointed": checkpointed,
                "flat_tokens": stats["flat_tokens"],
                "tree_tokens": stats["tree_tokens"],
                "token_ratio": stats["token_ratio"],
                "work_ratio": work_ratio(model, stats),
                "tokens_per_s": stats["flat_tokens"] / r["step_s"],
                **r,
            }
        )
        flat = next(x for x in rows if x["set"] == name and x["mode"] == "flat")
        rows[-1]["speedup"] = rows[-1]["tokens_per_s"] / flat["tokens_per_s"]
        bar.write(f"{name} {mode}: {r['step_s']:.3f} s, peak {r['peak_gib'] or 0:.1f} GiB, {r['choices']}")
        if on_row is not None:
            on_row(rows)
    return rows


def work_ratio(model, stats: dict) -> float:
    """The model's training FLOPs over the flat rollouts (every token and attended pair of each rollout,
    no padding) over its FLOPs over the trie (each tree token and tree pair once): what a tree mode gains
    at flat's FLOP rate, computing nothing twice. ``stats``: :meth:`RolloutTrie.stats`."""
    work = model_work(model)
    token, pair = work["flops_per_token"], work["flops_per_pair"]
    flat = token * stats["flat_tokens"] + pair * stats["flat_attention_pairs"]
    return flat / (token * stats["tree_tokens"] + pair * stats["tree_attention_pairs"])


TRAIN_COLUMNS = [
    ("set", "set"),
    ("mode", "mode"),
    ("token_ratio", "token ratio"),
    ("work_ratio", "work ratio"),
    ("step_s", "step s"),
    ("tokens_per_s", "flat tok/s"),
    ("speedup", "x flat"),
    ("peak_gib", "peak GiB"),
    ("activation_gib", "act. GiB"),
    ("choices", "auto chose"),
    ("recomputed_tokens", "recomputed"),
]
PROFILE_COLUMNS = [
    ("set", "set"),
    ("mode", "mode"),
    ("wall_s", "wall s"),
    ("kernel_s", "kernel s"),
    ("busy_share", "busy"),
    ("kernel_launches", "launches"),
    ("aten_ops", "aten ops"),
    ("host_reads", "host reads"),
    ("device_syncs", "device syncs"),
]


def run_setup(args) -> tuple[bool, torch.device, torch.dtype, TinyLMConfig, dict]:
    """What a training bench runs on: ``(quick, device, dtype, model config, engine settings)``. A GPU runs
    the 0.49B TinyLM in bf16 with 4096-token blocks and 32768-token micro-batches; a CPU (or ``--quick``)
    the tiny one in fp32 with 64 / 512."""
    cuda = torch.cuda.is_available()
    quick = args.quick or not cuda
    engine = {
        "block_tokens": args.block_tokens or (64 if quick else 4096),
        "token_budget": args.token_budget or (512 if quick else 32768),
    }
    return (quick, torch.device("cuda" if cuda else "cpu"), torch.bfloat16 if cuda else torch.float32,
            TINY if quick else LLAMA_05B, engine)


def check_memory_limit_applies(sets, device) -> None:
    """Stop before any work where ``--memory-limit-gib`` could not act: no large set asked for, or a device
    that reports no peak memory (what the cost model's memory fit needs)."""
    if not set(sets) & set(LARGE_SETS):
        raise SystemExit(f"--memory-limit-gib applies to the large sets ({', '.join(LARGE_SETS)}); "
                         f"--sets {','.join(sets)} has none")
    if device.type != "cuda":
        raise SystemExit(f"--memory-limit-gib needs peak memory, measured on CUDA only, not {device}")


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    quick, device, dtype, cfg, engine = run_setup(args)
    if args.memory_limit_gib is not None:
        check_memory_limit_applies(args.sets, device)
    torch.manual_seed(0)
    model = TinyLM(cfg).to(device, dtype)
    if args.compile_layers:
        compile_layers(model)  # before calibration: the cost model then learns the compiled layers' costs
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    cost_model = calibrate(model, **engine, seconds=args.calibration_s, use_cache=False)
    limit = None if args.memory_limit_gib is None else args.memory_limit_gib * 2**30
    if limit is not None and not measures_memory(cost_model):
        raise SystemExit(
            f"--memory-limit-gib needs a cost model calibrated with every mode's peak memory measured; on "
            f"{device} calibration gave calibrated={cost_model.calibrated}, memory fits "
            f"{ {m: cost_model.fit_info.get(m, {}).get('memory') for m in MODES} } in "
            f"{args.calibration_s:g} s: raise --calibration-s"
        )
    env = environment()
    name = "train-compiled-layers" if args.compile_layers else "train"
    extra = {"dtype": str(dtype), "params": n_params, "config": cfg.__dict__, **engine}
    extra.update(cost_model=cost_model.to_dict(), quick=quick, compile_layers=args.compile_layers)
    extra.update(memory_limit_gib=None if limit is None else args.memory_limit_gib)

    def save_partial(rows_so_far):  # a run cut short keeps its rows and cost model beside any earlier result
        write_results(f"{name}-partial", rows_so_far, env, directory=args.out,
                      extra={**extra, "bench": name, "partial": True})  # rendered as its bench

    rows = train_rows(
        model, optimizer, cost_model, args.sets, quick=quick, reps=args.reps, memory_limit=limit,
        on_row=save_partial, **engine
    )
    profiles = []
    for set_name in args.profile:
        for row in ("packed", *DFS_ROWS):
            with row_settings(model, row, engine) as (mode, settings):
                trie = bench_trie(set_name, quick)
                step = profile_step(model, trie, mode=mode, cost_model=cost_model, **settings)
            profiles.append({"set": set_name, **step, "mode": row, "block_tokens": settings["block_tokens"]})
    subset = [s[:1024] for s in load_rollouts("grpo_math")[: 4 if quick else 32]]
    precision = precision_check(
        model, subset, block_tokens=engine["block_tokens"], token_budget=min(engine["token_budget"], 8192)
    )
    checks = targets(rows, precision, profiles)

    title = (
        f"training step, {env['device']}, {str(dtype).removeprefix('torch.')}, TinyLM {n_params / 1e9:.2f}B, "
        f"block {engine['block_tokens']}, budget {engine['token_budget']}"
    )
    print_table(title, TRAIN_COLUMNS, rows)
    print_table(
        "gradient precision (bf16 vs fp32 flat)", [("mode", "mode"), ("grad_rel_err", "rel err")], precision
    )
    if profiles:
        print_table("one tree_backward under torch.profiler", PROFILE_COLUMNS, profiles)
    print_table(
        "targets", [("target", "target"), ("value", "value"), ("goal", "goal"), ("met", "met")], checks
    )
    extra.update(precision=precision, targets=checks, profile=profiles)
    path = write_results(name, rows, env, directory=args.out, extra=extra)
    result_path(f"{name}-partial", env, args.out).unlink(missing_ok=True)  # the whole run replaces it
    print(f"wrote {path}")
    return 0
