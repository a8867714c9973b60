"""The RAT+ layer and model, and the dilation experiment's plumbing (a micro run, not its results)."""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch

from treeattn_lab.corpus import VOCAB_SIZE, causal_sdpa
from treeattn_lab.experiments import rat_dilation
from treeattn_lab.lab import viz
from treeattn_lab.ops.dilated import dilated_attention, gated_scan
from treeattn_lab.patterns.dilated import DilatedPattern
from treeattn_lab.reference import TinyLM, TinyLMConfig
from treeattn_lab.reference.rat import RATAttention, RATTinyLM
from treeattn_lab.reference.scan import gated_scan as reference_scan

CFG = TinyLMConfig(vocab_size=VOCAB_SIZE, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48)


def _ids(n=24, batch=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB_SIZE, (batch, n), generator=gen)
    return ids, torch.arange(n).expand(batch, n)


def test_rat_model_shares_tinylm_parts_and_adds_gates():
    torch.manual_seed(0)
    model = RATTinyLM(CFG)
    plain = TinyLM(CFG)
    assert all(isinstance(b.attn, RATAttention) for b in model.blocks)
    assert type(model.blocks[0].mlp) is type(plain.blocks[0].mlp)  # SwiGLU, imported not copied
    extra = sum(p.numel() for p in model.parameters()) - sum(p.numel() for p in plain.parameters())
    hd = CFG.head_dim
    assert extra == CFG.n_layers * CFG.dim * (CFG.n_heads * hd + CFG.n_kv_heads * hd)  # o and g projections
    ids, pos = _ids()
    assert model(ids, pos, causal_sdpa).shape == (2, 24, VOCAB_SIZE)


def test_recurrence_runs_on_keys_and_values_with_one_gate():
    torch.manual_seed(1)
    layer = RATAttention(CFG)
    k, v = torch.randn(2, 2, 10, 2, 8)
    gate = torch.rand(2, 10, 2, 8)
    k_rec, v_rec = layer.recurrent_kv(k, v, gate)
    torch.testing.assert_close(k_rec, reference_scan(k, gate, dim=1))
    torch.testing.assert_close(v_rec, reference_scan(v, gate, dim=1))


@pytest.mark.parametrize("pattern", [DilatedPattern(1), DilatedPattern(4), DilatedPattern(8, 3, 2)])
def test_rat_model_is_causal(pattern):
    torch.manual_seed(2)
    model = RATTinyLM(CFG)
    ids, pos = _ids(n=20, batch=1)
    attention = rat_dilation.pattern_attention(pattern)
    base = model(ids, pos, attention)
    changed = ids.clone()
    changed[0, 12] = (changed[0, 12] + 1) % VOCAB_SIZE
    out = model(changed, pos, attention)
    torch.testing.assert_close(out[:, :12], base[:, :12])
    assert not torch.allclose(out[:, 12:], base[:, 12:])


def test_rat_model_with_the_triton_scan_equals_the_loop():
    torch.manual_seed(3)
    loop = RATTinyLM(CFG)
    fast = RATTinyLM(CFG, scan=functools.partial(gated_scan, backend="triton"))
    fast.load_state_dict(loop.state_dict())
    ids, pos = _ids(n=16, batch=2)
    out_loop, out_fast = loop(ids, pos, causal_sdpa), fast(ids, pos, causal_sdpa)
    torch.testing.assert_close(out_fast, out_loop, atol=1e-4, rtol=1e-4)
    out_loop.square().mean().backward()
    out_fast.square().mean().backward()
    for (name, a), b in zip(loop.named_parameters(), fast.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-5, rtol=1e-3, msg=name)


def test_pattern_attention_is_dilated_attention():
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 33, h, 8, generator=gen) for h in (4, 2, 2))
    for pattern in (DilatedPattern(1), DilatedPattern(5, 2, 3)):
        want = dilated_attention(q, k, v, dilation=pattern.dilation, window=pattern.window,
                                 initial=pattern.initial, backend="reference")
        got = rat_dilation.pattern_attention(pattern)(q, k, v)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


MICRO = replace(rat_dilation.MODES["tiny"], dim=16, n_heads=2, n_kv_heads=1, ffn_dim=32, seq_len=32,
                batch_size=2, steps=3, dilations=(1, 4), window=2, initial=1, adapt_steps=1, eval_windows=2,
                sparse_dilation=8)


def test_experiment_micro_run_has_every_row():
    result = rat_dilation.run_experiment(MICRO, device="cpu", progress=False)
    rows = result["rows"]
    # per model: D=1, D=4 without and with a window; each before and after adaptation
    assert len(rows) == 2 * 3 * 2
    assert {r["model"] for r in rows} == set(rat_dilation.MODELS)
    assert all(torch.isfinite(torch.tensor(r["val_loss"])) for r in rows)
    dense = [s for s in result["summary"] if s["dilation"] == 1]
    assert all(s["gap_vs_dense"] == 0 for s in dense)
    assert len(result["histories"]["rat+/seed0"][0]) == 2  # a dense and a sparse pass per batch
    assert len(result["histories"]["plain/seed0"]) == 2 * MICRO.steps  # as many optimizer steps
    assert set(rat_dilation.headline(result, dilation=4)) == set(rat_dilation.MODELS)
    assert len(viz.draw_dilation_results(result).data) > 0
    assert len(rat_dilation.draw_histories(result).data) == 3


def test_merged_seeds_summarize_like_one_run():
    """Runs of one setting with different seeds merge into the summary of all their rows."""
    def run(seed, loss):
        rows = [{"model": m, "dilation": d, "window": 0, "initial": 0, "adapted": False, "seed": seed,
                 "val_loss": loss * (1 + d / 100)} for m in rat_dilation.MODELS for d in (1, 16)]
        return {"config": {"steps": 5, "seeds": [seed]}, "rows": rows, "histories": {f"plain/seed{seed}": []},
                "seconds": 1.0 + seed, "device": "cpu"}

    merged = rat_dilation.merge_results([run(0, 2.0), run(1, 3.0)])
    assert merged["config"]["seeds"] == [0, 1] and len(merged["rows"]) == 8 and merged["seconds"] == 2.0
    row = next(s for s in merged["summary"] if s["model"] == "rat+" and s["dilation"] == 16)
    assert row["seeds"] == 2 and row["val_loss"] == pytest.approx(2.5 * 1.16)
    assert row["gap_vs_dense"] == pytest.approx(1.16 / 1.01 - 1)
    with pytest.raises(ValueError, match="repeat a seed"):
        rat_dilation.merge_results([run(0, 2.0), run(0, 3.0)])
    other = run(1, 3.0)
    other["config"]["steps"] = 6
    with pytest.raises(ValueError, match="same configuration"):
        rat_dilation.merge_results([run(0, 2.0), other])


def test_merge_command_refuses_results_of_another_mode(tmp_path, capsys):
    """``--merge`` names its output after ``--mode``: results run in another mode must not take its name."""
    import json
    from dataclasses import asdict

    def saved(mode, seed):
        rows = [{"model": m, "dilation": d, "window": 0, "initial": 0, "adapted": a, "seed": seed,
                 "val_loss": 2.0 + d / 100}
                for m in rat_dilation.MODELS for d in (1, 16) for a in (False, True)]
        config = {**json.loads(json.dumps(asdict(rat_dilation.MODES[mode]))), "seeds": [seed]}
        path = tmp_path / f"{mode}{seed}.json"
        path.write_text(json.dumps({"environment": {"device": "cpu"}, "config": config, "rows": rows,
                                    "histories": {}, "seconds": 1.0, "device": "cpu"}))
        return str(path)

    full = [saved("full", 0), saved("full", 1)]
    assert rat_dilation.main(["--merge", *full, "--mode", "full", "--no-save"]) == 0
    with pytest.raises(SystemExit):
        rat_dilation.main(["--merge", *full, "--no-save"])  # the default mode, quick
    assert "not run in --mode quick" in capsys.readouterr().err
