"""Routing heatmap: per-site, per-head routing entropy as a PNG (and a TensorBoard image).

Rows are routing sites in depth order, columns are heads; a cell is the entropy (nats)
of that head's softmax over depth, averaged over tokens. Low entropy means the head
reads few sources; ``log(N)`` means a uniform average of its ``N`` sources (the
zero-init start). Drawn with Pillow, no plotting library.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, List

import numpy

# viridis anchors (dark blue -> green -> yellow)
_ANCHORS = numpy.array(
    [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]], dtype=numpy.float64
)


def _colour(values: numpy.ndarray) -> numpy.ndarray:
    """``[...]`` in [0, 1] -> ``[..., 3]`` uint8 viridis-like colours."""
    x = numpy.clip(values, 0.0, 1.0) * (len(_ANCHORS) - 1)
    low = numpy.floor(x).astype(int).clip(0, len(_ANCHORS) - 2)
    frac = (x - low)[..., None]
    return (_ANCHORS[low] * (1 - frac) + _ANCHORS[low + 1] * frac).round().astype(numpy.uint8)


def _site_order(name: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def entropy_matrix(entropy: Dict[str, List[float]]):
    """``(site names in depth order, [sites, heads] array)``."""
    sites = sorted(entropy, key=_site_order)
    return sites, numpy.array([entropy[s] for s in sites], dtype=numpy.float64)


def render(entropy: Dict[str, List[float]], title: str, cell: int = 28) -> numpy.ndarray:
    """The heatmap as an ``[H, W, 3]`` uint8 image."""
    from PIL import Image, ImageDraw

    sites, matrix = entropy_matrix(entropy)
    lo, hi = float(matrix.min()), float(matrix.max())
    scaled = (matrix - lo) / (hi - lo) if hi > lo else numpy.zeros_like(matrix)
    label_w = 8 + 7 * max(len(s) for s in sites)
    top, bar = 34, 16
    rows, cols = matrix.shape
    width = label_w + cols * cell + 90
    height = top + rows * cell + 40
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    draw.text((4, 4), title, fill="black")
    draw.text((label_w, top - 14), "heads ->", fill="black")
    cells = _colour(scaled)
    for r in range(rows):
        draw.text((4, top + r * cell + cell // 3), sites[r], fill="black")
        for c in range(cols):
            x, y = label_w + c * cell, top + r * cell
            draw.rectangle([x, y, x + cell - 2, y + cell - 2], fill=tuple(int(v) for v in cells[r, c]))
    for c in range(cols):
        draw.text((label_w + c * cell + cell // 3, top + rows * cell + 4), str(c), fill="black")
    # colour bar
    x0 = label_w + cols * cell + 14
    steps = rows * cell
    for i in range(steps):
        colour = tuple(int(v) for v in _colour(numpy.array(1 - i / max(steps - 1, 1))))
        draw.line([x0, top + i, x0 + bar, top + i], fill=colour)
    draw.text((x0 + bar + 4, top), f"{hi:.2f}", fill="black")
    draw.text((x0 + bar + 4, top + steps - 12), f"{lo:.2f}", fill="black")
    draw.text((x0, top + steps + 4), "nats", fill="black")
    return numpy.asarray(image)


def save_heatmap(entropy: Dict[str, List[float]], path: Path, title: str) -> numpy.ndarray:
    """Write the PNG; returns the image array (for TensorBoard)."""
    from PIL import Image

    image = render(entropy, title)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(image).save(path)
    return image
