"""Drawing :meth:`RolloutTrie.stats` of several data sets: what the tree saves over flat rollouts.

- :func:`draw_stats_bars`: grouped bars of chosen statistics (by default the token and attention ratios).
- :func:`draw_stats_table`: every statistic as a table, one column per set.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import plotly.graph_objects as go

from .style import PALETTE, labelled_bar, table_figure


def draw_stats_bars(
    stats_by_name: Mapping[str, Mapping],
    keys: Sequence[str] = ("token_ratio", "ideal_attention_ratio"),
    *,
    title: str | None = None,
) -> go.Figure:
    """Grouped bars of ``trie.stats()`` values: one group per data set, one bar per key.

    With the default keys a bar of height 3 means "the tree stores / attends 3x less than flat";
    the dashed line at 1 is "no saving".
    """
    if not stats_by_name:
        raise ValueError("stats_by_name is empty")
    names = list(stats_by_name)
    fig = go.Figure()
    for i, key in enumerate(keys):
        missing = [n for n in names if key not in stats_by_name[n]]
        if missing:
            raise KeyError(f"stats of {missing} have no key {key!r}")
        vals = [float(stats_by_name[n][key]) for n in names]
        fig.add_trace(
            labelled_bar(
                names,
                vals,
                [f"{v:.2f}" for v in vals],
                name=key,
                marker_color=PALETTE[i % len(PALETTE)],
                hovertemplate=f"%{{x}}<br>{key}: %{{y:.3f}}<extra></extra>",
            )
        )
    ratios = all(k.endswith("ratio") for k in keys)
    if ratios:  # named in the legend, where no bar label can sit on it
        fig.add_hline(y=1.0, line_dash="dash", line_color="#666666")
        fig.add_trace(
            go.Scatter(
                x=[None],
                y=[None],
                mode="lines",
                name="1 = no saving",
                line=dict(dash="dash", color="#666666"),
            )
        )
    fig.update_layout(
        title=dict(text=title or "Saving of the tree over flat rollouts"),
        template="plotly_white",
        barmode="group",
        yaxis=dict(title="flat / tree (x)" if ratios else None, rangemode="tozero"),
        height=420,
        margin=dict(l=60, r=20, t=90, b=40),
        legend=dict(orientation="h", x=0, y=1.02, yanchor="bottom"),
    )
    return fig


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.2f}"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    return str(v)


def draw_stats_table(stats_by_name: Mapping[str, Mapping], keys: Sequence[str] | None = None) -> go.Figure:
    """``trie.stats()`` of several data sets as a table: one row per statistic, one column per set."""
    if not stats_by_name:
        raise ValueError("stats_by_name is empty")
    names = list(stats_by_name)
    if keys is None:
        keys = list(stats_by_name[names[0]])
    cells = [list(keys)] + [[_fmt(stats_by_name[n].get(k, "")) for k in keys] for n in names]
    return table_figure(
        ["statistic", *names],
        cells,
        height=60 + 24 * (len(keys) + 1),
        cell_align=["left"] + ["right"] * len(names),
    )


__all__ = ["draw_stats_bars", "draw_stats_table"]
