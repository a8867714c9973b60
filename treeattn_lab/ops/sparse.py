"""``sparse_attention``: causal attention restricted to a vertical-slash pattern, one call for every backend.

Backends:
- ``"reference"``: the einops definition over the pattern's dense per-head mask (any device, float64
  included; builds an ``H x N x N`` mask, so small inputs only).
- ``"flex"``: PyTorch FlexAttention with the pattern's ``mask_mod`` and a block mask made from the same
  tiles (selected off-diagonal tiles full, the diagonal and every tile holding a bar column partial);
  compiled on CUDA, forward only on CPU. The baseline the kernel is measured against.
- ``"triton"``: the lab's block-sparse kernel (``treeattn_lab.kernels.block_sparse``): selected tiles plus
  gathered bar columns, nothing else loaded.
- ``"auto"``: triton on CUDA, else reference.

The pattern's kernel index and Flex block mask are built once per (pattern, token count, device) and
cached on the pattern: every layer reusing a pattern pays for them once. Building them is host work, so
under ``torch.compile`` the triton backend needs them built first (one eager call, or
``kernels.block_sparse.prepare``) and says so otherwise.
"""

from __future__ import annotations

import torch

from ..patterns.vertical_slash import VerticalSlashPattern
from ..reference.sparse import sparse_attention as reference_sparse_attention
from .backends import available_backends, choose_backend
from .flex import block_mask_from_tiles, flex_attention
from .validation import check_qkv, check_scale


def sparse_backends(device="cpu") -> list[str]:
    """Backends that can run sparse attention here (forward at least)."""
    return available_backends(device, "sparse_attention")


def check_pattern(pattern, q, *, compiled_kernel: bool = False) -> None:
    """The pattern must be a :class:`VerticalSlashPattern` with q's heads, on q's device, fitting N.

    ``compiled_kernel``: the triton backend inside ``torch.compile``, which cannot build the kernel's index
    (host work): the pattern's index for N must be cached by then, and its entries were checked when it
    was built eagerly.
    """
    if not isinstance(pattern, VerticalSlashPattern):
        raise TypeError(
            f"pattern must be a VerticalSlashPattern (see estimate()), got {type(pattern).__name__}"
        )
    if pattern.num_heads != q.shape[1]:
        raise ValueError(f"pattern has {pattern.num_heads} heads but q has {q.shape[1]} query heads")
    if pattern.device != q.device:
        raise ValueError(f"pattern is on {pattern.device} but q on {q.device}; move it with pattern.to()")
    if not compiled_kernel:
        pattern.check_tokens(q.shape[0])
    elif ("block_index", q.shape[0], True) not in pattern._cache:
        raise ValueError("torch.compile cannot build a block-sparse index (host work): call sparse_attention "
                         "once eagerly, or prepare it with treeattn_lab.kernels.block_sparse.prepare("
                         "pattern.block_index(num_tokens), group=Hq // Hkv), before compiling")


# ------------------------------------------------------------------------------------------ flex
def flex_block_mask(pattern: VerticalSlashPattern, num_tokens: int):
    """The FlexAttention ``BlockMask`` of ``pattern`` over ``num_tokens`` (cached on the pattern).

    Built from the tiles directly (no ``N x N`` evaluation): off-diagonal selected tiles are *full*;
    the diagonal tiles and every other tile holding one of the head's columns are *partial* (the
    ``mask_mod`` decides per element).
    """
    key = ("flex_block_mask", num_tokens)
    if key in pattern._cache:
        return pattern._cache[key]
    bs = pattern.block_size
    tiles = pattern.block_map(num_tokens)  # [H, nB, nB]
    nb = tiles.shape[1]
    eye = torch.eye(nb, dtype=torch.bool, device=tiles.device)
    causal = torch.ones(nb, nb, dtype=torch.bool, device=tiles.device).tril()
    col_blocks = torch.zeros(pattern.num_heads, nb, dtype=torch.bool, device=tiles.device)
    cols = pattern.vertical
    rows = torch.arange(pattern.num_heads, device=tiles.device)[:, None].expand_as(cols)
    col_blocks[rows[cols >= 0], cols[cols >= 0] // bs] = True
    full = tiles & ~eye
    partial = ((tiles & eye) | (col_blocks[:, None, :] & causal)) & ~full

    block_mask = block_mask_from_tiles(partial, full, block_size=bs, mask_mod=pattern.mask_mod(num_tokens),
                                       seq_lengths=(num_tokens, num_tokens))
    pattern._cache[key] = block_mask
    return block_mask


def flex_sparse_attention(q, k, v, pattern: VerticalSlashPattern, *, scale=None):
    """FlexAttention of ``q, k, v`` under ``pattern`` (its block mask built once, :func:`flex_block_mask`)."""
    return flex_attention(q, k, v, flex_block_mask(pattern, q.shape[0]), scale=scale)


# ------------------------------------------------------------------------------------------ entry point
def sparse_attention(q, k, v, pattern: VerticalSlashPattern, *, scale: float | None = None,
                     backend: str = "auto") -> torch.Tensor:
    """Causal attention of ``q [N, Hq, D]`` over ``k, v [N, Hkv, D]`` restricted to ``pattern``.

    Query ``q`` sees key ``k <= q`` when ``k`` is one of its head's vertical columns or lies in a
    ``block_size`` tile that one of its head's slashes crosses (see
    :meth:`VerticalSlashPattern.dense_mask`). ``Hq`` must be a multiple of ``Hkv`` (grouped-query
    attention); ``scale`` defaults to ``1 / sqrt(head_dim)``. Rows that see no key output zeros.
    Differentiable in q, k and v (flex: on CUDA only). A ``nan`` / ``inf`` in k or v reaches every row
    that sees its token and, depending on the backend, rows that do not (:mod:`treeattn_lab.ops`).
    """
    check_qkv(q, k, v)
    check_scale(scale)
    name = choose_backend(backend, q.device, "sparse_attention")
    check_pattern(pattern, q, compiled_kernel=name == "triton" and torch.compiler.is_compiling())
    if name == "reference":
        return reference_sparse_attention(q, k, v, pattern, scale=scale)
    if name == "flex":
        return flex_sparse_attention(q, k, v, pattern, scale=scale)
    from ..kernels.block_sparse import triton_sparse_attention

    return triton_sparse_attention(q, k, v, pattern.block_index(q.shape[0]), scale=scale)
