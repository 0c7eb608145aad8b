"""Process-group and Megatron model-parallel setup from torchrun's environment.

One call for the training driver and the tests::

    ctx = initialize_model_parallel_from_env(tp=2, pp=2, vpp=2, seed=1234)
    ...
    destroy()

It reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT`` (set by torchrun, srun wrappers, or ``tests/helpers.py``),
initialises ``torch.distributed`` (nccl on CUDA, gloo on CPU), then Megatron's
``parallel_state.initialize_model_parallel`` and its model-parallel RNG tracker.
Without those variables it starts a single process (world size 1) on an
in-memory store, which is what unit tests and ``--cpu`` smoke runs use.

On a CPU-only machine (or with ``device="cpu"``) it switches on
:func:`megatron_mhar.runtime.cpu.enable_cpu_runtime` first, and :func:`destroy`
switches it off again if this module switched it on.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass
from typing import Any, Callable, List, Literal, Optional

import torch

from megatron_mhar.runtime.cpu import (
    disable_cpu_runtime,
    enable_cpu_runtime,
    is_cpu_runtime_enabled,
)

__all__ = ["DistributedContext", "destroy", "free_port", "initialize_model_parallel_from_env", "on_all_ranks",
           "on_rank0"]


@dataclass(frozen=True)
class DistributedContext:
    """What :func:`initialize_model_parallel_from_env` set up."""

    rank: int
    """Global rank in the default process group."""
    world_size: int
    """Number of processes in the default process group."""
    local_rank: int
    """Rank on this node; the CUDA device index on GPU runs."""
    device: torch.device
    """Device the model lives on (``cuda:<local_rank>`` or ``cpu``)."""
    backend: str
    """torch.distributed backend of the default group (``nccl`` or ``gloo``)."""


# Whether this module enabled the CPU runtime (and so must disable it on destroy).
_OWNS_CPU_RUNTIME = False


def _env_int(name: str, default: Optional[int]) -> Optional[int]:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def initialize_model_parallel_from_env(
    tp: int = 1,
    pp: int = 1,
    vpp: Optional[int] = None,
    cp: int = 1,
    ep: int = 1,
    etp: Optional[int] = None,
    seed: int = 1234,
    device: Literal["auto", "cuda", "cpu"] = "auto",
    timeout_minutes: int = 10,
    create_gloo_process_groups: bool = True,
    cuda_graph_rng: bool = False,
) -> DistributedContext:
    """Initialise torch.distributed and Megatron's model-parallel state.

    Args:
        tp: tensor-model-parallel size.
        pp: pipeline-model-parallel size.
        vpp: virtual pipeline stages per pipeline rank (``None``: no interleaving).
        cp: context-parallel size.
        ep: expert-model-parallel size.
        etp: expert-tensor-parallel size (``None``: ``tp``, Megatron's default).
        seed: seed for ``model_parallel_cuda_manual_seed`` (data-parallel stream
            ``seed``, tensor-parallel stream ``seed + 2718 + tp_rank``). On the
            CPU runtime the "CUDA" generator is the CPU default generator, so
            this also seeds ``torch.manual_seed``-driven CPU randomness.
        device: ``"auto"`` picks CUDA when available, else CPU.
        timeout_minutes: collective timeout of every process group.
        create_gloo_process_groups: also create Megatron's auxiliary gloo groups
            (Megatron's default; the distributed optimizer's checkpointing uses
            them). On CPU they duplicate the default groups; tests pass False.
        cuda_graph_rng: keep the model-parallel RNG streams in generators that a CUDA
            graph can register (Megatron's ``use_cudagraphable_rng``), as its
            full-iteration CUDA graph needs.

    Returns:
        A :class:`DistributedContext`. The data-parallel size is
        ``world_size // (tp * pp * cp)``; Megatron raises if that is not an integer.

    Raises:
        RuntimeError: if torch.distributed or Megatron's parallel state is
            already initialised (call :func:`destroy` first), or ``device="cuda"``
            without CUDA.
        ValueError: for an unknown ``device``, parallel sizes that are not positive or
            do not divide the world size, or ``vpp`` without ``pp > 1`` (checked before
            anything is initialised).
    """
    global _OWNS_CPU_RUNTIME
    from megatron.core import parallel_state, tensor_parallel

    if torch.distributed.is_initialized() or parallel_state.model_parallel_is_initialized():
        raise RuntimeError(
            "torch.distributed / Megatron parallel state is already initialised; call destroy()"
        )
    if device not in ("auto", "cuda", "cpu"):
        raise ValueError(f"device must be 'auto', 'cuda' or 'cpu', got {device!r}")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device='cuda' requested but CUDA is not available")

    rank = _env_int("RANK", 0)
    world_size = _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", rank)
    # Checked before anything is initialised, so a mistake leaves no process group behind.
    _check_layout(rank, world_size, tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep, etp=etp)
    if world_size > 1 and "MASTER_ADDR" not in os.environ:
        raise RuntimeError(
            f"WORLD_SIZE={world_size} but MASTER_ADDR is not set; launch with torchrun"
        )

    if device == "cpu":
        backend, torch_device = "gloo", torch.device("cpu")
        if not is_cpu_runtime_enabled():
            enable_cpu_runtime()
            _OWNS_CPU_RUNTIME = True
    else:
        backend, torch_device = "nccl", torch.device("cuda", local_rank)
        torch.cuda.set_device(torch_device)

    timeout = datetime.timedelta(minutes=timeout_minutes)
    if "MASTER_ADDR" in os.environ:
        torch.distributed.init_process_group(
            backend=backend, rank=rank, world_size=world_size, timeout=timeout
        )
    else:
        # Single process without a launcher: an in-memory store needs no port.
        torch.distributed.init_process_group(
            backend=backend,
            store=torch.distributed.HashStore(),
            rank=0,
            world_size=1,
            timeout=timeout,
        )

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        distributed_timeout_minutes=timeout_minutes,
        create_gloo_process_groups=create_gloo_process_groups,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(
        seed, use_cudagraphable_rng=cuda_graph_rng, force_reset_rng=True
    )
    return DistributedContext(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        device=torch_device,
        backend=backend,
    )


def free_port() -> int:
    """A TCP port free on this machine now, for ``MASTER_PORT`` of ranks started here."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def on_all_ranks(action: Callable[[], Any]) -> List[Any]:
    """``action()`` on every rank; every rank's result, on every rank (a collective).

    A rank's failure is raised on every rank (the others would otherwise wait for it in
    the next collective): on that rank as it is, elsewhere as an ``OSError`` of the same
    code (a full disk), a :class:`~megatron_mhar.errors.PeerFailure` (input or
    environment: rank 0 prints that rank's message) or a ``RuntimeError`` (a bug).
    """
    from megatron_mhar.errors import PeerFailure, is_user_error

    try:
        local = (action(), None)
    except Exception as err:  # raised below, here and on the other ranks
        local = (None, err)
    outcomes = [local]
    if torch.distributed.get_world_size() > 1:
        failure = local[1]
        shared = (local[0], None if failure is None else (
            type(failure).__name__, str(failure), getattr(failure, "errno", None), is_user_error(failure)))
        outcomes = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(outcomes, shared)
    if local[1] is not None:
        raise local[1]
    for rank, (_, failure) in enumerate(outcomes):
        if failure is not None:
            kind, message, code, user = failure
            if code is not None:
                raise OSError(code, f"rank {rank}: {message}")
            if user:
                raise PeerFailure(f"rank {rank}: {message}")
            raise RuntimeError(f"rank {rank} failed: {kind}: {message}")
    return [result for result, _ in outcomes]


def on_rank0(action: Callable[[], Any]) -> Any:
    """``action()`` on rank 0; its result (or its failure) on every rank (a collective)."""
    return on_all_ranks(lambda: action() if torch.distributed.get_rank() == 0 else None)[0]


def _check_layout(rank: int, world_size: int, **sizes: Optional[int]) -> None:
    """Clear errors for parallel sizes the world cannot be split into."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(
            f"RANK={rank} and WORLD_SIZE={world_size} do not describe a process of the job "
            f"(need 0 <= RANK < WORLD_SIZE); launch with torchrun or unset them"
        )
    for name, size in sizes.items():
        if name in ("vpp", "etp") and size is None:
            continue
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"{name} must be a positive integer, got {size!r}")
    if sizes["vpp"] is not None and sizes["pp"] == 1:
        raise ValueError(
            f"vpp={sizes['vpp']} (interleaved pipeline) needs pp > 1; set vpp=None or raise pp"
        )
    model_parallel = sizes["tp"] * sizes["pp"] * sizes["cp"]
    if world_size % model_parallel:
        raise ValueError(
            f"WORLD_SIZE={world_size} is not a multiple of tp*pp*cp = {sizes['tp']}*{sizes['pp']}*"
            f"{sizes['cp']} = {model_parallel}; launch a multiple of {model_parallel} processes "
            f"or change the parallel sizes"
        )


def destroy() -> None:
    """Tear down what :func:`initialize_model_parallel_from_env` set up.

    Destroys Megatron's parallel state and the default process group, and
    disables the CPU runtime if the initialiser enabled it. Safe to call when
    nothing is initialised.
    """
    global _OWNS_CPU_RUNTIME
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    if _OWNS_CPU_RUNTIME:
        disable_cpu_runtime()
        _OWNS_CPU_RUNTIME = False
