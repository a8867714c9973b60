"""Exercises on rollout tries: how many tokens a trie stores (notebook 00), and ``subtree_end`` computed
from the trie's nodes (notebook 01).

- :func:`tree_tokens` / :func:`check_tree_tokens`: the tokens a prefix trie stores = the distinct
  non-empty prefixes of the rollouts.
- :func:`subtree_end_from_nodes` / :func:`check_subtree_end`: the packed layout's one mask vector, from
  each node's parent and token count in DFS preorder. :func:`pack_nodes` gives those two lists of a pack.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from ...trie import RolloutTrie
from .checking import as_count, as_int_list, call_learner, random_rollout_case, report_failure


# ------------------------------------------------------------------------------------ tree tokens
def tree_tokens(seqs: Sequence[Sequence[int]]) -> int:
    """Tokens a prefix trie of ``seqs`` stores: each distinct non-empty prefix once.

    A token of a rollout is stored once per distinct prefix ending in it, so two rollouts share a token
    exactly when they agree on everything up to and including it. Equals
    ``RolloutTrie.from_sequences(seqs).stats()["tree_tokens"]``.
    """
    return len({tuple(s[: i + 1]) for s in seqs for i in range(len(s))})


def _tree_tokens_hint(seqs: list[list[int]], expected: int, got: int) -> str:
    flat = sum(len(s) for s in seqs)
    distinct_ids = len({t for s in seqs for t in s})
    distinct_seqs = {tuple(s) for s in seqs}
    if got == flat:
        return "that is the flat count: a prefix shared by several rollouts is stored once in a trie."
    if got == distinct_ids and got != expected:
        return (
            "that counts distinct token ids; the same id at two places of the tree (after different "
            "prefixes) is two stored tokens. Count distinct prefixes instead."
        )
    if got == sum(len(s) for s in distinct_seqs):
        return "duplicates are gone, but rollouts that share only a prefix still share those tokens."
    if got > expected:
        return "too many: every token shared by rollouts with the same prefix up to it is stored once."
    return (
        "too few: a token is shared only when the *whole* prefix up to it agrees; the same token after "
        "different prefixes is stored twice."
    )


def check_tree_tokens(
    fn: Callable[[list[list[int]]], int], *, trials: int = 40, seed: int | None = None, verbose: bool = True
) -> bool:
    """Check ``fn(rollouts) -> int``, the number of tokens a trie of the rollouts stores.

    ``fn`` gets a fresh list of lists of ints each time. Runs on ``trials`` random batches of rollouts
    (``seed=None``: new ones every call) with forks, duplicates and rollouts that are prefixes of others.
    Prints ``pass`` or ``fail`` with the failing case and a hint; returns the verdict.
    """
    rng = random.Random(seed)
    for case in range(1, trials + 1):
        seqs = random_rollout_case(rng, case)
        expected = RolloutTrie.from_sequences(seqs).stats()["tree_tokens"]
        got = call_learner(
            fn,
            ([list(s) for s in seqs],),
            as_count,
            call="fn(rollouts)",
            inputs=[f"rollouts = {seqs}"],
            hint="return one int: the number of tokens the trie stores.",
            verbose=verbose,
        )
        if got is None:
            return False
        if got != expected:
            lines = [f"rollouts = {seqs}", f"expected {expected}", f"got      {got}"]
            return report_failure(case, lines, verbose, _tree_tokens_hint, seqs, expected, got)
    if verbose:
        print(f"pass: {trials} random batches of rollouts")
    return True


# ------------------------------------------------------------------------------------ subtree end
def pack_nodes(pack) -> tuple[list[int], list[int]]:
    """``(parent, num_tokens)`` of a :class:`TreePack`'s nodes, numbered in the pack's DFS preorder.

    Node 0 is the root (``parent[0] == -1``, no tokens); node ``n``'s tokens are the ``num_tokens[n]``
    packed positions after those of nodes ``0..n-1``.
    """
    start, end = pack.node_start.tolist(), pack.node_end.tolist()
    order = sorted(range(len(start)), key=lambda n: (start[n], n != 0))  # root first, then by position
    rank = {n: i for i, n in enumerate(order)}
    old_parent = pack.node_parent.tolist()
    parent = [-1 if old_parent[n] < 0 else rank[old_parent[n]] for n in order]
    return parent, [end[n] - start[n] for n in order]


def subtree_end_from_nodes(parent: Sequence[int], num_tokens: Sequence[int]) -> list[int]:
    """``subtree_end`` of every packed token, from the nodes in DFS preorder (as :func:`pack_nodes`).

    Three sweeps: node ``n`` starts where node ``n - 1`` ends (a running sum of token counts); walking
    the nodes backwards, each adds its subtree's tokens to its parent's (children come after their parent
    in preorder, so a node's total is complete when it is reached); a node's subtree then ends at its start
    plus its subtree total, and each of its tokens gets that value.
    """
    parent, num_tokens = as_int_list(parent), as_int_list(num_tokens)
    if len(parent) != len(num_tokens) or not parent:
        raise ValueError(
            "parent and num_tokens must be non-empty lists of one length, "
            f"got {len(parent)} and {len(num_tokens)}"
        )
    if parent[0] != -1 or num_tokens[0] != 0:
        raise ValueError("node 0 must be the root: parent[0] == -1 and num_tokens[0] == 0")
    if min(num_tokens) < 0:
        raise ValueError(f"num_tokens holds a negative count: {min(num_tokens)}")
    path = [0]  # in DFS preorder, a node's parent lies on the path from the root to the node before it
    for n in range(1, len(parent)):
        while path and path[-1] != parent[n]:
            path.pop()
        if not path:
            raise ValueError(
                f"nodes are not in DFS preorder: node {n}'s parent {parent[n]} is not on the path "
                f"from the root to node {n - 1}"
            )
        path.append(n)
    start, starts = 0, []
    for n in range(len(parent)):
        starts.append(start)
        start += num_tokens[n]
    subtree = list(num_tokens)
    for n in range(len(parent) - 1, 0, -1):
        subtree[parent[n]] += subtree[n]
    return [starts[n] + subtree[n] for n in range(len(parent)) for _ in range(num_tokens[n])]


def _subtree_end_hint(parent, num_tokens, expected: list[int], got: list[int]) -> str:
    T = len(expected)
    if len(got) != T:
        per_node = len(got) == len(parent) or len(got) == len(parent) - 1
        what = "one per node" if per_node else f"{len(got)} values"
        return f"one value per packed token: T = sum(num_tokens) = {T} values, you gave {what}."
    k = next(i for i in range(T) if got[i] != expected[i])
    node = next(n for n in range(len(parent)) if sum(num_tokens[: n + 1]) > k)
    own_end = sum(num_tokens[: node + 1])
    where = f"at packed position {k} (node {node}): expected {expected[k]}, got {got[k]}. "
    if abs(got[k] - expected[k]) == 1:
        return where + "subtree_end is exclusive: the first position *after* the subtree."
    if got[k] == own_end and expected[k] > own_end:
        return where + (
            f"that is where node {node}'s own tokens end; its subtree goes on through its descendants, "
            "which follow it in preorder."
        )
    if got[k] > expected[k]:
        return where + (
            f"too far: positions {expected[k]}..{got[k] - 1} belong to a sibling branch (or a later tree), "
            f"which position {k} cannot see."
        )
    return where + f"too short: position {expected[k] - 1} is still in node {node}'s subtree (a descendant)."


def check_subtree_end(
    fn: Callable[[list[int], list[int]], Sequence[int]],
    *,
    trials: int = 40,
    seed: int | None = None,
    verbose: bool = True,
) -> bool:
    """Check ``fn(parent, num_tokens) -> subtree_end`` against ``trie.pack().subtree_end``.

    ``fn`` gets the nodes of a packed trie in DFS preorder (:func:`pack_nodes`): ``parent[n]`` (``-1``
    for the root, node 0, which holds no tokens) and ``num_tokens[n]``, as lists of ints, and must return
    one exclusive end per packed token. Runs on ``trials`` fresh random tries (``seed=None``: new ones
    every call), packed in either child order. Prints ``pass`` or ``fail`` with a hint; returns the verdict.
    """
    rng = random.Random(seed)
    for case in range(1, trials + 1):
        trie = RolloutTrie.from_sequences(random_rollout_case(rng, case))
        pack = trie.pack(order=rng.choice(["insertion", "size"]))
        parent, num_tokens = pack_nodes(pack)
        expected = pack.subtree_end.tolist()
        inputs = [f"parent     = {parent}", f"num_tokens = {num_tokens}"]
        got = call_learner(
            fn,
            (list(parent), list(num_tokens)),
            as_int_list,
            call="fn(parent, num_tokens)",
            inputs=inputs,
            hint=f"return a list of {len(expected)} ints, one exclusive end per packed token.",
            verbose=verbose,
        )
        if got is None:
            return False
        if got != expected:
            lines = [*inputs, f"expected {expected}", f"got      {got}"]
            return report_failure(case, lines, verbose, _subtree_end_hint, parent, num_tokens, expected, got)
    if verbose:
        print(f"pass: {trials} random tries")
    return True


__all__ = [
    "check_subtree_end",
    "check_tree_tokens",
    "pack_nodes",
    "subtree_end_from_nodes",
    "tree_tokens",
]
