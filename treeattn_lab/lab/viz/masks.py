"""Drawing attention masks: which (query, key) pairs are attended, as heatmaps.

- :func:`draw_mask`: one small ``[T_q, T_k]`` bool mask, dark where the query attends the key.
- :func:`draw_masks_side_by_side`: several masks in one row, each titled with its attended pairs.
- :func:`flat_causal_mask`: the block-diagonal mask of per-sequence causal attention, to set beside a
  pack's tree mask (``trie.pack().visibility_mask()``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .style import MASK_COLORSCALE, above_plot, fit_title, fit_width


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
    width = fit_width(max(side, 480))  # room for the title beside a small mask
    text, lines = fit_title(title or f"mask {n_q} x {n_k}: {sum(map(sum, rows))} pairs attended", width)
    top = 78 + 22 * lines  # the title, then the key axis (ticks and title) on top of the mask
    cell = min((side - 80) / n_k, (side - 80) / n_q)  # square cells; a wide mask gets a low figure
    fig.update_layout(
        title=above_plot(text, lines, 62),  # clear of the key axis on top
        template="plotly_white",
        width=width,
        height=int(max(160, cell * n_q) + top + 20),
        margin=dict(l=60, r=20, t=top, b=20),
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
    width = fit_width(max(600, len(all_rows) * min(560, 10 * biggest + 60) + 80))
    panel = (width - 80) * biggest / sum(sizes) * (1 - 0.06 * (len(all_rows) - 1))  # the biggest panel's side
    text, lines = fit_title(title, width) if title else ("", 0)
    top = 70 + 22 * lines  # the title, then two lines of subplot title
    fig.update_layout(
        title=above_plot(text, lines, 48) if title else None,  # clear of the subplot titles
        template="plotly_white",
        height=int(max(260, panel) + top + 50),
        width=width,
        margin=dict(l=60, r=20, t=top, b=50),
    )
    return fig


__all__ = ["draw_mask", "draw_masks_side_by_side", "flat_causal_mask"]
