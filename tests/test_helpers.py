"""tests/helpers.py's run_distributed: per-rank results, torchrun environment, failures, timeouts."""

from __future__ import annotations

import os
import time

import pytest
import torch

from tests.helpers import DistributedTestError, run_distributed


def _all_reduce_rank(scale: float):
    torch.distributed.init_process_group("gloo")
    try:
        value = torch.tensor([float(torch.distributed.get_rank())])
        torch.distributed.all_reduce(value)
        return {
            "rank": int(os.environ["RANK"]),
            "world": int(os.environ["WORLD_SIZE"]),
            "sum": value * scale,
        }
    finally:
        torch.distributed.destroy_process_group()


def _fail_on_rank_1():
    if os.environ["RANK"] == "1":
        raise ValueError("boom on rank 1")
    return "ok"


def _sleep_forever():
    time.sleep(600)


def test_results_are_per_rank_and_collectives_work():
    results = run_distributed(_all_reduce_rank, 2, 2.0, timeout=60)
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["world"] == 2 for r in results)
    assert all(torch.equal(r["sum"], torch.tensor([2.0])) for r in results)


def test_rank_failure_reports_rank_and_traceback():
    with pytest.raises(DistributedTestError, match=r"(?s)rank 1 \(error\).*boom on rank 1"):
        run_distributed(_fail_on_rank_1, 2, timeout=60)


def test_timeout_kills_ranks_and_says_so():
    start = time.monotonic()
    with pytest.raises(DistributedTestError, match=r"ranks \[0\]: no result \(timed out"):
        run_distributed(_sleep_forever, 1, timeout=5)
    assert time.monotonic() - start < 30
