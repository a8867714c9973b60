"""Drawing a profiled GPU run: kernels and NCCL transfers per stream over time.

:func:`draw_gpu_timeline` draws the rows of :func:`treeattn_lab.bench.trace.gpu_timeline`, one lane per
(run, stream), so overlap of communication and compute (or its absence) can be seen.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import plotly.graph_objects as go

FAMILY_COLORS = {
    "forward": "#4C78A8",
    "dQ": "#72B7B2",
    "dK/dV": "#54A24B",
    "delta": "#B279A2",
    "NCCL": "#F58518",
    "other": "#BAB0AC",
}


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
            fig.add_bar(
                y=[names[r["stream"]] for r in mine],
                x=[r["ms"] for r in mine],
                base=[r["start_ms"] for r in mine],
                orientation="h",
                marker_color=color,
                name=family,
                legendgroup=family,
                showlegend=family not in shown,
                customdata=[r["name"] for r in mine],
                hovertemplate="%{customdata}<br>%{base:.2f} ms + %{x:.2f} ms<extra></extra>",
            )
            shown.add(family)
    fig.update_layout(
        template="plotly_white",
        title=title,
        barmode="overlay",
        xaxis_title="ms",
        height=140 + 50 * len(lanes),
        margin=dict(l=40, r=20, t=60, b=40),
        yaxis=dict(categoryorder="array", categoryarray=lanes, autorange="reversed"),
    )
    return fig


__all__ = ["FAMILY_COLORS", "draw_gpu_timeline"]
