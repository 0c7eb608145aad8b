"""Shared pytest fixtures.

No CUDA calls at import time. Megatron is imported inside fixtures, so test
modules that do not use it do not pay for it.

Fixtures:
    seed_everything (autouse): seeds ``random``, ``numpy`` and ``torch`` to 0
        before every test, so a test's result does not depend on test order.
    cpu_runtime: the Megatron CPU runtime (``megatron_mhar.runtime.cpu``) for
        the duration of one test.
    nan_uninitialised: deterministic mode, in which ``torch.empty`` reads as NaN.
    single_process: no launcher variables in the environment (a world of one).
    megatron_world1: a single-process Megatron (world size 1, TP=PP=1) on the
        CPU runtime with gloo, torn down after the test; yields the
        ``DistributedContext``.
    megatron_cuda_world1: the same on one GPU (NCCL), for tests marked ``gpu``.
    embedded_dir: the embedded corpus, builtin tokenizer and dataset the driver
        tests train on, built once per test run.

Plain helpers that test modules import live in ``tests/helpers.py``.

Markers:
    gpu: the test needs CUDA; skipped cleanly on CPU-only machines.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from tests.helpers import EMBEDDED_BYTES, EMBEDDED_VOCAB, LAUNCHER_ENV


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped without one")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def seed_everything():
    """Seed Python, NumPy and torch (CPU) RNGs to 0 before each test."""
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


@pytest.fixture
def cpu_runtime():
    """Enable the Megatron CPU runtime for one test (restored afterwards)."""
    from megatron_mhar.runtime.cpu import cpu_runtime as runtime

    with runtime():
        yield


@pytest.fixture
def nan_uninitialised():
    """Deterministic mode for one test: memory from torch.empty reads as NaN, so a read of
    anything nothing has written shows. ``warn_only``: ops without a deterministic kernel
    (cuBLAS without a workspace config) warn instead of failing."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(deterministic)


@pytest.fixture
def single_process(monkeypatch):
    """No launcher variables: Megatron (and the driver) start a world of one."""
    for name in LAUNCHER_ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def megatron_world1(single_process):
    """Single-process Megatron (TP=PP=1, gloo, CPU runtime); destroyed after the test.

    Seeds Megatron's RNG tracker with ``model_parallel_cuda_manual_seed(1234)``.
    """
    from megatron_mhar.runtime import destroy, initialize_model_parallel_from_env

    ctx = initialize_model_parallel_from_env(tp=1, pp=1, seed=1234, device="cpu")
    try:
        yield ctx
    finally:
        destroy()


@pytest.fixture
def megatron_cuda_world1(single_process):
    """Single-process Megatron (TP=PP=1) on one GPU; destroyed after the test."""
    from megatron_mhar.runtime import destroy, initialize_model_parallel_from_env

    ctx = initialize_model_parallel_from_env(tp=1, pp=1, seed=1234, device="cuda")
    try:
        yield ctx
    finally:
        destroy()


@pytest.fixture(scope="session")
def embedded_dir(tmp_path_factory):
    """The embedded corpus, builtin tokenizer and dataset, built once per test run."""
    from megatron_mhar.data.corpus import prepare_embedded

    root = tmp_path_factory.mktemp("embedded")
    prepare_embedded(str(root), EMBEDDED_VOCAB, EMBEDDED_BYTES)
    return root
