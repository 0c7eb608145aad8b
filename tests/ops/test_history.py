"""SourceHistory (in-place buffer + token-ordered autograd) against the functional op."""

import pytest
import torch

from megatron_mhar.ops import depth_route_reference
from megatron_mhar.ops.history import TORCH_BACKEND, SourceHistory

S, B, D, H = 5, 2, 16, 4


def _history(capacity, like):
    return SourceHistory(capacity, like, TORCH_BACKEND, num_heads=H, eps=1e-6, logit_scale=1.3)


def _router():
    return (torch.randn(D, requires_grad=True), (1 + 0.2 * torch.randn(D)).requires_grad_(True))


def _sublayer(x, weight):
    """A stand-in sublayer with its own parameters, so gradients reach earlier sources."""
    return torch.tanh(x @ weight)


@pytest.mark.parametrize("num_sublayers", [1, 4, 9], ids=["one", "four", "nine"])
def test_history_matches_stacked_reference(num_sublayers):
    """A chain of routed sublayers: the history gives the stacked reference's outputs and grads."""
    embedding = torch.randn(S, B, D, requires_grad=True)
    routers = [_router() for _ in range(num_sublayers + 1)]
    weights = [torch.randn(D, D, requires_grad=True) * 0.3 for _ in range(num_sublayers)]
    weights = [w.detach().requires_grad_(True) for w in weights]

    def run(use_history):
        if use_history:
            history = _history(num_sublayers + 1, embedding)
            history.write(0, embedding)
        sources = [embedding]
        for j in range(1, num_sublayers + 1):
            query, norm = routers[j - 1]
            if use_history:
                x = history.route(j, query, norm)
            else:
                x = depth_route_reference(torch.stack(sources), query, norm, H, logit_scale=1.3)
            out = _sublayer(x, weights[j - 1])
            sources.append(out)
            if use_history:
                history.write(j, out)
        query, norm = routers[-1]
        if use_history:
            return history.route(num_sublayers + 1, query, norm)
        return depth_route_reference(torch.stack(sources), query, norm, H, logit_scale=1.3)

    leaves = [embedding, *weights, *[t for r in routers for t in r]]
    grad_out = torch.randn(S, B, D)
    expected = run(False)
    expected_grads = torch.autograd.grad(expected, leaves, grad_out)
    actual = run(True)
    actual_grads = torch.autograd.grad(actual, leaves, grad_out)
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)
    for got, want in zip(actual_grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_route_reads_only_earlier_rows():
    """Causality: the input of site j has zero gradient w.r.t. rows at or after j."""
    rows = [torch.randn(S, B, D, requires_grad=True) for _ in range(5)]
    history = _history(5, rows[0])
    for index, row in enumerate(rows):
        history.write(index, row)
    query, norm = _router()
    # Re-reading after all rows exist: route over the first 3 rows only.
    x = history.route(3, query, norm)
    grads = torch.autograd.grad(x.sum(), rows, allow_unused=True)
    assert all(g.abs().sum() > 0 for g in grads[:3])
    assert all(g is None or g.abs().sum() == 0 for g in grads[3:])


def test_extra_source_is_routed_last():
    """The block variant's running partial joins as source N."""
    rows = [torch.randn(S, B, D, requires_grad=True) for _ in range(3)]
    partial = torch.randn(S, B, D, requires_grad=True)
    history = _history(3, rows[0])
    for index, row in enumerate(rows):
        history.write(index, row)
    query, norm = _router()
    x = history.route(3, query, norm, extra=partial)
    expected = depth_route_reference(torch.stack(rows + [partial]), query, norm, H, logit_scale=1.3)
    torch.testing.assert_close(x, expected)
    leaves = rows + [partial, query, norm]
    got = torch.autograd.grad(x.square().sum(), leaves)
    want = torch.autograd.grad(expected.square().sum(), leaves)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_pack_and_load_round_trip_gradients():
    """A pipeline boundary: pack on one stage, load on the next, gradients flow back."""
    rows = [torch.randn(S, B, D, requires_grad=True) for _ in range(3)]
    sender = _history(4, rows[0])
    for index, row in enumerate(rows):
        sender.write(index, row)
    packed = sender.pack(3)
    assert packed.shape == (S, B, 3 * D)
    received = packed.detach().requires_grad_(True)
    receiver = _history(4, rows[0])
    receiver.load(received, 3)
    query, norm = _router()
    x = receiver.route(3, query, norm)
    x.square().sum().backward()
    packed.backward(received.grad)
    expected = depth_route_reference(torch.stack(rows), query.detach(), norm.detach(), H, logit_scale=1.3)
    want = torch.autograd.grad(expected.square().sum(), rows)
    for row, w in zip(rows, want):
        torch.testing.assert_close(row.grad, w, rtol=1e-5, atol=1e-6)


def test_cached_rows_send_their_gradients_to_the_earlier_chunk():
    """Cross-stage caching: a rank's later chunk takes rows 0-1 from its earlier chunk's
    history and receives only row 2; the later chunk's backward (first, as in the pipeline)
    adds the cached rows' gradients into the earlier history, whose own backward then hands
    each row's whole gradient to its producer once."""
    rows = [torch.randn(S, B, D, requires_grad=True) for _ in range(3)]
    (q0, n0), (q1, n1) = _router(), _router()
    earlier = _history(2, rows[0])
    earlier.write(0, rows[0])
    earlier.write(1, rows[1])
    x0 = earlier.route(2, q0, n0)
    sender = _history(3, rows[0])  # another rank's chunk, holding all three rows
    for index, row in enumerate(rows):
        sender.write(index, row.detach())
    packed = sender.pack(3, start=2)
    assert packed.shape == (S, B, D)
    torch.testing.assert_close(packed, rows[2].detach())
    received = packed.detach().requires_grad_(True)
    later = _history(4, rows[0])
    later.load(received, 3, start=2, cached=earlier)
    x1 = later.route(3, q1, n1)
    x1.square().sum().backward()
    rows[2].grad = received.grad.clone()
    x0.square().sum().backward()

    stacked = torch.stack(rows)
    want_x0 = depth_route_reference(stacked[:2], q0.detach(), n0.detach(), H, logit_scale=1.3)
    want_x1 = depth_route_reference(stacked, q1.detach(), n1.detach(), H, logit_scale=1.3)
    want = torch.autograd.grad(want_x0.square().sum() + want_x1.square().sum(), rows)
    for row, w in zip(rows, want):
        torch.testing.assert_close(row.grad, w, rtol=1e-5, atol=1e-6)


def test_loading_past_the_cache_raises():
    like = torch.randn(S, B, D)
    cached = _history(1, like)
    cached.write(0, like)
    with pytest.raises(ValueError, match="cached history of 2 rows"):
        _history(3, like).load(torch.randn(S, B, D), 3, start=2, cached=cached)


def test_reading_unwritten_rows_raises():
    like = torch.zeros(S, B, D)
    history = _history(4, like)
    history.write(0, like)
    with pytest.raises(IndexError, match="only 1 are written"):
        history.route(2, torch.zeros(D), torch.ones(D))
    with pytest.raises(IndexError, match="outside the history"):
        history.write(4, like)
    with pytest.raises(ValueError, match="expected"):
        history.load(torch.zeros(S, B, 3 * D + 1), 3)
