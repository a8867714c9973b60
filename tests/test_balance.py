"""Partitioning a trie over ranks: every rollout once, costs that add up and agree with the engine, the
surrogate's incremental arithmetic exact, the anchor optimal among contiguous splits, and this lab's
partitioner never worse than the anchor (measured targets on the bundled sets at K = 8 below)."""

from __future__ import annotations

import itertools
import json
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import rollout_forests
from treeattn_lab import RolloutTrie
from treeattn_lab.bench.balance import load_set, random_forest_trie, simulate, targets
from treeattn_lab.datasets import DATASETS, load_trie
from treeattn_lab.distributed.balance import (
    ANCHOR,
    BEST,
    PARTITIONERS,
    CostTree,
    EngineCost,
    TokenCost,
    balance,
    partition,
)
from treeattn_lab.distributed.partitioners import _SearchState, best_two_way_split, contiguous_dfs
from treeattn_lab.engine import CostModel, tree_backward
from treeattn_lab.reference import TinyLM, TinyLMConfig

partitioners = st.sampled_from(sorted(PARTITIONERS))


def tree_tokens(seqs) -> int:
    return len({tuple(s[: j + 1]) for s in seqs for j in range(len(s))})


@given(
    seqs=rollout_forests(max_sequences=10, max_len=12),
    num_ranks=st.integers(1, 6),
    name=partitioners,
    token_budget=st.one_of(st.none(), st.integers(1, 20)),
)
@settings(max_examples=40, deadline=None)
def test_partition_covers_every_rollout_once_and_costs_add_up(seqs, num_ranks, name, token_budget):
    trie = RolloutTrie.from_sequences(seqs)
    before = trie.to_dict()
    report = balance(trie, num_ranks, name, token_budget=token_budget)
    assert trie.to_dict() == before, "balance must not change the trie"
    assert report.num_ranks == num_ranks and report.partitioner == name
    got = sorted(i for s in report.shares for i in s.sequences)
    assert got == list(range(len(seqs))), "every rollout on exactly one rank"
    for share in report.shares:
        if not share.sequences:
            assert share.trie is None and share.cost == 0 and not share.micro_batches
            continue
        assert share.trie.sequences() == [seqs[i] for i in share.sequences]
        in_batches = [i for mb in share.micro_batches for i in mb.sequences]
        assert sorted(in_batches) == sorted(share.sequences), "micro-batches split the share exactly"
        assert share.cost == pytest.approx(sum(share.micro_batch_costs))
        assert share.tree_tokens == tree_tokens([seqs[i] for i in share.sequences])
        # tokens: a rank pays its trie's tokens, plus prefixes computed again after micro-batch cuts
        assert share.cost == share.tree_tokens + share.carried_tokens
        assert sum(mb.tree_tokens for mb in share.micro_batches) == share.cost
    assert report.replicated_tokens == sum(s.tree_tokens for s in report.shares) - tree_tokens(seqs)
    assert report.replicated_tokens >= 0
    assert report.makespan == max(report.costs)
    assert report.mean_cost == pytest.approx(sum(report.costs) / num_ranks)
    if token_budget is None:  # the surrogate is then exact, so its bound holds
        assert report.makespan >= report.lower_bound - 1e-9


@given(seqs=rollout_forests(max_sequences=10, max_len=12), data=st.data())
@settings(max_examples=30, deadline=None)
def test_surrogate_cost_of_any_subset_is_its_trie_tokens(seqs, data):
    tree = CostTree.of(RolloutTrie.from_sequences(seqs))
    subset = data.draw(st.lists(st.integers(0, len(seqs) - 1), unique=True))
    assert tree.cost(subset) == tree_tokens([seqs[i] for i in subset])
    assert tree.total == tree_tokens(seqs)


def random_cost_tree(seqs, seed) -> CostTree:
    """The trie of ``seqs`` with random non-negative node and rollout costs (as a cost model gives)."""
    rng = random.Random(seed)
    trie = RolloutTrie.from_sequences(seqs)
    node = [rng.choice([0.0, rng.random() * 10]) for _ in trie.nodes]
    rollout = [rng.choice([0.0, rng.random() * 5]) for _ in range(trie.num_sequences)]
    return CostTree(trie, node, rollout)


@given(
    seqs=rollout_forests(max_sequences=10, max_len=12),
    num_ranks=st.integers(2, 5),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=30, deadline=None)
def test_every_predicted_move_equals_the_cost_after_moving(seqs, num_ranks, seed):
    """The vectorised move evaluation (subtree sums in preorder) against recomputing the moved sets."""
    tree = random_cost_tree(seqs, seed)
    rng = random.Random(seed)
    groups = [[] for _ in range(num_ranks)]
    for i in range(len(seqs)):
        groups[rng.randrange(num_ranks)].append(i)
    state = _SearchState(tree, groups)
    for q in range(num_ranks):
        assert float(state.load[q]) == pytest.approx(tree.cost(groups[q]), abs=1e-9)
    r = max(range(num_ranks), key=lambda q: len(groups[q]))
    worst, growth = state.moves_from(r)
    for dest in range(num_ranks):
        for node in range(tree.num_nodes):
            chunk = [i for i in groups[r] if node <= tree.end_node[i] < tree.end[node]]
            if dest == r or node == 0 or not chunk:
                assert worst[dest, node] == float("inf")
                continue
            new_r = tree.cost([i for i in groups[r] if i not in chunk])
            new_dest = tree.cost(groups[dest] + chunk)
            assert float(worst[dest, node]) == pytest.approx(max(new_r, new_dest), abs=1e-9)
            old = tree.cost(groups[r]) + tree.cost(groups[dest])
            assert float(growth[dest, node]) == pytest.approx(new_r + new_dest - old, abs=1e-9)
    # applying a move keeps the bookkeeping exact
    node = next(v for v in range(1, tree.num_nodes) if state.count[r, v] > 0) if groups[r] else None
    if node is not None:
        state.move(r, node, (r + 1) % num_ranks)
        for q, g in enumerate(state.groups()):
            assert float(state.load[q]) == pytest.approx(tree.cost(g), abs=1e-9)


@given(seqs=rollout_forests(max_sequences=10, max_len=12), seed=st.integers(0, 2**16))
@settings(max_examples=30, deadline=None)
def test_two_way_split_is_the_best_range_split_and_costs_are_exact(seqs, seed):
    tree = random_cost_tree(seqs, seed)
    rollouts = list(range(len(seqs)))
    result = best_two_way_split(tree, rollouts)
    if len(seqs) < 2:
        assert result is None
        return
    value, inside, outside = result
    assert sorted(inside + outside) == rollouts and inside and outside
    assert value == pytest.approx(max(tree.cost(inside), tree.cost(outside)), abs=1e-9)
    order = sorted(rollouts, key=lambda i: tree.dfs_rank[i])
    brute = min(
        max(tree.cost(order[a : b + 1]), tree.cost(order[:a] + order[b + 1 :]))
        for a in range(len(order))
        for b in range(a, len(order))
        if (a, b) != (0, len(order) - 1)
    )
    assert value == pytest.approx(brute, abs=1e-9)


@given(
    seqs=rollout_forests(max_sequences=8, max_len=10), num_ranks=st.integers(1, 4), seed=st.integers(0, 99)
)
@settings(max_examples=30, deadline=None)
def test_anchor_is_the_best_contiguous_split(seqs, num_ranks, seed):
    tree = random_cost_tree(seqs, seed)
    order = tree.dfs_order
    groups = contiguous_dfs(tree, num_ranks)
    assert [i for g in groups for i in g] == order, "contiguous ranges of the DFS order, in order"
    got = max(tree.cost(g) for g in groups)
    n = len(order)
    best = min(
        max(tree.cost(order[a:b]) for a, b in itertools.pairwise((0, *cuts, n)))
        for m in range(min(num_ranks - 1, n - 1) + 1)
        for cuts in itertools.combinations(range(1, n), m)
    )
    assert got == pytest.approx(best, rel=1e-9, abs=1e-9)


@given(
    seqs=rollout_forests(max_sequences=12, max_len=12), num_ranks=st.integers(2, 6), seed=st.integers(0, 99)
)
@settings(max_examples=30, deadline=None)
def test_best_partitioner_is_never_worse_than_the_anchor(seqs, num_ranks, seed):
    tree = random_cost_tree(seqs, seed)
    makespan = {name: max(tree.cost(g) for g in PARTITIONERS[name](tree, num_ranks)) for name in PARTITIONERS}
    assert makespan[BEST] <= makespan[ANCHOR] + 1e-9
    assert makespan[BEST] >= tree.lower_bound(num_ranks) - 1e-9


def test_partitions_are_deterministic_and_restore_the_thread_count():
    trie = load_trie("tree_search")
    threads = torch.get_num_threads()
    first = partition(trie, 8)
    assert torch.get_num_threads() == threads
    assert partition(trie, 8) == first


def test_more_ranks_than_rollouts_leaves_ranks_empty():
    trie = RolloutTrie.from_sequences([[1, 2, 3], [1, 2, 4]])
    for name in PARTITIONERS:
        report = balance(trie, 5, name)
        assert sum(1 for s in report.shares if s.sequences) <= 2
        assert report.makespan == 3 and report.lower_bound == 3


# ------------------------------------------------------------------------- the engine agrees with the plan
@pytest.mark.parametrize("host_floor", [None, 0.0, 2e-4])
def test_engine_cost_predictions_are_what_tree_backward_predicts(host_floor):
    """Uncalibrated (greedy cuts) and calibrated models (the planner's cuts; with a host floor some
    micro-batches are host-bound): the shares' micro-batches and seconds are the engine's own."""
    torch.manual_seed(0)
    model = TinyLM(
        TinyLMConfig(vocab_size=50, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=24)
    ).double()
    rng = random.Random(0)
    prompt = [rng.randrange(50) for _ in range(12)]
    seqs = [prompt + [rng.randrange(50) for _ in range(rng.randint(1, 15))] for _ in range(7)]
    seqs += [[rng.randrange(50) for _ in range(20)] for _ in range(2)]  # two that share nothing
    trie = RolloutTrie.from_sequences(seqs)
    # packed wins where a micro-batch shares a prefix, flat (first on ties) where it shares nothing
    cost_model = CostModel(
        time={
            "flat": [0.0, 1e-6, 1e-9, 0.0],
            "packed": [0.0, 1e-6, 1e-9, 0.0],
            "dfs": [0.0, 1e-5, 1e-8, 1e-4],
        },
        host={m: [(host_floor or 0.0) * f, 0.0] for m, f in (("flat", 2), ("packed", 1), ("dfs", 10))},
        calibrated=host_floor is not None,
    )
    cost = EngineCost(cost_model, mode="auto", block_tokens=8)
    report = balance(trie, 3, BEST, cost=cost, token_budget=60)
    assert report.unit == "seconds"
    host_bound = sum(s.host_bound for s in report.shares)
    assert (host_bound > 0) == bool(host_floor), host_bound
    assert report.row()["host_bound_micro_batches"] == [s.host_bound for s in report.shares]
    chosen = set()
    for share in report.shares:
        if not share.sequences:
            continue
        result = tree_backward(
            model, share.trie, None, mode="auto", block_tokens=8, token_budget=60, cost_model=cost_model
        )
        engine = [p[m] for p, m in zip(result.report.predicted_s, result.report.modes, strict=True)]
        assert len(engine) == len(share.micro_batches)
        assert engine == pytest.approx(list(share.micro_batch_costs), rel=1e-12)
        assert share.cost == pytest.approx(sum(engine), rel=1e-12)
        chosen |= set(result.report.modes)
    assert "packed" in chosen  # the choice is the engine's own, per micro-batch


def test_engine_cost_surrogate_follows_the_mode():
    trie = RolloutTrie.from_sequences([[1, 2, 3, 4], [1, 2, 5], [6, 7]])
    theta = [0.0, 2.0, 0.5, 0.0]
    model = CostModel(time={"flat": theta, "packed": theta, "dfs": theta})
    node, rollout = EngineCost(model, mode="flat").surrogate(trie, None)
    assert node == [0.0] * len(trie.nodes)
    assert rollout == [2 * n + 0.5 * n * (n + 1) / 2 for n in trie.seq_lengths]
    node, rollout = EngineCost(model, mode="packed").surrogate(trie, None)
    tree = CostTree(trie, node, rollout)
    pairs = trie.stats()["tree_attention_pairs"]
    assert tree.total == pytest.approx(2 * trie.stats()["tree_tokens"] + 0.5 * pairs)


# ------------------------------------------------------------------------------------ the bundled sets
# measured at K = 8 (tokens; see the report): subtree_search reaches imbalance <= 1.05 on grpo_math,
# tree_search and low_sharing, and half the anchor's excess on tree_search. On agentic it has the lowest
# makespan of all partitioners (16604 tokens, a level-1 subtree kept whole; the anchor: 16895) but an
# imbalance of 1.064: agentic's 38 rollouts under two 5K-token prefixes leave too little to move, and
# only more replication would raise the mean. These assertions guard the measured values.
MEASURED_K8 = {"grpo_math": 1.05, "agentic": 1.07, "tree_search": 1.05, "low_sharing": 1.05}


@pytest.mark.parametrize("name", DATASETS)
def test_bundled_sets_at_eight_ranks(name):
    trie = load_trie(name)
    reports = {p: balance(trie, 8, p, exact=False) for p in PARTITIONERS}
    best, anchor = reports[BEST], reports[ANCHOR]
    assert best.makespan == min(r.makespan for r in reports.values())
    assert best.imbalance <= MEASURED_K8[name]
    if name == "tree_search":
        assert best.imbalance - 1 <= (anchor.imbalance - 1) / 2
    if name == "agentic":
        assert best.imbalance < anchor.imbalance and best.makespan < anchor.makespan


def test_simulation_rows_and_targets():
    trie = load_trie("tree_search")
    rows = simulate([("tree_search", trie)], ks=(2, 8), partitioners=tuple(PARTITIONERS))
    assert len(rows) == 2 * len(PARTITIONERS)
    assert {r["num_ranks"] for r in rows} == {2, 8}
    for r in rows:
        assert r["makespan"] >= r["lower_bound"] - 1e-9 and r["imbalance"] >= 1.0
        if r["partitioner"] == ANCHOR:
            assert r["makespan_vs_anchor"] == 1.0
    checks = targets(rows)
    assert any("half the anchor" in c["target"] and c["met"] for c in checks)


def test_generated_sets():
    assert load_set("tree_search_x1") == load_trie("tree_search")
    small = random_forest_trie(seed=3, prompts=4)
    assert small == random_forest_trie(seed=3, prompts=4) and small.num_sequences >= 4
    with pytest.raises(ValueError, match="unknown set"):
        load_set("nope_x2")


# ------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"trie": [[1, 2]]}, TypeError, "RolloutTrie"),
        ({"num_ranks": 0}, ValueError, "num_ranks must be at least 1"),
        ({"num_ranks": True}, TypeError, "num_ranks must be an int"),
        ({"num_ranks": 2.0}, TypeError, "num_ranks must be an int"),
        ({"partitioner": "round_robin"}, ValueError, "unknown partitioner"),
        ({"token_budget": 0}, ValueError, "token_budget must be at least 1"),
        ({"cost": "tokens"}, TypeError, "cost must be"),
    ],
)
def test_bad_input_is_named(kwargs, error, match):
    args = {"trie": RolloutTrie.from_sequences([[1, 2], [1, 3]]), "num_ranks": 2, "partitioner": BEST}
    args.update(kwargs)
    with pytest.raises(error, match=match):
        balance(args.pop("trie"), args.pop("num_ranks"), args.pop("partitioner"), **args)


def test_engine_cost_rejects_bad_settings():
    with pytest.raises(ValueError, match="mode must be one of"):
        EngineCost(mode="fast")
    with pytest.raises(TypeError, match="cost_model must be a CostModel"):
        EngineCost(cost_model={"time": {}})
    with pytest.raises(ValueError, match="block_tokens must be at least 1"):
        EngineCost(block_tokens=0)
    assert TokenCost().unit == "tokens"


def test_bench_balance_costs_ranks_with_a_saved_cost_model(tmp_path):
    """``bench balance --cost-model``: a saved model or a results file holding one; with a host floor the
    rows count the host-bound micro-batches, and the makespan includes their floor."""
    from treeattn_lab.bench.balance import load_cost_model

    theta = [1e-3, 1e-6, 1e-10, 0.0]
    model = CostModel(
        time={m: theta for m in ("flat", "packed", "dfs")},
        host={m: [0.05, 0.0] for m in ("flat", "packed", "dfs")},
        calibrated=True,
    )
    saved, wrapped, broken = tmp_path / "model.json", tmp_path / "train.json", tmp_path / "other.json"
    saved.write_text(json.dumps(model.to_dict()))
    wrapped.write_text(json.dumps({"rows": [], "cost_model": model.to_dict()}))
    broken.write_text(json.dumps({"rows": []}))
    assert load_cost_model(saved).to_dict() == load_cost_model(wrapped).to_dict() == model.to_dict()
    with pytest.raises(ValueError, match="other.json holds no saved cost model"):
        load_cost_model(broken)
    cost = EngineCost(load_cost_model(wrapped), mode="packed", block_tokens=4096)
    rows = simulate(["grpo_math"], (2,), (BEST,), cost=cost, token_budget=32768)
    (row,) = rows
    assert row["unit"] == "seconds" and len(row["micro_batches"]) == 2
    assert row["host_bound"] == sum(row["host_bound_micro_batches"]) >= 1  # each share's small last one
    report = balance(load_trie("grpo_math"), 2, BEST, cost=cost, token_budget=32768)
    for share in report.shares:
        assert all(c >= 0.05 for c in share.micro_batch_costs)  # no micro-batch below the host floor
    assert row["makespan"] == pytest.approx(report.makespan)
