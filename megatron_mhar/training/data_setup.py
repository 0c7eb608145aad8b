"""The run's data as the driver reads it: the tokenizer and training prefixes (building the
embedded corpus where the run trains on it) and the held-out blends."""

from __future__ import annotations

import os

import torch

from megatron_mhar.training.schema import TrainConfig


def prepare_data(cfg: TrainConfig):
    """The tokenizer and the dataset prefixes (building the embedded corpus if needed)."""
    data = cfg.data
    if data.embedded or data.tokenizer == "builtin":
        from megatron_mhar.data.corpus import embedded_root, prepare_embedded

        root = str(embedded_root(data.embedded_dir, data.cache_dir))
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:  # one build per node; atomic publish
            prepare_embedded(root, data.embedded_vocab_size, data.embedded_max_bytes)
        torch.distributed.barrier()
        embedded = prepare_embedded(root, data.embedded_vocab_size, data.embedded_max_bytes)
        tokenizer = embedded.tokenizer()
    else:
        from megatron_mhar.data.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_dir(data.tokenizer, data.eod_token)
    if data.embedded:
        paths = [embedded.prefix]
    else:
        paths = list(data.paths)
    return tokenizer, paths


def heldout_blends(cfg: TrainConfig):
    """``[valid, test]`` blends of ``data.valid_paths`` / ``data.test_paths`` (test
    ``None`` without test paths), or ``None`` when ``data.split`` carves them out."""
    data = cfg.data
    if not data.heldout:
        return None
    valid = (list(data.valid_paths), data.valid_weights)
    test = (list(data.test_paths), data.test_weights) if data.test_paths else None
    return [valid, test]
