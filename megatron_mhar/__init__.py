"""megatron_mhar: Multi-Head Attention Residuals for Megatron-Core GPT models.

Importing the package is cheap and does not import Megatron; the model modules
(``megatron_mhar.models``) do.
"""

__version__ = "0.1.0"
