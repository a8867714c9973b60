"""Flat fallback for tree attention: run a pack that shares little as plain causal attention per rollout.

Why
---
Tree attention saves the (query, key) pairs that flat attention repeats on shared prefixes; the saving
is the *ideal ratio* ``flat pairs / tree pairs``. A tree kernel pays for it with a lower speed per pair
than FlashAttention, so when the ratio is close to 1 the tree is slower than simply running every
rollout flat. This backend does exactly that, from the packed layout, with exact results
and gradients.

How
---
1. **Rollouts.** Only the root-to-*leaf* paths are needed: a rollout that is a prefix (or a copy) of
   another is contained in it, and causal attention of a prefix is the prefix of the longer rollout's.
2. **Buckets.** Rollouts are grouped by length; each bucket is a right-padded batch ``[n, L, H, D]``
   gathered out of the pack with one index (right padding is harmless under a causal mask: real queries
   never see the keys after them). Lengths are grouped to minimise padded pairs plus a fixed cost per
   bucket (:data:`BUCKET_OVERHEAD_PAIRS`), so equal-length rollouts (GRPO) form one batch.
3. **Attention.** ``scaled_dot_product_attention(..., is_causal=True)`` per bucket, as the flat baseline
   of ``python -m treeattn_lab bench tree`` runs it (FlashAttention on a GPU; grouped-query heads through
   ``enable_gqa``, as the flex backend does).
4. **One copy per token.** Each packed token takes its output from its *owner*: the first leaf, in DFS
   preorder, below the token's node. In preorder the tokens between two consecutive leaves are ancestors
   of the second, so leaf ``j`` owns the packed range ``[node_end(leaf j-1), node_end(leaf j))``: one
   contiguous range, the suffix of its rollout that no earlier rollout holds.

Gradients
---------
The other copies of a token (inside later rollouts) get a zero output gradient: their queries then get
exactly zero gradient (``dS = P * (dO V^T - rowsum(dO * O)) = 0`` row by row), so ``dq`` is just the owner
copies' ``dq``, and they add nothing to the keys and values they see. A key or value row is read by
every rollout that contains it, so its gradient is the sum over those copies: the owner copy is gathered
and the shared copies are added to it (``index_add_``, in the input dtype, as ``index_select``'s own
backward does). Padded slots get exactly zero gradient and are ignored.

The plan (rows of every slot, owner and shared slots per bucket) is built on the CPU once per pack and
device and cached on the pack, like the flex block mask and the Triton tile schedule. Building it walks
the rollouts on the host, which ``torch.compile`` cannot trace: a compiled call reads the plan an eager
call cached and refuses, with a ValueError, a pack that has none.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = [
    "BUCKET_OVERHEAD_PAIRS",
    "FLAT_BELOW_PAIR_RATIO",
    "FlatBucket",
    "FlatPlan",
    "flat_pair_ratio",
    "flat_plan",
    "flat_tree_attention",
    "group_lengths",
    "leaf_rollouts",
    "prefers_flat",
    "require_cached",
    "rollout_pair_ratio",
]

# ``backend="auto"`` runs a pack flat on CUDA when :func:`flat_pair_ratio` (the pairs the padded flat
# batches compute / the pairs the tree attends) is below this: the ratio of the Triton kernel's time per
# tree pair to the gathered-flat backend's time per padded pair, chosen by bench/results/tree__NVIDIA-H200__
# torch-2.11.0-cu130__triton-3.6.0.json (the "gather-flat" and "triton" rows of ``bench tree``).
FLAT_BELOW_PAIR_RATIO = 1.10

# Fixed cost of one more bucket (launches of gathers, attention and scatters, forward and backward),
# in attended pairs: the pairs a GPU attends in the time of those launches.
BUCKET_OVERHEAD_PAIRS = 1 << 19


# ------------------------------------------------------------------------------------------ the decision
def _leaf_nodes(pack) -> torch.Tensor:
    """Leaves of the pack's trie in DFS preorder (nodes with tokens and no children), on the CPU."""
    start, end, sub_end = (x.cpu() for x in (pack.node_start, pack.node_end, pack.node_subtree_end))
    leaves = torch.nonzero((sub_end == end) & (end > start)).flatten()
    return leaves[torch.argsort(start[leaves])]


def _causal_pairs(lengths: torch.Tensor) -> torch.Tensor:
    return lengths * (lengths + 1) // 2


def _rollout_lengths(pack) -> torch.Tensor:
    """Lengths of the distinct root-to-leaf rollouts, leaves in DFS preorder (CPU int64), cached."""
    def build() -> torch.Tensor:
        last = pack.node_end.cpu()[_leaf_nodes(pack)] - 1
        return pack.position_ids[last.to(pack.device)].cpu().to(torch.int64) + 1

    return pack.cached("rollout_lengths", build)


def rollout_pair_ratio(pack) -> float:
    """Pairs causal attention attends over the distinct root-to-leaf rollouts / pairs the tree attends.

    Equals the bench's ideal ratio (``flat_attended_pairs / attended_pairs``) when no rollout is a prefix
    or a copy of another; otherwise it counts only what the flat backend needs.
    """
    return int(_causal_pairs(_rollout_lengths(pack)).sum()) / pack.attended_pairs()


def require_cached(pack, key, what: str) -> None:
    """Under ``torch.compile``, a clear error when ``pack._cache`` lacks ``key``: building ``what`` is
    host work (lists of rollouts) that a traced graph cannot run."""
    if torch.compiler.is_compiling() and key not in pack._cache:
        raise ValueError(f"torch.compile cannot build {what} of a pack (host work): run the call once "
                         f"eagerly on this pack before compiling (the result is cached on the pack)")


def flat_pair_ratio(pack) -> float:
    """Pairs the flat backend computes (its padded batches, :func:`group_lengths`) / pairs the tree
    attends: :func:`rollout_pair_ratio` plus the padding of rollouts of unequal length. Cached (under
    ``torch.compile`` it must be cached already: :func:`require_cached`)."""
    require_cached(pack, "flat_pair_ratio", "the flat-or-tree decision of backend='auto'")

    def build() -> float:
        lengths = _rollout_lengths(pack).tolist()
        padded = sum(len(g) * _causal_pairs(max(lengths[i] for i in g)) for g in group_lengths(lengths))
        return padded / pack.attended_pairs()

    return pack.cached("flat_pair_ratio", build)


def prefers_flat(pack) -> bool:
    """True when the pack shares so little that flat attention per rollout beats the tree kernel."""
    return flat_pair_ratio(pack) < FLAT_BELOW_PAIR_RATIO


# ------------------------------------------------------------------------------------------------ plan
def group_lengths(lengths: list[int], overhead_pairs: int | None = None) -> list[list[int]]:
    """Indices of ``lengths`` grouped into buckets, longest bucket first.

    A bucket costs ``rollouts x L (L + 1) / 2`` causal pairs at its longest length ``L`` plus
    ``overhead_pairs`` (default :data:`BUCKET_OVERHEAD_PAIRS`); dynamic programming over the sorted
    distinct lengths finds the cheapest grouping (an optimal grouping of sorted lengths is contiguous).
    Equal lengths always share a bucket; inside a bucket the indices keep their order.
    """
    if not lengths:
        return []
    overhead_pairs = BUCKET_OVERHEAD_PAIRS if overhead_pairs is None else overhead_pairs
    distinct, counts = torch.tensor(lengths, dtype=torch.int64).unique(return_counts=True)  # ascending
    m = distinct.numel()
    cum = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).double()
    pairs = _causal_pairs(distinct).double()
    best = torch.zeros(m + 1, dtype=torch.float64)  # best[j]: cheapest grouping of the j shortest lengths
    cut = [0] * (m + 1)
    for j in range(1, m + 1):  # a bucket holding distinct lengths i .. j-1 costs its rollouts x pairs[j-1]
        cost = best[:j] + (cum[j] - cum[:j]) * pairs[j - 1] + overhead_pairs
        i = int(torch.argmin(cost))
        best[j], cut[j] = cost[i], i
    edges, j = [], m
    while j > 0:
        edges.append((cut[j], j))
        j = cut[j]
    groups = []
    for lo, hi in edges:  # longest first
        lo_len, hi_len = int(distinct[lo]), int(distinct[hi - 1])
        groups.append([i for i, n in enumerate(lengths) if lo_len <= n <= hi_len])
    return groups


@dataclass(frozen=True)
class FlatBucket:
    """One padded batch of ``rollouts`` rollouts of (at most) ``length`` tokens; slot = rollout x length.

    ``rows[slot]``: the packed row gathered into each slot (padding repeats the rollout's last token);
    ``own_slots`` / ``own_rows``: slots holding the owner copy of a token, and that token's packed row;
    ``shared_slots`` / ``shared_rows``: the other real slots (copies of tokens owned by another rollout).
    """

    rollouts: int
    length: int
    rows: torch.Tensor
    own_slots: torch.Tensor
    own_rows: torch.Tensor
    shared_slots: torch.Tensor
    shared_rows: torch.Tensor

    def to(self, device) -> FlatBucket:
        tensors = {n: getattr(self, n).to(device) for n in ("rows", "own_slots", "own_rows", "shared_slots",
                                                            "shared_rows")}
        return FlatBucket(self.rollouts, self.length, **tensors)


@dataclass(frozen=True)
class FlatPlan:
    """The buckets of a pack; every packed row is the owner slot of exactly one bucket slot.

    ``in_order``: one bucket whose owner slots list the packed rows 0..T-1 in order (then outputs are a
    single gather).
    """

    num_tokens: int
    buckets: tuple[FlatBucket, ...]
    in_order: bool

    def padded_pairs(self) -> int:
        """Causal pairs the padded batches compute (what this backend costs)."""
        return sum(b.rollouts * b.length * (b.length + 1) // 2 for b in self.buckets)


def _rollout(pack, leaf: int, start: torch.Tensor, end: torch.Tensor, owned_from: int):
    """Packed rows of the rollout ending at ``leaf`` (CPU ``start`` / ``end`` per node) and how many of
    its last rows it owns (the rows from ``owned_from``, where the previous leaf ended)."""
    rows = torch.cat([torch.arange(int(start[n]), int(end[n])) for n in pack.node_path(leaf)])
    owned = int(end[leaf]) - owned_from
    if not torch.equal(rows[rows.numel() - owned:], torch.arange(owned_from, int(end[leaf]))):
        raise RuntimeError("the pack is not in DFS preorder: leaves do not own contiguous ranges")
    return rows, owned


def leaf_rollouts(pack) -> list[tuple[torch.Tensor, int]]:
    """``(rows, owned)`` per leaf in DFS preorder, on the CPU: the packed rows of the leaf's rollout and
    how many of its last rows it owns. The owned ranges are contiguous and tile ``0 .. T`` in order."""
    start, end = pack.node_start.cpu(), pack.node_end.cpu()
    rollouts, owned_from = [], 0
    for leaf in _leaf_nodes(pack).tolist():
        rollouts.append(_rollout(pack, leaf, start, end, owned_from))
        owned_from = int(end[leaf])
    return rollouts


def _build_plan(pack) -> FlatPlan:
    rollouts = leaf_rollouts(pack)
    buckets = []
    for group in group_lengths([rows.numel() for rows, _ in rollouts]):
        L = max(rollouts[i][0].numel() for i in group)
        slot_rows, own_slots, own_rows, shared_slots, shared_rows = [], [], [], [], []
        for b, i in enumerate(group):  # rollouts in preorder inside a bucket
            rows, owned = rollouts[i]
            n, base = rows.numel(), b * L
            slot_rows += [rows, rows[-1:].expand(L - n)]
            own_slots.append(torch.arange(base + n - owned, base + n))
            own_rows.append(rows[n - owned:])
            shared_slots.append(torch.arange(base, base + n - owned))
            shared_rows.append(rows[: n - owned])
        parts = (slot_rows, own_slots, own_rows, shared_slots, shared_rows)
        buckets.append(FlatBucket(len(group), L, *(torch.cat(x) for x in parts)).to(pack.device))
    return FlatPlan(pack.num_tokens, tuple(buckets), in_order=len(buckets) == 1)


def flat_plan(pack) -> FlatPlan:
    """The rollout buckets of ``pack``, built once per pack and device and cached on the pack (under
    ``torch.compile`` it must be cached already: :func:`require_cached`)."""
    key = ("flat_plan", str(pack.device))
    require_cached(pack, key, "the flat backend's rollout plan")
    return pack.cached(key, lambda: _build_plan(pack))


# ------------------------------------------------------------------------------------- rows in and out
def _owner_rows(plan: FlatPlan, slots: list[torch.Tensor]) -> torch.Tensor:
    """Packed ``[T, ...]``: row t from the owner slot of t (``slots``: one ``[slots, ...]`` per bucket)."""
    if plan.in_order:
        return slots[0].index_select(0, plan.buckets[0].own_slots)
    x = slots[0]
    out = torch.empty((plan.num_tokens,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    for bucket, s in zip(plan.buckets, slots, strict=True):
        out.index_copy_(0, bucket.own_rows, s.index_select(0, bucket.own_slots))
    return out


class _GatherRollouts(torch.autograd.Function):
    """Packed ``x [T, H, D]`` -> one padded batch ``[n, L, H, D]`` per bucket; backward gathers the owner
    copies' gradients and, with ``sum_copies``, adds the shared copies' (queries skip them: exactly 0)."""

    @staticmethod
    def forward(ctx, x, plan, sum_copies):
        ctx.plan, ctx.sum_copies = plan, sum_copies
        return tuple(x.index_select(0, b.rows).view(b.rollouts, b.length, *x.shape[1:]) for b in plan.buckets)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        if not ctx.needs_input_grad[0]:
            return None, None, None
        plan = ctx.plan
        slots = [g.reshape(-1, *g.shape[2:]) for g in grads]
        grad = _owner_rows(plan, slots)
        for bucket, s in zip(plan.buckets, slots, strict=True):
            if ctx.sum_copies and bucket.shared_slots.numel():
                grad.index_add_(0, bucket.shared_rows, s.index_select(0, bucket.shared_slots))
        return grad, None, None


class _OwnerOutputs(torch.autograd.Function):
    """Bucket outputs ``[n, L, H, D]`` -> packed ``[T, H, D]`` from owner slots; the other slots get zero
    gradient."""

    @staticmethod
    def forward(ctx, plan, *outs):
        ctx.plan = plan
        return _owner_rows(plan, [o.reshape(-1, *o.shape[2:]) for o in outs])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        grads = []
        for b in ctx.plan.buckets:
            g = torch.zeros((b.rollouts * b.length,) + tuple(grad.shape[1:]), dtype=grad.dtype,
                            device=grad.device)
            owned = grad if ctx.plan.in_order else grad.index_select(0, b.own_rows)
            g.index_copy_(0, b.own_slots, owned)
            grads.append(g.view(b.rollouts, b.length, *grad.shape[1:]))
        return (None, *grads)


# ------------------------------------------------------------------------------------------- the op
def flat_tree_attention(q, k, v, pack, *, scale=None):
    """Tree attention computed flat: causal SDPA over every root-to-leaf rollout of ``pack``.

    Inputs as for ``treeattn_lab.tree_attention`` (packed ``q [T, Hq, D]``, ``k, v [T, Hkv, D]``, already
    validated there). Equal to the tree rule, differentiable in q, k and v.
    """
    plan = flat_plan(pack)
    scale = None if scale is None else float(scale)  # SDPA wants a Python float (numpy floats accepted)
    gqa = q.shape[1] != k.shape[1]
    outs = []
    # a query's shared copies get exactly zero gradient (see the module docstring): sum copies for k, v only
    batches = (_GatherRollouts.apply(x, plan, sums) for x, sums in ((q, False), (k, True), (v, True)))
    for qb, kb, vb in zip(*batches, strict=True):
        out = F.scaled_dot_product_attention(qb.transpose(1, 2), kb.transpose(1, 2), vb.transpose(1, 2),
                                             is_causal=True, scale=scale, enable_gqa=gqa)
        outs.append(out.transpose(1, 2))  # [n, L, Hq, D]; FlashAttention writes this layout, a free view
    return _OwnerOutputs.apply(plan, *outs)
