"""Objectives that are a sum of per-rollout terms, sent back in one pass.

An objective may declare ``objective.rollout_term(i, logp_i) -> scalar`` with

    objective(logps) = sum_i rollout_term(i, logps[i])          (i: the rollout's index in the trie)

(every :mod:`treeattn_lab.rl` objective does: per-sequence means, a group's token mean with its constant
token count, Dr. GRPO's constant length, GSPO's sequence ratio), and optionally
``objective.rollout_terms(indices, logps)``, the sum of several terms computed as one batch, and
``objective.num_rollouts``, how many rollouts it scores (checked against the trie before anything runs).
A term that is NaN or infinite raises a ValueError before its backward runs. Then no
rollout's gradient waits for another rollout, and each micro-batch is trained in one pass, with no
log-prob pass before it:

- flat and packed: the micro-batch's log-probs with autograd, the sum of its rollouts' terms, backward;
- dfs (:class:`TermScores`, a scorer for :func:`treeattn_lab.engine.dfs.run_dfs`): a rollout's log-probs
  are all known once the block holding its last entry has run. A block run without autograd (a push)
  records its entries' log-probs; the rollouts it completes send ``g = d term / d logp`` to the
  entries they pass through, which is summed into a per-entry weight. A span of sibling leaves runs with
  autograd: the rollouts it completes (those ending in it) backpropagate their terms through the span
  directly, and send ``g`` for their earlier entries as above. A popped block (with autograd) has, by
  then, every rollout of its subtree complete, so its loss is ``- sum_e weight[e] * logp[e]`` over its
  entries: the chain rule, summed over rollouts, exactly.
"""

from __future__ import annotations

import torch

from .dfs import Block, run_dfs
from .loss_plan import LossPlan
from .modes import flat_chunks, flat_token_logprobs, packed_token_logprobs


def is_per_rollout(objective) -> bool:
    return callable(getattr(objective, "rollout_term", None))


def terms_value(objective, rollouts, logps) -> torch.Tensor | None:
    """``sum_r objective.rollout_term(rollouts[r], logps[r])`` (None for no rollout), in one call of
    ``objective.rollout_terms(rollouts, logps)`` where the objective offers that batched form."""
    if not len(rollouts):
        return None
    batched = getattr(objective, "rollout_terms", None)
    if callable(batched):
        return _checked(batched(list(rollouts), list(logps)), "rollout_terms(rollouts, logps)")
    terms = [
        _checked(objective.rollout_term(i, lp), f"rollout_term({i}, logp)")
        for i, lp in zip(rollouts, logps, strict=True)
    ]
    return torch.stack(terms).sum()


def check_rollout_count(objective, num_sequences: int) -> None:
    """Refuse an objective that declares ``num_rollouts`` other than the trie's sequence count."""
    declared = getattr(objective, "num_rollouts", None)
    if declared is not None and declared != num_sequences:
        raise ValueError(
            f"the objective scores {declared} rollouts but the trie holds {num_sequences} sequences"
        )


def _checked(term, call: str) -> torch.Tensor:
    if not isinstance(term, torch.Tensor) or term.numel() != 1 or not term.dtype.is_floating_point:
        raise TypeError(f"objective.{call} must return a floating-point scalar tensor")
    if not bool(torch.isfinite(term.detach()).all()):
        raise ValueError(
            f"objective.{call} is not finite ({float(term.detach())}): no gradient was written"
        )
    return term.reshape(())


class TermScores:
    """The DFS scorer of a per-rollout objective (module docstring) over one micro-batch's ``plan``.

    ``rollouts[r]``: the trie index of the micro-batch's rollout r. ``value``: the sum of the terms sent.
    """

    def __init__(self, objective, plan, rollouts, device, dtype):
        self.objective, self.plan, self.rollouts = objective, plan, list(rollouts)
        self.recorded = torch.zeros(plan.num_entries, dtype=dtype, device=device)
        self.weight = torch.zeros(
            plan.num_entries, dtype=torch.promote_types(dtype, torch.float64), device=device
        )
        offsets = plan.seq_offsets.tolist()
        cpu_entries = [plan.seq_entry[offsets[r] : offsets[r + 1]] for r in range(len(self.rollouts))]
        self.entries = list(plan.device_copy("seq_entry", device).split(plan.seq_offsets.diff().tolist()))
        # a rollout is complete once the block holding its last entry has run (-1: nothing to predict)
        last = [int(e.max()) if e.numel() else -1 for e in cpu_entries]
        self.by_last = sorted(range(len(last)), key=lambda r: last[r])
        self.last = torch.tensor(sorted(last), dtype=torch.int64)
        self.value = torch.zeros((), dtype=dtype, device=device)
        self._leaf = None
        empty = [r for r in range(len(last)) if last[r] < 0]
        if empty:  # rollouts of one token: a constant term, no gradient
            self.value = self.value + self._send(empty, None, slice(0, 0)).detach()
            self._leaf = None

    def _completed(self, entries: slice) -> list[int]:
        lo = int(torch.searchsorted(self.last, entries.start))
        hi = int(torch.searchsorted(self.last, entries.stop))
        return self.by_last[lo:hi]

    def _send(self, rollouts: list[int], logp_span, entries: slice):
        """The terms of ``rollouts`` as one scalar. Their recorded entries enter as a leaf whose gradient
        goes to ``weight`` once the returned scalar is backpropagated (:meth:`collect`); entries in
        ``entries`` come from ``logp_span`` (differentiable) when it is given."""
        idx = [self.entries[r] for r in rollouts]
        flat = torch.cat(idx) if idx else torch.zeros(0, dtype=torch.int64, device=self.recorded.device)
        self._leaf = self.recorded[flat].detach().requires_grad_(True)
        self._leaf_index = flat
        values = self._leaf
        if logp_span is not None and logp_span.numel():
            inside = (flat >= entries.start) & (flat < entries.stop)
            local = (flat - entries.start).clamp(0, logp_span.numel() - 1)
            values = torch.where(inside, logp_span[local], self._leaf)
        pieces = values.split([i.numel() for i in idx])
        return terms_value(self.objective, [self.rollouts[r] for r in rollouts], pieces)

    def collect(self) -> None:
        """Add the gradient the last sent terms gave their recorded entries to ``weight`` (as ``-g``)."""
        if self._leaf.grad is not None:
            self.weight.index_add_(0, self._leaf_index, -self._leaf.grad.to(self.weight.dtype))
        self._leaf = None

    def pushed(self, features, head, block: Block) -> None:
        entries, logp, _ = self.plan.logprobs(features, block.start, head)
        self.recorded[entries] = logp
        done = self._completed(entries)
        if not done:
            return
        with torch.enable_grad():
            total = self._send(done, None, entries)
            if total.requires_grad:
                total.backward()
        self.value = self.value + total.detach()
        self.collect()

    def loss(self, features, head, block: Block):
        entries, logp, _ = self.plan.logprobs(features, block.start, head)
        self.recorded[entries] = logp.detach()
        if block.has_children:  # popped: every rollout through these entries has sent its gradient
            loss = -(self.weight[entries].to(logp.dtype) * logp).sum()
            return loss, logp.detach()
        done = self._completed(entries)
        if not done:
            return None, logp.detach()
        total = self._send(done, logp, entries)
        self.value = self.value + total.detach()
        return total, logp.detach()

    def after_backward(self) -> None:
        if self._leaf is not None:
            self.collect()


def _send_back(total) -> torch.Tensor | float:
    if total is None:
        return 0.0
    if total.requires_grad:
        total.backward()
    return total.detach()


def _micro_batch(adapter, objective, mb, mode, *, block_tokens, token_budget, backend):
    """``(logps, value, no_grad_tokens)`` of one micro-batch trained on its rollouts' terms in ``mode``."""
    rollouts = list(mb.sequences)
    if mode == "flat":
        seqs, logps, value = mb.trie.sequences(), [None] * len(rollouts), 0.0
        for chunk in flat_chunks([len(s) for s in seqs], token_budget):
            chunk_logps, _ = flat_token_logprobs(adapter, [seqs[j] for j in chunk])
            value = (
                value + _send_back(terms_value(objective, [rollouts[j] for j in chunk], chunk_logps)).cpu()
            )
            for j, lp in zip(chunk, chunk_logps, strict=True):
                logps[j] = lp.detach()
        return logps, value, 0
    pack = mb.trie.pack_on(adapter.device)
    plan = LossPlan.from_pack(pack)
    if mode == "packed":
        entry_logp, _ = packed_token_logprobs(adapter, pack, plan, backend=backend)
        logps = plan.sequence_values(entry_logp)
        value = _send_back(terms_value(objective, rollouts, logps))
        return [lp.detach() for lp in logps], value, 0
    dtype = torch.promote_types(adapter.dtype, torch.float32)
    scores = TermScores(objective, plan, rollouts, adapter.device, dtype)
    out = run_dfs(adapter, pack, plan, mb.dfs_block_tokens(block_tokens), scores, packed_subtrees=True)
    return plan.sequence_values(out["entry_logp"]), scores.value, out["no_grad_tokens"]


def run_per_rollout(plan, objective, logps: list, phase: dict, **settings) -> float:
    """Train every micro-batch of ``plan`` on its rollouts' terms; fill ``logps``; return the objective."""
    value = 0.0
    for mb, mode in zip(plan.micro_batches, plan.modes, strict=True):
        mb_logps, mb_value, no_grad = _micro_batch(plan.adapter, objective, mb, mode, **settings)
        value = value + mb_value
        for r, i in enumerate(mb.sequences):
            logps[i] = mb_logps[r]
        tokens = mb.flat_tokens if mode == "flat" else mb.tree_tokens
        phase["grad_tokens"] = phase.get("grad_tokens", 0) + tokens
        phase["no_grad_tokens"] = phase.get("no_grad_tokens", 0) + no_grad
    return float(value)
