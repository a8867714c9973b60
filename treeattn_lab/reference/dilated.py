"""Reference dilated attention: masked attention with a ``DilatedPattern``'s dense ``[N, N]`` mask.

Query ``t`` sees key ``p`` when ``p <= t`` and (``t - p <= W``, or ``p < P``, or ``(p + 1) % D == 0`` and
``p < t - W``) (``treeattn_lab.patterns.dilated``).
"""

from __future__ import annotations

import torch

from .attention import masked_attention


def dilated_attention(q, k, v, pattern, *, scale=None):
    """Attention of ``q [N, Hq, D]`` (or ``[B, N, Hq, D]``, each batch row alone) over ``k, v`` with the
    same layout and ``Hkv`` heads, under ``pattern``."""
    mask = pattern.dense_mask(q.shape[-3], device=q.device)
    if q.dim() == 3:
        return masked_attention(q, k, v, mask, scale=scale)
    rows = zip(q, k, v, strict=True)
    return torch.stack([masked_attention(a, b, c, mask, scale=scale) for a, b, c in rows])
