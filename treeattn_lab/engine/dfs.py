"""DFS materialization: train on a rollout trie one root-to-leaf path at a time.

A decoder layer's output for a token depends on earlier tokens only through that layer's keys and values.
So a trie can be trained holding just the *active path*: per layer, the K/V of the tokens from the root
to the current node (a stack), and beside them fp32 (fp64 for fp64 models) buffers for the gradients that
later tokens send back into those K/V.

The trie is cut into *blocks* of at most ``block_tokens`` tokens (:func:`split_blocks`): a node becomes a
chain of blocks, except that (``packed_subtrees``, what the engine's modes run) a node whose whole subtree
fits is one block, a *packed subtree*, run like a leaf. The blocks are walked depth first:

- **push** a block that has children: run it without autograd against the stored prefix, append its K/V
  to the stack (and zero its gradient buffers);
- visit its children;
- **pop** it (or handle a leaf block directly): run the block again *with* autograd against the prefix
  K/V; the loss of every entry whose logits lie in the block (targets include the children's first
  tokens); backpropagate that loss together with the gradients the descendants accumulated for this
  block's own K/V. On the way back each layer's attention adds its gradient for the prefix K/V into the
  ancestors' buffers (:class:`_OnPath`). Parameter gradients accumulate in ``.grad`` as usual.

Every event writes its block's K/V into the stack right after the prefix, so its attention reads
``[prefix; block]`` as one slice of the stack: the prefix is never copied.

Neighbouring leaf blocks below the same parent (sibling leaves and packed subtrees) run together as one
packed *span* of at most ``block_tokens`` tokens (:func:`group_sibling_leaves`): one model call on one
row, whose attention sees the whole stored prefix and, inside the span, the tree rule
``k <= q < subtree_end[k]`` of the pack. So only the spine above the spans is pushed and popped, and
each span is one call, without padding.

In the engine's training walk, consecutive pushes down one chain also run as one call
(:func:`merge_pushes`): a push keeps no activations for backward.

Every event's queries attend over ``[stored prefix; block]`` through one
:class:`~.block_attention.BlockAttention` (the rule, its mask built once for all layers), with one kernel
for the whole walk (:class:`~.block_attention.WalkKernel`: FlashAttention-4 where it runs and the walk's
blocks are large, SDPA otherwise).

Each tree token is computed with gradients exactly once; blocks with children are also run once without
(the ``recomputed`` tokens). Peak activation memory is that of one block, plus the path's K/V and
gradient buffers. Children's K/V gradients are summed into the shared prefix child by child, so the result
equals flat training on every rollout, up to floating-point rounding. The walk reads nothing back from the
model's device: every size and offset is known on the host from the pack before the first call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .adapters import features_and_head
from .block_attention import BlockAttention, WalkKernel


@dataclass(frozen=True)
class Block:
    start: int  # packed range [start, end) of the block's tokens
    end: int
    position: int  # position of the first token in its rollouts (= prefix length)
    parent: int  # index of the parent block, -1 at the root
    has_children: bool
    tree: bool = False  # the range holds more than one chain (a packed subtree, or a span of siblings)


def split_blocks(pack, block_tokens: int, *, packed_subtrees: bool = False) -> list[Block]:
    """Blocks of at most ``block_tokens`` tokens in DFS preorder, each node a chain of blocks; with
    ``packed_subtrees``, a node with children whose whole subtree fits is one block instead (a leaf of
    the walk: its subtree is inside it)."""
    start, end = pack._cpu("node_start").tolist(), pack._cpu("node_end").tolist()
    sub_end, parent = pack._cpu("node_subtree_end").tolist(), pack._cpu("node_parent").tolist()
    positions = pack._cpu("position_ids")
    # a node's depth is its first token's position (the root, with none, is never a block)
    depth = positions[pack._cpu("node_start").clamp(max=positions.numel() - 1)].tolist()
    has_kids = [False] * len(start)
    for p in parent[1:]:
        has_kids[p] = True
    order = sorted(range(1, len(start)), key=lambda n: start[n])  # preorder = packed order
    last_block = {0: -1}  # node -> index of its last block
    blocks: list[Block] = []
    covered = 0  # packed tokens before this are inside a packed subtree already emitted
    for node in order:
        if start[node] < covered:
            continue
        above = last_block[parent[node]]
        if packed_subtrees and has_kids[node] and sub_end[node] - start[node] <= block_tokens:
            blocks.append(Block(start[node], sub_end[node], depth[node], above, False, tree=True))
            covered = sub_end[node]
            continue
        for a in range(start[node], end[node], block_tokens):
            b = min(a + block_tokens, end[node])
            chained = b < end[node]
            blocks.append(Block(a, b, depth[node] + a - start[node], above, chained or has_kids[node]))
            above = len(blocks) - 1
        last_block[node] = above
    return blocks


def visit_order(blocks: list[Block]) -> list[tuple[str, int]]:
    """Events ``("push" | "pop" | "leaf", block)``: children are finished before their parent pops."""
    children: list[list[int]] = [[] for _ in blocks]
    roots = []
    for i, b in enumerate(blocks):
        (children[b.parent] if b.parent >= 0 else roots).append(i)
    events, stack = [], [(i, False) for i in reversed(roots)]
    while stack:
        i, done = stack.pop()
        if not blocks[i].has_children:
            events.append(("leaf", i))
        elif done:
            events.append(("pop", i))
        else:
            events.append(("push", i))
            stack.append((i, True))
            stack.extend((c, False) for c in reversed(children[i]))
    return events


def group_sibling_leaves(events, blocks: list[Block], block_tokens: int):
    """Merge runs of leaf blocks with the same parent into ``("leaves", [i, j, ...])`` events.

    Sibling leaves see the same prefix and sit next to each other in the pack, so they run as one packed
    span of at most ``block_tokens`` tokens: one model call instead of one per leaf.
    """
    out: list[tuple[str, list[int]]] = []
    for event, i in events:
        if event == "leaf" and out and out[-1][0] == "leaves":
            group = out[-1][1]
            tokens = blocks[i].end - blocks[group[0]].start
            if blocks[group[0]].parent == blocks[i].parent and tokens <= block_tokens:
                group.append(i)
                continue
        out.append(("leaves" if event == "leaf" else event, [i]))
    return out


def event_block(blocks: list[Block], group: list[int]) -> Block:
    """The block an event runs: one block, or the span of a group of sibling leaves."""
    first, last = blocks[group[0]], blocks[group[-1]]
    if len(group) == 1:
        return first
    return Block(first.start, last.end, first.position, first.parent, has_children=False, tree=True)


class PathState:
    """Per-layer K/V stacks of the active path and fp32 gradient buffers beside them, indexed by position
    (``with_grads=False``: no gradient buffers, for a pass without autograd). A stack holds
    ``stack_len`` positions: the path's, then room for the block that runs below it (its K/V are written
    right after the prefix, so its attention reads ``[prefix; block]`` as one slice of the stack); the
    buffers hold ``max_len``, the longest path. ``subtree_end``: the pack's visibility vector on the
    model's device (what a packed span's attention mask is cut from). ``kernel``: the attention kernel of
    the walk (:class:`~.block_attention.WalkKernel`; None: one for no blocks, which runs SDPA)."""

    def __init__(self, num_layers: int, max_len: int, with_grads: bool = True, subtree_end=None,
                 kernel: WalkKernel | None = None, stack_len: int | None = None):
        self.num_layers, self.max_len, self.with_grads = num_layers, max_len, with_grads
        self.stack_len = max_len if stack_len is None else max(stack_len, max_len)
        self.subtree_end = subtree_end
        self.kernel = WalkKernel([]) if kernel is None else kernel
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers
        self.grad_k: list[torch.Tensor | None] = [None] * num_layers
        self.grad_v: list[torch.Tensor | None] = [None] * num_layers

    def ensure(self, layer: int, like: torch.Tensor) -> None:
        if self.k[layer] is None:
            heads = like.shape[2:]  # [Hkv, D]
            self.k[layer] = like.new_empty((self.stack_len, *heads))
            self.v[layer] = like.new_empty((self.stack_len, *heads))
            if not self.with_grads:
                return
            accumulate = torch.promote_types(like.dtype, torch.float32)  # fp32, or fp64 for fp64 models
            self.grad_k[layer] = like.new_zeros((self.max_len, *heads), dtype=accumulate)
            self.grad_v[layer] = like.new_zeros((self.max_len, *heads), dtype=accumulate)

    def placed(self, layer: int, position: int, x, values: bool = False) -> torch.Tensor:
        """``[prefix; block]`` keys (``values``: values) ``[1, position + n, Hkv, D]`` for a block's own
        ``x [1, n, Hkv, D]`` at ``position``: ``x`` written into the stack after the prefix, and the
        stack's slice returned (no copy of the prefix). Writing there is safe in a depth-first walk: the
        stack below ``position`` holds the running block's ancestors, and the rows above are dead (a later
        block writes its own rows before it reads them)."""
        self.ensure(layer, x)
        stack = (self.v if values else self.k)[layer]
        end = position + x.shape[1]
        stack[position:end] = x[0]
        return stack[None, :end]

    def keys_and_values(self, layer: int, position: int, k, v) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`placed` keys and values of a block run without autograd."""
        return self.placed(layer, position, k), self.placed(layer, position, v, values=True)

    def buffers(self, lo: int, hi: int) -> list[torch.Tensor]:
        """The gradient buffers' rows ``[lo, hi)`` of every layer (K and V), as views."""
        return [buf[lo:hi] for group in (self.grad_k, self.grad_v) for buf in group if buf is not None]

    def nbytes(self) -> int:
        bufs = [t for group in (self.k, self.v, self.grad_k, self.grad_v) for t in group if t is not None]
        return sum(t.numel() * t.element_size() for t in bufs)


def attention_of(state: PathState, block: Block) -> BlockAttention:
    """The attention a block's queries run over the stored prefix and the block in every layer."""
    return BlockAttention(state.subtree_end, block.start, block.end, block.position, block.tree, state.kernel)


class _OnPath(torch.autograd.Function):
    """``x [1, n, Hkv, D]``, a block's own keys (or values), placed on the path after the prefix:
    returns the stack's slice ``[1, p + n, Hkv, D]`` (:meth:`PathState.placed`). Backward splits
    the slice's gradient: the prefix rows are added into the path's gradient buffer (the ancestors'
    share, which their own pops send back), the block's rows go to ``x``."""

    @staticmethod
    def forward(ctx, x, state: PathState, layer: int, position: int, values: bool):
        placed = state.placed(layer, position, x, values)
        ctx.buffer = (state.grad_v if values else state.grad_k)[layer][:position]
        ctx.position = position
        return placed

    @staticmethod
    def backward(ctx, grad):
        ctx.buffer.add_(grad[0, : ctx.position])
        return grad[:, ctx.position :], None, None, None, None


class PrefixRead:
    """Attention of a span of leaves run without autograd: read the stored prefix, store nothing that a
    later block reads."""

    def __init__(self, state: PathState, block: Block):
        self.state, self.block = state, block
        self.attend = attention_of(state, block)

    def __call__(self, layer: int, q, k, v, scale=None):
        keys, values = self.state.keys_and_values(layer, self.block.position, k, v)
        return self.attend(q, keys, values, scale)


class BlockRun:
    """The attention a model sees while one block runs: against the stored prefix, with or without grad."""

    def __init__(self, state: PathState, block: Block, with_grad: bool):
        self.state, self.block, self.with_grad = state, block, with_grad
        n = state.num_layers
        self.attend = attention_of(state, block)
        self.new_k: list[torch.Tensor | None] = [None] * n  # this block's own K/V, kept for injection
        self.new_v: list[torch.Tensor | None] = [None] * n

    def __call__(self, layer: int, q, k, v, scale=None):
        st, p = self.state, self.block.position
        if not self.with_grad:
            return self.attend(q, *st.keys_and_values(layer, p, k, v), scale)
        if not torch.is_grad_enabled():  # what a reentrant checkpoint does to the layers it wraps
            raise RuntimeError(
                "the DFS engine needs autograd inside the model's layers: with activation checkpointing use "
                "the non-reentrant kind (use_reentrant=False)"
            )
        if self.new_k[layer] is None:  # the first call's K/V: backward runs its graph (a checkpoint's
            # recomputation only refills the tensors that graph saved)
            self.new_k[layer], self.new_v[layer] = k, v
        keys = _OnPath.apply(k, st, layer, p, False)
        values = _OnPath.apply(v, st, layer, p, True)
        return self.attend(q, keys, values, scale)

    def backward(self, loss) -> None:
        """Backpropagate ``loss`` plus the gradients descendants sent to this block's K/V; the prefix's
        gradients land in the ancestors' buffers on the way (:class:`_OnPath`)."""
        st, b = self.state, self.block
        roots, grads = [], []
        if loss is not None and loss.requires_grad:  # no trainable parameter: nothing to send back
            roots.append(loss)
            grads.append(torch.ones_like(loss))
        if b.has_children:
            p, n = b.position, b.end - b.start
            for layer in range(st.num_layers):
                pairs = ((self.new_k[layer], st.grad_k[layer]), (self.new_v[layer], st.grad_v[layer]))
                for own, buf in pairs:
                    if own is None or not own.requires_grad:  # frozen layers below: no parameter to reach
                        continue
                    roots.append(own)
                    grads.append(buf[None, p : p + n].to(own.dtype))
        if roots:
            torch.autograd.backward(roots, grads)


def _zero_buffers(state: PathState, b: Block) -> None:
    bufs = state.buffers(b.position, b.position + b.end - b.start)
    if bufs:
        torch._foreach_zero_(bufs)


def _entry_logps(plan, adapter, pack) -> torch.Tensor:
    """Zeroed per-entry log-probs: float32, or float64 for a float64 model (or an adapter without dtype)."""
    dtype = torch.promote_types(getattr(adapter, "dtype", torch.float64), torch.float32)
    return torch.zeros(plan.num_entries, dtype=dtype, device=pack.input_ids.device)


class LinearScores:
    """What :func:`run_dfs` scores by default: the linear loss of a :class:`LossPlan`'s weights.

    A scorer has two methods: ``pushed(features, head, block)``, told of a block run without autograd
    (here: nothing to do, so the push costs no head), and ``loss(features, head, block)``, which returns
    ``(loss or None, detached entry log-probs)`` for a block run with autograd (a popped block, or a span
    of sibling leaves with ``has_children=False``), and ``after_backward()``, told once that loss and the
    gradients for the block's K/V have been backpropagated.
    """

    def __init__(self, plan):
        self.plan = plan

    def pushed(self, features, head, block: Block) -> None:
        pass

    def loss(self, features, head, block: Block):
        return self.plan.loss(features, block.start, head)

    def after_backward(self) -> None:
        pass


PUSH_BLOCKS = 4  # a chain of pushes runs as one call of at most this many blocks' tokens


def merge_pushes(events: list[tuple[str, Block]], max_tokens: int) -> list[tuple[str, Block]]:
    """Run consecutive pushes down one chain (each block the next one's parent, so their tokens and
    positions follow each other) as one push of at most ``max_tokens`` tokens.

    A push runs without autograd: it holds one layer's activations at a time, not every layer's, so a few
    blocks at once stay far inside the memory of one block run with autograd. Its blocks still pop one by
    one (each pop runs with autograd).
    """
    out: list[tuple[str, Block]] = []
    for event, b in events:
        if event == "push" and out and out[-1][0] == "push":
            top = out[-1][1]
            if top.end == b.start and b.end - top.start <= max_tokens:
                out[-1] = ("push", Block(top.start, b.end, top.position, top.parent, has_children=True))
                continue
        out.append((event, b))
    return out


def walk(pack, block_tokens: int, *, packed_subtrees: bool = True, push_blocks: int = 1):
    """``(blocks, [(event, block it runs)])``: the events of the walk over ``pack``, chains of pushes
    run as one of at most ``push_blocks`` blocks' tokens (:func:`merge_pushes`)."""
    blocks = split_blocks(pack, block_tokens, packed_subtrees=packed_subtrees)
    events = group_sibling_leaves(visit_order(blocks), blocks, block_tokens)
    events = [(event, event_block(blocks, group)) for event, group in events]
    return blocks, (merge_pushes(events, push_blocks * block_tokens) if push_blocks > 1 else events)


def walk_kernel(events) -> WalkKernel:
    """The attention kernel of a walk, chosen from its ``events`` before pushes merge (:func:`walk` with
    ``push_blocks=1``): the training walk and the log-prob walk over one pack then run the same kernel, so
    their log-probs agree as closely as two walks can."""
    return WalkKernel([(b.end - b.start) * (b.end - b.start + b.position) for _, b in events])


def _path_state(adapter, pack, events, kernel: WalkKernel, with_grads: bool) -> PathState:
    """The path of a walk over ``pack``: buffers for its longest rollout, stacks for its events' keys."""
    longest = int(pack._cpu("seq_lengths").max())
    keys = max((b.position + b.end - b.start for _, b in events), default=0)
    return PathState(adapter.num_layers, longest, with_grads, subtree_end=pack.subtree_end, kernel=kernel,
                     stack_len=keys)


def _features(adapter, pack, b: Block, attention):
    rows = slice(b.start, b.end)
    features, head = features_and_head(adapter, pack.input_ids[None, rows], pack.position_ids[None, rows],
                                       attention)
    return features[0], head


def run_dfs(adapter, pack, plan, block_tokens: int, scores=None, *, packed_subtrees: bool = False) -> dict:
    """Run one micro-batch's trie depth first; parameter gradients accumulate in ``.grad``.

    ``scores``: what each block's logits are scored with (default :class:`LinearScores` of ``plan``).
    ``packed_subtrees``: run every subtree that fits a block as one packed span and chains of pushes as
    one call of up to :data:`PUSH_BLOCKS` blocks (what the engine's modes do); without it every node is a
    chain of blocks, each pushed alone: the walk :func:`split_blocks` and :func:`visit_order` describe.
    Returns the entries' log-probs and token counts:
    ``{"entry_logp", "grad_tokens", "no_grad_tokens", "blocks", "path_bytes"}``.
    """
    scores = LinearScores(plan) if scores is None else scores
    blocks, events = walk(pack, block_tokens, packed_subtrees=packed_subtrees)
    state = _path_state(adapter, pack, events, walk_kernel(events), with_grads=True)
    if packed_subtrees:
        events = merge_pushes(events, PUSH_BLOCKS * block_tokens)
    entry_logp = _entry_logps(plan, adapter, pack)
    grad_tokens = no_grad_tokens = 0
    for event, b in events:
        if event == "push":
            _zero_buffers(state, b)
            with torch.no_grad():
                features, head = _features(adapter, pack, b, BlockRun(state, b, with_grad=False))
            scores.pushed(features, head, b)
            del features
            no_grad_tokens += b.end - b.start
            continue
        run = BlockRun(state, b, with_grad=True)
        features, head = _features(adapter, pack, b, run)
        loss, logp = scores.loss(features, head, b)
        entry_logp[plan.entries_in(b.start, b.end)] = logp
        del features
        run.backward(loss)
        scores.after_backward()
        grad_tokens += b.end - b.start
    return {
        "entry_logp": entry_logp,
        "grad_tokens": grad_tokens,
        "no_grad_tokens": no_grad_tokens,
        "blocks": len(blocks),
        "path_bytes": state.nbytes(),
    }


@torch.no_grad()
def dfs_logprobs(
    adapter, pack, plan, block_tokens: int, *, entropy: bool = False, packed_subtrees: bool = True
) -> dict:
    """The entries' log-probs (and entropies) of one micro-batch, depth first and without autograd.

    Every block runs once: a block with children is pushed (its K/V stored on the path), a span of
    sibling leaves runs as one packed call that reads the path. Memory: one block (pushes too are scored
    here, so they run block by block) plus the path's K/V.
    ``{"entry_logp", "entry_entropy" (or None), "no_grad_tokens", "path_bytes"}``.
    """
    _, events = walk(pack, block_tokens, packed_subtrees=packed_subtrees)
    state = _path_state(adapter, pack, events, walk_kernel(events), with_grads=False)
    entry_logp = _entry_logps(plan, adapter, pack)
    entry_entropy = torch.zeros_like(entry_logp) if entropy else None
    for event, b in events:
        if event == "pop":  # its tokens were scored when it was pushed
            continue
        run = BlockRun(state, b, with_grad=False) if event == "push" else PrefixRead(state, b)
        features, head = _features(adapter, pack, b, run)
        entries, logp, ent = plan.logprobs(features, b.start, head, entropy=entropy)
        entry_logp[entries] = logp
        if entropy:
            entry_entropy[entries] = ent
    return {
        "entry_logp": entry_logp,
        "entry_entropy": entry_entropy,
        "no_grad_tokens": pack.num_tokens,
        "path_bytes": state.nbytes(),
    }
