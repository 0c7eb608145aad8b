"""Multi-token prediction through the training driver on CPU: the MTP losses are logged
(``metrics.jsonl``, TensorBoard), a resumed run carries the MTP weights by name and logs
what an uninterrupted one logs, and a Hugging Face export leaves them out, saying so.
Checkpoints with and without MTP refuse each other, naming ``model.mtp_num_layers``,
except a weights-only load of one without MTP, which starts the depths fresh and says so."""

from __future__ import annotations

import os
import signal

import pytest

from megatron_mhar.training.metrics import read_metrics
from tests.helpers import TINY

MTP_TINY = TINY + ["model.mtp_num_layers=2", "model.mtp_loss_scaling_factor=0.3",
                   "training.train_iters=4", "eval.interval=2"]


@pytest.fixture
def run_overrides(tmp_path, embedded_dir):
    """The overrides that place run ``name`` under ``tmp_path`` on the embedded corpus."""
    return lambda name: [f"run.output_dir={tmp_path}", f"run.name={name}", f"data.embedded_dir={embedded_dir}"]


@pytest.fixture
def tiny_mtp(run_overrides, single_process):
    from megatron_mhar.training.recipes import load_config

    return lambda name: load_config("smoke_cpu", MTP_TINY + run_overrides(name))


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


def test_mtp_and_plain_checkpoints_refuse_each_other(megatron_world1, tmp_path):
    """A resume across a change of ``model.mtp_num_layers`` names it with both values and
    what to do; a weights-only load may add MTP depths to a checkpoint without them, never
    drop or change a checkpoint's; the MTP losses' weight may change."""
    import dataclasses

    from megatron.core import dist_checkpointing

    from megatron_mhar.checkpoint import format as fmt
    from megatron_mhar.errors import ConfigError
    from megatron_mhar.models.gpt_config import GPTModelConfig

    plain, mtp = (dataclasses.asdict(GPTModelConfig(mtp_num_layers=n)) for n in (None, 2))
    one = dict(mtp, mtp_num_layers=1)
    for name, model, iteration in (("plain", plain, 5), ("converted", plain, 0), ("mtp", mtp, 5)):
        (tmp_path / name).mkdir()
        dist_checkpointing.save({"iteration": iteration, "config": {"model": model, "mhar": {}}}, str(tmp_path / name))

    def check(name, model, model_only=False):
        return fmt.check_config(tmp_path / name, {"model": model, "mhar": {}}, model_only)

    with pytest.raises(ConfigError, match=r"model.mtp_num_layers: None \(checkpoint\) vs 2 \(config\)\n.*starts its 2 "
                       r"MTP depth\(s\) fresh .* checkpoint.load=\S+plain checkpoint.load_model_only=true"):
        check("plain", mtp)
    for model, model_only in ((plain, False), (plain, True), (one, True)):
        with pytest.raises(ConfigError, match=r"model.mtp_num_layers: 2 \(checkpoint\) vs (None|1) \(config\)\n"
                           r"the checkpoint holds 2 MTP depth\(s\): set model.mtp_num_layers=2"):
            check("mtp", model, model_only)
    assert check("plain", mtp, model_only=True)["iteration"] == 5
    assert check("converted", mtp)["iteration"] == 0  # step 0: weights only
    assert fmt.fresh_mtp_depths({"model": plain}, {"model": mtp}) == 2
    assert fmt.fresh_mtp_depths({"model": mtp}, {"model": mtp}) is None
    assert check("mtp", dict(mtp, mtp_loss_scaling_factor=0.5))["iteration"] == 5


def test_a_checkpoint_without_mtp_warm_starts_an_mtp_run(run_overrides, single_process, tmp_path, capsys,
                                                        monkeypatch):
    """checkpoint.load of a run without MTP, weights only, into an MTP recipe: the start
    line says the depths start fresh, and the first step's language-model loss is that of a
    run without MTP loaded the same way (the main weights are the checkpoint's). Resuming
    the run without MTP with the MTP recipe exits 2 naming model.mtp_num_layers."""
    from megatron_mhar.train import main
    from megatron_mhar.training.loop import run
    from megatron_mhar.training.recipes import load_config

    short = ["optimizer.lr_warmup_iters=0", "training.train_iters=1"]
    plain = [o for o in MTP_TINY if not o.startswith("model.mtp_")] + short
    source = run(load_config("smoke_cpu", plain + run_overrides("source")))
    warm = short + [f"checkpoint.load={source.run_dir / 'checkpoints'}", "checkpoint.load_model_only=true"]
    capsys.readouterr()
    with_mtp = run(load_config("smoke_cpu", MTP_TINY + run_overrides("with_mtp") + warm))
    assert ("the model's 2 MTP depth(s) (model.mtp_num_layers) start from their initialisation: the checkpoint "
            "has no MTP weights") in capsys.readouterr().out
    without = run(load_config("smoke_cpu", plain + run_overrides("without") + warm))
    first = [read_metrics(r.run_dir, "train")[0] for r in (with_mtp, without)]
    assert first[0]["loss"] == first[1]["loss"] and "mtp/depth1_loss" in first[0]

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["smoke_cpu", *MTP_TINY, *short, *run_overrides("source")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "model.mtp_num_layers: None (checkpoint) vs 2 (config)" in err and "Traceback" not in err
