"""FlexAttention backend for tree attention: the baseline every tree kernel is measured against.

FlexAttention evaluates a ``mask_mod`` on 128 x 128 blocks to build a ``BlockMask`` (which blocks are
empty, full or partial) and then runs a fused kernel that skips empty blocks. Building the block mask
costs about as much as a layer's attention on long packs, so it is built once per (pack, device) and
cached on the pack.
"""

from __future__ import annotations

import functools

import torch
from einops import rearrange

from ..patterns.tree import tree_mask_mod


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def tree_block_mask(pack):
    """The FlexAttention ``BlockMask`` of ``pack`` (cached on the pack)."""
    from torch.nn.attention.flex_attention import create_block_mask

    key = ("flex_block_mask", str(pack.device))
    if key not in pack._cache:
        T = pack.num_tokens
        on_gpu = pack.device.type == "cuda"
        pack._cache[key] = create_block_mask(
            tree_mask_mod(pack.subtree_end),
            B=None,
            H=None,
            Q_LEN=T,
            KV_LEN=T,
            device=pack.device,
            _compile=on_gpu,  # without it, long packs try to allocate T x T on the GPU
        )
    return pack._cache[key]


def flex_tree_attention(q, k, v, pack, *, scale=None):
    from torch.nn.attention.flex_attention import flex_attention

    fn = _compiled_flex() if q.device.type == "cuda" else flex_attention
    qh, kh, vh = (rearrange(x, "t h d -> 1 h t d") for x in (q, k, v))
    out = fn(
        qh,
        kh,
        vh,
        block_mask=tree_block_mask(pack),
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return rearrange(out, "1 h t d -> t h d")
