"""Build the ``transformer_engine_torch`` C++ extension from its sdist.

Shared by build_bundle.py (building on the CPU machine) and install.py (building on
the GPU machine when the bundle ships the sdist). The extension is a CppExtension: g++
and headers only, no nvcc. Its CUDA, cuBLAS, cuDNN and NCCL headers come from the
``nvidia-*`` wheels that torch installs, plus ``nvidia-cuda-crt`` and ``nvidia-cuda-cccl``
(the ``crt/`` and ``nv/target`` headers that ``cuda_runtime.h`` and ``cuda_fp16.h``
include) and ``nvidia-cudnn-frontend``.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

# NVTE_CUDA_ARCHS=90 keeps NCCL EP enabled (it needs an arch >= 90), matching the
# PyPI core library, which ships libnccl_ep.so.
BUILD_ENV = {
    "NVTE_BUILD_USE_NVIDIA_WHEELS": "1",
    "NVTE_PYTORCH_FORCE_BUILD": "TRUE",
    "NVTE_CUDA_ARCHS": "90",
}


_INCLUDE_DIRS = """
import importlib.metadata, pathlib, nvidia
dirs = [p / "include" for d in nvidia.__path__ for p in sorted(pathlib.Path(d).iterdir()) if (p / "include").is_dir()]
try:
    dirs.append(pathlib.Path(importlib.metadata.distribution("nvidia-cudnn-frontend").locate_file("include")))
except importlib.metadata.PackageNotFoundError:
    pass
print("\\n".join(str(d) for d in dirs if d.is_dir()))
"""


def header_dirs(python: Path) -> list[str]:
    """The ``include`` folders of the ``nvidia-*`` wheels (CUDA, cuBLAS, cuDNN, NCCL)
    and of ``nvidia-cudnn-frontend`` installed for ``python``."""
    out = subprocess.run([str(python), "-c", _INCLUDE_DIRS], capture_output=True, text=True, check=True).stdout
    return out.split()


def build_extension_wheel(
    python: Path, sdist: Path, out_dir: Path, max_jobs: int, find_links: Path | None = None
) -> Path:
    """Build ``sdist`` into a wheel in ``out_dir`` with ``python`` (which has torch)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # Older releases take only a CUDA toolkit's include folder (no cuDNN or NCCL headers
    # there) when one exists: CPATH adds the wheels' headers behind it.
    cpath = ":".join(header_dirs(python) + [p for p in [os.environ.get("CPATH")] if p])
    env = {**os.environ, **BUILD_ENV, "MAX_JOBS": str(max_jobs), "CPATH": cpath}
    cmd = [str(python), "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-w", str(out_dir)]
    if find_links is not None:
        cmd += ["--no-index", "--find-links", str(find_links)]
    subprocess.run(cmd + [str(sdist)], check=True, env=env)
    name = Path(sdist).name.removesuffix(".tar.gz")
    built = sorted(out_dir.glob(f"{name}-*.whl"))
    if len(built) != 1:
        raise FileNotFoundError(f"expected one {name} wheel in {out_dir}, found {[p.name for p in built]}")
    return built[0]
