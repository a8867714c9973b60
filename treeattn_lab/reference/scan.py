"""Gated linear recurrence, written as the plain loop it is: the definition the scan kernel is tested against.

For every channel independently, along time::

    h_t = g_t * h_{t-1} + (1 - g_t) * x_t,        h_{-1} = 0.

RAT+ applies it to keys and values with one sigmoid gate ``g`` (``treeattn_lab.reference.rat``). The loop
keeps its state in at least float32 (float64 stays float64) and returns the input dtype. It is
differentiable through autograd, one step at a time: fine for tests and for tiny models on a CPU.
"""

from __future__ import annotations

import torch


def gated_scan(x: torch.Tensor, g: torch.Tensor, *, dim: int = 0) -> torch.Tensor:
    """``h`` with ``h_t = g_t h_{t-1} + (1 - g_t) x_t`` along ``dim`` of ``x`` and ``g`` (same shape)."""
    if x.shape[dim] == 0:
        return torch.empty_like(x)
    state_dtype = torch.promote_types(x.dtype, torch.float32)
    xs = x.movedim(dim, 0).to(state_dtype)
    gs = g.movedim(dim, 0).to(state_dtype)
    h = torch.zeros_like(xs[0])
    out = []
    for x_t, g_t in zip(xs, gs, strict=True):
        h = g_t * h + (1 - g_t) * x_t
        out.append(h)
    return torch.stack(out).movedim(0, dim).to(x.dtype)

