"""A run preempted at step k and requeued under another parallel layout loses nothing.

Each case trains steps 1-3 under one layout from the reference run's starting weights
(``checkpoint.save_initial``; a layout's own initialisation draws in another order),
stops with its step-3 checkpoint, and is restarted in the same run directory under
another layout (other world size, or other TP/PP at the same world size) to step 6.
The resumed run must start at step 3 and follow the uninterrupted single-process run:
the same learning rate at every step (the LR schedule is restored), the same consumed
samples (the data position), and the same losses within ``RTOL``.

``RTOL``: the layouts change only the order of fp32 reductions (TP's split matmuls and
all-reduce, the DP gradient all-reduce, PP's per-stage accumulation), a few ulps
(~1e-7 relative) per step, which Adam carries for three steps; measured 0 to 4e-8.
A resume that lost the Adam moments, the schedule or the data position is off by
1e-3 or more at steps 4-6 (consecutive batches' losses differ by ~2e-3; zeroing the
restored Adam moments, checked once, put step 4 off by 5e-3 in the DP=2 -> TP=2 case).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import _LAUNCHER_ENV
from tests.training.conftest import TINY

RTOL = 1e-4
STOP, STEPS = 3, 6  # preempted after step 3 of 6

COMMON = (
    "eval.interval=0",
    f"optimizer.lr_decay_iters={STEPS}",  # the schedule of the whole run in both parts
    "training.global_batch_size=4",  # kept by every layout: micro-batch x DP divides it
    "training.micro_batch_size=2",
)

LAYOUTS = {
    # name: (processes, overrides)
    "single": (1, []),
    "dp2": (2, []),
    "tp2": (2, ["parallel.tensor_model_parallel_size=2"]),
    "pp2": (2, ["parallel.pipeline_model_parallel_size=2"]),
}


def _train(tmp_path, embedded_dir, layout, name, *overrides):
    """``megatron_mhar.train`` under ``layout`` (torchrun for two processes): stdout."""
    from benchmarks.bench_parallel import free_port

    processes, layout_overrides = LAYOUTS[layout]
    launcher = ["-m", "torch.distributed.run", "--nnodes=1", f"--nproc-per-node={processes}",
                f"--master-port={free_port()}"] if processes > 1 else []
    command = [sys.executable, *launcher, "-m", "megatron_mhar.train", "smoke_cpu", *TINY, *COMMON,
               f"data.embedded_dir={embedded_dir}", f"run.output_dir={tmp_path}", f"run.name={name}",
               *layout_overrides, *overrides]
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_ENV}
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def _records(run_dir):
    from megatron_mhar.training.metrics import read_metrics

    return {r["step"]: r for r in read_metrics(run_dir, "train")}


@pytest.fixture(scope="module")
def references(tmp_path_factory, embedded_dir):
    """The uninterrupted single-process run of each variant: its records and starting weights."""
    root = tmp_path_factory.mktemp("references")
    runs = {}
    for variant in ("full", "none"):
        _train(root, embedded_dir, "single", variant, f"mhar.variant={variant}",
               f"training.train_iters={STEPS}", "checkpoint.save_initial=true")
        runs[variant] = (_records(root / variant), root / variant / "checkpoints" / "iter_0000000")
    return runs


@pytest.mark.parametrize(
    "variant, before, after",
    [
        # MHAR, same world size, DP -> TP: the routing parameters' Adam state moves from a
        # replicated DP copy onto TP ranks; the RNG streams are the new layout's own.
        pytest.param("full", "dp2", "tp2", id="mhar-dp2-to-tp2"),
        # Baseline, two pipeline stages -> one process: both stages' weights and optimizer
        # state merge into one model.
        pytest.param("none", "pp2", "single", id="baseline-pp2-to-single"),
        # MHAR, one process -> DP=2: the data position splits over two ranks.
        pytest.param("full", "single", "dp2", id="mhar-single-to-dp2"),
    ],
)
def test_resume_under_another_layout_continues_the_run(tmp_path, embedded_dir, references, variant, before, after):
    reference, initial = references[variant]
    _train(tmp_path, embedded_dir, before, "run", f"mhar.variant={variant}", f"training.train_iters={STOP}",
           f"checkpoint.load={initial}", "checkpoint.load_model_only=true")
    output = _train(tmp_path, embedded_dir, after, "run", f"mhar.variant={variant}", f"training.train_iters={STEPS}")
    assert f"at step {STOP}" in output and f"from step {STOP}" in output, output  # resumed, not restarted
    assert "saved under another parallel layout" in output, output  # RNG streams: the new layout's own

    resumed = _records(tmp_path / "run")
    assert sorted(resumed) == sorted(reference) == list(range(1, STEPS + 1))  # one run's metrics
    for step, ref in reference.items():
        got = resumed[step]
        assert got["consumed_samples"] == ref["consumed_samples"] == 4 * step, step  # data position
        assert got["lr"] == pytest.approx(ref["lr"], rel=1e-12, abs=0), step  # LR schedule
        assert got["loss"] == pytest.approx(ref["loss"], rel=RTOL, abs=0), (step, got["loss"], ref["loss"])
    assert reference[STEPS]["loss"] < reference[1]["loss"]  # it trains


def test_distributed_optimizer_without_fused_adam_fails_before_training(tmp_path, embedded_dir):
    """megatron-core cannot checkpoint the distributed optimizer over torch's Adam (no
    Transformer Engine or apex, as in this CPU environment): the run says so, with the
    fixes, before its first step instead of crashing at its first save or resume."""
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:
        pytest.skip("a fused Adam is installed")
    command = [sys.executable, "-m", "megatron_mhar.train", "smoke_cpu", *TINY, *COMMON,
               f"data.embedded_dir={embedded_dir}", f"run.output_dir={tmp_path}", "run.name=distopt",
               "parallel.use_distributed_optimizer=true"]
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_ENV}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode != 0
    assert "cannot save and resume this optimizer's state" in done.stderr, done.stderr[-3000:]
    assert "parallel.use_distributed_optimizer=false" in done.stderr
    assert "step      1" not in done.stdout  # before training
