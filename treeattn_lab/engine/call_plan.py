"""What every engine call does before and around the model: check its arguments, cut the trie into
micro-batches, pick each micro-batch's mode, and time and measure each phase of the call.

``"auto"`` asks the cost model (:mod:`treeattn_lab.engine.cost_model`) for the mode it predicts fastest
for each micro-batch's shape (:func:`auto_micro_batches`); while dropout is active it never picks
``"dfs"`` for a gradient pass (DFS runs prefixes twice and needs the same activations both times).
Neighbouring micro-batches it puts in ``"dfs"`` then run as one where the cost model predicts that one
fits the memory limit: a DFS micro-batch's memory is its block and its path, not its tokens, and the
merged one computes no prefix twice across the cut.
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
from .microbatch import MicroBatch, plan_micro_batches
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
    cost_model = cost_model or CostModel()
    plan = CallPlan(adapter, [], longest=longest)
    if mode == "auto":
        allowed = MODES if deterministic else tuple(m for m in MODES if m != "dfs")
        planned = auto_micro_batches(trie, block_tokens, token_budget, cost_model, memory_limit, allowed)
        plan.micro_batches = [mb for mb, _ in planned]
        plan.predicted_s = [predicted for _, predicted in planned]
    else:
        cut = plan_micro_batches(trie, token_budget, cost_model=cost_model, mode=mode)
        plan.micro_batches = [replace(mb, mode=mode) for mb in cut]
        plan.predicted_s = [{} for _ in cut]
    plan.modes = [mb.mode for mb in plan.micro_batches]
    return plan


def auto_micro_batches(
    trie: RolloutTrie,
    block_tokens: int,
    token_budget: int | None,
    cost_model: CostModel,
    memory_limit: float | None = None,
    modes: tuple[str, ...] = MODES,
) -> list[tuple[MicroBatch, dict]]:
    """The micro-batches ``"auto"`` runs, each with its ``mode`` set, and the seconds predicted for it per
    mode: the budget's cuts, each in the fastest of ``modes`` that fits ``memory_limit``; then every run
    of neighbouring ``"dfs"`` micro-batches as one DFS micro-batch, where its predicted peak fits."""
    chosen = []
    for mb in plan_micro_batches(trie, token_budget, cost_model=cost_model, mode="auto"):
        mode, predictions = cost_model.choose(
            MicroBatchShape.of(mb.trie, block_tokens, token_budget), memory_limit=memory_limit, modes=modes
        )
        chosen.append((replace(mb, mode=mode), {m: p[0] for m, p in predictions.items()}))
    out: list[tuple[MicroBatch, dict]] = []
    for mode, run in groupby(chosen, key=lambda c: c[0].mode):
        run = list(run)
        merged = None
        if mode == "dfs" and len(run) > 1:
            run_mbs = [mb for mb, _ in run]
            merged = _merged(trie, run_mbs, block_tokens, token_budget, cost_model, memory_limit)
        out.extend(run if merged is None else [merged])
    return out


def _merged(trie, run: list[MicroBatch], block_tokens, token_budget, cost_model, memory_limit):
    """The micro-batches ``run`` as one DFS micro-batch with its prediction, or None where its predicted
    peak exceeds ``memory_limit``."""
    sequences = tuple(i for mb in run for i in mb.sequences)
    merged = MicroBatch(sequences, trie.subtrie(sequences), run[0].carried_tokens, mode="dfs")
    seconds, peak = cost_model.predict(MicroBatchShape.of(merged.trie, block_tokens, token_budget), "dfs")
    if memory_limit is not None and peak > memory_limit:
        return None
    return merged, {"dfs": seconds}


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
