"""Benchmark plumbing shared by every ``python -m treeattn_lab bench ...`` command.

- :func:`time_ms`: median milliseconds of a callable, with CUDA events (``triton.testing.do_bench``) on a
  GPU and ``time.perf_counter`` on the CPU.
- :func:`environment`: the GPU and versions, recorded in every result file.
- :func:`write_results`: JSON named with the benchmark, GPU, torch and triton, written atomically under
  ``--out`` or ``./bench/results`` of the current working directory (never inside the installed package).
- :func:`positive_int`, :func:`int_list`, :func:`choice_list`, :func:`out_dir`: argparse types, so bad
  options stop with a usage error before anything runs.
- :func:`print_table`: a rich table (plain text when rich is missing).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from ..atomic import write_text_atomic
from ..runtime import package_version

# The results committed with a source checkout (read by the notebooks and the results document). Runs
# write to default_results_dir() instead, so an installed package never writes into site-packages.
RESULTS_DIR = Path(__file__).resolve().parents[2] / "bench" / "results"


def default_results_dir() -> Path:
    """``./bench/results`` of the current working directory: where runs write without ``--out``."""
    return Path.cwd() / "bench" / "results"


# ------------------------------------------------------------------------------------- argparse types
def positive_int(text: str) -> int:
    """An integer >= 1 (``--heads 0`` is a usage error, not a traceback from deep inside a kernel)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def int_list(text: str) -> list[int]:
    """A comma list of positive integers, e.g. ``2,4,8``."""
    items = [t.strip() for t in text.split(",")]
    if not all(items):
        raise argparse.ArgumentTypeError(f"expected a comma list of positive integers, got {text!r}")
    try:
        return [positive_int(t) for t in items]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected a comma list of positive integers, got {text!r}") from None


def choice_list(choices: Iterable[str]) -> Callable[[str], list[str]]:
    """An argparse type for a comma list whose every item is one of ``choices``."""
    allowed = tuple(choices)

    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",")]
        unknown = [t for t in items if t not in allowed]
        if unknown:
            raise argparse.ArgumentTypeError(
                f"unknown {', '.join(map(repr, unknown))}; choose from {', '.join(allowed)}")
        return items

    parse.__name__ = "comma list"  # argparse names the type in its messages
    return parse


def out_dir(text: str) -> Path:
    """A results folder that exists and is writable, or can be created (checked before a run starts, so
    a long run never ends unable to save; nothing is created here)."""
    path = Path(text).expanduser()
    probe = path
    while not probe.exists():
        if probe.is_symlink() or probe.parent == probe:
            raise argparse.ArgumentTypeError(f"{text!r}: cannot create this folder")
        probe = probe.parent
    if not probe.is_dir():
        what = "is a file, not a folder" if probe == path else f"cannot be created: {probe} is a file"
        raise argparse.ArgumentTypeError(f"{text!r} {what}")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text!r}: {probe} is not writable")
    return path


def add_out_argument(parser: argparse.ArgumentParser) -> None:
    """The ``--out`` option every benchmark shares, checked by :func:`out_dir` when parsed."""
    parser.add_argument("--out", type=out_dir, default=None,
                        help="results folder, checked before the run (default ./bench/results)")


# ------------------------------------------------------------------------------------------- timing
def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work (a no-op off CUDA), so that a host clock times it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def flat_gradient(model) -> torch.Tensor:
    """Every parameter's ``.grad`` as one fp32 vector (to compare the gradients of two runs)."""
    return torch.cat([p.grad.detach().float().flatten() for p in model.parameters()])


def time_ms(fn, *, warmup: int = 3, rep: int = 10, grad_to_none=None, device=None) -> float:
    """Median wall time of ``fn()`` in milliseconds (events on CUDA, perf_counter on CPU)."""
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none, return_mode="median"))
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(rep):
        if grad_to_none:
            for x in grad_to_none:
                x.grad = None
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


# ------------------------------------------------------------------------------------------ results
def environment() -> dict:
    import triton

    env = {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if torch.cuda.is_available():
        env["cuda"] = torch.version.cuda
    fa4 = package_version("flash-attn-4")
    if fa4 is not None:
        env["flash_attn_4"] = fa4
    return env


def command_line() -> str:
    """The command that is running, as a user would type it (``python -m treeattn_lab bench tree ...``)."""
    argv = list(getattr(sys, "orig_argv", sys.argv))
    if argv and Path(argv[0]).name.startswith("python"):
        argv[0] = "python"
    return shlex.join(argv)


def result_path(bench: str, env: dict, directory: Path | None = None) -> Path:
    tag = f"{bench}__{env['device']}__torch-{env['torch']}__triton-{env['triton']}"
    tag = re.sub(r"[^A-Za-z0-9._-]+", "-", tag)
    return Path(directory if directory is not None else default_results_dir()) / f"{tag}.json"


def write_results(bench: str, rows: list[dict], env: dict, *, directory: Path | None = None,
                  extra: dict | None = None) -> Path:
    """Save a run as ``<directory>/<bench>__<device>__torch-<v>__triton-<v>.json``: the rows, the
    environment, the command line and ``extra``. ``directory`` defaults to ``./bench/results``."""
    path = result_path(bench, env, directory)
    payload = {"bench": bench, "environment": env, "command": command_line(), "rows": rows, **(extra or {})}
    text = json.dumps(payload, indent=1) + "\n"  # before touching the folder: a row that is not JSON fails
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, text)
    return path


def print_table(title: str, columns: list[tuple[str, str]], rows: list[dict]) -> None:
    """Print ``rows`` with ``columns`` = [(key, header)], numbers to 3 significant digits."""

    def fmt(x):
        if isinstance(x, float):
            return f"{x:.3g}" if abs(x) < 1000 else f"{x:.0f}"
        return "" if x is None else str(x)

    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # pragma: no cover
        print(title)
        print(" | ".join(h for _, h in columns))
        for r in rows:
            print(" | ".join(fmt(r.get(k)) for k, _ in columns))
        return
    table = Table(title=title)
    for _, header in columns:
        table.add_column(header, justify="right")
    for r in rows:
        table.add_row(*(fmt(r.get(k)) for k, _ in columns))
    Console(width=200).print(table)
