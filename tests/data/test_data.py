"""Embedded corpus, tokenizers, preprocessing to .bin/.idx, GPTDatasets and batches."""

from __future__ import annotations

import json
import os
import sysconfig

import numpy
import pytest
import torch

from megatron_mhar.data.corpus import prepare_embedded, stdlib_files
from megatron_mhar.data.preprocess import main as preprocess_main
from megatron_mhar.data.preprocess import write_indexed_dataset
from megatron_mhar.data.tokenizer import EOD_TOKEN, Tokenizer

VOCAB = 384
BYTES = 120_000


@pytest.fixture(scope="module")
def embedded(tmp_path_factory):
    return prepare_embedded(str(tmp_path_factory.mktemp("emb")), VOCAB, BYTES)


def _read_indexed(prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    return IndexedDataset(prefix)


def test_stdlib_corpus_is_deterministic_and_clean():
    root = sysconfig.get_paths()["stdlib"]
    files = stdlib_files()
    assert files == stdlib_files()
    assert len(files) > 100
    for path in files:
        rel = os.path.relpath(path, root).split(os.sep)
        assert path.suffix == ".py"
        assert rel[0] not in ("site-packages", "test") and "tests" not in rel[:-1]
    prefix = stdlib_files(max_bytes=BYTES)
    assert prefix == files[: len(prefix)]
    assert sum(p.stat().st_size for p in prefix[:-1]) < BYTES


def test_prepare_embedded_builds_once(embedded, tmp_path):
    manifest = embedded.manifest()
    tokenizer = embedded.tokenizer()
    assert manifest["vocab_size"] == tokenizer.vocab_size == VOCAB
    assert tokenizer.eod_token == EOD_TOKEN
    dataset = _read_indexed(embedded.prefix)
    assert len(dataset) == manifest["documents"] == manifest["files"]
    assert int(dataset.sequence_lengths.sum()) == manifest["tokens"]
    assert all(dataset[i][-1] == tokenizer.eod for i in range(len(dataset)))  # EOD after each doc
    # the first document decodes back to the first file of the corpus
    first = stdlib_files(max_bytes=BYTES)[0].read_text(encoding="utf-8", errors="replace")
    assert tokenizer.detokenize(dataset[0][:-1]) == first
    # a second call reuses the build (no rebuild: same inode)
    before = os.stat(embedded.prefix + ".bin").st_ino
    again = prepare_embedded(str(embedded.directory.parent), VOCAB, BYTES)
    assert again.directory == embedded.directory
    assert os.stat(again.prefix + ".bin").st_ino == before
    assert not [p for p in embedded.directory.parent.iterdir() if p.name.startswith(".")]


def test_tokenizer_round_trip_and_eod(embedded, tmp_path):
    tokenizer = embedded.tokenizer()
    text = "def f(x):\n    return x  # ünïcode ✓\n"
    ids = tokenizer.tokenize(text)
    assert tokenizer.detokenize(ids) == text
    assert tokenizer.tokenize_batch([text, "x"]) == [ids, tokenizer.tokenize("x")]
    assert tokenizer.eod not in ids
    assert tokenizer.unique_identifiers["vocab_size"] == VOCAB
    # eod from tokenizer_config.json when the vocabulary has no <|endoftext|>
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    spec = json.loads((embedded.directory / "tokenizer.json").read_text())
    spec["added_tokens"][0]["content"] = "</s>"
    spec["model"]["vocab"]["</s>"] = spec["model"]["vocab"].pop(EOD_TOKEN)
    (hf_dir / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(ValueError, match="set data.eod_token"):
        Tokenizer.from_dir(str(hf_dir))
    (hf_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>"}}))
    assert Tokenizer.from_dir(str(hf_dir)).eod_token == "</s>"
    with pytest.raises(ValueError, match="has no token '<nope>'"):
        Tokenizer.from_dir(str(hf_dir), eod_token="<nope>")


def test_preprocess_jsonl_and_text(embedded, tmp_path, capsys):
    docs = ["first document", "", "second one\nwith two lines", "third"]
    jsonl = tmp_path / "in.jsonl"
    jsonl.write_text("".join(json.dumps({"content": d}) + "\n" for d in docs))
    prefix = tmp_path / "out" / "corpus"
    assert preprocess_main([
        "--input", str(jsonl), "--output-prefix", str(prefix), "--tokenizer", str(embedded.directory),
        "--json-key", "content",
    ]) == 0
    assert "3 documents" in capsys.readouterr().out  # the empty one is skipped
    tokenizer = embedded.tokenizer()
    dataset = _read_indexed(str(prefix))
    kept = [d for d in docs if d]
    assert len(dataset) == len(kept)
    for i, doc in enumerate(kept):
        assert list(dataset[i]) == tokenizer.tokenize(doc) + [tokenizer.eod]
    assert sorted(os.listdir(prefix.parent)) == ["corpus.bin", "corpus.idx"]  # no leftovers

    text = tmp_path / "lines.txt"
    text.write_text("line one\n\nline two\n")
    stats = write_indexed_dataset(["line one", "line two"], tokenizer, str(tmp_path / "a"))
    assert preprocess_main([
        "--input", str(text), "--output-prefix", str(tmp_path / "b"), "--tokenizer", "builtin",
        "--embedded-dir", str(embedded.directory.parent), "--vocab-size", str(VOCAB),
        "--embedded-max-bytes", str(BYTES), "--line-docs",
    ]) == 0
    a, b = _read_indexed(str(tmp_path / "a")), _read_indexed(str(tmp_path / "b"))
    assert stats["documents"] == len(b) == 2
    assert [list(a[i]) for i in range(2)] == [list(b[i]) for i in range(2)]


def test_preprocess_errors(embedded, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n{"body": "b"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: no key 'text' \(keys: \['body'\]\); pass --json-key"):
        preprocess_main(["--input", str(bad), "--output-prefix", str(tmp_path / "x"),
                         "--tokenizer", str(embedded.directory)])
    assert not list(tmp_path.glob("x*"))  # nothing half-written
    with pytest.raises(SystemExit):
        preprocess_main(["--input", str(tmp_path / "missing.txt"), "--output-prefix", "y",
                         "--tokenizer", str(embedded.directory)])


def test_gpt_datasets_and_micro_batches(embedded):
    from megatron_mhar.data.datasets import MicroBatches, build_gpt_datasets

    seq, gbs = 16, 8
    train, valid, test = build_gpt_datasets(
        [embedded.prefix], None, "90,10,0", seq, [10 * gbs, 2 * gbs, 0], embedded.tokenizer(), seed=7
    )
    assert test is None and len(train) >= 10 * gbs and len(valid) >= 2 * gbs
    sample = train[0]
    assert sample["tokens"].shape == (seq,) and torch.equal(sample["tokens"][1:], sample["labels"][:-1])
    again = build_gpt_datasets(
        [embedded.prefix], None, "90,10,0", seq, [10 * gbs, 2 * gbs, 0], embedded.tokenizer(), seed=7
    )[0]
    assert all(torch.equal(train[i]["tokens"], again[i]["tokens"]) for i in range(gbs))

    # dp=1 reads samples in order; dp=2 ranks split every micro x dp group between them
    one = MicroBatches(train, 2, 0, 1)
    ranks = [MicroBatches(train, 2, r, 2) for r in range(2)]
    serial = torch.cat([next(one)["tokens"] for _ in range(4)])
    split = torch.cat([torch.cat([next(r)["tokens"] for r in ranks]) for _ in range(2)])
    assert torch.equal(serial, split)
    assert one.consumed_samples == ranks[0].consumed_samples == 8
    # resuming at a consumed-sample count continues exactly
    resumed = MicroBatches(train, 2, 0, 1, consumed_samples=8)
    assert torch.equal(next(resumed)["tokens"], next(one)["tokens"])
