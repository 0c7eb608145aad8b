"""Reading and writing Hugging Face checkpoint directories (safetensors only).

Layout written by the export (``mcore_to_hf_mhar.py``)::

    out/
      config.json                    the source model's config (or one derived from the model);
                                     for MHAR models its MHAR form (mhar_* fields, auto_map)
      generation_config.json, tokenizer files     copied from the source, when known
      model.safetensors              or model-0000k-of-0000n.safetensors + model.safetensors.index.json;
                                     MHAR models hold their routing parameters here too
      configuration_mhar.py, modeling_mhar.py, depth_route.py
                                     only for MHAR models: the model's code (megatron_mhar/hf and
                                     megatron_mhar/ops/depth_route.py, copied verbatim)

Earlier exports of MHAR models held the routing parameters in a side file that
transformers ignores, which ``hf_to_mcore_mhar.py`` still reads back:
``mhar_params.safetensors`` (every routing parameter under its Megatron name with the
global 0-based layer index, ``decoder.layers.3.input_router.query``;
``decoder.final_router.*`` for the final site of the full and block variants) and
``mhar_config.json`` (``{"format", "variant", "mhar", "model", "source_checkpoint"}``,
repeated in the safetensors metadata).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional

import torch

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MHAR_CONFIG_FILE = "mhar_config.json"
MHAR_PARAMS_FILE = "mhar_params.safetensors"
SIDE_FILE_FORMAT = "megatron_mhar.routing.v1"

# An MHAR export's code: file in the export -> its source under megatron_mhar/.
REMOTE_CODE = {
    "configuration_mhar.py": "hf/configuration_mhar.py",
    "modeling_mhar.py": "hf/modeling_mhar.py",
    "depth_route.py": "ops/depth_route.py",
}

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
)

# Files of an HF model directory carried along unchanged (tokenizer, generation settings).
AUXILIARY_FILES = ("generation_config.json",) + TOKENIZER_FILES


def read_config(hf_dir: Path) -> Dict[str, Any]:
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{hf_dir} has no config.json; is it a Hugging Face model directory?")
    return read_json_object(path)


def read_json_object(path: Path) -> Dict[str, Any]:
    """A JSON file holding one object, or a ``ValueError`` naming the file."""
    try:
        raw = json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON ({err}); restore it from the model's source") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path} holds a {type(raw).__name__}, expected a JSON object")
    return raw


class SafetensorsReader:
    """Lazy access to the tensors of an HF directory (one file or an index of shards)."""

    def __init__(self, hf_dir: Path):
        from safetensors import safe_open

        hf_dir = Path(hf_dir)
        index = hf_dir / INDEX_FILE
        if index.is_file():
            weight_map = read_json_object(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{index} has no 'weight_map' object")
        elif (hf_dir / SINGLE_FILE).is_file():
            weight_map = None
        else:
            found = sorted(p.name for p in hf_dir.glob("*.bin")) + sorted(p.name for p in hf_dir.glob("*.pt"))
            hint = f" (found {', '.join(found)}: re-save with safe_serialization=True)" if found else ""
            raise FileNotFoundError(f"{hf_dir} has neither {SINGLE_FILE} nor {INDEX_FILE}{hint}")
        self._files: Dict[str, Any] = {}
        self._where: Dict[str, str] = {}
        files = sorted(set(weight_map.values())) if weight_map else [SINGLE_FILE]
        for name in files:
            path = hf_dir / name
            if not path.is_file():
                raise FileNotFoundError(f"{index} names {name}, which does not exist")
            with _safetensors_read(path):
                handle = safe_open(str(path), framework="pt")
            self._files[name] = handle
            for key in handle.keys():
                self._where[key] = name
        if weight_map is not None:
            missing = sorted(k for k, f in weight_map.items() if self._where.get(k) != f)
            if missing:
                raise ValueError(f"{index} lists tensors its shards do not hold: {missing[:8]}")

    def keys(self) -> List[str]:
        return sorted(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise KeyError(f"HF checkpoint has no tensor {name!r}")
        return self._files[self._where[name]].get_tensor(name)


def write_safetensors(
    tensors: Mapping[str, torch.Tensor], out_dir: Path, max_shard_bytes: int = 5 * 2**30
) -> List[str]:
    """Write ``tensors`` like ``save_pretrained``: one file, or shards plus an index."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    shards: List[Dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        tensor = tensors[name].contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out_dir / SINGLE_FILE), metadata={"format": "pt"})
        return [SINGLE_FILE]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for name, shard in zip(names, shards):
        save_file(shard, str(out_dir / name), metadata={"format": "pt"})
        weight_map.update({key: name for key in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return names


def copy_remote_code(out_dir: Path) -> List[str]:
    """Copy the MHAR models' code into an export, for ``trust_remote_code=True`` loading.

    The files are those of this package (:data:`REMOTE_CODE`), byte for byte; the
    config's ``auto_map`` names them. Returns the file names written.
    """
    package = Path(__file__).resolve().parents[1]
    for name, source in REMOTE_CODE.items():
        shutil.copyfile(package / source, Path(out_dir) / name)
    return list(REMOTE_CODE)


def read_mhar_side_file(hf_dir: Path) -> Optional[tuple]:
    """``(description, routing tensors)`` if the directory has the MHAR side file, else None."""
    hf_dir = Path(hf_dir)
    config, params = hf_dir / MHAR_CONFIG_FILE, hf_dir / MHAR_PARAMS_FILE
    if not config.is_file() and not params.is_file():
        return None
    if not (config.is_file() and params.is_file()):
        raise FileNotFoundError(
            f"{hf_dir} has only one of {MHAR_CONFIG_FILE} and {MHAR_PARAMS_FILE}; both or neither"
        )
    from safetensors.torch import load_file

    description = read_json_object(config)
    if description.get("format") != SIDE_FILE_FORMAT:
        raise ValueError(
            f"{config}: format {description.get('format')!r}, expected {SIDE_FILE_FORMAT!r}"
        )
    with _safetensors_read(params):
        return description, load_file(str(params))


@contextlib.contextmanager
def _safetensors_read(path: Path) -> Iterator[None]:
    """A safetensors reader's failure on ``path`` as a ``ValueError`` naming the file."""
    from safetensors import SafetensorError

    try:
        yield
    except SafetensorError as err:
        raise ValueError(
            f"{path} is not a readable safetensors file ({err}); it is truncated or corrupt: download or copy it again"
        ) from None


def tokenizer_files(directory: Path) -> Dict[str, bytes]:
    """The tokenizer files of ``directory`` (one holding ``tokenizer.json``), by name.

    A directory without ``tokenizer_config.json`` (the builtin tokenizer a run trains) gets
    one for transformers' ``PreTrainedTokenizerFast`` that names its end-of-document token
    as the EOS token, so ``AutoTokenizer`` loads the export.
    """
    from megatron_mhar.data.tokenizer import Tokenizer

    directory = Path(directory)
    if not (directory / "tokenizer.json").is_file():
        raise FileNotFoundError(f"--tokenizer {directory} has no tokenizer.json")
    files = {name: (directory / name).read_bytes() for name in TOKENIZER_FILES if (directory / name).is_file()}
    if "tokenizer_config.json" not in files:
        eos = Tokenizer.from_dir(str(directory)).eod_token
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos,
                  "clean_up_tokenization_spaces": False}
        files["tokenizer_config.json"] = (json.dumps(config, indent=2) + "\n").encode()
    return files


def write_tokenizer(files: Mapping[str, bytes], out_dir: Path) -> None:
    """Write :func:`tokenizer_files`' result into ``out_dir`` (replacing copied tokenizer files)."""
    for name in TOKENIZER_FILES:
        (Path(out_dir) / name).unlink(missing_ok=True)
    for name, data in files.items():
        (Path(out_dir) / name).write_bytes(data)


def copy_auxiliary(src: Path, dst: Path, names: Iterable[str] = AUXILIARY_FILES) -> List[str]:
    """Copy tokenizer and generation files that exist in ``src``; returns their names."""
    copied = []
    for name in names:
        if (Path(src) / name).is_file():
            shutil.copy2(Path(src) / name, Path(dst) / name)
            copied.append(name)
    return copied


def fsync_tree(path: Path) -> None:
    """Flush every file and directory under ``path`` to disk before it is published."""
    for root, dirs, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
