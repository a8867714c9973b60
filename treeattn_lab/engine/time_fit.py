"""Fitting one mode's time to measurements: the model's FLOPs, the device term and the host term.

A model call costs about the *larger* of its host time (Python and kernel launches, nearly independent of
its tokens) and its device time (about :data:`TOKEN_FLOPS_PER_WEIGHT` x weights FLOPs per token and
:data:`PAIR_FLOPS_PER_CHANNEL` x heads x head dim x layers per attended pair), not their sum. So a mode's
time for one micro-batch is

    time = max(host, device)
    device = theta . [1, tokens, attention pairs, model calls]       (TIME_FEATURES)
    host   = eta . [1, model calls]                                  (HOST_FEATURES)

with every coefficient >= 0. The host term is a floor: a micro-batch below it costs the same whatever its
tokens, so two such micro-batches cost twice what one of both costs.

**The device term** (:func:`fit_time`): NNLS with the token and pair slopes held at or above their FLOPs
at :data:`MAX_PLAUSIBLE_FLOPS` (no device computes faster; :func:`model_work` counts the model's FLOPs),
kept only where the measurements identify it: more measurements than features and a condition number of
the column-normalized features of at most :data:`~treeattn_lab.engine.nnls.COND_LIMIT`. Otherwise (tries
too few or too alike) the time is fitted on physics, ``c + s * FLOPs + c_call * calls``, three
coefficients with the architecture fixing what a pair costs against a token; where even that is not
identified, as ``s * FLOPs`` alone.

**The host term** (:func:`fit_host_bound`): ``max`` is not linear, but it is linear on each side of the
line ``host = device``. The measurements are split into host-bound ones (those that took the longest
per FLOP) and device-bound ones; each side gets its own NNLS (the host side over ``[1, calls]``, the
device side as :func:`fit_time`), every measurement is reassigned to the side its fitted terms say it is
on, and the two fits are repeated until the split stops changing. Every split size is tried as a start;
the best fit over all measurements is kept (among equally good ones, the one found first: the fewest
host-bound), but only where both sides are identified and it has at most :data:`HOST_GAIN` times the
residual of the device term alone. Otherwise the host term is 0 and the time is the linear device term.
"""

from __future__ import annotations

import torch
from torch import nn

from .adapters import query_width
from .nnls import nnls_normalized

PER_CALL_FIT = "per-call"  # the method name of fit_per_call's fits

TIME_FEATURES = ("micro_batch", "tokens", "attention_pairs", "model_calls")
HOST_FEATURES = ("micro_batch", "model_calls")
HOST_GAIN = 0.5  # the max(host, device) fit must at least halve the linear fit's relative RMS residual
_HOST_ROUNDS = 20  # reassignments of the measurements between the two sides, at most

MAX_PLAUSIBLE_FLOPS = 2.5e15  # FLOP/s: above the dense bf16 rate of any accelerator today (B200: 2.25e15)
TOKEN_FLOPS_PER_WEIGHT = 6  # a trained token: 2 FLOPs per matmul weight forward, 4 backward
PAIR_FLOPS_PER_CHANNEL = 14  # an attended pair, per query head channel and layer: 4 forward (QK^T, PV),
# 10 backward with the scores recomputed (flash attention)
FORWARD_TOKEN_SHARE = 2 / TOKEN_FLOPS_PER_WEIGHT  # of a trained token's FLOPs, what a forward alone does
FORWARD_PAIR_SHARE = 4 / PAIR_FLOPS_PER_CHANNEL  # likewise for an attended pair
DEFAULT_PAIR_TOKEN_RATIO = 1.2e-4  # pair / token FLOPs of the 0.49B bench model, for unknown architectures


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
    costs :data:`PAIR_FLOPS_PER_CHANNEL` x query heads x head dim x layers (head dim: the mean of the
    query and value widths where they differ), read off the model's config (TinyLM's ``cfg`` or a Hugging
    Face ``config``); where it is missing, :data:`DEFAULT_PAIR_TOKEN_RATIO` of a token. ``known`` says
    whether the token FLOPs come from the model (the plausibility check of the
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
    # channels per pair: a query's width for Q.K and a value's for P.V (MLA configs give the value's as
    # v_head_dim; elsewhere the two are one head_dim)
    head_dim = query_width(cfg)
    if head_dim and _first_attr(cfg, "v_head_dim"):
        head_dim = (head_dim + _first_attr(cfg, "v_head_dim")) / 2
    if layers and heads and head_dim:
        per_pair = float(PAIR_FLOPS_PER_CHANNEL * heads * head_dim * layers)
    else:
        per_pair = per_token * DEFAULT_PAIR_TOKEN_RATIO
    return {"flops_per_token": per_token, "flops_per_pair": per_pair, "known": bool(weights)}


def _flops_weights(work: dict | None) -> tuple[float, float]:
    """FLOPs per token and per attention pair of the model's :func:`model_work` (without one: 1 per token
    and :data:`DEFAULT_PAIR_TOKEN_RATIO` per pair)."""
    return (work["flops_per_token"], work["flops_per_pair"]) if work else (1.0, DEFAULT_PAIR_TOKEN_RATIO)


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
    per_token, per_pair = _flops_weights(work)
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


# ------------------------------------------------------------------------------------------ host term
def _rel_rms(predicted: torch.Tensor, b: torch.Tensor) -> float:
    return float(((predicted - b) / b).square().mean().sqrt())


def _fit_host(H: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """Host coefficients over ``H = [1, calls]`` of host-bound measurements; None where not identified.
    Where every one made the same number of calls, the constant carries them."""
    if bool((H[:, 1] == H[0, 1]).all()):
        H = torch.stack([H[:, 0], torch.zeros_like(H[:, 1])], 1)
    eta, _ = nnls_normalized(H, b)
    return eta if eta is not None and bool((eta > 0).any()) else None


def _fit_sides(A, H, b, host_bound: torch.Tensor, work):
    """``(device, host, device info)`` fitted on the two sides of ``host_bound``; None where a side is not
    identified (the device side must be an ``"nnls"`` or ``"physical"`` fit)."""
    if int(host_bound.sum()) < 2 or int((~host_bound).sum()) < 2:
        return None
    eta = _fit_host(H[host_bound], b[host_bound])
    if eta is None:
        return None
    theta, info = fit_time(A[~host_bound], b[~host_bound], work)
    if info["method"] not in ("nnls", "physical"):
        return None
    return torch.tensor(theta, dtype=torch.float64), eta, info


def fit_host_bound(A, b, work: dict | None = None) -> tuple[list[float], list[float], dict]:
    """One mode's device and host coefficients (``time = max(host, device)``, module docstring) from
    features ``A [n, 4]`` (:data:`TIME_FEATURES`) and seconds ``b``.

    Returns ``(theta, eta, info)``: ``info`` is :func:`fit_time`'s for the device term (its residual over
    every measurement, with the max), plus ``host`` (``"max"`` where the host term was kept, else
    ``"none"``), ``host_bound`` (how many measurements the host term explains) and
    ``linear_rel_rms_residual`` (the device term alone, fitted on every measurement).
    """
    theta, info = fit_time(A, b, work)
    A = torch.as_tensor(A, dtype=torch.float64)
    b = torch.as_tensor(b, dtype=torch.float64)
    linear = info["rel_rms_residual"]
    info.update(host="none", host_bound=0, linear_rel_rms_residual=linear)
    H = A[:, [0, 3]]
    per_token, per_pair = _flops_weights(work)
    flops = (per_token * A[:, 1] + per_pair * A[:, 2]).clamp_min(1.0)
    order = torch.argsort(-b / flops, stable=True)  # the slowest per FLOP first: the likeliest host-bound
    best = None  # (residual, theta, eta, info, host-bound count)
    for k in range(2, A.shape[0] - 1):  # the k slowest measurements per FLOP start on the host side
        host_bound = torch.zeros(A.shape[0], dtype=torch.bool)
        host_bound[order[:k]] = True
        for _ in range(_HOST_ROUNDS):
            sides = _fit_sides(A, H, b, host_bound, work)
            if sides is None:
                break
            t, eta, side_info = sides
            device, host = A @ t, H @ eta
            residual = _rel_rms(torch.maximum(device, host), b)
            if best is None or residual < best[0] * (1 - 1e-6) - 1e-12:  # ties: the smaller host side
                best = (residual, t, eta, side_info, int((host > device).sum()))
            moved = host > device
            if torch.equal(moved, host_bound):
                break
            host_bound = moved
    if best is None or not best[0] <= HOST_GAIN * linear:
        return theta, [0.0, 0.0], info
    residual, t, eta, side_info, count = best
    info = {**side_info, "rel_rms_residual": residual, "shapes": int(A.shape[0])}
    info.update(host="max", host_bound=count, linear_rel_rms_residual=linear)
    return t.tolist(), eta.tolist(), info


# --------------------------------------------------------------------------------------- per call
PER_CALL_GRID = 96  # candidate values of each of the two fitted coefficients, per round
PER_CALL_ROUNDS = 3  # each round searches a finer grid around the previous round's best pair


def fit_per_call(calls, b, slopes) -> tuple[list[float], list[float], dict]:
    """A DFS mode's coefficients where each measured walk's time is the sum over its model calls of
    ``max(s_i h, s_i c + slopes . [tokens_i, pairs_i])``: ``h`` the host's cost of a call, ``c`` the
    device's constant per call, ``s_i`` the call's share of them (a forward alone issues a fraction of a
    training call's work), ``slopes`` (per token, per pair) held fixed (packed's: a call runs the same
    kernels).

    ``calls``: per measurement, its calls' ``(share, tokens, pairs)``; ``b``: the measured seconds. ``h`` and
    ``c`` minimize the relative squared error, found on a grid of :data:`PER_CALL_GRID` values each
    (zero and a log scale around the mean seconds per call), refined :data:`PER_CALL_ROUNDS` times.
    Returns ``(theta, eta, info)`` in the layout of :func:`fit_host_bound`: ``theta = [0, per token, per
    pair, c]``, ``eta = [0, h]``; ``info["method"]`` is :data:`PER_CALL_FIT`, ``host_bound`` counts the
    calls (over all measurements) that the fit says wait on the host.
    """
    b = torch.as_tensor(b, dtype=torch.float64)
    if b.dim() != 1 or len(calls) != b.shape[0] or not len(calls) or any(not c for c in calls):
        raise ValueError("need one non-empty list of (share, tokens, pairs) per measured time")
    if not (torch.isfinite(b).all() and (b > 0).all()):
        raise ValueError("measured times must be finite and > 0")
    if len(slopes) != 2:
        raise ValueError(f"slopes must be (per token, per pair), got {slopes!r}")
    per_token, per_pair = (float(x) for x in slopes)
    width = max(len(c) for c in calls)
    device = torch.zeros(len(calls), width, dtype=torch.float64)
    share = torch.zeros(len(calls), width, dtype=torch.float64)  # 0 pads the shorter walks
    for j, work in enumerate(calls):
        w = torch.tensor(work, dtype=torch.float64)
        share[j, : len(work)] = w[:, 0]
        device[j, : len(work)] = per_token * w[:, 1] + per_pair * w[:, 2]

    def errors(h: torch.Tensor, c: torch.Tensor) -> torch.Tensor:  # [len(h), len(c)] mean squared rel. error
        rows = []
        for host in h.tolist():  # one host value at a time: [len(c), measurements, calls] stays small
            predicted = torch.maximum(host * share, c[:, None, None] * share + device).sum(-1)
            rows.append(((predicted - b) / b).square().mean(-1))
        return torch.stack(rows)

    scale = float((b / share.sum(1)).mean())
    grid = torch.cat([torch.zeros(1, dtype=torch.float64), scale * torch.logspace(-5, 1, PER_CALL_GRID - 1,
                                                                                   dtype=torch.float64)])
    hs, cs = grid, grid
    for round_ in range(PER_CALL_ROUNDS):
        err = errors(hs, cs)
        i, j = divmod(int(err.argmin()), err.shape[1])
        h, c = float(hs[i]), float(cs[j])
        decades = 0.3 / 3**round_  # each round a third of the last one's width around the best pair
        hs, cs = _around(h, scale, decades), _around(c, scale, decades)
    best = errors(torch.tensor([h], dtype=torch.float64), torch.tensor([c], dtype=torch.float64))
    waiting = int(((h * share > c * share + device) & (share > 0)).sum())
    info = {"method": PER_CALL_FIT, "rel_rms_residual": float(best.sqrt()), "shapes": int(b.shape[0]),
            "host": "per-call", "host_bound": waiting}
    return [0.0, per_token, per_pair, c], [0.0, h], info


def _around(value: float, scale: float, decades: float) -> torch.Tensor:
    """:data:`PER_CALL_GRID` values within ``decades`` of ``value`` on a log scale; where ``value`` is
    zero, zero and values far below ``scale``."""
    if value == 0.0:
        return torch.cat([torch.zeros(1, dtype=torch.float64),
                          scale * torch.logspace(-7, -4, PER_CALL_GRID - 1, dtype=torch.float64)])
    return value * torch.logspace(-decades, decades, PER_CALL_GRID, dtype=torch.float64)
