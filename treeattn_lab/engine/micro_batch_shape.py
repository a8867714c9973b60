"""What the cost model reads of a micro-batch: its sizes in each mode's plan (padded batches, the packed
trie, the DFS walk's calls), computed once from its trie by :meth:`MicroBatchShape.of`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..trie import RolloutTrie
from .dfs import PUSH_BLOCKS, merge_pushes, walk, walk_kernel
from .modes import MODES, flat_chunks
from .time_fit import FORWARD_PAIR_SHARE, FORWARD_TOKEN_SHARE

__all__ = ["MicroBatchShape"]


@dataclass(frozen=True)
class MicroBatchShape:
    """What the cost model reads of a micro-batch (computed once from its trie)."""

    flat_tokens: int
    padded_tokens: int  # flat mode: rows x longest, summed over its padded batches
    padded_pairs: int
    flat_batches: int
    tree_tokens: int
    tree_pairs: int
    recomputed_tokens: int  # DFS: tokens of blocks with children, run once more without grad
    recomputed_pairs: int
    dfs_calls: int  # DFS: model calls (pushes, pops, packed spans of sibling leaves and subtrees)
    max_block: int  # DFS: tokens of its largest call with autograd
    max_length: int
    # DFS: per model call, (share, tokens, attended pairs): share 1 for a call with autograd, the forward
    # share of a trained token's FLOPs for a push (a forward alone), its tokens and pairs counted at it
    dfs_call_work: tuple[tuple[float, float, float], ...]
    # DFS: the mean queries x keys of the walk's blocks, from which its attention kernel is chosen
    # (:class:`~treeattn_lab.engine.block_attention.WalkKernel`)
    dfs_walk_rectangle: int = 0

    @classmethod
    def of(cls, trie: RolloutTrie, block_tokens: int, token_budget: int | None = None) -> MicroBatchShape:
        """Read the shape off the same plans the modes execute (padded batches, DFS blocks and events)."""
        lengths = trie.seq_lengths
        padded = [(len(c), lengths[c[0]]) for c in flat_chunks(lengths, token_budget)]  # (rows, longest)
        pack = trie.pack_on("cpu")
        _, events = walk(pack, block_tokens, packed_subtrees=True)
        rectangle = walk_kernel(events).mean_rectangle  # read before pushes merge, as the engine does
        events = merge_pushes(events, PUSH_BLOCKS * block_tokens)
        pushed = [b for e, b in events if e == "push"]
        # keys_before[q]: the pairs of the packed tokens before q (each sees its position + 1 keys), read
        # at the blocks' bounds only
        keys = torch.cumsum(pack._cpu("position_ids").long() + 1, 0)
        bounds = sorted({q for _, b in events for q in (b.start, b.end)})
        keys_before = dict(zip(bounds, (torch.cat([keys.new_zeros(1), keys])[bounds]).tolist(), strict=True))

        def pairs(b) -> int:
            return keys_before[b.end] - keys_before[b.start]

        call_work = []
        for event, b in events:
            token_share, pair_share = (FORWARD_TOKEN_SHARE, FORWARD_PAIR_SHARE) if event == "push" else (1, 1)
            call_work.append((token_share, token_share * (b.end - b.start), pair_share * pairs(b)))
        return cls(
            flat_tokens=sum(lengths),
            padded_tokens=sum(rows * n for rows, n in padded),
            padded_pairs=sum(rows * n * (n + 1) // 2 for rows, n in padded),
            flat_batches=len(padded),
            tree_tokens=pack.num_tokens,
            tree_pairs=pack.attended_pairs(),
            recomputed_tokens=sum(b.end - b.start for b in pushed),
            recomputed_pairs=sum(pairs(b) for b in pushed),
            dfs_calls=len(events),
            max_block=max(b.end - b.start for e, b in events if e != "push"),
            max_length=max(lengths),
            dfs_call_work=tuple(call_work),
            dfs_walk_rectangle=rectangle,
        )

    def time_features(self, mode: str) -> list[float]:
        if mode == "flat":
            return [1.0, self.padded_tokens, self.padded_pairs, self.flat_batches]
        if mode == "packed":
            return [1.0, self.tree_tokens, self.tree_pairs, 0.0]  # its one model call is the constant
        if mode == "dfs":
            return [
                1.0,
                self.tree_tokens + FORWARD_TOKEN_SHARE * self.recomputed_tokens,
                self.tree_pairs + FORWARD_PAIR_SHARE * self.recomputed_pairs,
                self.dfs_calls,
            ]
        raise ValueError(f"unknown mode {mode!r}; choose one of {MODES}")

    def memory_features(self, mode: str) -> list[float]:
        if mode == "flat":
            return [1.0, self.padded_tokens / self.flat_batches, 0.0]
        if mode == "packed":
            return [1.0, self.tree_tokens, 0.0]
        return [1.0, self.max_block, self.max_length]
