"""Reference sparse attention: masked attention with a vertical-slash pattern's dense per-head mask.

Query ``q`` sees key ``k <= q`` when ``k`` is one of its head's vertical columns or lies in a
``block_size`` tile that one of its head's slashes crosses (``VerticalSlashPattern.dense_mask``, block
rounding included). Builds an ``H x N x N`` mask: small inputs only.
"""

from __future__ import annotations

from einops import rearrange

from .attention import masked_attention


def sparse_attention(q, k, v, pattern, *, scale=None, return_lse: bool = False):
    """Attention of ``q [N, Hq, D]`` over ``k, v [N, Hkv, D]`` under ``pattern`` (a
    ``VerticalSlashPattern`` with Hq heads); with ``return_lse`` also the natural-log ``[N, Hq]`` lse."""
    mask = rearrange(pattern.dense_mask(q.shape[0]), "(hkv g) t s -> hkv g t s", hkv=k.shape[1])
    return masked_attention(q, k, v, mask, scale=scale, return_lse=return_lse)
