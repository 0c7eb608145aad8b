"""Signals in a real process, the demo, the routing-entropy logging, where caches go."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy
import pytest

from megatron_mhar.training.metrics import read_metrics
from tests.helpers import TINY


def _signalled_run(tmp_path, embedded_dir, *signals):
    """Starts ``python -m megatron_mhar.train``, sends ``signals`` once two steps are
    logged (50 ms apart: the tiny model's step and save take longer); (return code, output)."""
    run_dir = tmp_path / "sig"
    cmd = [sys.executable, "-m", "megatron_mhar.train", "smoke_cpu", *TINY,
           "training.train_iters=100000", "optimizer.lr_warmup_iters=2", "eval.interval=0",
           f"run.output_dir={tmp_path}", "run.name=sig", f"data.embedded_dir={embedded_dir}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    try:
        deadline = time.monotonic() + 240
        while len(read_metrics(run_dir, "train")) < 2:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "training did not start"
            time.sleep(0.2)
        for sig in signals:
            proc.send_signal(sig)
            time.sleep(0.05)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, output


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_stop_signal_saves_and_exits_cleanly(tmp_path, embedded_dir, single_process, sig):
    """A real SIGTERM (Slurm) or Ctrl-C to ``python -m megatron_mhar.train``: checkpoint at
    the current step, exit 0."""
    run_dir = tmp_path / "sig"
    returncode, output = _signalled_run(tmp_path, embedded_dir, sig)
    assert returncode == 0, output
    assert f"received {sig.name}" in output and "Traceback" not in output, output
    # megatron_mhar.quiet: no library warnings, no rerun-machine log lines
    assert "Warning:" not in output and "Rerun" not in output, output
    last = read_metrics(run_dir, "train")[-1]["step"]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"iter_{last:07d}"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped_by"] == sig.name and summary["iteration"] == last


def test_second_ctrl_c_stops_at_once_without_traceback(tmp_path, embedded_dir, single_process):
    returncode, output = _signalled_run(tmp_path, embedded_dir, signal.SIGINT, signal.SIGINT)
    assert returncode == 130, output
    assert "Traceback" not in output, output
    saved = sorted((tmp_path / "sig" / "checkpoints").glob("iter_*"))
    way_back = f"the steps since {saved[-1]} are lost; `" if saved else "no checkpoint was saved yet, so every step is lost"
    assert f"stopped at once; {way_back}" in output, output


def test_routing_entropy_is_logged(tiny):
    """Per-site per-head entropy in metrics.jsonl and TensorBoard; the routing maps at the end."""
    from megatron_mhar.training.loop import run

    cfg = tiny("training.train_iters=3", "eval.interval=0")
    run(cfg)
    records = read_metrics(cfg.run.dir, "train")
    entropy = records[-1]["routing_entropy"]
    assert len(entropy) == 2 * cfg.model.num_layers + 1  # every site of the full variant
    for heads in entropy.values():
        assert len(heads) == cfg.mhar.num_heads and all(0 <= h <= numpy.log(5) + 1e-6 for h in heads)
    assert (cfg.run.dir / "routing_maps.png").is_file() and (cfg.run.dir / "routing_maps.json").is_file()


def test_the_embedded_corpus_goes_to_data_cache_dir(tiny, tmp_path, monkeypatch):
    """Without data.embedded_dir the driver builds the embedded corpus in
    ``{data.cache_dir}/embedded``, and writes nothing under the home directory."""
    from megatron_mhar.training.loop import run

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    cache = tmp_path / "cache"
    cfg = tiny("data.embedded_dir=null", f"data.cache_dir={cache}", "training.train_iters=3",
               "eval.interval=0", "checkpoint.save_at_end=false")
    assert run(cfg).iteration == 3
    (build,) = (cache / "embedded").iterdir()
    assert (build / "manifest.json").is_file()
    assert not (tmp_path / "home").exists()
