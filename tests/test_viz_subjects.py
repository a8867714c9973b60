"""The lab's drawings by subject: the package layout, the shared style helpers, and the drawings of
partitions, sparse patterns and ring layouts checked against the data they draw."""

from __future__ import annotations

import importlib
import pkgutil

import pytest
import torch

go = pytest.importorskip("plotly.graph_objects")

from treeattn_lab import RolloutTrie  # noqa: E402
from treeattn_lab.distributed import balance as bal  # noqa: E402
from treeattn_lab.distributed.layouts import block_owner  # noqa: E402
from treeattn_lab.distributed.simulate import simulate  # noqa: E402
from treeattn_lab.lab import viz  # noqa: E402
from treeattn_lab.lab.viz import style  # noqa: E402
from treeattn_lab.patterns.vertical_slash import VerticalSlashPattern  # noqa: E402

SUBJECTS = [m.name for m in pkgutil.iter_modules(viz.__path__)]


def test_every_public_drawing_is_importable_from_the_package_and_lives_in_one_subject():
    homes: dict[str, list[str]] = {}
    for name in SUBJECTS:
        module = importlib.import_module(f"treeattn_lab.lab.viz.{name}")
        doc = (module.__doc__ or "").strip()
        assert len(doc) > 40, f"viz.{name} says nothing of what it draws"
        for public in getattr(module, "__all__", []):
            homes.setdefault(public, []).append(name)
    twice = {n: m for n, m in homes.items() if len(m) > 1}
    assert not twice, f"names defined in several subjects: {twice}"
    drawings = {n for n in homes if n.startswith(("draw_", "restyle_", "add_"))}
    missing = drawings - set(viz.__all__)
    assert not missing, f"drawings missing from treeattn_lab.lab.viz: {missing}"
    for public in viz.__all__:
        assert getattr(viz, public) is not None


def test_stepped_colorscale_gives_each_value_its_own_colour():
    colors = ["#000000", "#111111", "#222222"]
    scale = style.stepped_colorscale(colors)
    assert scale[0] == [0.0, "#000000"] and scale[-1] == [1.0, "#222222"]
    for i, color in enumerate(colors):  # value i of zmin=-0.5, zmax=2.5 sits mid-band (i + 0.5) / 3
        mid = (i + 0.5) / len(colors)
        band = [c for (lo, c), (hi, _) in zip(scale[::2], scale[1::2], strict=True) if lo <= mid <= hi]
        assert band == [color]


def test_legend_entry_draws_no_point():
    entry = style.legend_entry("full", dict(color="#54A24B", size=9), showlegend=True)
    assert entry.x == (None,) and entry.y == (None,) and entry.marker.color == "#54A24B" and entry.showlegend


ROLLOUTS = [[1, 2, 3, 4, 5], [1, 2, 3, 6], [1, 2, 7, 8, 9], [10, 11, 12], [10, 11, 13, 14], [15, 16]]


def test_partition_drawing_colours_every_node_by_its_rank():
    trie = RolloutTrie.from_sequences(ROLLOUTS)
    report = bal.balance(trie, 2, "greedy_tokens")
    colors = viz.rank_colors(trie, report)
    assert set(colors) == set(range(1, trie.num_nodes + 1))
    for node, ranks in report.node_ranks(trie).items():
        assert colors[node] == (viz.REPLICATED if len(ranks) > 1 else f"rank {ranks[0]}")
    fig = viz.draw_partition(trie, report)
    legend = {t.name for t in fig.data if t.showlegend}
    assert legend == set(colors.values())
    loads = viz.draw_rank_loads({"greedy": report})
    assert list(loads.data[0].y) == list(report.costs)


def test_balance_sweep_has_one_line_per_set_and_partitioner():
    rows = [
        {"set": s, "partitioner": p, "num_ranks": k, "imbalance": 1.0 + k / 100 + (p == "b")}
        for s in ("x", "y") for p in ("a", "b") for k in (4, 2, 8)
    ]  # fmt: skip
    fig = viz.draw_balance_sweep(rows, "imbalance")
    assert len(fig.data) == 4 and sum(t.showlegend for t in fig.data) == 2
    line = next(t for t in fig.data if t.name == "b" and t.xaxis == "x2")
    assert list(line.x) == [2, 4, 8] and list(line.y) == [2.02, 2.04, 2.08]


def test_rank_timeline_scales_the_prediction_to_the_measured_makespan():
    timeline = [
        {"rank": r, "compute_s": c, "wait_s": 0.3 - c, "reduce_s": 0.05, "predicted": p, "unit": "s"}
        for r, (c, p) in enumerate([(0.3, 2.0), (0.2, 1.0)])
    ]
    fig = viz.draw_rank_timeline(timeline)
    predicted = next(t for t in fig.data if t.name == "predicted (scaled)")
    assert list(predicted.x) == pytest.approx([0.3, 0.15])
    assert [t.name for t in fig.data[:3]] == ["compute", "wait", "all-reduce"]


def test_pattern_drawing_shows_the_lines_and_the_computed_pairs():
    pattern = VerticalSlashPattern(torch.tensor([[0, 5]]), torch.tensor([[0, 1, 20]]), block_size=16)
    fig = viz.draw_pattern(pattern, 40)
    lines, computed = (torch.as_tensor(t.z) for t in fig.data)
    assert torch.equal(lines.bool(), pattern.line_mask(40)[0])
    assert torch.equal(computed.bool(), pattern.dense_mask(40)[0])


def test_layouts_colour_each_selected_tile_by_its_query_blocks_owner():
    pattern = VerticalSlashPattern(torch.tensor([[0]]), torch.tensor([[0, 40]]), block_size=16)
    n, world = 128, 4
    fig = viz.draw_layouts(pattern, n, world, ["contiguous", "striped"])
    tiles = pattern.block_map(n)[0]
    for i, layout in enumerate(("contiguous", "striped")):
        owner = block_owner(layout, tiles.shape[0], world).float()
        strip, tile_map = torch.as_tensor(fig.data[2 * i].z[0]), torch.as_tensor(fig.data[2 * i + 1].z)
        assert torch.equal(strip, owner)
        assert torch.equal(tile_map.isnan(), ~tiles)
        assert torch.equal(tile_map[tiles], owner[:, None].expand_as(tile_map)[tiles])


def test_ring_work_bars_are_the_imbalances():
    pattern = VerticalSlashPattern(torch.tensor([[0, 3]]), torch.tensor([[0, 17]]), block_size=16)
    works = {layout: simulate(pattern, 256, 4, layout) for layout in ("contiguous", "striped")}
    fig = viz.draw_ring_work(works)
    bars = {t.name: list(t.y) for t in fig.data if t.type == "bar"}
    assert bars["worker-level"] == [works[n].worker_imbalance() for n in works]
    assert bars["step-level"] == [works[n].step_imbalance() for n in works]


def test_sparse_bench_draws_every_backend_but_dense():
    rows = [
        {"case": c, "backend": b, "fwd_speedup": s, "fwd_bwd_speedup": s / 2}
        for c in ("32K", "128K") for b, s in (("triton", 3.0), ("flex", 0.5))
    ] + [{"case": "32K", "backend": "dense", "fwd_speedup": 1.0, "fwd_bwd_speedup": 1.0}]  # fmt: skip
    fig = viz.draw_sparse_bench(rows)
    assert sorted({t.name for t in fig.data}) == ["flex", "triton"]
    with pytest.raises(ValueError, match="no timed rows"):
        viz.draw_sparse_bench([{"case": "x", "backend": "dense"}])
