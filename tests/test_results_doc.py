"""docs/results.md is generated from bench/results/*.json and cannot drift from it."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from treeattn_lab.bench import report

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
DOC = ROOT / "docs" / "results.md"


def test_committed_document_matches_the_json():
    """The check a reviewer runs: any edit to a table, or a new or changed result file without
    regenerating, fails here."""
    proc = subprocess.run([sys.executable, "-m", "treeattn_lab", "results", "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture
def results_copy(tmp_path):
    folder = tmp_path / "bench" / "results"
    shutil.copytree(RESULTS, folder)
    doc = tmp_path / "docs" / "results.md"
    doc.parent.mkdir()
    shutil.copy(DOC, doc)
    return folder, doc


def test_a_changed_number_in_the_json_fails_the_check_until_regenerated(results_copy, capsys):
    folder, doc = results_copy
    path = next(folder.glob("train__*.json"))
    payload = json.loads(path.read_text())
    payload["rows"][0]["tokens_per_s"] = 12345678.0
    path.write_text(json.dumps(payload))
    assert report.check_document(folder, doc) == 1
    assert "differs" in capsys.readouterr().err
    assert "12,345,678" not in doc.read_text()
    report.write_document(folder, doc)
    assert "12,345,678" in doc.read_text()
    assert report.check_document(folder, doc) == 0


def test_a_hand_edit_of_the_document_fails_the_check(results_copy):
    folder, doc = results_copy
    doc.write_text(doc.read_text().replace("| grpo_math |", "| grpo_math (edited) |", 1))
    assert report.check_document(folder, doc) == 1


def test_every_result_file_is_in_the_document():
    text = DOC.read_text()
    for path in RESULTS.iterdir():
        assert f"bench/results/{path.name}" in text, path.name


def test_each_file_names_its_gpu_versions_and_command():
    text = report.render_document(RESULTS)
    for path in RESULTS.glob("*.json"):
        env = json.loads(path.read_text())["environment"]
        block = text.split(f"`bench/results/{path.name}`", 1)[1].split("\n### ", 1)[0]
        header = block.split("\n\n", 1)[0]
        assert env["device"] in header and env["torch"] in header and env["triton"] in header, path.name
        assert "\nCommand: " in block and "Command: not recorded" not in block, path.name


def test_unknown_benches_and_logs(tmp_path):
    (tmp_path / "mystery__cpu__torch-1__triton-1.json").write_text(json.dumps(
        {"bench": "mystery", "environment": {"device": "cpu", "torch": "1", "triton": "1"},
         "command": "python -m treeattn_lab bench mystery", "rows": [{"case": "a", "ms": 1.25}]}))
    (tmp_path / "run.log").write_text("a table\n")
    text = report.render_document(tmp_path)
    assert "## Other results" in text and "| case | ms |" in text and "| a | 1.25 |" in text
    assert "`python -m treeattn_lab bench mystery`" in text
    assert "- `bench/results/run.log`" in text


def test_bad_input_is_named_and_leaves_the_document_alone(tmp_path):
    doc = tmp_path / "results.md"
    doc.write_text("old\n")
    (tmp_path / "broken__cpu__torch-1__triton-1.json").write_text("{not json")
    with pytest.raises(ValueError, match="broken__cpu"):
        report.write_document(tmp_path, doc)
    assert doc.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken__cpu__torch-1__triton-1.json", "results.md"]
    with pytest.raises(FileNotFoundError, match="no results folder"):
        report.render_document(tmp_path / "missing")


def test_numbers_are_formatted_from_the_json():
    assert report.fmt(0.0036123) == "0.00361"
    assert report.fmt(48086.95) == "48,087"
    assert report.fmt(float("nan")) == "nan"
    assert report.fmt(True) == "yes"
    assert report.fmt(7) == "7"
    assert report.fmt("a|b") == "a\\|b"


def test_the_command_line_exit_status(results_copy, capsys):
    from treeattn_lab.__main__ import main

    folder, doc = results_copy
    argv = ["results", "--results-dir", str(folder), "--out", str(doc)]
    assert main([*argv, "--check"]) == 0
    doc.write_text("stale\n")
    assert main([*argv, "--check"]) == 1
    assert doc.read_text() == "stale\n"
    assert main(argv) == 0
    assert main([*argv, "--check"]) == 0
    capsys.readouterr()


def test_a_sparse_training_run_names_its_pretraining_curriculum():
    from treeattn_lab.bench.experiment_report import render_sparse_training

    stages = [{"seq_len": 128, "steps": 800, "batch_size": 16},
              {"seq_len": 256, "steps": 600, "batch_size": 8}]
    config = {"seq_len": 512, "pretrain": stages, "model": {}}
    lines = render_sparse_training({"config": config, "summary": []})
    assert "Dense pretraining: 800 steps at 128 (batch 16), then 600 steps at 256 (batch 8)." in lines
    assert not any(line.startswith("Dense pretraining") for line in render_sparse_training(
        {"config": {"seq_len": 512}, "summary": []}))
