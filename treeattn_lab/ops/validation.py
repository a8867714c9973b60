"""Input checks shared by the attention entry points: clear errors instead of wrong answers."""

from __future__ import annotations

import numbers

import torch

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_qkv(q, k, v, *, num_tokens: int | None = None, device=None) -> None:
    """Check packed ``q [T, Hq, D]``, ``k, v [T, Hkv, D]`` against each other (and a pack's T / device)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 3:
            raise ValueError(f"{name} must be 3-D [T, heads, head_dim], got shape {tuple(x.shape)}")
        if x.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name} has dtype {x.dtype}; expected float16, bfloat16, float32 or float64")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v dtypes disagree: {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v devices disagree: {q.device}, {k.device}, {v.device}")
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(f"q, k, v token counts disagree: {q.shape[0]}, {k.shape[0]}, {v.shape[0]}")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes disagree: {tuple(k.shape)} vs {tuple(v.shape)}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q and k head dims disagree: {q.shape[2]} vs {k.shape[2]}")
    if q.shape[2] == 0:
        raise ValueError("head_dim is 0: q, k, v need at least one feature per head")
    hq, hkv = q.shape[1], k.shape[1]
    if hq == 0:
        raise ValueError("q has 0 heads")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    if num_tokens is not None and q.shape[0] != num_tokens:
        raise ValueError(f"q, k, v have T={q.shape[0]} tokens but the pack has T={num_tokens}")
    if device is not None and q.device != torch.device(device):
        raise ValueError(f"q, k, v are on {q.device} but the pack is on {device}; move one with .to()")


def check_scale(scale) -> None:
    if scale is None:
        return
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):  # numpy floats included
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    if not scale > 0 or scale != scale or scale == float("inf"):
        raise ValueError(f"scale must be a positive finite number, got {scale}")
