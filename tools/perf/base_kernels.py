"""Another revision's fused kernels beside this checkout's, for timing a kernel change in one run.

    python -m tools.perf.base_kernels REV DIR     # in the git checkout: REV's kernels into DIR
    python -m benchmarks.bench_training --base-kernels DIR --cuda-graph full_iteration \\
        --models baseline,mhar_lookahead,mhar_lookahead@kernels=base ...
    python -m tools.perf.compare_kernels DIR      # kernel by kernel, times and bits

A kernel change worth a few milliseconds per step is smaller than the spread between runs
on different GPUs of one model, so it shows only where both kernels train in one run,
interleaved, against one baseline. ``export`` writes the ``mhar_kernels`` package of a
revision into ``DIR/mhar_kernels`` and the commit into ``DIR/REVISION``. ``load`` imports
that package (its subpackages too) under another name, beside the installed one; inside
``active`` an ``import mhar_kernels`` finds it instead.
``megatron_mhar.ops`` imports the kernels when a routing history is made (every forward),
so a model whose forwards and backwards run inside ``active`` routes with the other
revision's kernels. The benchmark runs each such model's steps inside it. The other
revision must offer the functions this checkout's ``megatron_mhar`` calls; where it does
not, the model fails on its first step and names the missing function.
"""

import argparse
import contextlib
import hashlib
import importlib
import importlib.util
import io
import subprocess
import sys
import tarfile
from pathlib import Path
from types import ModuleType
from typing import Dict, Iterator

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "mhar_kernels"
ALIAS = "mhar_kernels_base"  # the other revision's package, as sys.modules holds it


def export(revision: str, directory) -> str:
    """Writes ``revision``'s ``mhar_kernels`` into ``directory/mhar_kernels`` and the
    commit into ``directory/REVISION``; returns the commit. Refuses a directory that
    already holds a package (nothing there is overwritten)."""
    target = Path(directory)
    if (target / PACKAGE).exists():
        raise FileExistsError(f"{target / PACKAGE} exists; remove it or export into another directory")
    resolved = subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{revision}^{{commit}}"],
                              cwd=ROOT, capture_output=True, text=True)  # fmt: skip
    if resolved.returncode != 0:
        raise ValueError(f"{revision!r} is not a commit of the checkout at {ROOT}")
    commit = resolved.stdout.strip()
    archive = subprocess.run(["git", "archive", "--format=tar", commit, PACKAGE], cwd=ROOT,
                             capture_output=True, check=True).stdout  # fmt: skip
    target.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        # git's own archive of one package; the safe filter where this Python has it (3.11.4+).
        tar.extractall(target, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    (target / "REVISION").write_text(commit + "\n")
    return commit


def describe(directory) -> Dict[str, str]:
    """Where a kernel tree came from: its REVISION (if exported here) and a SHA-256 over
    its package's Python files, to record next to the timings."""
    package = Path(directory) / PACKAGE
    digest = hashlib.sha256()
    for path in _python_files(package):
        digest.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes())
    revision = Path(directory) / "REVISION"
    return {"directory": str(directory), "revision": revision.read_text().strip() if revision.is_file() else None,
            "sha256": digest.hexdigest()}  # fmt: skip


def _python_files(package: Path):
    return sorted(package.rglob("*.py"))


def _module_names(package: Path):
    """Dotted names of the modules and subpackages under ``package``, parents first."""
    names = []
    for path in _python_files(package):
        parts = path.relative_to(package).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts:
            names.append(".".join(parts))
    return sorted(names, key=lambda name: (name.count("."), name))


def load(directory) -> Dict[str, ModuleType]:
    """The ``mhar_kernels`` package under ``directory`` imported as ``mhar_kernels_base``,
    with every module of it: {the name each has in this checkout: module}."""
    package_dir = Path(directory) / PACKAGE
    init = package_dir / "__init__.py"
    if not init.is_file():
        raise ValueError(f"{directory} holds no {PACKAGE}/__init__.py; write another revision's kernels "
                         f"there with: python -m tools.perf.base_kernels REV {directory}")
    if ALIAS in sys.modules:
        raise RuntimeError(f"{ALIAS} is already imported: one other kernel tree per process")
    names = _module_names(package_dir)
    # The installed modules first, so that ``active`` has them to restore (those of the
    # other tree's names that this checkout has).
    installed = set(_module_names(Path(importlib.import_module(PACKAGE).__file__).parent))
    for name in names:
        if name in installed:
            importlib.import_module(f"{PACKAGE}.{name}")
    spec = importlib.util.spec_from_file_location(ALIAS, init, submodule_search_locations=[str(package_dir)])
    package = importlib.util.module_from_spec(spec)
    sys.modules[ALIAS] = package
    spec.loader.exec_module(package)
    modules = {PACKAGE: package}
    for name in names:  # imported as ALIAS.<name>: its relative imports stay in the tree
        modules[f"{PACKAGE}.{name}"] = importlib.import_module(f"{ALIAS}.{name}")
    return modules


@contextlib.contextmanager
def active(modules: Dict[str, ModuleType]) -> Iterator[None]:
    """Inside, ``import mhar_kernels`` and its modules resolve to ``modules``; the
    installed ones are back afterwards."""
    saved = {name: sys.modules.get(name) for name in modules}
    sys.modules.update(modules)
    try:
        yield
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("revision", help="a commit, branch or tag of this checkout")
    parser.add_argument("directory", help="where its mhar_kernels package goes (carry it to the GPU machine)")
    args = parser.parse_args(argv)
    try:
        commit = export(args.revision, args.directory)
    except (ValueError, FileExistsError) as err:
        parser.error(str(err))
    print(f"{args.directory}/{PACKAGE}: the kernels of {commit}")


if __name__ == "__main__":
    main()
