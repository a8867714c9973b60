"""The results document, ``docs/results.md``, generated from the result files in ``bench/results/``.

``python -m treeattn_lab results`` writes it (atomically); ``--check`` compares the committed document
with what the JSON gives and fails when they differ, so a table cannot drift from its run. Every number
in the document is read from a result file: nothing here types a measurement.

Each result file ``<label>__<device>__torch-<v>__triton-<v>.json`` holds ``bench`` (what ran),
``environment`` (GPU, versions, time), ``rows`` and extra fields. A renderer per ``bench`` turns a file
into tables; files of an unknown ``bench`` get a plain table of their rows, and files that are not JSON
(logs) are listed, not parsed. Each file's heading names its GPU, versions and the command that produced
it: the ``command`` the harness records, or for files written before it did, the command below.
"""

from __future__ import annotations

import difflib
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..atomic import write_text_atomic
from .experiment_report import render_grpo, render_rat, render_recall, render_sparse_training
from .markdown import fmt, mapping, median_of, pivot, records, render_rows, table
from .recorded_commands import RECORDED_COMMANDS

__all__ = ["SECTIONS", "check_document", "render_document", "write_document"]

# ------------------------------------------------------------------------------------------ renderers
def render_tree(p: dict) -> list[str]:
    """``bench tree``: forward+backward ms per case and backend (with the speed-up over flat SDPA),
    forward TFLOP/s of useful pairs, and the bf16 errors of ``--check``."""
    rows = p["rows"]

    def with_speedup(group):
        r = group[0]
        ratio = f" ({fmt(r['fwd_bwd_speedup'])}x)" if "fwd_bwd_speedup" in r else ""
        picks = f", picks {r['auto_picks']}" if r.get("auto_picks") else ""
        return f"{fmt(r['fwd_bwd_ms'])}{ratio}{picks}"

    out = ["Forward + backward ms per backend (x flat SDPA):", ""]
    out += pivot(rows, ("case", "T", "ideal"), "backend", with_speedup)
    out += ["Forward ms / useful TFLOP/s per backend:", ""]
    out += pivot(rows, ("case",), "backend", lambda g: f"{fmt(g[0]['fwd_ms'])} / {fmt(g[0]['fwd_tflops'])}")
    checked = [r for r in rows if "rel_err_out" in r]
    if checked:
        out += ["bf16 against an fp32 per-sequence reference (relative error):", ""]
        out += records(checked, ("case", "backend", "rel_err_out", "rel_err_dq", "rel_err_dk", "rel_err_dv"))
    return out


def render_tree_tune(p: dict) -> list[str]:
    """``bench tree-tune``: ms per launch configuration and case, one table per pass."""
    out = []
    for name in dict.fromkeys(r["pass"] for r in p["rows"]):
        out += [f"Pass `{name}`, ms:", ""]
        out += pivot([r for r in p["rows"] if r["pass"] == name], ("config",), "case", median_of("ms"))
    errors = {r["error"] for r in p["rows"] if r.get("error")}
    out += [f"Error: {e}" for e in sorted(errors)] + ([""] if errors else [])
    return out


def render_tree_profile(p: dict) -> list[str]:
    """Per-kernel CUDA times of one forward+backward step, per case and variant."""
    out = ["Total kernel ms per step:", ""] + pivot(p["rows"], ("variant",), "case", median_of("total_ms"))
    rows = [{"case": r["case"], "variant": r["variant"], **{k: v for k, v in r["kernels_ms"].items()
                                                             if k.startswith("_")}} for r in p["rows"]]
    kernels = list(dict.fromkeys(k for r in rows for k in r if k.startswith("_")))
    return out + ["The lab's kernels, ms:", ""] + records(rows, ["case", "variant", *kernels])


def render_sparse(p: dict) -> list[str]:
    """``bench sparse``: the block-sparse kernel against dense SDPA, its check and tuning trials."""
    out = records(p["rows"], ("case", "tokens", "density", "ideal", "tiles_per_block", "backend", "fwd_ms",
                              "fwd_bwd_ms", "fwd_speedup", "fwd_bwd_speedup", "fwd_tflops"),
                  {"fwd_speedup": "fwd x dense", "fwd_bwd_speedup": "fwd+bwd x dense"})
    if "check" in p:
        out += [f"bf16 against fp32 (relative error): {mapping(p['check'])}", ""]
    for case, parts in p.get("breakdown", {}).items():
        kernels = {k: v for k, v in parts.get("kernel_ms", {}).items() if k.startswith("_")}
        steps = {k: v for k, v in parts.items() if k != "kernel_ms"}
        out += [f"{case}, ms by step: {mapping(steps)}; by kernel: {mapping(kernels)}", ""]
    if p.get("tune"):
        out += ["Launch settings tried:", ""] + records(p["tune"], ("case", "config", "fwd_ms", "fwd_bwd_ms"))
    return out


def render_ring(p: dict) -> list[str]:
    """Ring attention across GPUs against one GPU running the whole sequence."""
    return records(p["rows"], ("variant", "nccl_high_priority_streams", "layout", "tokens", "world",
                               "single_fwd_bwd_ms", "ring_fwd_bwd_ms", "fwd_bwd_speedup", "fwd_speedup",
                               "rel_err_out", "rel_err_dk", "source"),
                   {"nccl_high_priority_streams": "high-priority NCCL",
                    "single_fwd_bwd_ms": "one GPU fwd+bwd ms",
                    "ring_fwd_bwd_ms": "ring fwd+bwd ms", "fwd_bwd_speedup": "fwd+bwd x one GPU",
                    "fwd_speedup": "fwd x one GPU"})


def render_timeline(p: dict) -> list[str]:
    """A profiled ring step: GPU ms per kernel family and the span of the step, per run."""

    def busy(group):
        return fmt(sum(r["ms"] for r in group))

    spans = {run: max(r["start_ms"] + r["ms"] for r in p["rows"] if r["run"] == run)
             for run in dict.fromkeys(r["run"] for r in p["rows"])}
    out = ["GPU ms per kernel family (activities over the threshold):", ""]
    out += pivot(p["rows"], ("run",), "family", busy)
    return out + [f"Span of `{run}`: {fmt(ms)} ms" for run, ms in spans.items()] + [""]


def render_dilated(p: dict) -> list[str]:
    """``bench dilated``: the dilated kernel against dense SDPA and FlexAttention, checks and tuning."""
    out = records(p["rows"], ("case", "backend", "fwd_ms", "fwd_bwd_ms", "fwd_speedup", "fwd_bwd_speedup",
                              "ideal", "kv_cache_ratio", "fwd_tflops", "fwd_bwd_tflops"),
                  {"fwd_speedup": "fwd x dense", "fwd_bwd_speedup": "fwd+bwd x dense"})
    if p.get("checks"):
        out += ["bf16 against fp32 masked SDPA (relative error):", ""]
        out += records(p["checks"], ("check", "rel_err_out", "rel_err_dq", "rel_err_dk", "rel_err_dv"))
    if p.get("tune_trials"):
        out += [f"Tuning trials (chosen: {mapping(p.get('tuned', {}))}):", ""]
        out += records(p["tune_trials"], ("kernel", "config", "ms"))
    for key in ("scan", "scan_tune"):
        if p.get(key):
            out += [f"Scan (`{key}`):", ""] + render_scan({"scan": p[key]})
    return out


def render_scan(p: dict) -> list[str]:
    """The gated scan against a ``copy_`` of the same bytes, one row per launch configuration."""
    out = records(p["scan"], ("case", "config", "fwd_ms", "bwd_ms", "fwd_GBps", "bwd_GBps", "copy_GBps",
                              "fwd_frac_copy", "bwd_frac_copy"))
    if "scan_check" in p:
        out += [f"Check against the fp32 loop: {mapping(p['scan_check'])}", ""]
    return out


def render_train(p: dict) -> list[str]:
    """``bench train``: one optimizer step per rollout set and engine mode."""

    def throughput(group):
        r = group[0]
        chose = f", chose {r['choices']}" if r["mode"].startswith("auto") else ""
        return f"{fmt(r['tokens_per_s'])} ({fmt(r['speedup'])}x){chose}"

    ratios = ("token_ratio", "work_ratio") if all("work_ratio" in r for r in p["rows"]) else ("token_ratio",)
    out = model_line(p)
    if p.get("partial"):
        out += ["A partial run: it stopped after the rows below, before its profile, precision and targets.",
                ""]
    out += ["Flat tokens per second (x flat):", ""]
    out += pivot(p["rows"], ("set", *ratios), "mode", throughput)
    out += ["Peak GiB:", ""] + pivot(p["rows"], ("set",), "mode", lambda g: fmt(g[0]["peak_gib"]))
    if p.get("refit"):
        out += refit_lines(p["refit"])
    if p.get("precision"):
        out += ["bf16 gradients against fp32 flat (relative norm):", ""]
        out += records(p["precision"], ("mode", "grad_rel_err"))
    return out


def refit_lines(refit: dict) -> list[str]:
    """What ``auto`` plans under a run's cost model and under its timings refitted offline, per set."""
    out = [f"Auto's plan, predicted seconds: the run's cost model against its timings refitted per attention "
           f"kernel (FA4 from a mean block rectangle of {fmt(refit['fa4_rectangle'])}):", ""]
    rows = [{"set": name, "model": which, "predicted s": plan["predicted_s"],
             "plan": ", ".join(f"{c['mode']}@{c['block_tokens']}" if c["mode"] == "dfs" else c["mode"]
                               for c in plan["micro_batches"])}
            for name, plans in refit["plans"].items() for which, plan in plans.items()]
    return out + records(rows, ("set", "model", "predicted s", "plan"))


def model_line(p: dict) -> list[str]:
    """The model's settings (and parameter count where recorded) and the engine's block and budget."""
    params = f"{fmt(p['params'])} parameters, " if "params" in p else ""
    return [f"Model: {params}{mapping(p.get('config', {}))}; block_tokens {fmt(p.get('block_tokens'))}, "
            f"token_budget {fmt(p.get('token_budget'))}.", ""]


def peaks_in_gib(row: dict) -> dict:
    """``row`` with each ``<phase>_peak`` (bytes, as ``bench rl`` records it) as ``<phase>_peak_gib``."""
    peak = {k: k.endswith("_peak") and isinstance(v, (int, float)) for k, v in row.items()}
    return {(f"{k}_gib" if peak[k] else k): (v / 2**30 if peak[k] else v) for k, v in row.items()}


def render_rl(p: dict) -> list[str]:
    """``bench rl``: one GRPO step per set and mode, its phases' seconds and peak memory in GiB."""
    rows = [peaks_in_gib(r) for r in p["rows"]]
    out = model_line(p)
    if p.get("grpo"):
        out += [f"GRPO loss: {mapping(p['grpo'])}.", ""]
    return out + render_rows({"rows": rows})


def render_multi_gpu(p: dict) -> list[str]:
    """Data-parallel training on a trie split over ranks, measured against the cost model's prediction."""
    return records(p["rows"], ("partitioner", "ranks", "step_s", "tokens_per_s", "speedup_vs_one_device",
                               "measured_makespan_s", "predicted_makespan_s", "prediction_error",
                               "measured_imbalance", "predicted_imbalance", "modes"))


def render_balance(p: dict) -> list[str]:
    """``bench balance``: imbalance (max / mean rank cost) per set, rank count and partitioner."""
    out = ["Imbalance (makespan / anchor's makespan):", ""]
    return out + pivot(p["rows"], ("set", "num_ranks"), "partitioner",
                       lambda g: f"{fmt(g[0]['imbalance'])} ({fmt(g[0]['makespan_vs_anchor'])})",
                       {"num_ranks": "K"})


def render_targets(targets: list[dict] | dict) -> list[str]:
    """A run's checked targets: a list of ``{target, value, goal, met}``, or a dict target -> the rest
    (with ``min`` or ``max`` as the goal). A target with ``met: None`` was not evaluated; its ``why``
    says so in its own column."""
    if isinstance(targets, dict):
        targets = [{"target": name, **t} for name, t in targets.items()]
    return ["Targets:", ""] + records(targets, ("target", "value", "goal", "min", "max", "met", "why"))


@dataclass(frozen=True)
class Section:
    title: str
    about: str
    renderers: dict[str, Callable[[dict], list[str]]]  # bench name (or name prefix ending in "-") -> renderer


SECTIONS = (
    Section("Tree attention", "The tree kernel against flat SDPA and FlexAttention on packed tries, its "
            "launch tuning and a per-kernel profile of its backward.",
            {"tree": render_tree, "tree-tune": render_tree_tune, "tree-bwd-profile": render_tree_profile}),
    Section("Training on a trie", "One training step through the engine per rollout set and mode, one "
            "GRPO step (log-probs of the old and reference policies, then the training pass), the GRPO "
            "loop flat against the tree, the same step with each decoder layer compiled, a dfs step with "
            "every block on one attention kernel, and a whole packed step under "
            "torch.compile(fullgraph=True).",
            {"train": render_train, "rl": render_rl, "grpo-tree-": render_grpo,
             "train-compiled-layers": render_train, "train-walk-probe": render_train,
             "train-kernel-refit": render_train,
             "dfs-kernels": render_rows, "compile": render_rows}),
    Section("Balancing a trie over ranks", "Partitioners over K ranks (simulated), and a measured "
            "data-parallel step on two GPUs.",
            {"balance": render_balance, "multi-gpu-train-2x": render_multi_gpu}),
    Section("Dynamic sparse attention", "The block-sparse kernel on vertical-slash patterns, the "
            "recall of attention mass by estimated patterns, and training with dynamic sparse attention.",
            {"sparse": render_sparse, "sparse-recall": render_recall,
             "sparse-training-": render_sparse_training}),
    Section("Sparse ring attention", "The sparse kernel in a ring across GPUs, its variants and a profiled "
            "step.", {"sparse-ring": render_ring, "sparse-ring-variants": render_ring,
                      "sparse-ring-timeline": render_timeline}),
    Section("Dilated attention and the scan", "The dilated kernel and the gated recurrence (scan) of RAT+.",
            {"dilated": render_dilated, "scan": render_scan}),
    Section("Train dense, infer sparse (RAT+)", "Loss of densely trained models run with dilated attention.",
            {"rat-dilation-": render_rat}),
    Section("The notebooks", "How long each guided notebook takes top to bottom, as a learner runs it.",
            {"notebooks": render_rows, "notebooks-quick": render_rows}),
)


# ------------------------------------------------------------------------------------------ document
def renderer_for(bench: str) -> tuple[Section | None, int, Callable[[dict], list[str]]]:
    """The section a ``bench`` belongs to, the renderer's place in it, and the renderer."""
    for section in SECTIONS:
        for place, (name, render) in enumerate(section.renderers.items()):
            if bench == name or (name.endswith("-") and bench.startswith(name)):
                return section, place, render
    return None, 0, render_rows


def command_of(label: str, p: dict) -> str:
    """The recorded command line in backticks, with a remark where one command is not the whole story."""
    command = p.get("command") or RECORDED_COMMANDS.get(label)
    if command is None and p.get("bench") == "sparse-recall" and "config" in p:
        c = p["config"]
        command = (f"python -m treeattn_lab.experiments.sparse_recall --steps {c['steps']} "
                   f"--seq-len {c['seq_len']} --windows {c['windows']}")
    command, remark = command if isinstance(command, tuple) else (command, None)
    if command is None:
        return remark or "not recorded"
    text = f"`{command}`" + (f" ({remark})" if remark else "")
    parts = p.get("merged_from") or p.get("seeds")
    if isinstance(parts, list) and parts and all(isinstance(c, str) for c in parts):
        text = ", ".join(f"`{c}`" for c in parts) + f", one process each, then {text}"
    return text


def file_heading(path: Path, p: dict) -> list[str]:
    """The file, its GPU and versions, and the command that produced it."""
    env = dict(p.get("environment", {}))
    device = env.pop("device", "?")
    cuda = f" (CUDA {env.pop('cuda')})" if "cuda" in env else ""
    versions = f"torch {env.pop('torch', '?')}, triton {env.pop('triton', '?')}"
    when = env.pop("time_utc", "")
    label = path.name.split("__")[0]
    out = [f"### {label}, {device}", "", f"`bench/results/{path.name}`: {device}{cuda}, {versions}"
           + (f", {mapping(env)}" if env else "") + (f", run {when}" if when else "") + ".", "",
           f"Command: {command_of(label, p)}", ""]
    extras = {k: p[k] for k in ("dtype", "heads", "head_dim") if k in p}
    if extras:
        out += [f"Settings: {mapping(extras)}.", ""]
    for key in ("what", "how", "notes", "pattern"):
        for text in ([p[key]] if isinstance(p.get(key), str) else p.get(key) or []):
            out += [f"Note: {fmt(text)}", ""]
    return out


BEFORE = "-before-redesign"  # a run of the code before the house redesign, beside a run of the code after it


def _change(before: float, after: float) -> str:
    return f"{fmt(before)} -> {fmt(after)} ({fmt(after / before)})"


def render_before_after(loaded: Sequence[tuple[Path, dict]]) -> list[str]:
    """For each ``<bench>-before-redesign`` file with a ``<bench>`` file of the same GPU: per case and
    backend, forward and forward+backward ms after / before the redesign."""
    by_name = {path.name: payload for path, payload in loaded}
    out = []
    for name, before in sorted(by_name.items()):
        label, _, rest = name.partition("__")
        after = by_name.get(f"{label[: -len(BEFORE)]}__{rest}") if label.endswith(BEFORE) else None
        if after is None:
            continue
        old = {(r["case"], r["backend"]): r for r in before["rows"]}
        cells = [[r["case"], r["backend"]] + [_change(old[key][m], r[m]) for m in ("fwd_ms", "fwd_bwd_ms")]
                 for r in after["rows"] if (key := (r["case"], r["backend"])) in old]
        bench = label[: -len(BEFORE)]
        out += [f"### {bench}: `{name}` -> `{bench}__{rest}`", ""]
        out += table(["case", "backend", "fwd ms before -> after (ratio)",
                      "fwd+bwd ms before -> after (ratio)"], cells)
    return out


def slug(title: str) -> str:
    """The anchor GitHub gives a heading."""
    return "".join(c for c in title.lower().replace(" ", "-") if c.isalnum() or c in "-_")


def render_document(results_dir: Path | str) -> str:
    """The whole document for the result files in ``results_dir``, as markdown text."""
    results_dir = Path(results_dir)
    if not results_dir.is_dir():
        raise FileNotFoundError(f"no results folder {results_dir}")
    placed: dict[str, list[str]] = {s.title: [] for s in SECTIONS}
    placed["Other results"] = []
    loaded = []
    for path in sorted(results_dir.glob("*__*.json")):
        try:
            loaded.append((path, json.loads(path.read_text())))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not valid JSON: {exc}") from None
    # within a section: benchmarks in the section's order, each one's plain run (label == bench) first
    loaded.sort(key=lambda item: (renderer_for(str(item[1].get("bench", "")))[1],
                                  item[0].name.split("__")[0] != item[1].get("bench"), item[0].name))
    for path, payload in loaded:
        section, _, render = renderer_for(str(payload.get("bench", "")))
        lines = file_heading(path, payload) + render(payload)
        if payload.get("targets"):
            lines += render_targets(payload["targets"])
        placed[section.title if section else "Other results"] += lines
    out = ["# Measured results", "",
           "Generated by `python -m treeattn_lab results` from `bench/results/*.json`; do not edit by hand "
           "(`python -m treeattn_lab results --check` fails when this file and the JSON disagree). Numbers "
           "have three significant digits; \"x base\" is the speed-up over the first backend of the table "
           "(flat or dense SDPA). [design.md](design.md) explains what the runs mean for the design.", ""]
    compared = render_before_after(loaded)
    if compared:
        placed["Before and after the house redesign"] = compared
    abouts = {s.title: s.about for s in SECTIONS}
    abouts["Before and after the house redesign"] = (
        "The same benchmarks run on one H200 with the code before the redesign of the kernels into one "
        "attention core and after it; a ratio above 1 is slower after.")
    others = sorted(f.name for f in results_dir.iterdir() if f.is_file() and not f.name.endswith(".json"))
    titles = [t for t, lines in placed.items() if lines] + (["Other files"] if others else [])
    out += [f"- [{t}](#{slug(t)})" for t in titles] + [""]
    for title in titles[: len(titles) - bool(others)]:
        out += [f"## {title}", ""] + ([abouts[title], ""] if title in abouts else []) + placed[title]
    if others:
        out += ["## Other files", "", "Kept beside the JSON and not parsed:", ""]
        out += [f"- `bench/results/{name}`" for name in others] + [""]
    return "\n".join(out).rstrip("\n") + "\n"


def write_document(results_dir: Path | str = "bench/results", out: Path | str = "docs/results.md") -> Path:
    """Write the document to ``out`` through a temporary file and ``os.replace``."""
    out, text = Path(out), render_document(results_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out, text)
    return out


def check_document(results_dir: Path | str = "bench/results", out: Path | str = "docs/results.md") -> int:
    """0 when ``out`` is what the JSON gives, else 1 with a diff on stderr."""
    want = render_document(results_dir)
    out = Path(out)
    have = out.read_text() if out.exists() else ""
    if have == want:
        print(f"{out} matches {results_dir}")
        return 0
    diff = difflib.unified_diff(have.splitlines(), want.splitlines(), str(out), "from the JSON", lineterm="")
    print(f"{out} differs from what {results_dir} gives; run `python -m treeattn_lab results`:",
          *list(diff)[:60], sep="\n", file=sys.stderr)
    return 1
