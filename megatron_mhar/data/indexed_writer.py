"""Write Megatron indexed datasets (``PREFIX.bin`` + ``PREFIX.idx``) from documents.

The one writer of token data: the preprocessing command (:mod:`megatron_mhar.data.preprocess`)
and the embedded corpus (:mod:`megatron_mhar.data.corpus`) both call
:func:`write_indexed_dataset`. The pair is written under a temporary name and renamed into
place once complete, so an interrupted write never leaves a truncated dataset behind.

Beside the pair goes ``PREFIX.meta.json`` (:data:`METADATA_SUFFIX`): the tokenizer's
vocabulary size, the largest token id written, and the counts and ``.bin`` size that tie
it to this pair, so that a launch checks the ids against the model in O(1)
(:func:`read_metadata`). It is renamed into place last, after any older one is removed:
a pair never sits beside another pair's metadata.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Iterable, Iterator, List, Optional

import numpy

from megatron_mhar.data.tokenizer import Tokenizer

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
METADATA_FORMAT = "megatron_mhar.indexed.v1"


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
            "bin_bytes": os.path.getsize(tmp_prefix + ".bin"),
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


def read_metadata(prefix: str) -> Optional[dict]:
    """``PREFIX.meta.json`` when it describes the pair beside it (its document count and
    ``.bin`` size match), else ``None``: a pair written before metadata existed, or by
    another writer."""
    path = prefix + METADATA_SUFFIX
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            metadata = json.load(f)
    except (OSError, ValueError) as err:
        warnings.warn(f"{path} cannot be read ({err}); the token ids of {prefix} are checked as they are read")
        return None
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    if not isinstance(metadata, dict) or metadata.get("format") != METADATA_FORMAT:
        return None
    documents = len(IndexedDataset(prefix).document_indices) - 1
    if metadata.get("bin_bytes") != os.path.getsize(prefix + ".bin") or metadata.get("documents") != documents:
        return None
    return metadata
