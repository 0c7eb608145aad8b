"""A run directory left damaged by a kill or by hand is recovered on restart, or named.

* a torn last line of ``metrics.jsonl`` (killed mid-write) is dropped with a warning; a
  damaged line elsewhere is an error naming the file and line;
* leftovers of interrupted saves (``.tmp.*``) are removed at the start, before any save;
* a ``latest`` that is unreadable, or names a missing or unverifiable checkpoint, falls
  back to the newest verified ``iter_*``, saying so;
* an empty recipe is an error.
"""

from __future__ import annotations

import json
import shutil

import pytest

from megatron_mhar.checkpoint.format import LATEST, find_checkpoint
from megatron_mhar.training.metrics import METRICS_FILE, read_metrics

COMMON = ("eval.interval=0", "optimizer.lr_decay_iters=4", "checkpoint.interval=2")


def _run(cfg, step_hook=None):
    from megatron_mhar.training.loop import run

    return run(cfg, step_hook=step_hook)


def test_torn_metrics_and_leftovers_are_cleared_on_resume(tiny):
    first = tiny(*COMMON, "training.train_iters=2", name="torn")
    _run(first)
    metrics = first.run.dir / METRICS_FILE
    with open(metrics, "a") as f:
        f.write('{"kind": "train", "step": 3, "loss": 6.1')  # killed in the middle of a write
    staging = first.checkpoint_dir / ".tmp.iter_0000003"
    staging.mkdir()
    (staging / "__0_0.distcp").write_bytes(bytes(1024))
    (first.checkpoint_dir / ".tmp.latest").write_text("iter_00")

    seen = {}

    def leftovers(trainer, step):
        seen.setdefault(step, sorted(p.name for p in first.checkpoint_dir.glob(".tmp.*")))

    with pytest.warns(UserWarning, match=rf"{METRICS_FILE}:4: dropping a torn last line"):
        resumed = _run(tiny(*COMMON, "training.train_iters=4", name="torn"), step_hook=leftovers)
    assert seen[3] == []  # gone at the start, before the first save of the resumed run
    assert min(resumed.losses) == 3
    assert [r["step"] for r in read_metrics(first.run.dir, "train")] == [1, 2, 3, 4]
    assert all(line.endswith("}") for line in metrics.read_text().splitlines())

    # A damaged line that is not the last is not a torn write: it is named, not dropped.
    lines = metrics.read_text().splitlines()
    lines[1] = lines[1][:20]
    metrics.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=rf"{metrics}:2 is not a metrics record .*repair or delete that line"):
        read_metrics(first.run.dir)

    # ``latest`` damaged in every way falls back to the newest verified checkpoint.
    checkpoints = first.checkpoint_dir
    for text, why in [
        (b"\xff\xfe\x00garbage", "cannot be read"),
        (b"../../etc\n", "holds '../../etc', not a checkpoint name"),
        (b"", "holds '', not a checkpoint name"),
        (b"iter_0000009\n", "names 'iter_0000009', which does not exist"),
    ]:
        (checkpoints / LATEST).write_bytes(text)
        assert find_checkpoint(checkpoints) == checkpoints / "iter_0000004"
    # ... skipping a newest one that fails verification, and naming why.
    shutil.copytree(checkpoints / "iter_0000004", checkpoints / "iter_0000006")
    (checkpoints / "iter_0000006" / "common.pt").write_bytes(b"\0" * 16)
    (checkpoints / LATEST).write_text("iter_0000006\n")
    with pytest.raises(ValueError, match=r"iter_0000006 fails verification: .*common.pt has 16 bytes, the manifest "
                                         r"says \d+; use the intact .*iter_0000004 instead"):
        find_checkpoint(checkpoints / "iter_0000006")
    assert find_checkpoint(checkpoints) == checkpoints / "iter_0000004"


def test_latest_fallback_is_said(tiny, capsys):
    cfg = tiny(*COMMON, "training.train_iters=2", name="said")
    _run(cfg)
    (cfg.checkpoint_dir / LATEST).write_text("iter_0000042\n")
    capsys.readouterr()
    resumed = _run(tiny(*COMMON, "training.train_iters=3", name="said"))
    assert (f"{cfg.checkpoint_dir / LATEST} names 'iter_0000042', which does not exist; using the newest "
            f"verified checkpoint, iter_0000002") in capsys.readouterr().out
    assert min(resumed.losses) == 3


@pytest.mark.parametrize("text", ["", "# only a comment\n"], ids=["empty", "comments-only"])
def test_an_empty_recipe_is_an_error(tmp_path, text):
    from megatron_mhar.training.recipes import load_config

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(text)
    with pytest.raises(ValueError, match=rf"{recipe} is empty \(or only comments\); write the recipe's sections"):
        load_config(str(recipe))
    included = tmp_path / "outer.yaml"
    included.write_text(json.dumps({"include": ["recipe.yaml"]}))
    with pytest.raises(ValueError, match="is empty"):
        load_config(str(included))
