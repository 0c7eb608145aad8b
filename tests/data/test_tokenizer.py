"""Tokenizer.save: a Hugging Face tokenizer directory that reads back, with transformers too."""

from __future__ import annotations

import json

import pytest

from megatron_mhar.data.corpus import prepare_embedded
from megatron_mhar.data.tokenizer import EOD_TOKEN, Tokenizer

TEXT = "def f(x):\n    return x  # ünïcode ✓\n"


@pytest.fixture(scope="module")
def builtin(tmp_path_factory):
    return prepare_embedded(str(tmp_path_factory.mktemp("emb")), 300, 20_000).tokenizer()


def test_builtin_tokenizer_saves_as_a_hugging_face_directory(builtin, tmp_path):
    builtin.save(tmp_path / "tok")
    config = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast" and config["eos_token"] == EOD_TOKEN
    again = Tokenizer.from_dir(str(tmp_path / "tok"))
    assert again.tokenize(TEXT) == builtin.tokenize(TEXT) and again.eod == builtin.eod
    assert again.vocab_size == builtin.vocab_size

    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    ids = hf(TEXT, add_special_tokens=False)["input_ids"]
    assert ids == builtin.tokenize(TEXT)
    assert hf.decode(ids) == TEXT and hf.eos_token_id == builtin.eod


def test_a_downloaded_tokenizer_is_copied_as_it_is(builtin, tmp_path):
    """A Hugging Face tokenizer directory keeps its own files (chat template, special
    tokens), and its end-of-document token (here from tokenizer_config.json) reads back."""
    source = tmp_path / "download"
    builtin.save(source)
    spec = (source / "tokenizer.json").read_text()
    (source / "tokenizer.json").write_text(spec.replace(EOD_TOKEN, "</s>"))
    config = {"eos_token": {"content": "</s>"}, "chat_template": "{{ messages }}", "model_max_length": 77}
    (source / "tokenizer_config.json").write_text(json.dumps(config))
    (source / "special_tokens_map.json").write_text('{"eos_token": "</s>"}')
    tokenizer = Tokenizer.from_dir(str(source))
    tokenizer.save(tmp_path / "saved")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (tmp_path / "saved" / name).read_bytes() == (source / name).read_bytes(), name
    again = Tokenizer.from_dir(str(tmp_path / "saved"))
    assert again.eod_token == "</s>" and again.eod == tokenizer.eod
