"""The merge exercise of notebook 05: the checker accepts the solution and rejects wrong answers."""

import pytest
import torch

from treeattn_lab.lab import exercises
from treeattn_lab.reference import masked_attention


def test_merge_solution_equals_attention_over_the_union():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(5, 2, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    mask = torch.rand(5, 5, generator=gen) < 0.6
    mask[0] = False  # a row that sees nothing
    half = torch.arange(5) < 2
    a = masked_attention(q, k, v, mask & half, return_lse=True)
    b = masked_attention(q, k, v, mask & ~half, return_lse=True)
    out, lse = exercises.merge_partial_states(*a, *b)
    want, want_lse = masked_attention(q, k, v, mask, return_lse=True)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(lse, want_lse)


def test_checker_accepts_the_solution(capsys):
    assert exercises.check_merge_partial_states(exercises.merge_partial_states, seed=0)
    assert capsys.readouterr().out.startswith("pass")


def _naive(oa, la, ob, lb):  # no max trick, no care for empty parts
    wa, wb = la.exp(), lb.exp()
    return (oa * wa[..., None] + ob * wb[..., None]) / (wa + wb)[..., None], torch.log(wa + wb)


@pytest.mark.parametrize(("wrong", "hint"), [
    (lambda oa, la, ob, lb: (oa, la), "logaddexp"),
    (lambda oa, la, ob, lb: ((oa + ob) / 2, torch.logaddexp(la, lb)), "share of the mass"),
    (_naive, "-inf"),
    (lambda *args: 1 / 0, "raised ZeroDivisionError"),
    (lambda oa, la, ob, lb: (oa[:1], la), "expected shapes"),
])
def test_checker_rejects_wrong_answers_with_a_hint(wrong, hint, capsys):
    assert exercises.check_merge_partial_states(wrong, seed=0) is False
    out = capsys.readouterr().out
    assert out.startswith("fail") and hint in out
