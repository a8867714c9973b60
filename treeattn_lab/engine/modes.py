"""The three ways to run one micro-batch forward and backward; each returns per-rollout losses.

- ``flat``: rollouts padded into batches of at most ``token_budget`` padded tokens, causal attention.
  Shared prefixes are computed once per rollout: the baseline.
- ``packed``: the micro-batch's trie as one :class:`TreePack` row through tree attention. Each tree
  token is computed once, but the activations of the whole micro-batch are alive at once.
- ``dfs``: path materialization (:mod:`treeattn_lab.engine.dfs`): each tree token computed once with
  gradients, memory of one block.

Each also returns the rollouts' log-probs (``logps``, detached, in the micro-batch's order).
"""

from __future__ import annotations

import torch

from . import attention
from .adapters import features_and_head
from .dfs import run_dfs
from .lm_head import token_logprobs
from .loss_plan import LossPlan

MODES = ("flat", "packed", "dfs")


def flat_chunks(lengths: list[int], token_budget: int | None) -> list[list[int]]:
    """Rollouts sorted longest first (similar lengths pad less), cut into padded batches of at most
    ``token_budget`` tokens (rows x longest); a rollout longer than the budget gets a batch alone."""
    chunks: list[list[int]] = [[]]
    for j in sorted(range(len(lengths)), key=lambda j: -lengths[j]):
        current = chunks[-1]
        longest = lengths[current[0]] if current else lengths[j]
        if current and token_budget is not None and longest * (len(current) + 1) > token_budget:
            chunks.append([])
        chunks[-1].append(j)
    return chunks


def _causal(layer, q, k, v, scale):
    return attention.causal(q, k, v, scale)


def flat_token_logprobs(adapter, seqs: list[list[int]], *, entropy: bool = False):
    """``(logps, entropies)``: per rollout ``[len - 1]`` log-probs (differentiable when autograd is on) and
    entropies (None without ``entropy``) of rollouts right-padded into one causal batch."""
    lengths = [len(s) for s in seqs]
    ids = torch.zeros(len(seqs), max(lengths), dtype=torch.int64)
    for r, s in enumerate(seqs):
        ids[r, : lengths[r]] = torch.tensor(s)
    ids = ids.to(adapter.device)
    pos = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    features, head = features_and_head(adapter, ids, pos, _causal)
    counts = [n - 1 for n in lengths]
    rows = torch.cat([features[r, :c] for r, c in enumerate(counts)])
    targets = torch.cat([ids[r, 1 : c + 1] for r, c in enumerate(counts)])
    logp, ent = token_logprobs(head, rows, targets, entropy=entropy)
    return list(logp.split(counts)), (list(ent.split(counts)) if entropy else [None] * len(seqs))


def packed_token_logprobs(adapter, pack, plan: LossPlan, *, backend: str = "auto", entropy: bool = False):
    """``(entry_logp, entry_entropy)`` of ``plan``'s entries: the whole pack as one row, tree attention."""
    tree = attention.packed_tree(pack, backend)

    def attend(layer, q, k, v, scale):
        return tree(q, k, v, scale)

    features, head = features_and_head(adapter, pack.input_ids[None], pack.position_ids[None], attend)
    _, entry_logp, entry_entropy = plan.logprobs(features[0], 0, head, entropy=entropy)
    return entry_logp, entry_entropy


def _linear_loss(logp: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return -(weights[1:].to(logp.device, logp.dtype) * logp).sum()


def run_flat(adapter, micro_batch, weights, *, token_budget: int | None) -> dict:
    """Every rollout on its own, right-padded into batches of at most ``token_budget`` padded tokens."""
    seqs = micro_batch.trie.sequences()
    chunks = flat_chunks([len(s) for s in seqs], token_budget)
    losses = torch.zeros(len(seqs), dtype=torch.float64)
    logps: list[torch.Tensor | None] = [None] * len(seqs)
    for chunk in chunks:
        chunk_logps, _ = flat_token_logprobs(adapter, [seqs[j] for j in chunk])
        per_rollout = [_linear_loss(lp, weights[j]) for j, lp in zip(chunk, chunk_logps, strict=True)]
        loss = torch.stack(per_rollout).sum()
        if loss.requires_grad:  # a chunk of one-token rollouts has nothing to predict
            loss.backward()
        losses[chunk] = torch.stack(per_rollout).detach().to("cpu", torch.float64)
        for j, lp in zip(chunk, chunk_logps, strict=True):
            logps[j] = lp.detach()
    tokens = sum(len(s) for s in seqs)
    return {
        "losses": losses,
        "logps": logps,
        "grad_tokens": tokens,
        "no_grad_tokens": 0,
        "chunks": len(chunks),
    }


def run_packed(adapter, micro_batch, weights, *, backend: str = "auto") -> dict:
    pack = micro_batch.trie.pack_on(adapter.device)
    plan = LossPlan.from_pack(pack, weights)
    entry_logp, _ = packed_token_logprobs(adapter, pack, plan, backend=backend)
    loss = -(plan.device_copy("weight", entry_logp.device).to(entry_logp.dtype) * entry_logp).sum()
    if loss.requires_grad:  # no trainable parameter: nothing to send back
        loss.backward()
    entry_logp = entry_logp.detach()
    return {
        "losses": plan.sequence_losses(entry_logp),
        "logps": plan.sequence_values(entry_logp),
        "grad_tokens": pack.num_tokens,
        "no_grad_tokens": 0,
    }


def run_dfs_mode(adapter, micro_batch, weights, *, block_tokens: int) -> dict:
    """The micro-batch trained in DFS, in its planned block size (else ``block_tokens``)."""
    pack = micro_batch.trie.pack_on(adapter.device)
    plan = LossPlan.from_pack(pack, weights)
    out = run_dfs(adapter, pack, plan, micro_batch.dfs_block_tokens(block_tokens), packed_subtrees=True)
    entry_logp = out.pop("entry_logp")
    out["losses"] = plan.sequence_losses(entry_logp)
    out["logps"] = plan.sequence_values(entry_logp)
    return out
