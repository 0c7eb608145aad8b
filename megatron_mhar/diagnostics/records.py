"""Reading a run's ``metrics.jsonl`` (written by :mod:`megatron_mhar.training.metrics`,
which describes its records)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import List, Optional

METRICS_FILE = "metrics.jsonl"


def read_metrics(run_dir, kind: Optional[str] = None) -> List[dict]:
    """Records of ``run_dir/metrics.jsonl`` (optionally only one ``kind``).

    A torn last line (a write cut short) is left out with a warning; any other line that
    is not a JSON object raises a ``ValueError`` naming the file and line.
    """
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return []
    lines = path.read_bytes().split(b"\n")
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as err:  # JSONDecodeError, UnicodeDecodeError
            record, problem = None, str(err)
        else:
            problem = None if isinstance(record, dict) else "not a JSON object"
        if problem is None:
            records.append(record)
        elif number == len(lines):  # after the last newline: a write that never finished
            warnings.warn(f"{path}:{number}: dropping a torn last line (a write cut short): {line[:60]!r}")
        else:
            raise ValueError(
                f"{path}:{number} is not a metrics record ({problem}); repair or delete that line"
            )
    return [r for r in records if kind is None or r.get("kind") == kind]
