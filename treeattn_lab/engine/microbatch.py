"""Dynamic micro-batching: cut a rollout trie into micro-batches of neighbouring rollouts.

Rollouts are taken in DFS order of the trie (a rollout that is a prefix of another comes first), which
places rollouts with long common prefixes next to each other, and every micro-batch is a contiguous
range of that order within ``token_budget`` tree tokens. A range's tree tokens and attended pairs add up
rollout by rollout: rollout s adds ``len(s) - lcp(previous, s)`` tokens (positions ``lcp .. len - 1``,
each attending its position + 1 keys), because in DFS order the longest prefix s shares with any rollout
before it in the range is the one it shares with its predecessor. A cut between two rollouts makes the
next micro-batch compute their common prefix again, counted as ``carried_tokens``. A rollout longer than
the budget gets a micro-batch of its own (the DFS engine then splits it into blocks). Every rollout lands
in exactly one micro-batch, so every token's loss is counted exactly once, however the cuts fall.

The budget bounds what a flat or packed micro-batch holds at once. A DFS micro-batch holds one block and
the active path, whatever its tokens, so in ``"dfs"`` mode the whole trie is one micro-batch: no prefix is
carried over a cut, and each shared prefix is pushed once.

Where the cuts fall:

- **greedy fill** (no calibrated cost model, or flat mode, where a cut costs nothing since every rollout
  runs whole): a micro-batch grows while it fits the budget. This needs the fewest micro-batches, but may
  cut a subtree just before its end and carry its prefix.
- **cheapest cuts** (a calibrated :class:`~treeattn_lab.engine.CostModel`): the cuts that minimize the sum
  of the micro-batches' predicted seconds (:meth:`~treeattn_lab.engine.CostModel.planning_seconds`), by
  dynamic programming over the cut points (ties: fewer micro-batches). Where the model says small
  micro-batches are host-bound (each costs the host floor whatever its tokens), this prefers fewer,
  fuller micro-batches; where they are device-bound and a micro-batch costs little more than its tokens,
  it prefers cuts between subtrees that carry no prefix.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from itertools import pairwise

from ..checks import check_int
from ..trie import RolloutTrie
from .modes import MODES

PLANNING_MODES = ("auto",) + MODES  # the engine modes a plan can be made for


@dataclass(frozen=True)
class MicroBatch:
    """Rollouts ``sequences`` (global indices, DFS order) and the trie they form."""

    sequences: tuple[int, ...]
    trie: RolloutTrie = field(repr=False)
    carried_tokens: int  # prefix tokens shared with the previous micro-batch, computed again here
    mode: str | None = None  # the mode a plan fixed for it (see engine.call_plan); None: not yet chosen
    block_tokens: int | None = None  # the DFS block size a plan fixed for it; None: the engine call's

    def dfs_block_tokens(self, call_block_tokens: int) -> int:
        """The DFS block size this micro-batch runs in: the one its plan fixed, else the engine call's."""
        return self.block_tokens or call_block_tokens

    @property
    def flat_tokens(self) -> int:
        return sum(self.trie.seq_lengths)

    @property
    def tree_tokens(self) -> int:
        return sum(len(n.tokens) for n in self.trie.nodes)


def shared_micro_batch(trie: RolloutTrie, mb: MicroBatch) -> MicroBatch:
    """``mb`` (a micro-batch of ``trie``'s rollouts that a plan runs) with the trie of its rollouts that
    every plan of ``trie`` running the same rollouts shares: the first such plan's, kept on ``trie``. The
    passes over one set of rollouts (the log-prob passes and the training step of an RL step) then share
    that trie, its packs (on the device too) and what is cached on them, for as long as ``trie`` lives.
    Only what a plan runs is kept, never the candidates it weighed."""
    return replace(mb, trie=trie.cached(("micro_batch_trie", mb.sequences), lambda: mb.trie))


def _pairs(lo: int, hi: int) -> int:
    """Attended pairs of positions ``lo .. hi - 1`` of a rollout (position p attends p + 1 keys)."""
    return (hi * (hi + 1) - lo * (lo + 1)) // 2


def _greedy_starts(lengths: list[int], shared: list[int], token_budget: int | None) -> list[int]:
    """Where each micro-batch of the greedy fill starts (indices into the DFS order)."""
    starts, used = [], 0
    for k, (n, lcp) in enumerate(zip(lengths, shared, strict=True)):
        if starts and (token_budget is None or used + n - lcp <= token_budget):
            used += n - lcp
        else:
            starts.append(k)
            used = n
    return starts


def _cheapest_starts(lengths: list[int], shared: list[int], token_budget: int, seconds) -> list[int]:
    """Where each micro-batch starts under the cuts that minimize the sum of ``seconds(tokens, pairs)``
    over the micro-batches (ties: fewer micro-batches): ``best[b]`` is the cheapest plan of the first b
    rollouts, the last micro-batch ``a .. b - 1`` tried for every start a that fits the budget."""
    added_tokens, added_pairs = [0], [0]  # prefix sums of what each rollout adds after its predecessor
    for n, lcp in zip(lengths, shared, strict=True):
        added_tokens.append(added_tokens[-1] + n - lcp)
        added_pairs.append(added_pairs[-1] + _pairs(lcp, n))
    best = [(0.0, 0, -1)]  # (seconds, micro-batches, start of the last one)
    for b in range(1, len(lengths) + 1):
        choice = None
        for a in range(b - 1, -1, -1):  # a range's tokens only grow as its start moves back
            tokens = lengths[a] + added_tokens[b] - added_tokens[a + 1]
            if tokens > token_budget and a < b - 1:
                break
            pairs = _pairs(0, lengths[a]) + added_pairs[b] - added_pairs[a + 1]
            total = (best[a][0] + seconds(tokens, pairs), best[a][1] + 1, a)
            tol = 1e-12 * max(1.0, abs(total[0]))
            if (
                choice is None
                or total[0] < choice[0] - tol
                or (total[0] <= choice[0] + tol and total[1] < choice[1])
            ):
                choice = total
        best.append(choice)
    starts, b = [], len(lengths)
    while b > 0:
        b = best[b][2]
        starts.append(b)
    return starts[::-1]


def check_planning_mode(mode) -> str:
    """``mode`` if it is one of :data:`PLANNING_MODES`, else a ValueError naming them."""
    if not isinstance(mode, str) or mode not in PLANNING_MODES:
        raise ValueError(f"mode must be one of {PLANNING_MODES}, got {mode!r}")
    return mode


def plan_micro_batches(
    trie: RolloutTrie, token_budget: int | None = None, *, cost_model=None, mode: str = "auto"
) -> list[MicroBatch]:
    """Micro-batches of at most ``token_budget`` tree tokens each (``None``: the whole trie as one; in
    ``"dfs"`` mode always the whole trie, whose memory the blocks bound, not the budget).

    ``cost_model``: a calibrated :class:`~treeattn_lab.engine.CostModel` makes the cuts the cheapest
    predicted (module docstring) for ``mode``, the engine mode the micro-batches will run in: under
    ``"auto"`` the packed mode's prediction, whose features a range of rollouts determines exactly (the
    engine then picks each micro-batch's mode). Otherwise, and in ``"flat"`` mode, greedy fill.
    ``mode`` must be one of :data:`PLANNING_MODES`, with or without a cost model.
    """
    if not isinstance(trie, RolloutTrie):
        raise TypeError(f"trie must be a RolloutTrie, got {type(trie).__name__}")
    check_int("token_budget", token_budget, allow_none=True)
    check_planning_mode(mode)
    if mode == "dfs":
        token_budget = None
    calibrated = getattr(cost_model, "calibrated", False) is True
    if token_budget is None or not calibrated or mode == "flat":
        # the greedy cuts depend on the trie and the budget alone: cut once per trie, shared by every pass
        return list(trie.cached(("micro_batches", token_budget), lambda: _cut(trie, token_budget, None)))
    plan_mode = "packed" if mode == "auto" else mode
    return _cut(trie, token_budget, lambda t, p: cost_model.planning_seconds(plan_mode, t, p))


def _cut(trie: RolloutTrie, token_budget: int | None, seconds) -> list[MicroBatch]:
    """The micro-batches of the greedy fill (``seconds`` None) or of the cheapest cuts under ``seconds``."""
    order = trie.dfs_sequence_order()
    lengths = [trie.seq_lengths[i] for i in order]
    shared = [0] + [trie.shared_prefix(a, b) for a, b in pairwise(order)]
    if seconds is None:
        starts = _greedy_starts(lengths, shared, token_budget)
    else:
        starts = _cheapest_starts(lengths, shared, token_budget, seconds)
    bounds = starts + [len(order)]
    return [
        MicroBatch(tuple(order[a:b]), trie.subtrie(order[a:b]), shared[a])
        for a, b in pairwise(bounds)
    ]
