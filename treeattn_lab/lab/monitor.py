"""LiveMonitor: watch memory and per-step latency while work runs, live in a notebook.

    from treeattn_lab.lab.monitor import LiveMonitor

    with LiveMonitor(title="tree attention") as mon:
        for i in range(8):
            out = tree_attention(q, k, v, pack)
            mon.lap(label=f"step {i}")        # the time since the last step (CUDA synchronised first)
        # or, with a latency measured elsewhere: mon.step(latency_ms=time_ms(fn), label="triton")

What it records
    *Samples*, taken by a background thread ``hz`` times a second (15 by default) into a bounded history:
    for every GPU the memory the caching allocator has handed out to tensors (``allocated``), the memory
    it holds from the driver (``reserved``) and the highest ``allocated`` so far (``peak``, reset when the
    monitor starts), plus the GPU's utilisation through NVML where ``pynvml`` (``nvidia-ml-py``) is
    importable; and the resident memory of this process on the host (RSS, through ``psutil``).
    *Steps*: one latency per :meth:`LiveMonitor.step` or :meth:`LiveMonitor.lap` call, with a label.

Where it shows them
    Inside a Jupyter kernel: a plotly ``FigureWidget`` with two panels, memory over time and latency per
    step. The sampling thread redraws it every ``refresh_s`` seconds, so it stays live even while the
    main thread is stuck in one long call; it is drawn once more, complete, on exit. Elsewhere (a script,
    a terminal, pytest) a short text summary is printed on exit. ``display="none"`` shows nothing; the
    histories stay readable through :attr:`samples`, :attr:`steps`, :meth:`stats` and :meth:`summary`.

Threads
    The sampler is a daemon thread, started on entry and always joined on exit, also when the body
    raises. It and :meth:`step` share the histories through a lock. Only one thread ever writes to the
    figure: the sampler while the block runs, the main thread after the sampler has been joined.
    Reading the allocator's counters never initialises CUDA; a GPU the process has not touched reads 0.

Nothing here needs a GPU, plotly or NVML: without them the monitor records what it can and says so.
"""

from __future__ import annotations

import math
import numbers
import statistics
import sys
import threading
import time
import warnings
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..checks import check_int

MIB = 2**20
DISPLAYS = ("auto", "widget", "text", "none")
GPU_COLORS = ("#4C78A8", "#E45756", "#54A24B", "#F58518", "#B279A2", "#72B7B2", "#EECA3B", "#9D755D")
HOST_COLOR = "#888888"


# ---------------------------------------------------------------------------------------- records
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


# ---------------------------------------------------------------------------------------- probes
def in_notebook() -> bool:
    """True inside a Jupyter kernel (JupyterLab, nbclient), False in a script or a terminal IPython."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return False
    shell = ipython.get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def host_rss_bytes() -> int | None:
    """Resident memory of this process (psutil; ``/proc/self/statm`` where psutil is missing)."""
    try:
        import psutil
    except ImportError:
        try:
            with open("/proc/self/statm") as f:
                import os

                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError, AttributeError):
            return None
    return psutil.Process().memory_info().rss


def nvml_utilization(device: int) -> float:
    """GPU utilisation in percent through NVML (``torch.cuda.utilization``, which maps the device index
    through ``CUDA_VISIBLE_DEVICES``); raises when pynvml or the driver is missing."""
    with warnings.catch_warnings():  # the deprecated "pynvml" package warns on import
        warnings.simplefilter("ignore")
        return float(torch.cuda.utilization(device))


def _gpu_name(device: int) -> str:
    """`` <name>`` of a GPU, or nothing while CUDA is uninitialised (asking would initialise it)."""
    return f" {torch.cuda.get_device_name(device)}" if torch.cuda.is_initialized() else ""


def _check_number(name: str, value, lo: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    value = float(value)
    if not lo <= value <= hi or not math.isfinite(value):  # also rejects NaN and infinities
        raise ValueError(f"{name} must be in [{lo:g}, {hi:g}], got {value}")
    return value


def _check_devices(devices) -> list[int]:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if devices == "auto":
        return list(range(count))
    if devices is None:
        return []
    if isinstance(devices, (str, bytes)) or not isinstance(devices, Sequence):
        raise TypeError(f"devices must be 'auto', None or a list of GPU indices, got {devices!r}")
    out = []
    for d in devices:
        if isinstance(d, bool) or not isinstance(d, numbers.Integral):
            raise TypeError(f"devices must hold GPU indices (ints), got {d!r}")
        if not 0 <= d < count:
            raise ValueError(f"GPU {d} does not exist here ({count} CUDA device(s) visible)")
        out.append(int(d))
    if len(set(out)) != len(out):
        raise ValueError(f"devices lists a GPU twice: {out}")
    return out


# ---------------------------------------------------------------------------------------- monitor
class LiveMonitor:
    """Context manager that samples memory in a background thread and collects per-step latencies.

    Args:
        title: shown on the figure and in the summary.
        hz: samples per second, 1 to 50 (default 15).
        max_samples / max_steps: history bounds; the oldest entries are dropped beyond them (the summary's
            peaks and counts still cover the whole run).
        display: ``"auto"`` (a live figure inside a Jupyter kernel, a text summary elsewhere),
            ``"widget"``, ``"text"`` or ``"none"``.
        devices: GPUs to watch: ``"auto"`` (every visible one), None (none) or a list of indices.
        refresh_s: seconds between redraws of the live figure (at least 0.1).
        reset_peak: reset torch's peak-memory counters on entry (when CUDA is initialised), so that
            ``peak`` is the peak of the monitored block. False leaves them alone.
    """

    def __init__(
        self,
        title: str = "LiveMonitor",
        *,
        hz: float = 15.0,
        max_samples: int = 3000,
        max_steps: int = 10_000,
        display: str = "auto",
        devices="auto",
        refresh_s: float = 0.5,
        reset_peak: bool = True,
    ):
        if not isinstance(title, str):
            raise TypeError(f"title must be a str, got {type(title).__name__}")
        if not isinstance(display, str):
            raise TypeError(f"display must be one of {DISPLAYS}, got {type(display).__name__}")
        if display not in DISPLAYS:
            raise ValueError(f"display must be one of {DISPLAYS}, got {display!r}")
        if not isinstance(reset_peak, bool):
            raise TypeError(f"reset_peak must be a bool, got {type(reset_peak).__name__}")
        self.title = title
        self.hz = _check_number("hz", hz, 1.0, 50.0)
        self.max_samples = check_int("max_samples", max_samples, minimum=2)
        self.max_steps = check_int("max_steps", max_steps, minimum=1)
        self.refresh_s = _check_number("refresh_s", refresh_s, 0.1, 3600.0)
        self.display = display
        self.devices = _check_devices(devices)
        self.reset_peak = reset_peak

        self._lock = threading.Lock()
        self._samples: deque[Sample] = deque(maxlen=self.max_samples)
        self._steps: deque[Step] = deque(maxlen=self.max_steps)
        self._thread: threading.Thread | None = None
        self._stop_event = threading.Event()
        self._figure = None
        self._mode = "none"  # what this run shows: "widget", "text" or "none"
        self._notes: list[str] = []  # what could not be measured or shown, and why
        self._nvml = False
        self._reset_run_state()

    def _reset_run_state(self) -> None:
        self._samples.clear()
        self._steps.clear()
        self._t0 = time.perf_counter()
        self._t_end: float | None = None
        self._last_mark = self._t0
        self._num_samples = 0
        self._num_ticks = 0  # samples taken by the thread (the rate counts these only)
        self._num_steps = 0
        self._maxima: dict[str, float] = {}  # whole-run maxima, e.g. "rss", "peak:0", "reserved:0"
        self._firsts: dict[str, float] = {}
        self._util_sum: dict[int, float] = {}
        self._util_count: dict[int, int] = {}
        self._sampler_error: BaseException | None = None
        self._redraw_error: BaseException | None = None
        self._exit_error: str | None = None

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> LiveMonitor:
        self.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is not None:
            self._exit_error = f"{exc_type.__name__}: {exc}"
        self.stop()
        return False  # never swallow the body's exception

    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self) -> LiveMonitor:
        """Start sampling (what ``with`` does on entry). A stopped monitor can start again, afresh."""
        if self.running:
            raise RuntimeError("this LiveMonitor is already running; a monitor cannot be nested in itself")
        self._reset_run_state()
        self._notes = []
        self._figure = None
        self._probe_devices()
        self._mode = self._choose_mode()
        self._stop_event.clear()
        if self._mode == "widget":  # the first figure of a session imports plotly: seconds, not measured
            from IPython.display import display

            self._figure = self.figure(widget=True)
            display(self._figure)
        self._t0 = self._last_mark = time.perf_counter()  # the clock starts with the body
        self._record_sample()  # one sample at t = 0, before the body runs
        self._thread = threading.Thread(target=self._run, name=f"LiveMonitor({self.title})", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop and join the sampler, take a last sample, then draw or print the result. Idempotent."""
        thread = self._thread
        if thread is None:
            return
        self._stop_event.set()
        thread.join()
        self._thread = None
        try:
            self._record_sample()
        except Exception as e:  # the summary says so; never mask the body's own exception
            self._sampler_error = self._sampler_error or e
        self._t_end = time.perf_counter()
        if self._mode == "widget" and self._figure is not None:
            self._redraw()
            if self._redraw_error is not None:  # the figure is stale: say so in text
                print(self.summary())
        elif self._mode == "text":
            print(self.summary())

    def _probe_devices(self) -> None:
        """Whether NVML answers for the watched GPUs; the peak counters reset if asked."""
        self._nvml = False
        if not self.devices:
            return
        if self.reset_peak and torch.cuda.is_initialized():
            for d in self.devices:
                torch.cuda.reset_peak_memory_stats(d)
        try:
            for d in self.devices:
                nvml_utilization(d)
            self._nvml = True
        except Exception as e:  # no pynvml, no driver access, ...: memory only
            self._notes.append(f"no GPU utilisation ({type(e).__name__}: {str(e)[:80]})")

    def _choose_mode(self) -> str:
        if self.display in ("text", "none"):
            return self.display
        if self.display == "auto" and not in_notebook():
            return "text"
        try:  # a FigureWidget needs plotly, and plotly 6+ needs anywidget for it
            import anywidget  # noqa: F401
            import plotly.graph_objects  # noqa: F401
        except ImportError as e:
            if self.display == "widget":
                raise ImportError(f"LiveMonitor(display='widget') needs plotly and anywidget: {e}") from e
            self._notes.append(f"no live figure ({e}); text summary instead")
            return "text"
        return "widget"

    # ------------------------------------------------------------------ sampling thread
    def _run(self) -> None:
        period = 1.0 / self.hz
        next_tick = time.perf_counter() + period
        last_draw = time.perf_counter()
        while not self._stop_event.wait(max(0.0, next_tick - time.perf_counter())):
            try:
                self._record_sample(tick=True)
            except Exception as e:  # report it in the summary rather than die silently
                self._sampler_error = e
                return
            now = time.perf_counter()
            next_tick = max(next_tick + period, now)  # a late tick is not made up for
            if self._figure is not None and self._redraw_error is None and now - last_draw >= self.refresh_s:
                self._redraw()
                last_draw = now

    def _record_sample(self, tick: bool = False) -> None:
        rss = host_rss_bytes()
        gpus = []
        for d in self.devices:
            util = None
            if self._nvml:
                try:
                    util = nvml_utilization(d)
                except Exception:
                    util = None
            gpus.append(
                GpuSample(
                    device=d,
                    allocated_mib=torch.cuda.memory_allocated(d) / MIB,
                    reserved_mib=torch.cuda.memory_reserved(d) / MIB,
                    peak_mib=torch.cuda.max_memory_allocated(d) / MIB,
                    utilization=util,
                )
            )
        sample = Sample(
            t_s=time.perf_counter() - self._t0, rss_mib=None if rss is None else rss / MIB, gpus=tuple(gpus)
        )
        values = {} if sample.rss_mib is None else {"rss": sample.rss_mib}
        for g in gpus:
            values.update({f"allocated:{g.device}": g.allocated_mib, f"reserved:{g.device}": g.reserved_mib})
            values[f"peak:{g.device}"] = g.peak_mib
        with self._lock:
            self._samples.append(sample)
            self._num_samples += 1
            self._num_ticks += tick
            for key, v in values.items():
                self._firsts.setdefault(key, v)
                self._maxima[key] = max(v, self._maxima.get(key, v))
            for g in gpus:
                if g.utilization is not None:
                    self._util_sum[g.device] = self._util_sum.get(g.device, 0.0) + g.utilization
                    self._util_count[g.device] = self._util_count.get(g.device, 0) + 1

    # ------------------------------------------------------------------ steps
    def step(self, latency_ms: float, *, label: str | None = None) -> Step:
        """Record one step that took ``latency_ms`` (measured by you, e.g. with CUDA events).

        Usable as a callback: ``on_step=mon.step``. Returns the recorded :class:`Step`.
        """
        latency_ms = _check_number("latency_ms", latency_ms, 0.0, math.inf)
        if label is not None and not isinstance(label, str):
            raise TypeError(f"label must be a str or None, got {type(label).__name__}")
        if not self.running:
            raise RuntimeError("record steps inside `with LiveMonitor(...) as mon:` (or after mon.start())")
        now = time.perf_counter()
        with self._lock:
            step = Step(index=self._num_steps, t_s=now - self._t0, latency_ms=latency_ms, label=label)
            self._steps.append(step)
            self._num_steps += 1
            self._last_mark = now
        return step

    def lap(self, label: str | None = None) -> Step:
        """Record one step that lasted from the previous step (or the start) until now.

        Waits for the watched GPUs to finish their queued work first (when CUDA is initialised), so the
        latency is the work's, not the time it took to enqueue it.
        """
        if label is not None and not isinstance(label, str):
            raise TypeError(f"label must be a str or None, got {type(label).__name__}")
        if not self.running:
            raise RuntimeError("record steps inside `with LiveMonitor(...) as mon:` (or after mon.start())")
        if self.devices and torch.cuda.is_initialized():
            for d in self.devices:
                torch.cuda.synchronize(d)
        return self.step((time.perf_counter() - self._last_mark) * 1e3, label=label)

    # ------------------------------------------------------------------ reading
    @property
    def samples(self) -> list[Sample]:
        """The sample history (at most ``max_samples``, oldest first), a copy."""
        with self._lock:
            return list(self._samples)

    @property
    def steps(self) -> list[Step]:
        """The step history (at most ``max_steps``, oldest first), a copy."""
        with self._lock:
            return list(self._steps)

    @property
    def notes(self) -> list[str]:
        """What could not be measured or shown this run, and why."""
        return list(self._notes)

    def stats(self) -> dict:
        """Numbers of the run so far: duration, sample and step counts, latencies, memory maxima."""
        with self._lock:
            steps = [s.latency_ms for s in self._steps]
            out = {
                "title": self.title,
                "duration_s": (self._t_end or time.perf_counter()) - self._t0,
                "num_samples": self._num_samples,
                "num_ticks": self._num_ticks,
                "num_steps": self._num_steps,
                "devices": list(self.devices),
                "nvml": self._nvml,
                "maxima_mib": dict(self._maxima),
                "first_mib": dict(self._firsts),
                "last_mib": {},
                "utilization_mean": {
                    d: self._util_sum[d] / self._util_count[d]
                    for d in self._util_count
                    if self._util_count[d]
                },
                "sampler_error": None if self._sampler_error is None else repr(self._sampler_error),
            }
            last = self._samples[-1] if self._samples else None
        if last is not None:
            if last.rss_mib is not None:
                out["last_mib"]["rss"] = last.rss_mib
            for g in last.gpus:
                out["last_mib"][f"allocated:{g.device}"] = g.allocated_mib
        out["sample_hz"] = out["num_ticks"] / out["duration_s"] if out["duration_s"] > 0 else 0.0
        if steps:
            out["latency_ms"] = {
                "median": statistics.median(steps),
                "min": min(steps),
                "max": max(steps),
                "first": steps[0],
                "last": steps[-1],
                "total": sum(steps),
            }
        return out

    def _headline(self, s: dict) -> str:
        head = (
            f"{s['duration_s']:.2f} s, {s['num_samples']} samples ({s['sample_hz']:.1f} Hz), "
            f"{s['num_steps']} steps"
        )
        if self._exit_error:
            head += f"; stopped by {self._exit_error[:100]}"
        return head

    def summary(self) -> str:
        """A few lines of text: what :meth:`stop` prints outside a notebook."""
        s = self.stats()
        lines = [f"{self.title}: {self._headline(s)}"]
        lat = s.get("latency_ms")
        if lat:
            lines.append(
                f"  step latency ms: median {lat['median']:.3g}, min {lat['min']:.3g}, max {lat['max']:.3g} "
                f"(first {lat['first']:.3g}, last {lat['last']:.3g})"
            )
        mx, first, last = s["maxima_mib"], s["first_mib"], s["last_mib"]
        for d in self.devices:
            line = (
                f"  cuda:{d}{_gpu_name(d)}: allocated {first[f'allocated:{d}']:,.0f} -> "
                f"{last.get(f'allocated:{d}', 0.0):,.0f} MiB (max {mx[f'allocated:{d}']:,.0f}), "
                f"peak allocated {mx[f'peak:{d}']:,.0f} MiB, reserved max {mx[f'reserved:{d}']:,.0f} MiB"
            )
            if d in s["utilization_mean"]:
                line += f", utilisation mean {s['utilization_mean'][d]:.0f}%"
            lines.append(line)
        if "rss" in mx:
            lines.append(
                f"  host RSS: {first['rss']:,.0f} -> {last.get('rss', 0.0):,.0f} MiB (max {mx['rss']:,.0f})"
            )
        if s["sampler_error"]:
            lines.append(f"  sampling stopped early: {s['sampler_error']}")
        lines += [f"  note: {n}" for n in self._notes]
        return "\n".join(lines)

    # ------------------------------------------------------------------ figure
    def figure(self, widget: bool = False):
        """The two-panel plotly figure of the histories so far: memory over time (MiB; NVML utilisation
        in % on a second axis where available) on top, latency per step below.

        ``widget=True`` returns a ``go.FigureWidget`` (needs anywidget), else a ``go.Figure``.
        """
        import plotly.graph_objects as go
        from plotly.subplots import make_subplots

        fig = make_subplots(
            rows=2,
            cols=1,
            specs=[[{"secondary_y": True}], [{}]],
            vertical_spacing=0.14,
            subplot_titles=("memory over time (seconds since start)", "latency per step"),
        )
        line = "lines"
        for i, d in enumerate(self.devices):
            color = GPU_COLORS[i % len(GPU_COLORS)]
            for kind, dash in (("allocated", "solid"), ("reserved", "dash"), ("peak", "dot")):
                fig.add_trace(
                    go.Scatter(
                        x=[],
                        y=[],
                        mode=line,
                        name=f"cuda:{d} {kind}",
                        meta=f"{kind}:{d}",
                        line=dict(color=color, dash=dash),
                        hovertemplate=f"cuda:{d} {kind}: %{{y:,.0f}} MiB at %{{x:.2f}} s<extra></extra>",
                    ),
                    row=1,
                    col=1,
                    secondary_y=False,
                )
            if self._nvml:
                fig.add_trace(
                    go.Scatter(
                        x=[],
                        y=[],
                        mode=line,
                        name=f"cuda:{d} utilisation",
                        meta=f"util:{d}",
                        line=dict(color=color, width=1),
                        opacity=0.4,
                        hovertemplate=f"cuda:{d} utilisation: %{{y:.0f}}% at %{{x:.2f}} s<extra></extra>",
                    ),
                    row=1,
                    col=1,
                    secondary_y=True,
                )
        fig.add_trace(
            go.Scatter(
                x=[],
                y=[],
                mode=line,
                name="host RSS",
                meta="rss",
                line=dict(color=HOST_COLOR),
                hovertemplate="host RSS: %{y:,.0f} MiB at %{x:.2f} s<extra></extra>",
            ),
            row=1,
            col=1,
            secondary_y=False,
        )
        fig.add_trace(
            go.Scatter(
                x=[],
                y=[],
                mode="lines+markers",
                name="step latency",
                meta="latency",
                line=dict(color="#333333"),
                marker=dict(size=6),
                showlegend=False,
                hovertemplate="step %{x}: %{y:.3g} ms<br>%{text}<extra></extra>",
            ),
            row=2,
            col=1,
        )
        fig.update_layout(
            title=dict(text=self.title),
            template="plotly_white",
            height=520,
            margin=dict(l=60, r=60, t=80, b=50),
            legend=dict(orientation="h", y=-0.14),
            uirevision="live",  # redraws keep the user's zoom
        )
        fig.update_yaxes(title="MiB", rangemode="tozero", row=1, col=1, secondary_y=False)
        if self._nvml:
            fig.update_yaxes(title="utilisation %", range=[0, 100], row=1, col=1, secondary_y=True)
        fig.update_xaxes(title="step", row=2, col=1)
        fig.update_yaxes(title="ms", rangemode="tozero", row=2, col=1)
        if widget:
            fig = go.FigureWidget(fig)
        self._fill(fig)
        return fig

    def _columns(self) -> dict[str, tuple[list, list, list | None]]:
        """The histories as plot columns ``{trace meta: (x, y, hover text)}``."""
        with self._lock:
            samples, steps = list(self._samples), list(self._steps)
        t = [s.t_s for s in samples]
        cols: dict[str, tuple[list, list, list | None]] = {
            "rss": (t, [s.rss_mib for s in samples], None),
            "latency": (
                [s.index for s in steps],
                [s.latency_ms for s in steps],
                [s.label or "" for s in steps],
            ),
        }
        for j, d in enumerate(self.devices):
            cols[f"allocated:{d}"] = (t, [s.gpus[j].allocated_mib for s in samples], None)
            cols[f"reserved:{d}"] = (t, [s.gpus[j].reserved_mib for s in samples], None)
            cols[f"peak:{d}"] = (t, [s.gpus[j].peak_mib for s in samples], None)
            cols[f"util:{d}"] = (t, [s.gpus[j].utilization for s in samples], None)
        return cols

    def _fill(self, fig) -> None:
        cols = self._columns()
        head = self._headline(self.stats())
        with fig.batch_update():
            for trace in fig.data:
                x, y, text = cols[trace.meta]
                trace.x, trace.y = x, y
                if text is not None:
                    trace.text = text
            fig.layout.title.text = f"{self.title}<br><sup>{head}</sup>"

    def _redraw(self) -> None:
        try:
            self._fill(self._figure)
        except Exception as e:  # a redraw must never break the user's work
            self._redraw_error = e
            self._notes.append(f"live redraw stopped ({type(e).__name__}: {str(e)[:80]})")


__all__ = ["GpuSample", "LiveMonitor", "Sample", "Step", "host_rss_bytes", "in_notebook"]
