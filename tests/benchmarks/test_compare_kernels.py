"""tools/perf/compare_kernels.py: the checkout's lookahead kernels against another tree's.

Runs in the Triton interpreter on CPU (conftest.py) at a 1B-width group small enough for
it: G = 5 over 21 old rows, where the auto pick runs the tensor-core backward and defers
the rows' gradients, so every kernel of the comparison runs.
"""

import shutil
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.common import StepCase
from tools.perf import base_kernels, compare_kernels

ROOT = Path(__file__).resolve().parents[2]

CUDA = torch.cuda.is_available()


DEVICE, DTYPE = ("cuda", torch.bfloat16) if CUDA else ("cpu", torch.float32)


@pytest.fixture
def kernel_copy(tmp_path):
    """A copy of the checkout's kernels as another tree; dropped from sys.modules afterwards."""
    shutil.copytree(ROOT / base_kernels.PACKAGE, tmp_path / base_kernels.PACKAGE,
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    yield tmp_path
    for name in [n for n in sys.modules if n == base_kernels.ALIAS or n.startswith(base_kernels.ALIAS + ".")]:
        del sys.modules[name]


def test_a_changed_kernel_is_the_one_that_differs(kernel_copy):
    """Against a tree whose merge forward scales its logits by another factor, the merges'
    outputs differ and every other kernel's are bitwise the checkout's (both trees get
    the checkout's inputs); every kernel is timed on both trees."""
    source = kernel_copy / "mhar_kernels" / "lookahead" / "merges.py"
    text = source.read_text()
    merge_fwd = text.index("def merge_fwd_kernel(")
    site = text.index("route_fwd_step((b_v,), (b_w,), b_m, b_l, (b_acc,), eps, scale,", merge_fwd)
    mutated = text[:site] + text[site:].replace("eps, scale,", "eps, scale * 1.5,", 1)
    source.write_text(mutated)
    base = base_kernels.load(kernel_copy)["mhar_kernels.lookahead"]
    case = StepCase("1B-width", 1280, 12, 64 * 2 + 3 if CUDA else 2, "full")  # 25 sites: G = 5, n0 = 21
    rows = compare_kernels.compare(base, [case], [8], compare_kernels.KERNELS, DEVICE, DTYPE,
                                   compare_kernels.wall_ms, rounds=1)  # fmt: skip
    by_kernel = {row["kernel"]: row for row in rows}
    assert set(by_kernel) == set(compare_kernels.KERNELS)
    assert all("error" not in row and row["ms_checkout"] > 0 and row["ms_base"] > 0 for row in rows)
    assert (by_kernel["group_forward"]["group"], by_kernel["group_forward"]["n0"]) == (5, 21)
    assert not by_kernel["merges_forward"]["bitwise"]
    assert by_kernel["merges_forward"]["max_abs_diff"] > 0
    for kernel in set(compare_kernels.KERNELS) - {"merges_forward"}:
        assert by_kernel[kernel]["bitwise"], kernel
        assert by_kernel[kernel]["max_abs_diff"] == 0, kernel


def test_a_missing_entry_point_is_reported_not_raised(kernel_copy):
    """A tree without one of the entry points (an older revision) gets that kernel's row
    with the error; the others are still compared."""
    base = base_kernels.load(kernel_copy)["mhar_kernels.lookahead"]
    del base.merge_row_grad
    case = StepCase("narrow", 256, 2, 3, "full")  # 5 sites: G = 2, row loops
    rows = compare_kernels.compare(base, [case], [8], ["merges_forward", "new_row_grads"], DEVICE, DTYPE,
                                   compare_kernels.wall_ms, rounds=1)  # fmt: skip
    by_kernel = {row["kernel"]: row for row in rows}
    assert "merge_row_grad" in by_kernel["new_row_grads"]["error"]
    assert by_kernel["merges_forward"]["bitwise"]


@pytest.mark.parametrize("args,message", [
    (["--cases", "2B"], "the cases are 100M, 350M, 1B"),
    (["--kernels", "merges"], "unknown ['merges']"),
    (["--heads", "3"], "must divide every case's width"),
    (["--heads", "eight"], "is not a comma list of integers"),
    (["--rounds", "0"], "--rounds must be at least 1"),
    (["--out", "{tmp}"], "is a directory"),  # refused before the timings, not after them
    (["--out", "{tmp}/file/ab.json"], "is a file, not a directory"),
])  # fmt: skip
def test_arguments_name_their_errors(args, message, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as exit_info:
        compare_kernels.main([str(tmp_path), *[a.format(tmp=tmp_path) for a in args]])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_a_missing_base_tree_is_named_before_the_device(tmp_path, capsys):
    """A base directory without kernels is named, with the command that writes one, on any machine."""
    with pytest.raises(SystemExit) as exit_info:
        compare_kernels.main([str(tmp_path / "no-such-dir")])
    assert exit_info.value.code == 2
    assert "holds no mhar_kernels/__init__.py" in capsys.readouterr().err
