"""Drawing a rollout trie: a tidy layered tree, one marker per radix node.

- :func:`draw_trie`: the trie, marker area by token count, optionally one rollout highlighted or the
  nodes coloured by category (a micro-batch, a rank). A wide trie stays readable: markers shrink to the
  room each leaf has, and sibling leaves are bundled into one marker once there are too many to draw.
  Every node is labelled without hovering: beside it its token ids (a trie of short nodes) or its token
  count, below a leaf the rollouts that end there (``r3``); a label is shortened until it fits the room
  beside or below its node (:mod:`.trie_labels`), and left out only where even the shortest does not.
- :func:`tree_layout` / :func:`bfs_nodes` / :func:`node_size`: the layout pieces, reused by the drawings
  of the DFS engine's blocks.

Pure functions: data in, a ``plotly.graph_objects.Figure`` out, never ``.show()``.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable, Iterable, Mapping
from typing import TYPE_CHECKING

import plotly.graph_objects as go

from .style import (
    DIMMED_COLOR,
    EDGE_COLOR,
    HIGHLIGHT_COLOR,
    LINE_PX,
    NODE_COLOR,
    PALETTE,
    ROOT_COLOR,
    fit_title,
    legend_entry,
)
from .trie_labels import TOKENS_SHOWN, label_traces, node_labels

if TYPE_CHECKING:  # pragma: no cover
    import networkx

    from ...trie import RolloutTrie

_MAX_ENDS_SHOWN = 12
PLOT_WIDTH_PX = 830  # the plot area of a trie drawing autosized to a ~930-px output area (margins 60, 40)
MAX_MARKER_PX = 40  # no node marker is drawn wider than this, however many tokens it holds
MIN_MARKER_PX = 4
ROW_PX = 60  # the height of one depth row


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


def _bundle_leaves(full: networkx.DiGraph, graph: networkx.DiGraph, keep: set, category, max_leaves) -> dict:
    """``{bundle: leaves}``: when the drawn ``graph`` has more than ``max_leaves`` leaves, each parent's
    leaf children of one category become one bundle ``("bundle", parent, category)``. Only leaves of the
    whole trie (``full``) are bundled, never a node whose children were cut by ``max_nodes``; the leaves
    in ``keep`` (the highlighted path) stay single. Empty when the tree is narrow enough."""
    leaves = [n for n in graph if graph.out_degree(n) == 0 and n != 0]
    if max_leaves is None or len(leaves) <= max_leaves:
        return {}
    groups: dict[tuple, list] = {}
    for leaf in leaves:
        if leaf not in keep and full.out_degree(leaf) == 0:
            parent = next(iter(graph.predecessors(leaf)))
            groups.setdefault(("bundle", parent, category(leaf)), []).append(leaf)
    return {key: members for key, members in groups.items() if len(members) > 1}


def _bundled_graph(graph: networkx.DiGraph, bundles: dict) -> networkx.DiGraph:
    """``graph`` with each bundle's leaves replaced by one vertex, the bundle, under their parent."""
    drawn = graph.copy()
    for key, members in bundles.items():
        drawn.remove_nodes_from(members)
        drawn.add_edge(key[1], key)
    return drawn


def _marker_scale(sizes: list[float], num_leaves: int) -> float:
    """The factor that shrinks every marker (areas keep their ratios) so the largest fits the room one leaf
    has across the plot, and never exceeds :data:`MAX_MARKER_PX`."""
    room = min(MAX_MARKER_PX, max(MIN_MARKER_PX, 0.9 * PLOT_WIDTH_PX / max(1, num_leaves)))
    return min(1.0, room / max(sizes))


def _diameter(num_tokens: float, scale: float) -> float:
    """A drawn marker's diameter in pixels: :func:`node_size` shrunk by ``scale``, never below
    :data:`MIN_MARKER_PX`."""
    return max(MIN_MARKER_PX, scale * node_size(num_tokens))


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


def _edge_segments(graph, pos, highlighted: set) -> tuple[list, list, list, list]:
    """Edges as plotly line segments separated by None: ``(x, y)`` of the plain edges, then of the edges
    between highlighted nodes (or from the root to one)."""
    ex, ey, hx, hy = [], [], [], []
    for u, v in graph.edges():
        on_path = v in highlighted and (u in highlighted or u == 0)
        xs, ys = (hx, hy) if on_path else (ex, ey)
        xs += [pos[u][0], pos[v][0], None]
        ys += [pos[u][1], pos[v][1], None]
    return ex, ey, hx, hy


def _node_color(n, highlighted: set, color_by, cat_color) -> str:
    if n in highlighted:
        return HIGHLIGHT_COLOR
    if color_by and n in color_by:
        return cat_color[color_by[n]]
    if n == 0:
        return ROOT_COLOR
    return DIMMED_COLOR if highlighted else NODE_COLOR


def _node_trace(full, graph, kept, pos, highlighted: set, color_by, cat_color, scale: float) -> go.Scatter:
    """One marker per drawn node: size by token count, colour by highlight or category, hover text. The
    highlighted nodes come last, so they are drawn on top."""
    kept = sorted(kept, key=lambda n: n in highlighted)
    colors = [_node_color(n, highlighted, color_by, cat_color) for n in kept]
    return go.Scatter(
        x=[pos[n][0] for n in kept],
        y=[pos[n][1] for n in kept],
        mode="markers",
        name="nodes",
        showlegend=False,
        customdata=kept,
        text=[_hover(n, full.nodes[n], full.out_degree(n) - graph.out_degree(n)) for n in kept],
        hovertemplate="%{text}<extra></extra>",
        marker=dict(
            size=[_diameter(full.nodes[n]["num_tokens"], scale) for n in kept],
            color=colors,
            line=dict(width=[2.5 if n in highlighted else 0.5 for n in kept], color="#333333"),
            opacity=0.95,
        ),
    )


def _bundle_trace(full, bundles: dict, pos, colors: dict, scale: float) -> go.Scatter:
    """One diamond per bundle of sibling leaves, sized as their mean leaf, hover naming how many and which."""
    keys = list(bundles)
    tokens = [sum(full.nodes[n]["num_tokens"] for n in bundles[k]) for k in keys]
    text = [
        f"<b>{len(bundles[k])} leaves of node {k[1]}</b><br>tokens: {t} in all<br>"
        f"nodes: {', '.join(str(n) for n in bundles[k][:_MAX_ENDS_SHOWN])}"
        + (" ..." if len(bundles[k]) > _MAX_ENDS_SHOWN else "")
        for k, t in zip(keys, tokens, strict=True)
    ]
    return go.Scatter(
        x=[pos[k][0] for k in keys],
        y=[pos[k][1] for k in keys],
        mode="markers",  # its "xN" is drawn with the leaves' labels
        name="bundled leaves",
        showlegend=False,
        customdata=[list(bundles[k]) for k in keys],
        text=[f"x{len(bundles[k])}" for k in keys],
        hovertext=text,
        hovertemplate="%{hovertext}<extra></extra>",
        marker=dict(
            symbol="diamond",
            size=[_diameter(t / len(bundles[k]), scale) for k, t in zip(keys, tokens, strict=True)],
            color=[colors[k] for k in keys],
            line=dict(width=0.5, color="#333333"),
            opacity=0.95,
        ),
    )


def _edge_trace(xs, ys, name: str, color: str, width: float) -> go.Scatter:
    return go.Scatter(
        x=xs,
        y=ys,
        mode="lines",
        name=name,
        hoverinfo="skip",
        showlegend=False,
        line=dict(color=color, width=width),
    )


def _subtitle(trie, shown: int, truncated: bool, bundled: int, by_ids: bool) -> str:
    s = trie.stats()
    sub = (
        f"{s['num_sequences']} sequences, {s['num_nodes']} nodes, "
        f"{s['flat_tokens']} flat -> {s['tree_tokens']} tree tokens (x{s['token_ratio']:.2f})"
    )
    if truncated:
        sub += f"; showing the first {shown} of {s['num_nodes']} nodes (BFS)"
    if bundled:
        sub += f"; each diamond bundles N sibling leaves (xN), {bundled} in all"
    sub += "; beside a node its " + ("token ids" if by_ids else "token count") + ", rN: rollout N ends there"
    return sub


def _trie_layout(fig, title: str, sub: str, depth: int, categories, x_range, rows_px: float) -> float:
    """Title, axes and size of a trie drawing whose depth rows take ``rows_px`` pixels; returns the
    pixels per depth row."""
    text, lines = fit_title(f"{title}<br><sup>{sub}</sup>", PLOT_WIDTH_PX + 80)
    top, bottom = 30 + LINE_PX * lines, 60 if categories else 20
    px_per_y = (rows_px - 50) / max(depth, 1)
    fig.update_layout(
        title=dict(text=text),
        template="plotly_white",
        hovermode="closest",
        xaxis=dict(visible=False, range=list(x_range)),
        yaxis=dict(
            title="node depth (edges from the root)",
            tickvals=[-d for d in range(depth + 1)],
            ticktext=[str(d) for d in range(depth + 1)],
            zeroline=False,
            showgrid=False,
            range=[-depth - 38 / px_per_y, 12 / px_per_y],
        ),
        height=int(top + bottom + rows_px),
        margin=dict(l=60, r=40, t=top, b=bottom),
        legend=dict(title="category", orientation="h", x=0, y=0, yanchor="top") if categories else None,
    )
    return px_per_y


def draw_trie(
    trie: RolloutTrie,
    *,
    max_nodes: int = 400,
    highlight: Iterable[int] | None = None,
    color_by: Mapping[int, Hashable] | None = None,
    title: str | None = None,
    max_leaves: int | None = 48,
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
        max_leaves: when the drawn tree has more leaves than this, the leaf children of one parent (and
            one category) are drawn as one diamond, sized by their tokens and labelled with their count
            (trace ``"bundled leaves"``); the highlighted leaf stays single. ``None`` draws every leaf.

    Markers shrink together (their areas keep their ratios) so the largest fits the room a leaf has.
    """
    if max_nodes < 1:
        raise ValueError(f"max_nodes must be at least 1, got {max_nodes}")
    if max_leaves is not None and max_leaves < 1:
        raise ValueError(f"max_leaves must be at least 1 or None, got {max_leaves}")
    full = trie.to_networkx()
    kept = bfs_nodes(full, 0, limit=max_nodes + 1)
    graph = full.subgraph(kept)

    hi = set(highlight) if highlight is not None else set()
    unknown = hi - set(full.nodes)
    if unknown:
        raise ValueError(f"highlight names nodes the trie does not have: {sorted(unknown)[:5]}")
    categories = []
    if color_by:
        categories = sorted({color_by[n] for n in color_by}, key=lambda c: (str(type(c)), c))
    cat_color = {c: PALETTE[i % len(PALETTE)] for i, c in enumerate(categories)}

    bundles = _bundle_leaves(full, graph, hi, lambda n: (color_by or {}).get(n), max_leaves)
    drawn = _bundled_graph(graph, bundles) if bundles else graph
    pos = tree_layout(drawn, 0)
    singles = [n for n in kept if n in drawn]
    plain = DIMMED_COLOR if hi else NODE_COLOR
    bundle_colors = {k: plain if k[2] is None else cat_color[k[2]] for k in bundles}
    sizes = [node_size(full.nodes[n]["num_tokens"]) for n in singles]
    sizes += [node_size(sum(full.nodes[n]["num_tokens"] for n in m) / len(m)) for m in bundles.values()]
    scale = _marker_scale(sizes, sum(1 for n in drawn if drawn.out_degree(n) == 0))

    ex, ey, hx, hy = _edge_segments(drawn, pos, hi)
    fig = go.Figure()
    fig.add_trace(_edge_trace(ex, ey, "edges", EDGE_COLOR, 1))
    if hx:
        fig.add_trace(_edge_trace(hx, hy, "highlighted edges", HIGHLIGHT_COLOR, 3))
    if bundles:
        fig.add_trace(_bundle_trace(full, bundles, pos, bundle_colors, scale))
    fig.add_trace(_node_trace(full, graph, singles, pos, hi, color_by, cat_color, scale))
    for c in categories:  # legend-only entries, so the colours can be read
        fig.add_trace(legend_entry(str(c), dict(size=10, color=cat_color[c]), showlegend=True))
    depth = int(max(-y for _, y in pos.values()))
    slots = max(1, sum(1 for n in drawn if drawn.out_degree(n) == 0))
    x_range = (-0.8, slots - 0.2)  # a leaf's slot is one unit, and the rows' ends have some air
    px_per_x = PLOT_WIDTH_PX / (x_range[1] - x_range[0])
    by_ids = all(len(trie.nodes[n].tokens) <= TOKENS_SHOWN for n in singles if n != 0)
    sub = _subtitle(trie, len(kept) - 1, len(kept) < full.number_of_nodes(), sum(map(len, bundles.values())),
                    by_ids)
    rows_px = max(200, min(760, ROW_PX * depth + 60))
    px_per_y = _trie_layout(fig, title or "Rollout trie", sub, depth, categories, x_range, rows_px)
    radius = {n: _diameter(full.nodes[n]["num_tokens"], scale) / 2 for n in singles}
    for k, m in bundles.items():
        radius[k] = _diameter(sum(full.nodes[n]["num_tokens"] for n in m) / len(m), scale) / 2
    labels = node_labels(trie, full, drawn, pos, radius, px_per_x=px_per_x, x_lo=x_range[0],
                         x_hi=x_range[1] + 36 / px_per_x, bundles=bundles)  # beside: into the right margin
    fig.add_traces(label_traces(labels, pos, radius, px_per_x=px_per_x, px_per_y=px_per_y))
    return fig


__all__ = ["bfs_nodes", "draw_trie", "node_size", "tree_layout"]
