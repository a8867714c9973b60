"""A probe of the real rollouts: the engine's cost model rescaled to times measured on them, over ranks.

:func:`refine_cost_model` deals the whole trie's micro-batches round-robin over the ranks; each rank times
its micro-batches in every mode the engine could pick, the timings are all-gathered and rank 0's refit
(:meth:`treeattn_lab.engine.CostModel.refine`) is broadcast, so every rank plans with the same model.
:func:`predicted_for_modes_run` is the calibration's own prediction of what a plan actually ran, to report
beside the refined model's (which is fitted in part on the rollouts it then predicts).
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from ..engine import CostModel, MicroBatchShape, plan_micro_batches, tree_backward
from ..engine.cost_model import MODES
from ..trie import RolloutTrie
from .agreement import RankFailureError, describe, gather_objects, monitor_group, rank_in
from .costs import EngineCost
from .step import sync


def _probe_modes(cost_model: CostModel, shape: MicroBatchShape, mode: str, contenders: float) -> list[str]:
    """``[mode]``, or under ``"auto"`` every mode predicted within ``contenders`` x the fastest."""
    if mode != "auto":
        return [mode]
    predicted = {m: cost_model.predict(shape, m)[0] for m in MODES}
    return [m for m in MODES if predicted[m] <= contenders * min(predicted.values())]


def _time_micro_batches(model, micro_batches, indices, modes_of, *, repeats: int, **engine) -> list[tuple]:
    """``(index, mode, fastest seconds of repeats)`` for each micro-batch index and each of its modes.

    Leaves every trainable parameter's ``.grad`` as it found it, whatever happens."""
    params = [p for p in model.parameters() if p.requires_grad]
    saved = [p.grad for p in params]
    device = params[0].device if params else torch.device("cpu")
    timings = []
    try:
        for i in indices:
            for m in modes_of(i):
                best = math.inf
                for _ in range(max(1, repeats)):
                    for p in params:
                        p.grad = None
                    sync(device)
                    report = tree_backward(model, micro_batches[i].trie, None, mode=m, **engine).report
                    best = min(best, report.time_s)
                timings.append((i, m, best))
    finally:
        for p, g in zip(params, saved, strict=True):
            p.grad = g
    return timings


def _broadcast_refit(cost_model: CostModel, observations, rank: int, monitor) -> CostModel:
    """Rank 0's refit, on every rank; a refit that raises stops every rank (not a hung broadcast)."""
    shared = [None]
    if rank == 0:
        try:
            shared[0] = {"model": cost_model.refine(observations).to_dict()}
        except Exception as e:
            shared[0] = {"error": describe(e)}
    src = 0 if monitor is None else dist.get_global_rank(monitor, 0)
    dist.broadcast_object_list(shared, src=src, group=monitor)
    if "error" in shared[0]:
        raise RankFailureError(f"rank {rank}: refining the cost model failed on rank 0: {shared[0]['error']}")
    return CostModel.from_dict(shared[0]["model"])


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

    The whole trie's micro-batches (the budget's cuts with ``cost_model``, before ``"auto"`` joins its
    neighbouring dfs ones; in ``"dfs"`` mode the one whole trie) are dealt round-robin over the ranks;
    each rank times its micro-batches (``tree_backward``, the fastest of ``repeats`` runs, gradients
    discarded) in every mode the engine could pick: ``mode`` itself, or under ``"auto"`` each mode
    predicted within ``contenders`` x the fastest. The timings are all-gathered and rank 0's
    refit is broadcast, so every rank plans with the same model. Existing ``.grad`` are restored.
    Returns the refined model and a summary of the probe.

    The probe measures the rollouts that are then trained: predictions of the refined model are fitted in
    part on them (the whole trie's micro-batches; the ranks' shares cut them differently), so report them
    beside the calibration's own (:func:`predicted_for_modes_run`).
    """
    started = time.perf_counter()
    monitor = monitor_group(group)
    rank, world = rank_in(group), dist.get_world_size(group)
    micro_batches = plan_micro_batches(trie, token_budget, cost_model=cost_model, mode=mode)
    shapes = [MicroBatchShape.of(mb.trie, block_tokens, token_budget) for mb in micro_batches]
    timings, error = [], None
    try:
        timings = _time_micro_batches(
            model,
            micro_batches,
            range(rank, len(micro_batches), world),
            lambda i: _probe_modes(cost_model, shapes[i], mode, contenders),
            repeats=repeats,
            block_tokens=block_tokens,
            token_budget=token_budget,
            attention_backend=attention_backend,
        )
    except Exception as e:  # reported to every rank below
        error = describe(e)
    gathered = gather_objects({"timings": timings, "error": error}, monitor)
    failed = [(r, g["error"]) for r, g in enumerate(gathered) if g["error"]]
    if failed:
        detail = "; ".join(f"rank {r}: {msg}" for r, msg in failed)
        ranks = [r for r, _ in failed]
        raise RankFailureError(f"rank {rank}: the cost-model probe failed on rank(s) {ranks}: {detail}")
    every = [t for g in gathered for t in g["timings"]]
    refined = _broadcast_refit(cost_model, [([(shapes[i], m)], t) for i, m, t in every], rank, monitor)
    summary = {
        "micro_batches": len(micro_batches),
        "timings": [
            {"micro_batch": i, "mode": m, "measured_s": t, "predicted_s": cost_model.predict(shapes[i], m)[0]}
            for i, m, t in every
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
