"""Cost model: predict each mode's time and peak memory for a micro-batch, and pick the best mode.

Each mode's time for one micro-batch is a non-negative linear function of what it computes,

    time(mode) = theta_mode . [1, tokens, attention pairs, model calls]

- flat: padded tokens of the padded batches, their causal pairs, one model call per padded batch;
- packed: tree tokens, tree pairs (each token sees its position + 1 keys); its one model call *is* the
  micro-batch, so that column stays 0 and the constant alone carries the per-micro-batch cost;
- dfs: tree tokens + recomputed tokens (blocks with children run twice: the spine above the packed
  subtrees), their pairs, model calls (pushes, pops, packed spans of sibling leaves and subtrees).

Peak memory is ``m0 + m1 * held tokens + m2 * path tokens`` (flat holds one padded chunk, packed the
whole micro-batch, dfs its largest call with autograd plus the K/V of the longest path).

**Fitting** (:meth:`CostModel.fit`, on the measurements of
:func:`treeattn_lab.engine.calibration.calibrate`). A model call costs about the *larger* of its host time
(Python and kernel launches, nearly independent of its tokens) and its device time (about
:data:`TOKEN_FLOPS_PER_WEIGHT` x weights FLOPs per token and :data:`PAIR_FLOPS_PER_CHANNEL` x heads x head
dim x layers per attended pair), not their sum. On micro-batches small enough to be host-bound a free
linear fit finds a large constant and a near-zero token slope, which predicts that tokens cost nothing. So
NNLS runs with the token and pair slopes held at or above their FLOPs at :data:`MAX_PLAUSIBLE_FLOPS` (no
device computes faster; :func:`model_work` counts the model's FLOPs), and is kept only where the
measurements identify it: more measurements than features and a condition number of the
column-normalized features of at most :data:`~treeattn_lab.engine.nnls.COND_LIMIT`. Otherwise (tries too
few or too alike) the time is fitted on physics, ``c + s * FLOPs + c_call * calls``, three coefficients
with the architecture fixing what a pair costs against a token; where even that is not identified, as
``s * FLOPs`` alone.

**Refinement** (:meth:`CostModel.refine`): measured times of real micro-batches rescale each mode's
coefficients (least squares), which corrects what the synthetic calibration tries miss.

**Prior.** Without calibration, times are in relative units: a token costs 1 unit, an attended pair
:data:`PRIOR_PAIR_COST` units under flash attention and :data:`PRIOR_TREE_PAIR_FACTOR` times that under
tree-shaped attention (ratios read off
``bench/results/train__NVIDIA-H200__torch-2.11.0-cu130__triton-3.6.0.json``). So a trie that shares
little falls back to flat, where padding is small and flash attention is fastest.
"""

from __future__ import annotations

import copy
import math
import numbers
from dataclasses import dataclass, field

import torch
from torch import nn

from ..checks import check_int
from ..trie import RolloutTrie
from .dfs import PUSH_BLOCKS, walk
from .modes import MODES, flat_chunks
from .nnls import nnls, nnls_normalized

TIME_FEATURES = ("micro_batch", "tokens", "attention_pairs", "model_calls")
MEMORY_FEATURES = 3  # constant, held tokens, path tokens (see MicroBatchShape.memory_features)

MAX_PLAUSIBLE_FLOPS = 2.5e15  # FLOP/s: above the dense bf16 rate of any accelerator today (B200: 2.25e15)
TOKEN_FLOPS_PER_WEIGHT = 6  # a trained token: 2 FLOPs per matmul weight forward, 4 backward
PAIR_FLOPS_PER_CHANNEL = 14  # an attended pair, per query head channel and layer: 4 forward (QK^T, PV),
# 10 backward with the scores recomputed (flash attention)
DEFAULT_PAIR_TOKEN_RATIO = 1.2e-4  # pair / token FLOPs of the 0.49B bench model, for unknown architectures


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
    dfs_calls: int  # DFS: model calls (pushes, pops, packed spans of sibling leaves and subtrees)
    max_block: int  # DFS: tokens of its largest call with autograd
    max_length: int

    @classmethod
    def of(cls, trie: RolloutTrie, block_tokens: int, token_budget: int | None = None) -> MicroBatchShape:
        """Read the shape off the same plans the modes execute (padded batches, DFS blocks and events)."""
        lengths = trie.seq_lengths
        padded = [(len(c), lengths[c[0]]) for c in flat_chunks(lengths, token_budget)]  # (rows, longest)
        pack = trie.pack()
        _, events = walk(pack, block_tokens, packed_subtrees=True, push_blocks=PUSH_BLOCKS)
        pushed = [b for e, b in events if e == "push"]
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
            max_block=max(b.end - b.start for e, b in events if e != "push"),
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


PRIOR_PAIR_COST = 5e-4  # one attended pair costs this many tokens' worth of dense layers (0.49B model)
PRIOR_TREE_PAIR_FACTOR = 1.5  # cost of a pair under tree-shaped attention, relative to flash attention


def _prior() -> dict:
    pair = {m: PRIOR_PAIR_COST * (1.0 if m == "flat" else PRIOR_TREE_PAIR_FACTOR) for m in MODES}
    return {
        "time": {m: [0.0, 1e-6, 1e-6 * pair[m], 0.0] for m in MODES},
        "memory": {m: [0.0, 1.0, 0.05] for m in MODES},
        "calibrated": False,
        "samples": 0,
    }


def _coefficient_table(name: str, table, width: int) -> dict[str, list[float]]:
    """A copy of ``table`` (mode -> ``width`` coefficients) as floats, refusing anything but one finite,
    non-negative real number per coefficient for exactly the modes of :data:`MODES`."""
    if not isinstance(table, dict):
        raise TypeError(f"{name} must be a dict of mode -> coefficients, got {type(table).__name__}")
    missing = [m for m in MODES if m not in table]
    unknown = [m for m in table if m not in MODES]
    if missing or unknown:
        raise ValueError(
            f"{name} must give every mode of {MODES} and no other: missing {missing}, unknown modes {unknown}"
        )
    out = {}
    for mode in MODES:
        coefs = table[mode]
        if isinstance(coefs, (str, bytes, dict)) or not hasattr(coefs, "__len__") or len(coefs) != width:
            raise ValueError(f"{name}[{mode!r}] must hold {width} coefficients, got {coefs!r}")
        for j, c in enumerate(coefs):
            if isinstance(c, bool) or not isinstance(c, numbers.Real):
                raise TypeError(f"{name}[{mode!r}][{j}] is {c!r}; coefficients must be real numbers")
            if not (math.isfinite(c) and c >= 0):
                raise ValueError(f"{name}[{mode!r}][{j}] is {c!r}; coefficients must be finite and >= 0")
        out[mode] = [float(c) for c in coefs]
    return out


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


def fit_time(A, b, work: dict | None = None) -> tuple[list[float], dict]:
    """One mode's time coefficients from features ``A [n, 4]`` (:data:`TIME_FEATURES`) and seconds ``b``.

    NNLS where the measurements identify the four coefficients, else the physical fallbacks of the module
    docstring. Where every measurement made the same number of model calls, the constant carries them
    (the model-calls coefficient is 0). For a known model (``work`` from :func:`model_work`) the token
    and pair slopes are held at or above their FLOPs at :data:`MAX_PLAUSIBLE_FLOPS`: no device computes
    them faster. Returns the
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
    if bool((A[:, 3] == A[0, 3]).all()):  # the same model calls in every measurement (flat without a
        # budget runs one call): no fit can tell them from the constant, which carries them
        A = torch.cat([A[:, :3], torch.zeros_like(A[:, 3:])], 1)
    known = bool(work and work.get("known"))
    per_token = work["flops_per_token"] if work else 1.0
    per_pair = work["flops_per_pair"] if work else DEFAULT_PAIR_TOKEN_RATIO
    fastest = 1.0 / MAX_PLAUSIBLE_FLOPS if known else 0.0  # seconds per FLOP, at the very least
    floor = torch.tensor([0.0, per_token * fastest, per_pair * fastest, 0.0], dtype=torch.float64)
    x, cond = nnls_normalized(A, b, floor)
    method = "nnls"
    if x is None:  # physics: c + s * FLOPs + c_call * calls, s >= fastest
        flops = per_token * A[:, 1] + per_pair * A[:, 2]
        physical = torch.stack([torch.ones_like(flops), flops, A[:, 3]], 1)
        y, _ = nnls_normalized(physical, b, torch.tensor([0.0, fastest, 0.0], dtype=torch.float64))
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

    ``time[mode]``: the :data:`TIME_FEATURES` coefficients of every mode, ``memory[mode]``: its three memory
    coefficients; all finite and >= 0 (checked, and copied, on construction). ``calibrated``: every mode's
    time was identified by measurements (:meth:`fit`). ``fit_info``: per mode, how :meth:`fit` found its
    time coefficients (see :func:`fit_time`) and whether its memory was measured (``"memory"``: ``"nnls"``
    or ``"prior"``), the model's FLOPs (``"work"``) and, after :func:`~treeattn_lab.engine.calibrate`, what
    it measured (``"calibration"``); ``refinement``: what :meth:`refine` changed, None if never refined.
    """

    time: dict = field(default_factory=lambda: _prior()["time"])
    memory: dict = field(default_factory=lambda: _prior()["memory"])
    calibrated: bool = False
    samples: int = 0
    device: str = "any"
    fit_info: dict = field(default_factory=dict)
    refinement: dict | None = None

    def __post_init__(self):
        self.time = _coefficient_table("time", self.time, len(TIME_FEATURES))
        self.memory = _coefficient_table("memory", self.memory, MEMORY_FEATURES)
        if not isinstance(self.calibrated, bool):
            raise TypeError(f"calibrated must be a bool, got {type(self.calibrated).__name__}")
        check_int("samples", self.samples, minimum=0)
        if not isinstance(self.device, str):
            raise TypeError(f"device must be a str, got {type(self.device).__name__}")
        if not isinstance(self.fit_info, dict) or not isinstance(self.refinement, (dict, type(None))):
            raise TypeError("fit_info must be a dict and refinement a dict or None")
        self.fit_info = copy.deepcopy(self.fit_info)
        self.refinement = copy.deepcopy(self.refinement)

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
        """The fastest of ``modes`` whose predicted peak fits ``memory_limit``; and every prediction.

        A ``memory_limit`` needs a calibrated model whose peak memory was measured for every mode of
        ``modes`` (a calibration on a CPU measures none).
        """
        if memory_limit is not None and not self.calibrated:
            raise ValueError("memory_limit needs a calibrated cost model (see calibrate())")
        unmeasured = [m for m in modes if self.fit_info.get(m, {}).get("memory") == "prior"]
        if memory_limit is not None and unmeasured:
            raise ValueError(
                f"memory_limit needs measured peak memory, but the memory was not measured for {unmeasured} "
                f"(calibrated on {self.device}, which reports no peak memory)"
            )
        predictions = {m: self.predict(shape, m) for m in modes}
        fitting = [m for m in modes if memory_limit is None or predictions[m][1] <= memory_limit]
        pool = fitting or [min(modes, key=lambda m: predictions[m][1])]  # the leanest when none fits
        return min(pool, key=lambda m: predictions[m][0]), predictions

    # --------------------------------------------------------------------- fitting and storage
    @classmethod
    def fit(cls, samples: list[dict], *, device: str = "any", work: dict | None = None) -> CostModel:
        """Fit from ``samples``: dicts with ``mode``, ``time_features``, ``memory_features``, ``time_s``,
        ``peak_bytes`` (None where unknown). ``work``: the model's FLOPs (:func:`model_work`) for the
        plausibility check and the physical fallback. Modes without samples keep the prior.

        The result is ``calibrated`` only where every mode's time was identified (``"nnls"`` or
        ``"physical"``); memory is fitted where at least two samples of the mode report peak bytes.
        """
        model = cls(device=device, samples=len(samples))
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
            model.fit_info[mode]["memory"] = "nnls" if len(mem) >= 2 else "prior"
            if len(mem) >= 2:
                A = torch.tensor([r["memory_features"] for r in mem], dtype=torch.float64)
                scale = A.abs().amax(0).clamp_min(1.0)
                b = torch.tensor([float(r["peak_bytes"]) for r in mem], dtype=torch.float64)
                model.memory[mode] = (nnls(A / scale, b) / scale).tolist()
        identified = ("nnls", "physical")
        model.calibrated = all(model.fit_info.get(m, {}).get("method") in identified for m in MODES)
        return model

    def refine(self, observations) -> CostModel:
        """A copy whose time coefficients are rescaled per mode to match measured times.

        ``observations``: ``(parts, seconds)`` pairs; ``parts`` lists the ``(MicroBatchShape, mode)`` of
        the micro-batches one timed call ran (one micro-batch, or a rank's whole share), ``seconds`` is
        its measured time. With ``P[o, m]`` this model's prediction for observation o's parts in mode m,
        the scales ``s >= 0`` minimize ``sum_o (sum_m s_m P[o, m] - seconds_o)^2``:

        - per mode (NNLS) where the observations identify every mode they ran (more observations than
          such modes, condition number at most :data:`~treeattn_lab.engine.nnls.COND_LIMIT`);
        - else one pooled scale for every mode, ``s = sum_o p_o y_o / sum_o p_o^2`` with
          ``p_o = sum_m P[o, m]``.

        Modes no observation ran take the pooled scale. A mode's four coefficients scale together, so its
        calibrated shape stays and its level moves. ``refinement`` records the scales and the relative
        errors on the observations before and after (after is in-sample: the fit saw those times).
        """
        if isinstance(observations, (str, bytes)) or not hasattr(observations, "__len__") or not observations:
            raise ValueError("observations must be a non-empty list of (parts, seconds) pairs")
        P, y = self._observed(observations)
        p = P.sum(1)
        pooled = float(p @ y) / float(p @ p)
        scales = dict.fromkeys(MODES, pooled)
        per_mode, _ = nnls_normalized(P, y)
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

    def _observed(self, observations) -> tuple[torch.Tensor, torch.Tensor]:
        """``(P [n, modes], y [n])`` of :meth:`refine`: this model's predicted seconds of each observation's
        parts per mode, and the measured seconds; every observation checked."""
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
        return torch.tensor(P, dtype=torch.float64), torch.tensor(y, dtype=torch.float64)

    def to_dict(self) -> dict:
        """A JSON-ready copy (nothing in it aliases the model)."""
        return copy.deepcopy(
            {
                "time": self.time,
                "memory": self.memory,
                "calibrated": self.calibrated,
                "samples": self.samples,
                "device": self.device,
                "fit_info": self.fit_info,
                "refinement": self.refinement,
            }
        )

    @classmethod
    def from_dict(cls, data: dict) -> CostModel:
        """The model of :meth:`to_dict` (also of older files, without ``fit_info`` and ``refinement``),
        checked as the constructor checks its arguments."""
        required = ("time", "memory", "calibrated", "samples", "device")
        missing = [k for k in required if not isinstance(data, dict) or k not in data]
        if missing:
            raise ValueError(f"not a saved CostModel: missing {missing}")
        return cls(
            **{k: data[k] for k in required},
            fit_info=data.get("fit_info") or {},
            refinement=data.get("refinement"),
        )
