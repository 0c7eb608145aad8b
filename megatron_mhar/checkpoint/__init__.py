"""Megatron distributed checkpoints as the training driver, the conversion and inference use them.

* :mod:`~megatron_mhar.checkpoint.format`: what a checkpoint directory is (layout, ``latest``,
  the stored run config), which checkpoint a path designates, and the common state of a
  converted checkpoint.
* :mod:`~megatron_mhar.checkpoint.manifest`: each file's size and checksum, written before a
  checkpoint is published and checked before it is read.
* :mod:`~megatron_mhar.checkpoint.model`: the uninitialised (or meta-device) GPT chunk of this
  rank's layout that a checkpoint is loaded into, and the TP slicing of full tensors.
* :mod:`~megatron_mhar.checkpoint.streaming`: a chunk's tensors written and read one stored
  tensor at a time.

Importing this package imports neither Megatron nor the training driver.
"""
