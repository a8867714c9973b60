"""Drawing sparse ring attention: who computes which tile, and how balanced the ring's work is.

- :func:`draw_layouts`: a pattern's tiles coloured by the rank that computes them, one map per layout.
- :func:`draw_ring_work`: work per (rank, ring step) per layout, and the worker- and step-level
  imbalances as bars.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from .style import PALETTE, fit_width, labelled_bar, legend_entry, stepped_colorscale

LAYOUT_PX = 260  # the width one layout's map asks for (three fit the output area with the margins)


def draw_layouts(pattern, num_tokens: int, world: int, layouts: Sequence[str], *, head: int = 0) -> go.Figure:
    """Per layout, head ``head``'s selected tiles coloured by the rank that computes them (its query
    block's owner); the strip above each map shows which rank holds each block of tokens. The figure is at
    most :data:`~.style.MAX_FIGURE_WIDTH` wide, its legend below the maps."""
    from ...distributed.layouts import block_owner

    tiles = pattern.block_map(num_tokens)[head]
    nb = tiles.shape[0]
    colorscale = stepped_colorscale([PALETTE[r % len(PALETTE)] for r in range(world)])
    fig = make_subplots(
        rows=2,
        cols=len(layouts),
        row_heights=[0.06, 0.94],
        vertical_spacing=0.02,
        subplot_titles=list(layouts),
        horizontal_spacing=0.04,
    )
    for i, layout in enumerate(layouts, start=1):
        owner = block_owner(layout, nb, world).float()
        z = torch.where(tiles, owner[:, None].expand(nb, nb), float("nan")).numpy()
        for row, values, hover in (
            (1, owner[None].numpy(), "block %{x}: rank %{z}"),
            (2, z, "query block %{y}, key block %{x}: rank %{z}"),
        ):
            heatmap = go.Heatmap(
                z=values,
                zmin=0,
                zmax=world,
                colorscale=colorscale,
                showscale=False,
                hovertemplate=hover + "<extra></extra>",
            )
            fig.add_trace(heatmap, row=row, col=i)
        fig.update_yaxes(autorange="reversed", row=2, col=i, showticklabels=i == 1)
        fig.update_yaxes(showticklabels=False, row=1, col=i)
        fig.update_xaxes(showticklabels=False, row=1, col=i)
    for r in range(world):  # a heatmap of ranks names no colour itself
        marker = dict(symbol="square", size=12, color=PALETTE[r % len(PALETTE)])
        fig.add_trace(legend_entry(f"rank {r}", marker, showlegend=True), row=2, col=1)
    width = fit_width(LAYOUT_PX * len(layouts) + 80)
    fig.update_layout(
        title=f"Who computes which tile ({world} ranks)",
        template="plotly_white",
        height=int(150 + (width - 80) / len(layouts)),
        width=width,
        margin=dict(l=40, r=20, t=80, b=80),
        plot_bgcolor="#F4F4F4",
        legend=dict(
            orientation="h", x=0, y=-0.1, yanchor="top", title="colour = the rank that computes the tile:"
        ),
    )
    return fig


def draw_ring_work(works: Mapping[str, object], *, metric: str = "pairs") -> go.Figure:
    """Top: work per (rank, step) of each layout (:class:`RingWork`); bottom: worker- and step-level
    imbalance per layout (1.0 = balanced; a ring is as slow as its slowest rank at every step)."""
    names = list(works)
    fig = make_subplots(
        rows=2,
        cols=len(names),
        specs=[[{}] * len(names), [{"colspan": len(names)}] + [None] * (len(names) - 1)],
        subplot_titles=[n.replace(", ", ",<br>") for n in names] + ["imbalance (max / mean rank)"],
        vertical_spacing=0.14,
        row_heights=[0.55, 0.45],
    )
    top = max(float(w._metric(metric).max()) for w in works.values())
    for i, name in enumerate(names, start=1):
        w = works[name]._metric(metric)
        fig.add_trace(
            go.Heatmap(
                z=w.numpy(),
                zmin=0,
                zmax=top,
                colorscale="Blues",
                showscale=i == len(names),
                colorbar=dict(title=dict(text=metric, side="right"), len=0.5, y=1, yanchor="top", x=1.02),
                hovertemplate="rank %{y}, step %{x}: %{z:.3g}<extra></extra>",
            ),
            row=1,
            col=i,
        )
        fig.update_yaxes(title="rank" if i == 1 else None, autorange="reversed", row=1, col=i)
        fig.update_xaxes(title="ring step", row=1, col=i)
    for kind, color in (("worker", "#4C78A8"), ("step", "#E45756")):
        ys = [getattr(works[n], f"{kind}_imbalance")(metric) for n in names]
        fig.add_trace(
            labelled_bar(
                names,
                ys,
                [f"{y:.2f}" for y in ys],
                name=f"{kind}-level",
                marker_color=color,
            ),
            row=2,
            col=1,
        )
    fig.add_hline(y=1.0, line_dash="dash", line_color="#666", row=2, col=1)
    fig.update_yaxes(title="max / mean", rangemode="tozero", row=2, col=1)
    fig.update_layout(
        title="Work per (rank, ring step) of each layout, and its imbalance",
        template="plotly_white",
        barmode="group",
        height=680,
        margin=dict(l=50, r=90, t=100, b=40),
        legend=dict(orientation="h", x=0, y=-0.06, yanchor="top"),
    )
    return fig


__all__ = ["draw_layouts", "draw_ring_work"]
