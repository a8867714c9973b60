"""Exercise of notebook 03: the keys before a query tile that the tile sees (the kernel's tile schedule).

:func:`ancestor_keys` is the solution, :func:`check_ancestor_keys` the checker.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import torch

from ...trie import RolloutTrie
from .checking import random_rollouts


# ------------------------------------------------------------------------------------ ancestor keys
def ancestor_keys(subtree_end, q0: int) -> list[tuple[int, int]]:
    """Packed key ranges ``[(start, end), ...]`` (end exclusive, sorted, merged) that the query ``q0``
    sees before itself: every ``k < q0`` with ``subtree_end[k] > q0``.

    These are the tokens of the nodes on the path from the root to ``q0``'s node (the part of that
    node before ``q0`` included). A query ``q >= q0`` of the same tile sees a key ``k < q0`` only if
    ``q0`` does too (``k <= q0 <= q < subtree_end[k]`` needs ``subtree_end[k] > q0``), so these ranges
    are all a query tile starting at ``q0`` needs to visit to the left of its diagonal.
    """
    se = torch.as_tensor(subtree_end).reshape(-1)
    q0 = int(q0)
    if not 0 <= q0 < se.numel():
        raise ValueError(f"q0 must be a packed position in [0, {se.numel()}), got {q0}")
    seen = (se[:q0] > q0).tolist()
    ranges: list[tuple[int, int]] = []
    for k, visible in enumerate(seen):
        if not visible:
            continue
        if ranges and ranges[-1][1] == k:  # extends the current run
            ranges[-1] = (ranges[-1][0], k + 1)
        else:
            ranges.append((k, k + 1))
    return ranges


def _as_ranges(answer) -> list[tuple[int, int]]:
    """The learner's answer as a list of (start, end) int pairs, as given; TypeError on other shapes."""
    try:
        return [(int(a), int(b)) for a, b in answer]
    except (TypeError, ValueError) as e:
        raise TypeError(f"expected a list of (start, end) pairs, got {answer!r:.80}") from e


def _merged(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The keys of ``ranges`` as sorted, merged half-open ranges."""
    out: list[tuple[int, int]] = []
    for k in sorted(_keys(ranges)):
        if out and out[-1][1] == k:
            out[-1] = (out[-1][0], k + 1)
        else:
            out.append((k, k + 1))
    return out


def _keys(ranges: Sequence[tuple[int, int]]) -> set[int]:
    return {k for a, b in ranges for k in range(a, b)}


def _hint(subtree_end: list[int], q0: int, expected, got) -> str:
    extra, missing = _keys(got) - _keys(expected), _keys(expected) - _keys(got)
    lines = [f"  subtree_end[:q0 + 1] = {subtree_end[:q0 + 1]}  (later entries do not matter here)",
             f"  q0 = {q0}", f"  expected {expected}", f"  got      {got}"]
    if any(k >= q0 for k in extra):
        lines.append("hint: only keys before the tile count (k < q0); the diagonal tile is handled apart.")
    elif extra:
        k = min(extra)
        lines.append(
            f"hint: key {k} is not visible: subtree_end[{k}] = {subtree_end[k]} <= q0, so {k}'s subtree "
            "ends before the tile starts (a sibling branch)."
        )
    elif missing:
        k = min(missing)
        lines.append(
            f"hint: key {k} is visible: {k} < q0 and subtree_end[{k}] = {subtree_end[k]} > q0, so q0 lies "
            f"in {k}'s subtree. A key k < q0 is visible exactly when subtree_end[k] > q0."
        )
    else:
        lines.append("hint: the right keys, but return each run of consecutive keys as one range, in order "
                     f"(sorted, merged, no empty ranges): {_merged(got)}.")
    return "\n".join(lines)


def check_ancestor_keys(
    fn: Callable[[list[int], int], Sequence[tuple[int, int]]],
    *,
    trials: int = 40,
    seed: int | None = None,
    verbose: bool = True,
) -> bool:
    """Check ``fn(subtree_end, q0) -> [(start, end), ...]`` against :func:`ancestor_keys`.

    ``fn`` gets ``subtree_end`` as a list of ints and must return the half-open packed ranges of the
    keys ``k < q0`` that query ``q0`` sees, sorted and merged (each run of consecutive keys one range, as
    the kernel's schedule lists them). Runs on ``trials`` fresh random tries (``seed=None``: new ones
    every call), smallest first, with ``q0`` at tile starts and elsewhere, in increasing order, so the
    first failing case is a short one. Prints ``pass`` or ``fail`` with that case and a hint; returns the
    verdict.
    """
    rng = random.Random(seed)
    packs = sorted((RolloutTrie.from_sequences(random_rollouts(rng)).pack() for _ in range(trials)),
                   key=lambda p: p.num_tokens)
    cases = 0
    for pack in packs:
        se = pack.subtree_end.tolist()
        T = len(se)
        starts = {0, T - 1, rng.randrange(T)} | set(range(0, T, 8))
        for q0 in sorted(starts):
            expected = ancestor_keys(se, q0)
            try:
                got = _as_ranges(fn(list(se), q0))
            except Exception as e:  # the learner's bug, reported rather than raised
                if verbose:
                    print(f"fail: fn(subtree_end, q0={q0}) raised {type(e).__name__}: {e}")
                    print(f"  subtree_end[:q0 + 1] = {se[:q0 + 1]}")
                    print("hint: return a list of (start, end) pairs, end exclusive, e.g. [(0, 5), (9, 12)].")
                return False
            cases += 1
            if got != expected:
                if verbose:
                    print(f"fail on case {cases}:\n{_hint(se, q0, expected, got)}")
                return False
    if verbose:
        print(f"pass: {cases} query tiles on {trials} random tries")
    return True


__all__ = ["ancestor_keys", "check_ancestor_keys"]
