"""treeattn_lab.rl.sample: greedy equals plain decoding, sampled log-probs equal recomputed ones, the
shared-prefix cache equals no cache under a fixed generator, forks and turns make the tries they should."""

from __future__ import annotations

import math

import pytest
import torch

from tests.engine_models import VOCAB, hf_llama, tiny_lm
from treeattn_lab.engine import tree_logprobs
from treeattn_lab.rl import sample
from treeattn_lab.rl.sample import next_tokens
from treeattn_lab.trie import RolloutTrie

PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [8, 9], [10, 11, 12, 13]]  # awkward, unequal lengths


def last_logits(model, ids: list[int]) -> torch.Tensor:
    """The model's own next-token logits after ``ids`` (its own forward, its own attention)."""
    x = torch.tensor([ids])
    with torch.no_grad():
        if hasattr(model, "forward_padded"):
            return model.forward_padded(x)[0, -1]
        return model(input_ids=x).logits[0, -1]


def plain_greedy(model, prompt, steps, eos=None):
    """Token-by-token greedy decoding through the model's own forward, the whole sequence every step."""
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(last_logits(model, ids).argmax()))
        if ids[-1] == eos:
            break
    return ids[len(prompt):]


def recomputed(model, batch):
    """Per rollout the recomputed log-probs of its completion tokens (tree_logprobs, packed)."""
    logps = tree_logprobs(model, batch.trie, mode="packed")
    return [lp[p - 1:] for lp, p in zip(logps, batch.prompt_lengths, strict=True)]


def env_reply(j, tokens):
    """A reply that depends on the rollout (so observations differ in length), sometimes empty."""
    return [] if (j + len(tokens)) % 3 == 0 else [20 + (len(tokens) % 5)] * (1 + len(tokens) % 3)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_greedy_equals_plain_decoding_tiny_lm(dtype):
    model = tiny_lm(dtype, seed=3)
    batch = sample(model, PROMPTS, num_samples=3, max_new_tokens=9, temperature=0)
    for i, completion in enumerate(batch.completions):
        assert completion == plain_greedy(model, PROMPTS[i // 3], 9)


def test_greedy_equals_plain_decoding_hf_llama():
    model = hf_llama(torch.float32, seed=1)
    batch = sample(model, PROMPTS, num_samples=2, max_new_tokens=8, temperature=0)
    for i, completion in enumerate(batch.completions):
        assert completion == plain_greedy(model, PROMPTS[i // 2], 8)


def test_greedy_stops_at_eos_and_forks_keep_it():
    model = tiny_lm(seed=5)
    free = plain_greedy(model, PROMPTS[0], 6)
    eos = free[2]
    batch = sample(model, PROMPTS[:1], num_samples=1, max_new_tokens=3, temperature=0, eos_token_id=eos,
                   forks=(2,))
    want = plain_greedy(model, PROMPTS[0], 6, eos=eos)
    assert want[-1] == eos and len(want) <= 3
    assert batch.completions == [want, want]  # a finished rollout is copied at the fork, not continued


@pytest.mark.parametrize("model_fn", [tiny_lm, hf_llama], ids=["tiny_lm", "hf_llama"])
def test_sampled_logprobs_equal_recomputed(model_fn):
    model = model_fn(torch.float32, seed=2)
    gen = torch.Generator().manual_seed(11)
    batch = sample(model, PROMPTS, num_samples=4, max_new_tokens=7, temperature=0.7, top_p=0.9,
                   eos_token_id=5, generator=gen, forks=(2,))
    for got, want, gen_mask in zip(batch.logprobs, recomputed(model, batch), batch.generated, strict=True):
        assert gen_mask.all()  # no environment: every completion token was sampled
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    # the raw policy's log-probs, not the tempered distribution's: they differ from log softmax(l / 0.7)
    logits = last_logits(model, PROMPTS[0]).float()
    first, got = batch.completions[0][0], float(batch.logprobs[0][0])
    assert abs(got - float(torch.log_softmax(logits, -1)[first])) < 1e-5
    assert abs(got - float(torch.log_softmax(logits / 0.7, -1)[first])) > 1e-4


def test_sampled_logprobs_float64_tight_with_turns():
    model = tiny_lm(torch.float64, seed=4)
    batch = sample(model, PROMPTS, num_samples=2, max_new_tokens=4, eos_token_id=3, forks=(2, 3),
                   environment=env_reply, generator=torch.Generator().manual_seed(0))
    for got, want, gen_mask in zip(batch.logprobs, recomputed(model, batch), batch.generated, strict=True):
        assert got.dtype == torch.float64
        torch.testing.assert_close(got[gen_mask], want[gen_mask], atol=1e-12, rtol=1e-12)
        assert (got[~gen_mask] == 0).all()
    assert any((~g).any() for g in batch.generated), "the environment appended observations"


@pytest.mark.parametrize(
    "options",
    [
        dict(num_samples=5, max_new_tokens=8),
        dict(num_samples=3, max_new_tokens=5, eos_token_id=7, forks=(2,), top_p=0.8),
        dict(num_samples=2, max_new_tokens=4, eos_token_id=3, forks=(2, 2), environment=env_reply,
             temperature=1.3),
    ],
    ids=["plain", "forks", "turns"],
)
@pytest.mark.parametrize("model_fn", [tiny_lm, hf_llama], ids=["tiny_lm", "hf_llama"])
def test_shared_prefix_cache_equals_no_cache(model_fn, options):
    model = model_fn(torch.float64, seed=6)
    seed = int(torch.randint(0, 2**31, ()))  # a fresh seed each run; the same one for both
    cached = sample(model, PROMPTS, generator=torch.Generator().manual_seed(seed), **options)
    plain = sample(model, PROMPTS, generator=torch.Generator().manual_seed(seed), use_cache=False, **options)
    assert cached.completions == plain.completions, f"seed {seed}"
    assert cached.trie == plain.trie
    for a, b in zip(cached.logprobs, plain.logprobs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


def test_order_trie_and_masks():
    model = tiny_lm(seed=7)
    batch = sample(model, PROMPTS, num_samples=2, max_new_tokens=3, forks=(3,), environment=env_reply,
                   generator=torch.Generator().manual_seed(1))
    assert batch.group_size == 6 and batch.num_rollouts == 18
    assert batch.prompt_index == [j for j in range(3) for _ in range(6)]
    seqs = [PROMPTS[j] + c for j, c in zip(batch.prompt_index, batch.completions, strict=True)]
    assert batch.trie == RolloutTrie.from_sequences(seqs)
    assert batch.trie.sequences() == seqs
    for r in range(0, 18, 3):  # the three copies of a fork share the first turn (3 tokens and the reply)
        first = batch.completions[r][:3]
        assert all(batch.completions[r + w][:3] == first for w in range(3))
    rows = zip(batch.loss_masks(), batch.prompt_lengths, batch.generated, seqs, strict=True)
    for mask, p, gen, seq in rows:
        assert mask.shape == (len(seq) - 1,)
        assert (mask[: p - 1] == 0).all() and torch.equal(mask[p - 1:].bool(), gen)
    stats = batch.trie.stats()
    assert stats["token_ratio"] > 1 and stats["max_node_depth"] >= 2


def test_tiny_top_p_is_greedy():
    model = tiny_lm(seed=8)
    greedy = sample(model, PROMPTS, num_samples=2, max_new_tokens=6, temperature=0)
    nucleus = sample(model, PROMPTS, num_samples=2, max_new_tokens=6, top_p=1e-9,
                     generator=torch.Generator().manual_seed(0))
    assert greedy.completions == nucleus.completions


def test_next_tokens_draws_from_the_tempered_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).expand(40000, -1)
    gen = torch.Generator().manual_seed(0)
    tokens, logps = next_tokens(logits, 1.0, 1.0, gen)
    freq = torch.bincount(tokens, minlength=4) / tokens.numel()
    torch.testing.assert_close(freq, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.01, rtol=0)
    torch.testing.assert_close(logps, torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))[tokens])
    tokens, _ = next_tokens(logits, 1.0, 0.7, gen)  # nucleus {0, 1}: 0.5 + 0.3 >= 0.7
    freq = torch.bincount(tokens, minlength=4) / tokens.numel()
    assert freq[2:].sum() == 0
    torch.testing.assert_close(freq[:2], torch.tensor([0.625, 0.375]), atol=0.01, rtol=0)
    tokens, _ = next_tokens(logits, 2.0, 1.0, gen)
    want = torch.softmax(logits[0] / 2.0, -1)
    torch.testing.assert_close(torch.bincount(tokens, minlength=4) / tokens.numel(), want, atol=0.01, rtol=0)


def test_same_generator_state_same_batch_and_nothing_mutated():
    model = tiny_lm(seed=9)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    prompts = [list(p) for p in PROMPTS]
    a = sample(model, prompts, num_samples=3, max_new_tokens=5, generator=torch.Generator().manual_seed(3))
    b = sample(model, prompts, num_samples=3, max_new_tokens=5, generator=torch.Generator().manual_seed(3))
    assert a.completions == b.completions
    assert prompts == PROMPTS
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(num_samples=0), ValueError, "num_samples"),
        (dict(num_samples=1.5), TypeError, "num_samples"),
        (dict(max_new_tokens=0), ValueError, "max_new_tokens"),
        (dict(temperature=-1.0), ValueError, "temperature"),
        (dict(temperature=math.nan), ValueError, "temperature"),
        (dict(top_p=0.0), ValueError, "top_p"),
        (dict(top_p=1.5), ValueError, "top_p"),
        (dict(eos_token_id=VOCAB), ValueError, "eos_token_id"),
        (dict(generator=0), TypeError, "generator"),
        (dict(forks=2), TypeError, "forks"),
        (dict(forks=(0,)), ValueError, "forks"),
        (dict(environment="tool"), TypeError, "environment"),
        (dict(forks=(1,), environment=lambda j, t: [VOCAB]), ValueError, "environment returned"),
        (dict(forks=(1,), environment=lambda j, t: "ab"), TypeError, "observation"),
        (dict(prompts=[]), ValueError, "prompts is empty"),
        (dict(prompts=[[1, 2], []]), ValueError, "sequence 1 is empty"),
        (dict(prompts=[[1, VOCAB]]), ValueError, "prompt 0"),
        (dict(prompts=torch.ones(2, 3, dtype=torch.long)), TypeError, "prompts"),
    ],
)
def test_bad_input(kwargs, error, match):
    options = {"prompts": PROMPTS, "num_samples": 2, "max_new_tokens": 3, **kwargs}
    with pytest.raises(error, match=match):
        sample(tiny_lm(), options.pop("prompts"), **options)


def test_not_a_model():
    with pytest.raises(TypeError, match="TinyLM or a Hugging Face"):
        sample(torch.nn.Linear(2, 2), PROMPTS, num_samples=1, max_new_tokens=1)
