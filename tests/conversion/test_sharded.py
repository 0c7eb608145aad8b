"""Sharded checkpoints (several safetensors files and an index) through the streaming conversion.

The conversions hold one tensor at a time, not the model: the reader maps a shard only
while a tensor read from it lives, the import hands Megatron's writer tensors that own
their storage (a view would be copied, all at once), the export loads one stored tensor
per Megatron load and writes shards as they fill. ``benchmarks/bench_conversion.py``
measures the memory this keeps at Llama-3.1-8B's size.
"""

from __future__ import annotations

import gc
import json
import sys

import pytest
import torch

from tests.helpers import hf_logits, read_safetensors, token_batch


def _tensors(sizes):
    generator = torch.Generator().manual_seed(0)
    return {name: torch.randn(size, generator=generator) for name, size in sizes.items()}


def test_shard_writer_lays_out_shards_like_save_pretrained(tmp_path):
    from megatron_mhar.conversion.hf_io import INDEX_FILE, SafetensorsReader, ShardWriter

    # 4-byte floats in 1000-byte shards: a + b fit one, c starts the next, big (over the
    # limit) gets one of its own, d follows it
    tensors = _tensors({"a": 100, "b": 100, "c": 150, "big": 400, "d": 10})
    writer = ShardWriter(tmp_path, max_shard_bytes=1000)
    for name, tensor in tensors.items():
        writer.add(name, tensor)
    with pytest.raises(ValueError, match="tensor 'a' is written twice"):
        writer.add("a", tensors["a"])
    names = writer.close()
    assert names == [f"model-0000{i}-of-00004.safetensors" for i in (1, 2, 3, 4)]
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert index["metadata"]["total_size"] == 4 * 760
    assert index["weight_map"] == {"a": names[0], "b": names[0], "c": names[1], "big": names[2], "d": names[3]}
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names + [INDEX_FILE])  # no temporary files
    reader = SafetensorsReader(tmp_path)
    assert all(torch.equal(reader(name), tensor) for name, tensor in tensors.items())


def test_shard_writer_makes_room_and_writes_one_file_when_all_fit(tmp_path):
    from megatron_mhar.conversion.hf_io import SINGLE_FILE, ShardWriter

    (tmp_path / "one").mkdir()
    writer = ShardWriter(tmp_path / "one", max_shard_bytes=10_000)
    writer.add("a", torch.ones(10))
    writer.make_room(9_000)  # fits: nothing written yet
    writer.add("b", torch.ones(10))
    assert writer.close() == [SINGLE_FILE] and sorted(read_safetensors(tmp_path / "one")) == ["a", "b"]

    (tmp_path / "two").mkdir()
    writer = ShardWriter(tmp_path / "two", max_shard_bytes=10_000)
    writer.add("a", torch.ones(10))
    writer.make_room(9_990)  # would overflow: "a" goes to a shard of its own
    writer.add("b", torch.ones(10))
    assert len(writer.close()) == 2


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/maps")
def test_reader_maps_a_shard_only_while_its_tensor_lives(tmp_path):
    from megatron_mhar.conversion.hf_io import SafetensorsReader, ShardWriter

    writer = ShardWriter(tmp_path, max_shard_bytes=4096)
    for name, tensor in _tensors({"first": 1024, "second": 1024}).items():
        writer.add(name, tensor)
    shard = tmp_path / writer.close()[1]

    def mapped() -> bool:
        return str(shard) in open("/proc/self/maps").read()

    reader = SafetensorsReader(tmp_path)
    assert not mapped()  # listing the tensors keeps no file open
    tensor = reader("second")
    assert mapped() and tensor.sum().item() != 0
    del tensor
    gc.collect()
    assert not mapped()


@pytest.fixture(scope="module")
def sharded_llama(hf_dirs, tmp_path_factory):
    """The tiny Llama saved by transformers in shards of at most 40 kB (with an index)."""
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("sharded") / "llama"
    AutoModelForCausalLM.from_pretrained(hf_dirs["llama"]).save_pretrained(out, max_shard_size="40KB")
    assert len(list(out.glob("model-*.safetensors"))) >= 3 and (out / "model.safetensors.index.json").is_file()
    return out


def _record(monkeypatch, function):
    """The first argument of every call of ``megatron.core.dist_checkpointing.<function>``."""
    from megatron.core import dist_checkpointing

    calls, original = [], getattr(dist_checkpointing, function)

    def recording(state, *args, **kwargs):
        calls.append(state)
        return original(state, *args, **kwargs)

    monkeypatch.setattr(dist_checkpointing, function, recording)
    return calls


@pytest.mark.parametrize("variant", ["none", "delta"])
def test_sharded_round_trip_streams_one_tensor_at_a_time(megatron_world1, sharded_llama, tmp_path, monkeypatch,
                                                         variant):
    """HF (shards + index) -> Megatron -> HF (shards + index): every tensor bitwise, the
    routing at its identity values, and the export loads in transformers (``none``)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from megatron_mhar.conversion.convert import hf_to_mcore, mcore_to_hf, plan_import

    saves = _record(monkeypatch, "save")
    mhar = dict(delta_block_layers=2) if variant == "delta" else {}
    ckpt = hf_to_mcore(plan_import(sharded_llama, tmp_path / "mcore", variant, seq_length=16, mhar_overrides=mhar))
    (saved,) = saves
    tensors = [t for t in nested_values(saved["model"]) if isinstance(t, ShardedTensor)]
    # SwiGLU's fc1 is saved as its two halves, each a tensor of its own
    assert sum(t.key.endswith("linear_fc1.weight") for t in tensors) == 2 * 4
    for tensor in tensors:
        assert tensor.data.is_contiguous(), tensor.key
        assert tensor.data.untyped_storage().nbytes() == tensor.data.numel() * tensor.data.element_size(), tensor.key

    loads = _record(monkeypatch, "load")
    out = mcore_to_hf(ckpt, tmp_path / "hf", max_shard_bytes=30_000)
    keys = [{t.key for t in nested_values(call["model"]) if isinstance(t, ShardedTensor)} for call in loads]
    assert all(len(k) == 1 for k in keys) and len({next(iter(k)) for k in keys}) == len(keys)  # one key per load

    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 3
    original, exported = read_safetensors(sharded_llama), read_safetensors(out)
    assert sorted(index["weight_map"]) == sorted(exported)
    for name, tensor in original.items():
        assert torch.equal(exported.pop(name), tensor), name
    for name, tensor in exported.items():  # what is left: the routing tensors of the delta variant
        assert variant == "delta" and "_router." in name
        assert bool((tensor == (1.0 if name.endswith("norm_weight") else 0.0)).all()), name
    if variant == "none":
        tokens = token_batch(1)
        assert torch.equal(hf_logits(out, tokens), hf_logits(sharded_llama, tokens))
