"""The compiled-dfs probe (``python -m treeattn_lab.bench.compile_probe``) sees what it reports: graphs and
recompiles per step, and the floats a compiled layer takes from the host on every call."""

from __future__ import annotations

import json

from treeattn_lab.bench import compile_probe


def test_probe_reports_graphs_and_the_host_floats_of_dynamic_true(capsys):
    compile_probe.main(["--set", "agentic", "--quick", "--backend", "eager", "--dynamic", "true"])
    eager, compiled = (json.loads(line) for line in capsys.readouterr().out.splitlines()
                       if line.startswith("{"))
    assert eager["variant"] == "eager" and eager["profiled"]["aten_ops"] > 0
    assert compiled["after_step_1"]["graphs"] > 0
    assert compiled["after_step_2"] == compiled["after_step_1"]  # a second step compiles nothing new
    assert compiled["host_graph_inputs"]  # dynamic=True makes RMSNorm's eps a per-call input
