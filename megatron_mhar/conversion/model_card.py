"""The model card (``README.md``) of an export: what the model is, how to load it, what trained it.

Written by :func:`megatron_mhar.conversion.convert.mcore_to_hf` from the export's
``config.json`` and the checkpoint it came from: its stored run config
(``train_config.yaml``), its iteration, and the code that wrote it (the common state's
``provenance``: megatron_mhar's version and git commit).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

from megatron_mhar.checkpoint.format import TRAIN_CONFIG_FILE
from megatron_mhar.conversion.hf_config import MHAR_FIELDS, architecture

# routing fields only one variant reads
_OTHER_VARIANTS_FIELDS = {"mhar_block_size": "block", "mhar_delta_block_layers": "delta"}
_VARIANTS = {
    "full": "every sublayer reads a softmax mixture, per token and per routing head, of the embedding and "
            "all earlier sublayer outputs, which replaces the residual stream",
    "block": "every sublayer reads a softmax mixture, per token and per routing head, of the embedding, the "
             "sums of earlier blocks of sublayers and the running sum of its own block, which replaces the "
             "residual stream",
    "delta": "the residual stream is kept, and every sublayer input gets a gated correction: a softmax "
             "mixture, per token and per routing head, of the embedding and the change of the stream over "
             "each completed block of layers",
}


def model_card(config: Dict[str, Any], checkpoint: Path, common: Dict[str, Any]) -> str:
    """The text of ``README.md`` for an export whose ``config.json`` is ``config``, from the
    checkpoint directory ``checkpoint`` (one ``iter_*``) and its common state."""
    base = architecture(config)
    routed = "mhar_variant" in config
    family = base.removesuffix("ForCausalLM")
    provenance = common.get("provenance") or {}
    commit = provenance.get("commit")
    commit_text = (f"`{commit}`" + (" (with uncommitted changes)" if provenance.get("dirty") else "")
                   if commit else "not recorded")
    tags = ["megatron_mhar", "mhar", "custom_code"] if routed else ["megatron_mhar"]
    lines = ["---", "library_name: transformers", "pipeline_tag: text-generation", "tags:"]
    lines += [f"- {tag}" for tag in tags] + ["---", "", f"# {config['architectures'][0]}", ""]
    if routed:
        lines += [
            f"A {family} decoder with Multi-Head Attention Residuals (MHAR, arXiv 2607.27230), variant "
            f"`{config['mhar_variant']}`: {_VARIANTS[config['mhar_variant']]}. Trained with Megatron-Core "
            f"and megatron_mhar, exported to transformers with its "
            f"modeling code (`configuration_mhar.py`, `modeling_mhar.py`, `depth_route.py`, "
            f"`routing_layout.py`).",
            "",
            "| routing field | value |",
            "| --- | --- |",
        ]
        for key in MHAR_FIELDS.values():
            value = config.get(key)
            if key in _OTHER_VARIANTS_FIELDS and config["mhar_variant"] != _OTHER_VARIANTS_FIELDS[key]:
                continue  # a field the variant does not read
            if key == "mhar_eps" and value is None:
                value = f"the model's rms_norm_eps, {config.get('rms_norm_eps')}"
            lines.append(f"| `{key}` | {value} |")
    else:
        lines += [f"A plain `{base}` trained with Megatron-Core and megatron_mhar (no routing over depth)."]
    lines += [
        "",
        f"{config['num_hidden_layers']} layers, width {config['hidden_size']}, "
        f"{config['num_attention_heads']} attention heads ({config.get('num_key_value_heads')} KV heads), "
        f"vocabulary {config['vocab_size']}.",
        "",
        "## Load",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        'tokenizer = AutoTokenizer.from_pretrained("DIR")',
    ]
    if routed:
        lines += [
            "# without megatron_mhar: the modeling code in this directory",
            'model = AutoModelForCausalLM.from_pretrained("DIR", trust_remote_code=True)',
            "",
            "# with megatron_mhar installed (its classes, the fused routing kernels on CUDA; another",
            "# version than the one that exported it runs this directory's code with trust_remote_code=True)",
            "import megatron_mhar.hf",
            'model = AutoModelForCausalLM.from_pretrained("DIR")',
            "```",
            "",
            f"The modeling code needs transformers >= {config['transformers_version']}. `AutoModel` loads "
            f"the decoder without the output layer. `output_hidden_states` returns, for each layer, its "
            f"routed input before the attention norm, then the final output after the final norm.",
        ]
    else:
        lines += ['model = AutoModelForCausalLM.from_pretrained("DIR")', "```"]
    lines += [
        "",
        "## Training",
        "",
        f"Exported from `{checkpoint.name}` of `{checkpoint.parent}`, written by megatron_mhar "
        f"{provenance.get('megatron_mhar', 'of an unrecorded version')} at commit {commit_text}.",
    ]
    run_config = checkpoint / TRAIN_CONFIG_FILE
    if run_config.is_file():
        lines += ["", f"The run's configuration ({TRAIN_CONFIG_FILE}):", "", "```yaml",
                  run_config.read_text().rstrip(), "```"]
    conversion = common.get("conversion")
    if conversion:
        lines += ["", f"Converted from `{conversion.get('source')}` ({conversion.get('architecture')}) "
                      f"with routing from: {conversion.get('routing_source')}."]
    return "\n".join(lines) + "\n"
