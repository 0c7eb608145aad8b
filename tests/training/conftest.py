"""Fixtures of the training-driver tests: tiny run configs over the embedded corpus, a small file system."""

from __future__ import annotations

import subprocess

import pytest

from tests.helpers import TINY


@pytest.fixture
def tiny(tmp_path, embedded_dir, single_process):
    """``tiny(*overrides)``: the smoke recipe shrunk to seconds, writing under tmp_path."""
    from megatron_mhar.training.recipes import load_config

    def make(*overrides, name="tiny"):
        base = TINY + [
            f"run.output_dir={tmp_path}",
            f"run.name={name}",
            f"data.embedded_dir={embedded_dir}",
        ]
        return load_config("smoke_cpu", base + list(overrides))

    return make


@pytest.fixture
def small_filesystem(tmp_path):
    """A 20 MiB tmpfs (CI runs as root); ``None`` where mounting is not permitted."""
    mount = tmp_path / "small"
    mount.mkdir()
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(mount)],
                              capture_output=True, text=True)
    except FileNotFoundError:  # no mount command
        done = None
    if done is None or done.returncode != 0:
        yield None
        return
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)
