"""tools/perf/base_kernels.py and ``benchmarks.bench_training --base-kernels``: another
revision's kernels beside this checkout's, swapped in per model in one training run (on CPU,
at the tiny size)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _git(*args):
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture
def base_kernels_module():
    """tools/perf/base_kernels.py, with the other tree it loads dropped from sys.modules afterwards."""
    from tools.perf import base_kernels

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
    with pytest.raises(ValueError, match="python -m tools.perf.base_kernels REV"):
        bk.load(tmp_path / "other")
    tree = bk.load(tmp_path)
    assert tree["mhar_kernels.lookahead"].__name__ == "mhar_kernels_base.lookahead"
    # Its relative imports stay inside the other tree, its subpackages' too.
    assert tree["mhar_kernels.lookahead"].merge_row_grad.__module__ == "mhar_kernels_base.lookahead.row_grads"
    assert tree["mhar_kernels.lookahead.merges"].fast_exp is tree["mhar_kernels.primitives"].fast_exp
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


def test_a_tree_of_flat_modules_loads_beside_the_package(tmp_path, base_kernels_module):
    """Revisions whose kernels were one module per file (``mhar_kernels/lookahead.py``) load
    and swap in as well: the modules this checkout has under those names are restored."""
    package = tmp_path / "mhar_kernels"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "lookahead.py").write_text("from .rows import copy_rows\n\n\ndef merge_forward():\n    return 'base'\n")
    (package / "rows.py").write_text("def copy_rows():\n    return 'base'\n")
    import mhar_kernels.lookahead as installed

    tree = base_kernels_module.load(tmp_path)
    assert set(tree) == {"mhar_kernels", "mhar_kernels.lookahead", "mhar_kernels.rows"}
    with base_kernels_module.active(tree):
        from mhar_kernels import lookahead as inside

        assert inside.merge_forward() == "base" and inside.copy_rows() == "base"
    from mhar_kernels import lookahead as after

    assert after is installed


def _ab(*args, env=None):
    return subprocess.run([sys.executable, "-m", "benchmarks.bench_training", "--sizes", "tiny",
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
    run = _ab("--models", "baseline,mhar_lookahead,mhar_lookahead@kernels=base", "--base-kernels", str(tree),
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
    path = tree / "mhar_kernels" / "lookahead" / "merges.py"
    source = path.read_text()
    path.write_text(source.replace("def merge_forward(", 'def merge_forward(*args, **kwargs):\n'
                                   '    raise RuntimeError("the base tree ran")\n\n\ndef _unused_merge_forward(', 1))
    run = _ab("--kernel-impl", "triton", "--models", "mhar_lookahead@kernels=base", "--base-kernels", str(tree),
              env={**os.environ, "TRITON_INTERPRET": "1"})  # fmt: skip
    assert run.returncode != 0 and "RuntimeError: the base tree ran" in run.stderr, run.stderr[-2000:]


@pytest.mark.parametrize("args, message", [
    (("--models", "baseline,mhar@kernels=base"), "are marked @kernels=base: give --base-kernels DIR"),
    (("--models", "baseline,mhar", "--base-kernels", "."), "no model is marked @kernels=base"),
    (("--models", "mhar@kernels=old", "--base-kernels", "."), "takes only base"),
    (("--models", "mhar@kernels=base", "--base-kernels", "no-such-dir"), "holds no mhar_kernels/__init__.py"),
])  # fmt: skip
def test_ab_arguments_name_their_errors(args, message):
    run = _ab(*args)
    assert run.returncode == 2 and message in run.stderr, run.stderr
