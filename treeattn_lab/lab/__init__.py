"""Lab helpers for the notebooks: drawings, a live monitor, a stepper widget and exercise checks.

- :mod:`.viz`: every plotly drawing, one module per subject (``from treeattn_lab.lab import viz``).
- :mod:`.monitor`: :class:`~.monitor.LiveMonitor`, memory and step latency watched while work runs.
- :mod:`.dfs_stepper`: :func:`~.dfs_stepper.dfs_trace` and the :class:`~.dfs_stepper.DfsStepper` widget.
- :mod:`.exercises`: the "your turn" checkers and the library's solutions.
"""
