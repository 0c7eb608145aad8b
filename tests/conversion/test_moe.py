"""Qwen3-MoE (``Qwen3MoeForCausalLM``) <-> Megatron MHAR checkpoints with Megatron's MoE layer.

The tiny random model (``conftest.MODELS["qwen3_moe"]``) has 4 experts top-2 with the top-2
weights renormalised and a dense MLP in layer 1 (``mlp_only_layers``), so the router, every
expert, the dense layer and the mixed layout all go through the table.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from megatron_mhar.conversion import hf_config
from tests.helpers import edited_hf_dir, hf_logits, plan_hf_import, read_safetensors, run_distributed, token_batch

# Qwen3-30B-A3B's config.json, as published.
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
    "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [],
    "model_type": "qwen3_moe", "moe_intermediate_size": 768, "norm_topk_prob": True,
    "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
    "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936,
}


def test_delta_logits_equal_hf_and_none_bitwise(megatron_world1, hf_dirs, convert):
    """fp32: the converted delta model computes what the HF model computes (within 1e-5)
    and exactly what the converted ``none`` model computes (zero gates)."""
    import megatron_mhar

    tokens = token_batch()
    reference = hf_logits(hf_dirs["qwen3_moe"], tokens)
    none = megatron_mhar.load_model(convert("qwen3_moe", "none"))
    delta = megatron_mhar.load_model(convert("qwen3_moe", "delta", delta_block_layers=1))
    experts = [type(layer.mlp).__name__ for layer in delta.gpt.decoder.layers]
    assert experts == ["MoELayer", "MLP", "MoELayer", "MoELayer"]
    with torch.no_grad():
        none_logits, delta_logits = none(tokens), delta(tokens)
    assert reference.std() > 0.5  # O(1) logits: a mapping error cannot hide under 1e-5
    assert (delta_logits - reference).abs().max() <= 1e-5
    assert torch.equal(delta_logits, none_logits)


def test_none_round_trip_is_bitwise_and_loads_in_transformers(megatron_world1, hf_dirs, convert, tmp_path):
    from transformers import AutoModelForCausalLM

    from megatron_mhar.conversion.convert import mcore_to_hf

    out = mcore_to_hf(convert("qwen3_moe", "none"), tmp_path / "hf")
    original, exported = read_safetensors(hf_dirs["qwen3_moe"]), read_safetensors(out)
    assert sorted(exported) == sorted(original)
    assert "model.layers.3.mlp.experts.3.down_proj.weight" in exported
    for key, tensor in original.items():
        assert exported[key].dtype == tensor.dtype and torch.equal(exported[key], tensor), key
    assert json.loads((out / "config.json").read_text()) == json.loads((hf_dirs["qwen3_moe"] / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    tokens = token_batch(1)
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, hf_logits(hf_dirs["qwen3_moe"], tokens))


def _expert_parallel_logits(checkpoint, tokens):
    """One rank of an EP=2 world: the converted checkpoint (written at EP=1) loaded with
    this rank's two experts of each MoE layer; logits of ``tokens``."""
    from megatron.core import parallel_state

    from megatron_mhar.checkpoint.format import read_configs, require_checkpoint
    from megatron_mhar.checkpoint.model import build_model
    from megatron_mhar.checkpoint.streaming import load_into
    from megatron_mhar.runtime import destroy, initialize_model_parallel_from_env

    initialize_model_parallel_from_env(ep=2, device="cpu", create_gloo_process_groups=False)
    try:
        found = require_checkpoint(checkpoint)
        model_cfg, mhar, _ = read_configs(found)
        model = build_model(model_cfg, mhar, torch.float32)
        load_into(model, found)
        model.eval()
        experts = model.decoder.layers[0].mlp.local_expert_indices
        assert experts == [2 * parallel_state.get_expert_model_parallel_rank() + i for i in range(2)]
        positions = torch.arange(tokens.shape[1]).expand_as(tokens)
        with torch.no_grad():
            return model(tokens, positions, None)
    finally:
        destroy()


def test_converted_checkpoint_loads_expert_parallel(megatron_world1, convert):
    """Written at EP=1, loaded at EP=2 (Megatron's sharded keys hold each expert by its global
    index): both ranks compute the logits of the single-process load (to fp32 rounding: each
    expert multiplies the tokens gathered from both ranks in one batch)."""
    import megatron_mhar

    checkpoint = convert("qwen3_moe", "delta", delta_block_layers=1)
    tokens = token_batch()
    with torch.no_grad():
        expected = megatron_mhar.load_model(checkpoint)(tokens)
    from megatron_mhar.runtime import destroy

    destroy()  # the fixture's world of one; the ranks start their own
    results = run_distributed(_expert_parallel_logits, 2, checkpoint, tokens, timeout=300)
    for logits in results:  # the padded vocabulary's rows are not the model's
        assert (logits[..., :expected.shape[-1]] - expected).abs().max() <= 1e-5


@pytest.mark.parametrize("edit,message", [
    pytest.param(dict(drop=["model.layers.2.mlp.experts.3.up_proj.weight"]),
                 "missing 1 tensors: model.layers.2.mlp.experts.3.up_proj.weight", id="missing-expert"),
    pytest.param(dict(replace={"model.layers.0.mlp.experts.1.gate_proj.weight": torch.zeros(16, 64)}),
                 "model.layers.0.mlp.experts.1.gate_proj.weight has shape (16, 64), the config implies (32, 64)",
                 id="misshapen-expert"),
    pytest.param(dict(add={"model.layers.0.mlp.experts.4.down_proj.weight": torch.zeros(64, 32)}),
                 "model.layers.0.mlp.experts.4.down_proj.weight (expert 4 >= num_experts=4)", id="extra-expert"),
    pytest.param(dict(config={"mlp_only_layers": []}),
                 "model.layers.1.mlp.gate_proj.weight (layer 1 has an MoE MLP in the config)", id="dense-layer-as-moe"),
    pytest.param(dict(config={"num_experts_per_tok": 0}), "num_experts_per_tok=0", id="no-top-k"),
])
def test_bad_qwen3_moe_checkpoints_are_named(hf_dirs, tmp_path, edit, message):
    hf_dir = edited_hf_dir(hf_dirs["qwen3_moe"], tmp_path / "hf", **edit)
    with pytest.raises(ValueError) as err:
        plan_hf_import(hf_dir, tmp_path / "out")
    assert message in str(err.value)
    assert not (tmp_path / "out").exists()


def test_cpt_recipe_matches_a_converted_qwen3_30b_a3b():
    """`mhar-convert hf-to-mcore --variant delta --seq-length 4096` on Qwen3-30B-A3B writes the
    model and mhar sections of recipes/cpt_30b_a3b_mhar_delta.yaml, but for the fields that
    choose how the model runs (the spec, the token dispatcher, the router's precision), which
    the driver does not compare."""
    from megatron_mhar.checkpoint.format import MODEL_EXECUTION_FIELDS
    from megatron_mhar.models.mhar_config import MHARConfig
    from megatron_mhar.training.recipes import load_config

    recipe = load_config("cpt_30b_a3b_mhar_delta")
    converted = dataclasses.asdict(hf_config.model_config_from_hf(QWEN3_30B_A3B, seq_length=4096))
    wanted = dataclasses.asdict(recipe.model)
    assert {k for k in wanted if wanted[k] != converted[k]} <= set(MODEL_EXECUTION_FIELDS)
    assert converted["moe_aux_loss_coeff"] == wanted["moe_aux_loss_coeff"] == 1e-3
    assert dataclasses.asdict(MHARConfig(variant="delta")) == dataclasses.asdict(recipe.mhar)

