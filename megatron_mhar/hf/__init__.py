"""MHAR models in transformers: Llama, Qwen3 and Qwen3-MoE with routing over depth.

Importing this package registers the configs and models with ``AutoConfig``,
``AutoModel`` (the decoder without the output layer) and ``AutoModelForCausalLM``, so an
exported MHAR directory loads without ``trust_remote_code`` (and with the fused routing
kernels on CUDA)::

    import megatron_mhar.hf
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained("hf_out")

Without ``megatron_mhar`` installed, the same directory loads with
``trust_remote_code=True`` from the modeling files the export copies into it, and with
``trust_remote_code=True`` it always runs those. The registered classes refuse a directory
whose shipped modeling files differ from theirs (one exported by another version).
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from megatron_mhar.hf.configuration_mhar import MHARLlamaConfig, MHARQwen3Config, MHARQwen3MoeConfig
from megatron_mhar.hf.modeling_mhar import (
    MHARLlamaForCausalLM,
    MHARLlamaModel,
    MHARQwen3ForCausalLM,
    MHARQwen3Model,
    MHARQwen3MoeForCausalLM,
    MHARQwen3MoeModel,
)

for _config, _base, _causal in ((MHARLlamaConfig, MHARLlamaModel, MHARLlamaForCausalLM),
                                (MHARQwen3Config, MHARQwen3Model, MHARQwen3ForCausalLM),
                                (MHARQwen3MoeConfig, MHARQwen3MoeModel, MHARQwen3MoeForCausalLM)):
    AutoConfig.register(_config.model_type, _config, exist_ok=True)
    AutoModel.register(_config, _base, exist_ok=True)
    AutoModelForCausalLM.register(_config, _causal, exist_ok=True)

__all__ = [
    "MHARLlamaConfig",
    "MHARLlamaForCausalLM",
    "MHARLlamaModel",
    "MHARQwen3Config",
    "MHARQwen3ForCausalLM",
    "MHARQwen3Model",
    "MHARQwen3MoeConfig",
    "MHARQwen3MoeForCausalLM",
    "MHARQwen3MoeModel",
]
