"""A benchmark's JSON report: where it goes, its ``--out`` path checked before the run,
every write whole.

Reports of record live in ``benchmarks/results/<benchmark>/<device>.json`` (``default_out``):
<benchmark> is the script's name without ``bench_``, <device> the GPU model in lower case
with the GPU count where more than one runs (``h200``, ``h200x2``), ``cpu``, or
``analytic`` for the byte models that run nothing. The benchmarks rewrite their report after each case, so that a run cut short keeps what
it measured. ``write_json`` writes a temporary file beside the report and renames it over
the report, so a run that fails while writing leaves the previous report, never a
truncated one; ``check_out`` refuses a path that could never be written (a directory, a
path under a file) before any work, as an argparse error (exit 2).
"""

import json
import os
import re
from pathlib import Path

from megatron_mhar.files import nearest_existing, write_atomic

RESULTS = Path(__file__).resolve().parent / "results"


def device_name(gpus: int = 1, device: str = "cuda") -> str:
    """``h200`` (``h200x2`` for ``gpus`` > 1): the CUDA device's model in lower case, or
    ``cpu`` where ``device`` is cpu or there is no CUDA device."""
    import torch

    if device == "cpu" or not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name(0)
    model = re.search(r"\b([A-Z]+\d+\w*)\b", name.replace("NVIDIA", ""))
    tag = (model.group(1) if model else name).lower().replace(" ", "_")
    return tag if gpus <= 1 else f"{tag}x{gpus}"


def default_out(benchmark: str, device: str) -> str:
    """``benchmarks/results/<benchmark>/<device>.json``, the report of record's path."""
    return str(RESULTS / benchmark / f"{device}.json")


def check_out(parser, path, option="--out"):
    """``parser.error`` unless ``path`` (None: no report) can be written as a file: it is no
    directory and its nearest existing parent is a writable directory (``write_json``
    makes the missing ones)."""
    if path is None:
        return
    target = Path(path).absolute()
    if target.is_dir():
        parser.error(f"{option} {path} is a directory; give the report's file name, e.g. {Path(path) / 'report.json'}")
    parent = nearest_existing(target.parent)
    if not parent.is_dir():
        parser.error(f"{option} {path}: {parent} is a file, not a directory; give a path under a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        parser.error(f"{option} {path}: {parent} is not writable; give a path under a writable directory")


def write_json(path, data, indent=1):
    """Writes ``data`` to ``path`` (making its directories) whole (``write_atomic``): the
    file at ``path`` is always a whole report, the previous one or this one."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(data, indent=indent) + "\n")
