"""FlexAttention backend for tree attention: the baseline every tree kernel is measured against.

FlexAttention evaluates a ``mask_mod`` on 128 x 128 blocks to build a ``BlockMask`` (which blocks are
empty, full or partial) and then runs a fused kernel that skips empty blocks. Building the block mask
costs about as much as a layer's attention on long packs, so it is built once per (pack, device) and
cached on the pack.
"""

from __future__ import annotations

from ..patterns.tree import tree_mask_mod
from .flex import flex_attention


def pack_mask_mod(pack):
    """The FlexAttention ``mask_mod`` of ``pack``'s tree rule (``k <= q < subtree_end[k]``), batch and
    head independent; it reads ``pack.subtree_end`` on the pack's device."""
    return tree_mask_mod(pack.subtree_end)


def tree_block_mask(pack):
    """The FlexAttention ``BlockMask`` of ``pack`` (cached on the pack, one per device), for
    ``flex_attention`` on ``[1, H, T, D]`` layouts."""
    from torch.nn.attention.flex_attention import create_block_mask

    def build():
        T = pack.num_tokens
        return create_block_mask(
            pack_mask_mod(pack),
            B=None,
            H=None,
            Q_LEN=T,
            KV_LEN=T,
            device=pack.device,
            _compile=pack.device.type == "cuda",  # without it, long packs try to allocate T x T on the GPU
        )

    return pack.cached(("flex_block_mask", str(pack.device)), build)


def flex_tree_attention(q, k, v, pack, *, scale=None):
    """FlexAttention of packed ``q, k, v`` under the tree rule of ``pack``."""
    return flex_attention(q, k, v, tree_block_mask(pack), scale=scale)
