"""Routing maps: where each head of each routing site reads from, as JSON and a PNG.

For every routing site (rows, in depth order) and every source it routes over
(columns: ``emb``, then the sublayer outputs ``s<j>``, blocks ``b<n>`` or block deltas
``d<k>``, then the ``partial`` or ``null`` source), a cell holds the mean softmax weight
of that source over the recorded tokens, one panel per head. A last panel holds each
head's mean routing entropy normalised by ``ln N`` (N: the sources the site reads):
1 is a uniform average, 0 one source per token. Drawn with Pillow, no plotting library;
both files are written atomically.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Dict, List, Sequence

import numpy

from megatron_mhar.files import write_atomic

if TYPE_CHECKING:
    from megatron_mhar.diagnostics.recorder import SiteRouting

JSON_FILE = "routing_maps.json"
PNG_FILE = "routing_maps.png"

# viridis anchors (dark blue -> green -> yellow)
_ANCHORS = numpy.array(
    [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]], dtype=numpy.float64
)
_UNREAD = (235, 235, 235)  # a source the site does not read
_TEXT_W, _TEXT_H = 6, 11  # Pillow's default bitmap font, per character


def _colour(values: numpy.ndarray) -> numpy.ndarray:
    """``[...]`` in [0, 1] -> ``[..., 3]`` uint8 viridis-like colours."""
    x = numpy.clip(values, 0.0, 1.0) * (len(_ANCHORS) - 1)
    low = numpy.floor(x).astype(int).clip(0, len(_ANCHORS) - 2)
    frac = (x - low)[..., None]
    return (_ANCHORS[low] * (1 - frac) + _ANCHORS[low + 1] * frac).round().astype(numpy.uint8)


@dataclasses.dataclass
class SiteMap:
    """One routing site: the mean weight of each source it reads, and its entropy."""

    site: int
    """Global 1-based routing site (sublayer ``j``; ``2L + 1`` is the final site)."""

    sources: List[str]
    """Names of the sources read, in the routing op's order."""

    weights: List[List[float]]
    """``[source][head]`` mean softmax weight over the recorded tokens (each head sums to 1)."""

    entropy: List[float]
    """``[head]`` mean routing entropy in nats."""

    @property
    def normalised_entropy(self) -> List[float]:
        """``[head]`` entropy / ``ln N``; 0 for a site with one source."""
        n = len(self.sources)
        return [h / math.log(n) if n > 1 else 0.0 for h in self.entropy]


@dataclasses.dataclass
class RoutingMaps:
    """Every site's :class:`SiteMap`, in depth order, over ``tokens`` recorded tokens."""

    sites: List[SiteMap]
    tokens: int
    """Tokens averaged over (per site)."""

    @classmethod
    def from_records(cls, records: Dict[int, "SiteRouting"], layout) -> "RoutingMaps":
        """From a :class:`~megatron_mhar.models.routing.RoutingRecorder`'s sums and the
        model's depth layout (which names the sources)."""
        sites = []
        for site in sorted(records):
            record = records[site]
            names = layout.source_names(site)
            if record.weights.shape[0] != len(names):
                raise ValueError(
                    f"site {site} recorded {record.weights.shape[0]} sources but the layout names "
                    f"{len(names)}: the records come from another model"
                )
            sites.append(SiteMap(
                site=site,
                sources=names,
                weights=(record.weights.double() / record.tokens).tolist(),
                entropy=(record.entropy.double() / record.tokens).tolist(),
            ))
        tokens = min(records[site].tokens for site in records) if records else 0
        return cls(sites=sites, tokens=tokens)

    @property
    def num_heads(self) -> int:
        return len(self.sites[0].entropy)

    @property
    def columns(self) -> List[str]:
        """Every source name, ``emb`` first, rows in depth order, ``partial``/``null`` last."""
        return sorted({name for site in self.sites for name in site.sources}, key=_column_order)

    def matrix(self, head: int) -> numpy.ndarray:
        """``[sites, columns]`` mean weights of ``head``; NaN where a site does not read a source."""
        columns = {name: c for c, name in enumerate(self.columns)}
        out = numpy.full((len(self.sites), len(columns)), numpy.nan)
        for r, site in enumerate(self.sites):
            for name, weights in zip(site.sources, site.weights):
                out[r, columns[name]] = weights[head]
        return out

    def to_json(self, **metadata) -> Dict:
        """A JSON-serialisable dict: ``metadata``, the columns, and every site's map."""
        return {
            **metadata,
            "tokens": self.tokens,
            "num_heads": self.num_heads,
            "columns": self.columns,
            "sites": [
                {**dataclasses.asdict(site), "normalised_entropy": site.normalised_entropy}
                for site in self.sites
            ],
        }


def _column_order(name: str):
    if name == "emb":
        return 0, 0
    if name in ("partial", "null"):
        return 2, 0
    return 1, int(name[1:])


def render(maps: RoutingMaps, title: str) -> numpy.ndarray:
    """One panel per head (sites x sources, mean weight) and one of normalised entropy
    (sites x heads), as an ``[H, W, 3]`` uint8 image."""
    from PIL import Image, ImageDraw

    rows, columns = len(maps.sites), maps.columns
    heads = maps.num_heads
    cell = max(4, min(22, 420 // max(rows, len(columns), heads)))
    label_w = _TEXT_W * max(len(f"site {s.site}") for s in maps.sites) + 6
    panels = [(f"head {h}", maps.matrix(h), columns) for h in range(heads)]
    entropy = numpy.array([s.normalised_entropy for s in maps.sites])
    panels.append(("entropy / ln N", entropy, [f"h{h}" for h in range(heads)]))
    widths = [label_w + cell * matrix.shape[1] + 12 for _, matrix, _ in panels]
    panel_w = max(widths)
    panel_h = 2 * _TEXT_H + cell * rows + _TEXT_H * 3 + 8
    per_row = max(1, min(len(panels), 1600 // panel_w))
    grid_rows = math.ceil(len(panels) / per_row)
    top = 2 * _TEXT_H + 6
    bar = 80  # colour bar on the right
    image = Image.new("RGB", (per_row * panel_w + bar, top + grid_rows * panel_h), "white")
    draw = ImageDraw.Draw(image)
    draw.text((4, 4), title, fill="black")
    draw.text((4, 4 + _TEXT_H), f"mean routing weight over {maps.tokens} tokens per site", fill="black")
    labelled_rows = _thinned(rows, cell, _TEXT_H)
    for p, (name, matrix, names) in enumerate(panels):
        x0 = (p % per_row) * panel_w
        y0 = top + (p // per_row) * panel_h
        draw.text((x0 + label_w, y0), name, fill="black")
        y0 += _TEXT_H + 4
        colours = _colour(numpy.nan_to_num(matrix))
        for r in range(rows):
            if r in labelled_rows:
                draw.text((x0 + 2, y0 + r * cell + (cell - _TEXT_H) // 2), f"site {maps.sites[r].site}", fill="black")
            for c in range(matrix.shape[1]):
                fill = _UNREAD if numpy.isnan(matrix[r, c]) else tuple(int(v) for v in colours[r, c])
                x, y = x0 + label_w + c * cell, y0 + r * cell
                draw.rectangle([x, y, x + cell - 2, y + cell - 2], fill=fill)
        _column_labels(draw, names, x0 + label_w, y0 + rows * cell + 2, cell)
    _colour_bar(draw, per_row * panel_w + 10, top + _TEXT_H + 4, min(panel_h - 3 * _TEXT_H, 200))
    return numpy.asarray(image)


def _thinned(count: int, cell: int, label: int) -> set:
    """Indices of ``count`` cells of ``cell`` pixels that get a label of ``label`` pixels:
    evenly spaced, the last one too where it has room."""
    every = max(1, math.ceil(label / cell))
    shown = set(range(0, count, every))
    if (count - 1 - max(shown)) * cell >= label:
        shown.add(count - 1)
    return shown


def _column_labels(draw, names: Sequence[str], x0: int, y0: int, cell: int) -> None:
    """Column names under a panel, on two staggered lines, thinned so that they do not overlap."""
    shown = sorted(_thinned(len(names), cell, _TEXT_W * max(len(n) for n in names) // 2 + 2))
    for i, c in enumerate(shown):
        draw.text((x0 + c * cell, y0 + (i % 2) * _TEXT_H), names[c], fill="black")


def _colour_bar(draw, x0: int, y0: int, height: int, width: int = 14) -> None:
    for i in range(height):
        colour = tuple(int(v) for v in _colour(numpy.array(1 - i / max(height - 1, 1))))
        draw.line([x0, y0 + i, x0 + width, y0 + i], fill=colour)
    draw.text((x0 + width + 4, y0), "1", fill="black")
    draw.text((x0 + width + 4, y0 + height - _TEXT_H), "0", fill="black")


def save_routing_maps(maps: RoutingMaps, directory: Path, title: str, **metadata) -> numpy.ndarray:
    """``directory/routing_maps.json`` and ``directory/routing_maps.png``, each written
    atomically; returns the image (for TensorBoard)."""
    from PIL import Image

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    image = render(maps, title)
    png = io.BytesIO()
    Image.fromarray(image).save(png, format="PNG")
    write_atomic(directory / JSON_FILE, json.dumps(maps.to_json(title=title, **metadata), indent=1))
    write_atomic(directory / PNG_FILE, png.getvalue())
    return image
