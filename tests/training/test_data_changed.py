"""A data file changed under a running job: truncated (the read past its new end) or
written in place (at the next save), the run saves a checkpoint and exits 2 naming the
file, where Megatron's mapped reader dies of SIGBUS or trains on. Real processes, real files."""

from __future__ import annotations

import os
import shutil
import signal

import pytest

from tests.helpers import EMBEDDED_BYTES, EMBEDDED_VOCAB, TINY
from tests.training import paused_run


def _truncate(path):
    os.truncate(path, 1024)  # the samples of the next steps lie past it


def _rewrite(path):
    data = bytearray(path.read_bytes())
    data[: len(data) // 2] = bytes(len(data) // 2)  # same size, other ids
    with open(path, "r+b") as f:
        f.write(data)


@pytest.mark.parametrize("change, saved, what", [
    # the read of step 3 comes back short: the step-2 state is saved
    pytest.param(_truncate, "iter_0000002", "was truncated while the run reads it: a sample needs its bytes ",
                 id="truncated"),
    # same size, read on without an error: found at the step-4 save
    pytest.param(_rewrite, "iter_0000004", "was written in place (same size, modified since the run opened it); "
                 "the steps since may have read its new bytes", id="rewritten"),
])
def test_a_data_file_changed_under_the_run_exits_2_naming_it(tmp_path, embedded_dir, change, saved, what):
    from megatron_mhar.data.corpus import DATASET_NAME, prepare_embedded

    built = prepare_embedded(str(embedded_dir), EMBEDDED_VOCAB, EMBEDDED_BYTES)
    data = tmp_path / "data"
    data.mkdir()
    for path in built.directory.glob(f"{DATASET_NAME}.*"):  # the pair and its metadata: a copy to change
        shutil.copy(path, data / path.name)
    prefix = data / DATASET_NAME
    overrides = [*TINY, f"data.embedded_dir={embedded_dir}", f"run.output_dir={tmp_path}", "run.name=run",
                 f"data.paths=[{prefix}]", "logging.tensorboard=false", "eval.interval=0",
                 "checkpoint.interval=4", "training.train_iters=6"]
    marker = tmp_path / "paused"
    proc = paused_run.start("before-step-3", marker, overrides)
    try:
        paused_run.wait_for(marker, proc)
        change(prefix.with_suffix(".bin"))
        marker.with_suffix(".go").write_text("")
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 2, (proc.returncode, err[-3000:])
    checkpoints = tmp_path / "run" / "checkpoints"
    line = next(line for line in err.splitlines() if line.startswith("mhar-train: error: "))
    assert line.startswith(f"mhar-train: error: {prefix}.bin {what}"), line
    assert f"Saved {checkpoints / saved} (step {int(saved[-1])}), which the restarted run resumes from" in line
    assert (checkpoints / "latest").read_text().strip() == saved
