"""Cost model: predict each mode's time and peak memory for a micro-batch, and pick the best mode.

Each mode's time for one micro-batch is a non-negative linear function of what it computes,

    time(mode) = theta_mode . [1, tokens, attention pairs, model calls]

- flat: padded tokens of the padded batches, their causal pairs, one model call per padded batch;
- packed: tree tokens, tree pairs (each token sees its position + 1 keys); its one model call *is* the
  micro-batch, so that column stays 0 and the constant alone carries the per-micro-batch cost;
- dfs: tree tokens + recomputed tokens (blocks with children run twice), their pairs, model calls (pushes,
  pops, groups of sibling leaves).

Peak memory is ``m0 + m1 * held tokens + m2 * path tokens`` (flat holds one padded chunk, packed the
whole micro-batch, dfs one block plus the K/V of the longest path).

**Calibration** (:func:`calibrate`, about a minute, cached on disk) times every mode on synthetic tries
on the current device and fits the coefficients by non-negative least squares (NNLS). The tries are built
at the scale the engine runs (:func:`calibration_tries`): their tree tokens reach the token budget, their
rollouts are as long as RL rollouts (1/64 to 1/4 of the budget: 512 to 8K tokens at a 32K budget), their
sharing runs from a 5% to an 85% common prefix, with one and two levels of forks. Scale matters because a
model call costs about the *larger* of its host time (Python and kernel launches: ~0.1 s for the forward
and backward of a 24-layer model, whatever the batch) and its device time (~6 x parameters FLOPs per
token, ~14 x heads x head dim x layers FLOPs per attended pair), not their sum. A few thousand tokens
make a host-bound call whose time hardly grows with its tokens, and a linear fit there finds a large
constant and a near-zero slope. (The first calibration of this engine measured tries of at most 16K
tokens on an H200 and fitted 2.4e-7 s per token, over 10 PFLOP/s for a 0.49B model: 32K-token
micro-batches then ran 2-4x slower than predicted. They run at ~1.3e-5 s per token.)

**Fallback.** NNLS runs with the token and pair slopes held at or above their FLOPs at
:data:`MAX_PLAUSIBLE_FLOPS` (no device computes faster; :func:`model_work` counts the model's FLOPs), and
is kept only where the measurements identify it: more tries than features and a condition number of the
column-normalized features of at most :data:`COND_LIMIT`. Otherwise (a calibration cut short by its time
limit, tries too alike) the time is fitted on physics, ``c + s * FLOPs + c_call * calls``, three
coefficients with the architecture fixing what a pair costs against a token; where even that is not
identified (too few tries), as ``s * FLOPs`` alone.

**Refinement** (:meth:`CostModel.refine`): measured times of real micro-batches rescale each mode's
coefficients (least squares), which corrects what the synthetic tries miss (the distributed trainer
probes the real rollouts this way before it plans).

Without calibration a prior applies, read off one H200 run of ``bench train`` in relative units: a token
costs 1 unit, an attended pair 5e-4 units under flash attention and 1.5 times that under tree-shaped
attention. So a trie that shares little falls back to flat, where padding is small and flash attention is
fastest.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import numbers
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..trie import RolloutTrie

MODES = ("flat", "packed", "dfs")
TIME_FEATURES = ("micro_batch", "tokens", "attention_pairs", "model_calls")

COND_LIMIT = 1e3  # largest condition number of the column-normalized features at which NNLS is trusted
MAX_PLAUSIBLE_FLOPS = 2.5e15  # FLOP/s: above the dense bf16 rate of any accelerator today (B200: 2.25e15)
TOKEN_FLOPS_PER_WEIGHT = 6  # a trained token: 2 FLOPs per matmul weight forward, 4 backward
PAIR_FLOPS_PER_CHANNEL = 14  # an attended pair, per query head channel and layer: 4 forward (QK^T, PV),
# 10 backward with the scores recomputed (flash attention)
DEFAULT_PAIR_TOKEN_RATIO = 1.2e-4  # pair / token FLOPs of the 0.49B bench model, for unknown architectures
CALIBRATION_VERSION = 2  # part of the cache key: calibrations of older designs are not reused


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
            return [1.0, self.tree_tokens, self.tree_pairs, 0.0]  # its one model call is the constant
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


# ------------------------------------------------------------------------------------------- physics
def _first_attr(obj, *names):
    for name in names:
        value = getattr(obj, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def model_work(model: nn.Module) -> dict:
    """FLOPs of one trained token and of one attended pair (forward + backward) for ``model``.

    A token costs :data:`TOKEN_FLOPS_PER_WEIGHT` FLOPs per matmul weight (every parameter of two or more
    dimensions outside embedding lookups; a tied output head counts once, as the matmul it is). A pair
    costs :data:`PAIR_FLOPS_PER_CHANNEL` x query heads x head dim x layers, read off the model's config
    (TinyLM's ``cfg`` or a Hugging Face ``config``); where it is missing, :data:`DEFAULT_PAIR_TOKEN_RATIO`
    of a token. ``known`` says whether the token FLOPs come from the model (the plausibility check of the
    fit needs them).
    """
    weights = 0
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            continue
        weights += sum(p.numel() for p in module.parameters(recurse=False) if p.dim() >= 2)
    per_token = float(TOKEN_FLOPS_PER_WEIGHT * weights) if weights else 1.0
    cfg = getattr(model, "cfg", None) or getattr(model, "config", None)
    layers = _first_attr(cfg, "n_layers", "num_hidden_layers")
    heads = _first_attr(cfg, "n_heads", "num_attention_heads")
    width = _first_attr(cfg, "dim", "hidden_size")
    head_dim = _first_attr(cfg, "head_dim") or (width // heads if width and heads else None)
    if layers and heads and head_dim:
        per_pair = float(PAIR_FLOPS_PER_CHANNEL * heads * head_dim * layers)
    else:
        per_pair = per_token * DEFAULT_PAIR_TOKEN_RATIO
    return {"flops_per_token": per_token, "flops_per_pair": per_pair, "known": bool(weights)}


def _condition(A: torch.Tensor) -> float:
    """2-norm condition number of ``A`` (inf when it has fewer rows than columns or is rank deficient)."""
    if A.shape[0] < A.shape[1]:
        return math.inf
    sv = torch.linalg.svdvals(A)
    return float(sv[0] / sv[-1]) if float(sv[-1]) > 0 else math.inf


def _nnls_normalized(
    A: torch.Tensor, b: torch.Tensor, floor: torch.Tensor | None = None
) -> tuple[torch.Tensor | None, float]:
    """NNLS ``x >= floor`` over the non-zero columns of ``A`` in column-normalized units (conditioning),
    and the condition number of those units; ``None`` where the rows cannot identify the columns."""
    floor = torch.zeros(A.shape[1], dtype=torch.float64) if floor is None else floor
    cols = A.abs().amax(0) > 0
    scale = A[:, cols].abs().amax(0)
    An = A[:, cols] / scale
    cond = _condition(An)
    if A.shape[0] <= int(cols.sum()) or cond > COND_LIMIT:
        return None, cond
    x = floor.clone()
    x[cols] += nnls(An, b - A @ floor) / scale  # x = floor + x', x' >= 0
    return x, cond


def fit_time(A, b, work: dict | None = None) -> tuple[list[float], dict]:
    """One mode's time coefficients from features ``A [n, 4]`` (:data:`TIME_FEATURES`) and seconds ``b``.

    NNLS where the measurements identify the four coefficients, else the physical fallbacks of the module
    docstring. For a known model (``work`` from :func:`model_work`) the token and pair slopes are held at
    or above their FLOPs at :data:`MAX_PLAUSIBLE_FLOPS`: no device computes them faster. Returns the
    coefficients and how they were found: ``method`` (``"nnls"``, ``"physical"`` or ``"proportional"``),
    the condition number of the NNLS features, the relative RMS residual on the measurements and, for a
    known model, the throughput the per-token slope implies (``tflops``).
    """
    A = torch.as_tensor(A, dtype=torch.float64)
    b = torch.as_tensor(b, dtype=torch.float64)
    if A.dim() != 2 or A.shape[1] != len(TIME_FEATURES) or b.shape != (A.shape[0],) or A.shape[0] == 0:
        shape = tuple(A.shape) + tuple(b.shape)
        raise ValueError(f"need features [n >= 1, {len(TIME_FEATURES)}] and n times, got shapes {shape}")
    if not (torch.isfinite(A).all() and torch.isfinite(b).all()) or (A < 0).any() or (b <= 0).any():
        raise ValueError("features must be finite and >= 0, times finite and > 0")
    known = bool(work and work.get("known"))
    per_token = work["flops_per_token"] if work else 1.0
    per_pair = work["flops_per_pair"] if work else DEFAULT_PAIR_TOKEN_RATIO
    fastest = 1.0 / MAX_PLAUSIBLE_FLOPS if known else 0.0  # seconds per FLOP, at the very least
    floor = torch.tensor([0.0, per_token * fastest, per_pair * fastest, 0.0], dtype=torch.float64)
    x, cond = _nnls_normalized(A, b, floor)
    method = "nnls"
    if x is None:  # physics: c + s * FLOPs + c_call * calls, s >= fastest
        flops = per_token * A[:, 1] + per_pair * A[:, 2]
        physical = torch.stack([torch.ones_like(flops), flops, A[:, 3]], 1)
        y, _ = _nnls_normalized(physical, b, torch.tensor([0.0, fastest, 0.0], dtype=torch.float64))
        if y is not None and float(y[1]) > 0:
            x = torch.stack([y[0], y[1] * per_token, y[1] * per_pair, y[2]])
            method = "physical"
        else:  # time proportional to FLOPs: defined from a single measurement on
            s = float(flops @ b) / float(flops @ flops)
            x = torch.tensor([0.0, s * per_token, s * per_pair, 0.0], dtype=torch.float64)
            method = "proportional"
    residual = float(((A @ x - b) / b).square().mean().sqrt())
    info = {"method": method, "condition": cond, "rel_rms_residual": residual, "shapes": int(A.shape[0])}
    if known and float(x[1]) > 0:
        info["tflops"] = per_token / float(x[1]) / 1e12
    return x.tolist(), info


@dataclass
class CostModel:
    """Per-mode linear predictors of time (seconds) and peak memory (bytes; relative under the prior).

    ``fit_info``: per mode, how :meth:`fit` found its time coefficients (see :func:`fit_time`), and the
    model's FLOPs (``"work"``); ``refinement``: what :meth:`refine` changed, None if never refined.
    """

    time: dict = field(default_factory=lambda: _prior()["time"])
    memory: dict = field(default_factory=lambda: _prior()["memory"])
    calibrated: bool = False
    samples: int = 0
    device: str = "any"
    fit_info: dict = field(default_factory=dict)
    refinement: dict | None = None

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
    def fit(cls, samples: list[dict], *, device: str = "any", work: dict | None = None) -> CostModel:
        """Fit from ``samples``: dicts with ``mode``, ``time_features``, ``memory_features``, ``time_s``,
        ``peak_bytes`` (None where unknown). ``work``: the model's FLOPs (:func:`model_work`) for the
        plausibility check and the physical fallback. Modes without samples keep the prior."""
        model = cls(device=device, calibrated=True, samples=len(samples))
        if work is not None:
            model.fit_info["work"] = dict(work)
        for mode in MODES:
            rows = [s for s in samples if s["mode"] == mode]
            if not rows:
                continue
            A = torch.tensor([r["time_features"] for r in rows], dtype=torch.float64)
            b = torch.tensor([r["time_s"] for r in rows], dtype=torch.float64)
            model.time[mode], model.fit_info[mode] = fit_time(A, b, work)
            mem = [r for r in rows if r.get("peak_bytes") is not None]
            if len(mem) >= 2:
                A = torch.tensor([r["memory_features"] for r in mem], dtype=torch.float64)
                scale = A.abs().amax(0).clamp_min(1.0)
                b = torch.tensor([float(r["peak_bytes"]) for r in mem], dtype=torch.float64)
                model.memory[mode] = (nnls(A / scale, b) / scale).tolist()
        return model

    def refine(self, observations) -> CostModel:
        """A copy whose time coefficients are rescaled per mode to match measured times.

        ``observations``: ``(parts, seconds)`` pairs; ``parts`` lists the ``(MicroBatchShape, mode)`` of
        the micro-batches one timed call ran (one micro-batch, or a rank's whole share), ``seconds`` is
        its measured time. With ``P[o, m]`` this model's prediction for observation o's parts in mode m,
        the scales ``s >= 0`` minimize ``sum_o (sum_m s_m P[o, m] - seconds_o)^2``:

        - per mode (NNLS) where the observations identify every mode they ran (more observations than
          such modes, condition number at most :data:`COND_LIMIT`);
        - else one pooled scale for every mode, ``s = sum_o p_o y_o / sum_o p_o^2`` with
          ``p_o = sum_m P[o, m]``.

        Modes no observation ran take the pooled scale. A mode's four coefficients scale together, so its
        calibrated shape stays and its level moves. ``refinement`` records the scales and the relative
        errors on the observations before and after (after is in-sample: the fit saw those times).
        """
        if isinstance(observations, (str, bytes)) or not hasattr(observations, "__len__") or not observations:
            raise ValueError("observations must be a non-empty list of (parts, seconds) pairs")
        P, y = [], []
        for i, obs in enumerate(observations):
            try:
                parts, seconds = obs
            except (TypeError, ValueError):
                raise ValueError(f"observation {i} must be a (parts, seconds) pair") from None
            real = isinstance(seconds, numbers.Real) and not isinstance(seconds, bool)
            if not real or not math.isfinite(seconds) or not seconds > 0:
                raise ValueError(f"observation {i}: seconds must be a finite number > 0, got {seconds!r}")
            if not parts:
                raise ValueError(f"observation {i} has no parts (micro-batches)")
            row = dict.fromkeys(MODES, 0.0)
            for shape, mode in parts:
                if not isinstance(shape, MicroBatchShape):
                    raise TypeError(
                        f"observation {i}: parts must hold MicroBatchShape, got {type(shape).__name__}"
                    )
                if mode not in MODES:
                    raise ValueError(f"observation {i}: unknown mode {mode!r}; choose one of {MODES}")
                row[mode] += self.predict(shape, mode)[0]
            if not sum(row.values()) > 0:
                raise ValueError(f"observation {i}: the model predicts 0 s for it; nothing to rescale")
            P.append([row[m] for m in MODES])
            y.append(float(seconds))
        P = torch.tensor(P, dtype=torch.float64)
        y = torch.tensor(y, dtype=torch.float64)
        p = P.sum(1)
        pooled = float(p @ y) / float(p @ p)
        scales = dict.fromkeys(MODES, pooled)
        per_mode, _ = _nnls_normalized(P, y)
        method = "pooled"
        ran = [j for j, m in enumerate(MODES) if float(P[:, j].abs().max()) > 0]
        if per_mode is not None and all(float(per_mode[j]) > 0 for j in ran):
            scales.update({MODES[j]: float(per_mode[j]) for j in ran})
            method = "per_mode"
        fitted = P @ torch.tensor([scales[m] for m in MODES], dtype=torch.float64)
        refined = copy.deepcopy(self)
        refined.time = {m: [c * scales[m] for c in self.time[m]] for m in MODES}
        refined.refinement = {
            "method": method,
            "scales": scales,
            "observations": len(y),
            "modes_observed": [MODES[j] for j in ran],
            "median_abs_error_before": float(((p - y) / y).abs().median()),
            "median_abs_error_after": float(((fitted - y) / y).abs().median()),
            "previous": self.refinement,
        }
        return refined

    def to_dict(self) -> dict:
        return {
            "time": self.time,
            "memory": self.memory,
            "calibrated": self.calibrated,
            "samples": self.samples,
            "device": self.device,
            "fit_info": self.fit_info,
            "refinement": self.refinement,
        }

    @classmethod
    def from_dict(cls, data: dict) -> CostModel:
        """The model of :meth:`to_dict` (also of older files, without ``fit_info`` and ``refinement``)."""
        model = cls(**{k: data[k] for k in ("time", "memory", "calibrated", "samples", "device")})
        model.fit_info = dict(data.get("fit_info") or {})
        model.refinement = data.get("refinement")
        return model


# ------------------------------------------------------------------------------------ calibration
def _device_label(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def _scale(token_budget: int | None, scale_tokens: int | None) -> int:
    """Tree tokens of the largest calibration trie: ``scale_tokens``, else the budget, else 4096; never
    above the budget (each trie must be one micro-batch)."""
    scale = int(scale_tokens or token_budget or 4096)
    return min(scale, token_budget) if token_budget else scale


def cache_path(
    model, block_tokens: int, token_budget: int | None = None, scale_tokens: int | None = None
) -> Path:
    """Where a calibration is cached: per model architecture (class, parameter shapes and dtype), device,
    engine settings, calibration design version and torch version."""
    first = next(model.parameters())
    shapes = ";".join(f"{n}:{tuple(p.shape)}" for n, p in model.named_parameters())
    arch = hashlib.sha256(f"{type(model).__name__}|{shapes}".encode()).hexdigest()[:16]
    key = f"{type(model).__name__}-{arch}-{first.dtype}-{_device_label(first.device)}"
    key += f"-block{block_tokens}-budget{token_budget}-scale{_scale(token_budget, scale_tokens)}"
    key += f"-v{CALIBRATION_VERSION}-torch{torch.__version__}"
    safe = "".join(c if c.isalnum() or c in "-._" else "_" for c in key)
    root = Path(os.environ.get("TREEATTN_CACHE", Path.home() / ".cache" / "treeattn_lab"))
    return root / "cost_models" / f"{safe}.json"


def branching_trie(
    rng: random.Random, vocab: int, prompts: int, prompt_len: int, levels: list[tuple[int, int]]
) -> RolloutTrie:
    """``prompts`` random prompts of ``prompt_len`` tokens, each forking ``levels`` deep: at level j every
    node gets ``fanout_j`` children of ``uniform(0.5, 1) x segment_j`` random tokens. The leaves are the
    rollouts (``prod(fanouts)`` per prompt)."""
    seqs = []

    def grow(prefix: list[int], depth: int) -> None:
        if depth == len(levels):
            seqs.append(prefix)
            return
        fanout, segment = levels[depth]
        for _ in range(fanout):
            n = max(1, int(segment * rng.uniform(0.5, 1.0)))
            grow(prefix + [rng.randrange(vocab) for _ in range(n)], depth + 1)

    for _ in range(prompts):
        grow([rng.randrange(vocab) for _ in range(prompt_len)], 0)
    return RolloutTrie.from_sequences(seqs)


def synthetic_trie(
    rng: random.Random, vocab: int, prompts: int, samples: int, prompt_len: int, response_len: int
) -> RolloutTrie:
    """``prompts`` prompts each sampled ``samples`` times: a GRPO-shaped trie of random tokens."""
    return branching_trie(rng, vocab, prompts, prompt_len, [(samples, response_len)])


# (name, tree tokens / scale, rollout length / scale, shared prompt / rollout length, fan-out per level),
# measured in this order: the first tries fill the budget and differ most, so a calibration cut short by
# its time limit still spans tokens, pairs per token and model calls
CALIBRATION_DESIGN = (
    ("grpo", 1.0, 1 / 32, 0.3, (8,)),
    ("agentic", 1.0, 1 / 4, 0.6, (2, 3)),
    ("small-grpo", 0.3, 1 / 32, 0.3, (8,)),
    ("low-sharing", 0.95, 1 / 16, 0.05, (2,)),
    ("tree-search", 0.9, 1 / 16, 0.4, (4, 4)),
    ("short", 0.5, 1 / 64, 0.5, (16,)),
    ("high-sharing", 0.6, 1 / 8, 0.85, (8,)),
    ("long", 0.4, 1 / 4, 0.1, (2,)),
    ("multi-turn", 0.8, 1 / 4, 0.4, (2, 2, 2)),
)


def _expected_tree_tokens(prompt_len: int, levels: list[tuple[int, int]]) -> float:
    total, nodes = float(prompt_len), 1
    for fanout, segment in levels:
        nodes *= fanout
        total += nodes * 0.75 * segment  # segments are uniform(0.5, 1) x segment long
    return total


def calibration_tries(
    scale_tokens: int,
    *,
    vocab: int,
    seed: int = 0,
    max_length: int | None = None,
    design=CALIBRATION_DESIGN,
) -> list[tuple[str, RolloutTrie]]:
    """The synthetic tries :func:`calibrate` measures, in order: one per row of ``design``, with at most
    ``scale_tokens`` tree tokens each (one micro-batch under a budget of ``scale_tokens``) and rollouts
    of at most ``max_length`` tokens."""
    rng = random.Random(seed)
    out = []
    for name, fill, length_frac, shared, fanouts in design:
        length = max(2, int(scale_tokens * length_frac))
        if max_length is not None:
            length = max(2, min(length, max_length))
        prompt_len = max(1, int(length * shared))
        segment = max(1, (length - prompt_len) // len(fanouts))
        levels = [(f, segment) for f in fanouts]
        prompts = max(1, round(fill * scale_tokens / _expected_tree_tokens(prompt_len, levels)))
        while True:
            trie = branching_trie(rng, vocab, prompts, prompt_len, levels)
            if sum(len(n.tokens) for n in trie.nodes) <= scale_tokens:
                break
            forked = [j for j, (f, _) in enumerate(levels) if f > 1]
            if prompts > 1:  # shrink until one micro-batch: fewer prompts, then fewer forks, then shorter
                prompts -= 1
            elif forked:  # the deepest level that still forks
                levels[forked[-1]] = (levels[forked[-1]][0] - 1, levels[forked[-1]][1])
            elif prompt_len > 1 or any(s > 1 for _, s in levels):
                prompt_len = max(1, prompt_len // 2)
                levels = [(f, max(1, s // 2)) for f, s in levels]
            else:  # one chain of single tokens: nothing left to shrink
                raise ValueError(f"scale_tokens={scale_tokens} is too small for calibration trie {name!r}")
        out.append((name, trie))
    return out


def _longest_allowed(model, longest: int) -> int:
    """The longest rollout (at most ``longest``) the engine accepts for ``model`` (sliding windows)."""
    from .adapters import adapt

    adapter = adapt(model)
    while longest > 2:
        try:
            adapter.check_length(longest)
            return longest
        except ValueError:
            longest //= 2
    return longest


def calibrate(
    model,
    *,
    block_tokens: int = 2048,
    token_budget: int | None = None,
    seconds: float = 60.0,
    scale_tokens: int | None = None,
    seed: int = 0,
    use_cache: bool = True,
    progress: bool = True,
    repeats: int = 2,
) -> CostModel:
    """Time every mode on :func:`calibration_tries` on the model's device and fit (module docstring).

    ``scale_tokens``: tree tokens of the largest synthetic trie (default and at most ``token_budget``,
    else 4096): calibrate at the size the engine will run. Every mode first runs once on the smallest
    trie, not fitted (kernel compilation, library start-up). Then the tries are measured in order; none
    starts after ``seconds`` (counted from the warm-up on), but at least one is measured. Flat and packed
    keep the fastest of ``repeats`` runs (a new size can still compile a kernel variant), dfs (several
    times slower) runs once. Existing ``.grad`` of the model's parameters are saved and restored. The
    result is cached per model signature, device and settings.
    """
    from .tree_backward import tree_backward

    scale = _scale(token_budget, scale_tokens)
    path = cache_path(model, block_tokens, token_budget, scale)
    if use_cache and path.exists():
        return CostModel.from_dict(json.loads(path.read_text()))
    vocab = model.cfg.vocab_size if hasattr(model, "cfg") else model.config.vocab_size  # TinyLM or HF
    tries = calibration_tries(scale, vocab=vocab, seed=seed, max_length=_longest_allowed(model, scale))

    def run(trie, mode) -> tuple[float, int | None]:
        report = tree_backward(
            model, trie, None, mode=mode, block_tokens=block_tokens, token_budget=token_budget
        ).report
        return report.time_s, report.peak_memory_bytes

    saved = {p: (None if p.grad is None else p.grad.clone()) for p in model.parameters()}
    samples_out = []
    iterator = tries
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(tries, desc="calibrating cost model", leave=False)
    try:
        start = time.perf_counter()
        smallest = min((t for _, t in tries), key=lambda t: sum(len(n.tokens) for n in t.nodes))
        for mode in MODES:  # warm-up, not fitted
            run(smallest, mode)
        for _, trie in iterator:
            if samples_out and time.perf_counter() - start > seconds:
                break
            shape = MicroBatchShape.of(trie, block_tokens, token_budget)
            for mode in MODES:
                runs = [run(trie, mode) for _ in range(1 if mode == "dfs" else max(1, repeats))]
                best_t = min(t for t, _ in runs)
                samples_out.append(
                    {
                        "mode": mode,
                        "time_features": shape.time_features(mode),
                        "memory_features": shape.memory_features(mode),
                        "time_s": best_t,
                        "peak_bytes": runs[-1][1],
                    }
                )
    finally:
        for p, g in saved.items():
            p.grad = g
    fitted = CostModel.fit(
        samples_out, device=_device_label(next(model.parameters()).device), work=model_work(model)
    )
    if use_cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(fitted.to_dict(), indent=1))
    return fitted
