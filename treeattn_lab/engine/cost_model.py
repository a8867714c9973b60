"""Cost model: predict each mode's time and peak memory for a micro-batch, and pick the best mode.

Each mode's time is a non-negative linear function of what it computes,

    time(mode) = theta_mode . [1, tokens, attention pairs, launches]

- flat: tokens = padded tokens of the padded batches, pairs = their causal pairs, launches = batches;
- packed: tree tokens, tree pairs (each token sees its position + 1 keys), one launch;
- dfs: tree tokens + recomputed tokens (blocks with children run twice), their pairs, model calls.

Peak memory is ``m0 + m1 * held tokens + m2 * path tokens`` (flat holds one padded chunk, packed the
whole micro-batch, dfs one block plus the K/V of the longest path).

The coefficients are fitted by non-negative least squares on measurements taken on the current device
(:func:`calibrate`, about a minute, cached on disk). Without calibration a prior applies, read off one
H200 run of ``bench train``: a token costs 1 unit, an attended pair 5e-4 units under flash attention and
1.5 times that under tree-shaped attention. So a trie that shares little falls back to flat, where
padding is small and flash attention is fastest.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..trie import RolloutTrie

MODES = ("flat", "packed", "dfs")
TIME_FEATURES = ("constant", "tokens", "attention_pairs", "launches")


def nnls(A: torch.Tensor, b: torch.Tensor, max_iter: int = 200) -> torch.Tensor:
    """Non-negative least squares, min ||A x - b|| with x >= 0 (Lawson-Hanson active set, float64)."""
    A, b = A.to(torch.float64), b.to(torch.float64)
    n = A.shape[1]
    x = torch.zeros(n, dtype=torch.float64)
    passive = torch.zeros(n, dtype=torch.bool)
    for _ in range(max_iter):
        w = A.T @ (b - A @ x)
        candidates = (~passive) & (w > 1e-12 * max(1.0, float(w.abs().max())))
        if not candidates.any():
            break
        passive[int(torch.where(candidates, w, torch.full_like(w, -math.inf)).argmax())] = True
        while True:
            z = torch.zeros(n, dtype=torch.float64)
            z[passive] = torch.linalg.lstsq(A[:, passive], b[:, None]).solution[:, 0]
            if (z[passive] > 0).all():
                x = z
                break
            mask = passive & (z <= 0)
            alpha = float((x[mask] / (x[mask] - z[mask])).min())
            x = x + alpha * (z - x)
            passive &= x > 1e-15
    return x


@dataclass(frozen=True)
class MicroBatchShape:
    """What the cost model reads of a micro-batch (computed once from its trie)."""

    flat_tokens: int
    padded_tokens: int  # flat mode: rows x longest, summed over its padded batches
    padded_pairs: int
    flat_batches: int
    tree_tokens: int
    tree_pairs: int
    recomputed_tokens: int  # DFS: tokens of blocks with children, run once more without grad
    recomputed_pairs: int
    dfs_calls: int  # DFS: model calls (pushes, pops, groups of sibling leaves)
    max_block: int
    max_length: int

    @classmethod
    def of(cls, trie: RolloutTrie, block_tokens: int, token_budget: int | None = None) -> MicroBatchShape:
        """Read the shape off the same plans the modes execute (padded batches, DFS blocks and events)."""
        from .dfs import group_sibling_leaves, split_blocks, visit_order
        from .modes import flat_chunks

        lengths = trie.seq_lengths
        padded = [(len(c), lengths[c[0]]) for c in flat_chunks(lengths, token_budget)]  # (rows, longest)
        pack = trie.pack()
        blocks = split_blocks(pack, block_tokens)
        events = group_sibling_leaves(visit_order(blocks), blocks, block_tokens)
        pushed = [blocks[g[0]] for e, g in events if e == "push"]
        return cls(
            flat_tokens=sum(lengths),
            padded_tokens=sum(rows * n for rows, n in padded),
            padded_pairs=sum(rows * n * (n + 1) // 2 for rows, n in padded),
            flat_batches=len(padded),
            tree_tokens=pack.num_tokens,
            tree_pairs=pack.attended_pairs(),
            recomputed_tokens=sum(b.end - b.start for b in pushed),
            recomputed_pairs=sum(_block_pairs(b) for b in pushed),
            dfs_calls=len(events),
            max_block=max(b.end - b.start for b in blocks),
            max_length=max(lengths),
        )

    def time_features(self, mode: str) -> list[float]:
        if mode == "flat":
            return [1.0, self.padded_tokens, self.padded_pairs, self.flat_batches]
        if mode == "packed":
            return [1.0, self.tree_tokens, self.tree_pairs, 1]
        if mode == "dfs":
            return [
                1.0,
                self.tree_tokens + self.recomputed_tokens,
                self.tree_pairs + self.recomputed_pairs,
                self.dfs_calls,
            ]
        raise ValueError(f"unknown mode {mode!r}; choose one of {MODES}")

    def memory_features(self, mode: str) -> list[float]:
        if mode == "flat":
            return [1.0, self.padded_tokens / self.flat_batches, 0.0]
        if mode == "packed":
            return [1.0, self.tree_tokens, 0.0]
        return [1.0, self.max_block, self.max_length]


def _block_pairs(block) -> int:
    """Keys seen by a block's queries: its prefix plus itself, causally."""
    n = block.end - block.start
    return n * block.position + n * (n + 1) // 2


PRIOR_PAIR_COST = 5e-4  # one attended pair costs this many tokens' worth of dense layers (0.49B model, H200)
PRIOR_TREE_PAIR_FACTOR = 1.5  # tree-shaped attention kernels run about 1.5x slower per pair than flash


def _prior() -> dict:
    pair = {m: PRIOR_PAIR_COST * (1.0 if m == "flat" else PRIOR_TREE_PAIR_FACTOR) for m in MODES}
    return {
        "time": {m: [0.0, 1e-6, 1e-6 * pair[m], 0.0] for m in MODES},
        "memory": {m: [0.0, 1.0, 0.05] for m in MODES},
        "calibrated": False,
        "samples": 0,
    }


@dataclass
class CostModel:
    """Per-mode linear predictors of time (seconds) and peak memory (bytes; relative under the prior)."""

    time: dict = field(default_factory=lambda: _prior()["time"])
    memory: dict = field(default_factory=lambda: _prior()["memory"])
    calibrated: bool = False
    samples: int = 0
    device: str = "any"

    def predict(self, shape: MicroBatchShape, mode: str):
        """``(seconds, bytes)`` predicted for running ``shape`` in ``mode``."""
        time_x = shape.time_features(mode)
        memory_x = shape.memory_features(mode)
        t = sum(a * f for a, f in zip(self.time[mode], time_x, strict=True))
        m = sum(a * f for a, f in zip(self.memory[mode], memory_x, strict=True))
        return t, m

    def choose(
        self, shape: MicroBatchShape, *, memory_limit: float | None = None, modes: tuple[str, ...] = MODES
    ) -> tuple[str, dict]:
        """The fastest of ``modes`` whose predicted peak fits ``memory_limit``; and every prediction."""
        if memory_limit is not None and not self.calibrated:
            raise ValueError("memory_limit needs a calibrated cost model (see calibrate())")
        predictions = {m: self.predict(shape, m) for m in modes}
        fitting = [m for m in modes if memory_limit is None or predictions[m][1] <= memory_limit]
        pool = fitting or [min(modes, key=lambda m: predictions[m][1])]  # the leanest when none fits
        return min(pool, key=lambda m: predictions[m][0]), predictions

    # --------------------------------------------------------------------- fitting and storage
    @classmethod
    def fit(cls, samples: list[dict], *, device: str = "any") -> CostModel:
        """Fit from ``samples``: dicts with ``mode``, ``time_features``, ``memory_features``, ``time_s``,
        ``peak_bytes`` (None where unknown). Modes without samples keep the prior."""
        model = cls(device=device, calibrated=True, samples=len(samples))
        for mode in MODES:
            rows = [s for s in samples if s["mode"] == mode]
            if len(rows) < 2:
                continue
            A = torch.tensor([r["time_features"] for r in rows], dtype=torch.float64)
            scale = A.abs().amax(0).clamp_min(1.0)  # conditioning: fit in normalized units
            b = torch.tensor([r["time_s"] for r in rows], dtype=torch.float64)
            model.time[mode] = (nnls(A / scale, b) / scale).tolist()
            mem = [r for r in rows if r.get("peak_bytes") is not None]
            if len(mem) >= 2:
                A = torch.tensor([r["memory_features"] for r in mem], dtype=torch.float64)
                scale = A.abs().amax(0).clamp_min(1.0)
                b = torch.tensor([float(r["peak_bytes"]) for r in mem], dtype=torch.float64)
                model.memory[mode] = (nnls(A / scale, b) / scale).tolist()
        return model

    def to_dict(self) -> dict:
        return {
            "time": self.time,
            "memory": self.memory,
            "calibrated": self.calibrated,
            "samples": self.samples,
            "device": self.device,
        }

    @classmethod
    def from_dict(cls, data: dict) -> CostModel:
        return cls(**{k: data[k] for k in ("time", "memory", "calibrated", "samples", "device")})


# ------------------------------------------------------------------------------------ calibration
def _device_label(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def cache_path(model, block_tokens: int, token_budget: int | None = None, scale_tokens: int = 4096) -> Path:
    """Where a calibration is cached: per model architecture (class, parameter shapes and dtype), device,
    engine settings and torch version."""
    first = next(model.parameters())
    shapes = ";".join(f"{n}:{tuple(p.shape)}" for n, p in model.named_parameters())
    arch = hashlib.sha256(f"{type(model).__name__}|{shapes}".encode()).hexdigest()[:16]
    key = f"{type(model).__name__}-{arch}-{first.dtype}-{_device_label(first.device)}"
    key += f"-block{block_tokens}-budget{token_budget}-scale{scale_tokens}-torch{torch.__version__}"
    safe = "".join(c if c.isalnum() or c in "-._" else "_" for c in key)
    root = Path(os.environ.get("TREEATTN_CACHE", Path.home() / ".cache" / "treeattn_lab"))
    return root / "cost_models" / f"{safe}.json"


def synthetic_trie(
    rng: random.Random, vocab: int, prompts: int, samples: int, prompt_len: int, response_len: int
) -> RolloutTrie:
    """``prompts`` prompts each sampled ``samples`` times: a GRPO-shaped trie of random tokens."""
    seqs = []
    for _ in range(prompts):
        prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
        for _ in range(samples):
            n = max(1, int(response_len * rng.uniform(0.5, 1.0)))
            seqs.append(prompt + [rng.randrange(vocab) for _ in range(n)])
    return RolloutTrie.from_sequences(seqs)


def calibrate(
    model,
    *,
    block_tokens: int = 2048,
    token_budget: int | None = None,
    seconds: float = 60.0,
    scale_tokens: int = 4096,
    seed: int = 0,
    use_cache: bool = True,
    progress: bool = True,
) -> CostModel:
    """Measure every mode on synthetic tries of varied sharing and size on the model's device, fit.

    ``scale_tokens`` sets the largest synthetic trie (about that many flat tokens). Existing ``.grad``
    of the model's parameters are saved and restored. The result is cached per model signature and device.
    """
    from .tree_backward import tree_backward

    path = cache_path(model, block_tokens, token_budget, scale_tokens)
    if use_cache and path.exists():
        return CostModel.from_dict(json.loads(path.read_text()))
    rng = random.Random(seed)
    vocab = (
        model.cfg.vocab_size if hasattr(model, "cfg") else model.config.vocab_size
    )  # TinyLM or Hugging Face
    shapes = []  # (prompts, samples, prompt_len, response_len): low to high sharing, small to large
    for frac in (0.25, 0.5, 1.0):
        total = max(64, int(scale_tokens * frac))
        for share in (0.05, 0.5, 0.85):
            samples = rng.choice([2, 4, 8])
            per_seq = max(8, total // samples)
            prompt_len = max(1, int(per_seq * share))
            shapes.append((1, samples, prompt_len, max(4, per_seq - prompt_len)))
    saved = {p: (None if p.grad is None else p.grad.clone()) for p in model.parameters()}
    samples_out, start = [], time.perf_counter()
    iterator = shapes
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(shapes, desc="calibrating cost model", leave=False)
    try:
        for prompts, n, plen, rlen in iterator:
            trie = synthetic_trie(rng, vocab, prompts, n, plen, rlen)
            shape = MicroBatchShape.of(trie, block_tokens, token_budget)
            for mode in MODES:
                best_t, best_m = math.inf, None
                for _ in range(2):  # the first run of a shape may include warm-up
                    result = tree_backward(
                        model, trie, None, mode=mode, block_tokens=block_tokens, token_budget=token_budget
                    )
                    best_t = min(best_t, result.report.time_s)
                    best_m = result.report.peak_memory_bytes
                samples_out.append(
                    {
                        "mode": mode,
                        "time_features": shape.time_features(mode),
                        "memory_features": shape.memory_features(mode),
                        "time_s": best_t,
                        "peak_bytes": best_m,
                    }
                )
            if time.perf_counter() - start > seconds:
                break
    finally:
        for p, g in saved.items():
            p.grad = g
    fitted = CostModel.fit(samples_out, device=_device_label(next(model.parameters()).device))
    if use_cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(fitted.to_dict(), indent=1))
    return fitted
