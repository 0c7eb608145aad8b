"""``benchmarks.bench_hf_checkpointing``: a training step's memory with and without activation checkpointing."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_hf_checkpointing_bench_reports_both_modes(tmp_path):
    out = tmp_path / "hf_checkpointing.json"
    subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_hf_checkpointing", "--models", "mhar_full",
         "--seq", "32", "--layers", "2", "--hidden", "64", "--vocab", "512", "--out", str(out)],
        check=True, cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    report = json.loads(out.read_text())
    assert report["architecture"]["num_hidden_layers"] == 2 and report["args"]["seq"] == 32
    entry = report["results"]["mhar_full"]
    for mode in ("off", "checkpointing"):
        assert entry[mode]["saved_for_backward_mib"] > 0 and entry[mode]["step_s"] > 0
    # the same step: checkpointing changes what is held, not the loss or the gradients
    assert entry["checkpointing"]["loss"] == entry["off"]["loss"]
    assert abs(entry["checkpointing"]["grad_norm"] - entry["off"]["grad_norm"]) <= 1e-5 * entry["off"]["grad_norm"]
    assert entry["saved_for_backward_mib_ratio"] == (
        entry["checkpointing"]["saved_for_backward_mib"] / entry["off"]["saved_for_backward_mib"])
