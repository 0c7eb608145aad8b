"""``benchmarks/bench_training.py`` on CPU: the report a GPU run fills, at the tiny size."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def test_throughput_bench_reports_every_model(tmp_path):
    out = tmp_path / "training.json"
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_training.py"), "--sizes", "tiny",
         "--models", "baseline,attnres,mhar,attnres_lookahead,mhar_lookahead", "--steps", "2", "--warmup", "1",
         "--out", str(out)],
        check=True, cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    models = json.loads(out.read_text())["sizes"]["tiny"]["models"]
    assert set(models) == {"baseline", "attnres", "mhar", "attnres_lookahead", "mhar_lookahead"}
    assert models["baseline"]["throughput_ratio"] == 1.0
    for name, entry in models.items():
        assert entry["tokens_per_s"] > 0 and len(entry["step_s_all"]) == 2
        assert len(entry["losses"]) == 3  # one warmup step and two timed ones
        split = entry["micro_batch_host_split"]
        # Completed is never earlier than issued, and both phases took time.
        assert split["forward_ms"] >= split["forward_issued_ms"] > 0
        assert split["backward_ms"] >= split["backward_issued_ms"] > 0
    # AttnRes and MHAR are other models than the baseline: their parameters and losses differ.
    assert models["mhar"]["params"] > models["baseline"]["params"]
    assert models["mhar"]["losses"] != models["baseline"]["losses"]
    # Each AttnRes is compared with MHAR on its own schedule.
    assert 0 < models["attnres"]["throughput_vs_mhar"]
    assert 0 < models["attnres_lookahead"]["throughput_vs_mhar"]
    assert "throughput_vs_mhar" not in models["mhar_lookahead"]


def _bench_losses(tmp_path, name, *extra):
    out = tmp_path / f"{name}.json"
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_training.py"), "--sizes", "tiny",
         "--models", "baseline,mhar,mhar_lookahead", "--steps", "2", "--warmup", "3",
         "--no-profile", "--out", str(out), *extra],
        check=True, cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    models = json.loads(out.read_text())["sizes"]["tiny"]["models"]
    return {name: entry["losses"] for name, entry in models.items()}


@pytest.mark.gpu
def test_full_iteration_graph_replays_the_eager_steps(tmp_path):
    """Under Megatron's full-iteration CUDA graph (captured on the second step, replayed
    after) every model trains as it does eagerly: the same losses, step for step, from
    the same initialisation and batches."""
    eager = _bench_losses(tmp_path, "eager")
    graphed = _bench_losses(tmp_path, "graphed", "--cuda-graph", "full_iteration")
    for name, losses in eager.items():
        assert len(graphed[name]) == len(losses) == 5
        assert graphed[name][0] == losses[0]  # the first step runs eagerly in both
        torch.testing.assert_close(graphed[name], losses, rtol=2e-3, atol=0, msg=name)
    # The steps changed the model: a replay that did nothing would repeat one loss.
    assert len(set(graphed["mhar"])) == 5


def test_model_overrides_name_their_errors():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from bench_training import MODELS, parse_model
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert parse_model("mhar_lookahead") == MODELS["mhar_lookahead"]
    g8 = parse_model("mhar_lookahead@lookahead_group=8@lookahead_kernels=tensor_cores")
    assert (g8.lookahead_group, g8.lookahead_kernels) == (8, "tensor_cores")
    with pytest.raises(ValueError, match="unknown model 'mhr'"):
        parse_model("mhr@lookahead_group=8")
    with pytest.raises(ValueError, match="'group=8' is not field=value"):
        parse_model("mhar_lookahead@group=8")
    with pytest.raises(ValueError, match="lookahead_group takes an integer, got 'eight'"):
        parse_model("mhar_lookahead@lookahead_group=eight")
    with pytest.raises(ValueError, match="lookahead_kernels"):  # MHARConfig's own check
        parse_model("mhar_lookahead@lookahead_kernels=dots")


def _git(*args):
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture
def base_kernels_module():
    """benchmarks/base_kernels.py, with the other tree it loads dropped from sys.modules afterwards."""
    sys.path.insert(0, str(ROOT))
    try:
        from benchmarks import base_kernels
    finally:
        sys.path.remove(str(ROOT))
    yield base_kernels
    for name in [n for n in sys.modules if n == base_kernels.ALIAS or n.startswith(base_kernels.ALIAS + ".")]:
        del sys.modules[name]


def test_base_kernels_export_and_swap(tmp_path, base_kernels_module, monkeypatch):
    """A revision's kernels are written once (never over an existing tree), load beside the
    installed package, and replace it for imports inside ``active`` only: there the
    routing backends a model builds every forward hold the other tree's functions."""
    from megatron_mhar.ops.history import get_backend
    from megatron_mhar.ops.lookahead import get_lookahead_backend

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # impl='triton' on CPU; nothing is launched
    cpu = torch.device("cpu")
    bk = base_kernels_module
    import mhar_kernels.lookahead as installed

    head = _git("rev-parse", "HEAD")
    assert bk.export("HEAD", tmp_path) == head
    assert (tmp_path / "REVISION").read_text().strip() == head
    assert bk.describe(tmp_path)["revision"] == head
    with pytest.raises(FileExistsError, match="exists"):
        bk.export("HEAD", tmp_path)
    with pytest.raises(ValueError, match="'no-such-revision' is not a commit"):
        bk.export("no-such-revision", tmp_path / "other")
    with pytest.raises(ValueError, match="benchmarks/base_kernels.py REV"):
        bk.load(tmp_path / "other")
    tree = bk.load(tmp_path)
    assert tree["mhar_kernels.lookahead"].__name__ == "mhar_kernels_base.lookahead"
    # Its relative imports stay inside the other tree.
    assert tree["mhar_kernels.lookahead"].merge_row_grad.__module__ == "mhar_kernels_base.lookahead"
    assert tree["mhar_kernels.lookahead"]._exp is tree["mhar_kernels.depth_route"]._exp
    with bk.active(tree):
        from mhar_kernels import lookahead as inside
        from mhar_kernels.depth_route import route_forward

        assert inside is tree["mhar_kernels.lookahead"]
        assert route_forward is tree["mhar_kernels.depth_route"].route_forward
        assert get_lookahead_backend("triton", cpu).merge_forward is inside.merge_forward
        assert get_backend("triton", cpu).forward is route_forward
    from mhar_kernels import lookahead as after

    assert after is installed and after is not tree["mhar_kernels.lookahead"]
    assert get_lookahead_backend("triton", cpu).merge_forward is installed.merge_forward


def _bench(*args, env=None):
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_training.py"), "--sizes", "tiny",
                           "--steps", "2", "--warmup", "1", "--no-profile", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)  # fmt: skip


def test_base_kernels_models_in_one_run(tmp_path, base_kernels_module):
    """A model marked @kernels=base trains beside the same model on this checkout's kernels,
    which reports its throughput against it; the trees' provenance is in the report. On
    CPU the routing runs the torch reference and both trees are HEAD's, so the equal losses
    check the harness (one model, seed and data for both entries), not the kernels: that the
    base tree's kernels run is test_base_kernels_model_routes_with_the_other_tree's."""
    tree = tmp_path / "base"
    head = base_kernels_module.export("HEAD", tree)
    out = tmp_path / "ab.json"
    run = _bench("--models", "baseline,mhar_lookahead,mhar_lookahead@kernels=base", "--base-kernels", str(tree),
                 "--out", str(out))  # fmt: skip
    assert run.returncode == 0, run.stderr
    report = json.loads(out.read_text())
    assert report["kernel_trees"]["base"]["revision"] == head
    assert report["kernel_trees"]["checkout"]["sha256"] == base_kernels_module.describe(ROOT)["sha256"]
    models = report["sizes"]["tiny"]["models"]
    assert set(models) == {"baseline", "mhar_lookahead", "mhar_lookahead@kernels=base"}
    assert models["mhar_lookahead@kernels=base"]["losses"] == models["mhar_lookahead"]["losses"]  # same run twice
    assert models["mhar_lookahead"]["losses"] != models["baseline"]["losses"]  # ... of the model asked for
    assert models["mhar_lookahead"]["throughput_vs_base_kernels"] > 0
    assert len(models["mhar_lookahead"]["throughput_ratio_rounds"]) == 2


def test_base_kernels_model_routes_with_the_other_tree(tmp_path, base_kernels_module):
    """Through the Triton interpreter a model marked @kernels=base routes with the other
    tree's kernels: a tree whose merge_forward raises stops that model's first step."""
    tree = tmp_path / "base"
    base_kernels_module.export("HEAD", tree)
    path = tree / "mhar_kernels" / "lookahead.py"
    source = path.read_text()
    path.write_text(source.replace("def merge_forward(", 'def merge_forward(*args, **kwargs):\n'
                                   '    raise RuntimeError("the base tree ran")\n\n\ndef _unused_merge_forward(', 1))
    run = _bench("--kernel-impl", "triton", "--models", "mhar_lookahead@kernels=base", "--base-kernels", str(tree),
                 env={**os.environ, "TRITON_INTERPRET": "1"})  # fmt: skip
    assert run.returncode != 0 and "RuntimeError: the base tree ran" in run.stderr, run.stderr[-2000:]


@pytest.mark.parametrize("args, message", [
    (("--models", "baseline,mhar@kernels=base"), "give their tree with --base-kernels"),
    (("--models", "baseline,mhar", "--base-kernels", "."), "none is"),
    (("--models", "mhar@kernels=old", "--base-kernels", "."), "takes only base"),
    (("--models", "mhar@kernels=base", "--base-kernels", "no-such-dir"), "holds no mhar_kernels/__init__.py"),
])  # fmt: skip
def test_base_kernels_arguments_name_their_errors(args, message):
    run = _bench(*args)
    assert run.returncode == 2 and message in run.stderr, run.stderr


@pytest.mark.parametrize("args, message", [
    # timed rounds: none would leave no step time to take a median of (after every warmup)
    (("--steps", "0"), "--steps must be >= 1"),
    (("--steps", "-1"), "--steps must be >= 1"),
    # one size twice would be trained twice and its first report replaced
    (("--sizes", "tiny,tiny"), "names a size twice"),
    # --out paths that no report can be written to: refused before the run, not after it
    (("--out", "{tmp}"), "is a directory"),
    (("--out", "{tmp}/file/training.json"), "is a file, not a directory"),
])  # fmt: skip
def test_arguments_name_their_errors(args, message, tmp_path):
    (tmp_path / "file").write_text("")
    run = _bench(*[a.format(tmp=tmp_path) for a in args])
    assert run.returncode == 2 and message in run.stderr, run.stderr[-2000:]


@pytest.mark.parametrize("args, message", [
    (["--variants", ","], "names no model"),  # nothing would run, and exit 0
    (["--early-steps", "0"], "--early-steps >= 1"),  # the summary's max over no steps, after every run
    (["--skip", "-1"], "--skip must be >= 0"),
    (["--out", "{tmp}"], "is a directory"),  # the report's rename, after the first run
])  # fmt: skip
def test_parallel_bench_arguments_name_their_errors(args, message, tmp_path, capsys):
    sys.path.insert(0, str(ROOT))
    try:
        from benchmarks.bench_parallel import main
    finally:
        sys.path.remove(str(ROOT))
    with pytest.raises(SystemExit) as exit_info:
        main(["--device", "cpu", "--recipe", "smoke_cpu", "--run-dir", str(tmp_path / "runs"),
              *[a.format(tmp=tmp_path) for a in args]])  # fmt: skip
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()  # refused before any run started


def test_a_failed_write_keeps_the_previous_report(tmp_path):
    """A report that fails to serialise leaves the last whole one, and no partial file."""
    sys.path.insert(0, str(ROOT))
    try:
        from benchmarks.json_out import write_json
    finally:
        sys.path.remove(str(ROOT))
    out = tmp_path / "results" / "report.json"
    write_json(out, {"sizes": {"tiny": 1.0}})
    with pytest.raises(TypeError, match="not JSON serializable"):
        write_json(out, {"sizes": {"tiny": 1.0, "100m": object()}})
    assert json.loads(out.read_text()) == {"sizes": {"tiny": 1.0}}
    assert [p.name for p in out.parent.iterdir()] == ["report.json"]
