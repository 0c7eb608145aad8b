"""An export after training keeps the converted model's config.json.

A tiny Llama whose context (256), RoPE scaling, token ids and dtype differ from what a
config derived from the Megatron model would say is converted at a shorter
``model.seq_length`` (32), trained through the driver, resumed (so the record passes from
one of the run's checkpoints to the next), and exported without ``--hf-reference``:
every field of the source ``config.json`` is there as it was, and only what the export
really changed (here ``--dtype``) differs, said in its output.
"""

from __future__ import annotations

import json

import pytest
import yaml

from tests.helpers import EMBEDDED_VOCAB, TINY, redraw_hf_weights

# Fields an MHAR export sets itself (its classes, code and routing); every other one is the source's.
MHAR_FORM = ("architectures", "model_type", "auto_map", "transformers_version")


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    model = redraw_hf_weights(LlamaForCausalLM(LlamaConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, vocab_size=EMBEDDED_VOCAB, rms_norm_eps=1e-5, tie_word_embeddings=False,
        max_position_embeddings=256, bos_token_id=7, eos_token_id=9, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
    )))
    path = tmp_path_factory.mktemp("hf") / "llama"
    model.save_pretrained(path, safe_serialization=True)
    return path


def _train(checkpoint, tmp_path, embedded_dir, iters):
    from megatron_mhar.training import loop
    from megatron_mhar.training.recipes import load_config

    sections = yaml.safe_load((checkpoint / "iter_0000000" / "train_config.yaml").read_text())
    copied = [f"{section}.{key}={'null' if value is None else value}"
              for section in ("model", "mhar") for key, value in sections[section].items()]
    cfg = load_config("smoke_cpu", TINY + copied + [
        f"run.output_dir={tmp_path}", "run.name=cpt", f"data.embedded_dir={embedded_dir}",
        f"checkpoint.load={checkpoint}", "checkpoint.load_model_only=true", "eval.interval=0",
        "logging.tensorboard=false", "optimizer.lr_warmup_iters=1", f"training.train_iters={iters}",
    ])
    loop.run(cfg)
    return cfg.checkpoint_dir


def test_export_of_a_trained_run_keeps_the_source_config(tmp_path, embedded_dir, source, single_process, capsys):
    from megatron_mhar.conversion.convert import hf_to_mcore, mcore_to_hf, plan_import

    converted = hf_to_mcore(plan_import(source, tmp_path / "delta", "delta", seq_length=32,
                                        mhar_overrides=dict(num_heads=4, delta_block_layers=1)))
    _train(converted, tmp_path, embedded_dir, 2)
    checkpoints = _train(converted, tmp_path, embedded_dir, 3)  # resumes from its own step 2
    assert (checkpoints / "latest").read_text().strip() == "iter_0000003"

    reference = json.loads((source / "config.json").read_text())
    capsys.readouterr()
    out = mcore_to_hf(checkpoints, tmp_path / "hf_out")
    config = json.loads((out / "config.json").read_text())
    assert config["max_position_embeddings"] == 256 and config["mhar_variant"] == "delta"
    for key, value in reference.items():  # key by key: nothing of the source is lost or changed
        if key not in MHAR_FORM:
            assert config.get(key, "<absent>") == value, key
    assert not {k for k in config if k not in reference and not k.startswith("mhar_") and k not in MHAR_FORM}
    assert "unchanged" in capsys.readouterr().out

    # What the export does change is said, and nothing else differs.
    out = mcore_to_hf(checkpoints, tmp_path / "hf_bf16", dtype="bfloat16")
    config = json.loads((out / "config.json").read_text())
    assert "dtype 'float32' -> 'bfloat16' (--dtype)" in capsys.readouterr().out
    assert {k for k in reference if k not in MHAR_FORM and config.get(k) != reference[k]} == {"dtype"}
