"""Multi-token prediction through the training driver on CPU: the MTP losses are logged
(``metrics.jsonl``, TensorBoard), a resumed run carries the MTP weights by name and logs
what an uninterrupted one logs, and a Hugging Face export leaves them out, saying so."""

from __future__ import annotations

import os
import signal

import pytest

from megatron_mhar.training.metrics import read_metrics
from tests.helpers import TINY

MTP_TINY = TINY + ["model.mtp_num_layers=2", "model.mtp_loss_scaling_factor=0.3",
                   "training.train_iters=4", "eval.interval=2"]


@pytest.fixture
def tiny_mtp(tmp_path, embedded_dir, single_process):
    from megatron_mhar.training.recipes import load_config

    def make(name):
        return load_config("smoke_cpu", MTP_TINY + [
            f"run.output_dir={tmp_path}", f"run.name={name}", f"data.embedded_dir={embedded_dir}"])

    return make


def test_mtp_losses_logged_resumed_exactly_and_left_out_of_exports(tiny_mtp, tmp_path, capsys):
    """4 steps straight == 2 steps, stop (SIGUSR1), resume, 2 steps: every logged record
    bitwise, the MTP losses of both depths included; the export has no MTP tensor."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megatron_mhar.training.loop import run

    straight = run(tiny_mtp("straight"))

    def stop_at_2(trainer, step):
        if step == 2:
            os.kill(os.getpid(), signal.SIGUSR1)

    cfg = tiny_mtp("resumed")
    assert run(cfg, step_hook=stop_at_2).iteration == 2
    assert run(cfg).iteration == 4

    records = read_metrics(straight.run_dir, "train")
    assert records == [dict(r, tokens_per_s=s["tokens_per_s"], memory_gb=s["memory_gb"])
                       for r, s in zip(read_metrics(cfg.run.dir, "train"), records, strict=True)]
    for record in records:
        # near log(vocabulary) at the start, as the main loss
        assert 4.0 < record["mtp/depth1_loss"] < 8.0 and 4.0 < record["mtp/depth2_loss"] < 8.0
    assert records[0]["mtp/depth1_loss"] != records[1]["mtp/depth1_loss"]  # per step, not summed
    events = EventAccumulator(str(cfg.run.dir / "tensorboard"))
    events.Reload()
    assert {"train/mtp/depth1_loss", "train/mtp/depth2_loss"} <= set(events.Tags()["scalars"])
    assert [e.value for e in events.Scalars("train/mtp/depth2_loss")] == pytest.approx(
        [r["mtp/depth2_loss"] for r in records])
    _export_drops_mtp(straight.run_dir, tmp_path, capsys)


def _export_drops_mtp(run_dir, out, capsys):
    from megatron_mhar.conversion.convert import mcore_to_hf
    from megatron_mhar.runtime import destroy, initialize_model_parallel_from_env
    from tests.helpers import read_safetensors

    initialize_model_parallel_from_env(device="cpu")
    try:
        capsys.readouterr()
        exported = mcore_to_hf(run_dir / "checkpoints", out / "hf")
    finally:
        destroy()
    assert "2 MTP depth(s) (its mtp.* tensors) are left out of the export" in capsys.readouterr().out
    names = list(read_safetensors(exported))
    assert names and not any("mtp" in name for name in names)
