"""Data: the embedded corpus, tokenizers, preprocessing to ``.bin/.idx``, GPTDatasets.

``python -m megatron_mhar.data.preprocess`` writes Megatron indexed datasets from
jsonl or text; :mod:`~megatron_mhar.data.corpus` builds the embedded default (the
standard library's source and a tokenizer trained on it) without a download.
"""
