"""Bundled RL rollout data sets, generated from a seed.

Four synthetic sets span the range of prefix sharing that tree attention meets in RL training:

- ``grpo_math``: GRPO on math problems: a group of 8-16 samples per prompt, forking right after the prompt.
- ``agentic``: multi-turn agent trajectories forking at tool calls under a long shared history.
- ``tree_search``: tree-search RL: responses fork at segment boundaries, 4 x 4 over two depths.
- ``low_sharing``: short prompts and long independent responses, the case where a tree saves little.

The files live in ``data/rollouts/<name>.jsonl`` at the repository root (``data/README.md`` is their
datasheet). :func:`load_rollouts` reads them and, when the package is installed without them, falls back
to :func:`generate`, which returns the same rollouts by construction.

Byte stability: the only part of :mod:`random` that Python promises to keep across versions is
``Random.random()`` with an int seed, so every draw goes through ``rng.random()`` and the small helpers
below turn it into ints, choices and log-normal lengths (``randint``, ``choice`` or ``gauss`` may change).
The log-normal lengths also use ``math.log``, ``cos`` and ``exp``; a libm that differs in the last bit
could in principle move one length by a token, which ``python data/generate.py --check`` would report.

Token ids live in a 32K vocabulary: a few special tokens (chat-template markers) at the bottom, then
content tokens drawn from a Zipf law (the r-th most frequent token has probability proportional to 1/r),
mixed with a small per-prompt "topic" pool so that a prompt and its responses reuse the same words.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from .atomic import write_bytes_atomic
from .trie import RolloutTrie

DATASETS = ("grpo_math", "agentic", "tree_search", "low_sharing")

VOCAB_SIZE = 32_000
# Special tokens: the ids a chat template adds around the text. Content tokens start at NUM_SPECIAL.
PAD, BOS, EOS, SYSTEM, USER, ASSISTANT, TOOL, END_TURN, CALL_OPEN, CALL_CLOSE, STEP_BREAK = range(11)
NUM_SPECIAL = 16

DATA_DIR = Path(__file__).resolve().parents[1] / "data"
ROLLOUT_DIR = DATA_DIR / "rollouts"

_SEED_OFFSET = {"grpo_math": 1_000, "agentic": 2_000, "tree_search": 3_000, "low_sharing": 4_000}
_VOCAB_SEED = 32_000  # the "tokenizer" (id order of the content tokens) is fixed, whatever the set's seed
_TOPIC_SIZE = 48  # distinct topic tokens per prompt
_TOPIC_RATE = 0.25  # share of content tokens drawn from the topic pool instead of the global Zipf law


@dataclass(frozen=True)
class Rollout:
    """One rollout: ``group`` is its prompt (or task) index, ``path`` its branch choices inside the group."""

    group: int
    path: str
    tokens: list[int]


# ---------------------------------------------------------------------------------------------- drawing
def _uniform_int(rng: random.Random, lo: int, hi: int) -> int:
    """An int in [lo, hi], each equally likely."""
    return lo + int(rng.random() * (hi - lo + 1))


def _normal(rng: random.Random) -> float:
    """A standard normal draw (Box-Muller; 1 - u keeps the log away from 0)."""
    u, v = rng.random(), rng.random()
    return math.sqrt(-2.0 * math.log(1.0 - u)) * math.cos(2.0 * math.pi * v)


def _lognormal_int(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    """A heavy-tailed length: log-normal around ``median``, truncated to [lo, hi] by redrawing.

    Redrawing (rather than clamping) keeps the tail smooth instead of piling lengths up at ``hi``.
    """
    while True:
        length = round(median * math.exp(sigma * _normal(rng)))
        if lo <= length <= hi:
            return length


@functools.cache
def _content_vocab() -> tuple[list[int], list[float]]:
    """Content token id of each frequency rank, and the cumulative Zipf weights of the ranks.

    Ids follow a BPE-like order: frequent tokens were merged early and get small ids, but not exactly in
    frequency order, so each rank's id is sorted by ``rank * jitter`` with jitter in [0.5, 1.5).
    """
    num_content = VOCAB_SIZE - NUM_SPECIAL
    rng = random.Random(_VOCAB_SEED)
    sort_key = [(rank + 1) * (0.5 + rng.random()) for rank in range(num_content)]
    ranks_in_id_order = sorted(range(num_content), key=lambda rank: (sort_key[rank], rank))
    token_of_rank = [0] * num_content
    for offset, rank in enumerate(ranks_in_id_order):
        token_of_rank[rank] = NUM_SPECIAL + offset
    cumulative = list(itertools.accumulate(1.0 / (rank + 1) for rank in range(num_content)))
    return token_of_rank, cumulative


def _zipf_token(rng: random.Random) -> int:
    token_of_rank, cumulative = _content_vocab()
    rank = bisect.bisect_right(cumulative, rng.random() * cumulative[-1])
    return token_of_rank[min(rank, len(token_of_rank) - 1)]


def _topic(rng: random.Random) -> list[int]:
    """The words a prompt is about: mid-frequency tokens (ranks 200-8000), neither stop words nor rare."""
    token_of_rank, _ = _content_vocab()
    return [token_of_rank[_uniform_int(rng, 200, 8000)] for _ in range(_TOPIC_SIZE)]


def _text(rng: random.Random, length: int, topic: list[int]) -> list[int]:
    """``length`` content tokens: mostly Zipf-distributed, a quarter of them from the topic pool."""
    out = []
    for _ in range(length):
        if rng.random() < _TOPIC_RATE:
            out.append(topic[int(rng.random() * len(topic))])
        else:
            out.append(_zipf_token(rng))
    return out


# ---------------------------------------------------------------------------------------------- the sets
def _math_prompt(rng: random.Random, instruction: list[int], length: int, topic: list[int]) -> list[int]:
    """BOS, the shared system instruction, a user turn of problem text, then the assistant header.

    The prompt ends on ASSISTANT, so the sampled responses fork right after it.
    """
    head = [BOS, SYSTEM, *instruction, END_TURN, USER]
    return head + _text(rng, length - len(head) - 2, topic) + [END_TURN, ASSISTANT]


def _grpo_math(rng: random.Random) -> list[Rollout]:
    """16 prompts (80-300 tokens) x 8-16 samples; responses log-normal (median 320) in [50, 1500]."""
    instruction = _text(rng, 20, _topic(rng))  # "Reason step by step; put the answer in \boxed{}."
    rollouts = []
    for group in range(16):
        topic = _topic(rng)
        prompt = _math_prompt(rng, instruction, _uniform_int(rng, 80, 300), topic)
        for sample in range(_uniform_int(rng, 8, 16)):
            length = _lognormal_int(rng, median=320, sigma=0.7, lo=50, hi=1500)
            response = _text(rng, length - 2, topic) + [END_TURN, EOS]
            rollouts.append(Rollout(group, str(sample), prompt + response))
    return rollouts


def _agent_turn(rng: random.Random, length: int, topic: list[int], final: bool) -> list[int]:
    """``length`` tokens of agent work: the assistant's reasoning and tool call, then the tool's output.

    A non-final turn ends on the next ASSISTANT header (where the next fork happens); the final turn
    adds a short closing answer and EOS instead.
    """
    closing = _uniform_int(rng, 30, 120) if final else 0
    call = _uniform_int(rng, 10, 40)
    thought = _uniform_int(rng, 20, max(20, length // 4))
    # markers: CALL_OPEN, CALL_CLOSE, END_TURN, TOOL, END_TURN, then ASSISTANT (+ END_TURN, EOS if final)
    markers = 6 + (2 if final else 0)
    output = length - thought - call - closing - markers
    turn = _text(rng, thought, topic) + [CALL_OPEN] + _text(rng, call, topic) + [CALL_CLOSE, END_TURN]
    turn += [TOOL] + _text(rng, output, topic) + [END_TURN, ASSISTANT]
    if final:
        turn += _text(rng, closing, topic) + [END_TURN, EOS]
    return turn


def _agentic(rng: random.Random) -> list[Rollout]:
    """2 tasks under one system prompt (4K-8K tokens each with the task), forking at 3 tool calls.

    The first fork is 2-4 ways, the next two 2-3 ways. After each fork the branch runs 1-3 tool turns
    before the next fork (agents make many calls; a rollout group resamples at only some of them). Each
    turn is 200-1500 tokens (log-normal, median 600) of reasoning, tool call and tool output.
    """
    system = [BOS, SYSTEM] + _text(rng, _uniform_int(rng, 2500, 3500), _topic(rng)) + [END_TURN]
    widths = ((2, 4), (2, 3), (2, 3))
    rollouts = []

    def fork(group: int, history: list[int], level: int, path: str, topic: list[int]) -> None:
        lo, hi = widths[level]
        last_level = level == len(widths) - 1
        for branch in range(_uniform_int(rng, lo, hi)):
            tokens = list(history)
            num_turns = _uniform_int(rng, 1, 3)
            for turn in range(num_turns):
                length = _lognormal_int(rng, median=600, sigma=0.6, lo=200, hi=1500)
                tokens += _agent_turn(rng, length, topic, final=last_level and turn == num_turns - 1)
            branch_path = f"{path}.{branch}" if path else str(branch)
            if last_level:
                rollouts.append(Rollout(group, branch_path, tokens))
            else:
                fork(group, tokens, level + 1, branch_path, topic)

    for group in range(2):
        topic = _topic(rng)
        total = _uniform_int(rng, 4000, 8000)  # system prompt + task, the history every branch shares
        task = [USER] + _text(rng, total - len(system) - 3, topic) + [END_TURN, ASSISTANT]
        fork(group, system + task, 0, "", topic)
    return rollouts


def _tree_search(rng: random.Random) -> list[Rollout]:
    """4 math prompts; each response is 2 segments of 256-1024 tokens, forking 4 ways at each boundary."""
    instruction = _text(rng, 20, _topic(rng))
    rollouts = []
    for group in range(4):
        topic = _topic(rng)
        prompt = _math_prompt(rng, instruction, _uniform_int(rng, 80, 300), topic)
        for first in range(4):
            # a segment ends at a paragraph break: where tree-search RL cuts and resamples
            head = _text(rng, _uniform_int(rng, 256, 1024) - 1, topic) + [STEP_BREAK]
            for second in range(4):
                tail = _text(rng, _uniform_int(rng, 256, 1024) - 2, topic) + [END_TURN, EOS]
                rollouts.append(Rollout(group, f"{first}.{second}", prompt + head + tail))
    return rollouts


def _low_sharing(rng: random.Random) -> list[Rollout]:
    """32 short prompts (16-64 tokens) x 4 samples with long independent responses (512-2048 tokens)."""
    rollouts = []
    for group in range(32):
        topic = _topic(rng)
        length = _uniform_int(rng, 16, 64)
        prompt = [BOS, USER] + _text(rng, length - 4, topic) + [END_TURN, ASSISTANT]
        for sample in range(4):
            response = _text(rng, _uniform_int(rng, 512, 2048) - 2, topic) + [END_TURN, EOS]
            rollouts.append(Rollout(group, str(sample), prompt + response))
    return rollouts


_GENERATORS = {
    "grpo_math": _grpo_math,
    "agentic": _agentic,
    "tree_search": _tree_search,
    "low_sharing": _low_sharing,
}


# ---------------------------------------------------------------------------------------------- public API
def _check_name(name: str) -> None:
    if name not in DATASETS:
        raise ValueError(f"unknown data set {name!r}; valid names: {', '.join(DATASETS)}")


def generate_rollouts(name: str, seed: int = 0) -> list[Rollout]:
    """The rollouts of set ``name`` with their group and branch path (deterministic in ``seed``)."""
    _check_name(name)
    return _GENERATORS[name](random.Random(seed + _SEED_OFFSET[name]))


def generate(name: str, seed: int = 0) -> list[list[int]]:
    """The token ids of every rollout of set ``name``; ``seed=0`` gives the bundled file's rollouts."""
    return [r.tokens for r in generate_rollouts(name, seed)]


def to_jsonl(name: str, rollouts: list[Rollout]) -> str:
    """One compact JSON object per line, ``{"id", "group", "tokens"}``, each line ending in a newline."""
    records = ({"id": f"{name}/{r.group}/{r.path}", "group": r.group, "tokens": r.tokens} for r in rollouts)
    return "".join(json.dumps(record, separators=(",", ":")) + "\n" for record in records)


def write_all(directory) -> list[Path]:
    """Write ``<name>.jsonl`` for every set into ``directory`` (created if needed); return the paths.

    Each file is written atomically: a failed write (a full disk, a file-size limit) leaves the old file.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in DATASETS:
        path = directory / f"{name}.jsonl"
        write_bytes_atomic(path, to_jsonl(name, generate_rollouts(name)).encode("utf-8"))
        paths.append(path)
    return paths


def load_rollouts(name: str) -> list[list[int]]:
    """The token ids of every rollout of set ``name``, from the bundled file (or regenerated without it)."""
    _check_name(name)
    path = ROLLOUT_DIR / f"{name}.jsonl"
    if not path.is_file():  # e.g. installed from a wheel, which does not carry data/
        return generate(name)
    with path.open(encoding="utf-8") as f:
        return [json.loads(line)["tokens"] for line in f if line.strip()]


def load_trie(name: str) -> RolloutTrie:
    """The :class:`RolloutTrie` of set ``name``."""
    return RolloutTrie.from_sequences(load_rollouts(name))
