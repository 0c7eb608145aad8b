"""Run Megatron-Core on CPU with gloo, for smoke runs and tests.

Megatron-Core (0.16.1 through 0.19.x) assumes CUDA in a handful of places: it
allocates schedule token counters, p2p shape/receive buffers, the global memory
buffer, DDP param/grad buffers and optimizer scalars with ``device="cuda"`` or
``device=torch.cuda.current_device()``; it calls ``torch.cuda.synchronize``
around p2p communication; its model-parallel RNG tracker saves and restores the
CUDA generator; and its optimizers check parameter types by their legacy CUDA
type names (``'torch.cuda.FloatTensor'``). :func:`enable_cpu_runtime` makes each of
those land on the CPU, so the *unchanged* Megatron code paths (schedules, DDP,
``get_megatron_optimizer``, ``finalize_model_grads``, activation recomputation)
run on a CPU-only torch build with the gloo backend. Production code never
branches on this module; it is switched on by the test fixtures and by
``megatron_mhar.runtime.distributed.initialize_model_parallel_from_env`` when
it runs on the CPU (smoke runs).

What a CPU run's configuration must set (Megatron options, not patches):

* ``batch_p2p_comm=False`` in the ``ModelParallelConfig``. The plain
  ``isend``/``irecv`` path is the one the tests cover on gloo (PP=2, 1F1B and
  interleaved). The batched path (``batch_isend_irecv`` plus a
  ``torch.cuda.synchronize``) also gave identical losses in a one-off check
  with torch 2.13, but is not tested, so CPU configs must not rely on it.
  Keep ``overlap_p2p_comm=False`` (the default) too.
* :class:`~megatron_mhar.models.norms.SequenceParallelTorchNorm` instead of
  Megatron's ``WrappedTorchNorm`` in model specs when sequence parallelism is on
  (``build_gpt_model`` does so on CPU and GPU alike): the wrapped torch norm
  refuses ``sequence_parallel`` without apex/TE.
* fp32 parameters (the tested case); no fp8, no CUDA graphs, no
  ``enable_autocast``, no TE RNG tracker, no ``use_cudagraphable_rng``.

Scope and limits: the patches are process-global attributes on ``torch.cuda``,
``torch.autograd.function.BackwardCFunction`` and
``megatron.core.tensor_parallel.random`` plus one
:class:`torch.overrides.TorchFunctionMode`, which is *thread-local*: enable the
runtime in the thread that runs Megatron (the autograd engine runs CPU
backward on the calling thread). The CPU default generator doubles as the
"CUDA" generator, so ``torch.manual_seed`` and ``torch.cuda.manual_seed`` seed
the same stream; the tracker's forks still switch streams correctly. Every
torch call goes through the mode's Python handler while it is active: fine for
tiny models, not for benchmarks. Known to work with megatron-core 0.16.1:
GPTModel (local spec) with TP+SP, PP (1F1B and interleaved), DP with DDP
(overlapped or not), the non-distributed and the distributed optimizer (Adam;
gloo provides reduce-scatter and all-gather), ``finalize_model_grads`` and full
activation recomputation (CI); the training-driver and runtime tests also pass with
megatron-core 0.19.2 on Python 3.12. MoE layers with the ``allgather`` token dispatcher,
under expert parallelism beside TP/SP/DP/PP (CI). Not covered: ``num_distributed_optimizer_instances >
1`` (needs CUDA streams), NCCL user buffers, FSDP, the ``alltoall`` and ``flex`` MoE token
dispatchers (their constructors create CUDA streams), TE.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any, Callable, Iterator, List, Optional, Tuple

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

__all__ = [
    "CPU_DEVICE",
    "cpu_runtime",
    "disable_cpu_runtime",
    "enable_cpu_runtime",
    "is_cpu_runtime_enabled",
]

CPU_DEVICE = torch.device("cpu")

# Logger of megatron.core.tensor_parallel.random (see _SameGeneratorFilter).
_TRACKER_LOGGER = "megatron.core.tensor_parallel.random"

# Legacy type names Megatron's optimizers compare ``param.type()`` against.
_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
}


def _is_cuda_device(device: Any) -> bool:
    """True for anything torch would resolve to a CUDA device.

    A bare ``int`` is a CUDA ordinal (``torch.empty(n, device=0)``); ``bool`` is
    excluded because it is an ``int`` subclass that is never a device.
    """
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpuMode(TorchFunctionMode):
    """Redirects CUDA placements made inside Megatron onto the CPU.

    * ``device=`` keyword of any torch call (factories such as ``torch.empty``,
      ``torch.zeros``, ``torch.tensor``, ``Tensor.new_*``): schedule token
      counters, p2p buffers, GlobalMemoryBuffer, DDP param/grad buffers,
      optimizer scalars and grad-norm buffers are all created this way.
    * ``pin_memory=True`` is dropped: pinning needs a CUDA driver and only
      matters for host-to-device copies, of which there are none.
    * ``Tensor.cuda()`` returns the tensor itself, as it does for a tensor that
      already lives on the current CUDA device (data loading helpers, optimizer
      state reload, ``broadcast_data``).
    * ``Tensor.to(<cuda device>)`` keeps the CPU device (other ``to`` arguments,
      dtype and copy flags, are honoured).
    * ``Tensor.type()`` without arguments reports the CUDA type name for
      fp32/fp16/bf16, because the distributed optimizer and the fp16/bf16
      optimizer sort parameters by ``param.type() == 'torch.cuda.FloatTensor'``
      (etc.) and raise ``TypeError`` on anything else.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs or "pin_memory" in kwargs:
            kwargs = dict(kwargs)
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            tensor = args[0]
            if tensor.device.type == "cpu" and tensor.dtype in _CUDA_TYPE_NAMES:
                return _CUDA_TYPE_NAMES[tensor.dtype]
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], CPU_DEVICE) + tuple(args[2:])
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = CPU_DEVICE
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        return func(*args, **kwargs)


def _current_device() -> torch.device:
    """``torch.cuda.current_device``: every ``device=torch.cuda.current_device()``
    allocation in Megatron (memory buffers, p2p buffers, TP all-gather buffers,
    DDP buffers) then lands on the CPU even outside the function mode."""
    return CPU_DEVICE


def _synchronize(device: Any = None) -> None:
    """``torch.cuda.synchronize``: p2p communication and parallel_state call it;
    CPU ops are synchronous, so there is nothing to wait for."""


class _HostStream:
    """What :func:`_current_stream` returns: CPU work is ordered by program order."""

    def wait_event(self, event: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass


def _current_stream(device: Any = None) -> _HostStream:
    """``torch.cuda.current_stream``: megatron-core 0.19's grad-bucket sync asks for
    it (to wait on CUDA-graph replay events, which CPU runs never record)."""
    return _HostStream()


def _get_rng_state(device: Any = "cuda") -> torch.Tensor:
    """``torch.cuda.get_rng_state``: the model-parallel RNG tracker saves the
    "CUDA" generator; on CPU the default CPU generator plays that role."""
    return torch.default_generator.get_state()


def _set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
    """``torch.cuda.set_rng_state``: counterpart of :func:`_get_rng_state`."""
    torch.default_generator.set_state(new_state)


def _manual_seed(seed: int) -> None:
    """``torch.cuda.manual_seed(_all)``: ``model_parallel_cuda_manual_seed``
    seeds the data-parallel stream with it before adding tracker states."""
    torch.default_generator.manual_seed(int(seed))


def _megatron_set_cuda_rng_state(
    new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False
) -> None:
    """``megatron.core.tensor_parallel.random._set_cuda_rng_state``.

    Megatron's own setter defers through ``torch.cuda._lazy_call``, which on a
    CUDA-less build queues the callback forever, so ``tracker.fork()`` and the
    recompute RNG restore would silently not switch streams. Graph-safe
    (CUDA-graph) states are not supported on CPU.
    """
    if graph_safe:
        raise RuntimeError("CPU runtime: CUDA-graph-safe RNG states are not supported")
    torch.default_generator.set_state(new_state)


_ORIGINAL_BACKWARD_APPLY = torch.autograd.function.BackwardCFunction.apply


def _backward_apply_under_mode(ctx, *grads):
    """``BackwardCFunction.apply``: runs every custom autograd Function's
    backward with the function mode on the stack.

    ``Tensor.backward``, ``torch.autograd.backward`` and ``torch.autograd.grad``
    are themselves torch functions, so torch calls them from inside the mode's
    handler, where the mode is popped: the whole backward pass would run
    without it. Megatron's backward code allocates (sequence-parallel gathers)
    and activation recomputation re-runs the forward (``CheckpointFunction``
    builds the causal mask with ``device="cuda"``), so the mode is pushed
    again for each Python backward node.
    """
    mode = _State.mode
    if mode is None or mode in _get_current_function_mode_stack():
        return _ORIGINAL_BACKWARD_APPLY(ctx, *grads)
    with mode:
        return _ORIGINAL_BACKWARD_APPLY(ctx, *grads)


def _patch_table() -> List[Tuple[Any, str, Callable]]:
    """(owner, attribute, replacement) for every attribute patch."""
    import megatron.core.tensor_parallel.random as mcore_random

    return [
        (torch.cuda, "current_device", _current_device),
        (torch.cuda, "synchronize", _synchronize),
        (torch.cuda, "current_stream", _current_stream),
        (torch.cuda, "get_rng_state", _get_rng_state),
        (torch.cuda.random, "get_rng_state", _get_rng_state),
        (torch.cuda, "set_rng_state", _set_rng_state),
        (torch.cuda.random, "set_rng_state", _set_rng_state),
        (torch.cuda, "manual_seed", _manual_seed),
        (torch.cuda.random, "manual_seed", _manual_seed),
        (torch.cuda, "manual_seed_all", _manual_seed),
        (torch.cuda.random, "manual_seed_all", _manual_seed),
        (mcore_random, "_set_cuda_rng_state", _megatron_set_cuda_rng_state),
        (torch.autograd.function.BackwardCFunction, "apply", _backward_apply_under_mode),
    ]


class _SameGeneratorFilter(logging.Filter):
    """Drops the tracker's "CPU RNG state changed within GPU RNG context" warning.

    ``CudaRNGStatesTracker.fork`` warns when the CPU generator moves inside a
    fork. On the CPU runtime the CPU generator *is* the forked "CUDA" generator,
    so every dropout or weight init inside a fork would log it; the fork itself
    still saves and restores the state correctly.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


class _State:
    lock = threading.Lock()
    originals: Optional[List[Tuple[Any, str, Any]]] = None
    mode: Optional[_CudaToCpuMode] = None
    log_filter = _SameGeneratorFilter()


def is_cpu_runtime_enabled() -> bool:
    """Whether :func:`enable_cpu_runtime` is in effect."""
    return _State.originals is not None


def enable_cpu_runtime() -> None:
    """Make Megatron-Core run on the CPU (see the module docstring). Idempotent.

    Also works on a machine with CUDA (e.g. to run the CPU test-suite there):
    while enabled, everything Megatron places on "cuda" lands on the CPU.
    """
    with _State.lock:
        if _State.originals is not None:
            return
        table = _patch_table()
        _State.originals = [(owner, name, getattr(owner, name)) for owner, name, _ in table]
        for owner, name, replacement in table:
            setattr(owner, name, replacement)
        logging.getLogger(_TRACKER_LOGGER).addFilter(_State.log_filter)
        _State.mode = _CudaToCpuMode()
        _State.mode.__enter__()


def disable_cpu_runtime() -> None:
    """Undo :func:`enable_cpu_runtime`: restore every patched attribute and pop
    the function mode. A no-op when the runtime is not enabled."""
    with _State.lock:
        if _State.originals is None:
            return
        _State.mode.__exit__(None, None, None)
        _State.mode = None
        for owner, name, original in _State.originals:
            setattr(owner, name, original)
        _State.originals = None
        logging.getLogger(_TRACKER_LOGGER).removeFilter(_State.log_filter)


@contextlib.contextmanager
def cpu_runtime() -> Iterator[None]:
    """Context manager around :func:`enable_cpu_runtime`; on exit it disables the
    runtime only if this context enabled it (nesting is safe)."""
    owner = not is_cpu_runtime_enabled()
    enable_cpu_runtime()
    try:
        yield
    finally:
        if owner:
            disable_cpu_runtime()
