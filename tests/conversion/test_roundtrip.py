"""HF -> Megatron (none / delta) -> HF on tiny random Llama and Qwen3 models."""

import json

import pytest
import torch

from tests.helpers import hf_logits, read_safetensors, token_batch

MODELS = [
    pytest.param("llama", id="llama-gqa-untied-llama3-rope"),  # GQA, lm_head, RoPE scaling
    pytest.param("qwen3_tied", id="qwen3-qknorm-tied"),  # q/k norms, head_dim*heads != d, tied
    pytest.param("qwen3_untied", id="qwen3-qknorm-untied"),  # q/k norms with an lm_head
]


@pytest.mark.parametrize("name", MODELS)
def test_delta_logits_equal_hf_and_none_bitwise(megatron_world1, hf_dirs, convert, name):
    """fp32: delta == HF within 1e-4, and delta == none bitwise (zero gates)."""
    import megatron_mhar

    tokens = token_batch()
    reference = hf_logits(hf_dirs[name], tokens)
    none = megatron_mhar.load_model(convert(name, "none"))
    delta = megatron_mhar.load_model(convert(name, "delta", delta_block_layers=1))
    assert delta.mhar.variant == "delta" and none.mhar.variant == "none"
    with torch.no_grad():
        none_logits, delta_logits = none(tokens), delta(tokens)
    assert delta_logits.shape == reference.shape == (2, 16, 100)
    assert reference.std() > 0.5  # O(1) logits: a mapping error cannot hide under 1e-4
    assert (delta_logits - reference).abs().max() <= 1e-4
    assert torch.equal(delta_logits, none_logits)


@pytest.mark.parametrize("name", MODELS + [pytest.param("qwen3_bf16", id="qwen3-bf16")])
def test_none_round_trip_is_bitwise_and_loads_in_transformers(megatron_world1, hf_dirs, convert, tmp_path, name):
    from transformers import AutoModelForCausalLM

    from megatron_mhar.conversion.convert import mcore_to_hf

    out = mcore_to_hf(convert(name, "none"), tmp_path / "hf")
    original, exported = read_safetensors(hf_dirs[name]), read_safetensors(out)
    assert sorted(exported) == sorted(original)
    for key, tensor in original.items():
        assert exported[key].dtype == tensor.dtype and torch.equal(exported[key], tensor), key
    assert json.loads((out / "config.json").read_text()) == json.loads(
        (hf_dirs[name] / "config.json").read_text()
    )
    assert not (out / "mhar_params.safetensors").exists()
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    tokens = token_batch(1)
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, hf_logits(hf_dirs[name], tokens))


def test_delta_export_is_an_mhar_directory(megatron_world1, hf_dirs, convert, tmp_path):
    """MHAR models: the same HF tensors plus the routing tensors under their HF names, an
    MHAR config.json, and the routing tensors come back on re-import."""
    from safetensors.torch import load_file, save_file

    import megatron_mhar
    from megatron_mhar.conversion.convert import hf_to_mcore, mcore_to_hf, plan_import

    ckpt = convert("qwen3_tied", "delta", num_heads=4)
    out = mcore_to_hf(ckpt, tmp_path / "hf")
    original, exported = read_safetensors(hf_dirs["qwen3_tied"]), read_safetensors(out)
    routing = {k: v for k, v in exported.items() if "_router." in k}
    assert sorted(set(exported) - set(routing)) == sorted(original)
    assert all(torch.equal(exported[k], v) for k, v in original.items())
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["MHARQwen3ForCausalLM"] and config["model_type"] == "mhar_qwen3"
    assert config["mhar_variant"] == "delta" and config["mhar_num_heads"] == 4
    per_site = ("query", "norm_weight", "null_source", "gate")
    assert sorted(routing) == sorted(
        f"model.layers.{i}.{site}.{p}" for i in range(4)
        for site in ("input_router", "pre_mlp_router") for p in per_site
    )
    assert all(routing[f"model.layers.{i}.input_router.gate"].shape == (1,) for i in range(4))
    assert not (out / "mhar_params.safetensors").exists()

    # Trained routing: perturb it, re-import without --variant, the values come back.
    tensors = load_file(str(out / "model.safetensors"))
    tensors.update({k: v + 0.25 for k, v in routing.items()})
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    back = hf_to_mcore(plan_import(out, tmp_path / "back", None, seq_length=16,
                                   make_vocab_size_divisible_by=32))
    model = megatron_mhar.load_model(back)
    state = model.gpt.state_dict()
    for key, value in routing.items():
        assert torch.equal(state[key.replace("model.layers", "decoder.layers")], value + 0.25), key
    assert model.mhar.num_heads == 4


def test_bf16_checkpoint_loads_into_fp32(megatron_world1, hf_dirs, convert):
    """A bf16 conversion (the HF dtype is kept) loads into fp32 parameters exactly."""
    import megatron_mhar
    from megatron_mhar.checkpoint.format import find_checkpoint, stored_dtype

    ckpt = convert("qwen3_bf16", "delta")
    assert stored_dtype(find_checkpoint(ckpt)) == torch.bfloat16
    model = megatron_mhar.load_model(ckpt, dtype=torch.float32)
    embedding = model.gpt.embedding.word_embeddings.weight
    assert embedding.dtype == torch.float32
    original = read_safetensors(hf_dirs["qwen3_bf16"])["model.embed_tokens.weight"]
    assert torch.equal(embedding[:100], original.float())
    assert not embedding[100:].any()  # Megatron's padded rows are zero
