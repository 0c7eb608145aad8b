"""Benchmarks and tools refuse bad arguments by name, before any work, on any machine."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("module, args, message", [
    # group sizes: each an integer >= 0, parsed before the first section, not at the step section
    ("benchmarks.bench_routing", ["--lookahead-groups", "four"], "is not a comma list of group sizes"),
    ("benchmarks.bench_routing", ["--lookahead-groups", "4,-1"], "is not a comma list of group sizes"),
    # group sizes that nothing would time
    ("benchmarks.bench_routing", ["--lookahead-groups", "4", "--impls", "triton"],
     "add step to --sections and lookahead"),
    ("benchmarks.bench_routing", ["--sections", ""], "nothing to run"),
    ("benchmarks.bench_routing", ["--out", "{tmp}"], "is a directory"),
    ("benchmarks.routing_bytes", ["--out", "{tmp}/file/bytes.json"], "is a file, not a directory"),
    ("benchmarks.pipeline_bytes", ["--out", "{tmp}"], "is a directory"),
    ("tools.perf.profile_lookahead", ["--sizes", "2B"], "--sizes: unknown ['2B']"),
    ("tools.perf.sweep_launches", ["--sweep", "lookahead", "--kernels", "merges"], "--kernels: unknown ['merges']"),
    ("tools.perf.sweep_launches", ["--sweep", "site", "--heads", "3"], "must divide every case's width"),
    ("tools.perf.sweep_launches", ["--sweep", "site", "--out", "{tmp}"], "is a directory"),
])  # fmt: skip
def test_scripts_name_their_errors(module, args, message, tmp_path):
    (tmp_path / "file").write_text("")
    run = subprocess.run([sys.executable, "-m", module, *[a.format(tmp=tmp_path) for a in args]],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 2 and message in run.stderr, run.stderr[-2000:]
