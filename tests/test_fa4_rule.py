"""FlashAttention-4 called directly on a DFS event's rule (``ops/fa4_rule.py``).

On every machine: the block-sparse layout of the rule's tiles, forward and backward. Where FA4 runs (a
Hopper-class GPU with the ``[hopper]`` extra: ``pytest tests/test_fa4_rule.py``): the output and the
gradients of q, k and v against float32 SDPA under the dense mask, for chains (FA4's causal mask) and
trees (the rule as FA4's mask function) with awkward sizes, grouped-query heads and the caching
allocator's memory poisoned with NaN beforehand.
"""

from __future__ import annotations

import pytest
import torch

from tests.test_dfs_packed import long_forest
from treeattn_lab import RolloutTrie
from treeattn_lab.engine import block_attention
from treeattn_lab.engine import dfs as engine_dfs
from treeattn_lab.engine.attention import prefix_tree
from treeattn_lab.ops import fa4_rule
from treeattn_lab.ops.fa4_tree import fa4_available

FA4_HERE = torch.cuda.is_available() and fa4_available("cuda")
needs_fa4 = pytest.mark.skipif(not FA4_HERE, reason="FlashAttention-4 needs a Hopper-class GPU and the "
                                                    "[hopper] extra")


def test_the_backward_layout_is_the_forward_one_transposed():
    g = torch.Generator().manual_seed(3)
    partial = torch.rand(5, 7, generator=g) < 0.4
    full = (torch.rand(5, 7, generator=g) < 0.4) & ~partial
    s = fa4_rule.rule_sparsity(partial, full, 128)
    assert s.partial_count.shape == (1, 1, 5) and s.partial_index.shape == (1, 1, 5, 7)
    assert s.partial_count_bwd.shape == (1, 1, 7) and s.full_index_bwd.shape == (1, 1, 7, 5)
    assert all(t.dtype == torch.int32 and t.is_contiguous() for t in s[:-1])
    for count, index, tiles in ((s.partial_count, s.partial_index, partial),
                                (s.full_count, s.full_index, full),
                                (s.partial_count_bwd, s.partial_index_bwd, partial.T),
                                (s.full_count_bwd, s.full_index_bwd, full.T)):
        for row in range(tiles.shape[0]):
            c = int(count[0, 0, row])
            assert index[0, 0, row, :c].tolist() == tiles[row].nonzero().flatten().tolist()


def poison_allocator(nbytes: int) -> None:
    """Fill ``nbytes`` of fresh CUDA memory with NaN and free it: the next allocations reuse it."""
    poison = torch.full((nbytes // 4 + 1,), float("nan"), device="cuda")
    del poison


def rel(got, want) -> float:
    return float((got.float() - want).norm() / want.norm())


def event_cases(seed: int):
    pack = RolloutTrie.from_sequences(long_forest(seed)).pack_on("cuda")
    return pack, engine_dfs.walk(pack, 333, push_blocks=engine_dfs.PUSH_BLOCKS)[1]


@needs_fa4
@pytest.mark.parametrize(("seed", "heads", "head_dim"), [(0, (8, 2), 128), (1, (4, 4), 64), (2, (6, 2), 128)])
def test_fa4_direct_matches_fp32_sdpa_forward_and_backward(seed, heads, head_dim):
    torch.manual_seed(seed)
    pack, events = event_cases(seed)
    chains = trees = 0
    for _, b in events:
        n, p = b.end - b.start, b.position
        mask = block_attention.span_mask(pack.subtree_end, b.start, b.end, p)
        q = torch.randn(1, n, heads[0], head_dim, device="cuda")
        k, v = (torch.randn(1, p + n, heads[1], head_dim, device="cuda") for _ in range(2))
        dout = torch.randn(1, n, heads[0], head_dim, device="cuda")
        ref = [t.clone().requires_grad_(True) for t in (q, k, v)]
        want = prefix_tree(*ref, mask)
        want.backward(dout)
        poison_allocator(16 * (q.numel() + 2 * k.numel()) * 4)
        half = [t.bfloat16().requires_grad_(True) for t in (q, k, v)]
        if b.tree:
            first, last = block_attention.block_rule(pack.subtree_end, b.start, b.end, p)
            first, last, partial, full = block_attention.rule_tiles(first, last, n)
            got = fa4_rule.fa4_rule_attention(*half, first, last, fa4_rule.rule_sparsity(partial, full, 128))
            trees += 1
        else:
            got = fa4_rule.fa4_causal_attention(*half)
            chains += 1
        got.backward(dout.bfloat16())
        assert torch.isfinite(got).all() and rel(got, want) < 2e-2
        for h, r in zip(half, ref, strict=True):
            assert torch.isfinite(h.grad).all() and rel(h.grad, r.grad) < 3e-2
    assert chains and trees
