"""The routing layout: which sources each routing site reads and each sublayer writes.

Pure Python, imported by the Megatron model (``models/routing.py``), the pipeline shapes
(``models/block.py``), the pipeline byte model (``benchmarks/pipeline_bytes.py``) and the
transformers model (``hf/modeling_mhar.py``); exports ship this file verbatim beside their
model code, so it imports nothing of this package.

Sublayers are numbered globally and 1-based: decoder layer ``l`` (1-based) owns the
attention sublayer ``2l - 1`` and the MLP sublayer ``2l``; the final routing site of a
model with ``L`` layers is ``2L + 1``. The embedding is source 0.

The full and block variants are one rule with a block size ``S`` counted in sublayers (the
paper's variants): sublayer ``j`` lies in block ``n = (j - 1) // S + 1`` at position
``i = (j - 1) % S + 1`` (both 1-based). It reads the completed block sources
``b_0 .. b_{n-1}`` (rows ``0 .. n-1``; ``b_0`` is the embedding) plus, when ``i >= 2``, the
running partial ``b_n^{i-1}``, the sum of the block's outputs so far. A block of S
outputs, once complete, becomes row ``n``. The full variant is ``S = 1``: every sublayer
output is its own row and no partial ever exists.

The delta variant (continued pretraining, in the paper) keeps the additive stream ``h``
and corrects each sublayer input: ``x_j = h_{j-1} + a_j * route_j([null_j] + sources)``,
with sources the embedding and the delta ``h_end - h_start`` of every completed block of
``delta_block_layers`` decoder layers. The stream itself stays ``h_j = h_{j-1} + f_j``,
so with the zero-initialised gates ``a_j`` the model computes exactly the base model.
The null source joins as the routing op's last source (softmax over sources does not
depend on their order).
"""

import dataclasses
from typing import List, Optional, Union


@dataclasses.dataclass(frozen=True)
class DepthLayout:
    """Sources of the full (``block_size`` 1) and block variants."""

    num_layers: int
    """Decoder layers L of the whole model (all pipeline stages)."""

    block_size: int
    """Sublayers per block; 1 is the full variant."""

    has_final_site = True

    @property
    def final_site(self) -> int:
        return 2 * self.num_layers + 1

    @property
    def capacity(self) -> int:
        """Completed rows the model ever holds: the embedding plus every completed block."""
        return 1 + (2 * self.num_layers) // self.block_size

    @property
    def max_sources(self) -> int:
        """Sources one site ever routes over (completed rows and a partial): the final site's."""
        return self.sources_read(self.final_site)

    def position(self, site: int):
        """(block n, position i) of routing site / sublayer ``site``, both 1-based."""
        return (site - 1) // self.block_size + 1, (site - 1) % self.block_size + 1

    def rows_read(self, site: int) -> int:
        """Completed rows read by ``site`` (rows ``0 .. n-1``)."""
        return self.position(site)[0]

    def reads_partial(self, site: int) -> bool:
        """Whether ``site`` also reads the running partial of its block."""
        return self.position(site)[1] >= 2

    def sources_read(self, site: int) -> int:
        """Sources ``site`` routes over: its completed rows and its partial, if any."""
        return self.rows_read(site) + int(self.reads_partial(site))

    def completes_block(self, site: int) -> bool:
        """Whether sublayer ``site``'s output completes its block (row ``n`` is written)."""
        return self.position(site)[1] == self.block_size

    def boundary(self, site: int):
        """(rows, has_partial) of the history entering sublayer ``site`` (a stage input)."""
        return self.rows_read(site), self.reads_partial(site)

    def boundary_width(self, site: int, cached_rows: int = 0) -> int:
        """Number of [s, b, h] slices crossing into sublayer ``site`` from a previous stage,
        less ``cached_rows`` rows the receiving rank holds already (cross-stage caching)."""
        return self.sources_read(site) - cached_rows

    def source_names(self, site: int) -> List[str]:
        """Names of the sources ``site`` routes over, in the routing op's order: ``emb``,
        then ``s<j>`` (sublayer j's output, full variant) or ``b<n>`` (block n), then
        ``partial`` (the running sum of the site's own block)."""
        row = "s" if self.block_size == 1 else "b"
        names = ["emb"] + [f"{row}{k}" for k in range(1, self.rows_read(site))]
        return names + ["partial"] if self.reads_partial(site) else names


@dataclasses.dataclass(frozen=True)
class DeltaLayout:
    """Sources of the delta variant: row 0 the embedding, row k the delta of block k."""

    num_layers: int
    """Decoder layers L of the whole model."""

    block_layers: int
    """Decoder layers per block."""

    has_final_site = False

    @property
    def capacity(self) -> int:
        """Rows ever read: the embedding and every block completed before the last layer."""
        return 1 + (self.num_layers - 1) // self.block_layers

    @property
    def max_sources(self) -> int:
        """Sources one site ever routes over: every row and the site's null source."""
        return self.capacity + 1

    @staticmethod
    def layer_of(site: int) -> int:
        """1-based decoder layer of sublayer ``site``."""
        return (site + 1) // 2

    def rows_read(self, site: int) -> int:
        """Rows before the null source: the embedding and the blocks completed before ``site``."""
        return 1 + (self.layer_of(site) - 1) // self.block_layers

    def sources_read(self, site: int) -> int:
        """Sources ``site`` routes over: its rows and its null source."""
        return self.rows_read(site) + 1

    def completes_block(self, site: int) -> bool:
        """Whether sublayer ``site`` ends a block whose delta a later layer reads."""
        layer = self.layer_of(site)
        return site % 2 == 0 and layer % self.block_layers == 0 and layer < self.num_layers

    def starts_block(self, site: int) -> bool:
        """Whether ``site`` is the first sublayer of a block (then ``h_start`` is ``h``)."""
        return site % 2 == 1 and (self.layer_of(site) - 1) % self.block_layers == 0

    def boundary_width(self, site: int, cached_rows: int = 0) -> int:
        """Stream ``h``, the block's start ``h_start`` (unless it is ``h``) and the rows, less
        ``cached_rows`` rows the receiving rank holds already (cross-stage caching)."""
        return 1 + int(not self.starts_block(site)) + self.rows_read(site) - cached_rows

    def source_names(self, site: int) -> List[str]:
        """``emb``, ``d<k>`` (the delta of block k), then ``null`` (the site's null source)."""
        return ["emb"] + [f"d{k}" for k in range(1, self.rows_read(site))] + ["null"]


Layout = Union[DepthLayout, DeltaLayout]


def layout_for(variant: str, num_layers: int, block_size: int = 1, delta_block_layers: int = 1) -> Layout:
    """The layout of routing variant ``variant`` over ``num_layers`` decoder layers:
    ``delta`` reads ``delta_block_layers``, ``block`` reads ``block_size``, any other
    variant is the full one (``S = 1``)."""
    if variant == "delta":
        return DeltaLayout(num_layers=num_layers, block_layers=delta_block_layers)
    return DepthLayout(num_layers=num_layers, block_size=block_size if variant == "block" else 1)


def layout_error(variant: str, num_layers: int, block_size: int, delta_block_layers: int,
                 names=("block_size", "delta_block_layers")) -> Optional[str]:
    """Why no layout of ``variant`` fits ``num_layers`` decoder layers (a block longer than
    the model), or None; ``names`` spell the two fields as the caller's configuration does."""
    if variant == "block" and block_size > 2 * num_layers:
        return (f"{names[0]}={block_size} sublayers exceeds the model's {2 * num_layers} "
                f"sublayers ({num_layers} decoder layers x 2)")
    if variant == "delta" and delta_block_layers > num_layers:
        return (f"{names[1]}={delta_block_layers} decoder layers exceeds the model's {num_layers}: "
                f"no block would complete, so no source would be added")
    return None
