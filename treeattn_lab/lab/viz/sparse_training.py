"""Drawing the sparse-training experiment (:mod:`treeattn_lab.experiments.sparse_training`): dense, dynamic
sparse and sliding-window training from one checkpoint.

- :func:`draw_training_curves`: next-byte loss and passkey-answer loss per step at the long context
  (means over the result's seeds), after the dense short-context phase; a step whose batch held no
  passkey sample records a NaN answer loss, which the means skip;
- :func:`draw_retrieval_by_depth`: passkey exact match per needle depth, each model with its own attention;
- :func:`draw_training_times`: attention forward + backward per step (kernel and estimation) and step time.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping

import plotly.graph_objects as go
from plotly.subplots import make_subplots

VARIANT_COLORS = {"dense": "#4C78A8", "sparse": "#E45756", "window": "#72B7B2", "pretrain": "#888888"}
VARIANT_NAMES = {"dense": "dense", "sparse": "dynamic sparse", "window": "sliding window (equal pairs)",
                 "pretrain": "dense, short context"}


def _variants(result: Mapping) -> list[str]:
    found = [s["variant"] for s in result["summary"]]
    if not found:
        raise ValueError("the result's summary holds no variant")
    return found


def _nanmean(values) -> float | None:
    """The mean of the values that are not NaN; ``None`` (a gap in a plotly line) when every one is."""
    kept = [v for v in values if not math.isnan(v)]
    return statistics.mean(kept) if kept else None


def _mean_curve(result: Mapping, variant: str, key: str) -> list[float | None]:
    """Per step, the mean over seeds of ``histories[variant/seedS][key]``, skipping NaN (a step without a
    passkey sample has no answer loss); ``None`` where no seed has a value."""
    runs = [h[key] for name, h in result["histories"].items() if name.split("/")[0] == variant]
    return [_nanmean(step) for step in zip(*runs, strict=True)]


def draw_training_curves(result: Mapping) -> go.Figure:
    """Two panels over the training steps: next-byte loss and the passkey answer's loss (nats per byte,
    means over seeds); the short dense phase first, then the three variants from its checkpoint. Steps
    where no seed's batch held a passkey sample have no answer loss: the line joins the steps around them."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=["next-byte loss", "passkey answer loss"],
                        horizontal_spacing=0.1)
    short = len(_mean_curve(result, "pretrain", "lm_loss"))
    for variant in ("pretrain", *_variants(result)):
        for col, key in enumerate(("lm_loss", "key_loss"), start=1):
            ys = _mean_curve(result, variant, key)
            start = 0 if variant == "pretrain" else short
            fig.add_trace(go.Scatter(x=list(range(start, start + len(ys))), y=ys, mode="lines",
                                     name=VARIANT_NAMES[variant], legendgroup=variant, showlegend=col == 1,
                                     connectgaps=True,
                                     line=dict(color=VARIANT_COLORS[variant], width=1.5)), row=1, col=col)
    cfg = result["config"]
    for col in (1, 2):
        fig.add_vline(x=short, line=dict(color="#BBBBBB", dash="dot"), row=1, col=col)
        fig.update_xaxes(title=f"step (dense pretraining, then {cfg['seq_len']} tokens)", row=1, col=col)
    fig.update_yaxes(title="nats per byte", row=1, col=1)
    fig.update_layout(template="plotly_white", height=380, title="Training: one dense start, three ways on")
    return fig


def draw_retrieval_by_depth(result: Mapping) -> go.Figure:
    """Passkey exact match (greedy digits) per needle depth, one line per variant (means over seeds)."""
    fig = go.Figure()
    for s in result["summary"]:
        depths = sorted(s["retrieval"], key=float)
        fig.add_trace(go.Scatter(x=[float(d) for d in depths], y=[s["retrieval"][d] for d in depths],
                                 mode="lines+markers", name=VARIANT_NAMES[s["variant"]],
                                 line=dict(color=VARIANT_COLORS[s["variant"]]),
                                 customdata=[s["retrieval_digits"][d] for d in depths],
                                 hovertemplate="depth %{x}: exact %{y:.0%}, digits %{customdata:.0%}"
                                               "<extra></extra>"))
    fig.update_layout(template="plotly_white", height=340, xaxis_title="needle depth (0: start, 1: end)",
                      yaxis=dict(title="passkey exact match", tickformat=".0%", range=[-0.05, 1.05]),
                      title=f"Retrieval at {result['config']['seq_len']} tokens (each model, its attention)")
    return fig


def draw_training_times(result: Mapping) -> go.Figure:
    """Attention forward + backward per training step (kernel, plus the pattern estimation of the sparse
    run) and the whole step, per variant, with the computed-pair share on the bars."""
    summary = result["summary"]
    names = [VARIANT_NAMES[s["variant"]] for s in summary]
    fig = make_subplots(rows=1, cols=2, subplot_titles=["attention forward + backward", "training step"],
                        horizontal_spacing=0.12)
    fig.add_trace(go.Bar(x=names, y=[s["kernel_ms"] for s in summary], name="attention kernel",
                         marker_color=[VARIANT_COLORS[s["variant"]] for s in summary],
                         text=[f"{s['pair_fraction']:.0%} of pairs" for s in summary], textposition="inside"),
                  row=1, col=1)
    fig.add_trace(go.Bar(x=names, y=[s["estimate_ms"] for s in summary], name="pattern estimation",
                         marker_color="#F2B701"), row=1, col=1)
    fig.add_trace(go.Bar(x=names, y=[s["step_ms"] for s in summary], showlegend=False,
                         marker_color=[VARIANT_COLORS[s["variant"]] for s in summary]), row=1, col=2)
    fig.update_yaxes(title="ms per step", row=1, col=1)
    fig.update_layout(template="plotly_white", height=360, barmode="stack",
                      title=f"Time at {result['config']['seq_len']} tokens on {result['device']}")
    return fig
