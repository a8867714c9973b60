"""Tile census of a pack's tree mask: how many score tiles are full and how many the mask cuts.

A block-sparse attention kernel splits the ``T x T`` score matrix into ``q_block x kv_block`` tiles. Under
the tree rule (query q sees key k exactly when ``k <= q < subtree_end[k]``) a tile is

- *empty* when it holds no visible pair: never visited;
- *full* when it is a whole tile (inside ``T`` in both directions) whose every pair is visible: runs with
  no mask;
- *partial* otherwise: runs with the rule evaluated element by element.

This is FlexAttention's ``BlockMask`` classification (``full_kv_num_blocks`` / ``kv_num_blocks``, with
the tiles past ``T`` padded as invisible), which FlashAttention-4 runs as block sparsity. Packs of long
nodes whose lengths are multiples of the tile have few partial tiles (the diagonal ones); packs of many
short, ragged nodes are mostly partial tiles.

Counting without the tile matrix
--------------------------------
For key tile ``[k0, k1)`` with ``lo = min subtree_end`` and ``hi = max subtree_end`` over its keys (every
``subtree_end[k] > k``):

- it is seen from query tile ``[q0, q1)`` exactly when some key has ``k < q1`` and ``subtree_end[k] > q0``,
  that is ``q1 > k0`` and ``q0 < hi``: the query tiles ``floor(k0 / q_block) <= j < ceil(hi / q_block)``;
- the pair is full exactly when both tiles are whole, ``k1 - 1 <= q0`` and ``q1 <= lo``: the query tiles
  ``ceil((k1 - 1) / q_block) <= j < floor(lo / q_block)``.

So the census takes one pass over ``subtree_end`` (a min and a max per key tile), not ``T^2 / tile``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .flat_tree import require_cached

__all__ = ["FA4_TILE", "TileCensus", "partial_tile_share", "tile_census", "tile_indices"]

# FlexAttention's BlockMask block size (its default, which ``tree_block_mask`` uses): the tile FA4 visits.
FA4_TILE = (128, 128)


class TileCensus(NamedTuple):
    """Visited tiles of a tree mask: ``full`` ones run unmasked, ``partial`` ones with the element mask."""

    full: int
    partial: int

    @property
    def partial_share(self) -> float:
        """Partial tiles / visited tiles (0 for a mask with no visited tile)."""
        visited = self.full + self.partial
        return self.partial / visited if visited else 0.0


def tile_census(subtree_end: torch.Tensor, q_block: int, kv_block: int) -> TileCensus:
    """Full and partial ``q_block x kv_block`` tiles of the tree mask of ``subtree_end`` (a ``[T]``
    integer tensor, each ``subtree_end[k]`` in ``(k, T]``, as a pack holds it)."""
    for name, block in (("q_block", q_block), ("kv_block", kv_block)):
        if isinstance(block, bool) or not isinstance(block, int) or block < 1:
            raise ValueError(f"{name} must be a positive int, got {block!r}")
    if not isinstance(subtree_end, torch.Tensor) or subtree_end.dim() != 1:
        raise TypeError(f"subtree_end must be a 1-D tensor, got {type(subtree_end).__name__}")
    T = subtree_end.numel()
    if T == 0:
        return TileCensus(0, 0)
    n_kv = -(-T // kv_block)
    se = subtree_end.detach().to("cpu", torch.int64)
    if bool(((se <= torch.arange(T)) | (se > T)).any()):
        raise ValueError("subtree_end[k] must lie in (k, T] for every key k, as a pack's does")
    pad = n_kv * kv_block - T
    hi = torch.nn.functional.pad(se, (0, pad), value=0).view(n_kv, kv_block).amax(1)
    lo = torch.nn.functional.pad(se, (0, pad), value=T).view(n_kv, kv_block).amin(1)
    k0 = torch.arange(n_kv) * kv_block
    k1 = (k0 + kv_block).clamp(max=T)
    seen = -(-hi // q_block) - k0 // q_block
    full = (lo // q_block - (-(-(k1 - 1) // q_block))).clamp(min=0) * (k1 - k0 == kv_block)
    full_tiles = int(full.sum())
    return TileCensus(full_tiles, int(seen.sum()) - full_tiles)


def partial_tile_share(pack) -> float:
    """Share of ``pack``'s visited :data:`FA4_TILE` tiles that are partial (:func:`tile_census`).
    Cached on the pack (under ``torch.compile`` it must be cached already:
    :func:`~.flat_tree.require_cached`)."""
    require_cached(pack, "partial_tile_share", "the tile census")
    return pack.cached("partial_tile_share", lambda: tile_census(pack.subtree_end, *FA4_TILE).partial_share)


def tile_indices(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[H, rows, columns]`` bool tiles -> int32 counts ``[1, H, rows]`` and indices ``[1, H, rows,
    columns]``, each row's selected columns first and in order: the layout of a ``BlockMask``'s (and
    FlashAttention-4's) block sparsity."""
    counts = tiles.sum(-1, dtype=torch.int32)
    order = torch.argsort((~tiles).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return counts[None].contiguous(), order[None].contiguous()
