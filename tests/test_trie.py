"""RolloutTrie: exact read-back, radix compression, statistics, serialization, graphs and orders."""

import copy
import errno
import json
import os
import pickle
import tempfile

import networkx as nx
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.conftest import distinct_prefixes, orders, rollout_forests, rollout_inputs
from treeattn_lab import RolloutTrie, TreePack
from treeattn_lab.trie import ROOT


def node_prefix(trie: RolloutTrie, node: int) -> tuple[int, ...]:
    return tuple(t for n in trie.path(node) for t in trie.nodes[n].tokens)


def assert_packs_equal(a: TreePack, b: TreePack) -> None:
    for name in a.__dataclass_fields__:
        if name != "_cache":
            assert torch.equal(getattr(a, name), getattr(b, name)), name


# ------------------------------------------------------------------------------------------ read back
@given(rollout_forests())
def test_sequences_read_back_exactly(seqs):
    trie = RolloutTrie.from_sequences(seqs)
    assert trie.num_sequences == len(seqs)
    assert trie.sequences() == seqs
    for i, s in enumerate(seqs):
        assert trie.sequence(i) == s
        assert trie.seq_lengths[i] == len(s)
        assert node_prefix(trie, trie.seq_end_node[i]) == tuple(s)


@given(rollout_inputs())
def test_tensor_and_tuple_inputs_read_back(forest_inputs):
    seqs, inputs = forest_inputs
    trie = RolloutTrie.from_sequences(inputs)
    assert trie.sequences() == seqs
    assert trie == RolloutTrie.from_sequences(seqs)


def test_two_dim_tensor_of_sequences():
    x = torch.tensor([[1, 2, 3], [1, 2, 4], [1, 2, 3]])
    trie = RolloutTrie.from_sequences(x)
    assert trie.sequences() == [[1, 2, 3], [1, 2, 4], [1, 2, 3]]


def test_small_known_trie():
    seqs = [[1, 2, 3, 4], [1, 2, 3, 5], [1, 9], [1, 2], [1, 2, 3, 4]]
    trie = RolloutTrie.from_sequences(seqs)
    runs = sorted(tuple(n.tokens) for n in trie.nodes[1:])
    assert runs == [(1,), (2,), (3,), (4,), (5,), (9,)]
    # the two identical rollouts end at the same node
    assert trie.seq_end_node[0] == trie.seq_end_node[4]
    assert trie.nodes[trie.seq_end_node[0]].ends == [0, 4]
    assert trie.stats()["tree_tokens"] == 6
    assert trie.stats()["flat_tokens"] == 4 + 4 + 2 + 2 + 4


# ------------------------------------------------------------------------------------------ structure
@given(rollout_forests())
def test_radix_structure(seqs):
    trie = RolloutTrie.from_sequences(seqs)
    nodes = trie.nodes
    assert nodes[ROOT].tokens == [] and nodes[ROOT].parent == -1 and nodes[ROOT].depth == 0
    ends = []
    for i, n in enumerate(nodes):
        first = [nodes[c].tokens[0] for c in n.children]
        assert len(set(first)) == len(first), "two children start with the same token"
        for c in n.children:
            assert nodes[c].parent == i
            assert nodes[c].depth == n.end_depth
        ends.extend(n.ends)
        assert n.ends == sorted(n.ends)
        if i == ROOT:
            assert not n.ends
            continue
        assert len(n.tokens) >= 1
        # radix compression: a single child is only allowed where some rollout ends
        if len(n.children) == 1:
            assert n.ends, f"node {i} has one child and no rollout ending on it"
        if not n.children:
            assert n.ends, f"leaf {i} ends no rollout"
    assert sorted(ends) == list(range(len(seqs)))
    for i, node in enumerate(trie.seq_end_node):
        assert i in nodes[node].ends


@given(rollout_forests())
def test_node_count_is_minimal(seqs):
    """Nodes sit exactly at rollout ends and at forks: count them from the prefixes alone."""
    trie = RolloutTrie.from_sequences(seqs)
    prefixes = distinct_prefixes(seqs)
    ext = {}
    for p in prefixes:
        ext.setdefault(p[:-1], set()).add(p[-1])
    full = {tuple(s) for s in seqs}
    expected = {p for p in prefixes if p in full or len(ext.get(p, ())) >= 2}
    assert trie.num_nodes == len(expected)
    assert {node_prefix(trie, n) for n in range(1, len(trie.nodes))} == expected


@given(rollout_forests())
def test_node_ids_are_topological(seqs):
    """Parents come before children (what to_dict / from_dict rely on)."""
    trie = RolloutTrie.from_sequences(seqs)
    for i, n in enumerate(trie.nodes[1:], start=1):
        assert 0 <= n.parent < i


# ------------------------------------------------------------------------------------------ stats
@given(rollout_forests())
def test_stats_match_independent_counts(seqs):
    trie = RolloutTrie.from_sequences(seqs)
    s = trie.stats()
    prefixes = distinct_prefixes(seqs)
    flat_pairs = sum(len(x) * (len(x) + 1) // 2 for x in seqs)
    tree_pairs = sum(len(p) for p in prefixes)
    assert s["num_sequences"] == len(seqs)
    assert s["flat_tokens"] == sum(len(x) for x in seqs)
    assert s["tree_tokens"] == len(prefixes)
    assert s["token_ratio"] == pytest.approx(s["flat_tokens"] / len(prefixes))
    assert s["flat_attention_pairs"] == flat_pairs
    assert s["tree_attention_pairs"] == tree_pairs
    assert s["ideal_attention_ratio"] == pytest.approx(flat_pairs / tree_pairs)
    assert s["ideal_attention_ratio"] >= 1.0
    assert s["max_sequence_length"] == max(len(x) for x in seqs)
    assert s["mean_sequence_length"] == pytest.approx(sum(len(x) for x in seqs) / len(seqs))
    assert s["num_nodes"] == trie.num_nodes == len(trie.nodes) - 1
    assert s["num_leaves"] == len(trie.leaves())
    assert s["root_branching"] == len({x[0] for x in seqs})
    assert s["num_leaves"] <= len({tuple(x) for x in seqs})
    assert s["mean_node_tokens"] == pytest.approx(len(prefixes) / trie.num_nodes)
    pack = trie.pack()
    assert pack.attended_pairs() == tree_pairs
    assert pack.flat_attended_pairs() == flat_pairs


@given(rollout_forests())
def test_subtree_tokens(seqs):
    trie = RolloutTrie.from_sequences(seqs)
    prefixes = distinct_prefixes(seqs)
    sizes = trie.subtree_tokens()
    assert sizes[ROOT] == len(prefixes)
    for n in range(1, len(trie.nodes)):
        head = node_prefix(trie, n)[: trie.nodes[n].depth + 1]
        assert sizes[n] == sum(1 for p in prefixes if p[: len(head)] == head)


# ------------------------------------------------------------------------------------------ orders
@given(rollout_forests(), orders)
def test_preorder_is_a_dfs_preorder(seqs, order):
    trie = RolloutTrie.from_sequences(seqs)
    pre = trie.preorder(order)
    assert pre[0] == ROOT
    assert sorted(pre) == list(range(len(trie.nodes)))
    where = {n: i for i, n in enumerate(pre)}
    # every subtree is one contiguous run starting at its root
    descendants = {n: {n} for n in range(len(trie.nodes))}
    for n in reversed(pre):
        p = trie.nodes[n].parent
        if p >= 0:
            assert where[p] < where[n]
            descendants[p] |= descendants[n]
    for n, desc in descendants.items():
        span = sorted(where[d] for d in desc)
        assert span == list(range(where[n], where[n] + len(desc)))


@given(rollout_forests())
def test_preorder_size_visits_heaviest_child_first(seqs):
    trie = RolloutTrie.from_sequences(seqs)
    prefixes = distinct_prefixes(seqs)

    def size(n):  # tokens in n's subtree, counted from the prefixes alone
        head = node_prefix(trie, n)[: trie.nodes[n].depth + 1]
        return sum(1 for p in prefixes if p[: len(head)] == head)

    pre = trie.preorder("size")
    where = {n: i for i, n in enumerate(pre)}
    for n in trie.nodes:
        visited = sorted(n.children, key=where.__getitem__)
        sizes = [size(c) for c in visited]
        assert sizes == sorted(sizes, reverse=True)
    pre_ins = trie.preorder("insertion")
    where_ins = {n: i for i, n in enumerate(pre_ins)}
    for n in trie.nodes:
        assert sorted(n.children, key=where_ins.__getitem__) == n.children


def test_preorder_size_example():
    trie = RolloutTrie.from_sequences([[1, 2], [1, 3, 4, 5, 6], [1, 7, 8]])
    pre = trie.preorder("size")
    firsts = [trie.nodes[n].tokens[0] for n in pre[1:]]
    assert firsts == [1, 3, 7, 2]
    assert [trie.nodes[n].tokens[0] for n in trie.preorder("insertion")[1:]] == [1, 2, 3, 7]


def test_preorder_bad_order():
    trie = RolloutTrie.from_sequences([[1, 2]])
    with pytest.raises(ValueError, match="order"):
        trie.preorder("random")
    with pytest.raises(ValueError, match="order"):
        trie.pack(order="bfs")


# ------------------------------------------------------------------------------------------ save / load
@given(rollout_forests())
def test_save_load_round_trip(seqs):
    trie = RolloutTrie.from_sequences(seqs)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trie.json")
        trie.save(path)
        loaded = RolloutTrie.load(path)
        with open(path) as f:
            text = f.read()
    assert loaded == trie
    assert loaded.to_dict() == trie.to_dict()
    assert loaded.sequences() == seqs
    assert loaded.seq_end_node == trie.seq_end_node
    assert loaded.seq_lengths == trie.seq_lengths
    assert loaded.stats() == trie.stats()
    for a, b in zip(loaded.nodes, trie.nodes, strict=True):
        assert (a.tokens, a.parent, a.depth, a.children, a.ends) == (
            b.tokens,
            b.parent,
            b.depth,
            b.children,
            b.ends,
        )
    for order in ("insertion", "size"):
        assert_packs_equal(loaded.pack(order), trie.pack(order))
    assert RolloutTrie.from_dict(json.loads(text)) == trie


def test_save_load_after_splits_above_old_nodes():
    # the third rollout splits a node whose old children then hang under a newer node
    seqs = [[1, 2, 3, 4], [1, 2, 3, 5], [1, 9]]
    trie = RolloutTrie.from_sequences(seqs)
    loaded = RolloutTrie.from_dict(json.loads(json.dumps(trie.to_dict())))
    assert loaded == trie and loaded.sequences() == seqs


def test_a_failed_save_keeps_the_old_file_and_leaves_no_temp_file(tmp_path, monkeypatch):
    path = tmp_path / "rollouts.json"
    old = RolloutTrie.from_sequences([[1, 2, 3], [1, 2, 4]])
    old.save(path)
    before = path.read_bytes()

    def dump_then_fail(obj, f, **kwargs):  # a disk that fills up halfway through the write
        f.write(json.dumps(obj, **kwargs)[:10])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(json, "dump", dump_then_fail)
    with pytest.raises(OSError, match="No space left"):
        RolloutTrie.from_sequences([[5, 6], [5, 7, 8]]).save(path)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["rollouts.json"]
    assert RolloutTrie.load(path) == old
    new = RolloutTrie.from_sequences([[5, 6], [5, 7, 8]])
    new.save(str(path))  # a str path replaces the old file whole
    assert RolloutTrie.load(path) == new
    assert [p.name for p in tmp_path.iterdir()] == ["rollouts.json"]


def saved(**changes) -> dict:
    """The saved form of the trie [[1, 2], [1, 3]] (nodes: root, [1], [2], [3]) with ``changes``."""
    data = RolloutTrie.from_sequences([[1, 2], [1, 3]]).to_dict()
    for where, value in changes.items():
        if where == "seq_end_node":
            data["seq_end_node"] = value
        else:  # "node2_tokens", "node3_parent", ...
            node, key = where.removeprefix("node").split("_")
            data["nodes"][int(node)][key] = value
    return data


@pytest.mark.parametrize(
    ("changes", "error", "match"),
    [
        ({"node2_tokens": [1.9]}, TypeError, "node 2 holds 1.9 of type float; token ids must be integers"),
        ({"node2_tokens": [-5]}, ValueError, r"node 2 holds the token id -5; ids must lie in \[0, 2\*\*63\)"),
        (
            {"node2_tokens": [2**70]},
            ValueError,
            r"node 2 holds the token id 1180591620717411303424; ids must",
        ),
        ({"node2_tokens": [True]}, TypeError, "node 2 holds True of type bool; token ids must be integers"),
        ({"node2_tokens": ["7"]}, TypeError, "node 2 holds '7' of type str; token ids must be integers"),
        ({"node2_tokens": "27"}, TypeError, "node 2 is a str; expected a list of ints"),
        (
            {"node3_tokens": [2]},
            ValueError,
            "nodes 2 and 3 are children of node 1 that both start with token 2",
        ),
        ({"seq_end_node": [2]}, ValueError, "node 3 is a leaf that no rollout ends at"),
        ({"seq_end_node": []}, ValueError, "no sequences given: a trie needs at least one rollout"),
        ({"seq_end_node": 2}, TypeError, "seq_end_node must be a list of node ids"),
        (
            {"seq_end_node": [2, 3.0]},
            TypeError,
            "sequence 1 ends at 3.0 of type float; node ids must be integers",
        ),
        ({"seq_end_node": [True, 3]}, TypeError, "sequence 0 ends at True of type bool"),
        ({"node3_parent": "1"}, TypeError, "node 3 names parent '1' of type str; node ids must be integers"),
        ({"node3_parent": 1.0}, TypeError, "node 3 names parent 1.0 of type float"),
    ],
)
def test_load_checks_what_construction_checks(tmp_path, changes, error, match):
    data = saved(**changes)
    snapshot = copy.deepcopy(data)
    with pytest.raises(error, match=match):
        RolloutTrie.from_dict(data)
    assert data == snapshot  # nothing was touched on the way to the error
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(error, match=match):
        RolloutTrie.load(path)


@pytest.mark.parametrize("bad", [1.9, -5, True, "7", 2**70])
def test_load_names_a_bad_token_as_construction_does(bad):
    with pytest.raises((TypeError, ValueError)) as built:
        RolloutTrie.from_sequences([[1, 2], [1, bad]])
    with pytest.raises(built.type) as loaded:
        RolloutTrie.from_dict(saved(node3_tokens=[bad]))
    assert str(loaded.value) == str(built.value).replace("sequence 1", "node 3", 1)


def test_load_refuses_a_trie_that_construction_never_builds():
    # a chain [1] -> [2] that no rollout ends inside is one radix node [1, 2]
    data = {
        **saved(),
        "nodes": [{"parent": -1, "tokens": []}, {"parent": 0, "tokens": [1]}, {"parent": 1, "tokens": [2]}],
        "seq_end_node": [2],
    }
    with pytest.raises(ValueError, match="node 1 has one child and no rollout ends at it"):
        RolloutTrie.from_dict(data)
    for broken in (
        {**saved(), "nodes": "root"},
        {**saved(), "nodes": [{"parent": -1, "tokens": []}, [0, [1]]]},
        {**saved(), "nodes": [{"parent": -1, "tokens": []}, {"tokens": [1]}]},
    ):
        with pytest.raises(ValueError, match="nodes must be a list of"):
            RolloutTrie.from_dict(broken)
    data = saved()
    del data["seq_end_node"]
    with pytest.raises(ValueError, match="not a saved RolloutTrie"):
        RolloutTrie.from_dict(data)


def test_equality():
    a = RolloutTrie.from_sequences([[1, 2], [1, 3]])
    assert a == RolloutTrie.from_sequences([[1, 2], [1, 3]])
    assert a != RolloutTrie.from_sequences([[1, 3], [1, 2]])
    assert a != RolloutTrie.from_sequences([[1, 2], [1, 4]])
    assert a != "not a trie"


@given(rollout_forests())
def test_to_dict_does_not_alias_the_trie(seqs):
    trie = RolloutTrie.from_sequences(seqs)
    d = trie.to_dict()
    for n in d["nodes"]:
        n["tokens"].append(7)
    d["seq_end_node"].append(1)
    assert trie.sequences() == seqs


# ------------------------------------------------------------------------------------------ networkx
@given(rollout_forests())
def test_to_networkx_is_the_tree(seqs):
    trie = RolloutTrie.from_sequences(seqs)
    g = trie.to_networkx(preview_tokens=2)
    assert g.number_of_nodes() == trie.num_nodes + 1
    assert g.number_of_edges() == trie.num_nodes
    assert nx.is_arborescence(g)
    assert g.in_degree(ROOT) == 0
    for i, n in enumerate(trie.nodes):
        attrs = g.nodes[i]
        assert attrs["num_tokens"] == len(n.tokens)
        assert attrs["depth"] == n.depth
        assert attrs["end_depth"] == n.end_depth
        assert attrs["ends"] == n.ends
        assert sorted(g.successors(i)) == sorted(n.children)
        assert attrs["node_depth"] == len(trie.path(i))
        shown = attrs["preview"].split(" ...")[0]
        assert shown == " ".join(str(t) for t in n.tokens[:2])
    assert sum(a for _, a in g.nodes(data="num_tokens")) == len(distinct_prefixes(seqs))


# ------------------------------------------------------------------------------------------ no mutation
@given(rollout_inputs(), st.sampled_from(["insertion", "size"]))
def test_inputs_not_mutated(forest_inputs, order):
    seqs, inputs = forest_inputs
    before = [x.clone() if isinstance(x, torch.Tensor) else copy.deepcopy(x) for x in inputs]
    outer = list(inputs)
    trie = RolloutTrie.from_sequences(inputs)
    trie.pack(order)
    trie.stats()
    trie.to_networkx()
    assert len(inputs) == len(before) and all(a is b for a, b in zip(inputs, outer, strict=True))
    for x, y in zip(inputs, before, strict=True):
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y)
        else:
            assert type(x) is type(y) and x == y
    # the trie holds its own copies: changing the inputs afterwards does not change it
    for x in inputs:
        if isinstance(x, list):
            x.append(0)
            x[0] += 1
        elif isinstance(x, torch.Tensor):
            x.add_(1)
    assert trie.sequences() == seqs


def test_repr_mentions_sizes():
    trie = RolloutTrie.from_sequences([[1, 2, 3], [1, 2, 4]])
    assert "2 sequences" in repr(trie) and "6 flat -> 4 tree tokens" in repr(trie)


# ------------------------------------------------------------------------------------ from_padded
PAD = 0


def right_padded(seqs: list[list[int]], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor([s + [PAD] * (length - len(s)) for s in seqs])
    mask = (torch.arange(length) < torch.tensor([len(s) for s in seqs])[:, None]).to(torch.int64)
    return ids, mask


def test_from_padded_takes_right_and_left_padding():
    seqs = [[5, 6, 7, 8], [5, 6, 9], [3], [5, 6, 9]]
    want = RolloutTrie.from_sequences(seqs)
    ids, mask = right_padded(seqs, 6)
    left_ids = torch.stack([torch.roll(r, int(6 - m.sum())) for r, m in zip(ids, mask, strict=True)])
    left_mask = mask.flip(1)
    snapshot = (ids.clone(), mask.clone(), left_ids.clone(), left_mask.clone())
    assert RolloutTrie.from_padded(ids, mask) == want
    assert RolloutTrie.from_padded(left_ids, left_mask) == want
    assert RolloutTrie.from_padded(left_ids, left_mask.bool()) == want
    assert RolloutTrie.from_padded(ids, pad_id=PAD) == want
    assert RolloutTrie.from_padded(left_ids, pad_id=PAD) == want
    assert RolloutTrie.from_padded(ids.tolist(), mask.tolist()) == want  # nested lists too
    assert RolloutTrie.from_padded(ids.to(torch.int32), mask.float()) == want
    for a, b in zip((ids, mask, left_ids, left_mask), snapshot, strict=True):
        assert torch.equal(a, b)  # nothing the caller passed is changed


def test_from_padded_keeps_a_real_token_equal_to_the_pad_under_a_mask():
    # pad = eos, as in many tokenizers: the mask tells the completion's eos from the padding after it
    ids, mask = right_padded([[4, 7, PAD], [4, 8]], 5)
    assert RolloutTrie.from_padded(ids, mask).sequences() == [[4, 7, PAD], [4, 8]]


def test_from_padded_grpo_group_shares_its_prompt():
    # what a GRPO trainer holds: prompts left-padded to P, completions right-padded to C, side by side
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(1, 100, (n,), generator=g).tolist() for n in (5, 9)]
    completions = [torch.randint(1, 100, (n,), generator=g).tolist() for n in (3, 6, 1, 6, 2, 4)]
    group = [0, 0, 0, 1, 1, 1]
    P, C = 9, 6
    prompt_ids = torch.tensor([[PAD] * (P - len(prompts[k])) + prompts[k] for k in group])
    prompt_mask = (torch.arange(P) >= torch.tensor([P - len(prompts[k]) for k in group])[:, None]).long()
    completion_ids, completion_mask = right_padded(completions, C)
    trie = RolloutTrie.from_padded(
        torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1)
    )
    assert trie.sequences() == [prompts[k] + c for k, c in zip(group, completions, strict=True)]
    assert trie.stats()["tree_tokens"] == sum(len(p) for p in prompts) + sum(len(c) for c in completions)
    assert trie.stats()["root_branching"] == 2


@pytest.mark.parametrize(
    ("ids", "mask", "pad_id", "error", "match"),
    [
        ([[1, 2], [0, 0]], [[1, 1], [0, 0]], None, ValueError, "row 1 of attention_mask has no ones"),
        ([[1, 2], [0, 0]], None, 0, ValueError, "row 1 holds only pad_id 0"),
        ([[1, 2, 3]], [[1, 0, 1]], None, ValueError, "row 0 of attention_mask is not one contiguous run"),
        ([[1, 0, 3]], None, 0, ValueError, "row 0 has pad_id 0 between real tokens"),
        ([[1, 2, 3]], [[1, 1]], None, ValueError, r"attention_mask has shape \(1, 2\); input_ids \(1, 3\)"),
        ([1, 2, 3], [1, 1, 1], None, ValueError, "input_ids must be 2-D"),
        ([[1.0, 2.0]], [[1, 1]], None, TypeError, "input_ids must hold integer token ids, got torch.float32"),
        ([[True, False]], [[1, 1]], None, TypeError, "input_ids must hold integer token ids, got torch.bool"),
        ([[1, 2]], [[1, 2]], None, ValueError, "attention_mask must hold only 0 and 1"),
        ([[1, 2]], [[1, 1]], 0, TypeError, "pass attention_mask or pad_id, not both"),
        ([[1, 2]], None, None, TypeError, "pass attention_mask or pad_id"),
        ([[1, 2]], None, 0.0, TypeError, "pad_id must be an int"),
        ([[1, -2]], [[1, 1]], None, ValueError, "sequence 0 holds the token id -2"),
        ("ids", [[1]], None, TypeError, "input_ids must be a 2-D integer tensor"),
    ],
)
def test_from_padded_refuses_bad_batches(ids, mask, pad_id, error, match):
    if not isinstance(ids, str):
        ids = torch.tensor(ids)
    mask = None if mask is None else torch.tensor(mask)
    with pytest.raises(error, match=match):
        RolloutTrie.from_padded(ids, mask, pad_id=pad_id)


@given(rollout_forests(), orders)
def test_pack_on_is_the_pack_built_once_and_shared(seqs, order):
    trie = RolloutTrie.from_sequences(seqs)
    shared = trie.pack_on("cpu", order)
    assert_packs_equal(shared, trie.pack(order))
    assert trie.pack_on(torch.device("cpu"), order) is shared  # the same pack, with what is cached on it
    assert trie.pack() is not trie.pack()  # pack() still builds a fresh one each call
    meta = trie.pack_on("meta", order)
    assert meta.device.type == "meta" and trie.pack_on("meta", order) is meta
    calls = []
    assert trie.cached("k", lambda: calls.append(1) or len(calls)) == 1
    assert trie.cached("k", lambda: calls.append(1) or len(calls)) == 1 and calls == [1]
    assert trie == RolloutTrie.from_sequences(seqs)  # the cache is no part of the trie's value


def test_pack_on_refuses_an_unknown_order_and_caches_nothing():
    trie = RolloutTrie.from_sequences([[1, 2], [1, 3]])
    with pytest.raises(ValueError, match="order must be"):
        trie.pack_on("cpu", "depth")
    assert trie._cache == {}


@given(rollout_forests(), st.randoms(use_true_random=False))
def test_subtrie_is_the_trie_of_those_sequences(seqs, rng):
    trie = RolloutTrie.from_sequences(seqs)
    dfs_order = [i for node in trie.preorder() for i in trie.nodes[node].ends]
    some = rng.sample(range(len(seqs)), rng.randint(1, len(seqs)))
    middle = dfs_order[len(seqs) // 3 : max(len(seqs) // 3 + 1, 2 * len(seqs) // 3)]
    for indices in (dfs_order, some, dfs_order[: max(1, len(seqs) // 2)], middle, some + some[:2]):
        sub = trie.subtrie(indices)
        assert sub == RolloutTrie.from_sequences([seqs[i] for i in indices])
        assert sub.seq_lengths == [len(seqs[i]) for i in indices]
    whole = trie.subtrie(dfs_order)
    whole.nodes[-1].tokens.append(0)  # a subtrie shares no list with its trie
    assert trie == RolloutTrie.from_sequences(seqs)


@pytest.mark.parametrize(
    "indices, error, match",
    [([], ValueError, "no sequence indices"), ([0, 3], ValueError, "index 3; this trie holds 3"),
     ([-1], ValueError, "index -1"), ([0.0], TypeError, "sequence indices must be integers")],
)
def test_subtrie_refuses_no_indices_and_indices_it_does_not_hold(indices, error, match):
    trie = RolloutTrie.from_sequences([[1, 2], [1, 3], [4]])
    with pytest.raises(error, match=match):
        trie.subtrie(indices)


def test_a_pack_is_built_on_the_cpu_whatever_the_default_device_and_a_trie_pickles_without_its_cache():
    trie = RolloutTrie.from_sequences([[1, 2, 3], [1, 2, 4, 5], [6]])
    expected = trie.pack()
    with torch.device("meta"):
        pack = trie.pack()
    assert_packs_equal(pack, expected)
    trie.pack_on("cpu")
    restored = pickle.loads(pickle.dumps(trie))
    assert restored == trie and restored._cache == {} and trie._cache


@given(rollout_forests())
def test_shared_prefix_is_the_longest_common_prefix(seqs):
    trie = RolloutTrie.from_sequences(seqs)
    for i, a in enumerate(seqs):
        for j, b in enumerate(seqs):
            n = 0
            while n < min(len(a), len(b)) and a[n] == b[n]:
                n += 1
            assert trie.shared_prefix(i, j) == n, (a, b)
