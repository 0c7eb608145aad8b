"""Exports that do not fit: clear errors naming the tensor or field, on load and on import."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch


def _broken(export: Path, out: Path, config: dict = None, drop: str = None, reshape: str = None) -> Path:
    """A copy of ``export`` with config.json fields set, one tensor dropped or one cut in half."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(export, out)
    path = out / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **(config or {})}))
    tensors = load_file(str(out / "model.safetensors"))
    if drop:
        del tensors[drop]
    if reshape:
        tensors[reshape] = tensors[reshape][: tensors[reshape].shape[0] // 2].clone()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _load(directory: Path):
    import megatron_mhar.hf  # noqa: F401  (registers the classes)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)


def _plan(directory: Path, out: Path):
    from megatron_mhar.conversion.convert import plan_import

    return plan_import(directory, out, None, seq_length=64)


BROKEN_EXPORTS = [
    pytest.param("qwen3-full-h8", dict(drop="model.layers.1.pre_mlp_router.query"),
                 "missing keys: model.layers.1.pre_mlp_router.query",
                 "missing 1 tensors: model.layers.1.pre_mlp_router.query", id="missing-routing-tensor"),
    pytest.param("qwen3-delta-h8", dict(drop="model.layers.2.input_router.gate"),
                 "missing keys: model.layers.2.input_router.gate",
                 "missing 1 tensors: model.layers.2.input_router.gate", id="missing-delta-gate"),
    # the config says delta, the weights are a full model's: no gates, an extra final site
    pytest.param("qwen3-full-h8", dict(config={"mhar_variant": "delta", "mhar_delta_block_layers": 1}),
                 "model.layers.0.input_router.gate",
                 "model.final_router.norm_weight (only expected when mhar_variant is full or block",
                 id="variant-of-other-weights"),
    pytest.param("llama-block-h4", dict(reshape="model.final_router.query"),
                 "mismatched shapes: model.final_router.query (checkpoint (16,), config (32,))",
                 "model.final_router.query has shape (16,), but config.json "
                 "(hidden_size=32, mhar_variant='block') implies (32,)", id="routing-tensor-shape"),
    pytest.param("llama-full-h1", dict(config={"mhar_num_heads": 5}),
                 "mhar_num_heads=5 does not divide hidden_size=32",
                 "mhar_num_heads=5 does not divide hidden_size=32", id="heads-do-not-divide"),
    pytest.param("qwen3-delta-h8", dict(config={"mhar_variant": "none"}), "mhar_variant must be one of",
                 "mhar_variant='none'; an MHAR export is full, block or delta", id="variant-none"),
]


@pytest.mark.parametrize("case,edit,on_load,on_import", BROKEN_EXPORTS)
def test_broken_export_is_refused_on_load_and_on_import(exports, tmp_path, case, edit, on_load, on_import):
    broken = _broken(exports[case], tmp_path / "broken", **edit)
    with pytest.raises(ValueError, match=re.escape(on_load)):
        _load(broken)
    with pytest.raises(ValueError, match=re.escape(on_import)):
        _plan(broken, tmp_path / "out")


def test_unsupported_architectures_are_named(megatron_world1, checkpoints, exports, tmp_path):
    from megatron_mhar.conversion.convert import mcore_to_hf

    mistral = _broken(exports["qwen3-none"], tmp_path / "mistral",
                      config={"architectures": ["MistralForCausalLM"], "model_type": "mistral"})
    with pytest.raises(ValueError, match="unsupported architecture 'MistralForCausalLM'"):
        mcore_to_hf(checkpoints["qwen3-full-h8"], tmp_path / "out", hf_reference=mistral)
    renamed = _broken(exports["qwen3-full-h8"], tmp_path / "renamed",
                      config={"architectures": ["MHARMistralForCausalLM"], "model_type": "mhar_mistral"})
    with pytest.raises(ValueError, match="unsupported architecture 'MHARMistralForCausalLM'"):
        _plan(renamed, tmp_path / "out")
