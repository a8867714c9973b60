"""Partitioners: which rollouts each of K ranks trains, searched on the surrogate of a :class:`.CostTree`.

A partition trades balance (every rank equally busy, so nobody waits at the all-reduce) against
replication (each split of a subtree computes its prefix once more). The step takes as long as the
busiest rank: the **makespan**. Every partitioner maps ``(tree, K)`` to K lists of rollout indices
(:data:`PARTITIONERS`):

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

import heapq
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .costs import CostTree


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


__all__ = [
    "ANCHOR",
    "BEST",
    "PARTITIONERS",
    "best_two_way_split",
    "contiguous_dfs",
    "greedy_tokens",
    "lpt_split",
    "subtree_search",
]
