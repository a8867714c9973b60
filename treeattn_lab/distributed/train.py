"""Data-parallel training on a rollout trie: every rank runs ``tree_backward`` on its balanced share.

One step, on every rank of a ``torch.distributed`` group (all collective: every rank calls the same
functions in the same order):

1. :func:`plan_shares`: each rank checks its arguments and hashes the rollouts, their token weights and
   the settings (SHA-256); the digests are all-gathered, and if any rank rejected its input or differs,
   **every** rank raises :class:`RankMismatchError` naming the ranks. Then every rank computes the same
   partition (:func:`.balance.balance`, deterministic) with the engine's cost model, so the predicted
   cost per rank is in the engine's own units (seconds).
2. :func:`run_step`: the rank's share (its own trie) goes through
   :func:`treeattn_lab.engine.tree_backward`, timed. A monitored barrier then checks that every rank
   finished (a rank that hung or died is named within ``barrier_timeout_s``), the ranks exchange their
   status, and if any rank raised, **every** rank raises :class:`RankFailureError` with its message (and
   the gradients are left as they were before the step). Otherwise the gradients are all-reduced (sum,
   one flat buffer per dtype) and so are the per-rollout losses.

The sum over ranks of each share's gradient is the gradient of the whole trie's loss, so the result
equals single-process ``tree_backward`` (the tests check this in float64 on 2 and 3 gloo ranks).
:func:`distributed_tree_backward` does both steps in one call. Small control messages and the barriers run
on a gloo group (the default group when it is gloo; a side group next to NCCL), so they never block a GPU.

Command line, under torchrun (one process per GPU; NCCL on GPUs, gloo on CPUs)::

    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc-per-node 2 -m treeattn_lab.distributed.train \\
        --set grpo_math --out bench/results

calibrates the cost model on each GPU (rank 0's is used everywhere), refines it on a probe of the
real rollouts (:func:`refine_cost_model`; ``--no-refine`` skips it), then times training steps
(``tree_backward`` + all-reduce + AdamW) for the anchor partitioner and this lab's, records each rank's
measured compute time beside its predictions (the refined model's and the calibration's alone), times
the same step on one GPU alone for the throughput ratio, and writes
``multi-gpu-train-<K>x__<device>__*.json``. ``NCCL_NVLS_ENABLE=0`` (NVLink multicast off)
is also set by :func:`init_distributed` when unset. On a CPU, ``--model tiny`` on a small subset runs the
same code with gloo.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ..engine import CostModel, MicroBatchShape, plan_micro_batches, tree_backward
from ..engine.cost_model import MODES
from ..engine.tree_backward import TreeBackwardReport, check_token_weights
from ..reference import TinyLM, TinyLMConfig
from ..trie import RolloutTrie
from .balance import ANCHOR, BEST, PARTITIONERS, BalanceReport, EngineCost, TokenCost, balance

# the lab's TinyLM at the size of `bench train` (0.49B, Llama-style) and a tiny one for CPUs
MODELS = {
    "llama-0.5b": TinyLMConfig(
        vocab_size=32000, dim=1024, n_layers=24, n_heads=8, n_kv_heads=2, ffn_dim=4864
    ),
    "tiny": TinyLMConfig(vocab_size=32000, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128),
}


class RankMismatchError(ValueError):
    """The ranks hold different rollouts, token weights or settings (raised on every rank)."""


class RankFailureError(RuntimeError):
    """A rank failed or hung during the step (raised on every rank)."""


# ============================================================================================ process group
def init_distributed(
    backend: str | None = None, *, timeout_s: float = 600.0
) -> tuple[int, int, torch.device]:
    """``init_process_group`` from torchrun's environment: NCCL with one GPU per local rank where CUDA is
    available, else gloo; every collective times out after ``timeout_s``. Returns (rank, world, device)."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (see the module docstring)
    cuda = torch.cuda.is_available()
    backend = backend or ("nccl" if cuda else "gloo")
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size(), device


_MONITOR_GROUPS: dict = {}


def _monitor_group(group):
    """A gloo group over the ranks of ``group``, for barriers and small objects (``group`` itself if gloo)."""
    if "nccl" not in str(dist.get_backend(group)).lower():
        return group
    key = id(group)
    if key not in _MONITOR_GROUPS:  # collective: every rank creates it at the same call
        ranks = dist.get_process_group_ranks(group) if group is not None else None
        _MONITOR_GROUPS[key] = dist.new_group(ranks=ranks, backend="gloo")
    return _MONITOR_GROUPS[key]


def _barrier(monitor, timeout_s: float, where: str) -> None:
    """A monitored barrier: raises on every rank (rank 0 naming the missing ranks) instead of hanging."""
    if dist.get_world_size(monitor) == 1:
        return
    try:
        dist.monitored_barrier(group=monitor, timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)
    except RuntimeError as e:
        rank = dist.get_rank(monitor)
        raise RankFailureError(
            f"rank {rank}: not every rank reached the barrier {where} within {timeout_s:g} s (a rank hung, "
            f"died or is much slower): {e}"
        ) from e


def _rank_in(group) -> int:
    """This process's rank in ``group``; a clear error for a process outside it (torch returns -1)."""
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of the given process group")
    return rank


def _gather(obj, monitor) -> list:
    out = [None] * dist.get_world_size(monitor)
    dist.all_gather_object(out, obj, group=monitor)
    return out


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


def _digest(trie: RolloutTrie, weights: list[torch.Tensor], settings: dict) -> str:
    h = hashlib.sha256()
    h.update(json.dumps(trie.to_dict(), separators=(",", ":")).encode())
    for w in weights:
        h.update(bytes(w.detach().to("cpu", torch.float64).clone().untyped_storage()))
    h.update(json.dumps(settings, sort_keys=True, default=str).encode())
    return h.hexdigest()


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
    monitor = _monitor_group(group)
    rank, world = _rank_in(group), dist.get_world_size(group)
    cost_model = cost_model or CostModel()
    engine = {
        "mode": mode,
        "block_tokens": block_tokens,
        "token_budget": token_budget,
        "cost_model": cost_model,
        "memory_limit": memory_limit,
        "attention_backend": attention_backend,
    }
    digest, problem = None, None
    try:  # a bad argument on one rank must stop every rank, so it is reported through the exchange below
        if not isinstance(trie, RolloutTrie):
            raise TypeError(f"trie must be a RolloutTrie, got {type(trie).__name__}")
        if balance_by not in ("engine", "tokens"):
            raise ValueError(f"balance_by must be 'engine' or 'tokens', got {balance_by!r}")
        if partitioner not in PARTITIONERS:
            raise ValueError(f"unknown partitioner {partitioner!r}; choose one of {sorted(PARTITIONERS)}")
        weights = check_token_weights(trie, token_weights)
        settings = {k: (v.to_dict() if isinstance(v, CostModel) else v) for k, v in engine.items()}
        settings.update(partitioner=partitioner, balance_by=balance_by, world=world)
        digest = _digest(trie, weights, settings)
    except Exception as e:
        problem = f"{type(e).__name__}: {e}"
    _barrier(monitor, barrier_timeout_s, "at the start of planning")
    gathered = _gather({"digest": digest, "problem": problem}, monitor)
    problems = [(r, g["problem"]) for r, g in enumerate(gathered) if g["problem"]]
    if problems:
        detail = "; ".join(f"rank {r}: {msg}" for r, msg in problems)
        raise RankMismatchError(
            f"rank {rank}: rank(s) {[r for r, _ in problems]} rejected their input ({detail})"
        )
    digests = [g["digest"] for g in gathered]
    if len(set(digests)) > 1:
        groups: dict[str, list[int]] = {}
        for r, d in enumerate(digests):
            groups.setdefault(d, []).append(r)
        parts = "; ".join(f"ranks {ranks} hold {d[:12]}" for d, ranks in groups.items())
        raise RankMismatchError(
            f"rank {rank}: the ranks disagree on the rollouts, token weights or settings ({parts}); every "
            "rank must pass the same trie, weights and arguments"
        )
    cost = (
        TokenCost()
        if balance_by == "tokens"
        else EngineCost(cost_model, mode=mode, block_tokens=block_tokens, memory_limit=memory_limit)
    )
    report = balance(trie, world, partitioner, cost=cost, token_budget=token_budget)
    plan_digest = hashlib.sha256((digest + repr([s.sequences for s in report.shares])).encode()).hexdigest()
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


def _sync(device: torch.device) -> None:
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


def run_step(model, plan: StepPlan, *, group=None, barrier_timeout_s: float = 600.0) -> DistributedStepResult:
    """Collective: this rank's share through ``tree_backward``, then gradients and losses summed over ranks.

    Gradients accumulate into ``.grad`` as ``tree_backward`` does. If any rank fails, every rank raises
    :class:`RankFailureError` and ``.grad`` is left as it was before the call.
    """
    started = time.perf_counter()
    rank = _rank_in(group)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameter (requires_grad=True): nothing to train")
    monitor = _monitor_group(group)
    share = plan.balance.shares[rank]
    device = params[0].device
    saved = [p.grad for p in params]
    for p in params:
        p.grad = None
    result, error = None, None
    _sync(device)
    t0 = time.perf_counter()
    try:
        if share.sequences:
            weights = [plan.token_weights[i] for i in share.sequences]
            result = tree_backward(model, share.trie, weights, **plan.engine)
    except Exception as e:  # reported to every rank below, then raised everywhere
        error = f"{type(e).__name__}: {e}"
    _sync(device)
    seconds = time.perf_counter() - t0

    def restore():
        for p, g in zip(params, saved, strict=True):
            p.grad = g

    try:
        _barrier(monitor, barrier_timeout_s, "after each rank's share")
        statuses = _gather({"error": error, "seconds": seconds, "plan": plan.digest}, monitor)
    except BaseException:
        restore()
        raise
    failed = [(r, s["error"]) for r, s in enumerate(statuses) if s["error"]]
    if failed:
        restore()
        detail = "; ".join(f"rank {r}: {msg}" for r, msg in failed)
        raise RankFailureError(f"rank {rank}: the step failed on rank(s) {[r for r, _ in failed]}: {detail}")
    if len({s["plan"] for s in statuses}) > 1:
        restore()
        raise RankMismatchError(f"rank {rank}: the ranks run different plans; call plan_shares on every rank")

    _sync(device)
    t1 = time.perf_counter()
    for p in params:
        if p.grad is None:  # a rank without rollouts (or a parameter unused by its share) adds zeros
            p.grad = torch.zeros_like(p)
    _all_reduce_grads(params, group)
    losses = torch.zeros(plan.trie.num_sequences, dtype=torch.float64)
    if result is not None:
        losses[list(share.sequences)] = result.losses
    dist.all_reduce(losses, op=dist.ReduceOp.SUM, group=monitor)
    _sync(device)
    reduce_seconds = time.perf_counter() - t1
    for p, g in zip(params, saved, strict=True):
        if g is not None:
            p.grad += g
    return DistributedStepResult(
        losses,
        plan.balance,
        [s["seconds"] for s in statuses],
        plan.balance.costs,
        reduce_seconds,
        time.perf_counter() - started,
        None if result is None else result.report,
    )


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


# =========================================================================================== refinement
def refine_cost_model(
    model,
    trie: RolloutTrie,
    cost_model: CostModel,
    *,
    mode: str = "auto",
    block_tokens: int = 2048,
    token_budget: int | None = None,
    attention_backend: str = "auto",
    contenders: float = 2.0,
    repeats: int = 2,
    group=None,
) -> tuple[CostModel, dict]:
    """Collective: rescale ``cost_model`` to times measured on the real rollouts (:meth:`CostModel.refine`).

    The whole trie's micro-batches are dealt round-robin over the ranks; each rank times its micro-batches
    (``tree_backward``, the fastest of ``repeats`` runs, gradients discarded) in every mode the engine
    could pick: ``mode`` itself, or under ``"auto"`` each mode predicted within ``contenders`` x the
    fastest. The timings are all-gathered and rank 0's refit is broadcast, so every rank plans with the
    same model. Existing ``.grad`` are restored. Returns the refined model and a summary of the probe.

    The probe measures the rollouts that are then trained: predictions of the refined model are fitted in
    part on them (the whole trie's micro-batches; the ranks' shares cut them differently), so report them
    beside the calibration's own.
    """
    started = time.perf_counter()
    monitor = _monitor_group(group)
    rank, world = _rank_in(group), dist.get_world_size(group)
    micro_batches = plan_micro_batches(trie, token_budget)
    shapes = [MicroBatchShape.of(mb.trie, block_tokens, token_budget) for mb in micro_batches]
    params = [p for p in model.parameters() if p.requires_grad]
    saved = [p.grad for p in params]
    device = params[0].device if params else torch.device("cpu")
    timings, error = [], None
    try:
        for i in range(rank, len(micro_batches), world):
            if mode == "auto":
                predicted = {m: cost_model.predict(shapes[i], m)[0] for m in MODES}
                modes = [m for m in MODES if predicted[m] <= contenders * min(predicted.values())]
            else:
                modes = [mode]
            for m in modes:
                best = math.inf
                for _ in range(max(1, repeats)):
                    for p in params:
                        p.grad = None
                    _sync(device)
                    report = tree_backward(
                        model,
                        micro_batches[i].trie,
                        None,
                        mode=m,
                        block_tokens=block_tokens,
                        token_budget=token_budget,
                        attention_backend=attention_backend,
                    ).report
                    best = min(best, report.time_s)
                timings.append((i, m, best))
    except Exception as e:  # reported to every rank below
        error = f"{type(e).__name__}: {e}"
    finally:
        for p, g in zip(params, saved, strict=True):
            p.grad = g
    gathered = _gather({"timings": timings, "error": error}, monitor)
    failed = [(r, g["error"]) for r, g in enumerate(gathered) if g["error"]]
    if failed:
        detail = "; ".join(f"rank {r}: {msg}" for r, msg in failed)
        ranks = [r for r, _ in failed]
        raise RankFailureError(f"rank {rank}: the cost-model probe failed on rank(s) {ranks}: {detail}")
    observations = [([(shapes[i], m)], t) for g in gathered for i, m, t in g["timings"]]
    shared = [None]
    if rank == 0:  # a refit that raises must stop every rank, not leave them waiting for the broadcast
        try:
            shared[0] = {"model": cost_model.refine(observations).to_dict()}
        except Exception as e:
            shared[0] = {"error": f"{type(e).__name__}: {e}"}
    src = 0 if monitor is None else dist.get_global_rank(monitor, 0)
    dist.broadcast_object_list(shared, src=src, group=monitor)
    if "error" in shared[0]:
        raise RankFailureError(f"rank {rank}: refining the cost model failed on rank 0: {shared[0]['error']}")
    refined = CostModel.from_dict(shared[0]["model"])
    summary = {
        "micro_batches": len(micro_batches),
        "timings": [
            {"micro_batch": i, "mode": m, "measured_s": t, "predicted_s": cost_model.predict(shapes[i], m)[0]}
            for g in gathered
            for i, m, t in g["timings"]
        ],
        "scales": refined.refinement["scales"],
        "method": refined.refinement["method"],
        "seconds": time.perf_counter() - started,
    }
    return refined, summary


def predicted_for_modes_run(
    cost_model: CostModel,
    plan_model: CostModel,
    micro_batches,
    *,
    mode: str,
    block_tokens: int,
    token_budget: int | None,
) -> float:
    """Seconds ``cost_model`` predicts for ``micro_batches`` run in the modes that ``plan_model`` (the one
    the engine plans with) picks for them: the calibration's own prediction of what actually ran."""
    chooser = EngineCost(plan_model, mode=mode, block_tokens=block_tokens)
    total = 0.0
    for mb in micro_batches:
        run_mode, _ = chooser.mode_and_seconds(mb, token_budget)
        total += cost_model.predict(MicroBatchShape.of(mb.trie, block_tokens, token_budget), run_mode)[0]
    return total


# ====================================================================================== spawned CPU ranks
def _spawned_worker(rank, world, init_file, out_dir, fn, kwargs, timeout_s):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )
    try:
        outcome = {"ok": True, "value": fn(**kwargs)}
    except Exception as e:
        outcome = {"ok": False, "error": type(e).__name__, "message": str(e)}
    torch.save(outcome, Path(out_dir) / f"rank{rank}.pt")
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


def spawn(
    world: int,
    fn,
    kwargs: dict | None = None,
    *,
    timeout_s: float = 120.0,
    collective_timeout_s: float = 60.0,
) -> list[dict]:
    """Run ``fn(**kwargs)`` on ``world`` fresh CPU processes joined in a gloo group.

    ``fn`` must be importable (a module-level function). Returns each rank's outcome, ``{"ok": True,
    "value": ...}`` or ``{"ok": False, "error": exception type name, "message": ...}``. Kills the ranks it
    started and raises TimeoutError when they are not all done within ``timeout_s``.
    """
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        ctx = mp.start_processes(
            _spawned_worker,
            nprocs=world,
            join=False,
            start_method="spawn",
            args=(world, init_file, tmp, fn, kwargs or {}, collective_timeout_s),
        )
        deadline = time.monotonic() + timeout_s
        while not ctx.join(timeout=0.5):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise TimeoutError(f"{world} spawned ranks did not finish within {timeout_s:g} s")
        return [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _tiny_model(vocab: int, dtype: torch.dtype, seed: int) -> TinyLM:
    torch.manual_seed(seed)
    cfg = TinyLMConfig(vocab_size=vocab, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48)
    return TinyLM(cfg).to(dtype)


def check_step(
    seqs: list[list[int]],
    *,
    vocab: int = 50,
    seed: int = 0,
    steps: int = 1,
    corrupt_rank: int | None = None,
    short_rank: int | None = None,
    fail_rank: int | None = None,
    hang_rank: int | None = None,
    hang_s: float = 0.0,
    barrier_timeout_s: float = 30.0,
    **kwargs,
) -> dict:
    """One rank of a self-check (run it through :func:`spawn`): a float64 TinyLM on ``seqs`` with seeded
    random token weights, ``steps`` calls of :func:`distributed_tree_backward`. Returns this rank's
    gradients (a dict of tensors), losses and timeline. Fault injection: ``corrupt_rank`` changes one token
    weight on that rank, ``short_rank`` drops one, ``fail_rank`` makes that rank's model raise,
    ``hang_rank`` sleeps ``hang_s`` seconds before the step."""
    rank = dist.get_rank()
    model = _tiny_model(vocab, torch.float64, seed)
    trie = RolloutTrie.from_sequences(seqs)
    gen = torch.Generator().manual_seed(seed + 1)
    weights = [torch.randn(len(s), generator=gen, dtype=torch.float64) for s in seqs]
    if rank == corrupt_rank:
        weights[-1] = weights[-1].clone()
        weights[-1][-1] += 1.0
    if rank == short_rank:
        weights = weights[:-1]
    if rank == fail_rank:

        def broken(*args, **kw):
            raise RuntimeError("injected failure in the model's forward")

        model.forward = broken  # the engine calls the model (nn.Module.__call__ -> forward) in every mode
    if rank == hang_rank:
        time.sleep(hang_s)
    result = None
    for _ in range(steps):
        result = distributed_tree_backward(
            model, trie, weights, barrier_timeout_s=barrier_timeout_s, **kwargs
        )
    return {
        "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
        "losses": result.losses,
        "timeline": result.timeline(),
        "sequences": [s.sequences for s in result.balance.shares],
        "predicted_engine": None if result.local is None else result.local.predicted_s,
        "modes": None if result.local is None else result.local.modes,
    }


def check_cases(cases: list[dict]) -> list[dict]:
    """:func:`check_step` for each case in turn on the same ranks (run through :func:`spawn`); each case's
    outcome is ``{"ok": True, "value": ...}`` or ``{"ok": False, "error": type name, "message": ...}``.
    A case that breaks the group (a hung rank) should come last."""
    out = []
    for case in cases:
        try:
            out.append({"ok": True, "value": check_step(**case)})
        except Exception as e:
            out.append({"ok": False, "error": type(e).__name__, "message": str(e)})
    return out


def demo_step(
    set_name: str = "tree_search",
    *,
    max_rollouts: int = 16,
    stride: int = 3,
    max_tokens: int = 256,
    partitioners: tuple[str, ...] = (ANCHOR, BEST),
    mode: str = "auto",
    block_tokens: int = 64,
    token_budget: int | None = 512,
    steps: int = 2,
) -> dict:
    """One rank of a small real run (through :func:`spawn`): the tiny TinyLM (fp32) on ``max_rollouts``
    rollouts of a bundled set (every ``stride``-th, cut to ``max_tokens``). Per partitioner: the plan's
    numbers and the last step's timeline; then the largest relative gradient error against this rank
    running the whole trie alone."""
    from ..datasets import load_rollouts

    seqs = [s[:max_tokens] for s in load_rollouts(set_name)[::stride][:max_rollouts]]
    trie = RolloutTrie.from_sequences(seqs)
    torch.manual_seed(0)  # the same weights on every rank
    model = TinyLM(MODELS["tiny"])
    engine = {"mode": mode, "block_tokens": block_tokens, "token_budget": token_budget}
    out = {"timelines": {}, "plans": {}}
    for name in partitioners:
        plan = plan_shares(trie, partitioner=name, **engine)
        for _ in range(steps):
            model.zero_grad(set_to_none=True)
            result = run_step(model, plan)
        out["timelines"][name] = result.timeline()
        out["plans"][name] = plan.balance.row()
    together = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    tree_backward(model, trie, None, **engine)
    out["grad_rel_error"] = max(
        float((together[n] - p.grad).norm() / p.grad.norm().clamp_min(1e-30))
        for n, p in model.named_parameters()
    )
    return out


# ============================================================================================ command line
def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _timed_steps(model, optimizer, step, *, steps: int, warmup: int, group) -> list:
    """Run ``step()`` (returning a result) warmup + steps times, all ranks starting together."""
    device = next(model.parameters()).device
    out = []
    for i in range(warmup + steps):
        optimizer.zero_grad(set_to_none=True)
        dist.barrier(group=group)
        _sync(device)
        t0 = time.perf_counter()
        result = step()
        optimizer.step()
        _sync(device)
        if i >= warmup:
            out.append((time.perf_counter() - t0, result))
    return out


def main(argv: list[str] | None = None) -> int:
    from ..bench.harness import environment, print_table, write_results
    from ..datasets import DATASETS, load_rollouts
    from ..engine import calibrate

    parser = argparse.ArgumentParser(
        prog="torchrun --nproc-per-node K -m treeattn_lab.distributed.train",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--set", default="grpo_math", choices=DATASETS)
    parser.add_argument(
        "--model",
        default=None,
        choices=sorted(MODELS),
        help="default: llama-0.5b (bf16) on GPUs, tiny (fp32) on CPUs",
    )
    parser.add_argument("--partitioners", default=f"{ANCHOR},{BEST}")
    parser.add_argument("--mode", default="auto", choices=("auto", "flat", "packed", "dfs"))
    parser.add_argument("--block-tokens", type=int, default=None, help="default 4096 (GPU), 64 (CPU)")
    parser.add_argument("--token-budget", type=int, default=None, help="default 32768 (GPU), 512 (CPU)")
    parser.add_argument("--max-rollouts", type=int, default=None, help="default all (GPU), 16 (CPU)")
    parser.add_argument(
        "--max-tokens", type=int, default=None, help="cut rollouts; default none (GPU), 256 (CPU)"
    )
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--calibration-s", type=float, default=None, help="default 60 (GPU), 5 (CPU)")
    parser.add_argument(
        "--refine",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="rescale the calibrated cost model on a probe of these rollouts before planning "
        "(refine_cost_model; the calibration's own predictions are reported beside); default on",
    )
    parser.add_argument("--no-single", action="store_true", help="skip the one-device baseline")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="collective timeout")
    parser.add_argument("--barrier-timeout-s", type=float, default=600.0)
    parser.add_argument("--out", default=None, help="results folder (default bench/results/)")
    args = parser.parse_args(argv)
    partitioners = args.partitioners.split(",")
    if any(p not in PARTITIONERS for p in partitioners):
        parser.error(f"--partitioners: choose from {sorted(PARTITIONERS)}")

    rank, world, device = init_distributed(timeout_s=args.timeout_s)
    monitor = _monitor_group(None)
    cuda = device.type == "cuda"
    model_name = args.model or ("llama-0.5b" if cuda else "tiny")
    dtype = torch.bfloat16 if cuda else torch.float32
    block_tokens = args.block_tokens or (4096 if cuda else 64)
    token_budget = args.token_budget or (32768 if cuda else 512)
    max_rollouts = args.max_rollouts or (None if cuda else 16)
    max_tokens = args.max_tokens or (None if cuda else 256)
    seqs = load_rollouts(args.set)[:max_rollouts]
    seqs = [s[:max_tokens] for s in seqs] if max_tokens else seqs
    trie = RolloutTrie.from_sequences(seqs)
    flat_tokens = sum(trie.seq_lengths)

    torch.manual_seed(0)
    model = TinyLM(MODELS[model_name]).to(device, dtype)
    for p in model.parameters():  # identical weights everywhere, as DDP does at start
        dist.broadcast(p.data, src=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    calibration_s = args.calibration_s if args.calibration_s is not None else (60.0 if cuda else 5.0)
    local_model = calibrate(
        model,
        block_tokens=block_tokens,
        token_budget=token_budget,
        seconds=calibration_s,
        use_cache=False,
        progress=rank == 0,
    )
    shared = [local_model.to_dict()]
    dist.broadcast_object_list(shared, src=0, group=monitor)  # every rank plans with rank 0's model
    calibrated = cost_model = CostModel.from_dict(shared[0])
    probe = None
    if args.refine:
        cost_model, probe = refine_cost_model(
            model, trie, calibrated, mode=args.mode, block_tokens=block_tokens, token_budget=token_budget
        )
    engine = {
        "mode": args.mode,
        "block_tokens": block_tokens,
        "token_budget": token_budget,
        "cost_model": cost_model,
    }
    shape_of = {"mode": args.mode, "block_tokens": block_tokens, "token_budget": token_budget}

    rows, timelines = [], {}
    for name in partitioners:
        plan = plan_shares(trie, partitioner=name, barrier_timeout_s=args.barrier_timeout_s, **engine)
        timed = _timed_steps(
            model,
            optimizer,
            lambda plan=plan: run_step(model, plan, barrier_timeout_s=args.barrier_timeout_s),
            steps=args.steps,
            warmup=args.warmup,
            group=None,
        )
        step_s = _median([t for t, _ in timed])
        per_rank = [_median([r.rank_seconds[q] for _, r in timed]) for q in range(world)]
        makespan = _median([r.measured_makespan for _, r in timed])
        report = plan.balance
        calibrated_per_rank = [
            predicted_for_modes_run(calibrated, cost_model, share.micro_batches, **shape_of)
            for share in report.shares
        ]
        rows.append(
            {
                "partitioner": name,
                "ranks": world,
                "step_s": step_s,
                "tokens_per_s": flat_tokens / step_s,
                "measured_makespan_s": makespan,
                "predicted_makespan_s": report.makespan,
                "prediction_error": makespan / report.makespan - 1,
                "measured_imbalance": max(per_rank) / (sum(per_rank) / world),
                "predicted_imbalance": report.imbalance,
                "reduce_s": _median([r.reduce_seconds for _, r in timed]),
                "plan_s": plan.seconds,
                "replicated_tokens": report.replicated_tokens,
                "per_rank_measured_s": per_rank,
                "per_rank_predicted_s": report.costs,
                "predicted_makespan_calibrated_s": max(calibrated_per_rank),
                "prediction_error_calibrated": makespan / max(calibrated_per_rank) - 1,
                "per_rank_predicted_calibrated_s": calibrated_per_rank,
                "prediction_from": "refined" if probe else "calibrated",
                "modes": sorted({m for _, r in timed if r.local for m in r.local.modes}),
            }
        )
        timelines[name] = timed[-1][1].timeline()

    if not args.no_single:  # every rank trains the whole trie alone on its own device, at the same time
        single_plan = balance(
            trie,
            1,
            BEST,
            cost=EngineCost(cost_model, mode=args.mode, block_tokens=block_tokens),
            token_budget=token_budget,
        )
        timed = _timed_steps(
            model,
            optimizer,
            lambda: tree_backward(model, trie, None, **engine),
            steps=args.steps,
            warmup=args.warmup,
            group=None,
        )
        step_s = _median([t for t, _ in timed])
        compute = _median([r.report.time_s for _, r in timed])
        calibrated_single = predicted_for_modes_run(
            calibrated, cost_model, single_plan.shares[0].micro_batches, **shape_of
        )
        rows.append(
            {
                "partitioner": "one device",
                "ranks": 1,
                "step_s": step_s,
                "tokens_per_s": flat_tokens / step_s,
                "measured_makespan_s": compute,
                "predicted_makespan_s": single_plan.makespan,
                "prediction_error": compute / single_plan.makespan - 1,
                "predicted_makespan_calibrated_s": calibrated_single,
                "prediction_error_calibrated": compute / calibrated_single - 1,
                "prediction_from": "refined" if probe else "calibrated",
                "modes": sorted({m for _, r in timed for m in r.report.modes}),
            }
        )
        for r in rows[:-1]:
            r["speedup_vs_one_device"] = step_s / r["step_s"]

    checks = []
    best = next((r for r in rows if r["partitioner"] == BEST), None)
    if best is not None:
        if probe:
            checks.append(
                {
                    "target": f"{BEST}: measured makespan within 10% of the prediction (model refined on a "
                    "probe of these rollouts)",
                    "value": best["prediction_error"],
                    "goal": 0.10,
                    "met": abs(best["prediction_error"]) <= 0.10,
                }
            )
        checks.append(
            {
                "target": f"{BEST}: measured makespan within 10% of the calibration's prediction",
                "value": best["prediction_error_calibrated"],
                "goal": 0.10,
                "met": abs(best["prediction_error_calibrated"]) <= 0.10,
            }
        )
        if "speedup_vs_one_device" in best:
            goal = 0.9 * world
            checks.append(
                {
                    "target": f"{BEST}: throughput >= {goal:g} x one device ({args.set})",
                    "value": best["speedup_vs_one_device"],
                    "goal": goal,
                    "met": best["speedup_vs_one_device"] >= goal,
                }
            )
    if rank == 0:
        env = environment()
        env.update(
            world_size=world, backend=dist.get_backend(), nccl_nvls_enable=os.environ.get("NCCL_NVLS_ENABLE")
        )
        title = (
            f"{args.set} on {world} x {env['device']}, TinyLM {model_name} "
            f"{str(dtype).removeprefix('torch.')}, mode {args.mode}, block {block_tokens}, "
            f"budget {token_budget}"
        )
        print_table(
            title,
            [
                ("partitioner", "partitioner"),
                ("step_s", "step s"),
                ("tokens_per_s", "flat tok/s"),
                ("speedup_vs_one_device", "x one device"),
                ("measured_makespan_s", "makespan s"),
                ("predicted_makespan_s", "predicted s"),
                ("prediction_error", "error"),
                ("predicted_makespan_calibrated_s", "calib. pred. s"),
                ("prediction_error_calibrated", "calib. error"),
                ("measured_imbalance", "imbalance"),
                ("predicted_imbalance", "predicted imb."),
                ("reduce_s", "all-reduce s"),
                ("plan_s", "plan s"),
            ],
            rows,
        )
        print_table(
            "targets", [("target", "target"), ("value", "value"), ("goal", "goal"), ("met", "met")], checks
        )
        path = write_results(
            f"multi-gpu-train-{world}x",
            rows,
            env,
            directory=Path(args.out) if args.out else None,
            extra={
                "set": args.set,
                "model": model_name,
                "dtype": str(dtype),
                "mode": args.mode,
                "block_tokens": block_tokens,
                "token_budget": token_budget,
                "flat_tokens": flat_tokens,
                "cost_model": cost_model.to_dict(),
                "cost_model_calibrated": calibrated.to_dict(),
                "refinement_probe": probe,
                "timelines": timelines,
                "targets": checks,
            },
        )
        print(f"wrote {path}")
    dist.barrier(group=monitor)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
