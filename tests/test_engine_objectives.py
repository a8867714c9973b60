"""tree_backward(objective=...) gives the gradients of autograd through per-rollout flat forwards, for
non-linear objectives (PPO-clip with the clip active, k3 KL, sequence-mean normalisation, GSPO's sequence
ratio, a non-separable log-sum-exp over rollouts), in every mode, with and without checkpointing, with
tiny blocks and micro-batches; and a failed or interrupted call leaves ``.grad`` exactly as it was."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import rollout_forests
from tests.engine_models import (
    CASES,
    HF_RTOL,
    VOCAB,
    assert_grads_close,
    enable_hf_checkpointing,
    flat_logprobs,
    flat_objective_gradients,
    hf_llama,
    random_weights,
    tiny_lm,
)
from treeattn_lab import RolloutTrie
from treeattn_lab.engine import MODES, tree_backward

EPS_LOW, EPS_HIGH, BETA = 0.2, 0.28, 0.04


def rollout_data(model, seqs, seed):
    """Old-policy and reference log-probs near the model's own (the clip is active on some tokens),
    and one advantage per rollout of either sign."""
    g = torch.Generator().manual_seed(seed)
    own = flat_logprobs(model, seqs)
    old = [lp + 0.4 * torch.randn(lp.shape, generator=g, dtype=lp.dtype) for lp in own]
    ref = [lp + 0.3 * torch.randn(lp.shape, generator=g, dtype=lp.dtype) for lp in own]
    adv = torch.randn(len(seqs), generator=g, dtype=torch.float64)
    return own, old, ref, adv


def ppo_kl_sequence_mean(old, ref, adv):
    """Hand-written: mean over rollouts of the token mean of PPO-clip (DAPO's asymmetric clip) + k3 KL."""

    def objective(logps):
        per_rollout = []
        for lp, o, r, a in zip(logps, old, ref, adv, strict=True):
            ratio = torch.exp(lp - o.to(lp))
            clipped = torch.clamp(ratio, 1 - EPS_LOW, 1 + EPS_HIGH)
            policy = -torch.minimum(ratio * a, clipped * a)
            kl = torch.exp(r.to(lp) - lp) - (r.to(lp) - lp) - 1
            per_rollout.append((policy + BETA * kl).sum() / max(lp.numel(), 1))
        return torch.stack(per_rollout).mean()

    return objective


def gspo_sequence_ratio(old, adv):
    def objective(logps):
        terms = []
        for lp, o, a in zip(logps, old, adv, strict=True):
            ratio = torch.exp((lp - o.to(lp)).sum() / max(lp.numel(), 1))
            terms.append(-torch.minimum(ratio * a, torch.clamp(ratio, 1 - EPS_LOW, 1 + EPS_HIGH) * a))
        return torch.stack(terms).mean()

    return objective


def soft_best_of(logps):
    """Non-separable: every rollout's gradient depends on every other rollout's log-probs."""
    return -torch.logsumexp(torch.stack([lp.sum() for lp in logps]), dim=0)


def clip_is_active(own, old, adv) -> bool:
    for lp, o, a in zip(own, old, adv, strict=True):
        ratio = torch.exp(lp - o)
        if bool(((ratio > 1 + EPS_HIGH) & (a > 0)).any() or ((ratio < 1 - EPS_LOW) & (a < 0)).any()):
            return True
    return False


class PerRollout:
    """A hand-written objective that declares its per-rollout terms (the engine's one-pass protocol)."""

    def __init__(self, old, ref, adv):
        self.old, self.ref, self.adv = old, ref, adv

    def rollout_term(self, i, lp):
        ratio = torch.exp(lp - self.old[i].to(lp))
        a = self.adv[i]
        policy = -torch.minimum(ratio * a, torch.clamp(ratio, 1 - EPS_LOW, 1 + EPS_HIGH) * a)
        delta = self.ref[i].to(lp) - lp
        kl = torch.exp(delta) - delta - 1
        return (policy + BETA * kl).sum() / max(lp.numel(), 1) / len(self.old)

    def __call__(self, logps):
        return torch.stack([self.rollout_term(i, lp) for i, lp in enumerate(logps)]).sum()


def objectives_for(model, seqs, seed):
    own, old, ref, adv = rollout_data(model, seqs, seed)
    return own, {
        "ppo_kl": ppo_kl_sequence_mean(old, ref, adv),
        "gspo": gspo_sequence_ratio(old, adv),
        "soft_best_of": soft_best_of,
        "per_rollout": PerRollout(old, ref, adv),
    }


@given(
    seqs=rollout_forests(max_sequences=6, max_len=12, max_vocab=VOCAB),
    mode=st.sampled_from(MODES + ("auto",)),
    block_tokens=st.integers(1, 5),
    token_budget=st.one_of(st.none(), st.integers(1, 25)),
    checkpointing=st.booleans(),
    which=st.sampled_from(["ppo_kl", "gspo", "soft_best_of", "per_rollout"]),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=40, deadline=None)
def test_objective_gradients_equal_flat_autograd(
    seqs, mode, block_tokens, token_budget, checkpointing, which, seed
):
    model = tiny_lm(checkpointing=checkpointing)
    own, objectives = objectives_for(model, seqs, seed)
    expected, value = flat_objective_gradients(model, seqs, objectives[which])
    trie = RolloutTrie.from_sequences(seqs)
    result = tree_backward(
        model,
        trie,
        objective=objectives[which],
        mode=mode,
        block_tokens=block_tokens,
        token_budget=token_budget,
    )
    assert_grads_close(model, expected, 1e-7)
    assert result.loss == pytest.approx(value, rel=1e-9, abs=1e-12)
    for got, want in zip(result.logps, own, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)
    if which == "per_rollout":  # one pass: no log-prob pass, and dfs recomputes only its pushes
        assert set(result.report.phases) == {"train"}
        linear = tree_backward(
            tiny_lm(), trie, mode=mode, block_tokens=block_tokens, token_budget=token_budget
        )
        assert result.report.no_grad_tokens == linear.report.no_grad_tokens


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("token_budget", [None, 8])
def test_ppo_clip_kl_with_the_clip_active_in_every_mode(mode, checkpointing, token_budget):
    seqs = CASES[0] + CASES[1]
    model = tiny_lm(checkpointing=checkpointing, seed=1)
    own, old, ref, adv = rollout_data(model, seqs, 7)
    assert clip_is_active(own, old, adv)
    objective = ppo_kl_sequence_mean(old, ref, adv)
    expected, _ = flat_objective_gradients(model, seqs, objective)
    trie = RolloutTrie.from_sequences(seqs)
    result = tree_backward(
        model, trie, objective=objective, mode=mode, block_tokens=2, token_budget=token_budget
    )
    assert_grads_close(model, expected, 1e-7)
    phases = result.report.phases
    if token_budget is None and mode != "dfs":  # one forward with autograd does it all
        assert set(phases) == {"train"} and phases["train"]["grad_tokens"] > 0
    else:  # a log-prob pass (each tree token once, no autograd), then the training pass
        assert set(phases) == {"logprobs", "train"}
        if mode != "flat":
            assert phases["logprobs"]["no_grad_tokens"] == result.report.tree_tokens
    assert all(p["time_s"] >= 0 for p in phases.values())


@pytest.mark.parametrize("mode", MODES)
def test_float32_objective_gradients_within_1e5(mode):
    seqs = CASES[1]
    model = tiny_lm(dtype=torch.float32, seed=4)
    _, objectives = objectives_for(model, seqs, 3)
    expected, _ = flat_objective_gradients(model, seqs, objectives["ppo_kl"])
    tree_backward(
        model, RolloutTrie.from_sequences(seqs), objective=objectives["ppo_kl"], mode=mode, block_tokens=4
    )
    assert_grads_close(model, expected, 1e-5)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("checkpointing", [False, True])
def test_hugging_face_objective_gradients(mode, checkpointing):
    model = hf_llama()
    seqs = CASES[0] + [[4, 4, 4, 4, 4, 4, 4], [4, 4, 4, 4, 5]]
    _, objectives = objectives_for(model, seqs, 5)
    expected, _ = flat_objective_gradients(model, seqs, objectives["ppo_kl"])
    if checkpointing:
        enable_hf_checkpointing(model)
    trie = RolloutTrie.from_sequences(seqs)
    tree_backward(model, trie, objective=objectives["ppo_kl"], mode=mode, block_tokens=2, token_budget=12)
    assert_grads_close(model, expected, HF_RTOL)


def test_token_weights_is_the_linear_special_case():
    seqs = CASES[0]
    weights = random_weights(seqs, 2)
    trie = RolloutTrie.from_sequences(seqs)
    linear = tiny_lm()
    tree_backward(linear, trie, weights, mode="dfs", block_tokens=2)
    as_objective = tiny_lm()
    result = tree_backward(
        as_objective,
        trie,
        objective=lambda lps: -sum((w[1:] * lp).sum() for w, lp in zip(weights, lps, strict=True)),
        mode="dfs",
        block_tokens=2,
    )
    assert_grads_close(as_objective, {n: p.grad for n, p in linear.named_parameters()}, 1e-9)
    assert result.logps[0].shape == (len(seqs[0]) - 1,)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("checkpointing", [False, True])
def test_per_rollout_objective_with_the_clip_active(mode, checkpointing):
    seqs = CASES[0] + CASES[1]
    model = tiny_lm(checkpointing=checkpointing, seed=1)
    own, old, ref, adv = rollout_data(model, seqs, 7)
    assert clip_is_active(own, old, adv)
    expected, _ = flat_objective_gradients(model, seqs, PerRollout(old, ref, adv))
    trie = RolloutTrie.from_sequences(seqs)
    tree_backward(model, trie, objective=PerRollout(old, ref, adv), mode=mode, block_tokens=2, token_budget=8)
    assert_grads_close(model, expected, 1e-7)
    model32 = tiny_lm(dtype=torch.float32, checkpointing=checkpointing, seed=1)
    objective32 = PerRollout([o.float() for o in old], [r.float() for r in ref], adv.float())
    expected32, _ = flat_objective_gradients(model32, seqs, objective32)
    tree_backward(model32, trie, objective=objective32, mode=mode, block_tokens=3, token_budget=8)
    assert_grads_close(model32, expected32, 1e-5)


# --------------------------------------------------------------------------- failures leave .grad as it was
class Boom(Exception):
    pass


def fail_on_call(model, n: int, error: type[BaseException]):
    """Make the model's first block raise ``error`` on its ``n``-th forward call."""
    calls = {"n": 0}

    def hook(module, args, out):
        calls["n"] += 1
        if calls["n"] == n:
            raise error("injected failure")

    return model.blocks[0].register_forward_hook(hook)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("error", [Boom, KeyboardInterrupt])
@pytest.mark.parametrize("loss", ["linear", "ppo_kl", "per_rollout"])
def test_failed_or_interrupted_call_leaves_grad_as_it_was(mode, error, loss):
    seqs = CASES[0] + CASES[1]
    trie = RolloutTrie.from_sequences(seqs)
    model = tiny_lm()
    _, objectives = objectives_for(model, seqs, 9)
    kwargs = {"mode": mode, "block_tokens": 3, "token_budget": 8}
    if loss == "linear":
        kwargs["token_weights"] = random_weights(seqs, 4)
    else:
        kwargs["objective"] = objectives[loss]
    reference = tiny_lm()
    tree_backward(reference, trie, **kwargs)
    once = {n: p.grad.clone() for n, p in reference.named_parameters()}
    g = torch.Generator().manual_seed(0)
    params = list(model.parameters())
    for p in params[::2]:  # some parameters hold a gradient already, the others none
        p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)
    before = [None if p.grad is None else p.grad.clone() for p in params]
    handle = fail_on_call(model, 4, error)  # after earlier micro-batches have sent gradients back
    with pytest.raises(error, match="injected failure"):
        tree_backward(model, trie, **kwargs)
    handle.remove()
    for p, b in zip(params, before, strict=True):
        assert (p.grad is None) == (b is None) and (b is None or torch.equal(p.grad, b))
    tree_backward(model, trie, **kwargs)  # the retry counts every rollout exactly once
    for (name, p), b in zip(model.named_parameters(), before, strict=True):
        want = once[name] if b is None else b + once[name]
        torch.testing.assert_close(p.grad, want, rtol=1e-12, atol=1e-14)


def test_bad_objectives_are_refused_and_leave_grad_untouched():
    trie = RolloutTrie.from_sequences(CASES[0])
    model = tiny_lm()
    for p in model.parameters():
        p.grad = torch.full_like(p, 3.0)
    with pytest.raises(TypeError, match="scalar tensor"):
        tree_backward(model, trie, objective=lambda lps: torch.stack([lp.sum() for lp in lps]))
    with pytest.raises(TypeError, match="scalar tensor"):
        tree_backward(model, trie, objective=lambda lps: 1.0, mode="dfs")
    with pytest.raises(ValueError, match="not finite"):
        tree_backward(model, trie, objective=lambda lps: lps[0].sum() * float("nan"), token_budget=4)
    with pytest.raises(ValueError, match="not both"):
        tree_backward(model, trie, random_weights(CASES[0], 0), objective=soft_best_of)
    with pytest.raises(TypeError, match="objective must be a callable"):
        tree_backward(model, trie, objective=3)
    assert all(torch.all(p.grad == 3.0) for p in model.parameters())


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("token_budget", [None, 4])
def test_a_non_finite_rollout_term_is_refused_before_any_gradient(mode, token_budget):
    """Finite inputs whose loss overflows (old log-probs far below the current ones: ratio = inf) raise
    in every mode and leave ``.grad`` as it was."""
    from treeattn_lab.rl import completion_masks, grpo_objective

    seqs = CASES[0]
    trie = RolloutTrie.from_sequences(seqs)
    model = tiny_lm()
    own = flat_logprobs(model, seqs)
    old = [lp.detach().clone() for lp in own]
    old[len(seqs) - 1] = old[len(seqs) - 1] - 1000.0  # exp(1000) overflows
    adv = torch.linspace(1.0, -1.0, len(seqs), dtype=torch.float64)  # negative: min(r A, ...) = -inf
    objective = grpo_objective(old, adv, completion_masks(trie.seq_lengths, [1] * len(seqs)))
    for p in model.parameters():
        p.grad = torch.full_like(p, 3.0)
    with pytest.raises(ValueError, match="not finite"):
        tree_backward(model, trie, objective=objective, mode=mode, token_budget=token_budget)
    assert all(torch.all(p.grad == 3.0) for p in model.parameters())


def test_an_objective_of_fewer_rollouts_than_the_trie_is_refused_up_front():
    from treeattn_lab.rl import completion_masks, grpo_objective

    seqs = CASES[0]
    trie = RolloutTrie.from_sequences(seqs)
    model = tiny_lm()
    masks = completion_masks(trie.seq_lengths[:-1], [1] * (len(seqs) - 1))
    objective = grpo_objective(None, torch.ones(len(seqs) - 1, dtype=torch.float64), masks)
    for p in model.parameters():
        p.grad = torch.full_like(p, 3.0)
    refusal = f"scores {len(seqs) - 1} rollouts but the trie holds {len(seqs)} sequences"
    for mode in MODES:
        with pytest.raises(ValueError, match=refusal):
            tree_backward(model, trie, objective=objective, mode=mode)
    assert all(torch.all(p.grad == 3.0) for p in model.parameters())


def test_a_cost_model_of_the_wrong_type_is_refused():
    trie = RolloutTrie.from_sequences(CASES[0])
    with pytest.raises(TypeError, match="cost_model must be a treeattn_lab.engine.CostModel"):
        tree_backward(tiny_lm(), trie, cost_model="x")
