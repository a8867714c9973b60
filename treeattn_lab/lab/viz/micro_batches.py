"""Drawing micro-batches: how a trie is cut into micro-batches and which mode the cost model picks.

- :func:`micro_batch_choices`: the micro-batches of a trie with the cost model's predictions and choice.
- :func:`micro_batch_colors` / :func:`draw_micro_batches`: the trie coloured by micro-batch and mode.
- :func:`draw_micro_batch_table`: the same as a table (sizes, predicted time and memory, choice).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import plotly.graph_objects as go

from .style import table_figure
from .tries import draw_trie

GIB = 2**30


def micro_batch_choices(
    trie, *, token_budget: int | None, block_tokens: int, cost_model=None, memory_limit: float | None = None
) -> list[dict]:
    """The micro-batches ``"auto"`` runs ``trie`` as
    (:func:`~treeattn_lab.engine.call_plan.auto_micro_batches`: the budget's cuts, neighbouring dfs ones
    joined, under ``memory_limit`` each dfs one in its block size) and, per micro-batch, the cost model's
    predictions ``{mode: (seconds, bytes)}``, the mode ``"auto"`` runs it in and its DFS block size."""
    from ...engine import CostModel
    from ...engine.call_plan import auto_micro_batches

    cost_model = cost_model or CostModel()
    rows = []
    planned = auto_micro_batches(trie, block_tokens, token_budget, cost_model, memory_limit)
    for j, (mb, predictions) in enumerate(planned):
        rows.append(
            {
                "micro_batch": j,
                "sequences": mb.sequences,
                "flat_tokens": mb.flat_tokens,
                "tree_tokens": mb.tree_tokens,
                "carried_tokens": mb.carried_tokens,
                "choice": mb.mode,
                "block_tokens": mb.dfs_block_tokens(block_tokens),
                "predicted": predictions,
                "calibrated": cost_model.calibrated,
            }
        )
    return rows


def micro_batch_colors(trie, rows: Sequence[Mapping]) -> dict[int, str]:
    """``{node: label}`` for :func:`~.tries.draw_trie`'s ``color_by``: each node labelled by the
    micro-batch (and its mode) whose rollouts pass through it; a prefix that several micro-batches
    compute (carried across a cut) is labelled as shared."""
    owners: dict[int, set[int]] = {}
    for r in rows:
        for i in r["sequences"]:
            for node in trie.path(trie.seq_end_node[i]):
                owners.setdefault(node, set()).add(r["micro_batch"])
    width = len(str(len(rows) - 1))
    label = {r["micro_batch"]: f"{r['micro_batch']:0{width}d}: {r['choice']}" for r in rows}
    return {n: label[next(iter(o))] if len(o) == 1 else "shared prefix (carried)" for n, o in owners.items()}


def draw_micro_batches(trie, rows: Sequence[Mapping], *, title: str | None = None, max_nodes: int = 400):
    """The trie with every node coloured by its micro-batch and the mode chosen for it."""
    modes = [r["choice"] for r in rows]
    counts = ", ".join(f"{modes.count(m)} {m}" for m in ("flat", "packed", "dfs") if m in modes)
    head = title or "Micro-batches and the cost model's choices"
    return draw_trie(
        trie,
        color_by=micro_batch_colors(trie, rows),
        max_nodes=max_nodes,
        title=f"{head} ({len(rows)} micro-batches: {counts})",
    )


def draw_micro_batch_table(rows: Sequence[Mapping]) -> go.Figure:
    """The micro-batches as a table: sizes, predicted time (and memory, when calibrated) per mode, choice
    (a dfs one with its block size)."""
    if not rows:
        raise ValueError("rows is empty")
    modes = list(rows[0]["predicted"])
    header = ["micro-batch", "rollouts", "flat tokens", "tree tokens", "carried"]
    header += [f"{m} ms" for m in modes]
    calibrated = rows[0]["calibrated"]
    if calibrated:
        header += [f"{m} GiB" for m in modes]
    header.append("choice")
    cols = [
        [r["micro_batch"] for r in rows],
        [len(r["sequences"]) for r in rows],
        [r["flat_tokens"] for r in rows],
        [r["tree_tokens"] for r in rows],
        [r["carried_tokens"] for r in rows],
    ]
    cols += [[f"{r['predicted'][m][0] * 1e3:.1f}" for r in rows] for m in modes]
    if calibrated:
        cols += [[f"{r['predicted'][m][1] / GIB:.1f}" for r in rows] for m in modes]
    chosen = [f"{r['choice']} @ {r['block_tokens']}" if r["choice"] == "dfs" else r["choice"] for r in rows]
    cols.append([f"<b>{c}</b>" for c in chosen])
    height = 70 + 24 * (len(rows) + 1)
    return table_figure(header, cols, height=height, header_align="right", cell_align="right")


__all__ = ["draw_micro_batch_table", "draw_micro_batches", "micro_batch_choices", "micro_batch_colors"]
