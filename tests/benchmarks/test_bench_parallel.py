"""``benchmarks/bench_parallel.py``'s arguments; its runs are tests/training/test_layouts.py."""

import pytest


@pytest.mark.parametrize("args, message", [
    (["--variants", ","], "names no model"),  # nothing would run, and exit 0
    (["--early-steps", "0"], "--early-steps >= 1"),  # the summary's max over no steps, after every run
    (["--skip", "-1"], "--skip must be >= 0"),
    (["--out", "{tmp}"], "is a directory"),  # the report's rename, after the first run
])  # fmt: skip
def test_parallel_bench_arguments_name_their_errors(args, message, tmp_path, capsys):
    from benchmarks.bench_parallel import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--device", "cpu", "--recipe", "smoke_cpu", "--run-dir", str(tmp_path / "runs"),
              *[a.format(tmp=tmp_path) for a in args]])  # fmt: skip
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()  # refused before any run started
