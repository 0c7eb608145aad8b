"""Write Megatron indexed datasets (``PREFIX.bin`` + ``PREFIX.idx``) from documents.

The one writer of token data: the preprocessing command (:mod:`megatron_mhar.data.preprocess`)
and the embedded corpus (:mod:`megatron_mhar.data.corpus`) both call
:func:`write_indexed_dataset`. The pair is written under a temporary name and renamed into
place once complete, so an interrupted write never leaves a truncated dataset behind.

Beside the pair goes ``PREFIX.meta.json`` (:data:`METADATA_SUFFIX`): the tokenizer's
vocabulary size, the largest token id written, the counts, and the ``.bin``'s size, time
stamp and checksum (XXH3-64, :func:`megatron_mhar.checkpoint.manifest.new_digest`), so that a launch
checks the ids against the model in O(1) (:func:`read_metadata`). It is renamed into place
last, after any older one is removed: a pair never sits beside another pair's metadata.
A ``.bin`` changed since (edited, regenerated, copied) no longer matches its size or time
stamp; :func:`rescan` then reads every id once, with progress, and rewrites the metadata.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from typing import Callable, Iterable, Iterator, List, Optional, Tuple

import numpy

from megatron_mhar.data.tokenizer import Tokenizer
from megatron_mhar.checkpoint.manifest import new_digest, read_pieces

_BATCH_DOCS = 256


def _batched(items: Iterable[str], size: int) -> Iterator[List[str]]:
    batch: List[str] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


METADATA_SUFFIX = ".meta.json"
METADATA_FORMAT = "megatron_mhar.indexed.v2"
"""v2 adds the ``.bin``'s time stamp and checksum; v1 metadata is rescanned once."""


def write_indexed_dataset(documents: Iterable[str], tokenizer: Tokenizer, output_prefix: str) -> dict:
    """Tokenize ``documents`` (each followed by EOD) into ``output_prefix.{bin,idx}`` and
    its ``.meta.json``.

    Returns ``{"documents": n, "tokens": n, "max_token_id": id}``. Empty documents are skipped.
    """
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    prefix = os.path.abspath(output_prefix)
    os.makedirs(os.path.dirname(prefix), exist_ok=True)
    tmp_prefix = f"{prefix}.tmp{os.getpid()}"
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    builder = IndexedDatasetBuilder(tmp_prefix + ".bin", dtype=dtype)
    # The .bin is the documents' ids back to back (Megatron's format): hashed as written.
    digest = new_digest()
    n_docs = n_tokens = 0
    largest = -1
    try:
        for batch in _batched(documents, _BATCH_DOCS):
            for ids in tokenizer.tokenize_batch(batch):
                if not ids:
                    continue
                ids.append(tokenizer.eod)
                array = numpy.asarray(ids, dtype=dtype)
                builder.add_document(array, [len(ids)])
                digest.update(array.tobytes())
                largest = max(largest, int(array.max()))
                n_docs += 1
                n_tokens += len(ids)
        builder.finalize(tmp_prefix + ".idx")
        if n_docs == 0:
            raise ValueError("no non-empty documents in the input")
        metadata = {
            "format": METADATA_FORMAT,
            "vocab_size": tokenizer.vocab_size,
            "max_token_id": largest,
            "documents": n_docs,
            "tokens": n_tokens,
            **_bin_identity(tmp_prefix + ".bin"),
            "bin_xxh3_64": digest.hexdigest(),
        }
        with open(tmp_prefix + METADATA_SUFFIX, "w") as f:
            json.dump(metadata, f, indent=1)
        if os.path.exists(prefix + METADATA_SUFFIX):
            os.remove(prefix + METADATA_SUFFIX)
        os.replace(tmp_prefix + ".bin", prefix + ".bin")
        os.replace(tmp_prefix + ".idx", prefix + ".idx")
        os.replace(tmp_prefix + METADATA_SUFFIX, prefix + METADATA_SUFFIX)
    finally:
        for ext in (".bin", ".idx", METADATA_SUFFIX):
            if os.path.exists(tmp_prefix + ext):
                os.remove(tmp_prefix + ext)
    return {"documents": n_docs, "tokens": n_tokens, "max_token_id": largest}


def _bin_identity(path: str) -> dict:
    """The size and time stamp of a ``.bin``: what a change to it changes (a rename keeps both)."""
    stat = os.stat(path)
    return {"bin_bytes": stat.st_size, "bin_mtime_ns": stat.st_mtime_ns}


def read_metadata(prefix: str) -> Tuple[Optional[dict], Optional[str]]:
    """``(PREFIX.meta.json, why it no longer describes the .bin beside it)``: the second is
    ``None`` while it does (format, document count, the .bin's size and time stamp), and
    the first ``None`` where the pair has no metadata (written before metadata existed, or
    by another writer)."""
    path = prefix + METADATA_SUFFIX
    if not os.path.isfile(path):
        return None, None
    try:
        with open(path) as f:
            metadata = json.load(f)
    except (OSError, ValueError) as err:
        warnings.warn(f"{path} cannot be read ({err}); the token ids of {prefix} are checked as they are read")
        return None, None
    if not isinstance(metadata, dict) or not str(metadata.get("format", "")).startswith("megatron_mhar.indexed."):
        return None, None
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    documents = len(IndexedDataset(prefix).document_indices) - 1
    now = _bin_identity(prefix + ".bin")
    if metadata.get("format") != METADATA_FORMAT:
        return metadata, "the metadata was written before it recorded the .bin's checksum"
    if metadata.get("documents") != documents:
        return metadata, f"the .idx holds {documents} documents, the metadata {metadata.get('documents')}"
    if metadata.get("bin_bytes") != now["bin_bytes"]:
        return metadata, f"the .bin holds {now['bin_bytes']} bytes, the metadata says {metadata.get('bin_bytes')}"
    if metadata.get("bin_mtime_ns") != now["bin_mtime_ns"]:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now["bin_mtime_ns"] / 1e9))
        return metadata, f"the .bin was modified at {when}, after its metadata was written"
    return metadata, None


def rescan(prefix: str, previous: dict, reason: str, say: Callable[[str], None] = print) -> dict:
    """Read every id of ``PREFIX.bin`` once (its largest id and checksum, with progress
    lines through ``say``) and rewrite ``PREFIX.meta.json`` from it; returns the new
    metadata. ``previous``: the metadata that no longer describes the pair, ``reason`` why."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    index = IndexedDataset(prefix).index
    path = prefix + ".bin"
    identity = _bin_identity(path)
    size = identity["bin_bytes"]
    say(f"{path}: {reason}; reading all {size / 2**20:,.1f} MiB of its token ids once")
    digest, largest, done = new_digest(), -1, 0
    shown = started = time.monotonic()
    for piece in read_pieces(path):  # whole ids: the pieces' size is a multiple of any id's
        digest.update(piece)
        largest = max(largest, int(numpy.frombuffer(piece, index.dtype).max()))
        done += len(piece)
        if time.monotonic() - shown >= 10:
            shown = time.monotonic()
            say(f"  {done / size:.0%} of {path} ({done / 2**20 / (shown - started):,.0f} MiB/s)")
    checksum = digest.hexdigest()
    unchanged = checksum == previous.get("bin_xxh3_64") and previous.get("max_token_id") == largest
    metadata = {
        "format": METADATA_FORMAT,
        "vocab_size": previous.get("vocab_size"),
        "max_token_id": largest,
        "documents": len(index.document_indices) - 1,
        "tokens": size // index.dtype_size,
        **identity,
        "bin_xxh3_64": checksum,
    }
    from megatron_mhar.files import write_atomic

    try:
        write_atomic(prefix + METADATA_SUFFIX, json.dumps(metadata, indent=1))
        kept = f"rewrote {prefix + METADATA_SUFFIX}"
    except OSError as err:
        kept = f"could not rewrite {prefix + METADATA_SUFFIX} ({err.strerror}), so the next start reads it again"
    what = "its bytes are unchanged" if unchanged else "its bytes changed"
    say(f"{path}: {what}; largest token id {largest}; {kept}")
    return metadata
