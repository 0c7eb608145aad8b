"""The tensor-core phase-1 kernels fit an H200's shared memory at the model shapes and the
launches that once overflowed it (``tools/perf/kernel_resources.py``: compiled for sm_90 on
this machine, as the JIT would compile those launches)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_tensor_core_kernels_fit_shared_memory():
    pytest.importorskip("triton.backends.nvidia", reason="needs Triton's CUDA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile, not interpret
    result = subprocess.run(
        [sys.executable, "-m", "tools.perf.kernel_resources"],
        check=True, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    # 5 shapes x 3 launches x 4 kernels.
    assert len(rows) == 60
    over = [r for r in rows if r["shared_bytes"] > r["limit_bytes"]]
    assert not over, over
