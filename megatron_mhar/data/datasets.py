"""Megatron GPTDatasets from a blend of ``.bin/.idx`` prefixes, and their batches.

Datasets are built with Megatron's ``BlendedMegatronDatasetBuilder``: the sample
order is a function of the seed alone, and index files are cached (rank 0 builds
them first, the other ranks then read them).

:class:`MicroBatches` reads one data-parallel rank's micro-batches of a global
batch as Megatron's ``MegatronPretrainingSampler`` does: global batch ``k`` is
samples ``[k * G, (k + 1) * G)``; each group of ``micro x dp`` consecutive
samples gives every data-parallel rank ``micro`` of them. The position is the
number of consumed samples, so a resumed run reads exactly what an uninterrupted
run would have read. Given the model's vocabulary, it checks every sample's ids as it
reads them (one max per sequence) and names the file, document and offset of an id
beyond it: a launch reads only a pair's metadata or a sample of its ids.
"""

from __future__ import annotations

import os
import struct
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy
import torch

from megatron_mhar.data.tokenizer import Tokenizer
from megatron_mhar.errors import UserError, on_this_rank

_IDX_HEAD = struct.Struct("<9sQBQQ")
"""Megatron's ``.idx`` header: magic, version, dtype code, sequences, documents."""


Blend = Tuple[List[str], Optional[List[float]]]
"""Megatron's blend: dataset prefixes and their weights (``None``: proportional to size)."""

_EVALUATED = {1: ("validation", "data.valid_paths"), 2: ("test", "data.test_paths")}
"""Split index -> (name, key of its held-out paths)."""


def build_gpt_datasets(
    paths: Sequence[str],
    weights: Optional[Sequence[float]],
    split: Optional[str],
    seq_length: int,
    num_samples: Sequence[Optional[int]],
    tokenizer: Tokenizer,
    seed: int,
    cache_dir: Optional[str] = None,
    eod_mask_loss: bool = False,
    heldout: Optional[Sequence[Optional[Blend]]] = None,
) -> List:
    """``[train, valid, test]`` datasets (``None`` where ``num_samples`` is 0/None).

    ``split`` carves the three out of the documents of ``paths``; ``heldout``, the
    ``[valid, test]`` blends of held-out data (``test`` may be ``None``), instead gives
    each split its own data and trains on all of ``paths`` (Megatron's per-split blends;
    ``split`` must then be ``None``). Call on every rank after the process group exists.
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    train = _positive_blend(paths, weights, "data.paths", "data.weights")
    if heldout is None:
        blends = dict(blend=train, split=split)
    elif split is not None:
        raise ValueError(f"data.split={split!r} and held-out data paths exclude each other; set data.split=null")
    else:
        valid, test = heldout
        blends = dict(blend_per_split=[
            train,
            _positive_blend(*valid, "data.valid_paths", "data.valid_weights"),
            _positive_blend(*test, "data.test_paths", "data.test_weights") if test else None,
        ])
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        path_to_cache=cache_dir,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=eod_mask_loss,
        create_attention_mask=False,
        mid_level_dataset_surplus=0.005,
        **blends,
    )
    # 0, not None, for an unused split: with blend weights Megatron needs a size for every split.
    sizes = [n or 0 for n in num_samples]
    if heldout is None:
        _check_splits(train[0], config.split_matrix, sizes)
    datasets = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()
    _check_evaluation_sizes(datasets, sizes, seq_length, heldout is not None)
    datasets = [dataset if n else None for dataset, n in zip(datasets, sizes)]
    for indexed in indexed_datasets(datasets):
        indexed.bin_reader = CheckedBinReader(indexed.path_prefix + ".bin")
    return datasets


def indexed_datasets(datasets) -> List:
    """The ``IndexedDataset`` objects (one per ``.bin``/``.idx`` pair and split) under
    GPTDatasets and blends of them (``None`` entries skipped)."""
    from megatron.core.datasets.blended_dataset import BlendedDataset

    found = []
    for dataset in datasets:
        if isinstance(dataset, BlendedDataset):
            found += indexed_datasets(dataset.datasets)
        elif dataset is not None:
            found.append(dataset.dataset)
    return found


def split_tokens(dataset) -> int:
    """Tokens of the documents a split (a GPTDataset, or a blend of them) draws its samples from."""
    from megatron.core.datasets.blended_dataset import BlendedDataset

    if isinstance(dataset, BlendedDataset):
        return sum(split_tokens(d) for d in dataset.datasets)
    return int(dataset.dataset.sequence_lengths[dataset.indices].sum())


class DataChanged(UserError):
    """A data file changed under the running job; the message names it."""


def _stamp(path: str) -> Tuple[int, int, int]:
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns, st.st_ino


class CheckedBinReader:
    """Megatron's ``.bin`` reader interface (``read(dtype, count, offset)``) through ``pread``
    on a descriptor held open.

    Megatron maps the file: once it is truncated under the running job, the first read past
    its new end kills the process with SIGBUS, without a message. Here that read comes back
    short and raises :class:`DataChanged` naming the file. The copy costs what the mapped
    reader's own copy into the sample costs (GPTDataset concatenates the pieces it reads).
    """

    def __init__(self, bin_path: str):
        self.path = bin_path
        self.opened = _stamp(bin_path)  # (size, mtime, inode) when the run opened it
        self._fd = os.open(bin_path, os.O_RDONLY)

    def read(self, dtype, count: int, offset: int) -> numpy.ndarray:
        size = numpy.dtype(dtype).itemsize * count
        data = os.pread(self._fd, size, offset)
        if len(data) < size:
            now = os.fstat(self._fd).st_size
            raise on_this_rank(DataChanged(
                f"{self.path} was truncated while the run reads it: a sample needs its bytes {offset} to "
                f"{offset + size}, and it holds {now} (it held {self.opened[0]} when the run opened it)"
            ))
        return numpy.frombuffer(data, dtype=dtype, count=count)

    def changed(self) -> Optional[str]:
        """How the file differs from when it was opened (size, time stamp, a replaced file),
        or ``None``."""
        try:
            now = _stamp(self.path)
        except OSError as err:
            return f"{self.path} is gone or unreadable ({err.strerror})"
        if now == self.opened:
            return None
        if now[2] != self.opened[2]:
            return f"{self.path} was replaced by another file"
        if now[0] != self.opened[0]:
            return f"{self.path} changed size ({self.opened[0]} -> {now[0]} bytes)"
        return f"{self.path} was written in place (same size, modified since the run opened it)"

    def __del__(self) -> None:
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)


def changed_data(datasets) -> Optional[str]:
    """How the first of the datasets' ``.bin`` files that changed since they were opened
    differs, or ``None``."""
    return next(filter(None, (indexed.bin_reader.changed() for indexed in indexed_datasets(datasets)
                              if isinstance(indexed.bin_reader, CheckedBinReader))), None)


def _positive_blend(paths: Sequence[str], weights: Optional[Sequence[float]], paths_key: str,
                    weights_key: str) -> Blend:
    """``(paths, weights)`` with the paths weighted 0 left out (Megatron's blend takes
    positive weights only)."""
    paths = list(paths)
    if weights is None:
        return paths, None
    if len(weights) != len(paths) or min(weights) < 0 or sum(weights) <= 0:
        raise ValueError(
            f"{weights_key}={list(weights)} for {len(paths)} {paths_key}: give one non-negative "
            f"weight per path (positive sum), or {weights_key}=null"
        )
    return [p for p, w in zip(paths, weights) if w > 0], [w for w in weights if w > 0]


def _check_evaluation_sizes(datasets, sizes, seq_length: int, heldout: bool) -> None:
    """The validation and test datasets hold the samples an evaluation reads (a blend
    without weights holds one pass over its data, and would run dry inside a step)."""
    for index, (name, key) in _EVALUATED.items():
        dataset, needed = datasets[index], sizes[index]
        if not needed or len(dataset) >= needed:
            continue
        source = key if heldout else "data.split"
        raise ValueError(
            f"the {name} data ({source}) holds {len(dataset)} samples of {seq_length} "
            f"tokens, and an evaluation reads eval.iters x training.global_batch_size = {needed}: "
            f"lower eval.iters, give more data, or give blend weights (a weighted blend repeats its data)"
        )


def _check_splits(paths: Sequence[str], split_matrix, sizes) -> None:
    """Every split that is drawn from must get documents (Megatron loops forever otherwise)."""
    from megatron.core.datasets.utils import Split

    for path in paths:
        documents = len(open_indexed(path).document_indices) - 1
        for split in Split:
            if not sizes[split.value]:
                continue
            begin, end = split_matrix[split.value] or (0.0, 0.0)
            if int(round(end * documents)) - int(round(begin * documents)) < 1:
                raise ValueError(
                    f"data.split gives the {split.name} split of {path} no documents (it has "
                    f"{documents}); give that split a larger share or use more data"
                )


def open_indexed(path: str):
    """Megatron's ``IndexedDataset`` of ``path.{bin,idx}``, checked to be one intact pair.

    Megatron reads a truncated ``.bin`` or the ``.idx`` of another run without complaint
    (its samples are then garbage or a part of the data); this raises a ``ValueError``
    that names the file instead.
    """
    from megatron.core.datasets.indexed_dataset import _INDEX_HEADER, DType, IndexedDataset

    fix = f"write {path}.bin and {path}.idx again, together, with mhar-preprocess"
    missing = [path + ext for ext in (".bin", ".idx") if not os.path.isfile(path + ext)]
    if missing and path.endswith((".bin", ".idx")):
        raise ValueError(f"{' and '.join(missing)} not found; give the prefix, {path[:-4]}, without {path[-4:]}")
    if missing:
        raise ValueError(f"{' and '.join(missing)} not found; fix the data path or {fix}")
    idx_bytes = os.path.getsize(path + ".idx")
    with open(path + ".idx", "rb") as f:
        head = f.read(_IDX_HEAD.size)
    if len(head) < _IDX_HEAD.size or not head.startswith(_INDEX_HEADER):
        raise ValueError(f"{path}.idx is not a Megatron index file (no complete MMIDIDX header); {fix}")
    _, version, code, sequences, documents = _IDX_HEAD.unpack(head)
    if version != 1 or code not in {d.value for d in DType}:
        raise ValueError(f"{path}.idx has an unknown version ({version}) or dtype ({code}); {fix}")
    expected = _IDX_HEAD.size + sequences * (4 + 8) + documents * 8  # lengths, pointers, documents
    if idx_bytes < expected:
        raise ValueError(f"{path}.idx is truncated ({idx_bytes} of {expected} bytes); {fix}")
    if sequences == 0:
        raise ValueError(f"{path} holds no documents; {fix} from non-empty input")
    dataset = IndexedDataset(path)
    index = dataset.index
    end = int(index.sequence_pointers[-1]) + int(index.sequence_lengths[-1]) * index.dtype_size
    bin_bytes = os.path.getsize(path + ".bin")
    if bin_bytes != end:
        raise ValueError(
            f"{path}.idx describes {end} bytes of tokens but {path}.bin holds {bin_bytes}: the .bin "
            f"is truncated or the two files come from different runs; {fix}"
        )
    return dataset


def sampled_max_token(path: str, tokens: int = 1 << 18) -> int:
    """The largest token id among the first and the last ``tokens`` of ``path.bin`` (a
    sample: a dataset written with another tokenizer shows ids beyond the model's
    vocabulary within its first megabytes; reading the whole ``.bin`` could take hours)."""
    ids = numpy.memmap(path + ".bin", dtype=open_indexed(path).index.dtype, mode="r")
    return int(max(ids[:tokens].max(), ids[-tokens:].max()))


def locate_token(dataset, index: int, bound: int) -> str:
    """Where sample ``index`` of a GPTDataset (or a blend of them) holds its first id
    ``>= bound``: ``"<file>.bin, document d, token t of the document (token n of the
    file): id i"``. Follows GPTDataset's own sample layout (documents concatenated from
    an offset, plus the extra label token)."""
    from megatron.core.datasets.blended_dataset import BlendedDataset

    if isinstance(dataset, BlendedDataset):
        dataset[index]  # loads the blend's lazily mapped indices
        inner = int(dataset.dataset_sample_index[index])
        return locate_token(dataset.datasets[int(dataset.dataset_index[index])], inner, bound)
    dataset[index]  # loads the lazily mapped indices
    extra = dataset.config.add_extra_token_to_sequence
    shuffled = dataset.shuffle_index[index]
    (first, first_offset), (last, last_offset) = dataset.sample_index[shuffled], dataset.sample_index[shuffled + 1]
    for i in range(int(first), int(last) + 1):
        document = int(dataset.document_index[i])
        offset = int(first_offset) if i == first else 0
        length = int(last_offset) - offset + extra if i == last else None
        ids = dataset.dataset.get(document, offset=offset, length=length)
        bad = numpy.flatnonzero(ids >= bound)
        if len(bad):
            position = offset + int(bad[0])
            index_ = dataset.dataset.index
            in_file = int(index_.sequence_pointers[document]) // index_.dtype_size + position
            return (f"{dataset.dataset.path_prefix}.bin, document {document}, token {position} of the "
                    f"document (token {in_file} of the file): id {int(ids[bad[0]])}")
    raise ValueError(f"sample {index} of {dataset.dataset.path_prefix} holds no id >= {bound}")


class MicroBatches(Iterator[Dict[str, torch.Tensor]]):
    """This rank's micro-batches, starting after ``consumed_samples`` samples.

    ``vocab_size``: every sample's ids must be below it (checked as read; ``None``: not checked).
    """

    def __init__(
        self,
        dataset,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        consumed_samples: int = 0,
        device: Optional[torch.device] = None,
        vocab_size: Optional[int] = None,
    ):
        self.dataset = dataset
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.consumed_samples = consumed_samples
        self.device = device
        self.vocab_size = vocab_size

    def __iter__(self) -> "MicroBatches":
        return self

    def __next__(self) -> Dict[str, torch.Tensor]:
        start = self.consumed_samples + self.dp_rank * self.micro_batch_size
        stop = start + self.micro_batch_size
        if stop > len(self.dataset):
            raise StopIteration
        samples = [self.dataset[i] for i in range(start, stop)]
        if self.vocab_size is not None:
            for i, sample in zip(range(start, stop), samples):
                if max(int(sample["tokens"].max()), int(sample["labels"].max())) >= self.vocab_size:
                    raise on_this_rank(ValueError(  # this rank's share of the data: it says so itself
                        f"token id beyond model.vocab_size={self.vocab_size} in "
                        f"{locate_token(self.dataset, i, self.vocab_size)}: the data was written with "
                        f"another tokenizer or is damaged; rewrite it with mhar-preprocess --tokenizer "
                        f"<data.tokenizer>, or remove it from data.paths"
                    ))
        self.consumed_samples += self.micro_batch_size * self.dp_size
        # A blend's samples also carry their source's ``dataset_id`` (a NumPy scalar).
        batch = {key: torch.stack([torch.as_tensor(s[key]) for s in samples]) for key in samples[0]}
        if self.device is not None and self.device.type != "cpu":
            batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
        return batch
