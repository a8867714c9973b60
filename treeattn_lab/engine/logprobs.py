"""``tree_logprobs``: every rollout's per-token log-probs (and entropies) over a trie, without autograd.

    logps[i][t - 1] = log p(x_i[t] | x_i[<t])                       t = 1 .. len_i - 1
    entropies[i][t - 1] = - sum_v p(v | x_i[<t]) log p(v | x_i[<t])

This is what RL needs besides the training pass: the old policy's and the reference policy's log-probs of
the same rollouts. The trie is cut into micro-batches and each runs in one mode, as in
:func:`treeattn_lab.engine.tree_backward`:

- ``"flat"``: rollouts right-padded into batches of at most ``token_budget`` tokens (shared prefixes
  computed once per rollout);
- ``"packed"``: the micro-batch's trie as one packed row through tree attention (each tree token once);
- ``"dfs"``: depth first (:func:`treeattn_lab.engine.dfs.dfs_logprobs`): each tree token once, holding only
  one block and the active path's K/V;
- ``"auto"``: the mode the cost model picks for the training pass of that micro-batch.

The LM head runs by chunks of rows (:mod:`treeattn_lab.engine.lm_head`): ``[tokens, vocab]`` logits never
exist at once. Log-probs are float32 (float64 for a float64 model), on the model's device.
"""

from __future__ import annotations

import torch

from ..trie import RolloutTrie
from .call_plan import plan_call
from .cost_model import CostModel
from .dfs import dfs_logprobs
from .loss_plan import LossPlan
from .modes import flat_chunks, flat_token_logprobs, packed_token_logprobs


def _flat(adapter, micro_batch, token_budget, entropy):
    seqs = micro_batch.trie.sequences()
    logps: list = [None] * len(seqs)
    entropies: list = [None] * len(seqs)
    for chunk in flat_chunks([len(s) for s in seqs], token_budget):
        lp, ent = flat_token_logprobs(adapter, [seqs[j] for j in chunk], entropy=entropy)
        for r, j in enumerate(chunk):
            logps[j], entropies[j] = lp[r], ent[r]
    return logps, entropies


def _tree(adapter, micro_batch, mode, block_tokens, backend, entropy):
    pack = micro_batch.trie.pack_on(adapter.device)
    plan = LossPlan.from_pack(pack)
    if mode == "dfs":
        out = dfs_logprobs(adapter, pack, plan, micro_batch.dfs_block_tokens(block_tokens), entropy=entropy)
        entry_logp, entry_entropy = out["entry_logp"], out["entry_entropy"]
    else:
        entry_logp, entry_entropy = packed_token_logprobs(
            adapter, pack, plan, backend=backend, entropy=entropy
        )
    logps = plan.sequence_values(entry_logp)
    entropies = plan.sequence_values(entry_entropy) if entropy else [None] * len(logps)
    return logps, entropies


def check_cost_model(cost_model) -> None:
    """``cost_model`` must be None or a :class:`~treeattn_lab.engine.cost_model.CostModel`."""
    if cost_model is not None and not isinstance(cost_model, CostModel):
        raise TypeError(
            "cost_model must be a treeattn_lab.engine.CostModel (e.g. calibrate(model)) or None, "
            f"got {type(cost_model).__name__}"
        )


def micro_batch_logprobs(adapter, micro_batch, mode, *, block_tokens, token_budget, backend, entropy=False):
    """``(logps, entropies)`` of one micro-batch's rollouts (its own order) in ``mode``, without autograd."""
    with torch.no_grad():
        if mode == "flat":
            return _flat(adapter, micro_batch, token_budget, entropy)
        return _tree(adapter, micro_batch, mode, block_tokens, backend, entropy)


def tree_logprobs(
    model,
    trie: RolloutTrie,
    *,
    mode: str = "auto",
    block_tokens: int = 2048,
    token_budget: int | None = None,
    entropy: bool = False,
    attention_backend: str = "auto",
    cost_model: CostModel | None = None,
):
    """Per-rollout log-probs (module docstring), a list in trie order; with ``entropy=True`` the pair
    ``(logps, entropies)``. The arguments are :func:`treeattn_lab.engine.tree_backward`'s.
    ``logps[i]`` has one value per predicted token: length ``n - 1`` for a sequence of ``n`` tokens,
    ``logps[i][t - 1]`` for token t, whereas ``tree_backward``'s ``token_weights[i]`` has length ``n``,
    ``w[t]`` for token t (``w[0]`` ignored): ``w[1:]`` lines up with ``logps[i]``.

    The model runs as it is (call ``model.eval()`` for log-probs without dropout); nothing is written to
    ``.grad``.
    """
    if not isinstance(entropy, bool):
        raise TypeError(f"entropy must be a bool, got {type(entropy).__name__}")
    check_cost_model(cost_model)
    plan = plan_call(model, trie, mode, block_tokens, token_budget, cost_model, with_grad=False)
    adapter = plan.adapter
    logps: list = [None] * trie.num_sequences
    entropies: list = [None] * trie.num_sequences
    with adapter.session(plan.longest):
        for mb, chosen in zip(plan.micro_batches, plan.modes, strict=True):
            lp, ent = micro_batch_logprobs(
                adapter,
                mb,
                chosen,
                block_tokens=block_tokens,
                token_budget=token_budget,
                backend=attention_backend,
                entropy=entropy,
            )
            for r, i in enumerate(mb.sequences):
                logps[i], entropies[i] = lp[r], ent[r]
    return (logps, entropies) if entropy else logps
