"""Plotly drawings for notebook 05 (dynamic sparse attention), pure functions returning figures.

- :func:`draw_attention_maps`: attention probabilities of a few heads (log colour scale).
- :func:`draw_pattern`: a head's vertical-slash lines next to the pairs the kernel computes.
- :func:`draw_recall`: recall of attention mass against the line budget.
- :func:`draw_layouts`: a pattern's tiles coloured by the rank that computes them, per layout.
- :func:`draw_ring_work`: work per (rank, ring step) per layout, and the two imbalances as bars.
- :func:`draw_sparse_bench`: ``bench sparse`` rows: speed-up over dense per case and backend.
- :func:`draw_gpu_timeline`: kernels and NCCL transfers per stream over time (a profiled ring step).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import plotly.graph_objects as go
import torch
from plotly.colors import qualitative
from plotly.subplots import make_subplots

from .viz import BACKEND_COLORS, MASK_COLORSCALE

RANK_COLORS = qualitative.Plotly


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


def draw_layouts(pattern, num_tokens: int, world: int, layouts: Sequence[str], *, head: int = 0) -> go.Figure:
    """Per layout, head ``head``'s selected tiles coloured by the rank that computes them (its query
    block's owner); the strip above each map shows which rank holds each block of tokens."""
    from ..distributed.layouts import block_owner

    tiles = pattern.block_map(num_tokens)[head]
    nb = tiles.shape[0]
    colorscale = []
    for r in range(world):
        c = RANK_COLORS[r % len(RANK_COLORS)]
        colorscale += [[r / world, c], [(r + 1) / world, c]]
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
        fig.add_trace(
            go.Heatmap(
                z=owner[None].numpy(),
                zmin=0,
                zmax=world,
                colorscale=colorscale,
                showscale=False,
                hovertemplate="block %{x}: rank %{z}<extra></extra>",
            ),
            row=1,
            col=i,
        )
        fig.add_trace(
            go.Heatmap(
                z=z,
                zmin=0,
                zmax=world,
                colorscale=colorscale,
                showscale=False,
                hovertemplate="query block %{y}, key block %{x}: rank %{z}<extra></extra>",
            ),
            row=2,
            col=i,
        )
        fig.update_yaxes(autorange="reversed", row=2, col=i, showticklabels=i == 1)
        fig.update_yaxes(showticklabels=False, row=1, col=i)
        fig.update_xaxes(showticklabels=False, row=1, col=i)
    fig.update_layout(
        title=f"Who computes which tile ({world} ranks, colours = ranks)",
        template="plotly_white",
        height=430,
        width=min(1400, 360 * len(layouts) + 80),
        margin=dict(l=40, r=20, t=80, b=30),
        plot_bgcolor="#F4F4F4",
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
        subplot_titles=[f"{n}: work per (rank, step)" for n in names] + ["imbalance"],
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
            go.Bar(
                x=names,
                y=ys,
                name=f"{kind}-level",
                marker_color=color,
                text=[f"{y:.2f}" for y in ys],
                textposition="outside",
                cliponaxis=False,
            ),
            row=2,
            col=1,
        )
    fig.add_hline(y=1.0, line_dash="dash", line_color="#666", row=2, col=1)
    fig.update_yaxes(title="max / mean", rangemode="tozero", row=2, col=1)
    fig.update_layout(
        template="plotly_white", barmode="group", height=640, margin=dict(l=50, r=20, t=60, b=30)
    )
    return fig


def draw_sparse_bench(rows: Sequence[Mapping], *, title: str | None = None) -> go.Figure:
    """``bench sparse`` rows: forward and forward+backward speed-up over dense causal SDPA, per case."""
    ok = [r for r in rows if "fwd_bwd_speedup" in r and r["backend"] != "dense"]
    if not ok:
        raise ValueError("no timed rows")
    cases = list(dict.fromkeys(r["case"] for r in ok))
    fig = make_subplots(rows=1, cols=2, subplot_titles=("forward x dense", "forward + backward x dense"))
    for col, key in ((1, "fwd_speedup"), (2, "fwd_bwd_speedup")):
        for backend in dict.fromkeys(r["backend"] for r in ok):
            ys = [
                next((r[key] for r in ok if r["case"] == c and r["backend"] == backend), None) for c in cases
            ]
            fig.add_trace(
                go.Bar(
                    x=cases,
                    y=ys,
                    name=backend,
                    legendgroup=backend,
                    showlegend=col == 1,
                    marker_color=BACKEND_COLORS.get(backend),
                    text=[f"{y:.2f}x" if y else "" for y in ys],
                    textposition="outside",
                    cliponaxis=False,
                ),
                row=1,
                col=col,
            )
        fig.add_hline(y=1.0, line_dash="dash", line_color="#666", row=1, col=col)
    fig.update_layout(
        title=title or "Sparse attention against dense causal SDPA",
        template="plotly_white",
        barmode="group",
        height=420,
        margin=dict(l=50, r=20, t=80, b=40),
    )
    fig.update_yaxes(rangemode="tozero")
    return fig


__all__ = [
    "draw_attention_maps",
    "draw_gpu_timeline",
    "draw_layouts",
    "draw_pattern",
    "draw_recall",
    "draw_ring_work",
    "draw_sparse_bench",
]


FAMILY_COLORS = {"forward": "#4C78A8", "dQ": "#72B7B2", "dK/dV": "#54A24B", "delta": "#B279A2",
                 "NCCL": "#F58518", "other": "#BAB0AC"}


def draw_gpu_timeline(timelines: Mapping[str, Sequence[Mapping]], *, title: str | None = None) -> go.Figure:
    """One lane per (run, stream): each GPU activity a bar from its start, coloured by kernel family
    (rows of :func:`treeattn_lab.bench.trace.gpu_timeline`). Compute and NCCL run on different streams,
    so overlap (or its absence) shows as bars stacked in time across a run's lanes."""
    fig = go.Figure()
    lanes, shown = [], set()
    for run, rows in timelines.items():
        by_stream: dict[int, list] = {}
        for r in rows:
            by_stream.setdefault(r["stream"], []).append(r)
        streams = sorted(by_stream, key=lambda s: by_stream[s][0]["start_ms"])  # rows are in start order
        nccl = {s: sum(r["ms"] for r in by_stream[s] if r["family"] == "NCCL") for s in streams}
        kind = {s: "NCCL" if 2 * nccl[s] > sum(r["ms"] for r in by_stream[s]) else "compute" for s in streams}
        names = {s: f"{run} · {kind[s]} (stream {s})" for s in streams}
        lanes += [names[s] for s in streams]
        for family, color in FAMILY_COLORS.items():
            mine = [r for r in rows if r["family"] == family]
            if not mine:
                continue
            fig.add_bar(y=[names[r["stream"]] for r in mine], x=[r["ms"] for r in mine],
                        base=[r["start_ms"] for r in mine], orientation="h", marker_color=color,
                        name=family, legendgroup=family, showlegend=family not in shown,
                        customdata=[r["name"] for r in mine],
                        hovertemplate="%{customdata}<br>%{base:.2f} ms + %{x:.2f} ms<extra></extra>")
            shown.add(family)
    fig.update_layout(template="plotly_white", title=title, barmode="overlay", xaxis_title="ms",
                      height=140 + 50 * len(lanes), margin=dict(l=40, r=20, t=60, b=40),
                      yaxis=dict(categoryorder="array", categoryarray=lanes, autorange="reversed"))
    return fig
