"""What every engine call does before and around the model: check its arguments, cut the trie into
micro-batches, pick each micro-batch's mode, and time and measure each phase of the call.

``"auto"`` asks the cost model (:mod:`treeattn_lab.engine.cost_model`) for the mode it predicts fastest
for each micro-batch's shape (:func:`auto_micro_batches`); while dropout is active it never picks
``"dfs"`` for a gradient pass (DFS runs prefixes twice and needs the same activations both times).
Neighbouring micro-batches it puts in ``"dfs"`` then run as one where the cost model predicts that one
fits the memory limit: a DFS micro-batch's memory is its block and its path, not its tokens, and the
joined one computes no prefix twice across the cut. Each DFS micro-batch then runs in the fastest block
size of :func:`dfs_block_ladder` that fits: under a memory limit, whose predicted peak fits it; without
one, whose calls hold at most ``token_budget`` tokens (the budget bounds the tokens one call holds with
autograd, a packed micro-batch's or a DFS block's). ``block_tokens`` is the smallest block, and memory the
limit leaves unused buys fewer, larger calls.

The budget's cuts cost a packed plan the prefixes it carries over them; a walk of the whole trie in
budget-sized blocks (under a memory limit, blocks that fit it) carries none and recomputes only the spine
above its packed subtrees. So where the cost model's dfs time was fitted to measurements (it knows what a
call costs) ``"auto"`` also weighs the whole trie as one DFS walk and runs it where that is predicted
faster than the micro-batch plan. :func:`engine_micro_batches` is that plan, shared with the distributed
balancer.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field, replace
from itertools import groupby

import torch

from ..checks import check_int
from ..trie import RolloutTrie
from .adapters import ModelAdapter, adapt
from .cost_model import CostModel, MicroBatchShape
from .microbatch import MicroBatch, plan_micro_batches, shared_micro_batch
from .modes import MODES


@dataclass
class CallPlan:
    """The adapter, the micro-batches and the mode (and predicted seconds per mode) of each."""

    adapter: ModelAdapter
    micro_batches: list[MicroBatch]
    modes: list[str] = field(default_factory=list)
    predicted_s: list[dict] = field(default_factory=list)
    longest: int = 0


def active_dropout(model: torch.nn.Module) -> bool:
    return any(
        isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.training and m.p > 0 for m in model.modules()
    )


def plan_call(
    model,
    trie: RolloutTrie,
    mode: str,
    block_tokens: int,
    token_budget: int | None,
    cost_model: CostModel | None,
    memory_limit: float | None = None,
    *,
    with_grad: bool,
) -> CallPlan:
    """Check the arguments shared by every engine call and plan it; raises TypeError/ValueError."""
    if not isinstance(trie, RolloutTrie):
        raise TypeError(f"trie must be a RolloutTrie, got {type(trie).__name__}")
    if not isinstance(mode, str) or mode not in ("auto",) + MODES:
        raise ValueError(f"mode must be one of {('auto',) + MODES}, got {mode!r}")
    check_int("block_tokens", block_tokens)
    check_int("token_budget", token_budget, allow_none=True)
    adapter = adapt(model)
    if max(max(s) if s else 0 for s in (n.tokens for n in trie.nodes)) >= adapter.vocab_size:
        raise ValueError(f"the trie holds token ids >= the model's vocabulary size {adapter.vocab_size}")
    longest = max(trie.seq_lengths)
    adapter.check_length(longest)
    deterministic = not (with_grad and active_dropout(adapter.model))
    if mode == "dfs" and not deterministic:
        raise ValueError(
            "dropout is active (model in train mode with p > 0): the DFS mode runs prefixes twice and needs "
            "the same activations both times; call model.eval() or set dropout to 0"
        )
    allowed = MODES if deterministic else tuple(m for m in MODES if m != "dfs")
    planned = engine_micro_batches(trie, mode, block_tokens, token_budget, cost_model, memory_limit, allowed)
    plan = CallPlan(adapter, [mb for mb, _ in planned], longest=longest)
    plan.predicted_s = [predicted for _, predicted in planned]
    plan.modes = [mb.mode for mb in plan.micro_batches]
    return plan


def engine_micro_batches(
    trie: RolloutTrie,
    mode: str,
    block_tokens: int,
    token_budget: int | None,
    cost_model: CostModel | None = None,
    memory_limit: float | None = None,
    modes: tuple[str, ...] = MODES,
) -> list[tuple[MicroBatch, dict]]:
    """The micro-batches an engine call in ``mode`` runs, each with its ``mode`` set, and the seconds the
    cost model predicts for each per mode: under ``"auto"`` :func:`auto_micro_batches`, otherwise the cuts
    of :func:`~.microbatch.plan_micro_batches` (no predictions). ``cost_model`` None: the prior. Each
    micro-batch's trie is the one every call on ``trie`` running those rollouts shares
    (:func:`~.microbatch.shared_micro_batch`)."""
    cost_model = cost_model or CostModel()
    if mode == "auto":
        planned = auto_micro_batches(trie, block_tokens, token_budget, cost_model, memory_limit, modes)
        return [(shared_micro_batch(trie, mb), {m: p[0] for m, p in predictions.items()})
                for mb, predictions in planned]
    cut = plan_micro_batches(trie, token_budget, cost_model=cost_model, mode=mode)
    return [(shared_micro_batch(trie, replace(mb, mode=mode)), {}) for mb in cut]


def auto_micro_batches(
    trie: RolloutTrie,
    block_tokens: int,
    token_budget: int | None,
    cost_model: CostModel,
    memory_limit: float | None = None,
    modes: tuple[str, ...] = MODES,
) -> list[tuple[MicroBatch, dict]]:
    """The micro-batches ``"auto"`` runs, each with its ``mode`` set, and what the cost model predicts for
    it per mode, ``{mode: (seconds, bytes)}``: the budget's cuts, each in the fastest of ``modes`` that
    fits ``memory_limit``; then each run of neighbouring ``"dfs"`` micro-batches joined
    (:func:`_joined_dfs`); then each ``"dfs"`` one in its block size (:func:`_fastest_fitting_block`, which
    sets its ``block_tokens``; ``"dfs"`` then predicts that size). Finally, where the model's dfs time was
    fitted to measurements (:meth:`CostModel.identifies`: it knows what a call costs), the whole trie as
    one DFS walk (:func:`_whole_walk`) where it fits and is predicted faster than that plan."""
    chosen = []
    for mb in plan_micro_batches(trie, token_budget, cost_model=cost_model, mode="auto"):
        shape = MicroBatchShape.of(mb.trie, block_tokens, token_budget)
        mode, predictions = cost_model.choose(shape, memory_limit=memory_limit, modes=modes)
        chosen.append((replace(mb, mode=mode), predictions))
    joined: list[tuple[MicroBatch, dict]] = []
    for mode, run in groupby(chosen, key=lambda c: c[0].mode):
        run = list(run)
        if mode == "dfs" and len(run) > 1:
            run = _joined_dfs(trie, run, block_tokens, token_budget, cost_model, memory_limit, modes)
        joined.extend(run)
    plan = [
        _fastest_fitting_block(mb, p, block_tokens, token_budget, cost_model, memory_limit)
        if mb.mode == "dfs"
        else (mb, p)
        for mb, p in joined
    ]
    walked = len(plan) == 1 and plan[0][0].mode == "dfs"
    # without a memory limit the budget bounds a call, and a budget below block_tokens admits no walk
    unbounded = memory_limit is None and (token_budget is None or token_budget < block_tokens)
    if "dfs" not in modes or not cost_model.identifies("dfs") or walked or unbounded:
        return plan
    walk = _whole_walk(trie, block_tokens, token_budget, cost_model, memory_limit, modes)
    planned_s = sum(p[mb.mode][0] for mb, p in plan)
    return [walk] if walk is not None and walk[1]["dfs"][0] < planned_s else plan


def _whole_walk(trie, block_tokens, token_budget, cost_model, memory_limit, modes):
    """The whole trie as one ``"dfs"`` micro-batch in its fastest fitting block size, with its predictions;
    None where even ``block_tokens`` is predicted over ``memory_limit``."""
    order = tuple(trie.dfs_sequence_order())
    mb, predictions = _dfs_micro_batch(trie, order, 0, block_tokens, token_budget, cost_model, modes)
    if memory_limit is not None and predictions["dfs"][1] > memory_limit:
        return None
    return _fastest_fitting_block(mb, predictions, block_tokens, token_budget, cost_model, memory_limit)


def _dfs_micro_batch(trie, sequences, carried_tokens, block_tokens, token_budget, cost_model, modes):
    """Rollouts ``sequences`` of ``trie`` (DFS order) as one ``"dfs"`` micro-batch (its r-th rollout is
    ``sequences[r]``), with the cost model's ``{mode: (seconds, bytes)}`` for it at ``block_tokens``."""
    mb = MicroBatch(sequences, trie.subtrie(sequences), carried_tokens, mode="dfs")
    shape = MicroBatchShape.of(mb.trie, block_tokens, token_budget)
    return mb, {m: cost_model.predict(shape, m) for m in modes}


def dfs_block_ladder(block_tokens: int, tree_tokens: int, max_block: int | None = None) -> list[int]:
    """The DFS block sizes ``"auto"`` weighs: ``block_tokens`` doubled until one block holds all
    ``tree_tokens`` of the micro-batch; past ``block_tokens`` itself, only sizes whose calls hold at most
    ``max_block`` tokens (a block larger than the micro-batch holds its ``tree_tokens``; None: no bound)."""
    check_int("block_tokens", block_tokens)
    check_int("tree_tokens", tree_tokens, minimum=0)
    check_int("max_block", max_block, allow_none=True)
    ladder = [block_tokens]
    while ladder[-1] < tree_tokens and (max_block is None or min(2 * ladder[-1], tree_tokens) <= max_block):
        ladder.append(ladder[-1] * 2)
    return ladder


def _fastest_fitting_block(mb, predictions, block_tokens, token_budget, cost_model, memory_limit):
    """The dfs micro-batch ``mb`` in the block size of :func:`dfs_block_ladder` predicted fastest among
    those that fit, and its predictions with ``"dfs"`` at that size; ``block_tokens`` where no larger one
    fits and is faster. A block fits under ``memory_limit`` where its predicted peak does; without a limit,
    where it holds at most ``token_budget`` tokens (with neither, only ``block_tokens`` fits)."""
    if memory_limit is None and token_budget is None:
        return mb, predictions
    best, best_block = predictions["dfs"], block_tokens
    cap = token_budget if memory_limit is None else None
    for block in dfs_block_ladder(block_tokens, mb.tree_tokens, cap)[1:]:
        seconds, peak = cost_model.predict(MicroBatchShape.of(mb.trie, block, token_budget), "dfs")
        if (memory_limit is None or peak <= memory_limit) and seconds < best[0]:
            best, best_block = (seconds, peak), block
    return replace(mb, block_tokens=best_block), {**predictions, "dfs": best}


def _joined_dfs(trie, run, block_tokens, token_budget, cost_model, memory_limit, modes):
    """A run of neighbouring dfs micro-batches ``[(micro-batch, {mode: (seconds, bytes)})]`` joined into as
    few as fit: the whole run where its predicted peak fits, else groups grown left to right while theirs
    does. A group fits where its peak is within ``memory_limit`` or within its members' own (a member that
    no mode fitted runs in dfs, the leanest, anyway; joining must not make it worse)."""

    def fits(joined, members) -> bool:
        if memory_limit is None:
            return True
        bound = max([memory_limit] + [p["dfs"][1] for _, p in members])
        return joined[1]["dfs"][1] <= bound

    def join(members):
        sequences = tuple(i for mb, _ in members for i in mb.sequences)
        return _dfs_micro_batch(trie, sequences, members[0][0].carried_tokens, block_tokens, token_budget,
                                cost_model, modes)

    whole = join(run)
    if fits(whole, run):
        return [whole]
    groups, members, current = [], [run[0]], run[0]
    for item in run[1:]:
        joined = join(members + [item])
        if fits(joined, members + [item]):
            members, current = members + [item], joined
        else:
            groups.append(current)
            members, current = [item], item
    return groups + [current]


@contextlib.contextmanager
def measured_phase(phases: dict, name: str, device: torch.device):
    """Time the block (and its CUDA peak memory) into ``phases[name]``, a dict the block may add to."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    entry = phases.setdefault(name, {})
    start = time.perf_counter()
    try:
        yield entry
    finally:
        if cuda:
            torch.cuda.synchronize(device)
            entry["peak_memory_bytes"] = int(torch.cuda.max_memory_allocated(device))
        entry["time_s"] = time.perf_counter() - start
