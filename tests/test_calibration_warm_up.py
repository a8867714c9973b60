"""Calibration's warm-up: every run of the smallest trie, and dfs in the walks that run FA4 where walks
do, run first and are not fitted; the time limit counts from the end of that warm-up, so a cold device's
compilation does not use up the limit."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest

from tests.test_cost_model import TRUTH, tiny_model
from treeattn_lab.engine import MicroBatchShape, calibrate, calibration

# the smallest calibration trie at this scale holds 5 tokens: in blocks of 2 its dfs ladder is 4 and 8
SETTINGS = {"block_tokens": 2, "scale_tokens": 64, "token_budget": 64}
SMALLEST_RUNS = [("flat", 2), ("packed", 2), ("dfs", 2), ("dfs", 4), ("dfs", 8)]


@pytest.fixture
def clocked_device(monkeypatch, tmp_path):
    """A device whose first run of each kind (mode, and for dfs whether its walk reaches ``fa4``) takes
    ``compile_s`` of wall time, as compiling its kernels does, and later runs none; every run is recorded
    as ``(trie, mode, block_tokens)``."""
    monkeypatch.setenv("TREEATTN_CACHE", str(tmp_path))
    state = {"now": 0.0, "runs": [], "compile_s": 0.0, "compiled": set(), "fa4": None}

    def fake_tree_backward(model, trie, token_weights, *, mode, block_tokens, token_budget):
        shape = MicroBatchShape.of(trie, block_tokens, token_budget)
        runs_fa4 = state["fa4"] is not None and mode == "dfs" and shape.dfs_walk_rectangle >= state["fa4"]
        if (mode, runs_fa4) not in state["compiled"]:
            state["compiled"].add((mode, runs_fa4))
            state["now"] += state["compile_s"]
        state["runs"].append((trie, mode, block_tokens))
        seconds = sum(a * f for a, f in zip(TRUTH[mode], shape.time_features(mode), strict=True))
        return SimpleNamespace(report=SimpleNamespace(time_s=seconds, peak_memory_bytes=None))

    monkeypatch.setattr(calibration, "tree_backward", fake_tree_backward)
    monkeypatch.setattr(calibration, "_fa4_rectangle", lambda model: state["fa4"])
    monkeypatch.setattr(calibration.time, "perf_counter", lambda: state["now"])
    return state


def tree_tokens(trie) -> int:
    return sum(len(n.tokens) for n in trie.nodes)


def calibrated_tries():
    return calibration.calibration_tries(64, vocab=tiny_model().cfg.vocab_size, seed=0)


def test_without_fa4_the_warm_up_runs_every_run_of_the_smallest_trie_in_every_block(clocked_device):
    calibrate(tiny_model(), **SETTINGS, use_cache=False, progress=False)
    warm_up = clocked_device["runs"][: len(SMALLEST_RUNS)]
    smallest = warm_up[0][0]
    assert tree_tokens(smallest) == min(tree_tokens(t) for _, t in calibrated_tries()) == 5
    assert warm_up == [(smallest, mode, block) for mode, block in SMALLEST_RUNS]
    first_measured = clocked_device["runs"][len(SMALLEST_RUNS)][0]
    assert tree_tokens(first_measured) > 5  # then the tries in order, the largest first


def test_where_walks_run_fa4_the_warm_up_runs_each_fa4_walk_of_the_smallest_trie_with_one(clocked_device):
    clocked_device["fa4"] = fa4 = 40  # a mean rectangle some tries' larger-block walks reach
    calibrate(tiny_model(), **SETTINGS, use_cache=False, progress=False)
    runs = clocked_device["runs"]
    measured_from = next(i for i in range(len(SMALLEST_RUNS), len(runs)) if runs[i][1] == "flat")
    extra = runs[len(SMALLEST_RUNS) : measured_from]
    assert extra and {mode for _, mode, _ in extra} == {"dfs"} and len({id(t) for t, _, _ in extra}) == 1
    trie = extra[0][0]
    assert all(MicroBatchShape.of(trie, block, 64).dfs_walk_rectangle >= fa4 for _, _, block in extra)
    assert len({block for _, _, block in extra}) == len(extra)  # no run twice

    def reaches_fa4(t) -> bool:  # some dfs block of its ladder walks with FA4
        return any(MicroBatchShape.of(t, b, 64).dfs_walk_rectangle >= fa4 for b in (2, 4, 8, 16, 32, 64))

    assert not any(reaches_fa4(t) for _, t in calibrated_tries() if tree_tokens(t) < tree_tokens(trie))


@pytest.mark.parametrize("fa4", [None, 40])
def test_compilation_in_the_warm_up_does_not_count_against_the_time_limit(clocked_device, fa4):
    clocked_device["fa4"] = fa4
    clocked_device["compile_s"] = 1000.0  # far past the limit, all of it in the warm-up
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a full calibration: nothing to warn about
        fitted = calibrate(tiny_model(), **SETTINGS, seconds=1.0, use_cache=False, progress=False)
    assert fitted.fit_info["calibration"]["not_measured"] == [] and fitted.calibrated
    assert clocked_device["now"] == 1000.0 * len(clocked_device["compiled"])  # it did compile
