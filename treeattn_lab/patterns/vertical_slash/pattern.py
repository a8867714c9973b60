"""The vertical-slash pattern: per head, a few key columns plus a few diagonals.

The rule
--------
Query ``q`` attends key ``k <= q`` when ``k`` is one of the head's columns (``vertical``) or ``q - k``
one of its diagonal offsets (``slash``; ``s = 0`` is the query itself).

Block rounding: what a kernel computes
--------------------------------------
A diagonal touches every tile it crosses, and a tile is computed whole, so kernels round slashes up to
``block_size x block_size`` tiles (128 on a GPU): a tile (query block ``i``, key block ``j``) is
*selected* when some slash of the head crosses it, and then every causal pair in it is computed. A
slash ``s = a * block_size + b`` crosses the block diagonals ``i - j = a`` and, when ``b > 0``, ``a + 1``.
Vertical columns that fall outside the selected tiles become **bars**: per query block, a short list of
extra key columns gathered into dense chunks. :meth:`VerticalSlashPattern.dense_mask` gives exactly the
pairs the kernel computes (block rounding included); :meth:`VerticalSlashPattern.block_index` gives the
kernel's compact index (:class:`~.block_index.BlockSparseIndex`); :func:`pair_counts` counts both parts
without an ``N x N`` mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...checks import check_int
from .block_index import BlockSparseIndex, build_block_index
from .lines import PAD, normalized_lines


@dataclass(eq=False)
class VerticalSlashPattern:
    """Per-head key columns ``vertical [H, nv]`` and diagonal offsets ``slash [H, ns]`` (``-1`` = padding).

    The inputs are copied and normalized (sorted, unique, padding last); ``block_size`` is the tile side
    kernels round slashes to (a power of two >= 16; 128 on a GPU, small ones make small tests span many
    tiles). Derived tensors (block maps, kernel indices) are cached per token count and device.
    """

    vertical: torch.Tensor
    slash: torch.Tensor
    block_size: int = 128
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self):
        vertical = normalized_lines(self.vertical, "vertical")
        slash = normalized_lines(self.slash, "slash")
        _check_shapes(vertical, slash, self.block_size)
        self.vertical, self.slash = vertical, slash
        self._entries_below = None  # an exclusive bound on every entry, once known on the host

    @classmethod
    def _from_top_k(cls, vertical: torch.Tensor, slash: torch.Tensor, block_size: int, *,
                    num_tokens: int) -> VerticalSlashPattern:
        """The pattern of an estimator's own top-k indices, built on the device without a host read
        (private: user input goes through the validated constructor or :func:`estimate`).

        ``vertical [H, nv]`` and ``slash [H, ns]`` must be integer ``topk`` indices over ``num_tokens``
        scores per row: distinct, in ``[0, num_tokens)``, no padding. Rows are sorted on the device; the
        result equals the validated constructor's, which this path skips (its checks read the entries back
        to the host) and which user input must go through. Only what the host knows is checked here (types,
        shapes, a row no wider than ``num_tokens``); the entries' values are trusted.
        """
        for name, x in (("vertical", vertical), ("slash", slash)):
            if (not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype.is_floating_point
                    or x.dtype == torch.bool or x.is_complex()):
                raise TypeError(f"{name} must be a 2-D integer tensor of top-k indices")
        _check_shapes(vertical, slash, block_size)
        check_int("num_tokens", num_tokens)
        for name, x in (("vertical", vertical), ("slash", slash)):
            if x.shape[1] > num_tokens:
                raise ValueError(f"{name} has {x.shape[1]} entries per head, more than the {num_tokens} "
                                 "distinct indices of num_tokens scores")
        return cls._normalized(vertical.to(torch.int64).sort(dim=1).values.contiguous(),
                               slash.to(torch.int64).sort(dim=1).values.contiguous(), block_size, num_tokens)

    @classmethod
    def _normalized(cls, vertical, slash, block_size: int, entries_below: int) -> VerticalSlashPattern:
        """A pattern of line lists already in normal form, every entry below ``entries_below``."""
        pattern = cls.__new__(cls)
        pattern.vertical, pattern.slash, pattern.block_size = vertical, slash, block_size
        pattern._cache = {}
        pattern._entries_below = entries_below
        return pattern

    # ------------------------------------------------------------------------------------ basics
    @property
    def num_heads(self) -> int:
        return self.vertical.shape[0]

    @property
    def device(self) -> torch.device:
        return self.vertical.device

    def to(self, device) -> VerticalSlashPattern:
        """The same pattern on ``device`` (itself when already there)."""
        if torch.device(device) == self.device:
            return self
        if self._entries_below is not None:  # entries known in range: copy without a host read
            return VerticalSlashPattern._normalized(self.vertical.to(device), self.slash.to(device),
                                                    self.block_size, self._entries_below)
        return VerticalSlashPattern(self.vertical.to(device), self.slash.to(device), self.block_size)

    def counts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Lines per head: ``(n_vertical [H], n_slash [H])``."""
        return (self.vertical != PAD).sum(1), (self.slash != PAD).sum(1)

    def num_blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def check_tokens(self, num_tokens: int) -> None:
        """Raise ValueError unless every column and offset lies in ``[0, num_tokens)``.

        The entries are read back to the host only while no bound known so far settles it; the exact
        bound read then is kept (the lines never change), so later checks cost no host read.
        """
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
            raise ValueError(f"num_tokens must be a positive int, got {num_tokens!r}")
        if self._entries_below is not None and self._entries_below <= num_tokens:
            return
        largest = {name: int(x.max()) for name, x in (("vertical", self.vertical), ("slash", self.slash))
                   if x.numel()}
        self._entries_below = 1 + max(largest.values(), default=-1)
        for name, entry in largest.items():
            if entry >= num_tokens:
                raise ValueError(f"pattern {name} entry {entry} is out of range for {num_tokens} tokens")

    def __repr__(self) -> str:
        nv, ns = self.counts()
        return (f"VerticalSlashPattern(heads={self.num_heads}, vertical per head {nv.tolist()[:8]}, "
                f"slash per head {ns.tolist()[:8]}, block_size={self.block_size})")

    # ------------------------------------------------------------------------------------ masks
    def block_map(self, num_tokens: int) -> torch.Tensor:
        """``[H, nB, nB]`` bool: the tiles some slash of the head crosses (query block, key block).

        Exact at the edges: a slash selects a tile only if one of its pairs ``(q, q - s)`` with
        ``0 <= q - s``, ``q < num_tokens`` lies in it. Cached per token count and device.
        """
        key = ("block_map", num_tokens)
        if key not in self._cache:
            self.check_tokens(num_tokens)
            self._cache[key] = _slash_block_map(self.slash, num_tokens, self.block_size)
        return self._cache[key]

    def vertical_map(self, num_tokens: int) -> torch.Tensor:
        """``[H, N]`` bool: the key columns of each head."""
        self.check_tokens(num_tokens)
        out = torch.zeros(self.num_heads, num_tokens + 1, dtype=torch.bool, device=self.device)
        cols = torch.where(self.vertical == PAD, num_tokens, self.vertical)  # padding -> a spare column
        out.scatter_(1, cols, True)
        return out[:, :num_tokens]

    def mask_rows(self, rows: torch.Tensor, num_tokens: int, *, rounded: bool = True) -> torch.Tensor:
        """``[H, len(rows), N]`` bool: the pairs the kernel computes for the query positions ``rows``
        (``rounded=False``: the lines alone, without block rounding)."""
        rows = torch.as_tensor(rows, device=self.device).to(torch.int64)
        bs = self.block_size
        keys = torch.arange(num_tokens, device=self.device)
        causal = keys[None, :] <= rows[:, None]
        if rounded:
            tiles = self.block_map(num_tokens)[:, rows // bs]  # [H, R, nB]
            near = tiles.repeat_interleave(bs, dim=2)[:, :, :num_tokens]
        else:
            on_slash = torch.zeros(self.num_heads, num_tokens + 1, dtype=torch.bool, device=self.device)
            on_slash.scatter_(1, torch.where(self.slash == PAD, num_tokens, self.slash), True)
            near = on_slash[:, (rows[:, None] - keys[None, :]).clamp(min=0)]
        return causal[None] & (near | self.vertical_map(num_tokens)[:, None, :])

    def dense_mask(self, num_tokens: int) -> torch.Tensor:
        """``[H, N, N]`` bool: exactly the (query, key) pairs the kernel computes, block rounding included."""
        return self.mask_rows(torch.arange(num_tokens, device=self.device), num_tokens)

    def line_mask(self, num_tokens: int) -> torch.Tensor:
        """``[H, N, N]`` bool: the lines themselves, *without* block rounding (for drawings)."""
        self.check_tokens(num_tokens)
        return self.mask_rows(torch.arange(num_tokens, device=self.device), num_tokens, rounded=False)

    def num_pairs(self, num_tokens: int) -> int:
        """Pairs the kernel computes (block rounding included), counted without an ``N x N`` mask."""
        return int(self.pair_total(num_tokens))

    def pair_total(self, num_tokens: int) -> torch.Tensor:
        """:meth:`num_pairs` as a 0-d int64 tensor on the pattern's device (no host read)."""
        blocks, bars = pair_counts(self, num_tokens)
        return blocks.sum() + bars.sum()

    def density(self, num_tokens: int) -> float:
        """Computed pairs over the ``N (N + 1) / 2`` pairs of dense causal attention, over all heads."""
        return self.num_pairs(num_tokens) / (self.num_heads * num_tokens * (num_tokens + 1) / 2)

    # ------------------------------------------------------------------------------------ kernels
    def block_index(self, num_tokens: int, *, q_blocks=None, k_blocks=None, bars: bool = True,
                    block_map=None) -> BlockSparseIndex:
        """The kernel's index for queries in blocks ``q_blocks`` against keys in blocks ``k_blocks``.

        ``q_blocks`` / ``k_blocks`` are the global block ids of the local query / key tokens, ascending
        (default: all blocks, one GPU); ring attention passes a rank's own blocks and, per ring step, the
        blocks of the keys it holds. ``bars=False`` leaves the vertical columns out (ring steps after the
        first). Without explicit blocks the index is cached per token count and device.
        """
        default = q_blocks is None and k_blocks is None and block_map is None
        key = ("block_index", num_tokens, bars)
        if default and key in self._cache:
            return self._cache[key]
        index = build_block_index(self, num_tokens, q_blocks=q_blocks, k_blocks=k_blocks, bars=bars,
                                  block_map=block_map)
        if default:
            self._cache[key] = index
        return index

    def mask_mod(self, num_tokens: int):
        """A FlexAttention ``mask_mod(b, h, q_idx, kv_idx)`` computing :meth:`dense_mask`."""
        bs = self.block_size
        tiles = self.block_map(num_tokens)
        columns = self.vertical_map(num_tokens)

        def vertical_slash_mask(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & (tiles[h, q_idx // bs, kv_idx // bs] | columns[h, kv_idx])

        return vertical_slash_mask


def _check_shapes(vertical: torch.Tensor, slash: torch.Tensor, block_size) -> None:
    """Heads and devices of the two line lists agree; ``block_size`` is a power of two >= 16."""
    if vertical.shape[0] != slash.shape[0]:
        raise ValueError(f"vertical has {vertical.shape[0]} heads but slash has {slash.shape[0]}")
    if vertical.device != slash.device:
        raise ValueError(f"vertical is on {vertical.device} but slash on {slash.device}")
    bs = block_size
    if isinstance(bs, bool) or not isinstance(bs, int) or bs < 16 or bs & (bs - 1):
        raise ValueError(f"block_size must be a power of two >= 16, got {bs!r}")


def _slash_block_map(slash: torch.Tensor, num_tokens: int, bs: int) -> torch.Tensor:
    """``[H, nB, nB]`` tiles crossed by the slashes (see :meth:`VerticalSlashPattern.block_map`).

    A slash ``s = a * bs + b`` crosses, for every query block ``i``, the key block ``i - a`` (rows
    ``i * bs + b ..``: absent only in a last, partial query block shorter than ``b + 1`` rows) and, when
    ``b > 0``, the key block ``i - a - 1`` (its first ``b`` rows). So the map is a union of block
    diagonals, built as a Toeplitz gather.
    """
    H = slash.shape[0]
    nb = -(-num_tokens // bs)
    dev = slash.device
    valid = slash != PAD
    a, b = slash.clamp(min=0) // bs, slash.clamp(min=0) % bs
    last_rows = num_tokens - (nb - 1) * bs  # rows in the last query block
    rows = torch.arange(H, device=dev)[:, None].expand_as(slash)
    diag = torch.zeros(H, nb + 2, dtype=torch.bool, device=dev)  # block diagonal d = i - j selected
    diag_last = torch.zeros(H, nb + 2, dtype=torch.bool, device=dev)  # the same, for the last block
    spare = nb + 1  # a column no gather below reads (diagonals run 0..nb): where dropped lines write
    diag[rows, torch.where(valid, a, spare)] = True
    diag_last[rows, torch.where(valid & (b < last_rows), a, spare)] = True
    lower = torch.where(valid & (b > 0), a + 1, spare)
    diag[rows, lower] = True
    diag_last[rows, lower] = True
    i = torch.arange(nb, device=dev)
    d = i[:, None] - i[None, :]  # [nB, nB]
    causal = d >= 0
    dd = d.clamp(min=0)
    out = diag[:, dd] & causal  # [H, nB, nB]
    out[:, -1] = diag_last[:, dd[-1]] & causal[-1]
    return out


def pair_counts(pattern: VerticalSlashPattern, num_tokens: int, block_map=None):
    """Pairs per selected tile ``[H, nB, nB]`` (int64, 0 where unselected) and bar pairs per (head, query
    block) ``[H, nB]``: the two parts of the kernel's work, without building an ``N x N`` mask."""
    bs = pattern.block_size
    tiles = pattern.block_map(num_tokens) if block_map is None else block_map
    nb = tiles.shape[1]
    dev = tiles.device
    starts = torch.arange(nb, device=dev) * bs
    sizes = (starts + bs).clamp(max=num_tokens) - starts  # tokens per block
    per_tile = sizes[:, None] * sizes[None, :]
    per_tile.diagonal().copy_(sizes * (sizes + 1) // 2)  # causal triangle on the diagonal
    blocks = tiles.to(torch.int64) * per_tile
    # bars: a column v counts, for query block i, the rows q >= v of the block, unless tile (i, v // bs)
    # is selected (then the tile computes it already)
    cols = pattern.vertical
    valid = cols != PAD
    v = cols.clamp(min=0)  # [H, nv]
    q_last = starts + sizes - 1  # [nB]
    rows_seen = (q_last[None, None, :] - torch.maximum(v[..., None], starts[None, None, :]) + 1).clamp(min=0)
    covered = tiles.gather(2, (v // bs)[:, None, :].expand(-1, nb, -1)).transpose(1, 2)  # [H, nv, nB]
    rows_seen = rows_seen * (~covered) * valid[..., None]
    bars = rows_seen.sum(1)  # [H, nB]
    return blocks, bars
