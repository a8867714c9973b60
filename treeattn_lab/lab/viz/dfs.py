"""Drawing the DFS engine step by step: the blocks of the trie, the K/V stack and the gradient buffers.

- :func:`draw_dfs_step` / :func:`restyle_dfs_step`: one event of a
  :func:`~treeattn_lab.lab.dfs_stepper.dfs_trace` in three panels (the blocks by state, the K/V stack by
  position, the gradient buffers' fill); restyling moves the same figure to another event in place.
- :func:`draw_dfs_timeline`: every event at once, the stack over time (the static view of the stepper).
"""

from __future__ import annotations

import networkx as nx
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .style import (
    DIMMED_COLOR,
    EDGE_COLOR,
    HIGHLIGHT_COLOR,
    ROOT_COLOR,
    legend_entry,
    stepped_colorscale,
    wrap,
)
from .tries import node_size, tree_layout

# what a block (or a stack slot) is doing during an event
STATE_COLORS = {
    "waiting": DIMMED_COLOR,  # not run yet
    "stack": HIGHLIGHT_COLOR,  # its K/V (and gradient buffers) are held on the stack
    "push": "#F58518",  # running without autograd; its K/V are being stored
    "grad": "#54A24B",  # running with autograd (a pop or a batch of leaves)
    "done": "#7F7F7F",  # its gradient is computed; nothing of it is held any more
}
STATE_LABELS = {
    "push": "running: push (no autograd)",
    "grad": "running: with autograd",
    "stack": "K/V on the stack",
    "done": "done (freed)",
    "waiting": "waiting",
}


def _block_graph(trace) -> nx.DiGraph:
    """The blocks as a tree under a virtual root ``-1``, children in block (= packed) order."""
    graph = nx.DiGraph()
    graph.add_node(-1)
    for i, b in enumerate(trace.blocks):
        graph.add_edge(b.parent, i)
    return graph


def _block_hover(trace, i: int) -> str:
    b = trace.blocks[i]
    chunks = [j for j, n in enumerate(trace.block_node) if n == trace.block_node[i]]
    lines = [
        f"<b>block {i}</b> (node {trace.block_node[i]}, chunk {chunks.index(i) + 1} of {len(chunks)})",
        f"packed {b.start}..{b.end - 1}, positions {b.position}..{b.position + b.end - b.start - 1}",
        f"tokens: {trace.pack.input_ids[b.start : b.end].tolist()}",
    ]
    if trace.descendant_tokens[i]:
        lines.append(f"{trace.descendant_tokens[i]} tokens below it: pushed, then popped after them")
    else:
        lines.append("a leaf block: runs once, with autograd")
    return "<br>".join(lines)


def _running_state(step) -> str:
    return "push" if step.kind == "push" else "grad"


def _stack_columns(trace, i: int):
    """Per stack slot during event ``i``: (held, colour, pattern, hover) of the K/V panel and
    (fill, colour, hover) of the gradient buffer panel (after the event)."""
    step = trace[i]
    n = trace.num_slots
    kv_y, kv_color, kv_pattern, kv_text = [0.0] * n, [STATE_COLORS["waiting"]] * n, [""] * n, ["empty"] * n
    kv_block = [""] * n  # the block whose K/V sit in the slot, written on the bar
    gr_y, gr_color, gr_text = [0.0] * n, [STATE_COLORS["stack"]] * n, ["no buffer held"] * n

    def packed(b, s):
        return trace.blocks[b].start + s - trace.blocks[b].position

    for b in step.stack_before:
        if b in step.blocks:
            continue
        for s in trace.slots(b):
            kv_y[s], kv_color[s], kv_block[s] = 1.0, STATE_COLORS["stack"], str(b)
            kv_text[s] = f"K/V of block {b} (packed {packed(b, s)}), stored: read as prefix"
    running = _running_state(step)
    for b in step.blocks:
        for s in trace.slots(b):
            kv_y[s], kv_color[s], kv_block[s] = 1.0, STATE_COLORS[running], str(b)
            if step.kind == "push":
                kv_text[s] = f"K/V of block {b} (packed {packed(b, s)}): written by this push"
            elif step.kind == "pop":
                kv_text[s] = f"K/V of block {b} (packed {packed(b, s)}): recomputed with autograd, then freed"
            else:
                kv_pattern[s] = "/"
                kv_text[s] = (
                    f"leaf block {b} (packed {packed(b, s)}): K/V computed with autograd, never stored"
                )
    for b in step.stack_after:
        total = trace.descendant_tokens[b]
        got = step.grad_received[b]
        for s in trace.slots(b):
            gr_y[s] = got / total if total else 0.0
            gr_text[s] = f"block {b}: {got} of the {total} tokens below it have sent their gradients"
    if step.kind == "push":
        for s in trace.slots(step.blocks[0]):
            gr_y[s], gr_color[s] = 0.0, STATE_COLORS["push"]
            gr_text[s] = f"block {step.blocks[0]}: buffer zeroed, waiting for the tokens below it"
    elif step.kind == "pop":
        b = step.blocks[0]
        for s in trace.slots(b):
            gr_y[s], gr_color[s] = 1.0, STATE_COLORS["grad"]
            gr_text[s] = f"block {b}: complete buffer flows back through its K/V in this run, then freed"
    return (kv_y, kv_color, kv_pattern, kv_text, kv_block), (gr_y, gr_color, gr_text)


def _step_title(trace, i: int, title: str | None, sentence: bool) -> str:
    head = f"{title or 'DFS materialization'}: event {i + 1} of {len(trace)}"
    return f"{head}<br><sup>{wrap(trace.describe(i))}</sup>" if sentence else head


def _add_block_tree(fig, trace, graph, pos) -> None:
    """Left panel: the blocks as a tree under the root (all "waiting"; restyling colours them), and one
    legend entry per state."""
    ex, ey = [], []
    for u, v in graph.edges():
        ex += [pos[u][0], pos[v][0], None]
        ey += [pos[u][1], pos[v][1], None]
    fig.add_trace(
        go.Scatter(
            x=ex,
            y=ey,
            mode="lines",
            name="edges",
            hoverinfo="skip",
            showlegend=False,
            line=dict(color=EDGE_COLOR, width=1.5),
        ),
        row=1,
        col=1,
    )
    order = list(range(len(trace.blocks)))
    fig.add_trace(
        go.Scatter(
            x=[pos[-1][0]],
            y=[pos[-1][1]],
            mode="markers",
            name="root",
            showlegend=False,
            hovertemplate="root (holds no tokens)<extra></extra>",
            marker=dict(size=9, color=ROOT_COLOR),
        ),
        row=1,
        col=1,
    )
    fig.add_trace(
        go.Scatter(
            x=[pos[b][0] for b in order],
            y=[pos[b][1] for b in order],
            mode="markers+text",
            name="blocks",
            showlegend=False,
            text=[str(b) for b in order],
            textposition="middle right",
            customdata=order,
            hovertext=[_block_hover(trace, b) for b in order],
            hovertemplate="%{hovertext}<extra></extra>",
            marker=dict(
                size=[node_size(trace.block_size(b)) + 8 for b in order],
                color=[STATE_COLORS["waiting"]] * len(order),
                line=dict(width=1, color="#333333"),
            ),
        ),
        row=1,
        col=1,
    )
    for state, label in STATE_LABELS.items():  # legend entries
        fig.add_trace(legend_entry(label, dict(size=11, color=STATE_COLORS[state])), row=1, col=1)


def draw_dfs_step(trace, index: int = 0, *, title: str | None = None, sentence: bool = True) -> go.Figure:
    """One event of a DFS trace (:func:`treeattn_lab.lab.dfs_stepper.dfs_trace`) in three panels.

    Left: the trie's blocks as a tree (a node cut into several blocks is a chain), coloured by state:
    running (orange without autograd, green with), K/V on the stack (red), done (grey), waiting (pale).
    Top right: the K/V stack, one slot per position (the same slots in every layer); hatched slots are a
    leaf's K/V, computed in the run and never stored. Bottom right: after the event, each stack block's
    gradient buffer as the share of the tokens below it that have sent their gradients (a block pops at 1).
    Restyle the figure to another event with :func:`restyle_dfs_step` (a ``FigureWidget`` redraws in place).
    ``sentence``: say what the event does under the title (:meth:`DfsTrace.describe`).
    """
    graph = _block_graph(trace)
    pos = tree_layout(graph, -1)
    fig = make_subplots(
        rows=2,
        cols=2,
        specs=[[{"rowspan": 2}, {}], [None, {}]],
        column_widths=[0.5, 0.5],
        horizontal_spacing=0.07,
        vertical_spacing=0.22,
        subplot_titles=(
            "blocks of the trie, walked depth first",
            "K/V stack, by position (every layer alike)",
            "gradient buffers: share arrived",
        ),
    )
    _add_block_tree(fig, trace, graph, pos)
    slots = list(range(trace.num_slots))
    fig.add_trace(
        go.Bar(
            x=slots,
            y=[0.0] * len(slots),
            name="kv",
            showlegend=False,
            textposition="inside",
            insidetextanchor="middle",
            hovertemplate="slot %{x}: %{hovertext}<extra></extra>",
        ),
        row=1,
        col=2,
    )
    fig.add_trace(
        go.Bar(
            x=slots,
            y=[0.0] * len(slots),
            name="grad",
            showlegend=False,
            hovertemplate="slot %{x}: %{hovertext}<extra></extra>",
        ),
        row=2,
        col=2,
    )
    depth = max(-y for _, y in pos.values())
    fig.update_xaxes(visible=False, row=1, col=1)
    fig.update_yaxes(visible=False, range=[-depth - 0.5, 0.5], row=1, col=1)
    fig.update_xaxes(range=[-0.5, len(slots) - 0.5], row=1, col=2)
    fig.update_xaxes(title="position in the rollout", range=[-0.5, len(slots) - 0.5], row=2, col=2)
    fig.update_yaxes(range=[0, 1.05], tickvals=[0, 1], ticktext=["", "held"], row=1, col=2)
    fig.update_yaxes(range=[0, 1.05], tickformat=".0%", row=2, col=2)
    fig.update_layout(
        template="plotly_white",
        height=max(560, min(900, 260 + 60 * int(depth))),
        margin=dict(l=20, r=20, t=140, b=80),
        bargap=0.1,
        legend=dict(orientation="h", y=-0.16, x=0),
        meta=dict(index=index, events=len(trace)),
    )
    restyle_dfs_step(fig, trace, index, title=title, sentence=sentence)
    return fig


def restyle_dfs_step(fig, trace, index: int, *, title: str | None = None, sentence: bool = True) -> None:
    """Restyle a :func:`draw_dfs_step` figure (or its ``FigureWidget``) in place to event ``index``."""
    if not 0 <= index < len(trace):
        raise IndexError(f"event {index} out of range for {len(trace)} events")
    states = trace.block_states(index)
    running = _running_state(trace[index])
    colors = [STATE_COLORS[running if s == "running" else s] for s in states]
    widths = [3 if s in ("running", "stack") else 1 for s in states]
    kv_columns, (gr_y, gr_color, gr_text) = _stack_columns(trace, index)
    kv_y, kv_color, kv_pattern, kv_text, kv_block = kv_columns
    by_name = {t.name: t for t in fig.data}
    with fig.batch_update():
        by_name["blocks"].marker.color = colors
        by_name["blocks"].marker.line.width = widths
        by_name["kv"].y = kv_y
        by_name["kv"].marker.color = kv_color
        by_name["kv"].marker.pattern.shape = kv_pattern
        by_name["kv"].hovertext = kv_text
        by_name["kv"].text = kv_block
        zeroed = STATE_COLORS["push"]  # a just-zeroed buffer gets a sliver, so it can be seen and hovered
        by_name["grad"].y = [max(y, 0.03) if c == zeroed else y for y, c in zip(gr_y, gr_color, strict=True)]
        by_name["grad"].marker.color = gr_color
        by_name["grad"].hovertext = gr_text
        fig.layout.title.text = _step_title(trace, index, title, sentence)
        fig.layout.meta = dict(index=index, events=len(trace))


def _timeline_grids(trace):
    """Per (slot, event): the K/V state code (0 empty, 1 held, 2 pushed, 3 run with autograd), its hover
    text, and the gradient buffer's fill after the event (None where no buffer is held)."""
    n_slots, n_events = trace.num_slots, len(trace)
    code = {"stack": 1, "push": 2, "grad": 3}
    kv = [[0] * n_events for _ in range(n_slots)]
    kv_text = [["empty"] * n_events for _ in range(n_slots)]
    fill = [[None] * n_events for _ in range(n_slots)]
    for e, step in enumerate(trace):
        (held, _, _, text, _), (gr_y, _, gr_text) = _stack_columns(trace, e)
        running = {s for b in step.blocks for s in trace.slots(b)}
        buffers = {s for b in step.stack_after for s in trace.slots(b)}
        if step.kind == "pop":  # the popped block's full buffer is consumed by this event
            buffers |= running
        for s in range(n_slots):
            if held[s]:
                kv[s][e] = code[_running_state(step)] if s in running else code["stack"]
                kv_text[s][e] = text[s]
            if s in buffers:
                fill[s][e] = gr_y[s]
                kv_text[s][e] += f"<br>buffer after the event: {gr_text[s]}"
    return kv, kv_text, fill


def _event_label(step) -> str:
    return f"{step.index}: {step.kind} {','.join(str(b) for b in step.blocks)}"


def draw_dfs_timeline(trace, *, title: str | None = None) -> go.Figure:
    """Every event of a DFS trace at once: the K/V stack (top) and the gradient buffers (bottom) over time.

    Columns are events, rows stack slots (positions). Top: red = K/V held and read as prefix, orange =
    written by a push, green = run with autograd (a pop recomputing its block, or leaves). Bottom: each
    stack block's buffer fill after the event (share of the tokens below it whose gradients arrived).
    The stack grows and shrinks with the depth of the walk, never with the number of rollouts.
    """
    n_slots, n_events = trace.num_slots, len(trace)
    kv, kv_text, fill = _timeline_grids(trace)
    scale = stepped_colorscale(["#FFFFFF", STATE_COLORS["stack"], STATE_COLORS["push"], STATE_COLORS["grad"]])
    labels = [_event_label(s) for s in trace]
    fig = make_subplots(
        rows=2,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.1,
        subplot_titles=("K/V stack per position, event by event", "gradient buffer fill after each event"),
    )
    fig.add_trace(
        go.Heatmap(
            z=kv,
            x=labels,
            zmin=-0.5,
            zmax=3.5,
            colorscale=scale,
            showscale=False,
            xgap=1,
            ygap=1,
            text=kv_text,
            hovertemplate="event %{x}, slot %{y}: %{text}<extra></extra>",
            name="kv",
        ),
        row=1,
        col=1,
    )
    fig.add_trace(
        go.Heatmap(
            z=fill,
            x=labels,
            zmin=0,
            zmax=1,
            colorscale=[[0, "#FBE3E3"], [1, HIGHLIGHT_COLOR]],
            xgap=1,
            ygap=1,
            colorbar=dict(title="fill", len=0.4, y=0.2, tickformat=".0%"),
            hovertemplate="event %{x}, slot %{y}: %{z:.0%}<extra></extra>",
            name="grad",
        ),
        row=2,
        col=1,
    )
    for label, c in (
        ("K/V held (prefix)", "stack"),
        ("push: written", "push"),
        ("run with autograd", "grad"),
    ):
        marker = dict(symbol="square", size=12, color=STATE_COLORS[c])
        fig.add_trace(legend_entry(label, marker), row=1, col=1)
    peak = trace.peak_stack_tokens()
    sub = (
        f"{len(trace.blocks)} blocks of at most {trace.block_tokens} tokens, {n_events} events; "
        f"the stack never holds more than {peak} of the {trace.pack.num_tokens} tree tokens"
    )
    fig.update_yaxes(title="slot", autorange="reversed", row=1, col=1)
    fig.update_yaxes(title="slot", autorange="reversed", row=2, col=1)
    fig.update_xaxes(tickangle=-45, row=2, col=1)
    fig.update_layout(
        title=dict(text=f"{title or 'The stack over time'}<br><sup>{sub}</sup>"),
        template="plotly_white",
        height=max(560, min(1000, 320 + 30 * n_slots)),
        margin=dict(l=60, r=20, t=90, b=60),
        legend=dict(orientation="h", y=-0.22, x=0),
        plot_bgcolor="white",
    )
    return fig


__all__ = ["STATE_COLORS", "STATE_LABELS", "draw_dfs_step", "draw_dfs_timeline", "restyle_dfs_step"]
