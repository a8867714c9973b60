"""The bundled rollout sets: their documented shapes, and files that are exactly what the generator makes."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from collections import defaultdict

import pytest

from treeattn_lab import datasets
from treeattn_lab.datasets import DATASETS, generate, load_rollouts, load_trie, write_all
from treeattn_lab.trie import RolloutTrie


@functools.cache
def bundled_records(name: str) -> tuple[dict, ...]:
    """The JSON objects of ``data/rollouts/<name>.jsonl``, one per line."""
    path = datasets.ROLLOUT_DIR / f"{name}.jsonl"
    return tuple(json.loads(line) for line in path.read_text(encoding="utf-8").splitlines())


@functools.cache
def trie_stats(name: str) -> dict:
    return load_trie(name).stats()


def tokens_by_group(name: str) -> dict[int, list[list[int]]]:
    groups = defaultdict(list)
    for record in bundled_records(name):
        groups[record["group"]].append(record["tokens"])
    return dict(groups)


def common_prefix_length(seqs: list[list[int]]) -> int:
    """Tokens every sequence starts with: the prompt of a group whose samples fork right after it."""
    length = 0
    for column in zip(*seqs, strict=False):  # stops at the shortest sequence
        if any(t != column[0] for t in column):
            break
        length += 1
    return length


# ------------------------------------------------------------------------------------------ every set
@pytest.mark.parametrize("name", DATASETS)
def test_set_loads_as_chat_rollouts_in_the_vocabulary(name):
    rollouts = load_rollouts(name)
    assert rollouts and all(rollouts)
    assert all(0 <= t < datasets.VOCAB_SIZE for seq in rollouts for t in seq)
    assert all(seq[0] == datasets.BOS and seq[-1] == datasets.EOS for seq in rollouts)
    assert [r["tokens"] for r in bundled_records(name)] == rollouts
    # EOS only ends a rollout, so none is a prefix of another: every rollout ends on its own leaf
    stats = trie_stats(name)
    assert stats["num_leaves"] == stats["num_sequences"] == len(rollouts)


@pytest.mark.parametrize("name", DATASETS)
def test_records_have_unique_ids_and_contiguous_groups(name):
    records = bundled_records(name)
    assert [list(r) for r in records] == [["id", "group", "tokens"]] * len(records)
    assert len({r["id"] for r in records}) == len(records)
    groups = [r["group"] for r in records]
    assert groups == sorted(groups) and set(groups) == set(range(max(groups) + 1))


def test_bundled_files_equal_the_generator_byte_for_byte(tmp_path):
    paths = write_all(tmp_path)
    assert [p.name for p in paths] == [f"{name}.jsonl" for name in DATASETS]
    for path in paths:
        bundled = datasets.ROLLOUT_DIR / path.name
        assert bundled.read_bytes() == path.read_bytes(), f"{bundled} is stale: run python data/generate.py"
        text = path.read_text(encoding="utf-8")
        assert text.endswith("}\n") and ", " not in text and ": " not in text  # compact, newline-ended


FILE_SIZE_LIMIT = """
import resource, signal, sys
from treeattn_lab.datasets import write_all
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
resource.setrlimit(resource.RLIMIT_FSIZE, (400_000, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
try:
    write_all(sys.argv[1])
except OSError as error:
    print("failed:", error)
"""


def test_a_write_that_fails_midway_leaves_the_old_files_whole(tmp_path):
    # a file-size limit below the size of the first set's file: its write stops partway through
    old = {p.name: p.read_bytes() for p in write_all(tmp_path)}
    for path in tmp_path.iterdir():
        path.write_bytes(b"old " + old[path.name][:100])
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    run = subprocess.run(
        [sys.executable, "-c", FILE_SIZE_LIMIT, str(tmp_path)], capture_output=True, text=True, check=True
    )
    assert "failed:" in run.stdout and "File too large" in run.stdout
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # no partial file, no temp file


def test_load_regenerates_when_the_files_are_absent(tmp_path, monkeypatch):
    expected = [r["tokens"] for r in bundled_records("tree_search")]  # read before the folder "vanishes"
    monkeypatch.setattr(datasets, "ROLLOUT_DIR", tmp_path / "missing")
    assert load_rollouts("tree_search") == expected


def test_seed_changes_the_rollouts_and_repeats_them():
    assert generate("tree_search", seed=1) == generate("tree_search", seed=1)
    assert generate("tree_search", seed=1) != generate("tree_search")


@pytest.mark.parametrize("call", [load_rollouts, generate, load_trie])
def test_unknown_name_raises_naming_the_valid_ones(call):
    with pytest.raises(ValueError, match="grpo_math, agentic, tree_search, low_sharing"):
        call("grpo")


def test_data_folder_stays_small():
    data_bytes = sum(p.stat().st_size for p in datasets.DATA_DIR.rglob("*") if p.is_file())
    assert data_bytes < 10 * 2**20


# ------------------------------------------------------------------------------------------ shapes
def test_grpo_math_groups_of_samples_fork_after_the_prompt():
    groups = tokens_by_group("grpo_math")
    assert len(groups) == 16
    for samples in groups.values():
        assert 8 <= len(samples) <= 16
        prompt_length = common_prefix_length(samples)
        assert 80 <= prompt_length <= 300
        assert samples[0][prompt_length - 1] == datasets.ASSISTANT  # the fork is right after the prompt
        assert all(50 <= len(s) - prompt_length <= 1500 for s in samples)
    assert 1.2 < trie_stats("grpo_math")["token_ratio"] < 2.0


def test_agentic_branches_share_a_long_history():
    groups = tokens_by_group("agentic")
    assert len(groups) == 2
    trie = load_trie("agentic")
    # the history a rollout shares with its nearest sibling ends where its leaf node starts
    shared = [trie.nodes[leaf].depth for leaf in trie.seq_end_node]
    assert min(shared) >= 4000 and max(shared) <= 16_384
    assert all(6000 <= length <= 16_384 for length in trie.seq_lengths)
    stats = trie_stats("agentic")
    assert stats["flat_tokens"] < 400_000
    assert stats["token_ratio"] > 1.5


def test_tree_search_forks_four_ways_at_two_depths():
    groups = tokens_by_group("tree_search")
    assert len(groups) == 4 and all(len(samples) == 16 for samples in groups.values())
    for samples in groups.values():
        prompt_length = common_prefix_length(samples)
        for first in range(4):
            subtree = samples[4 * first : 4 * first + 4]  # ids "<first>.<second>", second fastest
            head_end = common_prefix_length(subtree)
            assert 256 <= head_end - prompt_length <= 1024
            assert subtree[0][head_end - 1] == datasets.STEP_BREAK  # segments end at a paragraph break
            assert all(256 <= len(s) - head_end <= 1024 for s in subtree)
    assert trie_stats("tree_search")["token_ratio"] > 1.5


def test_low_sharing_saves_almost_nothing():
    groups = tokens_by_group("low_sharing")
    assert len(groups) == 32 and all(len(samples) == 4 for samples in groups.values())
    for samples in groups.values():
        prompt_length = common_prefix_length(samples)
        assert 16 <= prompt_length <= 64
        assert all(512 <= len(s) - prompt_length <= 2048 for s in samples)
    assert trie_stats("low_sharing")["token_ratio"] < 1.2


def test_load_trie_matches_from_sequences():
    assert load_trie("tree_search") == RolloutTrie.from_sequences(load_rollouts("tree_search"))
