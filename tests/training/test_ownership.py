"""One run, one owner: a second run into a live run's directory refuses before writing
anything, and nothing a run starts outlives it, SIGKILL included. Real processes, real signals.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from megatron_mhar.checkpoint.format import checkpoint_problem
from megatron_mhar.training.metrics import read_metrics
from tests.helpers import LAUNCHER_ENV, TINY
from tests.training import paused_run

REPO = Path(__file__).resolve().parents[2]


def _env():
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def _overrides(embedded_dir, output_dir, *extra):
    return [*TINY, f"data.embedded_dir={embedded_dir}", f"run.output_dir={output_dir}", "run.name=run",
            "logging.tensorboard=false", "eval.interval=0", *extra]


def _tree(directory: Path) -> dict:
    """Every file under ``directory`` with its size, time stamp and content hash."""
    return {str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns,
                                            hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(directory.rglob("*")) if p.is_file()}


def test_a_second_run_into_a_live_run_directory_exits_2_and_writes_nothing(tmp_path, embedded_dir):
    overrides = _overrides(embedded_dir, tmp_path, "training.train_iters=6", "checkpoint.interval=2")
    marker = tmp_path / "paused"
    first = paused_run.start("before-step-5", marker, overrides)
    try:
        paused_run.wait_for(marker, first)
        run_dir = tmp_path / "run"
        before = _tree(run_dir)
        second = subprocess.run([sys.executable, "-m", "megatron_mhar.train", "smoke_cpu", *overrides], cwd=REPO,
                                env=_env(), capture_output=True, text=True, timeout=300)
        assert _tree(run_dir) == before  # the loser wrote nothing
        assert second.returncode == 2, second.stderr[-3000:]
        lines = second.stderr.strip().splitlines()
        assert lines[0].startswith(f"mhar-train: error: run directory {run_dir} is in use by pid {first.pid} on "
                                   f"{os.uname().nodename}, started "), second.stderr
        assert "give this run another run.name" in lines[0] and "Traceback" not in second.stderr
        assert f"(mhar-train smoke_cpu {' '.join(overrides)})" in lines[0]  # the holder's whole command
        assert lines[-1] == "(MHAR_TRACEBACK=1 shows where it was raised)"
        marker.with_suffix(".go").write_text("")
        out, err = first.communicate(timeout=300)
        assert first.returncode == 0, err[-3000:]
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    # the winner's outputs are whole: every step logged once, its checkpoints verified
    assert [r["step"] for r in read_metrics(run_dir, "train")] == [1, 2, 3, 4, 5, 6]
    for name in ("iter_0000002", "iter_0000004", "iter_0000006"):
        assert checkpoint_problem(run_dir / "checkpoints" / name, "full") is None
    assert not (run_dir / ".lock").exists()  # released at the end


def test_sigkill_mid_save_leaves_no_process_behind(tmp_path, embedded_dir):
    """The trainer alone is killed while its checkpoint writer writes; 5 s later none of
    its helpers (Megatron's writer helper, the forked writer, the resource tracker) runs."""
    overrides = _overrides(embedded_dir, tmp_path, "training.train_iters=4", "checkpoint.interval=2")
    marker = tmp_path / "paused"
    trainer = paused_run.start("in-writer", marker, overrides)
    try:
        paused_run.wait_for(marker, trainer)
        helpers = psutil.Process(trainer.pid).children(recursive=True)
        commands = [" ".join(p.cmdline()) for p in helpers]
        assert any("resource_tracker" in c for c in commands), commands
        assert any("spawn_main" in c for c in commands), commands  # Megatron's writer helper
        assert any(p.ppid() == trainer.pid and p.cmdline() == psutil.Process(trainer.pid).cmdline()
                   for p in helpers), commands  # the forked writer
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.wait(timeout=30)
        time.sleep(5)
        alive = [p for p in helpers if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not alive, [" ".join(p.cmdline()) for p in alive]
    finally:
        if trainer.poll() is None:
            os.killpg(trainer.pid, signal.SIGKILL)
        for p in psutil.process_iter():  # whatever the session left, should the test fail
            try:
                if os.getsid(p.pid) == trainer.pid:
                    p.kill()
            except (ProcessLookupError, psutil.NoSuchProcess, PermissionError):
                pass


def _train(*overrides):
    return subprocess.run([sys.executable, "-m", "megatron_mhar.train", "smoke_cpu", *overrides], cwd=REPO,
                          env=_env(), capture_output=True, text=True, timeout=300)


def test_a_checkpoint_directory_belongs_to_the_run_that_created_it(tmp_path, embedded_dir):
    """Run B (another name, seed and output directory) pointed at run A's checkpoint.dir
    refuses with exit 2, naming A and checkpoint.load, and leaves no trace (no run directory,
    nothing of A's touched); through checkpoint.load it starts from A's checkpoint, saves
    and prunes in its own directory, and every checkpoint A's summary names stays."""
    shared = tmp_path / "shared"
    first = _train(*_overrides(embedded_dir, tmp_path / "a", "training.train_iters=4", "checkpoint.interval=2",
                               "checkpoint.keep_last=1", f"checkpoint.dir={shared}"))
    assert first.returncode == 0, first.stderr[-3000:]
    summary = json.loads((tmp_path / "a" / "run" / "summary.json").read_text())
    assert summary["checkpoint"] == str(shared / "iter_0000004")
    before = _tree(shared)

    other = ["run.seed=7", "training.train_iters=6", "checkpoint.interval=1", "checkpoint.keep_last=1"]
    second = _train(*_overrides(embedded_dir, tmp_path / "b", *other, f"checkpoint.dir={shared}"))
    assert second.returncode == 2, second.stderr[-3000:]
    assert second.stderr.startswith(
        f"mhar-train: error: checkpoint directory {shared} belongs to run 'run' ({tmp_path / 'a' / 'run'}); this "
        f"run ({tmp_path / 'b' / 'run'}) would resume from its checkpoints and prune them."), second.stderr
    assert f"checkpoint.load={shared}" in second.stderr and "Traceback" not in second.stderr
    assert _tree(shared) == before
    assert not (tmp_path / "b").exists()  # the refused run left no directory

    warm = _train(*_overrides(embedded_dir, tmp_path / "b", *other, f"checkpoint.load={shared}"))
    assert warm.returncode == 0, warm.stderr[-3000:]
    assert f"resumed from {shared / 'iter_0000004'} at step 4" in warm.stdout
    assert _tree(shared) == before  # read, never written or pruned
    assert [p.name for p in (tmp_path / "b" / "run" / "checkpoints").glob("iter_*")] == ["iter_0000006"]
