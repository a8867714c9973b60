"""FlashAttention-4 called directly on a DFS event's rule: no ``torch.compile`` between the walk and FA4.

A DFS walk calls attention once per event and layer, forward and backward: hundreds of calls per step,
each over a few thousand queries. Reached through a compiled ``flex_attention`` (``ops/flex.py``), every
call first pays the compiled function's host work (guards over the ``BlockMask``'s tensors, the autograd
wrappers), which a step of many such calls cannot hide behind the GPU. Here the walk calls
``flash_attn.cute.flash_attn_func`` itself, with what FlexAttention's FLASH backend would hand it:

- a **chain** (queries ``[p, p + n)`` of one rollout over its keys ``[0, p + n)``): FA4's causal mask,
  which aligns to the bottom right when there are more keys than queries (query ``i`` sees keys
  ``j <= i + p``); no mask function, no block sparsity;
- a **tree** (a packed span or subtree below the prefix): the interval rule
  ``first[j] <= i < last[j]`` (``engine/block_attention.py``) as a CuTe DSL ``mask_mod`` that reads the two
  int32 vectors as auxiliary tensors, with the rule's 128 x 128 tiles as block sparsity, forward (per query
  tile, the key tiles it visits) and backward (per key tile, the query tiles): empty tiles are never
  visited, full tiles run unmasked, only partial tiles evaluate the rule.

The mask function is one Python function, so FA4 compiles it once per kernel configuration; sizes are
runtime values. Both calls are differentiable in ``q, k, v`` (FA4's own autograd function) and are
skipped by ``torch.compile`` (a graph break), which would otherwise trace into FA4's host code.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from .flex import tile_indices

__all__ = ["RuleSparsity", "fa4_causal_attention", "fa4_rule_attention", "rule_sparsity"]


class RuleSparsity(NamedTuple):
    """The tiles of a rule in FA4's block-sparse layout (int32, batch and head dims of size 1):
    ``[1, 1, rows]`` counts and ``[1, 1, rows, columns]`` indices, the selected tiles first. Forward rows
    are query tiles and columns key tiles; backward the reverse. ``tile``: the tile edge."""

    partial_count: torch.Tensor
    partial_index: torch.Tensor
    full_count: torch.Tensor
    full_index: torch.Tensor
    partial_count_bwd: torch.Tensor
    partial_index_bwd: torch.Tensor
    full_count_bwd: torch.Tensor
    full_index_bwd: torch.Tensor
    tile: int


def rule_sparsity(partial: torch.Tensor, full: torch.Tensor, tile: int) -> RuleSparsity:
    """:class:`RuleSparsity` of ``partial`` and ``full``, disjoint ``[query tiles, key tiles]`` bools."""
    fwd = (*tile_indices(partial[None]), *tile_indices(full[None]))
    bwd = (*tile_indices(partial.T[None]), *tile_indices(full.T[None]))
    return RuleSparsity(*fwd, *bwd, tile=tile)


@functools.cache
def _interval_mask_mod():
    """The rule ``first[j] <= i < last[j]`` as a CuTe DSL mask function over auxiliary tensors
    ``(first, last)``; built once, so FA4's compile cache (keyed by the function's source) hits."""
    import cutlass
    import cutlass.cute as cute
    from flash_attn.cute import utils

    @cute.jit
    def interval_mask(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors):
        first, last = aux_tensors[0], aux_tensors[1]
        lo = utils.scalar_to_ssa(first[kv_idx[0]], cutlass.Int32)
        hi = utils.scalar_to_ssa(last[kv_idx[0]], cutlass.Int32)
        return (q_idx >= lo) & (q_idx < hi)

    return interval_mask


def _output(result):
    return result[0] if isinstance(result, tuple) else result  # FA4 returns (out, lse)


@torch.compiler.disable
def fa4_causal_attention(q, k, v, scale=None):
    """FA4 causal attention of ``q [B, n, Hq, D]`` over ``k, v [B, s, Hkv, D]`` (``s >= n``), aligned to
    the bottom right: query ``i`` sees keys ``j <= i + s - n``."""
    from flash_attn.cute import flash_attn_func

    return _output(flash_attn_func(q, k, v, softmax_scale=scale, causal=True))


@torch.compiler.disable
def fa4_rule_attention(q, k, v, first, last, sparsity: RuleSparsity, scale=None):
    """FA4 attention of ``q [1, n, Hq, D]`` over ``k, v [1, s, Hkv, D]`` under the rule: query ``i`` sees
    key ``j`` exactly when ``first[j] <= i < last[j]``. ``first``, ``last``: int32 on the device, padded to
    whole key tiles with keys no query sees (the kernel reads them for every column of a partial tile);
    ``sparsity``: the rule's tiles (:func:`rule_sparsity`)."""
    from flash_attn.cute import flash_attn_func
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

    s = sparsity
    size = (s.tile, s.tile)
    fwd = BlockSparseTensorsTorch(s.partial_count, s.partial_index, s.full_count, s.full_index,
                                  block_size=size)
    bwd = BlockSparseTensorsTorch(s.partial_count_bwd, s.partial_index_bwd, s.full_count_bwd,
                                  s.full_index_bwd, block_size=size)
    return _output(flash_attn_func(q, k, v, softmax_scale=scale, mask_mod=_interval_mask_mod(),
                                   aux_tensors=[first, last], block_sparse_tensors=fwd,
                                   block_sparse_tensors_bwd=bwd))
