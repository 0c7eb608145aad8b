"""Write Megatron indexed datasets (``PREFIX.bin`` + ``PREFIX.idx``) from documents.

The one writer of token data: the preprocessing command (:mod:`megatron_mhar.data.preprocess`)
and the embedded corpus (:mod:`megatron_mhar.data.corpus`) both call
:func:`write_indexed_dataset`. The pair is written under a temporary name and renamed into
place once complete, so an interrupted write never leaves a truncated dataset behind.
"""

from __future__ import annotations

import os
from typing import Iterable, Iterator, List

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


def write_indexed_dataset(documents: Iterable[str], tokenizer: Tokenizer, output_prefix: str) -> dict:
    """Tokenize ``documents`` (each followed by EOD) into ``output_prefix.{bin,idx}``.

    Returns ``{"documents": n, "tokens": n}``. Empty documents are skipped.
    """
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    prefix = os.path.abspath(output_prefix)
    os.makedirs(os.path.dirname(prefix), exist_ok=True)
    tmp_prefix = f"{prefix}.tmp{os.getpid()}"
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    builder = IndexedDatasetBuilder(tmp_prefix + ".bin", dtype=dtype)
    n_docs = n_tokens = 0
    try:
        for batch in _batched(documents, _BATCH_DOCS):
            for ids in tokenizer.tokenize_batch(batch):
                if not ids:
                    continue
                ids.append(tokenizer.eod)
                builder.add_document(numpy.asarray(ids, dtype=dtype), [len(ids)])
                n_docs += 1
                n_tokens += len(ids)
        builder.finalize(tmp_prefix + ".idx")
        if n_docs == 0:
            raise ValueError("no non-empty documents in the input")
        os.replace(tmp_prefix + ".bin", prefix + ".bin")
        os.replace(tmp_prefix + ".idx", prefix + ".idx")
    finally:
        for ext in (".bin", ".idx"):
            if os.path.exists(tmp_prefix + ext):
                os.remove(tmp_prefix + ext)
    return {"documents": n_docs, "tokens": n_tokens}
