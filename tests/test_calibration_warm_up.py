"""Calibration's warm-up: every run the smallest trie makes, and dfs once in a walk large enough to run
FA4 where walks do, run first and are not fitted; the time limit counts from the end of that warm-up, so a
cold device's compilation does not use up the limit."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest

from tests.test_cost_model import SETTINGS, TRUTH, tiny_model
from treeattn_lab.engine import MicroBatchShape, calibrate, calibration

BUDGET = {**SETTINGS, "token_budget": 64}


def tree_tokens(trie) -> int:
    return sum(len(n.tokens) for n in trie.nodes)


@pytest.fixture
def clocked_device(monkeypatch, tmp_path):
    """A device whose first run of each kind (mode, and for dfs whether its walk reaches ``fa4``) takes
    ``compile_s`` of wall time, as compiling its kernels does, and later runs none; every run is recorded
    as ``(tree tokens, mode, block_tokens)``."""
    monkeypatch.setenv("TREEATTN_CACHE", str(tmp_path))
    state = {"now": 0.0, "runs": [], "compile_s": 0.0, "compiled": set(), "fa4": None}

    def fake_tree_backward(model, trie, token_weights, *, mode, block_tokens, token_budget):
        shape = MicroBatchShape.of(trie, block_tokens, token_budget)
        runs_fa4 = state["fa4"] is not None and mode == "dfs" and shape.dfs_walk_rectangle >= state["fa4"]
        kernel = (mode, runs_fa4)
        if kernel not in state["compiled"]:
            state["compiled"].add(kernel)
            state["now"] += state["compile_s"]
        state["runs"].append((tree_tokens(trie), mode, block_tokens))
        seconds = sum(a * f for a, f in zip(TRUTH[mode], shape.time_features(mode), strict=True))
        return SimpleNamespace(report=SimpleNamespace(time_s=seconds, peak_memory_bytes=None))

    monkeypatch.setattr(calibration, "tree_backward", fake_tree_backward)
    monkeypatch.setattr(calibration, "_fa4_rectangle", lambda model: state["fa4"])
    monkeypatch.setattr(calibration.time, "perf_counter", lambda: state["now"])
    return state


def smallest_trie():
    tries = calibration.calibration_tries(64, vocab=tiny_model().cfg.vocab_size, seed=0)
    return min((t for _, t in tries), key=tree_tokens)


def test_without_fa4_the_warm_up_runs_every_run_of_the_smallest_trie(clocked_device):
    calibrate(tiny_model(), **BUDGET, use_cache=False, progress=False)
    smallest = smallest_trie()
    expected = [(tree_tokens(smallest), mode, block)
                for mode, block in calibration._runs_of(smallest, {"block_tokens": 16, "token_budget": 64})]
    assert clocked_device["runs"][: len(expected)] == expected
    assert clocked_device["runs"][len(expected)][0] != tree_tokens(smallest)  # then the first trie's runs


def test_where_walks_run_fa4_the_warm_up_runs_the_smallest_walk_that_does(clocked_device):
    clocked_device["fa4"] = fa4 = 40  # a mean rectangle some tries' largest-block walks reach
    calibrate(tiny_model(), **BUDGET, use_cache=False, progress=False)
    smallest = smallest_trie()
    head = len(calibration._runs_of(smallest, {"block_tokens": 16, "token_budget": 64}))
    size, mode, block = clocked_device["runs"][head]
    assert mode == "dfs"
    tries = dict(calibration.calibration_tries(64, vocab=tiny_model().cfg.vocab_size, seed=0))
    trie = next(t for t in tries.values() if tree_tokens(t) == size)
    assert MicroBatchShape.of(trie, block, 64).dfs_walk_rectangle >= fa4
    smaller = [t for t in tries.values() if tree_tokens(t) < size]
    assert all(MicroBatchShape.of(t, 64, 64).dfs_walk_rectangle < fa4 for t in smaller)


@pytest.mark.parametrize("fa4", [None, 40])
def test_compilation_in_the_warm_up_does_not_count_against_the_time_limit(clocked_device, fa4):
    clocked_device["fa4"] = fa4
    clocked_device["compile_s"] = 1000.0  # far past the limit, all of it in the warm-up
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a full calibration: nothing to warn about
        fitted = calibrate(tiny_model(), **BUDGET, seconds=1.0, use_cache=False, progress=False)
    assert fitted.fit_info["calibration"]["not_measured"] == [] and fitted.calibrated
    assert clocked_device["now"] == 1000.0 * len(clocked_device["compiled"])  # it did compile
