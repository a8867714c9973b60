"""Data-parallel training on a rollout trie: every rank runs ``tree_backward`` on its balanced share.

One step, on every rank of a ``torch.distributed`` group (all collective: every rank calls the same
functions in the same order):

1. :func:`plan_shares`: each rank checks its arguments and hashes the rollouts, their token weights and
   the settings (SHA-256); the ranks agree on the digests (:func:`.agreement.agree`), so if any rank
   rejected its input or differs, **every** rank raises :class:`.RankMismatchError` naming the ranks.
   Then every rank computes the same partition (:func:`.balance.balance`, deterministic) with the
   engine's cost model, so the predicted cost per rank is in the engine's own units (seconds).
2. :func:`run_step`: the rank's share (its own trie) goes through
   :func:`treeattn_lab.engine.tree_backward`, timed. A monitored barrier then checks that every rank
   finished (a rank that hung or died is named within ``barrier_timeout_s``), and the ranks exchange
   their status: an error, the plan's digest and a summary of the model's parameters (names, shapes,
   dtypes and checksums of the values, :func:`.agreement.parameter_summary`). If the plans or the
   parameters differ, every rank raises :class:`.RankMismatchError`; if any rank raised, every rank
   raises :class:`.RankFailureError` with its message. Otherwise the gradients are all-reduced (sum, one
   flat buffer per dtype) and so are the per-rollout losses. Whenever the call does not return (an error
   on any rank, or an interrupt), ``.grad`` is left exactly as it was before it.

The sum over ranks of each share's gradient is the gradient of the whole trie's loss, so the result
equals single-process ``tree_backward`` (the tests check this in float64 on 2 and 3 gloo ranks).
:func:`distributed_tree_backward` does both steps in one call. The runner that times it on several GPUs is
:mod:`treeattn_lab.bench.multi_gpu_train`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..engine import CostModel, tree_backward
from ..engine.tree_backward import TreeBackwardReport, check_token_weights
from ..trie import RolloutTrie
from .agreement import (
    RankFailureError,
    RankMismatchError,
    agree,
    describe,
    gather_objects,
    monitor_group,
    monitored_barrier,
    parameter_difference,
    parameter_summary,
    rank_in,
    sha256,
)
from .balance import BalanceReport, EngineCost, TokenCost, balance
from .partitioners import BEST, PARTITIONERS


# ================================================================================================= planning
@dataclass(frozen=True)
class StepPlan:
    """What every rank agreed on: the rollouts, weights, engine settings and the partition."""

    trie: RolloutTrie = field(repr=False)
    token_weights: list = field(repr=False)  # one 1-D float tensor per rollout
    balance: BalanceReport = field(repr=False)
    engine: dict  # keyword arguments of tree_backward (mode, block_tokens, token_budget, cost_model, ...)
    digest: str  # of the rollouts, weights, settings and partition
    seconds: float  # time to agree and partition


def _check_plan_arguments(trie, token_weights, partitioner: str, balance_by: str) -> list[torch.Tensor]:
    if not isinstance(trie, RolloutTrie):
        raise TypeError(f"trie must be a RolloutTrie, got {type(trie).__name__}")
    if balance_by not in ("engine", "tokens"):
        raise ValueError(f"balance_by must be 'engine' or 'tokens', got {balance_by!r}")
    if partitioner not in PARTITIONERS:
        raise ValueError(f"unknown partitioner {partitioner!r}; choose one of {sorted(PARTITIONERS)}")
    return check_token_weights(trie, token_weights)


def plan_shares(
    trie: RolloutTrie,
    token_weights=None,
    *,
    partitioner: str = BEST,
    balance_by: str = "engine",
    mode: str = "auto",
    block_tokens: int = 2048,
    token_budget: int | None = None,
    cost_model: CostModel | None = None,
    memory_limit: float | None = None,
    attention_backend: str = "auto",
    group=None,
    barrier_timeout_s: float = 600.0,
) -> StepPlan:
    """Collective: check that every rank holds the same data and settings, then partition the trie.

    ``balance_by``: ``"engine"`` (predicted seconds of the engine's cost model, in ``mode``) or
    ``"tokens"``. The other arguments are :func:`treeattn_lab.engine.tree_backward`'s.
    """
    started = time.perf_counter()
    monitor = monitor_group(group)
    world = dist.get_world_size(group)
    rank_in(group)  # a clear error for a process outside the group
    cost_model = cost_model or CostModel()
    engine = {
        "mode": mode,
        "block_tokens": block_tokens,
        "token_budget": token_budget,
        "cost_model": cost_model,
        "memory_limit": memory_limit,
        "attention_backend": attention_backend,
    }
    digest, problem, weights = None, None, None
    try:  # a bad argument on one rank must stop every rank, so it is reported through agree() below
        weights = _check_plan_arguments(trie, token_weights, partitioner, balance_by)
        settings = {k: (v.to_dict() if isinstance(v, CostModel) else v) for k, v in engine.items()}
        settings.update(partitioner=partitioner, balance_by=balance_by, world=world)
        digest = sha256(
            json.dumps(trie.to_dict(), separators=(",", ":")),
            *(w.detach().to(torch.float64) for w in weights),
            json.dumps(settings, sort_keys=True, default=str),
        )
    except Exception as e:
        problem = describe(e)
    monitored_barrier(monitor, barrier_timeout_s, "at the start of planning")
    agree(
        digest,
        problem,
        monitor,
        what="the rollouts, token weights or settings",
        hint="every rank must pass the same trie, weights and arguments",
    )
    cost = (  # either way, the shares' micro-batches are cut as tree_backward will cut them
        TokenCost(plan_with=cost_model, mode=mode, block_tokens=block_tokens, memory_limit=memory_limit)
        if balance_by == "tokens"
        else EngineCost(cost_model, mode=mode, block_tokens=block_tokens, memory_limit=memory_limit)
    )
    report = balance(trie, world, partitioner, cost=cost, token_budget=token_budget)
    plan_digest = sha256(digest, [s.sequences for s in report.shares])
    return StepPlan(trie, weights, report, engine, plan_digest, time.perf_counter() - started)


# ================================================================================================== the step
@dataclass
class DistributedStepResult:
    """One step's outcome, the same on every rank except ``local``."""

    losses: torch.Tensor  # [B] float64, every rollout's loss (summed over ranks)
    balance: BalanceReport = field(repr=False)
    rank_seconds: list[float]  # measured tree_backward time of each rank's share
    predicted: list[float]  # predicted cost of each rank's share (balance.unit)
    reduce_seconds: float  # this rank's all-reduce time
    step_seconds: float  # this rank's whole run_step
    local: TreeBackwardReport | None = field(default=None, repr=False)  # this rank's engine report

    @property
    def loss(self) -> float:
        return float(self.losses.sum())

    @property
    def measured_makespan(self) -> float:
        return max(self.rank_seconds)

    def timeline(self) -> list[dict]:
        """Per rank: compute from 0, wait for the slowest rank, then the all-reduce (seconds)."""
        slowest = self.measured_makespan
        return [
            {
                "rank": r,
                "compute_s": t,
                "wait_s": slowest - t,
                "reduce_s": self.reduce_seconds,
                "predicted": p,
                "unit": self.balance.unit,
            }
            for r, (t, p) in enumerate(zip(self.rank_seconds, self.predicted, strict=True))
        ]


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU), so host clocks time what ran."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _all_reduce_grads(params: list[torch.nn.Parameter], group) -> None:
    """Sum every parameter's ``.grad`` over the ranks, one flat buffer per (device, dtype)."""
    buckets: dict = {}
    for p in params:
        buckets.setdefault((p.grad.device, p.grad.dtype), []).append(p)
    for bucket in buckets.values():
        flat = torch.cat([p.grad.reshape(-1) for p in bucket])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        offset = 0
        for p in bucket:
            n = p.grad.numel()
            p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
            offset += n


def _run_share(model, plan: StepPlan, rank: int, device: torch.device) -> dict:
    """This rank's share through ``tree_backward`` (into ``.grad``, which the caller cleared), timed.

    An exception is returned as ``"error"``, to be reported to every rank; an interrupt propagates."""
    share = plan.balance.shares[rank]
    status = {"error": None, "plan": plan.digest, "parameters": None, "result": None}
    try:
        status["parameters"] = parameter_summary(model)  # the weights the share runs with
    except Exception as e:
        status["error"] = describe(e)
    sync(device)
    t0 = time.perf_counter()
    try:
        if share.sequences and status["error"] is None:
            weights = [plan.token_weights[i] for i in share.sequences]
            status["result"] = tree_backward(model, share.trie, weights, **plan.engine)
    except Exception as e:
        status["error"] = describe(e)
    sync(device)
    status["seconds"] = time.perf_counter() - t0
    return status


def _check_statuses(statuses: list[dict], rank: int) -> None:
    """Raise on every rank when the ranks ran different plans or models, or a rank failed (a mismatch
    first: it explains a failure it causes)."""
    if len({s["plan"] for s in statuses}) > 1:
        raise RankMismatchError(f"rank {rank}: the ranks run different plans; call plan_shares on every rank")
    summaries = [s["parameters"] for s in statuses]
    difference = parameter_difference(summaries) if all(x is not None for x in summaries) else None
    if difference:
        raise RankMismatchError(
            f"rank {rank}: the ranks hold different model parameters ({difference}); every rank must start "
            "the step with the same model (broadcast rank 0's parameters, as DDP does)"
        )
    failed = [(r, s["error"]) for r, s in enumerate(statuses) if s["error"]]
    if failed:
        detail = "; ".join(f"rank {r}: {msg}" for r, msg in failed)
        raise RankFailureError(f"rank {rank}: the step failed on rank(s) {[r for r, _ in failed]}: {detail}")


def _step(model, params, plan: StepPlan, saved, *, rank, group, monitor, barrier_timeout_s, started):
    device = params[0].device
    for p in params:
        p.grad = None
    status = _run_share(model, plan, rank, device)
    result = status.pop("result")
    monitored_barrier(monitor, barrier_timeout_s, "after each rank's share")
    statuses = gather_objects(status, monitor)
    _check_statuses(statuses, rank)

    sync(device)
    t1 = time.perf_counter()
    for p in params:
        if p.grad is None:  # a rank without rollouts (or a parameter unused by its share) adds zeros
            p.grad = torch.zeros_like(p)
    _all_reduce_grads(params, group)
    share = plan.balance.shares[rank]
    losses = torch.zeros(plan.trie.num_sequences, dtype=torch.float64)
    if result is not None:
        losses[list(share.sequences)] = result.losses
    dist.all_reduce(losses, op=dist.ReduceOp.SUM, group=monitor)
    sync(device)
    reduce_seconds = time.perf_counter() - t1
    for p, g in zip(params, saved, strict=True):
        if g is not None:
            p.grad += g  # into the step's fresh tensor: ``saved`` stays intact until the call returns
    return DistributedStepResult(
        losses,
        plan.balance,
        [s["seconds"] for s in statuses],
        plan.balance.costs,
        reduce_seconds,
        time.perf_counter() - started,
        None if result is None else result.report,
    )


def run_step(model, plan: StepPlan, *, group=None, barrier_timeout_s: float = 600.0) -> DistributedStepResult:
    """Collective: this rank's share through ``tree_backward``, then gradients and losses summed over ranks.

    Gradients accumulate into ``.grad`` as ``tree_backward`` does. If any rank fails, every rank raises
    :class:`.RankFailureError`; if the ranks' model parameters differ (names, shapes, dtypes or values),
    every rank raises :class:`.RankMismatchError` before anything is all-reduced. Whenever the call does
    not return, an interrupt included, ``.grad`` is left exactly as it was before the call (the same
    tensors, unchanged).
    """
    started = time.perf_counter()
    if not isinstance(plan, StepPlan):
        raise TypeError(f"plan must be a StepPlan (from plan_shares), got {type(plan).__name__}")
    rank = rank_in(group)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameter (requires_grad=True): nothing to train")
    monitor = monitor_group(group)
    saved = [p.grad for p in params]
    try:
        return _step(
            model,
            params,
            plan,
            saved,
            rank=rank,
            group=group,
            monitor=monitor,
            barrier_timeout_s=barrier_timeout_s,
            started=started,
        )
    except BaseException:  # an interrupt too: every earlier gradient comes back, not None
        for p, g in zip(params, saved, strict=True):
            p.grad = g
        raise


def distributed_tree_backward(
    model, trie: RolloutTrie, token_weights=None, *, group=None, barrier_timeout_s: float = 600.0, **kwargs
) -> DistributedStepResult:
    """:func:`plan_shares` then :func:`run_step`: ``tree_backward`` over ranks, gradients summed.

    ``kwargs`` go to :func:`plan_shares` (``partitioner``, ``balance_by``, ``mode``, ``block_tokens``,
    ``token_budget``, ``cost_model``, ...). Where the same rollouts train for several steps, plan once
    and call :func:`run_step` per step.
    """
    plan = plan_shares(trie, token_weights, group=group, barrier_timeout_s=barrier_timeout_s, **kwargs)
    return run_step(model, plan, group=group, barrier_timeout_s=barrier_timeout_s)
