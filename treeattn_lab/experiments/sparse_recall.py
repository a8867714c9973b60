"""How much attention mass does an estimated vertical-slash pattern keep on a trained TinyLM?

Notebook 05 looks at one validation window; recall moves with the window and with training, so this
experiment measures it over many windows of a model trained for longer:

1. Train notebook 05's full-mode model: a 2-layer :class:`~treeattn_lab.reference.TinyLM` (dim 128,
   4 query heads over 2 key/value heads, head dim 32) on random 512-byte windows of the corpus' train split
   (:func:`treeattn_lab.corpus.train_language_model`, seeded, lr 3e-3, batch 16).
2. Take ``windows`` evenly spaced, non-overlapping windows of the **validation split** (other modules than
   training, so never seen), run the model once over them and record every layer's q and k (after RoPE).
3. Per window, layer and budget ``b``: ``estimate(q, k, n_vertical=b, n_slash=b, sinks=4, local=min(16, b),
   block_size=16)``, the notebook's settings (``estimate``'s own defaults, ``sinks=30, local=100,
   block_size=128``, are sized for GPU-length sequences, not 512 tokens). The default budget is the
   notebook's ``64 + 64`` lines per head (``N // 16`` each at ``N = 512``).
4. :func:`~treeattn_lab.patterns.vertical_slash.recall` per head, on the lines alone ("lines": judges the
   estimate) and block-rounded ("tiles": what the kernel computes), with the share of causal pairs each
   keeps (``density``): recall means little without it (keeping every pair has recall 1).

Rows report the mean and the minimum over windows and heads, per layer and over all layers.

    python -m treeattn_lab.experiments.sparse_recall --steps 2500 --windows 8
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from ..corpus import VOCAB_SIZE, causal_sdpa, evaluate_loss, load_corpus, train_language_model
from ..patterns.vertical_slash import estimate, recall
from ..reference import TinyLM, TinyLMConfig

BENCH_NAME = "sparse-recall"
DEFAULT_BUDGET = 64  # notebook 05: N // 16 columns + N // 16 diagonals per head at N = 512
BUDGETS = (4, 8, 16, 32, 64, 128)
SINKS, LOCAL, BLOCK = 4, 16, 16  # notebook 05's estimate settings (local is capped at the budget)
TARGET = 0.95  # recall a pattern should reach: MInference keeps 95% of the attention mass
KINDS = ("lines", "tiles")  # recall without / with block rounding


def notebook_model(seed: int = 0) -> TinyLM:
    """Notebook 05's TinyLM (dim 128, 2 layers, 4 heads over 2 key/value heads), seeded."""
    torch.manual_seed(seed)
    return TinyLM(TinyLMConfig(vocab_size=VOCAB_SIZE, dim=128, n_layers=2, n_heads=4, n_kv_heads=2))


def validation_windows(count: int, seq_len: int) -> torch.Tensor:
    """``[count, seq_len]``: evenly spaced, non-overlapping windows of the validation split."""
    val = load_corpus("validation")
    slots = val.numel() // seq_len
    if not 1 <= count <= slots:
        raise ValueError(f"windows must lie in [1, {slots}] for seq_len {seq_len}, got {count}")
    starts = torch.linspace(0, slots - 1, count).round().long() * seq_len
    return val[starts[:, None] + torch.arange(seq_len)]


@torch.no_grad()
def capture_qk(model, windows: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, ``(q [W, N, Hq, D], k [W, N, Hkv, D])`` of one causal forward pass over ``windows``."""
    captured = []

    def recording_attention(q, k, v):
        captured.append((q.detach(), k.detach()))
        return causal_sdpa(q, k, v)

    was_training = model.training
    model.eval()
    try:
        positions = torch.arange(windows.shape[1], device=windows.device).expand_as(windows)
        model(windows, positions, recording_attention)
    finally:
        model.train(was_training)
    return captured


def measure(q: torch.Tensor, k: torch.Tensor, budget: int) -> dict[str, tuple[torch.Tensor, float]]:
    """For one window and layer: ``{kind: (recall per head [H], density)}`` of the budget's pattern."""
    N = q.shape[0]
    pattern = estimate(q, k, n_vertical=budget, n_slash=budget, sinks=SINKS, local=min(LOCAL, budget),
                       block_size=BLOCK)
    causal_pairs = pattern.num_heads * N * (N + 1) / 2
    return {"lines": (recall(pattern, q, k, rounded=False), pattern.line_mask(N).sum().item() / causal_pairs),
            "tiles": (recall(pattern, q, k, rounded=True), pattern.density(N))}


def run_experiment(*, steps: int = 300, seq_len: int = 512, batch_size: int = 16, windows: int = 8,
                   budgets=BUDGETS, seed: int = 0, progress: bool = True, device="cpu") -> dict:
    """Train, capture, measure (on ``device``). Returns ``{"rows", "raw", "config", "train", "seconds"}``."""
    budgets = sorted(set(budgets))
    if not budgets or min(budgets) < 1:
        raise ValueError(f"budgets must be positive ints, got {budgets}")
    start = time.perf_counter()
    model = notebook_model(seed).to(device)
    history = train_language_model(model, load_corpus("train").to(device), steps=steps, batch_size=batch_size,
                                   seq_len=seq_len, lr=3e-3, seed=seed, progress=progress)
    train_seconds = time.perf_counter() - start
    data = validation_windows(windows, seq_len).to(device)
    val_loss = evaluate_loss(model, load_corpus("validation").to(device), seq_len=seq_len, max_windows=64)
    captured = capture_qk(model, data)

    raw = []  # one entry per (window, layer, budget, kind): per-head recall and the pattern's density
    for layer, (q, k) in enumerate(captured):
        for w in range(windows):
            for b in budgets:
                for kind, (per_head, density) in measure(q[w], k[w], b).items():
                    raw.append({"window": w, "layer": layer, "budget": b, "kind": kind,
                                "recall": per_head.tolist(), "density": density})
    layers = list(range(len(captured)))
    rows = []
    for layer in [*layers, "all"]:
        for b in budgets:
            for kind in KINDS:
                sel = [r for r in raw if r["budget"] == b and r["kind"] == kind
                       and (layer == "all" or r["layer"] == layer)]
                values = [x for r in sel for x in r["recall"]]
                rows.append({"layer": layer, "budget": b, "lines_per_head": 2 * min(b, seq_len), "kind": kind,
                             "recall_mean": sum(values) / len(values), "recall_min": min(values),
                             "heads_at_target": sum(x >= TARGET for x in values) / len(values),
                             "density": sum(r["density"] for r in sel) / len(sel), "samples": len(values)})
    config = {"steps": steps, "seq_len": seq_len, "batch_size": batch_size, "windows": windows,
              "budgets": budgets, "seed": seed, "default_budget": DEFAULT_BUDGET, "sinks": SINKS,
              "local": LOCAL, "block_size": BLOCK, "target": TARGET, "lr": 3e-3,
              "model": {"dim": 128, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "head_dim": 32},
              "validation_window_starts": "evenly spaced, non-overlapping, validation split"}
    loss = history["loss"]
    tail = loss[-min(50, len(loss)):]
    train = {"loss_first": loss[0], "loss_last50_mean": sum(tail) / len(tail),
             "val_loss_64_windows": val_loss, "seconds": train_seconds,
             "loss_every_50": loss[::50]}
    return {"rows": rows, "raw": raw, "config": config, "train": train,
            "seconds": time.perf_counter() - start}


def verdict(rows: list[dict], budget: int = DEFAULT_BUDGET) -> dict:
    """Per layer and kind at ``budget``: mean and min recall, density, and whether the mean reaches 0.95."""
    return {f"layer {r['layer']} {r['kind']}": {
        "recall_mean": r["recall_mean"], "recall_min": r["recall_min"], "density": r["density"],
        "mean_meets_target": r["recall_mean"] >= TARGET, "min_meets_target": r["recall_min"] >= TARGET}
        for r in rows if r["budget"] == budget}


COLUMNS = [("layer", "layer"), ("budget", "b (nv = ns)"), ("lines_per_head", "lines/head"), ("kind", "kept"),
           ("recall_mean", "recall mean"), ("recall_min", "recall min"),
           ("heads_at_target", "share >= 0.95"), ("density", "density")]


def main(argv: list[str] | None = None) -> int:
    from ..bench.harness import add_out_argument, positive_int

    parser = argparse.ArgumentParser(prog="python -m treeattn_lab.experiments.sparse_recall",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=positive_int, default=300)
    parser.add_argument("--seq-len", type=positive_int, default=512)
    parser.add_argument("--batch-size", type=positive_int, default=16)
    parser.add_argument("--windows", type=positive_int, default=8, help="validation windows measured")
    parser.add_argument("--budgets", type=positive_int, nargs="+", default=list(BUDGETS),
                        help=f"lines of each kind per head (default budget: {DEFAULT_BUDGET})")
    parser.add_argument("--seed", type=int, default=0)
    add_out_argument(parser)
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    args = parser.parse_args(argv)
    result = run_experiment(steps=args.steps, seq_len=args.seq_len, batch_size=args.batch_size,
                            windows=args.windows, budgets=args.budgets, seed=args.seed,
                            progress=not args.no_progress,
                            device=args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    from ..bench.harness import environment, print_table, write_results

    env = environment()
    tr = result["train"]
    print_table(f"Vertical-slash recall on a trained TinyLM ({args.steps} steps, {args.windows} validation "
                f"windows of {args.seq_len} bytes, {env['device']}, {result['seconds']:.0f} s; train loss "
                f"{tr['loss_last50_mean']:.3f}, val loss {tr['val_loss_64_windows']:.3f} nats/byte)",
                COLUMNS, result["rows"])
    summary = verdict(result["rows"])
    for key, v in summary.items():
        print(f"default budget {DEFAULT_BUDGET} + {DEFAULT_BUDGET}, {key}: mean {v['recall_mean']:.3f}, "
              f"min {v['recall_min']:.3f}, density {v['density']:.3f}, "
              f"mean >= {TARGET}: {v['mean_meets_target']}")
    path = write_results(BENCH_NAME, result["rows"], env, directory=Path(args.out) if args.out else None,
                         extra={**{k: v for k, v in result.items() if k != "rows"}, "verdict": summary})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
