"""``tree_backward``: the gradient of the weighted next-token loss of every rollout in a trie.

    L = - sum_i sum_{t >= 1} token_weights[i][t] * log p(x_i[t] | x_i[<t])

covers policy-gradient objectives (GRPO/PPO advantages per token) and plain NLL (all ones). The call
fills ``.grad`` of the model's parameters exactly as ``sum(flat per-rollout losses).backward()`` would,
however the trie is run:

- the trie is cut into micro-batches of neighbouring rollouts (:mod:`treeattn_lab.engine.microbatch`);
- each micro-batch runs in one mode (:mod:`treeattn_lab.engine.modes`): ``"flat"``, ``"packed"`` or
  ``"dfs"``, or under ``"auto"`` the mode the cost model (:mod:`treeattn_lab.engine.cost_model`)
  predicts fastest, which is flat where the trie shares too little.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..checks import check_int
from ..trie import RolloutTrie
from .adapters import adapt
from .cost_model import CostModel, MicroBatchShape
from .microbatch import plan_micro_batches
from .modes import MODES, run_dfs_mode, run_flat, run_packed


@dataclass
class TreeBackwardReport:
    """What a call did: modes per micro-batch, tokens per phase, memory and time."""

    modes: list[str] = field(default_factory=list)  # per micro-batch
    predicted_s: list[dict] = field(default_factory=list)  # per micro-batch: mode -> predicted seconds
    flat_tokens: int = 0  # tokens of all rollouts, counted per rollout
    tree_tokens: int = 0  # tokens of the micro-batches' tries
    grad_tokens: int = 0  # tokens run with autograd
    no_grad_tokens: int = 0  # tokens run without autograd (DFS pushes), i.e. recomputed
    carried_tokens: int = 0  # prefix tokens computed again because a micro-batch boundary cut them
    peak_memory_bytes: int | None = None  # CUDA peak allocated during the call (None on the CPU)
    time_s: float = 0.0

    @property
    def recomputed_tokens(self) -> int:
        return self.no_grad_tokens + self.carried_tokens


@dataclass
class TreeBackwardResult:
    losses: torch.Tensor  # [B] float64: each rollout's loss (detached)
    report: TreeBackwardReport

    @property
    def loss(self) -> float:
        return float(self.losses.sum())


def check_token_weights(trie: RolloutTrie, token_weights) -> list[torch.Tensor]:
    """Per-rollout 1-D float weights, each as long as its rollout (None: all ones), detached."""
    if token_weights is None:
        return [torch.ones(n, dtype=torch.float64) for n in trie.seq_lengths]
    if isinstance(token_weights, torch.Tensor) or not hasattr(token_weights, "__len__"):
        raise TypeError("token_weights must be a list of 1-D float tensors, one per sequence (or None)")
    if len(token_weights) != trie.num_sequences:
        raise ValueError(f"got {len(token_weights)} token_weights for {trie.num_sequences} sequences")
    out = []
    for i, (w, n) in enumerate(zip(token_weights, trie.seq_lengths, strict=True)):
        if not isinstance(w, torch.Tensor):
            raise TypeError(f"token_weights[{i}] must be a torch.Tensor, got {type(w).__name__}")
        if w.dim() != 1 or w.numel() != n:
            raise ValueError(f"token_weights[{i}] must have shape [{n}] (sequence {i}), got {tuple(w.shape)}")
        if not w.dtype.is_floating_point:
            raise TypeError(f"token_weights[{i}] must be floating point, got {w.dtype}")
        if not torch.isfinite(w).all():
            raise ValueError(f"token_weights[{i}] holds NaN or infinite values")
        out.append(w.detach())
    return out


def _run_micro_batch(
    adapter,
    mb,
    weights,
    losses,
    report,
    *,
    mode,
    block_tokens,
    token_budget,
    cost_model,
    memory_limit,
    attention_backend,
    deterministic=True,
) -> None:
    """Run one micro-batch in ``mode`` (or the cost model's choice), filling ``losses`` and ``report``."""
    mb_weights = [weights[i] for i in mb.sequences]
    chosen, predicted = mode, {}
    if mode == "auto":
        shape = MicroBatchShape.of(mb.trie, block_tokens, token_budget)
        allowed = MODES if deterministic else tuple(m for m in MODES if m != "dfs")
        chosen, predictions = cost_model.choose(shape, memory_limit=memory_limit, modes=allowed)
        predicted = {m: p[0] for m, p in predictions.items()}
    if chosen == "flat":
        out = run_flat(adapter, mb, mb_weights, token_budget=token_budget)
    elif chosen == "packed":
        out = run_packed(adapter, mb, mb_weights, backend=attention_backend)
    else:
        out = run_dfs_mode(adapter, mb, mb_weights, block_tokens=block_tokens)
    losses[list(mb.sequences)] = out["losses"]
    report.modes.append(chosen)
    report.predicted_s.append(predicted)
    report.tree_tokens += mb.tree_tokens
    if chosen != "flat":  # flat runs every rollout whole anyway: a cut prefix costs it nothing extra
        report.carried_tokens += mb.carried_tokens
    report.grad_tokens += out["grad_tokens"]
    report.no_grad_tokens += out["no_grad_tokens"]


def _active_dropout(model: torch.nn.Module) -> bool:
    return any(
        isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.training and m.p > 0 for m in model.modules()
    )


def tree_backward(
    model,
    trie: RolloutTrie,
    token_weights=None,
    *,
    mode: str = "auto",
    block_tokens: int = 2048,
    token_budget: int | None = None,
    cost_model: CostModel | None = None,
    memory_limit: float | None = None,
    attention_backend: str = "auto",
) -> TreeBackwardResult:
    """Accumulate the gradient of the loss above into the parameters' ``.grad``; return the losses.

    ``model``: a :class:`treeattn_lab.reference.TinyLM` or a Hugging Face causal LM (Llama, Qwen2, ...).
    ``trie``: the rollouts; ``token_weights[i]`` a 1-D float tensor as long as sequence i (index 0 is
    ignored), or None for plain NLL. ``mode``: ``"auto"``, ``"flat"``, ``"packed"`` or ``"dfs"``.
    ``block_tokens``: the longest run of tokens the DFS mode computes at once. ``token_budget``: tree tokens
    per micro-batch (None: the whole trie is one micro-batch; flat mode pads chunks of at most this many
    tokens). ``cost_model``: predictor for ``"auto"`` (default: the uncalibrated prior; see
    :func:`treeattn_lab.engine.calibrate`). ``memory_limit``: bytes ``"auto"`` may plan for.
    """
    if not isinstance(trie, RolloutTrie):
        raise TypeError(f"trie must be a RolloutTrie, got {type(trie).__name__}")
    if not isinstance(mode, str) or mode not in ("auto",) + MODES:
        raise ValueError(f"mode must be one of {('auto',) + MODES}, got {mode!r}")
    check_int("block_tokens", block_tokens)
    check_int("token_budget", token_budget, allow_none=True)
    if not torch.is_grad_enabled():
        raise RuntimeError("tree_backward computes gradients: call it outside torch.no_grad()")
    adapter = adapt(model)
    weights = check_token_weights(trie, token_weights)
    if max(max(s) if s else 0 for s in (n.tokens for n in trie.nodes)) >= adapter.vocab_size:
        raise ValueError(f"the trie holds token ids >= the model's vocabulary size {adapter.vocab_size}")
    adapter.check_length(max(trie.seq_lengths))
    deterministic = not _active_dropout(adapter.model)
    if mode == "dfs" and not deterministic:
        raise ValueError(
            "dropout is active (model in train mode with p > 0): the DFS mode runs prefixes twice and needs "
            "the same activations both times; call model.eval() or set dropout to 0"
        )
    cost_model = cost_model or CostModel()

    device = adapter.device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    report = TreeBackwardReport(flat_tokens=sum(trie.seq_lengths))
    losses = torch.zeros(trie.num_sequences, dtype=torch.float64)
    with adapter.session():
        for mb in plan_micro_batches(trie, token_budget):
            _run_micro_batch(
                adapter,
                mb,
                weights,
                losses,
                report,
                mode=mode,
                block_tokens=block_tokens,
                token_budget=token_budget,
                cost_model=cost_model,
                memory_limit=memory_limit,
                attention_backend=attention_backend,
                deterministic=deterministic,
            )
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        report.peak_memory_bytes = int(torch.cuda.max_memory_allocated(device))
    report.time_s = time.perf_counter() - start
    return TreeBackwardResult(losses=losses, report=report)
