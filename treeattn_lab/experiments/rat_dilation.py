"""Train dense, infer sparse: does RAT+ keep its loss under dilated attention where plain attention does not?

The question (RAT+, arXiv 2602.18196): a model trained with dense attention is run at inference with
dilated attention ``(D, W, P)``: query t reads only every D-th earlier position, plus a window of W and the
first P tokens (``treeattn_lab.patterns.dilated``). How much validation loss does that cost?

Protocol, per seed, on the bundled byte-level corpus (``treeattn_lab.corpus``):

1. Two models of one size: plain :class:`~treeattn_lab.reference.TinyLM` and
   :class:`~treeattn_lab.reference.rat.RATTinyLM` (gated recurrence on keys and values).
2. Training. RAT+: every batch twice, a dense pass (D = 1) and a dilated pass (D = ``sparse_dilation``,
   no window), each with its own optimizer step. Plain attention: dense only, for twice as many steps,
   so both take the same number of optimizer steps (plain attention sees twice the data).
3. Evaluation: validation loss (nats per byte) at every D in ``dilations``, without and with a window
   (``W = window, P = initial``), before and after a short *adaptation*: ``adapt_steps`` steps at
   ``lr * adapt_lr_ratio``, no warmup, with the target pattern, on a copy of the model. D = 1 gets the same
   extra steps with dense attention, so "after adaptation" compares models that trained equally long.

The target: RAT+ at D = 16 within 5% of its own D = 1 loss after adaptation, while plain
attention at D = 16 loses clearly more. Whatever the tiny scale shows is reported as measured.

Modes: ``tiny`` (notebook smoke run, well under a minute), ``quick`` (a few minutes on a CPU),
``full`` (a GPU: wider models, longer sequences, three seeds; the seeds are independent,
so run them as separate processes, one per GPU, and join them with ``--merge``).

    python -m treeattn_lab.experiments.rat_dilation --mode quick
"""

from __future__ import annotations

import argparse
import copy
import functools
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from ..corpus import VOCAB_SIZE, causal_sdpa, evaluate_loss, load_corpus, train_language_model
from ..patterns.dilated import DilatedPattern
from ..reference import TinyLM, TinyLMConfig
from ..reference.rat import RATTinyLM
from .cli_args import seed_list


@dataclass(frozen=True)
class ExperimentConfig:
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 172
    seq_len: int = 256
    batch_size: int = 16
    steps: int = 150  # RAT+ steps (two passes each); plain attention runs 2 * steps
    lr: float = 3e-3
    sparse_dilation: int = 64  # D of RAT+'s sparse training pass (W = 0, P = 0)
    dilations: tuple[int, ...] = (1, 4, 16, 64)
    window: int = 16
    initial: int = 4
    adapt_steps: int = 20
    adapt_lr_ratio: float = 0.1
    eval_windows: int = 32  # validation windows of seq_len bytes
    seeds: tuple[int, ...] = (0,)

    def model_config(self) -> TinyLMConfig:
        return TinyLMConfig(vocab_size=VOCAB_SIZE, dim=self.dim, n_layers=self.n_layers, n_heads=self.n_heads,
                            n_kv_heads=self.n_kv_heads, ffn_dim=self.ffn_dim)


MODES = {
    "tiny": ExperimentConfig(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64, seq_len=96,
                             batch_size=8, steps=25, dilations=(1, 4, 16), window=8, initial=2, adapt_steps=4,
                             eval_windows=8, sparse_dilation=32),
    "quick": ExperimentConfig(),
    "full": ExperimentConfig(dim=256, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=688, seq_len=1024,
                             batch_size=16, steps=600, window=64, initial=4, adapt_steps=50,
                             eval_windows=128, seeds=(0, 1, 2)),
}
MODELS = ("plain", "rat+")


# ---------------------------------------------------------------------------------------------- attention
@functools.cache
def _additive_mask(pattern: DilatedPattern, seq_len: int, device: str, dtype: torch.dtype) -> torch.Tensor:
    """0 where the pattern attends, -inf elsewhere (CPU SDPA's fused kernel takes float masks, not bool)."""
    mask = pattern.dense_mask(seq_len, device=device)
    return torch.zeros(mask.shape, device=device, dtype=dtype).masked_fill(~mask, float("-inf"))


def pattern_attention(pattern: DilatedPattern):
    """``attention(q, k, v)`` on ``[B, L, H, d]`` under ``pattern``: causal SDPA for D = 1; otherwise the
    Triton kernel on CUDA (when the head dim suits it) or SDPA with the pattern's dense mask."""
    if pattern.dilation == 1:
        return causal_sdpa

    def attention(q, k, v):
        from ..kernels.limits import SUPPORTED_HEAD_DIMS

        if q.is_cuda and q.shape[-1] in SUPPORTED_HEAD_DIMS:
            from ..ops.dilated import dilated_attention

            return dilated_attention(q, k, v, dilation=pattern.dilation, window=pattern.window,
                                     initial=pattern.initial, backend="triton")
        group = q.shape[-2] // k.shape[-2]
        if group > 1:
            k, v = k.repeat_interleave(group, dim=-2), v.repeat_interleave(group, dim=-2)
        mask = _additive_mask(pattern, q.shape[-3], str(q.device), q.dtype)
        out = F.scaled_dot_product_attention(q.transpose(-3, -2), k.transpose(-3, -2), v.transpose(-3, -2),
                                             attn_mask=mask)
        return out.transpose(-3, -2)

    return attention


def eval_patterns(cfg: ExperimentConfig) -> list[DilatedPattern]:
    """The inference patterns evaluated: each D without a window, and with (W, P); D = 1 once."""
    out = []
    for D in cfg.dilations:
        out.append(DilatedPattern(D))
        if D > 1:
            out.append(DilatedPattern(D, cfg.window, cfg.initial))
    return out


# ---------------------------------------------------------------------------------------------- the run
def _build(model_name: str, cfg: ExperimentConfig, seed: int, device) -> torch.nn.Module:
    torch.manual_seed(seed)
    if model_name == "plain":
        return TinyLM(cfg.model_config()).to(device)
    scan = None
    if torch.device(device).type == "cuda":
        from ..ops.dilated import gated_scan

        scan = functools.partial(gated_scan, backend="triton")
    return RATTinyLM(cfg.model_config(), scan=scan).to(device)


def train_model(model_name: str, cfg: ExperimentConfig, seed: int, device="cpu", progress: bool = True):
    """One trained model and its loss history (see the protocol above)."""
    model = _build(model_name, cfg, seed, device)
    train = load_corpus("train").to(device)
    if model_name == "plain":
        passes, steps = [causal_sdpa], 2 * cfg.steps
    else:
        passes, steps = [causal_sdpa, pattern_attention(DilatedPattern(cfg.sparse_dilation))], cfg.steps
    history = train_language_model(model, train, steps=steps, batch_size=cfg.batch_size, seq_len=cfg.seq_len,
                                   lr=cfg.lr, seed=seed, attention=passes, progress=progress)
    return model, history


def evaluate_model(model, model_name: str, cfg: ExperimentConfig, seed: int) -> list[dict]:
    """Validation loss at every pattern, before and after adaptation; one row per (pattern, adapted)."""
    device = next(model.parameters()).device
    train, val = load_corpus("train").to(device), load_corpus("validation").to(device)
    rows = []
    for pattern in eval_patterns(cfg):
        attention = pattern_attention(pattern)
        base = {"seed": seed, "model": model_name, "dilation": pattern.dilation, "window": pattern.window,
                "initial": pattern.initial}
        loss = evaluate_loss(model, val, attention=attention, seq_len=cfg.seq_len,
                             max_windows=cfg.eval_windows)
        rows.append({**base, "adapted": False, "val_loss": loss})
        if cfg.adapt_steps == 0:
            continue
        adapted = copy.deepcopy(model)
        train_language_model(adapted, train, steps=cfg.adapt_steps, batch_size=cfg.batch_size,
                             seq_len=cfg.seq_len, lr=cfg.lr * cfg.adapt_lr_ratio, seed=seed + 1000,
                             attention=attention, warmup_steps=0, final_lr_ratio=1.0, progress=False)
        loss = evaluate_loss(adapted, val, attention=attention, seq_len=cfg.seq_len,
                             max_windows=cfg.eval_windows)
        rows.append({**base, "adapted": True, "val_loss": loss})
    return rows


def summarize(rows: list[dict], cfg: ExperimentConfig | None = None) -> list[dict]:
    """Mean loss over seeds per (model, pattern, adapted), with the gap to the same model's D = 1 loss
    (adapted rows against D = 1 after the same number of extra dense steps)."""
    groups: dict[tuple, list[float]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["dilation"], r["window"], r["initial"], r["adapted"]), []).append(
            r["val_loss"])
    dense = {(m, a): sum(groups[(m, 1, 0, 0, a)]) / len(groups[(m, 1, 0, 0, a)])
             for m in MODELS for a in (False, True) if (m, 1, 0, 0, a) in groups}
    out = []
    for (model, D, W, P, adapted), losses in groups.items():
        mean = sum(losses) / len(losses)
        base = dense.get((model, adapted))
        out.append({"model": model, "dilation": D, "window": W, "initial": P, "adapted": adapted,
                    "val_loss": mean, "seeds": len(losses), "min": min(losses), "max": max(losses),
                    "gap_vs_dense": mean / base - 1 if base else None})
    return out


def run_experiment(cfg: ExperimentConfig | str = "quick", *, device=None, progress: bool = True) -> dict:
    """Train, evaluate and summarize; returns ``{"config", "rows", "summary", "histories", "seconds"}``."""
    cfg = MODES[cfg] if isinstance(cfg, str) else cfg
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    start = time.perf_counter()
    rows, histories = [], {}
    for seed in cfg.seeds:
        for name in MODELS:
            model, history = train_model(name, cfg, seed, device, progress)
            histories[f"{name}/seed{seed}"] = history["pass_losses"]
            rows += evaluate_model(model, name, cfg, seed)
    return {"config": asdict(cfg), "rows": rows, "summary": summarize(rows, cfg), "histories": histories,
            "seconds": time.perf_counter() - start, "device": str(device)}


def merge_results(results: list[dict]) -> dict:
    """One result from runs of the same setting with different seeds (for example one process per seed
    sharing a GPU): rows and histories joined, the summary recomputed over every seed."""
    if not results:
        raise ValueError("merge_results needs at least one result")
    settings = [{k: v for k, v in r["config"].items() if k != "seeds"} for r in results]
    if any(s != settings[0] for s in settings):
        raise ValueError("results to merge must come from the same configuration apart from the seeds")
    seeds = [seed for r in results for seed in r["config"]["seeds"]]
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"results to merge repeat a seed: {sorted(seeds)}")
    rows = [row for r in results for row in r["rows"]]
    histories = {k: v for r in results for k, v in r["histories"].items()}
    return {"config": {**results[0]["config"], "seeds": sorted(seeds)}, "rows": rows,
            "summary": summarize(rows), "histories": histories,
            "seconds": max(r["seconds"] for r in results), "device": results[0]["device"]}


def headline(result: dict, dilation: int = 16) -> dict:
    """The target's comparison at ``dilation``: each model's best adapted gap to its own D = 1 loss."""
    out = {}
    for model in MODELS:
        gaps = [s for s in result["summary"]
                if s["model"] == model and s["dilation"] == dilation and s["adapted"]]
        if gaps:
            best = min(gaps, key=lambda s: s["val_loss"])
            out[model] = {"window": best["window"], "initial": best["initial"], "val_loss": best["val_loss"],
                          "gap_vs_dense": best["gap_vs_dense"],
                          "no_window_gap": next((s["gap_vs_dense"] for s in gaps if s["window"] == 0), None)}
    return out


# ---------------------------------------------------------------------------------------------- drawing
def draw_histories(result: dict):
    """Training loss per optimizer step: plain attention, and RAT+'s dense and sparse passes."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for key, per_step in result["histories"].items():
        passes = len(per_step[0])
        for i in range(passes):
            label = key if passes == 1 else f"{key} {'dense' if i == 0 else 'sparse'} pass"
            fig.add_trace(go.Scatter(y=[p[i] for p in per_step], mode="lines", name=label))
    fig.update_layout(template="plotly_white", height=360, xaxis_title="batch",
                      yaxis_title="training loss (nats per byte)", title="Training")
    return fig


# ---------------------------------------------------------------------------------------------- command line
COLUMNS = [("model", "model"), ("dilation", "D"), ("window", "W"), ("initial", "P"), ("adapted", "adapted"),
           ("val_loss", "val loss"), ("gap_vs_dense", "vs own D=1"), ("seeds", "seeds")]


def main(argv: list[str] | None = None) -> int:
    from ..bench.harness import add_out_argument, positive_int

    parser = argparse.ArgumentParser(prog="python -m treeattn_lab.experiments.rat_dilation",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=sorted(MODES), default="quick")
    parser.add_argument("--steps", type=positive_int, default=None, help="override the mode's training steps")
    parser.add_argument("--adapt-steps", type=int, default=None, help="override the mode's adaptation steps")
    parser.add_argument("--seeds", type=seed_list, default=None, help="comma list, e.g. 0,1,2")
    parser.add_argument("--device", default=None)
    add_out_argument(parser)
    parser.add_argument("--no-save", action="store_true")
    parser.add_argument("--merge", nargs="+", metavar="JSON", default=None,
                        help="merge saved results of the same mode run with different seeds; trains nothing")
    args = parser.parse_args(argv)
    cfg = MODES[args.mode]
    if args.steps is not None:
        cfg = replace(cfg, steps=args.steps)
    if args.adapt_steps is not None:
        cfg = replace(cfg, adapt_steps=args.adapt_steps)
    if args.seeds:
        cfg = replace(cfg, seeds=args.seeds)
    if args.merge:
        import json

        saved = [json.loads(Path(f).read_text()) for f in args.merge]
        result, env = merge_results(saved), saved[0]["environment"]  # where they ran, not here
        mode = {k: v for k, v in json.loads(json.dumps(asdict(cfg))).items() if k != "seeds"}
        if {k: v for k, v in result["config"].items() if k != "seeds"} != mode:  # the name says the mode
            parser.error(f"the results to merge were not run in --mode {args.mode} (with its --steps)")
    else:
        result = run_experiment(cfg, device=args.device)
    from ..bench.harness import environment, print_table, write_results

    env = env if args.merge else environment()

    rows = sorted(result["summary"], key=lambda s: (s["model"], s["window"], s["dilation"], s["adapted"]))
    print_table(f"RAT+ vs plain attention under dilated inference ({args.mode}, {result['device']}, "
                f"{result['seconds']:.0f} s)", COLUMNS, rows)
    print("headline (D = 16, adapted):", headline(result))
    if not args.no_save:
        path = write_results(f"rat-dilation-{args.mode}", result["rows"], env,
                             directory=Path(args.out) if args.out else None,
                             extra={**{k: v for k, v in result.items() if k != "rows"},
                                    "headline": headline(result)})
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
