"""Cost model: predict each mode's time and peak memory for a micro-batch, and pick the best mode.

Each mode's time for one micro-batch is the larger of a host term and a device term, both non-negative
linear functions of what it computes (:mod:`treeattn_lab.engine.time_fit`):

    time(mode) = max(eta_mode . [1, model calls], theta_mode . [1, tokens, attention pairs, model calls])

- flat: padded tokens of the padded batches, their causal pairs, one model call per padded batch;
- packed: tree tokens, tree pairs (each token sees its position + 1 keys); its one model call *is* the
  micro-batch, so that column stays 0 and the constants alone carry the per-micro-batch cost;
- dfs: tree tokens + recomputed tokens (blocks with children run twice: the spine above the packed
  subtrees), their pairs, model calls (pushes, pops, packed spans of sibling leaves and subtrees). A
  recomputed token runs forward only, so it and its pairs count at their forward share of a trained one's
  FLOPs (:data:`~treeattn_lab.engine.time_fit.FORWARD_TOKEN_SHARE`, ``FORWARD_PAIR_SHARE``).

The host term is what the calls cost the host (Python, kernel launches) whatever their size: a micro-batch
below it is *host-bound* (:meth:`CostModel.host_bound`), and its device would finish sooner than its host.

A DFS walk mixes short calls, which wait on the host, with long ones, which keep the GPU busy while the
host issues the next, so where calibration measured every call's work its time is taken *per call*
(:meth:`CostModel.per_call_seconds`): ``sum over calls of max(host per call, c + device slopes . [tokens,
pairs])``. A call's tokens and pairs run the same kernels as a packed micro-batch's, so the device slopes
are packed's, and the fit finds the host's cost of a call and the device's constant per call
(:func:`~treeattn_lab.engine.time_fit.fit_per_call`). Walks whose blocks are large enough to run FA4
(:func:`~treeattn_lab.engine.block_attention.fa4_walk_rectangle`) cost a call differently from walks on
SDPA, so each side gets its own two costs (:attr:`CostModel.fa4_walks`).

Peak memory is ``m0 + m1 * held tokens + m2 * path tokens`` (flat holds one padded chunk, packed the
whole micro-batch, dfs its largest call with autograd plus the K/V of the longest path).

**Fitting** (:meth:`CostModel.fit`, on the measurements of
:func:`treeattn_lab.engine.calibration.calibrate`): per mode,
:func:`~treeattn_lab.engine.time_fit.fit_host_bound` (NNLS on each side of ``host = device``, the device
slopes held to what a device can do); dfs per call, as above, where packed's time was identified.

**Refinement** (:meth:`CostModel.refine`): measured times of real micro-batches rescale each mode's
coefficients (least squares), which corrects what the synthetic calibration tries miss.

**Prior.** Without calibration, times are in relative units and there is no host term: a token costs 1
unit, an attended pair :data:`PRIOR_PAIR_COST` units under flash attention and
:data:`PRIOR_TREE_PAIR_FACTOR` times that under tree-shaped attention (ratios read off
``bench/results/train__NVIDIA-H200__torch-2.11.0-cu130__triton-3.6.0.json``). So a trie that shares
little falls back to flat, where padding is small and flash attention is fastest.
"""

from __future__ import annotations

import copy
import math
import numbers
from dataclasses import dataclass, field

import torch

from ..checks import check_int
from .micro_batch_shape import MicroBatchShape
from .modes import MODES
from .nnls import nnls, nnls_normalized
from .time_fit import (
    HOST_FEATURES,
    PER_CALL_FIT,
    TIME_FEATURES,
    fit_host_bound,
    fit_per_call,
)

MEMORY_FEATURES = 3  # constant, held tokens, path tokens (see MicroBatchShape.memory_features)
TREE_MODES = ("packed", "dfs")  # the modes that run a micro-batch as its trie
IDENTIFIED_FITS = ("nnls", "physical", PER_CALL_FIT)  # time fits the measurements determine
# the time features' design, saved with a model: 2 counts a recomputed dfs token at its forward share
FEATURES_VERSION = 2
OLDER_FEATURES_FIT = "fitted to older features"  # the dfs method of a model saved before FEATURES_VERSION

PRIOR_PAIR_COST = 5e-4  # one attended pair costs this many tokens' worth of dense layers (0.49B model)
PRIOR_TREE_PAIR_FACTOR = 1.5  # cost of a pair under tree-shaped attention, relative to flash attention


def _prior() -> dict:
    pair = {m: PRIOR_PAIR_COST * (1.0 if m == "flat" else PRIOR_TREE_PAIR_FACTOR) for m in MODES}
    return {
        "time": {m: [0.0, 1e-6, 1e-6 * pair[m], 0.0] for m in MODES},
        "memory": {m: [0.0, 1.0, 0.05] for m in MODES},
        "host": {m: [0.0] * len(HOST_FEATURES) for m in MODES},
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
    return {mode: _coefficients(f"{name}[{mode!r}]", table[mode], width) for mode in MODES}


def _coefficients(name: str, coefs, width: int) -> list[float]:
    """``coefs`` as ``width`` floats, refusing anything but finite, non-negative real numbers."""
    if isinstance(coefs, (str, bytes, dict)) or not hasattr(coefs, "__len__") or len(coefs) != width:
        raise ValueError(f"{name} must hold {width} coefficients, got {coefs!r}")
    for j, c in enumerate(coefs):
        if isinstance(c, bool) or not isinstance(c, numbers.Real):
            raise TypeError(f"{name}[{j}] is {c!r}; coefficients must be real numbers")
        if not (math.isfinite(c) and c >= 0):
            raise ValueError(f"{name}[{j}] is {c!r}; coefficients must be finite and >= 0")
    return [float(c) for c in coefs]


@dataclass
class CostModel:
    """Per-mode predictors of time (seconds) and peak memory (bytes; relative under the prior).

    ``time[mode]``: the device term's :data:`TIME_FEATURES` coefficients of every mode, ``host[mode]``: its
    host term's :data:`HOST_FEATURES` coefficients (0: no host floor), ``memory[mode]``: its three memory
    coefficients; all finite and >= 0 (checked, and copied, on construction). ``calibrated``: every mode's
    time was identified by measurements (:meth:`fit`). ``fit_info``: per mode, how :meth:`fit` found its
    time coefficients (:func:`~treeattn_lab.engine.time_fit.fit_host_bound`) and whether its memory was
    measured (``"memory"``: ``"nnls"`` or ``"prior"``), the model's FLOPs (``"work"``) and, after
    :func:`~treeattn_lab.engine.calibrate`, what it measured (``"calibration"``); ``refinement``: what
    :meth:`refine` changed, None if never refined. ``fa4_walks``: None, or the dfs ``time`` and ``host``
    coefficients of walks whose mean block rectangle is at least ``rectangle`` (they run FA4; the others
    use ``time["dfs"]`` and ``host["dfs"]``).
    """

    time: dict = field(default_factory=lambda: _prior()["time"])
    memory: dict = field(default_factory=lambda: _prior()["memory"])
    calibrated: bool = False
    samples: int = 0
    device: str = "any"
    fit_info: dict = field(default_factory=dict)
    refinement: dict | None = None
    host: dict = field(default_factory=lambda: _prior()["host"])
    fa4_walks: dict | None = None

    def __post_init__(self):
        self.time = _coefficient_table("time", self.time, len(TIME_FEATURES))
        self.host = _coefficient_table("host", self.host, len(HOST_FEATURES))
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
        if self.fa4_walks is not None:
            walks = self.fa4_walks
            if not isinstance(walks, dict):
                raise TypeError(f"fa4_walks must be None or a dict, got {type(walks).__name__}")
            if set(walks) != {"rectangle", "time", "host"}:
                raise ValueError(f"fa4_walks must hold rectangle, time and host, got {sorted(walks)}")
            check_int("fa4_walks rectangle", walks["rectangle"], minimum=0)
            self.fa4_walks = {"rectangle": int(walks["rectangle"]),
                              "time": _coefficients("fa4_walks time", walks["time"], len(TIME_FEATURES)),
                              "host": _coefficients("fa4_walks host", walks["host"], len(HOST_FEATURES))}

    def identifies(self, mode: str) -> bool:
        """Whether ``mode``'s time is fitted to measurements that tell its parts apart (for dfs: its cost
        per model call apart from its cost per token): its fit's method is one of :data:`IDENTIFIED_FITS`,
        or, for a model built from coefficients without a record of its fits, the model is calibrated."""
        method = self.fit_info.get(mode, {}).get("method")
        return self.calibrated if method is None else method in IDENTIFIED_FITS

    def predict(self, shape: MicroBatchShape, mode: str):
        """``(seconds, bytes)`` predicted for running ``shape`` in ``mode``: seconds are the larger of the
        host and the device term, or for a dfs time fitted per call (:data:`PER_CALL_FIT`) the sum over
        its calls of each call's larger term (:meth:`per_call_seconds`)."""
        m = sum(a * f for a, f in zip(self.memory[mode], shape.memory_features(mode), strict=True))
        if self._per_call(mode):
            return max(self._walk_coefficients(shape)[1][0], self.per_call_seconds(shape)), m
        return max(self.time_terms(shape, mode)), m

    def _per_call(self, mode: str) -> bool:
        return mode == "dfs" and self.fit_info.get("dfs", {}).get("method") == PER_CALL_FIT

    def _walk_coefficients(self, shape: MicroBatchShape) -> tuple[list[float], list[float]]:
        """The dfs ``(time, host)`` coefficients of ``shape``'s walk: :attr:`fa4_walks`' where its blocks'
        mean rectangle makes the walk run FA4, else ``time["dfs"]`` and ``host["dfs"]``."""
        walks = self.fa4_walks
        if walks is not None and shape.dfs_walk_rectangle >= walks["rectangle"]:
            return walks["time"], walks["host"]
        return self.time["dfs"], self.host["dfs"]

    @staticmethod
    def _calls(shape: MicroBatchShape):
        if not shape.dfs_call_work:
            raise ValueError("a per-call dfs time needs the shape's dfs_call_work (MicroBatchShape.of)")
        return shape.dfs_call_work

    def per_call_seconds(self, shape: MicroBatchShape) -> float:
        """A DFS walk's seconds as the sum of its calls' times, each the larger of the host's cost of a
        call and the call's device time (the device term's constant once, then per call its cost per call,
        per token and per pair; a push's fixed costs at its forward share): a walk of short calls waits
        on the host, one of long calls on the GPU."""
        (c0, per_token, per_pair, per_call), (_, host_call) = self._walk_coefficients(shape)
        return c0 + sum(
            max(share * host_call, share * per_call + per_token * n + per_pair * p)
            for share, n, p in self._calls(shape)
        )

    def time_terms(self, shape: MicroBatchShape, mode: str) -> tuple[float, float]:
        """``(host, device)`` seconds of running ``shape`` in ``mode``: the time is the larger, except
        for a dfs time fitted per call, where they are the host's and the device's sums over the calls
        (each call's fixed costs at its share) and the time is :meth:`per_call_seconds`."""
        if self._per_call(mode):
            (c0, per_token, per_pair, per_call), (h0, host_call) = self._walk_coefficients(shape)
            shares = sum(share for share, _, _ in self._calls(shape))
            _, tokens, pairs, _ = shape.time_features(mode)
            return h0 + host_call * shares, c0 + per_call * shares + per_token * tokens + per_pair * pairs
        x = shape.time_features(mode)
        device = sum(a * f for a, f in zip(self.time[mode], x, strict=True))
        host = sum(a * f for a, f in zip(self.host[mode], (x[0], x[3]), strict=True))
        return host, device

    def host_bound(self, shape: MicroBatchShape, mode: str) -> bool:
        """Whether ``shape`` in ``mode`` is predicted to wait on the host (its host term is the larger)."""
        host, device = self.time_terms(shape, mode)
        return host > device

    def planning_seconds(self, mode: str, tokens: float, pairs: float) -> float:
        """Predicted seconds of a tree micro-batch of ``tokens`` tree tokens and ``pairs`` attended pairs
        in ``mode`` (one of :data:`TREE_MODES`): what :func:`~treeattn_lab.engine.plan_micro_batches`
        minimizes. The larger of the host floor (the host term's constant) and the device term's constant,
        per-token and per-pair terms; both terms' per-call coefficients are left out, since a DFS
        micro-batch's calls depend on the blocks it is cut into (a packed micro-batch's one call is
        its constant, so for packed this is :meth:`predict`'s time)."""
        if not isinstance(mode, str) or mode not in TREE_MODES:
            raise ValueError(f"planning_seconds needs one of the tree modes {TREE_MODES}, got mode {mode!r}")
        c0, per_token, per_pair, _ = self.time[mode]
        return max(self.host[mode][0], c0 + per_token * tokens + per_pair * pairs)

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
    def fit(cls, samples: list[dict], *, device: str = "any", work: dict | None = None,
            fa4_rectangle: int | None = None) -> CostModel:
        """Fit from ``samples``: dicts with ``mode``, ``time_features``, ``memory_features``, ``time_s``,
        ``peak_bytes`` (None where unknown) and, for dfs, optionally ``call_work`` and ``walk_rectangle``
        (its shape's ``dfs_call_work`` and ``dfs_walk_rectangle``: then dfs is fitted per call where
        packed's time was identified). ``work``: the model's FLOPs
        (:func:`~treeattn_lab.engine.time_fit.model_work`) for the plausibility check and the physical
        fallback. ``fa4_rectangle``: the mean block rectangle from which a walk runs FA4
        (:func:`~treeattn_lab.engine.block_attention.fa4_walk_rectangle`; None: no walk does). Where
        at least two samples (the per-call fit's two unknowns) fall on each side of it, each side is
        fitted per call on its own, the FA4 side into :attr:`fa4_walks`: the kernels differ in what a call
        costs the host and the device. Modes without samples keep the prior.

        The result is ``calibrated`` only where every mode's time was identified (a method of
        :data:`IDENTIFIED_FITS`); memory is fitted where at least two samples of the mode report peak bytes.
        """
        check_int("fa4_rectangle", fa4_rectangle, minimum=0, allow_none=True)
        model = cls(device=device, samples=len(samples))
        if work is not None:
            model.fit_info["work"] = dict(work)
        for mode in MODES:
            rows = [s for s in samples if s["mode"] == mode]
            if not rows:
                continue
            A = torch.tensor([r["time_features"] for r in rows], dtype=torch.float64)
            b = torch.tensor([r["time_s"] for r in rows], dtype=torch.float64)
            model.time[mode], model.host[mode], model.fit_info[mode] = fit_host_bound(A, b, work)
            if mode == "dfs" and model.identifies("packed") and all(r.get("call_work") for r in rows):
                model._fit_walks(rows, fa4_rectangle)
            mem = [r for r in rows if r.get("peak_bytes") is not None]
            model.fit_info[mode]["memory"] = "nnls" if len(mem) >= 2 else "prior"
            if len(mem) >= 2:
                A = torch.tensor([r["memory_features"] for r in mem], dtype=torch.float64)
                scale = A.abs().amax(0).clamp_min(1.0)
                b = torch.tensor([float(r["peak_bytes"]) for r in mem], dtype=torch.float64)
                model.memory[mode] = (nnls(A / scale, b) / scale).tolist()
        model.calibrated = all(model.fit_info.get(m, {}).get("method") in IDENTIFIED_FITS for m in MODES)
        return model

    def _fit_walks(self, rows: list[dict], fa4_rectangle: int | None) -> None:
        """dfs per call (:meth:`fit`): the walks below ``fa4_rectangle`` into ``time["dfs"]``, those at or
        above it into :attr:`fa4_walks`; all of them into ``time["dfs"]`` where a side has fewer than two."""
        free = self.fit_info["dfs"]["rel_rms_residual"]  # kept to compare the per-call fit with
        fa4 = [fa4_rectangle is not None and r.get("walk_rectangle", 0) >= fa4_rectangle for r in rows]
        sides = [[r for r, f in zip(rows, fa4, strict=True) if f == side] for side in (False, True)]
        sdpa_rows, fa4_rows = sides if min(map(len, sides)) >= 2 else (rows, [])
        slopes = self.time["packed"][1:3]

        def per_call(group):
            times = torch.tensor([r["time_s"] for r in group], dtype=torch.float64)
            return fit_per_call([r["call_work"] for r in group], times, slopes)

        self.time["dfs"], self.host["dfs"], self.fit_info["dfs"] = per_call(sdpa_rows)
        self.fit_info["dfs"]["free_fit_rel_rms_residual"] = free
        if fa4_rows:
            time, host, info = per_call(fa4_rows)
            self.fa4_walks = {"rectangle": fa4_rectangle, "time": time, "host": host}
            self.fit_info["dfs"]["fa4_walks"] = info

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

        Modes no observation ran take the pooled scale. A mode's coefficients (device and host terms)
        scale together, so its calibrated shape stays and its level moves. ``refinement`` records the
        scales and the relative errors on the observations before and after (after is in-sample: the fit
        saw those times).
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
        refined.host = {m: [c * scales[m] for c in self.host[m]] for m in MODES}
        if self.fa4_walks is not None:
            refined.fa4_walks = {**self.fa4_walks, **{k: [c * scales["dfs"] for c in self.fa4_walks[k]]
                                                      for k in ("time", "host")}}
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
                "host": self.host,
                "fa4_walks": self.fa4_walks,
                "features_version": FEATURES_VERSION,
            }
        )

    @classmethod
    def from_dict(cls, data: dict) -> CostModel:
        """The model of :meth:`to_dict` (also of older files, without ``fit_info``, ``refinement`` and
        ``host``: no host floor), checked as the constructor checks its arguments. A file written before
        :data:`FEATURES_VERSION` fitted dfs to features that counted a recomputed token as a trained one:
        its dfs coefficients are kept, but its dfs fit no longer counts as identified
        (:meth:`identifies`)."""
        required = ("time", "memory", "calibrated", "samples", "device")
        missing = [k for k in required if not isinstance(data, dict) or k not in data]
        if missing:
            raise ValueError(f"not a saved CostModel: missing {missing}")
        fit_info = copy.deepcopy(data.get("fit_info") or {})
        if data.get("features_version") != FEATURES_VERSION:
            fit_info["dfs"] = {**fit_info.get("dfs", {}), "method": OLDER_FEATURES_FIT}
        return cls(
            **{k: data[k] for k in required},
            fit_info=fit_info,
            refinement=data.get("refinement"),
            host=data.get("host") or _prior()["host"],
            fa4_walks=data.get("fa4_walks"),
        )
