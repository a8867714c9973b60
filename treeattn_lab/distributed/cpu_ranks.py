"""Several ranks on one CPU: fresh processes joined in a gloo group, each running the same function.

:func:`spawn` is torchrun for tests, notebooks and small demos: ``spawn(2, fn, kwargs)`` starts two
processes, joins them in a gloo group (through a file in a temporary folder), runs ``fn(**kwargs)`` on
each and returns every rank's outcome, ``{"ok": True, "value": ...}`` or ``{"ok": False, "error":
exception type name, "message": ...}``. Each rank writes its outcome atomically (temporary file, then
``os.replace``), so an outcome is either whole or missing; a rank that ends without one is reported by
rank and exit code, and ranks still running at the deadline are killed. :func:`run_cases` runs several
cases in one group, each case's exception caught on its own.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ..atomic import atomic_writer


def outcome(fn: Callable, kwargs: dict) -> dict:
    """``{"ok": True, "value": fn(**kwargs)}``, or the exception as ``{"ok": False, "error", "message"}``."""
    try:
        return {"ok": True, "value": fn(**kwargs)}
    except Exception as e:
        return {"ok": False, "error": type(e).__name__, "message": str(e)}


def run_cases(fn: Callable, cases: list[dict]) -> list[dict]:
    """:func:`outcome` of ``fn(**case)`` for each case in turn, on the same ranks (through :func:`spawn`).

    A case that breaks the group (a hung or lost rank) should come last."""
    return [outcome(fn, case) for case in cases]


def _spawned_worker(rank, world, init_file, out_dir, fn, kwargs, timeout_s):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )
    result = outcome(fn, kwargs)
    with atomic_writer(Path(out_dir) / f"rank{rank}.pt", binary=True) as f:
        torch.save(result, f)
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


def _results(tmp: str, processes) -> list[dict]:
    """Every rank's outcome, or a clear error naming each rank that ended without one."""
    missing = [r for r in range(len(processes)) if not (Path(tmp) / f"rank{r}.pt").exists()]
    if missing:
        detail = ", ".join(f"rank {r} exited with code {processes[r].exitcode}" for r in missing)
        raise RuntimeError(
            f"{detail} without a result: the process ended before fn returned or raised (sys.exit or "
            "os._exit inside fn)"
        )
    return [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False) for r in range(len(processes))]


def spawn(
    world: int,
    fn: Callable,
    kwargs: dict | None = None,
    *,
    timeout_s: float = 120.0,
    collective_timeout_s: float = 60.0,
) -> list[dict]:
    """Run ``fn(**kwargs)`` on ``world`` fresh CPU processes joined in a gloo group.

    ``fn`` must be importable (a module-level function). Returns each rank's outcome, ``{"ok": True,
    "value": ...}`` or ``{"ok": False, "error": exception type name, "message": ...}``. Collectives time
    out after ``collective_timeout_s``. Kills the ranks it started and raises TimeoutError when they are
    not all done within ``timeout_s``; raises RuntimeError naming the rank and its exit code when a rank
    ends without an outcome.
    """
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        ctx = mp.start_processes(
            _spawned_worker,
            nprocs=world,
            join=False,
            start_method="spawn",
            args=(world, init_file, tmp, fn, kwargs or {}, collective_timeout_s),
        )
        deadline = time.monotonic() + timeout_s
        while not ctx.join(timeout=0.5):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise TimeoutError(f"{world} spawned ranks did not finish within {timeout_s:g} s")
        return _results(tmp, ctx.processes)
