"""Build the Transformer Engine bundle for the GPU machine (H200, sm_90, no package index).

    python -m tools.gpu_env.build_bundle --out /work/gpuenv-build/bundle

downloads the pinned inputs from PyPI, prunes ``libtransformer_engine.so`` to the kept
architectures (other payloads zeroed in place), proves the kept cubins unchanged,
builds the ``transformer_engine_torch`` extension for CPython 3.12 against torch
2.11.0+cu130 (or ships its sdist with ``--extension-build gpu``), and writes
``<out>/manifest.json`` and the archive's parts, each small enough for one upload.
install.py installs the bundle on the GPU machine. Downloads and build outputs go
under ``--work`` and are reused when present.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tarfile
import venv
from pathlib import Path

from tools.gpu_env import cubins, fatbin, linkcheck, parts, wheels
from tools.gpu_env.extension import build_extension_wheel
from tools.gpu_env.manifest import MANIFEST_NAME, Manifest

# Pinned inputs. torch is the GPU machine's own (2.11.0+cu130, the PyPI Linux wheel);
# it is installed here only to build the extension, resolve dependencies and check
# the core library's symbols. --te-version changes the three Transformer Engine pins.
TE_VERSION = "2.20.2"
TE_PACKAGES = ("transformer_engine_cu13", "transformer_engine", "transformer_engine_torch")
PINS = {
    "transformer_engine_cu13": TE_VERSION,
    "transformer_engine": TE_VERSION,
    "transformer_engine_torch": TE_VERSION,
    "megatron-core": "0.19.2",
    "nvidia-cudnn-frontend": "1.32.0",
    "nvidia-cuda-crt": "13.0.88",
    "nvidia-cuda-cccl": "13.0.85",
    "nvidia-cuda-cuobjdump": "13.5.37",
    "torch": "2.11.0",
}
# transformer_engine_torch's install_requires (less torch and nvidia-cudnn-frontend,
# installed apart) and megatron-core's numpy.
RUNTIME_REQUIREMENTS = ["einops", "onnxscript", "onnx", "packaging", "pydantic", "nvdlfw-inspect", "numpy"]
# What torch 2.11.0+cu130 brings with it on the GPU machine: never shipped.
PROVIDED_BY_TORCH = re.compile(r"^(torch|triton|cuda-.*|nvidia-(?!cudnn-frontend$).*)$")
# Already in the GPU machine's image (its package list, read 2026-11-17): not shipped
# unless --ship-present; pip there uses the installed versions.
PRESENT_ON_GPU = {
    "einops", "filelock", "fsspec", "jinja2", "markupsafe", "ml-dtypes", "mpmath", "networkx", "numpy", "onnx",
    "onnx-ir", "onnxscript", "packaging", "protobuf", "pyyaml", "setuptools", "sympy", "typing-extensions",
    "wheel", "zipp",
}
LIBRARY = "transformer_engine/wheel_lib/libtransformer_engine.so"
BUILD_HEADERS = ("nvidia-cuda-crt", "nvidia-cuda-cccl", "nvidia-cudnn-frontend")
ARCHIVE_NAME = "gpu_env_bundle.tar"
MIB = 1 << 20


def log(msg: str) -> None:
    print(f"[build_bundle] {msg}", flush=True)


def pin(name: str) -> str:
    return f"{name}=={PINS[name]}"


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def make_build_venv(python: Path, work: Path) -> Path:
    """A CPython 3.12 venv with torch 2.11.0 and the extension's build dependencies."""
    env_dir = work / "venv312"
    py = env_dir / "bin" / "python"
    if not py.exists():
        version = subprocess.run([str(python), "-c", "import sys; print(sys.version_info[:2])"],
                                 capture_output=True, text=True, check=True).stdout.strip()
        if version != "(3, 12)":
            raise SystemExit(f"--python {python} is Python {version}; the GPU machine runs 3.12: pass a 3.12 interpreter")
        subprocess.run([str(python), "-m", "venv", str(env_dir)], check=True)
        pip = [str(py), "-m", "pip", "install", "-q"]
        subprocess.run(pip + [pin("torch"), "setuptools<82", "wheel", "packaging", "ninja"], check=True)
    # Headers torch's wheels lack (crt/, CCCL's nv/target, cudnn-frontend) and cuobjdump.
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps"] + [pin(n) for n in BUILD_HEADERS]
                   + [pin("nvidia-cuda-cuobjdump")], check=True)
    return py


def resolve_runtime(py: Path, work: Path, ship_present: bool) -> list[tuple[str, str]]:
    """(name, version) of every runtime wheel to ship: the dependency closure of TE,
    megatron-core and the runtime requirements, less what torch brings (and, unless
    ``ship_present``, less what the GPU image already holds)."""
    report = work / "resolve.json"
    reqs = [pin("transformer_engine_cu13"), pin("transformer_engine"), pin("megatron-core"), pin("torch")]
    subprocess.run([str(py), "-m", "pip", "install", "--dry-run", "--ignore-installed", "--only-binary=:all:",
                    "-q", "--report", str(report)] + reqs + RUNTIME_REQUIREMENTS, check=True)
    found = [(i["metadata"]["name"], i["metadata"]["version"]) for i in json.loads(report.read_text())["install"]]
    skip = set() if ship_present else PRESENT_ON_GPU
    return sorted((n, v) for n, v in found if not PROVIDED_BY_TORCH.match(canonical(n)) and canonical(n) not in skip)


def download(py: Path, dest: Path, requirements: list[str], sdist: bool = False) -> None:
    cmd = [str(py), "-m", "pip", "download", "-q", "--no-deps", "-d", str(dest)]
    cmd += ["--no-binary", ":all:", "--no-build-isolation"] if sdist else ["--only-binary=:all:"]
    subprocess.run(cmd + requirements, check=True)


def find_one(folder: Path, pattern: str) -> Path:
    found = sorted(folder.glob(pattern))
    if len(found) != 1:
        raise FileNotFoundError(f"expected one {pattern} in {folder}, found {[p.name for p in found]}")
    return found[0]


def find_wheel(folder: Path, name: str, version: str) -> Path:
    """The wheel of ``name`` ``version`` in ``folder`` (names compared as pip does)."""
    found = [p for p in folder.glob("*.whl")
             if canonical(p.name.split("-")[0]) == canonical(name) and p.name.split("-")[1] == version]
    if len(found) != 1:
        raise FileNotFoundError(f"expected one wheel of {name}=={version} in {folder}, found {[p.name for p in found]}")
    return found[0]


def check_links(py: Path, core_wheel: Path, work: Path, allow: bool) -> list[str]:
    """Refuse (unless ``allow``) a core library that needs symbols that the CUDA
    libraries of torch's wheels do not define: ctypes would fail to load it."""
    site = Path(cuobjdump_path(py)).parents[3]
    library = work / "lib" / "linkcheck.so"
    library.parent.mkdir(parents=True, exist_ok=True)
    library.write_bytes(wheels.read_member(core_wheel, LIBRARY))
    missing = linkcheck.unresolved_symbols(library, [site / "nvidia", site / "torch" / "lib"])
    library.unlink()
    if not missing:
        log("link check: every versioned symbol of the core library is defined by torch's CUDA wheels")
    elif allow:
        log(f"link check: unresolved against torch's CUDA wheels (allowed): {', '.join(missing)}")
    else:
        raise SystemExit(
            f"{core_wheel.name}: {LIBRARY} needs {', '.join(missing)}, which torch {PINS['torch']}'s CUDA wheels "
            "do not define, so importing it would fail. Pick a Transformer Engine version built against "
            "them (--te-version), or pass --allow-unresolved-symbols if the GPU machine holds newer libraries."
        )
    return missing


def cuobjdump_path(py: Path) -> Path:
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    return Path(site) / "nvidia" / "cu13" / "bin" / "cuobjdump"


def prune_and_verify(py: Path, core_wheel: Path, work: Path, keep: set[int], out_wheels: Path) -> tuple[Path, dict]:
    """Prune the core wheel's library, prove the kept cubins unchanged, repack the wheel."""
    lib_dir = work / "lib"
    lib_dir.mkdir(exist_ok=True)
    original, pruned = lib_dir / "libtransformer_engine.so", lib_dir / "pruned" / "libtransformer_engine.so"
    pruned.parent.mkdir(exist_ok=True)
    original.write_bytes(wheels.read_member(core_wheel, LIBRARY))
    report = fatbin.prune_file(original, pruned, keep)
    log(f"pruned: kept {len(report.kept)} entries ({report.kept_bytes} B), zeroed {len(report.zeroed)} ({report.zeroed_bytes} B)")
    fatbin.check_pruned(original.read_bytes(), pruned.read_bytes(), keep)
    log("structure check: only the other architectures' payloads differ, and they are zero")
    reference = cubins.cuobjdump_cubins(cuobjdump_path(py), original, keep)
    from_pruned = cubins.kept_cubins(pruned, keep)
    if reference != from_pruned:
        only = sorted(set(reference) ^ set(from_pruned))
        differ = sorted(k for k in set(reference) & set(from_pruned) if reference[k] != from_pruned[k])
        raise SystemExit(f"cubin check failed: names on one side only {only}, hashes differ {differ}")
    log(f"cubin check: {len(reference)} cubins and PTX files from cuobjdump -xelf/-xptx (original) == decompressed from the pruned library")
    repacked = wheels.replace_in_wheel(core_wheel, out_wheels, {LIBRARY: pruned})
    pruned_sha = parts.sha256_file(pruned)
    if hashlib.sha256(wheels.read_member(repacked, LIBRARY)).hexdigest() != pruned_sha:
        raise SystemExit(f"{repacked.name} does not hold the pruned library")
    return repacked, {
        "path_in_wheel": LIBRARY,
        "wheel": repacked.name,
        "keep_arches": sorted(keep),
        "original_sha256": parts.sha256_file(original),
        "pruned_sha256": pruned_sha,
        "size": pruned.stat().st_size,
        "entries_kept": len(report.kept),
        "entries_zeroed": len(report.zeroed),
        "payload_bytes_zeroed": report.zeroed_bytes,
        "cubins_sha256": reference,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for manifest.json and the parts")
    ap.add_argument("--work", type=Path, default=Path("/work/gpuenv-build/work"), help="downloads and build outputs")
    ap.add_argument("--python", type=Path, default=None, help="a CPython 3.12 interpreter (default: python3.12 on PATH)")
    ap.add_argument("--keep-arch", type=int, action="append", default=None, help="compute capability x10 to keep (default 90)")
    ap.add_argument("--te-version", default=TE_VERSION, help="Transformer Engine version (core, meta, torch)")
    ap.add_argument("--allow-unresolved-symbols", action="store_true",
                    help="bundle a core library that needs symbols torch's CUDA wheels lack (for a GPU machine "
                         "known to hold newer ones); they are recorded in the manifest")
    ap.add_argument("--no-prune", action="store_true",
                    help="ship the core library unpruned (all architectures; about six times the parts)")
    ap.add_argument("--part-mib", type=int, default=48,
                    help="largest part, MiB: one upload carries a part with the whole working tree, 64 MiB in all")
    ap.add_argument("--ship-present", action="store_true", help="also ship the packages the GPU image already has")
    ap.add_argument("--extension-build", choices=["here", "gpu"], default="here",
                    help="build transformer_engine_torch here, or ship its sdist and build on the GPU machine")
    ap.add_argument("--max-jobs", type=int, default=2, help="parallel compile jobs for the extension build here")
    args = ap.parse_args(argv)
    keep = set(args.keep_arch or [90])
    te_version = args.te_version
    PINS.update({name: te_version for name in TE_PACKAGES})
    python = args.python or (Path(shutil.which("python3.12")) if shutil.which("python3.12") else None)
    if python is None:
        raise SystemExit("no python3.12 on PATH: pass --python /path/to/python3.12 (its headers are needed)")
    work, out = args.work.resolve(), args.out.resolve()
    downloads, staged = work / "downloads", work / "stage" / "wheels"
    for d in (downloads, staged):
        d.mkdir(parents=True, exist_ok=True)
    for old in staged.iterdir():
        old.unlink()

    py = make_build_venv(python, work)
    runtime = resolve_runtime(py, work, args.ship_present)
    log(f"runtime wheels to ship: {', '.join(f'{n}=={v}' for n, v in runtime)}")
    download(py, downloads, [f"{n}=={v}" for n, v in runtime] + [pin("nvidia-cudnn-frontend")])
    download(py, downloads, [pin("transformer_engine_torch")], sdist=True)
    if args.extension_build == "gpu":
        download(py, downloads, [pin("nvidia-cuda-crt"), pin("nvidia-cuda-cccl"), "wheel", "setuptools<82"])

    core = find_one(downloads, f"transformer_engine_cu13-{te_version}-*.whl")
    unresolved = check_links(py, core, work, args.allow_unresolved_symbols)
    if args.no_prune:
        shutil.copy2(core, staged)
        pruned_info = {}
    else:
        _, pruned_info = prune_and_verify(py, core, work, keep, staged)
    for name, version in runtime + [("nvidia-cudnn-frontend", PINS["nvidia-cudnn-frontend"])]:
        if canonical(name) == "transformer-engine-cu13":
            continue
        shutil.copy2(find_wheel(downloads, name, version), staged)
    sdist = find_one(downloads, f"transformer_engine_torch-{te_version}.tar.gz")
    build_sdists: list[str] = []
    if args.extension_build == "here":
        ext_dir = work / "extension"
        built = sorted(ext_dir.glob(f"transformer_engine_torch-{te_version}-cp312-*.whl"))
        wheel = built[0] if built else build_extension_wheel(py, sdist, ext_dir, args.max_jobs)
        log(f"extension wheel: {wheel.name}")
        shutil.copy2(wheel, staged)
    else:
        shutil.copy2(sdist, staged)
        for extra in ("nvidia_cuda_crt-*.whl", "nvidia_cuda_cccl-*.whl", "wheel-*.whl", "setuptools-*.whl"):
            shutil.copy2(find_one(downloads, extra), staged)
        build_sdists.append(sdist.name)

    archive = work / ARCHIVE_NAME
    with tarfile.open(archive, "w") as tar:
        for path in sorted(staged.iterdir()):
            tar.add(path, arcname=f"wheels/{path.name}")
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob(f"{ARCHIVE_NAME}.part*"):
        old.unlink()
    manifest = Manifest(
        archive=parts.record_file(archive),
        parts=parts.split_file(archive, out, args.part_mib * MIB),
        wheels=[parts.record_file(p) for p in sorted(staged.iterdir())],
        install=[pin("transformer_engine_cu13"),
                 pin("transformer_engine"), pin("transformer_engine_torch"), pin("megatron-core")],
        install_no_deps=[pin("nvidia-cudnn-frontend")],
        build_sdists=build_sdists,
        packages={**{n: v for n, v in runtime}, **{k: v for k, v in PINS.items() if k != "nvidia-cuda-cuobjdump"}},
        pruned_library=pruned_info,
        unresolved_symbols=unresolved,
    )
    manifest.write(out / MANIFEST_NAME)
    total = sum(p.size for p in manifest.parts)
    log(f"archive {manifest.archive.size / MIB:.1f} MiB in {len(manifest.parts)} parts ({total} B); manifest {out / MANIFEST_NAME}")
    for w in manifest.wheels:
        log(f"  {w.size / MIB:8.2f} MiB  {w.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
