"""Drawing dynamic sparse attention: attention maps, vertical-slash patterns and their recall.

- :func:`draw_attention_maps`: attention probabilities of a few heads (log colour scale).
- :func:`draw_pattern`: a head's vertical-slash lines next to the pairs the kernel computes.
- :func:`draw_recall`: recall of attention mass against the line budget, one line per head.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from .style import LOG_AXIS, MASK_COLORSCALE, fit_title, fit_width

MAPS_PER_ROW = 3
MAP_PX = 240  # the side a map asks for; the figure is capped at MAX_FIGURE_WIDTH and the maps shrink to fit
SPACING = 0.04  # between maps, a share of the plot width
PATTERN_WIDTH = 840  # draw_pattern's two maps side by side, margins included


def draw_attention_maps(probs: torch.Tensor, titles: Sequence[str], *, title: str | None = None) -> go.Figure:
    """``probs [n, N, N]`` attention maps, up to :data:`MAPS_PER_ROW` a row, coloured by log10 probability
    (floor 1e-4) on one colour bar in the right margin. The figure is at most
    :data:`~.style.MAX_FIGURE_WIDTH` wide, margins and colour bar included, and as tall as its square maps
    need."""
    n = probs.shape[0]
    cols = min(n, MAPS_PER_ROW)
    rows = -(-n // cols)
    width = fit_width(MAP_PX * cols + 140)
    left, right, bottom, gap = 50, 90, 30, 40  # the right margin holds the colour bar
    side = (width - left - right) * (1 - SPACING * (cols - 1)) / cols  # each map square
    plot_height = rows * side + (rows - 1) * gap
    fig = make_subplots(
        rows=rows,
        cols=cols,
        subplot_titles=list(titles),
        horizontal_spacing=SPACING,
        vertical_spacing=gap / plot_height if rows > 1 else 0.0,
    )
    z = torch.log10(probs.float().clamp_min(1e-4)).numpy()
    for i in range(n):
        axis = f"x{'' if i == 0 else i + 1}"
        fig.add_trace(
            go.Heatmap(
                z=z[i],
                zmin=-4,
                zmax=0,
                colorscale="Viridis",
                showscale=i == 0,
                colorbar=dict(
                    title=dict(text="p", side="right"),
                    tickvals=[-4, -3, -2, -1, 0],
                    ticktext=["10<sup>-4</sup>", "10<sup>-3</sup>", "0.01", "0.1", "1"],
                    len=min(1.0, 0.8 / rows + 0.2),
                    thickness=16,
                    x=1.02,
                ),
                hovertemplate="query %{y}, key %{x}: 10^%{z:.2f}<extra></extra>",
            ),
            row=i // cols + 1,
            col=i % cols + 1,
        )
        fig.update_yaxes(
            autorange="reversed",
            scaleanchor=axis,
            row=i // cols + 1,
            col=i % cols + 1,
            showticklabels=i % cols == 0,
        )
    text, lines = fit_title(title, width) if title else ("", 0)
    top = 50 + 22 * lines
    fig.update_layout(
        title=dict(text=text) if title else None,
        template="plotly_white",
        height=int(top + plot_height + bottom),
        width=width,
        margin=dict(l=left, r=right, t=top, b=bottom),
    )
    return fig


def draw_pattern(pattern, num_tokens: int, head: int = 0, *, title: str | None = None) -> go.Figure:
    """One head: its lines (vertical columns and slashes) and the block-rounded pairs the kernel computes,
    two square maps side by side in at most :data:`~.style.MAX_FIGURE_WIDTH`."""
    lines = pattern.line_mask(num_tokens)[head].to(torch.uint8).numpy()
    dense = pattern.dense_mask(num_tokens)[head].to(torch.uint8).numpy()
    causal = num_tokens * (num_tokens + 1) // 2
    names = [
        f"lines: {int(lines.sum()):,} pairs",
        f"computed: {int(dense.sum()):,} pairs, {dense.sum() / causal:.0%} of causal<br>"
        f"<sup>{pattern.block_size} x {pattern.block_size} tiles + bar columns</sup>",
    ]
    fig = make_subplots(rows=1, cols=2, subplot_titles=names, horizontal_spacing=0.06)
    for i, z in enumerate((lines, dense)):
        fig.add_trace(
            go.Heatmap(z=z, zmin=0, zmax=1, colorscale=MASK_COLORSCALE, showscale=False, hoverinfo="skip"),
            row=1,
            col=i + 1,
        )
        fig.update_yaxes(autorange="reversed", scaleanchor=f"x{'' if i == 0 else 2}", row=1, col=i + 1)
    width = fit_width(PATTERN_WIDTH)
    left, right, bottom = 40, 20, 30
    side = (width - left - right) * (1 - 0.06) / 2  # each map square, 0.06 of the plot width between them
    text, n_lines = fit_title(title or f"head {head}", width)
    top = 60 + 22 * n_lines  # the title, then two lines of subplot title
    fig.update_layout(
        title=dict(text=text),
        template="plotly_white",
        height=int(top + side + bottom),
        width=width,
        margin=dict(l=left, r=right, t=top, b=bottom),
    )
    return fig


def draw_recall(
    budgets: Sequence[int],
    recalls: Mapping[str, Sequence[float]],
    *,
    target: float = 0.95,
    x_title: str = "lines per head (vertical = slash)",
) -> go.Figure:
    """Recall of attention mass against the budget, one line per head (or group), the target dashed."""
    fig = go.Figure()
    for name, ys in recalls.items():
        fig.add_trace(go.Scatter(x=list(budgets), y=list(ys), mode="lines+markers", name=name))
    fig.add_hline(y=target, line_dash="dash", line_color="#666", annotation_text=f"{target:.0%}")
    fig.update_layout(
        title="Attention mass kept by the estimated pattern",
        template="plotly_white",
        height=380,
        xaxis=dict(title=x_title, tickvals=list(budgets), **LOG_AXIS),
        yaxis=dict(title="recall", range=[0, 1.02]),
    )
    return fig


__all__ = ["draw_attention_maps", "draw_pattern", "draw_recall"]
