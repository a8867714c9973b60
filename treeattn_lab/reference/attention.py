"""Reference attention: softmax(q k^T * scale + mask) v, written with named dimensions.

Layouts: packed tensors are ``[T, H, D]`` (tokens, heads, head dim); padded batches ``[B, L, H, D]``.
Grouped-query attention (GQA): q has ``Hq = Hkv * G`` heads and query head ``h`` reads kv head
``h // G``, which is what ``rearrange(q, "t (hkv g) d -> t hkv g d")`` spells.
"""

from __future__ import annotations

import math

import torch
from einops import einsum, rearrange

from ..patterns.tree import tree_visibility


def masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    *,
    scale: float | None = None,
    return_lse: bool = False,
):
    """Attention over packed ``q [T, Hq, D]``, ``k, v [S, Hkv, D]`` with a ``[T, S]`` bool mask.

    Rows with no visible key output zeros (and log-sum-exp ``-inf``). With ``return_lse`` also returns
    the natural-log log-sum-exp of the scaled scores, ``[T, Hq]``, the state needed to merge partial
    attention results.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    hkv = k.shape[1]
    qg = rearrange(q, "t (hkv g) d -> t hkv g d", hkv=hkv)
    scores = einsum(qg, k, "t hkv g d, s hkv d -> hkv g t s") * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [hkv, g, t]
    probs = torch.exp(scores - lse[..., None].clamp_min(torch.finfo(scores.dtype).min))
    probs = probs.masked_fill(~mask, 0.0)
    out = einsum(probs, v, "hkv g t s, s hkv d -> t hkv g d")
    out = rearrange(out, "t hkv g d -> t (hkv g) d")
    if return_lse:
        return out, rearrange(lse, "hkv g t -> t (hkv g)")
    return out


def merge_attention_states(out_a, lse_a, out_b, lse_b):
    """Merge two partial attention results over disjoint key sets into the result over their union.

    ``out_* [T, H, D]`` are softmax-normalized partial outputs and ``lse_* [T, H]`` their log-sum-exps
    (``-inf`` where a part saw no key). The union's log-sum-exp is ``logaddexp(lse_a, lse_b)`` and each
    part is weighted by ``exp(lse_part - lse)``: the rule behind ring attention, cascade attention and
    split-KV decoding. Returns ``(out, lse)``; rows that saw no key at all stay zero with ``-inf``.
    """
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)  # both parts empty -> weights 0
    w_a = torch.exp(lse_a - safe)[..., None]
    w_b = torch.exp(lse_b - safe)[..., None]
    out = w_a * out_a.to(w_a.dtype) + w_b * out_b.to(w_b.dtype)
    return out.to(out_a.dtype), lse


def tree_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    subtree_end: torch.Tensor,
    *,
    scale: float | None = None,
    return_lse: bool = False,
):
    """Tree attention over a DFS-preorder pack: q sees k exactly when ``k <= q < subtree_end[k]``."""
    return masked_attention(q, k, v, tree_visibility(subtree_end), scale=scale, return_lse=return_lse)


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: torch.Tensor | None = None,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """Flat causal attention over a padded batch ``q [B, L, Hq, D]``, ``k, v [B, L, Hkv, D]``.

    ``lengths [B]`` marks each sequence's real tokens; outputs at padded positions are zero.
    """
    B, L = q.shape[:2]
    pos = torch.arange(L, device=q.device)
    mask = (pos[None, :] <= pos[:, None]).expand(B, L, L)
    if lengths is not None:
        valid = pos[None, :] < lengths.to(q.device)[:, None]  # [B, L]
        mask = mask & valid[:, None, :] & valid[:, :, None]
    outs = [masked_attention(q[b], k[b], v[b], mask[b], scale=scale) for b in range(B)]
    return torch.stack(outs)
