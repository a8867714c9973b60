"""In a real browser: JupyterLab runs every notebook, figures fit, widgets render, the monitor is live.

Starts one JupyterLab headless on loopback (a free port, no token, every JUPYTER_* folder in a temp dir,
``TREEATTN_QUICK=1``) over a *copy* of ``notebooks/`` (JupyterLab autosaves outputs into the files it
serves; the committed notebooks must stay clean), drives Debian's chromium through Playwright (never a
downloaded browser) in JupyterLab's default layout on a small laptop screen (a 1366 x 900 window, the file
browser open), and runs every notebook in turn, one kernel at a time
(each is shut down before the next notebook opens). From the page it reads, per notebook:

- the notebook model (through ``--LabApp.expose_app_in_browser``): every code cell ran, none errored;
- the DOM: every plotly output and every widget output rendered (an svg, a widget view, no "Error
  displaying widget"), no output area scrolls sideways (``scrollWidth <= clientWidth``), and no plotly
  figure is wider than its output area.

Screenshots land in ``build/browser/``: ``<notebook>.png`` (the window at the notebook's first figure)
and ``<notebook>/cell<NN>.png`` (each figure output), to review how the figures read.

Needs ``/usr/bin/chromium`` (``make browser`` installs it with apt-get) and Playwright for Python (dev
extras). Without them the tests skip, except under CI (``CI`` or ``TREEATTN_REQUIRE_BROWSER=1`` set), where
they fail: CI installs the browser, so a missing one is a broken setup.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import under_ci

pytestmark = [pytest.mark.browser, pytest.mark.xdist_group("browser")]  # one server per worker

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = REPO / "notebooks"
NOTEBOOKS = sorted(p.name for p in NOTEBOOK_DIR.glob("[0-9][0-9]_*.ipynb"))
SCREENSHOT_DIR = REPO / "build" / "browser"
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
SERVER_START_S = 300  # a hang guard: JupyterLab answers in seconds on an idle machine
RUN_ALL_S = 1800  # a hang guard for Run All Cells of one quick-mode notebook, never a speed check
WINDOW = {"width": 1366, "height": 900}  # a small laptop screen; the file browser stays open beside it
FIGURE_DRAW_MS = 120_000  # a hang guard: how long a plotly output may take to draw once on screen

# user settings of the temp JupyterLab: every cell kept in the DOM, no news or update checks
LAB_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
        "fetchNews": "false",
        "checkForUpdates": False,
    },
}

# JavaScript run in the page; `nb()` is the open notebook's widget
_NB = "() => window.jupyterapp.shell.currentWidget"
KERNEL_READY_JS = f"""() => {{
    const w = ({_NB})();
    const k = w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel;
    return !!k && k.status === 'idle' && k.connectionStatus === 'connected';
}}"""
# one entry per code cell: execution count, output types, whether its prompt shows it running
CELLS_JS = f"""() => {{
    const nb = ({_NB})().content;
    const out = [];
    for (let i = 0; i < nb.model.cells.length; i++) {{
        const cell = nb.model.cells.get(i);
        if (cell.type !== 'code') continue;
        const outputs = cell.outputs.toJSON();
        out.push({{
            index: i,
            count: cell.executionCount,
            types: outputs.map(o => o.output_type),
            errors: outputs.filter(o => o.output_type === 'error').map(o => o.ename + ': ' + o.evalue),
            running: nb.widgets[i].node.querySelector('.jp-InputArea-prompt').textContent === '[*]:',
        }});
    }}
    const k = ({_NB})().sessionContext.session.kernel;
    return {{cells: out, idle: k.status === 'idle'}};
}}"""
STARTED_JS = f"""() => ({CELLS_JS})().cells.some(c => c.running || c.count !== null)"""
# the notebook is done when the kernel is idle and every code cell ran, or a cell errored (Run All stops)
DONE_JS = f"""() => {{
    const s = ({CELLS_JS})();
    const ran = s.cells.every(c => c.count !== null);
    const failed = s.cells.some(c => c.errors.length > 0);
    return s.idle && !s.cells.some(c => c.running) && (ran || failed);
}}"""


def _require(ok: bool, why: str) -> None:
    """Skip where the browser cannot run; fail under CI, which installs it."""
    if ok:
        return
    if under_ci():
        pytest.fail(f"{why} (required under CI)")
    pytest.skip(why)


def _lab_python() -> str:
    """The interpreter JupyterLab (and so every kernel) runs from: the venv `make lab` builds, which
    `make test` names in ``TREEATTN_LAB_PYTHON``; this test's own interpreter where none is named, except
    under CI."""
    path = os.environ.get("TREEATTN_LAB_PYTHON")
    if path:
        assert Path(path).is_file(), f"TREEATTN_LAB_PYTHON={path}: no such interpreter"
        return path
    if under_ci():
        pytest.fail("TREEATTN_LAB_PYTHON is not set: `make test` builds the `make lab` venv and names it")
    return sys.executable


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen) -> None:
    """Stop the server we started (its PID), then its kernels (its own process group) if it hangs."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=15)


@pytest.fixture(scope="module")
def lab_url(tmp_path_factory):
    """Base URL of a JupyterLab serving a copy of notebooks/ (the server is stopped afterwards)."""
    _require(CHROMIUM.is_file(), f"{CHROMIUM} is missing: run `make browser` (apt-get install chromium)")
    root = tmp_path_factory.mktemp("jupyterlab")
    shutil.copytree(NOTEBOOK_DIR, root / "notebooks")
    settings = root / "lab-settings"
    for name, values in LAB_SETTINGS.items():
        path = settings / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    env = dict(
        os.environ,
        TREEATTN_QUICK="1",
        JUPYTER_CONFIG_DIR=str(root / "config"),
        JUPYTER_DATA_DIR=str(root / "data"),
        JUPYTER_RUNTIME_DIR=str(root / "runtime"),
        JUPYTERLAB_SETTINGS_DIR=str(settings),
        JUPYTERLAB_WORKSPACES_DIR=str(root / "workspaces"),
        IPYTHONDIR=str(root / "ipython"),
    )
    port = _free_port()
    cmd = [
        _lab_python(), "-m", "jupyter", "lab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
        "--ServerApp.token=", "--ServerApp.password=", f"--ServerApp.root_dir={root}",
        "--LabApp.expose_app_in_browser=True",
    ]  # fmt: skip
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")
    log = open(root / "server.log", "w")  # noqa: SIM115 (closed in the finally below)
    proc = subprocess.Popen(
        cmd, env=env, cwd=root, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVER_START_S
        while True:
            try:
                with urllib.request.urlopen(f"{url}/api/status", timeout=2):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.flush()
                    pytest.fail(f"JupyterLab did not start:\n{(root / 'server.log').read_text()[-3000:]}")
                time.sleep(0.25)
        yield url
    finally:
        _stop(proc)
        log.close()


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _require(False, "Playwright for Python is missing: pip install -e '.[dev]'")
    _require(CHROMIUM.is_file(), f"{CHROMIUM} is missing: run `make browser` (apt-get install chromium)")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


def _open_and_run_all(browser, lab_url: str, name: str, *, while_running=None):
    """Open ``notebooks/<name>`` in a fresh workspace, Run All Cells from the Run menu and wait until done.

    ``while_running(page)`` is called about every 0.1 s until then. Returns ``(page, cells)``, cells as
    :data:`CELLS_JS` reads them.
    """
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    page = browser.new_page(viewport=WINDOW)
    page.set_default_timeout(60_000)
    workspace = name.split("_")[0]
    page.goto(f"{lab_url}/lab/workspaces/w{workspace}/tree/notebooks/{name}")
    page.wait_for_selector(".jp-Notebook .jp-Cell")
    page.evaluate("() => window.jupyterapp.shell.activateById('filebrowser')")  # open, as a learner has it
    left = page.evaluate(LEFT_PANEL_JS)
    assert left["shown"] and left["width"] >= 200, f"the file browser is not open beside the notebook: {left}"
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']")
    page.wait_for_function(KERNEL_READY_JS)  # clicking Run All before the kernel connects may do nothing
    for attempt in range(2):  # a click lost to a race shows as no cell starting: click once more
        page.click("li.lm-MenuBar-item:has-text('Run')")
        page.click("li.lm-Menu-item:has-text('Run All Cells') >> nth=0")  # not "Restart Kernel and Run All"
        try:
            page.wait_for_function(STARTED_JS, timeout=15_000)
            break
        except PlaywrightTimeout:
            assert attempt == 0, f"Run All Cells did not start {name}"
    deadline = time.monotonic() + RUN_ALL_S
    while not page.evaluate(DONE_JS):
        assert time.monotonic() < deadline, f"{name} did not finish in {RUN_ALL_S} s"
        if while_running is not None:
            while_running(page)
        page.wait_for_timeout(100)
    return page, page.evaluate(CELLS_JS)["cells"]


def _assert_clean_run(name: str, cells: list[dict]) -> None:
    errors = [f"cell {c['index']}: {e}" for c in cells for e in c["errors"]]
    assert not errors, f"{name}: cells raised:\n" + "\n".join(errors)
    not_run = [c["index"] for c in cells if c["count"] is None]
    assert not not_run, f"{name}: code cells {not_run} did not run"


def _screenshot(target, name: str) -> Path:
    """A PNG of ``target`` (the page's window, or one element) at ``build/browser/<name>.png``."""
    path = SCREENSHOT_DIR / f"{name}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    target.screenshot(path=str(path))
    return path


# One entry per output of every code cell, read from the model (its kind) and from the DOM node that shows it
# (the output area's children follow the model's outputs one to one): how wide it is, what it holds.
OUTPUTS_JS = """() => {
    const PLOTLY = 'application/vnd.plotly.v1+json', WIDGET = 'application/vnd.jupyter.widget-view+json';
    const nb = (NB)().content;
    const out = [];
    for (let i = 0; i < nb.model.cells.length; i++) {
        const cell = nb.model.cells.get(i);
        if (cell.type !== 'code') continue;
        const outputs = cell.outputs.toJSON();
        const children = nb.widgets[i].node.querySelectorAll('.jp-OutputArea-child');
        outputs.forEach((o, j) => {
            const data = o.data || {};
            const kind = PLOTLY in data ? 'plotly' : WIDGET in data ? 'widget' : o.output_type;
            const node = children[j] && children[j].querySelector('.jp-OutputArea-output');
            const entry = {cell: i, output: j, kind: kind, found: !!node};
            if (node) {
                const plots = [...(node.matches('.js-plotly-plot') ? [node] : []),
                               ...node.querySelectorAll('.js-plotly-plot')];
                const svgs = plots.flatMap(p => [...p.querySelectorAll(':scope > div svg.main-svg')]);
                Object.assign(entry, {
                    scroll_width: node.scrollWidth,
                    client_width: node.clientWidth,
                    svg_widths: svgs.map(s => Math.ceil(s.getBoundingClientRect().width)),
                    plots: plots.length,
                    drawn: plots.filter(p => p.querySelector('svg.main-svg')).length,
                    widgets: node.querySelectorAll('.jupyter-widgets, .widget-output').length,
                    broken: /Error displaying widget|Loading widget|Javascript Error/.test(node.textContent),
                    closed: kind === 'widget' && !node.textContent.trim() && !node.querySelector(':not(div)'),
                    traceback: o.output_type === 'stream' && o.name === 'stderr' && /Traceback/.test(o.text),
                });
            }
            out.push(entry);
        });
    }
    return out;
}""".replace("(NB)", f"({_NB})")


def _layout_problems(outputs: list[dict]) -> list[str]:
    """What is wrong with the outputs as :data:`OUTPUTS_JS` reads them: missing, unrendered, too wide."""
    problems = []
    for o in outputs:
        where = f"cell {o['cell']} output {o['output']} ({o['kind']})"
        if not o["found"]:
            problems.append(f"{where}: not in the page")
            continue
        if o["traceback"]:
            problems.append(f"{where}: a traceback on stderr")
        if o["kind"] == "plotly" and not o["plots"]:
            problems.append(f"{where}: the plotly figure did not render")
        # a widget closed by its cell (a finished progress bar that does not stay) leaves an empty output
        if o["kind"] == "widget" and (o["broken"] or not (o["widgets"] or o["plots"] or o["closed"])):
            problems.append(f"{where}: the widget did not render")
        if o["drawn"] < o["plots"]:
            problems.append(f"{where}: {o['plots'] - o['drawn']} of {o['plots']} plotly figures not drawn")
        if o["scroll_width"] > o["client_width"] + 1:
            problems.append(f"{where}: scrolls sideways ({o['scroll_width']} > {o['client_width']} px)")
        too_wide = [w for w in o["svg_widths"] if w > o["client_width"] + 1]
        if too_wide:
            problems.append(f"{where}: a figure {max(too_wide)} px wide in {o['client_width']} px")
    return problems


def _reveal_figures(page, outputs: list[dict]) -> None:
    """Scroll every plotly output into the window and wait until it is drawn: the plotly renderer draws a
    figure only once its output is on screen."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    cell_nodes = page.locator(".jp-Notebook .jp-Cell")
    for o in outputs:
        if o["kind"] not in ("plotly", "widget") or not o["found"]:
            continue
        child = cell_nodes.nth(o["cell"]).locator(".jp-OutputArea-child").nth(o["output"])
        child.scroll_into_view_if_needed()
        if o["kind"] == "plotly":
            with contextlib.suppress(PlaywrightTimeout):  # what stays undrawn is reported as not rendered
                child.locator(".js-plotly-plot svg.main-svg").first.wait_for(
                    state="attached", timeout=FIGURE_DRAW_MS
                )


def _save_figures(page, stem: str, outputs: list[dict]) -> Path | None:
    """One PNG per figure output under ``build/browser/<stem>/``; the first figure's cell is scrolled into the
    window for the notebook's screenshot. Returns the first figure's path."""
    first = None
    cell_nodes = page.locator(".jp-Notebook .jp-Cell")
    for o in outputs:
        if not o["found"] or not o["plots"]:
            continue
        child = cell_nodes.nth(o["cell"]).locator(".jp-OutputArea-child").nth(o["output"])
        child.scroll_into_view_if_needed()
        path = _screenshot(child, f"{stem}/cell{o['cell']:02d}")
        if first is None:
            first, first_child = path, child
    if first is not None:
        first_child.scroll_into_view_if_needed()
    return first


def _check_monitor_live(page, seen_while_running: list[int]) -> None:
    """00: the LiveMonitor's figure grew in the page while its cell was still running."""
    final = page.evaluate(MONITOR_JS)
    assert final is not None and not final["running"]
    assert final["points"] >= 2 and final["steps"] >= 3, final
    assert seen_while_running, "never saw the monitor's cell running"
    assert max(seen_while_running) >= 2, f"no live points while running: {seen_while_running[-10:]}"


def _check_explorer(page) -> None:
    """01: the trie explorer (a FigureWidget driven by a dropdown and a slider) redrew for the last cell."""
    assert page.locator(".widget-slider").count() >= 1, "the explorer's slider did not render"
    assert page.locator(".widget-dropdown").count() >= 1, "the explorer's dropdown did not render"
    explorer = page.locator(".jp-OutputArea-output:has(.widget-slider) .js-plotly-plot")
    assert explorer.count() == 1
    assert "agentic, rollout 5" in explorer.first.inner_text()


# points of the monitor's host-memory line in the page, and whether the monitor's cell is running
MONITOR_JS = f"""() => {{
    const nb = ({_NB})().content;
    for (let i = 0; i < nb.model.cells.length; i++) {{
        const cell = nb.model.cells.get(i);
        if (cell.type !== 'code' || !cell.sharedModel.getSource().includes('with LiveMonitor(')) continue;
        const node = nb.widgets[i].node;
        const plot = node.querySelector('.js-plotly-plot');
        const trace = plot && plot.data && plot.data.find(t => t.meta === 'rss');
        return {{
            running: (node.querySelector('.jp-InputArea-prompt') || {{}}).textContent === '[*]:',
            points: trace && trace.x ? trace.x.length : 0,
            steps: plot && plot.data ? (plot.data.find(t => t.meta === 'latency') || {{x: []}}).x.length : 0,
        }};
    }}
    return null;
}}"""
LEFT_PANEL_JS = """() => {
    const left = document.querySelector('#jp-left-stack');
    return {shown: !!left && !left.classList.contains('lm-mod-hidden'),
            width: left ? left.getBoundingClientRect().width : 0};
}"""
SHUTDOWN_JS = f"() => ({_NB})().sessionContext.shutdown()"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_and_fits_in_jupyterlab(lab_url, browser, name):
    stem = name.removesuffix(".ipynb")
    committed = (NOTEBOOK_DIR / name).read_bytes()
    seen_while_running = []

    def watch_monitor(page):
        state = page.evaluate(MONITOR_JS)
        if state and state["running"]:
            seen_while_running.append(state["points"])

    live = name.startswith("00_")
    page, cells = _open_and_run_all(browser, lab_url, name, while_running=watch_monitor if live else None)
    try:
        _assert_clean_run(name, cells)
        _reveal_figures(page, page.evaluate(OUTPUTS_JS))
        outputs = page.evaluate(OUTPUTS_JS)
        problems = _layout_problems(outputs)
        _save_figures(page, stem, outputs)
        _screenshot(page, stem)
        assert not problems, f"{name} at a {WINDOW['width']}-px window:\n" + "\n".join(problems)
        kinds = [o["kind"] for o in outputs]
        assert "plotly" in kinds or "widget" in kinds, f"{name} shows no figure and no widget"
        if live:
            _check_monitor_live(page, seen_while_running)
        if name.startswith("01_"):
            _check_explorer(page)
    finally:
        try:
            page.evaluate(SHUTDOWN_JS)  # the next notebook gets the CPU to itself
        finally:
            page.close()
    assert (NOTEBOOK_DIR / name).read_bytes() == committed, "the committed notebook was modified"


def test_layout_problems_names_every_kind_of_failure():
    """The checker itself (no browser): each broken output is reported, a clean one is not."""
    clean = dict(found=True, traceback=False, plots=1, drawn=1, widgets=0, broken=False, closed=False)
    clean.update(scroll_width=1100, client_width=1100, svg_widths=[980, 980])
    outputs = [
        dict(clean, cell=1, output=0, kind="plotly"),
        dict(clean, cell=2, output=0, kind="plotly", svg_widths=[1400, 1400], scroll_width=1400),
        dict(clean, cell=3, output=0, kind="plotly", plots=0, drawn=0, svg_widths=[]),
        dict(clean, cell=4, output=1, kind="widget", broken=True),
        dict(clean, cell=5, output=0, kind="widget", plots=2, drawn=1),
        dict(cell=6, output=0, kind="plotly", found=False),
        dict(clean, cell=7, output=0, kind="stream", plots=0, drawn=0, svg_widths=[], traceback=True),
        dict(clean, cell=8, output=0, kind="widget", plots=0, drawn=0, svg_widths=[]),  # nothing drawn
        dict(clean, cell=9, output=0, kind="widget", plots=0, drawn=0, svg_widths=[], closed=True),
    ]
    problems = _layout_problems(outputs)
    assert not [p for p in problems if p.startswith("cell 1 ")]
    assert any("cell 2 " in p and "scrolls sideways" in p for p in problems)
    assert any("cell 2 " in p and "1400 px wide in 1100 px" in p for p in problems)
    assert any("cell 3 " in p and "did not render" in p for p in problems)
    assert any("cell 4 " in p and "widget did not render" in p for p in problems)
    assert any("cell 5 " in p and "1 of 2 plotly figures not drawn" in p for p in problems)
    assert any("cell 6 " in p and "not in the page" in p for p in problems)
    assert any("cell 7 " in p and "traceback" in p for p in problems)
    assert any("cell 8 " in p and "widget did not render" in p for p in problems)
    assert not [p for p in problems if p.startswith("cell 9 ")]  # closed by its cell: nothing to show
