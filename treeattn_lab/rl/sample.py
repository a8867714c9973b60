"""Sampling rollouts with a shared-prefix KV cache: the trie that real sampling makes.

    batch = sample(model, prompts, num_samples=8, max_new_tokens=16, temperature=1.0, eos_token_id=10)
    batch.trie            # RolloutTrie of prompt + completion; rollout j * 8 + s is sample s of prompt j
    batch.completions     # the tokens after each prompt
    batch.logprobs        # each generated token's log-prob under the model's own softmax

**The cache.** A decoder keeps every layer's keys and values (K/V) of the tokens it has seen, so each new
token costs one forward of one token. Here the cache is a chain of *segments*: a segment holds the K/V of a
run of tokens for a set of rows, right-padded (``lengths`` says how many keys of each row are real), and
every decoding row points, through a ``row_index``, at one row of each segment of its chain. Rollouts that
share a prefix point at the same segment row, so a prefix's K/V is computed once and stored once:

- the prompts are run once, as one right-padded batch; their K/V become the first segment, and the
  ``num_samples`` rows of prompt j all point at its row j;
- the new tokens of the running turn go to the *open* segment, one row per rollout, one column per step;
- ``forks=(k1, k2, ...)`` (tree search, agents that fork at tool calls): at the end of turn i the open
  segment is closed and every rollout forks ``forks[i]`` ways; the copies point at the same rows of every
  closed segment, so the K/V are shared at every fork and the trie has one level per fork.

A query attends the keys of its chain's segments (the padded keys masked), the open segment, and the new
tokens of its own call causally, exactly as a forward over the whole rollout would. ``use_cache=False``
recomputes every rollout from its first token at every step instead (plain decoding, for checks).

**Turns.** With ``forks`` there are ``len(forks) + 1`` turns of at most ``max_new_tokens`` tokens each.
Without an ``environment``, turns are segments of one answer: ``eos_token_id`` ends the rollout (a finished
rollout is still copied at later forks, so every prompt keeps ``num_samples * prod(forks)`` rollouts).
With ``environment(prompt_index, tokens) -> observation ids``, ``eos_token_id`` ends a turn; the
environment's reply (a tool result, the next question) is appended to the rollout before the next turn
and is not sampled: ``generated`` marks it False and :meth:`SampleBatch.loss_masks` leaves it out.

**Log-probs.** ``logprobs`` are ``log softmax(logits)`` of the model itself at the sampled token, *before*
temperature and top-p: the policy's log-probs, the ones a training pass recomputes
(:func:`treeattn_lab.engine.tree_logprobs`) and that PPO ratios compare against. The distribution the token
was drawn from (``softmax(logits / temperature)`` cut to the top-p nucleus) differs from it whenever
``temperature != 1`` or ``top_p < 1``; its log-probs are not returned.

**Randomness.** Each step draws one uniform number per rollout from ``generator`` (inverse-CDF sampling):
the same generator state gives the same tokens with or without the cache. ``temperature=0`` is greedy
decoding (argmax, the lowest token id on ties) and draws nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..checks import check_in_range, check_int
from ..engine.adapters import adapt
from ..engine.attention import causal
from ..token_ids import rollout_token_ids, token_ids
from ..trie import RolloutTrie

Environment = Callable[[int, list[int]], Sequence[int]]


@dataclass
class SampleBatch:
    """Sampled rollouts, prompt-major: rollout ``j * group_size + s`` is sample s of prompt j."""

    trie: RolloutTrie  # prompt + completion of every rollout
    prompt_lengths: list[int]  # per rollout
    prompt_index: list[int]  # per rollout: which prompt it continues
    completions: list[list[int]]  # per rollout: the tokens after the prompt (observations included)
    generated: list[torch.Tensor]  # per rollout [len(completion)] bool: sampled (True) or observed
    logprobs: list[torch.Tensor]  # per rollout [len(completion)]: log p of sampled tokens, 0 at observed
    # (float32, float64 for a float64 model)
    group_size: int  # rollouts per prompt: num_samples * prod(forks)

    @property
    def num_rollouts(self) -> int:
        return len(self.completions)

    def loss_masks(self) -> list[torch.Tensor]:
        """Per rollout ``[n_i - 1]`` float64 masks aligned with ``tree_logprobs``: 1 where token ``t`` was
        sampled (``m_i[t - 1]``), 0 on the prompt and on observations."""
        masks = []
        for p, gen in zip(self.prompt_lengths, self.generated, strict=True):
            masks.append(torch.cat([torch.zeros(p - 1, dtype=torch.float64), gen.to(torch.float64)]))
        return masks


# ---------------------------------------------------------------------------------------------- the cache
@dataclass
class _Segment:
    keys: list[torch.Tensor]  # per layer [R, L, Hkv, D]
    values: list[torch.Tensor]
    lengths: torch.Tensor  # [R] real keys of each row (the rest is padding)


class SharedPrefixCache:
    """The segment chain of the module docstring, as the attention the engine's adapters hand a model.

    ``attention(layer, q [B, n, Hq, D], k, v [B, n, Hkv, D], scale)``: the n new tokens of every row attend
    their chain's closed segments, the open segment and each other causally; their K/V are appended to the
    open segment. Every row of the open segment holds the same number of tokens; :meth:`close` says how
    many of them are real.
    """

    def __init__(self, num_layers: int, rows: int):
        self.num_layers, self.rows = num_layers, rows
        self.closed: list[tuple[_Segment, torch.Tensor]] = []  # (segment, row_index [rows])
        self.open_keys: list[torch.Tensor | None] = [None] * num_layers
        self.open_values: list[torch.Tensor | None] = [None] * num_layers

    def attention(self, layer, q, k, v, scale):
        n = q.shape[1]
        if self.open_keys[layer] is not None:
            k, v = torch.cat([self.open_keys[layer], k], 1), torch.cat([self.open_values[layer], v], 1)
        self.open_keys[layer], self.open_values[layer] = k, v
        keys, values, masks = [], [], []
        for segment, row_index in self.closed:
            keys.append(segment.keys[layer][row_index])
            values.append(segment.values[layer][row_index])
            columns = torch.arange(keys[-1].shape[1], device=q.device)
            real = columns[None, :] < segment.lengths.to(q.device)[row_index][:, None]  # [B, L]
            masks.append(real[:, None, :].expand(-1, n, -1))
        opened = k.shape[1]  # open tokens, the n new ones last: new token i sees keys 0 .. opened - n + i
        causal_part = torch.ones(n, opened, dtype=torch.bool, device=q.device).tril(opened - n)
        masks.append(causal_part[None].expand(q.shape[0], -1, -1))
        keys.append(k)
        values.append(v)
        return _masked_attention(q, torch.cat(keys, 1), torch.cat(values, 1), torch.cat(masks, 2), scale)

    def close(self, lengths: torch.Tensor) -> None:
        """The open segment becomes a closed one whose row b holds ``lengths[b]`` real tokens."""
        if self.open_keys[0] is not None:
            segment = _Segment(keys=self.open_keys, values=self.open_values, lengths=lengths.clone())
            self.closed.append((segment, torch.arange(self.rows)))
        self.open_keys, self.open_values = [None] * self.num_layers, [None] * self.num_layers

    def fork(self, ways: int) -> None:
        """Every row becomes ``ways`` consecutive rows pointing at the same closed rows (none may be open)."""
        if self.open_keys[0] is not None:
            raise RuntimeError("close the open segment before forking")
        self.closed = [(seg, rows.repeat_interleave(ways)) for seg, rows in self.closed]
        self.rows *= ways


def _masked_attention(q, k, v, mask, scale):
    """Softmax attention of ``q [B, n, Hq, D]`` over ``k, v [B, S, Hkv, D]`` where ``mask [B, n, S]``."""
    group = q.shape[2] // k.shape[2]
    if group > 1:
        k, v = (x.repeat_interleave(group, dim=2) for x in (k, v))
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=scale)
    return out.transpose(1, 2)


# ---------------------------------------------------------------------------------------------- one step
def _nucleus(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(probs, token ids)`` sorted by probability, cut to the smallest set whose mass reaches top_p."""
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
    if top_p < 1.0:
        before = sorted_probs.cumsum(-1) - sorted_probs  # mass of the more likely tokens
        sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)
    return sorted_probs / sorted_probs.sum(-1, keepdim=True), order


def next_tokens(logits: torch.Tensor, temperature: float, top_p: float, generator):
    """``(tokens [B], logprobs [B])`` from ``logits [B, V]``: greedy at temperature 0, else drawn from
    ``softmax(logits / temperature)`` cut to the top-p nucleus with one uniform per row; the log-probs are
    the model's own (module docstring)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    logp = torch.log_softmax(logits, dim=-1)
    if temperature == 0:
        tokens = logits.argmax(dim=-1)
    else:
        probs, order = _nucleus(torch.softmax(logits / temperature, dim=-1), top_p)
        device = generator.device if generator is not None else "cpu"
        u = torch.rand(logits.shape[0], 1, generator=generator, device=device, dtype=torch.float64)
        cdf = probs.to(torch.float64).cumsum(-1)
        pick = (cdf < u.to(cdf.device)).sum(-1).clamp(max=probs.shape[-1] - 1)
        pick = torch.minimum(pick, (probs > 0).sum(-1) - 1)  # rounding never lands outside the nucleus
        tokens = order.gather(-1, pick[:, None])[:, 0]
    return tokens, logp.gather(-1, tokens[:, None])[:, 0]


def _padded(rows: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids [B, L], lengths [B])`` of right-padded rows (padding id 0)."""
    lengths = torch.tensor([len(r) for r in rows])
    ids = torch.zeros(len(rows), int(lengths.max()), dtype=torch.int64)
    for b, r in enumerate(rows):
        ids[b, : len(r)] = torch.tensor(r, dtype=torch.int64)
    return ids.to(device), lengths


def _last_logits(adapter, features: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Logits ``[B, V]`` at each row's last real position."""
    rows = features[torch.arange(features.shape[0]), lengths.to(features.device) - 1]
    return adapter.head(rows)


# ---------------------------------------------------------------------------------------------- decoding
class _Decoder:
    """The rollouts being decoded (python lists, one per row), their next-token logits, and the cache."""

    def __init__(self, adapter, prompts: list[list[int]], num_samples: int, use_cache: bool):
        self.adapter, self.use_cache, self.device = adapter, use_cache, adapter.device
        self.prompt_index = [j for j in range(len(prompts)) for _ in range(num_samples)]
        self.tokens = [list(prompts[j]) for j in self.prompt_index]
        self.generated: list[list[bool]] = [[] for _ in self.tokens]
        self.logprobs: list[list[float]] = [[] for _ in self.tokens]
        self.cache = SharedPrefixCache(adapter.num_layers, len(prompts))
        self._logits = None
        if use_cache:  # each prompt once, as one right-padded batch
            ids, lengths = _padded(prompts, self.device)
            positions = torch.arange(ids.shape[1], device=self.device).expand_as(ids)
            features = adapter.hidden(ids, positions, self.cache.attention)
            self.cache.close(lengths)
            self.cache.fork(num_samples)
            self._logits = _last_logits(adapter, features, lengths).repeat_interleave(num_samples, dim=0)

    def logits(self) -> torch.Tensor:
        """Next-token logits ``[B, V]`` of every row."""
        if self.use_cache:
            return self._logits
        ids, lengths = _padded(self.tokens, self.device)
        positions = torch.arange(ids.shape[1], device=self.device).expand_as(ids)
        return _last_logits(self.adapter, self.adapter.hidden(ids, positions, _causal), lengths)

    def feed(self, new: list[list[int]]) -> None:
        """Append each row's new tokens (possibly none) and run them through the cache, right-padded (an
        empty row feeds a padding token and keeps its logits)."""
        starts = torch.tensor([len(t) for t in self.tokens])
        for t, r in zip(self.tokens, new, strict=True):
            t.extend(r)
        if not self.use_cache:
            return
        ids, lengths = _padded([r if r else [0] for r in new], self.device)
        positions = starts.to(self.device)[:, None] + torch.arange(ids.shape[1], device=self.device)
        features = self.adapter.hidden(ids, positions, self.cache.attention)
        logits = _last_logits(self.adapter, features, lengths)
        fed = torch.tensor([bool(r) for r in new], device=logits.device)[:, None]
        self._logits = torch.where(fed, logits, self._logits)

    def close(self, lengths: torch.Tensor) -> None:
        """End the open segment; row b's first ``lengths[b]`` tokens in it are real."""
        if self.use_cache:
            self.cache.close(lengths)

    def fork(self, ways: int) -> None:
        """Copy every row ``ways`` times (consecutive rows), sharing the closed segments."""
        if self.use_cache:
            self.cache.fork(ways)
            self._logits = self._logits.repeat_interleave(ways, dim=0)
        self.prompt_index = [j for j in self.prompt_index for _ in range(ways)]
        for name in ("tokens", "generated", "logprobs"):
            setattr(self, name, [list(r) for r in getattr(self, name) for _ in range(ways)])


def _causal(layer, q, k, v, scale):
    return causal(q, k, v, scale)


def _decode_turn(decoder: _Decoder, max_new_tokens: int, finished: list[bool], eos, settings):
    """Sample one turn (at most ``max_new_tokens`` steps) for every row not ``finished``; a row that samples
    ``eos`` ends its turn. Returns ``(added [B], ended [B])``: the tokens each row sampled, whether it
    sampled ``eos``."""
    done = list(finished)
    ended = [False] * len(done)
    added = torch.zeros(len(done), dtype=torch.int64)
    for _ in range(max_new_tokens):
        if all(done):
            break
        tokens, logps = next_tokens(decoder.logits(), *settings)
        new = []
        for b, (tok, lp) in enumerate(zip(tokens.tolist(), logps.tolist(), strict=True)):
            if done[b]:
                new.append([])
                continue
            new.append([tok])
            decoder.generated[b].append(True)
            decoder.logprobs[b].append(lp)
            added[b] += 1
            ended[b] = done[b] = eos is not None and tok == eos
        decoder.feed(new)
    return added, ended


# ---------------------------------------------------------------------------------------------- checks
def _check_prompts(prompts, vocab_size: int) -> list[list[int]]:
    if isinstance(prompts, (torch.Tensor, str, bytes)) or not isinstance(prompts, Sequence):
        raise TypeError("prompts must be a list of token-id lists (or of 1-D integer tensors)")
    if not prompts:
        raise ValueError("prompts is empty: give at least one prompt")
    out = [rollout_token_ids(p, i) for i, p in enumerate(prompts)]
    for i, p in enumerate(out):
        if max(p) >= vocab_size:
            raise ValueError(f"prompt {i} holds the token id {max(p)}; the model's vocabulary: {vocab_size}")
    return out


def _check_forks(forks) -> tuple[int, ...]:
    if isinstance(forks, (str, bytes)) or not isinstance(forks, Sequence):
        raise TypeError(f"forks must be a sequence of ints (ways per boundary), got {type(forks).__name__}")
    return tuple(check_int(f"forks[{i}]", k) for i, k in enumerate(forks))


# ---------------------------------------------------------------------------------------------- entry point
def sample(
    model,
    prompts,
    *,
    num_samples: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    eos_token_id: int | None = None,
    generator: torch.Generator | None = None,
    forks: Sequence[int] = (),
    environment: Environment | None = None,
    use_cache: bool = True,
) -> SampleBatch:
    """Sample ``num_samples`` rollouts of each prompt (module docstring) and return them as a trie.

    ``model``: a :class:`treeattn_lab.reference.TinyLM` or a Hugging Face causal LM, run as it is (without
    autograd). ``prompts``: token-id lists. ``max_new_tokens``: per turn. ``temperature`` >= 0 (0: greedy),
    ``top_p`` in (0, 1]. ``forks``: ways to fork at each turn boundary. ``environment``: the reply appended
    after each turn but the last. ``use_cache=False``: recompute every rollout at every step.
    """
    adapter = adapt(model)
    prompts = _check_prompts(prompts, adapter.vocab_size)
    num_samples = check_int("num_samples", num_samples)
    max_new_tokens = check_int("max_new_tokens", max_new_tokens)
    temperature = check_in_range("temperature", temperature, 0.0, math.inf)
    top_p = check_in_range("top_p", top_p, 0.0, 1.0, open_low=True)
    check_int("eos_token_id", eos_token_id, minimum=0, allow_none=True)
    if eos_token_id is not None and eos_token_id >= adapter.vocab_size:
        raise ValueError(f"eos_token_id {eos_token_id} is outside the vocabulary ({adapter.vocab_size})")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    forks = _check_forks(forks)
    if environment is not None and not callable(environment):
        raise TypeError(f"environment must be a callable (prompt index, tokens) -> ids: {environment!r:.40}")
    if not isinstance(use_cache, bool):
        raise TypeError(f"use_cache must be a bool, got {type(use_cache).__name__}")
    settings = (temperature, top_p, generator)
    with torch.no_grad(), adapter.session(_longest(prompts, max_new_tokens, forks, environment)):
        decoder = _Decoder(adapter, prompts, num_samples, use_cache)
        _run_turns(decoder, max_new_tokens, forks, environment, eos_token_id, settings)
    dtype = torch.promote_types(adapter.dtype, torch.float32)
    return _batch(decoder, prompts, num_samples * math.prod(forks), dtype)


def _longest(prompts, max_new_tokens: int, forks, environment) -> int | None:
    """The longest rollout possible, for the adapter's length check (None when observations are unbounded)."""
    if environment is not None and forks:
        return None
    return max(len(p) for p in prompts) + max_new_tokens * (len(forks) + 1)


def _run_turns(decoder: _Decoder, max_new_tokens: int, forks, environment, eos, settings) -> None:
    """Every turn, then at each boundary: close the turn's segment, fork, append the observations."""
    finished = [False] * len(decoder.tokens)
    for ways in (*forks, None):
        added, ended = _decode_turn(decoder, max_new_tokens, finished, eos, settings)
        if ways is None:
            return
        decoder.close(added)
        if environment is None:  # one answer in segments: an eos ends the rollout
            finished = [f or e for f, e in zip(finished, ended, strict=True)]
        else:
            observed = [
                _observation(environment, j, t, decoder.adapter.vocab_size)
                for j, t in zip(decoder.prompt_index, decoder.tokens, strict=True)
            ]
        decoder.fork(ways)
        finished = [f for f in finished for _ in range(ways)]
        if environment is not None:
            new = [o for o in observed for _ in range(ways)]
            for b, o in enumerate(new):
                decoder.generated[b].extend([False] * len(o))
                decoder.logprobs[b].extend([0.0] * len(o))
            decoder.feed(new)
            decoder.close(torch.tensor([len(o) for o in new]))


def _observation(environment, prompt_index: int, tokens: list[int], vocab_size: int) -> list[int]:
    """The environment's reply to one rollout, checked: token ids inside the vocabulary (possibly none)."""
    reply = token_ids(environment(prompt_index, list(tokens)), f"the observation for prompt {prompt_index}")
    if reply and max(reply) >= vocab_size:
        raise ValueError(f"the environment returned the token id {max(reply)}; vocabulary {vocab_size}")
    return reply


def _batch(decoder: _Decoder, prompts, group_size: int, dtype: torch.dtype) -> SampleBatch:
    prompt_lengths = [len(prompts[j]) for j in decoder.prompt_index]
    completions = [t[p:] for t, p in zip(decoder.tokens, prompt_lengths, strict=True)]
    return SampleBatch(
        trie=RolloutTrie.from_sequences(decoder.tokens),
        prompt_lengths=prompt_lengths,
        prompt_index=list(decoder.prompt_index),
        completions=completions,
        generated=[torch.tensor(g, dtype=torch.bool) for g in decoder.generated],
        logprobs=[torch.tensor(lp, dtype=dtype) for lp in decoder.logprobs],
        group_size=group_size,
    )


__all__ = ["SampleBatch", "SharedPrefixCache", "next_tokens", "sample"]
