"""TreePack: a rollout trie laid out as one packed sequence in DFS preorder.

Walking the trie depth first and writing each node's tokens as they are visited stores every tree token
exactly once. Preorder has one property everything else relies on: the subtree of a node occupies one
contiguous range of the pack, starting at the node's first token. So with

    subtree_end[k] = exclusive end of the packed range of the subtree of k's node,

packed token q may attend packed token k (k is q itself or one of its ancestors on a rollout) exactly when

    k <= q < subtree_end[k].

Tokens inside one node see each other causally; tokens of a node see all of the node's ancestors; tokens
of sibling branches never see each other. That single int32 vector replaces a T x T mask.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from itertools import chain

import torch

from .patterns.tree import tree_visibility


def _int64_tensor(values: Iterable[int]) -> torch.Tensor:
    """An int64 CPU tensor of Python ints, converted in C (through an int64 array) rather than one object
    at a time as ``torch.tensor`` of a list converts them."""
    buffer = array("q", values)
    if not buffer:  # frombuffer refuses an empty buffer
        return torch.zeros(0, dtype=torch.int64, device="cpu")
    return torch.frombuffer(buffer, dtype=torch.int64)


@dataclass(frozen=True, eq=False)
class TreePack:
    """Packed DFS-preorder layout of a :class:`RolloutTrie` (build with ``trie.pack()``).

    Per packed token (length T): ``input_ids``, ``position_ids`` (index inside any rollout that contains
    the token), ``node_id`` and ``subtree_end`` (int32). Per node: ``node_start`` / ``node_end`` (packed
    range of the node's own tokens, empty for the root) and ``node_subtree_end``. Per sequence:
    ``seq_lengths`` and ``seq_end_node``; ``seq_index(i)`` gives the packed positions of sequence i.

    A pack is not changed once built: what is derived from it (sequence indices, block masks, backend
    plans, tile schedules) is computed once per pack and kept on it (:meth:`cached`). :meth:`to` makes a
    copy whose cache starts empty, since a cached result may live on the old device.
    """

    input_ids: torch.Tensor  # [T] int64
    position_ids: torch.Tensor  # [T] int64
    node_id: torch.Tensor  # [T] int64
    subtree_end: torch.Tensor  # [T] int32
    node_start: torch.Tensor  # [num_nodes + 1] int64, root included
    node_end: torch.Tensor  # [num_nodes + 1] int64
    node_subtree_end: torch.Tensor  # [num_nodes + 1] int64
    node_parent: torch.Tensor  # [num_nodes + 1] int64, -1 for the root
    seq_lengths: torch.Tensor  # [B] int64
    seq_end_node: torch.Tensor  # [B] int64
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_trie(cls, trie, order: str = "insertion") -> TreePack:
        """Pack ``trie`` (a :class:`~treeattn_lab.trie.RolloutTrie`) in DFS preorder.

        ``order`` is the sibling order of :meth:`RolloutTrie.preorder`. The pack reads the trie's nodes
        (tokens, parent, depth), its preorder and its sequences, and imports nothing of ``trie.py``: the
        data model's imports run one way, ``trie.py`` -> ``pack.py``.
        """
        order_ids = trie.preorder(order)
        nodes = trie.nodes
        # per node in preorder: its token count, and where its tokens start in the pack
        lengths = _int64_tensor([len(nodes[n].tokens) for n in order_ids])
        starts = torch.cumsum(lengths, 0) - lengths
        node_start = torch.zeros(len(nodes), dtype=torch.int64, device="cpu")  # whatever the default device
        order_t = _int64_tensor(order_ids)
        node_start[order_t] = starts
        node_end = node_start.clone()
        node_end[order_t] = starts + lengths
        # a token's position: its node's depth plus its index in the node
        offsets = starts - _int64_tensor([nodes[n].depth for n in order_ids])
        positions = torch.arange(int(lengths.sum()), device="cpu") - offsets.repeat_interleave(lengths)
        node_id = order_t.repeat_interleave(lengths)
        # subtree end: children come after their parent in preorder, so a reverse sweep suffices
        sub_end = node_end.tolist()
        for node in reversed(order_ids):
            p = nodes[node].parent
            if p >= 0:
                sub_end[p] = max(sub_end[p], sub_end[node])
        node_sub_end = _int64_tensor(sub_end)
        return cls(
            input_ids=_int64_tensor(chain.from_iterable(nodes[n].tokens for n in order_ids)),
            position_ids=positions,
            node_id=node_id,
            subtree_end=node_sub_end[node_id].to(torch.int32),
            node_start=node_start,
            node_end=node_end,
            node_subtree_end=node_sub_end,
            node_parent=_int64_tensor([n.parent for n in nodes]),
            seq_lengths=_int64_tensor(trie.seq_lengths),
            seq_end_node=_int64_tensor(trie.seq_end_node),
        )

    # ------------------------------------------------------------------ sizes
    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @property
    def num_sequences(self) -> int:
        return self.seq_lengths.numel()

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    def attended_pairs(self) -> int:
        """(query, key) pairs the tree attends: each token sees its position + 1 keys."""
        return int((self.position_ids + 1).sum())

    def flat_attended_pairs(self) -> int:
        """Pairs causal attention attends when each sequence is its own sequence."""
        lengths = self.seq_lengths
        return int((lengths * (lengths + 1) // 2).sum())

    # ------------------------------------------------------------------ sequences
    def node_path(self, node: int) -> list[int]:
        parent = self._cpu("node_parent")
        out = []
        while node > 0:
            out.append(node)
            node = int(parent[node])
        return out[::-1]

    def seq_index(self, i: int) -> torch.Tensor:
        """LongTensor of the packed positions of sequence ``i`` in order (``input_ids[seq_index(i)]``)."""
        n = self.num_sequences
        if not -n <= i < n:
            raise IndexError(f"sequence index {i} out of range for {n} sequences")
        i = i % n
        return self.cached(("seq_index", i), lambda: self._build_seq_index(i))

    def _build_seq_index(self, i: int) -> torch.Tensor:
        start, end = self._cpu("node_start"), self._cpu("node_end")
        path = self.node_path(int(self._cpu("seq_end_node")[i]))
        return torch.cat([torch.arange(int(start[p]), int(end[p])) for p in path]).to(self.device)

    def sequence_positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(positions, offsets)`` on the CPU: every sequence's packed positions, sequences concatenated;
        sequence i owns ``positions[offsets[i]:offsets[i + 1]]`` (its :meth:`seq_index`). Built at once
        from the packed range of each (sequence, node on its path) pair, and cached."""
        return self.cached("sequence_positions", self._build_sequence_positions)

    def _build_sequence_positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        ends = self._cpu("seq_end_node").tolist()
        path_nodes = [n for end in ends for n in self.node_path(end)]
        starts = self._cpu("node_start")[path_nodes]
        sizes = self._cpu("node_end")[path_nodes] - starts
        before = sizes.cumsum(0) - sizes  # concatenated positions before each range
        positions = torch.arange(int(sizes.sum())) + torch.repeat_interleave(starts - before, sizes)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), self._cpu("seq_lengths").cumsum(0)])
        return positions, offsets

    def padded_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(index [B, L], valid [B, L])``: packed position of each sequence's token, 0 where padded
        (cached)."""
        return self.cached("padded_index", self._build_padded_index)

    def _build_padded_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        B, L = self.num_sequences, int(self.seq_lengths.max())
        index = torch.zeros(B, L, dtype=torch.int64)
        valid = torch.zeros(B, L, dtype=torch.bool)
        for i in range(B):
            idx = self.seq_index(i).cpu()
            index[i, : idx.numel()] = idx
            valid[i, : idx.numel()] = True
        return index.to(self.device), valid.to(self.device)

    def padded_owner(self) -> torch.Tensor:
        """``[B, L]`` bool: True at exactly one copy of each packed token (its first sequence); cached."""
        return self.cached("padded_owner", self._build_padded_owner)

    def _build_padded_owner(self) -> torch.Tensor:
        index, valid = (x.cpu() for x in self.padded_index())
        owner = torch.zeros_like(valid)
        seen = torch.zeros(self.num_tokens, dtype=torch.bool)
        for i in range(self.num_sequences):
            idx = index[i][valid[i]]
            owner[i, : idx.numel()] = ~seen[idx]
            seen[idx] = True
        return owner.to(self.device)

    def to_padded(self, x: torch.Tensor, fill: float = 0) -> torch.Tensor:
        """Packed ``[T, ...]`` -> padded per-sequence ``[B, L, ...]`` (shared tokens copied per sequence)."""
        self._check_packed(x, "x")
        index, valid = self.padded_index()
        out = x[index]
        shape = valid.shape + (1,) * (x.dim() - 1)
        return out.masked_fill(~valid.view(shape), fill)

    def from_padded(self, y: torch.Tensor) -> torch.Tensor:
        """Padded ``[B, L, ...]`` -> packed ``[T, ...]``.

        A token shared by several sequences takes the value of the first sequence that contains it
        (:meth:`padded_owner`), so gradients flow back through exactly one copy; for per-token
        quantities that really are shared (ids, activations of a causal model) the copies agree.
        """
        index, valid = self.padded_index()
        if y.dim() < 2 or tuple(y.shape[:2]) != tuple(index.shape):
            raise ValueError(
                f"padded tensor must be [B={index.shape[0]}, L={index.shape[1]}, ...], got {tuple(y.shape)}"
            )
        owner = self.padded_owner().to(y.device)
        out = y.new_zeros((self.num_tokens,) + tuple(y.shape[2:]))
        out[index.to(y.device)[owner]] = y[owner]
        return out

    def padded_input_ids(self, pad_id: int = 0) -> torch.Tensor:
        return self.to_padded(self.input_ids, fill=pad_id)

    # ------------------------------------------------------------------ masks and devices
    def visibility_mask(self) -> torch.Tensor:
        """Dense ``[T, T]`` bool: ``mask[q, k]`` = q may attend k. For small packs and drawings only."""
        return tree_visibility(self.subtree_end)

    def to(self, device) -> TreePack:
        """A copy on ``device`` (the cache, which may hold device-specific masks, starts empty)."""
        moved = {
            name: getattr(self, name).to(device)
            for name in self.__dataclass_fields__
            if name != "_cache"
        }
        return replace(self, **moved, _cache={})

    def cached(self, key, build):
        """``build()``, computed on the first call for ``key`` and returned again by later ones (the class
        docstring): readers keep what they derive from the pack here, keyed by what it depends on (the
        device included where the result lives on one)."""
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    def _cpu(self, name: str) -> torch.Tensor:
        return self.cached(("cpu", name), lambda: getattr(self, name).cpu())

    def _check_packed(self, x: torch.Tensor, name: str) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() < 1 or x.shape[0] != self.num_tokens:
            raise ValueError(f"{name} must be packed [T={self.num_tokens}, ...], got {tuple(x.shape)}")
        if x.device != self.device:
            raise ValueError(f"{name} is on {x.device} but the pack is on {self.device}; use pack.to()")

    def __repr__(self) -> str:
        return (
            f"TreePack(T={self.num_tokens}, sequences={self.num_sequences}, "
            f"nodes={self.node_start.numel() - 1}, device={self.device})"
        )
