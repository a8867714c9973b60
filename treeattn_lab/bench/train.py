"""``python -m treeattn_lab bench train``: one training step on rollout tries, in every engine mode.

A step is ``zero_grad`` + :func:`treeattn_lab.engine.tree_backward` + ``AdamW.step`` on a Llama-style
TinyLM with random weights (on a GPU about 0.49B parameters, bf16: 24 layers, width 1024, 8 query heads
and 2 kv heads of 128, SwiGLU 4864, vocabulary 32000), over each bundled rollout set. Modes: ``flat``
(every rollout on its own, padded), ``packed`` (tree attention over the packed trie), ``dfs`` (path
materialization) and ``auto`` (the cost model, calibrated on this device first, picks per micro-batch).

Reported per (set, mode): step time, throughput in flat tokens per second (the tokens a flat trainer
would process, so modes compare directly), speed-up over flat, peak CUDA memory of the backward call
(total, and above what was allocated before it), and the modes ``auto`` chose. A precision check runs
every mode in bf16 against fp32 flat gradients on a subset. At the end the run is checked against its
targets (:func:`targets`): auto against flat and against the best mode, DFS memory against packed, and
the bf16 gradient error. On a CPU a tiny model on small subsets runs the same code (``--quick``).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from tqdm.auto import tqdm

from ..datasets import load_rollouts
from ..engine import MODES, calibrate, tree_backward
from ..reference import TinyLM, TinyLMConfig
from ..trie import RolloutTrie
from .harness import add_out_argument, choice_list, environment, positive_int, print_table, write_results

SETS = ("grpo_math", "agentic", "tree_search", "low_sharing")
LLAMA_05B = TinyLMConfig(vocab_size=32000, dim=1024, n_layers=24, n_heads=8, n_kv_heads=2, ffn_dim=4864)
TINY = TinyLMConfig(vocab_size=32000, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _flat_grads(model) -> torch.Tensor:
    return torch.cat([p.grad.detach().float().flatten() for p in model.parameters()])


def timed_steps(model, optimizer, trie, *, mode, reps, warmup, **kwargs) -> dict:
    """Median step time over ``reps`` steps after ``warmup``; memory and choices of the last step."""
    device = next(model.parameters()).device
    times, result, static = [], None, 0
    for i in range(warmup + reps):
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        static = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        t0 = time.perf_counter()
        result = tree_backward(model, trie, None, mode=mode, **kwargs)
        optimizer.step()
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    rep = result.report
    peak = rep.peak_memory_bytes
    return {
        "step_s": statistics.median(times),
        "peak_gib": None if peak is None else peak / 2**30,
        "activation_gib": None if peak is None else (peak - static) / 2**30,
        "choices": ",".join(sorted(set(rep.modes))),
        "recomputed_tokens": rep.recomputed_tokens,
        "loss": result.loss,
    }


def precision_check(model, seqs, *, block_tokens, token_budget) -> list[dict]:
    """Relative error of each mode's bf16 (model dtype) gradient against the fp32 flat gradient."""
    trie = RolloutTrie.from_sequences(seqs)
    reference = TinyLM(model.cfg).to(next(model.parameters()).device)
    reference.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    tree_backward(reference, trie, None, mode="flat", token_budget=token_budget)
    want = _flat_grads(reference)
    del reference
    rows = []
    for mode in MODES:
        model.zero_grad(set_to_none=True)
        tree_backward(model, trie, None, mode=mode, block_tokens=block_tokens, token_budget=token_budget)
        rows.append({"mode": mode, "grad_rel_err": float((_flat_grads(model) - want).norm() / want.norm())})
    model.zero_grad(set_to_none=True)
    return rows


def targets(rows: list[dict], precision: list[dict]) -> list[dict]:
    """The engine's targets on this run's rows: ``auto`` at least 0.8 x token ratio x flat where the trie
    shares (0.95 x flat where it does not) and 0.95 x the best mode, DFS peak memory at most half of
    packed on the agentic set, and every mode's bf16 gradient within 2e-2 of fp32 flat."""
    by = {(r["set"], r["mode"]): r for r in rows}
    out = []
    for name in sorted({r["set"] for r in rows}):
        auto, flat = by.get((name, "auto")), by.get((name, "flat"))
        if not (auto and flat):
            continue
        best = max((by[(name, m)] for m in MODES if (name, m) in by), key=lambda r: r["tokens_per_s"])
        if name == "low_sharing":
            out.append({"target": f"{name}: auto >= 0.95 x flat", "value": auto["speedup"], "goal": 0.95})
        else:
            goal = 0.8 * auto["token_ratio"]
            out.append(
                {
                    "target": f"{name}: auto >= 0.8 x token_ratio x flat",
                    "value": auto["speedup"],
                    "goal": goal,
                }
            )
        out.append(
            {
                "target": f"{name}: auto >= 0.95 x best mode ({best['mode']})",
                "value": auto["tokens_per_s"] / best["tokens_per_s"],
                "goal": 0.95,
            }
        )
    dfs, packed = by.get(("agentic", "dfs")), by.get(("agentic", "packed"))
    if dfs and packed and dfs["peak_gib"] is not None:
        out.append(
            {
                "target": "agentic: dfs peak <= 0.5 x packed peak",
                "value": dfs["peak_gib"] / packed["peak_gib"],
                "goal": 0.5,
                "lower_is_better": True,
            }
        )
        out.append(
            {
                "target": "agentic: dfs activation peak <= 0.5 x packed (above static)",
                "value": dfs["activation_gib"] / packed["activation_gib"],
                "goal": 0.5,
                "lower_is_better": True,
            }
        )
    for p in precision:
        out.append(
            {
                "target": f"bf16 {p['mode']} grad vs fp32 flat <= 2e-2",
                "value": p["grad_rel_err"],
                "goal": 2e-2,
                "lower_is_better": True,
            }
        )
    for t in out:
        t["met"] = t["value"] <= t["goal"] if t.get("lower_is_better") else t["value"] >= t["goal"]
    return out


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m treeattn_lab bench train",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--sets", type=choice_list(SETS), default=list(SETS), help="comma list of rollout sets"
    )
    parser.add_argument("--quick", action="store_true", help="tiny model, small subsets (default on a CPU)")
    parser.add_argument("--block-tokens", type=positive_int, default=None)
    parser.add_argument("--token-budget", type=positive_int, default=None)
    parser.add_argument("--reps", type=positive_int, default=2)
    parser.add_argument("--calibration-s", type=float, default=60.0)
    add_out_argument(parser)
    return parser.parse_args(argv)


def train_rows(model, optimizer, cost_model, sets, *, quick: bool, reps: int, **engine) -> list[dict]:
    """One row per (set, mode): the step of :func:`timed_steps`, the trie's sizes and the speed-up."""
    rows = []
    jobs = [(name, mode) for name in sets for mode in MODES + ("auto",)]
    for name, mode in tqdm(jobs, desc="bench train", unit="step"):
        seqs = load_rollouts(name)
        if quick:
            seqs = [s[:200] for s in seqs[:8]]
        trie = RolloutTrie.from_sequences(seqs)
        stats = trie.stats()
        r = timed_steps(
            model,
            optimizer,
            trie,
            mode=mode,
            reps=1 if quick else reps,
            warmup=1,
            cost_model=cost_model,
            **engine,
        )
        rows.append(
            {
                "set": name,
                "mode": mode,
                "flat_tokens": stats["flat_tokens"],
                "tree_tokens": stats["tree_tokens"],
                "token_ratio": stats["token_ratio"],
                "tokens_per_s": stats["flat_tokens"] / r["step_s"],
                **r,
            }
        )
    for r in rows:
        flat = next(x for x in rows if x["set"] == r["set"] and x["mode"] == "flat")
        r["speedup"] = r["tokens_per_s"] / flat["tokens_per_s"]
    return rows


TRAIN_COLUMNS = [
    ("set", "set"),
    ("mode", "mode"),
    ("token_ratio", "token ratio"),
    ("step_s", "step s"),
    ("tokens_per_s", "flat tok/s"),
    ("speedup", "x flat"),
    ("peak_gib", "peak GiB"),
    ("activation_gib", "act. GiB"),
    ("choices", "auto chose"),
    ("recomputed_tokens", "recomputed"),
]


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    cuda = torch.cuda.is_available()
    quick = args.quick or not cuda
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    cfg = TINY if quick else LLAMA_05B
    engine = {
        "block_tokens": args.block_tokens or (64 if quick else 4096),
        "token_budget": args.token_budget or (512 if quick else 32768),
    }
    torch.manual_seed(0)
    model = TinyLM(cfg).to(device, dtype)
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    cost_model = calibrate(model, **engine, seconds=args.calibration_s, use_cache=False)
    rows = train_rows(model, optimizer, cost_model, args.sets, quick=quick, reps=args.reps, **engine)
    subset = [s[:1024] for s in load_rollouts("grpo_math")[: 4 if quick else 32]]
    precision = precision_check(
        model, subset, block_tokens=engine["block_tokens"], token_budget=min(engine["token_budget"], 8192)
    )
    checks = targets(rows, precision)

    env = environment()
    title = (
        f"training step, {env['device']}, {str(dtype).removeprefix('torch.')}, TinyLM {n_params / 1e9:.2f}B, "
        f"block {engine['block_tokens']}, budget {engine['token_budget']}"
    )
    print_table(title, TRAIN_COLUMNS, rows)
    print_table(
        "gradient precision (bf16 vs fp32 flat)", [("mode", "mode"), ("grad_rel_err", "rel err")], precision
    )
    print_table(
        "targets", [("target", "target"), ("value", "value"), ("goal", "goal"), ("met", "met")], checks
    )
    extra = {"dtype": str(dtype), "params": n_params, "config": cfg.__dict__, **engine}
    extra.update(cost_model=cost_model.to_dict(), precision=precision, targets=checks, quick=quick)
    path = write_results("train", rows, env, directory=args.out, extra=extra)
    print(f"wrote {path}")
    return 0
