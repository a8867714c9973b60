"""The :class:`LiveMonitor` context manager: a sampling thread, step latencies, numbers and a summary.

See :mod:`treeattn_lab.lab.monitor` for what it records, where it shows it and how its threads share the
histories; the figure is built in :mod:`.figure`.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections import deque

import torch

from ...checks import check_in_range, check_int
from .figure import fill_figure, history_columns, monitor_figure
from .probes import check_devices, gpu_name, host_rss_bytes, in_notebook, nvml_utilization
from .records import GpuSample, Sample, Step

MIB = 2**20
DISPLAYS = ("auto", "widget", "text", "none")


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
        self.hz = check_in_range("hz", hz, 1.0, 50.0)
        self.max_samples = check_int("max_samples", max_samples, minimum=2)
        self.max_steps = check_int("max_steps", max_steps, minimum=1)
        self.refresh_s = check_in_range("refresh_s", refresh_s, 0.1, 3600.0)
        self.display = display
        self.devices = check_devices(devices)
        self.reset_peak = reset_peak

        self._lock = threading.Lock()
        self._samples: deque[Sample] = deque(maxlen=self.max_samples)
        self._steps: deque[Step] = deque(maxlen=self.max_steps)
        self._thread: threading.Thread | None = None
        self._stop_event = threading.Event()
        self._figure = None  # the live widget, written by one thread at a time (see the package docstring)
        self._live = None  # the LiveFigure that shows it, and replaces it with a static figure on exit
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
        self._figure = self._live = None
        self._probe_devices()
        self._mode = self._choose_mode()
        self._stop_event.clear()
        if self._mode == "widget":  # drawn before the clock starts: building it is not the body's time
            from ..viz.live import LiveFigure

            self._live = LiveFigure(self.figure())
            self._figure = self._live.show()
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
            self._show_final_figure()
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
        latency_ms = check_in_range("latency_ms", latency_ms, 0.0, math.inf)
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
                f"  cuda:{d}{gpu_name(d)}: allocated {first[f'allocated:{d}']:,.0f} -> "
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
        fig = monitor_figure(self.title, self.devices, self._nvml, widget=widget)
        self._fill(fig)
        return fig

    def _fill(self, fig) -> None:
        with self._lock:
            samples, steps = list(self._samples), list(self._steps)
        head = self._headline(self.stats())
        fill_figure(fig, history_columns(samples, steps, self.devices), f"{self.title}<br><sup>{head}</sup>")

    def _show_final_figure(self) -> None:
        """Draw the whole run into the widget, then let its :class:`~treeattn_lab.lab.viz.LiveFigure`
        replace it with a static figure of that state and close it.

        A widget's redraws are events: those that reach the page before its front end has loaded are
        lost, so a short block can leave the widget empty. The static figure carries its data, draws
        whenever the page is ready, and stays in the saved notebook. The widget is closed even when the
        last redraw fails; the failure is noted, never raised."""
        try:
            self._fill(self._figure)
        except Exception as e:  # a redraw must never break the user's work
            self._redraw_error = e
            self._notes.append(f"final redraw failed ({type(e).__name__}: {str(e)[:80]})")
        try:
            self._live.finish()
        except Exception as e:
            self._redraw_error = self._redraw_error or e
            self._notes.append(f"the static figure could not be shown ({type(e).__name__}: {str(e)[:80]})")

    def _redraw(self) -> None:
        try:
            self._fill(self._figure)
        except Exception as e:  # a redraw must never break the user's work
            self._redraw_error = e
            self._notes.append(f"live redraw stopped ({type(e).__name__}: {str(e)[:80]})")



__all__ = ["LiveMonitor"]
