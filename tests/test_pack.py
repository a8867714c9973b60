"""TreePack: packed layout, per-sequence round trips and the subtree_end visibility rule."""

import itertools

import pytest
import torch
from hypothesis import given

from tests.conftest import distinct_prefixes, generator, orders, rollout_forests, seeds
from treeattn_lab import RolloutTrie, TreePack
from treeattn_lab.patterns import tree_mask_mod, tree_visibility


def build(seqs, order) -> TreePack:
    return RolloutTrie.from_sequences(seqs).pack(order)


def packed_prefixes(pack: TreePack, seqs) -> list[tuple[int, ...]]:
    """The rollout prefix each packed token stands for, read off the sequences through seq_index."""
    prefix: list = [None] * pack.num_tokens
    for i, s in enumerate(seqs):
        for j, t in enumerate(pack.seq_index(i).tolist()):
            p = tuple(s[: j + 1])
            assert prefix[t] in (None, p), "one packed token stands for two different prefixes"
            prefix[t] = p
    assert None not in prefix, "a packed token belongs to no sequence"
    return prefix


# ------------------------------------------------------------------------------------------ layout
@given(rollout_forests(), orders)
def test_sequences_round_trip(seqs, order):
    pack = build(seqs, order)
    assert pack.num_sequences == len(seqs)
    assert pack.seq_lengths.tolist() == [len(s) for s in seqs]
    for i, s in enumerate(seqs):
        idx = pack.seq_index(i)
        assert idx.dtype == torch.int64
        assert pack.input_ids[idx].tolist() == s
        assert torch.equal(pack.position_ids[idx], torch.arange(len(s)))
        assert torch.equal(pack.seq_index(i - len(seqs)), idx)


@given(rollout_forests(), orders)
def test_each_tree_token_stored_once(seqs, order):
    pack = build(seqs, order)
    prefixes = distinct_prefixes(seqs)
    assert pack.num_tokens == len(prefixes)
    got = packed_prefixes(pack, seqs)
    assert set(got) == prefixes and len(set(got)) == pack.num_tokens
    for t, p in enumerate(got):
        assert pack.input_ids[t].item() == p[-1]
        assert pack.position_ids[t].item() == len(p) - 1
    assert pack.input_ids.dtype == pack.position_ids.dtype == torch.int64


@given(rollout_forests(), orders)
def test_visibility_matches_prefix_rule(seqs, order):
    """q sees k exactly when k's prefix is a prefix of q's prefix (k is q or an ancestor token)."""
    pack = build(seqs, order)
    pre = packed_prefixes(pack, seqs)
    T = pack.num_tokens
    truth = torch.tensor([[pre[q][: len(pre[k])] == pre[k] for k in range(T)] for q in range(T)])
    assert pack.subtree_end.dtype == torch.int32
    assert torch.equal(pack.visibility_mask(), truth)
    assert torch.equal(tree_visibility(pack.subtree_end), truth)
    # the FlexAttention mask_mod spells the same rule
    mod = tree_mask_mod(pack.subtree_end)
    q_idx = torch.arange(T)[:, None].expand(T, T)
    k_idx = torch.arange(T)[None, :].expand(T, T)
    assert torch.equal(mod(0, 0, q_idx, k_idx), truth)
    # and every rollout sees, among its own tokens, exactly a causal mask
    for i in range(len(seqs)):
        idx = pack.seq_index(i)
        L = idx.numel()
        assert torch.equal(truth[idx][:, idx], torch.ones(L, L, dtype=torch.bool).tril())


@given(rollout_forests(), orders)
def test_node_ranges(seqs, order):
    trie = RolloutTrie.from_sequences(seqs)
    pack = trie.pack(order)
    n = len(trie.nodes)
    for name in ("node_start", "node_end", "node_subtree_end", "node_parent"):
        assert getattr(pack, name).shape == (n,)
    assert pack.node_parent.tolist() == [node.parent for node in trie.nodes]
    for i, node in enumerate(trie.nodes):
        s, e = int(pack.node_start[i]), int(pack.node_end[i])
        assert e - s == len(node.tokens)
        assert pack.input_ids[s:e].tolist() == node.tokens
        assert (pack.node_id[s:e] == i).all()
        assert pack.node_subtree_end[i] >= e
    assert pack.node_subtree_end[0] == pack.num_tokens
    assert torch.equal(pack.subtree_end.long(), pack.node_subtree_end[pack.node_id])
    assert pack.seq_end_node.tolist() == trie.seq_end_node


def test_known_pack_insertion_and_size():
    seqs = [[1, 2], [1, 3, 4, 5]]
    ins = build(seqs, "insertion")
    assert ins.input_ids.tolist() == [1, 2, 3, 4, 5]
    assert ins.position_ids.tolist() == [0, 1, 1, 2, 3]
    assert ins.subtree_end.tolist() == [5, 2, 5, 5, 5]
    size = build(seqs, "size")
    assert size.input_ids.tolist() == [1, 3, 4, 5, 2]
    assert size.subtree_end.tolist() == [5, 4, 4, 4, 5]


def test_single_chain_is_causal():
    pack = build([[5, 4, 3, 2, 1]], "insertion")
    assert pack.subtree_end.tolist() == [5] * 5
    assert torch.equal(pack.visibility_mask(), torch.ones(5, 5, dtype=torch.bool).tril())


# ------------------------------------------------------------------------------------------ padded
@given(rollout_forests(), orders, seeds)
def test_padded_round_trip(seqs, order, seed):
    pack = build(seqs, order)
    T, B, L = pack.num_tokens, len(seqs), max(len(s) for s in seqs)
    x = torch.randn(T, 3, 2, generator=generator(seed), dtype=torch.float64)
    padded = pack.to_padded(x, fill=-7.0)
    assert padded.shape == (B, L, 3, 2)
    for i, s in enumerate(seqs):
        assert torch.equal(padded[i, : len(s)], x[pack.seq_index(i)])
        assert (padded[i, len(s) :] == -7.0).all()
    assert torch.equal(pack.from_padded(padded), x)
    ids = pack.padded_input_ids(pad_id=99)
    for i, s in enumerate(seqs):
        assert ids[i].tolist() == s + [99] * (L - len(s))
    assert torch.equal(pack.from_padded(ids), pack.input_ids)
    index, valid = pack.padded_index()
    assert valid.sum(1).tolist() == [len(s) for s in seqs]
    # a token shared by several sequences takes the value of the first of them (sequence order)
    y = torch.randn(B, L, generator=generator(seed ^ 1), dtype=torch.float64)
    expected = torch.full((T,), float("nan"), dtype=torch.float64)
    for i in reversed(range(B)):
        expected[pack.seq_index(i)] = y[i, : len(seqs[i])]
    assert torch.equal(pack.from_padded(y), expected)
    # exactly one padded copy of each packed token owns it: the copy in the first sequence through it
    owner = pack.padded_owner()
    assert owner.shape == (B, L) and not (owner & ~valid).any()
    assert sorted(index[owner].tolist()) == list(range(T))
    first = {}
    for i in range(B):
        for t in pack.seq_index(i).tolist():
            first.setdefault(t, i)
    assert all(owner[first[int(index[i, j])], j] for i, j in valid.nonzero().tolist())


@given(rollout_forests(), orders)
def test_to_device_copy(seqs, order):
    pack = build(seqs, order)
    pack.seq_index(0)
    moved = pack.to("cpu")
    assert isinstance(moved, TreePack) and moved.device == torch.device("cpu")
    for name in pack.__dataclass_fields__:
        if name != "_cache":
            assert torch.equal(getattr(moved, name), getattr(pack, name)), name
    assert moved._cache == {}
    for i, s in enumerate(seqs):
        assert moved.input_ids[moved.seq_index(i)].tolist() == s
    meta = pack.to("meta")
    assert meta.device.type == "meta" and meta.input_ids.device.type == "meta"
    assert meta.num_tokens == pack.num_tokens and meta.num_sequences == len(seqs)


def test_cached_builds_once_per_key_and_a_moved_pack_starts_its_own():
    pack = build([[1, 2, 3], [1, 2, 4]], "insertion")
    calls = []

    def builder(tag):
        def build_it():
            calls.append(tag)
            return [tag]
        return build_it

    first = pack.cached(("probe", 1), builder("a"))
    assert first == ["a"] and pack.cached(("probe", 1), builder("b")) is first
    assert pack.cached(("probe", 2), builder("c")) == ["c"]
    assert calls == ["a", "c"], "build() ran again for a cached key, or not for a new one"

    def refuse():
        raise RuntimeError("refused")

    with pytest.raises(RuntimeError, match="refused"):
        pack.cached("failing", refuse)
    assert "failing" not in pack._cache, "a build that raised left an entry behind"

    moved = pack.to("cpu")
    assert moved.cached(("probe", 1), builder("d")) == ["d"], "the moved pack read the original's cache"
    moved.cached(("probe", 3), builder("e"))
    assert ("probe", 3) not in pack._cache and pack.cached(("probe", 1), builder("f")) is first
    assert calls == ["a", "c", "d", "e"]
    assert moved.seq_index(1) is moved.seq_index(1) and moved.seq_index(1) is not pack.seq_index(1)


def test_repr():
    pack = build([[1, 2, 3], [1, 2, 4]], "insertion")
    assert repr(pack) == "TreePack(T=4, sequences=2, nodes=3, device=cpu)"


@given(rollout_forests(), orders)
def test_sequence_positions_are_the_sequences_indices_concatenated(seqs, order):
    pack = build(seqs, order)
    positions, offsets = pack.sequence_positions()
    assert offsets.tolist() == [0] + list(itertools.accumulate(len(s) for s in seqs))
    for i, s in enumerate(seqs):
        assert torch.equal(positions[offsets[i] : offsets[i + 1]], pack.seq_index(i))
        assert pack.input_ids[positions[offsets[i] : offsets[i + 1]]].tolist() == s
    assert pack.sequence_positions()[0] is positions  # built once per pack
