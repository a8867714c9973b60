"""Step through DFS materialization one event at a time: a trace of what the engine holds, and a widget.

The DFS engine (:mod:`treeattn_lab.engine.dfs`) cuts a packed trie into *blocks* of at most
``block_tokens`` tokens (:func:`~treeattn_lab.engine.dfs.split_blocks`), walks them depth first
(:func:`~treeattn_lab.engine.dfs.visit_order`) and runs neighbouring sibling leaves as one batch
(:func:`~treeattn_lab.engine.dfs.group_sibling_leaves`). Each resulting *event* is one model call:

- ``push``: a block with children runs **without** autograd against the stored prefix; its keys and values
  join the K/V stack and its gradient buffers (dK, dV, one slot per position) start at zero;
- ``leaves``: one or more sibling leaf blocks run **with** autograd against the stored prefix; the
  gradients their loss sends into the prefix's K/V are added to the prefix blocks' buffers;
- ``pop``: a block with children runs again **with** autograd, once all its children are done: its loss
  and the gradients its buffer collected from its descendants flow back through it, into the parameters
  and into its own prefix's buffers; its K/V leave the stack.

:func:`dfs_trace` replays exactly those events (it asks the engine's own functions for them) and records
after each one what the engine holds: which blocks' K/V are on the stack, which packed positions the running
block reads as its prefix, and how full each stack block's gradient buffer is (the tokens of its subtree
whose gradients have arrived). A test ties the trace to the engine itself: the positions really stored in
``PathState`` while each block runs, and the buffer slots that really hold gradients.

:class:`DfsStepper` plays a trace in a notebook: ipywidgets Play, a slider and step buttons over a plotly
``FigureWidget`` drawn by :func:`treeattn_lab.lab.viz.draw_dfs_step`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from ..engine.dfs import Block, group_sibling_leaves, split_blocks, visit_order
from ..pack import TreePack
from ..trie import RolloutTrie

EVENT_KINDS = ("push", "pop", "leaves")
BLOCK_STATES = ("waiting", "stack", "running", "done")


@dataclass(frozen=True)
class DfsStep:
    """One event of the DFS walk and what the engine holds once it has run.

    ``prefix`` are the blocks whose stored K/V the running blocks read (their ancestors, root first);
    ``prefix_ranges`` their packed ranges. ``stack_before`` / ``stack_after``: the blocks on the K/V stack
    before and after the event. ``grad_received[b]`` (for every ``b`` in ``stack_after``): tokens of b's
    subtree whose gradients b's buffer holds after the event. ``grad_tokens`` / ``no_grad_tokens``: tokens
    run with and without autograd so far, this event included.
    """

    index: int
    kind: str  # "push" | "pop" | "leaves"
    blocks: tuple[int, ...]  # the blocks this event runs: one, or a batch of sibling leaves
    with_grad: bool
    prefix: tuple[int, ...]
    prefix_ranges: tuple[tuple[int, int], ...]
    stack_before: tuple[int, ...]
    stack_after: tuple[int, ...]
    grad_received: dict[int, int] = field(hash=False)
    grad_tokens: int
    no_grad_tokens: int

    @property
    def prefix_positions(self) -> list[int]:
        """Packed positions whose K/V the running blocks read from the stack (as many as their position)."""
        return [k for a, b in self.prefix_ranges for k in range(a, b)]


@dataclass(frozen=True)
class DfsTrace:
    """The events of :func:`dfs_trace` with the blocks they run; index it like a list of :class:`DfsStep`."""

    pack: TreePack = field(repr=False)
    block_tokens: int
    blocks: list[Block]
    steps: list[DfsStep]
    descendant_tokens: list[int]  # per block: tokens of the blocks below it (its gradient buffer's total)
    block_node: list[int]  # per block: the trie node it is cut from

    def __len__(self) -> int:
        return len(self.steps)

    def __getitem__(self, i: int) -> DfsStep:
        return self.steps[i]

    def __iter__(self) -> Iterator[DfsStep]:
        return iter(self.steps)

    @property
    def num_slots(self) -> int:
        """Positions of the K/V stack and of its gradient buffers: the longest rollout's length."""
        return int(self.pack.seq_lengths.max())

    def block_size(self, b: int) -> int:
        return self.blocks[b].end - self.blocks[b].start

    def slots(self, b: int) -> range:
        """The stack positions block ``b``'s K/V occupy (its tokens' positions in their rollouts)."""
        return range(self.blocks[b].position, self.blocks[b].position + self.block_size(b))

    def block_states(self, i: int) -> list[str]:
        """Per block during event ``i``: ``"running"``, ``"stack"`` (its K/V stored), ``"done"`` (its
        gradient computed, nothing of it held any more) or ``"waiting"``."""
        states = ["waiting"] * len(self.blocks)
        for step in self.steps[:i]:
            if step.with_grad:
                for b in step.blocks:
                    states[b] = "done"
        step = self.steps[i]
        for b in step.stack_before:
            states[b] = "stack"
        for b in step.blocks:
            states[b] = "running"
        return states

    def peak_stack_tokens(self) -> int:
        """Most tokens whose K/V (and gradient buffers) the stack held at once."""
        return max(sum(self.block_size(b) for b in {*s.stack_before, *s.stack_after}) for s in self.steps)

    def describe(self, i: int) -> str:
        """A sentence saying what event ``i`` does."""
        if not 0 <= i < len(self.steps):
            raise IndexError(f"event {i} out of range for {len(self.steps)} events")
        step = self.steps[i]
        prefix = len(step.prefix_positions)
        against = f"against {prefix} stored K/V tokens" if prefix else "with no prefix (a root block)"
        into = (
            f"gradients into the buffers of blocks {', '.join(str(b) for b in step.prefix)}"
            if step.prefix
            else "no prefix to send gradients to"
        )
        names = ", ".join(str(b) for b in step.blocks)
        first, last = self.blocks[step.blocks[0]].start, self.blocks[step.blocks[-1]].end - 1
        where = f"packed {first}" if first == last else f"packed {first}..{last}"
        if step.kind == "push":
            return (
                f"push block {names} ({where}): run without autograd {against}; its K/V join the stack, "
                "its gradient buffers start at zero"
            )
        if step.kind == "pop":
            b = step.blocks[0]
            return (
                f"pop block {names} ({where}): all {self.descendant_tokens[b]} tokens below it are done, so "
                f"it runs again, with autograd, {against}; its loss and its buffer flow back; {into}"
            )
        if len(step.blocks) > 1:
            return (
                f"leaf blocks {names} ({where}, one padded batch of {len(step.blocks)} rows): run with "
                f"autograd {against}; {into}"
            )
        return f"leaf block {names} ({where}): run with autograd {against}; {into}"


def _merged_ranges(ranges: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        elif b > a:
            out.append((a, b))
    return tuple(out)


def dfs_trace(pack, block_tokens: int) -> DfsTrace:
    """Replay the DFS engine's events over ``pack`` (a :class:`TreePack` or a :class:`RolloutTrie`).

    The events are the engine's own (``group_sibling_leaves(visit_order(split_blocks(...)))``, as
    :func:`treeattn_lab.engine.dfs.run_dfs` runs them); this function only keeps the books: the stack of
    blocks whose K/V are stored and, per stack block, the tokens of its subtree that have sent their
    gradients into its buffer. Pure: nothing is computed with a model.
    """
    if isinstance(pack, RolloutTrie):
        pack = pack.pack()
    if not isinstance(pack, TreePack):
        raise TypeError(f"pack must be a TreePack or a RolloutTrie, got {type(pack).__name__}")
    if isinstance(block_tokens, bool) or not isinstance(block_tokens, int):
        raise TypeError(f"block_tokens must be an int, got {type(block_tokens).__name__}")
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be at least 1, got {block_tokens}")
    blocks = split_blocks(pack, block_tokens)
    events = group_sibling_leaves(visit_order(blocks), blocks, block_tokens)
    size = [b.end - b.start for b in blocks]
    below = [0] * len(blocks)
    for i in reversed(range(len(blocks))):  # preorder: a block's subtree is complete when it is reached
        if blocks[i].parent >= 0:
            below[blocks[i].parent] += below[i] + size[i]
    node_id = pack.node_id.cpu()
    block_node = [int(node_id[b.start]) for b in blocks]

    stack: list[int] = []
    received: dict[int, int] = {}
    grad_tokens = no_grad_tokens = 0
    steps = []
    for index, (kind, group) in enumerate(events):
        before = tuple(stack)
        parent = blocks[group[0]].parent
        if kind == "pop":
            if not stack or stack[-1] != group[0]:
                raise RuntimeError(f"event {index}: pop of block {group[0]} that is not on top of the stack")
            stack.pop()
            del received[group[0]]
        if (stack[-1] if stack else -1) != parent:
            raise RuntimeError(
                f"event {index}: block {group[0]}'s parent {parent} is not on top of the stack"
            )
        prefix = tuple(stack)
        tokens = sum(size[b] for b in group)
        if kind == "push":
            stack.append(group[0])
            received[group[0]] = 0
            no_grad_tokens += tokens
        else:  # pop and leaves backpropagate into every prefix block's buffer
            grad_tokens += tokens
            for b in prefix:
                received[b] += tokens
        steps.append(
            DfsStep(
                index=index,
                kind=kind,
                blocks=tuple(group),
                with_grad=kind != "push",
                prefix=prefix,
                prefix_ranges=_merged_ranges([(blocks[b].start, blocks[b].end) for b in prefix]),
                stack_before=before,
                stack_after=tuple(stack),
                grad_received=dict(received),
                grad_tokens=grad_tokens,
                no_grad_tokens=no_grad_tokens,
            )
        )
    return DfsTrace(pack, block_tokens, blocks, steps, below, block_node)


# ------------------------------------------------------------------------------------ widget
class DfsStepper:
    """Play, step or scrub through the DFS events of a small trie.

        stepper = DfsStepper(trie, block_tokens=4)
        stepper            # in a notebook: the widget (Play, slider, buttons, figure, sentence)
        stepper.show(5)    # jump to event 5 from code (the figure and the sentence follow)

    The figure is :func:`treeattn_lab.lab.viz.draw_dfs_step`: the blocks of the trie coloured by
    state (running, on the K/V stack, done, waiting), the K/V stack by position and the gradient buffers'
    fill. It is restyled in place on every change, so playing does not rebuild it.
    """

    def __init__(self, trie, block_tokens: int, *, interval_ms: int = 900, title: str | None = None):
        self.trace = dfs_trace(trie, block_tokens)
        self.title = title
        self.interval_ms = interval_ms
        self._widget = None
        self.figure = None

    @property
    def index(self) -> int:
        return self.slider.value if self._widget is not None else 0

    def widget(self):
        """The ipywidgets box (built on first use): controls, the figure and the event's sentence."""
        if self._widget is None:
            self._build()
        return self._widget

    def _build(self) -> None:
        import ipywidgets as widgets
        import plotly.graph_objects as go

        from .viz.dfs import draw_dfs_step

        last = len(self.trace) - 1
        # the sentence goes in an HTML line above the figure, not in its title
        self.figure = go.FigureWidget(draw_dfs_step(self.trace, 0, title=self.title, sentence=False))
        self.play = widgets.Play(
            value=0, min=0, max=last, step=1, interval=self.interval_ms, description="play"
        )
        self.slider = widgets.IntSlider(value=0, min=0, max=last, description="event", continuous_update=True)
        widgets.jslink((self.play, "value"), (self.slider, "value"))
        self.back = widgets.Button(description="step back", icon="step-backward")
        self.forward = widgets.Button(description="step", icon="step-forward")
        self.back.on_click(lambda _: self.step(-1))
        self.forward.on_click(lambda _: self.step(+1))
        self.sentence = widgets.HTML(self._sentence(0))
        self.slider.observe(self._on_index, names="value")
        controls = widgets.HBox([self.play, self.back, self.forward, self.slider])
        self._widget = widgets.VBox([controls, self.sentence, self.figure])

    def _sentence(self, i: int) -> str:
        return f"<b>event {i + 1} of {len(self.trace)}</b>: {self.trace.describe(i)}"

    def _on_index(self, change) -> None:
        from .viz.dfs import restyle_dfs_step

        restyle_dfs_step(self.figure, self.trace, change["new"], title=self.title, sentence=False)
        self.sentence.value = self._sentence(change["new"])

    def show(self, i: int) -> None:
        """Go to event ``i`` (clamped to the trace); the figure and the sentence follow."""
        self.widget()
        self.slider.value = max(0, min(int(i), len(self.trace) - 1))

    def step(self, delta: int = 1) -> None:
        """Move ``delta`` events forward (negative: back)."""
        self.show(self.index + delta)

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget())


__all__ = ["BLOCK_STATES", "EVENT_KINDS", "DfsStep", "DfsStepper", "DfsTrace", "dfs_trace"]
