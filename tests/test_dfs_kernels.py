"""``bench dfs-kernels``: every walk forced onto one kernel (and the rule restored), the mean block work
the walk rule reads, and the rows of a quick CPU run (SDPA only: no FA4 on a CPU)."""

from __future__ import annotations

import math

import pytest
import torch

from treeattn_lab.bench import dfs_kernels
from treeattn_lab.bench.train import TINY, bench_trie
from treeattn_lab.engine import block_attention
from treeattn_lab.engine.dfs import walk
from treeattn_lab.reference import TinyLM


def test_a_forced_kernel_holds_inside_and_the_rule_returns_after(monkeypatch):
    q = torch.zeros(1, 4, 2, 8, dtype=torch.bfloat16)
    monkeypatch.setattr(block_attention, "runs_fa4", lambda q: True)
    threshold = block_attention.FA4_MIN_WALK_WORK
    with dfs_kernels.forced_kernel("fa4"):
        assert block_attention.WalkKernel([1])(q) == "fa4"  # the smallest walk
    with pytest.raises(RuntimeError, match="stop"), dfs_kernels.forced_kernel("sdpa"):
        assert block_attention.WalkKernel([2**60])(q) == "sdpa"  # the largest walk
        raise RuntimeError("stop")
    assert threshold == block_attention.FA4_MIN_WALK_WORK  # restored after the error
    with pytest.raises(ValueError, match="kind must be one of"), dfs_kernels.forced_kernel("flex"):
        pass


def test_mean_block_work_is_the_walk_rules_and_a_quick_run_times_sdpa():
    trie = bench_trie("agentic", True)
    work = dfs_kernels.mean_block_work(trie, block_tokens=64, heads=4, head_dim=16)
    _, events = walk(trie.pack(), 64)  # the blocks before pushes merge, as the walk's kernel reads them
    rectangles = [(b.end - b.start) * (b.end - b.start + b.position) for _, b in events]
    assert work == sum(rectangles) // len(rectangles) * 64
    torch.manual_seed(0)
    model = TinyLM(TINY)
    rows = dfs_kernels.kernel_rows(model, ["low_sharing"], quick=True, block_sizes=[32], reps=1)
    assert [(r["block_tokens"], r["checkpointed"]) for r in rows] == [(32, False), (32, True)]
    for r in rows:
        assert r["rule_pick"] == "sdpa" and r["sdpa_s"] > 0 and "fa4_s" not in r
        assert r["sdpa_peak_gib"] is None  # no peak memory on a CPU
        assert math.isfinite(r["mean_work_log2"]) and r["mean_work_log2"] > 0
    assert not model.gradient_checkpointing and all(p.grad is None for p in model.parameters())
