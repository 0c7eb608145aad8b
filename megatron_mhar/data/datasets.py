"""Megatron GPTDatasets from a blend of ``.bin/.idx`` prefixes, and their batches.

Datasets are built with Megatron's ``BlendedMegatronDatasetBuilder``: the sample
order is a function of the seed alone, and index files are cached (rank 0 builds
them first, the other ranks then read them).

:class:`MicroBatches` reads one data-parallel rank's micro-batches of a global
batch as Megatron's ``MegatronPretrainingSampler`` does: global batch ``k`` is
samples ``[k * G, (k + 1) * G)``; each group of ``micro x dp`` consecutive
samples gives every data-parallel rank ``micro`` of them. The position is the
number of consumed samples, so a resumed run reads exactly what an uninterrupted
run would have read.
"""

from __future__ import annotations

from typing import Dict, Iterator, List, Optional, Sequence

import torch

from megatron_mhar.data.tokenizer import Tokenizer


def build_gpt_datasets(
    paths: Sequence[str],
    weights: Optional[Sequence[float]],
    split: str,
    seq_length: int,
    num_samples: Sequence[Optional[int]],
    tokenizer: Tokenizer,
    seed: int,
    cache_dir: Optional[str] = None,
    eod_mask_loss: bool = False,
) -> List:
    """``[train, valid, test]`` datasets (``None`` where ``num_samples`` is 0/None).

    Call on every rank after the process group exists.
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=(list(paths), list(weights) if weights is not None else None),
        split=split,
        path_to_cache=cache_dir,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=eod_mask_loss,
        create_attention_mask=False,
        mid_level_dataset_surplus=0.005,
    )
    sizes = [n if n else None for n in num_samples]
    _check_splits(paths, config.split_matrix, sizes)
    return BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()


def _check_splits(paths: Sequence[str], split_matrix, sizes) -> None:
    """Every split that is drawn from must get documents (Megatron loops forever otherwise)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron.core.datasets.utils import Split

    for path in paths:
        documents = len(IndexedDataset(path).document_indices) - 1
        for split in Split:
            if not sizes[split.value]:
                continue
            begin, end = split_matrix[split.value]
            if int(round(end * documents)) - int(round(begin * documents)) < 1:
                raise ValueError(
                    f"data.split gives the {split.name} split of {path} no documents (it has "
                    f"{documents}); give that split a larger share or use more data"
                )


class MicroBatches(Iterator[Dict[str, torch.Tensor]]):
    """This rank's micro-batches, starting after ``consumed_samples`` samples."""

    def __init__(
        self,
        dataset,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        consumed_samples: int = 0,
        device: Optional[torch.device] = None,
    ):
        self.dataset = dataset
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.consumed_samples = consumed_samples
        self.device = device

    def __iter__(self) -> "MicroBatches":
        return self

    def __next__(self) -> Dict[str, torch.Tensor]:
        start = self.consumed_samples + self.dp_rank * self.micro_batch_size
        stop = start + self.micro_batch_size
        if stop > len(self.dataset):
            raise StopIteration
        samples = [self.dataset[i] for i in range(start, stop)]
        self.consumed_samples += self.micro_batch_size * self.dp_size
        batch = {key: torch.stack([s[key] for s in samples]) for key in samples[0]}
        if self.device is not None and self.device.type != "cpu":
            batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
        return batch
