"""A passkey retrieval probe built into corpus text: find a few random digits hidden at some depth.

A sample is ``seq_len + 1`` byte tokens: corpus text with a *needle* sentence inserted, and a question
whose answer ends the sample (``#`` stands for :data:`KEY_MARK`)::

    <text ...> The pass key is #48213. Remember it. #48213 is the pass key. <... text>
    What is the pass key? #48213

The key is always written right after :data:`KEY_MARK`, a byte the corpus never holds, so in a sample the
mark occurs only before a copy of the key. That makes the task one a small byte model can learn: at the
question's mark, find the earlier marks and copy the digit after them, then the digit after that (an
induction head: a previous-token head in one layer, a matching head in the next). Without the mark the
last bytes before the answer (``"is "``) occur all over the text and nothing points at the needle. The
needle's second copy of the key gives the next-byte loss the same copy to learn at short range.

The needle starts at ``round(depth * room)``, ``room`` being the text bytes around it, so depth 0 puts it
first and depth 1 right before the question. The answer's digits are the sample's last ``digits``
tokens; a model that reads them back must attend from the end of the sample to the needle.

Scoring (:func:`passkey_scores`) uses greedy predictions under teacher forcing: every digit is the
model's argmax given the digits before it, so all digits right is exactly greedy decoding's exact match.
"""

from __future__ import annotations

import torch

from ..checks import check_int

# ASCII record separator: absent from the corpus (the test suite checks both splits)
KEY_MARK = "\x1e"


def needle_text(key: str) -> str:
    return f" The pass key is {KEY_MARK}{key}. Remember it. {KEY_MARK}{key} is the pass key. "


def question_text(key: str) -> str:
    return f"\nWhat is the pass key? {KEY_MARK}{key}"


def passkey_overhead(digits: int) -> int:
    """Bytes the needle and the question of a ``digits``-digit key take: a sample must be longer."""
    key = "0" * check_int("digits", digits)
    return len(needle_text(key).encode()) + len(question_text(key).encode())


def random_key(digits: int, generator: torch.Generator) -> str:
    return "".join(str(int(d)) for d in torch.randint(0, 10, (digits,), generator=generator))


def _text_bytes(text: str) -> torch.Tensor:
    return torch.tensor(list(text.encode()), dtype=torch.int64)


def passkey_sample(filler: torch.Tensor, key: str, depth: float) -> tuple[torch.Tensor, int]:
    """``(tokens [len(filler)], needle_start)``: ``filler``'s bytes with the needle for ``key`` inserted at
    ``depth`` in [0, 1] and the question (ending in ``key``) at the end; the filler's tail is dropped to
    keep the length."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must lie in [0, 1], got {depth}")
    needle, question = _text_bytes(needle_text(key)), _text_bytes(question_text(key))
    room = filler.numel() - needle.numel() - question.numel()
    if room < 0:
        raise ValueError(f"a sample of {filler.numel()} tokens cannot hold the needle and the question "
                         f"({needle.numel() + question.numel()} tokens)")
    start = round(depth * room)
    text = filler[:room].cpu()
    tokens = torch.cat([text[:start], needle, text[start:], question])
    return tokens.to(filler.device), start


def _window(tokens: torch.Tensor, length: int, generator: torch.Generator) -> torch.Tensor:
    start = int(torch.randint(0, tokens.numel() - length + 1, (1,), generator=generator))
    return tokens[start:start + length]


def passkey_batch(tokens: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator, *,
                  share: float, digits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A training batch ``(inputs, targets, answer [B, seq_len] bool)``: random corpus windows, each turned
    into a passkey sample at a random depth with probability ``share``; ``answer`` marks the target
    positions of the answer's digits. Every draw comes from ``generator``: one seed, one batch."""
    check_int("batch_size", batch_size)
    check_int("digits", digits)
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"share must lie in [0, 1], got {share}")
    rows, answer = [], torch.zeros(batch_size, seq_len, dtype=torch.bool)
    for b in range(batch_size):
        window = _window(tokens, seq_len + 1, generator).cpu()
        if float(torch.rand((), generator=generator)) < share:
            depth = float(torch.rand((), generator=generator))
            window, _ = passkey_sample(window, random_key(digits, generator), depth)
            answer[b, seq_len - digits:] = True
        rows.append(window)
    batch = torch.stack(rows).to(tokens.device)
    return batch[:, :-1], batch[:, 1:], answer.to(tokens.device)


def probe_set(tokens: torch.Tensor, depths, per_depth: int, seq_len: int, digits: int, seed: int
              ) -> dict[float, torch.Tensor]:
    """Per depth, ``[per_depth, seq_len + 1]`` passkey samples on windows of ``tokens`` (the validation
    split), the same for every model evaluated with the same ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for depth in depths:
        samples = [passkey_sample(_window(tokens, seq_len + 1, generator).cpu(),
                                  random_key(digits, generator), depth)[0] for _ in range(per_depth)]
        out[float(depth)] = torch.stack(samples).to(tokens.device)
    return out


@torch.no_grad()
def passkey_scores(logits: torch.Tensor, samples: torch.Tensor, digits: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sample ``(exact [B] bool, digit_accuracy [B] float)`` from ``logits [B, seq_len, V]`` of
    ``samples[:, :-1]``: the last ``digits`` predictions against the answer's digits."""
    predicted = logits[:, -digits:].argmax(-1)
    correct = predicted == samples[:, -digits:]
    return correct.all(-1), correct.float().mean(-1)
