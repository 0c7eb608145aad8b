"""tests/helpers.py's run_distributed and DistributedStream: per-rank results, torchrun
environment, failures, timeouts, values streamed item by item."""

from __future__ import annotations

import os
import time

import pytest
import torch

from tests.helpers import DistributedStream, DistributedTestError, run_distributed


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


def _items_after_gate(gate: str):
    """Yields item 0 at once, item 1 only once ``gate`` exists, then fails on rank 1."""
    rank = int(os.environ["RANK"])
    yield {"item": 0, "rank": rank}
    while not os.path.exists(gate):
        time.sleep(0.05)
    yield {"item": 1, "rank": rank}
    if rank == 1:
        raise ValueError("boom after two items")
    yield {"item": 2, "rank": rank}


def test_stream_returns_each_item_while_the_ranks_go_on(tmp_path):
    gate = tmp_path / "gate"
    with DistributedStream(_items_after_gate, 2, str(gate), item_timeout=60) as stream:
        assert stream.result(0) == [{"item": 0, "rank": 0}, {"item": 0, "rank": 1}]  # item 1 is still held back
        gate.touch()
        assert stream.result(1) == [{"item": 1, "rank": 0}, {"item": 1, "rank": 1}]
        with pytest.raises(DistributedTestError, match=r"(?s)rank 1 \(error\).*boom after two items"):
            stream.result(2)
        assert stream.result(1)[0] == {"item": 1, "rank": 0}  # items done before stay available
        with pytest.raises(DistributedTestError, match="boom after two items"):  # the failure stays
            stream.result(2)


def test_stream_times_out_per_item(tmp_path):
    with DistributedStream(_items_after_gate, 1, str(tmp_path / "never"), item_timeout=5,
                           first_timeout=120) as stream:
        assert stream.result(0) == [{"item": 0, "rank": 0}]
        start = time.monotonic()
        with pytest.raises(DistributedTestError, match=r"ranks \[0\]: no result \(timed out, timeout=5s\)"):
            stream.result(1)
        assert time.monotonic() - start < 30


def _two_quick_items():
    yield 0
    yield 1


def test_stream_items_that_arrived_while_the_caller_was_busy_are_no_timeout():
    """An item the ranks finished while the caller did other work longer than the item
    timeout (another test of the module) is returned, not reported as timed out."""
    with DistributedStream(_two_quick_items, 1, item_timeout=2, first_timeout=120) as stream:
        assert stream.result(0) == [0]
        time.sleep(4)  # item 1 arrives meanwhile; nobody reads the queue
        assert stream.result(1) == [1]
