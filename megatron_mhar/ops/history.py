"""The per-micro-batch source history: one preallocated buffer of all routing sources.

A forward pass of an MHAR decoder creates one :class:`SourceHistory`. Every sublayer
writes its output into one row of the buffer exactly once and every routing site reads
a prefix of the rows in place, so nothing is stacked per call. The buffer layout is
``[s, b, R, h]``: the rows of one token are contiguous (the fused kernels read a token's
sources in one sweep) and a prefix of rows packs for a pipeline send as a free view
``[s, b, n * h]`` (docs/design.md, "Pipeline parallelism").

Autograd. Rows are written in place, so the graph is ordered by a chain of 0-dim
*tokens*: every write consumes the previous token and produces the next, and every read
consumes the token current at its call. Autograd runs a node's backward only after all
consumers of its outputs have run theirs; hence the backward of the write of row ``i``
runs after the backward of every read that saw row ``i``. Reads add their source
gradients into one fp32 gradient buffer (in place, deterministic); the write of row
``i`` hands ``grad_buffer[..., i, :]`` to the sublayer that produced the row, exactly
once. Reads save no copies of the sources: backward reads the buffer, whose rows never
change after they are written.

No module-global state: a history lives as long as its autograd graph, so several
micro-batches may be in flight (pipeline schedules), and activation recomputation may
re-run a layer, which rewrites the same rows with the same values.
"""

import collections
from typing import Callable, Deque, Dict, NamedTuple, Optional, Tuple

import torch

from megatron_mhar.ops.depth_route import resolve_impl, torch_route_backward, torch_route_forward


def torch_copy_rows(src: torch.Tensor, dst: torch.Tensor) -> None:
    """``dst.copy_(src)`` for two ``[T, D]`` views (a history row and a sublayer's tensor)."""
    dst.copy_(src)


class RoutingBackend(NamedTuple):
    """Forward/backward pair routing over a [T, N, D] view of the history buffer, and the
    copy of a ``[T, D]`` row between the buffers and the sublayers (``copy_rows``).

    The backward returns every gradient in the dtype of its input (extra, query, norm
    weight), so the autograd functions below hand them on without casts.
    """

    forward: Callable
    backward: Callable
    copy_rows: Callable = torch_copy_rows


TORCH_BACKEND = RoutingBackend(torch_route_forward, torch_route_backward)


def get_backend(impl: str, device: torch.device) -> RoutingBackend:
    """The routing backend for ``impl`` (``auto`` picks Triton on CUDA when available)."""
    if resolve_impl(impl, device) == "torch":
        return TORCH_BACKEND
    from mhar_kernels import depth_route as fused
    from mhar_kernels import rows

    return RoutingBackend(fused.route_forward, fused.route_backward, rows.copy_rows)


class SourceHistory:
    """Sources of one micro-batch's forward pass, in one buffer ``[s, b, R, h]``.

    Args:
        capacity: R, the number of rows this pipeline stage ever holds.
        like: an ``[s, b, h]`` tensor giving the token shape, dtype and device.
        backend: the routing backend (reference or fused).
        num_heads, eps, logit_scale: routing hyper-parameters (the MHAR paper).
    """

    def __init__(
        self,
        capacity: int,
        like: torch.Tensor,
        backend: RoutingBackend,
        num_heads: int,
        eps: float,
        logit_scale: float,
    ):
        s, b, h = like.shape
        self.shape = (s, b, h)
        self.capacity = capacity
        self.buffer = like.new_empty(s, b, capacity, h)
        self._flat = self.buffer.view(s * b, capacity, h)  # one view for every read
        self._grad_buffer: Optional[torch.Tensor] = None
        self._grad_flat: Optional[torch.Tensor] = None
        self.backend = backend
        self.num_heads = num_heads
        self.eps = eps
        self.logit_scale = logit_scale
        self.token: Optional[torch.Tensor] = None
        self.rows_written = 0

    # -- views ------------------------------------------------------------------------
    def rows(self, stop: int, start: int = 0) -> torch.Tensor:
        """[T, stop - start, h] view of rows ``[start, stop)`` (T = s * b tokens)."""
        return self._flat[:, start:stop]

    def _allocate_grad(self) -> None:
        """fp32 row gradients, allocated by the first backward that needs them and not
        zero-filled: a row holds no gradient until a kernel stores one
        (:meth:`grad_rows_to_store`) or a read that adds into it zeroes it first
        (:meth:`grad_rows`). The first kernel to reach a row then stores instead of adding,
        which saves the buffer's fill and one read of each row (at 100M 839 MB of each per
        micro-batch)."""
        if self._grad_buffer is None:
            self._grad_buffer = torch.empty(
                self.buffer.shape, dtype=torch.float32, device=self.buffer.device
            )
            self._grad_flat = self._grad_buffer.view(self._flat.shape)
            self._grad_unset = [True] * self.capacity

    def _zero_unset(self, stop: int, start: int) -> None:
        """Zero the rows in ``[start, stop)`` that hold no gradient yet, one fill per run."""
        self._allocate_grad()
        unset = self._grad_unset
        if not any(unset[start:stop]):  # the usual case after the first backward read
            return
        row = start
        while row < stop:
            if not unset[row]:
                row += 1
                continue
            end = row
            while end < stop and unset[end]:
                unset[end] = False
                end += 1
            self._grad_flat[:, row:end].zero_()
            row = end

    @property
    def grad_buffer(self) -> torch.Tensor:
        """fp32 gradients of the rows ``[s, b, R, h]``, every row holding one."""
        self._zero_unset(self.capacity, 0)
        return self._grad_buffer

    def grad_rows(self, stop: int, start: int = 0) -> torch.Tensor:
        """[T, stop - start, h] fp32 view of the gradients of rows ``[start, stop)``, to add
        into or read (rows that held none are zeroed)."""
        self._zero_unset(stop, start)
        return self._grad_flat[:, start:stop]

    def grad_rows_to_store(self, stop: int, start: int = 0) -> Tuple[torch.Tensor, bool]:
        """(view, accumulate) of rows ``[start, stop)`` for a kernel that adds into every
        element of them: ``accumulate`` is False when none holds a gradient yet, and the
        kernel may then store instead of adding (call :meth:`mark_stored` once it has);
        otherwise the rows that held none are zeroed and it must add."""
        self._allocate_grad()
        if stop > start and all(self._grad_unset[start:stop]):
            return self._grad_flat[:, start:stop], False
        return self.grad_rows(stop, start), True

    def mark_stored(self, stop: int, start: int = 0) -> None:
        """Rows ``[start, stop)`` now hold gradients (a kernel stored every element)."""
        self._grad_unset[start:stop] = [False] * (stop - start)

    def due_grads(self, stop: int, start: int = 0) -> torch.Tensor:
        """fp32 gradients ``[s, b, stop - start, h]`` of rows ``[start, stop)`` once every
        read of them has added its share: the backward of their write (or load) takes them.
        A history whose reads defer part of their gradients adds it here."""
        self._zero_unset(stop, start)
        return self._grad_buffer[:, :, start:stop]

    def store_row(self, row: int, source: torch.Tensor) -> None:
        """Copy ``source`` [s, b, h] into row ``row`` of the buffer."""
        s, b, h = self.shape
        flat = source.reshape(s * b, h)
        self.backend.copy_rows(flat if flat.stride(1) == 1 else flat.contiguous(), self._flat[:, row])

    def due_row_grad(self, row: int, dtype: torch.dtype) -> torch.Tensor:
        """Row ``row``'s due gradient (:meth:`due_grads`) as a new [s, b, h] tensor in ``dtype``,
        for the sublayer that wrote the row."""
        s, b, h = self.shape
        grad = self.due_grads(row + 1, row)[:, :, 0].reshape(s * b, h)  # a view: s, b merge
        out = torch.empty((s, b, h), dtype=dtype, device=grad.device)
        self.backend.copy_rows(grad, out.view(s * b, h))
        return out

    def release(self) -> None:
        """Drop the last token once the forward pass is done.

        The autograd nodes keep the history (for the buffer) and the history keeps the
        last token, an output of one of those nodes: a reference cycle through C++ that
        Python's garbage collector cannot free, which would keep every micro-batch's
        graph alive. Call this when no more reads or writes follow.
        """
        self.token = None

    # -- the operations the model uses --------------------------------------------
    def write(self, row: int, source: torch.Tensor) -> None:
        """Store ``source`` [s, b, h] as row ``row`` (each row is written once per pass)."""
        if not 0 <= row < self.capacity:
            raise IndexError(f"row {row} outside the history's {self.capacity} rows")
        self.token = _WriteRow.apply(self, row, source, self.token)
        self.rows_written = max(self.rows_written, row + 1)

    def route(
        self,
        num_rows: int,
        query: torch.Tensor,
        norm_weight: torch.Tensor,
        extra: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Route over rows ``[0, num_rows)`` (plus ``extra`` [s, b, h]); returns [s, b, h]."""
        if not 0 < num_rows <= self.rows_written:
            raise IndexError(
                f"routing over {num_rows} rows but only {self.rows_written} are written"
            )
        return _RouteRows.apply(self, num_rows, self.token, query, norm_weight, extra)

    def pack(self, stop: int, start: int = 0) -> torch.Tensor:
        """Rows ``[start, stop)`` as one ``[s, b, (stop - start) * h]`` tensor (a pipeline send;
        ``start`` > 0 leaves out the rows the receiving rank holds already)."""
        return _PackRows.apply(self, stop, start, self.token)

    def load(self, packed: torch.Tensor, stop: int, start: int = 0,
             cached: Optional["SourceHistory"] = None) -> None:
        """Fill rows ``[start, stop)`` from a received ``[s, b, (stop - start) * h]`` tensor and
        rows ``[0, start)`` from ``cached``, the history of this rank's earlier pipeline chunk
        of the same micro-batch (cross-stage caching). Backward hands the received rows'
        gradients to ``packed`` and adds the cached rows' into ``cached``'s gradient buffer,
        before that chunk's backward (it runs later: the chunks are a chain), so each cached
        row's gradient reaches its producer once."""
        s, b, h = self.shape
        if packed.shape != (s, b, (stop - start) * h):
            raise ValueError(
                f"received history of shape {tuple(packed.shape)}, expected "
                f"{(s, b, (stop - start) * h)} ({stop - start} sources of width {h})"
            )
        if start > 0 and (cached is None or cached.rows_written < start):
            have = 0 if cached is None else cached.rows_written
            raise ValueError(f"loading rows from {start} needs a cached history of {start} rows, got {have}")
        self.token = _LoadRows.apply(self, stop, start, cached, packed)
        self.rows_written = max(self.rows_written, stop)


class HistoryCache:
    """One rank's source histories handed from each pipeline chunk to the next chunk of the same
    rank, per micro-batch in flight (cross-stage caching under interleaved pipelines).

    Chunk ``v`` puts each micro-batch's history after its forward; chunk ``v + 1`` takes it
    before its forward of that micro-batch. Every chunk runs its micro-batches in order
    (Megatron's schedules), so one FIFO per chunk pairs them without micro-batch ids.
    """

    def __init__(self):
        self._queues: Dict[int, Deque[SourceHistory]] = collections.defaultdict(collections.deque)

    def put(self, chunk: int, history: SourceHistory) -> None:
        """Keep local chunk ``chunk``'s history of its latest micro-batch for chunk ``chunk + 1``."""
        self._queues[chunk].append(history)

    def take(self, chunk: int) -> SourceHistory:
        """The history local chunk ``chunk - 1`` kept for the micro-batch chunk ``chunk`` runs next."""
        queue = self._queues.get(chunk - 1)
        if not queue:
            raise RuntimeError(
                f"pipeline chunk {chunk} runs a micro-batch that chunk {chunk - 1} of this rank has "
                "not run: the cross-stage cache assumes Megatron's interleaved schedule"
            )
        return queue.popleft()

    def __len__(self) -> int:
        """Histories kept and not yet taken."""
        return sum(len(queue) for queue in self._queues.values())


def _new_token(reference: torch.Tensor) -> torch.Tensor:
    return reference.new_empty(())


class _WriteRow(torch.autograd.Function):
    @staticmethod
    def forward(ctx, history, row, source, token):
        history.store_row(row, source)
        ctx.set_materialize_grads(False)
        ctx.history, ctx.row, ctx.dtype = history, row, source.dtype
        return _new_token(source)

    @staticmethod
    def backward(ctx, _grad_token):
        return None, None, ctx.history.due_row_grad(ctx.row, ctx.dtype), None


def _route_forward(ctx, history, num_rows, query, norm_weight, extra):
    """Forward of a read; returns out [s, b, h]."""
    s, b, h = history.shape
    flat_extra = None if extra is None else extra.reshape(s * b, h)
    out, saved = history.backend.forward(
        history.rows(num_rows),
        flat_extra,
        query,
        norm_weight,
        history.num_heads,
        history.eps,
        history.logit_scale,
    )
    out = out.view(s, b, h)
    ctx.set_materialize_grads(False)
    ctx.history, ctx.num_rows, ctx.saved = history, num_rows, saved
    return out


def _route_backward(ctx, grad_out, query, norm_weight, extra):
    """(grad_extra [s, b, h] or None, grad_query, grad_norm) of a read."""
    history = ctx.history
    s, b, h = history.shape
    grad_extra, grad_query, grad_norm = history.backend.backward(
        grad_out.reshape(s * b, h),
        history.rows(ctx.num_rows),
        None if extra is None else extra.reshape(s * b, h),
        query,
        norm_weight,
        ctx.saved,
        history.num_heads,
        history.eps,
        history.logit_scale,
        history.grad_rows(ctx.num_rows),
    )
    if grad_extra is not None:
        grad_extra = grad_extra.view(s, b, h)
    return grad_extra, grad_query, grad_norm


class _RouteRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, history, num_rows, token, query, norm_weight, extra):
        ctx.save_for_backward(query, norm_weight, extra)
        return _route_forward(ctx, history, num_rows, query, norm_weight, extra)

    @staticmethod
    def backward(ctx, grad_out):
        if grad_out is None:  # the routed output was not used
            return (None,) * 6
        query, norm_weight, extra = ctx.saved_tensors
        grad_extra, grad_query, grad_norm = _route_backward(ctx, grad_out, query, norm_weight, extra)
        # Tokens carry ordering only; their gradient is None (materialize_grads is off,
        # so no zero tensors are allocated, and autograd still runs the producers).
        return None, None, None, grad_query, grad_norm, grad_extra


class _PackRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, history, stop, start, token):
        s, b, h = history.shape
        ctx.set_materialize_grads(False)
        ctx.history, ctx.stop, ctx.start = history, stop, start
        return history.buffer[:, :, start:stop].reshape(s, b, (stop - start) * h).clone()

    @staticmethod
    def backward(ctx, grad_packed):
        if grad_packed is not None:
            history, stop, start = ctx.history, ctx.stop, ctx.start
            s, b, h = history.shape
            grads, accumulate = history.grad_rows_to_store(stop, start)
            received = grad_packed.view(s * b, stop - start, h)
            if accumulate:
                grads.add_(received)
            else:  # the later stage's share is the first: copied, no fill and add
                grads.copy_(received)
                history.mark_stored(stop, start)
        return None, None, None, None


class _LoadRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, history, stop, start, cached, packed):
        s, b, h = history.shape
        if start > 0:
            history.buffer[:, :, :start].copy_(cached.buffer[:, :, :start])
        history.buffer[:, :, start:stop].copy_(packed.view(s, b, stop - start, h))
        ctx.set_materialize_grads(False)
        ctx.history, ctx.stop, ctx.start, ctx.cached, ctx.dtype = history, stop, start, cached, packed.dtype
        return _new_token(packed)

    @staticmethod
    def backward(ctx, _grad_token):
        history, stop, start = ctx.history, ctx.stop, ctx.start
        s, b, h = history.shape
        grad = history.due_grads(stop)
        if start > 0:
            ctx.cached.grad_rows(start).add_(grad[:, :, :start].reshape(s * b, start, h))
        received = grad[:, :, start:].reshape(s, b, (stop - start) * h).to(ctx.dtype)
        return None, None, None, None, received
