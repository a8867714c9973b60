"""Dynamic micro-batching: cut a rollout trie into micro-batches of neighbouring rollouts.

Rollouts are taken in DFS order of the trie (a rollout that is a prefix of another comes first), which
places rollouts with long common prefixes next to each other. A micro-batch grows while its own trie
stays within ``token_budget`` tree tokens; adding rollout s costs ``len(s) - lcp(previous, s)`` tokens,
because in DFS order the longest prefix s shares with any rollout already in the micro-batch is the one it
shares with its predecessor. So subtrees stay together, and a subtree larger than the budget is cut
between two of its rollouts: the next micro-batch computes their common prefix again, which is counted as
``carried_tokens``. A rollout longer than the budget gets a micro-batch of its own (the DFS engine then
splits it into blocks). Every rollout lands in exactly one micro-batch, so every token's loss is counted
exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..checks import check_int
from ..trie import RolloutTrie


@dataclass(frozen=True)
class MicroBatch:
    """Rollouts ``sequences`` (global indices, DFS order) and the trie they form."""

    sequences: tuple[int, ...]
    trie: RolloutTrie = field(repr=False)
    carried_tokens: int  # prefix tokens shared with the previous micro-batch, computed again here

    @property
    def flat_tokens(self) -> int:
        return sum(self.trie.seq_lengths)

    @property
    def tree_tokens(self) -> int:
        return sum(len(n.tokens) for n in self.trie.nodes)


def dfs_sequence_order(trie: RolloutTrie) -> list[int]:
    """Sequence indices in DFS preorder of their end nodes (ties: insertion order)."""
    return [i for node in trie.preorder() for i in trie.nodes[node].ends]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def plan_micro_batches(trie: RolloutTrie, token_budget: int | None = None) -> list[MicroBatch]:
    """Micro-batches of at most ``token_budget`` tree tokens each (``None``: the whole trie as one)."""
    if not isinstance(trie, RolloutTrie):
        raise TypeError(f"trie must be a RolloutTrie, got {type(trie).__name__}")
    check_int("token_budget", token_budget, allow_none=True)
    order = dfs_sequence_order(trie)
    seqs = {i: trie.sequence(i) for i in order}
    groups: list[tuple[list[int], int]] = []  # (sequence ids, carried tokens)
    used, previous = 0, None
    for i in order:
        shared = _common_prefix(seqs[previous], seqs[i]) if previous is not None else 0
        extra = len(seqs[i]) - shared
        if groups and (token_budget is None or used + extra <= token_budget):
            groups[-1][0].append(i)
            used += extra
        else:
            groups.append(([i], shared))
            used = len(seqs[i])
        previous = i
    return [
        MicroBatch(tuple(ids), RolloutTrie.from_sequences([seqs[i] for i in ids]), carried)
        for ids, carried in groups
    ]
