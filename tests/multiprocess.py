"""Run a test function in several gloo processes and collect what each rank returns.

    from tests.multiprocess import run_distributed

    def _worker(tp):                       # module level: spawn pickles it by name
        ctx = initialize_model_parallel_from_env(tp=tp, device="cpu")
        try:
            return compute_something()
        finally:
            destroy()

    results = run_distributed(_worker, 2, 2, timeout=120)   # [rank0_result, rank1_result]

Each rank is a fresh ``spawn`` process with torchrun's environment (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR=127.0.0.1`` and a free
``MASTER_PORT``), so the worker initialises the process group exactly like the
training driver does. Return values travel back through ``torch.save`` bytes
(no shared-memory tensor handles that die with the child). If any rank raises,
the others are stopped (they would hang in a collective) and the parent raises
:class:`DistributedTestError` with every failing rank's traceback. A run that
does not finish within ``timeout`` seconds is killed and reported the same way.
"""

from __future__ import annotations

import io
import os
import queue as queue_module
import socket
import time
import traceback
from typing import Any, Callable, Dict, List

import torch
import torch.multiprocessing as mp

__all__ = ["DistributedTestError", "run_distributed"]

# Seconds the parent waits for the other ranks after the first failure, so that
# a secondary error (e.g. a peer seeing the connection close) is also reported.
_GRACE_AFTER_FAILURE_S = 3.0


class DistributedTestError(RuntimeError):
    """One or more ranks failed or did not finish in time."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _dumps(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _worker(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    env: Dict[str, str],
    results: "mp.Queue",
) -> None:
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    try:
        payload = ("ok", _dumps(fn(*args, **kwargs)))
    except BaseException:  # report everything, including KeyboardInterrupt/SystemExit
        payload = ("error", traceback.format_exc())
    results.put((rank, *payload))


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    env: Dict[str, str] | None = None,
    **kwargs: Any,
) -> List[Any]:
    """Run ``fn(*args, **kwargs)`` in ``world_size`` spawned processes.

    Args:
        fn: a picklable (module-level) function. It sees torchrun's environment
            variables and must initialise (and destroy) the process group itself,
            e.g. with ``megatron_mhar.runtime.initialize_model_parallel_from_env``.
        world_size: number of processes (ranks).
        *args, **kwargs: passed to ``fn`` on every rank; must be picklable.
        timeout: seconds for the whole run (start-up included).
        env: extra environment variables for every rank.

    Returns:
        ``fn``'s return value on each rank, indexed by rank. Values must be
        serialisable with ``torch.save`` (tensors, numbers, lists, dicts).

    Raises:
        DistributedTestError: a rank raised (its traceback is in the message),
            died without reporting (exit code given), or the run timed out.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    env = dict(env or {})
    # Each rank gets one intra-op thread: ranks share the machine's cores.
    env.setdefault("OMP_NUM_THREADS", "1")
    procs = [
        ctx.Process(
            target=_worker,
            args=(rank, world_size, port, fn, args, kwargs, env, results),
            name=f"rank{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()

    outcomes: Dict[int, tuple] = {}
    deadline = time.monotonic() + timeout
    first_failure_at = None
    try:
        while len(outcomes) < world_size:
            now = time.monotonic()
            if now > deadline:
                break
            if first_failure_at is not None and now > first_failure_at + _GRACE_AFTER_FAILURE_S:
                break
            try:
                rank, status, payload = results.get(timeout=0.2)
            except queue_module.Empty:
                # A rank that died without reporting (segfault, os._exit, OOM kill).
                dead = [
                    r
                    for r, p in enumerate(procs)
                    if r not in outcomes and p.exitcode is not None and results.empty()
                ]
                for r in dead:
                    outcomes[r] = ("died", f"exited with code {procs[r].exitcode} without a result")
                if dead and first_failure_at is None:
                    first_failure_at = time.monotonic()
                continue
            outcomes[rank] = (status, payload)
            if status != "ok" and first_failure_at is None:
                first_failure_at = time.monotonic()
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()

    failures = {r: o for r, o in outcomes.items() if o[0] != "ok"}
    missing = [r for r in range(world_size) if r not in outcomes]
    if failures or missing:
        lines = [f"{fn.__name__} on {world_size} ranks failed:"]
        for r in sorted(failures):
            lines.append(f"--- rank {r} ({failures[r][0]}) ---\n{failures[r][1].rstrip()}")
        if missing:
            reason = "timed out" if first_failure_at is None else "stopped after a failure"
            lines.append(f"--- ranks {missing}: no result ({reason}, timeout={timeout}s) ---")
        raise DistributedTestError("\n".join(lines))
    return [
        torch.load(io.BytesIO(outcomes[r][1]), weights_only=False) for r in range(world_size)
    ]
