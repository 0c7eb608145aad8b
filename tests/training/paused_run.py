"""``mhar-train`` in a process of its own, paused at one point until the test lets it go
on: meanwhile the test starts a second run, sends signals or kills it.

    python tests/training/paused_run.py POINT MARKER [dotted.key=value ...]

POINT: ``before-step-N`` (the run set up, steps 1 to N-1 done and saved as configured),
``in-writer`` (inside the forked writer process of the step-2 checkpoint save), or
``at-exit`` (the command done, the interpreter exiting: an exit callback that runs before
the libraries'). The run writes MARKER when it pauses and goes on once ``MARKER.go``
exists. :func:`start` and :func:`wait_for` are the test side.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers import LAUNCHER_ENV

REPO = Path(__file__).resolve().parents[2]


def start(point: str, marker: Path, overrides) -> subprocess.Popen:
    """The paused command, in a session of its own (so that a failed test can stop all of
    it: ``os.killpg(proc.pid, SIGKILL)``); its output in ``proc.stdout`` / ``proc.stderr``."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return subprocess.Popen([sys.executable, __file__, point, str(marker), *overrides], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def wait_for(marker: Path, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    """Until the command pauses (raises if it ends first or takes longer than ``timeout``)."""
    deadline = time.monotonic() + timeout
    while not marker.exists():
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (code {proc.returncode}) before pausing: {proc.communicate()}")
        assert time.monotonic() < deadline, "the run did not pause in time"
        time.sleep(0.1)


def _pause(marker: Path) -> None:
    marker.write_text("paused")
    while not marker.with_suffix(".go").exists():
        time.sleep(0.05)


def main() -> int:
    import atexit

    from megatron_mhar.training import loop

    point, marker, overrides = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    if point.startswith("before-step-"):
        step, train_step = int(point[len("before-step-"):]), loop.Trainer.train_step

        def paused_step(trainer):
            if trainer.iteration == step - 1:
                _pause(marker)
            return train_step(trainer)

        loop.Trainer.train_step = paused_step
    elif point == "in-writer":
        from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

        write = FileSystemWriterAsync.write_preloaded_data

        def paused_write(*args, **kwargs):
            if "iter_0000002" in str(kwargs["write_bucket"][0]):
                _pause(marker)
            return write(*args, **kwargs)

        FileSystemWriterAsync.write_preloaded_data = staticmethod(paused_write)
    elif point == "at-exit":
        atexit.register(_pause, marker)
    else:
        raise SystemExit(f"unknown point {point!r}")
    sys.argv = ["mhar-train", "smoke_cpu", *overrides]
    from megatron_mhar.train import main as train

    return train()


if __name__ == "__main__":
    sys.exit(main())
