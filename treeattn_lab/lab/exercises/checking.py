"""What every exercise checker shares: fresh random rollouts, the learner's function called safely, and a
failed case reported the same way.

A checker never raises on a wrong answer: :func:`call_learner` turns the learner's exception, or an answer
of the wrong type, into None (saying why), and :func:`report_failure` prints the failing case (its inputs,
the expected and the received answer) with a hint and returns False, the checker's verdict.
"""

from __future__ import annotations

import operator
import random
from collections.abc import Callable, Sequence


def random_rollouts(rng: random.Random) -> list[list[int]]:
    """A few rollouts over a tiny vocabulary (so they share prefixes), with forks at random depths."""
    vocab = rng.choice([2, 3, 5])
    seqs: list[list[int]] = []
    for _ in range(rng.randint(1, 8)):
        if seqs and rng.random() < 0.6:  # fork off an earlier rollout
            base = rng.choice(seqs)
            tail = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
            seqs.append(base[: rng.randint(0, len(base))] + tail)
        else:
            seqs.append([rng.randrange(vocab) for _ in range(rng.randint(1, 24))])
    return seqs


def random_rollout_case(rng: random.Random, case: int) -> list[list[int]]:
    """Random rollouts with forks (as in notebook 03's exercise), sometimes with an exact duplicate and a
    rollout that is a prefix of another, which a trie must count once. Cases grow with ``case`` (from 1),
    so the first failing case a learner reads is a small one."""
    seqs = [s[: 3 + case] for s in random_rollouts(rng)[: 2 + case // 3]]
    if rng.random() < 0.3:
        seqs.append(list(rng.choice(seqs)))
    if rng.random() < 0.3:
        base = rng.choice(seqs)
        seqs.append(base[: rng.randint(1, len(base))])
    rng.shuffle(seqs)
    return seqs


def as_count(answer) -> int:
    if isinstance(answer, bool) or not hasattr(answer, "__index__"):
        raise TypeError(f"expected an int, got {answer!r:.60} of type {type(answer).__name__}")
    return operator.index(answer)


def as_int_list(answer) -> list[int]:
    if hasattr(answer, "tolist"):  # a tensor or an array
        answer = answer.tolist()
    if isinstance(answer, (str, bytes)) or not isinstance(answer, Sequence):
        raise TypeError(f"expected a list of ints, got {type(answer).__name__}")
    return [as_count(v) for v in answer]


def call_learner(fn, args: tuple, convert, *, call: str, inputs: list[str], hint: str, verbose: bool):
    """``convert(fn(*args))``, or None (after saying why when ``verbose``): the learner's exception or an
    answer of the wrong type is reported, never raised."""
    try:
        answer = fn(*args)
    except Exception as e:
        why = f"raised {type(e).__name__}: {e}"
    else:
        try:
            return convert(answer)
        except TypeError as e:
            why = f"returned the wrong type: {e}"
    if not verbose:
        return None
    print(f"fail: {call} {why}")
    for line in inputs:
        print(f"  {line}")
    print(f"hint: {hint}")


def report_failure(case: int, lines: Sequence[str], verbose: bool, hint: Callable[..., str], *hint_args
                   ) -> bool:
    """Print ``fail on case <case>:``, the indented ``lines`` and ``hint(*hint_args)`` (computed only when
    printed) when ``verbose``; return False."""
    if verbose:
        print(f"fail on case {case}:")
        for line in lines:
            print(f"  {line}")
        print(f"hint: {hint(*hint_args)}")
    return False
