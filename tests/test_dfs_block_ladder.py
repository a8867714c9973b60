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
from treeattn_lab.engine import MicroBatchShape, modes, rollout_terms, tree_backward
from treeattn_lab.engine.call_plan import auto_micro_batches, dfs_block_ladder

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
