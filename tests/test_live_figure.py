"""LiveFigure shows a FigureWidget copy through a display handle, and on exit (also when the body raises)
replaces it through that handle with a static figure of the widget's final state, then closes the widget."""

from __future__ import annotations

import pytest

go = pytest.importorskip("plotly.graph_objects")
pytest.importorskip("anywidget")

from treeattn_lab.lab import viz  # noqa: E402
from treeattn_lab.lab.viz import LiveFigure  # noqa: E402

PLOTLY_MIME, WIDGET_MIME = "application/vnd.plotly.v1+json", "application/vnd.jupyter.widget-view+json"


class RecordingHandle:
    """Stands for IPython's ``display``: records what is shown, and each update of its display handle."""

    def __init__(self, fail_update: bool = False):
        self.shown, self.updates = [], []
        self.fail_update = fail_update

    def __call__(self, bundle, raw=False, display_id=False):
        self.shown.append((bundle, raw, display_id))
        return self

    def update(self, bundle, raw=False):
        if self.fail_update:
            raise OSError("the page went away")
        self.updates.append((bundle, raw))


@pytest.fixture
def display(monkeypatch):
    import IPython.display
    import plotly.io as pio

    handle = RecordingHandle()
    monkeypatch.setattr(IPython.display, "display", handle)
    monkeypatch.setattr(pio.renderers, "default", "plotly_mimetype")  # JupyterLab's renderer
    return handle


def _row(backend: str, ms: float) -> dict:
    return {"backend": backend, "fwd_bwd_ms": ms, "fwd_bwd_tflops": 100.0 / ms}


def _final_lines(display) -> dict:
    """``{(trace name, metric): (x, y)}`` of the one static figure the handle was updated with."""
    [(final, raw)] = display.updates
    assert raw and WIDGET_MIME not in final
    return {(t["name"], t["meta"]): (list(t["x"]), list(t["y"])) for t in final[PLOTLY_MIME]["data"]}


def test_shows_a_widget_then_replaces_it_with_a_static_figure_of_its_final_state(display):
    source = viz.draw_speed_sweep(["flat", "triton"])
    with LiveFigure(source) as sweep:
        assert isinstance(sweep, go.FigureWidget) and sweep.comm is not None
        [(bundle, raw, display_id)] = display.shown
        assert WIDGET_MIME in bundle and PLOTLY_MIME not in bundle and raw and display_id is True
        assert display.updates == []  # live until the loop ends
        for x, ms in ((256, 2.0), (512, 4.0)):
            viz.add_speed_point(sweep, _row("triton", ms), x=x)
    lines = _final_lines(display)
    assert lines[("triton", "fwd_bwd_ms")] == ([256, 512], [2.0, 4.0])
    assert lines[("triton", "fwd_bwd_tflops")] == ([256, 512], [50.0, 25.0])
    assert lines[("flat", "fwd_bwd_ms")] == ([], [])
    assert sweep.comm is None  # the widget is closed
    assert all(not t.x for t in source.data)  # the widget was a copy: the source is untouched
    assert len(display.shown) == 1


def test_a_raising_body_still_leaves_what_was_measured_and_its_error_propagates(display):
    live = LiveFigure(viz.draw_speed_sweep(["flat"]))
    with pytest.raises(ZeroDivisionError, match="measured one"), live as sweep:
        viz.add_speed_point(sweep, _row("flat", 1.0), x=1)
        raise ZeroDivisionError("measured one, then failed")
    assert _final_lines(display)[("flat", "fwd_bwd_ms")] == ([1], [1.0])
    assert live.finished and sweep.comm is None


def test_a_failing_final_redraw_never_hides_the_body_error_and_is_raised_otherwise(display):
    display.fail_update = True
    live = LiveFigure(viz.draw_speed_sweep(["flat"]))
    warned = pytest.warns(RuntimeWarning, match="final figure could not be shown.*page went away")
    with warned, pytest.raises(KeyError, match="no line for backend"), live as sweep:
        viz.add_speed_point(sweep, _row("dense", 1.0), x=1)
    assert sweep.comm is None  # closed all the same
    live = LiveFigure(viz.draw_speed_sweep(["flat"]))
    with pytest.raises(OSError, match="page went away"), live as sweep:
        pass
    assert sweep.comm is None


def test_finish_is_idempotent_and_a_live_figure_shows_once(display):
    live = LiveFigure(viz.draw_grpo_live())
    live.finish()  # before show: nothing to replace
    assert display.shown == [] and display.updates == [] and not live.finished
    widget = live.show()
    with pytest.raises(RuntimeError, match="already been shown"):
        live.show()
    live.finish()
    live.finish()
    assert len(display.shown) == 1 and len(display.updates) == 1 and widget.comm is None
    with pytest.raises(RuntimeError, match="already been shown"):
        live.show()


def test_outside_an_ipython_kernel_finish_only_closes_the_widget(monkeypatch):
    import IPython.display

    monkeypatch.setattr(IPython.display, "display", lambda *a, **k: None)  # what it returns there
    with LiveFigure(viz.draw_grpo_live()) as widget:
        assert widget.comm is not None
    assert widget.comm is None


@pytest.mark.parametrize("bad", [None, {"data": [], "layout": {}}, "figure", go.Scatter(x=[1])])
def test_bad_figure(bad):
    with pytest.raises(TypeError, match="figure must be a plotly figure"):
        LiveFigure(bad)
