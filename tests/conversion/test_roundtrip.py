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


def test_delta_export_writes_base_weights_and_side_file(megatron_world1, hf_dirs, convert, tmp_path):
    """MHAR models: the same HF tensors plus mhar_params.safetensors / mhar_config.json,
    and the side file comes back on re-import."""
    from safetensors.torch import load_file

    import megatron_mhar
    from megatron_mhar.conversion.convert import hf_to_mcore, mcore_to_hf, plan_import

    ckpt = convert("qwen3_tied", "delta", num_heads=4)
    out = mcore_to_hf(ckpt, tmp_path / "hf")
    original, exported = read_safetensors(hf_dirs["qwen3_tied"]), read_safetensors(out)
    assert sorted(exported) == sorted(original)
    assert all(torch.equal(exported[k], v) for k, v in original.items())
    routing = load_file(str(out / "mhar_params.safetensors"))
    description = json.loads((out / "mhar_config.json").read_text())
    assert description["variant"] == "delta" and description["mhar"]["num_heads"] == 4
    per_site = ("query", "norm_weight", "null_source", "gate")
    assert sorted(routing) == sorted(
        f"decoder.layers.{i}.{site}.{p}" for i in range(4)
        for site in ("input_router", "pre_mlp_router") for p in per_site
    )
    assert all(routing[f"decoder.layers.{i}.input_router.gate"].shape == (1,) for i in range(4))

    # A trained side file: perturb it, re-import without --variant, the values come back.
    from safetensors.torch import save_file

    routing = {k: v + 0.25 for k, v in routing.items()}
    save_file(routing, str(out / "mhar_params.safetensors"))
    back = hf_to_mcore(plan_import(out, tmp_path / "back", None, seq_length=16,
                                   make_vocab_size_divisible_by=32))
    model = megatron_mhar.load_model(back)
    state = model.gpt.state_dict()
    for key, value in routing.items():
        assert torch.equal(state[key], value), key
    assert model.mhar.num_heads == 4


def test_bf16_checkpoint_loads_into_fp32(megatron_world1, hf_dirs, convert):
    """A bf16 conversion (the HF dtype is kept) loads into fp32 parameters exactly."""
    import megatron_mhar
    from megatron_mhar.checkpoint_format import find_checkpoint, stored_dtype

    ckpt = convert("qwen3_bf16", "delta")
    assert stored_dtype(find_checkpoint(ckpt)) == torch.bfloat16
    model = megatron_mhar.load_model(ckpt, dtype=torch.float32)
    embedding = model.gpt.embedding.word_embeddings.weight
    assert embedding.dtype == torch.float32
    original = read_safetensors(hf_dirs["qwen3_bf16"])["model.embed_tokens.weight"]
    assert torch.equal(embedding[:100], original.float())
    assert not embedding[100:].any()  # Megatron's padded rows are zero
