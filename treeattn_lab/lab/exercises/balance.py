"""Exercise of notebook 04: cut rollouts in DFS order into K contiguous ranges with the smallest makespan.

A range of rollouts costs the tokens of *its own* trie (shared prefixes once per range), and the
makespan is the costliest range. In DFS order (``sorted(seqs)`` is one) a rollout adds to its range only
the tokens after its longest common prefix with the previous rollout, which is what makes the anchor's
binary search plus greedy fill work.

:func:`contiguous_cuts` is the solution, :func:`check_contiguous_cuts` the checker (it compares the
makespan with the library's :func:`treeattn_lab.distributed.balance.contiguous_dfs`).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from itertools import pairwise

from ...trie import RolloutTrie


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def range_tokens(seqs: Sequence[Sequence[int]]) -> int:
    """Tokens of the trie of ``seqs``: each distinct non-empty prefix once."""
    return len({tuple(s[: i + 1]) for s in seqs for i in range(len(s))})


def contiguous_cuts(seqs: Sequence[Sequence[int]], num_ranks: int) -> list[int]:
    """Cut points ``0 < c_1 < ... < c_m < len(seqs)`` (m < num_ranks) of the contiguous split of ``seqs``
    (in DFS order) whose costliest range has the fewest trie tokens.

    Binary search on the makespan T: for a given T, fill ranges greedily (a rollout joins the current
    range while the range stays within T, else it opens the next one) and count the ranges.
    """
    added = [len(seqs[0])] + [len(s) - _common_prefix(p, s) for p, s in pairwise(seqs)]

    def greedy_cuts(limit: int) -> list[int]:
        cuts, used = [], len(seqs[0])
        for i in range(1, len(seqs)):
            if used + added[i] <= limit:
                used += added[i]
            else:  # a new range computes the whole rollout again, shared prefix included
                cuts.append(i)
                used = len(seqs[i])
        return cuts

    lo, hi = max(len(s) for s in seqs), sum(added)  # one range costs at most the whole trie
    while lo < hi:
        mid = (lo + hi) // 2
        if len(greedy_cuts(mid)) < num_ranks:
            hi = mid
        else:
            lo = mid + 1
    return greedy_cuts(lo)


def makespan_of_cuts(seqs: Sequence[Sequence[int]], cuts: Sequence[int]) -> int:
    """The costliest range's trie tokens."""
    bounds = [0, *cuts, len(seqs)]
    return max(range_tokens(seqs[a:b]) for a, b in pairwise(bounds))


def optimal_makespan(seqs: Sequence[Sequence[int]], num_ranks: int) -> int:
    """The library's anchor partitioner on the same rollouts (an independent implementation)."""
    from ...distributed.balance import CostTree, contiguous_dfs

    tree = CostTree.of(RolloutTrie.from_sequences(list(seqs)))
    return int(max(tree.cost(g) for g in contiguous_dfs(tree, num_ranks) if g))


# ------------------------------------------------------------------------------------ random cases
def _random_case(rng: random.Random, case: int) -> tuple[list[list[int]], int]:
    """GRPO- and tree-search-shaped rollouts in DFS (sorted) order, growing with ``case``; K ranks."""
    seqs = []
    for _ in range(rng.randint(1, 2 + case // 8)):
        prompt = [rng.randrange(1, 9) for _ in range(rng.randint(1, 4 + case // 4))]
        for _ in range(rng.randint(1, 4)):
            branch = prompt + [rng.randrange(9, 20) for _ in range(rng.randint(0, 6))]
            seqs += [
                branch + [rng.randrange(20, 99) for _ in range(rng.randint(1, 8))]
                for _ in range(rng.randint(1, 3))
            ]
    if rng.random() < 0.2:
        seqs.append(list(rng.choice(seqs)))  # a duplicate
    if rng.random() < 0.2:
        base = rng.choice(seqs)
        seqs.append(base[: rng.randint(1, len(base))])  # a rollout that is a prefix of another
    return sorted(seqs), rng.randint(1, min(6, len(seqs) + 1))


def _as_cuts(answer, n: int) -> list[int]:
    try:
        cuts = [int(c) for c in answer]
    except TypeError as e:
        raise TypeError(f"expected a list of ints, got {answer!r:.60}") from e
    if cuts != sorted(set(cuts)):
        raise ValueError(f"cut points must be strictly increasing, got {cuts}")
    if cuts and (cuts[0] <= 0 or cuts[-1] >= n):
        raise ValueError(f"cut points must lie in 1..{n - 1} (between rollouts), got {cuts}")
    return cuts


def _hint(seqs, k: int, cuts: list[int], got: int, best: int) -> str:
    flat = [len(s) for s in seqs]
    bounds = [0, *cuts, len(seqs)]
    flat_makespan = max(sum(flat[a:b]) for a, b in pairwise(bounds))
    if got == flat_makespan and got != best:
        return (
            "your ranges look balanced in flat tokens: a range computes its shared prefixes once, so a "
            "rollout adds only len(s) - lcp(previous, s) tokens."
        )
    return (
        "a smaller makespan exists. Binary search the makespan T between the longest rollout and the "
        "whole trie, fill ranges greedily for each T, and keep the smallest T needing at most K ranges."
    )


def check_contiguous_cuts(
    fn: Callable[[list[list[int]], int], Sequence[int]],
    *,
    trials: int = 60,
    seed: int | None = None,
    verbose: bool = True,
) -> bool:
    """Check ``fn(seqs, num_ranks) -> cut points`` on fresh random cases (``seed=None``: new ones each
    call): the cuts must make at most ``num_ranks`` non-empty contiguous ranges whose costliest range has
    the optimal number of trie tokens. Prints ``pass``, or ``fail`` with the first failing case and a hint;
    returns the verdict (never raises)."""
    rng = random.Random(seed)
    fixed = [
        ([[1, 2, 3], [1, 2, 4], [5, 6]], 2),
        ([[1, 2]], 1),
        ([[1], [1, 2], [1, 2, 3]], 3),
        ([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6, 7], [1, 8, 9, 10]], 2),
    ]
    cases = fixed + [_random_case(rng, case) for case in range(1, trials + 1)]
    for i, (seqs, k) in enumerate(cases):
        best = optimal_makespan(seqs, k)
        problem = None
        try:
            cuts = _as_cuts(fn([list(s) for s in seqs], k), len(seqs))
        except Exception as e:  # the learner's bug, reported rather than raised
            problem = f"fn(seqs, {k}) raised or returned something unusable: {type(e).__name__}: {e}"
            hint = "return a sorted list of cut points c (0 < c < len(seqs)); range j is seqs[c_j-1:c_j]."
        else:
            if len(cuts) >= k:
                problem = f"{len(cuts)} cut points make {len(cuts) + 1} ranges for {k} rank(s)"
                hint = "K ranks take at most K - 1 cut points."
            else:
                got = makespan_of_cuts(seqs, cuts)
                if got != best:
                    problem = f"your cuts {cuts} give a makespan of {got} tokens; the best is {best}"
                    hint = _hint(seqs, k, cuts, got, best)
        if problem is not None:
            if verbose:
                print(f"fail on case {i + 1}: {problem}")
                print(f"  seqs = {seqs}\n  num_ranks = {k}")
                print(f"hint: {hint}")
            return False
    if verbose:
        print(f"pass: {len(cases)} cases")
    return True


__all__ = ["check_contiguous_cuts", "contiguous_cuts", "makespan_of_cuts", "range_tokens"]
