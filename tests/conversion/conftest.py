"""Tiny random HF models built locally (no download) and their conversions, built once per test run.

Fixtures:
    hf_dirs: {name: directory} of ``save_pretrained(safe_serialization=True)`` models:
        ``llama`` (GQA, untied, RoPE theta 5e5 with llama3 scaling), ``qwen3_tied``
        (q/k norms, head_dim != d/heads, tied embeddings), ``qwen3_untied``,
        ``qwen3_bf16`` (bf16 tensors) and ``qwen3_moe`` (Qwen3-MoE: 4 experts top-2 with the
        top-2 weights renormalised, layer 1 a dense MLP).
    convert: ``convert(name, variant, tp=1, pp=1, divisible_by=32, **mhar) -> checkpoint dir``,
        cached; ``tp * pp > 1`` spawns that many gloo ranks, as the CLI does.

Weights are redrawn larger than HF's init (matrices N(0, 0.1^2), norms 1 + N(0, 0.2^2))
so that logits are O(1) and a mapping error cannot hide below the tolerance.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import HF_SEQ, HF_VOCAB, redraw_hf_weights

COMMON = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=96, vocab_size=HF_VOCAB, max_position_embeddings=16384,
              rms_norm_eps=1e-6)

MODELS = {
    # llama3 scaling with Megatron's fixed low/high factors and original context 8192
    "llama": ("llama", dict(tie_word_embeddings=False, rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192})),
    "qwen3_tied": ("qwen3", dict(tie_word_embeddings=True, head_dim=24, rope_theta=10000.0)),
    "qwen3_untied": ("qwen3", dict(tie_word_embeddings=False, head_dim=16, rope_theta=1000000.0)),
    "qwen3_bf16": ("qwen3", dict(tie_word_embeddings=True, head_dim=16)),
    "qwen3_moe": ("qwen3_moe", dict(tie_word_embeddings=False, head_dim=16, rope_theta=1000000.0,
                                    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                    norm_topk_prob=True, mlp_only_layers=[1])),
}


def build_hf_model(kind: str, options: dict, seed: int = 0):
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig,
                              Qwen3MoeForCausalLM)

    config_class, model_class = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
        "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
    }[kind]
    return redraw_hf_weights(model_class(config_class(**COMMON, **options)), seed)


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    dirs = {}
    for seed, (name, (kind, options)) in enumerate(MODELS.items()):
        model = build_hf_model(kind, options, seed)
        if name.endswith("bf16"):
            model = model.to(torch.bfloat16)
        model.save_pretrained(root / name, safe_serialization=True)
        dirs[name] = root / name
    return dirs


@pytest.fixture(scope="session")
def convert(hf_dirs, tmp_path_factory):
    """Convert (once per argument set) with the library API, as the CLI does."""
    from megatron_mhar.conversion.convert import hf_to_mcore, plan_import

    root = tmp_path_factory.mktemp("mcore")
    cache = {}

    def _convert(name: str, variant: str, tp: int = 1, pp: int = 1, divisible_by: int = 32,
                 **mhar) -> Path:
        key = (name, variant, tp, pp, divisible_by, tuple(sorted(mhar.items())))
        if key not in cache:
            out = root / f"{name}_{variant}_tp{tp}_pp{pp}_{len(cache)}"
            plan = plan_import(hf_dirs[name], out, variant, tp=tp, pp=pp, seq_length=HF_SEQ,
                               make_vocab_size_divisible_by=divisible_by, mhar_overrides=mhar)
            cache[key] = hf_to_mcore(plan)
        return cache[key]

    return _convert
