"""Token ids beyond the model's vocabulary are caught anywhere in the data, naming where.

A pair written by ``write_indexed_dataset`` (``mhar-preprocess``) carries its largest id in
``PREFIX.meta.json``, which the launch checks in O(1); a ``.bin`` changed since is read
whole once at the launch (and the metadata rewritten); for a pair without metadata, the
launch reads a sample of its ids, and every sample's ids are checked as training reads them.
"""

from __future__ import annotations

import json
import os
import re
import time

import numpy
import pytest

from megatron_mhar.data.datasets import MicroBatches, build_gpt_datasets, sampled_max_token
from megatron_mhar.data.indexed_writer import read_metadata, rescan, write_indexed_dataset
from megatron_mhar.training.launch_checks import validate_launch
from tests.helpers import EMBEDDED_BYTES, EMBEDDED_VOCAB, TINY

DOCUMENT, DOCUMENTS = 1000, 700  # 700,000 tokens: more than the 2 x 2^18 ids the launch samples
BAD_DOCUMENT, BAD_OFFSET, BAD_ID = 350, 417, EMBEDDED_VOCAB + 88


def _large_pair_with_a_bad_id(prefix: str) -> None:
    """A pair written as another tool would (Megatron's builder, no metadata): ids below
    the vocabulary but one, in the middle of the file."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    rng = numpy.random.default_rng(0)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=DType.optimal_dtype(EMBEDDED_VOCAB))
    for document in range(DOCUMENTS):
        ids = rng.integers(0, EMBEDDED_VOCAB - 1, DOCUMENT).astype(numpy.uint16)
        if document == BAD_DOCUMENT:
            ids[BAD_OFFSET] = BAD_ID
        builder.add_document(ids, [DOCUMENT])
    builder.finalize(prefix + ".idx")


def _launch_config(tmp_path, embedded_dir, prefix, *extra):
    from megatron_mhar.training.recipes import load_config

    return load_config("smoke_cpu", [*TINY, f"data.embedded_dir={embedded_dir}", f"data.paths=[{prefix}]",
                                     f"run.output_dir={tmp_path}", *extra])


def test_a_bad_id_in_the_middle_is_named_as_it_is_read(tmp_path, embedded_dir, single_process):
    prefix = str(tmp_path / "large")
    _large_pair_with_a_bad_id(prefix)
    assert read_metadata(prefix) == (None, None)
    assert sampled_max_token(prefix) < EMBEDDED_VOCAB  # the launch's sample misses it ...
    validate_launch(_launch_config(tmp_path, embedded_dir, prefix), 1)

    from megatron_mhar.data.corpus import prepare_embedded

    tokenizer = prepare_embedded(str(embedded_dir), EMBEDDED_VOCAB, EMBEDDED_BYTES).tokenizer()
    train, _, _ = build_gpt_datasets([prefix], None, "100,1,0", 64, [DOCUMENTS * DOCUMENT // 64, 1, 0],
                                     tokenizer, seed=1)
    batches = MicroBatches(train, 4, vocab_size=EMBEDDED_VOCAB)
    with pytest.raises(ValueError) as err:  # ... every sample's ids do not
        for _ in batches:
            pass
    in_file = BAD_DOCUMENT * DOCUMENT + BAD_OFFSET
    assert str(err.value) == (
        f"token id beyond model.vocab_size={EMBEDDED_VOCAB} in {prefix}.bin, document {BAD_DOCUMENT}, token "
        f"{BAD_OFFSET} of the document (token {in_file} of the file): id {BAD_ID}: the data was written with "
        f"another tokenizer or is damaged; rewrite it with mhar-preprocess --tokenizer <data.tokenizer>, or "
        f"remove it from data.paths"
    )
    unchecked = MicroBatches(train, 4)  # what a read without the check would have trained on
    assert any(int(batch["tokens"].max()) == BAD_ID or int(batch["labels"].max()) == BAD_ID for batch in unchecked)


def _written(tmp_path, embedded_dir, name="text"):
    from megatron_mhar.data.corpus import prepare_embedded

    tokenizer = prepare_embedded(str(embedded_dir), EMBEDDED_VOCAB, EMBEDDED_BYTES).tokenizer()
    prefix = str(tmp_path / name)
    stats = write_indexed_dataset([f"document {i} " * (i + 1) for i in range(50)], tokenizer, prefix)
    return prefix, stats


def _no_reading(*args, **kwargs):
    raise AssertionError("the launch read the .bin although the metadata describes it")


def test_metadata_checks_the_largest_id_at_launch_in_constant_time(tmp_path, embedded_dir, single_process,
                                                                    monkeypatch):
    from megatron_mhar.data import datasets, indexed_writer

    prefix, stats = _written(tmp_path, embedded_dir)
    metadata, stale = read_metadata(prefix)
    assert stale is None
    assert metadata["max_token_id"] == stats["max_token_id"] == int(numpy.memmap(prefix + ".bin", numpy.uint16).max())
    assert metadata["vocab_size"] == EMBEDDED_VOCAB

    monkeypatch.setattr(datasets, "sampled_max_token", _no_reading)
    monkeypatch.setattr(indexed_writer, "rescan", _no_reading)
    small = metadata["max_token_id"]  # a model one id short of the data
    cfg = _launch_config(tmp_path, embedded_dir, prefix, f"model.vocab_size={small}",
                         f"data.embedded_vocab_size={small}")
    with pytest.raises(ValueError, match=rf"holds token id {small}, beyond model.vocab_size={small} \(the model.s embedding rows\): it was written "
                                         rf"with a tokenizer of {EMBEDDED_VOCAB} tokens, not data.tokenizer \(builtin, {small} tokens\)"):
        validate_launch(cfg, 1)
    validate_launch(_launch_config(tmp_path, embedded_dir, prefix), 1)  # the right model passes


@pytest.mark.parametrize("change, reason", [
    ("append", "the .bin holds {size} bytes, the metadata says {old}"),  # a longer (regenerated) .bin
    ("documents", "the .idx holds 50 documents, the metadata 49"),  # metadata of another write
    ("v1", "the metadata was written before it recorded the .bin's checksum"),  # an older version's metadata
])  # fmt: skip
def test_metadata_that_does_not_describe_the_pair_is_rescanned(tmp_path, embedded_dir, change, reason, capsys):
    prefix, _ = _written(tmp_path, embedded_dir)
    metadata, _ = read_metadata(prefix)
    meta = tmp_path / "text.meta.json"
    if change == "append":
        with open(prefix + ".bin", "ab") as f:
            f.write(b"\0\0")
    elif change == "documents":
        meta.write_text(json.dumps({**metadata, "documents": 49}))
    else:
        meta.write_text(json.dumps({k: v for k, v in metadata.items() if not k.startswith("bin_")
                                    } | {"format": "megatron_mhar.indexed.v1", "bin_bytes": metadata["bin_bytes"]}))
    old, stale = read_metadata(prefix)
    size = os.path.getsize(prefix + ".bin")
    assert stale == reason.format(size=size, old=metadata["bin_bytes"])
    rescan(prefix, old, stale)
    out = capsys.readouterr().out
    assert out.startswith(f"{prefix}.bin: {stale}; reading all ")
    assert f"largest token id {metadata['max_token_id']}; rewrote {meta}" in out
    assert read_metadata(prefix)[1] is None and read_metadata(prefix)[0]["bin_bytes"] == size


def test_a_bin_changed_after_preprocessing_is_read_whole_at_launch(tmp_path, embedded_dir, single_process,
                                                                    capsys, monkeypatch):
    """The probe: ids beyond the vocabulary written into a .bin after its metadata (same
    size, an edit in place). The launch reads every id once, with progress, refuses naming
    the id, and records what it found; a .bin only touched reads once and passes."""
    from megatron_mhar.data import indexed_writer

    prefix, stats = _written(tmp_path, embedded_dir)
    ids = numpy.memmap(prefix + ".bin", numpy.uint16, mode="r+")
    ids[len(ids) // 2] = BAD_ID  # in the middle: a launch's sample of the first and last ids misses it
    ids.flush()
    del ids
    os.utime(prefix + ".bin", ns=(time.time_ns(), time.time_ns() + 10**9))  # a coarse clock still sees it
    with pytest.raises(ValueError, match=rf"holds token id {BAD_ID}, beyond model.vocab_size={EMBEDDED_VOCAB} \(the model.s embedding rows\): its .bin "
                                         r"changed after preprocessing \(edited or regenerated\)"):
        validate_launch(_launch_config(tmp_path, embedded_dir, prefix), 1)
    out = capsys.readouterr().out
    assert re.search(rf"{prefix}.bin: the .bin was modified at .*, after its metadata was written; reading all", out)
    assert f"its bytes changed; largest token id {BAD_ID}; rewrote {prefix}.meta.json" in out
    assert read_metadata(prefix)[0]["max_token_id"] == BAD_ID  # recorded: the next launch refuses in O(1)

    clean, _ = _written(tmp_path, embedded_dir, "clean")
    os.utime(clean + ".bin", ns=(time.time_ns(), time.time_ns() + 10**9))  # copied without -p, touched
    validate_launch(_launch_config(tmp_path, embedded_dir, clean), 1)
    assert "its bytes are unchanged; largest token id" in capsys.readouterr().out
    monkeypatch.setattr(indexed_writer, "rescan", _no_reading)
    validate_launch(_launch_config(tmp_path, embedded_dir, clean), 1)  # rewritten: O(1) again
