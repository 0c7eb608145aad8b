"""The checkpoint-writer helper starts under every supported megatron-core."""

import signal

import pytest

from megatron_mhar.training import checkpointing
from megatron_mhar.training.signals import SIGNALS as STOP_SIGNALS


@pytest.mark.parametrize("getter", ["_get_write_results_queue", "get_write_results_queue"])
def test_writer_helper_started_with_stop_signals_blocked(monkeypatch, getter):
    """megatron-core 0.16 names the helper's getter ``_get_write_results_queue``, 0.19
    ``get_write_results_queue`` (the driver failed at its first step on 0.19 before it
    looked up both); the helper must be created while the stop signals are blocked."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    seen = []

    def create_helper():
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])
        seen.append({sig: sig in blocked for sig in STOP_SIGNALS})

    for name in ("_get_write_results_queue", "get_write_results_queue"):
        monkeypatch.delattr(filesystem_async, name, raising=False)
    monkeypatch.setattr(filesystem_async, getter, create_helper, raising=False)
    before = signal.pthread_sigmask(signal.SIG_BLOCK, [])

    checkpointing.start_checkpoint_writer()

    assert seen == [{sig: True for sig in STOP_SIGNALS}]
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == before
