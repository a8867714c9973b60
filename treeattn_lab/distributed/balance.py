"""Balancing a rollout trie over K ranks: which rollouts each rank trains, and what it pays for them.

Data-parallel training on tries: rank r builds the trie of *its own* rollouts, runs
:func:`treeattn_lab.engine.tree_backward` on it, and the gradients are summed over the ranks. So rank r's
work is the cost of its own trie: a prefix shared by rollouts that sit on two ranks is computed on both
(it is *replicated*). The step takes as long as the busiest rank: the **makespan**; **imbalance** is
makespan / mean rank cost.

This module is the entry point: :func:`balance` partitions a trie with one of the
:data:`PARTITIONERS` (:mod:`.partitioners`) under a cost (:class:`TokenCost` or :class:`EngineCost`,
:mod:`.costs`) and returns a :class:`BalanceReport`: each rank's :class:`RankShare` (its rollouts, its own
trie, the engine's micro-batches of it, their exact costs) and the partition's makespan, imbalance,
replication and lower bound. :func:`partition` returns the rollout indices alone. Everything is
deterministic, so every rank of a job computes the same partition.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from ..checks import check_int
from ..engine.microbatch import MicroBatch
from ..trie import RolloutTrie
from .costs import CostTree, EngineCost, TokenCost
from .partitioners import (
    ANCHOR,
    BEST,
    PARTITIONERS,
    contiguous_dfs,
    greedy_tokens,
    lpt_split,
    subtree_search,
)


# =============================================================================================== report
@dataclass(frozen=True)
class RankShare:
    """What one rank trains: its rollouts, its own trie, the engine's micro-batches of it, the cost."""

    rank: int
    sequences: tuple[int, ...]  # global rollout indices, in the DFS order of the whole trie
    trie: RolloutTrie | None = field(repr=False)  # sequence j of it is sequences[j]; None if no rollouts
    micro_batches: tuple[MicroBatch, ...] = field(repr=False)  # their .sequences are global indices
    micro_batch_costs: tuple[float, ...]
    cost: float  # predicted, in the cost's unit
    tree_tokens: int  # tokens of the rank's trie
    carried_tokens: int  # prefix tokens computed again because a micro-batch cut them
    host_bound: int = 0  # micro-batches the cost model predicts host-bound (EngineCost; 0 under tokens)


@dataclass(frozen=True)
class BalanceReport:
    """A partition of a trie over ranks and how good it is.

    ``makespan`` = the busiest rank's cost; ``imbalance`` = makespan / mean rank cost (1 is perfect);
    ``replicated_tokens`` = tokens computed on more than one rank, counted once per extra copy (sum of the
    ranks' trie tokens minus the whole trie's); ``lower_bound`` = max(total / K, costliest rollout) under
    the surrogate (equal to the exact cost under TokenCost without a token budget).
    """

    partitioner: str
    unit: str
    shares: tuple[RankShare, ...]
    total_tree_tokens: int
    lower_bound: float
    token_budget: int | None
    seconds: float  # time the partitioner took (surrogate costs included)
    exact: bool = True  # costs from the engine's micro-batches (False: from the surrogate)

    @property
    def num_ranks(self) -> int:
        return len(self.shares)

    @property
    def costs(self) -> list[float]:
        return [s.cost for s in self.shares]

    @property
    def makespan(self) -> float:
        return max(self.costs)

    @property
    def mean_cost(self) -> float:
        return sum(self.costs) / self.num_ranks

    @property
    def imbalance(self) -> float:
        mean = self.mean_cost
        return self.makespan / mean if mean > 0 else 1.0

    @property
    def replicated_tokens(self) -> int:
        return sum(s.tree_tokens for s in self.shares) - self.total_tree_tokens

    @property
    def carried_tokens(self) -> int:
        return sum(s.carried_tokens for s in self.shares)

    def rank_of_sequence(self) -> list[int]:
        out = [0] * sum(len(s.sequences) for s in self.shares)
        for s in self.shares:
            for i in s.sequences:
                out[i] = s.rank
        return out

    def node_ranks(self, trie: RolloutTrie) -> dict[int, tuple[int, ...]]:
        """Node id of ``trie`` -> the ranks that compute it (several where it is replicated)."""
        ranks: dict[int, set[int]] = {}
        for s in self.shares:
            for i in s.sequences:
                for v in trie.path(trie.seq_end_node[i]):
                    ranks.setdefault(v, set()).add(s.rank)
        return {v: tuple(sorted(r)) for v, r in ranks.items()}

    def row(self) -> dict:
        """A flat dict for tables and plots."""
        return {
            "partitioner": self.partitioner,
            "num_ranks": self.num_ranks,
            "unit": self.unit,
            "makespan": self.makespan,
            "mean_cost": self.mean_cost,
            "imbalance": self.imbalance,
            "lower_bound": self.lower_bound,
            "makespan_over_bound": self.makespan / self.lower_bound if self.lower_bound > 0 else 1.0,
            "replicated_tokens": self.replicated_tokens,
            "replicated_fraction": self.replicated_tokens / self.total_tree_tokens,
            "carried_tokens": self.carried_tokens,
            "micro_batches": [len(s.micro_batches) for s in self.shares],
            "host_bound_micro_batches": [s.host_bound for s in self.shares],
            "token_budget": self.token_budget,
            "partition_s": self.seconds,
        }


# ============================================================================================ entry point
def _check_cost(cost) -> None:
    if not all(hasattr(cost, name) for name in ("surrogate", "plan", "micro_batch_terms", "unit")):
        raise TypeError(f"cost must be a TokenCost or an EngineCost, got {type(cost).__name__}")


@contextlib.contextmanager
def _one_thread():
    """Run torch on one thread for a while: the search makes many tiny tensor ops, which intra-op threads
    slow down, and one thread sums in a fixed order on every rank."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _partition(trie, num_ranks, partitioner, cost, token_budget) -> tuple[CostTree, list[list[int]]]:
    if not isinstance(trie, RolloutTrie):
        raise TypeError(f"trie must be a RolloutTrie, got {type(trie).__name__}")
    check_int("num_ranks", num_ranks)
    check_int("token_budget", token_budget, allow_none=True)
    if not isinstance(partitioner, str) or partitioner not in PARTITIONERS:
        raise ValueError(f"unknown partitioner {partitioner!r}; choose one of {sorted(PARTITIONERS)}")
    _check_cost(cost)
    tree = CostTree.of(trie, cost, token_budget)
    with _one_thread():
        groups = PARTITIONERS[partitioner](tree, num_ranks)
    return tree, [sorted(g, key=lambda i: tree.dfs_rank[i]) for g in groups]


def partition(
    trie: RolloutTrie, num_ranks: int, partitioner: str = BEST, *, cost=None, token_budget: int | None = None
) -> list[list[int]]:
    """Rollout indices per rank (each in the trie's DFS order); every rollout on exactly one rank."""
    return _partition(trie, num_ranks, partitioner, TokenCost() if cost is None else cost, token_budget)[1]


def rank_share(
    trie: RolloutTrie, rank: int, sequences: Sequence[int], *, cost=None, token_budget: int | None = None
) -> RankShare:
    """Rank ``rank``'s trie of ``sequences`` (global indices) and the engine's micro-batches of it, costed."""
    cost = TokenCost() if cost is None else cost
    sequences = tuple(sequences)
    if not sequences:
        return RankShare(rank, (), None, (), (), 0.0, 0, 0)
    local = RolloutTrie.from_sequences([trie.sequence(i) for i in sequences])
    mbs, costs, host_bound = [], [], 0
    for mb in cost.plan(local, token_budget):
        seconds, waits_on_host = cost.micro_batch_terms(mb, token_budget)
        costs.append(float(seconds))
        host_bound += bool(waits_on_host)
        mbs.append(replace(mb, sequences=tuple(sequences[j] for j in mb.sequences)))
    tree_tokens = sum(len(n.tokens) for n in local.nodes)
    return RankShare(
        rank,
        sequences,
        local,
        tuple(mbs),
        tuple(costs),
        sum(costs),
        tree_tokens,
        sum(mb.carried_tokens for mb in mbs),
        host_bound,
    )


def balance(
    trie: RolloutTrie,
    num_ranks: int,
    partitioner: str = BEST,
    *,
    cost=None,
    token_budget: int | None = None,
    exact: bool = True,
) -> BalanceReport:
    """Partition ``trie`` over ``num_ranks`` ranks with ``partitioner`` and report the result.

    ``cost``: :class:`TokenCost` (default) or :class:`EngineCost`; ``token_budget``: tree tokens per
    micro-batch, as given to ``tree_backward``. ``exact=False`` skips building the ranks' tries and costs
    each rank with the surrogate instead (fast, for large simulations; identical under TokenCost without a
    token budget), leaving ``trie`` and ``micro_batches`` of the shares empty.
    """
    cost = TokenCost() if cost is None else cost
    start = time.perf_counter()
    tree, groups = _partition(trie, num_ranks, partitioner, cost, token_budget)
    seconds = time.perf_counter() - start
    if exact:
        shares = tuple(
            rank_share(trie, r, g, cost=cost, token_budget=token_budget) for r, g in enumerate(groups)
        )
    else:
        tokens = CostTree.of(trie, TokenCost())
        shares = tuple(
            RankShare(r, tuple(g), None, (), (), tree.cost(g), int(tokens.cost(g)), 0)
            for r, g in enumerate(groups)
        )
    total_tree_tokens = sum(len(n.tokens) for n in trie.nodes)
    return BalanceReport(
        partitioner,
        cost.unit,
        shares,
        total_tree_tokens,
        tree.lower_bound(num_ranks),
        token_budget,
        seconds,
        exact,
    )


__all__ = [
    "ANCHOR",
    "BEST",
    "PARTITIONERS",
    "BalanceReport",
    "CostTree",
    "EngineCost",
    "RankShare",
    "TokenCost",
    "balance",
    "contiguous_dfs",
    "greedy_tokens",
    "lpt_split",
    "partition",
    "rank_share",
    "subtree_search",
]
