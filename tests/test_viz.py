"""Fast unit tests of the notebook drawings in treeattn_lab.lab.viz."""

from __future__ import annotations

import random

import networkx as nx
import plotly.graph_objects as go
import pytest
import torch

from treeattn_lab import RolloutTrie
from treeattn_lab.lab import viz
from treeattn_lab.lab.viz import style

SEQS = [[1, 2, 3, 4], [1, 2, 5], [1, 2, 5, 6], [7, 8], [1, 2, 5, 6]]


@pytest.fixture
def trie():
    return RolloutTrie.from_sequences(SEQS)


def _trace(fig: go.Figure, name: str):
    found = [t for t in fig.data if t.name == name]
    assert len(found) == 1, [t.name for t in fig.data]
    return found[0]


def _big_trie(n_seqs=1500, seed=0) -> RolloutTrie:
    rng = random.Random(seed)
    seqs = [[rng.randrange(30) for _ in range(rng.randrange(1, 12))] for _ in range(n_seqs)]
    return RolloutTrie.from_sequences(seqs)


# ------------------------------------------------------------------------------------ draw_trie
def test_draw_trie_traces_and_node_count(trie):
    fig = viz.draw_trie(trie)
    assert isinstance(fig, go.Figure)
    nodes = _trace(fig, "nodes")
    edges = _trace(fig, "edges")
    assert len(nodes.x) == len(trie.nodes)  # every node plus the root
    assert sorted(nodes.customdata) == list(range(len(trie.nodes)))
    # one segment (3 entries: start, end, None) per parent -> child edge
    assert len(edges.x) == 3 * (len(trie.nodes) - 1)
    assert "showing" not in fig.layout.title.text


def test_draw_trie_hover_has_token_count_range_and_ends(trie):
    fig = viz.draw_trie(trie)
    nodes = _trace(fig, "nodes")
    for node_id, text in zip(nodes.customdata, nodes.text, strict=True):
        n = trie.nodes[node_id]
        if node_id == 0:
            assert "root" in text
            continue
        assert f"node {node_id}" in text
        assert f"tokens: {len(n.tokens)}" in text
        assert f"positions: {n.depth}..{n.end_depth - 1}" in text
        for e in n.ends:
            assert str(e) in text.split("sequences ending here:")[1]
    # the node where sequences 2 and 4 (identical) end lists both
    end = trie.seq_end_node[2]
    text = nodes.text[list(nodes.customdata).index(end)]
    assert "sequences ending here: 2, 4" in text


def test_draw_trie_marker_size_grows_with_tokens():
    trie = RolloutTrie.from_sequences([[1] * 40, [2]])
    nodes = _trace(viz.draw_trie(trie), "nodes")
    size = dict(zip(nodes.customdata, nodes.marker.size, strict=True))
    long_node, short_node = trie.seq_end_node
    assert size[long_node] > size[short_node]
    assert viz.node_size(4) == pytest.approx(viz.node_size(1) + (viz.node_size(9) - viz.node_size(4)))


def test_draw_trie_layout_is_layered_and_tidy(trie):
    nodes = _trace(viz.draw_trie(trie), "nodes")
    y = dict(zip(nodes.customdata, nodes.y, strict=True))
    x = dict(zip(nodes.customdata, nodes.x, strict=True))
    g = trie.to_networkx()
    for node, depth in nx.shortest_path_length(g, 0).items():
        assert y[node] == -depth
    for node in g.nodes:
        kids = list(g.successors(node))
        if kids:
            assert min(x[k] for k in kids) <= x[node] <= max(x[k] for k in kids)
    leaves_x = sorted(x[n] for n in trie.leaves())
    assert leaves_x == list(range(len(leaves_x)))


def test_tree_layout_handles_deep_chains():
    g = nx.DiGraph()
    nx.add_path(g, range(5000))
    pos = viz.tree_layout(g, 0)
    assert pos[4999] == (0.0, -4999.0)


def test_draw_trie_highlight_changes_colours(trie):
    plain = _trace(viz.draw_trie(trie), "nodes")
    path = trie.path(trie.seq_end_node[2])
    fig = viz.draw_trie(trie, highlight=path)
    lit = _trace(fig, "nodes")
    assert list(plain.marker.color) != list(lit.marker.color)
    colour = dict(zip(lit.customdata, lit.marker.color, strict=True))
    assert all(colour[n] == viz.HIGHLIGHT_COLOR for n in path)
    assert all(colour[n] != viz.HIGHLIGHT_COLOR for n in colour if n not in path)
    hi_edges = _trace(fig, "highlighted edges")
    assert len(hi_edges.x) == 3 * len(path)  # root -> first node, then along the path
    with pytest.raises(ValueError, match="highlight"):
        viz.draw_trie(trie, highlight=[999])


def test_draw_trie_color_by_adds_legend_entries(trie):
    cats = {n: ("short" if len(trie.nodes[n].tokens) < 2 else "long") for n in range(1, len(trie.nodes))}
    fig = viz.draw_trie(trie, color_by=cats)
    nodes = _trace(fig, "nodes")
    colour = dict(zip(nodes.customdata, nodes.marker.color, strict=True))
    short = [n for n, c in cats.items() if c == "short"]
    long = [n for n, c in cats.items() if c == "long"]
    assert len({colour[n] for n in short}) == 1 and len({colour[n] for n in long}) == 1
    assert colour[short[0]] != colour[long[0]]
    legend = {t.name for t in fig.data if t.showlegend}
    assert legend == {"short", "long"}


def test_draw_trie_truncates_big_tries_by_bfs():
    big = _big_trie()
    assert big.num_nodes > 300
    fig = viz.draw_trie(big, max_nodes=100, title="big", max_leaves=None)  # every drawn leaf single
    nodes = _trace(fig, "nodes")
    assert len(nodes.x) == 101  # the root plus 100 nodes
    assert set(nodes.customdata) == set(viz.bfs_nodes(big.to_networkx(), 0, limit=101))
    assert f"showing the first 100 of {big.num_nodes} nodes" in fig.layout.title.text
    assert fig.layout.title.text.startswith("big")
    assert any("not drawn" in t for t in nodes.text)
    with pytest.raises(ValueError):
        viz.draw_trie(big, max_nodes=0)


def test_draw_trie_bundles_sibling_leaves_of_a_wide_trie_but_keeps_the_highlight():
    # one prompt, 60 answers of different lengths: 60 sibling leaves
    trie = RolloutTrie.from_sequences([[1, 2, 3] + [10 + i] * (1 + i % 7) for i in range(60)])
    leaves = [n for n in trie.leaves()]
    path = trie.path(trie.seq_end_node[7])
    fig = viz.draw_trie(trie, highlight=path, max_leaves=20)
    nodes, bundles = _trace(fig, "nodes"), _trace(fig, "bundled leaves")
    assert len(bundles.x) == 1 and sorted(bundles.customdata[0]) == sorted(set(leaves) - set(path))
    assert bundles.text[0] == f"x{len(leaves) - 1}"
    assert set(nodes.customdata) == {0, *path}  # the highlighted leaf is still drawn on its own
    assert list(nodes.customdata)[-len(path) :] == sorted(path, key=list(nodes.customdata).index)  # on top
    assert "59 in all" in fig.layout.title.text
    # every node's token count is still in the hover of its bundle's members
    assert (
        f"tokens: {sum(len(trie.nodes[n].tokens) for n in bundles.customdata[0])} in all"
        in bundles.hovertext[0]
    )
    # narrow enough: nothing bundled
    assert not [t for t in viz.draw_trie(trie, max_leaves=60).data if t.name == "bundled leaves"]
    with pytest.raises(ValueError, match="max_leaves"):
        viz.draw_trie(trie, max_leaves=0)


def test_draw_trie_markers_fit_the_room_of_a_leaf():
    # 100 sibling leaves of 1,000 tokens each: unscaled markers would be about 77 px wide and overlap
    trie = RolloutTrie.from_sequences([[1, 2] + [100 + i] * 1000 for i in range(100)])
    nodes = _trace(viz.draw_trie(trie, max_leaves=None), "nodes")
    assert max(nodes.marker.size) <= 0.9 * 860 / 100 + 1e-9
    size = dict(zip(nodes.customdata, nodes.marker.size, strict=True))
    assert size[trie.seq_end_node[0]] > size[1]  # a 1,000-token leaf against the 2-token prompt
    assert viz.draw_trie(trie).layout.width is None  # the figure takes the output area's width


# ------------------------------------------------------------------------------ trie labels
def test_trie_label_forms():
    from treeattn_lab.lab.viz import trie_labels

    counts = (7, 999, 1000, 1234, 9949, 9951, 12345, 999_499, 2_500_000)
    assert [trie_labels.count_label(n) for n in counts] == [
        "7", "999", "1.0K", "1.2K", "9.9K", "10K", "12K", "999K", "2.5M"]
    assert trie_labels.tokens_label([1, 2, 3], full=False) == "1 2 3"
    assert trie_labels.tokens_label([1, 2, 3, 4, 5], full=False) == "1 2 … 5"
    assert trie_labels.tokens_label([1, 2, 3, 4, 5], full=True) == "1 2 3 4 5"
    assert trie_labels.ends_labels([]) == []
    assert trie_labels.ends_labels([5]) == ["r5"]
    assert trie_labels.ends_labels([5, 0]) == ["r0,5", "r0…"]
    assert trie_labels.ends_labels([3, 4, 5, 6, 7]) == ["r3-7", "r3…"]


def _label_boxes(fig):
    """Every label of a trie drawing as a pixel box ``(x0, x1, y0, y1, text)``, at the plot width the
    drawing assumes and the height it sets; generous text widths (``trie_labels.text_px``)."""
    from treeattn_lab.lab.viz import trie_labels, tries

    (x_lo, x_hi), (y_lo, y_hi) = fig.layout.xaxis.range, fig.layout.yaxis.range
    plot_h = fig.layout.height - fig.layout.margin.t - fig.layout.margin.b
    boxes = []
    for trace in fig.data:
        if trace.name not in ("node labels", "rollout labels") or not trace.text:
            continue
        spots = trace.textposition if isinstance(trace.textposition, tuple) else [trace.textposition] * len(
            trace.text)
        for x, y, text, spot in zip(trace.x, trace.y, trace.text, spots, strict=True):
            px = (x - x_lo) / (x_hi - x_lo) * tries.PLOT_WIDTH_PX
            py = (y - y_lo) / (y_hi - y_lo) * plot_h
            w, h = trie_labels.text_px(text), (trie_labels.LABEL_FONT_PX + 2) * (text.count("<br>") + 1)
            left = px if spot == "middle right" else px - w / 2
            bottom = {"middle right": py - h / 2, "top center": py, "bottom center": py - h}[spot]
            boxes.append((left, left + w, bottom, bottom + h, text))
    return boxes


def _overlaps(boxes):
    return [(a[4], b[4]) for i, a in enumerate(boxes) for b in boxes[i + 1 :]
            if a[0] < b[1] - 1 and b[0] < a[1] - 1 and a[2] < b[3] - 1 and b[2] < a[3] - 1]


def test_draw_trie_labels_a_small_trie_with_its_tokens_and_rollouts():
    rollouts = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 8, 9], [1, 2, 3, 4, 10, 11],
                [1, 2, 3, 4, 10, 11, 12], [1, 2, 3, 4, 10, 13, 14], [1, 2, 3, 4, 5, 6, 7]]
    trie = RolloutTrie.from_sequences(rollouts)
    fig = viz.draw_trie(trie, highlight=trie.path(trie.seq_end_node[1]))
    beside = set(_trace(fig, "node labels").text)
    below = set(_trace(fig, "rollout labels").text)
    assert {"1 2 3 4", "5 6", "7", "8 9", "10", "11 · r2", "12", "13 14"} == beside
    assert {"r0,5", "r1", "r3", "r4"} == below  # rollout 2 ends on a node with a child: named beside it
    assert not _overlaps(_label_boxes(fig))
    assert all(not t.showlegend for t in fig.data if t.name in ("node labels", "rollout labels"))


@pytest.mark.parametrize("name", ["grpo_math", "agentic", "tree_search", "low_sharing"])
def test_the_bundled_sets_are_labelled_without_overlaps(name):
    from treeattn_lab.datasets import load_trie

    trie = load_trie(name)
    fig = viz.draw_trie(trie)
    boxes = _label_boxes(fig)
    assert not _overlaps(boxes)
    texts = [b[4] for b in boxes]
    drawn_leaves = len(_trace(fig, "nodes").customdata) - 1 - (trie.num_nodes - len(trie.leaves()))
    bundles = [t for t in fig.data if t.name == "bundled leaves"]
    assert sum(t.startswith("r") or t.startswith("x") for t in texts) == drawn_leaves + sum(
        len(b.x) for b in bundles)  # every leaf and bundle named below it
    from treeattn_lab.lab.viz.trie_labels import count_label

    nodes = _trace(fig, "nodes").customdata
    inner = {count_label(len(trie.nodes[n].tokens)) for n in nodes if n and trie.nodes[n].children}
    assert inner <= set(_trace(fig, "node labels").text)  # big nodes: labelled by their token count
    assert len(_trace(fig, "node labels").text) >= sum(1 for n in nodes if n and trie.nodes[n].children)


def test_a_crowded_row_of_leaves_is_labelled_on_two_levels():
    from treeattn_lab.datasets import load_trie
    from treeattn_lab.distributed import balance as bal

    trie = load_trie("tree_search")
    fig = viz.draw_partition(trie, bal.balance(trie, 8, "greedy_tokens"))  # ranks split the sibling leaves
    rollouts = _trace(fig, "rollout labels")
    assert len(set(rollouts.y)) > len({round(y) for y in rollouts.y})  # a second level below some row
    assert not _overlaps(_label_boxes(fig))


# ------------------------------------------------------------------------------------ masks
def test_draw_mask_shape_and_values(trie):
    mask = trie.pack().visibility_mask()
    fig = viz.draw_mask(mask, title="tree")
    (heat,) = fig.data
    assert isinstance(heat, go.Heatmap)
    z = [list(r) for r in heat.z]
    assert len(z) == mask.shape[0] and all(len(r) == mask.shape[1] for r in z)
    assert z == mask.int().tolist()
    assert fig.layout.yaxis.autorange == "reversed"  # row 0 on top, like a matrix
    assert fig.layout.xaxis.title.text == "key" and fig.layout.yaxis.title.text == "query"


def test_draw_mask_rejects_non_2d():
    with pytest.raises(ValueError):
        viz.draw_mask(torch.ones(4, dtype=torch.bool))


def test_flat_causal_mask_is_block_diagonal():
    m = viz.flat_causal_mask([2, 3])
    rows = [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]]
    expected = torch.tensor(rows, dtype=torch.bool)
    assert torch.equal(m, expected)


def test_draw_masks_side_by_side(trie):
    tree = trie.pack().visibility_mask()
    flat = viz.flat_causal_mask(trie.seq_lengths)
    fig = viz.draw_masks_side_by_side({"packed tree": tree, "flat per-sequence": flat})
    assert len(fig.data) == 2 and all(isinstance(t, go.Heatmap) for t in fig.data)
    assert len(fig.data[0].z) == tree.shape[0]
    assert len(fig.data[1].z) == sum(trie.seq_lengths)
    titles = [a.text for a in fig.layout.annotations]
    assert titles[0].startswith("packed tree") and f"{int(tree.sum())} pairs" in titles[0]
    assert titles[1].startswith("flat per-sequence") and f"{int(flat.sum())} pairs" in titles[1]
    # the pair counts are exactly the stats' attention pairs
    s = trie.stats()
    assert int(tree.sum()) == s["tree_attention_pairs"] and int(flat.sum()) == s["flat_attention_pairs"]


# ------------------------------------------------------------------------------------ stats
def test_draw_stats_bars_grouped(trie):
    stats = {"a": trie.stats(), "b": _big_trie(200).stats()}
    fig = viz.draw_stats_bars(stats)
    assert fig.layout.barmode == "group"
    bars = [t for t in fig.data if isinstance(t, go.Bar)]
    assert [b.name for b in bars] == ["token_ratio", "ideal_attention_ratio"]
    assert list(bars[0].x) == ["a", "b"]
    assert list(bars[0].y) == pytest.approx([stats["a"]["token_ratio"], stats["b"]["token_ratio"]])
    with pytest.raises(KeyError):
        viz.draw_stats_bars(stats, keys=("nope",))


def test_draw_stats_table(trie):
    fig = viz.draw_stats_table({"a": trie.stats()}, keys=["num_sequences", "token_ratio"])
    (table,) = fig.data
    assert list(table.header.values) == ["statistic", "a"]
    assert list(table.cells.values[0]) == ["num_sequences", "token_ratio"]
    assert list(table.cells.values[1]) == ["5", f"{trie.stats()['token_ratio']:.2f}"]


# ------------------------------------------------------------------------------------ tile schedule
def _branching_pack(roots=2, prompt=48, fan=4, resp=24):
    from treeattn_lab.bench.tree import branching_rollouts

    return RolloutTrie.from_sequences(branching_rollouts(roots, prompt, [(fan, resp)])).pack()


@pytest.mark.parametrize(("bm", "bn"), [(16, 16), (16, 32), (32, 16)])
def test_tile_classes_agree_with_the_mask(bm, bn):
    pack = _branching_pack()
    mask = pack.visibility_mask()
    cls, sched = viz.tile_classes(pack, bm, bn)
    T = pack.num_tokens
    assert cls.shape == (-(-T // bm), -(-T // bn))
    for i in range(cls.shape[0]):
        for j in range(cls.shape[1]):
            block = mask[i * bm : (i + 1) * bm, j * bn : (j + 1) * bn]
            c = int(cls[i, j])
            if c == viz.TILE_SKIPPED:
                assert not block.any()
            elif c == viz.TILE_FULL:
                assert block.all() and block.shape == (bm, bn)
            else:
                assert block.any() or block.shape != (bm, bn)
    assert int((cls == viz.TILE_FULL).sum()) == sched["full_tiles"]
    assert int((cls == viz.TILE_PARTIAL).sum()) == sched["partial_tiles"]


def test_draw_tile_schedule_small_pack_draws_mask_and_tiles():
    pack = _branching_pack()
    fig = viz.draw_tile_schedule(pack, 16, 16, title="toy")
    meta = fig.layout.meta
    cls, _ = viz.tile_classes(pack, 16, 16)
    assert meta["total"] == cls.numel() and meta["group"] == 1
    assert meta["skipped"] == int((cls == 0).sum()) > 0
    assert meta["skipped"] + meta["full"] + meta["partial"] == meta["total"]
    assert fig.data[0].name == "element mask" and len(fig.data[0].z) == pack.num_tokens
    tiles = _trace(fig, "tiles")
    assert [list(r) for r in tiles.z] == cls.tolist()
    assert tiles.dx == 16 and tiles.dy == 16
    legend = [t.name for t in fig.data if isinstance(t, go.Scatter)]
    assert len(legend) == 3 and legend[0].startswith(f"skipped: {meta['skipped']} tiles")
    assert fig.layout.title.text.startswith("toy") and "skipped" in fig.layout.title.text
    assert "full" in tiles.text[1][0] and "partial" in tiles.text[0][0]


def test_draw_tile_schedule_big_pack_draws_tiles_only_grouped():
    pack = _branching_pack(roots=4, prompt=200, fan=8, resp=100)  # T = 4000
    fig = viz.draw_tile_schedule(pack, 16, 16, max_tokens=512, max_cells=64)
    names = [t.name for t in fig.data]
    assert "element mask" not in names
    tiles = _trace(fig, "tiles")
    group = fig.layout.meta["group"]
    n = -(-pack.num_tokens // 16)
    assert group == -(-n // 64) and len(tiles.z) == -(-n // group) <= 64
    assert tiles.dx == 16 * group
    # a group shows its most expensive tile: any partial tile inside makes it partial
    cls, _ = viz.tile_classes(pack, 16, 16)
    assert tiles.z[0][0] == int(cls[:group, :group].max())
    assert f"{group} x {group} tiles" in fig.layout.title.text


# ------------------------------------------------------------------------------------ benchmarks
def test_load_bench_results_and_summary():
    data = viz.load_bench_results("tree", "NVIDIA-H200")
    assert data["environment"]["device"] == "NVIDIA H200" and data["rows"]
    fig = viz.draw_bench_summary(data["rows"], title="H200")
    cases = list(dict.fromkeys(r["case"] for r in data["rows"]))
    speed = [t for t in fig.data if t.xaxis == "x"]
    assert {t.name for t in speed} == {"flex", "triton", "ideal"}
    assert all(list(t.x) == cases for t in speed)
    ideal = next(t for t in speed if t.name == "ideal")
    ideal_of = {r["case"]: r["ideal"] for r in data["rows"]}
    assert list(ideal.y) == pytest.approx([ideal_of[c] for c in cases])
    assert {t.name for t in fig.data if t.xaxis == "x2"} == {"flat", "flex", "triton"}
    with pytest.raises(FileNotFoundError):
        viz.load_bench_results("tree", "no-such-gpu")
    auto = viz.draw_bench_summary(data["rows"], backends=("flat", "triton", "auto"))
    assert {t.name for t in auto.data if t.xaxis == "x"} == {"triton", "auto", "ideal"}
    with pytest.raises(ValueError, match="no rows for backends"):
        viz.draw_bench_summary(data["rows"], backends=("flat", "cudnn"))


def test_speed_sweep_grows_point_by_point():
    fig = viz.draw_speed_sweep(["flat", "triton"])
    assert all(len(t.x) == 0 for t in fig.data)
    for x, ms in [(256, 2.0), (512, 3.0)]:
        viz.add_speed_point(fig, {"backend": "triton", "fwd_bwd_ms": ms, "fwd_bwd_tflops": 100.0 * ms}, x=x)
    lines = [t for t in fig.data if t.name == "triton"]
    assert {t.meta for t in lines} == {"fwd_bwd_ms", "fwd_bwd_tflops"}
    assert all(list(t.x) == [256, 512] for t in lines)
    assert list(next(t for t in lines if t.meta == "fwd_bwd_ms").y) == [2.0, 3.0]
    assert all(len(t.x) == 0 for t in fig.data if t.name == "flat")
    with pytest.raises(KeyError):
        viz.add_speed_point(fig, {"backend": "flex", "fwd_bwd_ms": 1.0, "fwd_bwd_tflops": 1.0}, x=1)


def test_speed_sweep_updates_a_figure_widget():
    pytest.importorskip("ipywidgets")
    pytest.importorskip("anywidget")
    widget = go.FigureWidget(viz.draw_speed_sweep(["flex"]))
    viz.add_speed_point(widget, {"backend": "flex", "fwd_bwd_ms": 1.5, "fwd_bwd_tflops": 300.0}, x=128)
    assert [list(t.y) for t in widget.data] == [[1.5], [300.0]]


# ------------------------------------------------------------------------------------ figures fit
def _assert_fits(fig: go.Figure) -> None:
    """No wider than the output area allows, and the top margin holds every line of the title."""
    width = fig.layout.width
    assert width is None or width <= style.MAX_FIGURE_WIDTH, width
    text = fig.layout.title.text or ""
    if text:
        lines = text.count("<br>") + 1
        assert fig.layout.margin.t >= 30 + 22 * lines, (fig.layout.margin.t, text)
        if width:  # each line short enough for the figure's width
            longest = max(len(part.replace("<sup>", "").replace("</sup>", "")) for part in text.split("<br>"))
            assert longest * 0.55 * 17 <= width * 1.45, text


def test_mask_drawings_fit_with_long_titles_and_many_panels():
    long = "The same pairs as one varlen batch: a bottom-right causal block per leaf, " * 2
    small = torch.ones(6, 6, dtype=torch.bool).tril()
    fig = viz.draw_mask(small, title=long)
    _assert_fits(fig)
    assert fig.layout.title.text.count("<br>") >= 1  # wrapped, not cut
    big = torch.ones(48, 48, dtype=torch.bool).tril()
    side_by_side = viz.draw_masks_side_by_side({"a": big, "b": big, "c": big}, title=long)
    _assert_fits(side_by_side)
    assert side_by_side.layout.width == style.MAX_FIGURE_WIDTH  # three 48-token masks: as wide as allowed


def test_sparse_and_ring_drawings_fit_and_name_their_colours():
    from treeattn_lab.distributed.simulate import simulate
    from treeattn_lab.patterns.vertical_slash import synthetic_pattern

    probs = torch.rand(6, 32, 32).tril().softmax(-1)
    maps = viz.draw_attention_maps(probs, [f"head {i}" for i in range(6)], title="six heads " * 20)
    _assert_fits(maps)
    assert sum(bool(t.showscale) for t in maps.data) == 1  # one colour bar, beside the maps (right margin)
    assert maps.layout.margin.r >= 80
    recall = viz.draw_recall([4, 16, 64], {"layer 0": [0.5, 0.8, 0.97]})
    assert list(recall.layout.xaxis.tickvals) == [4, 16, 64] and recall.layout.xaxis.exponentformat == "power"
    pattern = synthetic_pattern(1024, 2, n_vertical=8, n_slash=16, sinks=4, local=32, block_size=64, seed=0)
    layouts = viz.draw_layouts(pattern, 1024, world=4, layouts=["contiguous", "zigzag", "striped"])
    _assert_fits(layouts)
    assert {t.name for t in layouts.data if t.showlegend} == {f"rank {r}" for r in range(4)}
    works = {name: simulate(pattern, 1024, 4, name) for name in ("contiguous", "zigzag", "striped")}
    ring = viz.draw_ring_work(works)
    _assert_fits(ring)
    assert ring.layout.legend.orientation == "h"  # the bars' legend below, away from the colour bar


@pytest.mark.parametrize("limit", [None, 700])
def test_sparse_maps_fit_the_output_area_margins_and_colour_bar_included(monkeypatch, limit):
    """The maps, the pattern and the ring layouts of notebook 05 fit a ~900-px output area, shrink with
    MAX_FIGURE_WIDTH, and keep their maps square."""
    from treeattn_lab.lab.viz import sparse_patterns
    from treeattn_lab.patterns.vertical_slash import synthetic_pattern

    if limit is not None:
        monkeypatch.setattr(style, "MAX_FIGURE_WIDTH", limit)
    widest = min(style.MAX_FIGURE_WIDTH, 900)
    probs = torch.rand(6, 64, 64).tril().softmax(-1)
    maps = viz.draw_attention_maps(probs, [f"head {i}" for i in range(6)], title="six heads")
    pattern = synthetic_pattern(256, 2, n_vertical=8, n_slash=16, sinks=4, local=32, block_size=16, seed=0)
    drawn = viz.draw_pattern(pattern, 256)
    layouts = viz.draw_layouts(pattern, 256, world=4, layouts=["contiguous", "zigzag", "striped"])
    for fig in (maps, drawn, layouts):
        _assert_fits(fig)
        assert fig.layout.width <= widest
    m = maps.layout.margin
    side = (maps.layout.width - m.l - m.r) * (1 - 2 * sparse_patterns.SPACING) / 3
    assert maps.layout.height - m.t - m.b == pytest.approx(2 * side + 40, abs=1)  # two rows of square maps
    m = drawn.layout.margin
    side = (drawn.layout.width - m.l - m.r) * 0.94 / 2  # two maps, 0.06 of the plot width between them
    assert drawn.layout.height - m.t - m.b == pytest.approx(side, abs=1)


def test_bar_labels_leave_the_no_saving_line_to_the_legend(trie):
    bars = viz.draw_stats_bars({"a": trie.stats(), "b": trie.stats()})
    assert not bars.layout.annotations  # no text on the dashed line, where a bar label may sit
    assert "1 = no saving" in {t.name for t in bars.data}
    _assert_fits(bars)


def test_dilation_results_are_bars_with_a_scale_per_window():
    def row(model, d, w, p, adapted, gap):
        return dict(
            model=model, dilation=d, window=w, initial=p, adapted=adapted, val_loss=1 + gap, gap_vs_dense=gap
        )

    summary = [row(m, 1, 0, 0, a, 0.0) for m in ("plain", "rat+") for a in (False, True)]
    for d in (4, 16):
        summary += [row("plain", d, 0, 0, a, 0.8 - 0.2 * a) for a in (False, True)]
        summary += [row("rat+", d, 0, 0, a, 0.012) for a in (False, True)]
        summary += [row("plain", d, 64, 4, a, 0.017) for a in (False, True)]
        summary += [row("rat+", d, 64, 4, a, 0.004) for a in (False, True)]
    result = {
        "summary": summary,
        "config": {"window": 64, "initial": 4, "dilations": [1, 4, 16], "seeds": [0, 1]},
    }
    fig = viz.draw_dilation_results(result)
    assert all(isinstance(t, go.Bar) for t in fig.data) and len(fig.data) == 8  # 2 panels x 2 models x 2
    assert not fig.layout.yaxis2.matches and not fig.layout.yaxis.matches  # +0.4% against +1.7% stays visible
    windowed = [t for t in fig.data if t.xaxis == "x2" and t.name == "rat+, adapted"]
    assert list(windowed[0].text) == ["+0.4%", "+0.4%"] and list(windowed[0].x) == ["D = 4", "D = 16"]
    assert "2 seeds" in fig.layout.title.text
    _assert_fits(fig)
    with pytest.raises(ValueError, match="models"):
        viz.draw_dilation_results({"summary": [], "config": result["config"]})


def test_fit_title_wraps_each_line_and_keeps_bold_runs_whole():
    text, lines = style.fit_title("Head<br><sup>" + "word " * 60 + "<b>99% skipped now</b> tail</sup>", 400)
    parts = text.split("<br>")
    assert lines == len(parts) > 3 and parts[0] == "Head"
    assert all(p.startswith("<sup>") and p.endswith("</sup>") for p in parts[1:])
    assert any("<b>99% skipped now</b>" in p for p in parts)


def test_tile_schedule_title_clears_the_key_axis_on_top():
    from treeattn_lab.bench.tree import branching_rollouts

    pack = RolloutTrie.from_sequences(branching_rollouts(2, 48, [(4, 24)])).pack()
    fig = viz.draw_tile_schedule(pack, 16, 16, title="a long title " * 8)
    _assert_fits(fig)
    lines = fig.layout.title.text.count("<br>") + 1
    assert fig.layout.margin.t >= 70 + 22 * lines  # the key axis (ticks and its title) sits above the map
