"""python -m megatron_mhar.demo: two runs taking turns, the table, its notes and the plots."""

from __future__ import annotations

import json
import multiprocessing
import os

import numpy

from megatron_mhar.demo import Turns
from megatron_mhar.training.metrics import read_metrics
from tests.helpers import TINY


def test_demo_compares_baseline_and_mhar(tmp_path, embedded_dir, single_process, capsys):
    from PIL import Image

    from megatron_mhar.demo import main

    out = tmp_path / "demo"
    (out / "baseline").mkdir(parents=True)
    (out / "baseline" / "from_an_earlier_demo").write_text("")
    assert main(["--out", str(out), *TINY, "training.train_iters=4", "eval.interval=2",
                 f"data.embedded_dir={embedded_dir}"]) == 0
    printed = capsys.readouterr().out
    assert f"replacing the runs of an earlier demo: {out / 'baseline'}\n" in printed  # said, then done
    assert not (out / "baseline" / "from_an_earlier_demo").exists()
    results = (out / "results.md").read_text()
    table = results.split("\n\n")[0]
    assert table.strip() in printed
    rows = [line for line in table.splitlines() if line.startswith("| baseline") or line.startswith("| mhar")]
    assert len(rows) == 2 and "| none |" in rows[0] and "| full H=4 |" in rows[1]  # the overrides win over the demo defaults
    # what the columns mean, for these settings (eval.tail=2 of TINY, evaluations at steps 2 and 4)
    assert "tail val loss: mean of the last 2 validation losses (steps 2, 4; eval.tail=2)" in results
    assert "the two runs alternate step by step" in results and results.split("\n\n")[1].strip() in printed
    for name in ("baseline", "mhar"):
        assert [r["step"] for r in read_metrics(out / name, "eval")] == [2, 4]
        assert os.listdir(out / name / "tensorboard")
    base = json.loads((out / "baseline" / "summary.json").read_text())
    mhar = json.loads((out / "mhar" / "summary.json").read_text())
    assert f"| {base['val_loss']:.4f} | {base['val_loss_tail']:.4f} |" in rows[0]
    # The paper's initialisation: 2 queries + 2 norm weights per layer plus the final site: (4L + 2) d
    assert mhar["parameters"] - base["parameters"] == (4 * 2 + 2) * 32
    assert "MHAR - baseline final validation loss" in printed

    curves = numpy.asarray(Image.open(out / "loss_curves.png"))
    assert curves.shape == (500, 800, 3)
    colours = {tuple(p) for p in curves.reshape(-1, 3)}
    assert (31, 119, 180) in colours and (255, 127, 14) in colours  # both runs drawn
    assert (out / "routing_maps.png").is_file()


def _party(me: int, steps: int, turns: Turns, log, length) -> None:
    turns.wait(me)
    try:
        for step in range(steps):
            log[length.value] = 10 * me + step  # written in this party's turn only
            length.value += 1
            turns.hand_over(me)
    finally:
        turns.leave(me)


def test_runs_take_turns_step_by_step():
    """Each party runs one step, then the other; a party that is done is skipped."""
    context = multiprocessing.get_context("spawn")
    turns = Turns(context, 2)
    log, length = context.Array("i", 8, lock=False), context.Value("i", 0, lock=False)
    parties = [context.Process(target=_party, args=(me, steps, turns, log, length))
               for me, steps in ((0, 4), (1, 2))]
    for party in parties:
        party.start()
    for party in parties:
        party.join(timeout=120)
        assert party.exitcode == 0
    assert list(log[: length.value]) == [0, 10, 1, 11, 2, 3]
