"""Runtime support: process-group setup and the CPU (gloo) runtime for Megatron-Core.

``cpu`` makes unmodified Megatron-Core code run on CPU for smoke runs and tests;
``distributed`` initialises torch.distributed and Megatron's parallel state from
torchrun's environment (and finds a free port for ranks started locally).
"""

from megatron_mhar.runtime.cpu import (
    cpu_runtime,
    disable_cpu_runtime,
    enable_cpu_runtime,
    is_cpu_runtime_enabled,
)
from megatron_mhar.runtime.distributed import (
    DistributedContext,
    destroy,
    free_port,
    initialize_model_parallel_from_env,
)

__all__ = [
    "DistributedContext",
    "cpu_runtime",
    "destroy",
    "disable_cpu_runtime",
    "enable_cpu_runtime",
    "free_port",
    "initialize_model_parallel_from_env",
    "is_cpu_runtime_enabled",
]
