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
- ``"auto"``: on CUDA for fp16 / bf16 inputs, flat when the pack shares little (attended pairs flat / tree
  below ``flat_tree.FLAT_BELOW_PAIR_RATIO``, decided once per pack and cached on it; while
  ``torch.compile`` traces, only a cached decision counts, since deciding reads the pack on the host), else
  fa4 where it runs on a pack sharing at least :data:`FA4_FROM_PAIR_RATIO` (below it the Triton kernel's
  backward is faster; the choice is per pack, so every pass over one pack runs the same kernel), else
  triton, else flex; triton for other dtypes on CUDA; reference on the CPU.
"""

from __future__ import annotations

import torch

from .. import reference
from .backends import available_backends, choose_backend
from .fa4_tree import fa4_takes, fa4_tree_attention
from .flat_tree import flat_pair_ratio, flat_tree_attention, prefers_flat
from .validation import check_qkv, check_scale
from .varlen_tree import varlen_tree_attention

__all__ = ["FA4_FROM_PAIR_RATIO", "available_backends", "choose_backend", "choose_tree_backend",
           "tree_attention"]


FLASH_DTYPES = (torch.float16, torch.bfloat16)  # where SDPA runs FlashAttention on CUDA

# ``backend="auto"`` runs a pack through FA4 only when its flat / tree pair ratio
# (:func:`~.flat_tree.flat_pair_ratio`) is at least this: on packs of many short rollouts FA4's forward
# still wins but its backward loses to the Triton kernel's (the "fa4" and "triton" rows of ``bench tree``
# in bench/results/tree__NVIDIA-H200__torch-2.11.0-cu130__triton-3.6.0.json, forward and fwd+bwd).
# The choice is the pack's, not the call's: the log-prob passes, the training pass and a checkpoint's
# recompute over one pack run the same kernel, so a PPO ratio starts at exactly 1.
FA4_FROM_PAIR_RATIO = 1.5


def choose_tree_backend(backend: str, pack, device, dtype: torch.dtype, head_dim: int) -> str:
    """The backend ``tree_attention`` runs for ``backend`` on ``device``. ``"auto"`` on CUDA in half
    precision runs a pack that shares little flat, where SDPA is FlashAttention
    (:func:`treeattn_lab.ops.flat_tree.prefers_flat`), else FlashAttention-4 where it is available, takes
    ``head_dim`` and the pack shares at least :data:`FA4_FROM_PAIR_RATIO`, else the Triton kernel. Both
    decisions read the pack's cached pair ratio; while ``torch.compile`` traces, only a ratio already
    cached by an eager call counts (without it: no flat fallback, and FA4 where it runs)."""
    half_on_gpu = backend == "auto" and torch.device(device).type == "cuda" and dtype in FLASH_DTYPES
    decided = not torch.compiler.is_compiling() or "flat_pair_ratio" in pack._cache
    if half_on_gpu and decided and prefers_flat(pack):
        return choose_backend(backend, device, low_sharing=True)
    if half_on_gpu and fa4_takes(device, dtype, head_dim) and (
            not decided or flat_pair_ratio(pack) >= FA4_FROM_PAIR_RATIO):
        return "fa4"
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
