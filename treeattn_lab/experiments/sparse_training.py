"""Train with dynamic sparse attention: does a model keep its loss and its long-range retrieval?

The claim (MTraining): extending a model to long context with dynamic vertical-slash sparse attention
keeps its quality. Protocol, per seed, on the bundled byte-level corpus (:mod:`treeattn_lab.corpus`) with
passkey samples mixed in (:mod:`.passkey`):

1. **Dense curriculum** (``pretrain``, :class:`~.sparse_training_config.Stage`): a
   :class:`~treeattn_lab.reference.TinyLM` trains densely in stages of growing context, a share
   ``passkey_share`` of the windows passkey samples (the needle at a random depth, the answer at the
   end): first short enough that copying the key is learned quickly, then longer up to the pretraining
   length, with one AdamW throughout and a learning rate that never rises from stage to stage (the
   rules: :mod:`.sparse_training_config`). The loss is the next-byte loss plus ``answer_weight`` times
   the mean loss of the answer's digits.
2. **Extension**: from that one checkpoint three copies train ``steps`` steps at ``seq_len`` on identical
   batches, with
   - ``dense``: causal attention;
   - ``sparse``: :class:`~treeattn_lab.ops.dynamic_sparse.DynamicSparseAttention` (every layer estimates
     every sequence's pattern from its last queries, then the block-sparse kernel runs forward and back);
   - ``window``: a fixed sliding window with the sparse run's sinks, as wide as the computed-pair share
     the sparse run measured (:func:`window_pattern`): the same attention work, no dynamic lines.
3. **Evaluation**, each model with the attention it trained with (and, for reference, with dense
   attention): validation loss (nats per byte on the validation split); passkey retrieval at each depth
   of ``depths`` (exact match of the greedy digits, and the share of right digits); attention forward +
   backward per training step at ``seq_len`` (the kernel, and the estimation on top for ``sparse``);
   median step time; the computed-pair share.

Targets (evaluated from the numbers, never assumed): sparse validation loss within 2% of dense; sparse
retrieval within 5 points of dense; sparse at least 10 points above the window; sparse attention forward
+ backward at least 2.5x faster than dense. The two retrieval targets are evaluated only when the dense
model retrieves (``DENSE_RETRIEVAL_FLOOR``); otherwise they are recorded with ``met: None``. The means
over seeds and the targets are computed in :mod:`.sparse_training_targets`.

The settings and the modes live in :mod:`.sparse_training_config`. Modes: ``tiny`` (the tests: the whole
protocol in seconds on a CPU, too short for a model to learn the passkey), ``quick`` (minutes per seed on
a CPU; the dense model learns the passkey; notebook 05 reads its committed run), ``smoke`` (the full
mode's model and kernels on a GPU at 4K tokens, a few steps), ``full`` (one H200: bf16 autocast, 32K
tokens; notebook 05 reads its committed run). Seeds are independent: run them in one process or one process
each and join the JSON files with ``--merge``. On a CPU shared with other work, ``OMP_NUM_THREADS=1``
keeps the small matrix products from competing for cores.

    python -m treeattn_lab.experiments.sparse_training --mode full --seeds 0,1,2
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from ..bench.harness import synchronize
from ..corpus import adamw, causal_sdpa, evaluate_loss, load_corpus, lr_factor
from ..ops.dynamic_sparse import DynamicSparseAttention, fixed_pattern_attention
from ..ops.sparse import sparse_attention
from ..patterns.vertical_slash import VerticalSlashPattern
from ..reference import TinyLM
from .cli_args import seed_list
from .passkey import passkey_batch, passkey_scores, probe_set
from .sparse_training_config import MODES, ExperimentConfig
from .sparse_training_targets import VARIANTS, summarize, targets, verdict

BENCH_NAME = "sparse-training"


# ---------------------------------------------------------------------------------------------- attention
def window_pattern(num_heads: int, num_tokens: int, fraction: float, *, sinks: int, block_size: int,
                   device="cpu") -> VerticalSlashPattern:
    """A sliding window computing about ``fraction`` of the causal pairs: per head the first ``sinks``
    columns and a band of whole tiles along the diagonal (``w`` block diagonals: query block ``i`` sees
    key blocks ``i - w + 1 .. i``). Heads get ``w`` or ``w + 1`` block diagonals so that the total is the
    closest to ``fraction`` the tiles allow (within one block diagonal of one head)."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must lie in (0, 1], got {fraction}")
    nb = -(-num_tokens // block_size)
    sink_cols = torch.arange(min(sinks, num_tokens)).expand(num_heads, -1)

    def band(width: int) -> torch.Tensor:  # offsets crossing exactly the block diagonals 0 .. width - 1
        return torch.arange((width - 1) * block_size + 1).clamp(max=num_tokens - 1)

    def pairs(width: int) -> int:
        return VerticalSlashPattern(sink_cols[:1], band(width)[None], block_size).num_pairs(num_tokens)

    target = fraction * num_heads * num_tokens * (num_tokens + 1) / 2
    width = 1
    while width < nb and pairs(width + 1) * num_heads <= target:
        width += 1
    wider = 0
    if width < nb:
        step = pairs(width + 1) - pairs(width)
        wider = max(0, min(num_heads, round((target - pairs(width) * num_heads) / step)))
    widths = [width + 1] * wider + [width] * (num_heads - wider)
    slash = torch.full((num_heads, len(band(max(widths)))), -1, dtype=torch.int64)
    for h, w in enumerate(widths):
        offsets = band(w)
        slash[h, : offsets.numel()] = offsets
    return VerticalSlashPattern(sink_cols.to(device), slash.to(device), block_size)


# ---------------------------------------------------------------------------------------------- training
def _autocast(device: torch.device, cfg: ExperimentConfig):
    if cfg.bf16 and device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _losses(model, inputs, targets, answer, attention):
    positions = torch.arange(inputs.shape[1], device=inputs.device).expand_as(inputs)
    logits = model(inputs, positions, attention).float()
    token_loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view_as(targets)
    # a batch without a passkey sample has no answer loss: NaN in the history, nothing added to the loss
    key_loss = token_loss[answer].mean() if bool(answer.any()) else token_loss.new_full((), math.nan)
    return token_loss.mean(), key_loss


def train_phase(model, attention, cfg: ExperimentConfig, *, seq_len: int, steps: int, batch_size: int,
                lr: float | Callable[[int], float], seed: int, desc: str, progress: bool = True,
                optimizer: torch.optim.Optimizer | None = None) -> dict[str, list]:
    """``steps`` AdamW steps of next-byte loss + ``cfg.answer_weight`` x answer-digit loss on passkey-mixed
    batches drawn from ``seed`` (the same batches for every model given the same seed); returns the
    per-step history, each step's learning rate in ``"lr"``.

    ``lr``: a peak (warmup over ``min(100, steps // 10)`` steps, then cosine decay to a tenth) or the rate
    of each step, ``lr(step)``. ``optimizer``: an AdamW over ``model`` to go on with (its moments carry
    over from an earlier phase); by default a new one."""
    from ..progress import progress_bar

    device = next(model.parameters()).device
    train = load_corpus("train")  # batches are built on the CPU, then moved
    generator = torch.Generator().manual_seed(seed)
    if not callable(lr):
        peak, warmup = lr, min(100, steps // 10)

        def lr(step):
            return peak * lr_factor(step, steps, warmup, 0.1)
    optimizer = adamw(model, lr(0), 0.1) if optimizer is None else optimizer
    history: dict[str, list] = {"loss": [], "lm_loss": [], "key_loss": [], "step_ms": [], "lr": []}
    model.train()
    bar = progress_bar(range(steps), desc=desc, disable=not progress, leave=False)
    for step in bar:
        rate = lr(step)
        for group in optimizer.param_groups:
            group["lr"] = rate
        history["lr"].append(rate)
        batch = passkey_batch(train, batch_size, seq_len, generator, share=cfg.passkey_share,
                              digits=cfg.digits)
        inputs, targets, answer = (x.to(device) for x in batch)
        synchronize(device)
        start = time.perf_counter()
        with _autocast(device, cfg):
            lm_loss, key_loss = _losses(model, inputs, targets, answer, attention)
        loss = lm_loss + cfg.answer_weight * key_loss if bool(answer.any()) else lm_loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        synchronize(device)
        history["step_ms"].append((time.perf_counter() - start) * 1e3)
        for key, value in (("loss", loss), ("lm_loss", lm_loss), ("key_loss", key_loss)):
            history[key].append(float(value.detach()))
        bar.set_postfix(lm=f"{history['lm_loss'][-1]:.3f}", key=f"{history['key_loss'][-1]:.2f}",
                        refresh=False)
    return history


def pretrain(model, cfg: ExperimentConfig, seed: int, progress: bool = True) -> dict[str, list]:
    """The dense curriculum: every stage of ``cfg.pretrain`` in order, each on its own stream of batches
    (seed ``seed + 100_000 * stage``), with one AdamW throughout (its moments carry from stage to stage)
    and the learning rates of :meth:`~.sparse_training_config.ExperimentConfig.pretrain_lr`; one history
    of all their steps, with each step's context in ``"seq_len"``."""
    history: dict[str, list] = {}
    optimizer = adamw(model, cfg.lr, 0.1)
    for index, stage in enumerate(cfg.pretrain):
        part = train_phase(model, causal_sdpa, cfg, seq_len=stage.seq_len, steps=stage.steps,
                           batch_size=stage.batch_size, lr=partial(cfg.pretrain_lr, index),
                           seed=seed + 100_000 * index, desc=f"seed {seed}: dense at {stage.seq_len}",
                           progress=progress, optimizer=optimizer)
        part["seq_len"] = [stage.seq_len] * stage.steps
        for key, values in part.items():
            history.setdefault(key, []).extend(values)
    return history


# ---------------------------------------------------------------------------------------------- evaluation
@torch.no_grad()
def retrieval(model, attention, probes: dict[float, torch.Tensor], cfg: ExperimentConfig) -> dict[str, dict]:
    """``{"exact": {depth: share}, "digits": {depth: share}}`` over the probes (keys are depth strings)."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    exact, digits = {}, {}
    try:
        for depth, samples in probes.items():
            hits, right = [], []
            for row in samples:  # one sample at a time: a 32K-token batch of logits is large
                inputs = row[None, :-1]
                with _autocast(device, cfg):
                    logits = model(inputs, torch.arange(inputs.shape[1], device=device)[None], attention)
                e, d = passkey_scores(logits.float(), row[None], cfg.digits)
                hits.append(float(e[0]))
                right.append(float(d[0]))
            exact[str(depth)], digits[str(depth)] = statistics.mean(hits), statistics.mean(right)
    finally:
        model.train(was_training)
    return {"exact": exact, "digits": digits}


def _capture(model, inputs, attention, cfg) -> list[tuple[torch.Tensor, ...]]:
    """Per layer ``(q, k, v)`` of one forward over ``inputs`` with ``attention``."""
    captured = []

    def recording(q, k, v):
        captured.append((q.detach(), k.detach(), v.detach()))
        return attention(q, k, v)

    positions = torch.arange(inputs.shape[1], device=inputs.device).expand_as(inputs)
    with torch.no_grad(), _autocast(inputs.device, cfg):
        model(inputs, positions, recording)
    return captured


def _fwd_bwd_ms(layers, attentions, cfg, device) -> float:
    """Median milliseconds of forward + backward of ``attentions[i]`` (one callable per layer) over every
    layer's captured q, k, v."""
    from ..bench.harness import time_ms

    leaves = [tuple(x.clone().requires_grad_() for x in qkv) for qkv in layers]
    grads = [torch.randn_like(q) for q, _, _ in leaves]

    def step():
        for (q, k, v), do, attention in zip(leaves, grads, attentions, strict=True):
            attention(q, k, v).backward(do)

    return time_ms(step, warmup=1, rep=cfg.timing_reps, device=device,
                   grad_to_none=[x for qkv in leaves for x in qkv])


def _under_patterns(patterns: list[VerticalSlashPattern]):
    """Attention on ``[B, N, H, D]`` with ``patterns[b]`` for sequence ``b`` (their indexes cached)."""
    def attention(q, k, v):
        return torch.stack([sparse_attention(q[b], k[b], v[b], p) for b, p in enumerate(patterns)])

    return attention


def attention_times(model, variant: str, attention, inputs, cfg: ExperimentConfig) -> dict[str, float]:
    """Attention forward + backward per training step (``inputs``: one training batch): ``attention_ms``
    as trained, ``kernel_ms`` under fixed patterns, and ``estimate_ms``, their difference (``sparse``)."""
    device = inputs.device
    layers = _capture(model, inputs, attention, cfg)
    total = _fwd_bwd_ms(layers, [attention] * len(layers), cfg, device)
    if variant != "sparse":
        return {"attention_ms": total, "kernel_ms": total, "estimate_ms": 0.0}
    fixed = [_under_patterns([attention.pattern_for(q[b], k[b]) for b in range(q.shape[0])])
             for q, k, _ in layers]
    kernel = _fwd_bwd_ms(layers, fixed, cfg, device)
    return {"attention_ms": total, "kernel_ms": kernel, "estimate_ms": max(total - kernel, 0.0)}


# ---------------------------------------------------------------------------------------------- one seed
def _evaluate(model, variant, attention, cfg, probes, device) -> dict:
    val = load_corpus("validation")  # evaluate_loss moves each window to the model's device
    with _autocast(device, cfg):
        own = evaluate_loss(model, val, attention=attention, seq_len=cfg.seq_len, batch_size=1,
                            max_windows=cfg.eval_windows)
        dense = own if variant == "dense" else evaluate_loss(model, val, seq_len=cfg.seq_len, batch_size=1,
                                                             max_windows=cfg.eval_windows)
    found = retrieval(model, attention, probes, cfg)
    found_dense = found if variant == "dense" else retrieval(model, causal_sdpa, probes, cfg)
    return {"val_loss": own, "val_loss_dense_eval": dense, "retrieval": found["exact"],
            "retrieval_digits": found["digits"], "retrieval_mean": statistics.mean(found["exact"].values()),
            "retrieval_dense_eval_mean": statistics.mean(found_dense["exact"].values())}


def run_seed(cfg: ExperimentConfig, seed: int, device, progress: bool = True) -> tuple[list[dict], dict]:
    """The protocol for one seed: ``(rows, histories)``, one row per variant."""
    start = time.perf_counter()
    torch.manual_seed(seed)
    base = TinyLM(cfg.model).to(device)
    histories = {f"pretrain/seed{seed}": pretrain(base, cfg, seed, progress)}
    probes = {depth: samples.to(device) for depth, samples in probe_set(
        load_corpus("validation"), cfg.depths, cfg.probes_per_depth, cfg.seq_len, cfg.digits,
        seed=10_000 + seed).items()}
    timing_generator = torch.Generator().manual_seed(20_000 + seed)
    timing_batch = passkey_batch(load_corpus("train"), cfg.batch_size, cfg.seq_len, timing_generator,
                                 share=1.0, digits=cfg.digits)[0].to(device)
    rows, sparse_fraction = [], None
    for variant in VARIANTS:
        phase_start = time.perf_counter()
        if variant == "dense":
            attention, fraction = causal_sdpa, 1.0
        elif variant == "sparse":
            attention = DynamicSparseAttention(cfg.budget())
        else:  # as many pairs as the sparse run computed
            window = window_pattern(cfg.model.n_heads, cfg.seq_len, sparse_fraction, sinks=cfg.sinks,
                                    block_size=cfg.block_size, device=device)
            attention, fraction = fixed_pattern_attention(window), window.density(cfg.seq_len)
        model = copy.deepcopy(base)
        history = train_phase(model, attention, cfg, seq_len=cfg.seq_len, steps=cfg.steps,
                              batch_size=cfg.batch_size, lr=cfg.extend_lr, seed=1_000 + seed,
                              desc=f"seed {seed}: {variant} at {cfg.seq_len}", progress=progress)
        histories[f"{variant}/seed{seed}"] = history
        if variant == "sparse":
            fraction = sparse_fraction = attention.stats.fraction
        row = {"seed": seed, "variant": variant, "pair_fraction": fraction,
               "step_ms": statistics.median(history["step_ms"][min(2, cfg.steps - 1):]),
               "train_loss_last": history["loss"][-1]}
        row.update(_evaluate(model, variant, attention, cfg, probes, device))
        row.update(attention_times(model, variant, attention, timing_batch, cfg))
        row["seconds"] = time.perf_counter() - phase_start
        rows.append(row)
        if progress:
            print(f"seed {seed} {variant}: val loss {row['val_loss']:.3f}, "
                  f"retrieval {row['retrieval_mean']:.2f}, attention {row['attention_ms']:.1f} ms, "
                  f"pairs {fraction:.3f}, {row['seconds']:.0f} s", flush=True)
    if progress:
        print(f"seed {seed}: {time.perf_counter() - start:.0f} s", flush=True)
    return rows, histories


def _result(cfg_dict: dict, rows: list[dict], histories: dict, seconds: float, device: str) -> dict:
    summary = summarize(rows)
    return {"config": cfg_dict, "rows": rows, "summary": summary, "targets": targets(summary),
            "histories": histories, "seconds": seconds, "device": device}


def run_experiment(cfg: ExperimentConfig | str = "quick", *, device=None, progress: bool = True,
                   on_seed=None) -> dict:
    """Every seed of ``cfg``, as ``{"config", "rows", "summary", "targets", "histories", "seconds",
    "device"}``. ``on_seed(result)`` receives the result of the seeds done so far after each seed (a
    long run saves what it has)."""
    cfg = MODES[cfg] if isinstance(cfg, str) else cfg
    if not cfg.seeds:
        raise ValueError("the configuration has no seeds to run")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    start = time.perf_counter()
    rows, histories = [], {}
    for done, seed in enumerate(cfg.seeds, start=1):
        seed_rows, seed_histories = run_seed(cfg, seed, device, progress)
        rows += seed_rows
        histories.update(seed_histories)
        # tuples as lists, as a saved result has them
        config = json.loads(json.dumps(asdict(replace(cfg, seeds=cfg.seeds[:done]))))
        result = _result(config, rows, histories, time.perf_counter() - start, str(device))
        if on_seed is not None:
            on_seed(result)
    return result


def merge_results(results: list[dict]) -> dict:
    """One result from runs of one configuration with different seeds (one process per seed)."""
    if not results:
        raise ValueError("merge_results needs at least one result")
    setting = {k: v for k, v in results[0]["config"].items() if k != "seeds"}
    for r in results[1:]:
        if {k: v for k, v in r["config"].items() if k != "seeds"} != setting:
            raise ValueError("results to merge must come from one configuration (apart from the seeds)")
    seeds = sorted(s for r in results for s in r["config"]["seeds"])
    if len(set(seeds)) < len(seeds):
        raise ValueError(f"results to merge repeat a seed: {seeds}")
    rows = sorted((row for r in results for row in r["rows"]), key=lambda row: row["seed"])
    histories = {k: _undefined_answer_loss(v) for r in results for k, v in r["histories"].items()}
    return _result({**setting, "seeds": seeds}, rows, histories, sum(r["seconds"] for r in results),
                   results[0]["device"])


def _undefined_answer_loss(history: dict) -> dict:
    """``history`` with NaN as the answer loss of every step whose batch held no passkey: the steps where
    the loss is the next-byte loss alone and the answer loss reads 0 (how per-seed files may record it)."""
    if "key_loss" not in history:
        return history
    key_loss = [math.nan if k == 0 and loss == lm else k
                for k, loss, lm in zip(history["key_loss"], history["loss"], history["lm_loss"], strict=True)]
    return {**history, "key_loss": key_loss}


# ---------------------------------------------------------------------------------------------- command line
COLUMNS = [("variant", "variant"), ("val_loss", "val loss"), ("retrieval_mean", "retrieval"),
           ("pair_fraction", "pairs"), ("attention_ms", "attn ms"), ("kernel_ms", "kernel ms"),
           ("step_ms", "step ms"), ("seeds", "seeds")]


def main(argv: list[str] | None = None) -> int:
    from ..bench.harness import add_out_argument, environment, print_table, write_results

    parser = argparse.ArgumentParser(prog="python -m treeattn_lab.experiments.sparse_training",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=sorted(MODES), default="quick")
    parser.add_argument("--seeds", type=seed_list, default=None, help="comma list, e.g. 0,1,2")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--merge", nargs="+", metavar="JSON", default=None,
                        help="join saved runs of this mode with different seeds; trains nothing")
    add_out_argument(parser)
    args = parser.parse_args(argv)
    cfg = MODES[args.mode]
    if args.seeds:
        cfg = replace(cfg, seeds=args.seeds)

    def save(result, env) -> Path:
        return write_results(f"{BENCH_NAME}-{args.mode}", result["rows"], env,
                             directory=Path(args.out) if args.out else None,
                             extra={k: v for k, v in result.items() if k != "rows"})
    if args.merge:
        saved = [json.loads(Path(f).read_text()) for f in args.merge]
        mode = {k: v for k, v in json.loads(json.dumps(asdict(cfg))).items() if k != "seeds"}
        if any({k: v for k, v in s["config"].items() if k != "seeds"} != mode for s in saved):
            parser.error(f"the results to merge were not all run in --mode {args.mode}")
        env = saved[0]["environment"]  # where they ran, not here
        result = merge_results(saved)
    else:
        env = environment()

        def save_so_far(partial):
            print(f"seeds {partial['config']['seeds']} saved in {save(partial, env)}", flush=True)

        result = run_experiment(cfg, device=args.device, progress=not args.no_progress, on_seed=save_so_far)
    print_table(f"Training with dynamic sparse attention ({args.mode}, {result['device']}, "
                f"{result['seconds']:.0f} s)", COLUMNS, result["summary"])
    for name, t in result["targets"].items():
        print(f"{name}: {t['value']:.3f} ({verdict(t)})")
    print(f"wrote {save(result, env)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
