"""Non-negative least squares, the solver behind the cost model's fits.

:func:`nnls` solves ``min ||A x - b||`` subject to ``x >= 0`` with the Lawson-Hanson active-set method:
start with every coefficient at 0 (all "active", i.e. held at the bound), repeatedly free the coefficient
whose gradient most wants to grow, solve unconstrained least squares over the freed ("passive") set, and
step back towards the previous point whenever that solution leaves the feasible region.

:func:`nnls_normalized` is what the fits call: it scales every column of ``A`` to a largest entry of 1
(features in tokens and in attended pairs differ by orders of magnitude), refuses where the rows cannot
identify the columns (too few rows, or a condition number above :data:`COND_LIMIT`), and takes an optional
lower bound per coefficient.
"""

from __future__ import annotations

import math

import torch

COND_LIMIT = 1e3  # largest condition number of the column-normalized features at which NNLS is trusted


def nnls(A: torch.Tensor, b: torch.Tensor, max_iter: int = 200) -> torch.Tensor:
    """Non-negative least squares, min ||A x - b|| with x >= 0 (Lawson-Hanson active set, float64)."""
    A, b = A.to(torch.float64), b.to(torch.float64)
    n = A.shape[1]
    x = torch.zeros(n, dtype=torch.float64)
    passive = torch.zeros(n, dtype=torch.bool)
    for _ in range(max_iter):
        w = A.T @ (b - A @ x)  # minus the gradient: where it is positive, growing x lowers the residual
        candidates = (~passive) & (w > 1e-12 * max(1.0, float(w.abs().max())))
        if not candidates.any():
            break
        passive[int(torch.where(candidates, w, torch.full_like(w, -math.inf)).argmax())] = True
        while True:
            z = torch.zeros(n, dtype=torch.float64)
            z[passive] = torch.linalg.lstsq(A[:, passive], b[:, None]).solution[:, 0]
            if (z[passive] > 0).all():
                x = z
                break
            mask = passive & (z <= 0)  # step from x towards z until the first coefficient reaches 0
            alpha = float((x[mask] / (x[mask] - z[mask])).min())
            x = x + alpha * (z - x)
            passive &= x > 1e-15
    return x


def condition_number(A: torch.Tensor) -> float:
    """2-norm condition number of ``A`` (inf when it has fewer rows than columns or is rank deficient)."""
    if A.shape[0] < A.shape[1]:
        return math.inf
    sv = torch.linalg.svdvals(A)
    return float(sv[0] / sv[-1]) if float(sv[-1]) > 0 else math.inf


def nnls_normalized(
    A: torch.Tensor, b: torch.Tensor, floor: torch.Tensor | None = None
) -> tuple[torch.Tensor | None, float]:
    """NNLS ``x >= floor`` over the non-zero columns of ``A`` in column-normalized units, and the condition
    number of those units; ``None`` for ``x`` where the rows cannot identify the columns.

    Columns that are zero in every row keep their floor. The problem is solved as ``x = floor + x'`` with
    ``x' >= 0`` fitted to ``b - A @ floor``.
    """
    floor = torch.zeros(A.shape[1], dtype=torch.float64) if floor is None else floor
    cols = A.abs().amax(0) > 0
    scale = A[:, cols].abs().amax(0)
    An = A[:, cols] / scale
    cond = condition_number(An)
    if A.shape[0] <= int(cols.sum()) or cond > COND_LIMIT:
        return None, cond
    x = floor.clone()
    x[cols] += nnls(An, b - A @ floor) / scale
    return x, cond
