"""Run outputs on rank 0: console lines, ``metrics.jsonl`` and TensorBoard events.

``metrics.jsonl`` holds one JSON object per logged step: ``{"kind": "train",
"step": ..., "loss": ..., "lr": ..., "grad_norm": ..., "tokens_per_s": ...,
"memory_gb": ..., "routing_entropy": {site: [per-head nats]}}`` (MoE models add
``"moe/load_balancing_loss"``, ``"moe/z_loss"`` and ``"expert_load": {layer: [share of the
layer's routed tokens per expert]}``; MTP models ``"mtp/depth1_loss"``, ...) and ``{"kind":
"eval", "step": ..., "val_loss": ..., "val_loss_tail": ...}`` (and ``{"kind": "test", "step":
..., "test_loss": ...}`` after the last step, with test data). Floats are written
with ``repr`` precision, so two runs can be compared bitwise from the files.
``memory_gb`` is the peak memory (CUDA allocated, or resident on CPU) of the busiest rank.

On resume, records after the resumed step (written by the interrupted run after its
last checkpoint) are dropped, and TensorBoard purges its events after that step,
so both outputs read as one uninterrupted run. A last line cut short (the process was
killed while writing it) is dropped with a warning; a damaged line anywhere else is an
error naming the file and line.

A write refused for space or permission (a full disk, a quota, a read-only mount) is not
retried: the writer keeps what is already written (a record cut short is cut off),
remembers the failure (:attr:`MetricsWriter.failure`, naming the file and the fix) and
keeps the records it could not write (:attr:`MetricsWriter.unwritten`), which the driver
saves with its checkpoint and a resumed run writes first.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

from megatron_mhar.diagnostics.records import METRICS_FILE, read_metrics  # noqa: F401  (its name here too)
from megatron_mhar.errors import PERMISSION_ERRNOS, SPACE_ERRNOS, os_error_fix
from megatron_mhar.files import write_atomic

TENSORBOARD_DIR = "tensorboard"


def format_duration(seconds: float) -> str:
    """``1h02m03s`` / ``2m03s`` / ``3s``."""
    seconds = int(max(0, seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m{secs:02d}s"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


class MetricsWriter:
    """Writes metrics on the logging rank; every method is a no-op elsewhere.

    ``write_files=False``: console lines only (a finished run restarted writes nothing).
    ``unwritten``: records a previous run could not write (saved with its checkpoint),
    written first.
    """

    def __init__(self, run_dir: Path, enabled: bool, tensorboard: bool, resume_step: int = 0,
                 write_files: bool = True, unwritten: Optional[List[list]] = None):
        self.enabled = enabled
        self.files = enabled and write_files
        self.path = Path(run_dir) / METRICS_FILE
        self.failure: Optional[str] = None
        """Why a write failed (the file and the fix); nothing is written after it."""
        self.unwritten: List[list] = []
        """``[kind, step, scalars, extra]`` of every record not written since the failure."""
        self._tb = None
        self._fd: Optional[int] = None
        if not self.files:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._truncate_after(resume_step)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            _quiet_event_writer_failures()
            self._tb = SummaryWriter(
                log_dir=str(Path(run_dir) / TENSORBOARD_DIR),
                purge_step=resume_step + 1 if resume_step else None,
            )
        for record in unwritten or []:
            self.log(*record)

    def _truncate_after(self, step: int) -> None:
        if not self.path.is_file():
            return
        kept = [r for r in read_metrics(self.path.parent) if r.get("step", 0) <= step]
        write_atomic(self.path, "".join(json.dumps(record) + "\n" for record in kept))

    def _failed(self, path: Path, err: OSError) -> None:
        """Stop writing after a refused write (space, permission); anything else is raised."""
        if err.errno not in SPACE_ERRNOS + PERMISSION_ERRNOS:
            raise err
        err.filename = err.filename or str(path)
        self.failure = f"writing the run's metrics failed: {os_error_fix(err)}"

    def log(self, kind: str, step: int, scalars: Dict[str, float], extra: Optional[dict] = None) -> None:
        """One ``metrics.jsonl`` record; scalars also go to TensorBoard as ``kind/name``."""
        if not self.files:
            return
        if self.failure is not None:
            self.unwritten.append([kind, step, scalars, extra])
            return
        record = {"kind": kind, "step": step, **scalars, **(extra or {})}
        line = (json.dumps(record) + "\n").encode()
        size = os.fstat(self._fd).st_size
        try:
            _write_all(self._fd, line)
        except OSError as err:
            os.ftruncate(self._fd, size)  # no record cut short (shrinking needs no space)
            self._failed(self.path, err)
            self.unwritten.append([kind, step, scalars, extra])
            return
        if self._tb is not None:
            self._to_tensorboard(lambda: [self._tb.add_scalar(f"{kind}/{name}", value, step)
                                          for name, value in scalars.items()
                                          if value is not None and math.isfinite(value)])

    def _to_tensorboard(self, write) -> None:
        """TensorBoard's writes; one it refuses (it reports a failed write at the next call)
        stops them."""
        if self.failure is not None or self._tb is None:
            return
        try:
            write()
        except OSError as err:
            self._failed(Path(self._tb.get_logdir()), err)
            self._close_tensorboard()

    def log_routing_entropy(self, step: int, entropy: Dict[str, List[float]]) -> None:
        """TensorBoard scalars ``routing_entropy/<site>/head<h>`` (nats)."""
        if not self.enabled or self._tb is None:
            return
        self._to_tensorboard(lambda: [self._tb.add_scalar(f"routing_entropy/{site}/head{h}", value, step)
                                      for site, heads in entropy.items() for h, value in enumerate(heads)])

    def log_expert_load(self, step: int, load: Dict[str, List[float]]) -> None:
        """TensorBoard, per MoE layer: ``expert_load/<layer>/max_over_mean`` (1 is a balanced
        layer, the expert count is one expert taking every token) and the histogram
        ``expert_load/<layer>`` of the experts' shares times the expert count."""
        if not self.enabled or self._tb is None:
            return
        import torch

        for layer, shares in load.items():
            relative = torch.tensor(shares, dtype=torch.float64) * len(shares)
            self._tb.add_scalar(f"expert_load/{layer}/max_over_mean", relative.max().item(), step)
            self._tb.add_histogram(f"expert_load/{layer}", relative, step)

    def add_image(self, tag: str, image_hwc, step: int) -> None:
        """An ``[H, W, 3]`` uint8 image into TensorBoard."""
        if self.enabled and self._tb is not None:
            self._to_tensorboard(lambda: self._tb.add_image(tag, image_hwc, step, dataformats="HWC"))

    def console(self, line: str) -> None:
        """A console line (rank 0 only), flushed so that logs stream under srun."""
        if self.enabled:
            print(line, flush=True)

    def _close_tensorboard(self) -> None:
        tb, self._tb = self._tb, None
        try:
            tb.close()
        except OSError as err:  # its last buffered events
            if self.failure is None:
                self._failed(Path(tb.get_logdir()), err)

    def close(self) -> None:
        if not self.files:
            return
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._tb is not None:
            self._close_tensorboard()


def _write_all(fd: int, data: bytes) -> None:
    """``data`` to ``fd``, however many writes it takes (a full disk fails part way)."""
    written = 0
    while written < len(data):
        written += os.write(fd, data[written:])


_previous_excepthook = None


def _quiet_event_writer_failures() -> None:
    """TensorBoard writes its events on a thread that, when a write fails, prints the
    traceback and leaves the error for the next call, where :class:`MetricsWriter` reports
    it with the file and the fix; the thread's traceback is left out for the errors
    reported so (space, permission). Installed once per process."""
    global _previous_excepthook
    if _previous_excepthook is not None:
        return
    _previous_excepthook = threading.excepthook

    def hook(args) -> None:
        reported = (type(args.thread).__name__ == "_AsyncWriterThread" and isinstance(args.exc_value, OSError)
                    and args.exc_value.errno in SPACE_ERRNOS + PERMISSION_ERRNOS)
        if not reported:
            _previous_excepthook(args)

    threading.excepthook = hook


class StepTimer:
    """Training-step time and tokens since the last log (eval and saves excluded)."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.seconds = 0.0
        self.steps = 0
        self._start = None

    def start(self) -> None:
        self._start = time.perf_counter()

    def stop(self) -> None:
        self.seconds += time.perf_counter() - self._start
        self.steps += 1

    @property
    def seconds_per_step(self) -> float:
        return self.seconds / max(self.steps, 1)
