"""``dilated_attention`` and ``gated_scan``: the two ops of RAT+ inference, one call for every backend.

``dilated_attention`` backends:

- ``"reference"``: the einops definition with the dense ``[N, N]`` mask (any device, float64 included);
- ``"flex"``: FlexAttention with the pattern's ``mask_mod``, the naive baseline (every block below the
  diagonal holds a strided column, so it is computed in full); forward only on CPU;
- ``"triton"``: the lab's kernel (``treeattn_lab.kernels.dilated_attention``): strided, initial and
  window keys in one online softmax, about D-fold less work than causal attention;
- ``"auto"``: triton on CUDA, reference elsewhere.

``gated_scan`` backends: ``"reference"`` (the plain loop) and ``"triton"`` (the chunked scan kernel).
"""

from __future__ import annotations

import functools

import torch

from ..patterns.dilated import DilatedPattern
from ..reference.dilated import dilated_attention as reference_dilated_attention
from ..reference.scan import gated_scan as reference_gated_scan
from .backends import choose_backend
from .flex import flex_attention
from .validation import check_qkv, check_scale


def _check_batched_qkv(q, k, v) -> None:
    """``[N, H, d]`` tensors, or ``[B, N, H, d]`` ones with one batch size (each row checked as 3-D)."""
    if all(isinstance(x, torch.Tensor) and x.dim() == 4 for x in (q, k, v)):
        if not (q.shape[0] == k.shape[0] == v.shape[0]):
            raise ValueError(f"q, k, v batch sizes disagree: {q.shape[0]}, {k.shape[0]}, {v.shape[0]}")
        if q.shape[0] == 0:
            raise ValueError("q, k, v have an empty batch")
        check_qkv(q[0], k[0], v[0])
        return
    check_qkv(q, k, v)


@functools.cache
def _dilated_block_mask(pattern: DilatedPattern, num_tokens: int, device: str):
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(pattern.mask_mod(), B=None, H=None, Q_LEN=num_tokens, KV_LEN=num_tokens,
                             device=device, _compile=device.startswith("cuda"))


def flex_dilated_attention(q, k, v, pattern: DilatedPattern, *, scale=None):
    """FlexAttention with the dilated ``mask_mod``; the block mask is built once per (pattern, N, device)."""
    def block_mask():
        return _dilated_block_mask(pattern, q.shape[-3], str(q.device))

    return flex_attention(q, k, v, block_mask, scale=scale)


def dilated_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    dilation: int,
    window: int = 0,
    initial: int = 0,
    scale: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Dilated causal attention of ``q [N, Hq, d]`` over ``k, v [N, Hkv, d]`` (or ``[B, N, H, d]``).

    Query ``t`` sees key ``p`` when ``p <= t`` and (``t - p <= window``, or ``p < initial``, or
    ``(p + 1) % dilation == 0`` and ``p < t - window``): the RAT+ inference pattern ``(D, W, P)``
    (``treeattn_lab.patterns.dilated``). ``dilation=1`` is causal attention. ``Hq`` must be a multiple of
    ``Hkv`` (grouped-query attention); ``scale`` defaults to ``1 / sqrt(d)``. Differentiable in q, k, v
    (the flex backend only on CUDA). A ``nan`` / ``inf`` in k or v reaches every row that sees its token
    and, depending on the backend, rows that do not (:mod:`treeattn_lab.ops`).
    """
    pattern = DilatedPattern(dilation, window, initial)
    _check_batched_qkv(q, k, v)
    check_scale(scale)
    name = choose_backend(backend, q.device, "dilated_attention")
    if name == "reference":
        return reference_dilated_attention(q, k, v, pattern, scale=scale)
    if name == "flex":
        return flex_dilated_attention(q, k, v, pattern, scale=scale)
    from ..kernels.dilated_attention import triton_dilated_attention

    return triton_dilated_attention(q, k, v, dilation=dilation, window=window, initial=initial, scale=scale)


def gated_scan(x: torch.Tensor, g: torch.Tensor, *, dim: int = 0, backend: str = "auto") -> torch.Tensor:
    """The gated linear recurrence ``h_t = g_t h_{t-1} + (1 - g_t) x_t`` (``h_{-1} = 0``) along ``dim``.

    ``x`` and ``g`` have one shape, dtype and device; every other dimension is an independent channel.
    State and arithmetic are fp32 (float64 in the reference for float64 inputs); the result has x's
    dtype. Backends: ``"reference"`` (a plain loop), ``"triton"`` (the chunked scan kernel), ``"auto"``
    (triton on CUDA, else reference). Differentiable in x and g.
    """
    for name, t in (("x", x), ("g", g)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if x.shape != g.shape:
        raise ValueError(f"x and g shapes disagree: {tuple(x.shape)} vs {tuple(g.shape)}")
    if x.dtype != g.dtype:
        raise TypeError(f"x and g dtypes disagree: {x.dtype} vs {g.dtype}")
    if x.device != g.device:
        raise ValueError(f"x and g devices disagree: {x.device} vs {g.device}")
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim must be an int, got {type(dim).__name__}")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim {dim} is out of range for a {x.dim()}-D tensor")
    if backend == "flex":
        raise ValueError("gated_scan has no 'flex' backend; choose 'reference', 'triton' or 'auto'")
    name = choose_backend(backend, x.device, "gated_scan")
    if name == "reference" or x.numel() == 0:
        return reference_gated_scan(x, g, dim=dim)
    from ..kernels.scan import triton_gated_scan

    return triton_gated_scan(x, g, dim=dim % x.dim())
