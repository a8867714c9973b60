"""What every engine call does before and around the model: check its arguments, cut the trie into
micro-batches, pick each micro-batch's mode, and time and measure each phase of the call.

``"auto"`` asks the cost model (:mod:`treeattn_lab.engine.cost_model`) for the mode it predicts fastest
for the micro-batch's shape; while dropout is active it never picks ``"dfs"`` for a gradient pass (DFS
runs prefixes twice and needs the same activations both times).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

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
    micro_batches = plan_micro_batches(trie, token_budget, cost_model=cost_model, mode=mode)
    plan = CallPlan(adapter, micro_batches, longest=longest)
    allowed = MODES if deterministic else tuple(m for m in MODES if m != "dfs")
    for mb in plan.micro_batches:
        chosen, predicted = mode, {}
        if mode == "auto":
            shape = MicroBatchShape.of(mb.trie, block_tokens, token_budget)
            chosen, predictions = cost_model.choose(shape, memory_limit=memory_limit, modes=allowed)
            predicted = {m: p[0] for m, p in predictions.items()}
        plan.modes.append(chosen)
        plan.predicted_s.append(predicted)
    return plan


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
