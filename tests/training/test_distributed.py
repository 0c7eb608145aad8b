"""The driver under several gloo processes (as under torchrun): data parallelism."""

from __future__ import annotations

import pytest

from tests.helpers import TINY, run_distributed


def _train(overrides):
    from megatron_mhar.training.recipes import load_config
    from megatron_mhar.training.loop import run

    return run(load_config("smoke_cpu", TINY + overrides)).losses


def test_data_parallel_matches_single_process(tmp_path, embedded_dir, single_process):
    """DP=2 sees the same global batches and averages over the same tokens as DP=1."""
    common = ["training.micro_batch_size=1", "eval.interval=0", f"data.embedded_dir={embedded_dir}",
              "checkpoint.save_at_end=false"]
    serial = _train(common + [f"run.output_dir={tmp_path}", "run.name=dp1"])
    ranks = run_distributed(_train, 2, common + [f"run.output_dir={tmp_path}", "run.name=dp2"], timeout=300)
    assert ranks[0] == ranks[1]  # every rank reports the global loss
    assert sorted(ranks[0]) == sorted(serial)
    for step, loss in serial.items():
        assert ranks[0][step] == pytest.approx(loss, rel=1e-5, abs=1e-6)
