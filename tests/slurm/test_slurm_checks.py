"""The Slurm scripts' check mode: every input checked before ``srun``, all problems at once.

``bash slurm/<script>.sh --check`` (and ``MHAR_DRY_RUN=1``) needs no allocation and no
Slurm: run with none of the variables its recipe reads, each script names all of them in
one message and exits 2; with its inputs given, it prints the ``srun`` command and the
configuration and starts nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# script -> the variables its recipe's paths read
SCRIPTS = {
    "cpt_8b_mhar_delta": ("MHAR_CPT_DATA_PREFIX", "MHAR_LLAMA3_TOKENIZER", "MHAR_MARIN_8B_CKPT"),
    "cpt_30b_a3b_mhar_delta": ("MHAR_CPT_DATA_PREFIX", "MHAR_QWEN3_30B_A3B_CKPT", "MHAR_QWEN3_TOKENIZER"),
    "pretrain_1b_mhar": ("MHAR_DATA_PREFIX", "MHAR_QWEN3_TOKENIZER"),
}


def _check(script: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MHAR_", "SLURM_"))}
    clean.update({"PYTHON": sys.executable, **env})
    return subprocess.run(["bash", f"slurm/{script}.sh", *args], cwd=REPO, env=clean, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_check_lists_every_missing_input_and_exits_2(script):
    done = _check(script, "--check")
    assert done.returncode == 2, done.stderr
    assert "srun" not in done.stdout
    assert f"error: environment variables not set: {', '.join(SCRIPTS[script])} (used by " in done.stderr


def test_launcher_problems_are_listed_together():
    done = _check("cpt_8b_mhar_delta", "--check", PYTHON="no-such-python", GPUS_PER_NODE="eight")
    assert done.returncode == 2
    assert "2 problem(s)" in done.stderr
    assert "error: PYTHON=no-such-python: no such command" in done.stderr
    assert "error: GPUS_PER_NODE=eight is not a number" in done.stderr


def test_dry_run_prints_the_command_and_configuration(tmp_path):
    """MHAR_DRY_RUN=1 (as ``MHAR_DRY_RUN=1 sbatch ...`` sets it): the job's layout from the
    script's #SBATCH lines (NODES overrides it outside an allocation), nothing started."""
    done = _check("cpt_8b_mhar_delta", "training.train_iters=50", MHAR_DRY_RUN="1", RECIPE="smoke_cpu",
                  GPUS_PER_NODE="0", NODES="1", OUTPUT_DIR=str(tmp_path))
    assert done.returncode == 0, done.stderr
    command = next(line for line in done.stdout.splitlines() if line.startswith("command: srun "))
    assert "--ntasks=1" in command and "-m megatron_mhar.train smoke_cpu run.device=cpu" in command
    assert "training.train_iters=50" in command
    assert "\ntraining:\n  train_iters: 50\n" in done.stdout
    assert not (tmp_path / "smoke_cpu").exists()
