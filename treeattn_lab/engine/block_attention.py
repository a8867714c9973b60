"""The attention of one DFS event: a block's queries over the stored prefix and the block's own keys.

A block of ``n`` packed tokens ``[start, start + n)`` whose first token sits at position ``p`` in its
rollouts runs its queries over ``p + n`` keys: the active path's stored prefix, which every query of the
block sees, then the block's own keys under the pack's tree rule cut to the block. Both parts are one rule
over two int32 vectors of length ``p + n``::

    query i sees key j   <=>   first[j] <= i < last[j]
    first = (0, ..., 0, 0, 1, ..., n - 1)         last = (n, ..., n, ends)
            \\-- p --/ \\---- block -----/                \\-- p --/

with ``ends[j] = min(subtree_end[start + j] - start, n)``: the end of key ``j``'s subtree inside the block
(``n`` everywhere in a chain, where the rule is causal attention aligned to the bottom right).

Two kernels run it, one for a whole walk (:class:`WalkKernel`), decided on its first layer call; each
event builds its mask once and every layer reads it:

- **FlashAttention-4** where it runs (CUDA compute capability >= 9.0 with the ``[hopper]`` extra, fp16 /
  bf16) and the walk's blocks are large enough to pay for it (:data:`FA4_MIN_WALK_WORK`), called directly
  (``ops/fa4_rule.py``): a chain with FA4's causal mask, a tree with the rule as FA4's mask function over
  ``first`` and ``last`` and its :data:`~treeattn_lab.ops.tile_census.FA4_TILE` tiles (:func:`rule_tiles`)
  as block sparsity. Tiles the rule fills (the prefix's, but for the tile that straddles the block's start
  and the last query tile) run unmasked, tiles the block's tree leaves empty are skipped, and only the
  tiles it cuts evaluate it;
- **SDPA** elsewhere: causal aligned to the bottom right for a chain (FlashAttention on CUDA), and for a
  block holding a tree an explicit additive mask. A masked SDPA kernel computes the whole ``n x (p + n)``
  rectangle, the pairs the mask hides included.

The choice is the walk's, not the block's: whether FA4's fixed host cost per call is paid back depends on
whether the step is bound by the host (many small blocks: every microsecond the host spends is the step's)
or by the GPU (large blocks: the host's work hides behind the kernels, and FA4's faster kernels count).
FA4 saves kernel time in proportion to the attention work and costs host time per call, so the walk's
measure is its work per call: the mean over its blocks.
"""

from __future__ import annotations

import torch

from ..ops.fa4_rule import RuleMask, fa4_causal_attention, fa4_rule_attention, rule_sparsity
from ..ops.fa4_tree import fa4_takes, runs_fa4
from ..ops.tile_census import FA4_TILE
from .attention import prefix_tree, suffix_causal

__all__ = ["FA4_MIN_WALK_WORK", "BlockAttention", "WalkKernel", "additive_mask", "block_rule",
           "fa4_min_rectangle", "fa4_walk_rectangle", "rule_mask", "rule_tiles", "span_mask"]

# A walk runs FA4 when its mean block's ``queries x keys x query heads x head dim`` (the work of the
# block's SDPA rectangle) is at least this: below it the step is bound by the host, which FA4's costlier
# calls slow down; above it by the GPU, which its faster kernels speed up. Set from ``bench dfs-kernels``
# (bench/results/dfs-kernels__*), which times a dfs step on each kernel.
FA4_MIN_WALK_WORK = 3 * 2**33


def fa4_min_rectangle(query_heads: int, head_dim: int) -> int:
    """The smallest mean block ``queries x keys`` whose work reaches :data:`FA4_MIN_WALK_WORK` for a model
    with ``query_heads`` heads of ``head_dim`` (where FA4 runs, walks from it on run FA4)."""
    return -(-FA4_MIN_WALK_WORK // (query_heads * head_dim))


def fa4_walk_rectangle(query_heads: int, head_dim: int, device, dtype: torch.dtype) -> int | None:
    """The smallest mean block ``queries x keys`` from which a walk of a model with ``query_heads`` heads
    of ``head_dim`` runs FA4 on ``device`` in ``dtype`` (:meth:`WalkKernel.choose`); None where FA4 does
    not run there (every walk runs SDPA)."""
    if not fa4_takes(torch.device(device), dtype, head_dim):
        return None
    return fa4_min_rectangle(query_heads, head_dim)


def block_rule(subtree_end: torch.Tensor, start: int, end: int, position: int):
    """``(first, last)``, int32 ``[position + n]`` on ``subtree_end``'s device: query ``i`` of the block
    ``[start, end)`` sees key ``j`` of ``[prefix; block]`` exactly when ``first[j] <= i < last[j]``
    (module docstring). Built on the device from host integers: nothing is read back."""
    n = end - start
    ends = (subtree_end[start:end].to(torch.int32) - start).clamp_(max=n)
    first = torch.arange(-position, n, dtype=torch.int32, device=subtree_end.device).clamp_(min=0)
    return first, torch.cat([ends.new_full((position,), n), ends])


def span_mask(subtree_end: torch.Tensor, start: int, end: int, position: int) -> torch.Tensor:
    """The rule as a dense ``[n, position + n]`` bool mask."""
    first, last = block_rule(subtree_end, start, end, position)
    i = torch.arange(end - start, device=first.device, dtype=torch.int32)[:, None]
    return (first[None, :] <= i) & (i < last[None, :])


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``mask`` as the additive bias attention kernels take (0 where seen, -inf elsewhere) in ``dtype``,
    rows aligned to 16 elements: built once per call and shared by every layer as it is (no kernel pads
    or converts a copy per layer, and autograd saves that one tensor for all of them)."""
    n, s = mask.shape
    bias = mask.new_full((n, -(-s // 16) * 16), float("-inf"), dtype=dtype)[:, :s]
    return bias.masked_fill_(mask, 0.0)


def rule_tiles(first: torch.Tensor, last: torch.Tensor, num_queries: int):
    """``(first, last, partial, full)``: the rule's vectors padded to whole :data:`FA4_TILE` key tiles
    with keys no query sees (``first = n``, ``last = 0``), and its ``[query tiles, key tiles]`` bool tiles,
    built from the vectors (no ``n x (p + n)`` mask): query tile ``[a, b)`` meets key ``j`` exactly when
    ``max(first[j], a) < min(last[j], b)``; a met tile is *full* when every key of a whole tile satisfies
    ``first[j] <= a`` and ``b <= last[j]`` (tiles cut by the end of the queries or keys are never full),
    else *partial*."""
    (tile, _), n, s = FA4_TILE, num_queries, first.numel()  # square tiles
    key_tiles = -(-s // tile)
    pad = key_tiles * tile - s
    first = torch.nn.functional.pad(first, (0, pad), value=n)
    last = torch.nn.functional.pad(last, (0, pad), value=0)
    f, l = first.view(1, key_tiles, tile), last.view(1, key_tiles, tile)
    a = torch.arange(0, n, tile, device=first.device, dtype=torch.int32)[:, None, None]
    seen = (torch.maximum(f, a) < torch.minimum(l, (a + tile).clamp(max=n))).any(-1)
    full = ((f <= a) & (a + tile <= l)).all(-1)
    return first, last, seen & ~full, full


def rule_mask(subtree_end: torch.Tensor, start: int, end: int, position: int) -> RuleMask:
    """The rule of the block ``[start, end)`` as FA4 takes it: :func:`block_rule`'s vectors padded, and
    their tiles (:func:`rule_tiles`) in FA4's block-sparse layout."""
    first, last = block_rule(subtree_end, start, end, position)
    first, last, partial, full = rule_tiles(first, last, end - start)
    return RuleMask(first, last, rule_sparsity(partial, full, FA4_TILE[0]))


class WalkKernel:
    """The attention kernel of every event of one walk: ``"fa4"`` or ``"sdpa"`` (module docstring), chosen
    on the first call from the first layer's queries and the mean of ``rectangles``, the walk's blocks'
    ``queries x keys`` (host integers; :func:`~treeattn_lab.engine.dfs.walk_kernel` reads them from the
    blocks before pushes merge)."""

    def __init__(self, rectangles):
        rectangles = list(rectangles)
        self.mean_rectangle = sum(rectangles) // len(rectangles) if rectangles else 0
        self.name: str | None = None

    @staticmethod
    def choose(work: int, fa4_runs: bool) -> str:
        """The rule: ``"fa4"`` where FA4 runs and the mean block's ``work`` is at least
        :data:`FA4_MIN_WALK_WORK`, else ``"sdpa"``."""
        return "fa4" if fa4_runs and work >= FA4_MIN_WALK_WORK else "sdpa"

    def __call__(self, q) -> str:
        if self.name is None:
            self.name = self.choose(self.mean_rectangle * q.shape[-2] * q.shape[-1], runs_fa4(q))
        return self.name


class BlockAttention:
    """What one event's queries attend with in every layer: ``attention(q [1, n, Hq, D], keys, values
    [1, p + n, Hkv, D], scale)`` over ``[prefix; block]``, by the walk's ``kernel``. ``tree``: the block
    holds more than one chain (a chain needs no mask on SDPA)."""

    def __init__(self, subtree_end: torch.Tensor, start: int, end: int, position: int, tree: bool,
                 kernel: WalkKernel):
        self.subtree_end, self.position, self.tree, self.kernel = subtree_end, position, tree, kernel
        self.start, self.end = start, end
        # a tree's mask, built on the first layer's call: a RuleMask on fa4, the additive mask on sdpa; a
        # chain needs none on either
        self.mask = None
        self.built = False

    def __call__(self, q, keys, values, scale=None):
        fa4 = self.kernel(q) == "fa4"
        if not self.built:
            if self.tree and fa4:
                self.mask = rule_mask(self.subtree_end, self.start, self.end, self.position)
            elif self.tree:
                self.mask = additive_mask(span_mask(self.subtree_end, self.start, self.end, self.position),
                                          q.dtype)
            self.built = True
        if fa4:
            if self.mask is None:
                return fa4_causal_attention(q, keys, values, scale)
            return fa4_rule_attention(q, keys, values, self.mask, scale)
        if self.mask is None:
            return suffix_causal(q, keys, values, scale)
        return prefix_tree(q, keys, values, self.mask, scale)
