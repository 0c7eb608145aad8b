"""What a resume applies: the optimizer and schedule settings its start line reports as
changed are the ones it trains with (single process, in-process)."""

from __future__ import annotations

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
