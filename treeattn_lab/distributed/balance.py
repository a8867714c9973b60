"""Balancing a rollout trie over K ranks: which rollouts each rank trains, and what it pays for them.

Data-parallel training on tries: rank r builds the trie of *its own* rollouts, runs
:func:`treeattn_lab.engine.tree_backward` on it, and the gradients are summed over the ranks. So rank r's
work is the cost of its own trie: a prefix shared by rollouts that sit on two ranks is computed on both
(it is *replicated*). A partition trades balance (every rank equally busy, so nobody waits at the
all-reduce) against replication (each split of a subtree computes its prefix once more). The step takes as
long as the busiest rank: the **makespan**; **imbalance** is makespan / mean rank cost.

Costs
-----
A cost says what a rank pays for its rollouts, evaluated on the micro-batches the engine will run on that
rank (:func:`treeattn_lab.engine.plan_micro_batches` of the rank's trie):

- :class:`TokenCost` (the default): the tokens the rank computes, i.e. the tree tokens of its micro-batches
  (a prefix carried over a micro-batch cut is counted again, as the engine computes it again).
- :class:`EngineCost`: the seconds the engine's :class:`~treeattn_lab.engine.CostModel` predicts for each
  micro-batch in the mode ``tree_backward`` runs it in (``"auto"``: the model's own choice), so the
  prediction here is the very number the engine reports in ``report.predicted_s``.

The partitioners search with an additive **surrogate** of the cost (:class:`CostTree`), which they can
update along one root path at a time:

    cost(S) = sum of node_cost[v] over the nodes v on the paths of the rollouts in S (each node once)
            + sum of rollout_cost[i] over the rollouts i in S

Tokens: ``node_cost`` = the node's token count (exact without a token budget). A tree mode of a cost
model: its per-token and per-attended-pair coefficients applied to the node's tokens (DFS: twice for a
node with children, which is pushed without grad and recomputed). Flat mode: ``rollout_cost`` = each
rollout's own tokens and causal pairs. Reports are always evaluated with the exact cost.

Partitioners (:data:`PARTITIONERS`)
-----------------------------------
- ``"greedy_tokens"``: the tree-blind baseline: rollouts by decreasing stand-alone cost (their length,
  under tokens), each to the least loaded rank. Balances flat work, ignores shared prefixes.
- ``"contiguous_dfs"``: the anchor (AReaL-DTA): rollouts in DFS order cut into K contiguous ranges; a
  binary search finds the smallest makespan T for which a greedy fill (extend a range while it costs
  <= T) needs at most K ranges. Keeps subtrees whole, but cannot split one heavy subtree finely nor pair
  light ones from far apart.
- ``"lpt_split"``: longest processing time over subtrees: a subtree heavier than the mean rank cost is
  replaced by its child subtrees (each carrying its prefix, replicated and counted), then units go
  heaviest first to the least loaded rank (loads add up unit costs, as LPT does).
- ``"subtree_search"`` (this lab's): local search with exact prefix-aware costs. Starting from the
  anchor's and from LPT's partitions (keeping the better result), it repeatedly takes the busiest rank r
  and, in this order of preference:

  1. moves the part of r's rollouts below one node v to another rank, choosing (v, destination) to
     minimise the larger of the two new loads. r saves the nodes that no longer carry any of its
     rollouts; the destination pays only for the nodes it does not already cover, so joining a rank that
     holds the prefix is cheap and splitting a subtree pays its prefix. All K x nodes moves are evaluated
     at once with subtree sums over the DFS preorder (a subtree is one contiguous slice);
  2. re-splits r's and another rank's rollouts together into a DFS range and the rest (every range tried
     at once from prefix sums; partners: the least loaded ranks and those sharing most prefix with r);
  3. tries two-move chains (move to a rank, then move something off that rank).

  Every step lowers the sorted vector of loads, so the search ends; it also stops at the lower bound
  max(total / K, the costliest single rollout).

Everything is deterministic (ties broken by index), so every rank of a job computes the same partition.
"""

from __future__ import annotations

import contextlib
import heapq
import time
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from ..checks import check_int
from ..engine.cost_model import MODES, CostModel, MicroBatchShape
from ..engine.microbatch import MicroBatch, dfs_sequence_order, plan_micro_batches
from ..trie import RolloutTrie


# ================================================================================================== costs
@dataclass(frozen=True)
class TokenCost:
    """A rank pays one unit per token it computes: the tree tokens of its micro-batches."""

    unit: ClassVar[str] = "tokens"

    def micro_batch_cost(self, micro_batch: MicroBatch, token_budget: int | None) -> float:
        return float(micro_batch.tree_tokens)

    def surrogate(self, trie: RolloutTrie, token_budget: int | None) -> tuple[list[float], list[float]]:
        """``(node_cost by node id, rollout_cost by rollout)``: every token once, nothing per rollout."""
        return [float(len(n.tokens)) for n in trie.nodes], [0.0] * trie.num_sequences


@dataclass(frozen=True)
class EngineCost:
    """A rank pays the seconds the engine's cost model predicts for its micro-batches.

    ``mode``: the mode ``tree_backward`` will be called with (``"auto"``: per micro-batch, the fastest
    mode that fits ``memory_limit``, exactly as the engine picks it). ``block_tokens`` must match the
    engine call too. Use a :func:`treeattn_lab.engine.calibrate`-d model for real seconds.
    """

    cost_model: CostModel = field(default_factory=CostModel)
    mode: str = "auto"
    block_tokens: int = 2048
    memory_limit: float | None = None
    unit: ClassVar[str] = "seconds"

    def __post_init__(self):
        if not isinstance(self.cost_model, CostModel):
            raise TypeError(f"cost_model must be a CostModel, got {type(self.cost_model).__name__}")
        if self.mode not in ("auto",) + MODES:
            raise ValueError(f"mode must be one of {('auto',) + MODES}, got {self.mode!r}")
        check_int("block_tokens", self.block_tokens)

    def mode_and_seconds(self, micro_batch: MicroBatch, token_budget: int | None) -> tuple[str, float]:
        """The mode the engine runs ``micro_batch`` in, and its predicted seconds."""
        shape = MicroBatchShape.of(micro_batch.trie, self.block_tokens, token_budget)
        if self.mode == "auto":
            mode, predictions = self.cost_model.choose(shape, memory_limit=self.memory_limit)
            return mode, predictions[mode][0]
        return self.mode, self.cost_model.predict(shape, self.mode)[0]

    def micro_batch_cost(self, micro_batch: MicroBatch, token_budget: int | None) -> float:
        return self.mode_and_seconds(micro_batch, token_budget)[1]

    def surrogate(self, trie: RolloutTrie, token_budget: int | None) -> tuple[list[float], list[float]]:
        """Per-node (tree modes) or per-rollout (flat) seconds from the model's linear coefficients, for
        the mode that the engine would pick for most of the trie's tokens."""
        mode = self.mode
        if mode == "auto":
            votes = dict.fromkeys(MODES, 0)
            for mb in plan_micro_batches(trie, token_budget):
                votes[self.mode_and_seconds(mb, token_budget)[0]] += mb.flat_tokens
            mode = max(MODES, key=lambda m: votes[m])  # ties: the first in MODES
        _, per_token, per_pair, per_call = self.cost_model.time[mode]
        if mode == "flat":
            rollout = [per_token * n + per_pair * n * (n + 1) / 2 for n in trie.seq_lengths]
            return [0.0] * len(trie.nodes), rollout
        node = []
        for n in trie.nodes:
            tokens = len(n.tokens)
            pairs = (n.depth + 1 + n.end_depth) * tokens / 2  # token at position p attends p + 1 keys
            c = per_token * tokens + per_pair * pairs
            if mode == "dfs":  # pushed without grad, then recomputed with grad when it has children
                c = c * (2 if n.children else 1) + per_call * (2 if n.children else 1)
            node.append(c if tokens else 0.0)
        return node, [0.0] * trie.num_sequences


# ============================================================================================ cost tree
class CostTree:
    """The trie as the partitioners see it, with the surrogate cost of every node and rollout.

    Nodes are renumbered in DFS preorder, so node v's subtree is the slice ``[v, end[v])`` and a sum over
    every subtree at once is two reads of one cumulative sum. ``cost(S)`` of a rollout set is exact under
    the surrogate (each node of the union of their root paths once).
    """

    def __init__(self, trie: RolloutTrie, node_cost: Sequence[float], rollout_cost: Sequence[float]):
        order = trie.preorder()
        pos = {node: i for i, node in enumerate(order)}
        n = len(order)
        self.trie = trie
        self.num_nodes = n
        self.num_rollouts = trie.num_sequences
        self.parent = [-1] + [pos[trie.nodes[v].parent] for v in order[1:]]
        self.node_cost = [float(node_cost[v]) for v in order]
        self.node_cost[0] = 0.0
        self.rollout_cost = [float(c) for c in rollout_cost]
        if len(self.rollout_cost) != self.num_rollouts:
            raise ValueError(f"got {len(self.rollout_cost)} rollout costs for {self.num_rollouts} rollouts")
        if any(c < 0 for c in self.node_cost) or any(c < 0 for c in self.rollout_cost):
            raise ValueError("surrogate costs must be non-negative")
        size = [1] * n
        for v in range(n - 1, 0, -1):
            size[self.parent[v]] += size[v]
        self.end = [v + size[v] for v in range(n)]
        self.children = [[] for _ in range(n)]
        self.level = [0] * n
        self.path_cost = [0.0] * n  # root .. v inclusive
        for v in range(1, n):
            p = self.parent[v]
            self.children[p].append(v)
            self.level[v] = self.level[p] + 1
            self.path_cost[v] = self.path_cost[p] + self.node_cost[v]
        self.end_node = [pos[v] for v in trie.seq_end_node]
        self.ends_at = [[] for _ in range(n)]  # rollouts ending at each node, in index order
        for i, v in enumerate(self.end_node):
            self.ends_at[v].append(i)
        self.dfs_order = dfs_sequence_order(trie)
        self.dfs_rank = [0] * self.num_rollouts
        for k, i in enumerate(self.dfs_order):
            self.dfs_rank[i] = k
        self.standalone = [
            self.path_cost[self.end_node[i]] + self.rollout_cost[i] for i in range(self.num_rollouts)
        ]
        self.total = sum(self.node_cost) + sum(self.rollout_cost)
        # tensors for the vectorised local search
        self.cost_t = torch.tensor(self.node_cost, dtype=torch.float64)
        self.end_t = torch.tensor(self.end, dtype=torch.long)
        self.parent_t = torch.tensor([0] + self.parent[1:], dtype=torch.long)
        by_level: dict[int, list[int]] = {}
        for v in range(1, n):
            by_level.setdefault(self.level[v], []).append(v)
        self.levels = [
            (torch.tensor(vs, dtype=torch.long), torch.tensor([self.parent[v] for v in vs], dtype=torch.long))
            for _, vs in sorted(by_level.items())
        ]

    @classmethod
    def of(cls, trie: RolloutTrie, cost=None, token_budget: int | None = None) -> CostTree:
        cost = TokenCost() if cost is None else cost
        return cls(trie, *cost.surrogate(trie, token_budget))

    def lower_bound(self, num_ranks: int) -> float:
        """No partition into ``num_ranks`` has a smaller surrogate makespan."""
        return max(self.total / num_ranks, max(self.standalone))

    def cost(self, rollouts: Sequence[int]) -> float:
        """Surrogate cost of a set of rollouts: each node of their root paths once, plus rollout costs."""
        seen = set()
        total = 0.0
        for i in rollouts:
            total += self.rollout_cost[i]
            v = self.end_node[i]
            while v > 0 and v not in seen:
                seen.add(v)
                total += self.node_cost[v]
                v = self.parent[v]
        return total

    def subtree_sum(self, x: torch.Tensor) -> torch.Tensor:
        """``out[..., v]`` = sum of ``x[..., u]`` over u in v's subtree (x indexed in preorder)."""
        cs = torch.nn.functional.pad(torch.cumsum(x, dim=-1), (1, 0))
        return cs.index_select(-1, self.end_t) - cs[..., : self.num_nodes]


# ========================================================================================= partitioners
def greedy_tokens(tree: CostTree, num_ranks: int) -> list[list[int]]:
    """Tree-blind: rollouts by decreasing stand-alone cost, each to the least loaded rank."""
    order = sorted(range(tree.num_rollouts), key=lambda i: (-tree.standalone[i], i))
    heap = [(0.0, r) for r in range(num_ranks)]
    groups: list[list[int]] = [[] for _ in range(num_ranks)]
    for i in order:
        load, r = heapq.heappop(heap)
        groups[r].append(i)
        heapq.heappush(heap, (load + tree.standalone[i], r))
    return groups


def _range_costs(tree: CostTree, order: Sequence[int]) -> tuple[list[float], list[float], list[float]]:
    """For rollouts ``order`` (in DFS order): what each costs when it opens a range, prefix sums of what each
    adds after its predecessor (its path below their common ancestor, plus its rollout cost), and the path
    cost of that common ancestor (``shared[k]`` for ``order[k - 1]`` and ``order[k]``; ``shared[0] = 0``).

    In DFS order the common ancestor of ``order[a]`` and ``order[b]`` is the shallowest of the neighbours'
    common ancestors in between (as the longest common prefix of sorted strings), so ranges of ``order``
    cost ``start[a] + prefix[b] - prefix[a]``, and two ranges together cost the sum minus the smallest
    ``shared`` between them.
    """
    start = [tree.standalone[i] for i in order]
    prefix, shared = [0.0], [0.0]
    for k in range(1, len(order)):
        a, b = tree.end_node[order[k - 1]], tree.end_node[order[k]]
        while a != b:  # lowest common ancestor: step up from the deeper node
            if tree.level[a] >= tree.level[b]:
                a = tree.parent[a]
            else:
                b = tree.parent[b]
        shared.append(tree.path_cost[a])
        prefix.append(prefix[-1] + start[k] - tree.path_cost[a])
    return start, prefix, shared


def _greedy_fill(start: list[float], prefix: list[float], limit: float) -> list[int]:
    """Range starts of the greedy contiguous fill: each range as long as it costs <= ``limit``."""
    starts, a, n = [], 0, len(start)
    slack = 1e-12 * max(1.0, abs(limit))  # the sums below round differently from the costs they bound
    while a < n:
        starts.append(a)
        # the last b with start[a] + prefix[b] - prefix[a] <= limit (a itself always fits a range)
        b = bisect_right(prefix, limit - start[a] + prefix[a] + slack, lo=a + 1) - 1
        a = max(b, a) + 1
    return starts


def contiguous_dfs(tree: CostTree, num_ranks: int) -> list[list[int]]:
    """The anchor: K contiguous ranges of the DFS order, smallest makespan by binary search + greedy fill."""
    order = tree.dfs_order
    start, prefix, _ = _range_costs(tree, order)

    def range_cost(a: int, b: int) -> float:  # rollouts order[a..b-1]
        return start[a] + prefix[b - 1] - prefix[a]

    lo, hi = max(start), start[0] + prefix[-1]
    if len(_greedy_fill(start, prefix, lo)) > num_ranks:
        for _ in range(200):  # bisection to float resolution: lo infeasible, hi feasible
            mid = (lo + hi) / 2
            if mid <= lo or mid >= hi:
                break
            if len(_greedy_fill(start, prefix, mid)) <= num_ranks:
                hi = mid
            else:
                lo = mid
    else:
        hi = lo
    bounds = _greedy_fill(start, prefix, hi) + [len(order)]
    ranges = [(bounds[j], bounds[j + 1]) for j in range(len(bounds) - 1)]
    # fewer ranges than ranks: cut the costliest range at its best point (never raises the makespan)
    while len(ranges) < num_ranks:
        splittable = [j for j, (a, b) in enumerate(ranges) if b - a >= 2]
        if not splittable:
            break
        j = max(splittable, key=lambda j: (range_cost(*ranges[j]), -j))
        a, b = ranges[j]
        cut = min(range(a + 1, b), key=lambda c: (max(range_cost(a, c), range_cost(c, b)), c))
        ranges[j : j + 1] = [(a, cut), (cut, b)]
    groups = [order[a:b] for a, b in ranges]
    return groups + [[] for _ in range(num_ranks - len(groups))]


@dataclass(order=True)
class _Unit:
    """A subtree (``node``, all rollouts below it) or the rollouts ending exactly at ``node``."""

    sort_key: tuple
    node: int = field(compare=False)
    rollouts: list[int] = field(compare=False)
    whole_subtree: bool = field(compare=False)
    cost: float = field(compare=False)


def _subtree_units(tree: CostTree, num_ranks: int) -> list[_Unit]:
    """Subtrees, split from the root down while one costs more than the mean rank cost (total / K)."""
    sub_node = tree.subtree_sum(tree.cost_t).tolist()
    ends_cost = [sum(tree.rollout_cost[i] for i in tree.ends_at[v]) for v in range(tree.num_nodes)]
    sub_rollout = tree.subtree_sum(torch.tensor(ends_cost, dtype=torch.float64)).tolist()

    def subtree(v: int) -> _Unit:
        rollouts = [i for u in range(v, tree.end[v]) for i in tree.ends_at[u]]
        cost = tree.path_cost[tree.parent[v]] + sub_node[v] + sub_rollout[v] if v else tree.total
        return _Unit((-cost, v, 0), v, rollouts, True, cost)

    def ends(v: int, rollouts: list[int], tag: int) -> _Unit:
        cost = tree.path_cost[v] + sum(tree.rollout_cost[i] for i in rollouts)
        return _Unit((-cost, v, tag), v, rollouts, False, cost)

    limit = tree.total / num_ranks
    heap = [subtree(0)]
    done = []
    while heap:
        unit = heapq.heappop(heap)
        if unit.cost <= limit or len(unit.rollouts) < 2:
            done.append(unit)
            continue
        v = unit.node
        if unit.whole_subtree:
            parts = [subtree(c) for c in tree.children[v]]
            if tree.ends_at[v]:
                parts.append(ends(v, list(tree.ends_at[v]), 1))
        else:  # several rollouts ending at one node: one unit each
            parts = [ends(v, [i], 2 + k) for k, i in enumerate(unit.rollouts)]
        for part in parts:
            heapq.heappush(heap, part)
    return [u for u in done if u.rollouts]


def lpt_split(tree: CostTree, num_ranks: int) -> list[list[int]]:
    """LPT over subtrees split down to the mean rank cost; loads add up unit costs (prefix per unit)."""
    units = sorted(_subtree_units(tree, num_ranks))  # heaviest first, ties by node
    heap = [(0.0, r) for r in range(num_ranks)]
    groups: list[list[int]] = [[] for _ in range(num_ranks)]
    for unit in units:
        load, r = heapq.heappop(heap)
        groups[r].extend(unit.rollouts)
        heapq.heappush(heap, (load + unit.cost, r))
    return groups


class _SearchState:
    """Per rank and node: rollouts ending there, their rollout costs, rollouts passing through; loads."""

    def __init__(self, tree: CostTree, groups: list[list[int]]):
        self.tree = tree
        k, n = len(groups), tree.num_nodes
        self.rank_of = [0] * tree.num_rollouts
        self.ends = torch.zeros(k, n, dtype=torch.long)
        self.end_cost = torch.zeros(k, n, dtype=torch.float64)
        for r, g in enumerate(groups):
            for i in g:
                self.rank_of[i] = r
                self.ends[r, tree.end_node[i]] += 1
                self.end_cost[r, tree.end_node[i]] += tree.rollout_cost[i]
        self.count = tree.subtree_sum(self.ends)
        self.load = (tree.cost_t * (self.count > 0)).sum(-1) + self.end_cost.sum(-1)

    def clone(self) -> _SearchState:
        other = object.__new__(_SearchState)
        other.tree, other.rank_of = self.tree, list(self.rank_of)
        for name in ("ends", "end_cost", "count", "load"):
            setattr(other, name, getattr(self, name).clone())
        return other

    def groups(self) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in range(self.ends.shape[0])]
        for i in self.tree.dfs_order:
            out[self.rank_of[i]].append(i)
        return out

    def moves_from(self, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        """For every (destination, node v): the larger new load if r's rollouts below v move there, and
        the change of the total cost (replication) it brings; ``inf`` where the move is void."""
        tree, count_r = self.tree, self.count[r]
        held = count_r > 0
        covered = tree.cost_t * held
        below = tree.subtree_sum(self.end_cost[r])  # rollout costs of the chunk
        # r saves its nodes below v, and the ancestors of v that carry no other rollout of r
        lone_above = torch.zeros(tree.num_nodes, dtype=torch.float64)
        # the destination pays the ancestors of v it does not cover, and r's nodes below v it lacks
        free = self.count == 0
        uncovered_path = torch.zeros_like(self.end_cost)
        cost = tree.cost_t
        for nodes, parents in tree.levels:
            same = count_r.index_select(0, parents) == count_r.index_select(0, nodes)
            above = lone_above.index_select(0, parents) + cost.index_select(0, parents)
            lone_above.index_copy_(0, nodes, torch.where(same, above, 0.0))
            pay = cost.index_select(0, nodes) * free.index_select(1, nodes)
            uncovered_path.index_copy_(1, nodes, uncovered_path.index_select(1, parents) + pay)
        saved = tree.subtree_sum(covered) + below + lone_above
        added = uncovered_path.index_select(1, tree.parent_t) + tree.subtree_sum(covered * free) + below
        worst = torch.maximum(self.load[r] - saved, self.load[:, None] + added)
        void = ~held
        void[0] = True  # moving all of r is never better than leaving it
        worst = worst.masked_fill(void, float("inf"))
        worst[r] = float("inf")
        return worst, added - saved

    def best_moves(self, r: int, limit: int) -> list[tuple[float, float, int, int]]:
        """Up to ``limit`` moves ``(new max of the two, replication change, destination, node)``, best
        first; among equal new maxima the one that replicates least, then the lowest index."""
        worst, growth = self.moves_from(r)
        worst, growth = worst.flatten(), growth.flatten()
        finite = int(torch.isfinite(worst).sum())
        if finite == 0:
            return []
        k = min(limit, finite)
        cutoff = torch.topk(worst, k, largest=False).values[-1]
        candidates = torch.nonzero(worst <= cutoff).flatten().tolist()
        candidates.sort(key=lambda j: (float(worst[j]), float(growth[j]), j))
        n = self.tree.num_nodes
        return [(float(worst[j]), float(growth[j]), j // n, j % n) for j in candidates[:k]]

    def partners(self, r: int, per_kind: int) -> list[int]:
        """Ranks worth splitting together with r: the ``per_kind`` least loaded, and the ``per_kind`` that
        share the most cost with r (their union is cheaper than the two apart)."""
        k = self.load.shape[0]
        shared = ((self.count > 0) & (self.count[r] > 0)).to(torch.float64) @ self.tree.cost_t
        shared[r] = -1.0
        by_load = sorted((q for q in range(k) if q != r), key=lambda q: (float(self.load[q]), q))
        by_shared = sorted(
            (q for q in range(k) if q != r and shared[q] > 0), key=lambda q: (-float(shared[q]), q)
        )
        return sorted(set(by_load[:per_kind]) | set(by_shared[:per_kind]))

    def reassign(self, groups: dict[int, Sequence[int]]) -> None:
        """Give rank r exactly the rollouts ``groups[r]`` (for each r named; they come from named ranks)."""
        tree = self.tree
        for r, rollouts in groups.items():
            self.ends[r] = 0
            self.end_cost[r] = 0.0
            for i in rollouts:
                self.rank_of[i] = r
                self.ends[r, tree.end_node[i]] += 1
                self.end_cost[r, tree.end_node[i]] += tree.rollout_cost[i]
        for r in groups:
            self._refresh(r)

    def _refresh(self, r: int) -> None:
        self.count[r] = self.tree.subtree_sum(self.ends[r])
        self.load[r] = (self.tree.cost_t * (self.count[r] > 0)).sum() + self.end_cost[r].sum()

    def move(self, r: int, node: int, dest: int) -> None:
        tree = self.tree
        part = slice(node, tree.end[node])
        for v in range(node, tree.end[node]):
            for i in tree.ends_at[v]:
                if self.rank_of[i] == r:
                    self.rank_of[i] = dest
        self.ends[dest, part] += self.ends[r, part]
        self.ends[r, part] = 0
        self.end_cost[dest, part] += self.end_cost[r, part]
        self.end_cost[r, part] = 0.0
        self._refresh(r)
        self._refresh(dest)


def best_two_way_split(tree: CostTree, rollouts: Sequence[int], *, quadratic_limit: int = 256):
    """The best split of ``rollouts`` into one DFS-order range ``[a, b]`` and the rest (the ranges before and
    after it, which share the prefix between them): ``(larger cost, range, rest)``, or None for fewer than
    two rollouts. All ranges are tried at once from prefix sums; beyond ``quadratic_limit`` rollouts only
    the ranges that start at the first one (a single cut)."""
    order = sorted(rollouts, key=lambda i: tree.dfs_rank[i])
    n = len(order)
    if n < 2:
        return None
    start, prefix, shared = (torch.tensor(x, dtype=torch.float64) for x in _range_costs(tree, order))
    inf = torch.tensor(float("inf"), dtype=torch.float64)
    a = (torch.arange(n) if n <= quadratic_limit else torch.zeros(1, dtype=torch.long))[:, None]
    b = torch.arange(n)[None, :]
    inside = start[a] + prefix[b] - prefix[a]
    before = torch.where(a > 0, start[0] + prefix[(a - 1).clamp(min=0)], 0.0)
    after_start = (b + 1).clamp(max=n - 1)
    after = torch.where(b < n - 1, start[after_start] + prefix[n - 1] - prefix[after_start], 0.0)
    # common ancestor of the ranges before and after: the smallest shared[k] for k in a..b+1
    joint = torch.cummin(torch.where(b >= a, shared[None, :], inf), dim=1).values
    joint = torch.cat([joint[:, 1:], inf.expand(joint.shape[0], 1)], dim=1)
    outside = before + after - torch.where((a > 0) & (b < n - 1), joint, 0.0)
    worst = torch.maximum(inside, outside).masked_fill((b < a) | ((a == 0) & (b == n - 1)), float("inf"))
    j = int(torch.argmin(worst))
    lo, hi = int(a.flatten()[j // n]), j % n
    return float(worst.flatten()[j]), order[lo : hi + 1], order[:lo] + order[hi + 1 :]


def _local_search(
    tree: CostTree, groups: list[list[int]], *, max_steps: int, chain_width: int = 8, partners: int = 4
) -> _SearchState:
    """Lower the busiest rank's load until no move, pair split or two-move chain helps."""
    state = _SearchState(tree, groups)
    bound = tree.lower_bound(len(groups))
    for _ in range(max_steps):
        r = int(torch.argmax(state.load))
        top = float(state.load[r])
        tol = 1e-9 * max(top, 1e-300)
        if top <= bound + tol:
            break
        # 1. move r's rollouts below one node to another rank
        moves = state.best_moves(r, chain_width)
        if moves and moves[0][0] < top - tol:
            _, _, dest, node = moves[0]
            state.move(r, node, dest)
            continue
        # 2. split r and another rank's rollouts together anew: a DFS range on one side, the rest on the other
        groups_now = state.groups()
        best_split = None
        for other in state.partners(r, partners):
            split = best_two_way_split(tree, groups_now[r] + groups_now[other])
            if split and split[0] < top - tol and (best_split is None or split[0] < best_split[0] - tol):
                best_split = (split[0], other, split[1], split[2])
        if best_split is not None:
            _, other, inside, outside = best_split
            state.reassign({r: inside, other: outside})
            continue
        # 3. move to a rank, then move something off that rank (an ejection chain)
        best = None
        for _, _, dest, node in moves:
            trial = state.clone()
            trial.move(r, node, dest)
            follow = trial.best_moves(dest, 1)
            if follow and follow[0][0] < top - tol and float(trial.load[r]) < top - tol:
                value = max(follow[0][0], float(trial.load[r]))
                if best is None or value < best[0] - tol:
                    best = (value, trial, dest, follow[0])
        if best is None:
            break
        _, trial, dest, (_, _, dest2, node2) = best
        trial.move(dest, node2, dest2)
        state = trial
    return state


def subtree_search(tree: CostTree, num_ranks: int, *, max_steps: int | None = None) -> list[list[int]]:
    """This lab's partitioner: prefix-aware local search over subtree moves, from the anchor and from LPT."""
    steps = max_steps if max_steps is not None else 50 * num_ranks + 200
    best = None
    for start in (contiguous_dfs, lpt_split):
        state = _local_search(tree, start(tree, num_ranks), max_steps=steps)
        key = (float(state.load.max()), float(state.load.sum()))
        if best is None or key < best[0]:
            best = (key, state)
    return best[1].groups()


PARTITIONERS: dict[str, Callable[[CostTree, int], list[list[int]]]] = {
    "greedy_tokens": greedy_tokens,
    "contiguous_dfs": contiguous_dfs,
    "lpt_split": lpt_split,
    "subtree_search": subtree_search,
}
ANCHOR = "contiguous_dfs"
BEST = "subtree_search"


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
            "token_budget": self.token_budget,
            "partition_s": self.seconds,
        }


# ============================================================================================ entry point
def _check_cost(cost) -> None:
    if not (hasattr(cost, "surrogate") and hasattr(cost, "micro_batch_cost") and hasattr(cost, "unit")):
        raise TypeError(f"cost must be a TokenCost or an EngineCost, got {type(cost).__name__}")


@contextlib.contextmanager
def _one_thread():
    """Run torch on one thread for a while: the search makes many tiny tensor ops, which intra-op threads
    slow down (by 10x on a busy machine), and one thread sums in a fixed order on every rank."""
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
    mbs, costs = [], []
    for mb in plan_micro_batches(local, token_budget):
        costs.append(float(cost.micro_batch_cost(mb, token_budget)))
        mbs.append(MicroBatch(tuple(sequences[j] for j in mb.sequences), mb.trie, mb.carried_tokens))
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
