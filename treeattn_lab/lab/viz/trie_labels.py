"""Labels on a drawn rollout trie, readable without hovering and never on top of each other.

Beside a node goes its token ids (a trie of short nodes, :data:`TOKENS_SHOWN`) or its token count; below a
leaf, the rollouts that end there (``r3``, ``r0,5``, ``r3-17``); below a bundle of leaves, ``xN``. Every
label has a few forms, longest first, and the longest that fits its room is drawn (:func:`node_labels`);
rooms are measured in pixels from the layout, with generous character widths (:func:`text_px`).
:func:`label_traces` turns the labels into text-only plotly traces clear of the markers.
"""

from __future__ import annotations

from collections.abc import Mapping

import plotly.graph_objects as go

LABEL_FONT_PX = 10
CHAR_PX = 0.6 * LABEL_FONT_PX  # a generous width of one label character
TOKENS_SHOWN = 8  # a trie whose drawn nodes hold at most this many tokens each is labelled with token ids
DIAMOND_REACH = 1.4  # a diamond marker reaches this many times its size / 2 above and below its centre


def count_label(n: int) -> str:
    """A token count in at most four characters: ``384``, ``1.2K``, ``12K``, ``1.2M``."""
    if n < 1000:
        return str(n)
    for unit, size in (("K", 1e3), ("M", 1e6)):
        if n < 9.95 * size:
            return f"{n / size:.1f}{unit}"
        if n < 999.5 * size:
            return f"{n / size:.0f}{unit}"
    return f"{n / 1e9:.1f}G"


def tokens_label(tokens, *, full: bool) -> str:
    """A node's token ids: all of them (``full``), or the first two and the last around an ellipsis."""
    ids = [str(t) for t in tokens]
    if full or len(ids) <= 3:
        return " ".join(ids)
    return f"{ids[0]} {ids[1]} … {ids[-1]}"


def ends_labels(ends) -> list[str]:
    """The rollouts ending at a node, longest form first: ``r0,5``, ``r3-17`` (a run), ``r3…`` (the
    first and more)."""
    ends = sorted(ends)
    if not ends:
        return []
    forms = []
    if len(ends) <= 4:
        forms.append("r" + ",".join(str(e) for e in ends))
    if len(ends) > 2 and ends[-1] - ends[0] == len(ends) - 1:
        forms.append(f"r{ends[0]}-{ends[-1]}")
    if len(ends) > 1:
        forms.append(f"r{ends[0]}…")
    return forms


def text_px(text: str) -> float:
    """The width of a label in pixels, its widest line at :data:`LABEL_FONT_PX` (generous)."""
    return CHAR_PX * max(len(line) for line in text.split("<br>"))


def _rows(pos: dict, nodes) -> list[list]:
    """``nodes`` grouped by depth (their y in ``pos``), each row ordered left to right."""
    rows: dict[float, list] = {}
    for n in nodes:
        rows.setdefault(pos[n][1], []).append(n)
    return [sorted(row, key=lambda n: pos[n][0]) for row in rows.values()]


def _row_neighbours(pos: dict, nodes, x_lo: float, x_hi: float) -> dict:
    """``{node: (left gap, left neighbour, right gap, right neighbour)}``: the distance in x units to the
    nearest drawn node of the same depth on either side and that node (to ``x_lo`` / ``x_hi`` and None at
    the row's ends)."""
    out = {}
    for row in _rows(pos, nodes):
        xs = [x_lo] + [pos[n][0] for n in row] + [x_hi]
        ns = [None, *row, None]
        for i, n in enumerate(row, start=1):
            out[n] = (xs[i] - xs[i - 1], ns[i - 1], xs[i + 1] - xs[i], ns[i + 1])
    return out


def _stagger_rooms(pos: dict, leaves, px_per_x: float, x_lo: float, x_hi: float) -> dict:
    """``{leaf: (level, room)}`` for labels below the leaves set on two levels, alternating along each
    row: a label's room is the distance to the next leaf on its own level (two along the row), or twice
    the distance to the axis end where there is none."""
    out = {}
    for row in _rows(pos, leaves):
        for i, n in enumerate(row):
            x = pos[n][0]
            left = x - pos[row[i - 2]][0] if i >= 2 else 2 * (x - x_lo)
            right = pos[row[i + 2]][0] - x if i + 2 < len(row) else 2 * (x_hi - x)
            out[n] = (i % 2, min(left, right) * px_per_x - 4)
    return out


def node_labels(
    trie, full, drawn, pos: dict, radius: Mapping, *, px_per_x: float, x_lo: float, x_hi: float,
    bundles: Mapping | None = None,
) -> dict:
    """``{item: (beside, above, below, level)}``: the text drawn to the right of each drawn node or
    bundle, centred above it and centred below it (``""``: none), each the longest of its forms that
    fits its room, and the level of the one below (0, or 1 for a line further down).

    A node's label is its token ids when every drawn node holds at most :data:`TOKENS_SHOWN` tokens
    (:func:`tokens_label`), else its token count (:func:`count_label`); a node that is not a leaf adds
    the rollouts ending on it. It goes beside the node, or above it where the row has no room beside.
    Below a leaf go the rollouts that end there (:func:`ends_labels`), with the leaf's label as a second
    line where it has no room beside; below a bundle of ``bundles`` (``{key: leaves}``), ``xN``. The
    leaves carry their labels all or none (so that a missing count never reads as a small one); where
    some leaf has no room for its label, the leaves show only their rollouts, on two alternating levels
    where one level leaves some without room. Rooms are in pixels at ``px_per_x`` per x unit: beside,
    the gap to the next node's marker in the row (to ``x_hi`` at its end); above and below, centred, the
    distance to a neighbour in the row (whose label is centred too) or twice the distance to the axis
    end (``x_lo``, ``x_hi``).
    """
    bundles = bundles or {}
    singles = [n for n in drawn if n not in bundles and n != 0]
    by_ids = all(len(trie.nodes[n].tokens) <= TOKENS_SHOWN for n in singles)
    rows = _row_neighbours(pos, list(drawn), x_lo, x_hi)

    def fit(options, room):
        return next((t for t in options if text_px(t) <= room), "")

    def centred(n):
        left, prev, right, nxt = rows[n]
        return min(gap * px_per_x * (1 if nb is not None else 2) - 4
                   for gap, nb in ((left, prev), (right, nxt)))

    labels = {}
    ends = {k: [f"x{len(m)}"] for k, m in bundles.items()}  # below a leaf: the rollouts ending there
    counted = True  # every single leaf shows its label
    for n in singles:
        tokens = trie.nodes[n].tokens
        if by_ids:
            mains = list(dict.fromkeys([tokens_label(tokens, full=True), tokens_label(tokens, full=False)]))
        else:
            mains = [count_label(len(tokens))]
        nxt = rows[n][3]
        beside_room = rows[n][2] * px_per_x - radius[n] - (radius[nxt] if nxt is not None else 0) - 6
        if full.out_degree(n):
            options = [f"{m} · {e}" for m in mains for e in ends_labels(full.nodes[n]["ends"])] + mains
            beside = fit(options, beside_room)
            labels[n] = (beside, "" if beside else fit(options, centred(n)), "", 0)
            continue
        ends[n] = ends_labels(full.nodes[n]["ends"])
        beside = fit(mains, beside_room)
        below = fit([f"{e}<br>{m}" for e in ends[n] for m in ([] if beside else mains)] + ends[n], centred(n))
        labels[n] = (beside, "", below, 0)
        counted &= bool(beside) or "<br>" in below
    plain = {n: fit(forms, centred(n)) for n, forms in ends.items()}
    if counted:
        labels.update({k: ("", "", plain[k], 0) for k in bundles})
        return labels
    staggered = _stagger_rooms(pos, list(ends), px_per_x, x_lo, x_hi)
    two_levels = {n: fit(ends[n], room) for n, (_, room) in staggered.items()}
    if not all(plain.values()) and all(two_levels.values()):
        labels.update({n: ("", "", two_levels[n], staggered[n][0]) for n in ends})
    else:
        labels.update({n: ("", "", plain[n], 0) for n in ends})
    return labels


def label_traces(labels: dict, pos: dict, radius: Mapping, *, px_per_x: float, px_per_y: float):
    """Two text-only traces, each label clear of its node's marker: the labels beside and above the
    nodes (``"node labels"``) and those below the leaves (``"rollout labels"``: the labels below one row
    on one line under its largest marker, a second level one line further down)."""
    beside = [(n, t) for n, (t, _, _, _) in labels.items() if t]
    above = [(n, t) for n, (_, t, _, _) in labels.items() if t]
    below = [(n, t, level) for n, (_, _, t, level) in labels.items() if t]
    common = dict(mode="text", hoverinfo="skip", showlegend=False, cliponaxis=False,
                  textfont=dict(size=LABEL_FONT_PX, color="#333333"))
    line = LABEL_FONT_PX + 2
    reach = {n: radius[n] * (DIAMOND_REACH if isinstance(n, tuple) else 1) for n, _, _ in below}
    row_reach: dict[float, float] = {}  # the labels below one row share their lines, clear of every marker
    for n, _, _ in below:
        row_reach[pos[n][1]] = max(row_reach.get(pos[n][1], 0.0), reach[n])
    return [
        go.Scatter(
            x=[pos[n][0] + (radius[n] + 4) / px_per_x for n, _ in beside] + [pos[n][0] for n, _ in above],
            y=[pos[n][1] for n, _ in beside] + [pos[n][1] + (radius[n] + 3) / px_per_y for n, _ in above],
            text=[t for _, t in beside + above],
            textposition=["middle right"] * len(beside) + ["top center"] * len(above),
            name="node labels",
            **common,
        ),
        go.Scatter(
            x=[pos[n][0] for n, _, _ in below],
            y=[pos[n][1] - (row_reach[pos[n][1]] + 3 + level * line) / px_per_y for n, _, level in below],
            text=[t for _, t, _ in below],
            textposition="bottom center",
            name="rollout labels",
            **common,
        ),
    ]
