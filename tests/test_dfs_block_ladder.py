"""Under a memory limit, ``"auto"`` runs each DFS micro-batch in the fastest block size of its ladder
whose predicted peak fits the limit; the engine, the report and the balancer's costs follow that size, and
the gradients stay those of flat autograd."""

from __future__ import annotations

import pytest
import torch

from tests.engine_models import (
    assert_grads_close,
    flat_gradients,
    flat_objective_gradients,
    random_weights,
    tiny_lm,
)
from tests.test_cost_model import dfs_fastest_model, prompt_groups
from tests.test_engine_objectives import PerRollout, rollout_data
from treeattn_lab import RolloutTrie
from treeattn_lab.distributed.balance import EngineCost
from treeattn_lab.engine import CostModel, MicroBatchShape, modes, rollout_terms, tree_backward
from treeattn_lab.engine.call_plan import auto_micro_batches, dfs_block_ladder, engine_micro_batches
from treeattn_lab.engine.modes import MODES

BLOCK = 8


@pytest.fixture
def dfs_blocks(monkeypatch) -> list[int]:
    """The block size of every DFS walk the engine runs (through either of its DFS entry points)."""
    seen = []
    for module in (modes, rollout_terms):
        original = module.run_dfs

        def spy(adapter, pack, plan, block_tokens, *args, _original=original, **kwargs):
            seen.append(block_tokens)
            return _original(adapter, pack, plan, block_tokens, *args, **kwargs)

        monkeypatch.setattr(module, "run_dfs", spy)
    return seen


def test_the_ladder_doubles_the_block_until_one_holds_the_micro_batch():
    assert dfs_block_ladder(8, 70) == [8, 16, 32, 64, 128]
    assert dfs_block_ladder(8, 64) == [8, 16, 32, 64]
    assert dfs_block_ladder(128, 70) == [128]


def ladder_predictions(trie, cost_model):
    """Per block size of the whole trie's ladder: the cost model's (seconds, peak bytes) in dfs."""
    ladder = dfs_block_ladder(BLOCK, trie.stats()["tree_tokens"])
    return {b: cost_model.predict(MicroBatchShape.of(trie, b), "dfs") for b in ladder}


def limit_between_two_sizes(predictions) -> tuple[float, int]:
    """A memory limit that the peaks of the smaller half of the ladder fit and the rest do not, and the
    largest size under it."""
    sizes = sorted(predictions)
    fitting = sizes[: max(2, len(sizes) // 2)]
    largest, next_size = fitting[-1], sizes[len(fitting)]
    peak, next_peak = predictions[largest][1], predictions[next_size][1]
    assert peak < next_peak, "the ladder's peaks must grow for this test to mean something"
    return (peak + next_peak) / 2, largest


def test_auto_grows_the_dfs_block_to_the_fastest_size_that_fits_the_limit(dfs_blocks):
    seqs = prompt_groups()  # four subtrees of 70 tree tokens, longest rollout 40
    trie, cost_model = RolloutTrie.from_sequences(seqs), dfs_fastest_model(memory_per_block_token=1.0)
    predictions = ladder_predictions(trie, cost_model)
    seconds = [predictions[b][0] for b in sorted(predictions)]
    assert seconds == sorted(seconds, reverse=True) and seconds[0] > seconds[-1]  # larger blocks: faster
    limit, expected_block = limit_between_two_sizes(predictions)

    ((mb, predicted),) = auto_micro_batches(trie, BLOCK, None, cost_model, memory_limit=limit)
    assert mb.mode == "dfs" and mb.block_tokens == expected_block > BLOCK
    assert predicted["dfs"] == predictions[expected_block] and predicted["dfs"][1] <= limit
    ((unlimited, _),) = auto_micro_batches(trie, BLOCK, None, cost_model)
    assert unlimited.mode == "dfs" and unlimited.block_tokens is None  # no limit: the call's block

    model = tiny_lm()
    weights = random_weights(seqs, 11)
    expected, _ = flat_gradients(model, seqs, weights)
    result = tree_backward(
        model, trie, weights, mode="auto", block_tokens=BLOCK, cost_model=cost_model, memory_limit=limit
    )
    report = result.report
    assert dfs_blocks == [expected_block]
    assert report.block_tokens == [expected_block] and report.choices == f"dfs@{expected_block}"
    assert report.predicted_s == [{m: p[0] for m, p in predicted.items()}]
    assert_grads_close(model, expected, 1e-9)

    balancer = EngineCost(cost_model, block_tokens=BLOCK, memory_limit=limit)
    (planned,) = balancer.plan(trie, None)
    assert planned.block_tokens == expected_block
    assert balancer.mode_and_seconds(planned, None) == ("dfs", pytest.approx(predictions[expected_block][0]))


def test_no_larger_block_fits_a_tight_limit_so_the_call_block_stays():
    seqs = prompt_groups()
    trie, cost_model = RolloutTrie.from_sequences(seqs), dfs_fastest_model(memory_per_block_token=1.0)
    smallest_peak = ladder_predictions(trie, cost_model)[BLOCK][1]
    ((mb, _),) = auto_micro_batches(trie, BLOCK, None, cost_model, memory_limit=smallest_peak)
    assert mb.mode == "dfs" and mb.block_tokens == BLOCK


def test_a_per_rollout_objective_in_a_grown_block_matches_flat_autograd(dfs_blocks):
    seqs = prompt_groups(seed=3)
    trie, cost_model = RolloutTrie.from_sequences(seqs), dfs_fastest_model(memory_per_block_token=1.0)
    limit, expected_block = limit_between_two_sizes(ladder_predictions(trie, cost_model))
    model = tiny_lm(seed=2)
    _, old, ref, adv = rollout_data(model, seqs, seed=5)
    objective = PerRollout(old, ref, adv)
    expected, value = flat_objective_gradients(model, seqs, objective)
    result = tree_backward(
        model, trie, objective=objective, mode="auto", block_tokens=BLOCK, cost_model=cost_model,
        memory_limit=limit,
    )  # fmt: skip
    assert dfs_blocks == [expected_block] and result.report.block_tokens == [expected_block]
    assert float(result.objective_value) == pytest.approx(value, rel=1e-9)
    assert_grads_close(model, expected, 1e-9)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_the_ladder_stops_at_its_bound_but_always_holds_the_call_block():
    assert dfs_block_ladder(8, 70, 32) == [8, 16, 32]
    assert dfs_block_ladder(8, 70, 40) == [8, 16, 32]
    assert dfs_block_ladder(64, 70, 32) == [64]
    assert dfs_block_ladder(8, 20, 20) == [8, 16, 32]  # a 32-token block holds the 20 tokens: within 20
    for bad in ((0, 70, None), (8, -1, None), (8, 70, 0)):
        with pytest.raises(ValueError, match="must be at least"):
            dfs_block_ladder(*bad)
    with pytest.raises(TypeError, match="block_tokens must be an int"):
        dfs_block_ladder(8.0, 70)


def walk_model(per_call: float) -> CostModel:
    """Calibrated: packed and dfs cost the same per token and pair, dfs ``per_call`` seconds per model
    call on top; flat three times packed; no cost per micro-batch, so only tokens, pairs and calls count."""
    per_token = [0.0, 1e-5, 1e-9, 0.0]
    time = {"flat": [3 * c for c in per_token], "packed": per_token, "dfs": per_token[:3] + [per_call]}
    return CostModel(time=time, host={m: [0.0, 0.0] for m in MODES}, calibrated=True)


def cut_prompts():
    """Two prompts of 40 tokens sampled six times (100 tree tokens each), for a budget of 64: every cut
    through a prompt's rollouts carries the prompt."""
    return prompt_groups(prompts=2, prompt_len=40, samples=6, tail=10, seed=4)


def test_auto_walks_the_whole_trie_in_budget_blocks_where_the_cuts_carry_prefixes(dfs_blocks):
    seqs, budget = cut_prompts(), 64
    trie, cost_model = RolloutTrie.from_sequences(seqs), walk_model(per_call=0.0)
    cut = auto_micro_batches(trie, BLOCK, budget, walk_model(per_call=1.0))  # calls too dear to walk
    assert len(cut) > 1 and {mb.mode for mb, _ in cut} == {"packed"}
    assert sum(mb.carried_tokens for mb, _ in cut) > 0

    ((walk, predicted),) = auto_micro_batches(trie, BLOCK, budget, cost_model)
    assert walk.mode == "dfs" and walk.sequences == tuple(trie.dfs_sequence_order())
    assert walk.carried_tokens == 0 and BLOCK < walk.block_tokens <= budget
    planned_s = sum(cost_model.predict(MicroBatchShape.of(mb.trie, BLOCK, budget), mb.mode)[0]
                    for mb, _ in cut)
    assert predicted["dfs"][0] < planned_s
    assert predicted["dfs"] == cost_model.predict(MicroBatchShape.of(trie, walk.block_tokens, budget), "dfs")

    model = tiny_lm(seed=1)
    weights = random_weights(seqs, 13)
    expected, _ = flat_gradients(model, seqs, weights)
    result = tree_backward(
        model, trie, weights, mode="auto", block_tokens=BLOCK, token_budget=budget, cost_model=cost_model
    )
    assert dfs_blocks == [walk.block_tokens] and result.report.choices == f"dfs@{walk.block_tokens}"
    assert result.report.carried_tokens == 0
    assert_grads_close(model, expected, 1e-9)


def test_without_a_fitted_dfs_time_without_dfs_or_under_a_small_budget_auto_keeps_its_micro_batches():
    seqs, budget = cut_prompts(), 64
    trie = RolloutTrie.from_sequences(seqs)
    prior = auto_micro_batches(trie, BLOCK, budget, CostModel())  # the prior knows no cost per call
    assert len(prior) > 1 and "dfs" not in {mb.mode for mb, _ in prior}
    # what plan_call passes while dropout is active: no dfs
    no_dfs = auto_micro_batches(trie, BLOCK, budget, walk_model(per_call=0.0), modes=("flat", "packed"))
    assert len(no_dfs) > 1 and {mb.mode for mb, _ in no_dfs} == {"packed"}
    # a budget below block_tokens: a walk's calls would hold more than the budget
    small = auto_micro_batches(trie, 2 * budget, budget, walk_model(per_call=0.0))
    assert len(small) > 1 and {mb.mode for mb, _ in small} == {"packed"}
    saved = walk_model(per_call=0.0).to_dict()
    del saved["features_version"]  # a model saved before recomputed tokens counted at their forward share
    older = CostModel.from_dict(saved)
    assert not older.identifies("dfs") and older.identifies("packed")
    assert len(auto_micro_batches(trie, BLOCK, budget, older)) > 1


def test_the_walk_hands_each_rollout_its_own_loss_and_gradient_in_any_input_order():
    groups = cut_prompts()  # two prompts of six rollouts each, interleaved: DFS order is not input order
    seqs = [s for pair in zip(groups[:6], groups[6:], strict=True) for s in pair]
    trie, budget = RolloutTrie.from_sequences(seqs), 64
    assert trie.dfs_sequence_order() != list(range(len(seqs)))
    ((walk, _),) = auto_micro_batches(trie, BLOCK, budget, walk_model(per_call=0.0))
    assert [walk.trie.seq_lengths[r] for r in range(len(seqs))] == [len(seqs[i]) for i in walk.sequences]
    model = tiny_lm(seed=4)
    weights = random_weights(seqs, 17)
    expected, losses = flat_gradients(model, seqs, weights)
    result = tree_backward(model, trie, weights, mode="auto", block_tokens=BLOCK, token_budget=budget,
                           cost_model=walk_model(per_call=0.0))
    assert result.report.modes == ["dfs"]
    torch.testing.assert_close(result.losses, torch.as_tensor(losses, dtype=result.losses.dtype),
                               rtol=1e-9, atol=1e-9)
    assert_grads_close(model, expected, 1e-9)


def test_under_a_memory_limit_the_walk_must_fit_it():
    seqs, budget = cut_prompts(), 64
    trie = RolloutTrie.from_sequences(seqs)
    cost_model = walk_model(per_call=0.0)
    # a byte per held token; dfs also holds its path, ten bytes per position of the longest rollout (50)
    cost_model.memory = {"flat": [0.0, 1.0, 0.0], "packed": [0.0, 1.0, 0.0], "dfs": [0.0, 1.0, 10.0]}
    cost_model.fit_info = {m: {"memory": "nnls"} for m in MODES}
    packed_only = auto_micro_batches(trie, BLOCK, budget, cost_model, memory_limit=100.0)
    assert len(packed_only) > 1 and {mb.mode for mb, _ in packed_only} == {"packed"}
    ((walk, predicted),) = auto_micro_batches(trie, BLOCK, budget, cost_model, memory_limit=1000.0)
    assert walk.mode == "dfs" and walk.sequences == tuple(trie.dfs_sequence_order())
    assert 500 < predicted["dfs"][1] <= 1000


def test_calls_on_one_trie_share_the_micro_batch_tries_they_run_and_keep_no_candidate():
    seqs, budget = cut_prompts(), 64
    for cost_model in (walk_model(per_call=1.0), walk_model(per_call=0.0)):  # cut, then walked
        trie = RolloutTrie.from_sequences(seqs)
        first = engine_micro_batches(trie, "auto", BLOCK, budget, cost_model)
        again = engine_micro_batches(trie, "auto", BLOCK, budget, cost_model)
        assert all(a.trie is b.trie for (a, _), (b, _) in zip(first, again, strict=True))
        for mb, _ in first:
            assert mb.trie == RolloutTrie.from_sequences([seqs[i] for i in mb.sequences])
        kept = [key for key in trie._cache if key[0] == "micro_batch_trie"]
        assert sorted(kept) == sorted(("micro_batch_trie", mb.sequences) for mb, _ in first)
    packed = engine_micro_batches(trie, "packed", BLOCK, budget, cost_model)
    assert all(a.trie is trie._cache[("micro_batch_trie", a.sequences)] for a, _ in packed)
