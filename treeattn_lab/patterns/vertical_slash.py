"""Vertical-slash attention patterns (MInference, MTraining): a few key columns plus a few diagonals.

The rule
--------
Long-context attention heads put most of their mass on two shapes: **vertical** lines (key columns that
every later query reads, e.g. the first tokens, "sinks", or a salient token) and **slash** lines
(diagonals: key ``k = q - s`` at a fixed distance ``s`` from the query, e.g. the local window ``s < 100``).
A :class:`VerticalSlashPattern` keeps, per head,

- ``vertical [H, nv]``: key columns, and
- ``slash [H, ns]``: diagonal offsets ``s >= 0`` (``s = 0`` is the query itself),

and query ``q`` attends key ``k <= q`` when ``k`` is one of the head's columns or ``q - k`` one of its
offsets. Entries ``-1`` are padding (heads may keep different numbers of lines).

Block rounding: what a kernel computes
--------------------------------------
A diagonal touches every tile it crosses, and a tile is computed whole, so kernels round slashes up to
``block_size x block_size`` tiles (128 on a GPU): a tile (query block ``i``, key block ``j``) is
*selected* when some slash of the head crosses it, and then every causal pair in it is computed. A
slash ``s = a * block_size + b`` crosses the block diagonals ``i - j = a`` and, when ``b > 0``, ``a + 1``.
Vertical columns that fall outside the selected tiles become **bars**: per query block, a short list of
extra key columns gathered into dense chunks. :meth:`VerticalSlashPattern.dense_mask` gives exactly the
pairs the kernel computes (block rounding included); :meth:`VerticalSlashPattern.block_index` gives the
kernel's compact index (:class:`BlockSparseIndex`).

Estimating a pattern (MInference)
---------------------------------
:func:`estimate` scores only the last ``last_q`` queries against all keys: a column's score is its
attention mass summed over those queries (vertical), a diagonal's score the mass summed along it
(slash). It keeps the top ``n_vertical`` columns and ``n_slash`` offsets per head, with the first
``sinks`` columns and the first ``local`` offsets always kept. :func:`estimate_top_p` keeps, per head,
the fewest lines that reach a share ``p`` of the mass (capped). :func:`recall` measures the attention
mass a pattern keeps against full causal attention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from einops import einsum, rearrange

PAD = -1  # padding entry in vertical / slash
BAR_PAD = 2**31 - 1  # padding position in BlockSparseIndex.bar_pos (never <= any query)


# ------------------------------------------------------------------------------------------ the pattern
def _normalized_lines(x, name: str) -> torch.Tensor:
    """A copy of ``x`` as int64 ``[H, n]``, each row sorted ascending and unique, padding ``-1`` last."""
    if not isinstance(x, torch.Tensor):
        x = torch.as_tensor(x)
    if x.dtype.is_floating_point or x.dtype == torch.bool or x.is_complex():
        raise TypeError(f"{name} must hold integer indices, got dtype {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D [heads, lines], got shape {tuple(x.shape)}")
    x = x.to(torch.int64)
    if (x < PAD).any():
        raise ValueError(f"{name} entries must be >= 0 (or -1 for padding), got {int(x.min())}")
    big = torch.iinfo(torch.int64).max
    keyed = torch.where(x == PAD, big, x).sort(dim=1).values
    dup = torch.zeros_like(keyed, dtype=torch.bool)
    dup[:, 1:] = keyed[:, 1:] == keyed[:, :-1]
    keyed = torch.where(dup, big, keyed).sort(dim=1).values  # duplicates become padding, moved last
    out = torch.where(keyed == big, PAD, keyed)
    width = int((out != PAD).sum(1).max()) if out.numel() else 0
    return out[:, :width].contiguous()


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
        vertical = _normalized_lines(self.vertical, "vertical")
        slash = _normalized_lines(self.slash, "slash")
        if vertical.shape[0] != slash.shape[0]:
            raise ValueError(f"vertical has {vertical.shape[0]} heads but slash has {slash.shape[0]}")
        if vertical.device != slash.device:
            raise ValueError(f"vertical is on {vertical.device} but slash on {slash.device}")
        bs = self.block_size
        if isinstance(bs, bool) or not isinstance(bs, int) or bs < 16 or bs & (bs - 1):
            raise ValueError(f"block_size must be a power of two >= 16, got {bs!r}")
        self.vertical, self.slash = vertical, slash

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
        return VerticalSlashPattern(self.vertical.to(device), self.slash.to(device), self.block_size)

    def counts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Lines per head: ``(n_vertical [H], n_slash [H])``."""
        return (self.vertical != PAD).sum(1), (self.slash != PAD).sum(1)

    def num_blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def check_tokens(self, num_tokens: int) -> None:
        """Raise ValueError unless every column and offset lies in ``[0, num_tokens)``."""
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
            raise ValueError(f"num_tokens must be a positive int, got {num_tokens!r}")
        for name, x in (("vertical", self.vertical), ("slash", self.slash)):
            if x.numel() and int(x.max()) >= num_tokens:
                raise ValueError(
                    f"pattern {name} entry {int(x.max())} is out of range for {num_tokens} tokens"
                )

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
        blocks, bars = pair_counts(self, num_tokens)
        return int(blocks.sum() + bars.sum())

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
    diag[rows[valid], a[valid]] = True
    keep_last = valid & (b < last_rows)
    diag_last[rows[keep_last], a[keep_last]] = True
    lower = valid & (b > 0)
    diag[rows[lower], a[lower] + 1] = True
    diag_last[rows[lower], a[lower] + 1] = True
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


# ------------------------------------------------------------------------------------------ kernel index
@dataclass(eq=False)
class BlockSparseIndex:
    """What the block-sparse kernel reads, for local queries against local keys (int32, on the device).

    Local tokens are whole blocks of the global sequence in ascending order: ``q_blocks [nQ]`` and
    ``k_blocks [nK]`` hold their global block ids (``arange`` on one GPU; a rank's blocks under ring
    attention). Per head ``h``:

    - ``row_ptr [H * nQ + 1]`` / ``row_idx``: CSR rows of local key blocks per (head, query block),
      ascending, so a row's diagonal tile (if listed) is its last entry;
    - ``col_ptr [H * nK + 1]`` / ``col_idx``: the transpose (query blocks per key block, diagonal first),
      walked by the backward pass for dK and dV;
    - ``bar_pos [H, nb]``: the head's vertical columns (global positions, ascending, padded with
      ``2**31 - 1``), ``bar_count [H, nQ]``: how many of them query block ``i`` can see (``pos <= `` its
      last query), ``bar_skip [H, nQ, nBg]`` uint8: tiles already selected (global key blocks), whose
      columns the bars must skip. ``bar_pos`` is None when the index has no bar part.
    """

    block_size: int
    num_q: int  # local query tokens
    num_k: int  # local key tokens
    q_blocks: torch.Tensor
    k_blocks: torch.Tensor
    row_ptr: torch.Tensor
    row_idx: torch.Tensor
    col_ptr: torch.Tensor
    col_idx: torch.Tensor
    bar_pos: torch.Tensor | None = None
    bar_count: torch.Tensor | None = None
    bar_skip: torch.Tensor | None = None
    num_heads: int = 0

    @property
    def num_tiles(self) -> int:
        """Selected tiles (over all heads)."""
        return int(self.row_idx.numel())

    @property
    def num_bar_columns(self) -> int:
        """Sum over (head, query block) of the bar columns it gathers (before skipping covered ones)."""
        return 0 if self.bar_count is None else int(self.bar_count.sum())

    def tile_map(self) -> torch.Tensor:
        """``[H, nQ, nK]`` bool: the selected tiles in local block coordinates (for tests and drawings)."""
        nq, nk = self.q_blocks.numel(), self.k_blocks.numel()
        out = torch.zeros(self.num_heads * nq, nk, dtype=torch.bool, device=self.row_idx.device)
        counts = (self.row_ptr[1:] - self.row_ptr[:-1]).long()
        rows = torch.repeat_interleave(torch.arange(self.num_heads * nq, device=out.device), counts)
        out[rows, self.row_idx.long()] = True
        return out.view(self.num_heads, nq, nk)

    def positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Global positions of the local queries ``[num_q]`` and keys ``[num_k]``."""
        bs = self.block_size
        offs = torch.arange(bs, device=self.q_blocks.device)
        q = (self.q_blocks.long()[:, None] * bs + offs).flatten()[: self.num_q]
        k = (self.k_blocks.long()[:, None] * bs + offs).flatten()[: self.num_k]
        return q, k

    def block_mask(self) -> torch.Tensor:
        """``[H, num_q, num_k]`` bool: the pairs of the tile part (causal inside diagonal tiles)."""
        bs = self.block_size
        qpos, kpos = self.positions()
        tiles = self.tile_map().repeat_interleave(bs, 1).repeat_interleave(bs, 2)
        tiles = tiles[:, : self.num_q, : self.num_k]
        return tiles & (kpos[None, :] <= qpos[:, None])[None]

    def bar_mask(self) -> torch.Tensor:
        """``[H, num_q, nb]`` bool: which bar columns each local query reads (the bar part's pairs)."""
        if self.bar_pos is None:
            return torch.zeros(self.num_heads, self.num_q, 0, dtype=torch.bool, device=self.q_blocks.device)
        bs = self.block_size
        qpos, _ = self.positions()
        pos = self.bar_pos.long()  # [H, nb]
        valid = pos != BAR_PAD
        qblock = torch.arange(self.num_q, device=pos.device) // bs
        kblock = torch.where(valid, pos // bs, 0)  # [H, nb]
        skip = self.bar_skip[:, qblock].gather(2, kblock[:, None, :].expand(-1, self.num_q, -1)).bool()
        return valid[:, None, :] & ~skip & (pos[:, None, :] <= qpos[None, :, None])


def _csr(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """CSR of a 2-D bool mask: ``ptr [rows + 1]``, ``idx`` (column ids ascending per row), int32."""
    counts = mask.sum(1)
    ptr = torch.zeros(mask.shape[0] + 1, dtype=torch.int64, device=mask.device)
    ptr[1:] = torch.cumsum(counts, 0)
    idx = mask.nonzero(as_tuple=True)[1]
    return ptr.to(torch.int32), idx.to(torch.int32)


def build_block_index(pattern: VerticalSlashPattern, num_tokens: int, *, q_blocks=None, k_blocks=None,
                      bars: bool = True, block_map=None) -> BlockSparseIndex:
    """See :meth:`VerticalSlashPattern.block_index`."""
    bs = pattern.block_size
    dev = pattern.device
    tiles = pattern.block_map(num_tokens) if block_map is None else block_map.to(dev)
    nbg = tiles.shape[1]
    all_blocks = torch.arange(nbg, device=dev)
    qb = all_blocks if q_blocks is None else torch.as_tensor(q_blocks, device=dev).long()
    kb = all_blocks if k_blocks is None else torch.as_tensor(k_blocks, device=dev).long()
    for name, b in (("q_blocks", qb), ("k_blocks", kb)):
        if b.dim() != 1 or (b.numel() and (int(b.min()) < 0 or int(b.max()) >= nbg)):
            raise ValueError(f"{name} must be a 1-D tensor of block ids in [0, {nbg})")
        if b.numel() > 1 and not bool((b[1:] > b[:-1]).all()):
            raise ValueError(f"{name} must be strictly ascending")

    def tokens(b):  # local tokens: whole blocks, except the global last one may be partial
        if b.numel() == 0:
            return 0
        return b.numel() * bs - (bs * nbg - num_tokens if int(b[-1]) == nbg - 1 else 0)

    H = pattern.num_heads
    rows = tiles[:, qb]  # [H, nQ, nBg]
    local = rows[:, :, kb]  # [H, nQ, nK]
    row_ptr, row_idx = _csr(local.reshape(H * qb.numel(), kb.numel()))
    col_ptr, col_idx = _csr(local.transpose(1, 2).reshape(H * kb.numel(), qb.numel()))
    index = BlockSparseIndex(
        block_size=bs, num_q=tokens(qb), num_k=tokens(kb), q_blocks=qb.to(torch.int32).contiguous(),
        k_blocks=kb.to(torch.int32).contiguous(), row_ptr=row_ptr, row_idx=row_idx, col_ptr=col_ptr,
        col_idx=col_idx, num_heads=H,
    )
    if bars and pattern.vertical.shape[1] > 0:
        pos = torch.where(pattern.vertical == PAD, BAR_PAD, pattern.vertical)  # sorted, padding last
        q_last = (qb * bs + bs).clamp(max=num_tokens) - 1  # last query of each local block
        index.bar_pos = pos.to(torch.int32).contiguous()
        index.bar_count = torch.searchsorted(pos, q_last[None, :].expand(H, -1).contiguous(), right=True
                                             ).to(torch.int32).contiguous()
        index.bar_skip = rows.to(torch.uint8).contiguous()
    return index


# ------------------------------------------------------------------------------------------ estimation
def _last_query_probs(q, k, last_q: int, scale):
    """Causal softmax of the last ``last_q`` queries against all keys: ``[Hq, last_q, N]`` float32."""
    N, hq, d = q.shape
    hkv = k.shape[1]
    last_q = min(last_q, N)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qg = rearrange(q[N - last_q:].float(), "t (hkv g) d -> hkv g t d", hkv=hkv)
    scores = einsum(qg, k.float(), "hkv g t d, s hkv d -> hkv g t s") * scale
    qpos = torch.arange(N - last_q, N, device=q.device)
    causal = torch.arange(N, device=q.device)[None, :] <= qpos[:, None]
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    return rearrange(probs, "hkv g t s -> (hkv g) t s"), qpos


def line_scores(q, k, *, last_q: int = 64, scale=None) -> tuple[torch.Tensor, torch.Tensor]:
    """MInference's line scores from the last ``last_q`` queries: ``(vertical [H, N], slash [H, N])``.

    ``vertical[h, k]`` sums the attention those queries give key ``k``; ``slash[h, s]`` sums it along
    the diagonal ``q - k = s``. Each row adds up to ``min(last_q, N)``.
    """
    probs, qpos = _last_query_probs(q, k, last_q, scale)
    N = k.shape[0]
    vertical = probs.sum(1)
    offsets = (qpos[:, None] - torch.arange(N, device=q.device)[None, :]).clamp(min=0)  # 0 where masked
    slash = torch.zeros_like(vertical)
    slash.scatter_add_(1, offsets.flatten()[None].expand(probs.shape[0], -1), probs.flatten(1))
    return vertical, slash


def _check_estimate_inputs(q, k, last_q, sinks, local, scale):
    from ..ops.validation import check_qkv, check_scale

    check_qkv(q, k, k)
    check_scale(scale)
    for name, value in (("last_q", last_q), ("sinks", sinks), ("local", local)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    if last_q < 1:
        raise ValueError("last_q must be >= 1")


def _forced(scores: torch.Tensor, first: int) -> torch.Tensor:
    out = scores.clone()
    out[:, :first] = float("inf")
    return out


def estimate(q, k, *, last_q: int = 64, n_vertical: int, n_slash: int, sinks: int = 30, local: int = 100,
             block_size: int = 128, scale=None) -> VerticalSlashPattern:
    """Estimate a vertical-slash pattern per head from ``q [N, Hq, D]``, ``k [N, Hkv, D]`` (MInference).

    Keeps per head the ``n_vertical`` columns and ``n_slash`` diagonal offsets with the highest
    :func:`line_scores`, always including the first ``sinks`` columns and the first ``local`` offsets
    (the attention sinks and the local window). Budgets larger than ``N`` are clipped.
    """
    _check_estimate_inputs(q, k, last_q, sinks, local, scale)
    for name, value in (("n_vertical", n_vertical), ("n_slash", n_slash)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    N = q.shape[0]
    vertical, slash = line_scores(q, k, last_q=last_q, scale=scale)
    v_idx = _forced(vertical, sinks).topk(min(n_vertical, N), dim=1).indices
    s_idx = _forced(slash, local).topk(min(n_slash, N), dim=1).indices
    return VerticalSlashPattern(v_idx, s_idx, block_size)


def _top_p_lines(scores: torch.Tensor, first: int, p: float, cap: int) -> torch.Tensor:
    """Per row, the fewest entries whose mass reaches ``p`` of the row total (forced ``first`` entries
    included and counted first), at most ``cap``; padding ``-1``."""
    total = scores.sum(1, keepdim=True).clamp_min(torch.finfo(scores.dtype).tiny)
    order = _forced(scores, first).argsort(dim=1, descending=True)
    mass = scores.gather(1, order) / total
    before = torch.cumsum(mass, 1) - mass  # mass of the entries ranked ahead
    rank = torch.arange(scores.shape[1], device=scores.device)[None, :]
    keep = ((before < p) | (rank < first)) & (rank < cap)
    return torch.where(keep, order, PAD)


def estimate_top_p(q, k, *, p: float = 0.95, max_vertical: int = 4096, max_slash: int = 4096,
                   last_q: int = 64, sinks: int = 30, local: int = 100, block_size: int = 128,
                   scale=None) -> VerticalSlashPattern:
    """Like :func:`estimate`, but each head keeps the fewest columns (and, separately, offsets) that hold a
    share ``p`` of its line scores, capped at ``max_vertical`` / ``max_slash``: focused heads get few
    lines, diffuse heads many."""
    _check_estimate_inputs(q, k, last_q, sinks, local, scale)
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 < p <= 1.0:
        raise ValueError(f"p must lie in (0, 1], got {p!r}")
    for name, value in (("max_vertical", max_vertical), ("max_slash", max_slash)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    vertical, slash = line_scores(q, k, last_q=last_q, scale=scale)
    return VerticalSlashPattern(_top_p_lines(vertical, sinks, p, max_vertical),
                                _top_p_lines(slash, local, p, max_slash), block_size)


def recall(pattern: VerticalSlashPattern, q, k, *, scale=None, rows=None, rounded: bool = True,
           chunk: int = 256) -> torch.Tensor:
    """Per head ``[H]``: the share of full causal attention mass that ``pattern`` computes, averaged over
    query rows (all rows, or the positions ``rows``), block rounding included (``rounded=False``: the
    mass on the lines alone, which judges the estimate rather than the kernel)."""
    from ..ops.validation import check_qkv, check_scale

    check_qkv(q, k, k)
    check_scale(scale)
    N, hq, d = q.shape
    if pattern.num_heads != hq:
        raise ValueError(f"pattern has {pattern.num_heads} heads but q has {hq}")
    pattern = pattern.to(q.device)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    rows = torch.arange(N, device=q.device) if rows is None else torch.as_tensor(rows, device=q.device).long()
    hkv = k.shape[1]
    keys = torch.arange(N, device=q.device)
    kept = torch.zeros(hq, dtype=torch.float64, device=q.device)
    for start in range(0, rows.numel(), chunk):
        r = rows[start:start + chunk]
        qg = rearrange(q[r].float(), "t (hkv g) d -> hkv g t d", hkv=hkv)
        scores = einsum(qg, k.float(), "hkv g t d, s hkv d -> hkv g t s") * scale
        probs = scores.masked_fill(keys[None, :] > r[:, None], float("-inf")).softmax(-1)
        probs = rearrange(probs, "hkv g t s -> (hkv g) t s")
        kept += (probs * pattern.mask_rows(r, N, rounded=rounded)).sum((1, 2)).double()
    return (kept / rows.numel()).float()


# ------------------------------------------------------------------------------------------ synthetic
def synthetic_pattern(num_tokens: int, num_heads: int, *, n_vertical: int = 1000, n_slash: int = 1000,
                      sinks: int = 30, local: int = 100, slash_scale: float = 256.0, far_slash: float = 0.0,
                      block_size: int = 128, seed: int = 0, device=None) -> VerticalSlashPattern:
    """A seeded pattern shaped like estimated ones, for benchmarks and tests (no model needed).

    Per head: the first ``sinks`` columns plus random columns spread uniformly over the sequence; the
    ``local`` nearest diagonals plus offsets drawn without replacement with weights ``exp(-s /
    slash_scale)`` (attention decays with distance, so a top-k of noisy diagonal scores is a band near
    the diagonal with a thinning tail), of which a share ``far_slash`` is drawn uniformly over the whole
    sequence instead (scattered far lines). ``far_slash=1`` is the scattered worst case, where slashes
    cross nearly every tile.
    """
    gen = torch.Generator().manual_seed(seed)
    n_vertical, n_slash = min(n_vertical, num_tokens), min(n_slash, num_tokens)
    positions = torch.arange(num_tokens)

    def pick(n_forced, n_total, log_weight):
        """Per head: the first ``n_forced`` positions plus ``n_total - n_forced`` more, drawn without
        replacement with weights ``exp(log_weight)`` (Gumbel top-k)."""
        n_forced = min(n_forced, n_total)
        rows = []
        for _ in range(num_heads):
            u = torch.rand(num_tokens, generator=gen, dtype=torch.float64).clamp_min(1e-300)
            key = log_weight() - torch.log(-torch.log(u))
            key[:n_forced] = float("inf")
            rows.append(key.topk(n_total).indices)
        return torch.stack(rows) if rows else torch.zeros(0, n_total, dtype=torch.int64)

    columns = pick(sinks, n_vertical, lambda: torch.zeros(num_tokens, dtype=torch.float64))
    n_far = round(far_slash * max(n_slash - local, 0))

    offsets = pick(local, n_slash - n_far, lambda: -positions.double() / slash_scale)
    if n_far:
        far = []
        for h in range(num_heads):
            free = torch.ones(num_tokens, dtype=torch.bool)
            free[offsets[h]] = False
            candidates = positions[free]
            far.append(candidates[torch.randperm(candidates.numel(), generator=gen)[:n_far]])
        offsets = torch.cat([offsets, torch.stack(far)], dim=1)
    pattern = VerticalSlashPattern(columns, offsets, block_size)
    return pattern.to(device) if device is not None else pattern


__all__ = [
    "BlockSparseIndex",
    "VerticalSlashPattern",
    "build_block_index",
    "pair_counts",
    "estimate",
    "estimate_top_p",
    "line_scores",
    "recall",
    "synthetic_pattern",
]
