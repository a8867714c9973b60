"""The line lists of a vertical-slash pattern: per head, a row of positions padded with ``-1``.

A pattern stores its key columns and its diagonal offsets in the same form: an int64 ``[H, n]`` tensor,
each row sorted ascending with duplicates removed and the padding entry :data:`PAD` last, so heads may keep
different numbers of lines and ``n`` is the longest row.
"""

from __future__ import annotations

import torch

PAD = -1  # padding entry in vertical / slash


def normalized_lines(x, name: str) -> torch.Tensor:
    """A copy of ``x`` as int64 ``[H, n]``, each row sorted ascending and unique, padding ``-1`` last."""
    if not isinstance(x, torch.Tensor):
        x = torch.as_tensor(x)
    if x.dtype.is_floating_point or x.dtype == torch.bool or x.is_complex():
        raise TypeError(f"{name} must hold integer indices, got dtype {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D [heads, lines], got shape {tuple(x.shape)}")
    x = x.to(torch.int64)
    if (x < PAD).any():
        raise ValueError(f"{name} entries must be >= 0 (or -1 for padding), got {int(x.min())}")
    big = torch.iinfo(torch.int64).max
    keyed = torch.where(x == PAD, big, x).sort(dim=1).values
    dup = torch.zeros_like(keyed, dtype=torch.bool)
    dup[:, 1:] = keyed[:, 1:] == keyed[:, :-1]
    keyed = torch.where(dup, big, keyed).sort(dim=1).values  # duplicates become padding, moved last
    out = torch.where(keyed == big, PAD, keyed)
    width = int((out != PAD).sum(1).max()) if out.numel() else 0
    return out[:, :width].contiguous()
