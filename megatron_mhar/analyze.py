"""Where the heads route: the routing maps of a checkpoint over some token data.

    python -m megatron_mhar.analyze CKPT --data PREFIX [--out DIR] [--sequences 64]
        [--seq-length N] [--batch-size 4] [--device cpu] [--dtype fp32]

CKPT is a checkpoint (a run's ``checkpoints/``, one ``iter_*`` directory, or the output of
``mhar-convert hf-to-mcore``); PREFIX a ``.bin/.idx`` dataset written with the model's
tokenizer (``mhar-preprocess``). The first ``--sequences`` windows of ``--seq-length``
tokens of the data (documents in order, back to back) run through the model; for every
routing site, every source it reads and every head, the mean softmax weight over all
their tokens is written, with each head's entropy normalised by ``ln N``, to
``DIR/routing_maps.json`` and ``DIR/routing_maps.png`` (each written atomically; the
format is :mod:`megatron_mhar.diagnostics.maps`'s).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Iterable, Optional, Sequence

import torch

from megatron_mhar.diagnostics.recorder import RoutingRecorder
from megatron_mhar.diagnostics.maps import JSON_FILE, PNG_FILE, RoutingMaps, save_routing_maps

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@torch.no_grad()
def routing_maps(gpt: torch.nn.Module, batches: Iterable[torch.Tensor]) -> RoutingMaps:
    """The routing maps of the MHAR GPT ``gpt`` over every token of ``batches`` ([b, s] ids)."""
    decoder = getattr(gpt, "decoder", None)
    if not hasattr(decoder, "routing_recorder"):
        raise ValueError("the model is a plain GPT (mhar.variant=none): it routes nothing to map")
    recorder = RoutingRecorder(sample_tokens=None)
    decoder.routing_recorder = recorder
    try:
        for tokens in batches:
            positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
            gpt(tokens, positions, None)
    finally:
        decoder.routing_recorder = None
    if not recorder.sites:
        raise ValueError("no tokens were given: nothing was routed")
    return RoutingMaps.from_records(recorder.sites, decoder.layout)


def token_windows(prefix: str, count: int, length: int, vocab_size: int) -> torch.Tensor:
    """``[n, length]`` ids: the first ``n <= count`` windows of ``length`` tokens of ``prefix``."""
    import numpy

    from megatron_mhar.data.datasets import open_indexed

    ids = numpy.memmap(prefix + ".bin", dtype=open_indexed(prefix).index.dtype, mode="r")
    n = min(count, len(ids) // length)
    if n == 0:
        raise ValueError(f"{prefix} holds {len(ids)} tokens, fewer than one window of --seq-length={length}")
    windows = torch.from_numpy(numpy.array(ids[: n * length], dtype=numpy.int64)).view(n, length)
    largest = int(windows.max())
    if largest >= vocab_size:
        raise ValueError(
            f"{prefix} holds token id {largest}, beyond the model's vocabulary ({vocab_size}): it "
            f"was written with another tokenizer; write it with the model's tokenizer (mhar-preprocess)"
        )
    return windows


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_mhar.analyze", description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", help="checkpoint directory (or one with a 'latest' file)")
    parser.add_argument("--data", required=True, help="dataset prefix (PREFIX.bin + PREFIX.idx)")
    parser.add_argument("--out", default="routing_maps", help="output directory (default: routing_maps)")
    parser.add_argument("--sequences", type=int, default=64, help="windows of the data to run (default 64)")
    parser.add_argument("--seq-length", type=int, default=None, help="tokens per window (default: the model's)")
    parser.add_argument("--batch-size", type=int, default=4, help="windows per forward pass (default 4)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:index] (default cpu)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="parameter dtype (default: the checkpoint's)")
    args = parser.parse_args(argv)
    for name in ("sequences", "batch_size", "seq_length"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")

    from megatron_mhar.errors import command_errors
    from megatron_mhar.inference import load_model
    from megatron_mhar.runtime import destroy

    with command_errors(parser.prog):
        model = load_model(args.checkpoint, device=args.device, dtype=DTYPES.get(args.dtype))
        try:
            length = args.seq_length or model.config.seq_length
            windows = token_windows(args.data, args.sequences, length, model.config.vocab_size)
            batches = (batch.to(model.gpt.embedding.word_embeddings.weight.device)
                       for batch in windows.split(args.batch_size))
            maps = routing_maps(model.gpt, batches)
        finally:
            destroy()
        title = f"{Path(args.checkpoint).resolve().name}: {model.mhar.variant}, H={model.mhar.num_heads}"
        save_routing_maps(
            maps, Path(args.out), title, checkpoint=str(args.checkpoint), data=args.data,
            sequences=len(windows), seq_length=length, variant=model.mhar.variant,
        )
    print(f"routing maps of {maps.tokens} tokens: {Path(args.out) / PNG_FILE}, {Path(args.out) / JSON_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
