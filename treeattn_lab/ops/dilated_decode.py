"""Decoding under dilated attention with the compact KV cache: ``P + W + 1 + N // D`` entries, not ``N``.

A new token at position ``t`` attends (``treeattn_lab.patterns.dilated``):

- the strided keys ``p_j = j D + D - 1`` with ``P // D <= j < (t - W) // D``: only every D-th key is
  ever read again once it leaves the window, so the cache keeps just those (``compact``);
- the first ``P`` keys that are not in the window (``initial``);
- the last ``W + 1`` keys, itself included (``window``, a sliding buffer).

:func:`dilated_decode_step` attends the strided part and the initial + window part separately and merges
them by log-sum-exp (``treeattn_lab.reference.merge_attention_states``), exactly as the Triton kernel's
online softmax does, and gives the last row of the full computation.

```python
cache = DilatedKVCache(dilation=16, window=256, initial=4)
cache.extend(k_prompt, v_prompt)              # [L, Hkv, d]: keeps P + (W + 1) + L // D rows
for step in range(n_new):
    q, k, v = ...                             # the new token's projections, [H, d]
    cache.append(k, v)
    out = dilated_decode_step(q, cache)       # [Hq, d]
```
"""

from __future__ import annotations

import torch

from ..patterns.dilated import DilatedPattern
from ..reference import masked_attention, merge_attention_states
from .validation import check_scale


class DilatedKVCache:
    """Keys and values a decoder keeps for the pattern ``(dilation D, window W, initial P)``.

    ``initial_*``: the first ``min(P, N)`` keys; ``window_*``: the last ``min(W + 1, N)``; ``compact_*``:
    the ``N // D`` keys at positions ``D-1, 2D-1, ...``. All ``[rows, Hkv, d]``; ``N`` = :attr:`num_tokens`.
    """

    def __init__(self, *, dilation: int, window: int = 0, initial: int = 0):
        self.pattern = DilatedPattern(dilation, window, initial)
        self.num_tokens = 0
        self.initial_k = self.initial_v = None
        self.window_k = self.window_v = None
        self.compact_k = self.compact_v = None

    @property
    def entries(self) -> int:
        """Rows held per kv head (``<= P + W + 1 + N // D``)."""
        if self.num_tokens == 0:
            return 0
        return sum(x.shape[0] for x in (self.initial_k, self.window_k, self.compact_k))

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append keys and values ``[L, Hkv, d]`` of the next ``L`` positions (a prompt, or one token)."""
        if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor):
            raise TypeError("k and v must be torch.Tensors")
        if k.dim() != 3 or k.shape != v.shape:
            raise ValueError(f"k and v must both be [L, Hkv, d], got {tuple(k.shape)} and {tuple(v.shape)}")
        if not k.dtype.is_floating_point or k.dtype != v.dtype or k.device != v.device:
            raise TypeError(f"k and v must share one floating-point dtype and device, got {k.dtype} on "
                            f"{k.device} and {v.dtype} on {v.device}")
        if k.shape[1] == 0 or k.shape[2] == 0:
            raise ValueError(f"k and v need at least one head and one feature, got {tuple(k.shape)}")
        held = self.window_k
        if held is not None and (k.shape[1:], k.dtype, k.device) != (held.shape[1:], held.dtype, held.device):
            raise ValueError("k and v must match the cache's heads, head dim, dtype and device")
        D, W, P = self.pattern.dilation, self.pattern.window, self.pattern.initial
        n, L = self.num_tokens, k.shape[0]
        empty = k[:0]
        take_initial = max(0, min(P - n, L))
        first_strided = (D - 1 - n) % D  # index in this chunk of the first position p with (p + 1) % D == 0

        def cat(old, new):
            return new.clone() if old is None else torch.cat([old, new])

        self.initial_k = cat(self.initial_k, k[:take_initial] if take_initial else empty)
        self.initial_v = cat(self.initial_v, v[:take_initial] if take_initial else empty)
        self.compact_k = cat(self.compact_k, k[first_strided::D])
        self.compact_v = cat(self.compact_v, v[first_strided::D])
        self.window_k = cat(self.window_k, k)[-(W + 1) :]
        self.window_v = cat(self.window_v, v)[-(W + 1) :]
        self.num_tokens = n + L

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append one position's key and value ``[Hkv, d]``."""
        self.extend(k[None], v[None])


def dilated_decode_step(q: torch.Tensor, cache: DilatedKVCache, *, scale: float | None = None,
                        return_lse: bool = False):
    """Attention of the newest token's query ``q [Hq, d]`` (position ``N - 1``) over the compact cache.

    Equals row ``N - 1`` of ``dilated_attention`` over all ``N`` keys. With ``return_lse`` also returns
    the natural-log log-sum-exp ``[Hq]``.
    """
    if not isinstance(cache, DilatedKVCache):
        raise TypeError(f"cache must be a DilatedKVCache, got {type(cache).__name__}")
    if cache.num_tokens == 0:
        raise ValueError("the cache is empty: append the current token's key and value first")
    if not isinstance(q, torch.Tensor) or q.dim() != 2:
        raise ValueError(f"q must be [Hq, d] (one token), got {getattr(q, 'shape', type(q).__name__)}")
    hkv, d = cache.window_k.shape[1:]
    if q.shape[1] != d or q.shape[0] == 0 or q.shape[0] % hkv:
        raise ValueError(f"q [Hq, d] = {tuple(q.shape)} does not fit the cache's {hkv} kv heads of dim {d} "
                         f"(Hq must be a multiple of {hkv})")
    if q.dtype != cache.window_k.dtype or q.device != cache.window_k.device:
        raise TypeError(f"q is {q.dtype} on {q.device} but the cache holds {cache.window_k.dtype} on "
                        f"{cache.window_k.device}")
    check_scale(scale)
    D, W, P = cache.pattern.dilation, cache.pattern.window, cache.pattern.initial
    t = cache.num_tokens - 1
    behind = max(t - W, 0)
    strided = slice(P // D, max(behind // D, P // D))
    keys = {  # the two disjoint parts: strided, and initial + window
        "strided": (cache.compact_k[strided], cache.compact_v[strided]),
        "local": (torch.cat([cache.initial_k[: min(P, behind)], cache.window_k]),
                  torch.cat([cache.initial_v[: min(P, behind)], cache.window_v])),
    }
    results = []
    for k, v in keys.values():
        if k.shape[0] == 0:
            continue
        mask = torch.ones(1, k.shape[0], dtype=torch.bool, device=q.device)
        results.append(masked_attention(q[None], k, v, mask, scale=scale, return_lse=True))
    out, lse = results[0]
    for part_out, part_lse in results[1:]:
        out, lse = merge_attention_states(out, lse, part_out, part_lse)
    return (out[0], lse[0]) if return_lse else out[0]
