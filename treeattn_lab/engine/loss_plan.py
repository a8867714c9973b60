"""The weighted next-token loss of many rollouts, written once per packed tree token.

The loss of a batch of rollouts is

    L = - sum_i sum_{t >= 1} w_i[t] * log p(x_i[t] | x_i[<t])

and in a packed trie the logits at packed position p are shared by every rollout through p. Inside a
node they all predict the same next token, so their weights simply add up; at a node's last token they
predict the first tokens of the node's children, one target per child. A :class:`LossPlan` lists these
(position, target, summed weight) *entries*, sorted by position, so any range of packed positions (a
whole pack, or one DFS block) finds its entries by binary search, and the loss is

    L = - sum_e weight[e] * logp[e],
    logp[e] = logits[position[e], target[e]] - logsumexp(logits[position[e]]).

It also remembers which entry each (rollout, t) pair used, to give per-rollout log-probs and losses.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .lm_head import token_logprobs


@dataclass(frozen=True)
class LossPlan:
    position: torch.Tensor  # [E] int64, sorted: packed position whose logits are scored
    target: torch.Tensor  # [E] int64: the predicted token
    weight: torch.Tensor  # [E] float64: sum of w_i[t] over the rollouts that share the entry
    seq_entry: torch.Tensor  # [F] int64: entry of every (rollout i, t >= 1) pair, rollouts concatenated
    seq_weight: torch.Tensor  # [F] float64: w_i[t] for those pairs
    seq_offsets: torch.Tensor  # [B + 1] int64: rollout i owns seq_entry[seq_offsets[i]:seq_offsets[i + 1]]
    # copies of the fields on the model's device, made once: a copy per block would stall the GPU each time
    on_device: dict = field(default_factory=dict, compare=False, repr=False)

    def device_copy(self, name: str, device: torch.device) -> torch.Tensor:
        key = (name, str(device))
        if key not in self.on_device:
            self.on_device[key] = getattr(self, name).to(device)
        return self.on_device[key]

    @classmethod
    def from_pack(cls, pack, token_weights=None) -> LossPlan:
        """Entries of ``pack`` (on the CPU) for weights ``token_weights[i] [len_i]`` (None: all ones; that
        plan depends on the pack alone, so it is built once per pack and cached on it)."""
        if token_weights is None:
            return pack.cached("loss_plan", lambda: cls._build(pack, None))
        return cls._build(pack, token_weights)

    @classmethod
    def _build(cls, pack, token_weights) -> LossPlan:
        ids = pack.input_ids.cpu()
        vocab = int(ids.max()) + 1
        positions, offsets = pack.sequence_positions()  # each rollout's packed positions, concatenated
        first = torch.zeros(positions.numel(), dtype=torch.bool)
        first[offsets[:-1]] = True  # a rollout's first token is predicted by nothing
        last = torch.zeros_like(first)
        last[offsets[1:] - 1] = True  # its last token predicts nothing
        source, target = positions[~last], ids[positions[~first]]
        if token_weights is None:
            seq_weight = torch.ones(source.numel(), dtype=torch.float64)
        else:
            seq_weight = torch.cat([w[1:].detach().to("cpu", torch.float64) for w in token_weights])
        offsets = offsets - torch.arange(offsets.numel())  # a rollout of n tokens has n - 1 pairs
        keys, seq_entry = torch.unique(source * vocab + target, sorted=True, return_inverse=True)
        weight = torch.zeros(keys.numel(), dtype=torch.float64).index_add_(0, seq_entry, seq_weight)
        return cls(
            position=keys // vocab,
            target=keys % vocab,
            weight=weight,
            seq_entry=seq_entry,
            seq_weight=seq_weight,
            seq_offsets=offsets,
        )

    @property
    def num_entries(self) -> int:
        return self.position.numel()

    def entries_in(self, start: int, end: int) -> slice:
        """The entries scored by the logits of packed positions ``[start, end)``."""
        lo = int(torch.searchsorted(self.position, start))
        hi = int(torch.searchsorted(self.position, end))
        return slice(lo, hi)

    def logprobs(self, features: torch.Tensor, start: int, head, *, entropy: bool = False):
        """``(entries, logp, entropy)`` for the rows ``features [n, ...]`` of packed positions
        ``[start, start + n)``: the slice of entries they score, each entry's log-prob (differentiable when
        autograd is on) and, with ``entropy=True``, the entropy of its next-token distribution (else None).
        ``head`` maps feature rows to logits; :func:`treeattn_lab.engine.lm_head.token_logprobs` runs it by
        chunks of rows."""
        entries = self.entries_in(start, start + features.shape[0])
        rows = self.device_copy("position", features.device)[entries] - start
        targets = self.device_copy("target", features.device)[entries]
        logp, ent = token_logprobs(head, features[rows], targets, entropy=entropy)
        return entries, logp, ent

    def loss(self, features: torch.Tensor, start: int, head):
        """``(loss, logp)``: ``loss = -sum_e weight[e] * logp[e]`` over the entries of the rows (a
        differentiable scalar, None when no entry falls in the range) and their detached log-probs."""
        entries, logp, _ = self.logprobs(features, start, head)
        if entries.start == entries.stop:
            return None, logp.detach()
        loss = -(self.device_copy("weight", features.device)[entries].to(logp.dtype) * logp).sum()
        return loss, logp.detach()

    def sequence_values(self, entry_values: torch.Tensor) -> list[torch.Tensor]:
        """Per-rollout 1-D tensors ``[len_i - 1]`` of an entry quantity (log-probs, entropies), in order.

        Differentiable: gradients flow back to ``entry_values``.
        """
        pairs = entry_values[self.device_copy("seq_entry", entry_values.device)]
        return list(pairs.split(self.seq_offsets.diff().tolist()))

    def sequence_losses(self, entry_logp: torch.Tensor) -> torch.Tensor:
        """Per-rollout losses ``[B]`` (float64, CPU) from every entry's log-prob."""
        per_pair = -self.seq_weight * entry_logp.detach().to("cpu", torch.float64)[self.seq_entry]
        owner = torch.repeat_interleave(torch.arange(self.seq_offsets.numel() - 1), self.seq_offsets.diff())
        return torch.zeros(self.seq_offsets.numel() - 1, dtype=torch.float64).index_add_(0, owner, per_pair)
