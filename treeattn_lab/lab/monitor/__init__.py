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
    step, shown through :class:`treeattn_lab.lab.viz.LiveFigure`. The sampling thread redraws it every
    ``refresh_s`` seconds, so it stays live even while the main thread is stuck in one long call; on exit
    it is drawn once more, complete, and a static figure of it takes its place (which the saved notebook
    keeps, and which a page still loading the widget draws all the same). Elsewhere (a script,
    a terminal, pytest) a short text summary is printed on exit. ``display="none"`` shows nothing; the
    histories stay readable through :attr:`samples`, :attr:`steps`, :meth:`stats` and :meth:`summary`.

Threads
    The sampler is a daemon thread, started on entry and always joined on exit, also when the body
    raises. It and :meth:`step` share the histories through a lock. Only one thread ever writes to the
    figure: the sampler while the block runs, the main thread after the sampler has been joined.
    Reading the allocator's counters never initialises CUDA; a GPU the process has not touched reads 0.

Nothing here needs a GPU, plotly or NVML: without them the monitor records what it can and says so.

Modules
    :mod:`.live` holds :class:`LiveMonitor` (lifecycle, sampling thread, steps, numbers and summary);
    :mod:`.records` the records it keeps (:class:`Sample`, :class:`GpuSample`, :class:`Step`);
    :mod:`.probes` what it asks the machine (notebook or not, host RSS, NVML, argument checks);
    :mod:`.figure` its two-panel plotly figure.
"""

from .live import LiveMonitor
from .probes import host_rss_bytes, in_notebook, nvml_utilization
from .records import GpuSample, Sample, Step

__all__ = ["GpuSample", "LiveMonitor", "Sample", "Step", "host_rss_bytes", "in_notebook", "nvml_utilization"]
