"""LiveMonitor samples in a background thread, keeps bounded histories, always joins its thread, records
step latencies, prints a summary outside a notebook, draws its figure and rejects bad arguments."""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch

from treeattn_lab.lab.monitor import LiveMonitor, in_notebook
from treeattn_lab.lab.monitor import live as monitor_live


def _monitor_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("LiveMonitor(")]


@pytest.fixture(autouse=True)
def no_thread_left_behind():
    assert not _monitor_threads()
    yield
    assert not _monitor_threads(), "a LiveMonitor thread outlived its test"


def _wait_for_samples(mon, n: int) -> None:
    """Sleep until the sampler has taken ``n`` samples (kept or not), with a hang guard: a loaded machine
    may starve the sampler thread for a while, never for minutes."""
    deadline = time.monotonic() + 120
    while mon.stats()["num_samples"] < n and time.monotonic() < deadline:
        time.sleep(0.02)


def test_samples_are_collected_in_the_background():
    with LiveMonitor(title="idle", hz=20, display="none") as mon:
        assert mon.running and len(_monitor_threads()) == 1
        _wait_for_samples(mon, 5)  # the main thread does nothing: only the sampler can add samples
    samples = mon.samples
    assert len(samples) >= 5
    assert [s.t_s for s in samples] == sorted(s.t_s for s in samples)
    assert all(s.rss_mib is not None and s.rss_mib > 0 for s in samples)
    stats = mon.stats()
    assert stats["num_samples"] == len(samples)
    assert 0 < stats["sample_hz"] <= 25  # never above its rate (a loaded machine may hold it below)
    if not torch.cuda.is_available():
        assert mon.devices == [] and all(s.gpus == () for s in samples)


def test_histories_are_bounded():
    with LiveMonitor(hz=50, max_samples=3, max_steps=2, display="none") as mon:
        _wait_for_samples(mon, 4)
        for i in range(5):
            mon.step(latency_ms=float(i), label=f"s{i}")
    assert len(mon.samples) == 3 and mon.stats()["num_samples"] > 3
    assert [(s.index, s.latency_ms, s.label) for s in mon.steps] == [(3, 3.0, "s3"), (4, 4.0, "s4")]
    assert mon.stats()["num_steps"] == 5


def test_thread_is_joined_when_the_body_raises(capsys):
    with pytest.raises(ZeroDivisionError), LiveMonitor(title="boom", display="text") as mon:
        time.sleep(0.05)
        raise ZeroDivisionError("division by zero")
    assert not mon.running and not _monitor_threads()
    out = capsys.readouterr().out
    assert out.startswith("boom:") and "stopped by ZeroDivisionError" in out


def test_step_and_lap_record_latencies():
    with LiveMonitor(display="none") as mon:
        first = mon.step(latency_ms=2.5, label="given")
        time.sleep(0.05)
        second = mon.lap(label="measured")
        third = mon.lap()
    steps = mon.steps
    assert steps == [first, second, third]
    assert [s.index for s in steps] == [0, 1, 2]
    assert first.latency_ms == 2.5 and first.label == "given"
    assert 45 <= second.latency_ms < 1000 and second.label == "measured"  # since the previous step
    assert 0 <= third.latency_ms < 45 and third.label is None
    lat = mon.stats()["latency_ms"]
    assert lat["first"] == 2.5 and lat["max"] == second.latency_ms and lat["median"] == 2.5


def test_text_summary_outside_a_notebook(capsys):
    assert not in_notebook()
    with LiveMonitor(title="cpu work", hz=20) as mon:  # display="auto"
        for i in range(3):
            torch.randn(64, 64) @ torch.randn(64, 64)
            mon.lap(label=f"step {i}")
    out = capsys.readouterr().out
    assert out == mon.summary() + "\n"
    assert out.startswith("cpu work: ") and "3 steps" in out
    assert "step latency ms: median" in out and "host RSS:" in out


def test_restart_begins_afresh():
    mon = LiveMonitor(display="none")
    with mon:
        mon.step(1.0)
    with mon:
        pass
    assert mon.steps == [] and mon.stats()["num_steps"] == 0


def test_figure_when_asked():
    go = pytest.importorskip("plotly.graph_objects")
    with LiveMonitor(title="fig", display="none") as mon:
        mon.step(3.0, label="a")
        mon.step(4.0, label="b")
    fig = mon.figure()
    assert isinstance(fig, go.Figure) and not isinstance(fig, go.FigureWidget)
    by_meta = {t.meta: t for t in fig.data}
    assert set(by_meta) == {"rss", "latency"}  # no GPU traces without GPUs
    assert len(by_meta["rss"].x) == len(mon.samples) >= 2
    assert list(by_meta["latency"].y) == [3.0, 4.0] and list(by_meta["latency"].text) == ["a", "b"]
    assert fig.layout.title.text.startswith("fig<br>")
    pytest.importorskip("anywidget")
    assert isinstance(mon.figure(widget=True), go.FigureWidget)


def test_live_widget_is_redrawn_by_the_sampler_then_replaced_by_a_static_figure(monkeypatch):
    """The sampler redraws the live widget; on exit a static figure of the whole run takes its place
    through the display handle (the widget's early redraws may never reach a page still loading it)."""
    import IPython.display

    pytest.importorskip("anywidget")
    pio = pytest.importorskip("plotly.io")
    from tests.test_live_figure import PLOTLY_MIME, WIDGET_MIME, RecordingHandle

    display = RecordingHandle()
    monkeypatch.setattr(IPython.display, "display", display)
    monkeypatch.setattr(pio.renderers, "default", "plotly_mimetype")  # JupyterLab's renderer
    with LiveMonitor(title="live", hz=20, refresh_s=0.1, display="widget") as mon:
        fig = mon._figure
        deadline = time.time() + 120  # a hang guard: a loaded machine may starve the sampler for a while
        while len(fig.data[0].x) < 3 and time.time() < deadline:  # only the sampler writes the figure
            time.sleep(0.02)
        assert len(fig.data[0].x) >= 3
        mon.step(1.0)
    assert mon._redraw_error is None
    [(bundle, raw, display_id)] = display.shown
    assert WIDGET_MIME in bundle and raw and display_id is True
    [(final, raw)] = display.updates
    traces = {t["meta"]: t for t in final[PLOTLY_MIME]["data"]}
    assert raw and len(traces["rss"]["x"]) == len(mon.samples) and list(traces["latency"]["y"]) == [1.0]
    assert fig.comm is None  # the widget is closed


def test_a_failing_static_figure_is_noted_and_never_breaks_the_work(monkeypatch, capsys):
    import IPython.display

    pytest.importorskip("anywidget")
    pio = pytest.importorskip("plotly.io")
    from tests.test_live_figure import RecordingHandle

    display = RecordingHandle(fail_update=True)
    monkeypatch.setattr(IPython.display, "display", display)
    monkeypatch.setattr(pio.renderers, "default", "plotly_mimetype")
    with LiveMonitor(title="lost page", display="widget") as mon:
        mon.step(1.0)
    assert isinstance(mon._redraw_error, OSError) and mon._figure.comm is None
    assert any("static figure could not be shown (OSError: the page went away)" in n for n in mon.notes)
    out = capsys.readouterr().out  # the figure is stale: the numbers are printed instead
    assert out.startswith("lost page:") and "1 steps" in out


def test_sampler_errors_are_reported_not_lost(monkeypatch):
    calls = []

    def flaky_rss():
        calls.append(1)
        if len(calls) > 1:
            raise OSError("no /proc here")
        return 2**20

    monkeypatch.setattr(monitor_live, "host_rss_bytes", flaky_rss)  # where the sampler looks it up
    mon = LiveMonitor(hz=50, display="none").start()
    time.sleep(0.1)
    mon.stop()  # the final sample fails too: noted, not raised
    assert not mon.running
    assert "sampling stopped early: OSError('no /proc here')" in mon.summary()


class _FakeCuda:
    """Two GPUs whose allocator counters grow each read, and an NVML that answers."""

    def __init__(self):
        self.reads = 0
        self.synced: list[int] = []
        self.reset: list[int] = []

    def install(self, monkeypatch):
        cuda = torch.cuda
        for name, fn in {
            "is_available": lambda: True,
            "is_initialized": lambda: True,
            "device_count": lambda: 2,
            "get_device_name": lambda d: f"Fake GPU {d}",
            "memory_allocated": self.allocated,
            "memory_reserved": lambda d: 4 * 2**30,
            "max_memory_allocated": lambda d: 3 * 2**30,
            "reset_peak_memory_stats": self.reset.append,
            "synchronize": self.synced.append,
            "utilization": lambda d: 50 + 10 * d,
        }.items():
            monkeypatch.setattr(cuda, name, fn)

    def allocated(self, d):
        self.reads += 1
        return (1 + d) * 2**30


def test_gpu_memory_and_utilisation_with_a_fake_gpu(monkeypatch, capsys):
    go = pytest.importorskip("plotly.graph_objects")
    fake = _FakeCuda()
    fake.install(monkeypatch)
    with LiveMonitor(title="fake", hz=20, display="text") as mon:
        time.sleep(0.1)
        mon.lap(label="x")
    assert mon.devices == [0, 1] and fake.reset == [0, 1] and fake.synced == [0, 1]
    g0, g1 = mon.samples[-1].gpus
    assert (g0.allocated_mib, g0.reserved_mib, g0.peak_mib, g0.utilization) == (1024, 4096, 3072, 50.0)
    assert (g1.device, g1.allocated_mib, g1.utilization) == (1, 2048, 60.0)
    out = capsys.readouterr().out
    assert "cuda:0 Fake GPU 0: allocated 1,024 -> 1,024 MiB (max 1,024), peak allocated 3,072 MiB" in out
    assert "cuda:1 Fake GPU 1" in out and "utilisation mean 60%" in out
    metas = [t.meta for t in mon.figure().data]
    assert metas == [
        "allocated:0", "reserved:0", "peak:0", "util:0",
        "allocated:1", "reserved:1", "peak:1", "util:1",
        "rss", "latency",
    ]  # fmt: skip
    assert isinstance(mon.figure(), go.Figure)
    with pytest.raises(ValueError, match="GPU 2 does not exist"):
        LiveMonitor(devices=[2])
    assert LiveMonitor(devices=[1]).devices == [1]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"hz": 0}, ValueError, "hz must lie in \\[1, 50\\]"),
        ({"hz": 500}, ValueError, "hz must lie in \\[1, 50\\]"),
        ({"hz": math.nan}, ValueError, "hz must lie in \\[1, 50\\]"),
        ({"hz": "fast"}, TypeError, "hz must be a number"),
        ({"hz": True}, TypeError, "hz must be a number"),
        ({"max_samples": 1}, ValueError, "max_samples must be at least 2"),
        ({"max_samples": 10.0}, TypeError, "max_samples must be an int"),
        ({"max_steps": 0}, ValueError, "max_steps must be at least 1"),
        ({"display": "gui"}, ValueError, "display must be one of"),
        ({"display": None}, TypeError, "display must be one of"),
        ({"refresh_s": 0.01}, ValueError, "refresh_s must lie in \\[0.1, 3600\\]"),
        ({"title": 3}, TypeError, "title must be a str"),
        ({"reset_peak": "yes"}, TypeError, "reset_peak must be a bool"),
        ({"devices": "cuda"}, TypeError, "devices must be"),
        ({"devices": [0.5]}, TypeError, "GPU indices"),
        ({"devices": [99]}, ValueError, "GPU 99 does not exist"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        LiveMonitor(**kwargs)


def test_bad_steps():
    mon = LiveMonitor(display="none")
    with pytest.raises(RuntimeError, match="inside `with LiveMonitor"):
        mon.step(1.0)
    with pytest.raises(RuntimeError, match="inside `with LiveMonitor"):
        mon.lap()
    with mon:
        with pytest.raises(ValueError, match="latency_ms"):
            mon.step(-1.0)
        with pytest.raises(ValueError, match="latency_ms"):
            mon.step(math.nan)
        with pytest.raises(ValueError, match="latency_ms"):
            mon.step(math.inf)
        with pytest.raises(TypeError, match="latency_ms must be a number"):
            mon.step("1 ms")
        with pytest.raises(TypeError, match="label must be a str"):
            mon.step(1.0, label=3)
        with pytest.raises(TypeError, match="label must be a str"):
            mon.lap(label=["a"])
        with pytest.raises(RuntimeError, match="already running"):
            mon.start()
    assert mon.steps == []
