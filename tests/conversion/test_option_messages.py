"""A conversion's routing error names the option it came from, not the config key."""

from __future__ import annotations

import pytest

from tests.helpers import plan_hf_import


def test_a_bad_routing_option_is_named_as_the_flag(hf_dirs, tmp_path):
    """A bad --delta-block-layers (too many layers for the model)."""
    with pytest.raises(ValueError) as err:  # the tiny Llama has 4 layers
        plan_hf_import(hf_dirs["llama"], tmp_path / "out", "delta", mhar_overrides={"delta_block_layers": 5})
    assert str(err.value).startswith("--delta-block-layers=5 ") and "mhar." not in str(err.value)
