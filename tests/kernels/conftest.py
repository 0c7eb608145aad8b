"""The kernels run in the Triton interpreter where there is no CUDA device."""

import pytest

from tests.helpers import use_interpreter_without_cuda

use_interpreter_without_cuda()


@pytest.fixture
def launch_reads(monkeypatch):
    """``{kernel: fields}`` of every launch override a kernel entry point read: an override
    that never reached its launch fails the test instead of running the default twice."""
    from mhar_kernels import depth_route, launch
    from mhar_kernels.lookahead import merges, phase1, row_grads

    reads = {}

    def recording(kernel):
        fields = launch.overrides(kernel)
        if fields:
            reads.setdefault(kernel, []).append(dict(fields))
        return fields

    for module in (depth_route, merges, phase1, row_grads):
        monkeypatch.setattr(module, "overrides", recording)
    return reads
