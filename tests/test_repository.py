"""Repository hygiene: the tracked files speak of the code, its commits and versions, not
of numbered work periods ("<word> <number>" with the word spelled as in WORK_PERIOD)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

WORK_PERIOD = re.compile(r"\b[Ss]tops? \d+")
"""A numbered work period: the word, then a number (identifiers such as ``scope=`` do not match)."""


def tracked_files() -> list[str]:
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True, check=True)
    return [name for name in listed.stdout.split("\0") if name]


def work_period_mentions(names: list[str]) -> list[str]:
    """``file:line: text`` of every line of the text files ``names`` that matches :data:`WORK_PERIOD`."""
    hits = []
    for name in names:
        path = REPO / name
        if not path.is_file():  # deleted in the working tree, not yet in the index
            continue
        data = path.read_bytes()
        if b"\0" in data:  # binary
            continue
        for lineno, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
            if WORK_PERIOD.search(line):
                hits.append(f"{name}:{lineno}: {line.strip()[:160]}")
    return hits


@pytest.mark.parametrize("text, matches", [
    # the word and a number, either case of its first letter, singular or plural
    pytest.param("HISTORY: " + "st" "op 40's candidate", True, id="lower"),
    pytest.param("St" "ops 38 and 39", True, id="capital-plural"),
    # identifiers and other words that contain the letters
    pytest.param("scope=3, nonst" "op 5, st" "op_at 7", False, id="identifiers"),
    # the word without a number after it
    pytest.param("training st" "ops at step 10", False, id="no-number"),
])
def test_work_period_pattern(text, matches):
    assert bool(WORK_PERIOD.search(text)) == matches


def test_tracked_files_name_no_work_periods():
    hits = work_period_mentions(tracked_files())
    assert not hits, f"{len(hits)} line(s) name a numbered work period:\n" + "\n".join(hits)
