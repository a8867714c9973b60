"""Exercises of notebook 02 (DFS materialization): what the K/V stack holds, and the order of the walk.

The engine cuts a packed trie into blocks (:func:`treeattn_lab.engine.dfs.split_blocks`);
:func:`block_lists` hands them to a learner as two plain lists, ``parent`` (the block above, ``-1`` at
the top) and ``ranges`` (each block's packed ``(start, end)``), in walk (preorder) order.

- :func:`stack_positions` / :func:`check_stack_positions`: the packed positions whose K/V block ``x``
  reads from the stack when it runs (its prefix).
- :func:`dfs_events` / :func:`check_dfs_events`: the walk as ``("push" | "leaf" | "pop", block)`` events.

The checkers compare with the engine itself (the trace of :func:`treeattn_lab.lab.dfs_stepper.dfs_trace`
and :func:`treeattn_lab.engine.dfs.visit_order`) on fresh random tries cut into blocks of 1 to 5 tokens.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from ...engine.dfs import split_blocks, visit_order
from ...trie import RolloutTrie
from ..dfs_stepper import dfs_trace
from .checking import as_int_list, call_learner, random_rollout_case, report_failure

EVENTS = ("push", "leaf", "pop")


def block_lists(pack, block_tokens: int) -> tuple[list[int], list[tuple[int, int]]]:
    """``(parent, ranges)`` of the engine's blocks of ``pack``: block ``i`` holds packed positions
    ``ranges[i][0] .. ranges[i][1] - 1`` and hangs below block ``parent[i]`` (``-1``: a top block)."""
    blocks = split_blocks(pack, block_tokens)
    return [b.parent for b in blocks], [(b.start, b.end) for b in blocks]


# ------------------------------------------------------------------------------------ stack positions
def stack_positions(parent: Sequence[int], ranges: Sequence[tuple[int, int]], block: int) -> list[int]:
    """Packed positions whose keys and values ``block`` reads from the stack when it runs, sorted.

    The stack holds the K/V of the active path: every block above ``block``, up to the top, each pushed
    before the walk went down to it. Nothing else: a finished sibling branch has popped, a later one has
    not started, and the block's own K/V are computed in its own run (a push stores them as it goes).
    """
    out: list[int] = []
    above = parent[block]
    while above >= 0:
        start, end = ranges[above]
        out[:0] = range(start, end)  # ancestors come before their descendants in the pack
        above = parent[above]
    return out


def _owner(ranges, k: int) -> int:
    return next(i for i, (a, b) in enumerate(ranges) if a <= k < b)


def _ancestors(parent, block: int) -> list[int]:
    out, above = [], parent[block]
    while above >= 0:
        out.append(above)
        above = parent[above]
    return out


def _stack_hint(parent, ranges, block: int, expected: list[int], got: list[int]) -> str:
    extra, missing = sorted(set(got) - set(expected)), sorted(set(expected) - set(got))
    start, end = ranges[block]
    if any(start <= k < end for k in extra):
        return (
            f"block {block}'s own positions {start}..{end - 1} are not on the stack when it starts: its run "
            "computes them (a push stores them as it goes, a leaf never stores them)."
        )
    if extra and max(extra) >= end:
        return f"position {max(extra)} comes later in the walk: nothing after block {block} is computed yet."
    if extra:
        k = extra[0]
        j = _owner(ranges, k)
        return (
            f"position {k} belongs to block {j}, which is not above block {block}: its branch finished and "
            "popped before the walk reached this block. Only the blocks above it stay on the stack."
        )
    if len(got) != len(set(got)):
        return "each position appears once."
    if missing:
        k = missing[0]
        j = _owner(ranges, k)
        far = j != parent[block]
        where = "further up than the parent" if far else "its parent"
        path = sorted(_ancestors(parent, block))
        return (
            f"position {k} is in block {j}, {where}: the stack holds the whole path from the top block down "
            f"to block {block}'s parent ({len(expected)} positions, blocks {path})."
        )
    return "return the positions sorted, as a list of ints."


def check_stack_positions(
    fn: Callable[[list[int], list[tuple[int, int]], int], Sequence[int]],
    *,
    trials: int = 40,
    seed: int | None = None,
    verbose: bool = True,
) -> bool:
    """Check ``fn(parent, ranges, block) -> [packed positions]`` against the engine's stack.

    The expected answer is what the DFS engine's stack holds when ``block`` runs (the prefix of its event
    in :func:`~treeattn_lab.lab.dfs_stepper.dfs_trace`). Runs ``trials`` fresh random tries (``seed=None``:
    new ones every call), a few blocks each; any order of the positions is accepted. Prints ``pass`` or
    ``fail`` with the failing case and a hint; returns the verdict.
    """
    rng = random.Random(seed)
    cases = 0
    for case in range(1, trials + 1):
        pack = RolloutTrie.from_sequences(random_rollout_case(rng, case)).pack(
            order=rng.choice(["insertion", "size"])
        )
        block_tokens = rng.randint(1, 5)
        parent, ranges = block_lists(pack, block_tokens)
        prefix = {b: step.prefix_positions for step in dfs_trace(pack, block_tokens) for b in step.blocks}
        deepest = max(range(len(parent)), key=lambda b: len(prefix[b]))
        for block in sorted({deepest, rng.randrange(len(parent)), rng.randrange(len(parent))}):
            expected = prefix[block]
            inputs = [f"parent = {parent}", f"ranges = {ranges}", f"block  = {block}"]
            got = call_learner(
                fn,
                (list(parent), [tuple(r) for r in ranges], block),
                as_int_list,
                call="fn(parent, ranges, block)",
                inputs=inputs,
                hint="return a list of ints: the packed positions on the stack when the block runs.",
                verbose=verbose,
            )
            if got is None:
                return False
            cases += 1
            if sorted(got) != expected or len(got) != len(expected):
                lines = [*inputs, f"expected {expected}", f"got      {sorted(got)}"]
                hint_args = (parent, ranges, block, expected, got)
                return report_failure(cases, lines, verbose, _stack_hint, *hint_args)
    if verbose:
        print(f"pass: {cases} blocks of {trials} random tries")
    return True


# ------------------------------------------------------------------------------------ walk order
def dfs_events(parent: Sequence[int]) -> list[tuple[str, int]]:
    """The DFS walk over blocks given by ``parent`` (in preorder): ``("push", b)`` for a block with children
    before its subtree and ``("pop", b)`` after it, ``("leaf", b)`` for a block without children.

    Children are taken in block order (the pack's order). A block pops only once all of its children are
    done, because its gradient buffer must hold every gradient they send back before it runs backward.
    """
    children: list[list[int]] = [[] for _ in parent]
    tops = []
    for b, p in enumerate(parent):
        (children[p] if p >= 0 else tops).append(b)

    events: list[tuple[str, int]] = []

    def walk(b: int) -> None:
        if not children[b]:
            events.append(("leaf", b))
            return
        events.append(("push", b))
        for c in children[b]:
            walk(c)
        events.append(("pop", b))

    for b in tops:
        walk(b)
    return events


def _as_events(answer) -> list[tuple[str, int]]:
    try:
        events = [(str(e), int(b)) for e, b in answer]
    except (TypeError, ValueError) as e:
        raise TypeError(f"expected a list of (event, block) pairs, got {answer!r:.80}") from e
    return events


def _events_hint(parent, expected: list[tuple[str, int]], got: list[tuple[str, int]]) -> str:
    with_children = {p for p in parent if p >= 0}
    bad = next((e for e, _ in got if e not in EVENTS), None)
    if bad is not None:
        return f"{bad!r} is no event: use 'push', 'leaf' and 'pop'."
    k = next((i for i, (a, b) in enumerate(zip(expected, got, strict=False)) if a != b), None)
    if k is None:
        return (
            f"{len(expected)} events expected, {len(got)} given: a block with children appears twice "
            "(push, then pop), every other block once (leaf)."
        )
    event, b = got[k]
    if event in ("push", "pop") and b not in with_children:
        return (
            f"block {b} has no children: it is a leaf, run once with autograd; nothing is pushed or popped."
        )
    if event == "leaf" and b in with_children:
        return f"block {b} has children: push it before them and pop it after them."
    want_event, want_block = expected[k]
    if event == "pop":
        return (
            f"block {b} pops too early (event {k}): a block pops once every block below it is done, so that "
            "its buffer holds all their gradients."
        )
    if want_event == "pop":
        return (
            f"event {k} should pop block {want_block}: its children are all done, and the walk finishes a "
            "branch before it starts the next."
        )
    return (
        f"event {k}: expected {expected[k]}, got {got[k]}. Visit children in block order (the pack's order), "
        "depth first: a whole branch before its next sibling."
    )


def check_dfs_events(
    fn: Callable[[list[int]], Sequence[tuple[str, int]]],
    *,
    trials: int = 40,
    seed: int | None = None,
    verbose: bool = True,
) -> bool:
    """Check ``fn(parent) -> [(event, block), ...]`` against the engine's walk
    (:func:`treeattn_lab.engine.dfs.visit_order`) on ``trials`` fresh random tries cut into blocks.

    ``fn`` gets ``parent`` (a list of ints, blocks in preorder, ``-1`` above the top blocks) and returns the
    events in order: ``"push"`` / ``"pop"`` for blocks with children, ``"leaf"`` for the others. Prints
    ``pass`` or ``fail`` with the failing case and a hint; returns the verdict.
    """
    rng = random.Random(seed)
    for case in range(1, trials + 1):
        pack = RolloutTrie.from_sequences(random_rollout_case(rng, case)).pack(
            order=rng.choice(["insertion", "size"])
        )
        blocks = split_blocks(pack, rng.randint(1, 5))
        parent = [b.parent for b in blocks]
        expected = list(visit_order(blocks))
        got = call_learner(
            fn,
            (list(parent),),
            _as_events,
            call="fn(parent)",
            inputs=[f"parent = {parent}"],
            hint="return a list of (event, block) pairs, e.g. [('push', 0), ('leaf', 1), ('pop', 0)].",
            verbose=verbose,
        )
        if got is None:
            return False
        if got != expected:
            lines = [f"parent = {parent}", f"expected {expected}", f"got      {got}"]
            return report_failure(case, lines, verbose, _events_hint, parent, expected, got)
    if verbose:
        print(f"pass: {trials} random tries")
    return True


__all__ = [
    "block_lists",
    "check_dfs_events",
    "check_stack_positions",
    "dfs_events",
    "stack_positions",
]
