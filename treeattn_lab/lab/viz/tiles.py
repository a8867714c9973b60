"""Drawing the tree-attention kernel's tile schedule: which (query tile, key tile) pairs it computes.

- :func:`tile_classes`: every tile of a pack as skipped (never loaded), full (computed with no mask) or
  partial (computed with the element mask), read from the kernel's own schedule.
- :func:`draw_tile_schedule`: those classes drawn over the pack's attention mask, with the counts.
"""

from __future__ import annotations

import math

import plotly.graph_objects as go

from .style import MASK_COLORSCALE, above_plot, fit_title, fit_width, legend_entry, stepped_colorscale

TILE_SKIPPED, TILE_FULL, TILE_PARTIAL = 0, 1, 2
TILE_NAMES = ("skipped", "full", "partial")
TILE_COLORS = ("#F2F2F2", "#54A24B", "#F58518")  # skipped, full (no mask), partial (masked)


def tile_classes(pack, block_m: int, block_n: int):
    """``[nQ, nK]`` int8 tile classes of ``pack`` under the Triton kernel's own schedule, and the schedule.

    0 = skipped (never loaded), 1 = full (computed with no mask), 2 = partial (computed with the
    element mask), read from ``tile_schedule(...)``'s CSR rows: each row lists its full tiles first.
    """
    import torch

    from ...kernels.tree_attention import tile_schedule

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


def _causal_tiles(nq: int, nk: int, block_m: int, block_n: int, T: int) -> int:
    """Tiles a causal kernel over the same T tokens visits: key tile ``j`` starts at or before the
    query tile's last query."""
    import torch

    q_last = (torch.arange(nq) * block_m + block_m).clamp(max=T) - 1
    return int(((torch.arange(nk) * block_n)[None, :] <= q_last[:, None]).sum())


def _grouped(cls, max_cells: int):
    """``(view, g)``: the class map in groups of ``g x g`` tiles, so no side exceeds ``max_cells``; a
    group shows its most expensive tile (max-pool: partial > full > skipped)."""
    import torch

    group = max(1, math.ceil(max(cls.shape) / max_cells))
    if group == 1:
        return cls, 1
    pooled = torch.nn.functional.max_pool2d(cls[None, None].float(), group, group, ceil_mode=True)[0, 0]
    return pooled.to(torch.int8), group


def _add_tile_maps(fig, pack, view, group: int, block_m: int, block_n: int, draw_elements: bool) -> None:
    """The element mask (when drawn) and the tile classes over it."""
    import torch

    T = pack.num_tokens
    rows = view.tolist()
    hover_text = len(rows) * len(rows[0]) <= _MAX_TILE_HOVERS
    step_m, step_n = block_m * group, block_n * group
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
    gap = 0 if draw_elements or len(rows) > 64 else 1
    fig.add_trace(
        go.Heatmap(
            z=view.numpy(),
            x0=(step_n - 1) / 2,
            dx=step_n,
            y0=(step_m - 1) / 2,
            dy=step_m,
            zmin=-0.5,
            zmax=2.5,
            colorscale=stepped_colorscale(TILE_COLORS),
            showscale=False,
            opacity=0.5 if draw_elements else 1.0,
            xgap=gap,
            ygap=gap,
            text=_tile_hover(rows, block_m, block_n, group, T) if hover_text else None,
            hovertemplate="%{text}<extra></extra>" if hover_text else _BIG_TILE_HOVER,
            name="tiles",
        )
    )


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

    if block_m < 1 or block_n < 1:
        raise ValueError(f"tile sizes must be positive, got {block_m} x {block_n}")
    T = pack.num_tokens
    cls, sched = tile_classes(pack, block_m, block_n)
    nq, nk = cls.shape
    full, partial, total = sched["full_tiles"], sched["partial_tiles"], sched["total_tiles"]
    skipped = total - full - partial
    causal = _causal_tiles(nq, nk, block_m, block_n, T)
    view, group = _grouped(cls, max_cells)

    fig = go.Figure()
    draw_elements = max_tokens >= T
    _add_tile_maps(fig, pack, view, group, block_m, block_n, draw_elements)
    if draw_elements:  # tile grid
        for j in range(1, nk):
            fig.add_vline(x=j * block_n - 0.5, line_width=1, line_color="#555555", opacity=0.6)
        for i in range(1, nq):
            fig.add_hline(y=i * block_m - 0.5, line_width=1, line_color="#555555", opacity=0.6)
    for c, (name, n) in enumerate(zip(TILE_NAMES, (skipped, full, partial), strict=True)):
        marker = dict(symbol="square", size=14, color=TILE_COLORS[c], line=dict(width=1, color="#888"))
        fig.add_trace(legend_entry(f"{name}: {n:,} tiles ({n / total:.0%})", marker))  # a heatmap has none
    head = title or "Tile schedule"
    sub = (
        f"T = {T:,} tokens, {block_m} x {block_n} tiles: {nq} x {nk} = {total:,}<br>"
        f"visited {full + partial:,} ({full:,} full + {partial:,} partial), "
        f"<b>{skipped / total:.0%} skipped</b> (causal over the same T would visit {causal:,})"
    )
    if group > 1:
        sub += f"<br>each cell shows {group} x {group} tiles (coloured by its most expensive tile)"
    width = fit_width(200 + (760 if not draw_elements else max(440, min(760, 2 * T + 160))))
    side = width - 200  # the map's side; the legend takes the rest
    text, lines = fit_title(
        f"{head}<br>" + "<br>".join(f"<sup>{s}</sup>" for s in sub.split("<br>")), side + 200
    )
    top = 75 + 22 * lines  # the title, then the key axis (ticks and title) on top of the map
    fig.update_layout(
        title=above_plot(text, lines, 55),  # clear of the key axis on top
        template="plotly_white",
        width=width,
        height=side + top - 90,
        margin=dict(l=60, r=20, t=top, b=40),
        legend=dict(title="key tiles per query tile", x=1.02, y=1, yanchor="top"),
        meta=dict(skipped=skipped, full=full, partial=partial, total=total, causal=causal, group=group),
        plot_bgcolor="white",
    )
    axes = dict(showgrid=False, constrain="domain", zeroline=False)
    fig.update_xaxes(title="key (packed token)", side="top", range=[-0.5, T - 0.5], **axes)
    fig.update_yaxes(title="query (packed token)", range=[T - 0.5, -0.5], scaleanchor="x", **axes)
    return fig


__all__ = ["TILE_FULL", "TILE_NAMES", "TILE_PARTIAL", "TILE_SKIPPED", "draw_tile_schedule", "tile_classes"]
