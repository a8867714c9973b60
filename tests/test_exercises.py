"""The exercise checkers of treeattn_lab.lab.exercises accept the solutions and reject wrong answers."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given

from tests.conftest import rollout_forests
from treeattn_lab import RolloutTrie
from treeattn_lab.lab import exercises


@given(rollout_forests())
def test_ancestor_keys_matches_the_mask(seqs):
    pack = RolloutTrie.from_sequences(seqs).pack()
    mask = pack.visibility_mask()
    for q0 in range(pack.num_tokens):
        ranges = exercises.ancestor_keys(pack.subtree_end, q0)
        keys = [k for a, b in ranges for k in range(a, b)]
        assert keys == mask[q0, :q0].nonzero().flatten().tolist()
        assert all(a < b for a, b in ranges)
        assert all(ranges[i][1] < ranges[i + 1][0] for i in range(len(ranges) - 1))  # merged, sorted
        # the whole tile [q0, q0 + 16) sees nothing before q0 that q0 itself does not see
        tile = mask[q0 : q0 + 16, :q0].any(0)
        assert tile.nonzero().flatten().tolist() == keys


def test_ancestor_keys_small_example():
    # root prompt [0, 3) forks into [3, 5) and [5, 8)
    se = torch.tensor([8, 8, 8, 5, 5, 8, 8, 8])
    assert exercises.ancestor_keys(se, 6) == [(0, 3), (5, 6)]
    assert exercises.ancestor_keys(se.tolist(), 0) == []
    with pytest.raises(ValueError):
        exercises.ancestor_keys(se, 8)


def test_check_ancestor_keys_accepts_the_solution(capsys):
    assert exercises.check_ancestor_keys(exercises.ancestor_keys, seed=0)
    assert capsys.readouterr().out.startswith("pass")

    # the right keys split into unmerged or unsorted ranges fail, with a hint naming the merged answer
    def split(se, q0):
        return [(k, k + 1) for a, b in reversed(exercises.ancestor_keys(se, q0)) for k in range(a, b)]

    assert not exercises.check_ancestor_keys(split, seed=1)
    out = capsys.readouterr().out
    assert out.startswith("fail") and "sorted, merged" in out

    # the starter's failing case is short: only subtree_end up to q0 is printed, q0 small
    assert not exercises.check_ancestor_keys(lambda se, q0: [], seed=2)
    shown = capsys.readouterr().out.splitlines()[1]
    assert shown.startswith("  subtree_end[:q0 + 1] = [") and shown.count(",") < 12


@pytest.mark.parametrize(
    ("wrong", "hint"),
    [
        (lambda se, q0: [], "is visible"),
        (lambda se, q0: [(0, q0)] if q0 else [], "is not visible"),  # causal: sibling branches too
        (lambda se, q0: [(k, k + 1) for k in range(q0 + 1) if se[k] > q0], "k < q0"),  # q0 itself
        (lambda se, q0: 1 / 0, "raised ZeroDivisionError"),
        (lambda se, q0: 7, "raised TypeError"),
    ],
)
def test_check_ancestor_keys_rejects_wrong_answers(wrong, hint, capsys):
    assert exercises.check_ancestor_keys(wrong, seed=0) is False
    out = capsys.readouterr().out
    assert out.startswith("fail") and hint in out
