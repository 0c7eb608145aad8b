"""Continued pretraining from converted checkpoints through the training driver (CPU).

A tiny Qwen3 (the smoke recipe's architecture: q/k norms, tied embeddings, the
builtin tokenizer's 512 tokens) is converted twice, ``none`` and ``delta``; runs of
``megatron_mhar.train``'s loop start from each with ``checkpoint.load`` and
``checkpoint.load_model_only``, the model/mhar sections copied from the
checkpoint's ``train_config.yaml`` (what a recipe does).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import yaml

from tests.helpers import EMBEDDED_VOCAB, TINY, redraw_hf_weights


@pytest.fixture(scope="module")
def base_model(tmp_path_factory):
    """A tiny HF Qwen3 over the builtin tokenizer's vocabulary, its weights redrawn large
    (at HF's init the logits are near zero and the loss is ln(vocab) whatever the model)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    model = redraw_hf_weights(Qwen3ForCausalLM(Qwen3Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, intermediate_size=64, vocab_size=EMBEDDED_VOCAB, rms_norm_eps=1e-6,
        tie_word_embeddings=True, max_position_embeddings=32,
    )))
    path = tmp_path_factory.mktemp("hf") / "qwen3"
    model.save_pretrained(path, safe_serialization=True)
    return path, model


def _convert(hf_dir, out, variant):
    from megatron_mhar.conversion.convert import hf_to_mcore, plan_import

    return hf_to_mcore(plan_import(hf_dir, out, variant, mhar_overrides=(
        dict(num_heads=4, delta_block_layers=1) if variant == "delta" else {}
    )))


def _run_from(checkpoint, tmp_path, embedded_dir, name, *overrides, record=None):
    """Train from a converted checkpoint; ``record`` collects the micro-batches of step 1."""
    from megatron_mhar.training import loop
    from megatron_mhar.training.recipes import load_config

    sections = yaml.safe_load((checkpoint / "iter_0000000" / "train_config.yaml").read_text())
    copied = [f"{section}.{key}={'null' if value is None else value}"
              for section in ("model", "mhar") for key, value in sections[section].items()]
    cfg = load_config("smoke_cpu", TINY + copied + [
        f"run.output_dir={tmp_path}", f"run.name={name}", f"data.embedded_dir={embedded_dir}",
        f"checkpoint.load={checkpoint}", "checkpoint.load_model_only=true", "eval.interval=0",
        "logging.tensorboard=false", *overrides,
    ])
    if record is not None:
        original = loop.Trainer._forward_step

        def recording(self, data_iterator, model):
            if self.iteration == 0:  # the first optimizer step, before any update
                batch = next(data_iterator)
                record.append({k: v.clone() for k, v in batch.items()})
                return original(self, iter([batch]), model)
            return original(self, data_iterator, model)

        loop.Trainer._forward_step = recording
    try:
        return loop.run(cfg), cfg
    finally:
        if record is not None:
            loop.Trainer._forward_step = original


def test_continued_pretraining_from_converted_checkpoints(
    tmp_path, embedded_dir, base_model, single_process
):
    import megatron_mhar
    from megatron_mhar.runtime import destroy

    hf_dir, hf_model = base_model
    none_ckpt = _convert(hf_dir, tmp_path / "none", "none")
    delta_ckpt = _convert(hf_dir, tmp_path / "delta", "delta")

    batches = []
    base, _ = _run_from(none_ckpt, tmp_path, embedded_dir, "base", "training.train_iters=3",
                        "checkpoint.save_at_end=false", record=batches)
    delta, cfg = _run_from(delta_ckpt, tmp_path, embedded_dir, "delta", "training.train_iters=6")

    # Step 0: the converted models compute the base model's loss on the same batch.
    assert delta.losses[1] == base.losses[1]
    losses, tokens = [], 0
    with torch.no_grad():
        for batch in batches:  # the driver's loss: sum over tokens / tokens, global batch
            logits = hf_model(batch["tokens"]).logits
            token_loss = torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), batch["labels"].flatten(), reduction="none"
            )
            losses.append((token_loss * batch["loss_mask"].flatten()).sum())
            tokens += batch["loss_mask"].sum()
    assert len(batches) == 2  # global batch 4 = 2 micro-batches of 2
    assert delta.losses[1] == pytest.approx((sum(losses) / tokens).item(), abs=1e-5)

    # A short run trains, and the zero-initialised gates leave zero.
    assert all(math.isfinite(v) for v in delta.losses.values())
    assert delta.losses[6] < delta.losses[1]
    trained = megatron_mhar.load_model(cfg.checkpoint_dir)
    try:
        gates = {n: p for n, p in trained.gpt.named_parameters() if n.endswith("router.gate")}
        assert len(gates) == 4 and all(g.abs().item() > 0 for g in gates.values())
    finally:
        destroy()

    # The trained checkpoint (written by the driver) goes back to HF in its MHAR form.
    from safetensors.torch import load_file

    from megatron_mhar.conversion.convert import mcore_to_hf

    out = mcore_to_hf(cfg.checkpoint_dir, tmp_path / "hf_out", hf_reference=hf_dir)
    exported = load_file(str(out / "model.safetensors"))
    for name, gate in gates.items():
        assert torch.equal(exported[name.replace("decoder.", "model.")], gate.detach())
    config, reference = (json.loads((d / "config.json").read_text()) for d in (out, hf_dir))
    assert config["architectures"] == ["MHARQwen3ForCausalLM"] and config["mhar_variant"] == "delta"
    # transformers_version: the oldest transformers the shipped modeling code runs on
    assert {k: v for k, v in config.items() if not k.startswith("mhar_") and k not in
            ("architectures", "model_type", "auto_map", "transformers_version")} == {
        k: v for k, v in reference.items() if k not in ("architectures", "model_type", "transformers_version")}
