"""The embedded corpora: text every Python install has, so runs train without a download.

``stdlib`` (the default recipe's): the ``.py`` files under ``sysconfig.get_paths()["stdlib"]``
(without ``site-packages`` and the test suites, about 10 MB on CPython 3.11).
``packages`` (the convergence benchmark's, :func:`package_files`): the documentation and
source text of the installed distributions, as their package registry (PyPI) ships them:
``.py``, ``.md``, ``.rst``, ``.txt`` and ``METADATA`` (the long description), deduplicated
by content (about 290 MB for this project's environment with torch and Megatron-Core).
Both are one document per file, in an order fixed by a hash of the file's name, so
Megatron's contiguous train/valid split (by document) draws both from all packages.

:func:`prepare_embedded` trains the builtin tokenizer on the corpus and writes
the Megatron ``.bin/.idx`` dataset once, into a directory named after the Python
version, vocabulary and size; it builds into a temporary directory and renames
it into place, so concurrent or interrupted builds never publish a partial one.

The builds live in a cache (:func:`embedded_root`): ``data.embedded_dir`` when set,
else ``{data.cache_dir}/embedded``, else ``$XDG_CACHE_HOME/megatron_mhar/embedded``
(``~/.cache/megatron_mhar/embedded`` when ``XDG_CACHE_HOME`` is unset); about 7 MB
for the whole corpus. Deleting it costs one rebuild.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import List, Optional

from megatron_mhar.data.indexed_writer import write_indexed_dataset
from megatron_mhar.data.tokenizer import Tokenizer, train_builtin_tokenizer

CACHE_NAME = "megatron_mhar"
EMBEDDED_SUBDIR = "embedded"

_SKIP_TOP = {"site-packages", "dist-packages", "test", "idlelib", "lib2to3", "tkinter", "turtledemo"}
_SKIP_ANY = {"test", "tests", "__pycache__"}
DATASET_NAME = "stdlib_text_document"
SOURCES = ("stdlib", "packages")
"""The embedded corpora (``prepare_embedded``'s ``source``)."""
PACKAGE_SUFFIXES = (".py", ".md", ".rst", ".txt")
PACKAGE_MIN_BYTES = 200  # empty ``__init__.py`` files, one-line stubs: no text to learn from
PACKAGE_MAX_BYTES = 1_000_000  # larger ones are data (word lists, generated tables), not text


def stdlib_files(max_bytes: Optional[int] = None) -> List[Path]:
    """The corpus' files in corpus order; with ``max_bytes``, a prefix of about that size."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).parts
        if parts[0] in _SKIP_TOP or _SKIP_ANY.intersection(parts[:-1]):
            continue
        files.append(path)
    if not files:
        raise RuntimeError(f"no standard-library sources under {root}; is this a full Python install?")
    key = lambda p: hashlib.sha1(p.relative_to(root).as_posix().encode()).hexdigest()
    files.sort(key=key)
    return _prefix(files, max_bytes)


def _prefix(files: List[Path], max_bytes: Optional[int]) -> List[Path]:
    if max_bytes is None:
        return files
    total, kept = 0, []
    for path in files:
        if total >= max_bytes:
            break
        kept.append(path)
        total += path.stat().st_size
    return kept


def _site_distributions():
    """The distributions installed in site-packages (not those a package vendors and puts
    on ``sys.path`` when imported, as setuptools does: the corpus must not depend on what
    the process imported before)."""
    import importlib.metadata

    paths = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    return list(importlib.metadata.distributions(path=paths))


def package_files(max_bytes: Optional[int] = None) -> List[Path]:
    """The ``packages`` corpus' files in corpus order (a hash of distribution and file
    name), each content once; with ``max_bytes``, a prefix of about that size."""
    named = {}
    for dist in _site_distributions():
        name = dist.metadata["Name"] or "unknown"
        for file in dist.files or []:
            if not (file.name == "METADATA" or file.suffix in PACKAGE_SUFFIXES):
                continue
            path = Path(dist.locate_file(file))
            if path.is_file() and PACKAGE_MIN_BYTES <= path.stat().st_size <= PACKAGE_MAX_BYTES:
                named.setdefault(f"{name}/{file.as_posix()}", path)
    if not named:
        raise RuntimeError("no installed distribution lists text files; is this a pip-installed environment?")
    seen, files = set(), []
    for key in sorted(named, key=lambda k: hashlib.sha1(k.encode()).hexdigest()):
        digest = hashlib.sha1(named[key].read_bytes()).digest()
        if digest not in seen:  # vendored copies and shared boilerplate count once
            seen.add(digest)
            files.append(named[key])
    return _prefix(files, max_bytes)


def packages_fingerprint() -> str:
    """A short hash of the installed distributions and versions: the ``packages`` corpus
    changes with them, so its builds are named by it."""
    names = sorted(f"{d.metadata['Name']}=={d.version}" for d in _site_distributions())
    return hashlib.sha1("\n".join(names).encode()).hexdigest()[:10]


def read_documents(files: List[Path]) -> List[str]:
    """File contents (undecodable bytes replaced)."""
    return [p.read_text(encoding="utf-8", errors="replace") for p in files]


@dataclasses.dataclass(frozen=True)
class EmbeddedData:
    """A built embedded dataset."""

    directory: Path
    """Holds ``tokenizer.json``, the ``.bin/.idx`` pair and ``manifest.json``."""

    @property
    def prefix(self) -> str:
        """The dataset prefix for ``data.paths``."""
        return str(self.directory / DATASET_NAME)

    def tokenizer(self) -> Tokenizer:
        """The builtin tokenizer trained on this corpus."""
        return Tokenizer.from_dir(str(self.directory))

    def manifest(self) -> dict:
        """Files, documents and tokens of the build."""
        return json.loads((self.directory / "manifest.json").read_text())


def embedded_root(embedded_dir: Optional[str] = None, cache_dir: Optional[str] = None) -> Path:
    """Where embedded builds live: ``embedded_dir``, else ``cache_dir/embedded``, else the
    user's cache, ``$XDG_CACHE_HOME/megatron_mhar/embedded`` (``~/.cache/...``)."""
    if embedded_dir:
        return Path(os.path.expanduser(embedded_dir))
    if cache_dir:
        return Path(os.path.expanduser(cache_dir)) / EMBEDDED_SUBDIR
    xdg = os.environ.get("XDG_CACHE_HOME")
    # The XDG spec: a relative XDG_CACHE_HOME is invalid and ignored.
    cache = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return cache / CACHE_NAME / EMBEDDED_SUBDIR


def embedded_data_dir(root: Optional[str], vocab_size: int, max_bytes: Optional[int] = None,
                      source: str = "stdlib") -> Path:
    """Where :func:`prepare_embedded` puts a build with these parameters under ``root``
    (``None``: :func:`embedded_root`'s default)."""
    version = f"py{sys.version_info.major}.{sys.version_info.minor}"
    size = "all" if max_bytes is None else f"{max_bytes}B"
    if source == "packages":
        return embedded_root(root) / f"packages-{packages_fingerprint()}-v{vocab_size}-{size}"
    return embedded_root(root) / f"stdlib-{version}-v{vocab_size}-{size}"


def prepare_embedded(
    root: Optional[str] = None, vocab_size: int = 4096, max_bytes: Optional[int] = None, source: str = "stdlib"
) -> EmbeddedData:
    """Build (once) the builtin tokenizer and the indexed dataset of the embedded corpus
    ``source`` (:data:`SOURCES`) under ``root`` (``None``: :func:`embedded_root`'s default);
    a build says so on stdout."""
    if source not in SOURCES:
        raise ValueError(f"unknown embedded corpus {source!r}; choose from {', '.join(SOURCES)}")
    if vocab_size < 260:  # the BPE trainer would silently stop at 257 (256 bytes + EOD)
        raise ValueError(
            f"the builtin tokenizer needs a vocabulary of >= 260 tokens (256 bytes + special "
            f"tokens), got {vocab_size}; raise data.embedded_vocab_size (preprocess: --vocab-size)"
        )
    if max_bytes is not None and max_bytes <= 0:
        raise ValueError(
            f"the embedded corpus needs a positive byte budget, got {max_bytes}; set "
            f"data.embedded_max_bytes (preprocess: --embedded-max-bytes) > 0, or null for all of it"
        )
    target = embedded_data_dir(root, vocab_size, max_bytes, source)
    if (target / "manifest.json").is_file():
        return EmbeddedData(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    start = time.perf_counter()
    try:
        files = stdlib_files(max_bytes) if source == "stdlib" else package_files(max_bytes)
        docs = read_documents(files)
        size = sum(len(d) for d in docs) / 1e6
        print(
            f"building the embedded corpus once ({len(files)} {source} files, {size:.1f} MB): "
            f"training a {vocab_size}-token tokenizer and tokenizing into {target} ...",
            flush=True,
        )
        tokenizer = train_builtin_tokenizer(docs, vocab_size, tmp)
        stats = write_indexed_dataset(docs, tokenizer, str(tmp / DATASET_NAME))
        manifest = dict(
            source=sysconfig.get_paths()["stdlib"] if source == "stdlib" else f"packages {packages_fingerprint()}",
            python=sys.version.split()[0],
            files=len(files),
            bytes=sum(p.stat().st_size for p in files),
            vocab_size=tokenizer.vocab_size,
            **stats,
        )
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "manifest.json").is_file():  # not a concurrent build that won
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"built the embedded corpus in {time.perf_counter() - start:.0f} s: {target}", flush=True)
    return EmbeddedData(target)
