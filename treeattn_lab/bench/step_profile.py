"""One engine step timed and profiled: its wall time, and under ``torch.profiler`` the aten ops it issues,
its host reads and device syncs, its kernel launches and the share of its wall time the GPU was busy.
What ``bench train --profile`` reports, and what notebook 02 draws."""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
import time
from collections.abc import Iterator

from ..engine import tree_backward
from .harness import synchronize

# Profiled events that read a tensor's value on the host: a scalar's value (``.item()``, ``bool()``,
# ``float()``, ``.tolist()`` of one element) and nonzero's output size. Copies of whole tensors to the host
# (``.cpu()``, ``.tolist()``) show as copies, not here.
HOST_READ_OPS = ("aten::_local_scalar_dense", "aten::nonzero")
# CUDA runtime calls in which the host waits for the GPU.
DEVICE_SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
KERNEL_LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")
# Lines the profiler's C++ library (kineto) writes to the process's stderr whenever a trace starts or
# stops ("USDT:... profiler_start", "STAGE:... Completed Stage: Warm Up"): progress marks, not problems.
PROFILER_MARKS = re.compile(r"^(USDT|STAGE):")


@contextlib.contextmanager
def profiler_marks_dropped() -> Iterator[None]:
    """Run the block with file descriptor 2 (the C++ stderr, which a notebook shows in red) sent to a
    temporary file, then write back to ``sys.stderr`` every line of it but the profiler's progress marks
    (:data:`PROFILER_MARKS`). Meant for the profiler's start and stop, not for the profiled work."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no file descriptor 2 to redirect: leave stderr as it is
        yield
        return
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        caught.seek(0)
        kept = [line for line in caught.read().decode(errors="replace").splitlines(keepends=True)
                if not PROFILER_MARKS.match(line)]
    if kept:
        sys.stderr.write("".join(kept))


def timed_tree_backward(model, trie, *, mode: str, **engine) -> float:
    """Wall seconds of one ``tree_backward`` from zeroed gradients, the device synchronized around it."""
    device = next(model.parameters()).device
    model.zero_grad(set_to_none=True)
    synchronize(device)
    t0 = time.perf_counter()
    tree_backward(model, trie, None, mode=mode, **engine)
    synchronize(device)
    return time.perf_counter() - t0


def profile_step(model, trie, *, mode: str, **engine) -> dict:
    """One ``tree_backward`` under ``torch.profiler``: aten ops; host reads (:data:`HOST_READ_OPS`, from a
    CPU tensor as from a device one); on CUDA, device syncs (:data:`DEVICE_SYNC_CALLS`: every host read
    of a device tensor is one, and so is an explicit synchronize), kernel launches, GPU seconds (kernels,
    copies, memsets) and the busy share: GPU seconds / the wall time of the same call run without the
    profiler (``wall_s``: the shorter of two runs after a warm-up; ``profiled_wall_s`` under it).
    The profiler's progress marks on stderr are dropped (:func:`profiler_marks_dropped`)."""
    from torch.profiler import ProfilerActivity, profile

    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    # a warm-up (caches, autotuning, compiled sizes, allocator), then the wall time without the profiler
    walls = [timed_tree_backward(model, trie, mode=mode, **engine) for _ in range(3)]
    unprofiled = min(walls[1:])
    model.zero_grad(set_to_none=True)
    prof = profile(activities=activities)
    with profiler_marks_dropped():
        prof.start()
    try:
        t0 = time.perf_counter()
        tree_backward(model, trie, None, mode=mode, **engine)
        synchronize(device)
        wall = time.perf_counter() - t0
    finally:
        with profiler_marks_dropped():
            prof.stop()
    model.zero_grad(set_to_none=True)
    events = profiled_events(prof)
    names = [name for name, _, _ in events]
    row = {
        "mode": mode,
        "wall_s": unprofiled,
        "profiled_wall_s": wall,
        "aten_ops": sum(n.startswith("aten::") for n in names),
        "host_reads": sum(n in HOST_READ_OPS for n in names),
    }
    if cuda:
        busy = sum(seconds for _, on_device, seconds in events if on_device)  # kernels, copies, memsets
        row.update(
            device_syncs=sum(n in DEVICE_SYNC_CALLS for n in names),
            kernel_launches=sum(n in KERNEL_LAUNCH_CALLS for n in names),
            kernel_s=busy,
            busy_share=busy / unprofiled,
            idle_share=1 - busy / unprofiled,
        )
    return row


def _annotation(event) -> bool:
    """A range a ``record_function`` drew on the GPU's timeline: not work of the GPU."""
    flag = getattr(event, "is_user_annotation", None)
    return bool(flag()) if callable(flag) else False


def profiled_events(prof) -> list[tuple[str, bool, float]]:
    """``(name, on the device, seconds)`` of every profiled event, read from the raw trace (building
    the profiler's event tree for a few hundred thousand launches would take longer than the step)."""
    try:
        raw = prof.profiler.kineto_results.events()
        return [
            (e.name(), not str(e.device_type()).endswith("CPU") and not _annotation(e), e.duration_ns() / 1e9)
            for e in raw
        ]
    except AttributeError:  # a torch without the raw trace
        return [
            (e.name, not str(e.device_type).endswith("CPU"), e.time_range.elapsed_us() / 1e6)
            for e in prof.events()
        ]
