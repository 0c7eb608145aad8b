"""Checkpoint conversion between Hugging Face Llama/Qwen3 and Megatron MHAR GPT models.

* :mod:`~megatron_mhar.conversion.mapping`: the weight-name table and its special cases.
* :mod:`~megatron_mhar.conversion.hf_config`: HF ``config.json`` <-> ``GPTModelConfig``.
* :mod:`~megatron_mhar.conversion.hf_io`: safetensors directories and the modeling files
  of an MHAR export.
* :mod:`~megatron_mhar.conversion.output`: the output directory: checked, locked, staged, published.
* :mod:`~megatron_mhar.conversion.convert`: :func:`plan_import` / :func:`hf_to_mcore`
  and :func:`mcore_to_hf`.
* :mod:`~megatron_mhar.conversion.cli`: the ``mhar-convert`` command (``hf-to-mcore``,
  ``mcore-to-hf``), which ``checkpoint_tools/`` also runs.

Importing this package does not import Megatron.
"""
