"""The three attentions the engine hands a model, one per way of laying out rollouts.

All take ``q [B, N, Hq, D]``, ``k, v [B, S, Hkv, D]`` (grouped-query heads allowed) and return
``[B, N, Hq, D]``:

- :func:`causal` (flat): each batch row is one rollout, right-padded; plain causal attention. Padding sits
  after the real tokens, so causality alone keeps real queries off padded keys.
- :func:`suffix_causal` (DFS): N new tokens of one root-to-leaf path after S - N stored prefix tokens;
  query i sees keys ``0 .. S - N + i`` (the causal mask aligned to the bottom right).
- :func:`prefix_tree` (DFS, a packed span): N new tokens after S - N stored prefix tokens, under an
  explicit ``[N, S]`` mask, boolean or additive (every prefix key, and the tree rule inside the span).
- :func:`packed_tree` (packed): one batch row holding a whole :class:`TreePack`; tree attention.

A model's layer reaches whichever of them the engine chose through a call ``torch.compile`` does not
trace (the adapter's per-layer call for TinyLM, ``adapters._call_with_layer``; the registered attention
function for a Hugging Face model, ``hf_attention._hf_attention``): the engine's attention keeps Python
state per call (the DFS path's stacks, per-layer indices), so a model whose layers were compiled
runs each layer as compiled graphs before and after one eager attention call, the same graphs for every
layer and call, instead of recompiling for each layer index and each DFS block.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right


def _repeat_heads(x, group: int):
    """``[B, S, H, D]`` -> ``[B, S, H * group, D]``, kv head h serving query heads ``h * group ..``: one
    copy forward and one sum backward."""
    b, n, h, d = x.shape
    return x[:, :, :, None].expand(b, n, h, group, d).reshape(b, n, h * group, d)


def _sdpa(q, k, v, scale, **mask):
    """SDPA on ``[B, N, H, D]`` layouts, kv heads repeated for grouped-query attention."""
    group = q.shape[2] // k.shape[2]
    if group > 1:
        k, v = (_repeat_heads(x, group) for x in (k, v))
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, scale=scale, **mask)
    return out.transpose(1, 2)


def causal(q, k, v, scale=None):
    return _sdpa(q, k, v, scale, is_causal=True)


def suffix_causal(q, k, v, scale=None):
    n, s = q.shape[1], k.shape[1]
    if n == s:
        return causal(q, k, v, scale)
    return _sdpa(q, k, v, scale, attn_mask=causal_lower_right(n, s))


def prefix_tree(q, k, v, mask, scale=None):
    return _sdpa(q, k, v, scale, attn_mask=mask)


def packed_tree(pack, backend: str = "auto"):
    """Tree attention over ``pack`` as a model attention (batch of one packed row)."""
    from ..ops.tree import tree_attention

    def attend(q, k, v, scale=None):
        if q.shape[0] != 1:
            raise ValueError(f"a packed tree is one batch row, got batch size {q.shape[0]}")
        return tree_attention(q[0], k[0], v[0], pack, scale=scale, backend=backend)[None]

    return attend


__all__ = ["causal", "packed_tree", "prefix_tree", "suffix_causal"]
