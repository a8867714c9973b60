"""Notebook 07's exercise: GRPO advantages, checked on fresh random cases."""

from __future__ import annotations

import statistics

from treeattn_lab.lab.exercises.grpo import advantages, check_advantages


def learner_solution(rewards, group_size):
    out = []
    for i in range(0, len(rewards), group_size):
        group = rewards[i : i + group_size]
        mean, std = statistics.fmean(group), statistics.stdev(group)
        out += [(r - mean) / (std + 1e-4) for r in group]
    return out


def test_solution_and_an_independent_one_pass(capsys):
    assert check_advantages(advantages, seed=0)
    assert check_advantages(learner_solution)
    assert capsys.readouterr().out.count("pass") == 2


def test_advantages_values():
    got = advantages([1.0, 0.0, 0.0, 0.0], 4)
    assert abs(got[0] - 0.75 / (0.5 + 1e-4)) < 1e-9 and abs(sum(got)) < 1e-9
    assert advantages([1.0, 1.0], 2) == [0.0, 0.0]


def test_wrong_answers_fail_with_a_hint(capsys):
    def centred(r, g):
        return [x - statistics.fmean(r[i // g * g : i // g * g + g]) for i, x in enumerate(r)]

    cases = {
        "centred only": centred,
        "batch std": lambda r, g: [(x - statistics.fmean(r)) / (statistics.stdev(r) + 1e-4) for x in r],
        "too short": lambda r, g: r[:1],
        "raises": lambda r, g: 1 / 0,
        "not a list": lambda r, g: "advantages",
    }
    for name, fn in cases.items():
        assert not check_advantages(fn, seed=1), name
        out = capsys.readouterr().out
        assert out.startswith("fail") and "hint:" in out, (name, out)
    assert not check_advantages(cases["batch std"], seed=1, verbose=False)
    assert capsys.readouterr().out == ""
