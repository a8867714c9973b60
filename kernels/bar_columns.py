"""The bar columns of a block-sparse index, on the host: gathering them and the plan the kernels read.

A :class:`~treeattn_lab.patterns.vertical_slash.BlockSparseIndex` lists, per head, the vertical columns
that lie in no selected tile (``bar_pos``, sorted, padded with ``BAR_PAD``). The kernels of
``block_sparse.py`` read their keys and values from dense per-head buffers (:func:`gather_bars`) and
skip masks wherever a :class:`BarPlan` says a chunk of bars is clean. Both are built once per index and
cached with it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import triton

from ..patterns.vertical_slash import BAR_PAD

_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # index -> {key: plan}, dies with the index


def _cached(index, key, build):
    plans = _PLANS.setdefault(index, {})
    if key not in plans:
        plans[key] = build()
    return plans[key]


@dataclass
class BarPlan:
    """What the kernels read about an index's bar columns besides the index itself (built once).

    ``clean [H, nQ]``: per query block, how many leading bars every query of the block sees and no
    selected tile covers (their chunks run unmasked). Per chunk of ``bar_kv`` bars, ``first [H, nc]``:
    the first query block that sees the chunk; ``clean_from [H, nc]``: from which query block on the
    chunk is clean for every later block; ``seen [H, nc]``: how many query blocks see it. ``pairs`` /
    ``longest``: (query block, chunk) pairs in all / in the longest chunk, which size the dK/dV launch
    (read back to the host only when asked for).
    """

    clean: torch.Tensor
    first: torch.Tensor
    clean_from: torch.Tensor
    seen: torch.Tensor

    @property
    def pairs(self) -> int:
        return int(self.seen.sum())

    @property
    def longest(self) -> int:
        return int(self.seen.max())


def _bar_conflicts(index) -> torch.Tensor:
    """``[H, nQ, nb]`` bool: bar ``b`` of head ``h`` needs a mask in query block ``i`` (after its first
    query, inside a tile the row selected, or padding)."""
    pos = index.bar_pos.long()  # [H, nb]
    q_first = index.q_blocks.long() * index.block_size
    kblock = torch.where(pos == BAR_PAD, 0, pos // index.block_size)
    in_tile = index.bar_skip.gather(2, kblock[:, None, :].expand(-1, q_first.numel(), -1)).bool()
    return in_tile | (pos[:, None, :] > q_first[None, :, None])  # padding (BAR_PAD) is after every query


def bar_plan(index, bar_kv: int) -> BarPlan:
    """The :class:`BarPlan` of ``index`` for dK/dV chunks of ``bar_kv`` bars (cached with the index)."""
    return _cached(index, ("bar_plan", bar_kv), lambda: _build_bar_plan(index, bar_kv))


def _build_bar_plan(index, bar_kv: int) -> BarPlan:
    heads, nb = index.bar_pos.shape
    nqb = index.q_blocks.numel()
    bs = index.block_size
    nchunk = triton.cdiv(nb, bar_kv)
    q_last = index.q_blocks.long() * bs + bs - 1
    if nqb:
        q_last[-1] -= nqb * bs - index.num_q  # the ragged last block
    blocks = torch.arange(nqb, device=q_last.device)
    conflicts = _bar_conflicts(index)  # [H, nQ, nb]
    none = ~conflicts.any(2)
    clean = torch.where(none, nb, conflicts.to(torch.uint8).argmax(2))
    real = index.bar_pos != BAR_PAD  # padding rows are zeroed at the end, no mask needed
    per_chunk = torch.nn.functional.pad(conflicts & real[:, None, :], (0, nchunk * bar_kv - nb))
    per_chunk = per_chunk.view(heads, nqb, nchunk, bar_kv).any(3)  # [H, nQ, nc]
    clean_from = torch.where(per_chunk, blocks[None, :, None], -1).amax(1) + 1
    chunk_min = index.bar_pos[:, ::bar_kv].long()  # [H, nc]: the smallest position of each chunk
    first = torch.searchsorted(q_last, chunk_min.contiguous())
    clean_from = torch.maximum(clean_from, first)
    return BarPlan(clean=clean.to(torch.int32).contiguous(), first=first.to(torch.int32).contiguous(),
                   clean_from=clean_from.to(torch.int32).contiguous(), seen=nqb - first)


def gather_index(index, group: int):
    """Key rows and kv heads ``[Hq, nb]``, ``[Hq, 1]`` of the bar columns (padding reads row 0)."""
    def build():
        cols = torch.where(index.bar_pos == BAR_PAD, 0, index.bar_pos).long()
        kv_head = (torch.arange(index.num_heads, device=cols.device) // group)[:, None]
        return cols, kv_head

    return _cached(index, ("gather", group), build)


def gather_bars(k, v, index):
    """The bar columns' keys and values per query head, ``[Hq, nb, D]`` each (differentiable gather).

    Columns are the global positions ``index.bar_pos``; on one GPU they index ``k`` directly. Padding
    reads row 0 (the kernels mask it).
    """
    if index.bar_pos is None:
        empty = k.new_zeros(index.num_heads, 0, k.shape[-1])
        return empty, empty
    cols, kv_head = gather_index(index, index.num_heads // k.shape[1])
    return k[cols, kv_head], v[cols, kv_head]


def bar_tensors(index, device, bar_kv: int):
    """The bar tensors of a launch, ``(bar_pos, bar_count, clean, bar_skip, first, clean_from)`` (int32
    dummies without bars), and the :class:`BarPlan` (None without bars)."""
    if index.bar_pos is None:
        dummy = torch.zeros(1, dtype=torch.int32, device=device)
        return (dummy,) * 6, None
    plan = bar_plan(index, bar_kv)
    return (index.bar_pos, index.bar_count, plan.clean, index.bar_skip, plan.first, plan.clean_from), plan
