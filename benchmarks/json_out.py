"""A benchmark's JSON report: its ``--out`` path checked before the run, every write whole.

The benchmarks rewrite their report after each case, so that a run cut short keeps what
it measured. ``write_json`` writes a temporary file beside the report and renames it over
the report, so a run that fails while writing leaves the previous report, never a
truncated one; ``check_out`` refuses a path that could never be written (a directory, a
path under a file) before any work, as an argparse error (exit 2).
"""

import json
import os
from pathlib import Path

from megatron_mhar.files import nearest_existing, write_atomic


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
