"""The kernels the tools compare run in the Triton interpreter without a CUDA device."""

from tests.kernels.interpreter import use_interpreter_without_cuda

use_interpreter_without_cuda()
