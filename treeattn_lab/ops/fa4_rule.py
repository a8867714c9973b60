"""FlashAttention-4 called directly on a DFS event's rule: no ``torch.compile`` between the walk and FA4.

A DFS walk calls attention once per event and layer, forward and backward. Each call goes straight to
``flash_attn.cute.flash_attn_func``, so the host pays FA4's own launch work and nothing else (a compiled
wrapper would add its guards over the mask's tensors and its autograd wrappers to every call):

- a **chain** (queries ``[p, p + n)`` of one rollout over its keys ``[0, p + n)``): FA4's causal mask,
  which aligns to the bottom right when there are more keys than queries (query ``i`` sees keys
  ``j <= i + p``); no mask function, no block sparsity;
- a **tree** (a packed span or subtree below the prefix): the interval rule
  ``first[j] <= i < last[j]`` (``engine/block_attention.py``) as a CuTe DSL ``mask_mod`` that reads the two
  int32 vectors as auxiliary tensors, with the rule's 128 x 128 tiles as block sparsity, forward (per query
  tile, the key tiles it visits) and backward (per key tile, the query tiles): empty tiles are never
  visited, full tiles run unmasked, only partial tiles evaluate the rule.

FA4 compiles a kernel per configuration, keyed by the mask function's source; sizes are runtime values.
Both calls are differentiable in ``q, k, v`` (FA4's own autograd function) and are skipped by
``torch.compile`` (a graph break), which would otherwise trace into FA4's host code. Tested on compute
capability 9.0 (Hopper); FA4 picks other tile schemes on newer GPUs.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from .tile_census import tile_indices

__all__ = ["RuleMask", "RuleSparsity", "fa4_causal_attention", "fa4_rule_attention", "rule_sparsity"]


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


class RuleMask(NamedTuple):
    """A tree event's rule as FA4 takes it: ``first``, ``last`` (int32 ``[key tiles x tile]``, padded with
    keys no query sees) and their tiles (:class:`RuleSparsity`)."""

    first: torch.Tensor
    last: torch.Tensor
    sparsity: RuleSparsity


def rule_sparsity(partial: torch.Tensor, full: torch.Tensor, tile: int) -> RuleSparsity:
    """:class:`RuleSparsity` of ``partial`` and ``full``, disjoint ``[query tiles, key tiles]`` bools."""
    for name, tiles in (("partial", partial), ("full", full)):
        if not isinstance(tiles, torch.Tensor) or tiles.dtype != torch.bool or tiles.dim() != 2:
            raise TypeError(f"{name} must be a 2-D bool tensor of tiles, got {_describe(tiles)}")
    if partial.shape != full.shape:
        raise ValueError(f"partial and full tiles differ in shape: {tuple(partial.shape)} and "
                         f"{tuple(full.shape)}")
    fwd = (*tile_indices(partial[None]), *tile_indices(full[None]))
    bwd = (*tile_indices(partial.T[None]), *tile_indices(full.T[None]))
    return RuleSparsity(*fwd, *bwd, tile=tile)


def _describe(x) -> str:
    return f"{x.dtype} of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__


@functools.cache
def _interval_mask_mod():
    """The rule ``first[j] <= i < last[j]`` as a CuTe DSL mask function over auxiliary tensors
    ``(first, last)``, built (and hashed by FA4) once rather than on every call."""
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


def _check_layout(q, k, v) -> None:
    """``q [B, n, Hq, D]`` and ``k, v [B, s, Hkv, D]`` with ``s >= n``: host-side shape checks only."""
    aligned = q.dim() == k.dim() == 4 and k.shape == v.shape
    if not aligned or q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q must be [B, n, Hq, D] and k, v [B, s, Hkv, D] alike, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[1] < q.shape[1]:
        raise ValueError(f"fewer keys ({k.shape[1]}) than queries ({q.shape[1]}): the rule needs s >= n")


def _output(result):
    return result[0] if isinstance(result, tuple) else result  # FA4 returns (out, lse)


@torch.compiler.disable
def fa4_causal_attention(q, k, v, scale=None):
    """FA4 causal attention of ``q [B, n, Hq, D]`` over ``k, v [B, s, Hkv, D]`` (``s >= n``), aligned to
    the bottom right: query ``i`` sees keys ``j <= i + s - n``."""
    _check_layout(q, k, v)
    from flash_attn.cute import flash_attn_func

    return _output(flash_attn_func(q, k, v, softmax_scale=scale, causal=True))


@torch.compiler.disable
def fa4_rule_attention(q, k, v, rule: RuleMask, scale=None):
    """FA4 attention of ``q [1, n, Hq, D]`` over ``k, v [1, s, Hkv, D]`` under ``rule``: query ``i`` sees
    key ``j`` exactly when ``first[j] <= i < last[j]``. ``first`` and ``last`` must cover whole key tiles
    (the kernel reads them for every column of a partial tile), padded with keys no query sees."""
    _check_layout(q, k, v)
    s = rule.sparsity
    if q.shape[0] != 1:
        raise ValueError(f"the rule is one row's: q must have batch 1, got {q.shape[0]}")
    padded = -(-k.shape[1] // s.tile) * s.tile
    for name, x in (("first", rule.first), ("last", rule.last)):
        if x.dtype != torch.int32 or x.shape != (padded,) or x.device != q.device:
            raise ValueError(f"{name} must be int32 [{padded}] (the {k.shape[1]} keys padded to whole "
                             f"{s.tile}-key tiles) on {q.device}, got {_describe(x)} on {x.device}")
    from flash_attn.cute import flash_attn_func
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

    size = (s.tile, s.tile)
    fwd = BlockSparseTensorsTorch(s.partial_count, s.partial_index, s.full_count, s.full_index,
                                  block_size=size)
    bwd = BlockSparseTensorsTorch(s.partial_count_bwd, s.partial_index_bwd, s.full_count_bwd,
                                  s.full_index_bwd, block_size=size)
    return _output(flash_attn_func(q, k, v, softmax_scale=scale, mask_mod=_interval_mask_mod(),
                                   aux_tensors=[rule.first, rule.last], block_sparse_tensors=fwd,
                                   block_sparse_tensors_bwd=bwd))
