"""Checksum cost against a checkpoint save of the 1B model's size, on this CPU.

    python -m benchmarks.bench_checksum --out benchmarks/results/checksum/cpu.json

Every checkpoint carries a manifest of its files' sizes and checksums
(:mod:`megatron_mhar.checkpoint.manifest`). This measures what that costs against Megatron's
``dist_checkpointing.save`` (fsynced) of ``--gib`` GiB of bf16 tensors on one process
(default 2.4: the 1B model's weights). Each round, interleaved because the machine may be
shared:

* ``save``: the plain save;
* ``save_checksummed``: the save as the training driver runs it, its shard files
  checksummed as they are written (``megatron_mhar.checkpoint.format.checksummed_writes``: hashed chunk
  by chunk while cache-hot, the disk's writeback started early), plus the manifest
  (:func:`megatron_mhar.checkpoint.manifest.write_manifest`);
* ``save_unhashed``: the same save with a checksum that does nothing, so that
  ``save_checksummed / save_unhashed`` is what the checksum itself costs; the three saves
  take turns going first;
* each candidate checksum over the saved files' bytes held in memory (the compute a
  checksum adds to a write), in an order rotated round by round;
* ``read_back``: the chosen checksum over the files read back from the filesystem (what a
  manifest computed after the save would cost instead).

The report gives medians and each one's share of the median plain save.
"""

import argparse
import contextlib
import hashlib
import os
import shutil
import statistics
import sys
import tempfile
import time
import zlib
from datetime import datetime, timezone

from benchmarks.common import check_out, command, commit, machine, versions, write_json

CHUNK = 1 << 24  # the manifest's read size


class NoDigest:
    """A checksum that reads nothing (``save_unhashed``)."""

    def update(self, data) -> None:
        pass

    def hexdigest(self) -> str:
        return "0"


class Crc32:
    """``zlib.crc32`` behind the hashlib interface."""

    def __init__(self):
        self.value = 0

    def update(self, data) -> None:
        self.value = zlib.crc32(data, self.value)


def _candidates():
    import xxhash

    return {
        "xxh3_64": xxhash.xxh3_64,
        "xxh3_128": xxhash.xxh3_128,
        "crc32": Crc32,
        "blake2b": hashlib.blake2b,
        "sha256": hashlib.sha256,
    }


@contextlib.contextmanager
def _driver_writer(name: str, manifest, checksummed_writes):
    """The writer of save ``name``: Megatron's own, the driver's, or the driver's with
    :class:`NoDigest`."""
    if name == "save":
        yield
        return
    previous = manifest._new_digest
    if name == "save_unhashed":
        manifest._new_digest = NoDigest
    try:
        with checksummed_writes():
            yield
    finally:
        manifest._new_digest = previous


def read_files(directory: str) -> list:
    """The bytes of every file of ``directory`` (for checksums over memory)."""
    return [open(os.path.join(directory, name), "rb").read() for name in sorted(os.listdir(directory))]


def checksum_memory(contents: list, make) -> None:
    """One checksum per file, over its bytes in memory, fed in pieces as a writer writes them."""
    for data in contents:
        digest, view = make(), memoryview(data)
        for start in range(0, len(view), CHUNK):
            digest.update(view[start:start + CHUNK])


def sharded_state(gib: float):
    """``gib`` GiB of bf16 tensors in 64 MiB pieces, as ShardedTensors of one rank."""
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    remaining = int(gib * 2**30) // 2
    rows, per = 4096, 32 * 2**20  # elements per tensor: 64 MiB of bf16
    state, i = {}, 0
    generator = torch.Generator().manual_seed(0)
    while remaining > 0:
        count = min(per, remaining) // rows * rows or rows
        tensor = torch.randn(count // rows, rows, generator=generator).to(torch.bfloat16)
        state[f"tensor{i}"] = ShardedTensor.from_rank_offsets(f"tensor{i}", tensor)
        remaining -= count
        i += 1
    return state


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=2.4, help="GiB of bf16 tensors saved (default: 1B weights)")
    parser.add_argument("--rounds", type=int, default=5, help="save + checksum rounds (medians over them)")
    parser.add_argument("--dir", default=None, help="where the checkpoints are written (default: a "
                                                   "temporary directory under the system's)")
    parser.add_argument("--out", default=None, help="JSON report")
    args = parser.parse_args(argv)
    if args.gib <= 0 or args.rounds < 1:
        parser.error("--gib must be positive and --rounds at least 1")
    check_out(parser, args.out)

    import torch
    from megatron.core import dist_checkpointing

    from megatron_mhar.runtime import destroy, initialize_model_parallel_from_env

    from megatron_mhar.checkpoint import manifest
    from megatron_mhar.checkpoint.format import checksummed_writes

    candidates = _candidates()
    initialize_model_parallel_from_env(tp=1, pp=1, device="cpu")
    times = {"save": [], "save_checksummed": [], "save_unhashed": [], "read_back": [],
             **{name: [] for name in candidates}}
    try:
        state = sharded_state(args.gib)
        root = tempfile.mkdtemp(prefix="bench_checksum.", dir=args.dir)
        try:
            for round_ in range(args.rounds):
                saves = [(name, os.path.join(root, name)) for name in ("save", "save_checksummed", "save_unhashed")]
                plain = saves[0][1]
                for name, target in saves[round_ % 3:] + saves[:round_ % 3]:  # each goes first in turn
                    os.makedirs(target)
                    start = time.perf_counter()
                    with _driver_writer(name, manifest, checksummed_writes):
                        dist_checkpointing.save(dict(state), target)
                        if name != "save":
                            manifest.write_manifest(target)
                    times[name].append(time.perf_counter() - start)
                size = sum(os.path.getsize(os.path.join(plain, n)) for n in os.listdir(plain))
                start = time.perf_counter()
                for name in sorted(os.listdir(plain)):
                    manifest.file_checksum(os.path.join(plain, name))
                times["read_back"].append(time.perf_counter() - start)
                contents = read_files(plain)
                names = list(candidates)
                for name in names[round_ % len(names):] + names[:round_ % len(names)]:
                    start = time.perf_counter()
                    checksum_memory(contents, candidates[name])
                    times[name].append(time.perf_counter() - start)
                del contents
                for _, target in saves:
                    shutil.rmtree(target)
                print(f"round {round_}: " + ", ".join(f"{n} {t[-1]:.2f}s" for n, t in times.items()), flush=True)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    finally:
        destroy()

    save_s = statistics.median(times["save"])
    medians = {name: statistics.median(values) for name, values in times.items()}
    report = {
        "commit": commit(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "command": command("benchmarks.bench_checksum", argv),
        "versions": versions("xxhash"),
        "environment": {**machine("cpu"), "device": "cpu", "load_average_1m": os.getloadavg()[0]},
        "note": "Megatron dist_checkpointing.save (fsynced) of bf16 tensors on one process; the same save "
                "through the driver's writer (files checksummed as written, writeback started early) "
                "plus the manifest; the driver's writer with a checksum that does nothing; each checksum "
                "over the saved bytes in memory; xxh3_64 over the files read back. Rounds interleaved, "
                "medians, shares of the median plain save; checksum_cost: save_checksummed over "
                "save_unhashed, per round and its median.",
        "bytes": size,
        "seconds_median": medians,
        "seconds_all": times,
        "share_of_save": {name: medians[name] / save_s for name in times if name != "save"},
        "checksum_cost_rounds": [c / u for c, u in zip(times["save_checksummed"], times["save_unhashed"])],
        "checksum_cost_median": statistics.median(
            c / u for c, u in zip(times["save_checksummed"], times["save_unhashed"])),
        "gb_per_s": {name: size / medians[name] / 1e9 for name in times},
    }
    for name in times:
        print(f"{name:>16}: {medians[name]:7.3f}s ({size / medians[name] / 1e9:6.2f} GB/s), "
              f"{100 * medians[name] / save_s:6.1f}% of a {save_s:.2f}s save of {size / 2**30:.2f} GiB")
    print(f"checksum cost: save_checksummed / save_unhashed, median over rounds "
          f"{report['checksum_cost_median']:.3f}")
    if args.out:
        write_json(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
