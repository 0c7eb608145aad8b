"""The Slurm launchers on a real one-node Slurm cluster, in their CPU smoke configuration.

``tests/slurm/setup_cluster.sh`` (run as root; CI runs it before pytest) installs
munge, slurmctld, slurmd and shellcheck from the distribution's packages and starts a
one-node cluster on localhost. These tests submit the production scripts
(``slurm/pretrain_1b_mhar.sh``, ``slurm/cpt_8b_mhar_delta.sh``) with ``sbatch``,
changed only by overrides: ``--gpus-per-node=0 --ntasks-per-node=1 -N 1`` on the
sbatch command line (one CPU rank), ``RECIPE=smoke_cpu`` and a tiny
model as training overrides.

* ``uninterrupted``: the pretrain script runs ``STEPS`` steps to the end; it must
  train every step and publish a checkpoint.
* ``preempted``: the CPT script runs the same training (the two scripts differ only
  in their defaults). Once it has trained a few steps it gets SIGUSR1 exactly as
  ``--signal=B:USR1@...`` delivers it before a time limit (``scancel --batch
  --signal=USR1``: to the batch shell only). The launcher must forward it to the
  ranks, which save and exit; the launcher requeues the job; the requeued job must
  resume from that checkpoint and its losses (and gradient norms and learning rates)
  must be bitwise those of the uninterrupted run.
* ``periodic``: as ``preempted``, but a periodic checkpoint is written before the
  signal, as in every production recipe (expected to fail until the driver shields
  Megatron's checkpoint-writer helper process from the step's signals; see the test).

Without Slurm the tests skip with the reason; with ``MHAR_REQUIRE_SLURM=1`` (CI) a
missing cluster fails them instead. Every wait is bounded; the module takes about
three minutes on an idle 2-core machine.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import pytest

REPO = Path(__file__).resolve().parents[2]
SETUP = REPO / "tests" / "slurm" / "setup_cluster.sh"
SCRIPTS = {
    "pretrain": REPO / "slurm" / "pretrain_1b_mhar.sh",
    "cpt": REPO / "slurm" / "cpt_8b_mhar_delta.sh",
    "cpt_moe": REPO / "slurm" / "cpt_30b_a3b_mhar_delta.sh",
}
LAUNCHER = REPO / "slurm" / "launch.sh"
CLUSTER_DIR = Path(os.environ.get("MHAR_SLURM_DIR", "/tmp/megatron_mhar_slurm"))
REQUIRED = os.environ.get("MHAR_REQUIRE_SLURM") == "1"

STEPS = 80
"""Steps of both runs: enough that a signal sent after step SIGNAL_AFTER lands mid-run."""
SIGNAL_AFTER = 3
"""Send SIGUSR1 once the preempted run has logged this many steps (its handler is set)."""
PERIODIC_STEPS = 40
"""Steps of the run that also saves every 2 steps."""
BUDGET_S = float(os.environ.get("MHAR_SLURM_TEST_BUDGET_S", 480))
"""The whole module: every wait draws on this one deadline (raise it on a loaded machine)."""

# A tiny model on a small slice of the embedded corpus: one step is milliseconds of math.
SMOKE_OVERRIDES = [
    "run.seed=1234",
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.num_query_groups=2",
    "model.ffn_hidden_size=128",
    "model.seq_length=64",
    "model.vocab_size=512",
    "mhar.num_heads=4",
    f"training.train_iters={STEPS}",
    "training.global_batch_size=4",
    "training.micro_batch_size=2",
    "optimizer.lr_warmup_iters=5",
    "eval.interval=0",
    "eval.iters=1",
    "logging.interval=1",
    "logging.tensorboard=false",
    "checkpoint.interval=0",          # the only mid-run checkpoint is the signal's
    "data.embedded_vocab_size=512",
    "data.embedded_max_bytes=1000000",
    "data.split=80,20,0",
]
# --time: far enough that the scripts' own --signal=B:USR1@<t> never fires during the test.
SMOKE_SBATCH = ["-N", "1", "--gpus-per-node=0", "--ntasks-per-node=1", "--time=00:30:00"]
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED"}


def _unavailable(reason: str) -> None:
    if REQUIRED:
        pytest.fail(f"{reason} (MHAR_REQUIRE_SLURM=1)")
    pytest.skip(reason)


# ------------------------------------------------------------------------------ cluster


class Cluster:
    """Client side of the test cluster: sbatch/scontrol/scancel with its SLURM_CONF."""

    def __init__(self, conf: Path, deadline: float):
        self.env = dict(os.environ, SLURM_CONF=str(conf))
        self.deadline = deadline

    def run(self, *cmd: str, env: Optional[Dict[str, str]] = None, check: bool = True) -> str:
        out = subprocess.run(
            cmd, cwd=REPO, env=env or self.env, capture_output=True, text=True, timeout=60
        )
        if check and out.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr.strip()}")
        return out.stdout

    def job(self, job_id: str) -> Dict[str, str]:
        """``scontrol show job`` as a dict (JobState, Restarts, ExitCode, ...)."""
        for attempt in range(5):  # a busy slurmctld may drop a query (scontrol dies of SIGPIPE)
            try:
                text = self.run("scontrol", "show", "job", "-o", job_id)
                break
            except RuntimeError:
                if attempt == 4:
                    raise
                time.sleep(1)
        fields: Dict[str, str] = {}
        key = None
        for token in text.split():
            if "=" in token:
                key, _, value = token.partition("=")
                fields[key] = value
            elif key is not None:  # a value with spaces
                fields[key] += " " + token
        return fields

    def wait(self, what: str, predicate, poll_s: float = 0.5, diagnose=None):
        """Poll ``predicate()`` until it returns something truthy, within the module budget."""
        while True:
            result = predicate()
            if result:
                return result
            if time.monotonic() > self.deadline:
                details = diagnose() if diagnose else ""
                pytest.fail(f"timed out waiting for {what} (module budget {BUDGET_S}s)\n{details}")
            time.sleep(poll_s)

    def daemon_logs(self) -> str:
        return "\n".join(_tail(CLUSTER_DIR / name, 15) for name in ("slurmctld.log", "slurmd.log"))


def _tail(path: Path, lines: int = 40) -> str:
    if not path.is_file():
        return f"--- {path}: missing"
    text = path.read_text(errors="replace").splitlines()
    return f"--- {path} (last {lines} lines)\n" + "\n".join(text[-lines:])


@pytest.fixture(scope="module")
def cluster() -> Cluster:
    missing = [tool for tool in ("sbatch", "scontrol", "scancel", "sinfo") if not shutil.which(tool)]
    if missing:
        _unavailable(
            f"Slurm is not installed ({', '.join(missing)} missing); run `{SETUP.relative_to(REPO)}` "
            "as root to install and start a one-node cluster"
        )
    conf = CLUSTER_DIR / "slurm.conf"
    up = subprocess.run(["bash", str(SETUP), "status"], capture_output=True)
    if up.returncode:
        if os.geteuid() != 0:
            _unavailable(f"the test cluster ({conf}) is not running; start it as root: {SETUP} start")
        started = subprocess.run(["bash", str(SETUP), "start"], capture_output=True, text=True, timeout=180)
        if started.returncode:
            pytest.fail(f"{SETUP} start failed:\n{started.stderr}")
    return Cluster(conf, deadline=time.monotonic() + BUDGET_S)


# ------------------------------------------------------------------------------ jobs


class Job:
    """One submitted smoke job: its id, run directory and log."""

    def __init__(self, cluster: Cluster, script: str, run_name: str, root: Path, extra: List[str] = ()):
        self.cluster = cluster
        self.name = run_name
        self.root = root
        self.run_dir = root / "runs" / run_name
        log_pattern = root / f"{run_name}-%j.log"
        env = dict(
            cluster.env,
            RECIPE="smoke_cpu",
            RUN_NAME=run_name,
            OUTPUT_DIR=str(root / "runs"),
            PYTHON=sys.executable,
        )
        # The embedded corpus is built once, by the first job, in the test's directory.
        overrides = SMOKE_OVERRIDES + [f"data.embedded_dir={root / 'embedded'}", *extra]
        out = cluster.run(
            "sbatch", "--parsable", *SMOKE_SBATCH, f"--output={log_pattern}",
            str(SCRIPTS[script]), *overrides, env=env,
        )
        self.id = out.strip().split(";")[0]
        self.log = Path(str(log_pattern).replace("%j", self.id))

    def info(self) -> Dict[str, str]:
        return self.cluster.job(self.id)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.is_file() else ""

    def train_records(self) -> List[dict]:
        path = self.run_dir / "metrics.jsonl"
        if not path.is_file():
            return []
        records = []
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:  # a line being written
                break
        return [r for r in records if r.get("kind") == "train"]

    def diagnose(self) -> str:
        info = self.info()
        state = {k: info.get(k) for k in ("JobState", "Reason", "Restarts", "ExitCode", "RunTime")}
        return f"job {self.id} ({self.name}): {state}\n{_tail(self.log)}\n{self.cluster.daemon_logs()}"

    def wait_final(self, restarts: int = 0) -> Dict[str, str]:
        """Wait until the job ended, after ``restarts`` requeues."""

        def done():
            info = self.info()
            if info.get("JobState") in FINAL_STATES and int(info.get("Restarts", 0)) >= restarts:
                return info
            return None

        return self.cluster.wait(f"job {self.id} ({self.name}) to end", done, diagnose=self.diagnose)


@pytest.fixture(scope="module")
def jobs(cluster, tmp_path_factory):
    """The smoke jobs, submitted at once; the node is exclusive, so they run in turn."""
    root = tmp_path_factory.mktemp("slurm")
    submitted = {}
    try:
        submitted["uninterrupted"] = Job(cluster, "pretrain", "uninterrupted", root)
        submitted["preempted"] = Job(cluster, "cpt", "preempted", root)
        yield submitted
    finally:
        for job in submitted.values():
            cluster.run("scancel", job.id, check=False)


def _checkpoint_step(run_dir: Path) -> int:
    latest = run_dir / "checkpoints" / "latest"
    assert latest.is_file(), f"no {latest}"
    name = latest.read_text().strip()
    assert (run_dir / "checkpoints" / name / "metadata.json").is_file(), f"{name} is not a complete checkpoint"
    return int(re.fullmatch(r"iter_(\d+)", name).group(1))


# ------------------------------------------------------------------------------ tests


def test_scripts_are_shellcheck_clean():
    if not shutil.which("shellcheck"):
        _unavailable("shellcheck is not installed; tests/slurm/setup_cluster.sh install adds it")
    scripts = sorted((REPO / "slurm").glob("*.sh")) + [SETUP]
    out = subprocess.run(["shellcheck", "--external-sources", *map(str, scripts)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_scripts_request_signal_and_requeue(script):
    """The directives the preemption path relies on (the cluster test sends USR1 itself)."""
    directives = re.findall(r"^#SBATCH\s+(\S+)", SCRIPTS[script].read_text(), flags=re.M)
    signal = [d for d in directives if d.startswith("--signal=")]
    assert len(signal) == 1 and re.fullmatch(r"--signal=B:USR1@(\d+)", signal[0]), signal
    assert int(signal[0].rsplit("@", 1)[1]) >= 120, "leave the ranks time to save"
    assert "--requeue" in directives
    assert "--open-mode=append" in directives  # one log per job, across requeues
    assert 'exec bash "$REPO_DIR/slurm/launch.sh" "$@"' in SCRIPTS[script].read_text()


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_scripts_name_a_wrong_submit_directory(script, tmp_path):
    """Submitted from outside the checkout: a named error, not bash's 'No such file' (no Slurm needed)."""
    env = dict(os.environ, SLURM_JOB_ID="1", SLURM_SUBMIT_DIR=str(tmp_path))
    env.pop("REPO_DIR", None)
    out = subprocess.run(["bash", str(SCRIPTS[script])], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 2, out.stderr  # launcher errors exit 2, as every command does
    assert f"REPO_DIR={tmp_path} has no slurm/launch.sh; submit from the megatron_mhar" in out.stderr


def test_job_trains_and_checkpoints(cluster, jobs):
    job = jobs["uninterrupted"]
    info = job.wait_final()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", job.diagnose()
    assert info["Restarts"] == "0"
    steps = [r["step"] for r in job.train_records()]
    assert steps == list(range(1, STEPS + 1)), job.diagnose()
    assert _checkpoint_step(job.run_dir) == STEPS
    summary = json.loads((job.run_dir / "summary.json").read_text())
    assert summary["iteration"] == STEPS and summary["stopped_by"] is None
    log = job.log_text()
    assert "1 ranks (CPU)" in log and "training exited with status 0" in log, log


def test_signal_checkpoints_requeues_and_resumes_exactly(cluster, jobs):
    reference, job = jobs["uninterrupted"], jobs["preempted"]

    # Let it train a few steps (the trainer's signal handler is installed by then).
    cluster.wait(
        f"job {job.id} to log {SIGNAL_AFTER} steps",
        lambda: len(job.train_records()) >= SIGNAL_AFTER and job.info().get("JobState") == "RUNNING",
        poll_s=0.1,
        diagnose=job.diagnose,
    )
    # What --signal=B:USR1@<t> does before the time limit: USR1 to the batch shell only.
    cluster.run("scancel", "--batch", "--signal=USR1", job.id)

    info = job.wait_final(restarts=1)
    log = job.log_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", job.diagnose()
    assert info["Restarts"] == "1", job.diagnose()

    # The launcher forwarded the signal, the ranks saved at a step boundary and exited,
    # the launcher requeued the job, and the requeued run resumed from that checkpoint.
    assert "received SIGUSR1: forwarding it to the ranks" in log, log
    stopped = re.search(r"received SIGUSR1 at step (\d+): checkpoint saved, exiting", log)
    assert stopped, log
    saved_step = int(stopped.group(1))
    assert SIGNAL_AFTER <= saved_step < STEPS, f"signal landed at step {saved_step}"
    assert f"requeueing job {job.id}" in log, log
    resumed = re.search(r"resumed from (\S+) at step (\d+)", log)
    assert resumed, log
    assert Path(resumed.group(1)).name == f"iter_{saved_step:07d}" and int(resumed.group(2)) == saved_step
    assert "run 2, restarts so far: 1" in log and "training exited with status 0" in log, log
    assert _checkpoint_step(job.run_dir) == STEPS

    # Interrupted + resumed == uninterrupted, bitwise, for every step.
    ours, theirs = job.train_records(), reference.train_records()
    assert [r["step"] for r in ours] == list(range(1, STEPS + 1))
    for key in ("loss", "grad_norm", "lr"):
        mismatched = [
            (a["step"], a[key], b[key]) for a, b in zip(ours, theirs) if a[key] != b[key]
        ]
        assert not mismatched, f"{key} differs from the uninterrupted run at (step, resumed, reference): {mismatched[:5]}"


def test_signal_after_periodic_checkpoint_requeues(cluster, jobs):
    # Submitted only now: a pending job would take the node while `preempted` waits to
    # be requeued.
    jobs["periodic"] = job = Job(
        cluster, "pretrain", "periodic", jobs["uninterrupted"].root,
        extra=["checkpoint.interval=2", f"training.train_iters={PERIODIC_STEPS}"],
    )
    cluster.wait(
        f"job {job.id} to log {SIGNAL_AFTER} steps after a checkpoint",
        lambda: len(job.train_records()) >= SIGNAL_AFTER
        and (job.run_dir / "checkpoints" / "latest").is_file()
        and job.info().get("JobState") == "RUNNING",
        poll_s=0.1,
        diagnose=job.diagnose,
    )
    cluster.run("scancel", "--batch", "--signal=USR1", job.id)

    # Requeued after the signal's checkpoint, or failed: both end the wait.
    def ended():
        info = job.info()
        restarted = int(info.get("Restarts", 0)) >= 1
        if info.get("JobState") in FINAL_STATES and (restarted or "not requeueing" in job.log_text()):
            return info
        return None

    info = cluster.wait(f"job {job.id} (periodic) to end", ended, diagnose=job.diagnose)
    log = job.log_text()
    assert info["Restarts"] == "1" and info["JobState"] == "COMPLETED", job.diagnose()
    assert re.search(r"received SIGUSR1 at step \d+: checkpoint saved, exiting", log), log
    assert [r["step"] for r in job.train_records()] == list(range(1, PERIODIC_STEPS + 1))
    assert _checkpoint_step(job.run_dir) == PERIODIC_STEPS
