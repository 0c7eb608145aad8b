"""Convergence of the variants a user chooses between: validation loss curves through the driver.

    python -m benchmarks.bench_convergence      # CPU: the smoke shape on the package corpus
    python -m benchmarks.bench_convergence --case golden_cpu --seeds 1,2,3 \\
        --out benchmarks/results/convergence/cpu.json      # the CPU golden curves (CI checks them)
    python -m benchmarks.bench_convergence --case golden_cpu --seeds 1 \\
        --check benchmarks/results/convergence/cpu.json    # the CI check: exit 1 if a curve moved
    python -m benchmarks.bench_convergence --case 100m --seeds 1,2,3 \\
        --specs local,transformer_engine                   # the GPU run of record (docs/performance.md)
    python -m benchmarks.bench_convergence --set data.paths=[/data/c] \\
        --set data.valid_paths=[/data/v] --set data.tokenizer=/tok      # any corpus

Every run is the training driver's: the case's recipe with the variant's routing as its
``mhar`` section, loaded by ``megatron_mhar.training.recipes``, checked by its launch
checks and trained by ``megatron_mhar.training.loop.Trainer.train`` (evaluation every
``--eval-interval`` steps on the same held-out batches). All runs of a seed share the
initialisation seed and the data order (``run.seed``); seeds differ in both.

The variants (:data:`VARIANTS`): the plain GPT (``baseline``), Attention Residuals
(``attnres``, H=1), MHAR with H=8 at logit scale 1 (``mhar``) and 8 (``mhar_tau8``), block
routing (``mhar_block``) and the delta routing of continued pretraining (``mhar_delta``). The
delta model's gates and queries start at zero and its other parameters are drawn as the
baseline's, so it starts as the baseline converted at step 0 (same step-1 loss, bitwise on
CPU). Any ``--variants`` entry may carry MHARConfig overrides (``mhar@num_heads=4``).

Data, unless ``--set data.paths=...`` names one: the ``packages`` embedded corpus
(``megatron_mhar.data.corpus``: the documentation and source text of the installed
distributions, deduplicated, one document per file) with the builtin tokenizer trained on
it, split by document (``data.split``); the golden case reads the ``stdlib`` corpus, which
changes only with Python.

Runs: on CPU one after another in this process; on a GPU ``--parallel`` worker processes at
once (default: as many as the driver's memory estimate fits into 85% of the GPU), each
training one run. The report: per run the validation curve and the training losses at the
evaluation steps; per variant the final validation loss's mean and spread over seeds and
its paired difference to the baseline of the same seed and spec; the table as markdown;
a plot beside the JSON where matplotlib is installed. ``--check GOLDEN`` compares each run
with the golden run of the same case, variant and seed (exit 1 beyond the golden's
tolerance).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

import torch

from benchmarks import common

# ------------------------------------------------------------------ cases and variants


@dataclasses.dataclass(frozen=True)
class Case:
    """A convergence case: a recipe, the overrides that make it, and its default corpus."""

    recipe: str
    overrides: tuple
    corpus: str
    """The embedded corpus it trains on without ``data.paths``: ``packages`` or ``stdlib``."""
    corpus_bytes: int
    vocab_size: int
    """Tokens of the builtin tokenizer trained on the corpus (= ``model.vocab_size``)."""
    steps: int
    eval_interval: int
    variant_overrides: tuple = ()
    """MHARConfig overrides of the block and delta variants for this depth (``name@field=value``)."""


_CPU_RUN = ("training.precision=fp32", "run.device=cpu")
CASES = {
    # The smoke shape (4 layers, d=128, 4 heads, seq 128) on 20 MB of package text.
    "tiny": Case("smoke_cpu", ("training.global_batch_size=16", "training.micro_batch_size=16",
                               "optimizer.lr_warmup_iters=30", "eval.iters=8", *_CPU_RUN),
                 "packages", 20_000_000, 4096, 300, 25,
                 ("mhar_block@block_size=2", "mhar_delta@delta_block_layers=1")),
    # CI's golden curves: the smoke shape at 8 x 64 tokens a step for 80 steps, on 1 MB of
    # the standard library; all variants in about a minute on 2 idle cores.
    "golden_cpu": Case("smoke_cpu", ("model.seq_length=64", "training.global_batch_size=8",
                                     "training.micro_batch_size=8", "optimizer.lr_warmup_iters=15",
                                     "eval.iters=4", *_CPU_RUN),
                       "stdlib", 1_000_000, 4096, 80, 16,
                       ("mhar_block@block_size=2", "mhar_delta@delta_block_layers=1")),
    # The paper's 100M shape (d=512, 12 layers, seq 2048, 64 x 2048 tokens a step), bf16, on
    # 120 MB of package text (~36M tokens) with a 32K builtin tokenizer: 300 steps read one
    # epoch; warm-up 5% of the steps, cosine to 0.1x.
    "100m": Case("pretrain_100m_baseline", ("model.vocab_size=32768", "optimizer.lr_warmup_iters=15",
                                            "eval.iters=16", "data.split=98,2,0", "training.precision=bf16"),
                 "packages", 120_000_000, 32768, 300, 25, ()),
}
"""The cases by name: the recipe, the overrides, the default corpus and run length."""

VARIANTS = {
    "baseline": "baseline",
    "attnres": "attnres",
    "mhar": "mhar",
    "mhar_tau8": "mhar@logit_scale=8.0",
    "mhar_block": "mhar_block",
    "mhar_delta": "mhar_delta",
}
"""The variants by name, each a model of ``benchmarks.common.MODELS`` with overrides."""


def variant_routing(name: str, case: Case):
    """The MHARConfig of ``--variants`` entry ``name`` (a :data:`VARIANTS` name with optional
    ``@field=value`` overrides) at ``case``'s depth."""
    base, *extra = name.split("@")
    if base not in VARIANTS:
        raise ValueError(f"unknown variant {base!r}; choose from {list(VARIANTS)}")
    model = VARIANTS[base]
    for item in case.variant_overrides:
        of, _, override = item.partition("@")
        if model.split("@")[0] == of:
            model += "@" + override
    return common.parse_model("@".join([model, *extra]))


# ------------------------------------------------------------------ one run


def run_overrides(case: Case, args, seed: int, spec: str, out_dir: Path, data: List[str]) -> List[str]:
    """The recipe overrides of one run of ``case``: the data, the length and evaluation, the
    seed and spec, no checkpoint or event file."""
    steps = args.steps or case.steps
    return [*case.overrides, *data, f"training.train_iters={steps}", f"optimizer.lr_decay_iters={steps}",
            f"eval.interval={args.eval_interval or case.eval_interval}", f"run.seed={seed}",
            f"model.spec={spec}", f"run.output_dir={out_dir}", "checkpoint.interval=0",
            "checkpoint.save_at_end=false", "logging.tensorboard=false", "logging.routing_entropy=false",
            "logging.routing_interval=0", f"logging.interval={args.eval_interval or case.eval_interval}",
            *args.set]  # fmt: skip


def run_config(case: Case, variant: str, overrides: List[str]):
    """The driver's TrainConfig of one run, resolved and checked as ``mhar-train`` does."""
    from megatron_mhar.training.launch_checks import validate_launch, with_resolved_spec
    from megatron_mhar.training.recipes import load_config

    cfg = load_config(case.recipe, [*overrides, f"run.name={variant.replace('@', '_').replace('=', '_')}"])
    cfg = with_resolved_spec(dataclasses.replace(cfg, mhar=variant_routing(variant, case)), say=lambda _: None)
    validate_launch(cfg, 1)
    return cfg


def train_run(cfg, ctx) -> dict:
    """Trains one run with the driver: its validation curve ``[[step, loss], ...]``, its
    training loss at each evaluation step, wall seconds and parameters."""
    from megatron_mhar.training.loop import Trainer

    start = time.perf_counter()
    trainer = Trainer(cfg, ctx)
    result = trainer.train()
    params = sum(p.numel() for p in trainer.model[0].module.parameters())
    train = [[step, result.losses[step]] for step, _ in result.val_losses]
    return {"val": result.val_losses, "train": train, "first_loss": result.losses[1],
            "seconds": time.perf_counter() - start, "params": params}


def _worker(spec_path: str) -> None:
    """One run in its own process (``--worker``): the job file names its config overrides
    and where its result goes."""
    from megatron_mhar.runtime import destroy, initialize_model_parallel_from_env

    job = json.loads(Path(spec_path).read_text())
    case = CASES[job["case"]]
    cfg = run_config(case, job["variant"], job["overrides"])
    ctx = initialize_model_parallel_from_env(seed=cfg.run.seed, device=job["device"])
    try:
        result = train_run(cfg, ctx)
    finally:
        destroy()
    Path(job["result"]).write_text(json.dumps(result))


# ------------------------------------------------------------------ data


def corpus_overrides(case: Case, args) -> tuple:
    """(recipe overrides naming the data, what the report says of it): the user's
    ``data.paths`` where ``--set`` names them, else the case's embedded corpus, built once."""
    if any(item.startswith("data.paths=") for item in args.set):
        return [], {"data": "user", "overrides": [s for s in args.set if s.startswith("data.")]}
    from megatron_mhar.data.corpus import embedded_root, prepare_embedded

    built = prepare_embedded(str(embedded_root()), case.vocab_size, case.corpus_bytes, source=case.corpus)
    data = [f"data.paths=[{built.prefix}]", f"data.tokenizer={built.directory}", "data.eod_token=<|endoftext|>",
            f"model.vocab_size={case.vocab_size}"]
    if not any(o.startswith("data.split=") for o in case.overrides):
        data.append("data.split=95,5,0")
    return data, {"data": f"embedded {case.corpus}", "manifest": built.manifest(),
                  "bin_sha1": _sha1(Path(built.prefix + ".bin"))}


def _sha1(path: Path) -> str:
    import hashlib

    return hashlib.sha1(path.read_bytes()).hexdigest()


# ------------------------------------------------------------------ running the runs


def _parallel_default(jobs: list, device: str) -> int:
    """Runs at once: one on CPU; on a GPU as many as the driver's estimate fits into 85%
    of its memory."""
    if device != "cuda":
        return 1
    from megatron_mhar.training.memory import estimate_memory

    need = max(estimate_memory(job["cfg"], 1).total for job in jobs)
    return max(1, min(len(jobs), int(0.85 * torch.cuda.get_device_properties(0).total_memory // need)))


def run_all(jobs: list, device: str, parallel: int, work: Path) -> None:
    """Fills each job's ``result``: in this process one after another, or ``parallel``
    worker processes at once."""
    if parallel <= 1:
        from megatron_mhar.runtime import destroy, initialize_model_parallel_from_env

        ctx = initialize_model_parallel_from_env(seed=1234, device=device)
        try:
            for job in jobs:
                job["result"] = train_run(job["cfg"], ctx)
                _say(job)
        finally:
            destroy()
        return
    pending, running = list(jobs), []
    while pending or running:
        while pending and len(running) < parallel:
            job = pending.pop(0)
            path = work / f"job{jobs.index(job)}.json"
            path.write_text(json.dumps({"case": job["case"], "variant": job["variant"], "device": device,
                                        "overrides": job["overrides"], "result": str(path) + ".result"}))
            log = open(work / f"job{jobs.index(job)}.log", "w")
            proc = subprocess.Popen([sys.executable, "-m", "benchmarks.bench_convergence", "--worker", str(path)],
                                    cwd=common.ROOT, stdout=log, stderr=subprocess.STDOUT)
            running.append((job, proc, path, log))
        time.sleep(1.0)
        for entry in list(running):
            job, proc, path, log = entry
            if proc.poll() is None:
                continue
            running.remove(entry)
            log.close()
            if proc.returncode:
                tail = Path(log.name).read_text()[-3000:]
                raise RuntimeError(f"run {job['key']} failed (exit {proc.returncode}):\n{tail}")
            job["result"] = json.loads(Path(str(path) + ".result").read_text())
            _say(job)


def _say(job: dict) -> None:
    result = job["result"]
    print(f"{job['key']}: val loss {result['val'][-1][1]:.4f} after {result['val'][-1][0]} steps "
          f"({result['seconds']:.0f} s)", flush=True)


# ------------------------------------------------------------------ the report


def summarize(runs: Dict[str, dict]) -> dict:
    """Per ``spec/variant``: the final validation loss of each seed, its mean, standard
    deviation and range, and the paired difference to the baseline of the same seed and
    spec (mean and standard deviation over seeds)."""
    final = {}
    for key, run in runs.items():
        spec, variant, seed = key.split("/")
        final.setdefault(f"{spec}/{variant}", {})[seed] = run["val"][-1][1]
    table = {}
    for name, by_seed in final.items():
        values = list(by_seed.values())
        row = {"seeds": len(values), "final": by_seed, "mean": statistics.fmean(values),
               "std": statistics.stdev(values) if len(values) > 1 else None,
               "range": max(values) - min(values)}
        base = final.get(name.split("/")[0] + "/baseline")
        paired = [by_seed[s] - base[s] for s in by_seed if base and s in base]
        if paired:
            row["paired_diff_mean"] = statistics.fmean(paired)
            row["paired_diff_std"] = statistics.stdev(paired) if len(paired) > 1 else None
        table[name] = row
    return table


def markdown(table: dict) -> str:
    """The summary as a markdown table (losses in nats per token)."""
    def fmt(value, sign=False):
        return "-" if value is None else (f"{value:+.4f}" if sign else f"{value:.4f}")

    lines = ["| spec / variant | seeds | final val loss (mean) | std over seeds | paired diff to baseline | "
             "its std |", "|---|---|---|---|---|---|"]
    for name, row in table.items():
        lines.append(f"| {name} | {row['seeds']} | {fmt(row['mean'])} | {fmt(row['std'])} | "
                     f"{fmt(row.get('paired_diff_mean'), True)} | {fmt(row.get('paired_diff_std'))} |")
    return "\n".join(lines)


def seed_spread(runs: Dict[str, dict]) -> dict:
    """The spread of the validation curves over seeds: at each evaluation step, the
    standard deviation over seeds of each spec/variant; its median over steps and variants
    (the pooled figure a tolerance is set from) and its smallest."""
    curves = {}
    for key, run in runs.items():
        spec, variant, _ = key.split("/")
        curves.setdefault(f"{spec}/{variant}", []).append([loss for _, loss in run["val"]])
    per_variant = {name: [statistics.stdev(point) for point in zip(*seeds)]
                   for name, seeds in curves.items() if len(seeds) > 1}
    pooled = [s for stds in per_variant.values() for s in stds]
    if not pooled:
        return {}
    return {"per_variant": per_variant, "median": statistics.median(pooled), "min": min(pooled)}


def plot(runs: Dict[str, dict], path: Path) -> str:
    """Validation curves per variant (one line per seed) into ``path``; or why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot (pip install matplotlib)"
    fig, ax = plt.subplots(figsize=(8, 5))
    colors = {}
    for key, run in runs.items():
        name = key.rsplit("/", 1)[0]
        color = colors.setdefault(name, f"C{len(colors)}")
        steps, losses = zip(*run["val"])
        ax.plot(steps, losses, color=color, alpha=0.8, label=name if key.endswith(f"/{_first_seed(runs, name)}") else None)
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss")
    ax.legend()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return f"plot: {common.shown(path)}"


def _first_seed(runs: Dict[str, dict], name: str) -> str:
    return next(key.rsplit("/", 1)[1] for key in runs if key.rsplit("/", 1)[0] == name)


# ------------------------------------------------------------------ the golden check


def check_golden(report: dict, golden: dict) -> List[str]:
    """What moved: for each run of ``report`` that ``golden`` holds (same case, spec,
    variant, seed), each evaluation whose loss differs from the golden's by more than the
    golden's ``tolerance``; a different corpus or case is one line too."""
    problems = [f"{key} differs from the golden's: {report.get(key)!r} vs {golden.get(key)!r}"
                for key in ("case",) if report.get(key) != golden.get(key)]
    for section, fields in golden.get("case_config", {}).items():
        now = report.get("case_config", {}).get(section, {})
        problems += [f"{section}.{name} differs from the golden's: {now.get(name)!r} vs {value!r}"
                     for name, value in fields.items() if now.get(name) != value]
    if report.get("corpus_sha1") != golden.get("corpus_sha1"):  # other data: no curve is comparable
        return [*problems, f"the corpus differs from the golden's (sha1 {report.get('corpus_sha1')} vs "
                           f"{golden.get('corpus_sha1')}, {golden['data'].get('manifest', {}).get('python')}): "
                           f"regenerate the golden file: {golden.get('regenerate')}"]
    tolerance = golden["tolerance"]
    for key, run in report["runs"].items():
        if key not in golden["runs"]:
            problems.append(f"{key}: the golden file has no such run")
            continue
        for (step, loss), (gstep, gloss) in zip(run["val"], golden["runs"][key]["val"]):
            if step != gstep or abs(loss - gloss) > tolerance:
                problems.append(f"{key} step {step}: val loss {loss:.6f}, golden {gloss:.6f} "
                                f"(|diff| {abs(loss - gloss):.2e} > tolerance {tolerance:.2e})")
    return problems


# ------------------------------------------------------------------ command line


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--case", choices=list(CASES), default=None,
                        help="default: tiny on CPU, 100m on a GPU")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="comma list of " + ",".join(VARIANTS) + " (each may carry @field=value "
                             "MHARConfig overrides)")
    parser.add_argument("--seeds", default="1,2", help="comma list of run.seed values")
    parser.add_argument("--specs", default=None,
                        help="comma list of local, transformer_engine (default: local on CPU, "
                             "transformer_engine on a GPU where it imports)")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default: the case's)")
    parser.add_argument("--eval-interval", type=int, default=None, help="default: the case's")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a recipe override for every run (data.paths=[...], data.valid_paths=[...], "
                             "data.tokenizer=..., optimizer.lr=...)")
    parser.add_argument("--parallel", type=int, default=None,
                        help="runs at once, each its own process (default: 1 on CPU; on a GPU as many "
                             "as fit)")
    parser.add_argument("--repeat", action="store_true",
                        help="train the first seed of each variant twice and report whether the "
                             "curves are bitwise equal")
    parser.add_argument("--tolerance-factor", type=float, default=0.25,
                        help="the golden tolerance: this times the median seed standard deviation")
    parser.add_argument("--check", metavar="GOLDEN", help="compare with a golden report; exit 1 if a curve moved")
    parser.add_argument("--out", default=None,
                        help="JSON report (default: benchmarks/results/convergence/<device>.json; "
                             "with --check none unless given)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.worker:
        return _worker(args.worker)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    args.case = args.case or ("100m" if device == "cuda" else "tiny")
    case = CASES[args.case]
    if device == "cpu" and args.case == "100m":
        parser.error("--case 100m trains on a GPU; on CPU use tiny or golden_cpu")
    if args.specs is None:
        from megatron_mhar.models.specs import resolve_spec

        args.specs = resolve_spec("auto").spec if device == "cuda" else "local"
    specs = args.specs.split(",")
    seeds = [int(s) for s in args.seeds.split(",")]
    variants = args.variants.split(",")
    try:
        for variant in variants:
            variant_routing(variant, case)
    except ValueError as err:
        parser.error(str(err))
    if args.out is None and not args.check:
        args.out = common.default_out("convergence", common.device_name())
    if args.out:
        common.check_out(parser, args.out)

    data, data_report = corpus_overrides(case, args)
    work = Path(tempfile.mkdtemp(prefix="bench_convergence_"))
    jobs = []
    runs_of = [(spec, variant, seed) for spec in specs for variant in variants for seed in seeds]
    if args.repeat:
        runs_of += [(spec, variant, f"{seeds[0]}-repeat") for spec in specs for variant in variants]
    for spec, variant, seed in runs_of:
        key = f"{spec}/{variant}/{seed}"
        overrides = run_overrides(case, args, int(str(seed).split("-")[0]), spec,
                                  work / key.replace("/", "_"), data)
        try:
            cfg = run_config(case, variant, overrides)
        except ValueError as err:
            parser.exit(2, f"config error ({key}): {err}\n")
        jobs.append({"key": key, "case": args.case, "variant": variant, "overrides": overrides, "cfg": cfg})
    parallel = args.parallel or _parallel_default(jobs, device)
    print(f"{len(jobs)} runs of {args.case}, {parallel} at once", flush=True)
    start = time.perf_counter()
    try:
        run_all(jobs, device, parallel, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    runs = {job["key"]: job["result"] for job in jobs if not job["key"].endswith("-repeat")}
    any_cfg = jobs[0]["cfg"]
    report = {
        "commit": common.commit(), "command": common.command("benchmarks.bench_convergence", argv),
        "case": args.case, "case_config": _case_config(any_cfg), "corpus_sha1": data_report.get("bin_sha1"),
        "data": data_report, "variants": {v: dataclasses.asdict(variant_routing(v, case)) for v in variants},
        "seconds": time.perf_counter() - start, "environment": common.environment(device), "runs": runs,
        "table": summarize(runs), "seed_spread": seed_spread(runs),
    }
    if args.repeat:
        report["repeat_bitwise_equal"] = {
            job["key"]: job["result"]["val"] == runs[job["key"].replace("-repeat", "")]["val"]
            for job in jobs if job["key"].endswith("-repeat")}
    spread = report["seed_spread"]
    if spread:
        report["tolerance"] = args.tolerance_factor * spread["median"]
        report["tolerance_rule"] = (f"{args.tolerance_factor} x the median over variants and evaluation steps of "
                                    f"the standard deviation of the validation loss over seeds "
                                    f"({spread['median']:.2e})")
    report["regenerate"] = report["command"]
    print(markdown(report["table"]), flush=True)
    if args.out:
        report["plot"] = plot(runs, Path(args.out).with_suffix(".png"))
        print(report["plot"], flush=True)
        common.write_json(args.out, report)
    if args.check:
        problems = check_golden(report, json.loads(Path(args.check).read_text()))
        for line in problems:
            print(f"moved: {line}", flush=True)
        if problems:
            sys.exit(1)
        print(f"every curve within the golden tolerance of {args.check}", flush=True)
    return report


def _case_config(cfg) -> dict:
    """What makes runs of a case comparable: the model shape, batch, optimizer, schedule
    and evaluation (the routing is per variant)."""
    return {"model": {k: v for k, v in dataclasses.asdict(cfg.model).items() if k != "spec"},
            "training": dataclasses.asdict(cfg.training), "optimizer": dataclasses.asdict(cfg.optimizer),
            "eval": dataclasses.asdict(cfg.eval)}


if __name__ == "__main__":
    main()
