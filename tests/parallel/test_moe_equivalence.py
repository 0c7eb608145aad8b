"""Expert parallelism on CPU (gloo) == the single-process run, for MoE models.

The MoE model (``harness.MOE``: Megatron's MoE layer in each of the 4 decoder layers, 4
experts top-2, the load-balancing and z-losses on) trains under layouts that split its
experts over expert-parallel ranks, beside TP/SP/DP/PP/VPP, through Megatron's process
groups, schedules, DDP, ``finalize_model_grads`` and optimizer; losses and every gradient
(experts gathered back by their global index) must match the single process as in
``test_equivalence``; the interleaved pipeline with cross-stage caching also equals the
same layout without it. One process group per world size streams the jobs.

Tensor parallelism (which MoE trains only with sequence parallelism) is compared with the
single process at half the router-loss coefficients: megatron-core 0.16.1 scales each
rank's load-balancing and z-loss by its own token count under ``calculate_per_token_loss``
(the driver's loss), so with the tokens split over TP ranks their gradients are 1/TP of the
unsplit run's (Megatron-LM pull request #5047 multiplies them by the TP x CP size).
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import pytest

from tests.helpers import DistributedStream
from tests.parallel import harness as H
from tests.parallel.test_equivalence import (
    GRAD_ATOL,
    JOB_TIMEOUT_S,
    LOSS_RTOL,
    _assert_grads_close,
    assert_runs_close,
)

L = H.Layout
JOBS = [
    # 2 experts per rank; tokens all-gathered over the expert-parallel (= data-parallel) ranks
    pytest.param(L(dp=2, ep=2), "moe-full", id="ep2-full"),
    # the source history crosses the stage boundary while the experts are split
    pytest.param(L(pp=2, dp=2, ep=2), "moe-full", id="ep2-pp2-full"),
    # interleaved: one MoE layer per virtual chunk; the delta stream and block sources cross
    # (chunk 1 of each rank takes chunk 0's rows from the cross-stage cache)
    pytest.param(L(pp=2, vpp=2, dp=2, ep=2), "moe-delta", id="ep2-pp2-vpp2-delta"),
    # the same without the cache
    pytest.param(L(pp=2, vpp=2, dp=2, ep=2, pipeline_cache=False), "moe-delta", id="ep2-pp2-vpp2-delta-nocache"),
    # tokens sharded over TP (SP); each rank holds its experts whole (expert TP 1) beside
    # tensor-parallel attention
    pytest.param(L(tp=2, sp=True, dp=2, ep=2, etp=1), "moe-full", id="tp2-sp-ep2-etp1-full"),
]


def reference_variant(layout: H.Layout, variant: str) -> str:
    """The single-process model a layout's run equals (see the module's docstring)."""
    assert layout.tp in (1, 2)
    return variant.replace("moe-", "moe-halfloss-") if layout.tp == 2 else variant


VARIANTS = sorted({p.values[1] for p in JOBS} | {reference_variant(*p.values) for p in JOBS})


@pytest.fixture(scope="module")
def references():
    return H.references(VARIANTS)


@pytest.fixture(scope="module")
def parallel_runs(references):
    weights = {variant: ref[0] for variant, ref in references.items()}
    jobs = [tuple(p.values) for p in JOBS]
    streams: Dict[int, Tuple[DistributedStream, List[Tuple[H.Layout, str]]]] = {}

    def get(layout: H.Layout, variant: str) -> List[dict]:
        if layout.world not in streams:
            mine = [job for job in jobs if job[0].world == layout.world]
            streams[layout.world] = (DistributedStream(H.parallel_worker, layout.world, mine, weights,
                                                       item_timeout=JOB_TIMEOUT_S), mine)
        stream, mine = streams[layout.world]
        return stream.result(mine.index((layout, variant)))

    try:
        yield get
    finally:
        for stream, _ in streams.values():
            stream.close()


@pytest.mark.parametrize("layout,variant", JOBS)
def test_expert_parallel_matches_single_process(references, parallel_runs, layout, variant):
    _, expected_losses, expected_grads = references[reference_variant(layout, variant)]
    results = parallel_runs(layout, variant)
    for result in results:
        assert result["losses"] == pytest.approx(expected_losses, rel=LOSS_RTOL, abs=0)
    grads = H.gather_grads(results)
    assert any(".mlp.experts.local_experts.3." in name for name in grads)  # every expert gathered
    _assert_grads_close(grads, expected_grads)
    for name in H.replicated_names(results):
        scale = expected_grads.get(name, expected_grads["embedding.word_embeddings.weight"])
        assert H.replicated_grad_spread(results, name) <= GRAD_ATOL * scale.abs().max().item(), name


def test_pipeline_cache_with_experts_matches_the_uncached_schedule(parallel_runs):
    """Cross-stage caching beside expert parallelism: the same losses and gradients as the
    uncached schedule (the MoE layers' all-gathers interleave with the cache's hand-overs)."""
    cached, uncached = L(pp=2, vpp=2, dp=2, ep=2), L(pp=2, vpp=2, dp=2, ep=2, pipeline_cache=False)
    assert_runs_close(parallel_runs(cached, "moe-delta"), parallel_runs(uncached, "moe-delta"))
