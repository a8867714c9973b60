"""treeattn_lab.rl.grpo: flat and tree run the same loop (same batch, same gradients to float32 rounding),
every phase is timed, a LiveMonitor is fed, and the loop raises the reward of a task it can learn."""

from __future__ import annotations

import copy

import pytest
import torch

from treeattn_lab.lab.monitor import LiveMonitor
from treeattn_lab.reference import TinyLM, TinyLMConfig
from treeattn_lab.rl.grpo import GRPO, PHASES, GRPOConfig
from treeattn_lab.rl.tasks import AdditionTask


def small_model(seed=0, dim=32, dtype=torch.float32):
    torch.manual_seed(seed)
    cfg = TinyLMConfig(vocab_size=256, dim=dim, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=2 * dim)
    return TinyLM(cfg).to(dtype)


def gradients(trainer, rollouts):
    trainer.backward(rollouts, trainer.objective(rollouts))
    return torch.cat([p.grad.flatten() for p in trainer.model.parameters()])


@pytest.mark.parametrize(
    "task, config",
    [
        (AdditionTask(digits=2, shots=3), GRPOConfig(prompts_per_step=3, group_size=5)),
        (AdditionTask(digits=1, shots=2, turns=3),
         GRPOConfig(prompts_per_step=2, group_size=4, forks=(2, 1), beta=0.04, loss_type="grpo")),
    ],
    ids=["single-turn", "multi-turn-forks-kl"],
)
@pytest.mark.parametrize("tree_mode", ["packed", "dfs"])
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.float64, 1e-12)],
                         ids=["float32", "float64"])
def test_step0_gradients_flat_and_tree_agree(task, config, tree_mode, dtype, tolerance):
    """float32: rounding-level agreement; float64: the tree loop computes flat's gradient exactly."""
    model = small_model(seed=1).to(dtype)
    config = GRPOConfig(**{**config.__dict__, "tree_mode": tree_mode})
    flat = GRPO(copy.deepcopy(model), task, config, mode="flat", seed=3)
    tree = GRPO(copy.deepcopy(model), task, config, mode="tree", seed=3)
    rollouts = flat.rollouts(0)
    flat.score(rollouts)
    # random advantages: an untrained model's rewards tie, which would leave nothing to compare
    rollouts.advantages = torch.randn(rollouts.rewards.shape, generator=torch.Generator().manual_seed(0))
    g_flat, g_tree = gradients(flat, rollouts), gradients(tree, rollouts)
    assert g_flat.norm() > 0
    assert float((g_tree - g_flat).norm() / g_flat.norm()) < tolerance
    assert rollouts.batch.trie.stats()["token_ratio"] > 1.5


def test_same_seed_same_first_batch_and_records():
    task = AdditionTask(digits=1, shots=3)
    config = GRPOConfig(prompts_per_step=2, group_size=4, ppo_epochs=2)
    model = small_model(seed=2)
    records = {}
    with LiveMonitor(display="none", devices=None) as monitor:
        for mode in ("flat", "tree"):
            trainer = GRPO(copy.deepcopy(model), task, config, mode=mode, seed=5, monitor=monitor)
            records[mode] = trainer.train(2, progress=False)
        steps = monitor.steps
    assert [s.label for s in steps] == ["flat step 0", "flat step 1", "tree step 0", "tree step 1"]
    flat, tree = records["flat"][0], records["tree"][0]
    for key in ("reward", "flat_tokens", "tree_tokens", "token_ratio", "generated_tokens"):
        assert flat[key] == tree[key], key
    assert flat["loss"] == pytest.approx(tree["loss"], rel=1e-4, abs=1e-6)
    for r in records["flat"] + records["tree"]:
        assert set(r["times_s"]) == set(PHASES) and all(t >= 0 for t in r["times_s"].values())
        assert r["step_s"] == pytest.approx(sum(r["times_s"].values()))
        assert r["times_s"]["train"] > 0 and r["times_s"]["sample"] > 0
        assert r["host_peak_rss_bytes"] > 2**20 and r["peak_memory_bytes"] is None  # CPU
        assert len(r["losses"]) == 2 and r["token_ratio"] > 1
    assert steps[0].latency_ms == pytest.approx(1e3 * records["flat"][0]["step_s"])


@pytest.mark.parametrize("tree_mode", ["packed", "dfs"])
def test_each_batch_is_packed_once_and_every_pass_reuses_it(tree_mode, monkeypatch):
    """The old-policy, reference and every PPO epoch's pass read one pack (and one loss plan, one set of
    micro-batches) per batch: nothing of the trie's layout is rebuilt per pass."""
    from treeattn_lab.engine import loss_plan, microbatch
    from treeattn_lab.pack import TreePack

    counts = {"pack": 0, "cut": 0, "plan": 0}
    packs_read = set()

    def counting(name, build):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return build(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(TreePack, "from_trie", classmethod(counting("pack", TreePack.from_trie.__func__)))
    monkeypatch.setattr(microbatch, "_cut", counting("cut", microbatch._cut))
    build_plan = loss_plan.LossPlan._build.__func__
    monkeypatch.setattr(loss_plan.LossPlan, "_build", classmethod(counting("plan", build_plan)))
    from_pack = loss_plan.LossPlan.from_pack.__func__

    def reading(cls, pack, token_weights=None):
        packs_read.add(id(pack))
        return from_pack(cls, pack, token_weights)

    monkeypatch.setattr(loss_plan.LossPlan, "from_pack", classmethod(reading))
    config = GRPOConfig(prompts_per_step=2, group_size=4, forks=(2,), beta=0.04, ppo_epochs=3,
                        tree_mode=tree_mode)
    trainer = GRPO(small_model(), AdditionTask(digits=1, shots=2, turns=2), config, mode="tree", seed=0)
    for step in range(2):
        trainer.step()
        # one batch: 2 log-prob passes (old policy, reference) and 3 epochs, all on one pack and plan
        assert counts == {"pack": step + 1, "cut": step + 1, "plan": step + 1}, counts
        assert len(packs_read) == step + 1


class FirstTokenTask(AdditionTask):
    """Reward 1 when the answer starts with a 5: a policy-gradient signal a tiny model picks up fast."""

    def reward(self, problem, completion):
        return float(list(completion)[:1] == [ord("5")])


def test_the_loop_raises_the_reward():
    task = FirstTokenTask(digits=1, shots=2)
    model = small_model(seed=0, dim=32)
    task.warm_up(model, steps=100, progress=False)  # digits come first: a 5 is sampled now and then
    trainer = GRPO(model, task, GRPOConfig(prompts_per_step=4, group_size=8, lr=3e-3, ppo_epochs=2), seed=0)
    records = trainer.train(15, progress=False)
    first = sum(r["reward"] for r in records[:3]) / 3
    last = sum(r["reward"] for r in records[-3:]) / 3
    assert last > first + 0.4, [round(r["reward"], 2) for r in records]


def test_objective_uses_the_loops_advantages():
    task = AdditionTask(digits=1, shots=2)
    trainer = GRPO(small_model(), task, GRPOConfig(prompts_per_step=2, group_size=4), seed=0)
    rollouts = trainer.rollouts(0)
    rollouts.advantages = torch.tensor([1.5, -2.0, 0.5, 3.0, 0.0, 1.0, -1.0, 2.0])
    logps = trainer.objective(rollouts)  # the objective closes over old log-probs and advantages
    from treeattn_lab.engine import tree_logprobs

    old = tree_logprobs(trainer.model, rollouts.batch.trie, mode="packed")
    value = float(logps(old))  # ratio 1 everywhere: -mean over completion tokens of A
    masks = rollouts.batch.loss_masks()
    want = -sum(float(a) * float(m.sum()) for a, m in zip(rollouts.advantages, masks, strict=True))
    assert abs(want) > 1
    assert value == pytest.approx(want / sum(float(m.sum()) for m in masks), rel=1e-5)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(group_size=6, forks=(4,)), "not a multiple"),
        (dict(loss_type="ppo"), "loss_type"),
        (dict(tree_mode="flat"), "tree_mode"),
        (dict(lr=0.0), "lr"),
        (dict(ppo_epochs=0), "ppo_epochs"),
    ],
)
def test_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GRPOConfig(**kwargs)


def test_forks_follow_the_turns():
    model = small_model()
    three_turns = AdditionTask(digits=1, shots=1, turns=3)
    assert GRPO(model, three_turns, GRPOConfig(group_size=4, forks=(2,))).forks == (2, 1)
    assert GRPO(model, AdditionTask(turns=1), GRPOConfig(group_size=4, forks=(2, 2))).forks == (2, 2)
    with pytest.raises(ValueError, match="3 forks for a task of 3 turns"):
        GRPO(model, three_turns, GRPOConfig(group_size=8, forks=(2, 2, 2)))
    trainer = GRPO(model, three_turns, GRPOConfig(prompts_per_step=1, group_size=2), seed=0)
    batch = trainer.rollouts(0).batch  # no forks given: still three turns, two environment replies
    for generated in batch.generated:  # sampled, observed, sampled, observed, sampled
        starts_of_replies = (generated[:-1] & ~generated[1:]).sum()
        assert int(starts_of_replies) == 2 and generated[0] and generated[-1]


def test_the_tree_attention_backend_changes_the_kernel_not_the_gradients(monkeypatch):
    import treeattn_lab.ops.tree as tree_ops

    calls = []
    real = tree_ops.flat_tree_attention
    monkeypatch.setattr(tree_ops, "flat_tree_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    task = AdditionTask(digits=1, shots=2)
    model = small_model()
    grads, rollouts = {}, None
    for backend in ("reference", "flat"):
        config = GRPOConfig(prompts_per_step=2, group_size=4, beta=0.04, attention_backend=backend)
        trainer = GRPO(copy.deepcopy(model), task, config, mode="tree", seed=0)
        assert trainer.engine == {"mode": "packed", "attention_backend": backend}
        if rollouts is None:
            rollouts = trainer.rollouts(0)
            trainer.score(rollouts)
        ran = len(calls)
        grads[backend] = gradients(trainer, rollouts)
        assert (len(calls) > ran) == (backend == "flat")
    assert torch.allclose(grads["flat"], grads["reference"], rtol=1e-4, atol=1e-6)
    flat = GRPO(model, task, GRPOConfig(attention_backend="flat"), mode="flat")
    assert flat.engine == {"mode": "flat", "attention_backend": "flat"}
    with pytest.raises(TypeError, match="attention_backend"):
        GRPOConfig(attention_backend=None)


def test_bad_mode():
    with pytest.raises(ValueError, match="mode must be one of"):
        GRPO(small_model(), AdditionTask(), mode="packed")
