"""Progress bars that read well in a terminal, a notebook and a log file alike.

:func:`progress_bar` is ``tqdm.auto``'s bar (a widget in a notebook, a text bar elsewhere), except where
the bar cannot redraw in place: a text bar on a stderr that is no terminal (a log file, a pipe, a remote
command's captured output) turns every redraw into one more line, so there it redraws at most every
:data:`LOG_REDRAW_INTERVAL_S` seconds unless the caller set ``mininterval``. Postfixes set with
``refresh=False`` show at the next redraw.
"""

from __future__ import annotations

import sys

__all__ = ["LOG_REDRAW_INTERVAL_S", "progress_bar", "redraws_in_place"]

LOG_REDRAW_INTERVAL_S = 5.0


def redraws_in_place(bar_class, file=None) -> bool:
    """Whether bars of ``bar_class`` writing to ``file`` (None: stderr) redraw in place: notebook widgets
    do, and text bars on a terminal."""
    from tqdm.notebook import tqdm_notebook

    stream = sys.stderr if file is None else file
    return issubclass(bar_class, tqdm_notebook) or bool(getattr(stream, "isatty", lambda: False)())


def progress_bar(iterable=None, **kwargs):
    """A ``tqdm.auto`` bar over ``iterable`` (tqdm's keyword arguments), throttled where it would log."""
    from tqdm.auto import tqdm

    if not redraws_in_place(tqdm, kwargs.get("file")):
        kwargs.setdefault("mininterval", LOG_REDRAW_INTERVAL_S)
    return tqdm(iterable, **kwargs)
