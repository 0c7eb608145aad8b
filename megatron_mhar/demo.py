"""Baseline vs MHAR on CPU, on the embedded corpus (no download).

    python -m megatron_mhar.demo [--out runs/demo] [dotted.key=value ...]

Trains the ``smoke_cpu`` recipe twice, as Megatron's plain GPT (``mhar.variant=none``)
and as MHAR (full routing, 8 heads), with the same seed, data order and schedule.
The two runs are separate processes that take turns step by step, so both see the
same machine (and whatever else it is doing) and their tokens/s compare fairly; the
whole demo takes as long as the two runs one after the other (about 1.5 minutes on 2
idle CPU cores; the first run on a machine also builds the embedded corpus, about 20 s,
cached for later runs). Then it prints a side-by-side validation-loss table and writes
(replacing what an earlier demo wrote there, and saying so)::

    runs/demo/baseline/, runs/demo/mhar/     run directories (metrics.jsonl, tensorboard/, ...)
    runs/demo/results.md                     the table
    runs/demo/loss_curves.png                training and validation loss of both runs
    runs/demo/routing_maps.png               where MHAR's heads route: site x source weights, per head

``tensorboard --logdir runs/demo`` shows both runs side by side. Extra overrides
apply to both runs (e.g. ``training.train_iters=100``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import shutil
import sys
import time
from pathlib import Path
from typing import List, Optional, Sequence


RUNS = (("baseline", ["mhar.variant=none"]), ("mhar", ["mhar.variant=full", "mhar.num_heads=8"]))
RECIPE = "smoke_cpu"


def results_table(rows: List[dict]) -> str:
    """Markdown table of the runs' results."""
    lines = [
        "| run | routing | parameters | final val loss | tail val loss | tokens/s |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['name']} | {row['routing']} | {row['parameters']:,} | {row['val_loss']:.4f} | "
            f"{row['val_loss_tail']:.4f} | {row['tokens_per_s']:,.0f} |"
        )
    return "\n".join(lines)


def table_notes(cfg, val_steps: List[int]) -> str:
    """What the table's columns mean, for this run's settings."""
    tail = val_steps[-cfg.eval.tail :]
    steps = ", ".join(str(s) for s in tail)
    return (
        f"final val loss: validation loss after the last step ({cfg.eval.iters} batches of "
        f"{cfg.training.global_batch_size} x {cfg.model.seq_length} held-out tokens, the same "
        f"batches at every evaluation).\n"
        f"tail val loss: mean of the last {len(tail)} validation losses (steps {steps}; "
        f"eval.tail={cfg.eval.tail}), less noisy than the final one alone.\n"
        f"tokens/s: training steps only, mean over the second half of the run; the two runs "
        f"alternate step by step, so both were measured under the same machine load."
    )


class Turns:
    """Processes that take turns: one runs while the others wait for it to hand over.

    A party waits for its turn (:meth:`wait`), runs, and hands over (:meth:`hand_over`:
    the turn goes to the next party still running, and it waits to get it back). A party
    that is done (:meth:`leave`) is skipped from then on.
    """

    def __init__(self, context, parties: int):
        self.parties = parties
        self._turn = context.Value("i", 0, lock=False)
        self._done = context.Array("b", [0] * parties, lock=False)
        self._cond = context.Condition()

    def _next(self, me: int) -> int:
        for offset in range(1, self.parties + 1):
            other = (me + offset) % self.parties
            if not self._done[other]:
                return other
        return me

    def wait(self, me: int) -> None:
        """Block until it is ``me``'s turn."""
        with self._cond:
            self._cond.wait_for(lambda: self._turn.value == me)

    def hand_over(self, me: int) -> None:
        """Give the turn to the next party still running, then wait for it to come back."""
        with self._cond:
            self._turn.value = self._next(me)
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._turn.value == me)

    def leave(self, me: int) -> None:
        """``me`` is done (finished or failed): the others no longer wait for it."""
        with self._cond:
            self._done[me] = 1
            if self._turn.value == me:
                self._turn.value = self._next(me)
            self._cond.notify_all()


class _Prefixed:
    """A text stream that starts every line with ``prefix`` (whose run printed it)."""

    def __init__(self, stream, prefix: str):
        self.stream, self.prefix, self._at_line_start = stream, prefix, True

    def write(self, text: str) -> int:
        for part in text.splitlines(keepends=True):
            if self._at_line_start:
                self.stream.write(self.prefix)
            self.stream.write(part)
            self._at_line_start = part.endswith("\n")
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def __getattr__(self, name):
        return getattr(self.stream, name)


def _train(index: int, name: str, overrides: List[str], turns: Turns) -> None:
    """One run, in its own process, taking turns with the other run at every step."""
    sys.stdout = _Prefixed(sys.stdout, f"[{name}] ")
    from megatron_mhar.training.loop import run
    from megatron_mhar.training.recipes import load_config

    cfg = load_config(RECIPE, overrides)
    turns.wait(index)
    try:
        run(cfg, step_hook=lambda trainer, step: turns.hand_over(index))
    finally:
        turns.leave(index)


def _run_in_turns(runs: Sequence[tuple]) -> Optional[str]:
    """Train ``(name, overrides)`` runs in processes that alternate step by step; returns
    what failed, or ``None``."""
    context = multiprocessing.get_context("spawn")  # fresh interpreters: no forked Megatron state
    turns = Turns(context, len(runs))
    processes = [
        context.Process(target=_train, args=(i, name, overrides, turns), name=name)
        for i, (name, overrides) in enumerate(runs)
    ]
    for process in processes:
        process.start()
    try:
        while any(p.is_alive() for p in processes):
            for i, process in enumerate(processes):
                process.join(timeout=0.5)
                if process.exitcode not in (None, 0):
                    turns.leave(i)
                    return f"the {process.name} run failed (exit code {process.exitcode}; its error is above)"
        return None
    finally:
        for process in processes:
            if process.is_alive():
                process.terminate()
            process.join()


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_mhar.demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", default="runs/demo",
                        help="output directory; the runs of an earlier demo there are replaced")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides for both runs")
    args = parser.parse_args(argv)

    from megatron_mhar.training.launch_checks import validate_launch
    from megatron_mhar.training.loop import SUMMARY_FILE
    from megatron_mhar.diagnostics.loss_curves import read_curves, save_loss_curves
    from megatron_mhar.training.metrics import format_duration, read_metrics
    from megatron_mhar.training.recipes import load_config

    out = Path(args.out)
    runs = [(name, [*extra, f"run.output_dir={out}", f"run.name={name}", *args.overrides]) for name, extra in RUNS]
    try:
        configs = [load_config(RECIPE, overrides) for _, overrides in runs]
        for cfg in configs:
            validate_launch(cfg, 1)
    except ValueError as err:
        parser.exit(2, f"config error: {err}\n")
    earlier = [str(cfg.run.dir) for cfg in configs if cfg.run.dir.exists()]
    if earlier:  # a fresh comparison each time, not a resume
        print(f"replacing the runs of an earlier demo: {', '.join(earlier)}", flush=True)
    for cfg in configs:
        shutil.rmtree(cfg.run.dir, ignore_errors=True)

    cfg = configs[0]
    print(
        f"training {' and '.join(name for name, _ in runs)} ({RECIPE}, {cfg.training.train_iters} steps "
        f"each) in two processes that take turns step by step; each reports every "
        f"{cfg.logging.interval} step{'s' if cfg.logging.interval > 1 else ''} (its ETA counts "
        f"its own steps only: the demo takes about twice as long)",
        flush=True,
    )
    start = time.perf_counter()
    failure = _run_in_turns(runs)
    if failure:
        print(f"demo failed: {failure}", file=sys.stderr)
        return 1

    rows = []
    for (name, _), cfg in zip(runs, configs):
        summary = json.loads((cfg.run.dir / SUMMARY_FILE).read_text())
        train = read_metrics(cfg.run.dir, "train")
        speed = [r["tokens_per_s"] for r in train[len(train) // 2 :]]  # after warm-up
        rows.append(
            dict(
                name=name,
                routing="none" if not cfg.mhar.enabled else f"{cfg.mhar.variant} H={cfg.mhar.num_heads}",
                parameters=summary["parameters"],
                val_loss=summary["val_loss"],
                val_loss_tail=summary["val_loss_tail"],
                tokens_per_s=sum(speed) / len(speed),
            )
        )

    table = results_table(rows)
    notes = table_notes(configs[0], [step for step, _ in summary["val_losses"]])
    (out / "results.md").write_text(f"{table}\n\n{notes}\n")
    curves = out / "loss_curves.png"
    save_loss_curves(
        [read_curves(cfg.run.dir, name) for (name, _), cfg in zip(runs, configs)],
        curves,
        f"{RECIPE}: baseline vs MHAR, training (lines) and validation (dots) loss",
    )
    print()
    print(table)
    print()
    print(notes)
    delta = rows[1]["val_loss"] - rows[0]["val_loss"]
    print(f"\nMHAR - baseline final validation loss: {delta:+.4f}")
    print(f"loss curves: {curves}")
    heatmap = out / "mhar" / "routing_maps.png"
    if heatmap.is_file():
        shutil.copyfile(heatmap, out / "routing_maps.png")
        print(f"routing maps: {out / 'routing_maps.png'}")
    else:
        print("routing maps: not written (logging.routing_entropy=false)")
    print(f"TensorBoard: tensorboard --logdir {out}")
    print(f"demo took {format_duration(time.perf_counter() - start)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
