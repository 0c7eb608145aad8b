"""Host time of the training driver's data path per optimizer step, at a recipe's shapes.

    python -m benchmarks.bench_data_loader    # writes benchmarks/results/data_loader/<device>.json

The training loop (``megatron_mhar/training/loop.py``) reads its batches through
``megatron_mhar.data.datasets``: ``build_gpt_datasets`` (Megatron's GPTDataset over
``data.paths``, split by ``data.split``) and one ``MicroBatches`` iterator per model chunk,
given ``model.vocab_size`` (every sample's ids are checked as they are read) and the run's
device (each batch is copied there, ``non_blocking``). Every optimizer step calls
``next()`` on it ``num_microbatches`` = global batch / (micro-batch x data-parallel) times,
eagerly, in Python, also when the forward/backward runs in a CUDA graph.

This benchmark builds that path as the driver does, at the shapes of ``--recipe`` (default
``pretrain_1b_baseline``: sequence 1024, micro-batch 2, global batch 32, so 16 micro-batches
per step on one GPU; model vocabulary 151,936; split 99,1,0; seed 1234), one data-parallel
rank and one model chunk, over an indexed dataset it writes itself with
``megatron_mhar/data/indexed_writer.py``: random ids below the tokenizer's vocabulary
(``--vocab``, default 151,669, the Qwen3 tokenizer the recipe names; 32-bit ids, the
writer's choice for it), documents of uniformly random lengths in [seq/4, 2 seq) tokens,
enough for the warm-up and timed steps within one pass over the training split. The
tokenizer is a stand-in with that vocabulary (its end-of-document id the last one): the
ids are what the path reads, not text.

Each step's ``num_microbatches`` ``next()`` calls are timed together; on CUDA the step ends
with a ``torch.cuda.synchronize()``, so the figure holds the host-to-device copies: the
loader's whole cost. Reported: median / p90 / max / mean ms per step and per micro-batch
(one ``next()``), their share of a training step (``--step-ms``), and a split of a step's
cost from a second pass over the same steps that runs ``MicroBatches.__next__``'s parts one
at a time (the dataset's ``__getitem__``, the vocabulary check, the ``torch.stack``, and on
CUDA the copy, synchronised per micro-batch there). The data was just written, so it is
read from the page cache (a step reads 32 x 1025 ids, 128 KiB at 1B).
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone

from benchmarks.common import (
    QWEN3_TOKENIZER_VOCAB,
    StandInTokenizer,
    check_out,
    command,
    commit,
    default_out,
    device_name,
    machine,
    shown,
    versions,
    write_dataset,
    write_json,
)

DEFAULT_RECIPE = "pretrain_1b_baseline"

DEFAULT_STEP_MS = 779.9
"""The 1B baseline's median step on one H200: ``benchmarks/results/training/h200.json``, run
``te_1b`` (2026-12-06; Transformer Engine spec, full-iteration CUDA graphs, 42,017
tokens/s), the latest run there. The local-spec run ``lookahead_1b`` took 1,108.6 ms."""


def next_in_parts(loader, parts: dict, sync) -> dict:
    """``loader.__next__`` (``MicroBatches``) run part by part, the same code in the same
    order, each part's seconds added to ``parts``; returns the batch."""
    import torch

    clock = time.perf_counter
    start = loader.consumed_samples + loader.dp_rank * loader.micro_batch_size
    stop = start + loader.micro_batch_size
    t0 = clock()
    samples = [loader.dataset[i] for i in range(start, stop)]
    t1 = clock()
    for sample in samples:
        if max(int(sample["tokens"].max()), int(sample["labels"].max())) >= loader.vocab_size:
            raise ValueError(f"an id >= {loader.vocab_size} in samples {start}..{stop - 1}")
    t2 = clock()
    loader.consumed_samples += loader.micro_batch_size * loader.dp_size
    batch = {key: torch.stack([torch.as_tensor(s[key]) for s in samples]) for key in samples[0]}
    t3 = clock()
    if loader.device is not None and loader.device.type != "cpu":
        batch = {k: v.to(loader.device, non_blocking=True) for k, v in batch.items()}
        sync()
    t4 = clock()
    for name, seconds in (("getitem", t1 - t0), ("vocab_check", t2 - t1), ("stack", t3 - t2), ("copy", t4 - t3)):
        parts[name] += seconds
    return batch


def summary(values_s) -> dict:
    """median / p90 / max / mean of seconds, in ms."""
    ms = sorted(1e3 * v for v in values_s)
    p90 = ms[min(len(ms) - 1, int(0.9 * len(ms)))]  # nearest rank at or above the 90th
    return {"median": statistics.median(ms), "p90": p90, "max": ms[-1], "mean": statistics.fmean(ms)}


def parse_args(argv):
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", default=DEFAULT_RECIPE,
                        help="recipe whose shapes are read: sequence length, micro-batch, global batch, "
                             "model.vocab_size, data.split, run.seed (default: %(default)s)")
    parser.add_argument("--vocab", type=int, default=None,
                        help="the tokenizer's vocabulary, ids are drawn below it (default: "
                             f"{QWEN3_TOKENIZER_VOCAB}, Qwen3's; data.embedded_vocab_size for a builtin-tokenizer recipe)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where the batches go (default: cuda if available, else cpu)")
    parser.add_argument("--steps", type=int, default=50, help="timed optimizer steps (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (default: %(default)s)")
    parser.add_argument("--step-ms", type=float, default=DEFAULT_STEP_MS,
                        help="a training step's milliseconds the loader's time is compared with (default: "
                             "%(default)s, the 1B baseline's median step on one H200, "
                             "benchmarks/results/training/h200.json run te_1b)")
    parser.add_argument("--dir", default=None, help="where the dataset is written (default: a temporary "
                                                   "directory under the system's, removed at the end)")
    parser.add_argument("--out", default=None, help="JSON report (default: benchmarks/results/data_loader/<device>.json)")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    if args.warmup < 0:
        parser.error(f"--warmup must be at least 0, got {args.warmup}")
    if not args.step_ms > 0:
        parser.error(f"--step-ms must be positive, got {args.step_ms}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here; use --device cpu")
    from megatron_mhar.training.recipes import load_config

    try:
        cfg = load_config(args.recipe)
    except (ValueError, FileNotFoundError) as err:
        parser.error(f"--recipe {args.recipe}: {err}")
    builtin = cfg.data.embedded or cfg.data.tokenizer == "builtin"
    if args.vocab is None:
        args.vocab = cfg.data.embedded_vocab_size if builtin else QWEN3_TOKENIZER_VOCAB
    if not 2 <= args.vocab <= cfg.model.vocab_size:
        parser.error(f"--vocab {args.vocab}: must be at least 2 and at most the recipe's model.vocab_size "
                     f"({cfg.model.vocab_size}), which the loader checks every id against")
    if args.out is None:
        args.out = default_out("data_loader", device_name(device=args.device))
    check_out(parser, args.out)
    return args, cfg


def main(argv=None) -> int:
    args, cfg = parse_args(argv)

    import numpy
    import torch

    from megatron_mhar.data.datasets import MicroBatches, build_gpt_datasets

    tr = cfg.training
    seq, micro, global_batch = cfg.model.seq_length, tr.micro_batch_size, tr.global_batch_size
    num_microbatches = global_batch // micro  # one data-parallel rank
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    samples = (args.warmup + args.steps) * global_batch
    shares = [float(w) for w in cfg.data.train_split.replace("/", ",").split(",")]
    shares = [w / sum(shares) for w in shares]  # each split's share of the documents
    # Every split with a share gets a document: Megatron builds each one, and one of no
    # documents loops forever (the driver always reads validation samples, so its
    # build_gpt_datasets refuses such a split instead).
    min_documents = int(max(2 / w for w in shares if w > 0)) + 1
    # One pass over the training split holds every sample read (plus 3% for the split's rounding).
    tokens = int(samples * (seq + 1) / shares[0] * 1.03) + 4 * seq
    load_start = os.getloadavg()[0]

    root = tempfile.mkdtemp(prefix="bench_data_loader.", dir=args.dir)
    try:
        tokenizer = StandInTokenizer(args.vocab, seed=cfg.run.seed)
        start = time.perf_counter()
        written = write_dataset(os.path.join(root, "data"), tokenizer, tokens, seq, cfg.run.seed, min_documents)
        write_s = time.perf_counter() - start
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        token_dtype = numpy.dtype(IndexedDataset(os.path.join(root, "data")).index.dtype).name
        start = time.perf_counter()
        train, _, _ = build_gpt_datasets(
            [os.path.join(root, "data")], None, cfg.data.train_split, seq, [samples, 0, 0], tokenizer,
            cfg.run.seed, cache_dir=os.path.join(root, "cache"), eod_mask_loss=cfg.data.eod_mask_loss,
        )  # fmt: skip
        build_s = time.perf_counter() - start
        print(f"{written['documents']} documents, {written['tokens']} {token_dtype} ids written in "
              f"{write_s:.1f}s; datasets built in {build_s:.2f}s; {num_microbatches} micro-batches of "
              f"{micro} x {seq} per step, device {device}", flush=True)

        # The driver's iterator: rank 0 of 1, from sample 0, the model's vocabulary checked.
        loader = MicroBatches(train, micro, 0, 1, 0, device, vocab_size=cfg.model.vocab_size)
        step_s, micro_s = [], []
        first = None
        for step in range(args.warmup + args.steps):
            times = []
            step_start = time.perf_counter()
            for _ in range(num_microbatches):
                t0 = time.perf_counter()
                batch = next(loader)
                times.append(time.perf_counter() - t0)
            sync()
            elapsed = time.perf_counter() - step_start
            if first is None:
                first = {k: {"shape": list(v.shape), "dtype": str(v.dtype).replace("torch.", ""),
                             "device": str(v.device), "bytes": v.numel() * v.element_size()}
                         for k, v in batch.items()}  # fmt: skip
            if step >= args.warmup:
                step_s.append(elapsed)
                micro_s.extend(times)

        # The split: the same timed steps again, __next__'s parts one at a time.
        parts = {"getitem": 0.0, "vocab_check": 0.0, "stack": 0.0, "copy": 0.0}
        per_step = {name: [] for name in parts}
        parted = MicroBatches(train, micro, 0, 1, args.warmup * global_batch, device, vocab_size=cfg.model.vocab_size)
        split_step_s = []
        for _ in range(args.steps):
            for name in parts:
                parts[name] = 0.0
            step_start = time.perf_counter()
            for _ in range(num_microbatches):
                next_in_parts(parted, parts, sync)
            sync()
            split_step_s.append(time.perf_counter() - step_start)
            for name, seconds in parts.items():
                per_step[name].append(seconds)
    finally:
        import shutil

        shutil.rmtree(root, ignore_errors=True)

    step = summary(step_s)
    share = {k: step[k] / args.step_ms for k in ("median", "p90", "mean")}
    split = {name: summary(values) for name, values in per_step.items()}
    if device.type == "cpu":
        del split["copy"]
    report = {
        "benchmark": "benchmarks/bench_data_loader.py",
        "commit": commit(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "command": command("benchmarks.bench_data_loader", argv),
        "versions": versions(),
        "environment": {
            **machine(device.type),
            "torch_threads": torch.get_num_threads(),
            "load_average_1m": {"start": load_start, "end": os.getloadavg()[0]},
        },
        "note": "The training driver's data path (build_gpt_datasets + MicroBatches with the vocabulary check, "
                "one data-parallel rank, one model chunk) at the recipe's shapes over a dataset of random ids "
                "written by the project's indexed writer, read from the page cache. step_ms: each step's "
                "num_microbatches next() calls (on CUDA the host-to-device copies included, synchronised at the "
                "step's end). split_ms_per_step: a second pass over the same steps, MicroBatches.__next__'s "
                "parts timed one at a time (on CUDA the copy synchronised per micro-batch).",
        "args": {**vars(args), "out": shown(args.out)},
        "shapes": {
            "recipe": args.recipe, "seq_length": seq, "micro_batch_size": micro, "global_batch_size": global_batch,
            "data_parallel": 1, "num_microbatches": num_microbatches, "model_vocab_size": cfg.model.vocab_size,
            "tokenizer_vocab": args.vocab, "split": cfg.data.train_split, "seed": cfg.run.seed,
        },
        "data": {"documents": written["documents"], "tokens": written["tokens"], "token_dtype": token_dtype,
                 "train_samples": len(train), "write_s": write_s, "build_gpt_datasets_s": build_s},
        "batch": first,
        "step_ms": step,
        "step_ms_all": [1e3 * s for s in step_s],
        "microbatch_ms": summary(micro_s),
        "split_ms_per_step": split,
        "split_step_ms": summary(split_step_s),
        "compared_to": {"step_ms": args.step_ms,
                        "source": "given as --step-ms" if args.step_ms != DEFAULT_STEP_MS else
                        "benchmarks/results/training/h200.json, run te_1b: the 1B Transformer Engine baseline's "
                        "median step on one H200"},
        "share_of_step": share,
        "below_1_percent": share["median"] < 0.01,
    }
    write_json(args.out, report)
    print(f"per step ({num_microbatches} micro-batches): median {step['median']:.3f} ms, p90 {step['p90']:.3f}, "
          f"max {step['max']:.3f}, mean {step['mean']:.3f}; per micro-batch median "
          f"{report['microbatch_ms']['median']:.3f} ms")
    print("split per step (median ms): " + ", ".join(f"{k} {v['median']:.3f}" for k, v in split.items()))
    print(f"share of a {args.step_ms} ms step: median {100 * share['median']:.3f}%, p90 {100 * share['p90']:.3f}%, "
          f"mean {100 * share['mean']:.3f}%  -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
