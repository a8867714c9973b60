"""Estimating a vertical-slash pattern on the fly from the last queries (MInference).

:func:`line_scores` scores only the last ``last_q`` queries against all keys: a column's score is its
attention mass summed over those queries (vertical), a diagonal's score the mass summed along it
(slash). :func:`estimate` keeps the top ``n_vertical`` columns and ``n_slash`` offsets per head, with the
first ``sinks`` columns and the first ``local`` offsets always kept; :func:`estimate_top_p` keeps, per
head, the fewest lines that reach a share ``p`` of the mass (capped).
"""

from __future__ import annotations

import torch

from .lines import PAD
from .pattern import VerticalSlashPattern
from .recall_mass import causal_row_probs


def line_scores(q, k, *, last_q: int = 64, scale=None) -> tuple[torch.Tensor, torch.Tensor]:
    """MInference's line scores from the last ``last_q`` queries: ``(vertical [H, N], slash [H, N])``.

    ``vertical[h, k]`` sums the attention those queries give key ``k``; ``slash[h, s]`` sums it along
    the diagonal ``q - k = s``. Each row adds up to ``min(last_q, N)``.
    """
    N = k.shape[0]
    qpos = torch.arange(max(N - last_q, 0), N, device=q.device)
    probs = causal_row_probs(q, k, qpos, scale)
    vertical = probs.sum(1)
    offsets = (qpos[:, None] - torch.arange(N, device=q.device)[None, :]).clamp(min=0)  # 0 where masked
    slash = torch.zeros_like(vertical)
    slash.scatter_add_(1, offsets.flatten()[None].expand(probs.shape[0], -1), probs.flatten(1))
    return vertical, slash


def _check_estimate_inputs(q, k, last_q, sinks, local, scale):
    from ...ops.validation import check_qkv, check_scale

    check_qkv(q, k, k)
    check_scale(scale)
    for name, value in (("last_q", last_q), ("sinks", sinks), ("local", local)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    if last_q < 1:
        raise ValueError("last_q must be >= 1")


def _forced(scores: torch.Tensor, first: int) -> torch.Tensor:
    out = scores.clone()
    out[:, :first] = float("inf")
    return out


def estimate(q, k, *, last_q: int = 64, n_vertical: int, n_slash: int, sinks: int = 30, local: int = 100,
             block_size: int = 128, scale=None) -> VerticalSlashPattern:
    """Estimate a vertical-slash pattern per head from ``q [N, Hq, D]``, ``k [N, Hkv, D]`` (MInference).

    Keeps per head the ``n_vertical`` columns and ``n_slash`` diagonal offsets with the highest
    :func:`line_scores`, always including the first ``sinks`` columns and the first ``local`` offsets
    (the attention sinks and the local window). Budgets larger than ``N`` are clipped. The top-k indices
    are distinct and in range by construction, so the pattern is built without reading them back
    (:meth:`VerticalSlashPattern._from_top_k`).
    """
    _check_estimate_inputs(q, k, last_q, sinks, local, scale)
    for name, value in (("n_vertical", n_vertical), ("n_slash", n_slash)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    N = q.shape[0]
    vertical, slash = line_scores(q, k, last_q=last_q, scale=scale)
    v_idx = _forced(vertical, sinks).topk(min(n_vertical, N), dim=1).indices
    s_idx = _forced(slash, local).topk(min(n_slash, N), dim=1).indices
    return VerticalSlashPattern._from_top_k(v_idx, s_idx, block_size, num_tokens=N)


def _top_p_lines(scores: torch.Tensor, first: int, p: float, cap: int) -> torch.Tensor:
    """Per row, the fewest entries whose mass reaches ``p`` of the row total (forced ``first`` entries
    included and counted first), at most ``cap``; padding ``-1``."""
    total = scores.sum(1, keepdim=True).clamp_min(torch.finfo(scores.dtype).tiny)
    order = _forced(scores, first).argsort(dim=1, descending=True)
    mass = scores.gather(1, order) / total
    before = torch.cumsum(mass, 1) - mass  # mass of the entries ranked ahead
    rank = torch.arange(scores.shape[1], device=scores.device)[None, :]
    keep = ((before < p) | (rank < first)) & (rank < cap)
    return torch.where(keep, order, PAD)


def estimate_top_p(q, k, *, p: float = 0.95, max_vertical: int = 4096, max_slash: int = 4096,
                   last_q: int = 64, sinks: int = 30, local: int = 100, block_size: int = 128,
                   scale=None) -> VerticalSlashPattern:
    """Like :func:`estimate`, but each head keeps the fewest columns (and, separately, offsets) that hold a
    share ``p`` of its line scores, capped at ``max_vertical`` / ``max_slash``: focused heads get few
    lines, diffuse heads many."""
    _check_estimate_inputs(q, k, last_q, sinks, local, scale)
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 < p <= 1.0:
        raise ValueError(f"p must lie in (0, 1], got {p!r}")
    for name, value in (("max_vertical", max_vertical), ("max_slash", max_slash)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    vertical, slash = line_scores(q, k, last_q=last_q, scale=scale)
    return VerticalSlashPattern(_top_p_lines(vertical, sinks, p, max_vertical),
                                _top_p_lines(slash, local, p, max_slash), block_size)
