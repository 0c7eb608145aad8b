"""Embedded corpus, tokenizers, preprocessing to .bin/.idx, GPTDatasets and batches."""

from __future__ import annotations

import json
import os
import re
import sysconfig

import pytest
import torch

from megatron_mhar.data.corpus import prepare_embedded, stdlib_files
from megatron_mhar.data.indexed_writer import write_indexed_dataset
from megatron_mhar.data.preprocess import main as preprocess_main
from megatron_mhar.data.tokenizer import EOD_TOKEN, Tokenizer
from megatron_mhar.checkpoint.manifest import file_checksum

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
    assert sorted(os.listdir(prefix.parent)) == ["corpus.bin", "corpus.idx", "corpus.meta.json"]  # no leftovers
    metadata = json.loads((prefix.parent / "corpus.meta.json").read_text())
    ids = [i for doc in kept for i in tokenizer.tokenize(doc) + [tokenizer.eod]]
    stat = os.stat(f"{prefix}.bin")
    assert metadata == {"format": "megatron_mhar.indexed.v2", "vocab_size": VOCAB, "max_token_id": max(ids),
                        "documents": 3, "tokens": len(ids), "bin_bytes": stat.st_size,
                        "bin_mtime_ns": stat.st_mtime_ns, "bin_xxh3_64": file_checksum(f"{prefix}.bin")}

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


def test_preprocess_errors(embedded, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n{"body": "b"}\n')
    with pytest.raises(SystemExit) as exit_:  # named, exit 2, no traceback
        preprocess_main(["--input", str(bad), "--output-prefix", str(tmp_path / "x"),
                         "--tokenizer", str(embedded.directory)])
    assert exit_.value.code == 2
    assert "bad.jsonl:2: no key 'text' (keys: ['body']); pass --json-key" in capsys.readouterr().err
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


def _preprocess(embedded, tmp_path, *inputs, extra=()):
    args = ["--input", *map(str, inputs), "--output-prefix", str(tmp_path / "out" / "p"),
            "--tokenizer", str(embedded.directory), *extra]
    return preprocess_main(args)


@pytest.mark.parametrize(
    "line, message",
    [
        pytest.param(b'{"text": "caf\xe9"}', r"bad.jsonl: not UTF-8 at byte offset 30 \(line 2\) \(byte 0xe9: ",
                     id="latin1"),
        pytest.param(b'["a", "b"]', r"bad.jsonl:2: a JSON array, not an object", id="array-line"),
        pytest.param(b'{"text": null}', r"bad.jsonl:2: 'text' holds a JSON null, not a string", id="null"),
        pytest.param(b'{"text": 7}', r"bad.jsonl:2: 'text' holds a JSON number", id="number"),
        # a list would be tokenized as a (text, pair) input without a word
        pytest.param(b'{"text": ["a", "b"]}', r"bad.jsonl:2: 'text' holds a JSON array", id="list"),
    ],
)
def test_preprocess_names_the_bad_jsonl_line(embedded, tmp_path, capsys, line, message):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"text": "fine"}\n' + line + b'\n{"text": "after"}\n')
    with pytest.raises(SystemExit) as exit_:
        _preprocess(embedded, tmp_path, bad)
    assert exit_.value.code == 2
    assert re.search(message, capsys.readouterr().err)
    assert not (tmp_path / "out").exists() or not os.listdir(tmp_path / "out")  # nothing half-written



# Latin-1 text: "café" and "naïve" (0xe9, 0xef undecodable) around a real U+FFFD, and a CRLF
# and a lone CR line end (read as Python's text mode reads them).
LATIN1 = "line one caf\xe9\r\nsecond \ufffd na\xefve\rthird".encode("utf-8").replace(
    b"\xc3\xa9", b"\xe9").replace(b"\xc3\xaf", b"\xef")


@pytest.mark.parametrize("line_docs", [False, True], ids=["file-docs", "line-docs"])
def test_preprocess_refuses_text_that_is_not_utf8(embedded, tmp_path, capsys, line_docs):
    """Undecodable text is an error naming the file and byte offset, nothing written; with
    --encoding-errors replace it reads as before (U+FFFD, as Python's text mode with
    errors='replace' reads it), with ignore the bytes are dropped, and the summary counts them."""
    text = tmp_path / "latin1.txt"
    text.write_bytes(LATIN1)
    extra = ["--line-docs"] if line_docs else []
    with pytest.raises(SystemExit) as exit_:
        _preprocess(embedded, tmp_path, text, extra=extra)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    line = " (line 1)" if line_docs else ""
    assert err.startswith(f"mhar-preprocess: error: {text}: not UTF-8 at byte offset 12{line} (byte 0xe9: "), err
    assert "--encoding-errors replace" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists() or not os.listdir(tmp_path / "out")

    tokenizer = embedded.tokenizer()
    for errors in ("replace", "ignore"):
        with open(text, encoding="utf-8", errors=errors) as f:  # replace: how preprocessing read it before
            documents = [ln.rstrip("\n") for ln in f if ln.strip()] if line_docs else [f.read()]
        assert _preprocess(embedded, tmp_path, text, extra=[*extra, "--encoding-errors", errors, "--overwrite"]) == 0
        done = "replaced with U+FFFD" if errors == "replace" else "dropped"
        assert f", 2 undecodable byte sequences {done} (--encoding-errors {errors})\n" in capsys.readouterr().out
        dataset = _read_indexed(str(tmp_path / "out" / "p"))
        assert [list(dataset[i][:-1]) for i in range(len(dataset))] == [tokenizer.tokenize(d) for d in documents]


def test_preprocess_output_prefix_misuse(embedded, tmp_path, capsys):
    first, second = tmp_path / "a.txt", tmp_path / "b.txt"
    first.write_text("one document")
    second.write_text("another, longer document than the first one")
    out = tmp_path / "out"
    assert _preprocess(embedded, tmp_path, first) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    # an existing dataset is never replaced without --overwrite, and is left as it was
    with pytest.raises(SystemExit):
        _preprocess(embedded, tmp_path, second)
    assert f"{out / 'p'}.bin and {out / 'p'}.idx exist; pass --overwrite" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert _preprocess(embedded, tmp_path, second, extra=["--overwrite"]) == 0
    dataset = _read_indexed(str(out / "p"))  # held: its samples are views of its mmap
    assert list(dataset[0][:-1]) == embedded.tokenizer().tokenize(second.read_text())
    # a directory is not a prefix (it would write out.bin beside it); nor is a path under a file
    for prefix, message in [(f"{out}/", "is a directory"), (str(first / "p"), "is a file, not a directory")]:
        with pytest.raises(SystemExit):
            preprocess_main(["--input", str(first), "--output-prefix", prefix, "--tokenizer",
                             str(embedded.directory)])
        assert message in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.txt", "out"]


def test_tokenizer_and_builtin_misuse(embedded, tmp_path):
    spec = embedded.directory / "tokenizer.json"
    with pytest.raises(ValueError, match="is a file; give the Hugging Face tokenizer directory"):
        Tokenizer.from_dir(str(spec))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_text(spec.read_text()[:100])  # an interrupted download
    with pytest.raises(ValueError, match=r"broken/tokenizer.json is not a tokenizer .*download it again"):
        Tokenizer.from_dir(str(broken))
    (broken / "tokenizer.json").write_text(spec.read_text().replace("<|endoftext|>", "</s>"))
    (broken / "tokenizer_config.json").write_text('{"eos_token": ')
    with pytest.raises(ValueError, match=r"tokenizer_config.json is not a JSON object"):
        Tokenizer.from_dir(str(broken))
    # the BPE trainer would silently stop at 257 tokens; an empty corpus would fail as "no documents"
    with pytest.raises(ValueError, match=r"vocabulary of >= 260 tokens .* got 100; raise data.embedded_vocab_size"):
        prepare_embedded(str(tmp_path / "emb"), 100, BYTES)
    with pytest.raises(ValueError, match=r"positive byte budget, got 0; set data.embedded_max_bytes"):
        prepare_embedded(str(tmp_path / "emb"), VOCAB, 0)
    assert not (tmp_path / "emb").exists()


def _damage(kind, prefix, other):
    """Break the pair at ``prefix`` the way ``kind`` says (``other``: another valid pair)."""
    bin_, idx = prefix + ".bin", prefix + ".idx"
    if kind == "no-idx":
        os.remove(idx)
    elif kind == "empty-idx":
        open(idx, "wb").close()
    elif kind == "truncated-idx":
        data = open(idx, "rb").read()
        open(idx, "wb").write(data[:-8])
    elif kind == "truncated-bin":
        data = open(bin_, "rb").read()
        open(bin_, "wb").write(data[: len(data) // 2])
    elif kind == "foreign-idx":
        open(idx, "wb").write(open(other + ".idx", "rb").read())


@pytest.mark.parametrize(
    "kind, message",
    [
        pytest.param("no-idx", r"p.idx not found; fix the data path", id="no-idx"),
        pytest.param("bin-suffix", r"p.bin.bin and .*p.bin.idx not found; give the prefix, .*p, without .bin",
                     id="bin-suffix"),
        pytest.param("empty-idx", r"p.idx is not a Megatron index file", id="empty-idx"),
        pytest.param("truncated-idx", r"p.idx is truncated", id="truncated-idx"),
        # Megatron would read these two without a word: garbage or part of the data
        pytest.param("truncated-bin", r"p.idx describes \d+ bytes of tokens but .*p.bin holds \d+", id="truncated-bin"),
        pytest.param("foreign-idx", r"p.idx describes \d+ bytes of tokens but .*p.bin holds \d+", id="foreign-idx"),
    ],
)
def test_gpt_datasets_refuse_a_damaged_pair(embedded, tmp_path, kind, message):
    from megatron_mhar.data.datasets import build_gpt_datasets

    tokenizer = embedded.tokenizer()
    prefix = str(tmp_path / "p")
    write_indexed_dataset([f"document {i} " * (i + 1) for i in range(20)], tokenizer, prefix)
    _damage(kind, prefix, embedded.prefix)
    if kind == "bin-suffix":  # the .bin file named instead of the prefix
        prefix += ".bin"
    else:
        message += r".*with mhar-preprocess"
    with pytest.raises(ValueError, match=message):
        build_gpt_datasets([prefix], None, "90,10,0", 16, [8, 8, 0], tokenizer, seed=1)


def test_gpt_datasets_blend_weights(embedded, tmp_path):
    from megatron_mhar.data.datasets import MicroBatches, build_gpt_datasets

    tokenizer = embedded.tokenizer()
    big, small = str(tmp_path / "big"), str(tmp_path / "small")
    write_indexed_dataset([f"text {i} " * (2 * i + 5) for i in range(60)], tokenizer, big)
    write_indexed_dataset([f"document {i} " * (i + 1) for i in range(40)], tokenizer, small)
    build = lambda paths, weights, split="90,10,0": build_gpt_datasets(
        paths, weights, split, 16, [64, 16, 0], tokenizer, seed=3
    )
    # with weights, Megatron needs a size for the unused test split too (it asserted before)
    for split in ("90,10,0", "60,20,20"):
        train, valid, test = build([big, small], [1.0, 3.0], split)
        assert len(train) >= 64 and len(valid) >= 16 and test is None
    # the mixture follows the weights: 1:3 over the first 64 samples, to within one sample
    train = build([big, small], [1.0, 3.0])[0]
    drawn = [int(train[i]["dataset_id"]) for i in range(64)]
    assert abs(drawn.count(0) - 16) <= 1 and abs(drawn.count(1) - 48) <= 1, drawn
    swapped = build([big, small], [3.0, 1.0])[0]
    assert abs([int(swapped[i]["dataset_id"]) for i in range(64)].count(0) - 48) <= 1
    # a path weighted 0 is left out (Megatron's blend refuses zero weights)
    zero = build([big, small], [0.0, 2.0])[0]
    alone = build([small], [1.0])[0]
    assert len(zero) == len(alone)
    assert all(torch.equal(zero[i]["tokens"], alone[i]["tokens"]) for i in range(len(alone)))
    # a blend's samples carry a NumPy dataset_id: batches of any blend stack (they failed to)
    for weights in (None, [1.0, 3.0]):
        batch = next(MicroBatches(build([big, small], weights)[0], 4))
        assert batch["tokens"].shape == (4, 16) and batch["dataset_id"].shape == (4,)
    with pytest.raises(ValueError, match=r"data.weights=\[1.0\] for 2 data.paths: give one non-negative"):
        build([big, small], [1.0])
