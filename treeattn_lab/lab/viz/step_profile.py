"""Where one training step's time goes: host work (aten ops, kernel launches) and device busy / idle time.

A step of :func:`~treeattn_lab.engine.tree_backward` is a series of model calls: one per micro-batch in
packed mode, one per block (pushed blocks twice) or span of sibling leaves in dfs mode. The host issues
every operator of every call; on a GPU each operator becomes one or more **kernel launches** queued for the
device, which runs them while the host goes on issuing. When the calls are small, the device finishes each
kernel before the host has queued the next, and it sits idle: the step is *host-bound*. On a CPU host and
device are the same cores, so there is no queue to starve.

- :func:`model_calls`: how many model calls one ``tree_backward`` makes in packed or dfs mode.
- :func:`with_model_calls`: a :func:`~treeattn_lab.bench.step_profile.profile_step` row labelled with its
  machine and its number of model calls.
- :func:`committed_profile_rows`: the ``profile`` rows of a committed ``bench train`` result, labelled
  the same way.
- :func:`draw_step_profile`: those rows side by side: aten ops and kernel launches per step, aten ops
  per model call, and each step's wall time split into device busy and idle.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .style import (
    LINE_PX,
    LOG_AXIS,
    MAX_FIGURE_WIDTH,
    MODE_COLORS,
    PALETTE,
    above_plot,
    fit_title,
    labelled_bar,
)
from .trie_labels import count_label

PROFILED_MODES = ("packed", "dfs")  # the modes whose calls are counted: one trie per micro-batch
REQUIRED = ("machine", "mode", "aten_ops", "wall_s", "model_calls")
BUSY_COLOR = "#B279A2"
IDLE_COLOR = "#D8D8D8"
HOST_COLOR = "#72B7B2"


def model_calls(
    trie, *, mode: str, block_tokens: int, token_budget: int | None = None, cost_model=None
) -> int:
    """Model calls of one ``tree_backward(model, trie, mode=mode, block_tokens=..., token_budget=...)``.

    The trie is cut into the micro-batches the engine plans (``cost_model`` as given to it); packed mode
    runs each as one call, dfs mode each as the events of its walk (pushes, pops, packed spans of sibling
    leaves and subtrees: :attr:`~treeattn_lab.engine.MicroBatchShape.dfs_calls`).
    """
    from ...engine import CostModel, MicroBatchShape, plan_micro_batches

    if mode not in PROFILED_MODES:
        raise ValueError(f"mode must be one of {PROFILED_MODES}, got {mode!r}")
    micro_batches = plan_micro_batches(trie, token_budget, cost_model=cost_model or CostModel(), mode=mode)
    if mode == "packed":
        return len(micro_batches)
    return sum(MicroBatchShape.of(mb.trie, block_tokens).dfs_calls for mb in micro_batches)


def with_model_calls(
    row: Mapping, trie, *, machine: str, block_tokens: int, token_budget: int | None = None, cost_model=None
) -> dict:
    """A copy of ``row`` (a ``profile_step`` result for ``trie``) with ``machine`` and ``model_calls``."""
    calls = model_calls(
        trie, mode=row["mode"], block_tokens=block_tokens, token_budget=token_budget, cost_model=cost_model
    )
    return {**row, "machine": machine, "model_calls": calls}


def committed_profile_rows(payload: Mapping) -> list[dict]:
    """The ``profile`` rows of a ``bench train`` result (as :func:`~treeattn_lab.lab.viz.load_bench_results`
    returns it), each labelled with the GPU it ran on and the model calls its step made on its set's trie
    under its ``block_tokens`` (the row's where it records one, else the run's, times
    ``CHECKPOINTED_BLOCKS`` for a ``dfs-ckpt`` row), the run's ``token_budget`` and cost model."""
    from ...bench.train import CHECKPOINTED_BLOCKS, CHECKPOINTED_DFS, bench_trie
    from ...engine import CostModel

    if not payload.get("profile"):
        raise ValueError("the result has no 'profile' rows: run bench train with --profile <set>")
    cost_model = CostModel.from_dict(payload["cost_model"]) if "cost_model" in payload else None
    machine = payload["environment"]["device"]
    tries = {name: bench_trie(name, payload["quick"]) for name in {r["set"] for r in payload["profile"]}}

    def labelled(r: Mapping) -> dict:
        checkpointed = r["mode"] == CHECKPOINTED_DFS
        blocks = r.get("block_tokens", payload["block_tokens"] * (CHECKPOINTED_BLOCKS if checkpointed else 1))
        row = with_model_calls(
            {**r, "mode": "dfs"} if checkpointed else r,
            tries[r["set"]],
            machine=machine,
            block_tokens=blocks,
            token_budget=payload["token_budget"],
            cost_model=cost_model,
        )
        return {**row, "mode": r["mode"]}

    return [labelled(r) for r in payload["profile"]]


def _check_rows(rows: Sequence[Mapping]) -> None:
    if not rows:
        raise ValueError("rows is empty")
    for i, r in enumerate(rows):
        missing = [k for k in REQUIRED if k not in r]
        if missing:
            raise ValueError(f"rows[{i}] lacks {missing}; label profile_step rows with with_model_calls")
        for key in ("aten_ops", "wall_s", "model_calls", "kernel_launches", "kernel_s"):
            value = r.get(key)
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ValueError(f"rows[{i}][{key!r}] must be a finite number >= 0, got {value!r}")
        if r["model_calls"] < 1:
            raise ValueError(f"rows[{i}] made {r['model_calls']} model calls; a step makes at least one")
    keys = [(r["machine"], r["mode"]) for r in rows]
    if len(set(keys)) < len(keys):
        raise ValueError(f"rows repeat a (machine, mode) pair: {keys}")


def _mode_bars(fig, col: int, mode: str, modes, xs, ys, labels, hover: str, **trace) -> None:
    """One mode's bars in panel ``col``, in the mode's colour, each labelled above it at a size that
    stays legible (labels are short: :func:`~.trie_labels.count_label`)."""
    fig.add_trace(
        labelled_bar(
            xs,
            ys,
            labels,
            name=mode,
            legendgroup=mode,
            marker_color=MODE_COLORS.get(mode, PALETTE[modes.index(mode) % len(PALETTE)]),
            textfont=dict(size=10),
            constraintext="none",
            hovertemplate=f"{mode}<br>%{{x}}: {hover}<extra></extra>",
            **trace,
        ),
        row=1,
        col=col,
    )


def _add_count_bars(fig, rows, machines, modes) -> None:
    """Left panel: aten ops per step on every machine, kernel launches where a GPU counted them."""
    groups = [(f"aten ops<br>{m}", m, "aten_ops") for m in machines]
    counted = {r["machine"] for r in rows if r.get("kernel_launches") is not None}
    groups += [(f"kernel launches<br>{m}", m, "kernel_launches") for m in machines if m in counted]
    by = {(r["machine"], r["mode"]): r for r in rows}
    for mode in modes:
        bars = [(label, by[(m, mode)].get(key)) for label, m, key in groups if (m, mode) in by]
        bars = [(label, y) for label, y in bars if y is not None]
        xs, ys = [b[0] for b in bars], [b[1] for b in bars]
        _mode_bars(fig, 1, mode, modes, xs, ys, [count_label(round(y)) for y in ys], "%{y:,}")


def _add_per_call_bars(fig, rows, machines, modes) -> None:
    """Middle panel: aten ops per model call, labelled with the number of calls (``x 51``)."""
    by = {(r["machine"], r["mode"]): r for r in rows}
    for mode in modes:
        picked = [by[(m, mode)] for m in machines if (m, mode) in by]
        ys = [r["aten_ops"] / r["model_calls"] for r in picked]
        labels = [f"{count_label(round(y))}<br>x {r['model_calls']:,}"
                  for y, r in zip(ys, picked, strict=True)]
        _mode_bars(
            fig,
            2,
            mode,
            modes,
            [r["machine"] for r in picked],
            ys,
            labels,
            "%{y:,.0f} ops per call",
            showlegend=False,
        )


def _wall_parts(rows, reference: dict[str, float]) -> list[tuple[str, str, list, list, list]]:
    """``(name, colour, bar bottoms, bar heights, seconds)`` of the wall panel, heights and bottoms in
    units of ``reference[machine]`` seconds: on a GPU the busy part (its kernels running) from 0 and the
    idle rest above it; on a CPU the whole wall, host and device being the same cores. Heights and
    seconds are ``None`` where a part does not apply to a row."""
    busy, idle, host = [], [], []
    for r in rows:
        on_gpu = r.get("kernel_s") is not None
        kernels = min(r["kernel_s"], r["wall_s"]) if on_gpu else None
        busy.append(kernels)
        idle.append(r["wall_s"] - kernels if on_gpu else None)
        host.append(None if on_gpu else r["wall_s"])
    scale = [1 / reference[r["machine"]] for r in rows]

    def scaled(seconds):
        return [None if t is None else t * k for t, k in zip(seconds, scale, strict=True)]

    zeros = [0.0] * len(rows)
    above_busy = [(b or 0.0) * k for b, k in zip(busy, scale, strict=True)]
    return [
        ("GPU busy (kernels running)", BUSY_COLOR, zeros, scaled(busy), busy),
        ("GPU idle (waiting on the host)", IDLE_COLOR, above_busy, scaled(idle), idle),
        ("CPU (host and device are one)", HOST_COLOR, zeros, scaled(host), host),
    ]


def _add_wall_bars(fig, rows, reference: dict[str, float]) -> None:
    """Right panel: each step's wall time relative to ``reference[machine]``, split into device busy
    and idle where a GPU was profiled; labels give the share of the wall (GPU) or the seconds (CPU)."""
    x = [[r["machine"] for r in rows], [r["mode"] for r in rows]]
    for name, color, base, heights, secs in _wall_parts(rows, reference):
        if all(h is None for h in heights):
            continue
        gpu_part = name.startswith("GPU")
        labels = [
            "" if t is None else (f"{t / r['wall_s']:.0%}" if gpu_part and r["wall_s"] else f"{t:.3g} s")
            for t, r in zip(secs, rows, strict=True)
        ]
        fig.add_trace(
            go.Bar(
                x=x,
                y=heights,
                base=base,
                offsetgroup="wall",  # busy and idle share a slot: idle sits on top of busy
                name=name,
                marker_color=color,
                text=labels,
                textposition="inside",
                textangle=0,
                customdata=[t or 0.0 for t in secs],
                hovertemplate=f"%{{x}}: %{{customdata:.3f}} s {name}<extra></extra>",
            ),
            row=1,
            col=3,
        )


def _log_range(values) -> list[float] | None:
    """A log axis range from a decade below the smallest value to above the largest label, so that bar
    heights compare as ratios from a common floor (None: nothing > 0 to draw)."""
    positive = [v for v in values if v > 0]
    if not positive:
        return None
    return [math.floor(math.log10(min(positive))) - 1, math.log10(max(positive)) + 0.35]


def draw_step_profile(rows: Sequence[Mapping], *, title: str | None = None) -> go.Figure:
    """Three panels from rows labelled by :func:`with_model_calls` / :func:`committed_profile_rows`.

    Left: aten ops per step (log scale) on every machine, and kernel launches where a GPU counted them.
    Middle: aten ops per model call, each bar labelled with its number of calls: a call costs about the
    model's own ops in either mode, dfs makes many more of them. Right: each step's wall time relative to
    the first mode's on the same machine (the machines' models differ in size), split on a GPU into the
    share its kernels kept it busy and the rest it waited for the host.
    """
    _check_rows(rows)
    machines = list(dict.fromkeys(r["machine"] for r in rows))
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    first = {}
    for r in rows:
        first.setdefault(r["machine"], r)
    if any(r["wall_s"] <= 0 for r in first.values()):
        raise ValueError(
            "the first row of each machine needs a wall_s > 0: the others are drawn relative to it"
        )
    reference = {m: r["wall_s"] for m, r in first.items()}
    base_mode = first[machines[0]]["mode"]
    fig = make_subplots(
        rows=1,
        cols=3,
        horizontal_spacing=0.09,
        column_widths=[0.38, 0.28, 0.34],
        subplot_titles=("operations per step", "aten ops per call (x calls)", f"wall time / {base_mode}'s"),
    )
    _add_count_bars(fig, rows, machines, modes)
    _add_per_call_bars(fig, rows, machines, modes)
    _add_wall_bars(fig, rows, reference)
    width = MAX_FIGURE_WIDTH
    text, lines = fit_title(title or "Where a step's time goes: host work and device time", width)
    top = 60 + LINE_PX * lines  # the title, then a line of subplot titles
    fig.update_layout(
        title=above_plot(text, lines, 30),  # clear of the subplot titles
        template="plotly_white",
        barmode="group",
        width=width,
        height=460 + top,
        margin=dict(l=60, r=20, t=top, b=90),
        legend=dict(orientation="h", y=-0.2),  # below the two-line axis labels
    )
    fig.update_xaxes(tickfont=dict(size=10))
    counts = [r[k] for r in rows for k in ("aten_ops", "kernel_launches") if r.get(k)]
    fig.update_yaxes(LOG_AXIS, dtick=1, range=_log_range(counts), row=1, col=1)
    fig.update_yaxes(
        LOG_AXIS, dtick=1, range=_log_range([r["aten_ops"] / r["model_calls"] for r in rows]), row=1, col=2
    )
    fig.update_yaxes(rangemode="tozero", row=1, col=3)
    return fig


__all__ = ["committed_profile_rows", "draw_step_profile", "model_calls", "with_model_calls"]
