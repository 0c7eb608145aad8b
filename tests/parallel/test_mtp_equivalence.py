"""Multi-token prediction under model parallelism on CPU (gloo) == the single-process run.

The model of ``harness.MTP`` (two MTP depths, Megatron's MTP block on the last pipeline
stage, which also holds a tied copy of the embedding for them) trains under pipeline,
interleaved pipeline and tensor/sequence-parallel layouts through Megatron's schedules,
DDP, ``finalize_model_grads`` and optimizer; the losses and every gradient (the MTP
layers' and, through the MTP losses, every decoder and routing parameter's) must match the
single process as in ``test_equivalence``.
"""

from __future__ import annotations

from typing import List, Tuple

import pytest
import torch

from tests.helpers import DistributedStream
from tests.parallel import harness as H
from tests.parallel.test_equivalence import GRAD_ATOL, JOB_TIMEOUT_S, LOSS_RTOL, _assert_grads_close

L = H.Layout
JOBS = [
    # Megatron's own GPT: the MTP stage's embedding copy is tied to the first stage's
    pytest.param(L(pp=2), "mtp-none", id="pp2-none"),
    # the MTP block reads the final routing site of the last stage
    pytest.param(L(pp=2), "mtp-full", id="pp2-full"),
    # interleaved: MTP on the last virtual chunk; the delta stream crosses the chunks
    pytest.param(L(pp=2, vpp=2), "mtp-delta", id="pp2-vpp2-delta"),
    # eh_proj column-parallel, the MTP layers' tokens sharded over TP (SP)
    pytest.param(L(tp=2, sp=True), "mtp-block", id="tp2-sp-block"),
]
VARIANTS = sorted({p.values[1] for p in JOBS})


@pytest.fixture(scope="module")
def references():
    return H.references(VARIANTS)


@pytest.fixture(scope="module")
def parallel_runs(references):
    weights = {variant: ref[0] for variant, ref in references.items()}
    jobs: List[Tuple[H.Layout, str]] = [tuple(p.values) for p in JOBS]
    assert {layout.world for layout, _ in jobs} == {2}
    stream = DistributedStream(H.parallel_worker, 2, jobs, weights, item_timeout=JOB_TIMEOUT_S)
    try:
        yield lambda layout, variant: stream.result(jobs.index((layout, variant)))
    finally:
        stream.close()


@pytest.mark.parametrize("layout,variant", JOBS)
def test_mtp_parallel_matches_single_process(references, parallel_runs, layout, variant):
    _, expected_losses, expected_grads = references[variant]
    results = parallel_runs(layout, variant)
    for result in results:
        assert result["losses"] == pytest.approx(expected_losses, rel=LOSS_RTOL, abs=0)
    # The MTP stage's embedding copy holds the first stage's gradient (Megatron's
    # embedding-group all-reduce); gather_grads keeps one copy per name.
    copies = [r["grads"]["embedding.word_embeddings.weight"][0] for r in results
              if r["tp_rank"] == 0 and "embedding.word_embeddings.weight" in r["grads"]]
    assert len(copies) == (2 if layout.pp > 1 else 1)
    assert all(torch.equal(copy, copies[0]) for copy in copies)
    grads = H.gather_grads(results)
    if layout.pp > 1:
        # Megatron builds the last stage's output layer with a weight, but with MTP there the
        # tied weight is its embedding copy's: the output layer's own stays unused.
        assert not grads.pop("output_layer.weight").any()
    # the second depth's transformer layer (transformer_layer in megatron-core 0.16,
    # mtp_model_layer in 0.19)
    assert any(name.startswith("mtp.layers.1.") and ".self_attention." in name for name in grads)
    _assert_grads_close(grads, expected_grads)
    for name in H.replicated_names(results):
        scale = expected_grads.get(name, expected_grads["embedding.word_embeddings.weight"])
        assert H.replicated_grad_spread(results, name) <= GRAD_ATOL * scale.abs().max().item(), name
