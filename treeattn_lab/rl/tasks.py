"""A task with a verifiable reward that a tiny byte-level model learns on a CPU in minutes: addition.

Text is bytes (:class:`ByteTokenizer`, vocabulary 256, ``"\\n"`` ends an answer), and every problem is
generated in code from a seed, so nothing is downloaded. A prompt holds ``shots`` solved examples, one a
line, then the question; the model completes the line:

    "31+4=35\\n70+18=88\\n5+62=67\\n25+19="        ->   "44\\n"                       (single turn)

The few-shot lines make the prompt long and the completions short, as in RL for reasoning models: the
``num_samples`` rollouts of a prompt share most of their tokens, which is what a trie saves.

**Multi-turn** (``turns > 1``): after each answer the environment, like a tool, replies with the running
total so far (always the true one) and the next operand, and the model answers again; the samples of a
prompt share the prompt, and rollouts forked at a turn boundary share the whole history before it:

    "...25+19="  ->  "44\\n"  env: "44+7="  ->  "51\\n"  env: "51+30="  ->  "81\\n"

**Reward**: the fraction of turns whose answer (the generated digits before ``"\\n"``) is the right sum,
1.0 or 0.0 for one turn. It is checked, never learned. **Warm-up**: a few hundred supervised steps on a
stream of solved lines (:func:`treeattn_lab.corpus.train_language_model`) teach the format and some sums,
so RL starts from a reward above zero. ``error_rate`` makes that share of the warm-up's lines one too high
(``"3+4=8"``), like demonstrations from a sloppy solver: a model that imitates them learns both answers,
samples the right one only part of the time and often ranks the wrong one first. Imitation cannot tell
the two apart; the checked reward can, which is the gap RL closes. The prompts' few-shot lines are
always right.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..checks import check_in_range, check_int
from ..corpus import VOCAB_SIZE, train_language_model


class ByteTokenizer:
    """UTF-8 bytes as token ids (0-255); ``eos_token_id`` is ``"\\n"``, which ends an answer."""

    vocab_size = VOCAB_SIZE
    eos_token_id = ord("\n")

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        """Token ids back to text (ids that are not valid UTF-8 are shown as the replacement character)."""
        values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        return bytes(v for v in values if 0 <= v < 256).decode("utf-8", errors="replace")


@dataclass(frozen=True)
class Problem:
    """One prompt: the few-shot text and question, and the operands of every turn."""

    prompt: str  # "31+4=35\n...\n25+19="
    operands: tuple[int, ...]  # (a, b, c, ...): turn 0 asks a + b, turn i adds operands[i + 1]

    @property
    def answers(self) -> list[int]:
        """The right answer of every turn: the running sums ``a + b``, ``a + b + c``, ..."""
        total, out = self.operands[0], []
        for x in self.operands[1:]:
            total += x
            out.append(total)
        return out


class AdditionTask:
    """Addition of ``digits``-digit numbers with ``shots`` worked examples per prompt, over ``turns`` turns.

    ``problems(n, seed)`` draws prompts; ``reward(problem, completion)`` scores one rollout;
    ``environment(problems)`` is the multi-turn reply for :func:`treeattn_lab.rl.sample`.
    """

    def __init__(self, digits: int = 2, shots: int = 4, turns: int = 1):
        self.digits = check_int("digits", digits)
        self.shots = check_int("shots", shots, minimum=0)
        self.turns = check_int("turns", turns)
        self.tokenizer = ByteTokenizer()

    def __repr__(self) -> str:
        return f"AdditionTask(digits={self.digits}, shots={self.shots}, turns={self.turns})"

    def _number(self, rng: random.Random) -> int:
        return rng.randrange(10**self.digits)

    def _line(self, rng: random.Random, error_rate: float = 0.0) -> str:
        """A solved line; with probability ``error_rate`` its answer is one too high."""
        a, b = self._number(rng), self._number(rng)
        wrong = error_rate > 0 and rng.random() < error_rate  # an extra draw only when errors are wanted
        return f"{a}+{b}={a + b + int(wrong)}\n"

    def problems(self, n: int, seed: int = 0) -> list[Problem]:
        """``n`` problems drawn from ``seed`` (the same seed, the same problems)."""
        check_int("n", n)
        rng = random.Random(seed)
        out = []
        for _ in range(n):
            shots = "".join(self._line(rng) for _ in range(self.shots))
            operands = tuple(self._number(rng) for _ in range(self.turns + 1))
            out.append(Problem(prompt=f"{shots}{operands[0]}+{operands[1]}=", operands=operands))
        return out

    def prompt_ids(self, problems: Sequence[Problem]) -> list[list[int]]:
        return [self.tokenizer.encode(p.prompt) for p in problems]

    def observation(self, problem: Problem, completion: str) -> str:
        """The environment's reply after the turns in ``completion``: the true total and the next operand,
        on a new line (a turn cut off before its ``"\\n"`` gets one)."""
        done = completion.count("\n") + (0 if completion.endswith("\n") else 1)
        total = problem.answers[done - 1]
        return ("" if completion.endswith("\n") else "\n") + f"{total}+{problem.operands[done + 1]}="

    def environment(self, problems: Sequence[Problem]):
        """``(prompt index, tokens) -> reply ids`` for :func:`treeattn_lab.rl.sample` (None for one turn)."""
        if self.turns == 1:
            return None
        problems = list(problems)
        tok = self.tokenizer

        def reply(j: int, tokens: list[int]) -> list[int]:
            prompt_length = len(tok.encode(problems[j].prompt))
            return tok.encode(self.observation(problems[j], tok.decode(tokens[prompt_length:])))

        return reply

    def turn_answers(self, problem: Problem, completion: str) -> list[str]:
        """The answer text of every turn in ``completion`` (the prompt excluded): line 0 is the first
        answer, line i the environment's question then the i-th answer."""
        lines = completion.split("\n")
        answers = []
        for i in range(self.turns):
            line = lines[i] if i < len(lines) else ""
            if i > 0:
                question = f"{problem.answers[i - 1]}+{problem.operands[i + 1]}="
                line = line[len(question) :] if line.startswith(question) else ""
            answers.append(line)
        return answers

    def reward(self, problem: Problem, completion) -> float:
        """The fraction of turns answered right (``completion``: text or token ids after the prompt)."""
        text = completion if isinstance(completion, str) else self.tokenizer.decode(completion)
        answers = self.turn_answers(problem, text)
        right = sum(a == str(want) for a, want in zip(answers, problem.answers, strict=True))
        return right / self.turns

    def rewards(self, problems: Sequence[Problem], batch) -> torch.Tensor:
        """Rewards ``[rollouts]`` (float32) of a :class:`treeattn_lab.rl.SampleBatch` sampled from them."""
        return torch.tensor(
            [self.reward(problems[j], c) for j, c in zip(batch.prompt_index, batch.completions, strict=True)],
            dtype=torch.float32,
        )

    def max_new_tokens(self) -> int:
        """Tokens an answer may need: the digits of the largest sum and ``"\\n"``."""
        return len(str((self.turns + 1) * (10**self.digits - 1))) + 1

    def rollout_length(self) -> int:
        """A bound on a rollout's tokens: the longest of 64 drawn prompts, then per turn the longest answer,
        and between turns the environment's question."""
        prompt = max(len(p.prompt) for p in self.problems(64, seed=0))
        question = self.max_new_tokens() + self.digits + 2  # "<total>+<operand>="
        return prompt + self.turns * self.max_new_tokens() + (self.turns - 1) * question

    def training_tokens(self, num_lines: int, seed: int = 0, error_rate: float = 0.0) -> torch.Tensor:
        """A stream of ``num_lines`` solved lines ``"a+b=c\\n"`` as byte tokens, for the warm-up; a share
        ``error_rate`` of them is one too high (module docstring)."""
        error_rate = check_in_range("error_rate", error_rate, 0.0, 1.0)
        rng = random.Random(seed)
        text = "".join(self._line(rng, error_rate) for _ in range(check_int("num_lines", num_lines)))
        return torch.tensor(self.tokenizer.encode(text), dtype=torch.int64)

    def warm_up(
        self,
        model,
        *,
        steps: int,
        batch_size: int = 16,
        seq_len: int | None = None,
        lr: float = 3e-3,
        seed: int = 0,
        error_rate: float = 0.0,
        progress: bool = True,
    ) -> dict[str, list]:
        """Supervised next-byte training on solved lines (the format, and some sums); returns the history.

        ``seq_len``: the training window (None: :meth:`rollout_length`, at least 64), so the model has seen
        every position a rollout reaches. ``error_rate``: the share of lines that are one too high
        (:meth:`training_tokens`)."""
        seq_len = max(64, self.rollout_length()) if seq_len is None else seq_len
        tokens = self.training_tokens(max(2000, steps * batch_size * seq_len // 8), seed=seed + 7919,
                                      error_rate=error_rate)
        return train_language_model(
            model,
            tokens.to(next(model.parameters()).device),
            steps=steps,
            batch_size=batch_size,
            seq_len=seq_len,
            lr=lr,
            seed=seed,
            progress=progress,
        )

    def evaluate(self, model, problems: Sequence[Problem]) -> float:
        """Mean reward of greedy answers to ``problems`` (one rollout each)."""
        from .sample import sample

        batch = sample(
            model,
            self.prompt_ids(problems),
            num_samples=1,
            max_new_tokens=self.max_new_tokens(),
            temperature=0,
            eos_token_id=self.tokenizer.eos_token_id,
            forks=(1,) * (self.turns - 1),
            environment=self.environment(problems),
        )
        return float(self.rewards(problems, batch).mean())


__all__ = ["AdditionTask", "ByteTokenizer", "Problem"]
