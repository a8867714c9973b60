"""FlashAttention-4 called directly on a DFS event's rule (``ops/fa4_rule.py``).

On every machine: the tiles of a block's rule against its dense mask (what FA4 applies under them, the
padding, the block-sparse layout forward and backward), the dispatch of ``BlockAttention`` on the FA4
path (chains to the causal call, trees to the rule call with one mask per event, the scale passed on;
FA4's calls replaced by SDPA under the mask rebuilt from their arguments), and bad inputs refused. Where
FA4 runs (a Hopper-class GPU with the ``[hopper]`` extra: ``pytest tests/test_fa4_rule.py``): the output
and the gradients of q, k and v against float32 SDPA under the dense mask, for chains (FA4's causal mask)
and trees (the rule as FA4's mask function) with awkward sizes, grouped-query heads, explicit scales and
the caching allocator's memory poisoned with NaN beforehand.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import long_forest
from treeattn_lab import RolloutTrie
from treeattn_lab.engine import block_attention
from treeattn_lab.engine import dfs as engine_dfs
from treeattn_lab.engine.attention import prefix_tree, suffix_causal
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


def dense_tiles(mask: torch.Tensor, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(partial, full)`` ``[query tiles, key tiles]`` of a dense ``[n, s]`` mask: a tile is met when it
    holds a seen pair, full when it is a whole ``tile x tile`` square of seen pairs."""
    n, s = mask.shape
    padded = torch.zeros(-(-n // tile) * tile, -(-s // tile) * tile, dtype=torch.bool)
    padded[:n, :s] = mask
    tiles = padded.view(padded.shape[0] // tile, tile, -1, tile).transpose(1, 2).flatten(2)
    seen, full = tiles.any(-1), tiles.all(-1)
    return seen & ~full, full


def fa4_view(first, last, partial, full, n, s, tile=128) -> torch.Tensor:
    """The ``[n, s]`` mask FA4 applies under block sparsity: full tiles all seen, partial tiles the rule
    ``first[j] <= i < last[j]`` (read from the padded vectors), every other tile skipped."""
    i = torch.arange(partial.shape[0] * tile)[:, None]
    rule = (first[None, :] <= i) & (i < last[None, :])
    spread = lambda tiles: tiles.repeat_interleave(tile, 0).repeat_interleave(tile, 1)  # noqa: E731
    return (spread(full) | (spread(partial) & rule))[:n, :s]


@pytest.mark.parametrize("seed", [0, 1])
def test_the_fa4_tiles_of_a_block_apply_its_dense_mask(seed):
    """Blocks several 128-token tiles long: the tiles FA4 visits (partial: masked, full: unmasked) are
    those of the dense mask, forward and transposed for backward; the padded rule hides the padding; and
    what FA4 applies under those tiles (full tiles whole, partial tiles through the rule) is the dense
    mask exactly."""
    pack = RolloutTrie.from_sequences(long_forest(seed)).pack()
    tree_blocks = longest = partial_tiles = 0
    for _, b in engine_dfs.walk(pack, 333, push_blocks=engine_dfs.PUSH_BLOCKS)[1]:
        n, p = b.end - b.start, b.position
        first, last = block_attention.block_rule(pack.subtree_end, b.start, b.end, p)
        mask = block_attention.span_mask(pack.subtree_end, b.start, b.end, p)
        padded_first, padded_last, partial, full = block_attention.rule_tiles(first, last, n)
        want_partial, want_full = dense_tiles(mask, 128)
        assert torch.equal(partial, want_partial) and torch.equal(full, want_full)
        assert padded_first.numel() % 128 == 0 and padded_first.numel() - (p + n) < 128
        assert torch.equal(padded_first[: p + n], first) and torch.equal(padded_last[: p + n], last)
        assert bool((padded_first[p + n :] >= padded_last[p + n :]).all())  # padded keys: seen by no query
        assert torch.equal(fa4_view(padded_first, padded_last, partial, full, n, p + n), mask)
        sparsity = fa4_rule.rule_sparsity(partial, full, 128)
        for count, index, tiles in ((sparsity.partial_count, sparsity.partial_index, partial),
                                    (sparsity.full_count_bwd, sparsity.full_index_bwd, full.T)):
            assert torch.equal(count[0, 0], tiles.sum(-1, dtype=torch.int32))
            for row, c in enumerate(count[0, 0].tolist()):
                assert index[0, 0, row, :c].tolist() == tiles[row].nonzero().flatten().tolist()
        partial_tiles += int(partial.sum())
        tree_blocks += b.tree
        longest = max(longest, n)
    assert tree_blocks and longest > 2 * 128 and partial_tiles  # blocks of trees, several tiles, cut tiles


def rule_view(rule: fa4_rule.RuleMask, n: int, s: int) -> torch.Tensor:
    """The ``[n, s]`` mask of a :class:`~treeattn_lab.ops.fa4_rule.RuleMask` read back from its
    forward block-sparse layout, as FA4 applies it."""
    sp = rule.sparsity
    rows, cols = sp.partial_index.shape[-2:]
    tiles = [torch.zeros(rows, cols, dtype=torch.bool) for _ in range(2)]
    layouts = ((tiles[0], sp.partial_count, sp.partial_index), (tiles[1], sp.full_count, sp.full_index))
    for grid, count, index in layouts:
        for row in range(rows):
            grid[row, index[0, 0, row, : int(count[0, 0, row])].long()] = True
    return fa4_view(rule.first, rule.last, tiles[0], tiles[1], n, s, sp.tile)


@pytest.mark.parametrize("scale", [None, 0.3])
def test_the_fa4_path_routes_chains_and_trees_and_passes_the_scale(monkeypatch, scale):
    """With FA4 forced on (its calls replaced by SDPA under the mask rebuilt from what they are given):
    chains reach the causal call, trees the rule call with their mask built once per event, and every
    layer's output and gradients equal the SDPA path's, the scale included."""
    calls = []

    def causal(q, k, v, scale=None):
        calls.append("chain")
        return suffix_causal(q, k, v, scale)

    def rule_call(q, k, v, rule, scale=None):
        calls.append(("tree", id(rule)))
        return prefix_tree(q, k, v, rule_view(rule, q.shape[1], k.shape[1]), scale)

    monkeypatch.setattr(block_attention, "fa4_causal_attention", causal)
    monkeypatch.setattr(block_attention, "fa4_rule_attention", rule_call)
    monkeypatch.setattr(block_attention, "runs_fa4", lambda q: True)
    g = torch.Generator().manual_seed(11)
    pack = RolloutTrie.from_sequences(long_forest(1)).pack()
    fa4, sdpa = block_attention.WalkKernel([2**40]), block_attention.WalkKernel([0])
    kinds = set()
    for _, b in engine_dfs.walk(pack, 333, push_blocks=engine_dfs.PUSH_BLOCKS)[1]:
        n, p = b.end - b.start, b.position
        q = torch.randn(1, n, 4, 16, generator=g, dtype=torch.float64, requires_grad=True)
        k, v = (torch.randn(1, p + n, 2, 16, generator=g, dtype=torch.float64, requires_grad=True)
                for _ in range(2))
        on_fa4 = block_attention.BlockAttention(pack.subtree_end, b.start, b.end, p, b.tree, fa4)
        on_sdpa = block_attention.BlockAttention(pack.subtree_end, b.start, b.end, p, b.tree, sdpa)
        before = len(calls)
        for _layer in range(2):
            got, want = on_fa4(q, k, v, scale), on_sdpa(q, k, v, scale)
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
            grads = torch.autograd.grad(got.square().sum(), (q, k, v))
            for a, e in zip(grads, torch.autograd.grad(want.square().sum(), (q, k, v)), strict=True):
                torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-12)
        event_calls = calls[before:]
        assert len(event_calls) == 2 and event_calls[0] == event_calls[1]  # one mask for every layer
        assert (event_calls[0] != "chain") == b.tree
        kinds.add(b.tree)
    assert kinds == {False, True}
    assert fa4.name == "fa4" and sdpa.name == "sdpa"


def test_bad_inputs_are_refused_before_fa4_runs():
    tiles = torch.zeros(2, 3, dtype=torch.bool)
    with pytest.raises(TypeError, match="partial must be a 2-D bool tensor"):
        fa4_rule.rule_sparsity(tiles.int(), tiles, 128)
    with pytest.raises(ValueError, match="differ in shape"):
        fa4_rule.rule_sparsity(tiles, tiles[:1], 128)
    rule = fa4_rule.RuleMask(torch.zeros(384, dtype=torch.int32), torch.zeros(384, dtype=torch.int32),
                             fa4_rule.rule_sparsity(tiles, tiles, 128))
    q, k = torch.zeros(1, 200, 4, 16), torch.zeros(1, 300, 2, 16)
    with pytest.raises(ValueError, match=r"fewer keys \(200\) than queries \(300\)"):
        fa4_rule.fa4_causal_attention(k, q[:, :200], q[:, :200])
    with pytest.raises(ValueError, match="q must be"):
        fa4_rule.fa4_rule_attention(q[0], k, k, rule)
    with pytest.raises(ValueError, match="batch 1"):
        two = k.expand(2, -1, -1, -1)
        fa4_rule.fa4_rule_attention(q.expand(2, -1, -1, -1), two, two, rule)
    short = rule._replace(first=rule.first[:300])
    with pytest.raises(ValueError, match=r"first must be int32 \[384\] \(the 300 keys padded"):
        fa4_rule.fa4_rule_attention(q, k, k, short)
    with pytest.raises(ValueError, match="last must be int32"):
        fa4_rule.fa4_rule_attention(q, k, k, rule._replace(last=rule.last.long()))


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
@pytest.mark.parametrize(("seed", "heads", "head_dim", "scale"),
                         [(0, (8, 2), 128, None), (1, (4, 4), 64, 0.2), (2, (6, 2), 128, 0.05)])
def test_fa4_direct_matches_fp32_sdpa_forward_and_backward(seed, heads, head_dim, scale):
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
        want = prefix_tree(*ref, mask, scale)
        want.backward(dout)
        poison_allocator(16 * (q.numel() + 2 * k.numel()) * 4)
        half = [t.bfloat16().requires_grad_(True) for t in (q, k, v)]
        if b.tree:
            rule = block_attention.rule_mask(pack.subtree_end, b.start, b.end, p)
            got = fa4_rule.fa4_rule_attention(*half, rule, scale)
            trees += 1
        else:
            got = fa4_rule.fa4_causal_attention(*half, scale)
            chains += 1
        got.backward(dout.bfloat16())
        assert torch.isfinite(got).all() and rel(got, want) < 2e-2
        for h, r in zip(half, ref, strict=True):
            assert torch.isfinite(h.grad).all() and rel(h.grad, r.grad) < 3e-2
    assert chains and trees
