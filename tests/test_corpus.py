"""The bundled text corpus: files match their manifest, splits are fixed, windows and training behave."""

from __future__ import annotations

import hashlib
import importlib.util
import json

import pytest
import torch

from treeattn_lab.corpus import (
    CORPUS_DIR,
    VOCAB_SIZE,
    batches,
    causal_sdpa,
    decode,
    evaluate_loss,
    load_corpus,
    train_language_model,
)
from treeattn_lab.reference import TinyLM, TinyLMConfig, causal_attention


def _manifest() -> dict:
    return json.loads((CORPUS_DIR / "MANIFEST.json").read_text(encoding="utf-8"))


def test_files_match_manifest_hashes():
    for name, entry in _manifest()["files"].items():
        data = (CORPUS_DIR / name).read_bytes()
        assert len(data) == entry["bytes"], name
        assert hashlib.sha256(data).hexdigest() == entry["sha256"], name


def test_build_script_check_agrees():
    spec = importlib.util.spec_from_file_location("build_corpus", CORPUS_DIR.parent / "build_corpus.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.check() == []


def test_splits_are_fixed_disjoint_modules_and_real_text():
    modules = _manifest()["modules"]
    train = {m["path"] for m in modules if m["split"] == "train"}
    validation = {m["path"] for m in modules if m["split"] == "validation"}
    assert train and validation and not train & validation
    train_tokens, val_tokens = load_corpus("train"), load_corpus("validation")
    assert train_tokens.dtype == torch.int64 and train_tokens.dim() == 1
    assert 1_500_000 < train_tokens.numel() < 3_000_000
    assert 0.03 < val_tokens.numel() / train_tokens.numel() < 0.15
    assert int(train_tokens.min()) >= 0 and int(train_tokens.max()) < VOCAB_SIZE
    assert torch.equal(load_corpus("validation"), val_tokens)  # same every call
    text = decode(val_tokens[:2000])
    assert text.startswith("# === Lib/csv.py ===") and "def " in text
    for module in validation:  # every module sits in its own split's file under its header
        assert f"# === {module} ===" in decode(val_tokens)


def test_load_corpus_returns_a_fresh_tensor():
    a = load_corpus("validation")
    a[:10] = 0
    assert int(load_corpus("validation")[:10].min()) > 0


@pytest.mark.parametrize("bad", ["test", "TRAIN", 0])
def test_load_corpus_rejects_unknown_split(bad):
    with pytest.raises(ValueError, match="split"):
        load_corpus(bad)


def test_batches_are_seeded_windows_in_range():
    tokens = load_corpus("validation")
    gen_a, gen_b = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    pairs = zip(batches(tokens, 4, 33, gen_a), batches(tokens, 4, 33, gen_b), range(3), strict=False)
    for (xa, ya), (xb, yb), _ in pairs:
        assert xa.shape == ya.shape == (4, 33) and xa.dtype == torch.int64
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert torch.equal(xa[:, 1:], ya[:, :-1])  # targets are the inputs shifted by one
        for row_x, row_y in zip(xa, ya, strict=True):  # each row is a real window of the corpus
            window = torch.cat([row_x, row_y[-1:]])
            hits = (tokens.unfold(0, 34, 1) == window).all(dim=1)
            assert bool(hits.any())


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"batch_size": 0, "seq_len": 8}, ValueError),
        ({"batch_size": 2, "seq_len": 10**8}, ValueError),
        ({"batch_size": 2.0, "seq_len": 8}, TypeError),
    ],
)
def test_batches_reject_bad_arguments(kwargs, error):
    with pytest.raises(error):
        next(batches(load_corpus("validation"), **kwargs))
    with pytest.raises(TypeError, match="1-D int64"):
        next(batches(torch.randn(100), 2, 8))


def test_causal_sdpa_equals_reference():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 9, 4, 8, generator=gen, dtype=torch.float64)
    k, v = torch.randn(2, 2, 9, 2, 8, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(causal_sdpa(q, k, v), causal_attention(q, k, v))


def _tiny_model(seed: int = 0) -> TinyLM:
    torch.manual_seed(seed)
    cfg = TinyLMConfig(vocab_size=VOCAB_SIZE, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64)
    return TinyLM(cfg)


def test_training_lowers_loss_and_is_seeded():
    val = load_corpus("validation")
    model = _tiny_model()
    before = evaluate_loss(model, val, seq_len=64, max_windows=32)
    assert before == pytest.approx(evaluate_loss(model, val, seq_len=64, max_windows=32))
    history = train_language_model(
        model, load_corpus("train"), steps=30, batch_size=8, seq_len=64, lr=1e-2, seed=1, progress=False
    )
    after = evaluate_loss(model, val, seq_len=64, max_windows=32)
    assert len(history["loss"]) == 30 and history["step"] == list(range(30))
    assert before > 5.0  # about ln 256 = 5.55 at initialization
    assert after < before - 1.0
    twin = _tiny_model()
    again = train_language_model(
        twin, load_corpus("train"), steps=30, batch_size=8, seq_len=64, lr=1e-2, seed=1, progress=False
    )
    assert again["loss"] == pytest.approx(history["loss"], rel=1e-4)


def test_training_with_several_passes_steps_once_per_pass():
    model = _tiny_model()
    calls = []

    def counting(q, k, v):
        calls.append(q.shape)
        return causal_sdpa(q, k, v)

    history = train_language_model(
        model,
        load_corpus("validation"),
        steps=2,
        batch_size=2,
        seq_len=16,
        attention=[causal_sdpa, counting],
        progress=False,
    )
    assert len(history["pass_losses"]) == 2 and all(len(p) == 2 for p in history["pass_losses"])
    assert len(calls) == 2  # one layer, called once per step in the second pass
    with pytest.raises(TypeError, match="callable"):
        train_language_model(model, load_corpus("validation"), steps=1, attention=[], progress=False)
    with pytest.raises(ValueError, match="steps"):
        train_language_model(model, load_corpus("validation"), steps=0, progress=False)
