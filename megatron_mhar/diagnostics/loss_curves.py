"""Loss curves as a PNG: the training and validation loss of several runs against the step.

One colour per run; training loss (the mean over each logging interval) as a line,
validation loss as dots joined by a thin line. Read from the runs' ``metrics.jsonl``
(:func:`read_curves`) and drawn with Pillow, no plotting library.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import List, Sequence, Tuple

import numpy

from megatron_mhar.diagnostics.records import read_metrics

COLOURS = ((31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189))
"""Run colours, in order (blue, orange, green, red, purple)."""


@dataclasses.dataclass
class Curves:
    """One run's losses: ``[(step, loss), ...]`` for training and validation."""

    name: str
    train: List[Tuple[int, float]]
    val: List[Tuple[int, float]]


def read_curves(run_dir: Path, name: str) -> Curves:
    """A run's curves from its ``metrics.jsonl``."""
    train = [(r["step"], r["loss"]) for r in read_metrics(run_dir, "train")]
    val = [(r["step"], r["val_loss"]) for r in read_metrics(run_dir, "eval")]
    return Curves(name, train, val)


def nice_ticks(low: float, high: float, count: int = 6) -> List[float]:
    """Round tick values (1, 2 or 5 times a power of ten apart) covering ``[low, high]``."""
    if not high > low:
        return [low]
    raw = (high - low) / max(count - 1, 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.ceil(low / step - 1e-9) * step
    ticks = []
    value = first
    while value <= high + 1e-9 * step:
        ticks.append(round(value, 10))
        value += step
    return ticks


def render(curves: Sequence[Curves], title: str, width: int = 800, height: int = 500) -> numpy.ndarray:
    """The plot as an ``[height, width, 3]`` uint8 image."""
    from PIL import Image, ImageDraw

    points = [p for c in curves for p in c.train + c.val]
    if not points:
        raise ValueError("no losses to plot: the runs logged no training or validation loss")
    steps = [s for s, _ in points]
    losses = [v for _, v in points]
    x_max = max(max(steps), 1)
    y_low, y_high = min(losses), max(losses)
    pad = 0.05 * (y_high - y_low) or 0.5
    y_low, y_high = y_low - pad, y_high + pad

    left, right, top, bottom = 60, 20, 36, 44
    plot_w, plot_h = width - left - right, height - top - bottom
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)

    def xy(step: float, loss: float) -> Tuple[float, float]:
        return (left + plot_w * step / x_max, top + plot_h * (y_high - loss) / (y_high - y_low))

    draw.text((left, 8), title, fill="black")
    grey, axis = (225, 225, 225), (90, 90, 90)
    for value in nice_ticks(y_low, y_high):
        _, y = xy(0, value)
        draw.line([left, y, left + plot_w, y], fill=grey)
        draw.text((6, y - 6), f"{value:g}", fill="black")
    for value in nice_ticks(0, x_max):
        x, _ = xy(value, y_low)
        draw.line([x, top, x, top + plot_h], fill=grey)
        draw.text((x - 8, top + plot_h + 6), f"{value:g}", fill="black")
    draw.rectangle([left, top, left + plot_w, top + plot_h], outline=axis)
    draw.text((left + plot_w // 2 - 12, height - 18), "step", fill="black")
    draw.text((6, top - 16), "loss", fill="black")

    legend_y = top + 8
    for curve, colour in zip(curves, COLOURS * (len(curves) // len(COLOURS) + 1)):
        if len(curve.train) > 1:
            draw.line([xy(*p) for p in curve.train], fill=colour, width=2)
        light = tuple((c + 255) // 2 for c in colour)
        if len(curve.val) > 1:
            draw.line([xy(*p) for p in curve.val], fill=light, width=1)
        for point in curve.val:
            x, y = xy(*point)
            draw.ellipse([x - 4, y - 4, x + 4, y + 4], fill=colour, outline="black")
        lx = left + plot_w - 170
        draw.line([lx, legend_y + 6, lx + 24, legend_y + 6], fill=colour, width=2)
        draw.text((lx + 30, legend_y), f"{curve.name} train", fill="black")
        draw.ellipse([lx + 8, legend_y + 18, lx + 16, legend_y + 26], fill=colour, outline="black")
        draw.text((lx + 30, legend_y + 16), f"{curve.name} validation", fill="black")
        legend_y += 36
    return numpy.asarray(image)


def save_loss_curves(curves: Sequence[Curves], path: Path, title: str) -> numpy.ndarray:
    """Write the PNG; returns the image array."""
    from PIL import Image

    image = render(curves, title)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(image).save(path)
    return image
