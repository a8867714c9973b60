"""The notebook-04 exercise: the checker accepts the solution and rejects wrong answers with a hint."""

from __future__ import annotations

import itertools

import pytest

from treeattn_lab.lab import exercises
from treeattn_lab.lab.exercises.balance import makespan_of_cuts, optimal_makespan, range_tokens


def flat_balanced_cuts(seqs, num_ranks):
    """A plausible mistake: the contiguous split that balances flat tokens (shared prefixes ignored)."""
    lengths, n = [len(s) for s in seqs], len(seqs)
    options = (
        cuts for m in range(min(num_ranks - 1, n - 1) + 1) for cuts in itertools.combinations(range(1, n), m)
    )
    return list(min(options, key=lambda c: max(sum(lengths[a:b]) for a, b in itertools.pairwise((0, *c, n)))))


def test_solution_is_optimal_on_small_cases():
    seqs = sorted([[1, 2, 3], [1, 2, 4], [1, 5], [6, 7, 8, 9], [6, 7, 1]])
    for k in range(1, 6):
        cuts = exercises.contiguous_cuts(seqs, k)
        brute = min(
            makespan_of_cuts(seqs, c)
            for m in range(min(k - 1, len(seqs) - 1) + 1)
            for c in itertools.combinations(range(1, len(seqs)), m)
        )
        assert len(cuts) < k and makespan_of_cuts(seqs, cuts) == brute == optimal_makespan(seqs, k)
    assert range_tokens(seqs) == 10


def test_check_contiguous_cuts_accepts_the_solution(capsys):
    assert exercises.check_contiguous_cuts(exercises.contiguous_cuts, seed=0)
    assert capsys.readouterr().out.startswith("pass")
    assert exercises.check_contiguous_cuts(
        lambda s, k: tuple(exercises.contiguous_cuts(s, k)), seed=1, verbose=False
    )


@pytest.mark.parametrize(
    ("wrong", "hint"),
    [
        (lambda s, k: [], "smaller makespan exists"),  # one range for everything
        (flat_balanced_cuts, "balanced in flat tokens"),
        (lambda s, k: list(range(1, len(s))), "at most K - 1 cut points"),
        (lambda s, k: [0], "must lie in 1.."),
        (lambda s, k: [2, 1], "strictly increasing"),
        (lambda s, k: 1 / 0, "ZeroDivisionError"),
    ],
)
def test_check_contiguous_cuts_rejects_wrong_answers(wrong, hint, capsys):
    assert exercises.check_contiguous_cuts(wrong, seed=0) is False
    out = capsys.readouterr().out
    assert out.startswith("fail") and hint in out
