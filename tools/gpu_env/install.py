"""Install the Transformer Engine bundle on the GPU machine, from parts uploaded over
one or several runs.

    python -m tools.gpu_env.install --bundle DIR

DIR holds manifest.json and some or all of the parts. Each part found is checked
against the manifest (size, sha256) and copied into ``--store``, a folder on the GPU
machine that outlives the run while the machine stays warm. Once the store holds every
part, the archive is reassembled and checked, its wheels are checked, installed with
``pip install --no-index --find-links``, the installed pruned library's sha256 is
checked, and ``import transformer_engine.pytorch`` runs. Exit status: 0 installed,
3 parts still missing (run again with the rest), 1 a check failed, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tarfile
from importlib import metadata
from pathlib import Path

from tools.gpu_env import parts
from tools.gpu_env.extension import build_extension_wheel
from tools.gpu_env.manifest import MANIFEST_NAME, Manifest, ManifestError

DEFAULT_STORE = Path("/var/tmp/mhar_gpu_env")
EXIT_MISSING = 3
# Runs a Transformer Engine kernel (LayerNorm, from the pruned library's sm_90 cubins)
# and compares it with torch's.
GPU_SMOKE = """
import torch, transformer_engine.pytorch as te
x = torch.randn(64, 256, device="cuda")
ln = te.LayerNorm(256).cuda()
ref = torch.nn.functional.layer_norm(x, (256,), ln.weight, ln.bias, ln.eps)
err = (ln(x) - ref).abs().max().item()
assert err < 1e-4, f"TE LayerNorm differs from torch by {err}"
print(f"TE LayerNorm on {torch.cuda.get_device_name()} matches torch (max abs err {err:.2e})")
"""


class InstallError(RuntimeError):
    """A check failed; the message names what and how to fix it."""


def log(msg: str) -> None:
    print(f"[install] {msg}", flush=True)


def stage_parts(manifest: Manifest, bundle: Path, store: Path) -> list[str]:
    """Check the parts present in ``bundle``, copy them into ``store``, and return the
    names of the parts the store still lacks."""
    store.mkdir(parents=True, exist_ok=True)
    stored_manifest = store / MANIFEST_NAME
    if stored_manifest.exists():
        previous = Manifest.read(stored_manifest)
        if previous.archive != manifest.archive:
            raise InstallError(
                f"{store} holds parts of another bundle (archive sha256 {previous.archive.sha256[:12]}..., "
                f"this one {manifest.archive.sha256[:12]}...): pass another --store or delete {store}"
            )
    else:
        manifest.write(stored_manifest)
    for record in manifest.parts:
        source = bundle / record.name
        if not source.is_file():
            continue
        parts.check_part(source, record)
        target = store / record.name
        if source.resolve() != target.resolve():
            shutil.copyfile(source, target)
            parts.check_part(target, record)
        log(f"part {record.name} checked and stored")
    return parts.missing_parts(manifest.parts, store)


def unpack(manifest: Manifest, store: Path) -> Path:
    """Reassemble and check the archive, extract it, check every wheel; the wheels folder."""
    archive = parts.reassemble(manifest.parts, store, manifest.archive, store / manifest.archive.name)
    log(f"archive {archive.name} reassembled, sha256 matches")
    unpacked = store / "unpacked"
    if unpacked.exists():
        shutil.rmtree(unpacked)
    with tarfile.open(archive) as tar:
        # The archive's sha256 is the manifest's; the "data" filter (Python >= 3.11.4)
        # refuses links and paths outside the folder all the same.
        tar.extractall(unpacked, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    wheels_dir = unpacked / "wheels"
    found = {p.name for p in wheels_dir.iterdir()}
    expected = {w.name for w in manifest.wheels}
    if found != expected:
        raise InstallError(f"archive holds {sorted(found ^ expected)} unlike the manifest: rebuild the bundle")
    for record in manifest.wheels:
        got = parts.record_file(wheels_dir / record.name)
        if got != record:
            raise InstallError(f"{record.name} in the archive does not match the manifest's sha256: rebuild the bundle")
    log(f"{len(manifest.wheels)} files checked against the manifest")
    return wheels_dir


def pip_install(wheels_dir: Path, requirements: list[str], no_deps: bool) -> None:
    if not requirements:
        return
    cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--find-links", str(wheels_dir)]
    subprocess.run(cmd + (["--no-deps"] if no_deps else []) + requirements, check=True)


def check_pruned_library(manifest: Manifest) -> None:
    info = manifest.pruned_library
    if not info:
        log("bundle ships the unpruned library (built with --no-prune)")
        return
    dist = metadata.distribution("transformer_engine_cu13")
    installed = Path(dist.locate_file(info["path_in_wheel"]))
    if parts.sha256_file(installed) != info["pruned_sha256"]:
        raise InstallError(f"installed {installed} is not the bundle's pruned library (sha256 differs)")
    log(f"installed {installed} is the pruned library (sm {info['keep_arches']}), sha256 matches")


def prebuilt_extension(sdist: str, wheel: Path) -> Path:
    """``wheel`` if it is a build of ``sdist`` (same name and version, this Python's tag);
    the installer then skips the build (a wheel an earlier install left in ``$OUT``)."""
    name = sdist.removesuffix(".tar.gz")
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    if not wheel.is_file() or not wheel.name.startswith(f"{name}-") or f"-{tag}-" not in wheel.name:
        raise InstallError(f"--extension-wheel {wheel} is not a {name} wheel for {tag}: pass the wheel "
                           f"an earlier install built from {sdist}, or leave the option out to build it")
    return wheel


def install(manifest: Manifest, wheels_dir: Path, max_jobs: int, extension_wheel: Path | None = None) -> None:
    if manifest.unresolved_symbols:
        log("the core library needs symbols that torch's CUDA wheels lack: "
            f"{', '.join(manifest.unresolved_symbols)}; the import fails unless this machine holds newer ones")
    pip_install(wheels_dir, manifest.install_no_deps, no_deps=True)
    if manifest.build_sdists:
        # Build tools first (wheel, setuptools, the crt/ and CCCL headers), then the extension.
        pip_install(wheels_dir, ["wheel", "setuptools", "nvidia-cuda-crt", "nvidia-cuda-cccl"], no_deps=True)
        for sdist in manifest.build_sdists:
            if extension_wheel is not None:
                shutil.copy2(prebuilt_extension(sdist, extension_wheel), wheels_dir)
                log(f"using the prebuilt {extension_wheel.name}")
                continue
            built = build_extension_wheel(Path(sys.executable), wheels_dir / sdist, wheels_dir, max_jobs, wheels_dir)
            log(f"built {built.name}")
    pip_install(wheels_dir, manifest.install, no_deps=False)
    check_pruned_library(manifest)
    subprocess.run([sys.executable, "-c", manifest.import_check], check=True)
    log(f"`{manifest.import_check}` succeeded")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", type=Path, required=True, help="folder with manifest.json and uploaded parts")
    ap.add_argument("--store", type=Path, default=DEFAULT_STORE, help="where parts gather across runs")
    ap.add_argument("--stage-only", action="store_true", help="check and store the parts, install nothing")
    ap.add_argument("--max-jobs", type=int, default=16, help="compile jobs when the extension is built here")
    ap.add_argument("--gpu-smoke", action="store_true", help="then run a TE LayerNorm on the GPU against torch")
    ap.add_argument("--extension-wheel", type=Path,
                    help="a transformer_engine_torch wheel an earlier install built here: installed "
                         "instead of building the sdist again")
    args = ap.parse_args(argv)
    if not args.bundle.is_dir():
        ap.error(f"--bundle {args.bundle} is not a folder: pass the folder holding {MANIFEST_NAME} and the parts")
    try:
        manifest = Manifest.read(args.bundle / MANIFEST_NAME)
        missing = stage_parts(manifest, args.bundle, args.store)
        if missing:
            log(f"{len(manifest.parts) - len(missing)}/{len(manifest.parts)} parts in {args.store}; "
                f"still missing: {', '.join(missing)}. Upload them with {MANIFEST_NAME} and run this again.")
            return EXIT_MISSING
        if args.stage_only:
            log(f"all {len(manifest.parts)} parts are in {args.store}")
            return 0
        install(manifest, unpack(manifest, args.store), args.max_jobs, args.extension_wheel)
        if args.gpu_smoke:
            subprocess.run([sys.executable, "-c", GPU_SMOKE], check=True)
    except (ManifestError, parts.PartError, InstallError) as e:
        print(f"[install] error: {e}", file=sys.stderr)
        return 1
    except subprocess.CalledProcessError as e:
        print(f"[install] error: {' '.join(map(str, e.cmd))[:300]} exited with {e.returncode}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
