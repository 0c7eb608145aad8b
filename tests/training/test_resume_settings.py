"""What a resume applies: the optimizer and schedule settings its start line reports as
changed are the ones it trains with; a diverging run stops before it saves a bad state, and
goes on from its last checkpoint as its message says (single process, in-process)."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_mhar.errors import UserError
from megatron_mhar.training.metrics import read_metrics


def _run(cfg, step_hook=None):
    from megatron_mhar.training.loop import run

    return run(cfg, step_hook=step_hook)


def _logged_lrs(run_dir):
    return {r["step"]: r["lr"] for r in read_metrics(run_dir, "train")}


# Every optimizer and schedule field a resume may change (the checkpoint's run: TINY's).
CHANGED = ("optimizer.lr=3.0e-3", "optimizer.min_lr=1.0e-4", "optimizer.lr_decay_style=linear",
           "optimizer.lr_warmup_iters=1", "optimizer.adam_beta1=0.8", "optimizer.adam_beta2=0.9",
           "optimizer.adam_eps=1.0e-6", "optimizer.weight_decay=0.01")


def test_a_resume_trains_with_the_optimizer_settings_it_reports_changed(tiny, capsys):
    """3 steps, then a resume to 6 with every optimizer field changed: steps 4-6 log the
    learning rates of a run started with the new settings, and Adam's param groups hold
    the new betas, epsilon and weight decay (the checkpoint's are not kept)."""
    common = ("eval.interval=0", "optimizer.lr_decay_iters=6")
    _run(tiny(*common, "training.train_iters=3", name="changed"))
    capsys.readouterr()
    groups = {}

    def inspect(trainer, step):
        groups[step] = {(g["betas"], g["eps"], g["weight_decay"]) for g in trainer.optimizer.param_groups}

    resumed = _run(tiny(*common, *CHANGED, "training.train_iters=6", name="changed"), step_hook=inspect)
    start = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("training changed:"))
    assert "optimizer.lr 0.01 -> 0.003" in start and "optimizer.adam_beta2 0.95 -> 0.9" in start, start
    fresh = _run(tiny(*common, *CHANGED, "training.train_iters=6", name="fresh"))

    lrs, expected = _logged_lrs(resumed.run_dir), _logged_lrs(fresh.run_dir)
    assert {step: lrs[step] for step in (4, 5, 6)} == {step: expected[step] for step in (4, 5, 6)}
    assert lrs[3] != expected[3]  # steps 1-3 ran the checkpoint's schedule
    assert groups[4] == {((0.8, 0.9), 1.0e-6, 0.01), ((0.8, 0.9), 1.0e-6, 0.0)}  # no decay on biases, norms


# ---------------------------------------------------------------- a diverging run


@pytest.fixture
def poisoned(monkeypatch):
    """``poisoned(steps)``: the loss of those training steps (and so their gradients) is NaN,
    as a bad batch or a blown-up learning rate makes it; returns the step hook to run with."""
    from megatron_mhar.training import loop

    trainer = {}
    clean = loop._loss_func

    def loss_func(loss_mask, output_tensor):
        loss, tokens, report = clean(loss_mask, output_tensor)
        if trainer and trainer["t"].model[0].training and trainer["t"].iteration + 1 in trainer["steps"]:
            return loss * float("nan"), tokens, {"lm loss": report["lm loss"] * float("nan")}
        return loss, tokens, report

    def make(steps):
        monkeypatch.setattr(loop, "_loss_func", loss_func)
        trainer.clear()  # an earlier run's

        def hook(t, step):
            trainer.update(t=t, steps=set(steps))
        return hook

    return make


def test_a_diverging_run_stops_before_saving_and_resumes_from_its_last_checkpoint(tiny, poisoned):
    """NaN at step 5 of 6, a checkpoint every step: exit 2 (a UserError) naming the step, the
    loss and grad norm and the step-4 checkpoint, which stays `latest`, with nothing saved
    after it; the resume the message gives (a new run from that checkpoint, the bad batch
    passed over, a lower lr) trains to the end."""
    cfg = tiny("training.train_iters=6", "eval.interval=0", "checkpoint.interval=1", name="diverged")
    with pytest.raises(UserError) as err:
        _run(cfg, step_hook=poisoned([5]))
    last = cfg.checkpoint_dir / "iter_0000004"
    message = str(err.value)
    assert message.startswith(f"training diverged at step 5: loss nan, grad norm nan; nothing of this step or "
                              f"later is saved, and the last checkpoint, {last}, holds step 4."), message
    assert f"run.name=<new name> checkpoint.load={last} data.skip_batches=1 " in message
    assert (cfg.checkpoint_dir / "latest").read_text().strip() == "iter_0000004"
    assert sorted(p.name for p in cfg.checkpoint_dir.glob("iter_*"))[-1] == "iter_0000004"

    poisoned([])
    rescued = _run(tiny("training.train_iters=6", "eval.interval=0", f"checkpoint.load={last}",
                        "data.skip_batches=1", "optimizer.lr=5.0e-3", name="rescued"))
    assert sorted(rescued.losses) == [5, 6] and all(math.isfinite(v) for v in rescued.losses.values())
    positions = {r["step"]: r["consumed_samples"] for r in read_metrics(rescued.run_dir, "train")}
    assert positions == {5: 24, 6: 28}  # batch 5 (samples 16-19) passed over


def test_nonfinite_steps_are_skipped_up_to_the_configured_count(tiny, poisoned):
    """training.skip_nonfinite_steps=1: a NaN step 3 makes no update (the weights after it are
    step 2's) and the run goes on; a second NaN step stops it, naming the count."""
    weights = {}

    def hook(trainer, step):
        weights[step] = [p.detach().clone() for chunk in trainer.model for p in chunk.parameters()]
        poison(trainer, step)

    poison = poisoned([3])
    result = _run(tiny("training.skip_nonfinite_steps=1", "eval.interval=0", name="skipped"), step_hook=hook)
    assert result.iteration == 6 and math.isnan(result.losses[3])
    assert all(torch.equal(a, b) for a, b in zip(weights[2], weights[3]))
    assert all(math.isfinite(result.losses[step]) for step in (1, 2, 4, 5, 6))

    poison = poisoned([3, 4])
    with pytest.raises(UserError, match=r"^training diverged at step 4: loss nan, grad norm nan; .*; already "
                                        r"skipped 1$"):
        _run(tiny("training.skip_nonfinite_steps=1", "eval.interval=0", name="stopped"), step_hook=hook)
