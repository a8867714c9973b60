"""What a rank pays for its rollouts: the exact costs, and the additive surrogate the partitioners search.

Data-parallel training on tries: rank r builds the trie of *its own* rollouts and runs
:func:`treeattn_lab.engine.tree_backward` on it, so rank r's work is the cost of its own trie (a prefix
shared by rollouts on two ranks is computed on both). A cost is evaluated on the micro-batches the engine
will run on that rank (:meth:`plan`: :func:`treeattn_lab.engine.call_plan.engine_micro_batches` of the
rank's trie with the cost model and mode the engine plans with), each micro-batch priced by
:meth:`micro_batch_terms` (its cost, and whether the cost model predicts it host-bound):

- :class:`TokenCost` (the default): the tokens the rank computes, i.e. the tree tokens of its micro-batches
  (a prefix carried over a micro-batch cut is counted again, as the engine computes it again).
- :class:`EngineCost`: the seconds the engine's :class:`~treeattn_lab.engine.CostModel` predicts for each
  micro-batch in the mode ``tree_backward`` runs it in (``"auto"``: the model's own choice), so the
  prediction here is the very number the engine reports in ``report.predicted_s``. Each micro-batch costs
  the larger of its host and device terms, so a rank whose share ends in a small, host-bound micro-batch
  pays the host floor for it, and the rank's makespan is the sum over its micro-batches.

The partitioners (:mod:`.partitioners`) search with an additive **surrogate** of the cost
(:class:`CostTree`), which they can update along one root path at a time:

    cost(S) = sum of node_cost[v] over the nodes v on the paths of the rollouts in S (each node once)
            + sum of rollout_cost[i] over the rollouts i in S

Tokens: ``node_cost`` = the node's token count (exact without a token budget). A tree mode of a cost
model: its per-token and per-attended-pair coefficients applied to the node's tokens (DFS: twice for a
node with children, which is pushed without grad and recomputed). Flat mode: ``rollout_cost`` = each
rollout's own tokens and causal pairs. The surrogate has no per-micro-batch term (neither the constant
nor the host floor: they depend on where the rank's micro-batches are cut, not on single nodes); reports
(:mod:`.balance`) are always evaluated with the exact cost, which has both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from ..checks import check_int
from ..engine.call_plan import engine_micro_batches
from ..engine.cost_model import MODES, CostModel, MicroBatchShape
from ..engine.microbatch import MicroBatch, check_planning_mode
from ..engine.time_fit import FORWARD_PAIR_SHARE, FORWARD_TOKEN_SHARE
from ..trie import RolloutTrie


# ================================================================================================== costs
def _check_planning(name: str, cost_model, mode, *, optional: bool) -> None:
    if not (isinstance(cost_model, CostModel) or (optional and cost_model is None)):
        wanted = "a CostModel or None" if optional else "a CostModel"
        raise TypeError(f"{name} must be {wanted}, got {type(cost_model).__name__}")
    check_planning_mode(mode)


@dataclass(frozen=True)
class TokenCost:
    """A rank pays one unit per token it computes: the tree tokens of its micro-batches.

    ``plan_with``, ``mode``, ``block_tokens``, ``memory_limit``: what ``tree_backward`` plans its
    micro-batches with (``plan_with`` None: the prior, whose cuts are the greedy fill), so the
    micro-batches counted are the engine's."""

    plan_with: CostModel | None = None
    mode: str = "auto"
    block_tokens: int = 2048
    memory_limit: float | None = None
    unit: ClassVar[str] = "tokens"

    def __post_init__(self):
        _check_planning("plan_with", self.plan_with, self.mode, optional=True)
        check_int("block_tokens", self.block_tokens)

    def plan(self, trie: RolloutTrie, token_budget: int | None) -> list[MicroBatch]:
        """The micro-batches the engine runs ``trie`` as
        (:func:`~treeattn_lab.engine.call_plan.engine_micro_batches`)."""
        planned = engine_micro_batches(
            trie, self.mode, self.block_tokens, token_budget, self.plan_with, self.memory_limit
        )
        return [mb for mb, _ in planned]

    def micro_batch_terms(self, micro_batch: MicroBatch, token_budget: int | None) -> tuple[float, bool]:
        """``(cost, host-bound)`` of a micro-batch: its tree tokens; tokens know no host."""
        return float(micro_batch.tree_tokens), False

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
        _check_planning("cost_model", self.cost_model, self.mode, optional=False)
        check_int("block_tokens", self.block_tokens)

    def plan(self, trie: RolloutTrie, token_budget: int | None) -> list[MicroBatch]:
        """The micro-batches the engine runs ``trie`` as, each with the mode it runs in
        (:func:`~treeattn_lab.engine.call_plan.engine_micro_batches`)."""
        planned = engine_micro_batches(
            trie, self.mode, self.block_tokens, token_budget, self.cost_model, self.memory_limit
        )
        return [mb for mb, _ in planned]

    def predict(self, micro_batch: MicroBatch, token_budget: int | None) -> tuple[str, float, bool]:
        """The mode the engine runs ``micro_batch`` in, its predicted seconds, and whether the model
        predicts it host-bound in that mode."""
        block_tokens = micro_batch.dfs_block_tokens(self.block_tokens)  # the size auto grew it to, if any
        shape = MicroBatchShape.of(micro_batch.trie, block_tokens, token_budget)
        mode = micro_batch.mode or self.mode
        if mode == "auto":
            mode, _ = self.cost_model.choose(shape, memory_limit=self.memory_limit)
        return mode, self.cost_model.predict(shape, mode)[0], self.cost_model.host_bound(shape, mode)

    def mode_and_seconds(self, micro_batch: MicroBatch, token_budget: int | None) -> tuple[str, float]:
        """The mode the engine runs ``micro_batch`` in, and its predicted seconds."""
        return self.predict(micro_batch, token_budget)[:2]

    def micro_batch_terms(self, micro_batch: MicroBatch, token_budget: int | None) -> tuple[float, bool]:
        """``(predicted seconds, host-bound)`` of a micro-batch."""
        return self.predict(micro_batch, token_budget)[1:]

    def surrogate(self, trie: RolloutTrie, token_budget: int | None) -> tuple[list[float], list[float]]:
        """Per-node (tree modes) or per-rollout (flat) seconds from the model's linear coefficients, for
        the mode that the engine would pick for most of the trie's tokens. A dfs node costs one call at the
        cost per call of walks in small blocks (``time["dfs"]``, not :attr:`CostModel.fa4_walks`): a node
        is a call where blocks are short."""
        mode = self.mode
        if mode == "auto":
            votes = dict.fromkeys(MODES, 0)
            for mb in self.plan(trie, token_budget):
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
            if mode == "dfs":  # one call with grad; a node with children is pushed first, forward only
                c += per_call
                if n.children:
                    c += FORWARD_TOKEN_SHARE * (per_token * tokens + per_call)
                    c += FORWARD_PAIR_SHARE * per_pair * pairs
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
        self.dfs_order = trie.dfs_sequence_order()
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


__all__ = ["CostTree", "EngineCost", "TokenCost"]
