"""The routing layout (``ops/routing_layout.py``): what each site reads and each sublayer
completes, as the Megatron model, the pipeline shapes and the transformers model read it."""

import pytest

from megatron_mhar.ops.routing_layout import DeltaLayout, DepthLayout, layout_for


@pytest.mark.parametrize("variant,layers,size", [
    pytest.param("full", 3, 1, id="full"),  # every sublayer output is a row
    pytest.param("block", 3, 4, id="block-4-over-6"),  # a block spans layers, the final site reads a partial
    pytest.param("block", 4, 3, id="block-3-over-8"),  # odd block size, several partials
    pytest.param("block", 2, 4, id="block-one-whole"),  # one block of all sublayers
    pytest.param("delta", 5, 2, id="delta-2-of-5"),  # the last block is incomplete
    pytest.param("delta", 4, 1, id="delta-1"),  # a source per layer
    pytest.param("delta", 4, 4, id="delta-one-block"),  # no completed block is ever read
])
def test_layout_reads_what_each_site_routes_over(variant, layers, size):
    """A site's sources are its completed rows and its partial (full, block) or null source
    (delta); ``max_sources`` (a transformers forward's buffer) is the most any site reads,
    ``capacity`` the rows the model completes, and every completed block adds one row."""
    layout = layout_for(variant, layers, block_size=size, delta_block_layers=size)
    sites = range(1, 2 * layers + 1 + int(layout.has_final_site))
    assert layout.max_sources == max(layout.sources_read(j) for j in sites)
    assert layout.capacity == 1 + sum(layout.completes_block(j) for j in range(1, 2 * layers + 1))
    assert [len(layout.source_names(j)) for j in sites] == [layout.sources_read(j) for j in sites]
    if variant == "delta":
        assert isinstance(layout, DeltaLayout) and not layout.has_final_site
        assert [layout.sources_read(j) for j in sites] == [layout.rows_read(j) + 1 for j in sites]
        assert layout.capacity == layout.rows_read(2 * layers)  # the last layer reads every row
    else:
        assert isinstance(layout, DepthLayout) and layout.final_site == 2 * layers + 1
        assert [layout.sources_read(j) for j in sites] == [
            layout.rows_read(j) + layout.reads_partial(j) for j in sites]
        # a site reads the rows of the blocks before its own, and its own block's partial
        assert [layout.rows_read(j) for j in sites] == [layout.position(j)[0] for j in sites]
        assert [layout.boundary_width(j) for j in sites] == [layout.sources_read(j) for j in sites]

