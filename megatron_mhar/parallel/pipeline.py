"""Pipeline p2p shapes for MHAR decoders under Megatron's own schedules.

An MHAR chunk that is not the last pipeline stage sends its depth history packed along
the hidden dimension, ``[s, b, width * h]`` (docs/design.md, "Pipeline parallelism"), and the
width differs per boundary: :meth:`MHARTransformerBlock.input_width` and
:meth:`~MHARTransformerBlock.output_width` give it from the routing layout
(:mod:`~megatron_mhar.ops.routing_layout`) and the chunk's global layer offset (so uneven
first/last stages and ``pipeline_model_parallel_layout`` follow automatically). Megatron's schedules assume
``[s, b, h]`` everywhere; this module tells them the real shapes:

* Non-interleaved 1F1B: Megatron's ``adjust_tensor_shapes_fn`` hook
  (:func:`make_adjust_tensor_shapes_fn`) widens the receive shape to the chunk's input
  width and the output-gradient shape to its output width, per rank.
* Interleaved 1F1B: the schedule has one ``tensor_shape`` for every chunk and refuses
  ``adjust_tensor_shapes_fn``. Megatron's own way out, ``variable_seq_lengths=True``,
  exchanges the shape before every p2p call (an extra blocking round trip per hop, and
  it needs ``batch_isend_irecv``, which gloo lacks). :class:`LayoutP2PCommunicator` does
  better: the receive shapes are static, and the *order* of the messages on each link is
  fixed by the schedule table that every rank shares. Forward pass ``k`` of every rank
  runs chunk ``table[k]``; backward pass ``k`` runs chunk ``V - 1 - table[k]``; each pass
  sends one tensor to the neighbour, except the model's first and last stages. Messages
  on a link arrive in the order they were sent, so the ``n``-th tensor a rank receives
  from its previous (next) rank is for a chunk known in advance, and its shape is that
  chunk's input (output) width. The communicator plugs into Megatron's
  ``variable_seq_lengths`` path by answering ``_communicate_shapes`` from that list
  instead of communicating; the schedule itself is unchanged.

Cross-stage caching (``mhar.pipeline_cache``, on by default; interleaved schedules only): the
model chunks of a rank share a :class:`~megatron_mhar.ops.history.HistoryCache`, through
which each chunk hands its history of a micro-batch to the rank's next chunk. A boundary
then sends only the rows the receiving rank's previous chunk did not hold (the widths above
already say so: :meth:`MHARTransformerBlock.input_width`); the gradients of the cached rows
go back through the cache, added into the earlier chunk's gradient buffer by the later
chunk's backward, which the schedule runs first.

:func:`forward_backward` is the one call a training loop makes: it picks Megatron's
schedule (``get_forward_backward_func``) and adds the hook the layout needs. With
``variant: none`` (or PP=1) it calls Megatron's schedule unchanged.
"""

from __future__ import annotations

import copy
from typing import Callable, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.pipeline_parallel.schedules import get_schedule_table
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.utils import get_model_config

from megatron_mhar.models.block import MHARTransformerBlock
from megatron_mhar.ops.history import HistoryCache

__all__ = [
    "LayoutP2PCommunicator",
    "chunk_widths",
    "check_pipeline_config",
    "forward_backward",
    "make_adjust_tensor_shapes_fn",
    "receive_order",
    "send_order",
]

Shape = Tuple[int, int, int]


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while not hasattr(chunk, "decoder") and hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def chunk_widths(chunk: torch.nn.Module) -> Tuple[int, int]:
    """(input width, output width) of a model chunk's pipeline tensors, in multiples of h.

    1 and 1 for a plain Megatron decoder (``variant: none``).
    """
    decoder = getattr(_unwrap(chunk), "decoder", None)
    if isinstance(decoder, MHARTransformerBlock):
        return decoder.input_width(), decoder.output_width()
    return 1, 1


def _widen(shape: Sequence[int], width: int) -> Shape:
    s, b, h = shape
    return (s, b, h * width)


def make_adjust_tensor_shapes_fn(chunk: torch.nn.Module) -> Callable:
    """``adjust_tensor_shapes_fn`` for Megatron's non-interleaved 1F1B schedule.

    Megatron computes ``[s, b, h]`` (``s`` already divided for sequence / context
    parallelism) for what this rank receives (its input) and sends (its output, whose
    gradient it receives); the hook scales the hidden dimension by the chunk's widths.
    """
    input_width, output_width = chunk_widths(chunk)

    def adjust_tensor_shapes(recv_tensor_shapes, send_tensor_shapes):
        return (
            [_widen(shape, input_width) for shape in recv_tensor_shapes],
            [_widen(shape, output_width) for shape in send_tensor_shapes],
        )

    return adjust_tensor_shapes


def receive_order(
    pp_rank: int, pp_size: int, num_chunks: int, chunk_table: Sequence[int]
) -> Tuple[List[int], List[int]]:
    """The local chunk of every tensor this rank receives, in arrival order.

    Args:
        pp_rank, pp_size: this rank's pipeline position.
        num_chunks: model chunks per rank V (1 without interleaving).
        chunk_table: chunk run by forward pass ``k`` on every rank (Megatron's schedule
            table; all zeros without interleaving).

    Returns:
        (forward, backward): the chunk each activation received from the previous rank
        feeds, and the chunk whose output each gradient received from the next rank
        belongs to. The previous rank of rank 0 is rank ``P - 1`` holding the previous
        chunk (and the next rank of rank ``P - 1`` is rank 0 holding the next chunk).
    """
    last = num_chunks - 1
    forward, backward = [], []
    for chunk in chunk_table:
        # Forward: the previous rank sends the output of its pass on `chunk`, unless that
        # pass is the model's last stage (rank P-1, last chunk), which sends nothing.
        if pp_rank > 0:
            forward.append(chunk)
        elif chunk != last:
            forward.append(chunk + 1)
        # Backward passes run chunks in reverse; the model's first stage sends no grad.
        grad_chunk = last - chunk
        if pp_rank < pp_size - 1:
            backward.append(grad_chunk)
        elif grad_chunk != 0:
            backward.append(grad_chunk - 1)
    return forward, backward


def send_order(
    pp_rank: int, pp_size: int, num_chunks: int, chunk_table: Sequence[int]
) -> Tuple[List[int], List[int]]:
    """The local chunk of every tensor this rank sends, in send order: (forward, the chunk
    whose output each activation is; backward, the chunk whose input each gradient is).
    The model's last stage sends no activation and its first stage no gradient."""
    last = num_chunks - 1
    forward = [c for c in chunk_table if not (pp_rank == pp_size - 1 and c == last)]
    backward = [last - c for c in chunk_table if not (pp_rank == 0 and last - c == 0)]
    return forward, backward


class LayoutP2PCommunicator(P2PCommunicator):
    """Megatron's P2PCommunicator with receive shapes from the depth layout.

    Built for one ``forward_backward`` call (the order of messages depends on the number
    of micro-batches). It enables ``variable_seq_lengths`` on a private copy of the
    config, so Megatron's ``_communicate`` asks :meth:`_communicate_shapes` for the
    receive shapes; the answer comes from :func:`receive_order`, with no communication.

    Args:
        pp_group: the pipeline group.
        config: the model config (not modified).
        widths: ``(input width, output width)`` of each local chunk.
        num_microbatches: micro-batches of this call.
        base_shape: ``(s, b)`` of every pipeline tensor on this rank.

    ``sent_bytes`` counts the bytes of the tensors this rank hands to the process group, by
    ``("forward" | "backward", local chunk)`` (activations by the chunk that produced them,
    gradients by the chunk whose input they are).
    """

    def __init__(
        self,
        pp_group: torch.distributed.ProcessGroup,
        config,
        widths: Sequence[Tuple[int, int]],
        num_microbatches: int,
        base_shape: Tuple[int, int],
    ):
        shape_config = copy.copy(config)
        shape_config.variable_seq_lengths = True
        super().__init__(pp_group=pp_group, config=shape_config)
        num_chunks = len(widths)
        if num_chunks > 1:
            table = get_schedule_table(
                num_microbatches, num_chunks, config.microbatch_group_size_per_vp_stage
            )
            chunk_table = [chunk for _, chunk in table]
        else:
            chunk_table = [0] * num_microbatches
        forward, backward = receive_order(pp_group.rank(), pp_group.size(), num_chunks, chunk_table)
        s, b, h = base_shape[0], base_shape[1], config.hidden_size
        self._recv_prev: Iterator[List[int]] = iter([[s, b, widths[c][0] * h] for c in forward])
        self._recv_next: Iterator[List[int]] = iter([[s, b, widths[c][1] * h] for c in backward])
        send_forward, send_backward = send_order(pp_group.rank(), pp_group.size(), num_chunks, chunk_table)
        self._send_next: Iterator[int] = iter(send_forward)
        self._send_prev: Iterator[int] = iter(send_backward)
        self.sent_bytes = {}

    def _communicate(self, *, tensor_send_next, tensor_send_prev, **kwargs):
        for tensor, chunks, direction in ((tensor_send_next, self._send_next, "forward"),
                                          (tensor_send_prev, self._send_prev, "backward")):
            if tensor is not None:
                key = (direction, next(chunks))
                self.sent_bytes[key] = self.sent_bytes.get(key, 0) + tensor.numel() * tensor.element_size()
        return super()._communicate(tensor_send_next=tensor_send_next, tensor_send_prev=tensor_send_prev, **kwargs)

    def _communicate_shapes(self, tensor_send_next, tensor_send_prev, recv_prev, recv_next):
        prev_shape = self._next_shape(self._recv_prev, "activation") if recv_prev else [0, 0, 0]
        next_shape = self._next_shape(self._recv_next, "gradient") if recv_next else [0, 0, 0]
        return prev_shape, next_shape

    @staticmethod
    def _next_shape(shapes: Iterator[List[int]], what: str) -> List[int]:
        try:
            return next(shapes)
        except StopIteration:
            raise RuntimeError(
                f"the pipeline schedule received more {what} tensors than its schedule table "
                "predicts; LayoutP2PCommunicator assumes Megatron's interleaved 1F1B order "
                "(forward pass k runs chunk table[k] on every rank)"
            ) from None


def check_pipeline_config(config) -> None:
    """Raise for pipeline options the MHAR p2p shapes do not support (before training)."""
    if getattr(config, "variable_seq_lengths", False):
        raise ValueError(
            "variable_seq_lengths=True is not supported with MHAR pipeline parallelism: the "
            "p2p shapes are derived from the depth layout for a fixed sequence length; pad "
            "micro-batches to one length and set variable_seq_lengths=False"
        )
    if getattr(config, "overlap_moe_expert_parallel_comm", False):
        raise ValueError(
            "overlap_moe_expert_parallel_comm=True is not supported with MHAR decoders "
            "(no MoE layers); set it to False"
        )


def _pipeline_base_shape(config, seq_length, micro_batch_size, decoder_seq_length) -> Tuple[int, int]:
    """``(s, b)`` of a pipeline tensor, as Megatron's schedules compute it."""
    s = decoder_seq_length if decoder_seq_length is not None else seq_length
    s //= parallel_state.get_context_parallel_world_size()
    if config.sequence_parallel:
        s //= parallel_state.get_tensor_model_parallel_world_size()
    return s, micro_batch_size


def _default_pg_collection() -> ProcessGroupCollection:
    """The process groups Megatron's schedules use when none are passed."""
    pgs = ProcessGroupCollection()
    pgs.tp = parallel_state.get_tensor_model_parallel_group()
    pgs.cp = parallel_state.get_context_parallel_group()
    pgs.pp = parallel_state.get_pipeline_model_parallel_group()
    pgs.embd = parallel_state.get_embedding_group(check_initialized=False)
    pgs.pos_embd = parallel_state.get_position_embedding_group(check_initialized=False)
    pgs.dp_cp = parallel_state.get_data_parallel_group(
        with_context_parallel=True, partial_data_parallel=False
    )
    return pgs


def forward_backward(
    *,
    forward_step_func: Callable,
    data_iterator,
    model: Union[torch.nn.Module, List[torch.nn.Module]],
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    decoder_seq_length: Optional[int] = None,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    first_val_step: Optional[bool] = None,
    sent_bytes: Optional[dict] = None,
):
    """Megatron's ``forward_backward_func`` for the current layout, with MHAR p2p shapes.

    Same arguments and return value as the function ``get_forward_backward_func()``
    returns. ``model`` / ``data_iterator`` may be a list (one per virtual stage) or a
    single chunk / iterator. ``sent_bytes``, a dict, receives the bytes this rank sent under
    an interleaved schedule (:class:`LayoutP2PCommunicator`'s ``sent_bytes``).
    """
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    iterators = list(data_iterator) if isinstance(data_iterator, (list, tuple)) else [data_iterator]
    config = get_model_config(chunks[0])
    kwargs = dict(
        forward_step_func=forward_step_func,
        num_microbatches=num_microbatches,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        decoder_seq_length=decoder_seq_length,
        forward_only=forward_only,
        collect_non_loss_data=collect_non_loss_data,
        first_val_step=first_val_step,
    )
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    schedule = get_forward_backward_func()
    if pp_size == 1:
        return schedule(model=chunks if len(chunks) > 1 else chunks[0],
                        data_iterator=iterators if len(iterators) > 1 else iterators[0], **kwargs)
    widths = [chunk_widths(chunk) for chunk in chunks]
    if all(width == (1, 1) for width in widths):  # plain decoders: Megatron's shapes hold
        return schedule(model=chunks if len(chunks) > 1 else chunks[0],
                        data_iterator=iterators if len(iterators) > 1 else iterators[0], **kwargs)
    check_pipeline_config(config)
    if len(chunks) == 1:
        return schedule(
            model=chunks[0],
            data_iterator=iterators[0],
            adjust_tensor_shapes_fn=make_adjust_tensor_shapes_fn(chunks[0]),
            **kwargs,
        )
    pgs = _default_pg_collection()
    communicator = LayoutP2PCommunicator(
        pgs.pp,
        config,
        widths,
        num_microbatches,
        _pipeline_base_shape(config, seq_length, micro_batch_size, decoder_seq_length),
    )
    decoders = [_unwrap(chunk).decoder for chunk in chunks]
    cache = HistoryCache()
    for decoder in decoders:
        decoder.history_cache = cache
    try:
        result = schedule(
            model=chunks,
            data_iterator=iterators,
            p2p_communicator=communicator,
            pg_collection=pgs,
            **kwargs,
        )
    finally:
        for decoder in decoders:
            decoder.history_cache = None
    if len(cache):
        raise RuntimeError(f"{len(cache)} cached histories were never taken by a later pipeline chunk")
    if sent_bytes is not None:
        sent_bytes.update(communicator.sent_bytes)
    return result
