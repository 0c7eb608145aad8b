"""Baseline vs MHAR on CPU in a few minutes, on the embedded corpus (no download).

    python -m megatron_mhar.demo [--out runs/demo] [dotted.key=value ...]

Trains the ``smoke_cpu`` recipe twice, as Megatron's plain GPT (``mhar.variant=none``)
and as MHAR (full routing, 8 heads), with the same seed, data order and schedule;
then prints a side-by-side validation-loss table and writes::

    runs/demo/baseline/, runs/demo/mhar/     run directories (metrics.jsonl, tensorboard/, ...)
    runs/demo/results.md                     the table
    runs/demo/routing_maps.png               where MHAR's heads route: site x source weights, per head

``tensorboard --logdir runs/demo`` shows both runs side by side. Extra overrides
apply to both runs (e.g. ``training.train_iters=100``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import List, Optional, Sequence

RUNS = (("baseline", ["mhar.variant=none"]), ("mhar", ["mhar.variant=full", "mhar.num_heads=8"]))


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


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_mhar.demo", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="runs/demo", help="output directory (replaced)")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides for both runs")
    args = parser.parse_args(argv)

    from megatron_mhar.training.recipes import load_config
    from megatron_mhar.training.loop import SUMMARY_FILE, run
    from megatron_mhar.training.metrics import read_metrics

    out = Path(args.out)
    try:
        configs = [
            (name, load_config("smoke_cpu", [*extra, f"run.output_dir={out}", f"run.name={name}", *args.overrides]))
            for name, extra in RUNS
        ]
    except ValueError as err:
        parser.exit(2, f"config error: {err}\n")
    for _, cfg in configs:  # a fresh comparison each time, not a resume
        shutil.rmtree(cfg.run.dir, ignore_errors=True)

    rows = []
    for name, cfg in configs:
        result = run(cfg)
        summary = json.loads((cfg.run.dir / SUMMARY_FILE).read_text())
        train = read_metrics(cfg.run.dir, "train")
        speed = [r["tokens_per_s"] for r in train[len(train) // 2 :]]  # after warm-up
        rows.append(
            dict(
                name=name,
                routing="none" if not cfg.mhar.enabled else f"{cfg.mhar.variant} H={cfg.mhar.num_heads}",
                parameters=summary["parameters"],
                val_loss=summary["val_loss"],
                val_loss_tail=result.val_loss_tail,
                tokens_per_s=sum(speed) / len(speed),
            )
        )

    table = results_table(rows)
    (out / "results.md").write_text(table + "\n")
    heatmap = out / "mhar" / "routing_maps.png"
    print()
    print(table)
    delta = rows[1]["val_loss"] - rows[0]["val_loss"]
    print(f"\nMHAR - baseline final validation loss: {delta:+.4f}")
    if heatmap.is_file():
        shutil.copyfile(heatmap, out / "routing_maps.png")
        print(f"routing maps: {out / 'routing_maps.png'}")
    else:
        print("routing maps: not written (logging.routing_entropy=false)")
    print(f"TensorBoard: tensorboard --logdir {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
