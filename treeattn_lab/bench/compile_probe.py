"""Probe one dfs training step eager and with compiled decoder layers (``engine.compile_layers``).

    python -m treeattn_lab.bench.compile_probe --set agentic [--quick] [--backend inductor] [--dynamic true]

For each variant it prints one JSON line: the wall time of two steps; after each, the graphs dynamo
compiled, its frame compilations and graph breaks; the graph inputs that are floats or 0-d tensors
(values dynamo builds on the host for every call, which inductor's GPU kernels read back with
``.item()``); and, for a third step under ``torch.profiler``, every event that reads a value back to the
host or waits for the device, counted by name, beside the aten op count and, on CUDA, the kernel
launches. The model, set and sizes are those of ``bench train`` (``--quick``, or a machine without CUDA:
the tiny model on the shrunk sets).
"""

from __future__ import annotations

import argparse
import collections
import json

import torch
from torch._dynamo.backends.registry import lookup_backend
from torch._dynamo.utils import counters

from treeattn_lab.bench.step_profile import (
    DEVICE_SYNC_CALLS,
    HOST_READ_OPS,
    KERNEL_LAUNCH_CALLS,
    profiled_events,
    timed_tree_backward,
)
from treeattn_lab.bench.train import SETS, bench_trie, run_setup
from treeattn_lab.engine import compile_layers
from treeattn_lab.reference import TinyLM


def recording(backend: str, host_inputs: list):
    """``backend`` (a registered name) that first records each graph's float and 0-d tensor inputs."""
    compiler = lookup_backend(backend)

    def record(gm, example_inputs):
        host_inputs.extend(
            type(x).__name__ if not isinstance(x, torch.Tensor) else f"0-d {x.dtype} on {x.device}"
            for x in example_inputs
            if isinstance(x, (float, torch.SymFloat)) or (isinstance(x, torch.Tensor) and x.dim() == 0)
        )
        return compiler(gm, example_inputs)

    return record


def dynamo_state() -> dict:
    return {
        "graphs": counters["stats"]["unique_graphs"],
        "frame_compiles": counters["frames"]["total"],
        "graph_breaks": sum(counters["graph_break"].values()),
    }


def profiled_counts(model, trie, engine) -> dict:
    from torch.profiler import ProfilerActivity, profile

    cuda = next(model.parameters()).device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        timed_tree_backward(model, trie, mode="dfs", **engine)
    names = collections.Counter(name for name, _, _ in profiled_events(prof))
    out = {"aten_ops": sum(n for name, n in names.items() if name.startswith("aten::"))}
    out["host_reads"] = {name: names[name] for name in HOST_READ_OPS if names[name]}
    if cuda:
        out["kernel_launches"] = sum(names[name] for name in KERNEL_LAUNCH_CALLS)
        out["device_syncs"] = {name: names[name] for name in DEVICE_SYNC_CALLS if names[name]}
    return out


def probe(args, compiled: bool) -> dict:
    _, device, dtype, cfg, engine = run_setup(args)
    torch.manual_seed(0)
    model = TinyLM(cfg).to(device, dtype)
    trie = bench_trie(args.set, args.quick or device.type != "cuda")
    row: dict = {"variant": "eager"}
    host_inputs: list = []
    if compiled:
        torch._dynamo.reset()
        counters.clear()
        dynamic = {"none": None, "true": True, "false": False}[args.dynamic]
        compile_layers(model, backend=recording(args.backend, host_inputs), dynamic=dynamic)
        row["variant"] = f"compiled ({args.backend}, dynamic={dynamic})"
    for i in (1, 2):
        row[f"step_{i}_s"] = timed_tree_backward(model, trie, mode="dfs", **engine)
        if compiled:
            row[f"after_step_{i}"] = dynamo_state()
    if compiled:
        row["host_graph_inputs"] = dict(collections.Counter(host_inputs))
    row["profiled"] = profiled_counts(model, trie, engine)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", choices=SETS, default="agentic")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--dynamic", choices=("none", "true", "false"), default="none")
    args = parser.parse_args(argv)
    args.block_tokens = args.token_budget = None  # run_setup's defaults for the device
    for compiled in (False, True):
        print(json.dumps(probe(args, compiled)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
