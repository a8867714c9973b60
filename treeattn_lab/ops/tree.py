"""``tree_attention``: attention over a packed rollout tree, one call for every backend.

Backends:
- ``"reference"``: the einops definition (any device, float64 included; builds a T x T mask).
- ``"flex"``: PyTorch FlexAttention with the tree ``mask_mod``; its block mask is built once per pack
  and device and reused by every layer and head (compiled on CUDA; forward only on CPU).
- ``"triton"``: the lab's tile-skipping Triton kernel (``treeattn_lab.kernels.tree_attention``).
- ``"auto"``: the fastest available: triton on CUDA, else flex on CUDA, else reference.
"""

from __future__ import annotations

import torch

from .. import reference
from .backends import available_backends, choose_backend
from .validation import check_qkv, check_scale

__all__ = ["available_backends", "choose_backend", "tree_attention"]

def tree_attention(q, k, v, pack, *, scale: float | None = None, backend: str = "auto") -> torch.Tensor:
    """Attention of packed ``q [T, Hq, D]`` over ``k, v [T, Hkv, D]`` under the tree rule of ``pack``.

    Packed query q sees key k exactly when ``k <= q < pack.subtree_end[k]``, which equals causal
    attention inside every rollout. ``Hq`` must be a multiple of ``Hkv`` (grouped-query attention);
    ``scale`` defaults to ``1 / sqrt(head_dim)``. Differentiable in q, k and v.
    """
    from ..pack import TreePack

    if not isinstance(pack, TreePack):
        raise TypeError(f"pack must be a TreePack (from trie.pack()), got {type(pack).__name__}")
    check_qkv(q, k, v, num_tokens=pack.num_tokens, device=pack.device)
    check_scale(scale)
    name = choose_backend(backend, q.device)
    if name == "reference":
        return reference.tree_attention(q, k, v, pack.subtree_end, scale=scale)
    if name == "flex":
        from .flex_tree import flex_tree_attention

        return flex_tree_attention(q, k, v, pack, scale=scale)
    from ..kernels.tree_attention import triton_tree_attention

    return triton_tree_attention(q, k, v, pack, scale=scale)
