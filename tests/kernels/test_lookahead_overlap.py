"""The overlapped phase-1 backward (``mhar.overlap_old_rows``) through a LookaheadHistory on
the Triton row-loop kernels: a chain of sublayers over a history, grouped, run with the
phase-1 backward whole and split at the group start below (the older rows second).

The rows' gradients must be bitwise those of the whole backward (each row's arithmetic is
the same, only the launch that does it differs) and the routers' gradients equal up to the
order of two reductions. On CPU the kernels run in the Triton interpreter in fp32 and the
split runs on one stream; on CUDA in bf16 too, and with the routers carrying Megatron DDP's
``main_grad`` the older rows go to the side stream.
"""

import pytest
import torch

from megatron_mhar.ops.history import get_backend
from megatron_mhar.ops.lookahead import GroupSite, LookaheadHistory, get_lookahead_backend, group_ranges

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPES = [torch.float32, torch.bfloat16] if CUDA else [torch.float32]


def _chain(overlap, dtype, main_grad, impl="triton", sites=9, group=3, heads=8, t=5, d=64):
    """Route ``sites`` sites in groups of ``group`` over a history whose row j is
    tanh(scale_j * x_j) of site j's output; returns (history, {name: gradient})."""
    gen = torch.Generator().manual_seed(0)

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen)).to(DEVICE)

    tokens = t * (64 if CUDA else 1) + 1
    embedding = randn(tokens, 1, d).to(dtype).requires_grad_()
    queries = [torch.nn.Parameter(randn(d, scale=0.3).to(dtype)) for _ in range(sites)]
    norms = [torch.nn.Parameter((1 + randn(d, scale=0.2)).to(dtype)) for _ in range(sites)]
    scales = [randn(d).to(dtype) for _ in range(sites)]
    weights = [randn(tokens, 1, d) for _ in range(sites)]
    if main_grad:  # as Megatron DDP sets them up
        for p in queries + norms:
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=DEVICE)
            p.grad_added_to_main_grad = False
    history = LookaheadHistory(
        capacity=sites, like=embedding, backend=get_backend(impl, DEVICE),
        lookahead=get_lookahead_backend(impl, DEVICE, "row_loop"), num_heads=heads, eps=1e-6,
        logit_scale=1.0, overlap_old_rows=overlap,
    )  # fmt: skip
    history.write(0, embedding)
    loss = 0.0
    for run in group_ranges(1, sites, group):
        members = [GroupSite(j, j, queries[j - 1], norms[j - 1]) for j in run]
        for index, j in enumerate(run):
            x = history.route_group(members, index)
            loss = loss + (x.float() * weights[j - 1]).sum()
            if j < sites:
                history.write(j, torch.tanh(x * scales[j - 1]))
    history.release()
    loss.backward()
    grads = {"embedding": embedding.grad}
    for name, params in (("query", queries), ("norm", norms)):
        for j, p in enumerate(params, 1):
            grads[f"{name}{j}"] = p.main_grad if main_grad else p.grad
    return history, grads


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("main_grad", [False, True] if CUDA else [False])
def test_overlapped_backward_matches_whole(dtype, main_grad):
    _, whole = _chain(False, dtype, main_grad)
    history, split = _chain(True, dtype, main_grad)
    assert history.old_rows_split(_group_at(history, 7)) == 4  # the split happened
    assert (history._side_stream is not None) == (CUDA and main_grad)
    assert not history._side_jobs  # the last read (row 0) waited for every job
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-3)
    for name, grad in whole.items():
        torch.testing.assert_close(split[name].float(), grad.float(), **tol, msg=lambda m: f"{name}: {m}")


def test_overlapped_backward_matches_reference():
    """The split backward against the torch backend's history (which defers instead)."""
    _, reference = _chain(False, torch.float32, False, impl="torch")
    _, split = _chain(True, torch.float32, False)
    for name, grad in reference.items():
        torch.testing.assert_close(split[name], grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_no_split_where_the_backend_defers():
    """The torch backend (and the tensor-core kernels) leave the rows' gradients deferred,
    so there is nothing to overlap: the group's backward stays whole."""
    history, _ = _chain(True, torch.float32, False, impl="torch")
    assert history.old_rows_split(_group_at(history, 7)) == 0


def _group_at(history, old_rows):
    """A stand-in group of three sites starting at ``old_rows`` (what old_rows_split reads)."""
    sites = [GroupSite(old_rows + k, old_rows + k, None, None) for k in range(3)]
    return type("Group", (), {"sites": sites, "old_rows": old_rows})()
