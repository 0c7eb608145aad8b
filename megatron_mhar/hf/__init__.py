"""MHAR models in transformers: Llama and Qwen3 with routing over depth.

Importing this package registers the configs and models with ``AutoConfig`` and
``AutoModelForCausalLM``, so an exported MHAR directory loads without
``trust_remote_code`` (and with the fused routing kernels on CUDA)::

    import megatron_mhar.hf
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained("hf_out")

Without ``megatron_mhar`` installed, the same directory loads with
``trust_remote_code=True`` from the modeling files the export copies into it.
"""

from transformers import AutoConfig, AutoModelForCausalLM

from megatron_mhar.hf.configuration_mhar import MHARLlamaConfig, MHARQwen3Config
from megatron_mhar.hf.modeling_mhar import MHARLlamaForCausalLM, MHARQwen3ForCausalLM

for _config, _model in ((MHARLlamaConfig, MHARLlamaForCausalLM), (MHARQwen3Config, MHARQwen3ForCausalLM)):
    AutoConfig.register(_config.model_type, _config, exist_ok=True)
    AutoModelForCausalLM.register(_config, _model, exist_ok=True)

__all__ = ["MHARLlamaConfig", "MHARLlamaForCausalLM", "MHARQwen3Config", "MHARQwen3ForCausalLM"]
