"""The cost model's fit and refinement: NNLS where the measurements identify it, physical fallbacks where
they do not, slopes held to what a device can do, calibration tries at the scale of use, and per-mode
rescaling from measured micro-batches (also through the distributed probe, on a one-rank gloo group)."""

from __future__ import annotations

import copy
import dataclasses
import errno
import json
import math
import random
import warnings
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import rollout_forests
from treeattn_lab import RolloutTrie
from treeattn_lab.datasets import load_trie
from treeattn_lab.distributed.balance import BEST, EngineCost, balance
from treeattn_lab.distributed.probe import predicted_for_modes_run, refine_cost_model
from treeattn_lab.engine import (
    CostModel,
    MicroBatchShape,
    calibrate,
    calibration,
    plan_micro_batches,
    tree_backward,
)
from treeattn_lab.engine.calibration import calibration_tries
from treeattn_lab.engine.call_plan import auto_micro_batches
from treeattn_lab.engine.cost_model import MODES
from treeattn_lab.engine.nnls import COND_LIMIT
from treeattn_lab.engine.time_fit import (
    MAX_PLAUSIBLE_FLOPS,
    PER_CALL_FIT,
    fit_host_bound,
    fit_per_call,
    fit_time,
    model_work,
)
from treeattn_lab.reference import TinyLM, TinyLMConfig

# the FLOPs of the 0.49B model of `bench train` (model_work of its TinyLM)
WORK = {"flops_per_token": 2.7e9, "flops_per_pair": 3.4e5, "known": True}


def random_features(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1_000, 33_000, (n,), generator=g).double()
    pairs = tokens * torch.randint(200, 8_000, (n,), generator=g).double()
    calls = torch.randint(1, 40, (n,), generator=g).double()
    return torch.stack([torch.ones(n, dtype=torch.float64), tokens, pairs, calls], 1)


# ------------------------------------------------------------------------------------------- fit_time
def test_fit_recovers_identified_coefficients():
    A = random_features(9, seed=0)
    truth = torch.tensor([0.02, 1.3e-5, 7e-10, 0.09], dtype=torch.float64)
    coef, info = fit_time(A, A @ truth, WORK)
    assert info["method"] == "nnls" and info["rel_rms_residual"] < 1e-9
    torch.testing.assert_close(torch.tensor(coef, dtype=torch.float64), truth, rtol=1e-6, atol=0)
    assert info["tflops"] == pytest.approx(WORK["flops_per_token"] / 1.3e-5 / 1e12)


def test_host_bound_measurements_keep_a_physical_token_slope():
    # every call costs 0.1 s whatever its tokens (host-bound): unconstrained NNLS finds a zero token slope,
    # which predicts that tokens are free; with the model's FLOPs the slope stays at the fastest possible
    A = random_features(9, seed=1)
    b = 0.05 + 0.1 * A[:, 3]
    coef, info = fit_time(A, b)  # no model: nothing to hold the slope up
    assert info["method"] == "nnls" and coef[1] == pytest.approx(0.0, abs=1e-15)
    coef, info = fit_time(A, b, WORK)
    assert info["method"] == "nnls"
    assert coef[1] == pytest.approx(WORK["flops_per_token"] / MAX_PLAUSIBLE_FLOPS, rel=1e-9)
    assert coef[2] == pytest.approx(WORK["flops_per_pair"] / MAX_PLAUSIBLE_FLOPS, rel=1e-9)
    assert info["tflops"] == pytest.approx(MAX_PLAUSIBLE_FLOPS / 1e12)
    assert coef[3] == pytest.approx(0.1, rel=0.05)


def test_collinear_features_fall_back_to_physics():
    # tokens and pairs in a fixed ratio: NNLS cannot tell them apart (condition number ~1e16), so the
    # time is fitted as c + s * FLOPs + c_call * calls with the architecture's pair/token FLOPs ratio
    A = random_features(8, seed=2)
    A[:, 2] = 500.0 * A[:, 1]
    flops = WORK["flops_per_token"] * A[:, 1] + WORK["flops_per_pair"] * A[:, 2]
    b = 0.03 + flops / 2.0e14 + 0.08 * A[:, 3]
    coef, info = fit_time(A, b, WORK)
    assert info["method"] == "physical" and info["condition"] > COND_LIMIT
    assert coef[0] == pytest.approx(0.03, rel=1e-6) and coef[3] == pytest.approx(0.08, rel=1e-6)
    assert coef[1] == pytest.approx(WORK["flops_per_token"] / 2.0e14, rel=1e-6)
    assert coef[2] / coef[1] == pytest.approx(WORK["flops_per_pair"] / WORK["flops_per_token"])


def test_too_few_measurements_give_time_proportional_to_flops():
    A = random_features(1, seed=3)
    coef, info = fit_time(A, torch.tensor([0.7], dtype=torch.float64), WORK)
    assert info["method"] == "proportional"
    assert coef[0] == 0.0 and coef[3] == 0.0
    assert float(A[0] @ torch.tensor(coef, dtype=torch.float64)) == pytest.approx(0.7)
    # three rows cannot identify the three physical coefficients either
    A = random_features(3, seed=4)
    assert fit_time(A, A @ torch.tensor([0.0, 1e-5, 1e-9, 0.1], dtype=torch.float64), WORK)[1]["method"] == (
        "proportional"
    )


@pytest.mark.parametrize(
    ("A", "b", "match"),
    [
        (torch.ones(3, 3), torch.ones(3), "need features"),
        (torch.ones(3, 4), torch.ones(2), "need features"),
        (torch.ones(0, 4), torch.ones(0), "need features"),
        (torch.ones(3, 4), torch.tensor([1.0, 0.0, 1.0]), "times finite and > 0"),
        (-torch.ones(3, 4), torch.ones(3), "features must be finite and >= 0"),
        (torch.ones(3, 4), torch.tensor([1.0, math.nan, 1.0]), "finite"),
    ],
)
def test_fit_rejects_bad_measurements(A, b, match):
    with pytest.raises(ValueError, match=match):
        fit_time(A, b)


# --------------------------------------------------------------------- calibration at the scale of use
def packed_time(shape: MicroBatchShape) -> float:
    """A device where a model call costs the larger of its host time (0.1 s) and its device time."""
    return 0.01 + max(0.1, 1.3e-5 * shape.tree_tokens + 7e-10 * shape.tree_pairs)


def fitted_packed(scale_tokens: int) -> CostModel:
    tries = calibration_tries(scale_tokens, vocab=32000, seed=0)
    shapes = [MicroBatchShape.of(t, 4096, scale_tokens) for _, t in tries]
    samples = [
        {
            "mode": "packed",
            "time_features": s.time_features("packed"),
            "memory_features": s.memory_features("packed"),
            "time_s": packed_time(s),
            "peak_bytes": None,
        }
        for s in shapes
    ]
    return CostModel.fit(samples, work=WORK)


def test_calibration_at_the_budget_predicts_budget_sized_micro_batches():
    # the grpo_math micro-batches at a 32K budget: tries of at most 8K tree tokens (host-bound on this
    # device) extrapolate far too low, tries that reach the budget predict them
    real = [
        MicroBatchShape.of(mb.trie, 4096, 32768) for mb in plan_micro_batches(load_trie("grpo_math"), 32768)
    ]
    truth = sum(packed_time(s) for s in real)
    at_budget = sum(fitted_packed(32768).predict(s, "packed")[0] for s in real)
    small = sum(fitted_packed(8192).predict(s, "packed")[0] for s in real)
    assert abs(at_budget / truth - 1) < 0.05
    assert small / truth - 1 < -0.25


# a device whose calls cost max(host, device): host = eta . [1, calls], device = theta . TIME_FEATURES
HOST_TRUTH = {"flat": [0.054, 0.0], "packed": [0.11, 0.0], "dfs": [0.07, 0.0]}
DEVICE_TRUTH = {
    "flat": [0.005, 1.2e-5, 5e-10, 0.002],
    "packed": [0.01, 1.3e-5, 7e-10, 0.0],
    "dfs": [0.02, 1.4e-5, 8e-10, 0.0005],
}


def max_time(shape: MicroBatchShape, mode: str, noise: float = 0.0, rng=None) -> float:
    x = shape.time_features(mode)
    device = sum(a * f for a, f in zip(DEVICE_TRUTH[mode], x, strict=True))
    host = HOST_TRUTH[mode][0] + HOST_TRUTH[mode][1] * x[3]
    return max(host, device) * (1.0 + noise * rng.uniform(-1.0, 1.0) if noise else 1.0)


def max_samples(scale: int, noise: float = 0.0, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    shapes = [MicroBatchShape.of(t, 4096, scale) for _, t in calibration_tries(scale, vocab=32000, seed=0)]
    return [
        {
            "mode": m,
            "time_features": s.time_features(m),
            "memory_features": s.memory_features(m),
            "time_s": max_time(s, m, noise, rng),
            "peak_bytes": None,
        }
        for s in shapes
        for m in MODES
    ]


def rank_share_shapes(name: str, ranks: int, budget: int) -> list[MicroBatchShape]:
    """The micro-batches every rank of a partition runs: most fill the budget, the last of each share not."""
    report = balance(load_trie(name), ranks, BEST, token_budget=budget)
    return [MicroBatchShape.of(mb.trie, 4096, budget) for s in report.shares for mb in s.micro_batches]


def test_calibration_recovers_the_host_floor_of_max_host_device_timings():
    fitted = CostModel.fit(max_samples(32768), work=WORK)
    assert fitted.calibrated
    for m in MODES:
        assert fitted.fit_info[m]["host"] == "max" and fitted.fit_info[m]["host_bound"] >= 2, m
        assert fitted.fit_info[m]["rel_rms_residual"] < 1e-9
        assert fitted.fit_info[m]["linear_rel_rms_residual"] > 0.05  # no linear fit explains the floor
        torch.testing.assert_close(
            torch.tensor(fitted.time[m]), torch.tensor(DEVICE_TRUTH[m]), rtol=1e-6, atol=0
        )
        torch.testing.assert_close(
            torch.tensor(fitted.host[m]), torch.tensor(HOST_TRUTH[m]), rtol=1e-6, atol=0
        )
    # the linear model of the same measurements under-predicts the small micro-batches of ranks' shares
    linear = CostModel(
        time={m: fit_time(*_rows(max_samples(32768), m), WORK)[0] for m in MODES}, calibrated=True
    )
    shapes = rank_share_shapes("grpo_math", 2, 32768) + rank_share_shapes("agentic", 4, 16384)
    assert any(fitted.host_bound(s, "packed") for s in shapes) and not all(
        fitted.host_bound(s, "packed") for s in shapes
    )
    for m in MODES:
        truth = torch.tensor([max_time(s, m) for s in shapes])
        err_max = (torch.tensor([fitted.predict(s, m)[0] for s in shapes]) / truth - 1).abs().max()
        err_linear = (torch.tensor([linear.predict(s, m)[0] for s in shapes]) / truth - 1).abs().max()
        assert err_max < 1e-6 and err_linear > 0.05, (m, float(err_max), float(err_linear))
    again = CostModel.from_dict(json.loads(json.dumps(fitted.to_dict())))
    assert again.host == fitted.host and again.predict(shapes[0], "dfs") == fitted.predict(shapes[0], "dfs")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_noisy_max_host_device_timings_still_predict_better_than_linear(seed):
    """3% timing noise: every prediction stays within a few noise widths, and on the packed micro-batches
    of ranks' shares (two of them host-bound) the max fit errs far less than the linear one."""
    samples = max_samples(32768, noise=0.03, seed=seed)
    fitted = CostModel.fit(samples, work=WORK)
    linear = CostModel(time={m: fit_time(*_rows(samples, m), WORK)[0] for m in MODES}, calibrated=True)
    shapes = rank_share_shapes("grpo_math", 2, 32768) + rank_share_shapes("agentic", 4, 16384)
    errors = {}
    for m in MODES:
        assert fitted.fit_info[m]["host"] == "max", m
        truth = torch.tensor([max_time(s, m) for s in shapes])
        for name, model in (("max", fitted), ("linear", linear)):
            predicted = torch.tensor([model.predict(s, m)[0] for s in shapes])
            errors[m, name] = float((predicted / truth - 1).abs().max())
        assert errors[m, "max"] < 0.12, errors
    assert errors["packed", "max"] < 0.05 and errors["packed", "linear"] > 0.2, errors


def test_linear_timings_get_no_host_term():
    A = random_features(9, seed=0)
    truth = torch.tensor([0.02, 1.3e-5, 7e-10, 0.09], dtype=torch.float64)
    theta, eta, info = fit_host_bound(A, A @ truth, WORK)
    assert eta == [0.0, 0.0] and info["host"] == "none" and info["host_bound"] == 0
    torch.testing.assert_close(torch.tensor(theta, dtype=torch.float64), truth, rtol=1e-6, atol=0)
    # a prior or an older saved model has no host floor: its time is its device term
    shape = small_shapes(1, seed=0)[0]
    model = CostModel()
    assert model.predict(shape, "packed")[0] == model.time_terms(shape, "packed")[1]
    assert not model.host_bound(shape, "packed")


def _rows(samples: list[dict], mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    rows = [s for s in samples if s["mode"] == mode]
    A = torch.tensor([r["time_features"] for r in rows], dtype=torch.float64)
    return A, torch.tensor([r["time_s"] for r in rows], dtype=torch.float64)


def test_calibration_tries_reach_the_budget_with_rollouts_like_rl():
    scale = 32768
    tries = calibration_tries(scale, vocab=32000, seed=0)
    tree = [sum(len(n.tokens) for n in t.nodes) for _, t in tries]
    assert all(t <= scale for t in tree)  # one micro-batch each
    assert min(tree[:2]) >= 0.9 * scale  # the first two fill the budget
    assert len(plan_micro_batches(tries[0][1], scale)) == 1
    longest = [max(t.seq_lengths) for _, t in tries]
    assert max(longest) >= scale // 5 and min(longest) <= scale // 60  # 8K-token and 512-token rollouts
    ratios = [t.stats()["token_ratio"] for _, t in tries]
    assert min(ratios) < 1.2 and max(ratios) > 3.0  # low to high sharing
    capped = calibration_tries(scale, vocab=32000, seed=0, max_length=1000)
    assert max(max(t.seq_lengths) for _, t in capped) <= 1000
    assert [t.num_sequences for _, t in calibration_tries(64, vocab=7, seed=1)]  # tiny scales still build


def test_calibration_tries_at_tiny_scales_fit_or_refuse():
    # scales the deeper designs cannot reach by dropping prompts alone: they shrink forks, then lengths,
    # and refuse with a clear error where even one chain of single tokens is too big
    for scale in (4, 8):
        tries = calibration_tries(scale, vocab=50)
        assert all(sum(len(n.tokens) for n in t.nodes) <= scale for _, t in tries)
    with pytest.raises(ValueError, match="scale_tokens=2 is too small"):
        calibration_tries(2, vocab=50)


def test_model_work_counts_matmuls_and_attended_pairs():
    cfg = TinyLMConfig(vocab_size=100, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=48)
    model = TinyLM(cfg)
    per_layer = 32 * 32 * 2 + 2 * (32 * 16) + 3 * 32 * 48  # wq, wo; wk, wv (2 kv heads of 8); SwiGLU
    work = model_work(model)
    assert work["flops_per_token"] == 6 * (3 * per_layer + 32 * 100)  # the head, not the embedding
    assert work["flops_per_pair"] == 14 * 4 * 8 * 3
    assert work["known"]


def test_model_work_takes_an_mla_query_and_value_width_not_its_rope_part():
    model = torch.nn.Linear(4, 4)
    model.config = SimpleNamespace(num_hidden_layers=2, num_attention_heads=3, hidden_size=48,
                                   head_dim=16, qk_head_dim=48)  # 16 rope + 32 nope channels per query
    assert model_work(model)["flops_per_pair"] == 14 * 3 * 48 * 2
    model.config.v_head_dim = 32  # Q.K over 48 channels, P.V over 32
    assert model_work(model)["flops_per_pair"] == 14 * 3 * 40 * 2
    model.config = SimpleNamespace(num_hidden_layers=2, num_attention_heads=3, hidden_size=48, head_dim=8)
    assert model_work(model)["flops_per_pair"] == 14 * 3 * 8 * 2


# ------------------------------------------------------------------------------------------- refine
def small_shapes(n: int, seed: int) -> list[MicroBatchShape]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = [rng.randrange(50) for _ in range(rng.randint(5, 40))]
        seqs = [
            prompt + [rng.randrange(50) for _ in range(rng.randint(1, 60))] for _ in range(rng.randint(2, 6))
        ]
        out.append(MicroBatchShape.of(RolloutTrie.from_sequences(seqs), 16))
    return out


def calibrated_model() -> CostModel:
    return CostModel(
        time={
            "flat": [0.0, 1e-5, 1e-8, 0.0],
            "packed": [0.004, 1e-5, 3e-8, 0.0],
            "dfs": [0.01, 4e-5, 3e-8, 0.05],
        },
        calibrated=True,
    )


def test_refine_recovers_per_mode_scales_and_changes_the_choice():
    model = calibrated_model()
    before = model.to_dict()
    shapes = small_shapes(6, seed=0)
    truth = {"flat": 3.0, "packed": 0.5}
    observations = [([(s, m)], truth[m] * model.predict(s, m)[0]) for s in shapes for m in truth]
    refined = model.refine(observations)
    assert refined.refinement["method"] == "per_mode"
    assert refined.refinement["scales"]["flat"] == pytest.approx(3.0)
    assert refined.refinement["scales"]["packed"] == pytest.approx(0.5)
    assert refined.refinement["median_abs_error_after"] < 1e-9
    # dfs was not observed: it takes the pooled scale (sum p y / sum p^2 over all observations)
    p = torch.tensor([model.predict(s, m)[0] for s in shapes for m in truth])
    y = torch.tensor([t for _, t in observations])
    assert refined.refinement["scales"]["dfs"] == pytest.approx(float(p @ y / (p @ p)))
    for s in shapes:
        for m in MODES:
            assert refined.predict(s, m)[0] == pytest.approx(
                refined.refinement["scales"][m] * model.predict(s, m)[0]
            )
    assert model.to_dict() == before  # not mutated
    assert CostModel.from_dict(refined.to_dict()).to_dict() == refined.to_dict()
    # where the calibration picked the wrong one of flat and packed, the refined model picks the measured best
    pair = ("flat", "packed")
    fastest = [min(pair, key=lambda m: truth[m] * model.predict(s, m)[0]) for s in shapes]
    assert any(model.choose(s, modes=pair)[0] != f for s, f in zip(shapes, fastest, strict=True))
    assert [refined.choose(s, modes=pair)[0] for s in shapes] == fastest


def test_refine_pools_what_the_observations_cannot_separate():
    model = calibrated_model()
    shapes = small_shapes(3, seed=1)
    # each call ran one flat and one packed micro-batch of the same shape: two modes, two observations
    observations = [
        ([(s, "flat"), (s, "packed")], 1.3 * sum(model.predict(s, m)[0] for m in ("flat", "packed")))
        for s in shapes[:2]
    ]
    refined = model.refine(observations)
    assert refined.refinement["method"] == "pooled"
    assert all(v == pytest.approx(1.3) for v in refined.refinement["scales"].values())
    assert refined.refinement["modes_observed"] == ["flat", "packed"]
    again = refined.refine([([(shapes[2], "dfs")], 2.0 * refined.predict(shapes[2], "dfs")[0])])
    assert again.refinement["scales"]["dfs"] == pytest.approx(2.0)
    assert again.refinement["previous"] == refined.refinement


def test_old_files_without_fit_info_still_load():
    data = calibrated_model().to_dict()
    del data["fit_info"], data["refinement"], data["host"]
    model = CostModel.from_dict(data)
    assert model.fit_info == {} and model.refinement is None
    assert model.host == {m: [0.0, 0.0] for m in MODES}  # no host floor: the device term alone


@pytest.mark.parametrize(
    ("observations", "error", "match"),
    [
        ([], ValueError, "non-empty list"),
        ("flat", ValueError, "non-empty list"),
        ([(1.0,)], ValueError, r"\(parts, seconds\) pair"),
        ([([], 1.0)], ValueError, "no parts"),
        ([("SHAPE", -1.0)], ValueError, "seconds must be a finite number > 0"),
        ([("SHAPE", math.inf)], ValueError, "seconds must be a finite number > 0"),
        ([("SHAPE", True)], ValueError, "seconds must be a finite number > 0"),
        ([([("not a shape", "flat")], 1.0)], TypeError, "MicroBatchShape"),
        ([([("S", "tree")], 1.0)], ValueError, "unknown mode 'tree'"),
    ],
)
def test_refine_rejects_bad_observations(observations, error, match):
    shape = small_shapes(1, seed=2)[0]
    fixed = []
    for obs in observations if isinstance(observations, list) else []:
        if obs and obs[0] == "SHAPE":
            obs = ([(shape, "flat")], obs[1])
        elif obs and isinstance(obs[0], list) and obs[0] and obs[0][0][0] == "S":
            obs = ([(shape, obs[0][0][1])], obs[1])
        fixed.append(obs)
    with pytest.raises(error, match=match):
        calibrated_model().refine(fixed if isinstance(observations, list) else observations)


# ------------------------------------------------------------------------------- planning the cuts
def device_bound_model(host_floor: float = 0.0, dfs_call_s: float = 0.0) -> CostModel:
    """Calibrated coefficients where a micro-batch costs little more than its tokens, plus a host floor
    (flat three times slower: ``"auto"`` runs the tree modes), and ``dfs_call_s`` of host time per dfs
    model call (a large one keeps ``"auto"`` from walking the whole trie in dfs)."""
    theta = [1e-6, 1e-5, 1e-9, 1e-6]
    host = {m: [host_floor, 0.0] for m in MODES}
    host["dfs"] = [host_floor, dfs_call_s]
    return CostModel(
        time={m: [c * (3 if m == "flat" else 1) for c in theta] for m in MODES},
        host=host,
        calibrated=True,
    )


def prompt_groups(prompts: int = 4, prompt_len: int = 30, samples: int = 4, tail: int = 10, seed: int = 0):
    """``prompts`` prompts of ``prompt_len`` tokens, sampled ``samples`` times each (distinct tails)."""
    rng = random.Random(seed)
    seqs = []
    for _ in range(prompts):
        prompt = [rng.randrange(50) for _ in range(prompt_len)]
        seqs += [prompt + [j] + [rng.randrange(50) for _ in range(tail - 1)] for j in range(samples)]
    return seqs


@pytest.mark.parametrize("mode", ["packed", "auto"])
def test_a_host_bound_model_plans_fewer_fuller_micro_batches_with_exact_gradients(mode):
    from tests.engine_models import assert_grads_close, flat_gradients, random_weights, tiny_lm

    seqs = prompt_groups()  # four subtrees of 70 tree tokens: two never fit a budget of 120
    trie, budget = RolloutTrie.from_sequences(seqs), 120
    # dfs calls too dear for auto to walk the whole trie: it runs the planned micro-batches
    host_bound, device_bound = device_bound_model(host_floor=1.0, dfs_call_s=10.0), device_bound_model()
    fewer = plan_micro_batches(trie, budget, cost_model=host_bound, mode=mode)
    apart = plan_micro_batches(trie, budget, cost_model=device_bound, mode=mode)
    assert len(fewer) == len(plan_micro_batches(trie, budget)) == 3  # as few as the budget allows
    assert sum(mb.carried_tokens for mb in fewer) > 0  # ... at the price of a prefix computed twice
    assert len(apart) == 4 and sum(mb.carried_tokens for mb in apart) == 0  # one subtree each
    model = tiny_lm()
    weights = random_weights(seqs, 3)
    expected, _ = flat_gradients(model, seqs, weights)
    for cost_model, plan in ((host_bound, fewer), (device_bound, apart)):
        model.zero_grad(set_to_none=True)
        result = tree_backward(
            model, trie, weights, mode=mode, block_tokens=8, token_budget=budget, cost_model=cost_model
        )
        assert len(result.report.modes) == len(plan)
        carried = [mb.carried_tokens for mb, m in zip(plan, result.report.modes, strict=True) if m != "flat"]
        assert result.report.carried_tokens == sum(carried)
        assert_grads_close(model, expected, 1e-9)


def dfs_fastest_model(memory_per_block_token: float = 0.0, others_bytes: float = 0.0) -> CostModel:
    """Calibrated coefficients under which ``"auto"`` puts every micro-batch in ``"dfs"`` where it fits; a
    DFS micro-batch's predicted peak is ``memory_per_block_token`` bytes per token of its largest call,
    the other modes' ``others_bytes``."""
    theta = [1e-6, 1e-5, 1e-9, 1e-6]
    memory = {m: [others_bytes, 0.0, 0.0] for m in MODES}
    memory["dfs"] = [0.0, memory_per_block_token, 0.0]
    return CostModel(
        time={m: [c * (1 if m == "dfs" else 3) for c in theta] for m in MODES},
        host={m: [0.0, 0.0] for m in MODES},
        memory=memory,
        calibrated=True,
    )


class FirstPackedThenDfs(CostModel):
    """A calibrated model whose ``choose`` puts the first micro-batch it is asked about in packed and every
    later one in dfs (a plan where a dfs run follows a packed micro-batch)."""

    def choose(self, shape, *, memory_limit=None, modes=MODES):
        _, predictions = super().choose(shape, memory_limit=memory_limit, modes=modes)
        self.asked = getattr(self, "asked", 0) + 1
        return ("packed" if self.asked == 1 else "dfs"), predictions


def test_the_dfs_mode_runs_the_whole_trie_as_one_micro_batch_whatever_the_budget():
    from tests.engine_models import assert_grads_close, flat_gradients, random_weights, tiny_lm

    seqs = prompt_groups()
    trie, budget = RolloutTrie.from_sequences(seqs), 120
    for cost_model in (None, device_bound_model(host_floor=1.0)):
        (whole,) = plan_micro_batches(trie, budget, cost_model=cost_model, mode="dfs")
        assert sorted(whole.sequences) == list(range(len(seqs))) and whole.carried_tokens == 0
    model = tiny_lm()
    weights = random_weights(seqs, 5)
    expected, _ = flat_gradients(model, seqs, weights)
    result = tree_backward(model, trie, weights, mode="dfs", block_tokens=8, token_budget=budget)
    assert result.report.modes == ["dfs"] and result.report.carried_tokens == 0
    assert result.report.tree_tokens == trie.stats()["tree_tokens"]
    assert_grads_close(model, expected, 1e-9)


def test_auto_runs_neighbouring_dfs_micro_batches_as_one_where_it_fits_the_memory_limit():
    from tests.engine_models import assert_grads_close, flat_gradients, random_weights, tiny_lm

    seqs = prompt_groups()  # four subtrees of 70 tree tokens, longest rollout 40
    trie, budget = RolloutTrie.from_sequences(seqs), 120
    assert len(plan_micro_batches(trie, budget, cost_model=dfs_fastest_model(), mode="auto")) > 1
    merged = auto_micro_batches(trie, 8, budget, dfs_fastest_model(), memory_limit=None)
    ((whole, predicted),) = merged
    assert whole.mode == "dfs" and whole.sequences == tuple(trie.dfs_sequence_order())
    assert set(predicted) == set(MODES) and predicted["dfs"][0] < predicted["packed"][0]
    # 24 unshared rollouts of 10 tokens: each half of the budget runs as one span of 120 tokens, the whole
    # trie as spans of up to 200 (block_tokens); a limit between the two keeps the cuts
    unshared = RolloutTrie.from_sequences([[j % 50, *(7 * j + i for i in range(9))] for j in range(24)])
    limited = auto_micro_batches(unshared, 200, budget, dfs_fastest_model(1.0), memory_limit=150.0)
    assert [mb.mode for mb, _ in limited] == ["dfs", "dfs"]
    assert len(auto_micro_batches(unshared, 200, budget, dfs_fastest_model(1.0), memory_limit=250.0)) == 1
    # three cuts of 80 tokens: the whole (spans of 200) does not fit 170, the first two (160) do
    thirds = auto_micro_batches(unshared, 200, 80, dfs_fastest_model(1.0), memory_limit=170.0)
    assert [len(mb.sequences) for mb, _ in thirds] == [16, 8]
    # no mode fits 50: each cut runs in dfs, the leanest; joined, the spans stay 120 tokens, no worse
    leanest = auto_micro_batches(unshared, 120, budget, dfs_fastest_model(1.0, 1e9), memory_limit=50.0)
    assert [(mb.mode, len(mb.sequences)) for mb, _ in leanest] == [("dfs", 24)]
    model = tiny_lm()
    weights = random_weights(seqs, 6)
    expected, _ = flat_gradients(model, seqs, weights)
    result = tree_backward(
        model, trie, weights, mode="auto", block_tokens=8, token_budget=budget, cost_model=dfs_fastest_model()
    )
    assert result.report.modes == ["dfs"] and result.report.carried_tokens == 0
    assert_grads_close(model, expected, 1e-9)
    balanced = EngineCost(dfs_fastest_model(), block_tokens=8).plan(trie, budget)
    assert [mb.sequences for mb in balanced] == [whole.sequences]


def test_a_dfs_run_after_a_packed_micro_batch_carries_its_first_members_prefix_with_exact_gradients():
    from tests.engine_models import assert_grads_close, flat_gradients, random_weights, tiny_lm

    seqs = prompt_groups()
    trie, budget = RolloutTrie.from_sequences(seqs), 120
    # three cuts, the second carrying its prompt; dfs calls too dear to walk the whole trie instead
    host_bound = device_bound_model(host_floor=1.0, dfs_call_s=10.0)
    cut = plan_micro_batches(trie, budget, cost_model=host_bound, mode="auto")
    assert [mb.carried_tokens for mb in cut] == [0, 30, 0]

    def first_packed():
        return FirstPackedThenDfs(time=host_bound.time, host=host_bound.host, calibrated=True)

    planned = auto_micro_batches(trie, 8, budget, first_packed())
    assert [(mb.mode, mb.sequences, mb.carried_tokens) for mb, _ in planned] == [
        ("packed", cut[0].sequences, 0), ("dfs", cut[1].sequences + cut[2].sequences, 30)]
    model = tiny_lm()
    weights = random_weights(seqs, 7)
    expected, _ = flat_gradients(model, seqs, weights)
    result = tree_backward(
        model, trie, weights, mode="auto", block_tokens=8, token_budget=budget, cost_model=first_packed()
    )
    assert result.report.modes == ["packed", "dfs"] and result.report.carried_tokens == 30
    assert_grads_close(model, expected, 1e-9)


def test_a_host_floor_moves_the_cut_so_no_micro_batch_is_left_below_it():
    """Ten unshared rollouts of 10 tokens under a budget of 80: the greedy fill leaves a 20-token
    micro-batch that waits on the host; with the floor at 50 tokens' device time the planner cuts 50 + 50
    (two micro-batches at the floor instead of one full one plus a floor)."""
    seqs = [[7 * j + i % 7 for i in range(10)] for j in range(10)]
    trie = RolloutTrie.from_sequences(seqs)
    assert trie.stats()["tree_tokens"] == 100
    per_token = 0.01
    model = CostModel(
        time={m: [0.0, per_token, 0.0, 0.0] for m in MODES},
        host={m: [50 * per_token, 0.0] for m in MODES},
        calibrated=True,
    )
    greedy = plan_micro_batches(trie, 80)
    planned = plan_micro_batches(trie, 80, cost_model=model, mode="packed")
    assert [mb.tree_tokens for mb in greedy] == [80, 20]
    assert [mb.tree_tokens for mb in planned] == [50, 50]
    shapes = [MicroBatchShape.of(mb.trie, 16) for mb in planned]
    assert all(model.predict(s, "packed")[0] == pytest.approx(0.5) for s in shapes)


@given(
    seqs=rollout_forests(max_sequences=12, max_len=16),
    budget=st.integers(1, 40),
    floor=st.sampled_from([0.0, 1e-4, 1.0]),
)
@settings(max_examples=40, deadline=None)
def test_cheapest_cuts_cover_every_rollout_once_and_never_cost_more_than_greedy(seqs, budget, floor):
    trie = RolloutTrie.from_sequences(seqs)
    model = device_bound_model(floor)
    planned = plan_micro_batches(trie, budget, cost_model=model, mode="packed")
    greedy = plan_micro_batches(trie, budget)
    assert sorted(i for mb in planned for i in mb.sequences) == list(range(len(seqs)))
    for mb in planned:
        assert mb.trie.sequences() == [seqs[i] for i in mb.sequences]
        assert mb.tree_tokens <= budget or len(mb.sequences) == 1
    total = trie.stats()["tree_tokens"]
    assert sum(mb.tree_tokens - mb.carried_tokens for mb in planned) == total

    def predicted(plan):
        shapes = [MicroBatchShape.of(mb.trie, 8) for mb in plan]
        return sum(model.planning_seconds("packed", s.tree_tokens, s.tree_pairs) for s in shapes)

    assert predicted(planned) <= predicted(greedy) * (1 + 1e-9)
    if floor == 1.0:  # every micro-batch host-bound: as few as the greedy fill
        assert len(planned) == len(greedy)


@pytest.mark.parametrize(
    "cost_model", [None, CostModel(), device_bound_model()], ids=["none", "prior", "calibrated"]
)
@pytest.mark.parametrize("mode", ["packd", "Flat", "", None, 3])
def test_the_planner_names_the_modes_for_a_bad_mode_with_or_without_a_cost_model(cost_model, mode):
    trie = RolloutTrie.from_sequences(prompt_groups(prompts=2))
    for budget in (None, 50):
        with pytest.raises(ValueError, match=r"mode must be one of \('auto', 'flat', 'packed', 'dfs'\)"):
            plan_micro_batches(trie, budget, cost_model=cost_model, mode=mode)


@pytest.mark.parametrize("mode", ["flat", "auto", "packd", None])
def test_planning_seconds_refuses_a_mode_that_is_not_a_tree_mode(mode):
    model = device_bound_model(host_floor=0.5)
    with pytest.raises(ValueError, match=r"tree modes \('packed', 'dfs'\)"):
        model.planning_seconds(mode, 100, 1000)


def test_planning_seconds_is_the_host_floor_or_the_device_term_without_calls():
    """The device term's constant, tokens and pairs against the host constant; no per-call term in
    either, so for packed it equals the prediction of the micro-batch's own shape."""
    model = CostModel(
        time={m: [0.5, 0.01, 1e-4, 7.0] for m in MODES}, host={m: [2.0, 9.0] for m in MODES}, calibrated=True
    )
    for mode in ("packed", "dfs"):
        assert model.planning_seconds(mode, 1000, 10_000) == pytest.approx(0.5 + 10.0 + 1.0)
        assert model.planning_seconds(mode, 10, 0) == pytest.approx(2.0)  # below the host floor
    trie = RolloutTrie.from_sequences(prompt_groups(prompts=2, prompt_len=200, tail=40))
    shape = MicroBatchShape.of(trie, 16)
    assert shape.tree_tokens > 150  # the device term is the larger, so the comparison is not the floor's
    predicted, _ = model.predict(shape, "packed")
    assert model.planning_seconds("packed", shape.tree_tokens, shape.tree_pairs) == pytest.approx(predicted)


# ------------------------------------------------------------------------- the distributed probe
def test_probe_times_every_micro_batch_in_the_contending_modes(one_rank_group):
    torch.manual_seed(0)
    model = TinyLM(TinyLMConfig(vocab_size=50, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48))
    for p in model.parameters():
        p.grad = torch.full_like(p, 7.0)
    rng = random.Random(3)
    prompts = [[rng.randrange(50) for _ in range(20)] for _ in range(3)]
    trie = RolloutTrie.from_sequences(
        [p + [rng.randrange(50) for _ in range(rng.randint(5, 30))] for p in prompts for _ in range(4)]
    )
    model_in = calibrated_model()
    model_in.time["packed"] = list(model_in.time["flat"])  # flat and packed contend,
    model_in.time["dfs"] = [10.0, 0.0, 0.0, 0.0]  # dfs never does
    refined, probe = refine_cost_model(model, trie, model_in, mode="auto", block_tokens=16, token_budget=100)
    micro_batches = plan_micro_batches(trie, 100, cost_model=model_in)  # cut as the engine cuts them
    assert probe["micro_batches"] == len(micro_batches) >= 2
    probed = {(t["micro_batch"], t["mode"]) for t in probe["timings"]}
    assert {i for i, _ in probed} == set(range(len(micro_batches)))
    assert {m for _, m in probed} == {"flat", "packed"}
    assert refined.refinement["observations"] == len(probe["timings"])
    assert all(s > 0 for s in refined.refinement["scales"].values())
    assert all(torch.all(p.grad == 7.0) for p in model.parameters())  # gradients restored
    # the calibration's prediction of what the refined plan runs; equal to the plan's own without a refit
    report = balance(trie, 1, BEST, cost=EngineCost(model_in, block_tokens=16), token_budget=100)
    again = predicted_for_modes_run(
        model_in, model_in, report.shares[0].micro_batches, mode="auto", block_tokens=16, token_budget=100
    )
    assert again == pytest.approx(report.shares[0].cost, rel=1e-12)


def test_refine_takes_numpy_seconds_like_floats():
    """Timings often arrive as numpy scalars (np.float32 included): the same refit as a Python float."""
    import numpy as np

    shape = small_shapes(1, seed=2)[0]
    model = calibrated_model()
    as_float = model.refine([([(shape, "flat")], 0.5)]).to_dict()["time"]
    as_numpy = model.refine([([(shape, "flat")], np.float32(0.5))]).to_dict()["time"]
    assert as_numpy.keys() == as_float.keys()
    for mode, coefs in as_float.items():
        assert as_numpy[mode] == pytest.approx(coefs, rel=1e-6)


# ------------------------------------------------------------------- calibration faults and the cache
TRUTH = {"flat": [0.01, 1e-5, 1e-8, 0.0], "packed": [0.02, 1e-5, 2e-8, 0.0], "dfs": [0.03, 2e-5, 2e-8, 0.004]}


def tiny_model(checkpointing: bool = False) -> TinyLM:
    torch.manual_seed(0)
    model = TinyLM(TinyLMConfig(vocab_size=50, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48))
    model.gradient_checkpointing = checkpointing
    return model


@pytest.fixture
def fake_device(monkeypatch, tmp_path):
    """``tree_backward`` replaced by a device whose times are exactly TRUTH . features (calls counted),
    and the cache in a fresh folder."""
    monkeypatch.setenv("TREEATTN_CACHE", str(tmp_path))
    calls = {"n": 0, "fail_at": None, "peak_bytes": None}

    def fake_tree_backward(model, trie, token_weights, *, mode, block_tokens, token_budget):
        calls["n"] += 1
        if calls["n"] == calls["fail_at"]:
            raise RuntimeError("out of memory")
        for p in model.parameters():  # what a real call does to .grad
            p.grad = torch.zeros_like(p)
        features = MicroBatchShape.of(trie, block_tokens, token_budget).time_features(mode)
        seconds = sum(a * f for a, f in zip(TRUTH[mode], features, strict=True))
        report = SimpleNamespace(time_s=seconds, peak_memory_bytes=calls["peak_bytes"])
        return SimpleNamespace(report=report)

    monkeypatch.setattr(calibration, "tree_backward", fake_tree_backward)
    return calls


SETTINGS = {"block_tokens": 16, "scale_tokens": 64}


def test_a_full_calibration_is_calibrated_and_cached(fake_device, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about
        fitted = calibrate(tiny_model(), **SETTINGS, progress=False)
    assert fitted.calibrated
    report = fitted.fit_info["calibration"]
    assert report["not_measured"] == [] and len(report["measured"]) == len(calibration.CALIBRATION_DESIGN)
    assert {fitted.fit_info[m]["method"] for m in MODES} <= {"nnls", "physical", PER_CALL_FIT}
    assert all(fitted.fit_info[m]["memory"] == "prior" for m in MODES)  # no peak memory on this device
    with pytest.raises(ValueError, match="memory was not measured"):
        fitted.choose(small_shapes(1, seed=0)[0], memory_limit=1e9)
    assert len(list(tmp_path.rglob("*.json"))) == 1
    n = fake_device["n"]
    assert calibrate(tiny_model(), **SETTINGS, progress=False).to_dict() == fitted.to_dict()
    assert fake_device["n"] == n  # from the cache


# what a dfs call costs the host, and the device's constant: at TRUTH's rates the calibration tries' short
# calls wait on the host and their long ones on the device
HOST_PER_CALL, DEVICE_PER_CALL = 3e-4, 1e-4


def per_call_truth(shape: MicroBatchShape) -> float:
    """A dfs walk on a device where every call costs the larger of its host and its device time, the
    device running a call's tokens and pairs at packed's rates (TRUTH) and a push at its forward share."""
    _, per_token, per_pair, _ = TRUTH["packed"]
    return sum(max(share * HOST_PER_CALL, share * DEVICE_PER_CALL + per_token * n + per_pair * p)
               for share, n, p in shape.dfs_call_work)


def test_dfs_is_fitted_per_call_and_predicts_walks_in_other_block_sizes(fake_device, monkeypatch):
    def fake_tree_backward(model, trie, token_weights, *, mode, block_tokens, token_budget):
        shape = MicroBatchShape.of(trie, block_tokens, token_budget)
        if mode == "dfs":
            seconds = per_call_truth(shape)
        else:
            seconds = sum(a * f for a, f in zip(TRUTH[mode], shape.time_features(mode), strict=True))
        return SimpleNamespace(report=SimpleNamespace(time_s=seconds, peak_memory_bytes=None))

    monkeypatch.setattr(calibration, "tree_backward", fake_tree_backward)
    fitted = calibrate(tiny_model(), block_tokens=8, token_budget=64, progress=False, use_cache=False)
    assert fitted.fit_info["dfs"]["method"] == PER_CALL_FIT and fitted.fit_info["packed"]["method"] == "nnls"
    assert fitted.time["dfs"][1:3] == fitted.time["packed"][1:3]  # a call's tokens at packed's rates
    assert fitted.host["dfs"][1] == pytest.approx(HOST_PER_CALL, rel=0.03)
    assert fitted.time["dfs"][3] == pytest.approx(DEVICE_PER_CALL, rel=0.1)
    assert fitted.fit_info["dfs"]["rel_rms_residual"] < 0.01
    trie = RolloutTrie.from_sequences(prompt_groups(prompts=3, prompt_len=40, samples=5, tail=12, seed=9))
    for block in (8, 16, 32, 64):  # sizes and a trie the calibration never ran
        shape = MicroBatchShape.of(trie, block, 64)
        assert fitted.predict(shape, "dfs")[0] == pytest.approx(per_call_truth(shape), rel=0.03)


def test_the_calls_work_adds_up_to_the_dfs_features_and_without_a_host_cost_to_the_device_term():
    shape = MicroBatchShape.of(RolloutTrie.from_sequences(prompt_groups(seed=2)), 16, 64)
    _, tokens, pairs, calls = shape.time_features("dfs")
    shares = [share for share, _, _ in shape.dfs_call_work]
    assert len(shares) == calls and min(shares) < 1  # the walk pushes
    assert sum(n for _, n, _ in shape.dfs_call_work) == pytest.approx(tokens, rel=1e-12)
    assert sum(p for _, _, p in shape.dfs_call_work) == pytest.approx(pairs, rel=1e-12)
    c0, per_token, per_pair, per_call = 0.01, 1e-5, 1e-8, 0.002
    model = CostModel(time={m: [c0, per_token, per_pair, per_call] for m in MODES}, calibrated=True,
                      fit_info={"dfs": {"method": PER_CALL_FIT}})
    device = c0 + per_token * tokens + per_pair * pairs + per_call * sum(shares)  # a push's: its share
    assert model.predict(shape, "dfs")[0] == pytest.approx(device, rel=1e-12)


def test_a_per_call_model_says_which_walks_wait_on_the_host_and_survives_a_round_trip():
    trie = RolloutTrie.from_sequences(prompt_groups(prompts=3, prompt_len=40, samples=5, tail=12, seed=9))
    small, large = MicroBatchShape.of(trie, 8, 64), MicroBatchShape.of(trie, 64, 64)
    _, per_token, per_pair, _ = TRUTH["packed"]
    model = CostModel(time={m: [0.0, per_token, per_pair, DEVICE_PER_CALL] for m in MODES},
                      host={m: [0.0, HOST_PER_CALL] for m in MODES}, calibrated=True,
                      fit_info={"dfs": {"method": PER_CALL_FIT}})
    for shape in (small, large):
        host, device = model.time_terms(shape, "dfs")
        assert model.predict(shape, "dfs")[0] == pytest.approx(per_call_truth(shape), rel=1e-12)
        seconds = model.predict(shape, "dfs")[0]
        assert max(host, device) <= seconds * (1 + 1e-12) and seconds <= (host + device) * (1 + 1e-12)
    assert model.host_bound(small, "dfs") and small.dfs_calls > large.dfs_calls
    again = CostModel.from_dict(json.loads(json.dumps(model.to_dict())))
    assert again.predict(small, "dfs") == model.predict(small, "dfs") and again.identifies("dfs")
    bare = dataclasses.replace(small, dfs_call_work=())
    with pytest.raises(ValueError, match="dfs_call_work"):
        model.predict(bare, "dfs")


def test_a_per_call_fit_refuses_walks_without_calls():
    with pytest.raises(ValueError, match="one non-empty list"):
        fit_per_call([[(1.0, 10.0, 55.0)], []], [0.1, 0.2], (1e-5, 1e-8))
    with pytest.raises(ValueError, match="one non-empty list"):
        fit_per_call([[(1.0, 10.0, 55.0)]], [0.1, 0.2], (1e-5, 1e-8))
    with pytest.raises(ValueError, match="finite and > 0"):
        fit_per_call([[(1.0, 10.0, 55.0)]], [0.0], (1e-5, 1e-8))
    with pytest.raises(ValueError, match="per token, per pair"):
        fit_per_call([[(1.0, 10.0, 55.0)]], [0.1], (1e-5,))


def test_a_calibration_is_refitted_from_its_recorded_timings_without_measuring(fake_device):
    fitted = calibrate(tiny_model(), block_tokens=8, token_budget=64, progress=False, use_cache=False)
    n = fake_device["n"]
    saved = CostModel.from_dict(json.loads(json.dumps(fitted.to_dict())))
    again = calibration.refit(saved)
    assert fake_device["n"] == n  # nothing measured
    for mode in MODES:  # the same fit, up to the rounding of the solver's floating-point sums
        assert again.fit_info[mode]["method"] == fitted.fit_info[mode]["method"]
        assert again.time[mode] == pytest.approx(fitted.time[mode], rel=1e-9, abs=1e-15)
        assert again.host[mode] == pytest.approx(fitted.host[mode], rel=1e-9, abs=1e-15)
    assert again.fit_info["calibration"] == fitted.fit_info["calibration"]
    timings = fitted.fit_info["calibration"]["timings"]
    dfs_blocks = {t["block_tokens"] for t in timings if t["mode"] == "dfs"}
    assert {t["mode"] for t in timings} == set(MODES) and 8 in dfs_blocks and max(dfs_blocks) <= 64
    assert len(dfs_blocks) >= 2  # the call's block, and the largest within the budget
    with pytest.raises(ValueError, match="no timings"):
        calibration.refit(CostModel())


def test_measured_peak_memory_is_fitted(fake_device):
    fake_device["peak_bytes"] = 2**30
    fitted = calibrate(tiny_model(), **SETTINGS, progress=False, use_cache=False)
    assert all(fitted.fit_info[m]["memory"] == "nnls" for m in MODES)
    mode, _ = fitted.choose(small_shapes(1, seed=0)[0], memory_limit=2**31)
    assert mode in MODES


def test_a_calibration_cut_short_says_what_it_could_not_fit(fake_device, tmp_path):
    total = len(calibration.CALIBRATION_DESIGN)
    with pytest.warns(UserWarning, match=rf"measured 1 of {total} calibration tries.*flat: proportional"):
        fitted = calibrate(tiny_model(), **SETTINGS, seconds=0.0, progress=False)
    assert not fitted.calibrated
    report = fitted.fit_info["calibration"]
    names = [row[0] for row in calibration.CALIBRATION_DESIGN]
    assert report["measured"] == names[:1] and report["not_measured"] == names[1:]
    assert report["stopped_by_time_limit"]
    assert all(fitted.fit_info[m]["method"] == "proportional" for m in MODES)
    assert fitted.samples == 3
    assert not list(tmp_path.rglob("*.json")), "an incomplete calibration is not cached"
    with pytest.raises(ValueError, match="calibrated cost model"):
        fitted.choose(small_shapes(1, seed=0)[0], memory_limit=1e9)


class RecordingBar:
    """A stand-in for tqdm that records whether it was closed."""

    made: list[RecordingBar] = []

    def __init__(self, iterable, **kwargs):
        self.iterable, self.closed = iterable, False
        RecordingBar.made.append(self)

    def __iter__(self):
        return iter(self.iterable)

    def close(self):
        self.closed = True


@pytest.mark.parametrize("how", ["time limit", "a failing run", "all tries"])
def test_the_progress_bar_is_closed_in_every_case(fake_device, monkeypatch, how):
    import tqdm.auto

    monkeypatch.setattr(tqdm.auto, "tqdm", RecordingBar)
    RecordingBar.made = []
    model = tiny_model()
    for p in model.parameters():
        p.grad = torch.full_like(p, 7.0)
    if how == "a failing run":
        fake_device["fail_at"] = 5  # after the warm-up, inside the first trie
        with pytest.raises(RuntimeError, match="out of memory"):
            calibrate(model, **SETTINGS, use_cache=False)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            calibrate(model, **SETTINGS, seconds=0.0 if how == "time limit" else 60.0, use_cache=False)
    assert len(RecordingBar.made) == 1 and RecordingBar.made[0].closed
    assert all(torch.all(p.grad == 7.0) for p in model.parameters())  # gradients restored


@pytest.mark.parametrize(
    "entry",
    [
        '{"time": {"flat": [0.0, 1',  # cut off mid-write
        "",
        "\x00\x00\x00",
        json.dumps({"time": 1}),
        json.dumps({**calibrated_model().to_dict(), "time": {**TRUTH, "flat": [math.nan, 1e-5, 0.0, 0.0]}}),
    ],
)
def test_an_unreadable_cache_entry_is_a_miss_and_is_overwritten(fake_device, entry):
    model = tiny_model()
    path = calibration.cache_path(model, SETTINGS["block_tokens"], None, SETTINGS["scale_tokens"])
    path.parent.mkdir(parents=True)
    path.write_text(entry)
    fitted = calibrate(model, **SETTINGS, progress=False)
    assert fitted.calibrated and fake_device["n"] > 0
    assert CostModel.from_dict(json.loads(path.read_text())).to_dict() == fitted.to_dict()


def test_a_failed_cache_write_leaves_no_partial_entry(fake_device, monkeypatch, tmp_path):
    model = tiny_model()

    def dump_then_fail(obj, f, **kwargs):  # a disk that fills up halfway through the write
        f.write(json.dumps(obj, **kwargs)[:20])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(json, "dump", dump_then_fail)
    with pytest.raises(OSError, match="No space left"):
        calibrate(model, **SETTINGS, progress=False)
    monkeypatch.undo()
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []
    monkeypatch.setenv("TREEATTN_CACHE", str(tmp_path))
    monkeypatch.setattr(calibration, "tree_backward", calibration.tree_backward)
    assert calibrate(model, **SETTINGS, progress=False, use_cache=True).calibrated


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"block_tokens": 0}, ValueError, "block_tokens must be at least 1"),
        ({"token_budget": 2.5}, TypeError, "token_budget must be an int"),
        ({"scale_tokens": True}, TypeError, "scale_tokens must be an int"),
        ({"repeats": 0}, ValueError, "repeats must be at least 1"),
        ({"seconds": -1.0}, ValueError, "seconds must be a finite number >= 0"),
        ({"seconds": math.nan}, ValueError, "seconds must be a finite number >= 0"),
        ({"seconds": "60"}, TypeError, "seconds must be a number"),
    ],
)
def test_calibrate_refuses_bad_settings(fake_device, kwargs, error, match):
    with pytest.raises(error, match=match):
        calibrate(tiny_model(), **{**SETTINGS, **kwargs}, progress=False)
    assert fake_device["n"] == 0, "nothing was measured"


def test_the_cache_key_sees_gradient_checkpointing(fake_device):
    plain, checkpointed = tiny_model(), tiny_model(checkpointing=True)
    key = (SETTINGS["block_tokens"], None, SETTINGS["scale_tokens"])
    assert calibration.cache_path(plain, *key) != calibration.cache_path(checkpointed, *key)
    calibrate(plain, **SETTINGS, progress=False)
    n = fake_device["n"]
    calibrate(checkpointed, **SETTINGS, progress=False)
    assert fake_device["n"] > n, "a calibration without checkpointing is not reused with it"


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"time": {**TRUTH, "flat": [math.nan, 1e-5, 0.0, 0.0]}}, ValueError, r"time\['flat'\]\[0\] is nan"),
        ({"time": {**TRUTH, "dfs": [0.0, -1e-5, 0.0, 0.0]}}, ValueError, r"time\['dfs'\]\[1\] is -1e-05"),
        (
            {"time": {**TRUTH, "packed": [0.0, "1e-5", 0.0, 0.0]}},
            TypeError,
            r"time\['packed'\]\[1\] is '1e-5'",
        ),
        ({"time": {**TRUTH, "packed": [0.0, True, 0.0, 0.0]}}, TypeError, r"time\['packed'\]\[1\] is True"),
        ({"time": {**TRUTH, "flat": [0.0, 1e-5]}}, ValueError, r"time\['flat'\] must hold 4 coefficients"),
        (
            {"time": {"flat": TRUTH["flat"]}},
            ValueError,
            r"time must give every mode.*missing \['packed', 'dfs'\]",
        ),
        ({"time": {**TRUTH, "tree": TRUTH["flat"]}}, ValueError, r"unknown modes \['tree'\]"),
        ({"time": "fast"}, TypeError, "time must be a dict"),
        ({"memory": {m: [0.0, math.inf, 0.0] for m in MODES}}, ValueError, r"memory\['flat'\]\[1\] is inf"),
        ({"host": {m: [0.0, -1.0] for m in MODES}}, ValueError, r"host\['flat'\]\[1\] is -1.0"),
        ({"host": {**TRUTH}}, ValueError, r"host\['flat'\] must hold 2 coefficients"),
        ({"calibrated": "yes"}, TypeError, "calibrated must be a bool"),
        ({"samples": -1}, ValueError, "samples must be at least 0"),
    ],
)
def test_cost_model_refuses_bad_coefficients(change, error, match):
    with pytest.raises(error, match=match):
        CostModel(**change)
    data = {**CostModel().to_dict(), **change}
    snapshot = copy.deepcopy(data)
    with pytest.raises(error, match=match):
        CostModel.from_dict(data)
    assert data == snapshot


def test_cost_model_copies_what_it_is_given():
    time = copy.deepcopy(TRUTH)
    model = CostModel(time=time)
    time["flat"][1] = 5.0
    assert model.time["flat"][1] == 1e-5
    with pytest.raises(ValueError, match="not a saved CostModel.*'memory'"):
        CostModel.from_dict({"time": TRUTH})


def test_fit_lets_the_constant_carry_calls_that_never_change():
    # flat mode without a token budget runs one model call per micro-batch: the calls column equals the
    # constant column, which NNLS cannot separate; the fit folds the calls into the constant
    A = random_features(9, seed=5)
    A[:, 3] = 1.0
    b = A @ torch.tensor([0.02, 1.3e-5, 7e-10, 0.09], dtype=torch.float64)
    coef, info = fit_time(A, b, WORK)
    assert info["method"] == "nnls" and info["rel_rms_residual"] < 1e-9
    assert coef[0] == pytest.approx(0.11) and coef[3] == 0.0
    assert coef[1] == pytest.approx(1.3e-5) and coef[2] == pytest.approx(7e-10)
