"""Dynamic sparse attention: estimate a vertical-slash pattern on every call, then attend sparsely.

This is the attention MInference runs at inference and MTraining trains with. On every call (every layer
of every step) and for every sequence of the batch:

1. **estimate** the pattern per head from the last ``last_q`` queries
   (:func:`~treeattn_lab.patterns.vertical_slash.estimate`): the ``n_vertical`` key columns and
   ``n_slash`` diagonals with the most attention from those queries, always with the first ``sinks``
   columns and the first ``local`` diagonals. The estimate runs without gradient and in float32: the
   pattern is a discrete choice, so the gradient of the whole call is exactly the gradient of sparse
   attention under the chosen pattern;
2. **attend** with :func:`~treeattn_lab.ops.sparse.sparse_attention` under that pattern, forward and
   backward (the block-sparse Triton kernel on CUDA, the reference elsewhere).

:class:`DynamicSparseAttention` is an ``attention(q, k, v)`` callable on ``[B, N, H, D]`` or ``[N, H, D]``
tensors, so it drops into :class:`~treeattn_lab.reference.TinyLM` (``model(ids, pos, attention)``). Its
:attr:`~DynamicSparseAttention.stats` count the (query, key) pairs it computed (block rounding included)
against dense causal attention: the share an equal-cost baseline must match.

A batch ``[B, N, H, D]`` runs as one call with its sequences' heads side by side (``[N, B * H, D]``):
attention and the estimate are per head, so one estimate, one pattern, one kernel index and one kernel
call serve every sequence. Nothing on that path reads the device back to the host: the pattern is built
from the estimator's own top-k indices without the checks that guard user input
(:meth:`~treeattn_lab.patterns.vertical_slash.VerticalSlashPattern._from_top_k`), the index has a fixed
capacity, and the pair count stays on the device until :attr:`PairStats.fraction` is read. One
exception: the Triton kernel's launch config for calls of more than ``kernels.tuning.SPARSE_SHORT_QUERIES``
queries leaves ``split`` open, and a call then sizes it from the index's tile and bar counts, read back
(``kernels.block_sparse_call.bar_split``): three host reads per such call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from einops import rearrange

from ..checks import check_int
from ..patterns.vertical_slash import VerticalSlashPattern, estimate
from .sparse import sparse_attention


@dataclass(frozen=True)
class SparseBudget:
    """Lines kept per head: ``n_vertical`` columns (the first ``sinks`` always among them) and ``n_slash``
    diagonals (the first ``local`` always among them), estimated from the last ``last_q`` queries, rounded
    to ``block_size`` tiles by the kernel (128 on a GPU)."""

    n_vertical: int
    n_slash: int
    sinks: int = 64
    local: int = 1024
    last_q: int = 64
    block_size: int = 128

    def __post_init__(self):
        for name in ("n_vertical", "n_slash", "sinks", "local"):
            check_int(name, getattr(self, name), minimum=0)
        check_int("last_q", self.last_q)
        check_int("block_size", self.block_size, minimum=16)
        if self.n_slash < 1:
            raise ValueError("n_slash must be at least 1: every query needs its own diagonal (offset 0)")
        if self.sinks > self.n_vertical:
            raise ValueError(f"sinks ({self.sinks}) exceed the column budget n_vertical ({self.n_vertical})")
        if self.local > self.n_slash:
            raise ValueError(f"local ({self.local}) exceeds the diagonal budget n_slash ({self.n_slash})")


@dataclass(eq=False)
class PairStats:
    """Pairs computed by the calls since the last :meth:`reset`, against dense causal attention's.

    A call adds its count on the device; the total is read back to the host only when asked for
    (:attr:`computed_pairs`, :attr:`fraction`), so recording never waits for the GPU.
    """

    calls: int = 0
    causal_pairs: int = 0
    _pending: torch.Tensor | None = field(default=None, init=False, repr=False)  # device total not yet read
    _counted: int = field(default=0, init=False, repr=False)  # total already read

    @property
    def computed_pairs(self) -> int:
        """Pairs the calls computed (block rounding included): one host read of the pending total."""
        if self._pending is not None:
            self._counted += int(self._pending)
            self._pending = None
        return self._counted

    @property
    def fraction(self) -> float:
        """Computed pairs over causal pairs (0.0 before the first call)."""
        return self.computed_pairs / self.causal_pairs if self.causal_pairs else 0.0

    def record(self, pattern: VerticalSlashPattern, num_tokens: int, sequences: int = 1) -> None:
        """Count one call of ``pattern`` over ``num_tokens`` (its heads may hold ``sequences``
        sequences' heads side by side)."""
        self.calls += sequences
        pairs = pattern.pair_total(num_tokens)
        self._pending = pairs if self._pending is None else self._pending + pairs
        self.causal_pairs += pattern.num_heads * num_tokens * (num_tokens + 1) // 2

    def reset(self) -> None:
        self.calls = self.causal_pairs = self._counted = 0
        self._pending = None

    def __eq__(self, other) -> bool:
        if not isinstance(other, PairStats):
            return NotImplemented
        return ((self.calls, self.computed_pairs, self.causal_pairs)
                == (other.calls, other.computed_pairs, other.causal_pairs))


def _check_batch(q, k, v) -> None:
    """``q, k, v`` are tensors, all ``[N, H, D]`` or all ``[B, N, H, D]`` with one batch size."""
    if not all(isinstance(x, torch.Tensor) for x in (q, k, v)):
        raise TypeError("q, k, v must be torch.Tensors")
    if q.dim() == 3 and k.dim() == 3 and v.dim() == 3:
        return
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be [B, N, H, D] or [N, H, D], got shapes {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if not q.shape[0] == k.shape[0] == v.shape[0]:
        raise ValueError(f"q, k, v batch sizes disagree: {q.shape[0]}, {k.shape[0]}, {v.shape[0]}")


def per_sequence(attention: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``attention`` (on one sequence ``[N, H, D]``) applied to ``[B, N, H, D]`` row by row, or to a
    single ``[N, H, D]`` sequence directly."""
    _check_batch(q, k, v)
    if q.dim() == 3:
        return attention(q, k, v)
    return torch.stack([attention(q[b], k[b], v[b]) for b in range(q.shape[0])])


class DynamicSparseAttention:
    """``attention(q, k, v)`` that estimates each sequence's vertical-slash pattern from its last queries
    (``budget``, a :class:`SparseBudget`) and runs :func:`sparse_attention` under it (``backend`` as there).

    ``q [B, N, Hq, D]`` or ``[N, Hq, D]``, ``k, v`` with ``Hkv`` heads (grouped-query attention). Budgets
    larger than ``N`` are clipped, so a budget covering every line is dense causal attention.
    """

    def __init__(self, budget: SparseBudget, *, backend: str = "auto"):
        if not isinstance(budget, SparseBudget):
            raise TypeError(f"budget must be a SparseBudget, got {type(budget).__name__}")
        self.budget = budget
        self.backend = backend
        self.stats = PairStats()

    def __repr__(self) -> str:
        return f"DynamicSparseAttention({self.budget}, backend={self.backend!r})"

    def pattern_for(self, q: torch.Tensor, k: torch.Tensor) -> VerticalSlashPattern:
        """The pattern of one sequence ``q [N, Hq, D]``, ``k [N, Hkv, D]``: no gradient, float32, and
        outside any autocast region (autocast would run the scores in bf16)."""
        b = self.budget
        with torch.no_grad(), torch.autocast(q.device.type, enabled=False):
            return estimate(q.detach().float(), k.detach().float(), last_q=b.last_q, n_vertical=b.n_vertical,
                            n_slash=b.n_slash, sinks=b.sinks, local=b.local, block_size=b.block_size)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        _check_batch(q, k, v)
        if q.dim() == 3:
            return self._attend(q, k, v, sequences=1)
        batch = q.shape[0]
        # the batch side by side as heads: one estimate, one pattern, one index and one kernel call
        out = self._attend(*(rearrange(x, "b n h d -> n (b h) d") for x in (q, k, v)), sequences=batch)
        return rearrange(out, "n (b h) d -> b n h d", b=batch)

    def _attend(self, q, k, v, *, sequences: int) -> torch.Tensor:
        """Attention of ``sequences`` sequences held side by side as heads of ``q [N, B * Hq, D]`` and
        ``k, v [N, B * Hkv, D]``: query head ``b * Hq + h`` reads kv head ``b * Hkv + h // (Hq // Hkv)``,
        its own sequence's, and every head's lines are estimated from its own scores alone."""
        pattern = self.pattern_for(q, k)
        self.stats.record(pattern, q.shape[0], sequences)
        return sparse_attention(q, k, v, pattern, backend=self.backend)


def fixed_pattern_attention(pattern: VerticalSlashPattern, *, backend: str = "auto") -> Callable:
    """``attention(q, k, v)`` on ``[B, N, H, D]`` or ``[N, H, D]`` under one fixed ``pattern`` for every
    sequence (its kernel index is built once per token count and cached on the pattern)."""
    if not isinstance(pattern, VerticalSlashPattern):
        raise TypeError(f"pattern must be a VerticalSlashPattern, got {type(pattern).__name__}")

    on_device = {pattern.device: pattern}  # one copy per device, so each keeps its cached index

    def one(q, k, v):
        if q.device not in on_device:
            on_device[q.device] = pattern.to(q.device)
        return sparse_attention(q, k, v, on_device[q.device], backend=backend)

    def attention(q, k, v):
        return per_sequence(one, q, k, v)

    return attention
