"""Dilated attention with a local window and initial tokens (the RAT+ inference pattern ``(D, W, P)``).

Rule: query ``t`` sees key ``p`` exactly when ``p <= t`` and

- ``t - p <= W``: the local window (the query itself and the ``W`` keys before it), or
- ``p < P``: the first ``P`` positions ("initial" or sink tokens), or
- ``(p + 1) % D == 0 and p < t - W``: every D-th position further back (positions D-1, 2D-1, ...).

``D = 1`` is plain causal attention; ``W = 0, P = 0`` keeps only the query itself and the strided keys.
Only the strided keys ``p = j D + D - 1`` (the *compact* keys, ``j = 0 .. N // D - 1``) are ever needed
beyond the window, so a decoder caches ``P + W + 1 + N // D`` entries instead of ``N``: both the cache
and the attention work shrink about D-fold.

Kernels split the visible keys of query ``t`` into three disjoint parts (``dilated_parts``):

- strided: compact keys ``j`` with ``P // D <= j < max(t - W, 0) // D`` (``p_j >= P`` and ``p_j < t - W``);
- initial: positions ``p < min(P, t - W)`` (the initial keys not already in the window);
- window: positions ``max(t - W, 0) <= p <= t``.

``python -m treeattn_lab.patterns.dilated`` prints a small mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..checks import check_int


@dataclass(frozen=True)
class DilatedPattern:
    """The pattern ``(dilation D, window W, initial P)``; validated on construction."""

    dilation: int
    window: int = 0
    initial: int = 0

    def __post_init__(self):
        check_int("dilation", self.dilation, minimum=1)
        check_int("window", self.window, minimum=0)
        check_int("initial", self.initial, minimum=0)

    # ------------------------------------------------------------------ the rule, elementwise
    def visible(self, t, p):
        """``t`` may attend ``p``: tensors (broadcast) or ints; the one definition of the rule."""
        D, W, P = self.dilation, self.window, self.initial
        strided = ((p + 1) % D == 0) & (p < t - W)
        return (p <= t) & ((t - p <= W) | (p < P) | strided)

    def dense_mask(self, num_tokens: int, device=None) -> torch.Tensor:
        """``[N, N]`` bool mask, ``mask[t, p]`` = query t attends key p (for drawings and references)."""
        check_int("num_tokens", num_tokens, minimum=0)
        pos = torch.arange(num_tokens, device=device)
        return self.visible(pos[:, None], pos[None, :])

    def mask_mod(self):
        """A FlexAttention ``mask_mod`` for the rule (batch and head independent)."""

        def mask_mod(b, h, q_idx, kv_idx):
            return self.visible(q_idx, kv_idx)

        return mask_mod

    # ------------------------------------------------------------------ the compact form kernels read
    def num_compact(self, num_tokens: int) -> int:
        """How many strided (compact) keys a sequence of ``num_tokens`` has: positions D-1, 2D-1, ..."""
        return num_tokens // self.dilation

    def compact_positions(self, num_tokens: int, device=None) -> torch.Tensor:
        """Positions ``j D + D - 1`` of the compact keys, ``[N // D]`` int64."""
        D = self.dilation
        return torch.arange(self.num_compact(num_tokens), device=device) * D + D - 1

    def parts(self, t: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The three disjoint key ranges of queries ``t`` as ``{part: (start, end)}`` (end exclusive).

        ``strided`` ranges index compact keys; ``initial`` and ``window`` index positions.
        """
        D, W, P = self.dilation, self.window, self.initial
        t = torch.as_tensor(t)
        behind = (t - W).clamp_min(0)  # keys p < t - W lie behind the window
        return {
            "strided": (torch.full_like(t, P // D), torch.maximum(behind // D, torch.full_like(t, P // D))),
            "initial": (torch.zeros_like(t), torch.clamp(behind, max=P)),
            "window": (behind, t + 1),
        }

    def kv_cache_entries(self, num_tokens: int) -> int:
        """Entries per kv head a decoder keeps at ``num_tokens``: ``P + W + 1 + N // D`` (capped at N)."""
        D, W, P = self.dilation, self.window, self.initial
        return min(num_tokens, P + W + 1 + num_tokens // D)

    def keys_per_query(self, num_tokens: int) -> torch.Tensor:
        """Number of visible keys of every query ``[N]`` int64 (from the three parts, no N x N mask)."""
        t = torch.arange(num_tokens)
        return sum(end - start for start, end in self.parts(t).values())

    def num_pairs(self, num_tokens: int) -> int:
        """Attended (query, key) pairs; attention FLOPs are ``4 * pairs * heads * head_dim``."""
        return int(self.keys_per_query(num_tokens).sum())


def dilated_mask(num_tokens: int, dilation: int, window: int = 0, initial: int = 0, device=None):
    """Dense ``[N, N]`` bool mask of the pattern (shorthand for ``DilatedPattern(...).dense_mask(N)``)."""
    return DilatedPattern(dilation, window, initial).dense_mask(num_tokens, device=device)


def dilated_mask_mod(dilation: int, window: int = 0, initial: int = 0):
    """FlexAttention ``mask_mod`` of the pattern."""
    return DilatedPattern(dilation, window, initial).mask_mod()


def main() -> None:  # pragma: no cover - draw it yourself: python -m treeattn_lab.patterns.dilated
    pattern = DilatedPattern(dilation=4, window=2, initial=1)
    print(pattern)
    for row in pattern.dense_mask(20).int().tolist():
        print("".join("#" if v else "." for v in row))


if __name__ == "__main__":  # pragma: no cover
    main()
