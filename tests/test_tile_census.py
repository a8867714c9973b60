"""The tile census of a pack's tree mask (``ops/tile_census.py``) against a brute-force count of the dense
mask's tiles, and against the ``BlockMask`` FlexAttention builds for the pack."""

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from tests.conftest import long_rollout_forests, rollout_forests
from treeattn_lab import RolloutTrie
from treeattn_lab.ops import tile_census as census
from treeattn_lab.ops.flex_tree import tree_block_mask

BLOCKS = st.sampled_from([(1, 1), (1, 5), (2, 3), (5, 7), (8, 8), (16, 4), (7, 64), (64, 128), (128, 128)])


def brute_force(subtree_end: torch.Tensor, q_block: int, kv_block: int) -> tuple[int, int]:
    """(full, partial) tiles of the dense mask, padded with invisible pairs up to whole tiles."""
    T = subtree_end.numel()
    mask = torch.zeros(-(-T // q_block) * q_block, -(-T // kv_block) * kv_block, dtype=torch.bool)
    q, k = torch.arange(T)[:, None], torch.arange(T)[None, :]
    mask[:T, :T] = (k <= q) & (q < subtree_end.long()[None, :])
    seen = mask.view(mask.shape[0] // q_block, q_block, -1, kv_block).sum((1, 3))
    whole = q_block * kv_block
    return int((seen == whole).sum()), int(((seen > 0) & (seen < whole)).sum())


@settings(max_examples=60, deadline=None)
@given(seqs=st.one_of(rollout_forests(max_sequences=8, max_len=40), long_rollout_forests()), blocks=BLOCKS)
def test_the_census_counts_what_the_dense_mask_holds(seqs, blocks):
    pack = RolloutTrie.from_sequences(seqs).pack()
    se = pack.subtree_end.clone()
    got = census.tile_census(pack.subtree_end, *blocks)
    assert tuple(got) == brute_force(pack.subtree_end, *blocks)
    assert torch.equal(pack.subtree_end, se)  # not mutated
    visited = got.full + got.partial
    assert visited > 0 and got.partial_share == pytest.approx(got.partial / visited)


def test_the_census_is_the_flex_block_masks():
    seqs = [list(range(300)), list(range(200)) + [7] * 90, list(range(50)) + [5] * 301, [3] * 77, [9, 8],
            [1] * 640]  # T = 1410: the last tile is cut by T
    pack = RolloutTrie.from_sequences(seqs).pack()
    block_mask = tree_block_mask(pack)
    assert block_mask.BLOCK_SIZE == census.FA4_TILE
    got = census.tile_census(pack.subtree_end, *census.FA4_TILE)
    assert got.full == int(block_mask.full_kv_num_blocks.sum()) > 0
    assert got.partial == int(block_mask.kv_num_blocks.sum()) > 0


def test_aligned_long_nodes_are_mostly_full_and_short_ragged_ones_partial():
    aligned = RolloutTrie.from_sequences([[r] * 1024 + [c] * 1024 for r in range(2) for c in range(4)]).pack()
    ragged = RolloutTrie.from_sequences([[r] * (50 + 7 * r) + [c] * (3 + 11 * c)
                                         for r in range(12) for c in range(5)]).pack()
    # 10 nodes of 8 tiles: a node's 8 x 9 / 2 causal tiles, of which the 8 diagonal ones are partial, and
    # each prompt's 8 tiles fully seen from its 4 responses' 32 tiles
    assert census.tile_census(aligned.subtree_end, 128, 128) == (2 * (5 * 28 + 8 * 32), 10 * 8)
    assert census.partial_tile_share(aligned) < 0.1 < 0.9 < census.partial_tile_share(ragged)


def test_the_share_is_cached_on_the_pack(monkeypatch):
    pack = RolloutTrie.from_sequences([[1] * 300, [1] * 100 + [2] * 50]).pack()
    share = census.partial_tile_share(pack)
    monkeypatch.setattr(census, "tile_census", lambda *args: pytest.fail("counted the tiles twice"))
    assert census.partial_tile_share(pack) == share == pack._cache["partial_tile_share"]
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert census.partial_tile_share(pack) == share  # a cached share is read while tracing


def test_edges_and_bad_inputs():
    assert census.tile_census(torch.zeros(0, dtype=torch.int32), 128, 128) == (0, 0)
    assert census.tile_census(torch.tensor([1], dtype=torch.int32), 1, 1) == (1, 0)
    assert census.TileCensus(0, 0).partial_share == 0.0
    se = torch.tensor([2, 2], dtype=torch.int32)
    for bad in (0, -1, 1.5, True, None):
        with pytest.raises(ValueError, match="q_block must be a positive int"):
            census.tile_census(se, bad, 8)
        with pytest.raises(ValueError, match="kv_block must be a positive int"):
            census.tile_census(se, 8, bad)
    with pytest.raises(TypeError, match="subtree_end must be a 1-D tensor"):
        census.tile_census([2, 2], 8, 8)
    with pytest.raises(TypeError, match="subtree_end must be a 1-D tensor"):
        census.tile_census(se[None], 8, 8)
    for bad in ([1, 1], [2, 3], [0, 2]):  # a key outside (k, T]: not a tree rule
        with pytest.raises(ValueError, match=r"subtree_end\[k\] must lie in \(k, T\]"):
            census.tile_census(torch.tensor(bad), 8, 8)
