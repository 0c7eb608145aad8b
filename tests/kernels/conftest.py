"""The kernels run in the Triton interpreter where there is no CUDA device."""

from tests.helpers import use_interpreter_without_cuda

use_interpreter_without_cuda()
