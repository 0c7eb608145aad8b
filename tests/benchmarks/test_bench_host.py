"""``benchmarks/bench_host.py``: the routing's host cost with stub kernels, on CPU."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_host_bench_runs_every_site_through_the_stubs(tmp_path):
    out = tmp_path / "host.json"
    subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_host", "--sizes", "100m",
         "--steps", "2", "--warmup", "1", "--out", str(out)],
        check=True, cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    size = json.loads(out.read_text())["sizes"]["100m"]
    models, sites = size["models"], size["sites"]
    assert size["layers"] == 12 and sites == 25
    # Every routing site reads through the stubs once forward and once backward; the
    # baseline has none. Lookahead: groups of 5 (the auto size at 25 sites), 5 groups,
    # whose new rows (a group's sites but its first) are each finished once; a group's first
    # site merges no rows, so phase 1 finishes it and only the others run a merge forward.
    assert models["baseline"]["stub_calls"] == {}
    assert models["mhar"]["stub_calls"] == {"route_forward": sites, "route_backward": sites}
    groups = -(-sites // 5)
    assert models["mhar_lookahead"]["stub_calls"] == {
        "group_forward": groups, "merge_forward": sites - groups, "merge_backward": sites,
        "group_backward_deferred": groups,
        "merge_row_grad": sites - groups,
    }  # fmt: skip
    for name in ("mhar", "mhar_lookahead"):
        entry = models[name]
        assert entry["aten_ops"] > models["baseline"]["aten_ops"]
        assert entry["extra_ops_per_site"] == (entry["aten_ops"] - models["baseline"]["aten_ops"]) / sites
        assert len(entry["ms_all"]) == 2 and entry["ms_median"] > 0


@pytest.mark.parametrize("args, message", [
    (["--sizes", "100m,100m"], "['100m'] twice"),  # timed twice, the first report replaced
    (["--models", "mhar,baseline,mhar"], "['mhar'] twice"),
    (["--sizes", "2b"], "unknown sizes/models ['2b']"),
    (["--steps", "0"], "--steps and --warmup must be at least 1"),
    (["--out", "{tmp}"], "is a directory"),  # refused before the run, not after it
    (["--out", "{tmp}/file/host.json"], "is a file, not a directory"),
])  # fmt: skip
def test_arguments_name_their_errors(args, message, tmp_path):
    (tmp_path / "file").write_text("")
    run = subprocess.run([sys.executable, "-m", "benchmarks.bench_host",
                          *[a.format(tmp=tmp_path) for a in args]],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 2 and message in run.stderr, run.stderr[-2000:]
