"""megatron_mhar.checkpoint.format: which directory a path designates, how the stored
config is read and compared, how unreadable checkpoints are named; and that conversion
and inference read checkpoints without the training driver."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

from megatron_mhar.checkpoint import format as fmt
from megatron_mhar.checkpoint import manifest

REPO = Path(__file__).resolve().parents[2]


def _published(root: Path, *names: str, complete: bool = True) -> None:
    """Checkpoint directories as a save leaves them: ``metadata.json`` and the manifest."""
    for name in names:
        (root / name).mkdir(parents=True)
        if complete:
            (root / name / fmt.METADATA_FILE).write_text("{}")
            manifest.write_manifest(root / name)


def test_checkpoint_names_and_staging(tmp_path):
    assert fmt.checkpoint_name(200) == "iter_0000200"
    staging = fmt.staging_dir(tmp_path / "checkpoints" / "iter_0000200")
    assert staging == tmp_path / "checkpoints" / ".tmp.iter_0000200"
    _published(tmp_path, staging.name, complete=False)
    assert fmt.find_checkpoint(tmp_path) is None  # a save in progress is never read


def test_latest_names_the_checkpoint(tmp_path):
    _published(tmp_path, "iter_0000003", "iter_0000006")
    (tmp_path / fmt.LATEST).write_text("iter_0000003\n")
    assert fmt.find_checkpoint(tmp_path) == tmp_path / "iter_0000003"
    assert fmt.find_checkpoint(tmp_path / "iter_0000006") == tmp_path / "iter_0000006"  # itself


def test_latest_naming_an_incomplete_checkpoint_is_an_error(tmp_path):
    """With no intact checkpoint to fall back to, the error names what is wrong and the ways out."""
    _published(tmp_path, "iter_0000003", complete=False)
    (tmp_path / fmt.LATEST).write_text("iter_0000003\n")
    with pytest.raises(ValueError, match=r"(?s)holds no checkpoint that can be read.*names 'iter_0000003', "
                                         r"which fails verification: .* is not a complete checkpoint.*"
                                         r"checkpoint.verify=off.*start afresh"):
        fmt.find_checkpoint(tmp_path)


def test_without_latest_the_newest_published_checkpoint_is_found(tmp_path, capsys):
    """(iteration, repeated save): iter_5.2 is newer than iter_5; other names and
    incomplete directories do not count."""
    _published(tmp_path, "iter_0000004", "iter_0000005", "iter_0000005.2", "iter_notes")
    _published(tmp_path, "iter_0000009", complete=False)
    assert fmt.find_checkpoint(tmp_path) == tmp_path / "iter_0000005.2"
    out = capsys.readouterr().out
    assert "has no 'latest' file; iter_0000009: " in out and "is not a complete checkpoint" in out
    assert out.endswith("; using the newest verified checkpoint, iter_0000005.2\n")
    assert fmt.find_checkpoint(tmp_path / "missing") is None


@pytest.mark.parametrize(
    "error",
    [
        pytest.param(RuntimeError("PytorchStreamReader failed\nmore"), id="reader-error"),
        # torch's distributed reader: a BaseException wrapping each rank's failure
        pytest.param(CheckpointException("load", {0: (EOFError("short read"), "tb")}), id="per-rank"),
    ],
)
def test_reading_names_the_checkpoint_and_the_way_back(tmp_path, error):
    checkpoint = tmp_path / "iter_0000003"
    with pytest.raises(ValueError) as raised:
        with fmt.reading(checkpoint):
            raise error
    message = str(raised.value)
    assert message.startswith(f"checkpoint {checkpoint} cannot be read (")
    assert "PytorchStreamReader failed)" in message or "EOFError: short read)" in message
    assert f"write its name into {tmp_path / fmt.LATEST}" in message


def test_stored_config_is_read_and_compared(megatron_world1, tmp_path):
    from megatron.core import dist_checkpointing

    config = {"model": {"hidden_size": 32, "num_layers": 2}, "mhar": {"variant": "full", "kernel_impl": "auto"}}
    checkpoint = tmp_path / "iter_0000001"
    checkpoint.mkdir()
    dist_checkpointing.save({"iteration": 1, "config": config}, str(checkpoint))

    assert fmt.check_config(checkpoint, config)["iteration"] == 1
    # how routing runs is not part of the model
    other_kernel = {**config, "mhar": {"variant": "full", "kernel_impl": "torch"}}
    assert fmt.check_config(checkpoint, other_kernel)["iteration"] == 1
    other_model = {**config, "model": {"hidden_size": 64, "num_layers": 2}}
    with pytest.raises(ValueError, match=r"(?s)different model.*model.hidden_size: 32 \(checkpoint\) vs 64 \(config\)"):
        fmt.check_config(checkpoint, other_model)
    model, mhar, common = fmt.read_configs(checkpoint)
    assert (model.hidden_size, model.num_layers, mhar.variant, common["iteration"]) == (32, 2, "full", 1)

    stored = {
        "foreign": {"iteration": 1},  # no run config at all
        "newer": {"iteration": 1, "config": {"model": {"hidden_size": 32, "field_of_a_later_version": 1}}},
    }
    for name, common in stored.items():
        (tmp_path / name).mkdir()
        dist_checkpointing.save(common, str(tmp_path / name))
    with pytest.raises(ValueError, match="has no run config"):
        fmt.check_config(tmp_path / "foreign", config)
    with pytest.raises(ValueError, match="has no model config in its common state"):
        fmt.read_configs(tmp_path / "foreign")
    with pytest.raises(ValueError, match="its model/mhar config does not fit this version"):
        fmt.read_configs(tmp_path / "newer")


def test_checkpoints_without_manifest_fail_verification(megatron_world1, tmp_path):
    """A checkpoint without its manifest (checkpoint_version 1, written before manifests; or
    version 2 with it deleted, or a copy that left it out) fails verification, naming the
    file; verification off reads it."""
    from megatron.core import dist_checkpointing

    for version in (1, 2):
        checkpoint = tmp_path / f"v{version}" / "iter_0000001"
        checkpoint.mkdir(parents=True)
        dist_checkpointing.save({"checkpoint_version": version, "iteration": 1}, str(checkpoint))
        assert fmt.checkpoint_problem(checkpoint) == f"{checkpoint / manifest.MANIFEST_FILE} is missing"
        assert fmt.checkpoint_problem(checkpoint, "off") is None
    manifest.write_manifest(tmp_path / "v2" / "iter_0000001")
    assert fmt.checkpoint_problem(tmp_path / "v2" / "iter_0000001") is None


def test_stored_dtype_is_read_from_metadata(megatron_world1, tmp_path):
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    weight = torch.zeros(4, 2, dtype=torch.bfloat16)
    checkpoint = tmp_path / "iter_0000000"
    checkpoint.mkdir()
    dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets(fmt.EMBEDDING_KEY, weight)}, str(checkpoint))
    assert fmt.stored_dtype(checkpoint) == torch.bfloat16


def test_conversion_and_inference_do_not_import_the_training_driver():
    """The modules ``load_model`` and the converters import, imported in a fresh process."""
    modules = ("megatron_mhar.inference", "megatron_mhar.conversion.convert", "megatron_mhar.conversion.output",
               "megatron_mhar.checkpoint.model", "megatron_mhar.checkpoint.streaming",
               "megatron_mhar.models.builder", "megatron_mhar.runtime")
    code = (
        f"import importlib, sys\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        f"print(sorted(m for m in sys.modules if m.startswith('megatron_mhar.training')))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
