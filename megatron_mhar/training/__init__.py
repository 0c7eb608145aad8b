"""The training driver: the run configuration (schema, recipes, launch checks), the loop,
checkpointing, metrics and signals.

``mhar-train RECIPE [dotted.key=value ...]`` (or ``python -m megatron_mhar.train``) is the
entry point; :func:`megatron_mhar.training.loop.run` trains one run on one rank.
"""
