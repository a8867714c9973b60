"""A seeded synthetic vertical-slash pattern shaped like estimated ones (no model needed)."""

from __future__ import annotations

import torch

from .pattern import VerticalSlashPattern


def synthetic_pattern(num_tokens: int, num_heads: int, *, n_vertical: int = 1000, n_slash: int = 1000,
                      sinks: int = 30, local: int = 100, slash_scale: float = 256.0, far_slash: float = 0.0,
                      block_size: int = 128, seed: int = 0, device=None) -> VerticalSlashPattern:
    """A seeded pattern shaped like estimated ones, for benchmarks and tests (no model needed).

    Per head: the first ``sinks`` columns plus random columns spread uniformly over the sequence; the
    ``local`` nearest diagonals plus offsets drawn without replacement with weights ``exp(-s /
    slash_scale)`` (attention decays with distance, so a top-k of noisy diagonal scores is a band near
    the diagonal with a thinning tail), of which a share ``far_slash`` is drawn uniformly over the whole
    sequence instead (scattered far lines). ``far_slash=1`` is the scattered worst case, where slashes
    cross nearly every tile.
    """
    gen = torch.Generator().manual_seed(seed)
    n_vertical, n_slash = min(n_vertical, num_tokens), min(n_slash, num_tokens)
    positions = torch.arange(num_tokens)

    def pick(n_forced, n_total, log_weight):
        """Per head: the first ``n_forced`` positions plus ``n_total - n_forced`` more, drawn without
        replacement with weights ``exp(log_weight)`` (Gumbel top-k)."""
        n_forced = min(n_forced, n_total)
        rows = []
        for _ in range(num_heads):
            u = torch.rand(num_tokens, generator=gen, dtype=torch.float64).clamp_min(1e-300)
            key = log_weight() - torch.log(-torch.log(u))
            key[:n_forced] = float("inf")
            rows.append(key.topk(n_total).indices)
        return torch.stack(rows) if rows else torch.zeros(0, n_total, dtype=torch.int64)

    columns = pick(sinks, n_vertical, lambda: torch.zeros(num_tokens, dtype=torch.float64))
    n_far = round(far_slash * max(n_slash - local, 0))

    offsets = pick(local, n_slash - n_far, lambda: -positions.double() / slash_scale)
    if n_far:
        far = []
        for h in range(num_heads):
            free = torch.ones(num_tokens, dtype=torch.bool)
            free[offsets[h]] = False
            candidates = positions[free]
            far.append(candidates[torch.randperm(candidates.numel(), generator=gen)[:n_far]])
        offsets = torch.cat([offsets, torch.stack(far)], dim=1)
    pattern = VerticalSlashPattern(columns, offsets, block_size)
    return pattern.to(device) if device is not None else pattern
