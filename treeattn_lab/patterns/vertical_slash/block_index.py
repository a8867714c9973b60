"""The block-sparse kernel's index of a vertical-slash pattern: CSR tiles plus bar columns.

:func:`build_block_index` turns a pattern's selected tiles (its block map) and its vertical columns into
the int32 tensors :mod:`kernels.block_sparse` reads, for the local queries and keys of one GPU or of one
ring-attention step: CSR rows of key blocks per (head, query block) for the forward and dQ, their
transpose for dK / dV, and per (head, query block) the bar columns outside the selected tiles.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .lines import PAD

BAR_PAD = 2**31 - 1  # padding position in BlockSparseIndex.bar_pos (never <= any query)


@dataclass(eq=False)
class BlockSparseIndex:
    """What the block-sparse kernel reads, for local queries against local keys (int32, on the device).

    Local tokens are whole blocks of the global sequence in ascending order: ``q_blocks [nQ]`` and
    ``k_blocks [nK]`` hold their global block ids (``arange`` on one GPU; a rank's blocks under ring
    attention). Per head ``h``:

    - ``row_ptr [H * nQ + 1]`` / ``row_idx``: CSR rows of local key blocks per (head, query block),
      ascending, so a row's diagonal tile (if listed) is its last entry. ``row_idx`` has a fixed
      capacity (a bound on the tiles, known without reading the tile map back) and may run past
      ``row_ptr[-1]``: entries from there on are slack (zeros) that no row reads;
    - ``col_ptr [H * nK + 1]`` / ``col_idx``: the transpose (query blocks per key block, diagonal first),
      walked by the backward pass for dK and dV, with slack like ``row_idx``;
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
        """Selected tiles (over all heads; reads ``row_ptr[-1]`` back to the host)."""
        return int(self.row_ptr[-1])

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
        out[rows, self.row_idx[: rows.numel()].long()] = True
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


def _csr(mask: torch.Tensor, per_row: int) -> tuple[torch.Tensor, torch.Tensor]:
    """CSR of a 2-D bool mask with at most ``per_row`` entries per row: ``ptr [rows + 1]`` and ``idx
    [rows * per_row]`` (column ids ascending per row from ``ptr[r]``, zeros after ``ptr[-1]``), int32.

    Each entry goes to ``ptr[r] +`` (its rank in the row), so no step reads the mask back to the host.
    """
    rows, cols = mask.shape
    dev = mask.device
    rank = torch.cumsum(mask, 1, dtype=torch.int64)  # entries up to and including each column
    ptr = torch.zeros(rows + 1, dtype=torch.int64, device=dev)
    ptr[1:] = torch.cumsum(rank[:, -1], 0) if cols else 0
    capacity = rows * per_row
    flat = torch.arange(rows * cols, device=dev).view(rows, cols)
    # unselected entries write to spare slots after the capacity, one each (no two writes collide)
    slot = torch.where(mask, ptr[:-1, None] + rank - 1, capacity + flat)
    idx = torch.zeros(capacity + rows * cols, dtype=torch.int32, device=dev)
    idx.scatter_(0, slot.flatten(), (flat % max(cols, 1)).to(torch.int32).flatten())
    return ptr.to(torch.int32), idx[:capacity]


def _local_blocks(name: str, blocks, nbg: int, num_tokens: int, bs: int, dev) -> tuple[torch.Tensor, int]:
    """``(block ids, local tokens)`` of ``blocks`` (None: all ``nbg`` blocks, known without a check).

    Local tokens are whole blocks, except that the global last one may be partial.
    """
    if blocks is None:
        return torch.arange(nbg, device=dev), num_tokens
    b = torch.as_tensor(blocks, device=dev).long()
    if b.dim() != 1 or (b.numel() and (int(b.min()) < 0 or int(b.max()) >= nbg)):
        raise ValueError(f"{name} must be a 1-D tensor of block ids in [0, {nbg})")
    if b.numel() > 1 and not bool((b[1:] > b[:-1]).all()):
        raise ValueError(f"{name} must be strictly ascending")
    if b.numel() == 0:
        return b, 0
    return b, b.numel() * bs - (bs * nbg - num_tokens if int(b[-1]) == nbg - 1 else 0)


def build_block_index(pattern, num_tokens: int, *, q_blocks=None, k_blocks=None,
                      bars: bool = True, block_map=None) -> BlockSparseIndex:
    """The index of ``pattern`` (a :class:`~.pattern.VerticalSlashPattern`): see its ``block_index``."""
    bs = pattern.block_size
    dev = pattern.device
    tiles = pattern.block_map(num_tokens) if block_map is None else block_map.to(dev)
    nbg = tiles.shape[1]
    qb, num_q = _local_blocks("q_blocks", q_blocks, nbg, num_tokens, bs, dev)
    kb, num_k = _local_blocks("k_blocks", k_blocks, nbg, num_tokens, bs, dev)
    H = pattern.num_heads
    rows = tiles[:, qb]  # [H, nQ, nBg]
    local = rows[:, :, kb]  # [H, nQ, nK]
    nq, nk = qb.numel(), kb.numel()
    # a slash selects at most two block diagonals: at most two tiles per row and per column of the map
    per_line = 2 * pattern.slash.shape[1] if block_map is None else max(nq, nk)
    row_ptr, row_idx = _csr(local.reshape(H * nq, nk), min(per_line, nk))
    col_ptr, col_idx = _csr(local.transpose(1, 2).reshape(H * nk, nq), min(per_line, nq))
    index = BlockSparseIndex(
        block_size=bs, num_q=num_q, num_k=num_k, q_blocks=qb.to(torch.int32).contiguous(),
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
