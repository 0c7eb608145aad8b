"""A conversion's output directory: checked, locked and staged beside its place while it is
written, renamed into place whole once complete (:func:`publish`).

A converted Megatron checkpoint (``mhar-convert hf-to-mcore``)::

    out/
      latest                  text: iter_0000000
      iter_0000000/           one megatron.core.dist_checkpointing checkpoint
        common.pt, metadata.json, __*.distcp
        train_config.yaml     the model and mhar sections a recipe must repeat
        conversion.json       the conversion record: source, architecture, dtype, layout, and
                              the source's config.json and generation_config.json
        hf/                   the source config.json and tokenizer files (for the export)
        manifest.json         every other file's size and checksum (megatron_mhar.checkpoint.manifest)

It has the training driver's layout (:mod:`megatron_mhar.checkpoint.format`), so
``checkpoint.load`` of a recipe points at it directly; there is no optimizer state, so a
run starting from it sets ``checkpoint.load_model_only: true``. The conversion record is
also the ``conversion`` entry of the common state, which the training driver carries into
every checkpoint of a run started from it (and of its resumes): an export of any of them
restores the source model's config (:data:`SOURCE_CONFIG`). An export
(``mhar-convert mcore-to-hf``) is a Hugging Face directory, staged and published the same way.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Tuple

from megatron_mhar.checkpoint import manifest
from megatron_mhar.checkpoint.format import checkpoint_name, is_complete, staging_dir
from megatron_mhar.files import fsync_dir, nearest_existing
from megatron_mhar.runtime.lock import DirectoryLock

ITERATION_DIR = checkpoint_name(0)
OLD_PREFIX = ".old."
CONVERSION_FILE = "conversion.json"
SOURCE_CONFIG = "hf_config"
"""Conversion-record entry: the source model's ``config.json``, as it was."""
SOURCE_GENERATION_CONFIG = "hf_generation_config"
"""Conversion-record entry: the source's ``generation_config.json`` (``None`` if it had none)."""


def check_output(out: Path, overwrite: bool, inputs: Tuple[Path, ...] = ()) -> None:
    """Raise unless ``out`` may be (re)placed without touching anything it must not.

    ``--overwrite`` replaces an existing output directory, never a file, and never a
    directory that is or holds one of the conversion's ``inputs``.
    """
    out = Path(out).absolute()
    parent = nearest_existing(out.parent)
    if not parent.is_dir():
        raise ValueError(f"--out {out}: {parent} is a file, not a directory; choose another --out")
    if not out.exists():
        return
    for path in inputs:
        path = Path(path).resolve()
        if path == out.resolve() or out.resolve() in path.parents:
            raise ValueError(
                f"--out {out} is or contains the input {path}; writing it would delete the input. "
                f"Choose an --out outside it"
            )
    if not overwrite:
        raise FileExistsError(f"{out} exists; choose a new --out or pass --overwrite")
    if not out.is_dir():
        raise FileExistsError(f"{out} is a file; --overwrite replaces only a directory; choose another --out")


def output_lock(out: Path) -> DirectoryLock:
    """The lock a conversion holds on ``out`` while it writes (:mod:`megatron_mhar.runtime.lock`;
    its file ``.lock.<name>`` lies beside ``out``, which does not exist before the end): a
    second conversion into ``out`` refuses instead of deleting the first one's staging directory."""
    out = Path(out).absolute()
    return DirectoryLock(out.parent / f".lock.{out.name}", f"output {out}", "choose another --out")


def prepare_output(out: Path, overwrite: bool, inputs: Tuple[Path, ...] = ()) -> Tuple[Path, DirectoryLock]:
    """Take ``out``'s lock (:func:`output_lock`), check ``out`` may be written
    (:func:`check_output`) and make a fresh, empty staging directory; returns it and the
    lock, which the caller releases once the output is published or cleaned up."""
    out = Path(out).absolute()
    check_output(out, overwrite, inputs)  # before the lock file is made beside it
    lock = output_lock(out).acquire()
    try:
        check_output(out, overwrite, inputs)  # again: another conversion may have published it meanwhile
        tmp = staging_dir(out)
        if tmp.exists():  # an interrupted earlier conversion
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    except BaseException:
        lock.release()
        raise
    return tmp, lock


def publish(tmp: Path, out: Path) -> Path:
    """Rename the complete staging directory to ``out`` (replacing an old ``out``), once
    each checkpoint in it has its manifest."""
    from megatron_mhar.conversion.hf_io import fsync_tree

    for iteration_dir in sorted(Path(tmp).glob("iter_*")):
        if is_complete(iteration_dir):
            manifest.write_manifest(iteration_dir)
    out = Path(out).absolute()
    fsync_tree(tmp)
    old = None
    if out.exists():
        old = out.parent / f"{OLD_PREFIX}{out.name}"
        if old.exists():
            shutil.rmtree(old)
        os.rename(out, old)
    os.rename(tmp, out)
    fsync_dir(out.parent)
    if old is not None:
        shutil.rmtree(old)
    return out
