"""A figure that grows live in a notebook while a loop runs, and stays, complete, in the saved notebook.

    with viz.LiveFigure(viz.draw_speed_sweep(["flat", "triton"])) as sweep:
        for p in prompts:
            viz.add_speed_point(sweep, run(p), x=p)   # the page redraws at once

Why not a bare ``go.FigureWidget``: a widget reaches the page as events (restyle and relayout
messages), and the page loads the widget's front-end code asynchronously; every event sent before it
has loaded is lost, so a short loop can leave the widget empty, and a saved notebook keeps no figure for
a widget at all. :class:`LiveFigure` shows the widget through an IPython display handle and, when the
loop ends (also when it raises), replaces it through that handle with a static figure of the widget's
final state, which carries its data, draws whenever the page is ready and is saved with the notebook.

Both are shown as raw mime bundles: ``go.Figure`` displays itself through ``_ipython_display_``, which
ignores ``display_id``, and the static figure cannot itself be the live one (plotly's JupyterLab renderer
ignores updates of an output it has drawn).
"""

from __future__ import annotations

import warnings


class LiveFigure:
    """Context manager that shows a live ``go.FigureWidget`` copy of ``figure`` and, on exit, a static one.

    :meth:`show` (what ``with`` does on entry) displays a ``FigureWidget`` copy of ``figure`` and returns
    it: update that widget, not ``figure``. :meth:`finish` (what ``with`` does on exit, also when the body
    raised) replaces the widget's output with a static ``go.Figure`` of the widget's state, then closes
    the widget; it is idempotent. A body's exception always propagates; a failure of the final redraw
    then only warns, so it never hides the body's own error. Needs IPython, plotly and anywidget; outside
    an IPython kernel nothing can be replaced, and :meth:`finish` only closes the widget.
    """

    def __init__(self, figure):
        from plotly.basedatatypes import BaseFigure

        if not isinstance(figure, BaseFigure):
            raise TypeError(f"figure must be a plotly figure (go.Figure), got {type(figure).__name__}")
        self._source = figure
        self.widget = None  # the live go.FigureWidget, once shown
        self._handle = None  # the IPython display handle of the widget's output
        self._finished = False

    def show(self):
        """Display a ``go.FigureWidget`` copy of the figure and return it. A LiveFigure shows once."""
        if self.widget is not None or self._finished:
            raise RuntimeError("this LiveFigure has already been shown; make a new one for another loop")
        import plotly.graph_objects as go
        from IPython.display import display

        widget = go.FigureWidget(self._source)
        self._handle = display(widget._repr_mimebundle_(), raw=True, display_id=True)
        self.widget = widget
        return widget

    def finish(self) -> None:
        """Replace the live widget with a static figure of its final state, and close it. Idempotent."""
        if self._finished or self.widget is None:
            return
        self._finished = True
        import plotly.graph_objects as go

        try:
            if self._handle is not None:  # None outside an IPython kernel: nothing was shown to replace
                self._handle.update(go.Figure(self.widget)._repr_mimebundle_(), raw=True)
        finally:
            self.widget.close()

    @property
    def finished(self) -> bool:
        return self._finished

    def __enter__(self):
        return self.show()

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            self.finish()
            return False
        try:  # the body's exception is the one the user must see
            self.finish()
        except Exception as e:
            warnings.warn(f"LiveFigure: the final figure could not be shown ({type(e).__name__}: {e})",
                          RuntimeWarning, stacklevel=2)
        return False  # never swallow the body's exception


__all__ = ["LiveFigure"]
