"""TreeGRPOTrainer against TRL's stock GRPOTrainer: a few GRPO steps of a tiny random-weight Qwen2 on the
CPU, same seed, same generations. The loss of every step and the gradients of step 0 must agree (float32
model: within 1e-5 relative), in every tree mode, with the reference model's KL and with old-policy
log-probs (``num_iterations=2``), both computed through the tree too."""

from __future__ import annotations

import pytest
import torch

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
tokenizers = pytest.importorskip("tokenizers")

from treeattn_lab.integrations.trl import TreeGRPOTrainer  # noqa: E402

PROMPTS = ["w1 w2 w3 w4", "w5 w6 w7", "w8 w9 w10 w11 w12", "w13 w14"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random Qwen2 and a word-level tokenizer, saved where TRL loads policy and reference from."""
    path = tmp_path_factory.mktemp("tiny_qwen2")
    words = ["[PAD]", "[EOS]"] + [f"w{i}" for i in range(38)]
    tok = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0")
    )
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", eos_token="[EOS]"
    )
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(
        vocab_size=len(words),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=48,
        max_position_embeddings=128,
        pad_token_id=0,
        eos_token_id=1,
    )
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, tokenizer


def reward(completions, **kwargs):
    return [float(len(c) % 3) for c in completions]


class StepZeroGradients(transformers.TrainerCallback):
    def __init__(self):
        self.grads = None

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if state.global_step == 0:
            self.grads = {
                n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None
            }


def run_config(output_dir, **overrides):
    """The GRPOConfig of the tiny runs here: CPU, float32, four generations per prompt, no reports."""
    base = {
        "output_dir": str(output_dir),
        "per_device_train_batch_size": 8,
        "num_generations": 4,
        "max_completion_length": 6,
        "report_to": "none",
        "use_cpu": True,
        "save_strategy": "no",
        "seed": 0,
        "beta": 0.04,
        "bf16": False,
        "gradient_checkpointing": False,
        "disable_dropout": True,
    }
    return trl.GRPOConfig(**{**base, **overrides})


def make_trainer(cls, model_dir, args, **kwargs):
    path, tokenizer = model_dir
    return cls(
        model=str(path),
        reward_funcs=reward,
        args=args,
        processing_class=tokenizer,
        train_dataset=datasets.Dataset.from_dict({"prompt": PROMPTS}),
        **kwargs,
    )


def train(cls, model_dir, tmp_path, *, loss_type, num_iterations, checkpointing=False, **tree):
    args = run_config(
        tmp_path / cls.__name__,
        max_steps=3,
        logging_steps=1,
        gradient_checkpointing=checkpointing,
        learning_rate=1e-2,
        loss_type=loss_type,
        num_iterations=num_iterations,
    )
    grab = StepZeroGradients()
    trainer = make_trainer(cls, model_dir, args, callbacks=[grab], **tree)
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    return logged, grab.grads


@pytest.fixture(scope="module")
def stock_runs(model_dir, tmp_path_factory):
    cache = {}

    def run(loss_type, num_iterations):
        key = (loss_type, num_iterations)
        if key not in cache:
            tmp = tmp_path_factory.mktemp("stock")
            cache[key] = train(
                trl.GRPOTrainer, model_dir, tmp, loss_type=loss_type, num_iterations=num_iterations
            )
        return cache[key]

    return run


@pytest.mark.parametrize(
    ("tree_mode", "loss_type", "num_iterations", "checkpointing"),
    [
        ("packed", "dapo", 1, False),
        ("dfs", "dapo", 1, False),
        ("flat", "grpo", 1, False),
        ("auto", "grpo", 2, False),
        ("dfs", "dr_grpo", 2, False),
        ("dfs", "dapo", 1, True),  # TRL's default activation checkpointing, against the stock run without
        ("packed", "grpo", 2, True),
    ],
)
def test_tree_trainer_matches_the_stock_trainer(
    model_dir, stock_runs, tmp_path, tree_mode, loss_type, num_iterations, checkpointing
):
    want_logs, want_grads = stock_runs(loss_type, num_iterations)
    logs, grads = train(
        TreeGRPOTrainer,
        model_dir,
        tmp_path,
        loss_type=loss_type,
        num_iterations=num_iterations,
        checkpointing=checkpointing,
        tree_mode=tree_mode,
        block_tokens=3,
    )
    assert len(logs) == len(want_logs) == 3
    for got, want in zip(logs, want_logs, strict=True):  # every step's loss and TRL's loss metrics
        for key in [k for k in want if k == "loss" or k.startswith(("kl", "clip_ratio", "reward"))]:
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
    assert grads.keys() == want_grads.keys()
    total = torch.sqrt(sum(g.double().pow(2).sum() for g in want_grads.values()))
    for name, want in want_grads.items():
        err = (grads[name] - want).double().norm() / torch.maximum(want.double().norm(), 1e-6 * total)
        assert err <= 1e-5, f"{name}: relative error {err:.2e}"


def test_what_the_tree_cannot_reproduce_is_refused(model_dir, tmp_path):
    args = run_config(
        tmp_path, per_device_train_batch_size=4, max_completion_length=4, temperature=0.7, loss_type="cispo"
    )
    with pytest.raises(ValueError, match=r"loss_type 'cispo'.*temperature=0.7"):
        make_trainer(TreeGRPOTrainer, model_dir, args)


def evaluate(cls, model_dir, tmp_path, **tree):
    """``trainer.evaluate()`` of an untrained trainer: TRL computes the loss under ``torch.no_grad()``."""
    # bnpo is a token mean: nonzero though each group's advantages sum to zero
    args = run_config(tmp_path / cls.__name__, per_device_eval_batch_size=8, loss_type="bnpo")
    eval_dataset = datasets.Dataset.from_dict({"prompt": PROMPTS})
    trainer = make_trainer(cls, model_dir, args, eval_dataset=eval_dataset, **tree)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # the policy moves away from the reference: a nonzero KL
        for p in trainer.model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    before = [p.grad for p in trainer.model.parameters()]
    metrics = trainer.evaluate()
    assert all(p.grad is g for p, g in zip(trainer.model.parameters(), before, strict=True))
    return metrics


@pytest.mark.parametrize("tree_mode", ["packed", "dfs"])
def test_evaluate_matches_the_stock_trainer(model_dir, tmp_path, tree_mode):
    want = evaluate(trl.GRPOTrainer, model_dir, tmp_path / "stock")
    got = evaluate(TreeGRPOTrainer, model_dir, tmp_path / "tree", tree_mode=tree_mode, block_tokens=3)
    assert abs(want["eval_loss"]) > 1e-4 and want["eval_kl"] > 1e-4
    for key in [k for k in want if k == "eval_loss" or k.startswith(("eval_kl", "eval_clip_ratio"))]:
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key


def test_more_than_one_process_is_refused(model_dir, tmp_path, monkeypatch):
    import accelerate

    args = run_config(tmp_path, per_device_train_batch_size=4, max_completion_length=4)
    monkeypatch.setattr(accelerate.Accelerator, "num_processes", property(lambda self: 2))
    with pytest.raises(ValueError, match=r"2 processes .*TreeGRPOTrainer supports one process"):
        make_trainer(TreeGRPOTrainer, model_dir, args)
