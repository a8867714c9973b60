"""What a :class:`~.live.LiveMonitor` records: samples of the machine (host and GPUs) and steps."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GpuSample:
    """One GPU at one instant. Memory in MiB; ``utilization`` in percent, None without NVML."""

    device: int
    allocated_mib: float
    reserved_mib: float
    peak_mib: float
    utilization: float | None


@dataclass(frozen=True)
class Sample:
    """One tick of the sampling thread: seconds since the monitor started, host RSS (MiB), each GPU."""

    t_s: float
    rss_mib: float | None
    gpus: tuple[GpuSample, ...]


@dataclass(frozen=True)
class Step:
    """One step: its number (counting from 0 since the start), when it ended, its latency, its label."""

    index: int
    t_s: float
    latency_ms: float
    label: str | None
