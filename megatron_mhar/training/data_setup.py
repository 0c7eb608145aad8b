"""The run's data as the driver reads it: the tokenizer and training prefixes (building the
embedded corpus where the run trains on it), the held-out blends, and whether each split
holds enough tokens for what reads it."""

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


def check_split_sizes(cfg: TrainConfig, datasets, is_logger: bool) -> None:
    """Raise a ``ValueError`` for a split holding less than one sequence; warn (rank 0) for
    one holding fewer tokens than a training batch or an evaluation reads: its tokens repeat
    within each (Megatron's datasets loop over their documents as often as asked)."""
    from megatron_mhar.data.datasets import split_tokens

    data, seq, batch = cfg.data, cfg.model.seq_length, cfg.training.global_batch_size
    shares = [("training", "a training batch", batch, "data.paths"),
              ("validation", "an evaluation", cfg.eval.iters * batch, "data.valid_paths"),
              ("test", "the test", cfg.eval.iters * batch, "data.test_paths")]
    for (name, reader, samples, key), dataset in zip(shares, datasets):
        if dataset is None:
            continue
        source = key if data.heldout else f"its share of data.split={data.split} of data.paths"
        tokens, reads = split_tokens(dataset), samples * seq
        if tokens <= seq:
            raise ValueError(
                f"the {name} data ({source}) holds {tokens} tokens, less than one sequence of "
                f"model.seq_length={seq} (+1 for the labels): give it more data"
            )
        if tokens < reads and is_logger:
            print(f"warning: the {name} data ({source}) holds {tokens} tokens and {reader} reads {reads} "
                  f"({samples} x {seq}): each of its tokens is read ~{reads / tokens:.1f} times in each; "
                  f"give it more data", flush=True)
