"""FlexAttention for every Flex backend (tree, sparse, dilated): compiled once on CUDA, eager elsewhere.

Each backend builds its own ``BlockMask`` (which 128 x 128 blocks are empty, full or partial, plus the
pattern's ``mask_mod``) and hands it here with the packed tensors. On CUDA the call goes through one
``torch.compile``'d ``flex_attention`` (a fused kernel); on the CPU the eager implementation runs, which
materializes the scores and has no backward.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def _compiled_flex(dynamic: bool | None):
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=dynamic)


def flex_attention(q, k, v, block_mask, *, scale=None, kernel_options=None, dynamic: bool | None = False):
    """FlexAttention of ``q [N, Hq, D]`` (or ``[B, N, Hq, D]``) over ``k, v`` with ``Hkv`` heads (grouped
    query attention when ``Hq != Hkv``) under ``block_mask`` (a ``BlockMask``, or a function of no
    arguments that builds it); returns ``q``'s layout. With no token (``N = 0``) the output is empty, as
    on the other backends, and no block mask is built (FlexAttention cannot build or run one).

    ``kernel_options`` go to the compiled kernel (``{"BACKEND": "FLASH"}`` runs FlashAttention-4);
    ``dynamic`` is ``torch.compile``'s: ``False`` compiles every size on its own, ``None`` marks sizes
    dynamic once a second size comes."""
    from torch.nn.attention.flex_attention import BlockMask
    from torch.nn.attention.flex_attention import flex_attention as eager_flex

    if q.shape[-3] == 0:  # still tied to q, k, v, so that a backward through it runs
        return torch.zeros_like(q) + 0 * (q.sum() + k.sum() + v.sum())
    if not isinstance(block_mask, BlockMask):
        block_mask = block_mask()
    fn = _compiled_flex(dynamic) if q.device.type == "cuda" else eager_flex
    batched = q.dim() == 4
    qh, kh, vh = ((x if batched else x[None]).transpose(1, 2) for x in (q, k, v))  # [B, H, N, D]
    options = {} if kernel_options is None else {"kernel_options": kernel_options}
    out = fn(qh, kh, vh, block_mask=block_mask, scale=scale, enable_gqa=q.shape[-2] != k.shape[-2], **options)
    out = out.transpose(1, 2)
    return out if batched else out[0]
