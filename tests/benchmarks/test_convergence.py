"""``benchmarks.bench_convergence``: the golden CPU loss curves, the check that guards them,
the summary table and the package corpus it trains on by default.

The golden file, ``benchmarks/results/convergence/cpu.json``, holds the validation curves of
every variant of the ``golden_cpu`` case over three seeds, the commit and command that made
it and its tolerance (a fraction of the seed spread it measured). A change that moves a
curve beyond the tolerance fails ``test_golden_curves_hold``; it regenerates the file with
the file's ``regenerate`` command in the same commit, saying why the curves moved.
"""

import copy
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import bench_convergence

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "benchmarks" / "results" / "convergence" / "cpu.json"


@pytest.fixture(scope="module")
def golden():
    return json.loads(GOLDEN.read_text())


def test_golden_curves_hold(golden, tmp_path):
    """Every variant of the golden case, trained again with the golden's first seed, stays
    within the golden tolerance at every evaluation (CI: about a minute on 2 cores)."""
    seed = min(int(key.split("/")[2]) for key in golden["runs"])
    out = tmp_path / "now.json"
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_convergence", "--case", "golden_cpu", "--seeds", str(seed),
         "--check", str(GOLDEN), "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    moved = [line for line in result.stdout.splitlines() if line.startswith("moved:")]
    assert result.returncode == 0, "\n".join(moved) or result.stdout[-3000:] + result.stderr[-3000:]
    now = json.loads(out.read_text())["runs"]
    assert set(now) == {k for k in golden["runs"] if k.endswith(f"/{seed}")}
    # The delta model starts as the baseline converted at step 0: the same first loss.
    assert now[f"local/mhar_delta/{seed}"]["first_loss"] == now[f"local/baseline/{seed}"]["first_loss"]


def test_golden_file_states_its_origin_and_tolerance(golden):
    assert len(golden["commit"]) == 40 and "bench_convergence" in golden["regenerate"]
    assert set(bench_convergence.VARIANTS) == {key.split("/")[1] for key in golden["runs"]}
    assert len({key.split("/")[2] for key in golden["runs"]}) >= 3  # the spread is measured over seeds
    spread = golden["seed_spread"]
    assert golden["tolerance"] == pytest.approx(0.25 * spread["median"])
    # Below every variant's typical seed-to-seed difference: a move the size of what another
    # seed does fails for every variant.
    assert golden["tolerance"] < min(statistics.median(stds) for stds in spread["per_variant"].values())


@pytest.mark.parametrize("shift, moved", [
    pytest.param(0.99, False, id="within-tolerance"),  # float noise of another CPU passes
    pytest.param(1.01, True, id="beyond-tolerance"),   # just past it, one point of one run fails
])  # fmt: skip
def test_check_flags_a_moved_point(golden, shift, moved):
    report = copy.deepcopy(golden)
    key = next(iter(report["runs"]))
    step, loss = report["runs"][key]["val"][-1]
    report["runs"][key]["val"][-1] = [step, loss + shift * golden["tolerance"]]
    problems = bench_convergence.check_golden(report, golden)
    assert bool(problems) == moved
    if moved:
        assert problems[0].startswith(f"{key} step {step}")


def test_check_refuses_another_corpus(golden):
    report = dict(golden, corpus_sha1="0" * 40)
    (problem,) = bench_convergence.check_golden(report, golden)
    assert "the corpus differs" in problem and golden["regenerate"] in problem


def test_summary_pairs_each_seed_with_its_baseline():
    runs = {"local/baseline/1": {"val": [[10, 5.0]]}, "local/baseline/2": {"val": [[10, 5.2]]},
            "local/mhar/1": {"val": [[10, 4.9]]}, "local/mhar/2": {"val": [[10, 5.0]]}}
    table = bench_convergence.summarize(runs)
    assert table["local/mhar"]["mean"] == pytest.approx(4.95)
    assert table["local/mhar"]["paired_diff_mean"] == pytest.approx(-0.15)
    assert table["local/mhar"]["paired_diff_std"] == pytest.approx(0.0707107, rel=1e-5)
    assert table["local/baseline"]["paired_diff_mean"] == 0
    assert "| local/mhar | 2 | 4.9500 |" in bench_convergence.markdown(table)


def test_variants_take_the_case_depth():
    """The tiny cases' 4 layers: blocks of 2 sublayers and delta blocks of one layer, so
    that block and delta routing have more than one block to route over."""
    case = bench_convergence.CASES["golden_cpu"]
    assert bench_convergence.variant_routing("mhar_block", case).block_size == 2
    assert bench_convergence.variant_routing("mhar_delta", case).delta_block_layers == 1
    assert bench_convergence.variant_routing("mhar_tau8", case).logit_scale == 8.0
    assert bench_convergence.variant_routing("mhar@num_heads=4", case).num_heads == 4
    with pytest.raises(ValueError, match="unknown variant"):
        bench_convergence.variant_routing("mhar_wide", case)


def test_package_corpus_is_deduplicated_and_ordered():
    import hashlib

    from megatron_mhar.data.corpus import package_files, packages_fingerprint

    files = package_files(max_bytes=2_000_000)
    assert files == package_files(max_bytes=2_000_000)
    digests = [hashlib.sha1(p.read_bytes()).digest() for p in files]
    assert len(set(digests)) == len(digests)
    assert "site-packages" in str(files[0])
    assert packages_fingerprint() == packages_fingerprint()
