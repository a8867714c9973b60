"""treeattn_lab.rl.tasks: the byte tokenizer, addition problems generated in code, the verifiable reward,
the multi-turn environment and the supervised warm-up."""

from __future__ import annotations

import re

import pytest
import torch

from treeattn_lab.reference import TinyLM, TinyLMConfig
from treeattn_lab.rl import sample
from treeattn_lab.rl.tasks import AdditionTask, ByteTokenizer, Problem


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "12+7=19\nπ"
    ids = tok.encode(text)
    assert ids[:3] == [ord("1"), ord("2"), ord("+")] and max(ids) < tok.vocab_size == 256
    assert tok.decode(ids) == text and tok.decode(torch.tensor(ids)) == text
    assert tok.eos_token_id == ord("\n")
    with pytest.raises(TypeError, match="text must be a str"):
        tok.encode(b"12")


def test_problems_are_seeded_and_well_formed():
    task = AdditionTask(digits=2, shots=3)
    a, b = task.problems(20, seed=4), task.problems(20, seed=4)
    assert a == b and a != task.problems(20, seed=5)
    for p in a:
        *shots, question = p.prompt.split("\n")
        assert len(shots) == 3 and question == f"{p.operands[0]}+{p.operands[1]}="
        for line in shots:
            left, right = line.split("=")
            x, y = map(int, left.split("+"))
            assert x + y == int(right) and 0 <= x < 100 and 0 <= y < 100
        assert p.answers == [p.operands[0] + p.operands[1]]
    assert len(task.prompt_ids(a)[0]) == len(a[0].prompt)


def test_single_turn_reward():
    task = AdditionTask(digits=2, shots=1)
    p = Problem(prompt="1+2=3\n25+19=", operands=(25, 19))
    assert task.reward(p, "44\n") == 1.0
    assert task.reward(p, task.tokenizer.encode("44\n")) == 1.0
    assert task.reward(p, "44") == 1.0  # the answer, cut before its newline
    for wrong in ("45\n", "4\n", "440\n", "\n", "", " 44\n"):
        assert task.reward(p, wrong) == 0.0, wrong


def test_multi_turn_environment_and_reward():
    task = AdditionTask(digits=2, shots=1, turns=3)
    p = Problem(prompt="1+2=3\n25+19=", operands=(25, 19, 7, 30))
    assert p.answers == [44, 51, 81]
    assert task.observation(p, "44\n") == "44+7="
    assert task.observation(p, "40\n") == "44+7="  # the true total, whatever the model said
    assert task.observation(p, "4444") == "\n44+7="  # a turn cut off gets its newline
    assert task.observation(p, "44\n44+7=51\n") == "51+30="
    assert task.reward(p, "44\n44+7=51\n51+30=81\n") == 1.0
    assert task.reward(p, "40\n44+7=51\n51+30=81\n") == pytest.approx(2 / 3)
    assert task.reward(p, "44\n44+7=50\n51+30=80\n") == pytest.approx(1 / 3)
    assert task.reward(p, "44\n99+7=51\n") == pytest.approx(1 / 3)  # a line the environment did not write
    env = task.environment([p])
    prompt = task.tokenizer.encode(p.prompt)
    assert task.tokenizer.decode(env(0, prompt + task.tokenizer.encode("44\n"))) == "44+7="
    assert AdditionTask(turns=1).environment([p]) is None


def test_rewards_of_a_sampled_multi_turn_batch():
    task = AdditionTask(digits=1, shots=2, turns=2)
    torch.manual_seed(0)
    model = TinyLM(TinyLMConfig(vocab_size=256, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64))
    problems = task.problems(3, seed=1)
    batch = sample(model, task.prompt_ids(problems), num_samples=2, max_new_tokens=task.max_new_tokens(),
                   eos_token_id=10, forks=(2,), environment=task.environment(problems),
                   generator=torch.Generator().manual_seed(0))
    rewards = task.rewards(problems, batch)
    assert rewards.shape == (12,) and set(rewards.tolist()) <= {0.0, 0.5, 1.0}
    for j, completion in zip(batch.prompt_index, batch.completions, strict=True):
        text = task.tokenizer.decode(completion)
        want = f"{problems[j].answers[0]}+{problems[j].operands[2]}="
        assert want in text  # the environment's question of turn 2 follows the first answer
    assert batch.trie.stats()["max_node_depth"] >= 2


def test_max_new_tokens_fits_every_answer():
    for digits, turns in [(1, 1), (2, 1), (2, 3), (3, 2)]:
        task = AdditionTask(digits=digits, shots=0, turns=turns)
        longest = max(len(str(a)) for p in task.problems(200) for a in p.answers)
        assert task.max_new_tokens() >= longest + 1


def test_rollout_length_bounds_sampled_rollouts():
    task = AdditionTask(digits=2, shots=5, turns=3)
    torch.manual_seed(0)
    model = TinyLM(TinyLMConfig(vocab_size=256, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=32))
    problems = task.problems(64, seed=0)
    batch = sample(model, task.prompt_ids(problems), num_samples=1, max_new_tokens=task.max_new_tokens(),
                   eos_token_id=10, forks=(1, 1), environment=task.environment(problems))
    assert max(batch.trie.seq_lengths) <= task.rollout_length()
    assert AdditionTask(digits=1, shots=8).rollout_length() <= 64  # the quick experiment's window


def test_warm_up_reaches_a_nonzero_reward():
    task = AdditionTask(digits=1, shots=2)
    torch.manual_seed(0)
    model = TinyLM(TinyLMConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=172))
    held_out = task.problems(32, seed=99)
    assert task.evaluate(model, held_out) == 0.0
    history = task.warm_up(model, steps=150, progress=False)
    assert history["loss"][-1] < history["loss"][0] / 3
    assert task.evaluate(model, held_out) > 0.3


def _offsets(task, tokens):
    """Each warm-up line's answer minus its true sum."""
    lines = [re.fullmatch(r"(\d+)\+(\d+)=(\d+)", line) for line in task.tokenizer.decode(tokens).splitlines()]
    return [int(m[3]) - int(m[1]) - int(m[2]) for m in lines]


def test_warm_up_lines_are_one_too_high_at_the_error_rate(monkeypatch):
    task = AdditionTask(digits=1, shots=2)
    exact = task.training_tokens(200, seed=3)
    assert torch.equal(exact, task.training_tokens(200, seed=3, error_rate=0.0))
    assert set(_offsets(task, exact)) == {0}
    assert set(_offsets(task, task.training_tokens(200, seed=3, error_rate=1.0))) == {1}
    offsets = _offsets(task, task.training_tokens(4000, seed=3, error_rate=0.6))
    assert set(offsets) == {0, 1} and 0.57 < sum(offsets) / len(offsets) < 0.63
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="error_rate"):
            task.training_tokens(10, error_rate=bad)
    asked, real = [], task.training_tokens

    def spy(*args, **kwargs):
        asked.append(kwargs["error_rate"])
        return real(*args, **kwargs)

    monkeypatch.setattr(task, "training_tokens", spy)
    model = TinyLM(TinyLMConfig(vocab_size=256, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=32))
    task.warm_up(model, steps=1, error_rate=0.25, progress=False)
    assert asked == [0.25]


@pytest.mark.parametrize("kwargs, match", [(dict(digits=0), "digits"), (dict(turns=0), "turns"),
                                           (dict(shots=-1), "shots"), (dict(digits=1.0), "digits")])
def test_bad_task(kwargs, match):
    with pytest.raises((TypeError, ValueError), match=match):
        AdditionTask(**kwargs)
