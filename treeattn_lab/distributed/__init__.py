"""Several GPUs (or CPU processes): partitioning rollout tries across ranks, ring attention, torchrun entry points."""
