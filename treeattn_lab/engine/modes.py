"""The three ways to run one micro-batch forward and backward; each returns per-rollout losses.

- ``flat``: rollouts padded into batches of at most ``token_budget`` padded tokens, causal attention.
  Shared prefixes are computed once per rollout: the baseline.
- ``packed``: the micro-batch's trie as one :class:`TreePack` row through tree attention. Each tree
  token is computed once, but the activations of the whole micro-batch are alive at once.
- ``dfs``: path materialization (:mod:`treeattn_lab.engine.dfs`): each tree token computed once with
  gradients, memory of one block.
"""

from __future__ import annotations

import torch

from . import attention
from .dfs import run_dfs
from .loss_plan import LossPlan, flat_losses

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


def run_flat(adapter, micro_batch, weights, *, token_budget: int | None) -> dict:
    """Every rollout on its own, right-padded into batches of at most ``token_budget`` padded tokens."""
    device = adapter.device
    seqs = micro_batch.trie.sequences()
    chunks = flat_chunks([len(s) for s in seqs], token_budget)
    losses = torch.zeros(len(seqs), dtype=torch.float64)
    for chunk in chunks:
        lengths = [len(seqs[j]) for j in chunk]
        ids = torch.zeros(len(chunk), max(lengths), dtype=torch.int64)
        for r, j in enumerate(chunk):
            ids[r, : lengths[r]] = torch.tensor(seqs[j])
        ids = ids.to(device)
        pos = torch.arange(ids.shape[1], device=device).expand_as(ids)
        logits = adapter.logits(ids, pos, lambda layer, q, k, v, scale: attention.causal(q, k, v, scale))
        loss, per_rollout = flat_losses(logits, ids, lengths, [weights[j] for j in chunk])
        del logits
        if loss.requires_grad:  # a chunk of one-token rollouts has nothing to predict
            loss.backward()
        losses[chunk] = per_rollout
    tokens = sum(len(s) for s in seqs)
    return {"losses": losses, "grad_tokens": tokens, "no_grad_tokens": 0, "chunks": len(chunks)}


def run_packed(adapter, micro_batch, weights, *, backend: str = "auto") -> dict:
    pack = micro_batch.trie.pack().to(adapter.device)
    plan = LossPlan.from_pack(pack, weights)
    tree = attention.packed_tree(pack, backend)
    logits = adapter.logits(
        pack.input_ids[None], pack.position_ids[None], lambda layer, q, k, v, scale: tree(q, k, v, scale)
    )
    loss, nll = plan.loss(logits[0], 0)
    del logits
    if loss is not None and loss.requires_grad:  # no trainable parameter: nothing to send back
        loss.backward()
    return {
        "losses": plan.sequence_losses(nll),
        "grad_tokens": pack.num_tokens,
        "no_grad_tokens": 0,
    }


def run_dfs_mode(adapter, micro_batch, weights, *, block_tokens: int) -> dict:
    pack = micro_batch.trie.pack().to(adapter.device)
    plan = LossPlan.from_pack(pack, weights)
    out = run_dfs(adapter, pack, plan, block_tokens)
    out["losses"] = plan.sequence_losses(out.pop("entry_nll"))
    return out
