"""Drawings of the RL loop on tries (notebook 07): a sampled trie with its text, and GRPO flat against tree.

- :func:`draw_sampled_trie`: :func:`treeattn_lab.lab.viz.draw_trie` of a sampled batch, hover showing each
  node's text (decoded) and the reward of the rollouts ending there.
- :func:`draw_grpo_live` / :func:`add_grpo_record`: reward and log-prob + training seconds per step, one
  line per loop; show the figure through :class:`treeattn_lab.lab.viz.LiveFigure` and add each step's
  record to its widget as it arrives.
- :func:`draw_phase_times`: mean seconds per phase (sample, reward, log-probs, train), loops side by side.
- :func:`draw_learner_parts`: the learner's seconds per part, stacked, one bar per loop
  (:func:`treeattn_lab.rl.learner_costs.learner_parts`).
- :func:`draw_seconds_by_tokens`: a call's seconds against the tokens it computes, flat and tree, with the
  straight line fitted to each (:func:`treeattn_lab.rl.learner_costs.seconds_by_size`).
- :func:`draw_reward_curves` / :func:`draw_greedy_gains`: a GRPO experiment's result
  (:mod:`treeattn_lab.experiments.grpo_tree`): reward per step of every seed, and the held-out greedy
  reward before and after RL per seed and loop.

Flat and tree loops that compute the same gradients sample the same rollouts, so their reward lines can
lie on each other: the tree's is drawn dashed over the flat one.

Pure functions: data in, a ``plotly.graph_objects.Figure`` out (``add_grpo_record`` updates the one given).
"""

from __future__ import annotations

import html
import statistics
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .style import MODE_COLORS
from .tries import draw_trie

LOOP_COLORS = {"flat": MODE_COLORS["flat"], "tree": MODE_COLORS["packed"]}
LOOP_DASH = {"flat": "solid", "tree": "dash"}
PHASE_NAMES = {"sample": "sample", "reward": "reward", "logprobs": "log-probs", "train": "train"}
PART_NAMES = {"layout": "laying the trie out", "logprobs": "log-prob passes",
              "forward_backward": "forward + backward", "optimizer": "clip + AdamW step"}
_MAX_TEXT = 120


def _shown(text: str) -> str:
    """Text safe for a hover label: escaped, newlines shown as ⏎, cut to a readable length."""
    text = text if len(text) <= _MAX_TEXT else text[: _MAX_TEXT - 3] + "..."
    return html.escape(text).replace("\n", "⏎")


def draw_sampled_trie(batch, decode: Callable[[list[int]], str], rewards=None, *, max_nodes: int = 300,
                      title: str | None = None) -> go.Figure:
    """The trie of a :class:`treeattn_lab.rl.SampleBatch`; hover shows each node's tokens as text (``decode``)
    and, when ``rewards [rollouts]`` is given, the rewards of the rollouts ending at the node."""
    trie = batch.trie
    fig = draw_trie(trie, max_nodes=max_nodes, title=title or "The trie that sampling made")
    nodes = next(t for t in fig.data if t.name == "nodes")
    texts = []
    for node in nodes.customdata:
        if node == 0:
            texts.append("<b>root</b>")
            continue
        n = trie.nodes[node]
        lines = [f"<b>node {node}</b> (positions {n.depth}..{n.end_depth - 1})", _shown(decode(n.tokens))]
        if n.ends:
            ends = ", ".join(str(e) for e in n.ends[:8]) + (" ..." if len(n.ends) > 8 else "")
            lines.append(f"rollouts ending here: {ends}")
            if rewards is not None:
                lines.append("rewards: " + ", ".join(f"{float(rewards[e]):.2f}" for e in n.ends[:8]))
        texts.append("<br>".join(lines))
    nodes.text = texts
    return fig


def draw_grpo_live(loops: Sequence[str] = ("flat", "tree"), *, title: str | None = None) -> go.Figure:
    """Empty panels, reward per step and log-prob + training seconds per step, with one line per loop."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=("mean reward of the step's rollouts",
                                                        "log-probs + train, seconds per step"))
    for col in (1, 2):
        for loop in loops:
            fig.add_trace(go.Scatter(x=[], y=[], mode="lines+markers", name=loop, legendgroup=loop,
                                     showlegend=col == 1, line=_loop_line(loop)), row=1, col=col)
    fig.update_xaxes(title="GRPO step")
    fig.update_yaxes(title="reward", row=1, col=1)
    fig.update_yaxes(title="seconds", rangemode="tozero", row=1, col=2)
    fig.update_layout(template="plotly_white", height=360, title=title or "GRPO, flat against tree")
    return fig


def add_grpo_record(fig, record: Mapping) -> None:
    """Append one step's record (:meth:`treeattn_lab.rl.grpo.GRPO.step`) to its loop's two lines."""
    learner = record["times_s"]["logprobs"] + record["times_s"]["train"]
    traces = [t for t in fig.data if t.name == record["mode"]]
    if len(traces) != 2:
        raise ValueError(f"the figure has no lines for the loop {record['mode']!r}")
    for trace, y in zip(traces, (record["reward"], learner), strict=True):
        trace.x = (*(trace.x or ()), record["step"])
        trace.y = (*(trace.y or ()), y)


def draw_phase_times(histories: Mapping[str, Sequence[Mapping]], *, skip_first: bool = True,
                     title: str | None = None) -> go.Figure:
    """Mean seconds per phase for each loop (``{loop: records}``), stacked, the loops side by side.

    ``skip_first``: leave step 0 out of the means (it pays one-time allocations)."""
    fig = go.Figure()
    loops = list(histories)
    for phase, name in PHASE_NAMES.items():
        means = []
        for loop in loops:
            records = list(histories[loop])
            records = records[1:] if skip_first and len(records) > 1 else records
            means.append(statistics.fmean(r["times_s"][phase] for r in records))
        fig.add_trace(go.Bar(x=loops, y=means, name=name, text=[f"{m:.3f}" for m in means],
                             textposition="inside"))
    fig.update_layout(barmode="stack", template="plotly_white", height=380, yaxis_title="seconds per step",
                      title=title or "Where a GRPO step's time goes")
    return fig


def _loop_line(loop: str) -> dict:
    return dict(color=LOOP_COLORS.get(loop), dash=LOOP_DASH.get(loop, "solid"))


def draw_learner_parts(parts: Mapping[str, Mapping[str, float]], *, title: str | None = None) -> go.Figure:
    """Seconds of each learner part (``{label: {part: seconds}}``, parts named as in :data:`PART_NAMES`),
    stacked, one bar per label, the total above each bar."""
    labels = list(parts)
    fig = go.Figure()
    for part, name in PART_NAMES.items():
        fig.add_trace(go.Bar(x=labels, y=[parts[label].get(part, 0.0) for label in labels], name=name))
    totals = [sum(parts[label].values()) for label in labels]
    fig.add_trace(go.Scatter(x=labels, y=totals, mode="text", text=[f"{t:.3f} s" for t in totals],
                             textposition="top center", showlegend=False, cliponaxis=False))
    fig.update_layout(barmode="stack", template="plotly_white", height=380, yaxis_title="seconds per step",
                      title=title or "The learner's time per GRPO step, part by part")
    return fig


def line_fit(rows: Sequence[Mapping]) -> tuple[float, float]:
    """``(intercept s, seconds per token)`` of the least-squares line through rows of ``tokens`` and
    ``seconds``."""
    slope, intercept = np.polyfit([r["tokens"] for r in rows], [r["seconds"] for r in rows], 1)
    return float(intercept), float(slope)


def draw_seconds_by_tokens(rows: Sequence[Mapping], *, title: str | None = None) -> go.Figure:
    """A call's seconds against the tokens it computes (rows of ``loop``, ``prompts``, ``tokens``,
    ``seconds``), one colour per loop, with the line fitted to each loop's points (:func:`line_fit`):
    its intercept is what a call costs with no tokens, its slope what a token adds."""
    fig = go.Figure()
    for loop in dict.fromkeys(r["loop"] for r in rows):
        mine = sorted((r for r in rows if r["loop"] == loop), key=lambda r: r["tokens"])
        color = LOOP_COLORS.get(loop)
        fig.add_trace(go.Scatter(x=[r["tokens"] for r in mine], y=[r["seconds"] for r in mine],
                                 mode="markers", name=loop, legendgroup=loop,
                                 marker=dict(color=color, size=9),
                                 text=[f"{r['prompts']} prompts" for r in mine],
                                 hovertemplate="%{text}: %{x} tokens, %{y:.3f} s<extra></extra>"))
        if len(mine) > 1:
            intercept, slope = line_fit(mine)
            xs = [0, mine[-1]["tokens"]]
            fig.add_trace(go.Scatter(x=xs, y=[intercept + slope * x for x in xs], mode="lines",
                                     name=f"{loop}: {1e3 * intercept:.1f} ms + {1e6 * slope:.0f} µs/token",
                                     legendgroup=loop, line=dict(color=color, dash="dot")))
    fig.update_layout(template="plotly_white", height=380, xaxis_title="tokens computed",
                      yaxis_title="seconds per forward + backward",
                      title=title or "A call's time against the tokens it computes")
    return fig


def _seed_steps(steps: Sequence[Mapping], seed, loop: str) -> list[Mapping]:
    return sorted((r for r in steps if r["seed"] == seed and r["mode"] == loop), key=lambda r: r["step"])


def draw_reward_curves(result: Mapping, *, title: str | None = None) -> go.Figure:
    """Mean reward of each step's rollouts against the GRPO step, one panel per seed of ``result`` (a
    :mod:`treeattn_lab.experiments.grpo_tree` result: its ``steps`` and ``config["seeds"]``), flat and
    tree in each."""
    seeds = list(result["config"]["seeds"])
    fig = make_subplots(rows=1, cols=len(seeds), shared_yaxes=True,
                        subplot_titles=[f"seed {seed}" for seed in seeds])
    for col, seed in enumerate(seeds, start=1):
        for loop in ("flat", "tree"):
            rows = _seed_steps(result["steps"], seed, loop)
            fig.add_trace(go.Scatter(x=[r["step"] for r in rows], y=[r["reward"] for r in rows], mode="lines",
                                     name=loop, legendgroup=loop, showlegend=col == 1, line=_loop_line(loop)),
                          row=1, col=col)
    fig.update_xaxes(title="GRPO step")
    fig.update_yaxes(title="mean reward", row=1, col=1)
    fig.update_layout(template="plotly_white", height=340, title=title or "Reward per GRPO step, every seed")
    return fig


def draw_greedy_gains(summary: Sequence[Mapping], *, title: str | None = None) -> go.Figure:
    """Held-out greedy reward per seed (``summary`` rows of ``seed``, ``loop``, ``eval_before``,
    ``eval_after``): after the warm-up, and after GRPO in each loop, grouped by seed."""
    seeds = list(dict.fromkeys(r["seed"] for r in summary))
    by = {(r["seed"], r["loop"]): r for r in summary}
    names = [f"seed {seed}" for seed in seeds]
    first = [next(by[seed, loop] for loop in ("flat", "tree") if (seed, loop) in by) for seed in seeds]
    fig = go.Figure(go.Bar(x=names, y=[r["eval_before"] for r in first], name="after the warm-up",
                           marker_color="#CFCFCF", text=[f"{r['eval_before']:.2f}" for r in first],
                           textposition="outside", cliponaxis=False))
    for loop in ("flat", "tree"):
        rows = [by.get((seed, loop)) for seed in seeds]
        fig.add_trace(go.Bar(x=names, y=[r["eval_after"] if r else None for r in rows],
                             name=f"{loop}, after GRPO", marker_color=LOOP_COLORS[loop],
                             text=[f"{r['eval_after']:.2f}" if r else "" for r in rows],
                             textposition="outside", cliponaxis=False))
    fig.update_layout(barmode="group", template="plotly_white", height=360, yaxis=dict(title="greedy reward",
                      range=[0, 1.1]), title=title or "Held-out greedy reward, before and after GRPO")
    return fig


__all__ = ["LOOP_COLORS", "LOOP_DASH", "PART_NAMES", "add_grpo_record", "draw_greedy_gains", "draw_grpo_live",
           "draw_learner_parts", "draw_phase_times", "draw_reward_curves", "draw_sampled_trie",
           "draw_seconds_by_tokens", "line_fit"]
