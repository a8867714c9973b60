"""The sparse-training experiment: the passkey probe, the pretraining curriculum, equal-FLOP window sizing,
targets, tiny mode end to end through the command line, and the merge of per-seed runs."""

import json
import math
from dataclasses import replace

import pytest
import torch

from treeattn_lab.corpus import causal_sdpa, decode, load_corpus
from treeattn_lab.experiments import passkey, sparse_training
from treeattn_lab.experiments.cli_args import seed_list
from treeattn_lab.experiments.sparse_training import (
    MODES,
    VARIANTS,
    merge_results,
    targets,
    train_phase,
    window_pattern,
)
from treeattn_lab.experiments.sparse_training_config import ExperimentConfig, Stage
from treeattn_lab.experiments.sparse_training_targets import DENSE_RETRIEVAL_FLOOR
from treeattn_lab.reference import TinyLM


# ---------------------------------------------------------------------------------------------- the probe
@pytest.mark.parametrize("depth", [0.0, 0.1, 0.37, 0.5, 0.9, 1.0])
def test_the_needle_sits_where_the_depth_says_and_the_answer_ends_the_sample(depth):
    filler = load_corpus("validation")[1000:1513]
    key = "90417"
    tokens, start = passkey.passkey_sample(filler, key, depth)
    needle, question = passkey.needle_text(key).encode(), passkey.question_text(key).encode()
    room = filler.numel() - len(needle) - len(question)
    assert tokens.numel() == filler.numel()
    assert start == round(depth * room)
    assert bytes(tokens[start:start + len(needle)].tolist()) == needle
    assert bytes(tokens[-len(question):].tolist()) == question
    assert decode(tokens[-len(key):]) == key
    assert torch.equal(tokens[:start], filler[:start])  # the text before the needle is untouched
    assert torch.equal(tokens[start + len(needle):-len(question)], filler[start:room])


@pytest.mark.parametrize("split", ["train", "validation"])
def test_the_key_mark_is_a_byte_the_corpus_never_holds(split):
    (mark,) = passkey.KEY_MARK.encode()
    assert not bool((load_corpus(split) == mark).any())


def test_in_a_sample_the_mark_occurs_only_right_before_each_copy_of_the_key():
    key = "7305"
    tokens, start = passkey.passkey_sample(load_corpus("train")[5000:5400], key, 0.4)
    (mark,) = passkey.KEY_MARK.encode()
    where = (tokens == mark).nonzero().flatten().tolist()
    assert len(where) == 3 and where[-1] == tokens.numel() - len(key) - 1  # twice in the needle, once asked
    assert start < where[0] < where[1] < start + len(passkey.needle_text(key))
    assert all(decode(tokens[i + 1:i + 1 + len(key)]) == key for i in where)
    assert passkey.passkey_overhead(4) == len(passkey.needle_text(key)) + len(passkey.question_text(key))


def test_probe_samples_that_do_not_fit_or_bad_depths_are_refused():
    with pytest.raises(ValueError, match="cannot hold"):
        passkey.passkey_sample(load_corpus("validation")[:40], "123", 0.5)
    with pytest.raises(ValueError, match="depth"):
        passkey.passkey_sample(load_corpus("validation")[:400], "123", 1.5)


def test_training_batches_are_seeded_and_mark_the_answer_digits():
    train = load_corpus("train")

    def batch(seed, share):
        generator = torch.Generator().manual_seed(seed)
        return passkey.passkey_batch(train, 6, 200, generator, share=share, digits=4)

    a, b = batch(3, 0.5), batch(3, 0.5)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    inputs, targets_, answer = a
    assert inputs.shape == targets_.shape == answer.shape == (6, 200)
    assert torch.equal(inputs[:, 1:], targets_[:, :-1])
    with_key = answer.any(1)
    assert 0 < int(with_key.sum()) < 6, "share 0.5 of 6 rows should mix both kinds (this seed)"
    for row in with_key.nonzero().flatten().tolist():
        assert answer[row].sum() == 4 and answer[row, -4:].all()
        digits = decode(targets_[row, answer[row]])
        assert digits.isdigit()
        assert f"The pass key is {passkey.KEY_MARK}{digits}. Remember it." in decode(inputs[row])
    assert not batch(3, 0.0)[2].any() and batch(3, 1.0)[2][:, -4:].all()


def test_scores_are_greedy_exact_match_and_per_digit_accuracy():
    samples = torch.tensor([[5, 1, 2, 3], [5, 1, 2, 3]])
    logits = torch.zeros(2, 3, 10)
    logits[0, torch.arange(3), torch.tensor([1, 2, 3])] = 1.0  # row 0 predicts every next token
    logits[1, torch.arange(3), torch.tensor([1, 2, 9])] = 1.0  # row 1 gets the last digit wrong
    exact, digit = passkey.passkey_scores(logits, samples, digits=2)
    assert exact.tolist() == [True, False]
    assert digit.tolist() == [1.0, 0.5]


# ---------------------------------------------------------------------------------------------- curriculum
def test_the_curriculum_runs_its_stages_in_order_on_one_model_and_records_each(monkeypatch):
    stages = (Stage(100, 3, 2), Stage(128, 2, 3, lr=1e-3), Stage(160, 4, 1, lr=5e-4))
    cfg = replace(MODES["tiny"], pretrain=stages, seq_len=160, lr=2e-3)
    calls = []

    def recording(model, attention, cfg_, **kw):
        before = [p.detach().clone() for p in model.parameters()]
        history = train_phase(model, attention, cfg_, **kw)
        changed = any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
        calls.append({**kw, "model": model, "attention": attention, "changed": changed})
        return history

    monkeypatch.setattr(sparse_training, "train_phase", recording)
    torch.manual_seed(0)
    model = TinyLM(cfg.model)
    history = sparse_training.pretrain(model, cfg, seed=4, progress=False)
    assert [(c["seq_len"], c["steps"], c["batch_size"]) for c in calls] == [(s.seq_len, s.steps, s.batch_size)
                                                                           for s in stages]
    assert all(c["model"] is model and c["changed"] for c in calls)  # one model trained stage after stage
    assert all(c["attention"] is causal_sdpa for c in calls)  # dense
    optimizer = calls[0]["optimizer"]  # one AdamW through the stages: its moments carry over
    assert optimizer is not None and all(c["optimizer"] is optimizer for c in calls)
    assert {int(state["step"]) for state in optimizer.state.values()} == {9}
    assert len({c["seed"] for c in calls}) == 3, "each stage draws its own batches"
    assert history["seq_len"] == [100] * 3 + [128] * 2 + [160] * 4
    for key in ("loss", "lm_loss", "key_loss", "step_ms", "lr"):
        assert len(history[key]) == 9
    assert history["lr"] == [cfg.pretrain_lr(i, step) for i, stage in enumerate(stages)
                             for step in range(stage.steps)]
    assert history["lr"][3] == 1e-3 and history["lr"][5] == 5e-4  # each later stage starts at its own peak
    assert max(history["lr"]) == 2e-3  # the configuration's rate, for the stage that names none
    assert all(math.isfinite(x) for x in history["lm_loss"])
    again = sparse_training.pretrain(TinyLM(cfg.model), cfg, seed=4, progress=False)
    assert again["seq_len"] == history["seq_len"] and len(calls) == 6


def test_curricula_that_shrink_overrun_or_cannot_hold_the_passkey_are_refused():
    with pytest.raises(ValueError, match="grow stage by stage"):
        ExperimentConfig(pretrain=(Stage(256, 5, 2), Stage(128, 5, 2)))
    with pytest.raises(ValueError, match="grow stage by stage"):
        ExperimentConfig(pretrain=(Stage(128, 5, 2), Stage(1024, 5, 2)), seq_len=512)
    with pytest.raises(ValueError, match="cannot hold the passkey"):
        ExperimentConfig(pretrain=(Stage(80, 5, 2),), digits=4)
    with pytest.raises(TypeError, match="non-empty tuple of Stage"):
        ExperimentConfig(pretrain=())
    with pytest.raises(TypeError, match="non-empty tuple of Stage"):
        ExperimentConfig(pretrain=((128, 5, 2),))
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="answer_weight"):
            ExperimentConfig(answer_weight=bad)
    with pytest.raises(ValueError, match="Stage.steps"):
        Stage(128, 0, 2)
    with pytest.raises(TypeError, match="Stage.batch_size"):
        Stage(128, 5, 2.0)


@pytest.mark.parametrize("bad", [0.0, -1e-3, math.nan, math.inf])
def test_learning_rates_that_are_not_finite_and_positive_are_refused(bad):
    with pytest.raises(ValueError, match=r"Stage\.lr must be a finite number > 0"):
        Stage(128, 5, 2, lr=bad)
    for name in ("lr", "extend_lr"):
        with pytest.raises(ValueError, match=f"^{name} must be a finite number > 0"):
            ExperimentConfig(**{name: bad})
    for wrong in ("3e-3", True, [1e-3]):
        with pytest.raises(TypeError, match=r"Stage\.lr must be a number"):
            Stage(128, 5, 2, lr=wrong)
    for wrong in ("3e-3", True, None):  # a stage may leave its peak to the configuration, which may not
        with pytest.raises(TypeError, match="^lr must be a number"):
            ExperimentConfig(lr=wrong)


def test_stage_peaks_that_rise_are_refused_and_a_stage_without_one_takes_the_configurations():
    with pytest.raises(ValueError, match="must not rise from one stage to the next"):
        ExperimentConfig(pretrain=(Stage(128, 5, 2, lr=1e-3), Stage(256, 5, 2, lr=2e-3)))
    with pytest.raises(ValueError, match="must not rise"):  # None is cfg.lr: 3e-3 after 1e-3
        ExperimentConfig(lr=3e-3, pretrain=(Stage(128, 5, 2, lr=1e-3), Stage(256, 5, 2)))
    stages = (Stage(128, 5, 2), Stage(256, 5, 2, lr=2e-3), Stage(512, 5, 2, 1e-3))
    cfg = ExperimentConfig(lr=2e-3, pretrain=stages)
    assert cfg.stage_peaks() == (2e-3, 2e-3, 1e-3)


def test_the_pretraining_rate_warms_up_once_then_falls_continuously_from_peak_to_peak():
    stages = (Stage(100, 50, 2, lr=3e-3), Stage(128, 7, 2, lr=2e-3), Stage(160, 1, 2, lr=2e-3),
              Stage(200, 30, 2, lr=5e-4))
    cfg = ExperimentConfig(pretrain=stages, seq_len=200)
    rates = [[cfg.pretrain_lr(i, step) for step in range(s.steps)] for i, s in enumerate(stages)]
    warmup = 5  # min(100, 50 // 10)
    assert rates[0][:warmup] == pytest.approx([3e-3 * (k + 1) / warmup for k in range(warmup)])
    assert rates[0][warmup] == pytest.approx(3e-3)
    for i in (1, 2, 3):  # a later stage starts at its own peak: no second warmup, no jump
        assert rates[i][0] == pytest.approx(stages[i].lr)
    flat = [r for stage in rates for r in stage][warmup:]
    assert all(b <= a * (1 + 1e-12) for a, b in zip(flat, flat[1:], strict=False)), "never rises"
    # the step before a stage starts is within one cosine step of the next stage's peak
    for i in (0, 1):
        step = math.pi / (stages[i].steps - (warmup if i == 0 else 0))
        gap = (stages[i].lr - stages[i + 1].lr) * (1 - math.cos(step)) / 2
        assert rates[i][-1] - stages[i + 1].lr == pytest.approx(gap, abs=1e-15)
    # the last stage decays towards a tenth of its peak
    assert rates[-1][-1] == pytest.approx(5e-5 + 4.5e-4 * (1 + math.cos(math.pi * 29 / 30)) / 2, rel=1e-12)


def test_every_mode_pretrains_first_at_a_shorter_context_than_its_last_stage():
    """(The config itself refuses stages that shrink or pass seq_len.) Every mode's curriculum has a
    first stage strictly shorter than its last, and its last no longer than the extension's context."""
    for name, cfg in MODES.items():
        lengths = [s.seq_len for s in cfg.pretrain]
        assert len(lengths) >= 2 and lengths[0] < lengths[-1] <= cfg.seq_len, name
    assert all(MODES[m].model.n_layers >= 2 for m in MODES)  # an induction head takes two layers


@pytest.mark.parametrize("mode", ["quick", "full"])
def test_quick_and_full_learn_the_copy_at_128_bytes_then_double_the_context_without_re_heating(mode):
    cfg = MODES[mode]
    lengths = [s.seq_len for s in cfg.pretrain] + [cfg.seq_len]
    assert lengths[0] == 128 and all(b == 2 * a for a, b in zip(lengths, lengths[1:], strict=False)), lengths
    assert cfg.pretrain[0].steps == max(s.steps for s in cfg.pretrain)  # the copy forms first
    rates = [cfg.pretrain_lr(i, step) for i, s in enumerate(cfg.pretrain) for step in range(s.steps)]
    top = rates.index(max(rates))  # the end of the first stage's warmup
    assert all(b <= a for a, b in zip(rates[top:], rates[top + 1:], strict=False))
    assert cfg.extend_lr <= cfg.stage_peaks()[-1]


# ---------------------------------------------------------------------------------------------- window sizing
@pytest.mark.parametrize(("heads", "n", "block", "fraction"),
                         [(4, 1024, 32, 0.3), (2, 500, 16, 0.12), (3, 4096, 128, 0.456),
                          (4, 32768, 128, 0.09)])
def test_window_matches_the_pair_fraction_to_one_block_diagonal_of_one_head(heads, n, block, fraction):
    pattern = window_pattern(heads, n, fraction, sinks=4, block_size=block)
    causal = heads * n * (n + 1) / 2
    one_diagonal = n * block / causal  # the most one block diagonal of one head can add
    assert abs(pattern.density(n) - fraction) <= one_diagonal
    widths = pattern.block_map(n).sum(2)[:, -1]  # block diagonals each head's last query block sees
    assert int(widths.max() - widths.min()) <= 1
    if n <= 1024:  # the kernel's pairs, from the dense mask: the sinks and a band of whole tiles
        mask = pattern.dense_mask(n)
        pos = torch.arange(n)
        qb, kb = pos[:, None] // block, pos[None, :] // block
        for h in range(heads):
            band = (qb - kb < int(widths[h])) & (pos[None, :] <= pos[:, None])
            sinks = (pos[None, :] < 4) & (pos[None, :] <= pos[:, None])
            assert torch.equal(mask[h], band | sinks)


def test_window_at_fraction_one_is_dense_and_bad_fractions_are_refused():
    assert window_pattern(2, 300, 1.0, sinks=4, block_size=16).density(300) == 1.0
    for bad in (0.0, -0.1, 1.5, math.nan):
        with pytest.raises(ValueError, match="fraction"):
            window_pattern(2, 300, bad, sinks=4, block_size=16)


# ---------------------------------------------------------------------------------------------- targets
def _summary(dense_loss=2.0, sparse_loss=2.02, window_loss=2.1, retrieval=(0.9, 0.88, 0.3),
             ms=(10.0, 3.0, 2.9), estimate_ms=1.0):
    rows = []
    for variant, loss, found, t in zip(VARIANTS, (dense_loss, sparse_loss, window_loss), retrieval, ms,
                                       strict=True):
        extra = estimate_ms if variant == "sparse" else 0.0
        rows.append({"variant": variant, "val_loss": loss, "retrieval_mean": found, "kernel_ms": t,
                     "attention_ms": t + extra})
    return rows


def test_targets_are_computed_from_the_numbers():
    t = targets(_summary())
    assert t["sparse_loss_within_2pct_of_dense"]["value"] == pytest.approx(0.01)
    assert t["sparse_loss_within_2pct_of_dense"]["met"]
    assert t["sparse_retrieval_within_5pts_of_dense"]["met"]
    assert t["sparse_retrieval_above_window"]["value"] == pytest.approx(0.58)
    assert t["attention_fwd_bwd_speedup"]["value"] == pytest.approx(10 / 3)
    assert t["attention_fwd_bwd_speedup"]["met"]
    assert t["attention_fwd_bwd_speedup_with_estimation"]["value"] == pytest.approx(2.5)
    missed = targets(_summary(sparse_loss=2.05, retrieval=(0.9, 0.8, 0.75), ms=(10.0, 5.0, 5.0)))
    assert not any(missed[name]["met"] for name in missed)
    assert all(isinstance(t["met"], bool) and "evaluated" not in t for t in missed.values())


RETRIEVAL_TARGETS = ("sparse_retrieval_within_5pts_of_dense", "sparse_retrieval_above_window")


@pytest.mark.parametrize("dense", [0.0, 0.2, DENSE_RETRIEVAL_FLOOR - 1e-9])
def test_retrieval_targets_are_not_evaluated_when_dense_does_not_retrieve(dense):
    t = targets(_summary(retrieval=(dense, 0.0, 0.0)))
    for name in RETRIEVAL_TARGETS:
        assert t[name]["met"] is None and t[name]["evaluated"] is False, name
        assert "dense model does not retrieve" in t[name]["why"]
        assert math.isfinite(t[name]["value"])  # the number is still recorded
    for name in set(t) - set(RETRIEVAL_TARGETS):  # the other targets are judged as usual
        assert isinstance(t[name]["met"], bool) and "evaluated" not in t[name]


def test_retrieval_targets_are_evaluated_from_the_floor_up():
    t = targets(_summary(retrieval=(DENSE_RETRIEVAL_FLOOR, DENSE_RETRIEVAL_FLOOR, 0.0)))
    assert t["sparse_retrieval_within_5pts_of_dense"]["met"] is True
    assert t["sparse_retrieval_above_window"]["met"] is True
    assert not any("evaluated" in t[name] for name in RETRIEVAL_TARGETS)


# ---------------------------------------------------------------------------------------------- answer loss
def test_batches_without_a_passkey_record_nan_answer_loss_and_train_on_the_next_byte_loss():
    cfg = replace(MODES["tiny"], answer_weight=3.0)
    histories = {}
    for share in (0.0, 0.5):
        torch.manual_seed(0)
        model = TinyLM(cfg.model)
        histories[share] = train_phase(model, causal_sdpa, replace(cfg, passkey_share=share), seq_len=128,
                                       steps=8, batch_size=1, lr=1e-3, seed=5, desc="", progress=False)
    none = histories[0.0]
    assert all(math.isnan(k) for k in none["key_loss"])
    assert none["loss"] == none["lm_loss"] and all(math.isfinite(x) for x in none["loss"])
    mixed = histories[0.5]
    with_key = [not math.isnan(k) for k in mixed["key_loss"]]
    assert any(with_key) and not all(with_key), "share 0.5 over 8 single-sample batches mixes both (seed 5)"
    for loss, lm, key, has in zip(mixed["loss"], mixed["lm_loss"], mixed["key_loss"], with_key, strict=True):
        assert loss == pytest.approx(lm + 3.0 * key if has else lm)  # the answer loss weighs answer_weight
        assert math.isfinite(loss)


def test_the_answer_loss_curve_skips_nan():
    pytest.importorskip("plotly")
    from treeattn_lab.lab import viz

    nan = math.nan
    histories = {"pretrain/seed0": {"lm_loss": [3.0, 2.0], "key_loss": [nan, 2.5]},
                 "pretrain/seed1": {"lm_loss": [3.2, 2.2], "key_loss": [nan, 1.5]}}
    for variant in VARIANTS:
        histories[f"{variant}/seed0"] = {"lm_loss": [1.0, 1.1, 1.2], "key_loss": [2.0, nan, nan]}
        histories[f"{variant}/seed1"] = {"lm_loss": [1.2, 1.3, 1.4], "key_loss": [4.0, 1.0, nan]}
    result = {"summary": [{"variant": v} for v in VARIANTS], "histories": histories,
              "config": {"seq_len": 16}}
    fig = viz.draw_training_curves(result)
    curves = {(t.legendgroup, t.xaxis): t for t in fig.data}
    assert list(curves["pretrain", "x2"].y) == [None, 2.0]
    assert list(curves["dense", "x2"].y) == [3.0, 1.0, None]  # step 1: seed 1 alone; step 2: no value
    assert list(curves["dense", "x"].y) == pytest.approx([1.1, 1.2, 1.3])


# ---------------------------------------------------------------------------------------------- seeds
def test_seeds_are_a_comma_list_as_in_the_other_experiments(capsys):
    assert seed_list("0,1,2") == (0, 1, 2) and seed_list("7") == (7,)
    for bad in ("0 1", "a", "-1", "1,1"):
        with pytest.raises(SystemExit):
            sparse_training.main(["--mode", "tiny", "--seeds", bad, "--no-progress"])
        assert "argument --seeds" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory):
    """Tiny mode through the command line, seed 0 and seed 1 as two runs, then merged."""
    out = tmp_path_factory.mktemp("sparse_training")
    paths = []
    for seed in (0, 1):
        folder = out / f"seed{seed}"
        assert sparse_training.main(["--mode", "tiny", "--seeds", str(seed), "--no-progress", "--out",
                                     str(folder)]) == 0
        (path,) = folder.glob("sparse-training-tiny__*.json")
        paths.append(path)
    merged_dir = out / "merged"
    merge = ["--mode", "tiny", "--merge", *map(str, paths), "--out", str(merged_dir)]
    assert sparse_training.main(merge) == 0
    (merged,) = merged_dir.glob("sparse-training-tiny__*.json")
    return [json.loads(p.read_text()) for p in paths], json.loads(merged.read_text())


def test_tiny_mode_writes_every_measurement(tiny_runs):
    (run, _), _ = tiny_runs
    cfg = MODES["tiny"]
    assert run["config"]["seeds"] == [0]
    assert [r["variant"] for r in run["rows"]] == list(VARIANTS)
    for row in run["rows"]:
        assert set(row["retrieval"]) == {str(d) for d in cfg.depths} == set(row["retrieval_digits"])
        assert all(0.0 <= x <= 1.0 for x in [*row["retrieval"].values(), *row["retrieval_digits"].values()])
        assert math.isfinite(row["val_loss"]) and 0 < row["val_loss"] < 8
        assert math.isfinite(row["val_loss_dense_eval"])
        for key in ("attention_ms", "kernel_ms", "step_ms"):
            assert row[key] > 0
        assert row["estimate_ms"] >= 0
    by = {r["variant"]: r for r in run["rows"]}
    assert by["dense"]["pair_fraction"] == 1.0
    assert by["dense"]["val_loss"] == by["dense"]["val_loss_dense_eval"]
    assert 0 < by["sparse"]["pair_fraction"] < 1
    one_diagonal = cfg.seq_len * cfg.block_size / (cfg.model.n_heads * cfg.seq_len * (cfg.seq_len + 1) / 2)
    assert abs(by["window"]["pair_fraction"] - by["sparse"]["pair_fraction"]) <= one_diagonal
    for name, t in run["targets"].items():
        assert math.isfinite(t["value"]), name
        if t["met"] is None:  # a tiny model may not retrieve: then only the retrieval targets wait
            assert name in RETRIEVAL_TARGETS and t["evaluated"] is False and t["why"], name
        else:
            assert isinstance(t["met"], bool), name
    for variant in ("pretrain", *VARIANTS):
        history = run["histories"][f"{variant}/seed0"]
        steps = sum(s.steps for s in cfg.pretrain) if variant == "pretrain" else cfg.steps
        assert len(history["loss"]) == len(history["step_ms"]) == steps
    assert run["histories"]["pretrain/seed0"]["seq_len"] == [s.seq_len for s in cfg.pretrain for _ in
                                                             range(s.steps)]
    assert run["config"]["pretrain"] == [{"seq_len": s.seq_len, "steps": s.steps, "batch_size": s.batch_size,
                                          "lr": s.lr} for s in cfg.pretrain]
    assert run["histories"]["pretrain/seed0"]["loss"][-1] < run["histories"]["pretrain/seed0"]["loss"][0]
    assert run["environment"]["device"] and run["bench"] == "sparse-training-tiny"


def test_the_three_variants_start_from_one_checkpoint_on_identical_batches(tiny_runs):
    (run, _), _ = tiny_runs
    first = {v: run["histories"][f"{v}/seed0"]["loss"][0] for v in VARIANTS}
    # one checkpoint and one batch: the first losses differ only by the attention each variant uses
    assert max(first.values()) - min(first.values()) < 0.05 * first["dense"]


def test_merged_runs_hold_both_seeds_and_recomputed_means(tiny_runs):
    (a, b), merged = tiny_runs
    assert merged["config"]["seeds"] == [0, 1]
    assert len(merged["rows"]) == 6 and {r["seed"] for r in merged["rows"]} == {0, 1}
    assert set(merged["histories"]) == set(a["histories"]) | set(b["histories"])
    assert merged["environment"] == a["environment"]
    for s in merged["summary"]:
        mine = [r for r in a["rows"] + b["rows"] if r["variant"] == s["variant"]]
        assert s["seeds"] == 2
        assert s["val_loss"] == pytest.approx(sum(r["val_loss"] for r in mine) / 2)
        for depth, value in s["retrieval"].items():
            assert value == pytest.approx(sum(r["retrieval"][depth] for r in mine) / 2)
    assert merged["targets"] == targets(merged["summary"])


@pytest.mark.parametrize("dense_retrieval", [0.0, 1.0])
def test_merge_recomputes_the_retrieval_verdict_from_the_rows(tiny_runs, tmp_path, capsys, dense_retrieval):
    (a, b), _ = tiny_runs
    paths = []
    for run in (a, b):
        rows = [{**r, "retrieval_mean": dense_retrieval} if r["variant"] == "dense" else r
                for r in run["rows"]]
        path = tmp_path / f"seed{run['config']['seeds'][0]}.json"
        path.write_text(json.dumps({**run, "rows": rows}))
        paths.append(str(path))
    capsys.readouterr()
    assert sparse_training.main(["--mode", "tiny", "--merge", *paths, "--out", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    (merged,) = (tmp_path / "out").glob("sparse-training-tiny__*.json")
    t = json.loads(merged.read_text())["targets"]
    for name in RETRIEVAL_TARGETS:
        line = next(x for x in printed.splitlines() if x.startswith(f"{name}:"))
        if dense_retrieval < DENSE_RETRIEVAL_FLOOR:
            assert t[name]["met"] is None and t[name]["evaluated"] is False
            assert line.endswith("(not evaluated: dense model does not retrieve)")
        else:
            assert isinstance(t[name]["met"], bool) and "evaluated" not in t[name]
            assert line.endswith("(met)") or line.endswith("(missed)")


def test_merge_refuses_repeated_seeds_and_other_configurations(tiny_runs):
    (a, b), _ = tiny_runs
    with pytest.raises(ValueError, match="repeat a seed"):
        merge_results([a, a])
    other = {**b, "config": {**b["config"], "steps": b["config"]["steps"] + 1}}
    with pytest.raises(ValueError, match="one configuration"):
        merge_results([a, other])
    with pytest.raises(ValueError, match="at least one"):
        merge_results([])


def test_drawings_show_the_merged_numbers(tiny_runs):
    pytest.importorskip("plotly")
    from treeattn_lab.lab import viz

    _, merged = tiny_runs
    curves = viz.draw_training_curves(merged)
    dense = [t for t in curves.data if t.legendgroup == "dense"]
    assert len(dense) == 2  # next-byte loss and answer loss
    cfg = merged["config"]
    assert dense[0].x[0] == sum(s["steps"] for s in cfg["pretrain"]) and len(dense[0].y) == cfg["steps"]
    runs = [merged["histories"][f"dense/seed{s}"]["lm_loss"] for s in (0, 1)]
    assert list(dense[0].y) == pytest.approx([(a + b) / 2 for a, b in zip(*runs, strict=True)])
    retrieval = viz.draw_retrieval_by_depth(merged)
    by = {s["variant"]: s for s in merged["summary"]}
    for trace, variant in zip(retrieval.data, VARIANTS, strict=True):
        assert list(trace.y) == [by[variant]["retrieval"][str(d)] for d in cfg["depths"]]
    times = viz.draw_training_times(merged)
    kernel, estimate, step = times.data
    assert list(kernel.y) == [by[v]["kernel_ms"] for v in VARIANTS]
    assert list(estimate.y) == [by[v]["estimate_ms"] for v in VARIANTS]
    assert list(step.y) == [by[v]["step_ms"] for v in VARIANTS]


def test_merge_reads_a_zero_answer_loss_without_a_passkey_as_undefined():
    from treeattn_lab.experiments.sparse_training import _undefined_answer_loss

    history = {"loss": [3.0, 2.5, 2.0], "lm_loss": [3.0, 2.0, 2.0], "key_loss": [0.0, 0.5, 0.0],
               "step_ms": [1, 1, 1]}
    history["loss"][2] = 2.0 + 1e-9  # a passkey step whose answer loss happens to be 0: kept
    got = _undefined_answer_loss(history)
    assert math.isnan(got["key_loss"][0]) and got["key_loss"][1:] == [0.5, 0.0]
    assert history["key_loss"] == [0.0, 0.5, 0.0]  # the input is not changed


def test_the_pretraining_rate_refuses_a_stage_or_step_outside_the_curriculum():
    cfg = ExperimentConfig(pretrain=(Stage(128, 5, 2), Stage(256, 3, 2)))
    for stage, step, error, match in ((2, 0, ValueError, "past the curriculum's 2 stages"),
                                      (-1, 0, ValueError, "stage must be at least 0"),
                                      (1, 3, ValueError, "past stage 1's 3 steps"),
                                      (0, -5, ValueError, "step must be at least 0"),
                                      (0, 1.5, TypeError, "step must be an int")):
        with pytest.raises(error, match=match):
            cfg.pretrain_lr(stage, step)


def test_rates_are_stored_as_python_floats():
    import json

    import numpy as np

    stage = Stage(128, 5, 2, lr=np.float32(1e-3))
    cfg = ExperimentConfig(pretrain=(stage,), lr=np.float64(2e-3), extend_lr=np.float32(5e-4))
    assert type(stage.lr) is float and type(cfg.lr) is float and type(cfg.extend_lr) is float
    json.dumps([stage.lr, cfg.lr, cfg.extend_lr])  # what the results file needs
