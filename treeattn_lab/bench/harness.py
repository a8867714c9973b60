"""Benchmark plumbing shared by every ``python -m treeattn_lab bench ...`` command.

- :func:`time_ms`: median milliseconds of a callable, with CUDA events (``triton.testing.do_bench``) on a
  GPU and ``time.perf_counter`` on the CPU.
- :func:`environment`: the GPU and versions, recorded in every result file.
- :func:`write_results`: JSON under ``bench/results/`` named with the benchmark, GPU, torch and triton.
- :func:`print_table`: a rich table (plain text when rich is missing).
"""

from __future__ import annotations

import json
import re
import statistics
import time
from pathlib import Path

import torch

RESULTS_DIR = Path(__file__).resolve().parents[2] / "bench" / "results"


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
    return env


def result_path(bench: str, env: dict, directory: Path | None = None) -> Path:
    tag = f"{bench}__{env['device']}__torch-{env['torch']}__triton-{env['triton']}"
    tag = re.sub(r"[^A-Za-z0-9._-]+", "-", tag)
    return (directory or RESULTS_DIR) / f"{tag}.json"


def write_results(bench: str, rows: list[dict], env: dict, *, directory: Path | None = None,
                  extra: dict | None = None) -> Path:
    path = result_path(bench, env, directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"bench": bench, "environment": env, "rows": rows, **(extra or {})}
    path.write_text(json.dumps(payload, indent=1) + "\n")
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
