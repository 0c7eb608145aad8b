"""The kernels run in the Triton interpreter where there is no CUDA device (interpreter.py)."""

from tests.kernels.interpreter import use_interpreter_without_cuda

use_interpreter_without_cuda()
