"""``tree_attention``: attention over a packed rollout tree, one call for every backend.

Backends:
- ``"reference"``: the einops definition (any device, float64 included; builds a T x T mask).
- ``"flex"``: PyTorch FlexAttention with the tree ``mask_mod``; its block mask is built once per pack
  and device and reused by every layer and head (compiled on CUDA; forward only on CPU).
- ``"triton"``: the lab's tile-skipping Triton kernel (``treeattn_lab.kernels.tree_attention``).
- ``"flat"``: causal SDPA (FlashAttention on CUDA) over every root-to-leaf rollout gathered out of the
  pack, each token's output taken from one rollout (``ops/flat_tree.py``).
- ``"varlen"``: FlashAttention's variable-length kernel with one sequence per leaf: the packed queries as
  they are, each leaf's rollout gathered as keys, causal aligned bottom-right (``ops/varlen_tree.py``);
  every visible pair once, at flash's speed per pair.
- ``"fa4"``: FlashAttention-4's CuTe DSL kernels with the tree ``mask_mod`` through FlexAttention's FLASH
  backend (``ops/fa4_tree.py``): CUDA compute capability >= 9.0 with the ``[hopper]`` extra installed.
- ``"auto"``: on CUDA for fp16 / bf16 inputs, fa4 where it runs on a pack whose visited tiles are mostly
  full (at most :data:`FA4_MAX_PARTIAL_SHARE` of them partial, :func:`~.tile_census.partial_tile_share`),
  whatever the pack shares; else flat when the pack shares little (attended pairs flat / tree below
  ``flat_tree.FLAT_BELOW_PAIR_RATIO``); else triton, else flex; triton for other dtypes on CUDA; reference
  on the CPU. Both features are computed once per pack and cached on it, so every pass over one pack runs
  the same kernel; while ``torch.compile`` traces, only a cached feature counts, since computing one reads
  the pack on the host.
"""

from __future__ import annotations

import torch

from .. import reference
from .backends import available_backends, choose_backend
from .fa4_tree import fa4_takes, fa4_tree_attention
from .flat_tree import flat_tree_attention, prefers_flat
from .tile_census import partial_tile_share
from .validation import check_qkv, check_scale
from .varlen_tree import varlen_tree_attention

__all__ = ["FA4_MAX_PARTIAL_SHARE", "available_backends", "choose_backend", "choose_tree_backend",
           "tree_attention"]


FLASH_DTYPES = (torch.float16, torch.bfloat16)  # where SDPA runs FlashAttention on CUDA

# ``backend="auto"`` runs a pack through FA4 only when at most this share of the FA4 tiles it visits are
# partial (:func:`~.tile_census.partial_tile_share`). FA4 runs full tiles unmasked, and its forward is the
# fastest at any tile mix, but its backward pays more than the Triton kernel's (or flat SDPA's) for the
# tiles the tree mask cuts: packs of long nodes in whole tiles run fastest on FA4 even when they share
# little, packs of many short, ragged nodes do not (the "fa4", "triton" and "gather-flat" rows of
# ``bench tree`` in bench/results/tree__NVIDIA-H200__torch-2.11.0-cu130__triton-3.6.0.json, fwd+bwd).
# The choice is the pack's, not the call's: the log-prob passes, the training pass and a checkpoint's
# recompute over one pack run the same kernel, so a PPO ratio starts at exactly 1.
FA4_MAX_PARTIAL_SHARE = 0.25


def _decided(pack, feature: str) -> bool:
    """Whether ``auto`` may read ``feature`` of ``pack``: always eagerly, while ``torch.compile`` traces
    only when an eager call cached it."""
    return not torch.compiler.is_compiling() or feature in pack._cache


def choose_tree_backend(backend: str, pack, device, dtype: torch.dtype, head_dim: int) -> str:
    """The backend ``tree_attention`` runs for ``backend`` on ``device``. ``"auto"`` on CUDA in half
    precision runs FlashAttention-4 where it is available, takes ``head_dim`` and at most
    :data:`FA4_MAX_PARTIAL_SHARE` of the pack's visited tiles are partial; else a pack that shares little
    flat, where SDPA is FlashAttention (:func:`treeattn_lab.ops.flat_tree.prefers_flat`); else the Triton
    kernel. Both decisions read features cached on the pack; while ``torch.compile`` traces, only a
    feature already cached by an eager call counts (without them: FA4 where it runs, and no flat
    fallback)."""
    half_on_gpu = backend == "auto" and torch.device(device).type == "cuda" and dtype in FLASH_DTYPES
    if half_on_gpu and fa4_takes(device, dtype, head_dim) and (
            not _decided(pack, "partial_tile_share") or partial_tile_share(pack) <= FA4_MAX_PARTIAL_SHARE):
        return "fa4"
    if half_on_gpu and _decided(pack, "flat_pair_ratio") and prefers_flat(pack):
        return choose_backend(backend, device, low_sharing=True)
    return choose_backend(backend, device)


def tree_attention(q, k, v, pack, *, scale: float | None = None, backend: str = "auto") -> torch.Tensor:
    """Attention of packed ``q [T, Hq, D]`` over ``k, v [T, Hkv, D]`` under the tree rule of ``pack``.

    Packed query q sees key k exactly when ``k <= q < pack.subtree_end[k]``, which equals causal
    attention inside every rollout. ``Hq`` must be a multiple of ``Hkv`` (grouped-query attention);
    ``scale`` defaults to ``1 / sqrt(head_dim)``. Differentiable in q, k and v. A ``nan`` / ``inf`` in
    k or v reaches every row that sees its token and, depending on the backend, rows that do not
    (:mod:`treeattn_lab.ops`).
    """
    from ..pack import TreePack

    if not isinstance(pack, TreePack):
        raise TypeError(f"pack must be a TreePack (from trie.pack()), got {type(pack).__name__}")
    check_qkv(q, k, v, num_tokens=pack.num_tokens, device=pack.device)
    check_scale(scale)
    name = choose_tree_backend(backend, pack, q.device, q.dtype, q.shape[-1])
    if name == "reference":
        return reference.tree_attention(q, k, v, pack.subtree_end, scale=scale)
    if name == "flex":
        from .flex_tree import flex_tree_attention

        return flex_tree_attention(q, k, v, pack, scale=scale)
    if name == "fa4":
        return fa4_tree_attention(q, k, v, pack, scale=scale)
    if name == "flat":
        return flat_tree_attention(q, k, v, pack, scale=scale)
    if name == "varlen":
        return varlen_tree_attention(q, k, v, pack, scale=scale)
    from ..kernels.tree_attention import triton_tree_attention

    return triton_tree_attention(q, k, v, pack, scale=scale)
