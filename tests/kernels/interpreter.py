"""Run the Triton kernels in the interpreter where there is no CUDA device.

``TRITON_INTERPRET`` is read when a kernel is decorated, so it must be set before
``mhar_kernels`` is imported; modules imported earlier (by tests collected before) are
dropped, so the next import decorates their kernels for the interpreter. The interpreter
is exact in fp32 but not in bf16, so the CPU tests run in fp32 only.
"""

import os
import sys

import torch


def use_interpreter_without_cuda() -> None:
    """Set ``TRITON_INTERPRET=1`` and drop imported ``mhar_kernels`` modules, off CUDA."""
    if torch.cuda.is_available():
        return
    os.environ["TRITON_INTERPRET"] = "1"
    for name in [n for n in sys.modules if n == "mhar_kernels" or n.startswith("mhar_kernels.")]:
        del sys.modules[name]
