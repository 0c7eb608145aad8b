"""Data: the embedded corpus, tokenizers, preprocessing to ``.bin/.idx``, GPTDatasets.

``mhar-preprocess`` (:mod:`~megatron_mhar.data.preprocess`) writes Megatron indexed
datasets from jsonl or text through :mod:`~megatron_mhar.data.indexed_writer`;
:mod:`~megatron_mhar.data.corpus` builds the embedded default (the standard library's
source and a tokenizer trained on it) without a download.
"""
