"""Plotly drawings shared by the notebooks, so every notebook stays short and looks alike.

Every function here is pure: it takes data, returns a ``plotly.graph_objects.Figure`` and never calls
``.show()``. Display the figure yourself (a notebook shows the last expression of a cell), or wrap it
in ``go.FigureWidget(fig)`` to update it from an ipywidgets control.

- :func:`draw_trie`: a rollout trie as a tidy layered tree, one marker per radix node.
- :func:`draw_mask` / :func:`draw_masks_side_by_side`: bool attention masks as heatmaps.
- :func:`flat_causal_mask`: the block-diagonal mask of per-sequence causal attention, for comparison.
- :func:`draw_stats_bars` / :func:`draw_stats_table`: :meth:`RolloutTrie.stats` of several sets.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import plotly.graph_objects as go
from plotly.colors import qualitative
from plotly.subplots import make_subplots

if TYPE_CHECKING:  # pragma: no cover
    import networkx

    from ..trie import RolloutTrie

NODE_COLOR = "#4C78A8"
ROOT_COLOR = "#888888"
EDGE_COLOR = "#B0B0B0"
HIGHLIGHT_COLOR = "#E45756"
DIMMED_COLOR = "#C8D3E0"
PALETTE = qualitative.Plotly
MASK_COLORSCALE = [[0.0, "#F4F4F4"], [1.0, "#2F5D8A"]]

_MAX_ENDS_SHOWN = 12


# ---------------------------------------------------------------------------------------- trie
def bfs_nodes(graph: networkx.DiGraph, root: Hashable = 0, limit: int | None = None) -> list:
    """Vertices of a tree in breadth-first order from ``root``, at most ``limit`` of them."""
    out, queue = [], deque([root])
    while queue and (limit is None or len(out) < limit):
        node = queue.popleft()
        out.append(node)
        queue.extend(graph.successors(node))
    return out


def tree_layout(graph: networkx.DiGraph, root: Hashable = 0) -> dict[Hashable, tuple[float, float]]:
    """A tidy layered layout of a tree: ``{vertex: (x, y)}``.

    Leaves sit at x = 0, 1, 2, ... in depth-first order; a parent sits at the midpoint of its first and
    last child, so no edges cross. ``y`` is minus the number of edges from the root (root on top).
    """
    pos: dict[Hashable, tuple[float, float]] = {}
    next_leaf = 0
    # iterative post-order DFS (a recursive walk would hit Python's limit on deep agentic tries)
    stack: list[tuple[Hashable, int, bool]] = [(root, 0, False)]
    while stack:
        node, depth, expanded = stack.pop()
        kids = list(graph.successors(node))
        if not kids:
            pos[node] = (float(next_leaf), -float(depth))
            next_leaf += 1
        elif expanded:
            pos[node] = ((pos[kids[0]][0] + pos[kids[-1]][0]) / 2, -float(depth))
        else:
            stack.append((node, depth, True))
            stack.extend((k, depth + 1, False) for k in reversed(kids))
    return pos


def node_size(num_tokens: int) -> float:
    """Marker diameter in pixels: grows with the square root of the node's token count."""
    return 7.0 + 2.2 * math.sqrt(num_tokens)


def _hover(node: int, attrs: dict, hidden_children: int) -> str:
    ends = attrs["ends"]
    if not ends:
        ends_txt = "-"
    else:
        ends_txt = ", ".join(str(e) for e in ends[:_MAX_ENDS_SHOWN])
        if len(ends) > _MAX_ENDS_SHOWN:
            ends_txt += f" ... ({len(ends)} in all)"
    if node == 0:
        lines = ["<b>root</b> (holds no tokens)"]
    else:
        lines = [
            f"<b>node {node}</b>",
            f"tokens: {attrs['num_tokens']}",
            f"positions: {attrs['depth']}..{attrs['end_depth'] - 1}",
            f"sequences ending here: {ends_txt}",
            f"preview: {attrs['preview']}",
        ]
    if hidden_children:
        lines.append(f"<i>{hidden_children} child node(s) not drawn</i>")
    return "<br>".join(lines)


def draw_trie(
    trie: RolloutTrie,
    *,
    max_nodes: int = 400,
    highlight: Iterable[int] | None = None,
    color_by: Mapping[int, Hashable] | None = None,
    title: str | None = None,
) -> go.Figure:
    """Draw a :class:`RolloutTrie`: one marker per radix node, parent -> child edges as lines.

    Marker area grows with the node's token count; hover shows the node id, its token count, the
    positions it covers (``depth..end_depth - 1``), the sequences ending there and its first tokens.
    Only the root and the first ``max_nodes`` nodes in breadth-first order are drawn (the root holds
    no tokens and is not counted, as in ``trie.num_nodes``); the title says so when the trie is bigger.

    Args:
        highlight: node ids to emphasise (e.g. ``trie.path(trie.seq_end_node[i])``, one rollout); the
            other nodes are dimmed and the edges between highlighted nodes (and the root) drawn red.
        color_by: ``{node id: category}`` colours the nodes by category (one legend entry each);
            nodes missing from the dict keep the default colour.
    """
    if max_nodes < 1:
        raise ValueError(f"max_nodes must be at least 1, got {max_nodes}")
    full = trie.to_networkx()
    kept = bfs_nodes(full, 0, limit=max_nodes + 1)
    graph = full.subgraph(kept)
    pos = tree_layout(graph, 0)
    truncated = len(kept) < full.number_of_nodes()

    hi = set(highlight) if highlight is not None else set()
    unknown = hi - set(full.nodes)
    if unknown:
        raise ValueError(f"highlight names nodes the trie does not have: {sorted(unknown)[:5]}")
    categories = []
    if color_by:
        categories = sorted({color_by[n] for n in color_by}, key=lambda c: (str(type(c)), c))
    cat_color = {c: PALETTE[i % len(PALETTE)] for i, c in enumerate(categories)}

    # edges: one trace of segments separated by None, plus one trace for the highlighted ones
    ex, ey, hx, hy = [], [], [], []
    for u, v in graph.edges():
        on_path = v in hi and (u in hi or u == 0)
        xs, ys = (hx, hy) if on_path else (ex, ey)
        xs += [pos[u][0], pos[v][0], None]
        ys += [pos[u][1], pos[v][1], None]

    xs, ys, sizes, colors, texts, lines = [], [], [], [], [], []
    for n in kept:
        attrs = full.nodes[n]
        xs.append(pos[n][0])
        ys.append(pos[n][1])
        sizes.append(node_size(attrs["num_tokens"]))
        if n in hi:
            color = HIGHLIGHT_COLOR
        elif color_by and n in color_by:
            color = cat_color[color_by[n]]
        elif n == 0:
            color = ROOT_COLOR
        else:
            color = DIMMED_COLOR if hi else NODE_COLOR
        colors.append(color)
        lines.append(2.5 if n in hi else 0.5)
        hidden = full.out_degree(n) - graph.out_degree(n)
        texts.append(_hover(n, attrs, hidden))

    fig = go.Figure()
    fig.add_trace(
        go.Scatter(
            x=ex,
            y=ey,
            mode="lines",
            name="edges",
            hoverinfo="skip",
            showlegend=False,
            line=dict(color=EDGE_COLOR, width=1),
        )
    )
    if hx:
        fig.add_trace(
            go.Scatter(
                x=hx,
                y=hy,
                mode="lines",
                name="highlighted edges",
                hoverinfo="skip",
                showlegend=False,
                line=dict(color=HIGHLIGHT_COLOR, width=3),
            )
        )
    fig.add_trace(
        go.Scatter(
            x=xs,
            y=ys,
            mode="markers",
            name="nodes",
            showlegend=False,
            customdata=kept,
            text=texts,
            hovertemplate="%{text}<extra></extra>",
            marker=dict(size=sizes, color=colors, line=dict(width=lines, color="#333333"), opacity=0.95),
        )
    )
    for c in categories:  # legend-only entries, so the colours can be read
        fig.add_trace(
            go.Scatter(
                x=[None],
                y=[None],
                mode="markers",
                name=str(c),
                showlegend=True,
                marker=dict(size=10, color=cat_color[c]),
            )
        )

    s = trie.stats()
    head = title or "Rollout trie"
    sub = (
        f"{s['num_sequences']} sequences, {s['num_nodes']} nodes, "
        f"{s['flat_tokens']} flat -> {s['tree_tokens']} tree tokens (x{s['token_ratio']:.2f})"
    )
    if truncated:
        sub += f"; showing the first {len(kept) - 1} of {s['num_nodes']} nodes (BFS)"
    depth = max(-y for y in ys) if ys else 0
    fig.update_layout(
        title=dict(text=f"{head}<br><sup>{sub}</sup>"),
        template="plotly_white",
        hovermode="closest",
        xaxis=dict(visible=False),
        yaxis=dict(
            title="node depth (edges from the root)",
            tickvals=[-d for d in range(int(depth) + 1)],
            ticktext=[str(d) for d in range(int(depth) + 1)],
            zeroline=False,
            showgrid=False,
        ),
        height=max(320, min(900, 140 + 60 * (int(depth) + 1))),
        margin=dict(l=60, r=20, t=80, b=30),
        legend=dict(title="category") if categories else None,
    )
    return fig


# ---------------------------------------------------------------------------------------- masks
def _as_bool_rows(mask) -> list[list[int]]:
    """A 2-D bool mask (tensor, numpy array or nested lists) as rows of 0/1 ints."""
    if hasattr(mask, "detach"):
        mask = mask.detach().cpu()
    rows = mask.tolist() if hasattr(mask, "tolist") else [list(r) for r in mask]
    if not rows or not isinstance(rows[0], list) or any(len(r) != len(rows[0]) for r in rows):
        raise ValueError("mask must be a non-empty 2-D array")
    return [[int(bool(v)) for v in r] for r in rows]


def _mask_heatmap(rows: list[list[int]], *, x_title: str, y_title: str) -> go.Heatmap:
    n_q, n_k = len(rows), len(rows[0])
    gap = 1 if max(n_q, n_k) <= 64 else 0
    seen = [["attends" if v else "masked" for v in r] for r in rows]
    return go.Heatmap(
        z=rows,
        text=seen,
        zmin=0,
        zmax=1,
        colorscale=MASK_COLORSCALE,
        showscale=False,
        xgap=gap,
        ygap=gap,
        hovertemplate=f"{y_title} %{{y}}, {x_title} %{{x}}: %{{text}}<extra></extra>",
    )


def draw_mask(mask_bool_2d, *, title: str | None = None, x_title: str = "key", y_title: str = "query"):
    """Heatmap of a small ``[T_q, T_k]`` bool mask: dark where ``mask[q, k]`` (q attends k).

    Row 0 is on top, as in a matrix, so a causal mask is a lower triangle.
    """
    rows = _as_bool_rows(mask_bool_2d)
    fig = go.Figure(_mask_heatmap(rows, x_title=x_title, y_title=y_title))
    n_q, n_k = len(rows), len(rows[0])
    side = max(300, min(700, 12 * max(n_q, n_k) + 120))
    fig.update_layout(
        title=dict(text=title or f"mask {n_q} x {n_k}: {sum(map(sum, rows))} pairs attended"),
        template="plotly_white",
        width=side,
        height=side,
        margin=dict(l=60, r=20, t=60, b=50),
    )
    fig.update_xaxes(title=x_title, side="top", constrain="domain", showgrid=False)
    fig.update_yaxes(title=y_title, autorange="reversed", scaleanchor="x", constrain="domain", showgrid=False)
    return fig


def flat_causal_mask(lengths: Sequence[int]):
    """Block-diagonal ``[sum L, sum L]`` bool mask: each sequence causal on its own, no sharing.

    This is what attention costs when every rollout is its own sequence (copies of shared prefixes
    included); compare it with ``trie.pack().visibility_mask()``.
    """
    import torch

    lengths = [int(n) for n in lengths]
    if not lengths or min(lengths) < 1:
        raise ValueError("lengths must be a non-empty list of positive ints")
    return torch.block_diag(*[torch.ones(n, n, dtype=torch.bool).tril() for n in lengths])


def draw_masks_side_by_side(
    masks: Mapping[str, object],
    *,
    title: str | None = None,
    x_title: str = "key",
    y_title: str = "query",
) -> go.Figure:
    """Several bool masks as heatmaps in one row, e.g. ``{"packed tree": m1, "flat per-sequence": m2}``.

    Each subplot title gives the mask's size and the number of (query, key) pairs it attends, the cost
    an attention kernel that skips masked pairs pays.
    """
    if not masks:
        raise ValueError("masks is empty")
    all_rows = {name: _as_bool_rows(m) for name, m in masks.items()}
    names = [
        f"{name}<br><sup>{len(r)} x {len(r[0])}, {sum(map(sum, r))} pairs</sup>"
        for name, r in all_rows.items()
    ]
    sizes = [max(len(r), len(r[0])) for r in all_rows.values()]
    fig = make_subplots(
        rows=1, cols=len(all_rows), subplot_titles=names, column_widths=sizes, horizontal_spacing=0.06
    )
    for i, rows in enumerate(all_rows.values(), start=1):
        fig.add_trace(_mask_heatmap(rows, x_title=x_title, y_title=y_title), row=1, col=i)
        fig.update_xaxes(title=x_title, showgrid=False, constrain="domain", row=1, col=i)
        fig.update_yaxes(
            title=y_title if i == 1 else None,
            autorange="reversed",
            showgrid=False,
            scaleanchor=f"x{'' if i == 1 else i}",
            constrain="domain",
            constraintoward="top",
            row=1,
            col=i,
        )
    biggest = max(sizes)
    height = max(320, min(700, 10 * biggest + 140))
    fig.update_layout(
        title=dict(text=title) if title else None,
        template="plotly_white",
        height=height,
        width=max(600, min(1400, int(height * len(all_rows) * 0.95))),
        margin=dict(l=60, r=20, t=90 if title else 70, b=50),
    )
    return fig


# ---------------------------------------------------------------------------------------- stats
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
            go.Bar(
                x=names,
                y=vals,
                name=key,
                marker_color=PALETTE[i % len(PALETTE)],
                text=[f"{v:.2f}" for v in vals],
                textposition="outside",
                cliponaxis=False,
                hovertemplate=f"%{{x}}<br>{key}: %{{y:.3f}}<extra></extra>",
            )
        )
    ratios = all(k.endswith("ratio") for k in keys)
    if ratios:
        fig.add_hline(y=1.0, line_dash="dash", line_color="#666666", annotation_text="no saving")
    fig.update_layout(
        title=dict(text=title or "Saving of the tree over flat rollouts"),
        template="plotly_white",
        barmode="group",
        yaxis=dict(title="flat / tree (x)" if ratios else None, rangemode="tozero"),
        height=420,
        margin=dict(l=60, r=20, t=60, b=40),
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
    fig = go.Figure(
        go.Table(
            header=dict(
                values=["statistic", *names], fill_color="#2F5D8A", font=dict(color="white"), align="left"
            ),
            cells=dict(values=cells, align=["left"] + ["right"] * len(names), fill_color="#F7F7F7"),
        )
    )
    fig.update_layout(height=60 + 24 * (len(keys) + 1), margin=dict(l=10, r=10, t=10, b=10))
    return fig


__all__ = [
    "bfs_nodes",
    "draw_mask",
    "draw_masks_side_by_side",
    "draw_stats_bars",
    "draw_stats_table",
    "draw_trie",
    "flat_causal_mask",
    "node_size",
    "tree_layout",
]
