"""Tokenize text into Megatron indexed datasets (``PREFIX.bin`` + ``PREFIX.idx``).

    python -m megatron_mhar.data.preprocess --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer /path/to/qwen3_tokenizer [--json-key text] [--workers 8]

Inputs: ``.jsonl`` files (one JSON object per line, the document under
``--json-key``) or plain text files (one document per file, or per line with
``--line-docs``). Every document is followed by the end-of-document token, so
GPTDataset can pack documents into sequences. ``--tokenizer builtin`` uses the
tokenizer of the embedded corpus (``--embedded-dir``, built on first use).

The output is written next to its final name and renamed into place once
complete, so an interrupted run never leaves a truncated dataset behind.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Iterable, Iterator, List, Sequence

import numpy

from megatron_mhar.data.tokenizer import Tokenizer

_BATCH_DOCS = 256


def iter_documents(paths: Sequence[str], json_key: str = "text", line_docs: bool = False) -> Iterator[str]:
    """Documents of ``.jsonl`` files (one per line) and text files (one per file or line)."""
    for path in paths:
        if path.endswith(".jsonl") or path.endswith(".json"):
            with open(path, encoding="utf-8") as f:
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as err:
                        raise ValueError(f"{path}:{lineno}: not a JSON line ({err})") from None
                    if json_key not in record:
                        raise ValueError(
                            f"{path}:{lineno}: no key {json_key!r} (keys: {sorted(record)}); "
                            f"pass --json-key"
                        )
                    yield record[json_key]
        else:
            with open(path, encoding="utf-8", errors="replace") as f:
                if line_docs:
                    yield from (line.rstrip("\n") for line in f if line.strip())
                else:
                    yield f.read()


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


def load_tokenizer(spec: str, eod_token: str | None = None, embedded_dir: str | None = None,
                   vocab_size: int = 4096, max_bytes: int | None = None) -> Tokenizer:
    """``builtin`` (the embedded corpus' tokenizer, built if missing) or a tokenizer dir.

    The builtin tokenizer is identified by ``embedded_dir``, ``vocab_size`` and
    ``max_bytes``, the ``data.embedded_*`` settings of a recipe.
    """
    if spec == "builtin":
        from megatron_mhar.data.corpus import prepare_embedded

        return prepare_embedded(embedded_dir, vocab_size, max_bytes).tokenizer()
    return Tokenizer.from_dir(os.path.expanduser(spec), eod_token)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_mhar.data.preprocess",
        description="Tokenize jsonl or text files into a Megatron .bin/.idx dataset.",
    )
    parser.add_argument("--input", nargs="+", required=True, help=".jsonl or text files")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    parser.add_argument("--tokenizer", required=True,
                        help="local Hugging Face tokenizer directory, or 'builtin'")
    parser.add_argument("--json-key", default="text", help="document key of jsonl lines")
    parser.add_argument("--line-docs", action="store_true",
                        help="text files: one document per line (default: per file)")
    parser.add_argument("--eod-token", default=None, help="end-of-document token to append")
    parser.add_argument("--embedded-dir", default="~/.cache/megatron_mhar/embedded",
                        help="with --tokenizer builtin: where the builtin tokenizer lives")
    parser.add_argument("--vocab-size", type=int, default=4096,
                        help="with --tokenizer builtin: its vocabulary size (data.embedded_vocab_size)")
    parser.add_argument("--embedded-max-bytes", type=int, default=None,
                        help="with --tokenizer builtin: corpus bytes it was trained on "
                             "(data.embedded_max_bytes)")
    args = parser.parse_args(argv)

    missing = [p for p in args.input if not os.path.isfile(p)]
    if missing:
        parser.error(f"input not found: {', '.join(missing)}")
    tokenizer = load_tokenizer(
        args.tokenizer, args.eod_token, args.embedded_dir, args.vocab_size, args.embedded_max_bytes
    )
    docs = iter_documents(args.input, args.json_key, args.line_docs)
    stats = write_indexed_dataset(docs, tokenizer, args.output_prefix)
    print(
        f"wrote {args.output_prefix}.bin/.idx: {stats['documents']} documents, "
        f"{stats['tokens']} tokens (vocab {tokenizer.vocab_size}, eod {tokenizer.eod_token!r})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
