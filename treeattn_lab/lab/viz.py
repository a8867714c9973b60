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


# ---------------------------------------------------------------------------------------- tile schedule
TILE_SKIPPED, TILE_FULL, TILE_PARTIAL = 0, 1, 2
TILE_NAMES = ("skipped", "full", "partial")
TILE_COLORS = ("#F2F2F2", "#54A24B", "#F58518")  # skipped, full (no mask), partial (masked)


def tile_classes(pack, block_m: int, block_n: int):
    """``[nQ, nK]`` int8 tile classes of ``pack`` under the Triton kernel's own schedule, and the schedule.

    0 = skipped (never loaded), 1 = full (computed with no mask), 2 = partial (computed with the
    element mask), read from ``tile_schedule(...)``'s CSR rows: each row lists its full tiles first.
    """
    import torch

    from ..kernels.tree_attention import tile_schedule

    sched = tile_schedule(pack.subtree_end.cpu(), block_m, block_n)
    ptr, idx = sched["fwd_ptr"].long(), sched["fwd_idx"].long()
    nq = ptr.shape[0]
    nk = -(-pack.num_tokens // block_n)
    cls = torch.zeros(nq, nk, dtype=torch.int8)
    rows = torch.arange(nq)
    n_full, n_all = ptr[:, 1] - ptr[:, 0], ptr[:, 2] - ptr[:, 0]
    row_of = torch.repeat_interleave(rows, n_all)
    pos_in_row = torch.arange(idx.numel()) - ptr[row_of, 0]
    is_full = pos_in_row < n_full[row_of]
    cls[row_of, idx] = torch.where(is_full, TILE_FULL, TILE_PARTIAL).to(torch.int8)
    return cls, sched


_MAX_TILE_HOVERS = 64 * 64  # beyond this many cells, hover shows coordinates and the class number only
_BIG_TILE_HOVER = "query ~%{y}, key ~%{x}: %{z} (0 skipped, 1 full, 2 partial)<extra></extra>"


def _tile_hover(cls_rows, block_m, block_n, group, T) -> list[list[str]]:
    texts = []
    for i, row in enumerate(cls_rows):
        q0, q1 = i * block_m * group, min((i + 1) * block_m * group, T) - 1
        line = []
        for j, c in enumerate(row):
            k0, k1 = j * block_n * group, min((j + 1) * block_n * group, T) - 1
            if group == 1:
                head = f"query tile {i} (queries {q0}..{q1}), key tile {j} (keys {k0}..{k1})"
                line.append(f"{head}: <b>{TILE_NAMES[c]}</b>")
            else:
                head = f"queries {q0}..{q1}, keys {k0}..{k1} ({group} x {group} tiles)"
                worst = {0: "all skipped", 1: "some full, none partial", 2: "some partial"}[c]
                line.append(f"{head}: <b>{worst}</b>")
        texts.append(line)
    return texts


def draw_tile_schedule(
    pack,
    block_m: int,
    block_n: int,
    title: str | None = None,
    *,
    max_tokens: int = 512,
    max_cells: int = 256,
) -> go.Figure:
    """The Triton kernel's tile schedule of ``pack`` drawn over its attention mask.

    Every (query tile, key tile) cell is coloured as *skipped* (never loaded), *full* (computed with no
    mask) or *partial* (computed with the element mask). When the pack has at most ``max_tokens``
    tokens the element mask is drawn underneath (dark = attended) with the tile grid; bigger packs get
    the tile-level map only. A map of more than ``max_cells`` tiles a side is shown in groups of
    ``g x g`` tiles, each coloured by its most expensive tile (partial > full > skipped); the counts in
    the legend and title are always exact. Axes are in packed tokens. ``fig.layout.meta`` holds the
    counts: ``skipped``, ``full``, ``partial``, ``total``, ``causal`` (tiles a causal
    kernel over the same T tokens would visit).
    """
    import torch

    if block_m < 1 or block_n < 1:
        raise ValueError(f"tile sizes must be positive, got {block_m} x {block_n}")
    T = pack.num_tokens
    cls, sched = tile_classes(pack, block_m, block_n)
    nq, nk = cls.shape
    full, partial, total = sched["full_tiles"], sched["partial_tiles"], sched["total_tiles"]
    skipped = total - full - partial
    q_last = (torch.arange(nq) * block_m + block_m).clamp(max=T) - 1
    causal = int(((torch.arange(nk) * block_n)[None, :] <= q_last[:, None]).sum())

    group = max(1, math.ceil(max(nq, nk) / max_cells))
    view = cls
    if group > 1:  # max-pool: a group shows its most expensive tile
        view = torch.nn.functional.max_pool2d(cls[None, None].float(), group, group, ceil_mode=True)[0, 0].to(
            torch.int8
        )
    rows = view.tolist()
    hover_text = len(rows) * len(rows[0]) <= _MAX_TILE_HOVERS
    step_m, step_n = block_m * group, block_n * group
    colorscale = []
    for c, color in enumerate(TILE_COLORS):
        colorscale += [[c / 3, color], [(c + 1) / 3, color]]

    fig = go.Figure()
    draw_elements = max_tokens >= T
    if draw_elements:
        fig.add_trace(  # numpy z travels as a compact typed array
            go.Heatmap(
                z=pack.visibility_mask().cpu().to(torch.uint8).numpy(),
                zmin=0,
                zmax=1,
                colorscale=MASK_COLORSCALE,
                showscale=False,
                hoverinfo="skip",
                name="element mask",
            )
        )
    fig.add_trace(
        go.Heatmap(
            z=view.numpy(),
            x0=(step_n - 1) / 2,
            dx=step_n,
            y0=(step_m - 1) / 2,
            dy=step_m,
            zmin=-0.5,
            zmax=2.5,
            colorscale=colorscale,
            showscale=False,
            opacity=0.5 if draw_elements else 1.0,
            xgap=0 if draw_elements or len(rows) > 64 else 1,
            ygap=0 if draw_elements or len(rows) > 64 else 1,
            text=_tile_hover(rows, block_m, block_n, group, T) if hover_text else None,
            hovertemplate="%{text}<extra></extra>" if hover_text else _BIG_TILE_HOVER,
            name="tiles",
        )
    )
    if draw_elements:  # tile grid
        for j in range(1, nk):
            fig.add_vline(x=j * block_n - 0.5, line_width=1, line_color="#555555", opacity=0.6)
        for i in range(1, nq):
            fig.add_hline(y=i * block_m - 0.5, line_width=1, line_color="#555555", opacity=0.6)
    for c, (name, n) in enumerate(zip(TILE_NAMES, (skipped, full, partial), strict=True)):
        fig.add_trace(  # legend entries (a heatmap has none)
            go.Scatter(
                x=[None],
                y=[None],
                mode="markers",
                name=f"{name}: {n:,} tiles ({n / total:.0%})",
                marker=dict(symbol="square", size=14, color=TILE_COLORS[c], line=dict(width=1, color="#888")),
            )
        )
    head = title or "Tile schedule"
    sub = (
        f"T = {T:,} tokens, {block_m} x {block_n} tiles: {nq} x {nk} = {total:,}<br>"
        f"visited {full + partial:,} ({full:,} full + {partial:,} partial), "
        f"<b>{skipped / total:.0%} skipped</b> (causal over the same T would visit {causal:,})"
    )
    if group > 1:
        sub += f"<br>each cell shows {group} x {group} tiles (coloured by its most expensive tile)"
    side = 760 if not draw_elements else max(440, min(760, 2 * T + 160))
    fig.update_layout(
        title=dict(text=f"{head}<br><sup>{sub}</sup>"),
        template="plotly_white",
        width=side + 200,
        height=side + (60 if group > 1 else 40),
        margin=dict(l=60, r=20, t=150 if group > 1 else 130, b=40),
        legend=dict(title="key tiles per query tile", x=1.02, y=1, yanchor="top"),
        meta=dict(skipped=skipped, full=full, partial=partial, total=total, causal=causal, group=group),
        plot_bgcolor="white",
    )
    fig.update_xaxes(
        title="key (packed token)",
        side="top",
        range=[-0.5, T - 0.5],
        showgrid=False,
        constrain="domain",
        zeroline=False,
    )
    fig.update_yaxes(
        title="query (packed token)",
        range=[T - 0.5, -0.5],
        showgrid=False,
        scaleanchor="x",
        constrain="domain",
        zeroline=False,
    )
    return fig


# ---------------------------------------------------------------------------------------- benchmarks
def load_bench_results(bench: str = "tree", device: str = "NVIDIA-H200", directory=None) -> dict:
    """The newest committed result file ``bench/results/<bench>__<device>__*.json``, as a dict.

    Keys: ``rows`` (one dict per case and backend, as ``python -m treeattn_lab bench tree`` writes them),
    ``environment`` (GPU, versions, time) and the run's settings (``dtype``, ``heads``, ``head_dim``).
    """
    import json
    from pathlib import Path

    from ..bench.harness import RESULTS_DIR

    folder = Path(directory) if directory is not None else RESULTS_DIR
    paths = sorted(folder.glob(f"{bench}__{device}__*.json"))
    if not paths:
        raise FileNotFoundError(f"no {bench}__{device}__*.json under {folder}")
    payloads = [json.loads(p.read_text()) for p in paths]
    return max(payloads, key=lambda d: d.get("environment", {}).get("time_utc", ""))


BACKEND_COLORS = {"flat": "#888888", "flex": "#4C78A8", "triton": "#E45756", "reference": "#72B7B2"}


def draw_bench_summary(rows: Sequence[Mapping], *, title: str | None = None,
                       backends: Sequence[str] | None = None) -> go.Figure:
    """Two panels from ``bench tree`` rows: fwd+bwd speed-up over flat SDPA against the ideal ratio
    (attended pairs flat / tree) per case, and forward TFLOP/s per backend (useful work only).

    ``backends``: which of the rows' backends to draw (default: those of flat, flex and triton the rows
    hold; a run may also hold ``gather-flat``, ``varlen`` and ``auto`` rows)."""
    if not rows:
        raise ValueError("rows is empty")
    present = set(r["backend"] for r in rows)
    if backends is None:
        backends = [b for b in ("flat", "flex", "triton") if b in present]
    missing = [b for b in backends if b not in present]
    if missing:
        raise ValueError(f"no rows for backends {missing}; the rows hold {sorted(present)}")
    cases = list(dict.fromkeys(r["case"] for r in rows))
    backends = list(backends)
    by = {(r["case"], r["backend"]): r for r in rows}
    fig = make_subplots(
        rows=2,
        cols=1,
        vertical_spacing=0.16,
        subplot_titles=(
            "fwd+bwd speed-up over flat SDPA (higher is better); grey: ideal = flat pairs / tree pairs",
            "forward TFLOP/s (useful work: attended pairs only)",
        ),
    )
    for b in backends:
        if b == "flat":
            continue
        ys = [by.get((c, b), {}).get("fwd_bwd_speedup") for c in cases]
        fig.add_trace(
            go.Bar(
                x=cases,
                y=ys,
                name=b,
                legendgroup=b,
                marker_color=BACKEND_COLORS.get(b),
                text=[f"{y:.2f}x" if y is not None else "" for y in ys],
                textposition="outside",
                cliponaxis=False,
                hovertemplate=f"{b}<br>%{{x}}: %{{y:.2f}}x<extra></extra>",
            ),
            row=1,
            col=1,
        )
    ideal = [next(r["ideal"] for r in rows if r["case"] == c) for c in cases]
    fig.add_trace(
        go.Bar(
            x=cases,
            y=ideal,
            name="ideal",
            marker_color="#CCCCCC",
            text=[f"{y:.2f}x" for y in ideal],
            textposition="outside",
            cliponaxis=False,
            hovertemplate="ideal<br>%{x}: %{y:.2f}x<extra></extra>",
        ),
        row=1,
        col=1,
    )
    fig.add_hline(y=1.0, line_dash="dash", line_color="#666666", row=1, col=1)
    for b in backends:
        ys = [by.get((c, b), {}).get("fwd_tflops") for c in cases]
        fig.add_trace(
            go.Bar(
                x=cases,
                y=ys,
                name=b,
                legendgroup=b,
                showlegend=b == "flat",
                marker_color=BACKEND_COLORS.get(b),
                hovertemplate=f"{b}<br>%{{x}}: %{{y:.0f}} TFLOP/s<extra></extra>",
            ),
            row=2,
            col=1,
        )
    fig.update_layout(
        title=dict(text=title or "Tree attention against flat SDPA"),
        template="plotly_white",
        barmode="group",
        height=820,
        margin=dict(l=60, r=20, t=90, b=40),
    )
    fig.update_yaxes(title="x over flat", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(title="TFLOP/s", rangemode="tozero", row=2, col=1)
    fig.update_xaxes(tickangle=-20)
    return fig


def draw_speed_sweep(backends: Sequence[str], *, x_title: str = "prompt length", title: str | None = None):
    """Empty two-panel figure (fwd+bwd latency, fwd+bwd TFLOP/s) with one line per backend, to be filled
    point by point with :func:`add_speed_point` (wrap it in ``go.FigureWidget`` to watch it grow)."""
    if not backends:
        raise ValueError("backends is empty")
    fig = make_subplots(
        rows=1,
        cols=2,
        horizontal_spacing=0.1,
        subplot_titles=("fwd+bwd latency (ms, lower is better)", "fwd+bwd TFLOP/s (useful work)"),
    )
    for col, metric in ((1, "fwd_bwd_ms"), (2, "fwd_bwd_tflops")):
        for b in backends:
            fig.add_trace(
                go.Scatter(
                    x=[],
                    y=[],
                    mode="lines+markers",
                    name=b,
                    legendgroup=b,
                    showlegend=col == 1,
                    meta=metric,
                    line=dict(color=BACKEND_COLORS.get(b)),
                    hovertemplate=f"{b}<br>{x_title} %{{x}}: %{{y:.3g}}<extra></extra>",
                ),
                row=1,
                col=col,
            )
    fig.update_layout(
        title=dict(text=title or "Tree attention as the tree grows"),
        template="plotly_white",
        height=420,
        margin=dict(l=60, r=20, t=80, b=50),
    )
    fig.update_xaxes(title=x_title)
    fig.update_yaxes(rangemode="tozero")
    return fig


def add_speed_point(fig, row: Mapping, x) -> None:
    """Append one ``run_case`` row (one backend) at ``x`` to a :func:`draw_speed_sweep` figure, in place
    (a ``go.FigureWidget`` redraws at once)."""
    traces = [t for t in fig.data if t.name == row["backend"] and t.meta in ("fwd_bwd_ms", "fwd_bwd_tflops")]
    if not traces:
        raise KeyError(f"the figure has no line for backend {row['backend']!r}")
    with fig.batch_update():
        for t in traces:
            t.x = (*(t.x or ()), x)
            t.y = (*(t.y or ()), float(row[t.meta]))


__all__ += [
    "add_speed_point",
    "draw_bench_summary",
    "draw_speed_sweep",
    "draw_tile_schedule",
    "load_bench_results",
    "tile_classes",
]
