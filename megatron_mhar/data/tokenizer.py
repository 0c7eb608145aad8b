"""Tokenizers: a local Hugging Face ``tokenizer.json`` or the builtin byte-level BPE.

Both are read with the ``tokenizers`` package (no ``transformers``, no download).
:class:`Tokenizer` offers what Megatron's GPTDataset reads from a tokenizer
(``vocab_size``, ``eod``) plus ``tokenize``/``detokenize``.

The builtin tokenizer is a byte-level BPE (GPT-2 style pre-tokenizer, no unknown
tokens) trained on the embedded corpus by :func:`train_builtin_tokenizer`; its only
special token is ``<|endoftext|>``, the end-of-document token.

:meth:`Tokenizer.save` writes a Hugging Face tokenizer directory (``tokenizer.json``,
``tokenizer_config.json``): the training driver saves the run's tokenizer into every
checkpoint (``iter_*/tokenizer/``), so a trained model maps text to text on its own
(:func:`megatron_mhar.load_model`) and ``transformers.AutoTokenizer`` reads it.

For the published recipes, download the Qwen3 tokenizer once (e.g. the
``tokenizer.json`` and ``tokenizer_config.json`` of ``Qwen/Qwen3-0.6B-Base``) into a
directory and point ``data.tokenizer`` at it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Iterable, List, Optional

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

EOD_TOKEN = "<|endoftext|>"
"""End-of-document token of the builtin tokenizer (and of Qwen/GPT-2 tokenizers)."""

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
HF_TOKENIZER_FILES = (
    TOKENIZER_FILE, TOKENIZER_CONFIG_FILE, "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "chat_template.jinja",
)
"""Files of a Hugging Face tokenizer directory that :meth:`Tokenizer.save` copies."""


class Tokenizer:
    """A ``tokenizers.Tokenizer`` with the end-of-document id Megatron needs."""

    def __init__(self, tokenizer: HFTokenizer, eod_token: str, path: str = ""):
        eod = tokenizer.token_to_id(eod_token)
        if eod is None:
            raise ValueError(
                f"tokenizer {path or ''} has no token {eod_token!r}; set data.eod_token (preprocess: "
                f"--eod-token) to its end-of-document token"
            )
        self._tokenizer = tokenizer
        self.path = path
        self.eod_token = eod_token
        self.eod = eod
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_dir(cls, directory: str, eod_token: Optional[str] = None) -> "Tokenizer":
        """Load ``directory/tokenizer.json``.

        The end-of-document token is ``eod_token``, else ``<|endoftext|>`` when the
        vocabulary has it (Qwen, GPT-2), else ``eos_token`` of ``tokenizer_config.json``.
        """
        if os.path.isfile(directory):
            raise ValueError(
                f"{directory} is a file; give the Hugging Face tokenizer directory that holds "
                f"tokenizer.json"
            )
        path = os.path.join(directory, TOKENIZER_FILE)
        if not os.path.isfile(path):
            raise ValueError(f"no tokenizer.json in {directory}; give a Hugging Face tokenizer dir")
        try:
            tokenizer = HFTokenizer.from_file(path)
        except Exception as err:  # the Rust library raises a bare Exception
            raise ValueError(
                f"{path} is not a tokenizer the tokenizers library can read ({err}); download it "
                f"again (one written by a newer release needs pip install -U tokenizers)"
            ) from None
        if eod_token is None:
            eod_token = EOD_TOKEN if tokenizer.token_to_id(EOD_TOKEN) is not None else None
        if eod_token is None:
            eod_token = _configured_eos(directory)
        if eod_token is None:
            raise ValueError(
                f"cannot tell the end-of-document token of {directory}; set data.eod_token "
                f"(preprocess: --eod-token)"
            )
        return cls(tokenizer, eod_token, path=directory)

    @property
    def unique_identifiers(self) -> dict:
        """What GPTDataset hashes into its index-cache names."""
        return {
            "class": type(self).__name__,
            "tokenizer_path": self.path,
            "vocab_size": self.vocab_size,
            "eod": self.eod,
        }

    def save(self, directory: Path) -> None:
        """Write a Hugging Face tokenizer directory that :meth:`from_dir` and
        ``transformers.AutoTokenizer`` read back.

        A tokenizer read from a directory has its Hugging Face files copied as they are
        (a Qwen3 download keeps its chat template); one that has no ``tokenizer_config.json``
        (the builtin) gets one naming ``PreTrainedTokenizerFast`` and its end-of-document
        token as ``eos_token``.
        """
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        source = Path(self.path) if self.path and os.path.isdir(self.path) else None
        copied = []
        for name in HF_TOKENIZER_FILES if source is not None else ():
            if (source / name).is_file():
                shutil.copyfile(source / name, directory / name)
                copied.append(name)
        if TOKENIZER_FILE not in copied:
            self._tokenizer.save(str(directory / TOKENIZER_FILE))
        if TOKENIZER_CONFIG_FILE not in copied:
            config = {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": self.eod_token,
                "clean_up_tokenization_spaces": False,
            }
            (directory / TOKENIZER_CONFIG_FILE).write_text(json.dumps(config, indent=1) + "\n")

    def tokenize(self, text: str) -> List[int]:
        """Token ids of ``text`` (no special tokens added)."""
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def tokenize_batch(self, texts: List[str]) -> List[List[int]]:
        """Token ids of several texts, encoded in parallel by the Rust library."""
        return [e.ids for e in self._tokenizer.encode_batch(texts, add_special_tokens=False)]

    def detokenize(self, ids: Iterable[int]) -> str:
        """Text of token ids."""
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)


def _configured_eos(directory: str) -> Optional[str]:
    config = os.path.join(directory, TOKENIZER_CONFIG_FILE)
    if not os.path.isfile(config):
        return None
    with open(config, encoding="utf-8") as f:
        try:
            eos = json.load(f).get("eos_token")
        except (json.JSONDecodeError, AttributeError) as err:
            raise ValueError(f"{config} is not a JSON object ({err}); download it again") from None
    if isinstance(eos, dict):  # {"content": "<|im_end|>", ...}
        eos = eos.get("content")
    return eos


def train_builtin_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: Path) -> Tokenizer:
    """Train the builtin byte-level BPE on ``texts`` and save ``out_dir/tokenizer.json``."""
    tokenizer = HFTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / TOKENIZER_FILE))
    return Tokenizer(tokenizer, EOD_TOKEN, path=str(out_dir))
