"""treeattn_lab.rl.objectives against hand-written formulas and against TRL's GRPOTrainer itself.

TRL's loss is computed by calling ``GRPOTrainer._compute_loss`` on a stand-in trainer that holds only the
attributes the loss reads, with its per-token log-probs a padded ``[B, completion]`` leaf tensor: the
loss value and the gradient with respect to every log-prob must agree with ours on ragged rollouts.
"""

from __future__ import annotations

import collections
import math
import types

import pytest
import torch

from treeattn_lab.rl import completion_masks, group_advantages, grpo_loss, grpo_objective, k3_kl, ppo_clip


def ragged_batch(seed: int, groups: int = 2, group_size: int = 3, prompt: int = 4, longest: int = 6):
    g = torch.Generator().manual_seed(seed)
    B = groups * group_size
    completion = [int(torch.randint(1, longest + 1, (1,), generator=g)) for _ in range(B)]
    completion[0] = longest
    lengths = [prompt + c for c in completion]
    logps = [-torch.rand(n - 1, generator=g, dtype=torch.float64) * 3 for n in lengths]
    old = [lp + 0.5 * torch.randn(lp.shape, generator=g, dtype=torch.float64) for lp in logps]
    ref = [lp + 0.5 * torch.randn(lp.shape, generator=g, dtype=torch.float64) for lp in logps]
    rewards = torch.randn(B, generator=g, dtype=torch.float64)
    return {
        "logps": logps,
        "old": old,
        "ref": ref,
        "rewards": rewards,
        "advantages": group_advantages(rewards, group_size),
        "masks": completion_masks(lengths, [prompt] * B),
        "prompt": prompt,
        "completion": completion,
        "group_size": group_size,
    }


# ------------------------------------------------------------------------------- hand-written formulas
def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 2.0, 4.0, 0.0, 0.0, 3.0], dtype=torch.float64)
    got = group_advantages(rewards, 3)
    for start in (0, 3):
        grp = rewards[start : start + 3].tolist()
        mean = sum(grp) / 3
        std = math.sqrt(sum((r - mean) ** 2 for r in grp) / 2)
        for j, r in enumerate(grp):
            assert got[start + j].item() == pytest.approx((r - mean) / (std + 1e-4), rel=1e-12)
    none = group_advantages(rewards, 3, scale="none")
    assert none.tolist() == pytest.approx([-4 / 3, -1 / 3, 5 / 3, -1.0, -1.0, 2.0])
    batch = group_advantages(rewards, 3, scale="batch")
    torch.testing.assert_close(batch, none / (rewards.std() + 1e-4))


def test_ppo_clip_and_k3_by_hand():
    for logp, old, adv, lo, hi in [
        (0.0, -0.5, 1.0, 0.2, 0.28),
        (-1.0, -0.2, -2.0, 0.2, None),
        (-0.3, -0.3, 0.5, 0.1, 0.3),
    ]:
        r = math.exp(logp - old)
        h = lo if hi is None else hi
        want = -min(r * adv, min(max(r, 1 - lo), 1 + h) * adv)
        got = ppo_clip(
            torch.tensor(logp), torch.tensor(old), torch.tensor(adv), epsilon_low=lo, epsilon_high=hi
        )
        assert got.item() == pytest.approx(want, rel=1e-6)
    assert k3_kl(torch.tensor(-1.0), torch.tensor(-1.5)).item() == pytest.approx(
        math.exp(-0.5) + 0.5 - 1, rel=1e-6
    )
    assert k3_kl(torch.tensor(-2.0), torch.tensor(-2.0)).item() == 0.0


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo", "dr_grpo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_grpo_loss_by_hand(loss_type, level):
    b = ragged_batch(1)
    beta, lo, hi, L = 0.04, 0.2, 0.28, 6
    per_rollout_sums, per_rollout_counts = [], []
    for lp, o, r, a, m in zip(
        b["logps"], b["old"], b["ref"], b["advantages"].tolist(), b["masks"], strict=True
    ):
        idx = [t for t in range(lp.numel()) if m[t]]
        seq_ratio = math.exp(sum(lp[t].item() - o[t].item() for t in idx) / len(idx))
        total = 0.0
        for t in idx:
            ratio = math.exp(lp[t].item() - o[t].item()) if level == "token" else seq_ratio
            policy = -min(ratio * a, min(max(ratio, 1 - lo), 1 + hi) * a)
            d = r[t].item() - lp[t].item()
            total += policy + beta * (math.exp(d) - d - 1)
        per_rollout_sums.append(total)
        per_rollout_counts.append(len(idx))
    G = len(per_rollout_sums)
    want = {
        "grpo": sum(s / c for s, c in zip(per_rollout_sums, per_rollout_counts, strict=True)) / G,
        "bnpo": sum(per_rollout_sums) / sum(per_rollout_counts),
        "dapo": sum(per_rollout_sums) / sum(per_rollout_counts),
        "dr_grpo": sum(per_rollout_sums) / (G * L),
    }[loss_type]
    got = grpo_loss(
        b["logps"],
        b["old"],
        b["advantages"],
        b["masks"],
        ref_logps=b["ref"],
        beta=beta,
        epsilon_low=lo,
        epsilon_high=hi,
        loss_type=loss_type,
        importance_sampling=level,
        max_completion_length=L,
    )
    assert got.item() == pytest.approx(want, rel=1e-12)


def test_bad_arguments_are_refused():
    b = ragged_batch(2)
    args = (b["logps"], b["old"], b["advantages"], b["masks"])
    with pytest.raises(ValueError, match="loss_type must be one of"):
        grpo_loss(*args, loss_type="ppo")
    with pytest.raises(ValueError, match="needs ref_logps"):
        grpo_loss(*args, beta=0.1)
    with pytest.raises(ValueError, match="max_completion_length"):
        grpo_loss(*args, loss_type="dr_grpo")
    with pytest.raises(ValueError, match=r"old_logps\[0\] must be a tensor of shape"):
        grpo_loss(b["logps"], [o[:-1] for o in b["old"]], b["advantages"], b["masks"])
    with pytest.raises(ValueError, match="advantages must have shape"):
        grpo_loss(b["logps"], b["old"], b["advantages"][:-1], b["masks"])
    with pytest.raises(ValueError, match="do not split into groups"):
        group_advantages(torch.ones(5), 2)
    with pytest.raises(ValueError, match="prompt length 0"):
        completion_masks([3], [0])


def test_group_advantages_of_groups_of_one_name_the_rule():
    with pytest.raises(ValueError, match="needs group_size >= 2"):
        group_advantages(torch.tensor([1.0, 2.0]), 1)
    with pytest.raises(ValueError, match="needs >= 2 rewards"):
        group_advantages(torch.tensor([1.0]), 1, scale="batch")
    # without a standard deviation of the group, a group of one is meaningful
    centred = group_advantages(torch.tensor([1.0, 2.0], dtype=torch.float64), 1, scale="none")
    assert torch.equal(centred, torch.zeros(2, dtype=torch.float64))
    batch = group_advantages(torch.tensor([1.0, 3.0], dtype=torch.float64), 1, scale="batch")
    assert torch.isfinite(batch).all() and torch.equal(batch, torch.zeros(2, dtype=torch.float64))


def test_advantages_as_a_sequence_equal_the_tensor_and_other_types_are_refused():
    b = ragged_batch(3)
    want = grpo_loss(b["logps"], b["old"], b["advantages"], b["masks"])
    for seq in (b["advantages"].tolist(), tuple(b["advantages"].tolist())):
        assert torch.equal(grpo_loss(b["logps"], b["old"], seq, b["masks"]), want)
    with pytest.raises(TypeError, match="advantages must be a tensor or a sequence of numbers"):
        grpo_loss(b["logps"], b["old"], 1.5, b["masks"])
    with pytest.raises(TypeError, match="advantages must be a tensor or a sequence of numbers"):
        grpo_loss(b["logps"], b["old"], ["a"] * len(b["logps"]), b["masks"])


@pytest.mark.parametrize(
    "options",
    [{"epsilon_low": -0.1}, {"epsilon_high": -0.2}, {"beta": -0.01}, {"beta": float("nan")}],
)
def test_negative_or_nan_clip_and_kl_settings_are_refused(options):
    b = ragged_batch(4)
    name = next(iter(options))
    with pytest.raises(ValueError, match=f"{name} must be a finite number >= 0"):
        grpo_objective(b["old"], b["advantages"], b["masks"], ref_logps=b["ref"], **options)


@pytest.mark.parametrize("poisoned", ["advantages", "old", "ref"])
def test_non_finite_advantages_or_counted_log_probs_are_refused(poisoned):
    b = ragged_batch(5)
    old, ref, adv = [o.clone() for o in b["old"]], [r.clone() for r in b["ref"]], b["advantages"].clone()
    if poisoned == "advantages":
        adv[2] = float("nan")
    else:
        (old if poisoned == "old" else ref)[2][-1] = float("inf")
    name = {"advantages": "advantages", "old": "old_logps", "ref": "ref_logps"}[poisoned]
    with pytest.raises(ValueError, match=rf"{name}\[2\] holds NaN or infinite"):
        grpo_objective(old, adv, b["masks"], ref_logps=ref, beta=0.1)


def test_non_finite_log_probs_off_the_mask_are_harmless():
    b = ragged_batch(6)
    old = [o.clone() for o in b["old"]]
    old[1][0] = float("nan")  # a prompt slot: the mask is 0 there
    objective = grpo_objective(old, b["advantages"], b["masks"])
    assert torch.equal(objective(b["logps"]), grpo_loss(b["logps"], b["old"], b["advantages"], b["masks"]))


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_metrics_with_every_mask_zero(level):
    b = ragged_batch(7)
    masks = [torch.zeros_like(m) for m in b["masks"]]
    objective = grpo_objective(b["old"], b["advantages"], masks, ref_logps=b["ref"], beta=0.1,
                               importance_sampling=level)
    out = objective.metrics(b["logps"])
    assert out["clip_ratio/low_min"] == 0.0 and out["clip_ratio/high_max"] == 0.0
    assert out["kl"] == 0.0


# ---------------------------------------------------------------------------------------- against TRL
def trl_loss(
    b, *, loss_type, level, beta, epsilon_low, epsilon_high, max_completion_length, on_policy, kl_weight
):
    """TRL's own GRPOTrainer._compute_loss on the batch; returns (loss, per-token log-probs leaf)."""
    trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")
    B, P, C = len(b["logps"]), b["prompt"], max(b["completion"])
    padded = torch.zeros(B, C, dtype=torch.float64)
    old, ref, mask = torch.zeros_like(padded), torch.zeros_like(padded), torch.zeros_like(padded)
    for i, c in enumerate(b["completion"]):
        padded[i, :c] = b["logps"][i][P - 1 :]
        old[i, :c], ref[i, :c] = b["old"][i][P - 1 :], b["ref"][i][P - 1 :]
        mask[i, :c] = 1
    leaf = padded.clone().requires_grad_(True)
    accelerator = types.SimpleNamespace(
        num_processes=1, gather=lambda x: x, gather_for_metrics=lambda x: x, reduce=lambda x, reduction: x
    )
    trainer = types.SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (leaf, torch.zeros_like(leaf), None),
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level=level,
        beta=beta,
        args=types.SimpleNamespace(use_bias_correction_kl=kl_weight, delta=None, steps_per_generation=1),
        loss_type=loss_type,
        epsilon_low=epsilon_low,
        epsilon_high=epsilon_high,
        use_vllm=False,
        vllm_importance_sampling_correction=False,
        model=types.SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1,
        max_completion_length=max_completion_length,
        accelerator=accelerator,
        _entropy_bonus_enabled=False,
        aux_loss_enabled=False,
        _metrics=collections.defaultdict(lambda: collections.defaultdict(list)),
    )
    inputs = {
        "prompt_ids": torch.ones(B, P, dtype=torch.long),
        "prompt_mask": torch.ones(B, P, dtype=torch.long),
        "completion_ids": torch.ones(B, C, dtype=torch.long),
        "completion_mask": mask.long(),
        "advantages": b["advantages"],
        "old_per_token_logps": None if on_policy else old,
        "ref_per_token_logps": ref,
        "num_items_in_batch": mask.sum(),
    }
    loss = trl_grpo.GRPOTrainer._compute_loss(trainer, None, inputs)
    return loss, leaf, {k: v[0] for k, v in trainer._metrics["train"].items()}


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo", "dr_grpo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize(("beta", "kl_weight"), [(0.0, False), (0.04, False), (0.04, True)])
@pytest.mark.parametrize("on_policy", [False, True])
def test_grpo_loss_and_gradients_equal_trl(loss_type, level, beta, kl_weight, on_policy):
    b = ragged_batch(3 + int(beta * 100))
    P = b["prompt"]
    for o, r in zip(b["old"], b["ref"], strict=True):  # values off the mask never matter, not even these
        o[: P - 1], r[: P - 1] = 1e30, -1e30
    options = dict(
        beta=beta, epsilon_low=0.2, epsilon_high=0.28, max_completion_length=max(b["completion"]) + 2
    )
    want, leaf, trl_metrics = trl_loss(
        b, loss_type=loss_type, level=level, on_policy=on_policy, kl_weight=kl_weight, **options
    )
    want.backward()
    leaves = [lp.clone().requires_grad_(True) for lp in b["logps"]]
    objective = grpo_objective(
        None if on_policy else b["old"],
        b["advantages"],
        b["masks"],
        ref_logps=b["ref"] if beta else None,
        loss_type=loss_type,
        importance_sampling=level,
        kl_importance_weight=kl_weight,
        **options,
    )
    got = objective(leaves)
    got.backward()
    assert got.item() == pytest.approx(want.item(), rel=1e-12, abs=1e-15)
    metrics = objective.metrics(b["logps"])
    assert set(metrics) == {k for k in trl_metrics if k.startswith(("kl", "clip_ratio"))}
    for key, value in metrics.items():  # what TRL logs, from the same log-probs
        assert value == pytest.approx(trl_metrics[key], rel=1e-6, abs=1e-9), key
    terms = sum(objective.rollout_term(i, lp.detach()) for i, lp in enumerate(b["logps"]))
    assert terms.item() == pytest.approx(want.item(), rel=1e-12, abs=1e-15)  # the per-rollout form agrees
    for i, c in enumerate(b["completion"]):
        assert torch.all(leaves[i].grad[: P - 1] == 0)  # the prompt's tokens carry no loss
        torch.testing.assert_close(leaves[i].grad[P - 1 :], leaf.grad[i, :c], rtol=1e-12, atol=1e-15)


# ------------------------------------------------------------------------------ through the engine
@pytest.mark.parametrize("mode", ["flat", "packed", "dfs"])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_grpo_step_through_the_engine_equals_flat_autograd(mode, loss_type):
    from tests.engine_models import assert_grads_close, flat_objective_gradients, tiny_lm
    from treeattn_lab import RolloutTrie
    from treeattn_lab.engine import tree_backward, tree_logprobs

    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    completions = [[8, 9, 10], [8, 9, 11, 12], [8, 13], [8, 9, 10]]  # a duplicate rollout in each group
    seqs = [p + c for p in prompts for c in completions]
    trie = RolloutTrie.from_sequences(seqs)
    model = tiny_lm(seed=5)
    g = torch.Generator().manual_seed(0)
    old = [lp + 0.3 * torch.randn(lp.shape, generator=g, dtype=lp.dtype) for lp in tree_logprobs(model, trie)]
    ref = [lp + 0.3 * torch.randn(lp.shape, generator=g, dtype=lp.dtype) for lp in old]
    advantages = group_advantages(torch.randn(len(seqs), generator=g, dtype=torch.float64), len(completions))
    masks = completion_masks(trie.seq_lengths, [len(p) for p in prompts for _ in completions])
    objective = grpo_objective(
        old, advantages, masks, ref_logps=ref, beta=0.04, epsilon_high=0.28, loss_type=loss_type
    )
    expected, value = flat_objective_gradients(model, seqs, objective)
    result = tree_backward(model, trie, objective=objective, mode=mode, block_tokens=2, token_budget=10)
    assert_grads_close(model, expected, 1e-7)
    assert result.loss == pytest.approx(value, rel=1e-9)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_batched_rollout_terms_equal_the_sum_of_single_terms(level):
    b = ragged_batch(11)
    objective = grpo_objective(
        b["old"],
        b["advantages"],
        b["masks"],
        ref_logps=b["ref"],
        beta=0.04,
        loss_type="grpo",
        importance_sampling=level,
        kl_importance_weight=True,
    )
    picked = [4, 0, 2]
    batched = objective.rollout_terms(picked, [b["logps"][i] for i in picked])
    single = sum(objective.rollout_term(i, b["logps"][i]) for i in picked)
    assert batched.item() == pytest.approx(single.item(), rel=1e-12)
    assert objective(b["logps"]).item() == pytest.approx(
        sum(objective.rollout_term(i, lp) for i, lp in enumerate(b["logps"])).item(), rel=1e-12
    )
    with pytest.raises(ValueError, match=r"logps\[0\] must have shape"):
        objective.rollout_terms([0], [b["logps"][1][:2]])
