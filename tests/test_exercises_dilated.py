"""The notebook-06 exercise: the checker accepts the solution and rejects wrong answers with a hint."""

from __future__ import annotations

import pytest

from treeattn_lab.lab import exercises
from treeattn_lab.patterns.dilated import dilated_mask


def test_dilated_keys_is_the_mask_row():
    mask = dilated_mask(30, 4, 3, 2)
    for t in range(30):
        assert exercises.dilated_keys(t, 4, 3, 2) == mask[t].nonzero().flatten().tolist()


def test_check_dilated_keys_accepts_the_solution(capsys):
    assert exercises.check_dilated_keys(exercises.dilated_keys, seed=0)
    assert capsys.readouterr().out.startswith("pass")
    backwards = lambda *a: reversed(exercises.dilated_keys(*a))  # any order is fine
    assert exercises.check_dilated_keys(backwards, seed=1, verbose=False)


@pytest.mark.parametrize(
    ("wrong", "hint"),
    [
        (lambda t, D, W, P: list(range(t + 1)), "is not visible"),  # plain causal attention
        (lambda t, D, W, P: [p for p in range(t + 1) if p % D == 0 or t - p <= W or p < P], "% D = 1"),
        (lambda t, D, W, P: [p for p in range(t + 1) if t - p <= W or ((p + 1) % D == 0 and p < t - W)],
         "first"),  # forgot the initial tokens
        (lambda t, D, W, P: [p for p in range(t + 2) if exercises.dilated_keys(t + 1, D, W, P).count(p)],
         "after the query"),
        (lambda t, D, W, P: [p for p in exercises.dilated_keys(t, D, W, P) if p != t], "sees itself"),
        (lambda t, D, W, P: 1 / 0, "raised ZeroDivisionError"),
    ],
)
def test_check_dilated_keys_rejects_wrong_answers(wrong, hint, capsys):
    assert exercises.check_dilated_keys(wrong, seed=0) is False
    out = capsys.readouterr().out
    assert out.startswith("fail") and hint in out
