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

from .style import MASK_COLORSCALE


def draw_attention_maps(probs: torch.Tensor, titles: Sequence[str], *, title: str | None = None) -> go.Figure:
    """``probs [n, N, N]`` attention maps side by side, coloured by log10 probability (floor 1e-4)."""
    n = probs.shape[0]
    fig = make_subplots(rows=1, cols=n, subplot_titles=list(titles), horizontal_spacing=0.03)
    z = torch.log10(probs.float().clamp_min(1e-4)).numpy()
    for i in range(n):
        fig.add_trace(
            go.Heatmap(
                z=z[i],
                zmin=-4,
                zmax=0,
                colorscale="Viridis",
                showscale=i == n - 1,
                colorbar=dict(title="log10 p"),
                hovertemplate="query %{y}, key %{x}: 10^%{z:.2f}<extra></extra>",
            ),
            row=1,
            col=i + 1,
        )
        fig.update_yaxes(
            autorange="reversed",
            scaleanchor=f"x{'' if i == 0 else i + 1}",
            row=1,
            col=i + 1,
            showticklabels=i == 0,
        )
    fig.update_layout(
        title=title,
        template="plotly_white",
        height=360,
        width=min(1400, 280 * n + 120),
        margin=dict(l=40, r=20, t=70, b=30),
    )
    return fig


def draw_pattern(pattern, num_tokens: int, head: int = 0, *, title: str | None = None) -> go.Figure:
    """One head: its lines (vertical columns and slashes) and the block-rounded pairs the kernel computes."""
    lines = pattern.line_mask(num_tokens)[head].to(torch.uint8).numpy()
    dense = pattern.dense_mask(num_tokens)[head].to(torch.uint8).numpy()
    causal = num_tokens * (num_tokens + 1) // 2
    names = [
        f"lines: {int(lines.sum()):,} pairs",
        f"computed ({pattern.block_size} x {pattern.block_size} "
        f"tiles + bars): {int(dense.sum()):,} pairs, {dense.sum() / causal:.0%} of causal",
    ]
    fig = make_subplots(rows=1, cols=2, subplot_titles=names, horizontal_spacing=0.06)
    for i, z in enumerate((lines, dense)):
        fig.add_trace(
            go.Heatmap(z=z, zmin=0, zmax=1, colorscale=MASK_COLORSCALE, showscale=False, hoverinfo="skip"),
            row=1,
            col=i + 1,
        )
        fig.update_yaxes(autorange="reversed", scaleanchor=f"x{'' if i == 0 else 2}", row=1, col=i + 1)
    fig.update_layout(
        title=title or f"head {head}",
        template="plotly_white",
        height=430,
        width=860,
        margin=dict(l=40, r=20, t=80, b=30),
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
        xaxis=dict(title=x_title, type="log"),
        yaxis=dict(title="recall", range=[0, 1.02]),
    )
    return fig


__all__ = ["draw_attention_maps", "draw_pattern", "draw_recall"]
