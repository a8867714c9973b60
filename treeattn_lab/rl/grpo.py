"""A readable GRPO loop over rollout tries: sample, reward, advantages, log-probs, K PPO epochs, step.

One step of :class:`GRPO` (``GRPO.step``, read it top to bottom):

1. **sample** ``prompts_per_step`` problems of the task, ``group_size`` rollouts each, with the
   shared-prefix KV cache (:func:`treeattn_lab.rl.sample`); the rollouts come back as a trie;
2. **reward** every rollout (the task checks it), and turn the rewards into GRPO *advantages*: each
   reward minus its group's mean, over the group's standard deviation
   (:func:`treeattn_lab.rl.group_advantages`);
3. **log-probs** of the *old policy* (the model that sampled, before this step's updates) and, when
   ``beta > 0``, of the frozen *reference policy*, over the trie (:func:`treeattn_lab.engine.tree_logprobs`);
4. **train**: ``ppo_epochs`` times, the gradient of the PPO-clip objective with its KL term
   (:func:`treeattn_lab.rl.grpo_objective`) through :func:`treeattn_lab.engine.tree_backward`, gradient
   clipping, an AdamW step. Epoch 1 has ratio 1 everywhere; later epochs see the clip.

``mode="tree"`` runs phases 3 and 4 over the packed trie (each shared prefix token once; the engine mode
``tree_mode``, ``"packed"`` by default, with the tree attention ``attention_backend``: ``"auto"`` picks a
kernel on a GPU and the dense reference on a CPU, ``"flat"`` runs causal attention per rollout gathered
from the pack, see :func:`treeattn_lab.ops.tree_attention`); ``mode="flat"`` runs the identical loop with
every rollout padded on its own (engine mode ``"flat"``). Both give the same gradients; only the time
differs. Every phase is timed (wall clock, CUDA synchronised), the step's record holds the CUDA peak
memory (or the process's peak resident memory on a CPU), and a
:class:`treeattn_lab.lab.monitor.LiveMonitor` passed as ``monitor`` gets one step per GRPO step.
"""

from __future__ import annotations

import contextlib
import copy
import resource
import sys
import time
from dataclasses import dataclass

import torch

from ..checks import check_int
from ..engine import tree_backward, tree_logprobs
from .objectives import LOSS_TYPES, group_advantages, grpo_objective
from .sample import sample

MODES = ("flat", "tree")
PHASES = ("sample", "reward", "logprobs", "train")


@dataclass(frozen=True)
class GRPOConfig:
    prompts_per_step: int = 8
    group_size: int = 8  # rollouts per prompt: num_samples * prod(forks)
    forks: tuple[int, ...] = ()  # ways to fork at each turn boundary (num_samples = group_size / prod)
    max_new_tokens: int | None = None  # per turn (None: what the task's answers need)
    temperature: float = 1.0
    top_p: float = 1.0
    ppo_epochs: int = 2
    lr: float = 1e-3
    beta: float = 0.0  # weight of the k3 KL to the reference policy
    epsilon_low: float = 0.2
    epsilon_high: float | None = 0.28  # DAPO's clip-higher
    loss_type: str = "dapo"
    advantage_scale: str = "group"
    grad_clip: float = 1.0
    tree_mode: str = "packed"  # the engine mode of mode="tree": "packed", "dfs" or "auto"
    attention_backend: str = "auto"  # the tree attention of mode="tree" (treeattn_lab.ops.tree_attention)

    def __post_init__(self):
        check_int("prompts_per_step", self.prompts_per_step)
        check_int("group_size", self.group_size)
        check_int("ppo_epochs", self.ppo_epochs)
        forks = 1
        for k in self.forks:
            forks *= check_int("forks[...]", k)
        if self.group_size % forks:
            raise ValueError(f"group_size {self.group_size} is not a multiple of prod(forks) = {forks}")
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {self.loss_type!r}")
        if self.tree_mode not in ("packed", "dfs", "auto"):
            raise ValueError(f"tree_mode must be 'packed', 'dfs' or 'auto', got {self.tree_mode!r}")
        if not isinstance(self.attention_backend, str):
            raise TypeError(f"attention_backend must be a backend name, got {self.attention_backend!r}")
        if not (self.lr > 0 and self.grad_clip > 0 and self.beta >= 0):
            raise ValueError("lr and grad_clip must be > 0, beta >= 0")

    @property
    def num_samples(self) -> int:
        """Rollouts sampled per prompt before any fork."""
        forks = 1
        for k in self.forks:
            forks *= k
        return self.group_size // forks


@dataclass
class Rollouts:
    """What phases 1 and 2 produce: the problems and the sampled batch, then rewards and advantages."""

    problems: list
    batch: object  # treeattn_lab.rl.SampleBatch
    rewards: torch.Tensor | None = None  # [rollouts], set by GRPO.score
    advantages: torch.Tensor | None = None


@contextlib.contextmanager
def timed(times: dict, phase: str, device: torch.device):
    """Add the wall time of the block (CUDA synchronised on both ends) to ``times[phase]``."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    yield
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    times[phase] = times.get(phase, 0.0) + time.perf_counter() - start


def host_peak_rss_bytes() -> int:
    """The peak resident memory of this process so far (``getrusage``; kilobytes on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def _turn_forks(forks: tuple[int, ...], turns: int) -> tuple[int, ...]:
    """The forks of a task's turn boundaries: a multi-turn task samples ``turns`` turns, so its forks are
    padded with 1 (no fork) to ``turns - 1``; a single-turn task forks its answer into segments."""
    if turns == 1:
        return tuple(forks)
    if len(forks) > turns - 1:
        raise ValueError(f"{len(forks)} forks for a task of {turns} turns (at most one per boundary)")
    return tuple(forks) + (1,) * (turns - 1 - len(forks))


class GRPO:
    """The GRPO loop of the module docstring for ``model`` on ``task`` (an :class:`AdditionTask` or any
    object with ``problems``, ``prompt_ids``, ``environment``, ``rewards``, ``max_new_tokens`` and a
    ``tokenizer`` with ``eos_token_id``).

    ``seed`` fixes the problems of every step and the sampling generator: two loops with the same seed and
    the same starting weights (flat and tree) sample the same first batch. ``ref_model``: the reference
    policy (default: a frozen copy of ``model`` as it is now, made only when ``beta > 0``).
    """

    def __init__(
        self,
        model,
        task,
        config: GRPOConfig | None = None,
        *,
        mode: str = "tree",
        seed: int = 0,
        ref_model=None,
        monitor=None,
    ):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.model, self.task, self.config = model, task, config or GRPOConfig()
        self.mode, self.seed, self.monitor = mode, check_int("seed", seed, minimum=0), monitor
        self.engine_mode = "flat" if mode == "flat" else self.config.tree_mode
        # how tree_logprobs and tree_backward run this loop
        self.engine = {"mode": self.engine_mode, "attention_backend": self.config.attention_backend}
        self.forks = _turn_forks(self.config.forks, getattr(task, "turns", 1))
        if ref_model is None and self.config.beta > 0:
            ref_model = copy.deepcopy(model).requires_grad_(False)
        self.ref_model = ref_model
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=self.config.lr, betas=(0.9, 0.99), weight_decay=0.0
        )
        self.generator = torch.Generator().manual_seed(seed)
        self.device = next(model.parameters()).device
        self.history: list[dict] = []

    # ---------------------------------------------------------------------------------------------- phases
    def rollouts(self, step: int, generator: torch.Generator | None = None) -> Rollouts:
        """Phase 1: the step's problems and their sampled rollouts."""
        cfg, task = self.config, self.task
        problems = task.problems(cfg.prompts_per_step, seed=self.seed * 1_000_003 + step)
        batch = sample(
            self.model,
            task.prompt_ids(problems),
            num_samples=cfg.num_samples,
            max_new_tokens=cfg.max_new_tokens or task.max_new_tokens(),
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            eos_token_id=task.tokenizer.eos_token_id,
            generator=generator or self.generator,
            forks=self.forks,
            environment=task.environment(problems),
        )
        return Rollouts(problems, batch)

    def score(self, rollouts: Rollouts) -> None:
        """Phase 2: every rollout's reward, and its group-relative advantage."""
        rollouts.rewards = self.task.rewards(rollouts.problems, rollouts.batch)
        rollouts.advantages = group_advantages(
            rollouts.rewards, rollouts.batch.group_size, scale=self.config.advantage_scale
        )

    def objective(self, rollouts: Rollouts):
        """Phase 3: the old (and reference) policy's log-probs over the trie, closed into the objective."""
        cfg, trie = self.config, rollouts.batch.trie
        old = tree_logprobs(self.model, trie, **self.engine)
        ref = tree_logprobs(self.ref_model, trie, **self.engine) if cfg.beta > 0 else None
        return grpo_objective(
            old,
            rollouts.advantages,
            rollouts.batch.loss_masks(),
            ref_logps=ref,
            beta=cfg.beta,
            epsilon_low=cfg.epsilon_low,
            epsilon_high=cfg.epsilon_high,
            loss_type=cfg.loss_type,
        )

    def backward(self, rollouts: Rollouts, objective):
        """One PPO epoch's gradient, into fresh ``.grad``: ``tree_backward`` in this loop's engine mode."""
        self.optimizer.zero_grad(set_to_none=True)
        return tree_backward(self.model, rollouts.batch.trie, objective=objective, **self.engine)

    # ---------------------------------------------------------------------------------------------- a step
    def step(self) -> dict:
        """One GRPO step (module docstring); returns and records what it measured."""
        cfg, times, step = self.config, {}, len(self.history)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.model.eval()  # sampling and log-probs without dropout; TinyLM has none anyway
        with timed(times, "sample", self.device):
            rollouts = self.rollouts(step)
        with timed(times, "reward", self.device):
            self.score(rollouts)
        with timed(times, "logprobs", self.device):
            objective = self.objective(rollouts)
        losses, grad_norms = [], []
        with timed(times, "train", self.device):
            for _ in range(cfg.ppo_epochs):
                result = self.backward(rollouts, objective)
                grad_norms.append(
                    float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip))
                )
                self.optimizer.step()
                losses.append(result.loss)
        record = self._record(step, rollouts, times, losses, grad_norms)
        self.history.append(record)
        if self.monitor is not None:
            self.monitor.step(latency_ms=1e3 * record["step_s"], label=f"{self.mode} step {step}")
        return record

    def _record(self, step: int, rollouts: Rollouts, times: dict, losses, grad_norms) -> dict:
        stats = rollouts.batch.trie.stats()
        generated = sum(int(g.sum()) for g in rollouts.batch.generated)
        return {
            "step": step,
            "mode": self.mode,
            "reward": float(rollouts.rewards.mean()),
            "reward_std": float(rollouts.rewards.std()) if rollouts.rewards.numel() > 1 else 0.0,
            "loss": losses[0],
            "losses": losses,
            "grad_norm": grad_norms[0],
            "times_s": {p: times[p] for p in PHASES},
            "step_s": sum(times.values()),
            "flat_tokens": stats["flat_tokens"],
            "tree_tokens": stats["tree_tokens"],
            "token_ratio": stats["token_ratio"],
            "generated_tokens": generated,
            "peak_memory_bytes": torch.cuda.max_memory_allocated(self.device)
            if self.device.type == "cuda"
            else None,
            "host_peak_rss_bytes": host_peak_rss_bytes(),
        }

    def train(self, steps: int, *, progress: bool = True) -> list[dict]:
        """``steps`` GRPO steps behind a progress bar; returns their records."""
        from ..progress import progress_bar

        bar = progress_bar(range(check_int("steps", steps)), desc=f"GRPO ({self.mode})", disable=not progress)
        records = []
        for _ in bar:
            records.append(self.step())
            bar.set_postfix(reward=f"{records[-1]['reward']:.2f}", step_s=f"{records[-1]['step_s']:.2f}",
                            refresh=False)
        return records


__all__ = ["MODES", "PHASES", "GRPO", "GRPOConfig", "Rollouts", "host_peak_rss_bytes", "timed"]
