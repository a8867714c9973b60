"""Several ranks: partitioning rollout tries across GPUs, ring attention, torchrun entry points."""
