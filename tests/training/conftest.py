"""Fixtures of the training-driver tests: tiny run configs over the embedded corpus."""

from __future__ import annotations

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
