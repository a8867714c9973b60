"""The LM head run by chunks of rows: per-token log-probs without the full ``[tokens, vocab]`` logits.

For hidden rows ``h [n, d]`` (the model's final-norm output) and targets ``y [n]``,

    logp[r]    = logits[r, y[r]] - logsumexp(logits[r])          logits = head(h)
    entropy[r] = logsumexp(logits[r]) - sum_v softmax(logits[r])_v * logits[r, v]

are computed ``chunk_rows`` rows at a time in float32 (float64 for a float64 model), so at most
``chunk_rows x vocab`` logits exist at once. With autograd on and more than one chunk, each chunk runs under
a non-reentrant checkpoint: backward recomputes that chunk's logits instead of keeping all of them alive.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

CHUNK_ROWS = 1024  # rows x vocab logits per chunk: 1024 x 152K fp32 is 0.6 GB


def _score(head, rows: torch.Tensor, targets: torch.Tensor, entropy: bool):
    logits = head(rows)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets[:, None])[:, 0] - lse
    if not entropy:
        return logp, None
    probs = torch.softmax(logits, dim=-1)
    return logp, lse - (probs * logits).sum(-1)


def _score_logp(head, rows, targets):
    return _score(head, rows, targets, False)[0]


def token_logprobs(
    head, hidden: torch.Tensor, targets: torch.Tensor, *, entropy: bool = False, chunk_rows: int | None = None
):
    """``(logp [n], entropy [n] or None)`` for ``hidden [n, d]`` and ``targets [n]`` (module docstring).

    ``logp`` is differentiable when autograd is on; the entropy is computed without autograd.
    ``chunk_rows``: rows per chunk (None: :data:`CHUNK_ROWS`).
    """
    if hidden.shape[0] == 0:
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        empty = hidden.new_zeros(0, dtype=dtype)
        return empty, (empty if entropy else None)
    chunk_rows = chunk_rows or CHUNK_ROWS
    pieces = list(zip(hidden.split(chunk_rows), targets.split(chunk_rows), strict=True))
    grad = torch.is_grad_enabled()
    logps, entropies = [], []
    for rows, tgt in pieces:
        if not grad:
            logp, ent = _score(head, rows, tgt, entropy)
            logps.append(logp)
            entropies.append(ent)
            continue
        if entropy:
            with torch.no_grad():
                entropies.append(_score(head, rows, tgt, True)[1])
        if len(pieces) > 1:
            logps.append(checkpoint(_score_logp, head, rows, tgt, use_reentrant=False))
        else:
            logps.append(_score_logp(head, rows, tgt))
    return torch.cat(logps), (torch.cat(entropies) if entropy else None)
