"""Run outputs on rank 0: console lines, ``metrics.jsonl`` and TensorBoard events.

``metrics.jsonl`` holds one JSON object per logged step: ``{"kind": "train",
"step": ..., "loss": ..., "lr": ..., "grad_norm": ..., "tokens_per_s": ...,
"memory_gb": ..., "routing_entropy": {site: [per-head nats]}}`` and ``{"kind":
"eval", "step": ..., "val_loss": ..., "val_loss_tail": ...}`` (and ``{"kind": "test", "step":
..., "test_loss": ...}`` after the last step, with test data). Floats are written
with ``repr`` precision, so two runs can be compared bitwise from the files.
``memory_gb`` is the peak memory (CUDA allocated, or resident on CPU) of the busiest rank.

On resume, records after the resumed step (written by the interrupted run after its
last checkpoint) are dropped, and TensorBoard purges its events after that step,
so both outputs read as one uninterrupted run.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Dict, List, Optional

from megatron_mhar.files import write_atomic

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


def read_metrics(run_dir, kind: Optional[str] = None) -> List[dict]:
    """Records of ``run_dir/metrics.jsonl`` (optionally only one ``kind``)."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return []
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [r for r in records if kind is None or r.get("kind") == kind]


def format_duration(seconds: float) -> str:
    """``1h02m03s`` / ``2m03s`` / ``3s``."""
    seconds = int(max(0, seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m{secs:02d}s"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


class MetricsWriter:
    """Writes metrics on the logging rank; every method is a no-op elsewhere."""

    def __init__(self, run_dir: Path, enabled: bool, tensorboard: bool, resume_step: int = 0):
        self.enabled = enabled
        self.path = Path(run_dir) / METRICS_FILE
        self._tb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._truncate_after(resume_step)
        self._file = open(self.path, "a")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(
                log_dir=str(Path(run_dir) / TENSORBOARD_DIR),
                purge_step=resume_step + 1 if resume_step else None,
            )

    def _truncate_after(self, step: int) -> None:
        if not self.path.is_file():
            return
        kept = [r for r in read_metrics(self.path.parent) if r.get("step", 0) <= step]
        write_atomic(self.path, "".join(json.dumps(record) + "\n" for record in kept))

    def log(self, kind: str, step: int, scalars: Dict[str, float], extra: Optional[dict] = None) -> None:
        """One ``metrics.jsonl`` record; scalars also go to TensorBoard as ``kind/name``."""
        if not self.enabled:
            return
        record = {"kind": kind, "step": step, **scalars, **(extra or {})}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for name, value in scalars.items():
                if value is not None and math.isfinite(value):
                    self._tb.add_scalar(f"{kind}/{name}", value, step)

    def log_routing_entropy(self, step: int, entropy: Dict[str, List[float]]) -> None:
        """TensorBoard scalars ``routing_entropy/<site>/head<h>`` (nats)."""
        if not self.enabled or self._tb is None:
            return
        for site, heads in entropy.items():
            for h, value in enumerate(heads):
                self._tb.add_scalar(f"routing_entropy/{site}/head{h}", value, step)

    def add_image(self, tag: str, image_hwc, step: int) -> None:
        """An ``[H, W, 3]`` uint8 image into TensorBoard."""
        if self.enabled and self._tb is not None:
            self._tb.add_image(tag, image_hwc, step, dataformats="HWC")

    def console(self, line: str) -> None:
        """A console line (rank 0 only), flushed so that logs stream under srun."""
        if self.enabled:
            print(line, flush=True)

    def close(self) -> None:
        if not self.enabled:
            return
        self._file.close()
        if self._tb is not None:
            self._tb.close()


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
