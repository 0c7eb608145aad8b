"""The package as a user installs it: a wheel (not editable), used from outside the checkout.

A wheel of this checkout (its tracked files and untracked ones git does not ignore) is
built with the running interpreter's setuptools and installed without dependencies
into a fresh virtual environment. The dependencies (torch, Megatron-Core, ...) come from
the running environment through a ``.pth`` file listing its site-packages, so nothing
is downloaded; a ``--system-site-packages`` venv would not do, since a venv made from
a venv sees the base interpreter's site-packages, not the running venv's. Commands run
without ``PYTHONPATH`` from a directory outside the checkout, so the recipes and the
code can only come from the installed copy.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# A launcher's variables in the job's environment would make mhar-train rendezvous.
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _run(cmd, cwd, env=None, timeout=300):
    result = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{result.stdout}\n{result.stderr}"
    return result


def _copy_sources(dest: Path) -> None:
    """The files a clone would have (plus untracked, unignored ones): a build in the
    checkout itself would pack whatever an earlier build left in ``build/``."""
    listed = _run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], REPO).stdout
    for name in filter(None, listed.split("\0")):
        source = REPO / name
        if source.is_file():  # a tracked file deleted in the working tree is not copied
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)


def _running_environment(python: Path, root: Path) -> None:
    """Give the venv of ``python`` the running environment's packages (plain paths, so that
    environment's .pth files, an editable install's hook among them, stay unread)."""
    purelib = _run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], root)
    dependencies = site.getsitepackages() + ([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])
    (Path(purelib.stdout.strip()) / "running_environment.pth").write_text("\n".join(dependencies) + "\n")


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """``(bin directory, environment)`` of a venv holding the installed wheel, and a clean
    working directory outside the checkout."""
    root = tmp_path_factory.mktemp("install")
    source, dist, venv = root / "src", root / "dist", root / "venv"
    _copy_sources(source)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
          "--no-cache-dir", "--wheel-dir", dist, source], root)
    (wheel,) = dist.glob("megatron_mhar-*.whl")
    _run([sys.executable, "-m", "venv", "--without-pip", venv], root)
    python = venv / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index",
          "--no-cache-dir", wheel], root)
    _running_environment(python, root)  # after the install: pip must not see the running copy
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and k not in LAUNCHER_VARIABLES}
    work = root / "work"
    work.mkdir()
    return venv / "bin", env, work


def test_installed_package_is_the_wheel(installed):
    bin_dir, env, work = installed
    code = "import megatron_mhar, megatron_mhar.training.recipes as r; print(megatron_mhar.__file__); print(r.RECIPES_DIR)"
    module, recipes = _run([bin_dir / "python", "-c", code], work, env).stdout.split()
    venv = bin_dir.parent.resolve()
    assert Path(module).resolve().is_relative_to(venv), module
    assert Path(recipes).resolve().is_relative_to(venv) and (Path(recipes) / "smoke_cpu.yaml").is_file()
    assert (Path(recipes) / "base" / "pretrain.yaml").is_file()  # what the recipes include


def test_checkout_without_install_finds_its_recipes(tmp_path):
    """``python -m`` from the root of a checkout that is not installed reads the checkout's
    ``recipes/``, which an install ships as ``megatron_mhar/recipes``."""
    source, venv = tmp_path / "src", tmp_path / "venv"
    _copy_sources(source)
    _run([sys.executable, "-m", "venv", "--without-pip", venv], tmp_path)
    _running_environment(venv / "bin" / "python", tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and k not in LAUNCHER_VARIABLES}
    code = "import megatron_mhar.training.recipes as r; print(r.RECIPES_DIR)"
    recipes = _run([venv / "bin" / "python", "-c", code], source, env).stdout.strip()
    assert Path(recipes) == source / "recipes"


def test_mhar_train_smoke_recipe_from_outside_the_checkout(installed):
    """``mhar-train smoke_cpu training.train_iters=2``; the embedded corpus at a test size."""
    bin_dir, env, work = installed
    assert not work.resolve().is_relative_to(REPO)
    embedded = work.parent / "embedded"
    _run([bin_dir / "mhar-train", "smoke_cpu", "training.train_iters=2", "optimizer.lr_warmup_iters=1",
          f"data.embedded_dir={embedded}", "data.embedded_max_bytes=200000", "data.split=80,20,0"],
         work, env, timeout=600)
    run_dir = work / "runs" / "smoke_cpu"  # the recipe's run.output_dir, relative to the working directory
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["iteration"] == 2 and summary["name"] == "smoke_cpu"
    train = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in train if r.get("kind") == "train"][-1] == 2
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "iter_0000002"
    assert "smoke_cpu" in (run_dir / "config.yaml").read_text()


@pytest.mark.parametrize("command", [
    pytest.param(["mhar-convert", "--help"], id="convert"),
    pytest.param(["mhar-convert", "hf-to-mcore", "--help"], id="convert-hf-to-mcore"),
    pytest.param(["mhar-convert", "mcore-to-hf", "--help"], id="convert-mcore-to-hf"),
    pytest.param(["mhar-preprocess", "--help"], id="preprocess"),
    pytest.param(["mhar-train", "--help"], id="train"),
])
def test_console_scripts_help(installed, command):
    bin_dir, env, work = installed
    out = _run([bin_dir / command[0], *command[1:]], work, env).stdout
    assert out.startswith(f"usage: {' '.join(command[:-1])}")


def test_mhar_convert_runs_the_conversion(installed):
    """The subcommand reaches the library: a directory without config.json is refused (exit 2)."""
    bin_dir, env, work = installed
    empty = work / "not_a_model"
    empty.mkdir(exist_ok=True)
    result = subprocess.run(
        [str(bin_dir / "mhar-convert"), "hf-to-mcore", "--hf-dir", str(empty), "--out", str(work / "o"),
         "--variant", "none"], cwd=work, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "has no config.json" in result.stderr
