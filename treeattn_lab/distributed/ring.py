"""Sparse ring attention: each rank's queries meet every rank's keys, one ring step at a time.

The sequence is split over ``W`` ranks by a layout (:mod:`.layouts`; ``striped`` by default). Each rank
keeps its queries and, at every step, holds the keys and values of one *origin* rank:

Forward
    1. **Bars once.** The pattern's vertical columns are few (a bounded number per head), so their keys and
       values are gathered from their owners in one all-reduce (``[Hq, nb, D]``, a few MB) and every
       rank computes its queries against them locally, at step 0.
    2. **Tiles around the ring.** At step ``t`` the rank runs the block-sparse kernel on its queries
       against the keys of ``origin(t)``, only the selected tiles whose key block that origin holds, and
       folds the partial result into a running fp32 output with the log-sum-exp rule (``MERGE`` in the
       kernel; :func:`treeattn_lab.reference.merge_attention_states` is the same rule in einops). The
       next keys travel meanwhile (point-to-point, posted before the compute).
Backward
    With the final output's log-sum-exp and ``delta = rowsum(dO * O)`` every step's gradient is exact
    on its own. The keys go around the ring a second time, *backwards*: the backward starts on the keys
    the forward ended with (kept from the forward: no transfer before the first step, at the cost of one
    more K/V shard held per call until its backward) and ends on the rank's own. Each step computes dQ
    (accumulated locally, fp32), and dK, dV of the keys held (written into an fp32 buffer), adds the
    accumulator arriving from the rank that held those keys one step later, and passes it on: a second
    ring of fp32 dK/dV whose last stop is the keys' owner, computing its own part, so no transfer is left
    after the last kernel (a ring walked forwards would end with every finished accumulator one hop from
    its owner). dK and dV travel stacked in one fp32 buffer (one add per merge, one transfer per hand-over),
    and three such buffers, allocated once per call, take turns: the one being computed into, the one on
    its way to the next rank, the one arriving. The bars' dK, dV (computed at step 0) are summed over
    ranks with one all-reduce and added by the owners.

Hierarchical rings (``inner=ranks per node``) visit a node's ranks in an inner loop and move to the
previous node in an outer loop; in the forward the outer transfer is posted before the inner loop, so it
hides behind a whole inner loop of compute (the backward walks the same steps in reverse, one hop each).
:class:`RingPlan` holds a rank's per-step kernel indices, built once per (pattern, tokens, layout, world,
rank) and cached on the pattern (and the pattern's copy on the inputs' device, where it lives elsewhere).

Every call is collective and starts with a quick agreement (:func:`.agreement.agree`): the ranks
compare a fingerprint of a digest of the pattern's values, the layout, the sizes and the settings in one
small all-reduce, so a rank that passes another pattern or layout, or rejects its own input, makes every
rank raise instead of computing a wrong result or leaving its peers waiting.

Per-step math comes from a *step backend*: ``"triton"`` (the kernel) or ``"reference"`` (an einops twin,
for CPU tests without the interpreter's cost).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from einops import einsum

from ..ops.validation import check_qkv, check_scale
from ..patterns.vertical_slash import BAR_PAD, VerticalSlashPattern
from .agreement import agree, describe, monitor_group, sha256
from .layouts import RingSchedule, block_owner, rank_blocks

LN2 = math.log(2.0)


# ------------------------------------------------------------------------------------------ the plan
@dataclass(eq=False)
class RingPlan:
    """Everything a rank needs to run its part of the ring, independent of the inputs' values."""

    layout: str
    rank: int
    world: int
    schedule: RingSchedule
    num_tokens: int
    blocks: torch.Tensor  # this rank's global block ids
    steps: list  # BlockSparseIndex per step (step 0 with the bars)
    bar_owned: torch.Tensor | None  # [Hq, nb] bool: bar columns this rank holds
    bar_rows: torch.Tensor | None  # [Hq, nb] int64: their local rows (0 where not owned)

    @property
    def num_local(self) -> int:
        return self.steps[0].num_q


def ring_plan(pattern: VerticalSlashPattern, num_tokens: int, layout: str, rank: int, world: int, *,
              inner: int | None = None) -> RingPlan:
    """The :class:`RingPlan` of ``rank`` (cached on the pattern)."""
    key = ("ring_plan", num_tokens, layout, rank, world, inner)
    if key in pattern._cache:
        return pattern._cache[key]
    bs = pattern.block_size
    if num_tokens % bs:
        raise ValueError(f"ring attention needs whole blocks: {num_tokens} tokens is not a multiple of {bs}")
    nb = num_tokens // bs
    schedule = RingSchedule.make(world, inner)
    owner = block_owner(layout, nb, world).to(pattern.device)
    mine = rank_blocks(layout, nb, world, rank).to(pattern.device)
    tiles = pattern.block_map(num_tokens)
    steps = []
    for t in range(world):
        theirs = (owner == schedule.origin(rank, t)).nonzero().flatten()
        steps.append(pattern.block_index(num_tokens, q_blocks=mine, k_blocks=theirs, bars=t == 0,
                                         block_map=tiles))
    bar_owned = bar_rows = None
    if steps[0].bar_pos is not None:
        pos = steps[0].bar_pos.long()
        valid = pos != BAR_PAD
        block = torch.where(valid, pos // bs, 0)
        bar_owned = valid & (owner[block] == rank)
        local_block = torch.zeros(nb, dtype=torch.int64, device=pattern.device)
        local_block[mine] = torch.arange(mine.numel(), device=pattern.device)
        bar_rows = torch.where(bar_owned, local_block[block] * bs + pos % bs, 0)
    plan = RingPlan(layout, rank, world, schedule, num_tokens, mine, steps, bar_owned, bar_rows)
    pattern._cache[key] = plan
    return plan


# ------------------------------------------------------------------------------------------ step backends
class TritonStep:
    """One ring step with the block-sparse Triton kernel (see ``kernels/block_sparse.py``)."""

    @staticmethod
    def forward(q, k, v, bar_k, bar_v, index, scale, state):
        from ..kernels.block_sparse import sparse_forward

        return sparse_forward(q, k, v, bar_k, bar_v, index, scale=scale, state=state)

    @staticmethod
    def delta(o, do):
        from ..kernels.attention_core import attention_delta

        return attention_delta(o, do)

    @staticmethod
    def backward(do, q, k, v, bar_k, bar_v, lse2, delta, index, scale, dq, dk, dv):
        """Accumulates into ``dq``; writes the step's dK, dV into the fresh fp32 ``dk``, ``dv``."""
        from ..kernels.block_sparse import sparse_backward

        _, _, _, dbk, dbv = sparse_backward(do, q, k, v, bar_k, bar_v, lse2, delta, index, scale=scale,
                                            dq=dq, dk=dk, dv=dv, accumulate_q=True)
        return dbk, dbv


class ReferenceStep:
    """The same step in einops over the index's dense masks: slow, obviously right, any dtype."""

    @staticmethod
    def _scores(q, k, bar_k, index, scale):
        """Scores ``[H, T, keys + bars]`` (``-inf`` outside the step's pairs) and the GQA group size."""
        group = q.shape[1] // k.shape[1]
        kq = k.repeat_interleave(group, dim=1)  # keys per query head
        s_tiles = einsum(q, kq, "t h d, s h d -> h t s") * scale
        s_tiles = s_tiles.masked_fill(~index.block_mask(), float("-inf"))
        s_bars = einsum(q, bar_k, "t h d, h b d -> h t b") * scale
        s_bars = s_bars.masked_fill(~index.bar_mask(), float("-inf"))
        return torch.cat([s_tiles, s_bars], dim=-1), group

    @staticmethod
    def forward(q, k, v, bar_k, bar_v, index, scale, state):
        if index.bar_pos is None:  # a step without the bar part
            bar_k, bar_v = bar_k[:, :0], bar_v[:, :0]
        s, group = ReferenceStep._scores(q, k, bar_k, index, scale)
        lse = torch.logsumexp(s, -1)  # [H, T], natural log
        p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
        vq = torch.cat([v.repeat_interleave(group, dim=1).transpose(0, 1), bar_v], dim=1)  # [H, S + nb, D]
        out = einsum(p, vq, "h t s, h s d -> t h d")
        o, lse2 = state  # the log-sum-exp rule of merge_attention_states, in base 2 and in place
        step2 = (lse / LN2).to(lse2.dtype)
        union = torch.logaddexp2(lse2, step2)
        safe = torch.where(torch.isinf(union), 0.0, union)  # rows no key has reached yet: weights 0
        o.mul_(torch.exp2(lse2 - safe).T[..., None])
        o.add_(out.to(o.dtype) * torch.exp2(step2 - safe).T[..., None])
        lse2.copy_(union)
        return o, lse2

    @staticmethod
    def delta(o, do):
        acc = torch.float64 if o.dtype == torch.float64 else torch.float32
        return (o.to(torch.float64) * do.to(torch.float64)).sum(-1).T.to(acc).contiguous()

    @staticmethod
    def backward(do, q, k, v, bar_k, bar_v, lse2, delta, index, scale, dq, dk, dv):
        if index.bar_pos is None:
            bar_k, bar_v = bar_k[:, :0], bar_v[:, :0]
        s, group = ReferenceStep._scores(q, k, bar_k, index, scale)
        lse = (lse2 * LN2).to(s.dtype)
        p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])  # masked entries: exp(-inf) = 0
        n_keys = k.shape[0]
        vq = torch.cat([v.repeat_interleave(group, dim=1).transpose(0, 1), bar_v], dim=1)
        kq = torch.cat([k.repeat_interleave(group, dim=1).transpose(0, 1), bar_k], dim=1)
        dp = einsum(do, vq, "t h d, h s d -> h t s")
        ds = p * (dp - delta.to(p.dtype)[..., None])
        dq += (einsum(ds, kq, "h t s, h s d -> t h d") * scale).to(dq.dtype)
        dkq = einsum(ds, q, "h t s, t h d -> h s d") * scale
        dvq = einsum(p, do, "h t s, t h d -> h s d")
        dk.copy_(dkq[:, :n_keys].unflatten(0, (-1, group)).sum(1).transpose(0, 1))
        dv.copy_(dvq[:, :n_keys].unflatten(0, (-1, group)).sum(1).transpose(0, 1))
        if index.bar_pos is None:
            return None, None
        return dkq[:, n_keys:], dvq[:, n_keys:]


STEP_BACKENDS = {"triton": TritonStep, "reference": ReferenceStep}


# ------------------------------------------------------------------------------------------ communication
class _Transfers:
    """Non-blocking point-to-point sends and receives, waited for as a batch (NCCL or gloo)."""

    def __init__(self, group):
        self.group = group
        self.works = []

    def exchange(self, send_to: int, recv_from: int, tensors, tag: int, into=None):
        """Send ``tensors`` to rank ``send_to`` and receive the same shapes from ``recv_from`` (into the
        buffers ``into`` when given, which nothing may read or write until :meth:`wait`)."""
        received = [torch.empty_like(x) for x in tensors] if into is None else list(into)
        ops = []
        for j, x in enumerate(tensors):
            ops.append(dist.P2POp(dist.isend, x.contiguous(), self._peer(send_to), self.group, tag + j))
        for j, x in enumerate(received):
            ops.append(dist.P2POp(dist.irecv, x, self._peer(recv_from), self.group, tag + j))
        self.works += dist.batch_isend_irecv(ops)
        return received

    def _peer(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def wait(self):
        for w in self.works:
            w.wait()
        self.works = []


_TAG_KV, _TAG_OUTER, _TAG_DKV = 0, 10, 20


def _gather_bars(k, v, plan: RingPlan, group):
    """Every bar column's key and value per query head ``[Hq, nb, D]``, from their owners (all-reduce)."""
    index = plan.steps[0]
    hq = index.num_heads
    if index.bar_pos is None:
        empty = k.new_zeros(hq, 0, k.shape[-1])
        return empty, empty
    group_size = hq // k.shape[1]
    kv_head = (torch.arange(hq, device=k.device) // group_size)[:, None].expand_as(plan.bar_rows)
    own = plan.bar_owned[..., None]
    bar_kv = torch.stack([torch.where(own, x[plan.bar_rows, kv_head], 0) for x in (k, v)])
    dist.all_reduce(bar_kv, group=group)
    return bar_kv[0], bar_kv[1]


def _ring_forward(q, k, v, bar_k, bar_v, plan: RingPlan, scale, step, group):
    sched = plan.schedule
    nq, hq, d = q.shape
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    state = (torch.zeros(nq, hq, d, device=q.device, dtype=acc),
             torch.full((hq, nq), float("-inf"), device=q.device, dtype=acc))
    comm = _Transfers(group)
    outer_comm = _Transfers(group)
    cur = [k, v]
    outer_next = None
    for t in range(plan.world):
        o_step, i_step = divmod(t, sched.inner)
        if i_step == 0 and o_step < sched.outer - 1:  # next node's keys, posted before the inner loop
            outer_next = outer_comm.exchange(sched.outer_next(plan.rank), sched.outer_prev(plan.rank), cur,
                                             _TAG_OUTER)
        nxt = None
        if i_step < sched.inner - 1:
            nxt = comm.exchange(sched.inner_next(plan.rank), sched.inner_prev(plan.rank), cur, _TAG_KV)
        step.forward(q, cur[0], cur[1], bar_k, bar_v, plan.steps[t], scale, state)
        comm.wait()
        if nxt is not None:
            cur = nxt
        elif t < plan.world - 1:
            outer_comm.wait()
            cur = outer_next
    return state[0].to(q.dtype), state[1], cur  # cur: the last step's keys, where the backward starts


def _ring_backward(do, q, k, v, last_kv, bar_k, bar_v, o, lse2, plan: RingPlan, scale, step, group):
    """The ring walked backwards: from the keys the forward ended on (``last_kv``) to the rank's own, so
    the dK/dV accumulator of each key block ends on its owner's last step instead of a final hop."""
    sched = plan.schedule
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    delta = step.delta(o, do)
    dq = torch.zeros(q.shape, device=q.device, dtype=acc_dtype)
    kv_comm, dkv_comm = _Transfers(group), _Transfers(group)
    cur = list(last_kv)
    # fp32 dK/dV stacked in one buffer (one add per merge, one transfer per hand-over); three take turns:
    # computed into, on its way to the next rank (until dkv_comm.wait()), arriving
    computing, *free = [torch.empty((2, *k.shape), device=k.device, dtype=acc_dtype)
                        for _ in range(3 if plan.world > 1 else 1)]
    sent = None  # the accumulator passed on at the previous step
    incoming = None  # the dK, dV accumulator of the keys held, from the rank that held them at step t + 1
    dbar = (None, None)
    for t in reversed(range(plan.world)):
        origin = sched.origin(plan.rank, t)
        if t > 0:  # step t - 1's keys: from their holder at step t; ours go to theirs at step t - 1
            to, frm = sched.holder(origin, t - 1), sched.holder(sched.origin(plan.rank, t - 1), t)
            nxt = kv_comm.exchange(to, frm, cur, _TAG_KV)
        dk, dv = computing[0], computing[1]  # views (select, not unbind: they may be written in place)
        dbk, dbv = step.backward(do, q, cur[0], cur[1], bar_k, bar_v, lse2, delta, plan.steps[t], scale,
                                 dq, dk, dv)
        if t == 0:
            dbar = (dbk, dbv)
        if incoming is not None:
            dkv_comm.wait()  # the previous accumulator has left, this one has arrived: both free after
            computing += incoming
            free = [sent, incoming]
        if t > 0:  # pass the accumulator on, receive the one of step t - 1's keys
            (arriving,) = dkv_comm.exchange(to, frm, [computing], _TAG_DKV, into=[free[0]])
            sent, incoming = computing, arriving
            computing = free[1]  # nothing reads it any more: added at the previous step or never used
            kv_comm.wait()
            cur = nxt
    if dbar[0] is not None:  # bar columns: sum over ranks, owners add their columns
        dbar_kv = torch.stack(dbar).to(acc_dtype)
        dist.all_reduce(dbar_kv, group=group)
        group_size = q.shape[1] // k.shape[1]
        kv_head = (torch.arange(q.shape[1], device=k.device) // group_size)[:, None].expand_as(plan.bar_rows)
        own = plan.bar_owned
        rows, heads = plan.bar_rows[own], kv_head[own]
        dk.index_put_((rows, heads), dbar_kv[0][own], accumulate=True)
        dv.index_put_((rows, heads), dbar_kv[1][own], accumulate=True)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingSparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan, scale, step, group):
        bar_k, bar_v = _gather_bars(k, v, plan, group)
        o, lse2, last_kv = _ring_forward(q, k, v, bar_k, bar_v, plan, scale, step, group)
        ctx.save_for_backward(q, k, v, *last_kv, bar_k, bar_v, o, lse2)
        ctx.plan, ctx.scale, ctx.step, ctx.group = plan, scale, step, group
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, last_k, last_v, bar_k, bar_v, o, lse2 = ctx.saved_tensors
        dq, dk, dv = _ring_backward(do.contiguous(), q, k, v, (last_k, last_v), bar_k, bar_v, o, lse2,
                                    ctx.plan, ctx.scale, ctx.step, ctx.group)
        return dq, dk, dv, None, None, None, None


def _on_device(pattern: VerticalSlashPattern, device: torch.device) -> VerticalSlashPattern:
    """``pattern`` on ``device``: itself, or its copy there, made once and cached on it (so the plans
    cached on the copy are found again on the next call)."""
    if pattern.device == device:
        return pattern
    key = ("on_device", str(device))
    if key not in pattern._cache:
        pattern._cache[key] = pattern.to(device)
    return pattern._cache[key]


def _prepare(q, k, v, pattern, num_tokens, layout, inner, group, scale, backend):
    """Check this rank's arguments; returns ``(plan, scale, step backend, digest)``. The digest covers
    what every rank must pass alike: layout, tokens, ring, scale, backend, head counts, head dim, dtypes
    and the pattern's values (hashed once per pattern object, which is treated as immutable, as the plan
    cache does)."""
    check_qkv(q, k, v)
    check_scale(scale)
    if not isinstance(pattern, VerticalSlashPattern):
        raise TypeError(f"pattern must be a VerticalSlashPattern, got {type(pattern).__name__}")
    if pattern.num_heads != q.shape[1]:
        raise ValueError(f"pattern has {pattern.num_heads} heads but q has {q.shape[1]}")
    if backend == "auto":
        backend = "triton" if q.device.type == "cuda" else "reference"
    if backend not in STEP_BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose auto, triton or reference")
    if "digest" not in pattern._cache:
        pattern._cache["digest"] = sha256(pattern.vertical, pattern.slash, pattern.block_size)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    digest = sha256(layout, num_tokens, inner, world, scale, backend, pattern._cache["digest"],
                    *[(tuple(x.shape[1:]), str(x.dtype)) for x in (q, k, v)])
    plan = ring_plan(_on_device(pattern, q.device), num_tokens, layout, rank, world, inner=inner)
    if q.shape[0] != plan.num_local:
        raise ValueError(
            f"rank {rank} holds {plan.num_local} tokens under the {layout} layout, got {q.shape[0]}"
        )
    if backend == "triton":
        from ..kernels.block_sparse import check_inputs

        check_inputs(q, k, v, plan.steps[0])
    return plan, scale, STEP_BACKENDS[backend], digest


def ring_sparse_attention(q, k, v, pattern: VerticalSlashPattern, *, num_tokens: int, layout: str = "striped",
                          inner: int | None = None, group=None, scale: float | None = None,
                          backend: str = "auto") -> torch.Tensor:
    """Sparse attention of one sequence of ``num_tokens`` split over the ranks of ``group``.

    ``q [n, Hq, D]``, ``k, v [n, Hkv, D]`` are this rank's local tokens under ``layout`` (see
    :func:`.layouts.shard`); ``pattern`` is the whole sequence's (the same on every rank). Returns this
    rank's output rows; gradients flow to the local q, k, v. Equals :func:`treeattn_lab.sparse_attention`
    on the full sequence, sharded. ``inner`` (ranks per node) selects the hierarchical ring. ``backend``:
    ``"triton"`` (default on CUDA) or ``"reference"`` (einops steps).

    Collective: the ranks first agree (:func:`.agreement.agree`, on a gloo group) that they pass the same
    pattern, layout, sizes and settings; where one rank rejects its input or they differ, **every** rank
    raises :class:`.agreement.RankMismatchError` (on the rejecting rank, from its own error).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("ring_sparse_attention needs torch.distributed initialized (torchrun, or "
                           "init_process_group)")
    prepared, error = None, None
    try:
        prepared = _prepare(q, k, v, pattern, num_tokens, layout, inner, group, scale, backend)
    except Exception as e:  # reported to every rank by agree(), then raised everywhere
        error = e
    agree(None if prepared is None else prepared[3], None if error is None else describe(error),
          monitor_group(group), what="the ring's pattern, layout, sizes or settings", cause=error,
          hint="every rank must pass the same pattern and arguments, and its own shard of the sequence",
          quick=True)
    plan, scale, step, _ = prepared
    q, k, v = (x.contiguous() for x in (q, k, v))
    return _RingSparseAttention.apply(q, k, v, plan, scale, step, group)


__all__ = ["ReferenceStep", "RingPlan", "TritonStep", "ring_plan", "ring_sparse_attention"]
