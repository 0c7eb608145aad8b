"""Run the Triton kernels in the interpreter where there is no CUDA device.

``TRITON_INTERPRET`` is read when a kernel is decorated, so it must be set before
``mhar_kernels.depth_route`` is imported. The interpreter is exact in fp32 but not in
bf16, so the CPU tests run in fp32 only.
"""

import importlib
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    for name in ("mhar_kernels.depth_route", "mhar_kernels.rows"):
        if name in sys.modules:
            importlib.reload(sys.modules[name])
