"""The DFS exercises (notebook 02): the solutions agree with the engine, the checkers accept them, reject
wrong answers with a hint, report the learner's exceptions instead of raising, and draw fresh cases."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import orders, rollout_forests
from treeattn_lab import RolloutTrie
from treeattn_lab.engine.dfs import split_blocks, visit_order
from treeattn_lab.lab import exercises
from treeattn_lab.lab.dfs_stepper import dfs_trace

# a prompt of 6 tokens cut into blocks 0 (0..3) and 1 (4..5); three branches below it
TOY = [
    [1, 2, 3, 4, 5, 6, 7, 8, 9],
    [1, 2, 3, 4, 5, 6, 7, 8, 10, 11],
    [1, 2, 3, 4, 5, 6, 12, 13],
    [1, 2, 3, 4, 5, 6, 18],
]


# ---------------------------------------------------------------------------------------- solutions
@given(rollout_forests(max_sequences=6, max_len=12), orders, st.integers(1, 6))
@settings(max_examples=40)
def test_solutions_agree_with_the_engine(seqs, order, block_tokens):
    pack = RolloutTrie.from_sequences(seqs).pack(order=order)
    parent, ranges = exercises.block_lists(pack, block_tokens)
    assert exercises.dfs_events(parent) == list(visit_order(split_blocks(pack, block_tokens)))
    for step in dfs_trace(pack, block_tokens):
        for block in step.blocks:
            assert exercises.stack_positions(parent, ranges, block) == step.prefix_positions


def test_toy_example():
    pack = RolloutTrie.from_sequences(TOY).pack()
    parent, ranges = exercises.block_lists(pack, 4)
    assert parent == [-1, 0, 1, 2, 2, 1, 1]
    assert ranges == [(0, 4), (4, 6), (6, 8), (8, 9), (9, 11), (11, 13), (13, 14)]
    assert exercises.stack_positions(parent, ranges, 4) == [0, 1, 2, 3, 4, 5, 6, 7]
    assert exercises.stack_positions(parent, ranges, 6) == [0, 1, 2, 3, 4, 5]  # the branch 6..12 popped
    assert exercises.stack_positions(parent, ranges, 0) == []
    assert exercises.dfs_events(parent) == [
        ("push", 0), ("push", 1), ("push", 2), ("leaf", 3), ("leaf", 4), ("pop", 2),
        ("leaf", 5), ("leaf", 6), ("pop", 1), ("pop", 0),
    ]  # fmt: skip


# ---------------------------------------------------------------------------------------- checkers
def test_checkers_accept_the_solutions(capsys):
    assert exercises.check_stack_positions(exercises.stack_positions, seed=0)
    assert capsys.readouterr().out.startswith("pass")
    assert exercises.check_dfs_events(exercises.dfs_events, seed=0)
    assert capsys.readouterr().out.startswith("pass")
    # any order of positions, tensors and tuples are fine too
    import torch

    assert exercises.check_stack_positions(
        lambda p, r, b: torch.tensor(exercises.stack_positions(p, r, b)[::-1], dtype=torch.long),
        seed=1,
        verbose=False,
    )
    assert exercises.check_dfs_events(lambda p: tuple(exercises.dfs_events(p)), seed=1, verbose=False)


def _with_own(p, r, b):
    return exercises.stack_positions(p, r, b) + list(range(*r[b]))


def _everything_before(p, r, b):
    return list(range(r[b][0]))


def _parent_only(p, r, b):
    return [] if p[b] < 0 else list(range(*r[p[b]]))


def _twice(p, r, b):
    return exercises.stack_positions(p, r, b) * 2


@pytest.mark.parametrize(
    ("wrong", "hint"),
    [
        (_with_own, "own positions"),
        (_everything_before, "popped before the walk reached"),
        (_parent_only, "whole path"),
        (lambda p, r, b: [r[-1][1] + 3], "comes later in the walk"),
        (_twice, "appears once"),
        (lambda p, r, b: r[1000], "raised IndexError"),
        (lambda p, r, b: None, "returned the wrong type"),
        (lambda p, r, b: [0.5], "returned the wrong type"),
    ],
)
def test_check_stack_positions_rejects_wrong_answers(wrong, hint, capsys):
    assert exercises.check_stack_positions(wrong, seed=0) is False
    out = capsys.readouterr().out
    assert out.startswith("fail") and hint in out and "hint:" in out


def _preorder_only(parent):
    kids = {p for p in parent if p >= 0}
    return [("push" if b in kids else "leaf", b) for b in range(len(parent))]


def _pops_before_last_child(parent):
    events = exercises.dfs_events(parent)
    for i, (event, _) in enumerate(events):
        if event == "pop" and events[i - 1][0] == "leaf":
            events[i - 1], events[i] = events[i], events[i - 1]
            return events
    return events


def _pushes_leaves(parent):
    kids = {p for p in parent if p >= 0}
    return [("push" if b not in kids else e, b) for e, b in exercises.dfs_events(parent)]


def _leaf_for_everything(parent):
    return [("leaf", b) for b in range(len(parent))]


def _pops_at_the_end(parent):  # every pop postponed to the end: the walk never climbs back up
    events = exercises.dfs_events(parent)
    pops = [e for e in events if e[0] == "pop"]
    return [e for e in events if e[0] != "pop"] + pops


@pytest.mark.parametrize(
    ("wrong", "hint"),
    [
        (_preorder_only, "appears twice"),
        (_pops_before_last_child, "pops too early"),
        (_pushes_leaves, "it is a leaf"),
        (_leaf_for_everything, "push it before them"),
        (_pops_at_the_end, "should pop block"),
        (lambda p: [("visit", b) for b in range(len(p))], "no event"),
        (lambda p: [("leaf", 0)] + exercises.dfs_events(p)[1:], "push it before them"),
        (lambda p: 1 / 0, "raised ZeroDivisionError"),
        (lambda p: 7, "returned the wrong type"),
        (lambda p: ["push"], "returned the wrong type"),
    ],
)
def test_check_dfs_events_rejects_wrong_answers(wrong, hint, capsys):
    assert exercises.check_dfs_events(wrong, seed=0) is False
    out = capsys.readouterr().out
    assert out.startswith("fail") and hint in out and "hint:" in out


def test_checkers_are_quiet_when_asked(capsys):
    assert exercises.check_stack_positions(lambda p, r, b: 1 / 0, verbose=False) is False
    assert exercises.check_dfs_events(lambda p: None, verbose=False) is False
    assert capsys.readouterr().out == ""


def test_checkers_draw_fresh_cases_and_never_share_inputs():
    seen_stack, seen_walk = [], []

    def spy_stack(parent, ranges, block):
        seen_stack.append((list(parent), list(ranges), block))
        answer = exercises.stack_positions(parent, ranges, block)
        parent.clear()  # a learner mutating its input must not change the checker's case
        ranges.clear()
        return answer

    def spy_walk(parent):
        seen_walk.append(list(parent))
        answer = exercises.dfs_events(parent)
        parent.append(0)
        return answer

    calls = []
    for _ in range(2):  # seed=None: two calls see different cases
        assert exercises.check_stack_positions(spy_stack, trials=6, verbose=False)
        assert exercises.check_dfs_events(spy_walk, trials=6, verbose=False)
        calls.append(len(seen_stack))
    assert seen_walk[:6] != seen_walk[6:] and seen_stack[: calls[0]] != seen_stack[calls[0] :]
    assert len(seen_walk[0]) <= 12  # the first case (the one a wrong answer usually fails on) is small
    runs = [[], []]  # same seed, same cases
    for seen in runs:
        exercises.check_dfs_events(lambda p, seen=seen: seen.append(p) or [], seed=3, verbose=False)
    assert runs[0] == runs[1] != []
