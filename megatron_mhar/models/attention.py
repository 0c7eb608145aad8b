"""Core attention backed by torch's scaled_dot_product_attention (flash backend on GPU)."""

import math
from contextlib import nullcontext
from typing import Optional

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import divide


class SDPACoreAttention(MegatronModule):
    """Drop-in for Megatron's local ``DotProductAttention`` (same constructor and forward).

    Causal self-attention only; Megatron's local path materialises the [s, s] score
    matrix, this one lets torch pick a fused kernel, so non-TE baselines are fast and
    fair. Query/key/value arrive as [s, b, heads_per_partition, head_dim].
    """

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SDPACoreAttention does not support context parallelism")
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"SDPACoreAttention supports causal masks only, got {attn_mask_type}")
        if config.window_size is not None:
            raise ValueError("SDPACoreAttention does not support sliding-window attention")
        if pg_collection is None:
            from megatron.core.process_groups_config import ProcessGroupCollection

            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        tp_size = pg_collection.tp.size()
        self.heads_per_partition = divide(config.num_attention_heads, tp_size)
        self.groups_per_partition = divide(config.num_query_groups, tp_size)
        head_dim = config.kv_channels
        self.softmax_scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        """[s, b, np, hn] x3 -> [s, b, np * hn]; ``attention_mask`` is implied causal."""
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError(
                "SDPACoreAttention supports neither packed sequences nor attention bias; use the "
                "transformer_engine spec"
            )
        repeat = self.heads_per_partition // self.groups_per_partition
        if repeat > 1:
            key = key.repeat_interleave(repeat, dim=2)
            value = value.repeat_interleave(repeat, dim=2)
        # [s, b, n, d] -> [b, n, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        dropout_p = self.dropout_p if self.training else 0.0
        rng = (
            tensor_parallel.get_cuda_rng_tracker().fork()
            if dropout_p > 0 and not self.config.sequence_parallel
            else nullcontext()
        )
        with rng:
            context = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, dropout_p=dropout_p, is_causal=True, scale=self.softmax_scale
            )
        s, b = query.shape[0], query.shape[1]
        return context.permute(2, 0, 1, 3).reshape(s, b, -1)

