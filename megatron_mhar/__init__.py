"""megatron_mhar: Multi-Head Attention Residuals for Megatron-Core GPT models.

Importing the package is cheap and does not import Megatron; the model modules
(``megatron_mhar.models``) do, and so does :func:`load_model` when first used. It
silences the library warnings known to be harmless here first (:mod:`megatron_mhar.quiet`),
as Megatron prints some of them at import: every command, and a script that builds a
model, prints only its own output.
"""

from megatron_mhar.quiet import quiet_known_warnings

quiet_known_warnings()

__version__ = "0.1.0"

__all__ = ["load_model"]


def __getattr__(name):
    # Lazy: ``megatron_mhar.load_model`` imports Megatron only when it is looked up.
    if name == "load_model":
        from megatron_mhar.inference import load_model

        return load_model
    raise AttributeError(f"module 'megatron_mhar' has no attribute {name!r}")
