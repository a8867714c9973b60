"""Plotly drawings shared by the notebooks, one module per subject; every name is importable from here.

Every drawing is pure: it takes data, returns a ``plotly.graph_objects.Figure`` and never calls
``.show()``. Display the figure yourself (a notebook shows the last expression of a cell), wrap it in
``go.FigureWidget(fig)`` to update it from an ipywidgets control, or, to watch a loop fill it, in
:class:`LiveFigure`: ``with LiveFigure(fig) as widget:`` shows a widget to update in the loop and
leaves a static figure of its final state in the notebook.

========================  ==========================================================================
module                    what it draws
========================  ==========================================================================
:mod:`.tries`             a rollout trie as a tidy layered tree (highlight a rollout, colour by category)
:mod:`.stats`             ``trie.stats()`` of several data sets as bars and as a table
:mod:`.masks`             bool attention masks as heatmaps; the flat per-sequence causal mask
:mod:`.tiles`             the tree kernel's tile schedule (skipped / full / partial) over the mask
:mod:`.dfs`               the DFS engine event by event: blocks, K/V stack, gradient buffers
:mod:`.engine_modes`      flat / packed / dfs side by side: tokens held, peak memory, gradient errors
:mod:`.step_profile`      where a step's time goes: aten ops, kernel launches, ops per call, GPU busy / idle
:mod:`.micro_batches`     a trie cut into micro-batches, with the cost model's choice per micro-batch
:mod:`.balance`           partitions over ranks, their loads, sweeps over K, a measured step per rank
:mod:`.sparse_patterns`   attention maps, vertical-slash patterns and their recall
:mod:`.dilation`          the RAT+ experiment: loss above dense per dilation, per window, per model
:mod:`.sparse_training`   the sparse-training experiment: loss curves, retrieval by depth, time
:mod:`.ring`              sparse ring attention: who computes which tile, work per (rank, step)
:mod:`.gpu_timeline`      a profiled run: kernels and NCCL transfers per stream over time
:mod:`.bench`             benchmark result files and figures (tree, train, sparse; live speed sweeps)
:mod:`.rl`                a sampled GRPO batch's trie with text, live reward and time panels, phase times
:mod:`.live`              :class:`LiveFigure`: a figure updated live while a loop runs, saved complete
:mod:`.style`             the shared colours, colour scales, legend entries and tables
========================  ==========================================================================
"""

from .balance import (
    REPLICATED,
    draw_balance_sweep,
    draw_partition,
    draw_rank_loads,
    draw_rank_timeline,
    rank_colors,
)
from .bench import (
    add_speed_point,
    draw_backend_times,
    draw_bench_summary,
    draw_sparse_bench,
    draw_speed_sweep,
    draw_train_bench,
    load_bench_results,
    load_calibrated_train_results,
)
from .dfs import STATE_COLORS, STATE_LABELS, draw_dfs_step, draw_dfs_timeline, restyle_dfs_step
from .dilation import MODEL_COLORS, draw_dilation_results
from .engine_modes import (
    draw_gradient_errors,
    draw_held_tokens,
    draw_mode_memory,
    held_tokens,
    host_rss_rise,
    mode_memory_rows,
)
from .gpu_timeline import FAMILY_COLORS, draw_gpu_timeline
from .live import LiveFigure
from .masks import draw_mask, draw_masks_side_by_side, flat_causal_mask
from .micro_batches import draw_micro_batch_table, draw_micro_batches, micro_batch_choices, micro_batch_colors
from .ring import draw_layouts, draw_ring_work
from .rl import (
    LOOP_COLORS,
    add_grpo_record,
    draw_greedy_gains,
    draw_grpo_live,
    draw_learner_parts,
    draw_phase_times,
    draw_reward_curves,
    draw_sampled_trie,
    draw_seconds_by_tokens,
)
from .sparse_patterns import draw_attention_maps, draw_pattern, draw_recall
from .sparse_training import draw_retrieval_by_depth, draw_training_curves, draw_training_times
from .stats import draw_stats_bars, draw_stats_table
from .step_profile import committed_profile_rows, draw_step_profile, model_calls, with_model_calls
from .style import (
    BACKEND_COLORS,
    DIMMED_COLOR,
    EDGE_COLOR,
    HIGHLIGHT_COLOR,
    MASK_COLORSCALE,
    MODE_COLORS,
    NODE_COLOR,
    PALETTE,
    ROOT_COLOR,
)
from .tiles import TILE_FULL, TILE_NAMES, TILE_PARTIAL, TILE_SKIPPED, draw_tile_schedule, tile_classes
from .tries import bfs_nodes, draw_trie, node_size, tree_layout

__all__ = [
    "BACKEND_COLORS",
    "DIMMED_COLOR",
    "EDGE_COLOR",
    "FAMILY_COLORS",
    "HIGHLIGHT_COLOR",
    "LOOP_COLORS",
    "MASK_COLORSCALE",
    "MODEL_COLORS",
    "MODE_COLORS",
    "NODE_COLOR",
    "PALETTE",
    "REPLICATED",
    "ROOT_COLOR",
    "STATE_COLORS",
    "STATE_LABELS",
    "TILE_FULL",
    "TILE_NAMES",
    "TILE_PARTIAL",
    "TILE_SKIPPED",
    "LiveFigure",
    "add_grpo_record",
    "add_speed_point",
    "bfs_nodes",
    "committed_profile_rows",
    "draw_attention_maps",
    "draw_backend_times",
    "draw_balance_sweep",
    "draw_bench_summary",
    "draw_dfs_step",
    "draw_dfs_timeline",
    "draw_dilation_results",
    "draw_gpu_timeline",
    "draw_gradient_errors",
    "draw_grpo_live",
    "draw_held_tokens",
    "draw_layouts",
    "draw_mask",
    "draw_masks_side_by_side",
    "draw_micro_batch_table",
    "draw_micro_batches",
    "draw_mode_memory",
    "draw_partition",
    "draw_pattern",
    "draw_phase_times",
    "draw_learner_parts",
    "draw_reward_curves",
    "draw_greedy_gains",
    "draw_seconds_by_tokens",
    "draw_rank_loads",
    "draw_rank_timeline",
    "draw_recall",
    "draw_retrieval_by_depth",
    "draw_ring_work",
    "draw_sampled_trie",
    "draw_sparse_bench",
    "draw_speed_sweep",
    "draw_stats_bars",
    "draw_stats_table",
    "draw_step_profile",
    "draw_tile_schedule",
    "draw_train_bench",
    "draw_training_curves",
    "draw_training_times",
    "draw_trie",
    "flat_causal_mask",
    "held_tokens",
    "host_rss_rise",
    "load_bench_results",
    "load_calibrated_train_results",
    "micro_batch_choices",
    "micro_batch_colors",
    "mode_memory_rows",
    "model_calls",
    "node_size",
    "rank_colors",
    "restyle_dfs_step",
    "tile_classes",
    "tree_layout",
    "with_model_calls",
]
