"""The sparse-training experiment's settings (:mod:`.sparse_training`): the dense pretraining curriculum,
the long-context extension, the sparse budget and the four modes.

The curriculum (:class:`Stage`, after MTraining, which extends its models in stages) follows three rules:

- **Learn the copy short.** The first stage is short enough (quick and full: 128 bytes, the needle a few
  dozen bytes before the question) that the copy circuit forms, and it gets the most steps.
- **Grow the context by doubling.** In quick and full each stage is twice as long as the one before,
  and the extension twice the last (full: 128 up to 16K, then 32K): a model that retrieves at ``L`` bytes
  meets needles at most twice as far back, so the circuit it has carries over and only has to sharpen.
- **Never re-heat.** One AdamW runs through every stage, its moments carried over, and the learning rate
  never rises after the first stage's warmup: each stage decays by half a cosine from its own peak
  (``Stage.lr``, else the configuration's ``lr``) to the next stage's peak, the last stage to a tenth of
  its own (:meth:`ExperimentConfig.pretrain_lr`); the peaks may not rise from stage to stage. A new
  optimizer warming up to a high rate at a stage change takes steps as large as the first ones, which
  shake the circuit loose just when the longer context makes it harder to keep; later, longer stages take
  lower peaks.

The extension then trains three copies at ``seq_len``, each with its own AdamW at ``extend_lr`` (warmup
and cosine decay), no higher in full mode than the last stage's peak.

What lets a small byte model learn the copy: the probe's key mark (:mod:`.passkey`), one byte to match;
an induction head, which takes at least two layers (quick has three, full four); a key/value head of
its own per query head (quick and full use no grouping, so the previous-token head and the matching
head need not share keys); and the answer's loss weighed ``answer_weight`` times against the next-byte loss,
since a few digits per sample are otherwise a small share of the gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from ..checks import check_finite, check_int
from ..corpus import VOCAB_SIZE, lr_factor
from ..ops.dynamic_sparse import SparseBudget
from ..reference import TinyLMConfig
from .passkey import passkey_overhead


def byte_lm(dim: int, n_layers: int, n_heads: int, n_kv_heads: int, ffn_dim: int, rope_theta: float = 10000.0
            ) -> TinyLMConfig:
    """A byte-level TinyLM's configuration."""
    return TinyLMConfig(vocab_size=VOCAB_SIZE, dim=dim, n_layers=n_layers, n_heads=n_heads,
                        n_kv_heads=n_kv_heads, ffn_dim=ffn_dim, rope_theta=rope_theta)


@dataclass(frozen=True)
class Stage:
    """One dense pretraining stage: ``steps`` AdamW steps on batches of ``batch_size`` windows of
    ``seq_len`` bytes, starting at the peak learning rate ``lr`` (``None``: the configuration's ``lr``)."""

    seq_len: int
    steps: int
    batch_size: int
    lr: float | None = None

    def __post_init__(self):
        for name in ("seq_len", "steps", "batch_size"):
            check_int(f"Stage.{name}", getattr(self, name))
        if self.lr is not None:
            object.__setattr__(self, "lr", check_finite("Stage.lr", self.lr, positive=True))


@dataclass(frozen=True)
class ExperimentConfig:
    """One run of the protocol. ``pretrain``: the dense curriculum, its stages run in order at
    contexts that never shrink and never exceed ``seq_len``; every sample of every stage must hold the
    passkey's needle and question."""

    model: TinyLMConfig = field(default_factory=lambda: byte_lm(64, 3, 4, 4, 172))
    pretrain: tuple[Stage, ...] = (Stage(128, 800, 16), Stage(256, 600, 16))
    seq_len: int = 512  # the long context all three variants train at
    steps: int = 150
    batch_size: int = 4
    lr: float = 3e-3
    extend_lr: float = 1e-3
    n_vertical: int = 32  # the sparse budget per head (SparseBudget)
    n_slash: int = 48
    sinks: int = 4
    local: int = 32
    last_q: int = 64
    block_size: int = 16
    passkey_share: float = 0.75  # of the training samples
    answer_weight: float = 4.0  # of the answer digits' mean loss, added to the next-byte loss
    digits: int = 4
    depths: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7, 0.9)
    probes_per_depth: int = 8
    eval_windows: int = 16  # validation windows of seq_len bytes
    timing_reps: int = 2
    bf16: bool = False  # autocast to bf16 on CUDA
    seeds: tuple[int, ...] = (0,)

    def __post_init__(self):
        object.__setattr__(self, "lr", check_finite("lr", self.lr, positive=True))
        object.__setattr__(self, "extend_lr", check_finite("extend_lr", self.extend_lr, positive=True))
        if not math.isfinite(self.answer_weight) or self.answer_weight < 0:
            raise ValueError(f"answer_weight must be a finite number >= 0, got {self.answer_weight}")
        if not self.pretrain or not all(isinstance(s, Stage) for s in self.pretrain):
            raise TypeError(f"pretrain must be a non-empty tuple of Stage, got {self.pretrain!r}")
        lengths = [s.seq_len for s in self.pretrain]
        if lengths != sorted(lengths) or lengths[-1] > self.seq_len:
            raise ValueError(f"the pretraining contexts must grow stage by stage up to at most seq_len "
                             f"{self.seq_len}, got {lengths}")
        if lengths[0] <= passkey_overhead(self.digits):
            raise ValueError(f"a {lengths[0]}-byte sample of the first stage cannot hold the passkey's "
                             f"needle and question ({passkey_overhead(self.digits)} bytes for {self.digits} "
                             "digits)")
        peaks = self.stage_peaks()
        if list(peaks) != sorted(peaks, reverse=True):
            raise ValueError(f"the pretraining stages' peak learning rates must not rise from one stage to "
                             f"the next (the schedule never re-heats), got {list(peaks)}")

    def stage_peaks(self) -> tuple[float, ...]:
        """Each pretraining stage's peak learning rate (its ``lr``, else the configuration's)."""
        return tuple(self.lr if s.lr is None else s.lr for s in self.pretrain)

    def pretrain_lr(self, stage: int, step: int) -> float:
        """The learning rate of step ``step`` of pretraining stage ``stage``: the first stage warms up
        linearly over its first ``min(100, steps // 10)`` steps; then every stage decays by half a cosine
        from its own peak toward the next stage's peak, which that stage starts at (the last stage toward a
        tenth of its peak), so the rate never rises after the warmup."""
        check_int("stage", stage, minimum=0)
        if stage >= len(self.pretrain):
            raise ValueError(f"stage {stage} is past the curriculum's {len(self.pretrain)} stages")
        check_int("step", step, minimum=0)
        if step >= self.pretrain[stage].steps:
            raise ValueError(f"step {step} is past stage {stage}'s {self.pretrain[stage].steps} steps")
        peaks, steps = self.stage_peaks(), self.pretrain[stage].steps
        warmup = min(100, steps // 10) if stage == 0 else 0
        end = peaks[stage + 1] if stage + 1 < len(peaks) else peaks[stage] * 0.1
        return peaks[stage] * lr_factor(step, steps, warmup, end / peaks[stage])

    def budget(self) -> SparseBudget:
        return SparseBudget(self.n_vertical, self.n_slash, sinks=self.sinks, local=self.local,
                            last_q=self.last_q, block_size=self.block_size)


# Full mode's curriculum: the copy forms at 128 bytes, then the context doubles up to 16K, each stage at
# a lower peak; the extension trains at 32K, below the last peak. The rates are lower than quick's, as
# suits a wider model.
# Full mode's budget: the sinks and a local band of 768 diagonals (7 block diagonals of tiles), 448 estimated
# columns and only 16 estimated diagonals beyond the band, since a far diagonal costs a block diagonal of
# tiles while a column costs one gathered bar.
_FULL = ExperimentConfig(model=byte_lm(256, 4, 4, 4, 688, rope_theta=500000.0),
                         pretrain=(Stage(128, 3000, 64, lr=1e-3), Stage(256, 600, 64, lr=1e-3),
                                   Stage(512, 600, 32, lr=8e-4), Stage(1024, 600, 32, lr=7e-4),
                                   Stage(2048, 600, 16, lr=6e-4), Stage(4096, 600, 8, lr=5e-4),
                                   Stage(8192, 800, 8, lr=4e-4), Stage(16384, 400, 4, lr=3e-4)),
                         seq_len=32768, steps=400, batch_size=1, lr=1e-3, extend_lr=3e-4, n_vertical=512,
                         n_slash=784, sinks=64, local=768, block_size=128, digits=5, probes_per_depth=8,
                         eval_windows=4, timing_reps=10, bf16=True)
MODES = {
    "tiny": ExperimentConfig(model=byte_lm(32, 2, 2, 1, 64), pretrain=(Stage(128, 20, 8), Stage(256, 10, 4)),
                             seq_len=256, steps=8, batch_size=2, n_vertical=16, n_slash=24, sinks=4, local=16,
                             last_q=16, block_size=16, passkey_share=0.5, digits=3, depths=(0.2, 0.5, 0.8),
                             probes_per_depth=2, eval_windows=2, timing_reps=1),
    "quick": ExperimentConfig(),
    "smoke": replace(_FULL, pretrain=(Stage(512, 5, 4), Stage(1024, 5, 2)), seq_len=4096, steps=5,
                     n_vertical=128, n_slash=264, sinks=16, local=256, depths=(0.5,), probes_per_depth=1,
                     eval_windows=1, timing_reps=2),
    "full": _FULL,
}
