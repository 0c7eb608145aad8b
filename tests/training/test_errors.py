"""One error contract: every failure caused by input or environment ends with its message
alone and exit code 2; a full disk under the metrics loses nothing; the messages of a stop
and of a resume say what is true.

The probes run ``mhar-train`` (``megatron_mhar.train.main``) on one tiny run of 4 steps
(checkpoints at steps 2 and 4), shared by the module, or on copies of its directory.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import signal
import time
from pathlib import Path

import pytest

from megatron_mhar.checkpoint import manifest
from megatron_mhar.errors import UserError
from megatron_mhar.training.metrics import read_metrics
from tests.helpers import EMBEDDED_VOCAB, LAUNCHER_ENV, TINY, metric_records
from tests.training import paused_run

HINT = "(MHAR_TRACEBACK=1 shows where it was raised)"
CONFIG = ["training.train_iters=4", "checkpoint.interval=2", "eval.interval=2"]


def _overrides(embedded_dir, output_dir, *extra):
    return [*TINY, *CONFIG, f"data.embedded_dir={embedded_dir}", f"run.output_dir={output_dir}", "run.name=run",
            *extra]


def _config(embedded_dir, output_dir, *extra):
    from megatron_mhar.training.recipes import load_config

    return load_config("smoke_cpu", _overrides(embedded_dir, output_dir, *extra))


@pytest.fixture(scope="module")
def reference(tmp_path_factory, embedded_dir):
    """The uninterrupted run: its directory and records."""
    from megatron_mhar.training.loop import run

    with pytest.MonkeyPatch.context() as env:
        for name in LAUNCHER_ENV:
            env.delenv(name, raising=False)
        cfg = _config(embedded_dir, tmp_path_factory.mktemp("reference"))
        run(cfg)
    return cfg.run.dir, metric_records(cfg.run.dir)


def _main_exits_2(capsys, *argv) -> list:
    """``mhar-train argv`` exits 2 with the message alone; its lines."""
    from megatron_mhar.train import main

    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert "Traceback" not in err and "[rank" not in err, err
    lines = err.strip().splitlines()
    assert lines[-1] == HINT
    return lines


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _oov_pair(prefix: str) -> None:
    """A pair written as another tool would (no metadata) whose middle documents hold ids
    beyond the vocabulary: the launch's sample (the first and last 2^18 ids) misses them."""
    import numpy
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=DType.optimal_dtype(EMBEDDED_VOCAB))
    for document in range(700):
        ids = numpy.arange(1000, dtype=numpy.uint16) % 100
        if 270 <= document < 430:
            ids[::10] = EMBEDDED_VOCAB + 5
        builder.add_document(ids, [1000])
    builder.finalize(prefix + ".idx")


def _writer_fails(monkeypatch, code):
    """The checkpoint writer's shard files fail with ``code`` (in its forked processes)."""
    write = manifest.ChecksummingFile.write

    def failing(self, data):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(manifest.ChecksummingFile, "write", failing)
    return write


@pytest.mark.parametrize("probe", [
    "no-readable-checkpoint",  # every checkpoint of the run damaged
    "damaged-metrics-line",  # a line in the middle of metrics.jsonl that is not a record
    "token-ids",  # ids beyond the vocabulary, found as training reads them
    "disk-full",  # the checkpoint writer's files hit a full disk
    "read-only",  # the checkpoint directory became read-only
])  # fmt: skip
def test_user_errors_exit_2_with_the_message_alone(probe, reference, tmp_path, embedded_dir, single_process,
                                                   monkeypatch, capsys):
    source, _ = reference
    run_dir = tmp_path / "run"
    argv = ["smoke_cpu", *_overrides(embedded_dir, tmp_path, "training.train_iters=6")]
    if probe in ("no-readable-checkpoint", "damaged-metrics-line"):
        shutil.copytree(source, run_dir)
    if probe == "no-readable-checkpoint":
        for name in ("iter_0000002", "iter_0000004"):
            _flip_a_byte(run_dir / "checkpoints" / name / "common.pt")
        first = f"mhar-train: error: {run_dir / 'checkpoints'} holds no checkpoint that can be read:"
    elif probe == "damaged-metrics-line":
        lines = (run_dir / "metrics.jsonl").read_text().splitlines(keepends=True)
        lines[1] = '{"kind": "train", "step": 2, "loss": 6.1\n'
        (run_dir / "metrics.jsonl").write_text("".join(lines))
        first = (f"mhar-train: error: {run_dir / 'metrics.jsonl'}:2 is not a metrics record (Expecting ',' "
                 f"delimiter: line 1 column 41 (char 40)); repair or delete that line")
    elif probe == "token-ids":
        _oov_pair(str(tmp_path / "oov"))
        argv += [f"data.paths=[{tmp_path / 'oov'}]", "data.split=90,10,0"]
        first = f"mhar-train: error: token id beyond model.vocab_size={EMBEDDED_VOCAB} in {tmp_path / 'oov'}.bin, "
    else:
        _writer_fails(monkeypatch, errno.ENOSPC if probe == "disk-full" else errno.EROFS)
        reason = "No space left on device" if probe == "disk-full" else "Read-only file system"
        first = (f"mhar-train: error: saving checkpoint iter_0000002 into {run_dir / 'checkpoints'} failed: "
                 f"{reason}")
    lines = _main_exits_2(capsys, *argv)
    assert lines[0].startswith(first), lines


def test_other_commands_follow_the_contract(reference, tmp_path, capsys):
    """``analyze`` and ``evaluate`` print the message alone and exit 2 as well."""
    from megatron_mhar import analyze, evaluate

    source, _ = reference
    for main, argv, first in [
        (analyze.main, [str(source / "checkpoints"), "--data", str(tmp_path / "missing")],
         f"python -m megatron_mhar.analyze: error: {tmp_path / 'missing'}.bin and {tmp_path / 'missing'}.idx not found"),
        (evaluate.main, [str(tmp_path / "nothing"), "--tasks", "x"],
         f"python -m megatron_mhar.evaluate: error: {tmp_path / 'nothing'} is not a directory"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and err.startswith(first), err
        assert err.strip().splitlines()[-1] == HINT and "Traceback" not in err


def test_the_traceback_on_request(reference, tmp_path, embedded_dir, single_process, monkeypatch, capsys):
    from megatron_mhar.train import main

    monkeypatch.setenv("MHAR_TRACEBACK", "1")
    with pytest.raises(SystemExit) as exit_info:
        main(["smoke_cpu", *_overrides(embedded_dir, tmp_path, "data.paths=[/nonexistent/corpus]")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert err.startswith("Traceback (most recent call last):") and "in validate_launch" in err
    assert err.strip().splitlines()[-1].startswith("mhar-train: error: data.paths[0]='/nonexistent/corpus'")


def _fail_on_rank1():
    """On two gloo ranks: rank 1's bad input, as each rank sees it after ``on_all_ranks``."""
    from megatron_mhar.runtime import destroy, initialize_model_parallel_from_env
    from megatron_mhar.runtime.distributed import on_all_ranks

    initialize_model_parallel_from_env(device="cpu", create_gloo_process_groups=False)
    try:
        def action():
            if int(os.environ["RANK"]) == 1:
                raise ValueError("data.paths[0]: holds no documents")

        try:
            on_all_ranks(action)
        except Exception as err:  # noqa: BLE001 - what each rank raises is the result
            return type(err).__name__, str(err)
    finally:
        destroy()


def test_every_rank_stops_and_one_prints(monkeypatch, capsys):
    """A failure of one rank is raised on every rank; rank 0 prints it once (another
    rank's as ``rank N: ...``), the others stay quiet unless the failure is theirs alone."""
    from megatron_mhar.errors import PeerFailure, on_this_rank, report
    from tests.helpers import run_distributed

    assert run_distributed(_fail_on_rank1, 2) == [
        ("PeerFailure", "rank 1: data.paths[0]: holds no documents"),
        ("ValueError", "data.paths[0]: holds no documents"),
    ]
    for rank, err, printed in [
        ("0", PeerFailure("rank 1: data.paths[0]: holds no documents"),
         "mhar-train: error: rank 1: data.paths[0]: holds no documents"),
        ("1", ValueError("data.paths[0]: holds no documents"), None),  # rank 0 prints it
        ("1", on_this_rank(ValueError("token id beyond model.vocab_size")),
         "[rank 1] mhar-train: error: token id beyond model.vocab_size"),
    ]:
        monkeypatch.setenv("RANK", rank)
        report("mhar-train", err)
        err_text = capsys.readouterr().err
        assert err_text == (f"{printed}\n{HINT}\n" if printed else ""), err_text


# ---------------------------------------------------------------- a full disk under the metrics


def test_a_full_disk_under_the_metrics_saves_and_loses_nothing(reference, tmp_path, embedded_dir, single_process,
                                                               small_filesystem, monkeypatch):
    """The run directory's file system fills up after step 2's training record: the
    evaluation record of step 2 cannot be written. The run saves its step-2 checkpoint
    (on another file system) with that record, exits with a message naming the file and
    the fix; resumed once there is room, its metrics equal the uninterrupted run's."""
    from megatron_mhar.training import metrics
    from megatron_mhar.training.loop import run

    _, expected = reference
    output = small_filesystem or tmp_path / "out"
    cfg = _config(embedded_dir, output, f"checkpoint.dir={tmp_path / 'checkpoints'}")

    def fill(trainer, step):
        if step != 2:
            return
        if small_filesystem is None:  # no mount here: the writer's own error, injected
            def full(fd, data):
                os.write(fd, data[: len(data) // 2])
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

            monkeypatch.setattr(metrics, "_write_all", full)
        else:
            with open(small_filesystem / "filler", "wb") as f:
                while True:
                    try:
                        f.write(bytes(1 << 16))
                        f.flush()
                    except OSError:
                        break

    with pytest.raises(UserError) as err:
        run(cfg, step_hook=fill)
    # Whichever write meets the full disk first is named: metrics.jsonl, or TensorBoard's
    # events (on a tmpfs a short record may still fit the last page of its file).
    message = str(err.value)
    assert re.fullmatch(
        rf"writing the run's metrics failed: {cfg.run.dir}/(metrics.jsonl|tensorboard): No space left on device; "
        rf"free space on that file system \(df -h shows it\) or write elsewhere. Saved checkpoint "
        rf"{tmp_path}/checkpoints/iter_000000(\d) at step \2 with the [1-9] records not written: once there is "
        rf"room, the same command resumes from it and writes them", message), message
    written = [(r["kind"], r["step"]) for r in read_metrics(cfg.run.dir)]
    assert written == list(expected)[:len(written)]  # what was written is whole, in order

    monkeypatch.undo()
    if small_filesystem is not None:
        (small_filesystem / "filler").unlink()
    run(_config(embedded_dir, output, f"checkpoint.dir={tmp_path / 'checkpoints'}"))
    assert metric_records(cfg.run.dir) == expected  # bitwise: nothing lost, nothing twice


# ---------------------------------------------------------------- messages that tell the truth


def test_a_resume_names_the_fields_it_changes(reference, tmp_path, embedded_dir, single_process, capsys):
    from megatron_mhar.training.loop import run

    source, _ = reference
    shutil.copytree(source, tmp_path / "run")
    capsys.readouterr()
    run(_config(embedded_dir, tmp_path, "training.train_iters=5", "logging.interval=5"))
    start = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("training run:"))
    # the run directory was copied: its output_dir changed too
    assert start.endswith(f", from step 4; changed since the checkpoint: logging.interval 1 -> 5, "
                          f"optimizer.lr_decay_iters 4 -> 5, run.output_dir '{source.parent}' -> '{tmp_path}', "
                          f"training.train_iters 4 -> 5"), start


@pytest.mark.parametrize("point", ["before-step-2", "at-exit"])
def test_ctrl_c_twice_says_how_the_run_goes_on(tmp_path, embedded_dir, point):
    """Without a checkpoint (``checkpoint.interval=0``), both Ctrl-C lines say the run starts
    again from step 0; after the save of the first Ctrl-C, a second one during the
    interpreter's exit stops at once, naming that checkpoint, without a traceback."""
    overrides = [*TINY, f"data.embedded_dir={embedded_dir}", f"run.output_dir={tmp_path}", "run.name=run",
                 "checkpoint.interval=0", "training.train_iters=500", "eval.interval=0", "logging.tensorboard=false"]
    command = "mhar-train smoke_cpu " + " ".join(overrides)
    marker = tmp_path / "paused"
    proc = paused_run.start(point, marker, overrides)
    try:
        if point == "before-step-2":
            paused_run.wait_for(marker, proc)
            proc.send_signal(signal.SIGINT)
            time.sleep(1)
            proc.send_signal(signal.SIGINT)
        else:
            while not (tmp_path / "run" / "metrics.jsonl").is_file():  # training: the handlers are in place
                assert proc.poll() is None, proc.communicate()
                time.sleep(0.1)
            proc.send_signal(signal.SIGINT)
            paused_run.wait_for(marker, proc)
            proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "Exception ignored" not in err, err
    lines = [line for line in err.splitlines() if line]
    if point == "before-step-2":
        lost = f"no checkpoint was saved yet, so every step is lost; `{command}` starts again from step 0"
        assert lines[-2:] == [f"Ctrl-C: finishing this step, then saving a checkpoint and exiting (Ctrl-C again "
                              f"stops at once: {lost})", f"stopped at once; {lost}"], err
        assert not (tmp_path / "run" / "checkpoints").exists()
    else:
        saved = re.search(r"received SIGINT at step (\d+): checkpoint saved, exiting", out)
        assert saved, out
        checkpoint = tmp_path / "run" / "checkpoints" / f"iter_{int(saved[1]):07d}"
        assert lines[-1] == f"stopped at once; the steps since {checkpoint} are lost; `{command}` resumes from it"


def test_ctrl_c_during_a_save_is_answered_by_that_save(tmp_path, embedded_dir):
    """Ctrl-C while the step-2 checkpoint is written says that checkpoint is being saved,
    and the run exits after it: no step 3 is trained and saved for the same Ctrl-C."""
    overrides = [*TINY, f"data.embedded_dir={embedded_dir}", f"run.output_dir={tmp_path}", "run.name=run",
                 "checkpoint.interval=2", "training.train_iters=500", "eval.interval=0", "logging.tensorboard=false"]
    command = "mhar-train smoke_cpu " + " ".join(overrides)
    marker = tmp_path / "paused"
    proc = paused_run.start("in-writer", marker, overrides)
    try:
        paused_run.wait_for(marker, proc)
        proc.send_signal(signal.SIGINT)
        time.sleep(1)  # the handler's line comes while the save waits
        marker.with_suffix(".go").write_text("")
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err[-3000:]
    checkpoints = tmp_path / "run" / "checkpoints"
    lost = f"no checkpoint was saved yet, so every step is lost; `{command}` starts again from step 0"
    assert f"Ctrl-C: saving the checkpoint {checkpoints / 'iter_0000002'}, then exiting (Ctrl-C again stops at " \
           f"once: {lost})" in err.splitlines(), err[-3000:]
    assert "received SIGINT at step 2: checkpoint saved, exiting" in out, out[-3000:]
    assert sorted(p.name for p in checkpoints.glob("iter_*")) == ["iter_0000002"]
    assert [r["step"] for r in read_metrics(tmp_path / "run", "train")] == [1, 2]
