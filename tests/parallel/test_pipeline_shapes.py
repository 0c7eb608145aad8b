"""Receive order of the layout-driven p2p communicator, and the combinations refused early."""

import pytest
import torch

from megatron_mhar.models.mhar_config import MHARConfig


def _sent_messages(pp, chunks, table):
    """Every link's messages from the *senders'* side, in send order.

    Rank q runs forward pass k on chunk table[k] and sends the output to rank q + 1
    (rank 0, next chunk, when q = P - 1) unless it is the model's last stage; backward
    pass k runs chunk V - 1 - table[k] and sends the input grad to rank q - 1 (rank P - 1,
    previous chunk, when q = 0) unless it is the model's first stage.
    """
    forward = {r: [] for r in range(pp)}
    backward = {r: [] for r in range(pp)}
    for q in range(pp):
        for chunk in table:
            if not (q == pp - 1 and chunk == chunks - 1):
                forward[(q + 1) % pp].append(chunk + (q == pp - 1))
            grad_chunk = chunks - 1 - chunk
            if not (q == 0 and grad_chunk == 0):
                backward[(q - 1) % pp].append(grad_chunk - (q == 0))
    return forward, backward


@pytest.mark.parametrize(
    "pp,chunks,microbatches,group",
    [
        pytest.param(2, 1, 4, 2, id="1f1b-pp2"),  # non-interleaved: one chunk
        pytest.param(4, 1, 8, 4, id="1f1b-pp4"),
        pytest.param(2, 2, 4, 2, id="pp2-vpp2"),  # the CPU equivalence layout
        pytest.param(4, 2, 8, 4, id="pp4-vpp2"),
        pytest.param(4, 3, 12, 4, id="pp4-vpp3"),  # 1B recipe: 36 layers in 12 chunks
        pytest.param(2, 2, 5, 3, id="pp2-vpp2-group3"),  # microbatch groups larger than PP
        pytest.param(4, 2, 6, 4, id="pp4-vpp2-ragged"),  # last group smaller than the others
    ],
)
def test_receive_order_matches_what_neighbours_send(pp, chunks, microbatches, group):
    from megatron.core.pipeline_parallel.schedules import get_schedule_table

    from megatron_mhar.parallel import receive_order

    if chunks > 1:
        table = [c for _, c in get_schedule_table(microbatches, chunks, group)]
    else:
        table = [0] * microbatches
    sent_forward, sent_backward = _sent_messages(pp, chunks, table)
    for rank in range(pp):
        forward, backward = receive_order(rank, pp, chunks, table)
        assert forward == sent_forward[rank]
        assert backward == sent_backward[rank]
        # every chunk with a previous (next) stage receives one tensor per micro-batch
        for chunk in range(chunks):
            has_prev = not (rank == 0 and chunk == 0)
            has_next = not (rank == pp - 1 and chunk == chunks - 1)
            assert forward.count(chunk) == microbatches * has_prev
            assert backward.count(chunk) == microbatches * has_next


def _model_config():
    from megatron_mhar.models.gpt_config import GPTModelConfig

    return GPTModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=64)


REJECTED = [
    pytest.param(dict(context_parallel_size=2), "context_parallel_size", id="context-parallel"),
    pytest.param(dict(cuda_graph_impl="local"), "cuda_graph_impl", id="cuda-graphs"),
    pytest.param(dict(cuda_graph_impl="transformer_engine"), "cuda_graph_impl", id="te-cuda-graphs"),
    pytest.param(dict(pipeline_model_parallel_size=2, pipeline_dtype=torch.float32,
                      variable_seq_lengths=True, moe_token_dispatcher_type="alltoall"),
                 "variable_seq_lengths", id="pp-variable-seq"),
]


@pytest.mark.parametrize("variant", ["full", "block"])
@pytest.mark.parametrize("overrides,option", REJECTED)
def test_unsupported_combinations_fail_at_config_time(variant, overrides, option):
    """Refused when the TransformerConfig is built (before any process group or model),
    with the option's name in the message."""
    from megatron_mhar.models.builder import make_transformer_config

    with pytest.raises(ValueError, match=option):
        make_transformer_config(_model_config(), MHARConfig(variant=variant, block_size=4), **overrides)


def test_uneven_pipeline_stages_are_accepted():
    """num_layers_in_first/last_pipeline_stage: the widths follow from the layer offsets."""
    from megatron_mhar.models.builder import make_transformer_config

    config = make_transformer_config(
        _model_config(), MHARConfig(variant="full"), pipeline_model_parallel_size=2,
        pipeline_dtype=torch.float32, num_layers_in_first_pipeline_stage=1,
        num_layers_in_last_pipeline_stage=3,
    )
    assert config.num_layers_in_first_pipeline_stage == 1


def test_check_pipeline_config_names_the_option():
    from types import SimpleNamespace

    from megatron_mhar.parallel import check_pipeline_config

    with pytest.raises(ValueError, match="variable_seq_lengths"):
        check_pipeline_config(SimpleNamespace(variable_seq_lengths=True))
    with pytest.raises(ValueError, match="overlap_moe_expert_parallel_comm"):
        check_pipeline_config(SimpleNamespace(overlap_moe_expert_parallel_comm=True))
    check_pipeline_config(SimpleNamespace(variable_seq_lengths=False))
