"""The bundled text corpus as byte tokens, random training windows, and a small language-model trainer.

The corpus (``data/corpus/``, datasheet in ``data/README.md``) is a fixed selection of CPython 3.11
standard-library modules: real, structured text (code, comments, docstrings) that a tiny model learns
quickly and whose attention maps show real structure. Tokens are bytes (vocabulary 256), so there is no
tokenizer to ship; a TinyLM reads it with ``TinyLMConfig(vocab_size=VOCAB_SIZE)``.

```python
from treeattn_lab.corpus import VOCAB_SIZE, evaluate_loss, load_corpus, train_language_model
from treeattn_lab.reference import TinyLM, TinyLMConfig

model = TinyLM(TinyLMConfig(vocab_size=VOCAB_SIZE, dim=128, n_layers=2))
history = train_language_model(model, load_corpus("train"), steps=300, batch_size=16, seq_len=256,
                               lr=3e-3, seed=0)
evaluate_loss(model, load_corpus("validation"), seq_len=256)   # nats per byte
```

Any model called as ``model(input_ids [B, L], position_ids [B, L], attention) -> logits [B, L, V]`` trains
here (both TinyLM variants do); ``attention(q, k, v)`` receives ``[B, L, H, head_dim]`` tensors and
defaults to causal :func:`causal_sdpa`. Passing a list of attention callables trains with one optimizer
step per callable on every batch (the joint dense + sparse passes of RAT+).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from .checks import check_finite, check_int

CORPUS_DIR = Path(__file__).resolve().parents[1] / "data" / "corpus"
SPLITS = ("train", "validation")
VOCAB_SIZE = 256

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


# ---------------------------------------------------------------------------------------------- data
@functools.cache
def _corpus_bytes(split: str) -> bytes:
    path = CORPUS_DIR / f"{split}.txt"
    if not path.exists():
        raise FileNotFoundError(
            f"{path} is missing: the text corpus ships with the source repository (data/corpus/), "
            "not with the wheel; run from a checkout or an editable install"
        )
    return path.read_bytes()


def load_corpus(split: str = "train") -> torch.Tensor:
    """The ``split`` ("train" or "validation") of the corpus as a 1-D int64 tensor of bytes (0-255).

    The split is by module: the validation modules never appear in training. Returns a fresh tensor
    each call (about 2.1M train tokens, 135K validation tokens).
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    data = bytearray(_corpus_bytes(split))
    return torch.frombuffer(data, dtype=torch.uint8).to(torch.int64)


def decode(tokens: torch.Tensor | Sequence[int]) -> str:
    """Byte tokens back to text (invalid UTF-8, e.g. a window cut inside a character, is replaced)."""
    values = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
    return bytes(values).decode("utf-8", errors="replace")


def _check_windows(tokens: torch.Tensor, batch_size: int, seq_len: int) -> None:
    token_dtypes = (torch.int32, torch.int64)
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1 or tokens.dtype not in token_dtypes:
        raise TypeError("tokens must be a 1-D int64 (or int32) tensor of token ids (from load_corpus)")
    check_int("batch_size", batch_size)
    check_int("seq_len", seq_len)
    if tokens.numel() < seq_len + 1:
        raise ValueError(f"need at least seq_len + 1 = {seq_len + 1} tokens, got {tokens.numel()}")


def batches(
    tokens: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator | None = None
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless random windows: yields ``(inputs, targets)``, both ``[batch_size, seq_len]`` int64.

    Each row is a window ``tokens[s : s + seq_len + 1]`` at a uniformly random start ``s``; targets are
    the inputs shifted by one token. Starts are drawn from ``generator`` (on the CPU), so a seeded
    generator gives the same batches on every machine. Batches live on ``tokens.device``.
    """
    _check_windows(tokens, batch_size, seq_len)
    offsets = torch.arange(seq_len + 1, device=tokens.device)
    while True:
        starts = torch.randint(0, tokens.numel() - seq_len, (batch_size,), generator=generator)
        windows = tokens[starts.to(tokens.device)[:, None] + offsets]
        yield windows[:, :-1], windows[:, 1:]


# ---------------------------------------------------------------------------------------------- model calls
def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention on ``q [..., L, Hq, D]``, ``k, v [..., L, Hkv, D]`` with torch's fused SDPA (GQA)."""
    group = q.shape[-2] // k.shape[-2]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=-2), v.repeat_interleave(group, dim=-2)
    out = F.scaled_dot_product_attention(
        q.transpose(-3, -2), k.transpose(-3, -2), v.transpose(-3, -2), is_causal=True
    )
    return out.transpose(-3, -2)


def _model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def language_model_loss(model, inputs: torch.Tensor, targets: torch.Tensor, attention: Attention):
    """Mean next-byte cross entropy (nats) of ``model`` on one batch, positions 0..L-1 in every row."""
    positions = torch.arange(inputs.shape[-1], device=inputs.device).expand_as(inputs)
    logits = model(inputs, positions, attention)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


@torch.no_grad()
def evaluate_loss(
    model,
    tokens: torch.Tensor,
    *,
    attention: Attention | None = None,
    seq_len: int = 256,
    batch_size: int = 16,
    max_windows: int | None = None,
) -> float:
    """Mean next-byte cross entropy (nats per byte) over consecutive non-overlapping windows of ``tokens``.

    Deterministic: windows start at 0, ``seq_len``, ``2 seq_len``, ... (the first ``max_windows`` of them
    when given). Divide by ``ln 2`` for bits per byte. The model is put in eval mode and restored.
    """
    attention = causal_sdpa if attention is None else attention
    _check_windows(tokens, batch_size, seq_len)
    check_int("max_windows", max_windows, allow_none=True)
    device = _model_device(model)
    n_windows = (tokens.numel() - 1) // seq_len
    if max_windows is not None:
        n_windows = min(n_windows, max_windows)
    starts = torch.arange(n_windows) * seq_len
    offsets = torch.arange(seq_len + 1)
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for i in range(0, n_windows, batch_size):
            windows = tokens[starts[i : i + batch_size, None] + offsets].to(device)
            loss = language_model_loss(model, windows[:, :-1], windows[:, 1:], attention)
            total += float(loss) * windows.shape[0]
            count += windows.shape[0]
    finally:
        model.train(was_training)
    return total / count


def lr_factor(step: int, steps: int, warmup_steps: int, final_lr_ratio: float) -> float:
    """Linear warmup, then cosine decay from 1 to ``final_lr_ratio``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, steps - warmup_steps)
    return final_lr_ratio + (1 - final_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def adamw(model, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW (betas 0.9, 0.95) decaying the matrices only: norms' gains and biases keep no decay."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def train_language_model(
    model,
    tokens: torch.Tensor,
    *,
    steps: int,
    batch_size: int = 16,
    seq_len: int = 256,
    lr: float = 3e-3,
    seed: int = 0,
    attention: Attention | Sequence[Attention] | None = None,
    weight_decay: float = 0.1,
    warmup_steps: int | None = None,
    final_lr_ratio: float = 0.1,
    grad_clip: float = 1.0,
    progress: bool = True,
    on_step: Callable[[int, float], None] | None = None,
) -> dict[str, list]:
    """Train ``model`` in place on random windows of ``tokens`` with AdamW; returns the loss history.

    - ``attention``: one callable (default :func:`causal_sdpa`) or a sequence of them. With a sequence,
      every batch is used once per callable, each pass with its own optimizer step (RAT+ trains with
      ``[dense, dilated D=64]``); optimizer steps = ``steps * len(attention)``.
    - Schedule: linear warmup over ``warmup_steps`` (default ``min(100, steps // 10)``; 0 for a short
      adaptation), then cosine decay to ``final_lr_ratio * lr``. Gradients clipped to ``grad_clip``.
    - ``seed`` fixes the batches (a CPU generator); the model's initial weights are the caller's.
    - ``on_step(step, loss)`` is called after every step (a live plot, early stopping by raising).

    Returns ``{"step": [...], "loss": [...], "pass_losses": [[...], ...]}``: the mean training loss of
    each step over its passes, and each pass's loss.
    """
    from .progress import progress_bar

    passes = [causal_sdpa] if attention is None else attention
    if callable(passes):
        passes = [passes]
    passes = list(passes)
    if not passes or not all(callable(a) for a in passes):
        raise TypeError("attention must be a callable or a non-empty sequence of callables")
    check_int("steps", steps)
    check_int("warmup_steps", warmup_steps, minimum=0, allow_none=True)
    for name, value in (("lr", lr), ("grad_clip", grad_clip)):
        check_finite(name, value, positive=True)
    for name, value in (("weight_decay", weight_decay), ("final_lr_ratio", final_lr_ratio)):
        check_finite(name, value, positive=False)
    if on_step is not None and not callable(on_step):
        raise TypeError(f"on_step must be callable or None, got {type(on_step).__name__}")
    device = _model_device(model)
    warmup_steps = min(100, steps // 10) if warmup_steps is None else warmup_steps
    optimizer = adamw(model, lr, weight_decay)
    data = batches(tokens, batch_size, seq_len, torch.Generator().manual_seed(seed))
    history: dict[str, list] = {"step": [], "loss": [], "pass_losses": []}
    model.train()
    bar = progress_bar(range(steps), disable=not progress, desc="train", leave=False)
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = lr * lr_factor(step, steps, warmup_steps, final_lr_ratio)
        inputs, targets = (x.to(device) for x in next(data))
        losses = []
        for attn in passes:
            loss = language_model_loss(model, inputs, targets, attn)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            optimizer.step()
            losses.append(float(loss.detach()))
        mean = sum(losses) / len(losses)
        history["step"].append(step)
        history["loss"].append(mean)
        history["pass_losses"].append(losses)
        if progress:
            bar.set_postfix(loss=f"{mean:.3f}", refresh=False)  # shown at the next redraw
        if on_step is not None:
            on_step(step, mean)
    return history
