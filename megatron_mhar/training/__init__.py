"""The training driver: recipes (config), the loop, checkpointing, metrics and signals.

``python -m megatron_mhar.train RECIPE [dotted.key=value ...]`` is the entry point;
:func:`megatron_mhar.training.loop.run` trains one run on one rank.
"""
