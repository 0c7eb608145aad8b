"""A model and a tokenizer of different vocabularies: found at conversion (the tokenizer given
or beside the model), and at launch named as what it is, the model's rows against the
tokenizer's tokens, with fixes that fix it."""

from __future__ import annotations

import shutil

import pytest

from tests.helpers import EMBEDDED_BYTES, EMBEDDED_VOCAB, HF_VOCAB, edited_hf_dir, plan_hf_import


@pytest.fixture(scope="module")
def builtin(embedded_dir):
    """The embedded corpus, whose builtin tokenizer has 512 tokens, more than the tiny models' 100 rows."""
    from megatron_mhar.data.corpus import prepare_embedded

    return prepare_embedded(str(embedded_dir), EMBEDDED_VOCAB, EMBEDDED_BYTES)


def test_a_larger_tokenizer_beside_the_model_is_refused(hf_dirs, builtin, tmp_path):
    builtin_tokenizer = builtin.directory
    hf_dir = edited_hf_dir(hf_dirs["llama"], tmp_path / "llama")
    shutil.copy(builtin_tokenizer / "tokenizer.json", hf_dir)
    with pytest.raises(ValueError, match=(
            rf"the tokenizer beside the model, {hf_dir}/tokenizer.json has {EMBEDDED_VOCAB} tokens but the "
            rf"model has {HF_VOCAB} embedding rows \(vocab_size in {hf_dir}/config.json\): ids from "
            rf"{HF_VOCAB} up would have no embedding.*Give the tokenizer this model was trained with")):
        plan_hf_import(hf_dir, tmp_path / "out")


def test_the_tokenizer_given_is_checked_and_carried(hf_dirs, builtin, tmp_path, single_process):
    builtin_tokenizer = builtin.directory
    from megatron_mhar.conversion.convert import hf_to_mcore

    with pytest.raises(ValueError, match=rf"--tokenizer {builtin_tokenizer}/tokenizer.json has {EMBEDDED_VOCAB} tokens"):
        plan_hf_import(hf_dirs["llama"], tmp_path / "out", tokenizer=builtin_tokenizer)
    with pytest.raises(FileNotFoundError, match=rf"--tokenizer {tmp_path} has no tokenizer.json"):
        plan_hf_import(hf_dirs["llama"], tmp_path / "out", tokenizer=tmp_path)

    # A fitting tokenizer (the builtin one under a model of as many rows) goes with the checkpoint.
    wide = edited_hf_dir(hf_dirs["llama"], tmp_path / "wide", config={"vocab_size": EMBEDDED_VOCAB},
                         replace=_widened(hf_dirs["llama"]))
    out = hf_to_mcore(plan_hf_import(wide, tmp_path / "out", tokenizer=builtin_tokenizer))
    carried = out / "iter_0000000" / "hf" / "tokenizer.json"
    assert carried.read_bytes() == (builtin_tokenizer / "tokenizer.json").read_bytes()


def _widened(hf_dir):
    """The tiny Llama's vocabulary matrices grown to the builtin tokenizer's size."""
    import torch

    from tests.helpers import read_safetensors

    tensors = read_safetensors(hf_dir)
    return {name: torch.cat([t, torch.zeros(EMBEDDED_VOCAB - t.shape[0], t.shape[1], dtype=t.dtype)])
            for name, t in tensors.items() if name in ("model.embed_tokens.weight", "lm_head.weight")}


def test_launch_names_the_model_rows_against_the_tokenizer(tmp_path, builtin):
    """The issue's case: a converted model of fewer rows than ``data.tokenizer`` has tokens,
    with data that tokenizer wrote: the launch blames the pair, not the data."""
    from megatron_mhar.training.launch_checks import validate_launch
    from megatron_mhar.training.recipes import load_config

    builtin_tokenizer = builtin.directory
    cfg = load_config("smoke_cpu", [f"data.tokenizer={builtin_tokenizer}", "model.vocab_size=300",
                                    f"data.paths=[{builtin.prefix}]", f"checkpoint.load={tmp_path}"])
    with pytest.raises(ValueError) as err:
        validate_launch(cfg, 1)
    assert str(err.value) == (
        f"the model has 300 embedding rows (model.vocab_size) but data.tokenizer='{builtin_tokenizer}' has "
        f"{EMBEDDED_VOCAB} tokens: ids from 300 up have no embedding. The loaded model's vocabulary is fixed: "
        f"set data.tokenizer to the tokenizer it was converted with (mhar-convert hf-to-mcore checks the two) "
        f"and write the data with it (mhar-preprocess --tokenizer)"
    )
