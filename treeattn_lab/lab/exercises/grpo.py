"""Exercise of notebook 07: GRPO advantages, each rollout's reward against its group's.

:func:`advantages` is the solution (the library's :func:`treeattn_lab.rl.group_advantages`),
:func:`check_advantages` the checker.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence

import torch

from ...rl.objectives import group_advantages
from .checking import call_learner, report_failure


def advantages(rewards: Sequence[float], group_size: int) -> list[float]:
    """``(R_i - mean of its group) / (std of its group + 1e-4)``; groups are consecutive runs of
    ``group_size`` rewards, std the unbiased standard deviation (divide by ``group_size - 1``)."""
    return group_advantages(torch.tensor(rewards, dtype=torch.float64), group_size).tolist()


def _as_floats(answer) -> list[float]:
    if hasattr(answer, "tolist"):
        answer = answer.tolist()
    if isinstance(answer, (str, bytes)) or not isinstance(answer, Sequence):
        raise TypeError(f"expected a list of floats, got {type(answer).__name__}")
    return [float(a) for a in answer]


def _hint(rewards: list[float], group_size: int, want: list[float], got: list[float]) -> str:
    if len(got) != len(want):
        return f"return one advantage per reward ({len(want)}), not {len(got)}."
    first = rewards[:group_size]
    mean = sum(first) / group_size
    if all(abs(g - (r - mean)) < 1e-6 for g, r in zip(got, first, strict=False)) and any(want):
        return "centred but not scaled: divide by the group's standard deviation + 1e-4."
    if len(set(first)) == 1:
        return "a group whose rewards all tie has advantage 0 for every rollout (0 / (0 + 1e-4))."
    return (f"group 0 has mean {mean:.4g}; use the unbiased std (divide by group_size - 1 = "
            f"{group_size - 1}) of each group separately, not of the whole batch.")


def check_advantages(fn: Callable[[list[float], int], Sequence[float]], *, trials: int = 100,
                     seed: int | None = None, verbose: bool = True) -> bool:
    """Check ``fn(rewards, group_size) -> advantages`` against :func:`advantages` on fresh random cases
    (binary and fractional rewards, ties, groups of 2 to 8). Prints ``pass`` or ``fail`` with the first
    failing case and a hint; returns the verdict."""
    rng = random.Random(seed)
    cases = [([1.0, 0.0, 0.0, 1.0], 2), ([0.0, 0.0, 0.0, 0.0], 4), ([1.0, 0.0, 0.0, 0.0, 1.0, 1.0], 3)]
    for _ in range(trials):
        g = rng.randint(2, 8)
        values = [0.0, 1.0] if rng.random() < 0.5 else [0.0, 0.25, 0.5, 0.75, 1.0]
        cases.append(([rng.choice(values) for _ in range(g * rng.randint(1, 4))], g))
    for i, (rewards, g) in enumerate(cases, start=1):
        want = advantages(rewards, g)
        got = call_learner(fn, (list(rewards), g), _as_floats, call=f"fn({rewards}, {g})",
                           inputs=[f"rewards = {rewards}, group_size = {g}"],
                           hint="return a list of floats, one advantage per reward.", verbose=verbose)
        if got is None:
            return False
        if len(got) != len(want) or any(not math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6)
                                        for a, b in zip(got, want, strict=True)):
            lines = [f"rewards = {rewards}, group_size = {g}", f"expected {[round(w, 4) for w in want]}",
                     f"got      {[round(x, 4) for x in got]}"]
            return report_failure(i, lines, verbose, _hint, rewards, g, want, got)
    if verbose:
        print(f"pass ({len(cases)} cases)")
    return True


__all__ = ["advantages", "check_advantages"]
