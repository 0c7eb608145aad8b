"""Faults during and after a save: each run must lose nothing and resume bitwise.

One uninterrupted run (4 steps, a checkpoint every 2, dropout on, so the RNG state matters)
is the reference of every case, shared by the module. Each case breaks a run of the same
config, then resumes it in the same directory and compares every step's loss, learning
rate and validation loss with the reference, bitwise, and checks that nothing older than
the fault was lost:

* SIGKILL (the whole process group, the checkpoint writer's processes included) before,
  during and after the shard writes, before the publishing rename, between the publish
  and ``latest``, and in the middle of pruning;
* one flipped byte in each kind of file of the newest checkpoint;
* a full disk (a 20 MiB tmpfs, where mounting is permitted; else ``ENOSPC`` raised in the
  checkpoint writer) and a read-only checkpoint directory during a save.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_mhar.checkpoint import manifest
from megatron_mhar.checkpoint.format import checkpoint_problem
from tests.helpers import LAUNCHER_ENV, TINY, metric_records

REPO = Path(__file__).resolve().parents[2]

CONFIG = (
    "training.train_iters=4",
    "checkpoint.interval=2",
    "checkpoint.keep_last=2",
    "eval.interval=2",
    "model.hidden_dropout=0.1",  # the resumed RNG streams decide every dropout mask
    "model.attention_dropout=0.1",
    "logging.tensorboard=false",
)


def _config(embedded_dir, output_dir, *extra):
    from megatron_mhar.training.recipes import load_config

    return load_config("smoke_cpu", [*TINY, *CONFIG, f"data.embedded_dir={embedded_dir}",
                                     f"run.output_dir={output_dir}", "run.name=run", *extra])


def _run(cfg, step_hook=None):
    from megatron_mhar.training.loop import run

    return run(cfg, step_hook=step_hook)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, embedded_dir):
    """The uninterrupted run: its directory (checkpoints at steps 2 and 4) and records."""
    with pytest.MonkeyPatch.context() as env:
        for name in LAUNCHER_ENV:
            env.delenv(name, raising=False)
        root = tmp_path_factory.mktemp("reference")
        cfg = _config(embedded_dir, root)
        _run(cfg)
    records = metric_records(cfg.run.dir)
    assert sorted(step for kind, step in records if kind == "train") == [1, 2, 3, 4]
    return cfg.run.dir, records


def _assert_intact(checkpoint: Path) -> None:
    assert checkpoint_problem(checkpoint, "full") is None, checkpoint


# ---------------------------------------------------------------- SIGKILL

# A training run whose save at step 4 kills its whole process group at one point. It runs
# in a session of its own, so the kill reaches Megatron's forked writer processes and no
# further.
KILLED_RUN = r"""
import os, signal, sys
from pathlib import Path
from megatron_mhar.checkpoint import manifest
from megatron_mhar.training import checkpointing, loop
from megatron_mhar.training.recipes import load_config

point, overrides = sys.argv[1], sys.argv[2:]
STEP4 = "iter_0000004"


def die():
    os.killpg(0, signal.SIGKILL)


def wrap(owner, name, hit):
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        if hit(*args, **kwargs):
            die()
        return original(*args, **kwargs)

    setattr(owner, name, wrapper)


if point == "before-shards":
    wrap(checkpointing.dist_checkpointing, "save", lambda state, path, *a, **k: STEP4 in str(path))
elif point == "during-shards":  # in a forked writer: half of a shard's first write reaches the file
    write = manifest.ChecksummingFile.write

    def torn(self, data):
        if STEP4 in self.path and self.path.endswith(".distcp"):
            write(self, memoryview(data)[: len(data) // 2])
            self.flush()
            die()
        return write(self, data)

    manifest.ChecksummingFile.write = torn
elif point == "after-shards":
    wrap(checkpointing, "_write_manifest", lambda directory: STEP4 in str(directory))
elif point == "before-publish":
    wrap(checkpointing, "_publish", lambda ckpt_dir, tmp, name: name == STEP4)
elif point == "before-latest":
    wrap(checkpointing, "write_atomic", lambda path, text: Path(path).name == "latest" and STEP4 in text)
elif point == "during-prune":  # the old checkpoint renamed aside, its files half deleted
    rmtree = checkpointing.shutil.rmtree

    def half(path, *args, **kwargs):
        if ".tmp.pruned." not in str(path):
            return rmtree(path, *args, **kwargs)
        os.remove(sorted(Path(path).glob("__*"))[0])
        die()

    checkpointing.shutil.rmtree = half
loop.run(load_config("smoke_cpu", overrides))
raise SystemExit("the run was not killed")
"""


@pytest.mark.parametrize(
    "point, latest_after",
    [
        pytest.param("before-shards", "iter_0000002", id="before-shards"),  # staging directory made, nothing written
        pytest.param("during-shards", "iter_0000002", id="during-shards"),  # a shard file torn
        pytest.param("after-shards", "iter_0000002", id="after-shards"),  # every file written, no manifest
        pytest.param("before-publish", "iter_0000002", id="before-publish"),  # manifest written, not renamed
        pytest.param("before-latest", "iter_0000002", id="before-latest"),  # published, `latest` not yet moved
        pytest.param("during-prune", "iter_0000004", id="during-prune"),  # keep_last=1: iter_2 half deleted
    ],
)
def test_sigkill_during_a_save_loses_nothing(tmp_path, embedded_dir, reference, single_process, point, latest_after):
    _, expected = reference
    extra = ("checkpoint.keep_last=1",) if point == "during-prune" else ()
    cfg = _config(embedded_dir, tmp_path, *extra)
    overrides = [*TINY, *CONFIG, f"data.embedded_dir={embedded_dir}", f"run.output_dir={tmp_path}",
                 "run.name=run", *extra]
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", KILLED_RUN, point, *overrides], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600, start_new_session=True)
    assert done.returncode == -signal.SIGKILL, done.stdout[-2000:] + done.stderr[-3000:]

    checkpoints = cfg.checkpoint_dir
    assert (checkpoints / "latest").read_text().strip() == latest_after
    _assert_intact(checkpoints / latest_after)
    if point != "during-prune":
        _assert_intact(checkpoints / "iter_0000002")  # the checkpoint before the fault

    resumed = _run(_config(embedded_dir, tmp_path, *extra))
    assert resumed.iteration == 4
    assert metric_records(cfg.run.dir) == expected  # bitwise: losses, learning rates, evaluations
    assert not list(checkpoints.glob(".tmp.*"))  # leftovers cleared
    _assert_intact(checkpoints / (resumed.checkpoint.name))


# ---------------------------------------------------------------- corruption


@pytest.mark.parametrize("name", [
    "__0_0.distcp",  # a shard of weights and optimizer state
    ".metadata",  # torch's index of the shards
    "common.pt",  # iteration, train state, run config
    "metadata.json",  # Megatron's checkpoint format marker
    "train_config.yaml",
    "manifest.json",  # the manifest itself: it names itself
])  # fmt: skip
def test_a_flipped_byte_falls_back_to_the_previous_checkpoint(tmp_path, embedded_dir, reference, single_process,
                                                                name, capsys):
    source, expected = reference
    shutil.copytree(source, tmp_path / "run")
    cfg = _config(embedded_dir, tmp_path)
    damaged = cfg.checkpoint_dir / "iter_0000004" / name
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0x01
    damaged.write_bytes(bytes(data))

    resumed = _run(cfg)
    out = capsys.readouterr().out
    assert f"names 'iter_0000004', which fails verification: {damaged}" in out, out
    assert "using the newest verified checkpoint, iter_0000002" in out
    assert f"left iter_0000004 in place (failed verification)" in out  # not pruned, not counted
    assert min(resumed.losses) == 3 and resumed.iteration == 4
    assert metric_records(cfg.run.dir) == expected
    assert (cfg.checkpoint_dir / "latest").read_text().strip() == "iter_0000004.2"
    _assert_intact(cfg.checkpoint_dir / "iter_0000002")  # keep_last=2 kept it: the damaged one does not count
    _assert_intact(cfg.checkpoint_dir / "iter_0000004.2")


def test_a_checkpoint_given_itself_names_the_intact_one(reference, tmp_path):
    """``checkpoint.load`` or a converter pointed at a damaged ``iter_*`` directory: the
    error names the file and the intact checkpoint beside it."""
    from megatron_mhar.checkpoint.format import find_checkpoint

    source, _ = reference
    checkpoints = shutil.copytree(source / "checkpoints", tmp_path / "checkpoints")
    shard = checkpoints / "iter_0000004" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-4096] + bytes(4096))  # 4 KiB zeroed in place
    with pytest.raises(ValueError) as err:
        find_checkpoint(checkpoints / "iter_0000004")
    assert str(err.value) == (
        f"checkpoint {checkpoints / 'iter_0000004'} fails verification: {shard} does not match its checksum "
        f"(its bytes changed); use the intact {checkpoints / 'iter_0000002'} instead (or restore iter_0000004 "
        f"from a copy)"
    )
    assert find_checkpoint(checkpoints / "iter_0000004", verify="size") == checkpoints / "iter_0000004"


# ---------------------------------------------------------------- full and read-only disks


def _inject_writer_error(monkeypatch, code):
    """The checkpoint writer's files of the step-4 save fail with ``code`` (in its forked processes)."""
    write = manifest.ChecksummingFile.write

    def failing(self, data):
        if "iter_0000004" in self.path:
            raise OSError(code, os.strerror(code))
        return write(self, data)

    monkeypatch.setattr(manifest.ChecksummingFile, "write", failing)


@pytest.mark.parametrize("fault", ["disk-full", "read-only"])
def test_a_failed_save_says_what_to_free_and_loses_nothing(tmp_path, embedded_dir, reference, single_process,
                                                             small_filesystem, monkeypatch, fault):
    _, expected = reference
    checkpoint_dir = (small_filesystem or tmp_path) / "checkpoints"
    cfg = _config(embedded_dir, tmp_path, f"checkpoint.dir={checkpoint_dir}")

    def break_disk(trainer, step):
        if step != 3:
            return
        if small_filesystem is None:  # no mount here: the writer's own error, injected
            _inject_writer_error(monkeypatch, errno.ENOSPC if fault == "disk-full" else errno.EROFS)
        elif fault == "disk-full":  # leave less than a checkpoint's size
            free = shutil.disk_usage(small_filesystem).free
            with open(small_filesystem / "filler", "wb") as f:
                f.write(bytes(free - 64 * 1024))
        else:
            subprocess.run(["mount", "-o", "remount,ro", str(small_filesystem)], check=True)

    with pytest.raises(OSError) as err:
        _run(cfg, step_hook=break_disk)
    message = str(err.value)
    assert err.value.errno == (errno.ENOSPC if fault == "disk-full" else errno.EROFS), message
    assert f"saving checkpoint iter_0000004 into {checkpoint_dir} failed" in message
    assert "Nothing was published" in message and "latest still names iter_0000002" in message
    if fault == "disk-full":
        assert "Free space on the filesystem" in message and "MiB per checkpoint" in message
    else:
        assert "is not writable by this user" in message

    monkeypatch.undo()
    if small_filesystem is not None:
        if fault == "disk-full":
            (small_filesystem / "filler").unlink()
            assert not list(checkpoint_dir.glob(".tmp.*"))  # the partial save was removed
        else:
            subprocess.run(["mount", "-o", "remount,rw", str(small_filesystem)], check=True)
    assert (checkpoint_dir / "latest").read_text().strip() == "iter_0000002"
    _assert_intact(checkpoint_dir / "iter_0000002")
    resumed = _run(_config(embedded_dir, tmp_path, f"checkpoint.dir={checkpoint_dir}"))
    assert min(resumed.losses) == 3 and resumed.iteration == 4
    assert metric_records(cfg.run.dir) == expected
