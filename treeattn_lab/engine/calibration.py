"""Calibration: time every engine mode on synthetic tries on this device and fit a :class:`CostModel`.

:func:`calibrate` measures :func:`calibration_tries`, synthetic tries built at the scale the engine runs:
their tree tokens reach the token budget, their rollouts are as long as RL rollouts (1/64 to 1/4 of the
budget), their sharing runs from a 5% to an 85% common prefix, with one to three levels of forks. Scale
matters because a model call costs the larger of its host and device time (see
:mod:`treeattn_lab.engine.time_fit`): tries far below the budget measure host-bound calls and say little
about budget-sized ones, so most tries fill a good part of the budget. Three small ones (1/32 to 1/8 of
it, like the last micro-batch of a rank's share) measure the host floor. The tries are measured in the
order of :data:`CALIBRATION_DESIGN`, which puts first the tries that fill the budget and differ most, so
a calibration cut short by its time limit still spans tokens, pairs per token and model calls. DFS runs
each trie in two block sizes, the call's and the largest within the budget, so that even two tries tell
its cost per model call from its cost per token (``"auto"`` weighs DFS in large blocks).

The fitted model is cached on disk per model architecture, device and engine settings (:func:`cache_path`).
It records every run's seconds with the tries' design, so :func:`refit` can fit it again under a later
version of the fit without measuring anything.
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
import warnings
from pathlib import Path

import torch

from ..atomic import atomic_writer
from ..checks import check_int
from ..trie import RolloutTrie
from .adapters import adapt
from .block_attention import fa4_walk_rectangle
from .call_plan import dfs_block_ladder
from .cost_model import MODES, CostModel, MicroBatchShape
from .time_fit import model_work
from .tree_backward import tree_backward

CALIBRATION_VERSION = 7  # part of the cache key: calibrations of older designs are not reused


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
    gradient checkpointing (it recomputes every layer in backward), engine settings, calibration design
    version and torch version."""
    first = next(model.parameters())
    shapes = ";".join(f"{n}:{tuple(p.shape)}" for n, p in model.named_parameters())
    arch = hashlib.sha256(f"{type(model).__name__}|{shapes}".encode()).hexdigest()[:16]
    key = f"{type(model).__name__}-{arch}-{first.dtype}-{_device_label(first.device)}"
    key += "-checkpointed" if _gradient_checkpointing(model) else ""
    key += f"-fa4from{_fa4_rectangle(model)}"  # FA4 installed or not: the walks' kernels differ
    key += f"-block{block_tokens}-budget{token_budget}-scale{_scale(token_budget, scale_tokens)}"
    key += f"-v{CALIBRATION_VERSION}-torch{torch.__version__}"
    safe = "".join(c if c.isalnum() or c in "-._" else "_" for c in key)
    root = Path(os.environ.get("TREEATTN_CACHE", Path.home() / ".cache" / "treeattn_lab"))
    return root / "cost_models" / f"{safe}.json"


def _gradient_checkpointing(model) -> bool:
    """Whether any module of ``model`` recomputes its layers in backward (TinyLM sets
    ``gradient_checkpointing`` on itself, a Hugging Face model on its inner model)."""
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


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
# its time limit still spans tokens, pairs per token and model calls; the tiny tries measure the host floor
CALIBRATION_DESIGN = (
    ("grpo", 1.0, 1 / 32, 0.3, (8,)),
    ("agentic", 1.0, 1 / 4, 0.6, (2, 3)),
    ("small-grpo", 0.3, 1 / 32, 0.3, (8,)),
    ("tiny-grpo", 1 / 32, 1 / 256, 0.3, (4,)),
    ("low-sharing", 0.95, 1 / 16, 0.05, (2,)),
    ("tiny-tree", 1 / 16, 1 / 64, 0.5, (2, 2)),
    ("tree-search", 0.9, 1 / 16, 0.4, (4, 4)),
    ("tiny-short", 1 / 8, 1 / 128, 0.3, (8,)),
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
    """Time every mode on :func:`calibration_tries` on the model's device and fit a :class:`CostModel`.

    ``scale_tokens``: tree tokens of the largest synthetic trie (default and at most ``token_budget``,
    else 4096): calibrate at the size the engine will run. Every run of the smallest trie, and dfs in
    walks that run FA4 where walks do, first runs once, not fitted (:func:`_warm_up_runs`: kernels compile
    and libraries start on first use). Then the tries are measured in order; none starts once ``seconds``
    have passed since the warm-up ended, but at least one is measured. Each trie runs every mode at
    ``block_tokens`` and dfs also in the two largest blocks within the budget (:func:`_runs_of`). Every
    run keeps the fastest of ``repeats`` (a new size can still compile a kernel variant), except dfs at
    ``block_tokens`` (several times slower), which runs once. Existing ``.grad``
    of the model's parameters are saved and restored, and the progress bar is closed, whatever happens.

    The result says what it could fit: ``fit_info["calibration"]`` names the tries measured and those
    the time limit left out, ``fit_info[mode]`` how each mode was fitted. Where some mode's time was not
    identified, the model is not ``calibrated``, a warning says what is missing and nothing is cached
    (the next call measures again). Otherwise the model is cached (:func:`cache_path`; the write is
    atomic); an entry that cannot be read back counts as missing and is overwritten.
    """
    _check_settings(block_tokens, token_budget, scale_tokens, repeats, seconds)
    scale = _scale(token_budget, scale_tokens)
    path = cache_path(model, block_tokens, token_budget, scale)
    cached = _read_cache(path) if use_cache else None
    if cached is not None:
        return cached
    vocab = model.cfg.vocab_size if hasattr(model, "cfg") else model.config.vocab_size  # TinyLM or HF
    longest = _longest_allowed(model, scale)
    tries = calibration_tries(scale, vocab=vocab, seed=seed, max_length=longest)
    settings = {"block_tokens": block_tokens, "token_budget": token_budget}
    fa4_rectangle = _fa4_rectangle(model)
    saved = {p: (None if p.grad is None else p.grad.clone()) for p in model.parameters()}
    try:
        samples, measured = _measure(model, tries, settings, seconds=seconds, repeats=repeats,
                                     progress=progress, fa4_rectangle=fa4_rectangle)
    finally:
        for p, g in saved.items():
            p.grad = g
    fitted = CostModel.fit(samples, device=_device_label(next(model.parameters()).device),
                           work=model_work(model), fa4_rectangle=fa4_rectangle)
    names = [name for name, _ in tries]
    fitted.fit_info["calibration"] = {
        "measured": names[:measured],
        "not_measured": names[measured:],
        "seconds": seconds,
        "stopped_by_time_limit": measured < len(names),
        # what refit() rebuilds the samples from
        "scale_tokens": scale, "vocab_size": vocab, "seed": seed, "max_length": longest,
        "token_budget": token_budget, "fa4_rectangle": fa4_rectangle,
        "timings": [{k: sample[k] for k in TIMING_KEYS} for sample in samples],
    }
    if not fitted.calibrated:
        warnings.warn(_shortfall(fitted), stacklevel=2)
    elif use_cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_writer(path) as f:
            json.dump(fitted.to_dict(), f, indent=1)
    return fitted


def _check_settings(block_tokens, token_budget, scale_tokens, repeats, seconds) -> None:
    check_int("block_tokens", block_tokens)
    check_int("token_budget", token_budget, allow_none=True)
    check_int("scale_tokens", scale_tokens, allow_none=True)
    check_int("repeats", repeats)
    if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real):
        raise TypeError(f"seconds must be a number, got {type(seconds).__name__}")
    if not (math.isfinite(seconds) and seconds >= 0):
        raise ValueError(f"seconds must be a finite number >= 0, got {seconds}")


def _read_cache(path: Path) -> CostModel | None:
    """The model cached at ``path``; None where there is none or it cannot be read back (cut off,
    corrupt, invalid coefficients), so that :func:`calibrate` measures again and overwrites it."""
    try:
        return CostModel.from_dict(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError):  # JSON and Unicode decode errors are ValueErrors
        return None


def _shortfall(fitted: CostModel) -> str:
    """What an incomplete calibration could and could not fit, in one sentence for a warning."""
    report = fitted.fit_info["calibration"]
    done, total = len(report["measured"]), len(report["measured"]) + len(report["not_measured"])
    methods = ", ".join(f"{m}: {fitted.fit_info.get(m, {}).get('method', 'prior')}" for m in MODES)
    if report["stopped_by_time_limit"]:
        limit = f" within its time limit of {report['seconds']} s"
        remedy = "give calibrate() more seconds (or a smaller scale_tokens)"
    else:
        limit, remedy = "", "the tries were too alike to tell the coefficients apart"
    return (
        f"calibrate() measured {done} of {total} calibration tries{limit}; time fits {methods} (only nnls "
        f"and physical fits are identified by the measurements). The cost model is not calibrated and not "
        f"cached: {remedy}."
    )


def _fa4_rectangle(model) -> int | None:
    """The mean block rectangle from which the model's dfs walks run FA4 on its device and dtype."""
    adapter, param = adapt(model), next(model.parameters())
    return fa4_walk_rectangle(adapter.query_heads, adapter.head_dim, param.device, param.dtype)


def _run(model, trie: RolloutTrie, mode: str, settings: dict) -> tuple[float, int | None]:
    """One ``tree_backward`` call: its seconds and CUDA peak bytes (None on the CPU)."""
    report = tree_backward(model, trie, None, mode=mode, **settings).report
    return report.time_s, report.peak_memory_bytes


def _runs_of(trie: RolloutTrie, settings: dict) -> list[tuple[str, int]]:
    """``(mode, block_tokens)`` of each run on ``trie``: every mode at the call's block size, and dfs also
    in the two largest blocks of :func:`~treeattn_lab.engine.call_plan.dfs_block_ladder` within the
    budget (what ``"auto"`` may run it in; the largest often holds the whole trie in one call, the one
    below it splits the trie into a walk of several large calls), so the fit sees dfs's cost per call
    apart from its cost per token, in the walks of small blocks and of large ones (which may run another
    attention kernel)."""
    block, budget = settings["block_tokens"], settings["token_budget"]
    runs = [(mode, block) for mode in MODES]
    if budget is not None:
        tree_tokens = sum(len(n.tokens) for n in trie.nodes)
        runs += [("dfs", b) for b in dfs_block_ladder(block, tree_tokens, budget)[1:][-2:]]
    return runs


def _sample(trie: RolloutTrie, timing: dict, token_budget: int | None) -> dict:
    """A sample of :meth:`CostModel.fit` from one timed run of ``trie`` (``timing``: its ``mode``,
    ``block_tokens``, ``time_s`` and ``peak_bytes``, kept beside the features)."""
    mode = timing["mode"]
    shape = MicroBatchShape.of(trie, timing["block_tokens"], token_budget)
    return {
        **timing,
        "time_features": shape.time_features(mode),
        "memory_features": shape.memory_features(mode),
        "call_work": shape.dfs_call_work if mode == "dfs" else None,
        "walk_rectangle": shape.dfs_walk_rectangle,
    }


TIMING_KEYS = ("trie", "mode", "block_tokens", "time_s", "peak_bytes")


def refit(cost_model: CostModel) -> CostModel:
    """``cost_model`` fitted again, by this version's :meth:`CostModel.fit`, from the timings its
    calibration recorded (``fit_info["calibration"]``: the tries' design and each run's seconds), without
    measuring anything: the tries are rebuilt from their seed. Raises ValueError for a model whose
    calibration recorded no timings."""
    report = cost_model.fit_info.get("calibration", {})
    if not report.get("timings"):
        raise ValueError("this cost model's calibration recorded no timings to refit from (calibrate again)")
    tries = dict(calibration_tries(report["scale_tokens"], vocab=report["vocab_size"], seed=report["seed"],
                                   max_length=report["max_length"]))
    samples = [_sample(tries[t["trie"]], t, report["token_budget"]) for t in report["timings"]]
    fitted = CostModel.fit(samples, device=cost_model.device, work=cost_model.fit_info.get("work"),
                           fa4_rectangle=report.get("fa4_rectangle"))
    fitted.fit_info["calibration"] = copy.deepcopy(report)
    return fitted


def _warm_up_runs(tries, settings: dict, fa4_rectangle: int | None) -> list[tuple[RolloutTrie, str, int]]:
    """``(trie, mode, block_tokens)`` of the warm-up: every run of :func:`_runs_of` on the smallest trie,
    and, where walks of large enough blocks run FA4 (``fa4_rectangle``), dfs in every block in which the
    smallest trie with such a walk walks with FA4 (its largest block often holds it in one tree-shaped
    call, the one below splits chains: FA4's kernels for both compile on first use, and the smallest
    trie's walks are often too small to reach them); no run twice."""
    by_size = sorted((t for _, t in tries), key=lambda t: sum(len(n.tokens) for n in t.nodes))
    smallest = _runs_of(by_size[0], settings)
    runs = [(by_size[0], mode, block) for mode, block in smallest]
    if fa4_rectangle is None:
        return runs

    def runs_fa4(trie, block) -> bool:
        return MicroBatchShape.of(trie, block, settings["token_budget"]).dfs_walk_rectangle >= fa4_rectangle

    for trie in by_size:
        walks = [block for mode, block in _runs_of(trie, settings) if mode == "dfs" and runs_fa4(trie, block)]
        if walks:
            done = smallest if trie is by_size[0] else []
            return runs + [(trie, "dfs", block) for block in walks if ("dfs", block) not in done]
    return runs


def _measure(model, tries, settings: dict, *, seconds: float, repeats: int, progress: bool,
             fa4_rectangle: int | None):
    """The samples of :meth:`CostModel.fit` (every mode on each trie, in order, until ``seconds`` have
    passed since the warm-up) and how many tries were measured."""
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(tries, desc="calibrating cost model", leave=False)
    samples, measured = [], 0
    try:
        for trie, mode, block in _warm_up_runs(tries, settings, fa4_rectangle):  # not fitted
            _run(model, trie, mode, {**settings, "block_tokens": block})
        start = time.perf_counter()
        for name, trie in tries if bar is None else bar:
            if samples and time.perf_counter() - start > seconds:
                break
            for mode, block in _runs_of(trie, settings):
                run_settings = {**settings, "block_tokens": block}
                once = mode == "dfs" and block == settings["block_tokens"]  # the slowest run: once
                runs = [_run(model, trie, mode, run_settings) for _ in range(1 if once else repeats)]
                timing = {"trie": name, "mode": mode, "block_tokens": block,
                          "time_s": min(t for t, _ in runs), "peak_bytes": runs[-1][1]}
                samples.append(_sample(trie, timing, settings["token_budget"]))
            measured += 1
    finally:
        if bar is not None:
            bar.close()
    return samples, measured
