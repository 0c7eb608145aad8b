"""End-to-end runs of the training driver on CPU (single process, in-process)."""

from __future__ import annotations

import json
import math
import os
import signal

import pytest
import torch

from megatron_mhar.checkpoint import manifest
from megatron_mhar.training.metrics import read_metrics


def _run(cfg, step_hook=None):
    from megatron_mhar.training.loop import run

    return run(cfg, step_hook=step_hook)


def _train_losses(run_dir):
    return {r["step"]: r["loss"] for r in read_metrics(run_dir, "train")}


@pytest.mark.parametrize(
    "variant",
    [
        pytest.param("none", id="baseline"),  # Megatron's own GPT
        pytest.param("full", id="mhar-full"),  # routing over every sublayer output
    ],
)
def test_run_writes_outputs_and_learns(tiny, variant):
    cfg = tiny(f"mhar.variant={variant}", "training.train_iters=12", "eval.interval=6")
    result = _run(cfg)
    run_dir = cfg.run.dir

    assert result.iteration == 12
    train = read_metrics(run_dir, "train")
    assert [r["step"] for r in train] == list(range(1, 13))  # one record per logged step
    for record in train:
        for key in ("loss", "lr", "grad_norm", "tokens_per_s", "memory_gb", "consumed_samples"):
            assert math.isfinite(record[key]), (key, record)
    assert train[-1]["consumed_samples"] == 12 * 4
    assert train[-1]["loss"] < train[0]["loss"] - 0.3  # it learns
    assert train[0]["lr"] == 0.0 and train[1]["lr"] == pytest.approx(5e-3)  # warm-up 2 steps
    assert [r["step"] for r in read_metrics(run_dir, "eval")] == [6, 12]

    evals = read_metrics(run_dir, "eval")
    assert evals[-1]["val_loss_tail"] == pytest.approx((evals[0]["val_loss"] + evals[1]["val_loss"]) / 2)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["val_loss"] == evals[-1]["val_loss"]
    assert summary["val_loss_tail"] == result.val_loss_tail
    assert (run_dir / "config.yaml").is_file()
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(run_dir / "tensorboard"))
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "iter_0000012"


def test_same_seed_same_losses(tiny):
    a = _run(tiny(name="a"))
    b = _run(tiny(name="b"))
    c = _run(tiny("run.seed=99", name="c"))
    assert a.losses == b.losses  # bitwise
    assert a.val_losses == b.val_losses
    assert a.losses != c.losses


DROPOUT = ("model.hidden_dropout=0.1", "model.attention_dropout=0.1")  # the RNG state decides the masks


def test_resume_is_exact(tiny):
    """2N steps straight == N steps, stop (signal), resume, N steps: bitwise on CPU, with
    dropout, so the restored RNG state is part of what is checked."""
    straight = _run(tiny("training.train_iters=8", "eval.interval=4", *DROPOUT, name="straight"))

    def stop_at_4(trainer, step):
        if step == 4:
            os.kill(os.getpid(), signal.SIGUSR1)

    cfg = tiny("training.train_iters=8", "eval.interval=4", *DROPOUT, name="resumed")
    first = _run(cfg, step_hook=stop_at_4)
    assert first.stopped_by == "SIGUSR1" and first.iteration == 4
    assert (cfg.checkpoint_dir / "latest").read_text().strip() == "iter_0000004"
    second = _run(cfg)
    assert second.iteration == 8
    assert min(second.losses) == 5  # resumed after step 4, did not redo steps

    assert _train_losses(cfg.run.dir) == _train_losses(straight.run_dir)  # bitwise
    assert second.val_losses == straight.val_losses  # includes the eval before the stop
    assert second.val_loss_tail == straight.val_loss_tail


def test_bf16_runs_megatrons_mixed_precision_path_and_resumes_exactly(tiny):
    """``training.precision=bf16`` on CPU: bf16 parameters under Megatron's mixed-precision
    optimizer (fp32 main weights, which the checkpoint carries); 2 + 2 steps resumed equal
    4 straight, bitwise."""
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    seen = {}

    def inspect(trainer, step):
        optimizer = trainer.optimizer.chained_optimizers[0] if hasattr(trainer.optimizer, "chained_optimizers") \
            else trainer.optimizer
        seen["optimizer"] = type(optimizer)
        seen["dtypes"] = {p.dtype for chunk in trainer.model for p in chunk.parameters()}
        seen["main"] = {p.dtype for group in optimizer.fp32_from_float16_groups for p in group}

    common = ("training.precision=bf16", "eval.interval=0", "optimizer.lr_decay_iters=4", *DROPOUT)
    straight = _run(tiny(*common, "training.train_iters=4", name="bf16"), step_hook=inspect)
    assert seen == {"optimizer": Float16OptimizerWithFloat16Params, "dtypes": {torch.bfloat16},
                    "main": {torch.float32}}
    _run(tiny(*common, "training.train_iters=2", name="bf16_resumed"))
    resumed = _run(tiny(*common, "training.train_iters=4", name="bf16_resumed"))
    assert min(resumed.losses) == 3
    assert _train_losses(resumed.run_dir) == _train_losses(straight.run_dir)  # bitwise
    assert straight.losses[4] < straight.losses[1]


@pytest.mark.gpu
def test_bf16_local_spec_on_gpu_keeps_one_dtype_and_resumes_exactly(tiny):
    """The local spec in bf16 on a GPU: torch's norms, built in fp32 whatever params_dtype
    says, are cast to bf16 with everything else, so Megatron's mixed-precision optimizer
    numbers one group of bf16 parameters and its checkpoint pairs each state with its
    parameter: 2 + 2 steps resumed equal 4 straight, bitwise. Megatron's own attention: the
    flash-attention backward of torch's SDPA sums in a varying order."""
    from megatron_mhar.training.model import unwrap

    seen = {}

    def inspect(trainer, step):
        model = unwrap(trainer.model[0])
        norms = [m for m in model.modules() if isinstance(m, (torch.nn.LayerNorm, torch.nn.RMSNorm))]
        seen.update(norms=bool(norms), dtypes={p.dtype for p in model.parameters()},
                    device=next(model.parameters()).device.type)

    common = ("run.device=cuda", "model.spec=local", "model.attention_backend=megatron",
              "training.precision=bf16", "eval.interval=0", "optimizer.lr_decay_iters=4",
              "logging.tensorboard=false", "logging.routing_entropy=false")
    straight = _run(tiny(*common, "training.train_iters=4", name="gpu_bf16"), step_hook=inspect)
    assert seen == {"norms": True, "dtypes": {torch.bfloat16}, "device": "cuda"}
    _run(tiny(*common, "training.train_iters=2", name="gpu_bf16_resumed"))
    resumed = _run(tiny(*common, "training.train_iters=4", name="gpu_bf16_resumed"))
    assert min(resumed.losses) == 3
    assert _train_losses(resumed.run_dir) == _train_losses(straight.run_dir)  # bitwise
    assert straight.losses[4] < straight.losses[1]


def test_first_loss_logged_after_a_resume_covers_the_whole_interval(tiny):
    """Stopped between two logged steps, the run saves the losses since the last log with
    the checkpoint: the loss logged after the resume averages the same steps as the
    uninterrupted run's (not only those after the resume)."""
    common = ("training.train_iters=8", "eval.interval=0", "logging.interval=4")
    straight = _run(tiny(*common, name="straight"))

    def stop_at_6(trainer, step):
        if step == 6:
            os.kill(os.getpid(), signal.SIGUSR1)

    cfg = tiny(*common, name="resumed")
    assert _run(cfg, step_hook=stop_at_6).iteration == 6
    _run(cfg)
    logged = _train_losses(cfg.run.dir)
    assert sorted(logged) == [4, 8]
    assert logged == _train_losses(straight.run_dir)  # bitwise
    assert logged[8] == sum(straight.losses[s] for s in range(5, 9)) / 4


def test_interrupted_save_keeps_last_good_checkpoint(tiny, monkeypatch):
    from megatron_mhar.training import checkpointing

    cfg = tiny("checkpoint.interval=3", "training.train_iters=3", name="crash")
    _run(cfg)
    good = cfg.checkpoint_dir / "iter_0000003"
    before = sorted(p.name for p in good.iterdir())

    real_save = checkpointing.dist_checkpointing.save

    def save_then_die(state, directory, *args, **kwargs):
        real_save(state, directory, *args, **kwargs)  # files are written ...
        raise KeyboardInterrupt("killed while publishing")  # ... but never published

    monkeypatch.setattr(checkpointing.dist_checkpointing, "save", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        _run(tiny("checkpoint.interval=3", "training.train_iters=6", name="crash"))
    monkeypatch.setattr(checkpointing.dist_checkpointing, "save", real_save)

    assert (cfg.checkpoint_dir / "latest").read_text().strip() == "iter_0000003"
    assert sorted(p.name for p in good.iterdir()) == before
    assert not (cfg.checkpoint_dir / "iter_0000006").exists()
    assert any(p.name.startswith(".tmp.") for p in cfg.checkpoint_dir.iterdir())

    resumed = _run(tiny("checkpoint.interval=3", "training.train_iters=6", name="crash"))
    assert min(resumed.losses) == 4 and resumed.iteration == 6
    assert (cfg.checkpoint_dir / "latest").read_text().strip() == "iter_0000006"
    assert not any(p.name.startswith(".tmp.") for p in cfg.checkpoint_dir.iterdir())


def test_checkpoints_without_latest_are_resumed(tiny, capsys):
    """Checkpoints that no ``latest`` names (a stop between publishing one and writing
    ``latest``, or a ``latest`` deleted) are not lost: the run resumes from the newest (a
    repeated save's suffix counts as newer), where a fresh start would also prune them."""
    cfg = tiny("training.train_iters=3", "eval.interval=0", name="nolatest")
    _run(cfg)
    (cfg.checkpoint_dir / "latest").unlink()
    resumed = _run(tiny("training.train_iters=5", "eval.interval=0", "checkpoint.keep_last=1", name="nolatest"))
    assert "has no 'latest' file; using the newest verified checkpoint, iter_0000003" in capsys.readouterr().out
    assert min(resumed.losses) == 4 and resumed.iteration == 5
    assert sorted(p.name for p in cfg.checkpoint_dir.iterdir()) == ["iter_0000005", "latest"]
    from megatron_mhar.checkpoint.format import find_checkpoint

    for name in ("iter_0000005.2", "iter_0000004", "iter_notes"):
        (cfg.checkpoint_dir / name).mkdir()
        (cfg.checkpoint_dir / name / "metadata.json").write_text("{}")
        manifest.write_manifest(cfg.checkpoint_dir / name)
    (cfg.checkpoint_dir / "latest").unlink()
    assert find_checkpoint(cfg.checkpoint_dir).name == "iter_0000005.2"


def _snapshot(directory):
    """Every file under ``directory`` with its bytes."""
    return {p.relative_to(directory): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("train_iters", [4, 3], ids=["same-length", "shorter"])
def test_a_finished_run_restarted_writes_nothing(tiny, capsys, train_iters):
    """A finished run requeued (or restarted by hand) changes no file: no second final
    evaluation, no metrics, no TensorBoard events, no checkpoint, config or summary. The
    final evaluation precedes the last interval save, so the checkpoint holds it."""
    cfg = tiny("training.train_iters=4", "eval.interval=0", "checkpoint.interval=2", name="finished")
    _run(cfg)
    before = _snapshot(cfg.run.dir)
    capsys.readouterr()
    for _ in range(2):
        again = _run(tiny(f"training.train_iters={train_iters}", "eval.interval=0", "checkpoint.interval=2",
                          name="finished"))
        assert again.iteration == 4 and not again.losses and [s for s, _ in again.val_losses] == [4]
    assert f"is at step 4, at or past training.train_iters={train_iters}: nothing to train, nothing written" in (
        capsys.readouterr().out
    )
    assert _snapshot(cfg.run.dir) == before


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param("truncate:__0_0.distcp", id="shard-truncated"),  # an interrupted copy
        pytest.param("truncate:common.pt", id="common-truncated"),
        pytest.param("delete:.metadata", id="metadata-missing"),
        pytest.param("garble:metadata.json", id="metadata-json-garbled"),
    ],
)
def test_corrupt_checkpoint_is_named(tiny, damage):
    cfg = tiny("training.train_iters=3", "eval.interval=0", name="corrupt")
    _run(cfg)
    how, name = damage.split(":")
    target = cfg.checkpoint_dir / "iter_0000003" / name
    if how == "truncate":
        target.write_bytes(target.read_bytes()[:100])
    elif how == "delete":
        target.unlink()
    else:
        target.write_text("{garbage")
    # Verified (the default): the file at fault, and that no intact checkpoint is left.
    with pytest.raises(ValueError) as err:
        _run(tiny("training.train_iters=6", "eval.interval=0", name="corrupt"))
    message = str(err.value)
    assert f"{cfg.checkpoint_dir} holds no checkpoint that can be read" in message
    assert f"names 'iter_0000003', which fails verification: {target} " in message
    assert "restore a checkpoint from a copy, or set checkpoint.verify=off" in message
    # Unverified, the reader's failure still names the checkpoint and the way back.
    with pytest.raises(ValueError) as err:
        _run(tiny("training.train_iters=6", "eval.interval=0", "checkpoint.verify=off", name="corrupt"))
    message = str(err.value)
    assert f"checkpoint {cfg.checkpoint_dir / 'iter_0000003'} cannot be read" in message
    assert "truncated or corrupt" in message and "write its name into" in message


def test_resume_with_another_batch_size_continues_the_data(tiny):
    """The data position is the samples consumed, saved in the checkpoint, not
    iteration x the current global batch: a doubled batch after a resume reads on
    from where the run stopped, skipping nothing."""
    _run(tiny("training.train_iters=2", "optimizer.lr_warmup_iters=1", "eval.interval=0", name="batch"))  # 2 x 4
    positions = {}

    def record(trainer, step):
        positions[step] = (trainer.consumed_samples, trainer.train_iterators[0].consumed_samples)

    from megatron_mhar.training.loop import run

    cfg = tiny("training.train_iters=3", "optimizer.lr_warmup_iters=1", "eval.interval=0",
               "training.global_batch_size=8", name="batch")
    run(cfg, step_hook=record)
    assert positions == {3: (16, 16)}  # 8 before the resume, then one batch of 8
    assert [r["consumed_samples"] for r in read_metrics(cfg.run.dir, "train")] == [4, 8, 16]


def test_load_into_different_model_names_fields(tiny):
    _run(tiny("training.train_iters=3", "eval.interval=0", name="mismatch"))
    cfg = tiny(
        "training.train_iters=4", "model.hidden_size=64", "model.num_layers=4", name="mismatch"
    )
    with pytest.raises(ValueError) as err:
        _run(cfg)
    message = str(err.value)
    assert "model.hidden_size: 32 (checkpoint) vs 64 (config)" in message
    assert "model.num_layers: 2 (checkpoint) vs 4 (config)" in message
    assert "model.num_attention_heads" not in message  # only the differing fields


def test_spec_auto_is_said_and_recorded_and_spec_is_not_part_of_the_model(tiny, capsys):
    """The driver resolves ``model.spec: auto`` at the start, says so in one line and records
    the spec that ran; a checkpoint matches a config of either spec (both store the same
    tensors under the same keys), while a change of the model is still refused."""
    import yaml

    from megatron_mhar.checkpoint.format import check_config

    cfg = tiny("model.spec=auto", "training.train_iters=3", "eval.interval=0", name="auto")
    result = _run(cfg)
    out = capsys.readouterr().out
    assert out.count("model.spec auto -> ") == 1
    assert "model.spec auto -> local (the model runs on CPU; Transformer Engine layers run on GPUs)" in out
    assert yaml.safe_load((cfg.run.dir / "config.yaml").read_text())["model"]["spec"] == "local"

    config = cfg.to_dict()
    for spec in ("local", "transformer_engine", "auto"):
        check_config(result.checkpoint, {**config, "model": {**config["model"], "spec": spec}})
    with pytest.raises(ValueError, match="model.hidden_size: 32 .checkpoint. vs 64 .config."):
        check_config(result.checkpoint, {**config, "model": {**config["model"], "hidden_size": 64}})


def test_extra_state_absent_from_a_checkpoint_keeps_the_modules_own():
    """Transformer Engine's norms carry an extra state (empty without FP8) that the local
    spec's torch norms lack: a local-spec checkpoint loads into TE layers, each such module
    keeping its own; any other tensor the checkpoint lacks is named."""
    from megatron_mhar.errors import ConfigError
    from megatron_mhar.training.checkpointing import _check_absent_keys, _load_model_state

    class NormWithExtraState(torch.nn.Module):  # as TE's RMSNorm: a weight and an extra state
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(4))
            self.extra = "own"

        def get_extra_state(self):
            return self.extra

        def set_extra_state(self, state):
            self.extra = state

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), NormWithExtraState())
    saved = {k: torch.ones_like(v) for k, v in model.state_dict().items() if torch.is_tensor(v)}
    _check_absent_keys("ckpt", ["decoder.final_layernorm._extra_state"])
    _load_model_state(model, saved)
    assert model[1].extra == "own" and torch.equal(model[1].weight, torch.ones(4))
    with pytest.raises(ConfigError, match=r"checkpoint ckpt lacks 1 tensors of this model, e\.g\. "
                                          r"decoder\.layers\.mlp\.linear_fc1\.weight"):
        _check_absent_keys("ckpt", ["decoder.layers.mlp.linear_fc1.weight", "a._extra_state"])


def test_resume_may_change_how_routing_runs(tiny):
    """Execution choices (kernel, schedule) are not part of the model: a
    checkpoint resumes under other values."""
    _run(tiny("training.train_iters=3", "eval.interval=0", "checkpoint.interval=3", name="exec"))
    resumed = _run(tiny(
        "training.train_iters=4", "eval.interval=0", "mhar.kernel_impl=torch",
        "mhar.routing_schedule=lookahead", "mhar.lookahead_group=2",
        name="exec",
    ))  # fmt: skip
    assert resumed.iteration == 4 and min(resumed.losses) == 4


def test_model_only_load_starts_fresh_schedule(tiny, monkeypatch, capsys):
    from megatron.core.optimizer.optimizer import FP32Optimizer

    common = ("training.train_iters=3", "eval.interval=0")
    source = tiny(*common, name="source")
    _run(source)
    # A mixed-precision (bf16) optimizer keeps fp32 main weights copied from the
    # parameters when it was built, i.e. from this run's own initialisation: after a
    # model-only load they must be refreshed, or the first step writes that
    # initialisation back over the loaded weights. (Found on the H200: TP/PP runs started
    # from a single-GPU checkpoint trained on from their own random weights.) bf16 does
    # not run on CPU, so this checks that the refresh is asked of the optimizer.
    refreshed = []
    monkeypatch.setattr(FP32Optimizer, "reload_model_params", lambda self, *a, **k: refreshed.append(1))
    result = _run(tiny(*common, f"checkpoint.load={source.checkpoint_dir}",
                       "checkpoint.load_model_only=true", name="finetune"))
    assert refreshed, "model-only load did not refresh the optimizer's main weights"
    assert (f"loaded the weights of {source.checkpoint_dir / 'iter_0000003'} (saved at step 3); training starts "
            f"at step 0 with a new optimizer, schedule and data order") in capsys.readouterr().out
    assert sorted(result.losses) == [1, 2, 3]  # a new run from step 0 ...
    fresh = _run(tiny(*common, name="fresh"))
    for step in (1, 2, 3):  # ... from the trained weights at every step
        assert result.losses[step] < fresh.losses[step] - 0.1, (step, result.losses, fresh.losses)


@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_initial_checkpoint_is_its_weights(tiny, distributed_optimizer):
    """``checkpoint.save_initial`` writes the starting weights before step 1. The optimizer
    has no state yet (Megatron's distributed optimizer cannot even describe it; the H200
    run failed there), so the checkpoint holds weights only, and a run that resumes from it
    (preempted before its next save) restarts from exactly those weights: same losses."""
    overrides = ("training.train_iters=3", "eval.interval=0", "checkpoint.save_initial=true",
                 "checkpoint.save_at_end=false",
                 f"parallel.use_distributed_optimizer={str(distributed_optimizer).lower()}")
    cfg = tiny(*overrides, name="initial")
    first = _run(cfg)
    saved = sorted(p.name for p in cfg.checkpoint_dir.glob("iter_*"))
    assert saved == ["iter_0000000"]
    again = _run(tiny(*overrides, name="initial"))  # resumes from the step-0 checkpoint ...
    assert again.checkpoint == cfg.checkpoint_dir / "iter_0000000"
    assert sorted(p.name for p in cfg.checkpoint_dir.glob("iter_*")) == saved  # ... saves no second one
    assert again.losses == first.losses


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", ["per_site", "lookahead"])
def test_cuda_graph_training_replays_the_eager_steps(tiny, schedule):
    """``training.cuda_graph=full_iteration`` (one eager step, capture on the second,
    replays after) trains as the eager loop does: the same losses step for step, the
    same evaluation, from the same seed and data."""
    common = ("run.device=cuda", "logging.routing_entropy=false", f"mhar.routing_schedule={schedule}")
    eager = _run(tiny(*common, name="eager"))
    graphed = _run(tiny(*common, "training.cuda_graph=full_iteration", name="graphed"))
    assert sorted(graphed.losses) == sorted(eager.losses) == list(range(1, 7))
    assert graphed.losses[1] == eager.losses[1]  # the first step runs eagerly in both
    for step, loss in eager.losses.items():
        assert graphed.losses[step] == pytest.approx(loss, rel=1e-4), step
    assert len(set(graphed.losses.values())) == 6  # the replays train: no loss repeats
    assert [s for s, _ in graphed.val_losses] == [s for s, _ in eager.val_losses] == [3, 6]
    for (_, got), (_, want) in zip(graphed.val_losses, eager.val_losses):
        assert got == pytest.approx(want, rel=1e-4)
