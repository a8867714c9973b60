"""The live CPU demonstrations of the notebooks (treeattn_lab.lab.demos) against the einops references."""

from __future__ import annotations

import random

import pytest
import torch

from treeattn_lab import RolloutTrie, sparse_attention, tree_attention
from treeattn_lab.bench.tree import branching_rollouts
from treeattn_lab.lab import demos
from treeattn_lab.patterns.vertical_slash import synthetic_pattern


def _random_pack(seed: int):
    rng = random.Random(seed)
    seqs = [[rng.randrange(4) for _ in range(rng.randint(1, 23))] for _ in range(rng.randint(1, 9))]
    return RolloutTrie.from_sequences(seqs).pack()


@pytest.mark.parametrize("seed", range(6))
def test_nodewise_tree_attention_matches_the_reference(seed):
    pack = _random_pack(seed)
    gen = torch.Generator().manual_seed(100 + seed)
    q = torch.randn(pack.num_tokens, 4, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(pack.num_tokens, 2, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    before = [x.clone() for x in (q, k, v)]
    got = demos.nodewise_tree_attention(q, k, v, pack)
    assert torch.isfinite(got).all()
    want = tree_attention(q, k, v, pack, backend="reference")
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), before, strict=True))


def test_nodewise_tree_attention_refuses_a_wrong_length():
    pack = _random_pack(0)
    x = torch.randn(pack.num_tokens + 1, 2, 8)
    with pytest.raises(ValueError, match="packed tokens"):
        demos.nodewise_tree_attention(x, x, x, pack)


@pytest.mark.parametrize(("tokens", "block", "seed"), [(200, 16, 1), (77, 16, 2), (130, 32, 3)])
def test_gathered_sparse_attention_matches_the_reference(tokens, block, seed):
    pattern = synthetic_pattern(tokens, 4, n_vertical=9, n_slash=7, sinks=3, local=12, block_size=block,
                                seed=seed)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, 4, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(tokens, 2, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    got = demos.gathered_sparse_attention(q, k, v, pattern)
    want = sparse_attention(q, k, v, pattern, backend="reference")
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    plan = demos.sparse_gather_plan(pattern, tokens)
    torch.testing.assert_close(demos.gathered_sparse_attention(q, k, v, pattern, plan), want)
    # the plan holds exactly the pattern's pairs, each once
    rows = [torch.arange(b * block, min(tokens, b * block + block)) for b in range(len(plan))]
    pairs = sum(int(((pos[:, None, :] <= r[None, :, None]) & ok[:, None, :]).sum())
                for r, (pos, ok) in zip(rows, plan, strict=True))
    assert pairs == pattern.num_pairs(tokens)


def test_gathered_sparse_attention_refuses_other_heads():
    pattern = synthetic_pattern(64, 2, n_vertical=2, n_slash=2, sinks=1, local=4, block_size=16, seed=0)
    x = torch.randn(64, 4, 8)
    with pytest.raises(ValueError, match="heads"):
        demos.gathered_sparse_attention(x, x, x, pattern)


def test_tree_against_flat_counts_pairs_and_restores_threads():
    pack = RolloutTrie.from_sequences(branching_rollouts(1, 48, [(3, 8)])).pack()
    threads = torch.get_num_threads()
    r = demos.tree_against_flat(pack, heads=2, dim=8, repeats=1)
    assert torch.get_num_threads() == threads
    assert r["tree_pairs"] == int(pack.visibility_mask().sum())
    assert r["flat_pairs"] == 3 * 56 * 57 // 2 and r["pair_ratio"] == r["flat_pairs"] / r["tree_pairs"]
    assert r["flat_s"] > 0 and r["tree_s"] > 0 and r["speedup"] == r["flat_s"] / r["tree_s"]


def test_sparse_against_dense_reports_density():
    pattern = synthetic_pattern(256, 2, n_vertical=4, n_slash=4, sinks=2, local=16, block_size=32, seed=0)
    r = demos.sparse_against_dense(pattern, 256, dim=8, repeats=1)
    assert r["density"] == pattern.density(256) and r["ideal"] == pytest.approx(1 / r["density"])
    assert r["dense_s"] > 0 and r["sparse_s"] > 0


def test_threads_restores_the_setting_after_an_error():
    before = torch.get_num_threads()
    with pytest.raises(RuntimeError, match="inside"), demos.threads(1):
        assert torch.get_num_threads() == 1
        raise RuntimeError("inside")
    assert torch.get_num_threads() == before
    with pytest.raises(ValueError, match="threads"), demos.threads(0):
        pass


def test_median_seconds_and_its_arguments():
    calls = []
    assert demos.median_seconds(lambda: calls.append(1), repeats=3, warmup=2) >= 0
    assert len(calls) == 5
    with pytest.raises(ValueError, match="repeats"):
        demos.median_seconds(lambda: None, repeats=0)


def test_measured_balance():
    timeline = [{"rank": 0, "compute_s": 1.0, "wait_s": 0.5, "reduce_s": 0.1, "predicted": 2.0},
                {"rank": 1, "compute_s": 1.5, "wait_s": 0.0, "reduce_s": 0.1, "predicted": 2.0}]
    b = demos.measured_balance(timeline)
    assert b["measured_imbalance"] == pytest.approx(1.2) and b["predicted_imbalance"] == 1.0
    assert b["slowest_rank"] == 1 and b["wait_share"] == pytest.approx([0.5 / 1.6, 0.0])
    with pytest.raises(ValueError, match="no ranks"):
        demos.measured_balance([])


def test_measured_on_names_the_device():
    env = {"device": "NVIDIA H200", "time_utc": "2026-11-30T12:00:00Z", "torch": "2.11", "triton": "3.6"}
    assert demos.measured_on({"environment": env}).startswith("an NVIDIA H200 on 2026-11-30")
    assert "CPU" in demos.measured_on({"environment": {**env, "device": "cpu"}})


def test_rat_live_config_is_the_quick_models_on_smaller_batches():
    from treeattn_lab.experiments.rat_dilation import MODES

    cfg = demos.rat_live_config()
    assert (cfg.dim, cfg.n_layers) == (MODES["quick"].dim, MODES["quick"].n_layers)
    assert 16 in cfg.dilations and cfg.batch_size < MODES["quick"].batch_size


def test_run_with_progress_returns_and_reraises():
    assert demos.run_with_progress(lambda: 42, expected_s=1, desc="x") == 42

    def fails():
        raise TimeoutError("ranks hung")

    with pytest.raises(TimeoutError, match="ranks hung"):
        demos.run_with_progress(fails, expected_s=1, desc="x")


def test_micro_batch_modes_colour_by_mode():
    from treeattn_lab.datasets import load_rollouts
    from treeattn_lab.lab import live, viz

    trie = RolloutTrie.from_sequences(load_rollouts("grpo_math")[:12])
    rows = viz.micro_batch_choices(trie, token_budget=2048, block_tokens=256)
    modes = live.micro_batch_modes(trie, rows)
    assert set(modes.values()) <= {"flat", "packed", "dfs", live.SHARED}
    by_batch = viz.micro_batch_colors(trie, rows)
    assert set(modes) == set(by_batch)
    for node, label in by_batch.items():
        assert modes[node] == (live.SHARED if label == live.SHARED else label.split(": ")[1])
    fig = live.draw_micro_batch_modes(trie, rows, title="t")
    assert fig.layout.title.text.startswith("t (")


# ------------------------------------------------------------------------------------ scaled_down
def test_scaled_down_keeps_the_shape_at_a_fraction_of_the_tokens():
    rollouts = [[5, 6, 7, 8, 9, 10, 11, 12], [5, 6, 7, 8, 20, 21], [5, 6, 7, 8, 20, 21, 22, 23, 24], [30, 31]]
    trie = RolloutTrie.from_sequences(rollouts)
    small = demos.scaled_down(trie, 3)
    assert small.num_sequences == trie.num_sequences and small.num_nodes == trie.num_nodes
    assert [n.parent for n in small.nodes] == [n.parent for n in trie.nodes]
    assert [len(n.tokens) for n in small.nodes] == [-(-len(n.tokens) // 3) for n in trie.nodes]
    ids = sorted({t for s in small.sequences() for t in s})
    assert ids == list(range(len(ids)))  # renumbered densely
    assert demos.scaled_down(trie, 1).sequences() == [
        [sorted({t for s in rollouts for t in s}, key=[t for s in rollouts for t in s].index).index(t)
         for t in s] for s in rollouts
    ]
    with pytest.raises(ValueError, match="factor"):
        demos.scaled_down(trie, 0)


# ------------------------------------------------------------------------------- split_step_time
def test_split_step_time_solves_two_steps_exactly():
    per_op, per_token = 4e-6, 1e-4
    steps = [{"aten_ops": ops, "work": work, "seconds": per_op * ops + per_token * work}
             for ops, work in ((8000, 900), (70000, 800))]
    split = demos.split_step_time(steps)
    assert split["per_op_s"] == pytest.approx(per_op) and split["per_token_s"] == pytest.approx(per_token)
    assert split["op_share"] == pytest.approx([per_op * s["aten_ops"] / s["seconds"] for s in steps])
    proportional = [{"aten_ops": 10, "work": 1, "seconds": 1.0}, {"aten_ops": 20, "work": 2, "seconds": 2.0}]
    assert demos.split_step_time(proportional) is None
    noisy = [{"aten_ops": 1000, "work": 10, "seconds": 1.0}, {"aten_ops": 2000, "work": 10, "seconds": 0.5}]
    assert demos.split_step_time(noisy) is None  # more ops in less time: no positive cost per op


def test_token_work_counts_pushed_tokens_at_their_forward_share():
    from treeattn_lab.engine import TreeBackwardReport
    from treeattn_lab.engine.time_fit import FORWARD_TOKEN_SHARE

    report = TreeBackwardReport(grad_tokens=700, no_grad_tokens=300)
    assert demos.token_work(report) == pytest.approx(700 + 300 * FORWARD_TOKEN_SHARE)


# -------------------------------------------------------------------------- dilated against dense
@pytest.mark.parametrize("n,dilation,window,initial,block", [
    (83, 5, 6, 3, 16), (300, 4, 0, 0, 64), (130, 1, 0, 0, 32), (257, 16, 32, 4, 64), (40, 64, 2, 1, 8),
])
def test_blockwise_dilated_attention_matches_the_reference(n, dilation, window, initial, block):
    from treeattn_lab import dilated_attention
    from treeattn_lab.patterns.dilated import DilatedPattern

    gen = torch.Generator().manual_seed(n)
    q = torch.randn(n, 4, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(n, 2, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    got = demos.blockwise_dilated_attention(q, k, v, DilatedPattern(dilation, window, initial), block=block)
    want = dilated_attention(q, k, v, dilation=dilation, window=window, initial=initial, backend="reference")
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


def test_dilated_against_dense_counts_pairs_and_cache_bytes():
    from treeattn_lab.patterns.dilated import DilatedPattern

    pattern = DilatedPattern(8, window=16, initial=2)
    before = torch.get_num_threads()
    r = demos.dilated_against_dense(pattern, 256, heads=2, kv_heads=1, dim=8, repeats=1)
    assert torch.get_num_threads() == before
    assert r["ideal"] == pytest.approx(256 * 257 / 2 / pattern.num_pairs(256))
    row_bytes = 1 * 8 * 4  # one kv head of 8 fp32 numbers
    assert r["dense_cache_bytes"] == 2 * 256 * row_bytes
    assert r["dilated_cache_bytes"] == 2 * pattern.kv_cache_entries(256) * row_bytes
    assert r["cache_ratio"] == pytest.approx(r["dense_cache_bytes"] / r["dilated_cache_bytes"])
    assert r["dense_s"] > 0 and r["dilated_s"] > 0
    assert r["speedup"] == pytest.approx(r["dense_s"] / r["dilated_s"])


# ------------------------------------------------------------------------------- logged tables
LOG = """\
                     grpo_math on 2 x NVIDIA H200, TinyLM llama-0.5b bfloat16
┏━━━━━━━━━━━━━━━━┳━━━━━━━━┳━━━━━━━━━━━┳━━━━━━━━━━━━━━━━┓
┃    partitioner ┃ step s ┃ imbalance ┃ predicted imb. ┃
┡━━━━━━━━━━━━━━━━╇━━━━━━━━╇━━━━━━━━━━━╇━━━━━━━━━━━━━━━━┩
│ contiguous_dfs │  0.648 │         1 │           1.01 │
│     one device │  1,050 │           │                │
└────────────────┴────────┴───────────┴────────────────┘
                  targets
┏━━━━━━━━━━━━━━━━━━━┳━━━━━━━┓
┃            target ┃   met ┃
┡━━━━━━━━━━━━━━━━━━━╇━━━━━━━┩
│ throughput >= 1.8 │ False │
└───────────────────┴───────┘
wrote /somewhere/else.json
"""


def test_load_logged_tables_reads_the_printed_tables(tmp_path):
    name = "multi-gpu-train-2x__NVIDIA-H100-80GB-HBM3__torch-2.11.0-cu130__triton-3.6.0.log"
    (tmp_path / name).write_text(LOG)
    got = demos.load_logged_tables("multi-gpu-train-2x", "NVIDIA-H100-80GB-HBM3", directory=tmp_path)
    env = {"device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0+cu130", "triton": "3.6.0"}
    assert got["environment"] == env
    assert got["title"] == "grpo_math on 2 x NVIDIA H200, TinyLM llama-0.5b bfloat16"
    first, targets = got["tables"][got["title"]], got["tables"]["targets"]
    assert first[0] == {"partitioner": "contiguous_dfs", "step s": 0.648, "imbalance": 1.0,
                        "predicted imb.": 1.01}
    assert first[1]["step s"] == 1050.0 and first[1]["imbalance"] == ""
    assert targets == [{"target": "throughput >= 1.8", "met": "False"}]
    assert demos.measured_on(got) == "an NVIDIA H100 80GB HBM3 (torch 2.11.0+cu130, triton 3.6.0)"
    with pytest.raises(FileNotFoundError):
        demos.load_logged_tables("nothing", directory=tmp_path)


def test_the_committed_two_gpu_log_has_both_partitioners():
    got = demos.load_logged_tables("multi-gpu-train-2x", "NVIDIA-H200")
    rows = {r["partitioner"]: r for r in got["tables"][got["title"]]}
    for name in ("contiguous_dfs", "subtree_search"):
        assert isinstance(rows[name]["imbalance"], float) and isinstance(rows[name]["predicted imb."], float)
