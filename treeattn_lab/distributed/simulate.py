"""Work per (rank, ring step) of sparse ring attention, counted from the pattern alone (no attention run).

Ring attention is as slow as its slowest rank, twice over:

- **worker-level imbalance**: one rank's total work against the mean (``max_r W_r / mean_r W_r``). With a
  contiguous layout under causal attention the last rank does the most.
- **step-level imbalance**: every step ends with a hand-over of keys, so each step lasts as long as its
  slowest rank: ``sum_t max_r w[r, t] / sum_t mean_r w[r, t]``. Ranks can have equal totals and still
  wait at every step (zigzag under a vertical-slash pattern).

:func:`simulate` counts, for a pattern, a token count, a layout and a ring, the work of every (rank,
step) as the kernel does it: every selected tile the rank's query blocks meet in the keys held at that
step, and the bar columns (gathered once, computed at step 0 next to the rank's own keys). Two measures:
``pairs`` (attended (query, key) pairs, exactly the pattern's :meth:`num_pairs` in total) and ``tiles``
(tile-equivalents: selected tiles plus gathered bar columns / block size, closer to kernel time).
Heads are counted one at a time, so worlds of 64 ranks at 512K tokens fit in a laptop's memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..patterns.vertical_slash import PAD, VerticalSlashPattern, pair_counts
from .layouts import RingSchedule, block_owner


@dataclass
class RingWork:
    """Work of each (rank, step): ``pairs`` and ``tiles`` are ``[world, world]`` float64 tensors."""

    layout: str
    world: int
    inner: int
    num_tokens: int
    pairs: torch.Tensor
    tiles: torch.Tensor

    def _metric(self, metric: str) -> torch.Tensor:
        if metric not in ("pairs", "tiles"):
            raise ValueError(f"metric must be 'pairs' or 'tiles', got {metric!r}")
        return getattr(self, metric)

    def per_rank(self, metric: str = "pairs") -> torch.Tensor:
        return self._metric(metric).sum(1)

    def worker_imbalance(self, metric: str = "pairs") -> float:
        """Slowest rank's total over the mean total (1.0 = perfectly balanced)."""
        w = self.per_rank(metric)
        return float(w.max() / w.mean()) if w.sum() > 0 else 1.0

    def step_imbalance(self, metric: str = "pairs") -> float:
        """Ring time with every step waiting for its slowest rank, over the ideal (1.0 = balanced)."""
        w = self._metric(metric)
        return float(w.max(0).values.sum() / w.mean(0).sum()) if w.sum() > 0 else 1.0

    def ring_time(self, handover: float = 0.0, metric: str = "pairs") -> float:
        """Ring time in work units when each step also needs ``handover`` units to pass the keys on
        (overlapped with compute): ``sum_t max(max_r w[r, t], handover)``, the last step excluded from
        the hand-over. A layout that leaves steps nearly empty exposes the transfers."""
        w = self._metric(metric).max(0).values
        floor = torch.full_like(w, float(handover))
        floor[-1] = 0.0
        return float(torch.maximum(w, floor).sum())

    @property
    def total_pairs(self) -> int:
        return int(self.pairs.sum())

    def summary(self) -> dict:
        return {"layout": self.layout, "world": self.world, "inner": self.inner, "tokens": self.num_tokens,
                "worker_imbalance": self.worker_imbalance(), "step_imbalance": self.step_imbalance(),
                "worker_imbalance_tiles": self.worker_imbalance("tiles"),
                "step_imbalance_tiles": self.step_imbalance("tiles")}


def simulate(pattern: VerticalSlashPattern, num_tokens: int, world: int, layout: str = "striped", *,
             inner: int | None = None) -> RingWork:
    """Work per (rank, step) of ring attention over ``world`` ranks (see the module docstring)."""
    if not isinstance(pattern, VerticalSlashPattern):
        raise TypeError(f"pattern must be a VerticalSlashPattern, got {type(pattern).__name__}")
    pattern.check_tokens(num_tokens)
    bs = pattern.block_size
    nb = pattern.num_blocks(num_tokens)
    owner = block_owner(layout, nb, world)  # checks the layout and divisibility
    sched = RingSchedule.make(world, inner)
    step_of = torch.empty(world, world, dtype=torch.int64)  # step at which rank r holds origin s
    table = sched.table()
    step_of.scatter_(1, table, torch.arange(world).expand(world, -1).contiguous())
    pairs = torch.zeros(world * world, dtype=torch.float64)
    tiles = torch.zeros(world * world, dtype=torch.float64)
    q_last = (torch.arange(nb) * bs + bs).clamp(max=num_tokens) - 1
    cpu = pattern.to("cpu")
    for h in range(pattern.num_heads):
        head = VerticalSlashPattern(cpu.vertical[h:h + 1], cpu.slash[h:h + 1], bs)
        tile_pairs, bar_pairs = pair_counts(head, num_tokens)
        m, n = tile_pairs[0].nonzero(as_tuple=True)
        rank = owner[m]
        cell = rank * world + step_of[rank, owner[n]]
        pairs.index_add_(0, cell, tile_pairs[0, m, n].double())
        tiles.index_add_(0, cell, torch.ones_like(cell, dtype=torch.float64))
        # bars: computed by the query block's rank at step 0 (next to its own keys)
        cols = head.vertical[0]
        cols = cols[cols != PAD]
        gathered = torch.searchsorted(cols, q_last, right=True).double()  # bar columns per query block
        cell0 = owner * world + step_of[owner, owner]
        pairs.index_add_(0, cell0, bar_pairs[0].double())
        tiles.index_add_(0, cell0, gathered / bs)
    return RingWork(layout, world, sched.inner, num_tokens, pairs.view(world, world),
                    tiles.view(world, world))


__all__ = ["RingWork", "simulate"]
