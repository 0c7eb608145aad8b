"""Loss curves drawn with Pillow: ticks, colours per run, read from metrics.jsonl."""

from __future__ import annotations

import json

import numpy
import pytest

from megatron_mhar.diagnostics.loss_curves import COLOURS, Curves, nice_ticks, read_curves, save_loss_curves


@pytest.mark.parametrize(
    "low, high, expected",
    [
        (0, 150, [0, 50, 100, 150]),
        (0, 4, [0, 1, 2, 3, 4]),
        (5.93, 8.41, [6, 6.5, 7, 7.5, 8]),
        (6.15, 6.23, [6.16, 6.18, 6.2, 6.22]),
        (3, 3, [3]),
    ],
)
def test_nice_ticks(low, high, expected):
    assert nice_ticks(low, high) == pytest.approx(expected)


def test_curves_of_each_run_in_its_colour(tmp_path):
    from PIL import Image

    run = tmp_path / "run"
    run.mkdir()
    records = [{"kind": "train", "step": s, "loss": 8 - s / 10} for s in (10, 20, 30)]
    records += [{"kind": "eval", "step": 30, "val_loss": 5.1, "val_loss_tail": 5.1}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    one = read_curves(run, "one")
    assert one == Curves("one", [(10, 7.0), (20, 6.0), (30, 5.0)], [(30, 5.1)])
    other = Curves("other", [(10, 7.5), (30, 5.5)], [(15, 6.5), (30, 5.4)])
    image = save_loss_curves([one, other], tmp_path / "curves.png", "title")
    loaded = numpy.asarray(Image.open(tmp_path / "curves.png"))
    assert loaded.shape == image.shape == (500, 800, 3)
    colours = {tuple(p) for p in loaded.reshape(-1, 3)}
    assert COLOURS[0] in colours and COLOURS[1] in colours and COLOURS[2] not in colours
    with pytest.raises(ValueError, match="no losses to plot"):
        save_loss_curves([Curves("empty", [], [])], tmp_path / "none.png", "title")
