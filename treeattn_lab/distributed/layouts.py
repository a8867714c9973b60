"""Which rank holds which tokens, and which keys a rank holds at each ring step.

Layouts
-------
Ring (context-parallel) attention splits one long sequence over ``W`` ranks. The sequence is cut into
blocks of ``block_size`` tokens (the kernel's tiles) and each rank holds whole blocks, in ascending order:

- ``contiguous``: rank ``r`` holds the ``r``-th ``1/W`` of the sequence. Under causal attention the last
  rank has the most work (its queries see every earlier key); the first one has almost none.
- ``zigzag``: the sequence is cut into ``2W`` chunks and rank ``r`` holds chunks ``r`` and ``2W - 1 - r``
  (an early and a late one): balances the dense causal triangle (ring-flash-attn, Megatron).
- ``striped``: blocks are dealt round robin, rank ``r`` holds blocks ``r, r + W, r + 2W, ...``
  (Striped Attention, MTraining at 128-token granularity). Every rank gets a share of every region, so
  near-diagonal work, sink columns and far slashes all spread evenly over ranks *and* ring steps.

Ring schedule
-------------
At step ``t`` rank ``r`` computes its queries against the keys and values of one *origin* rank. A flat ring
visits origins ``r, r - 1, r - 2, ...``. A hierarchical ring groups ranks into nodes of ``inner`` ranks:
the inner loop visits the node's own ranks (fast links), and each outer step moves to the previous node
(``origin = (node - o, local - i)`` at step ``t = o * inner + i``); the transfer to the next node is posted
before the inner loop so it hides behind compute. Both are :class:`RingSchedule`\\ s.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LAYOUTS = ("contiguous", "zigzag", "striped")


def _check_layout(layout: str, num_blocks: int, world: int) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose one of {LAYOUTS}")
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be a positive int, got {world!r}")
    unit = 2 * world if layout == "zigzag" else world
    if num_blocks % unit:
        raise ValueError(
            f"the {layout} layout over {world} ranks needs a multiple of {unit} blocks, got {num_blocks}"
        )


def block_owner(layout: str, num_blocks: int, world: int) -> torch.Tensor:
    """``[num_blocks]`` int64: the rank holding each block."""
    _check_layout(layout, num_blocks, world)
    b = torch.arange(num_blocks)
    if layout == "contiguous":
        return b // (num_blocks // world)
    if layout == "striped":
        return b % world
    chunk = b // (num_blocks // (2 * world))  # zigzag: chunks r and 2W - 1 - r go to rank r
    return torch.where(chunk < world, chunk, 2 * world - 1 - chunk)


def rank_blocks(layout: str, num_blocks: int, world: int, rank: int) -> torch.Tensor:
    """The global block ids rank ``rank`` holds, ascending (its local tokens in order)."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in [0, {world})")
    return (block_owner(layout, num_blocks, world) == rank).nonzero().flatten()


def shard(x: torch.Tensor, layout: str, world: int, rank: int, block_size: int) -> torch.Tensor:
    """Rank ``rank``'s local tokens of a full sequence ``x [N, ...]`` (a copy, blocks in ascending order)."""
    n = x.shape[0]
    if n % block_size:
        raise ValueError(f"ring layouts need whole blocks: {n} tokens is not a multiple of {block_size}")
    blocks = rank_blocks(layout, n // block_size, world, rank).to(x.device)
    return x.unflatten(0, (n // block_size, block_size))[blocks].flatten(0, 1)


def unshard(shards, layout: str, block_size: int) -> torch.Tensor:
    """The full sequence from every rank's local tokens (the inverse of :func:`shard`)."""
    world = len(shards)
    n = sum(s.shape[0] for s in shards)
    owner = block_owner(layout, n // block_size, world)
    out = shards[0].new_empty((n, *shards[0].shape[1:]))
    view = out.unflatten(0, (n // block_size, block_size))
    for r, s in enumerate(shards):
        view[(owner == r).nonzero().flatten().to(s.device)] = s.unflatten(0, (-1, block_size))
    return out


@dataclass(frozen=True)
class RingSchedule:
    """Which origin's keys each rank holds at each step, and who passes them on.

    ``inner`` ranks per node (``inner == world``: a flat ring). Rank ``r = node * inner + local``.
    """

    world: int
    inner: int

    def __post_init__(self):
        if self.world < 1 or self.inner < 1 or self.world % self.inner:
            raise ValueError(f"inner ring size {self.inner} must divide the world size {self.world}")

    @classmethod
    def make(cls, world: int, inner: int | None = None) -> RingSchedule:
        return cls(world, world if inner is None else inner)

    @property
    def outer(self) -> int:
        return self.world // self.inner

    def _split(self, rank: int) -> tuple[int, int]:
        return divmod(rank, self.inner)

    def _join(self, node: int, local: int) -> int:
        return (node % self.outer) * self.inner + local % self.inner

    def origin(self, rank: int, step: int) -> int:
        """The rank whose keys ``rank`` holds at ``step``."""
        node, local = self._split(rank)
        o, i = divmod(step, self.inner)
        return self._join(node - o, local - i)

    def holder(self, origin: int, step: int) -> int:
        """The rank holding ``origin``'s keys at ``step``."""
        node, local = self._split(origin)
        o, i = divmod(step, self.inner)
        return self._join(node + o, local + i)

    def inner_next(self, rank: int) -> int:
        node, local = self._split(rank)
        return self._join(node, local + 1)

    def inner_prev(self, rank: int) -> int:
        node, local = self._split(rank)
        return self._join(node, local - 1)

    def outer_next(self, rank: int) -> int:
        node, local = self._split(rank)
        return self._join(node + 1, local)

    def outer_prev(self, rank: int) -> int:
        node, local = self._split(rank)
        return self._join(node - 1, local)

    def table(self) -> torch.Tensor:
        """``[world, world]``: ``table[rank, step]`` is the origin of the keys held."""
        return torch.tensor([[self.origin(r, t) for t in range(self.world)] for r in range(self.world)])


__all__ = ["LAYOUTS", "RingSchedule", "block_owner", "rank_blocks", "shard", "unshard"]
