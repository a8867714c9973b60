"""Data-parallel tree_backward on gloo ranks (fresh processes, with a timeout): the all-reduced gradients
equal single-process tree_backward on the whole trie (float64 TinyLM), and a rank that disagrees on the
data, fails, or hangs makes every rank raise a clear error instead of hanging."""

from __future__ import annotations

import random

import pytest
import torch

from treeattn_lab import RolloutTrie
from treeattn_lab.bench.spawned_train import check_cases, check_model
from treeattn_lab.distributed import RankFailureError, plan_shares, run_step, spawn
from treeattn_lab.distributed import step as step_module
from treeattn_lab.engine import MODES, CostModel, tree_backward

VOCAB = 50


def rollouts(seed: int, prompts: int = 3, samples: int = 4) -> list[list[int]]:
    """GRPO-shaped rollouts that fork again, plus a duplicate and a rollout that is a prefix of another."""
    rng = random.Random(seed)
    seqs = []
    for _ in range(prompts):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(2, 8))]
        for _ in range(samples):
            seqs.append(prompt + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 9))])
    seqs.append(list(seqs[1]))
    seqs.append(seqs[2][: len(seqs[2]) - 1])
    rng.shuffle(seqs)
    return seqs


def single_process(seqs, steps: int = 1, seed: int = 0):
    """The ground truth: one process, the whole trie, the same model and token weights as check_step."""
    model = check_model(VOCAB, torch.float64, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    weights = [torch.randn(len(s), generator=gen, dtype=torch.float64) for s in seqs]
    result = None
    for _ in range(steps):
        result = tree_backward(model, RolloutTrie.from_sequences(seqs), weights, mode="flat")
    grads = {n: p.grad for n, p in model.named_parameters()}
    return grads, result.losses


def by_case(results) -> list[tuple[dict, ...]]:
    """``spawn`` outcomes of ``check_cases`` -> each case's outcome per rank."""
    assert all(r["ok"] for r in results), results
    return list(zip(*(r["value"] for r in results), strict=True))


def assert_equal_to_single_process(outcomes, case, world):
    grads, losses = single_process(case["seqs"], case.get("steps", 1))
    for rank, outcome in enumerate(outcomes):
        assert outcome["ok"], f"rank {rank}: {outcome}"
        got = outcome["value"]
        assert sorted(i for s in got["sequences"] for i in s) == list(range(len(case["seqs"])))
        assert len(got["sequences"]) == world and len(got["timeline"]) == world
        torch.testing.assert_close(got["losses"], losses, rtol=1e-12, atol=1e-12)
        for name, want in grads.items():
            torch.testing.assert_close(got["grads"][name], want, rtol=1e-10, atol=1e-12, msg=name)


def calibrated(host_floor: float) -> CostModel:
    """A calibrated cost model: with a floor every micro-batch is host-bound (fewest micro-batches),
    without one a micro-batch costs little more than its tokens (cuts between subtrees)."""
    return CostModel(
        time={m: [1e-6, 1e-5, 1e-9, 1e-6] for m in MODES},
        host={m: [host_floor, 0.0] for m in MODES},
        calibrated=True,
    )


SEQS = rollouts(0)
THREE_RANK_CASES = [
    # gradients: two steps accumulate, like tree_backward
    dict(seqs=SEQS, partitioner="subtree_search", mode="packed", token_budget=12, steps=2),
    dict(seqs=SEQS, partitioner="contiguous_dfs", mode="auto", balance_by="tokens"),
    dict(seqs=[[1, 2, 3], [1, 2, 4, 5]], partitioner="greedy_tokens", mode="flat"),  # one rank gets nothing
    # faults: every rank raises, and the group stays usable afterwards
    dict(seqs=SEQS, corrupt_rank=1),
    dict(seqs=SEQS, fail_rank=2, mode="dfs", block_tokens=3),
    dict(seqs=SEQS, short_rank=0),
    dict(seqs=SEQS, partitioner="lpt_split", mode="dfs", block_tokens=3),
    # the micro-batch planner of a calibrated cost model, on every rank's share
    dict(seqs=SEQS, partitioner="subtree_search", mode="auto", token_budget=12, cost_model=calibrated(1.0)),
    dict(seqs=SEQS, mode="packed", token_budget=12, balance_by="tokens", cost_model=calibrated(0.0)),
]


@pytest.mark.xdist_group("distributed_train")
def test_three_gloo_ranks_equal_one_process_and_fail_together():
    results = spawn(3, check_cases, {"cases": THREE_RANK_CASES}, timeout_s=900)  # a hang guard only
    per_case = by_case(results)  # per_case[case][rank]
    for i in (0, 1, 2, 6, 7, 8):
        assert_equal_to_single_process(per_case[i], THREE_RANK_CASES[i], 3)
    assert sum(1 for s in per_case[2][0]["value"]["sequences"] if not s) == 1
    for rank, outcome in enumerate(per_case[3]):  # rank 1 changed one token weight
        assert not outcome["ok"] and outcome["error"] == "RankMismatchError", outcome
        assert outcome["message"].startswith(f"rank {rank}: the ranks disagree on the rollouts")
        assert "ranks [0, 2] hold" in outcome["message"] and "ranks [1] hold" in outcome["message"]
    for rank, outcome in enumerate(per_case[4]):  # rank 2's model raised in the middle of its share
        assert not outcome["ok"] and outcome["error"] == "RankFailureError", outcome
        assert f"rank {rank}: the step failed on rank(s) [2]" in outcome["message"]
        assert "injected failure in the model's forward" in outcome["message"]
    for rank, outcome in enumerate(per_case[5]):  # rank 0 passed one token weight too few
        assert not outcome["ok"] and outcome["error"] == "RankMismatchError", outcome
        assert f"rank {rank}: rank(s) [0] rejected their input" in outcome["message"]
        assert "got 13 token_weights for 14 sequences" in outcome["message"]


@pytest.mark.xdist_group("distributed_train")
def test_two_gloo_ranks_equal_one_process_and_a_hung_rank_is_named():
    cases = [
        dict(seqs=rollouts(1), mode="auto", token_budget=20),
        dict(seqs=SEQS, hang_rank=1, hang_s=6.0, barrier_timeout_s=1.5),
    ]  # last: it breaks the group
    results = spawn(2, check_cases, {"cases": cases}, timeout_s=900, collective_timeout_s=20)
    per_case = by_case(results)
    assert_equal_to_single_process(per_case[0], cases[0], 2)
    timeline = per_case[0][0]["value"]["timeline"]
    assert {"compute_s", "wait_s", "reduce_s", "predicted"} <= set(timeline[0])
    assert min(t["wait_s"] for t in timeline) == 0.0
    hung = per_case[1]
    assert all(not o["ok"] and o["error"] == "RankFailureError" for o in hung), hung
    assert "Ranks 1 failed to pass monitoredBarrier" in hung[0]["message"]
    assert "not every rank reached the barrier" in hung[1]["message"]


@pytest.mark.xdist_group("distributed_train")
def test_ranks_with_different_model_parameters_fail_together():
    """Other weights, another dtype or another architecture on one rank: every rank raises and names the
    parameter, nothing is all-reduced (no mixed-dtype all-reduce), and the group stays usable."""
    cases = [
        dict(seqs=SEQS, mode="flat", model_rank=1, model_change={"seed": 1}),
        dict(seqs=SEQS, mode="flat", model_rank=0, model_change={"dtype": torch.float32}),
        dict(seqs=SEQS, mode="flat", model_rank=1, model_change={"dim": 16}),
        dict(seqs=SEQS, mode="flat"),
    ]
    results = spawn(2, check_cases, {"cases": cases}, timeout_s=900, collective_timeout_s=20)
    per_case = by_case(results)
    expected = [
        "parameter 'embed.weight' has different values on rank 1 and rank 0",
        "parameter 'embed.weight' is torch.float64 [50, 32] on rank 1 but torch.float32 [50, 32] on rank 0",
        "parameter 'embed.weight' is torch.float64 [50, 16] on rank 1 but torch.float64 [50, 32] on rank 0",
    ]
    for outcomes, detail in zip(per_case[:3], expected, strict=True):
        for rank, outcome in enumerate(outcomes):
            assert not outcome["ok"] and outcome["error"] == "RankMismatchError", outcome
            assert outcome["message"].startswith(f"rank {rank}: the ranks hold different model parameters")
            assert detail in outcome["message"], outcome["message"]
    assert_equal_to_single_process(per_case[3], cases[3], 2)


@pytest.mark.xdist_group("distributed_train")
def test_spawn_kills_ranks_that_run_past_the_timeout():
    with pytest.raises(TimeoutError, match="did not finish within"):
        spawn(1, check_cases, {"cases": [dict(seqs=SEQS, hang_rank=0, hang_s=60.0)]}, timeout_s=5)


@pytest.mark.xdist_group("distributed_train")
def test_spawn_names_a_rank_that_exits_without_a_result():
    """A rank that leaves with exit code 0 before returning (sys.exit inside fn) is reported by rank and
    exit code, not as a missing file."""
    case = dict(seqs=SEQS, exit_rank=1, barrier_timeout_s=5.0)
    with pytest.raises(RuntimeError, match=r"^rank 1 exited with code 0 without a result"):
        spawn(2, check_cases, {"cases": [case]}, timeout_s=900, collective_timeout_s=10)


def _raise_interrupt(*args):
    raise KeyboardInterrupt


def _raise_error(*args):
    raise RuntimeError("injected failure in the model's forward")


def _reduce_then_interrupt(params, group):
    params[0].grad.add_(1.0)  # half-way through the all-reduce
    raise KeyboardInterrupt


@pytest.mark.parametrize(
    ("where", "expected"),
    [("share", KeyboardInterrupt), ("all-reduce", KeyboardInterrupt), ("failure", RankFailureError)],
)
def test_a_failed_or_interrupted_step_leaves_grad_as_it_was(one_rank_group, monkeypatch, where, expected):
    model = check_model(VOCAB, torch.float64, seed=0)
    named = list(model.named_parameters())
    gen = torch.Generator().manual_seed(7)
    for i, (_, p) in enumerate(named):
        if i % 3:  # earlier accumulated gradients on most parameters, None on the others
            p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)
    held = {n: p.grad for n, p in named}
    values = {n: None if g is None else g.clone() for n, g in held.items()}
    plan = plan_shares(RolloutTrie.from_sequences(SEQS), mode="flat")
    if where == "share":
        model.embed.register_forward_pre_hook(_raise_interrupt)
    elif where == "failure":
        model.embed.register_forward_pre_hook(_raise_error)
    else:
        monkeypatch.setattr(step_module, "_all_reduce_grads", _reduce_then_interrupt)
    with pytest.raises(expected):
        run_step(model, plan)
    for name, p in named:
        assert p.grad is held[name], name
        if values[name] is not None:
            assert torch.equal(p.grad, values[name]), name
