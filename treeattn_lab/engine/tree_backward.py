"""``tree_backward``: the gradient of an objective of every rollout's per-token log-probs over a trie.

    logps[i][t - 1] = log p(x_i[t] | x_i[<t])                     t = 1 .. len_i - 1

- ``objective(logps)`` -> a scalar: any differentiable function (PPO-clip ratios, KL terms, sequence
  normalisations, sequence-level ratios as in GSPO; see :mod:`treeattn_lab.rl.objectives`);
- ``token_weights``, the linear special case ``L = - sum_i sum_{t >= 1} w_i[t] * logps[i][t - 1]``
  (policy-gradient advantages per token; all ones is plain NLL).

The call fills ``.grad`` of the model's parameters exactly as autograd through per-rollout flat forwards
would, however the trie is run:

- the trie is cut into micro-batches of neighbouring rollouts (:mod:`treeattn_lab.engine.microbatch`);
- each micro-batch runs in one mode (:mod:`treeattn_lab.engine.modes`): ``"flat"``, ``"packed"`` or
  ``"dfs"``, or under ``"auto"`` the mode the cost model (:mod:`treeattn_lab.engine.cost_model`)
  predicts fastest, which is flat where the trie shares too little.

An objective that is a sum of per-rollout terms and says so (``objective.rollout_term``, see
:mod:`treeattn_lab.engine.rollout_terms`; every :mod:`treeattn_lab.rl` objective does) trains each
micro-batch in one pass, in every mode (phase ``"train"`` only). Any other objective is reduced to the
linear case by the chain rule: with ``g_i = d objective / d logps[i]``
evaluated at the current log-probs, ``d objective / d theta = sum_i g_i . d logps[i] / d theta``, which
is the gradient of the linear loss with ``w_i[t] = -g_i[t - 1]``. Where the whole trie is one flat or
packed micro-batch, one forward with autograd gives the log-probs, the objective and its backward
(phase ``"train"``). Otherwise the log-probs of every rollout are needed before any micro-batch can send
gradients back, so a pass without autograd computes them first (phase ``"logprobs"``, each tree token
once), then the linear pass runs with the weights ``-g`` (phase ``"train"``).

A call that fails or is interrupted leaves ``.grad`` exactly as it was: the call accumulates into fresh
gradients and adds them to the previous ones only once every micro-batch has succeeded.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch

from ..trie import RolloutTrie
from .call_plan import CallPlan, measured_phase, plan_call
from .cost_model import CostModel
from .logprobs import check_cost_model, micro_batch_logprobs
from .loss_plan import LossPlan
from .modes import flat_chunks, flat_token_logprobs, packed_token_logprobs, run_dfs_mode, run_flat, run_packed
from .rollout_terms import check_rollout_count, is_per_rollout, run_per_rollout


@dataclass
class TreeBackwardReport:
    """What a call did: modes per micro-batch, tokens per phase, memory and time.

    ``phases``: per phase (``"logprobs"``, ``"train"``) its ``time_s``, ``grad_tokens``, ``no_grad_tokens``
    and, on CUDA, ``peak_memory_bytes``.
    """

    modes: list[str] = field(default_factory=list)  # per micro-batch
    block_tokens: list[int] = field(default_factory=list)  # per micro-batch: the DFS block size it ran in
    predicted_s: list[dict] = field(default_factory=list)  # per micro-batch: mode -> predicted seconds
    flat_tokens: int = 0  # tokens of all rollouts, counted per rollout
    tree_tokens: int = 0  # tokens of the micro-batches' tries
    grad_tokens: int = 0  # tokens run with autograd
    no_grad_tokens: int = 0  # tokens run without autograd (DFS pushes, the log-prob pass), i.e. recomputed
    carried_tokens: int = 0  # prefix tokens computed again because a micro-batch boundary cut them
    peak_memory_bytes: int | None = None  # CUDA peak allocated during the call (None on the CPU)
    time_s: float = 0.0
    phases: dict[str, dict] = field(default_factory=dict)

    @property
    def recomputed_tokens(self) -> int:
        return self.no_grad_tokens + self.carried_tokens

    @property
    def choices(self) -> str:
        """The modes the call ran, sorted, a DFS one with its block size: ``"dfs@8192,packed"``."""
        labels = {f"dfs@{b}" if m == "dfs" else m for m, b in zip(self.modes, self.block_tokens, strict=True)}
        return ",".join(sorted(labels))


@dataclass
class TreeBackwardResult:
    losses: torch.Tensor  # [B] float64: each rollout's linear loss (detached); zeros under an objective
    report: TreeBackwardReport
    logps: list[torch.Tensor] = field(default_factory=list)  # per rollout [len_i - 1], detached
    objective_value: float | None = None  # objective(logps), when an objective was given

    @property
    def loss(self) -> float:
        if self.objective_value is not None:
            return self.objective_value
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


def _linear_pass(plan: CallPlan, weights, losses, logps, report, *, block_tokens, token_budget, backend):
    """Each micro-batch forward and backward with the linear loss of ``weights``; fills losses and logps."""
    adapter, phase = plan.adapter, report.phases["train"]
    for mb, chosen in zip(plan.micro_batches, plan.modes, strict=True):
        mb_weights = [weights[i] for i in mb.sequences]
        if chosen == "flat":
            out = run_flat(adapter, mb, mb_weights, token_budget=token_budget)
        elif chosen == "packed":
            out = run_packed(adapter, mb, mb_weights, backend=backend)
        else:
            out = run_dfs_mode(adapter, mb, mb_weights, block_tokens=block_tokens)
        losses[list(mb.sequences)] = out["losses"]
        for r, i in enumerate(mb.sequences):
            logps[i] = out["logps"][r]
        if chosen != "flat":  # flat runs every rollout whole anyway: a cut prefix costs it nothing extra
            report.carried_tokens += mb.carried_tokens
        phase["grad_tokens"] = phase.get("grad_tokens", 0) + out["grad_tokens"]
        phase["no_grad_tokens"] = phase.get("no_grad_tokens", 0) + out["no_grad_tokens"]


def _logprob_pass(plan: CallPlan, logps, phase, *, block_tokens, token_budget, backend) -> None:
    """Every rollout's log-probs without autograd, each micro-batch in its planned mode."""
    for mb, chosen in zip(plan.micro_batches, plan.modes, strict=True):
        mb_logps, _ = micro_batch_logprobs(
            plan.adapter, mb, chosen, block_tokens=block_tokens, token_budget=token_budget, backend=backend
        )
        for r, i in enumerate(mb.sequences):
            logps[i] = mb_logps[r]
        tokens = mb.flat_tokens if chosen == "flat" else mb.tree_tokens
        phase["no_grad_tokens"] = phase.get("no_grad_tokens", 0) + tokens


def _evaluate(objective, logps: list[torch.Tensor]) -> torch.Tensor:
    value = objective(logps)
    if not isinstance(value, torch.Tensor) or value.numel() != 1 or not value.dtype.is_floating_point:
        raise TypeError(f"objective(logps) must return a floating-point scalar tensor, got {value!r:.80}")
    if not torch.isfinite(value.detach()).all():
        raise ValueError(f"objective(logps) is not finite ({float(value.detach())}): no gradient was written")
    return value.reshape(())


def _objective_weights(objective, logps: list[torch.Tensor]):
    """``(weights, value)``: per rollout ``w_i = [0, -d objective / d logps[i]]`` (float64, CPU)."""
    leaves = [lp.detach().requires_grad_(True) for lp in logps]
    with torch.enable_grad():
        value = _evaluate(objective, leaves)
        grads = (
            torch.autograd.grad(value, leaves, allow_unused=True)
            if value.requires_grad
            else [None] * len(leaves)
        )
    flat = torch.cat([torch.zeros_like(lp) if g is None else g for lp, g in zip(leaves, grads, strict=True)])
    flat = -flat.detach().to("cpu", torch.float64)
    weights = [torch.cat([flat.new_zeros(1), g]) for g in flat.split([lp.numel() for lp in leaves])]
    return weights, float(value.detach())


def _fused_pass(plan: CallPlan, objective, logps, phase, *, backend) -> float:
    """One flat or packed micro-batch: log-probs with autograd, the objective, its backward."""
    adapter, mb, chosen = plan.adapter, plan.micro_batches[0], plan.modes[0]
    if chosen == "flat":
        mb_logps, _ = flat_token_logprobs(adapter, mb.trie.sequences())
        tokens = mb.flat_tokens
    else:
        pack = mb.trie.pack_on(adapter.device)
        loss_plan = LossPlan.from_pack(pack)
        entry_logp, _ = packed_token_logprobs(adapter, pack, loss_plan, backend=backend)
        mb_logps = loss_plan.sequence_values(entry_logp)
        tokens = pack.num_tokens
    ordered: list = [None] * len(mb_logps)
    for r, i in enumerate(mb.sequences):
        ordered[i] = mb_logps[r]
    value = _evaluate(objective, ordered)
    if value.requires_grad:
        value.backward()
    logps[:] = [lp.detach() for lp in ordered]
    phase["grad_tokens"] = phase.get("grad_tokens", 0) + tokens
    return float(value.detach())


def _one_graph(plan: CallPlan, token_budget: int | None) -> bool:
    """Whether the whole call is one forward: one micro-batch, packed or flat in one padded batch."""
    if len(plan.micro_batches) != 1 or plan.modes[0] == "dfs":
        return False
    return (
        plan.modes[0] == "packed"
        or len(flat_chunks(plan.micro_batches[0].trie.seq_lengths, token_budget)) == 1
    )


@contextlib.contextmanager
def accumulated_on_success(model):
    """Run the block on fresh ``.grad``; add them to the previous ones only if it completes.

    On any exception, KeyboardInterrupt included, every trainable parameter's ``.grad`` is put back as it
    was (the same tensor, or None), so a failed call can be retried without counting anything twice.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    previous = [p.grad for p in params]
    try:
        for p in params:
            p.grad = None
        yield
    except BaseException:
        for p, g in zip(params, previous, strict=True):
            p.grad = g
        raise
    for p, g in zip(params, previous, strict=True):
        if g is not None:
            p.grad = g if p.grad is None else g.add_(p.grad)


def _run_passes(plan: CallPlan, objective, weights, losses, logps, report, **settings):
    """The passes of a call (module docstring); returns ``objective(logps)`` (None without objective)."""
    device, value = plan.adapter.device, None
    if is_per_rollout(objective):
        with measured_phase(report.phases, "train", device) as phase:
            return run_per_rollout(plan, objective, logps, phase, **settings)
    fused = objective is not None and _one_graph(plan, settings["token_budget"])
    if objective is not None and not fused:
        with measured_phase(report.phases, "logprobs", device) as phase:
            _logprob_pass(plan, logps, phase, **settings)
        weights, value = _objective_weights(objective, logps)
    with measured_phase(report.phases, "train", device) as phase:
        if fused:
            value = _fused_pass(plan, objective, logps, phase, backend=settings["backend"])
        else:
            _linear_pass(plan, weights, losses, logps, report, **settings)
    return value


def tree_backward(
    model,
    trie: RolloutTrie,
    token_weights=None,
    *,
    objective=None,
    mode: str = "auto",
    block_tokens: int = 2048,
    token_budget: int | None = None,
    cost_model: CostModel | None = None,
    memory_limit: float | None = None,
    attention_backend: str = "auto",
) -> TreeBackwardResult:
    """Accumulate the gradient of ``objective(logps)`` (or of the linear loss of ``token_weights``) into
    the parameters' ``.grad``; return the losses, the log-probs and what each phase cost.

    ``model``: a :class:`treeattn_lab.reference.TinyLM` or a Hugging Face causal LM (Llama, Qwen2, ...).
    ``trie``: the rollouts. The two per-token conventions, side by side, for sequence i of ``n`` tokens:

    - ``token_weights[i]``: length ``n``, indexed by the predicted token: ``w[t]`` weighs
      ``log p(x[t] | x[<t])`` for t = 1 .. n - 1, and ``w[0]`` is ignored (token 0 has no prediction);
    - the log-probs the objective receives (and ``result.logps[i]``, and masks such as
      :func:`treeattn_lab.rl.completion_masks`): length ``n - 1``, ``logps[i][t - 1]`` for the same token.

    ``token_weights`` None is plain NLL. ``objective``: a callable taking the list of per-rollout log-prob
    tensors (trie order) and returning a scalar tensor; give it or ``token_weights``, not both; one that
    declares ``num_rollouts`` must score exactly the trie's sequences.
    ``mode``: ``"auto"``, ``"flat"``, ``"packed"`` or ``"dfs"``.
    ``block_tokens``: the longest run of tokens the DFS mode computes at once. ``token_budget``: tree tokens
    per flat or packed micro-batch (None: the whole trie is one micro-batch; flat mode pads chunks of at
    most this many tokens). A DFS micro-batch holds one block and the active path, so ``"dfs"`` runs the
    whole trie as one, and ``"auto"`` joins neighbouring micro-batches it puts in ``"dfs"``.
    ``cost_model``: predictor for ``"auto"`` (default: the uncalibrated prior; see
    :func:`treeattn_lab.engine.calibrate`). ``memory_limit``: bytes ``"auto"`` may plan for.
    """
    if objective is not None and not callable(objective):
        raise TypeError(
            f"objective must be a callable logps -> scalar tensor, got {type(objective).__name__}"
        )
    if objective is not None and token_weights is not None:
        raise ValueError("give token_weights or objective, not both (token_weights is the linear objective)")
    if not torch.is_grad_enabled():
        raise RuntimeError("tree_backward computes gradients: call it outside torch.no_grad()")
    check_cost_model(cost_model)
    plan = plan_call(model, trie, mode, block_tokens, token_budget, cost_model, memory_limit, with_grad=True)
    if objective is not None:
        check_rollout_count(objective, trie.num_sequences)
    weights = check_token_weights(trie, token_weights) if objective is None else None
    report = TreeBackwardReport(flat_tokens=sum(trie.seq_lengths), modes=list(plan.modes))
    report.block_tokens = [mb.dfs_block_tokens(block_tokens) for mb in plan.micro_batches]
    report.predicted_s = list(plan.predicted_s)
    report.tree_tokens = sum(mb.tree_tokens for mb in plan.micro_batches)
    losses = torch.zeros(trie.num_sequences, dtype=torch.float64)
    logps: list = [None] * trie.num_sequences
    start = time.perf_counter()
    settings = {"block_tokens": block_tokens, "token_budget": token_budget, "backend": attention_backend}
    with accumulated_on_success(plan.adapter.model), plan.adapter.session(plan.longest):
        value = _run_passes(plan, objective, weights, losses, logps, report, **settings)
    report.time_s = time.perf_counter() - start
    _sum_phases(report)
    if objective is not None:
        losses.zero_()  # the linear pass ran a surrogate of the objective: no per-rollout loss to report
    return TreeBackwardResult(losses=losses, report=report, logps=logps, objective_value=value)


def _sum_phases(report: TreeBackwardReport) -> None:
    phases = report.phases.values()
    report.grad_tokens = sum(p.get("grad_tokens", 0) for p in phases)
    report.no_grad_tokens = sum(p.get("no_grad_tokens", 0) for p in phases)
    peaks = [p["peak_memory_bytes"] for p in phases if "peak_memory_bytes" in p]
    report.peak_memory_bytes = max(peaks) if peaks else None
