"""Exercise of notebook 06: which keys a query sees under dilated attention ``(D, W, P)``.

:func:`dilated_keys` is the solution, :func:`check_dilated_keys` the checker.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from ...patterns.dilated import DilatedPattern


def dilated_keys(t: int, dilation: int, window: int = 0, initial: int = 0) -> list[int]:
    """Sorted key positions query ``t`` attends: ``p <= t`` and (``t - p <= window``, or ``p < initial``, or
    ``(p + 1) % dilation == 0`` and ``p < t - window``)."""
    pattern = DilatedPattern(dilation, window, initial)
    return [p for p in range(t + 1) if pattern.visible(t, p)]


def _hint(t: int, D: int, W: int, P: int, expected: list[int], got: list[int]) -> str:
    extra, missing = sorted(set(got) - set(expected)), sorted(set(expected) - set(got))
    lines = [
        f"  t = {t}, dilation = {D}, window = {W}, initial = {P}",
        f"  expected {expected}",
        f"  got      {got}",
    ]
    if extra and max(extra) > t:
        lines.append(f"hint: key {max(extra)} lies after the query: attention is causal, p <= t.")
    elif extra:
        p = extra[0]
        lines.append(
            f"hint: key {p} is not visible: it is outside the window (t - p = {t - p} > {W}), not "
            f"among the first {P}, and (p + 1) % D = {(p + 1) % D}, not 0."
        )
    elif missing:
        p = missing[0]
        if t - p <= W:
            why = f"it is in the window (t - p = {t - p} <= {W}; the query sees itself too)"
        elif p < P:
            why = f"it is one of the first {P} (initial) positions"
        else:
            why = f"(p + 1) % D = 0: the strided keys are D-1, 2D-1, ... (here {D - 1}, {2 * D - 1}, ...)"
        lines.append(f"hint: key {p} is visible: {why}.")
    return "\n".join(lines)


def check_dilated_keys(
    fn: Callable[[int, int, int, int], Sequence[int]],
    *,
    trials: int = 200,
    seed: int | None = None,
    verbose: bool = True,
) -> bool:
    """Check ``fn(t, dilation, window, initial) -> key positions`` against :func:`dilated_keys`.

    Any order is accepted (the answer is compared as a sorted list without duplicates). Runs ``trials``
    fresh random cases (``seed=None``: new ones every call), edge cases first (D = 1, W = 0, t = 0).
    Prints ``pass`` or ``fail`` with the first failing case and a hint; returns the verdict.
    """
    rng = random.Random(seed)
    cases = [(0, 1, 0, 0), (5, 1, 0, 0), (9, 4, 0, 0), (10, 3, 2, 1), (3, 8, 0, 6)]
    for _ in range(trials):
        cases.append((rng.randrange(0, 80), rng.randint(1, 16), rng.randint(0, 12), rng.randint(0, 8)))
    for i, (t, D, W, P) in enumerate(cases):
        expected = dilated_keys(t, D, W, P)
        try:
            got = sorted({int(p) for p in fn(t, D, W, P)})
        except Exception as e:  # the learner's bug, reported rather than raised
            if verbose:
                print(
                    f"fail: fn(t={t}, dilation={D}, window={W}, initial={P}) raised {type(e).__name__}: {e}"
                )
                print("hint: return a list of ints, the positions p the query attends.")
            return False
        if got != expected:
            if verbose:
                print(f"fail on case {i + 1}:\n{_hint(t, D, W, P, expected, got)}")
            return False
    if verbose:
        print(f"pass: {len(cases)} queries")
    return True


__all__ = ["check_dilated_keys", "dilated_keys"]
