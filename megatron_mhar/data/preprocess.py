"""Tokenize text into Megatron indexed datasets (``PREFIX.bin`` + ``PREFIX.idx``).

    mhar-preprocess --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer /path/to/qwen3_tokenizer [--json-key text] [--overwrite]

(``python -m megatron_mhar.data.preprocess`` is the same command.)

Inputs: ``.jsonl`` files (one JSON object per line, the document under
``--json-key``) or plain text files (one document per file, or per line with
``--line-docs``). Every document is followed by the end-of-document token, so
GPTDataset can pack documents into sequences. ``--tokenizer builtin`` uses the
tokenizer of the embedded corpus (``--embedded-dir``, built on first use).

The output is written next to its final name and renamed into place once
complete, so an interrupted run never leaves a truncated dataset behind; an
existing ``PREFIX.bin``/``PREFIX.idx`` is replaced only with ``--overwrite``.
``PREFIX.meta.json`` records the tokenizer's vocabulary size and the largest token id,
which the training launch checks against the model in O(1).

Input is UTF-8: a file that is not is refused, naming the file and byte offset of the
first undecodable byte; ``--encoding-errors replace`` (U+FFFD for each undecodable
sequence) or ``ignore`` (dropped) reads it anyway and counts them in the summary line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Iterator, Sequence

from megatron_mhar.data.corpus import prepare_embedded
from megatron_mhar.data.indexed_writer import write_indexed_dataset
from megatron_mhar.data.tokenizer import Tokenizer
from megatron_mhar.errors import command_errors
from megatron_mhar.files import nearest_existing


ENCODING_ERRORS = ("strict", "replace", "ignore")
"""``--encoding-errors``: refuse undecodable bytes, or replace each undecodable sequence
with U+FFFD, or drop it (both counted)."""


class Decoder:
    """UTF-8 decoding of input files under one ``--encoding-errors`` policy; ``count`` is
    the number of undecodable byte sequences replaced or dropped so far."""

    def __init__(self, errors: str = "strict"):
        if errors not in ENCODING_ERRORS:
            raise ValueError(f"--encoding-errors {errors!r}: use one of {', '.join(ENCODING_ERRORS)}")
        self.errors = errors
        self.count = 0

    def decode(self, raw: bytes, path: str, offset: int, where: str = "") -> str:
        """``raw``, the bytes at ``offset`` of ``path`` (``where``: e.g. its line), as text."""
        view, parts, start = memoryview(raw), [], 0
        while True:
            try:
                parts.append(str(view[start:], "utf-8"))
                return "".join(parts)
            except UnicodeDecodeError as err:
                if self.errors == "strict":
                    bad = view[start + err.start]
                    raise ValueError(
                        f"{path}: not UTF-8 at byte offset {offset + start + err.start}{where} (byte {bad:#04x}: "
                        f"{err.reason}); re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8), or pass "
                        f"--encoding-errors replace (each undecodable sequence becomes U+FFFD) or ignore "
                        f"(dropped); both count them"
                    ) from None
                parts.append(str(view[start:start + err.start], "utf-8"))
                parts.append("\ufffd" if self.errors == "replace" else "")
                self.count += 1
                start += err.end


def _text_lines(path: str, decoder: Decoder) -> Iterator[str]:
    """The lines of a text file, as Python's text mode splits them (``\\n``, ``\\r\\n``, ``\\r``)."""
    offset = 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            text = decoder.decode(raw, path, offset, f" (line {number})").replace("\r\n", "\n")
            offset += len(raw)
            yield from text.split("\r")


def iter_documents(paths: Sequence[str], json_key: str = "text", line_docs: bool = False,
                   decoder: Decoder | None = None) -> Iterator[str]:
    """Documents of ``.jsonl`` files (one per line) and text files (one per file or line),
    decoded by ``decoder`` (default: strict UTF-8)."""
    decoder = decoder or Decoder()
    for path in paths:
        if path.endswith(".jsonl") or path.endswith(".json"):
            offset = 0
            with open(path, "rb") as f:  # decoded per line, so an error can name its line
                for lineno, raw in enumerate(f, 1):
                    line = decoder.decode(raw, path, offset, f" (line {lineno})")
                    offset += len(raw)
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as err:
                        raise ValueError(f"{path}:{lineno}: not a JSON line ({err})") from None
                    if not isinstance(record, dict):
                        raise ValueError(
                            f"{path}:{lineno}: a JSON {_json_type(record)}, not an object; "
                            f"every line must be an object with the document under --json-key"
                        )
                    if json_key not in record:
                        raise ValueError(
                            f"{path}:{lineno}: no key {json_key!r} (keys: {sorted(record)}); "
                            f"pass --json-key"
                        )
                    text = record[json_key]
                    if not isinstance(text, str):
                        raise ValueError(
                            f"{path}:{lineno}: {json_key!r} holds a JSON {_json_type(text)}, not "
                            f"a string; pass the --json-key of the document text or drop the line"
                        )
                    yield text
        elif line_docs:
            yield from (line.rstrip("\n") for line in _text_lines(path, decoder) if line.strip())
        else:
            with open(path, "rb") as f:
                text = decoder.decode(f.read(), path, 0)
            yield text.replace("\r\n", "\n").replace("\r", "\n")  # as text mode reads it


def _json_type(value) -> str:
    """The JSON name of a decoded value's type (for error messages)."""
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def _output_problem(output_prefix: str, overwrite: bool) -> str | None:
    """Why ``output_prefix`` cannot be written (checked before any work), or ``None``."""
    prefix = os.path.abspath(output_prefix)
    if output_prefix.endswith(("/", os.sep)) or os.path.isdir(prefix):
        return (
            f"--output-prefix {output_prefix} is a directory; give a prefix inside it, e.g. "
            f"{os.path.join(output_prefix, 'corpus_text_document')} (writes .bin and .idx)"
        )
    parent = nearest_existing(os.path.dirname(prefix))
    if not parent.is_dir():
        return f"--output-prefix {output_prefix}: {parent} is a file, not a directory"
    existing = [prefix + ext for ext in (".bin", ".idx") if os.path.exists(prefix + ext)]
    if existing and not overwrite:
        return (
            f"--output-prefix {output_prefix}: {' and '.join(existing)} "
            f"{'exists' if len(existing) == 1 else 'exist'}; pass --overwrite to replace, or "
            f"choose another prefix"
        )
    return None


def load_tokenizer(spec: str, eod_token: str | None = None, embedded_dir: str | None = None,
                   vocab_size: int = 4096, max_bytes: int | None = None) -> Tokenizer:
    """``builtin`` (the embedded corpus' tokenizer, built if missing) or a tokenizer dir.

    The builtin tokenizer is identified by ``embedded_dir``, ``vocab_size`` and
    ``max_bytes``, the ``data.embedded_*`` settings of a recipe.
    """
    if spec == "builtin":
        return prepare_embedded(embedded_dir, vocab_size, max_bytes).tokenizer()
    return Tokenizer.from_dir(os.path.expanduser(spec), eod_token)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="mhar-preprocess",
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
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing PREFIX.bin/PREFIX.idx (default: refuse)")
    parser.add_argument("--embedded-dir", default=None,
                        help="with --tokenizer builtin: where the builtin tokenizer lives "
                             "(data.embedded_dir; default $XDG_CACHE_HOME/megatron_mhar/embedded, "
                             "~/.cache/megatron_mhar/embedded)")
    parser.add_argument("--vocab-size", type=int, default=4096,
                        help="with --tokenizer builtin: its vocabulary size (data.embedded_vocab_size)")
    parser.add_argument("--embedded-max-bytes", type=int, default=None,
                        help="with --tokenizer builtin: corpus bytes it was trained on "
                             "(data.embedded_max_bytes)")
    parser.add_argument("--encoding-errors", choices=ENCODING_ERRORS, default="strict",
                        help="undecodable (non-UTF-8) input: refuse, naming the file and byte offset (strict, "
                             "the default), or replace each undecodable sequence with U+FFFD, or drop it "
                             "(both counted in the summary)")
    args = parser.parse_args(argv)

    missing = [p for p in args.input if not os.path.isfile(p)]
    if missing:
        parser.error(f"input not found: {', '.join(missing)}")
    problem = _output_problem(args.output_prefix, args.overwrite)
    if problem:
        parser.error(problem)
    with command_errors(parser.prog):  # a bad line or tokenizer file names itself; nothing is left written
        tokenizer = load_tokenizer(
            args.tokenizer, args.eod_token, args.embedded_dir, args.vocab_size, args.embedded_max_bytes
        )
        decoder = Decoder(args.encoding_errors)
        docs = iter_documents(args.input, args.json_key, args.line_docs, decoder)
        stats = write_indexed_dataset(docs, tokenizer, args.output_prefix)
    undecodable = ""
    if args.encoding_errors != "strict":
        done = "replaced with U+FFFD" if args.encoding_errors == "replace" else "dropped"
        undecodable = f", {decoder.count} undecodable byte sequences {done} (--encoding-errors {args.encoding_errors})"
    print(
        f"wrote {args.output_prefix}.bin/.idx/.meta.json: {stats['documents']} documents, "
        f"{stats['tokens']} tokens, largest id {stats['max_token_id']} (vocab {tokenizer.vocab_size}, "
        f"eod {tokenizer.eod_token!r}){undecodable}"
    )
    return 0

if __name__ == "__main__":
    sys.exit(main())
