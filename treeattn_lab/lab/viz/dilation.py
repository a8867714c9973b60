"""Drawing the RAT+ dilation experiment (:mod:`treeattn_lab.experiments.rat_dilation`): what dilated
attention costs a dense-trained model in loss.

- :func:`draw_dilation_results`: per window setting, bars of each model's validation loss above its own
  dense (``D = 1``) loss at every dilation ``D``, before and after adaptation.

Each panel has its own y-scale: without a window plain attention loses tens of percent, with one every
model stays within a few, and a shared scale would flatten the second panel to nothing.
"""

from __future__ import annotations

from collections.abc import Mapping

import plotly.graph_objects as go
from plotly.subplots import make_subplots

MODEL_COLORS = {"plain": "#4C78A8", "rat+": "#E45756"}
PALE_COLORS = {"plain": "#BBCBE0", "rat+": "#F5BCBB"}  # the same models before adaptation


def _gap_rows(summary, model: str, adapted: bool, window: int, initial: int) -> dict[int, Mapping]:
    """``{D: summary row}`` of one model, adapted or not, at one window setting (``D > 1`` only)."""
    return {
        s["dilation"]: s
        for s in summary
        if s["model"] == model
        and s["adapted"] == adapted
        and s["dilation"] > 1
        and (s["window"], s["initial"]) == (window, initial)
    }


def draw_dilation_results(result: Mapping) -> go.Figure:
    """Bars of ``gap_vs_dense`` (validation loss over the model's own ``D = 1`` loss, minus one) per
    dilation, one panel per window setting (none, and the result's ``W``, ``P``); solid bars are the
    adapted models (labelled), pale bars the same models before adaptation. Values are the means over
    the result's seeds."""
    summary, cfg = result["summary"], result["config"]
    settings = [
        (0, 0, "no window (W = 0, P = 0)"),
        (cfg["window"], cfg["initial"], f"window W = {cfg['window']}, initial P = {cfg['initial']}"),
    ]
    models = [m for m in MODEL_COLORS if any(s["model"] == m for s in summary)]
    if not models:
        raise ValueError(f"the result's summary holds none of the models {list(MODEL_COLORS)}")
    fig = make_subplots(rows=1, cols=2, subplot_titles=[s[2] for s in settings], horizontal_spacing=0.12)
    for col, (window, initial, _) in enumerate(settings, start=1):
        for model in models:
            for adapted in (False, True):
                rows = _gap_rows(summary, model, adapted, window, initial)
                dilations = sorted(rows)
                gaps = [rows[d]["gap_vs_dense"] for d in dilations]
                name = f"{model}, adapted" if adapted else f"{model}, not adapted"
                fig.add_trace(
                    go.Bar(
                        x=[f"D = {d}" for d in dilations],
                        y=gaps,
                        name=name,
                        legendgroup=name,
                        showlegend=col == 1,
                        marker_color=(MODEL_COLORS if adapted else PALE_COLORS)[model],
                        text=[f"{g:+.1%}" for g in gaps] if adapted else None,
                        textposition="outside",
                        textfont=dict(size=10),
                        cliponaxis=False,
                        customdata=[rows[d]["val_loss"] for d in dilations],
                        hovertemplate=f"{name}<br>%{{x}}: %{{y:+.2%}}, %{{customdata:.3f}} nats/byte"
                        "<extra></extra>",
                    ),
                    row=1,
                    col=col,
                )
        fig.update_yaxes(tickformat=".1~%", rangemode="tozero", row=1, col=col)
    fig.update_yaxes(title="validation loss above own D = 1", row=1, col=1)
    seeds = len(cfg.get("seeds", [])) or 1
    mean = f", means over {seeds} seeds" if seeds > 1 else ""
    fig.update_layout(
        title=f"Dense-trained models under dilated attention (lower is better{mean})",
        template="plotly_white",
        barmode="group",
        height=440,
        margin=dict(l=70, r=20, t=90, b=90),
        legend=dict(orientation="h", x=0, y=-0.12, yanchor="top"),
    )
    return fig


__all__ = ["MODEL_COLORS", "draw_dilation_results"]
