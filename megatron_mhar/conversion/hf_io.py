"""Reading and writing Hugging Face checkpoint directories (safetensors only).

Layout written by the export (``mcore_to_hf_mhar.py``)::

    out/
      config.json                    the source model's config (or one derived from the model);
                                     for MHAR models its MHAR form (mhar_* fields, auto_map)
      generation_config.json, tokenizer files     copied from the source, when known; else the
                                     run's tokenizer and its special tokens (pad set)
      README.md                      the model card (megatron_mhar.conversion.model_card)
      model.safetensors              or model-0000k-of-0000n.safetensors + model.safetensors.index.json;
                                     MHAR models hold their routing parameters here too
      configuration_mhar.py, modeling_mhar.py, depth_route.py, routing_layout.py
                                     only for MHAR models: the model's code (megatron_mhar/hf,
                                     megatron_mhar/ops/depth_route.py and routing_layout.py,
                                     copied verbatim)

Earlier exports of MHAR models held the routing parameters in a side file
(``mhar_params.safetensors`` and ``mhar_config.json``); the import refuses a directory
carrying one (:data:`SIDE_FILES`), which is exported again with the current tool.
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional

import torch

from megatron_mhar.files import TMP_PREFIX

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SIDE_FILES = ("mhar_params.safetensors", "mhar_config.json")
"""The routing side file of earlier MHAR exports, no longer read."""

# An MHAR export's code: file in the export -> its source under megatron_mhar/.
REMOTE_CODE = {
    "configuration_mhar.py": "hf/configuration_mhar.py",
    "modeling_mhar.py": "hf/modeling_mhar.py",
    "depth_route.py": "ops/depth_route.py",
    "routing_layout.py": "ops/routing_layout.py",
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
    """Lazy access to the tensors of an HF directory (one file or an index of shards).

    Each read maps its file only for as long as the returned tensor lives (safetensors
    maps rather than copies): a converter that drops each tensor once used holds a few
    tensors of the checkpoint in memory at any time, never whole shards.
    """

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
        self._dir = hf_dir
        self._where: Dict[str, str] = {}
        files = sorted(set(weight_map.values())) if weight_map else [SINGLE_FILE]
        for name in files:
            path = hf_dir / name
            if not path.is_file():
                raise FileNotFoundError(f"{index} names {name}, which does not exist")
            with _safetensors_read(path), safe_open(str(path), framework="pt") as handle:
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
        from safetensors import safe_open

        if name not in self._where:
            raise KeyError(f"HF checkpoint has no tensor {name!r}")
        path = self._dir / self._where[name]
        with _safetensors_read(path), safe_open(str(path), framework="pt") as handle:
            return handle.get_tensor(name)


DEFAULT_SHARD_BYTES = 2 * 2**30
"""Largest shard the export writes: an export holds at most one shard's tensors (and the
stored tensor being converted), so smaller shards keep its memory small."""


class ShardWriter:
    """Writes tensors as they come into safetensors shards of at most ``max_shard_bytes``
    (a tensor larger than that gets a shard of its own), as ``save_pretrained`` lays them
    out: ``model.safetensors``, or ``model-0000k-of-0000n.safetensors`` and an index.

    At most one shard's tensors are held: a shard is written once the next tensor would
    not fit, under a temporary name (the count of shards is known only at the end), and
    :meth:`close` gives the shards their final names and writes the index.
    """

    def __init__(self, out_dir: Path, max_shard_bytes: int = DEFAULT_SHARD_BYTES):
        if max_shard_bytes < 1:
            raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
        self.out_dir = Path(out_dir)
        self.max_shard_bytes = max_shard_bytes
        self._pending: Dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._written: List[List[str]] = []  # tensor names of each written shard
        self._names = set()
        self._total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._names:
            raise ValueError(f"tensor {name!r} is written twice")
        self._names.add(name)
        tensor = tensor.contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        self.make_room(nbytes)
        self._pending[name] = tensor
        self._pending_bytes += nbytes
        self._total_bytes += nbytes

    def make_room(self, nbytes: int) -> None:
        """Start a new shard unless ``nbytes`` more fit in the current one: a caller about to
        load that many bytes keeps the pending shard and those bytes within one shard's size."""
        if self._pending and self._pending_bytes + nbytes > self.max_shard_bytes:
            self._flush()

    def _flush(self) -> None:
        from safetensors.torch import save_file

        save_file(self._pending, str(self._shard_path(len(self._written))), metadata={"format": "pt"})
        self._written.append(list(self._pending))
        self._pending, self._pending_bytes = {}, 0

    def _shard_path(self, index: int) -> Path:
        return self.out_dir / f"{TMP_PREFIX}shard-{index:05d}.safetensors"

    def close(self) -> List[str]:
        """Write what is pending, name the shards, write the index; returns the file names."""
        if self._pending or not self._written:
            self._flush()
        count = len(self._written)
        if count == 1:
            os.replace(self._shard_path(0), self.out_dir / SINGLE_FILE)
            return [SINGLE_FILE]
        names = [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        weight_map = {}
        for i, (name, tensors) in enumerate(zip(names, self._written)):
            os.replace(self._shard_path(i), self.out_dir / name)
            weight_map.update({key: name for key in tensors})
        index = {"metadata": {"total_size": self._total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        return names


def min_transformers_version() -> str:
    """``MIN_TRANSFORMERS_VERSION`` of the shipped ``configuration_mhar.py``, read from its
    source: the export is written without importing transformers."""
    source = Path(__file__).resolve().parents[1] / REMOTE_CODE["configuration_mhar.py"]
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, ast.Assign) and [t.id for t in node.targets if isinstance(t, ast.Name)] == [
                "MIN_TRANSFORMERS_VERSION"]:
            return ast.literal_eval(node.value)
    raise RuntimeError(f"{source} assigns no MIN_TRANSFORMERS_VERSION")


def copy_remote_code(out_dir: Path) -> List[str]:
    """Copy the MHAR models' code into an export, for ``trust_remote_code=True`` loading.

    The files are those of this package (:data:`REMOTE_CODE`), byte for byte; the
    config's ``auto_map`` names them. Returns the file names written.
    """
    package = Path(__file__).resolve().parents[1]
    for name, source in REMOTE_CODE.items():
        shutil.copyfile(package / source, Path(out_dir) / name)
    return list(REMOTE_CODE)


def check_no_side_file(hf_dir: Path) -> None:
    """Refuse a directory carrying the routing side file of an earlier export: its routing
    parameters would otherwise be left behind unread."""
    found = [name for name in SIDE_FILES if (Path(hf_dir) / name).exists()]
    if found:
        raise ValueError(
            f"{hf_dir} carries {', '.join(found)}, the routing side file of an earlier MHAR export, "
            f"which this version does not read; export the Megatron checkpoint again with mcore-to-hf "
            f"(the routing parameters are then in the model's own safetensors)"
        )


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


def read_tokenizer_files(directory: Path) -> Dict[str, bytes]:
    """The tokenizer files of ``directory``, as they are, by name."""
    return {name: (Path(directory) / name).read_bytes() for name in TOKENIZER_FILES
            if (Path(directory) / name).is_file()}


def tokenizer_files(directory: Path) -> Dict[str, bytes]:
    """The tokenizer files of ``directory`` (one holding ``tokenizer.json``), by name.

    A directory without ``tokenizer_config.json`` (the builtin tokenizer a run trains) gets
    one for transformers' ``PreTrainedTokenizerFast`` that names its end-of-document token
    as the EOS token, so ``AutoTokenizer`` loads the export. A config naming no pad token
    gets the end-of-document token as one, as Qwen's tokenizers have it: batched generation
    and ``pipeline`` pad, and the attention mask hides what they pad.
    """
    from megatron_mhar.data.tokenizer import Tokenizer

    directory = Path(directory)
    if not (directory / "tokenizer.json").is_file():
        raise FileNotFoundError(f"--tokenizer {directory} has no tokenizer.json")
    files = read_tokenizer_files(directory)
    eod = Tokenizer.from_dir(str(directory)).eod_token
    if "tokenizer_config.json" in files:
        config = read_json_object(directory / "tokenizer_config.json")
    else:
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eod, "clean_up_tokenization_spaces": False}
    if "tokenizer_config.json" not in files or not config.get("pad_token"):
        config["pad_token"] = config.get("pad_token") or eod
        files["tokenizer_config.json"] = (json.dumps(config, indent=2) + "\n").encode()
    return files


def special_token_ids(files: Mapping[str, bytes], eod: int) -> Dict[str, int]:
    """``bos_token_id``, ``eos_token_id`` and ``pad_token_id`` of :func:`tokenizer_files`'
    result for a model trained with end-of-document id ``eod``: EOS is ``eod``; BOS and pad
    are the tokens ``tokenizer_config.json`` names, else ``eod`` (documents are separated by
    it in training, and Qwen's base models name it for all three)."""
    from tokenizers import Tokenizer as HFTokenizer

    vocab = HFTokenizer.from_str(files["tokenizer.json"].decode())
    config = json.loads(files["tokenizer_config.json"])
    ids = {"eos_token_id": eod}
    for key in ("bos", "pad"):
        token = config.get(f"{key}_token")
        token = token.get("content") if isinstance(token, dict) else token
        found = vocab.token_to_id(token) if token else None
        ids[f"{key}_token_id"] = eod if found is None else found
    return ids


def read_generation_config(hf_dir: Path) -> Optional[Dict[str, Any]]:
    """``generation_config.json`` of ``hf_dir``, or ``None`` where it has none."""
    path = Path(hf_dir) / "generation_config.json"
    return read_json_object(path) if path.is_file() else None


def write_generation_config(config: Mapping[str, Any], out_dir: Path) -> None:
    """``generation_config.json`` from ``config``'s special token ids (and its
    ``transformers_version``), for an export whose source has none."""
    fields = {key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id", "transformers_version")
              if config.get(key) is not None}
    (Path(out_dir) / "generation_config.json").write_text(json.dumps(fields, indent=2) + "\n")


def set_file_modes(directory: Path) -> None:
    """Give every file in ``directory`` the mode a new file gets (0666 less the umask), as
    ``config.json`` of ``save_pretrained`` has it: safetensors' writer makes its files 0600,
    which other users of a shared model directory cannot read."""
    umask = os.umask(0)  # reading the umask sets it: put it back at once
    os.umask(umask)
    for path in Path(directory).rglob("*"):
        if path.is_file() and not path.is_symlink():
            os.chmod(path, 0o666 & ~umask)


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
