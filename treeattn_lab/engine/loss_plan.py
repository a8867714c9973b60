"""The weighted next-token loss of many rollouts, written once per packed tree token.

The loss of a batch of rollouts is

    L = - sum_i sum_{t >= 1} w_i[t] * log p(x_i[t] | x_i[<t])

and in a packed trie the logits at packed position p are shared by every rollout through p. Inside a
node they all predict the same next token, so their weights simply add up; at a node's last token they
predict the first tokens of the node's children, one target per child. A :class:`LossPlan` lists these
(position, target, summed weight) *entries*, sorted by position, so any range of packed positions (a
whole pack, or one DFS block) finds its entries by binary search, and the loss is

    L = sum_e weight[e] * (logsumexp(logits[position[e]]) - logits[position[e], target[e]]).

It also remembers which entry each (rollout, t) pair used, to report per-rollout losses afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LossPlan:
    position: torch.Tensor  # [E] int64, sorted: packed position whose logits are scored
    target: torch.Tensor  # [E] int64: the predicted token
    weight: torch.Tensor  # [E] float64: sum of w_i[t] over the rollouts that share the entry
    seq_entry: torch.Tensor  # [F] int64: entry of every (rollout i, t >= 1) pair, rollouts concatenated
    seq_weight: torch.Tensor  # [F] float64: w_i[t] for those pairs
    seq_offsets: torch.Tensor  # [B + 1] int64: rollout i owns seq_entry[seq_offsets[i]:seq_offsets[i + 1]]

    @classmethod
    def from_pack(cls, pack, token_weights) -> LossPlan:
        """Entries of ``pack`` (on the CPU) for per-rollout weights ``token_weights[i] [len_i]``."""
        ids = pack.input_ids.cpu()
        vocab = int(ids.max()) + 1
        sources, targets, weights, offsets = [], [], [], [0]
        for i in range(pack.num_sequences):
            idx = pack.seq_index(i).cpu()
            sources.append(idx[:-1])
            targets.append(ids[idx[1:]])
            weights.append(token_weights[i][1:].detach().to("cpu", torch.float64))
            offsets.append(offsets[-1] + idx.numel() - 1)
        source, target, seq_weight = torch.cat(sources), torch.cat(targets), torch.cat(weights)
        keys, seq_entry = torch.unique(source * vocab + target, sorted=True, return_inverse=True)
        weight = torch.zeros(keys.numel(), dtype=torch.float64).index_add_(0, seq_entry, seq_weight)
        return cls(
            position=keys // vocab,
            target=keys % vocab,
            weight=weight,
            seq_entry=seq_entry,
            seq_weight=seq_weight,
            seq_offsets=torch.tensor(offsets, dtype=torch.int64),
        )

    @property
    def num_entries(self) -> int:
        return self.position.numel()

    def entries_in(self, start: int, end: int) -> slice:
        """The entries scored by the logits of packed positions ``[start, end)``."""
        lo = int(torch.searchsorted(self.position, start))
        hi = int(torch.searchsorted(self.position, end))
        return slice(lo, hi)

    def loss(self, logits: torch.Tensor, start: int, chunk_rows: int = 4096):
        """``(loss, nll)`` for ``logits [n, V]`` of packed positions ``[start, start + n)``.

        ``loss`` is the weighted sum (a differentiable scalar, None when no entry falls in the range);
        ``nll [e]`` the detached negative log-likelihood of each entry in the range. The log-sum-exp runs
        in float32 (float64 for float64 logits) by chunks of rows to bound the temporary memory.
        """
        entries = self.entries_in(start, start + logits.shape[0])
        if entries.start == entries.stop:
            return None, torch.zeros(0, dtype=torch.float64)
        dtype = torch.promote_types(logits.dtype, torch.float32)
        rows = (self.position[entries] - start).to(logits.device)
        targets = self.target[entries].to(logits.device)
        picked = logits[rows, targets].to(dtype)
        lse = torch.cat([torch.logsumexp(c.to(dtype), dim=-1) for c in logits.split(chunk_rows)])
        nll = lse[rows] - picked
        loss = (self.weight[entries].to(logits.device, dtype) * nll).sum()
        return loss, nll.detach().to("cpu", torch.float64)

    def sequence_losses(self, entry_nll: torch.Tensor) -> torch.Tensor:
        """Per-rollout losses ``[B]`` (float64) from every entry's negative log-likelihood."""
        per_pair = self.seq_weight * entry_nll[self.seq_entry]
        owner = torch.repeat_interleave(torch.arange(self.seq_offsets.numel() - 1), self.seq_offsets.diff())
        return torch.zeros(self.seq_offsets.numel() - 1, dtype=torch.float64).index_add_(0, owner, per_pair)


def flat_losses(logits: torch.Tensor, input_ids: torch.Tensor, lengths, token_weights):
    """``(loss, per_rollout)`` for a right-padded batch: ``logits [B, L, V]``, ``input_ids [B, L]``."""
    dtype = torch.promote_types(logits.dtype, torch.float32)
    losses = []
    for b, (n, w) in enumerate(zip(lengths, token_weights, strict=True)):
        if n < 2:
            losses.append(logits.new_zeros((), dtype=dtype))
            continue
        rows = logits[b, : n - 1].to(dtype)
        nll = torch.logsumexp(rows, dim=-1) - rows.gather(-1, input_ids[b, 1:n, None]).squeeze(-1)
        losses.append((w[1:n].to(logits.device, dtype) * nll).sum())
    per_rollout = torch.stack(losses)
    return per_rollout.sum(), per_rollout.detach().to("cpu", torch.float64)
