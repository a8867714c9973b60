"""FlexAttention for every Flex backend (tree, sparse, dilated, fa4): compiled on CUDA, eager elsewhere.

Each backend builds its own ``BlockMask`` (which 128 x 128 blocks are empty, full or partial, plus the
pattern's ``mask_mod``) and hands it here with the packed tensors. On CUDA the call goes through a
``torch.compile``'d ``flex_attention`` (a fused kernel); on the CPU the eager implementation runs, which
materializes the scores and has no backward.

Two compiled kernels, each its own function so that each has its own ``torch.compile`` cache (a compiled
function recompiles for every new size until its recompile limit, then falls back to the eager code,
which materializes every score):

- ``"triton"``: FlexAttention's generated Triton kernel, every size compiled on its own;
- ``"flash"``: FlashAttention-4 (``kernel_options={"BACKEND": "FLASH"}``, ``ops/fa4_tree.py``), with
  automatic dynamic sizes: a second size compiles once for every later size.
"""

from __future__ import annotations

import functools

import torch

from .tile_census import tile_indices


def _flex_triton(q, k, v, block_mask, scale, enable_gqa):
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa)


def _flex_flash(q, k, v, block_mask, scale, enable_gqa):
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa,
                          kernel_options={"BACKEND": "FLASH"})


# kernel -> (function, torch.compile dynamic)
FLEX_KERNELS = {"triton": (_flex_triton, False), "flash": (_flex_flash, None)}


@functools.cache
def _compiled(kernel: str):
    fn, dynamic = FLEX_KERNELS[kernel]
    return torch.compile(fn, dynamic=dynamic)


def block_mask_from_tiles(partial, full, *, block_size: int, mask_mod, seq_lengths):
    """A batch-independent FlexAttention ``BlockMask`` from its tiles: ``partial`` and ``full``, disjoint
    ``[H, query tiles, key tiles]`` bools (H = 1: every head alike). Full tiles run without the mask,
    partial ones evaluate ``mask_mod`` per element, the rest are skipped; ``seq_lengths`` is
    ``(queries, keys)``."""
    from torch.nn.attention.flex_attention import BlockMask

    kv_num, kv_idx = tile_indices(partial)
    full_num, full_idx = tile_indices(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block_size,
                                    mask_mod=mask_mod, seq_lengths=seq_lengths)


def flex_attention(q, k, v, block_mask, *, scale=None, kernel: str = "triton"):
    """FlexAttention of ``q [N, Hq, D]`` (or ``[B, N, Hq, D]``) over ``k, v`` with ``Hkv`` heads (grouped
    query attention when ``Hq != Hkv``) under ``block_mask`` (a ``BlockMask``, or a function of no
    arguments that builds it); returns ``q``'s layout. ``kernel`` is ``"triton"`` or ``"flash"`` (CUDA
    only; module docstring). With no token (``N = 0``) the output is empty, as on the other backends,
    and no block mask is built (FlexAttention cannot build or run one)."""
    from torch.nn.attention.flex_attention import BlockMask

    if kernel not in FLEX_KERNELS:
        raise ValueError(f"unknown FlexAttention kernel {kernel!r}; choose one of {tuple(FLEX_KERNELS)}")
    if q.shape[-3] == 0:  # still tied to q, k, v, so that a backward through it runs
        return torch.zeros_like(q) + 0 * (q.sum() + k.sum() + v.sum())
    if not isinstance(block_mask, BlockMask):
        block_mask = block_mask()
    fn = _compiled(kernel) if q.device.type == "cuda" else FLEX_KERNELS[kernel][0]
    batched = q.dim() == 4
    qh, kh, vh = ((x if batched else x[None]).transpose(1, 2) for x in (q, k, v))  # [B, H, N, D]
    out = fn(qh, kh, vh, block_mask, scale, q.shape[-2] != k.shape[-2])
    out = out.transpose(1, 2)
    return out if batched else out[0]
