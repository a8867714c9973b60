"""Recall of a vertical-slash pattern: the share of full causal attention mass it computes.

Recall judges a pattern against dense causal attention on real queries and keys; it means little
without the pattern's density (keeping every pair has recall 1), so report the two together.
"""

from __future__ import annotations

import math

import torch
from einops import einsum, rearrange

from .pattern import VerticalSlashPattern


def causal_row_probs(q, k, rows: torch.Tensor, scale=None) -> torch.Tensor:
    """Causal softmax of the queries at positions ``rows`` against all keys: ``[Hq, len(rows), N]`` float32.

    ``q [N, Hq, D]``, ``k [N, Hkv, D]``; query head ``h`` reads key head ``h // (Hq // Hkv)``.
    """
    hkv = k.shape[1]
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else scale
    qg = rearrange(q[rows].float(), "t (hkv g) d -> hkv g t d", hkv=hkv)
    scores = einsum(qg, k.float(), "hkv g t d, s hkv d -> hkv g t s") * scale
    keys = torch.arange(k.shape[0], device=q.device)
    probs = scores.masked_fill(keys[None, :] > rows[:, None], float("-inf")).softmax(-1)
    return rearrange(probs, "hkv g t s -> (hkv g) t s")


def recall(pattern: VerticalSlashPattern, q, k, *, scale=None, rows=None, rounded: bool = True,
           chunk: int = 256) -> torch.Tensor:
    """Per head ``[H]``: the share of full causal attention mass that ``pattern`` computes, averaged over
    query rows (all rows, or the positions ``rows``), block rounding included (``rounded=False``: the
    mass on the lines alone, which judges the estimate rather than the kernel)."""
    from ...ops.validation import check_qkv, check_scale

    check_qkv(q, k, k)
    check_scale(scale)
    N, hq, _ = q.shape
    if pattern.num_heads != hq:
        raise ValueError(f"pattern has {pattern.num_heads} heads but q has {hq}")
    pattern = pattern.to(q.device)
    rows = torch.arange(N, device=q.device) if rows is None else torch.as_tensor(rows, device=q.device).long()
    kept = torch.zeros(hq, dtype=torch.float64, device=q.device)
    for start in range(0, rows.numel(), chunk):
        r = rows[start:start + chunk]
        probs = causal_row_probs(q, k, r, scale)
        kept += (probs * pattern.mask_rows(r, N, rounded=rounded)).sum((1, 2)).double()
    return (kept / rows.numel()).float()
