"""The command that reproduces each committed result file written before runs recorded their own command
line (``"command"`` in the JSON), keyed by the file's label (its name before ``__``). A tuple adds a remark
where one command is not the whole story; ``None`` as the command means the run came from a script that
is not kept in the repository, and the remark then says so in the document."""

M = "python -m treeattn_lab"
TORCHRUN2 = "torchrun --standalone --nproc-per-node 2 -m treeattn_lab.bench"
RECORDED_COMMANDS = {  # result files without a "command" field: the command that reproduces them
    "tree": f"{M} bench tree --check",
    "tree-repeat": f"{M} bench tree --cases research --backends triton,auto,flex,flat",
    "tree-varlen": f"{M} bench tree --cases research --backends flat,flex,triton,gather-flat,varlen,auto "
                   "--check",
    "tree-fallback": f"{M} bench tree --cases research --backends flat,flex,triton,gather-flat,auto --check",
    "tree-tma": f"{M} bench tree --cases research --backends flat,flex,triton,auto --check",
    "tree-auto-data": f"{M} bench tree --cases data --backends flat,flex,triton,gather-flat,auto --check",
    "tree-before-redesign": (f"{M} bench tree --cases all --check", "the code before the house redesign "
                             "(cdb4083), run beside the redesigned code on the same H200"),
    "sparse-before-redesign": (f"{M} bench sparse --check --ring 0", "the code before the house redesign "
                               "(cdb4083), run beside the redesigned code on the same H200"),
    "dilated-before-redesign": (f"{M} bench dilated --check", "the code before the house redesign "
                                "(cdb4083), run beside the redesigned code on the same H200"),
    "tree-tune": f"{M} bench tree-tune",
    "tree-tune-atomic": f"{M} bench tree-tune --passes dkdv,atomic --loads pointer",
    "tree-tune-stream": (f"{M} bench tree-tune --passes stream", "a pass timing dQ beside dK/dV on a second "
                         "stream, not in the code"),
    "tree-bwd-profile": (None, "none: the profile came from a torch.profiler script that is not kept in "
                         "the repository; the note says what it timed"),
    "train": f"{M} bench train",
    "balance": f"{M} bench balance",
    "multi-gpu-train-2x-before-refit": f"NCCL_NVLS_ENABLE=0 {TORCHRUN2}.multi_gpu_train --set grpo_math "
                                       "--out bench/results",
    "sparse": f"{M} bench sparse --cases band --backends dense,triton --check",
    "sparse-tune": f"{M} bench sparse --cases band --backends dense,triton --check --tune",
    "sparse-ring": f"{TORCHRUN2}.ring",
    "sparse-ring-variants": (f"{TORCHRUN2}.ring [--high-priority] [--layouts striped]",
                             "one run per variant"),
    "sparse-ring-timeline": f"{TORCHRUN2}.ring --profile",
    "dilated": (f"{M} bench dilated", "three invocations merged, see the note"),
    "scan": f"{M} bench dilated --scan-only",
    "scan-tune": f"{M} bench dilated --scan-only --tune-scan",
    "scan-tune-persistent": f"{M} bench dilated --scan-only --tune-scan persistent",
    "scan-narrow-1": (f"{M} bench dilated --scan-only --scan-config CONFIG", "one per configuration below"),
    "scan-narrow-2": (f"{M} bench dilated --scan-only --scan-config CONFIG", "one per configuration below"),
    "rat-dilation-quick": "python -m treeattn_lab.experiments.rat_dilation --mode quick",
    "rat-dilation-full": ("python -m treeattn_lab.experiments.rat_dilation --mode full --seeds S",
                          "one process per seed, then the same with --merge"),
}
