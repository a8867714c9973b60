"""Where a step's time goes: model calls counted against the model's real calls, the committed H200
profile labelled from its file, and the drawing checked against the rows it draws."""

from __future__ import annotations

import copy
import math
import random

import pytest
import torch

pytest.importorskip("plotly.graph_objects")

from treeattn_lab import RolloutTrie  # noqa: E402
from treeattn_lab.bench.step_profile import profile_step  # noqa: E402
from treeattn_lab.engine import tree_backward  # noqa: E402
from treeattn_lab.lab import viz  # noqa: E402
from treeattn_lab.lab.viz import style  # noqa: E402
from treeattn_lab.reference import TinyLM, TinyLMConfig  # noqa: E402

CFG = TinyLMConfig(vocab_size=40, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=32)


def _random_trie(seed: int) -> RolloutTrie:
    rng = random.Random(seed)
    prompt = [rng.randrange(1, CFG.vocab_size) for _ in range(rng.randint(5, 13))]
    seqs = []
    for _ in range(rng.randint(3, 7)):
        cut = rng.randint(1, len(prompt))  # rollouts fork at different depths
        seqs.append(prompt[:cut] + [rng.randrange(1, CFG.vocab_size) for _ in range(rng.randint(1, 9))])
    return RolloutTrie.from_sequences(seqs)


def _counted_calls(model, trie, **engine) -> int:
    """Model calls of one tree_backward, counted where every call starts: the embedding."""
    calls = []
    handle = model.embed.register_forward_hook(lambda *_: calls.append(1))
    try:
        tree_backward(model, trie, **engine)
    finally:
        handle.remove()
    return len(calls)


@pytest.mark.parametrize("seed", [3, 11, 29])
@pytest.mark.parametrize("block_tokens,token_budget", [(3, None), (4, 24), (7, 16)])
def test_model_calls_match_the_calls_the_engine_makes(seed, block_tokens, token_budget):
    torch.manual_seed(seed)
    model = TinyLM(CFG)
    trie = _random_trie(seed)
    engine = dict(block_tokens=block_tokens, token_budget=token_budget)
    counted = {mode: _counted_calls(model, trie, mode=mode, **engine) for mode in ("packed", "dfs")}
    predicted = {mode: viz.model_calls(trie, mode=mode, **engine) for mode in ("packed", "dfs")}
    assert predicted == counted
    assert predicted["dfs"] > predicted["packed"]  # a trie that forks makes dfs push, pop and run leaves


def test_model_calls_rejects_a_mode_it_cannot_count():
    with pytest.raises(ValueError, match="mode must be one of"):
        viz.model_calls(_random_trie(0), mode="flat", block_tokens=4)


def test_a_profiled_cpu_step_is_labelled_without_touching_the_row():
    torch.manual_seed(0)
    model = TinyLM(CFG)
    trie = _random_trie(5)
    rows = []
    for mode in ("packed", "dfs"):
        row = profile_step(model, trie, mode=mode, block_tokens=4)
        before = copy.deepcopy(row)
        labelled = viz.with_model_calls(row, trie, machine="cpu", block_tokens=4)
        assert row == before
        assert labelled == {
            **row,
            "machine": "cpu",
            "model_calls": _counted_calls(model, trie, mode=mode, block_tokens=4),
        }
        rows.append(labelled)
    fig = viz.draw_step_profile(rows)
    names = {t.name for t in fig.data}
    assert "CPU (host and device are one)" in names and not any(n.startswith("GPU") for n in names)
    assert fig.layout.width <= style.MAX_FIGURE_WIDTH


def test_committed_profile_rows_are_the_files_rows_with_their_machine_and_calls():
    payload = viz.load_bench_results("train", "NVIDIA-H200")
    if not payload.get("profile"):
        pytest.skip("the newest committed bench train result has no profile")
    rows = viz.committed_profile_rows(payload)
    assert [{k: r[k] for k in payload["profile"][0]} for r in rows] == payload["profile"]
    assert {r["machine"] for r in rows} == {payload["environment"]["device"]}
    calls = {r["mode"]: r["model_calls"] for r in rows}
    assert calls["packed"] >= 1 and calls["dfs"] > calls["packed"]
    with pytest.raises(ValueError, match="no 'profile' rows"):
        viz.committed_profile_rows({k: v for k, v in payload.items() if k != "profile"})


def _rows() -> list[dict]:
    cpu = [
        {"machine": "cpu", "mode": "packed", "aten_ops": 2000, "wall_s": 0.02, "model_calls": 1},
        {"machine": "cpu", "mode": "dfs", "aten_ops": 9000, "wall_s": 0.05, "model_calls": 6},
    ]
    gpu = [
        {"machine": "gpu", "mode": "packed", "aten_ops": 80000, "wall_s": 2.0, "model_calls": 4,
         "kernel_launches": 20000, "kernel_s": 1.6},
        {"machine": "gpu", "mode": "dfs", "aten_ops": 700000, "wall_s": 8.0, "model_calls": 50,
         "kernel_launches": 190000, "kernel_s": 2.0},
    ]  # fmt: skip
    return cpu + gpu


def test_step_profile_draws_the_rows_counts_per_call_and_busy_idle_split():
    rows = _rows()
    before = copy.deepcopy(rows)
    fig = viz.draw_step_profile(rows)
    assert rows == before
    counts = {t.name: t for t in fig.data if t.xaxis == "x"}
    assert list(counts["dfs"].x) == ["aten ops<br>cpu", "aten ops<br>gpu", "kernel launches<br>gpu"]
    assert list(counts["dfs"].y) == [9000, 700000, 190000]
    per_call = {t.name: t for t in fig.data if t.xaxis == "x2"}
    assert list(per_call["dfs"].y) == pytest.approx([1500, 14000])
    assert list(per_call["packed"].y) == pytest.approx([2000, 20000])
    assert (
        per_call["dfs"].text[1] == "14K<br>x 50"
        and per_call["packed"].text[0] == "2.0K<br>x 1"
    )
    wall = {t.name: t for t in fig.data if t.xaxis == "x3"}
    busy, idle, host = (wall[n] for n in ("GPU busy (kernels running)", "GPU idle (waiting on the host)",
                                          "CPU (host and device are one)"))  # fmt: skip
    assert list(busy.y[2:]) == pytest.approx([0.8, 1.0])  # seconds / the gpu's packed wall
    assert list(idle.y[2:]) == pytest.approx([0.2, 3.0]) and list(idle.base[2:]) == pytest.approx([0.8, 1.0])
    assert list(busy.text[2:]) == ["80%", "25%"] and list(idle.text[2:]) == ["20%", "75%"]
    assert list(host.y[:2]) == pytest.approx([1.0, 2.5]) and host.y[2] is None and busy.y[0] is None
    assert fig.layout.yaxis.type == "log" and fig.layout.yaxis2.type == "log"
    low, high = fig.layout.yaxis2.range  # a decade below the smallest bar, room above the largest label
    assert low <= math.log10(1500) - 1 and high > math.log10(20000)
    assert fig.layout.width <= style.MAX_FIGURE_WIDTH


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda rows: rows.clear(), "rows is empty"),
        (lambda rows: rows[1].pop("model_calls"), r"rows\[1\] lacks \['model_calls'\]"),
        (lambda rows: rows[2].update(aten_ops=-1), r"rows\[2\]\['aten_ops'\] must be a finite number"),
        (lambda rows: rows[3].update(kernel_s=float("nan")), r"rows\[3\]\['kernel_s'\] must be a finite"),
        (lambda rows: rows[0].update(model_calls=0), r"rows\[0\] made 0 model calls"),
        (lambda rows: rows[1].update(mode="packed"), "repeat a \\(machine, mode\\) pair"),
        (lambda rows: rows[0].update(wall_s=0.0), "first row of each machine needs a wall_s > 0"),
    ],
)
def test_step_profile_rejects_bad_rows(change, message):
    rows = _rows()
    change(rows)
    with pytest.raises(ValueError, match=message):
        viz.draw_step_profile(rows)


def test_the_profilers_marks_are_dropped_and_other_stderr_kept(capfd):
    import os

    from treeattn_lab.bench.step_profile import profiler_marks_dropped

    with profiler_marks_dropped():
        os.write(2, b"USDT:2026-12-06 11:22:12 1:1 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"STAGE:2026-12-06 11:22:12 1:1 ActivityProfilerController.cpp:312] Completed Stage\n")
        os.write(2, b"a real warning\n")
    err = capfd.readouterr().err
    assert err == "a real warning\n"


def test_profile_step_writes_no_profiler_marks_to_stderr():
    import subprocess
    import sys

    script = (
        "import random, torch\n"
        "from treeattn_lab.bench.step_profile import profile_step\n"
        "from treeattn_lab.engine.calibration import synthetic_trie\n"
        "from treeattn_lab.reference import TinyLM, TinyLMConfig\n"
        "cfg = TinyLMConfig(vocab_size=40, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=32)\n"
        "trie = synthetic_trie(random.Random(0), 40, 1, 3, 8, 4)\n"
        "print(profile_step(TinyLM(cfg), trie, mode='dfs', block_tokens=4)['aten_ops'] > 0)\n"
    )  # a fresh process: the profiler's library prints its marks on its first traces
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("True")
    assert "profiler_start" not in done.stderr and "USDT:" not in done.stderr, done.stderr
