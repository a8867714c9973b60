"""Drawing partitions of a trie over ranks, their balance and a measured step per rank.

- :func:`rank_colors` / :func:`draw_partition`: the trie coloured by the rank that computes each node.
- :func:`draw_rank_loads`: each rank's cost under several partitioners, side by side, with the lower bound.
- :func:`draw_balance_sweep`: a metric (imbalance, makespan over the bound, ...) against K, one panel per set.
- :func:`draw_rank_timeline`: a measured step per rank: compute, wait for the slowest rank, all-reduce.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .style import LOG_AXIS, PALETTE
from .tries import draw_trie

REPLICATED = "replicated"
_DASHES = ("solid", "dash", "dot", "dashdot")


def _rank_label(rank: int, num_ranks: int) -> str:
    return f"rank {rank:0{len(str(num_ranks - 1))}d}"  # zero-padded, so the legend sorts by rank


def rank_colors(trie, report) -> dict[int, str]:
    """Node id -> ``"rank r"`` for a node computed on one rank, ``"replicated"`` for one on several."""
    return {
        v: _rank_label(ranks[0], report.num_ranks) if len(ranks) == 1 else REPLICATED
        for v, ranks in report.node_ranks(trie).items()
    }


def draw_partition(trie, report, *, max_nodes: int = 400, title: str | None = None) -> go.Figure:
    """The trie with every node coloured by its rank (or as replicated), titled with the report's numbers."""
    title = title or (
        f"{report.partitioner}, K = {report.num_ranks}: makespan {report.makespan:,.0f} {report.unit}, "
        f"imbalance {report.imbalance:.3f}, replicated {report.replicated_tokens:,} tokens"
    )
    return draw_trie(trie, color_by=rank_colors(trie, report), max_nodes=max_nodes, title=title)


def draw_rank_loads(reports: Mapping[str, object], *, title: str | None = None) -> go.Figure:
    """Grouped bars: each rank's predicted cost under each partitioner (``{name: BalanceReport}``), and the
    lower bound max(total / K, costliest rollout) as a dashed line."""
    fig = go.Figure()
    bound = None
    for i, (name, report) in enumerate(reports.items()):
        fig.add_bar(
            name=f"{name} (imbalance {report.imbalance:.3f})",
            x=[f"rank {r}" for r in range(report.num_ranks)],
            y=report.costs,
            marker_color=PALETTE[i % len(PALETTE)],
            hovertemplate="%{x}: %{y:,.4g} " + report.unit + "<extra>" + name + "</extra>",
        )
        bound, unit = report.lower_bound, report.unit
    if bound is not None:
        fig.add_hline(
            y=bound,
            line_dash="dash",
            line_color="#444",
            annotation_text="lower bound",
            annotation_position="top left",
        )
        fig.update_yaxes(title_text=unit)
    fig.update_layout(
        barmode="group",
        title=title,
        legend_title_text="partitioner",
        height=380,
        margin=dict(l=60, r=20, t=50, b=40),
    )
    return fig


def draw_balance_sweep(
    rows: Sequence[Mapping], metric: str = "imbalance", *, title: str | None = None, log_y: bool = False
) -> go.Figure:
    """``metric`` of :func:`treeattn_lab.bench.balance.simulate` rows against K, one panel per
    set, one line per partitioner (same colour in every panel)."""
    sets = list(dict.fromkeys(r["set"] for r in rows))
    parts = list(dict.fromkeys(r["partitioner"] for r in rows))
    cols = min(len(sets), 4)
    grid_rows = (len(sets) + cols - 1) // cols
    fig = make_subplots(
        rows=grid_rows,
        cols=cols,
        subplot_titles=sets,
        horizontal_spacing=0.06,
        vertical_spacing=0.2 if grid_rows > 1 else 0.1,
    )
    for s, name in enumerate(sets):
        for p, part in enumerate(parts):
            pts = sorted(
                (r["num_ranks"], r[metric]) for r in rows if r["set"] == name and r["partitioner"] == part
            )
            fig.add_scatter(
                x=[k for k, _ in pts],
                y=[v for _, v in pts],
                name=part,
                legendgroup=part,
                showlegend=s == 0,
                mode="lines+markers",
                line=dict(color=PALETTE[p % len(PALETTE)], dash=_DASHES[p % len(_DASHES)]),
                hovertemplate=f"{part}<br>K=%{{x}}: %{{y:.4g}}<extra>{name}</extra>",
                row=s // cols + 1,
                col=s % cols + 1,
            )
    fig.update_xaxes(type="log", dtick=0.30103, title_text="ranks K")  # ticks at powers of two
    fig.update_yaxes(**(LOG_AXIS if log_y else dict(type="linear")))
    fig.update_layout(
        title=title or f"{metric} against the number of ranks",
        height=90 + 300 * grid_rows,
        legend_title_text="partitioner",
        margin=dict(l=50, r=20, t=70, b=40),
    )
    return fig


def draw_rank_timeline(timeline: Sequence[Mapping], *, title: str | None = None) -> go.Figure:
    """One step per rank as stacked horizontal bars: compute (its share through ``tree_backward``), wait
    (for the slowest rank), all-reduce. A diamond marks the predicted compute time, scaled so that the
    predicted and measured makespans coincide (the cost model's units may be another device's seconds):
    compare the shape, not the scale."""
    ranks = [f"rank {t['rank']}" for t in timeline]
    fig = go.Figure()
    for key, name, color in (
        ("compute_s", "compute", "#4C78A8"),
        ("wait_s", "wait", "#E0E0E0"),
        ("reduce_s", "all-reduce", "#F58518"),
    ):
        fig.add_bar(
            y=ranks,
            x=[t[key] for t in timeline],
            name=name,
            orientation="h",
            marker_color=color,
            hovertemplate="%{y}: %{x:.4f} s<extra>" + name + "</extra>",
        )
    predicted = [t["predicted"] for t in timeline]
    measured = max(t["compute_s"] for t in timeline)
    if max(predicted) > 0:
        scale = measured / max(predicted)
        fig.add_scatter(
            y=ranks,
            x=[p * scale for p in predicted],
            mode="markers",
            name="predicted (scaled)",
            marker=dict(symbol="diamond", size=12, color="#E45756"),
            hovertemplate="%{y}: predicted %{customdata:.3g} " + timeline[0]["unit"] + "<extra></extra>",
            customdata=predicted,
        )
    fig.update_layout(
        barmode="stack",
        title=title,
        xaxis_title="seconds",
        height=120 + 45 * len(ranks),
        margin=dict(l=70, r=20, t=50, b=40),
        yaxis=dict(autorange="reversed"),
    )
    return fig


__all__ = [
    "REPLICATED",
    "draw_balance_sweep",
    "draw_partition",
    "draw_rank_loads",
    "draw_rank_timeline",
    "rank_colors",
]
