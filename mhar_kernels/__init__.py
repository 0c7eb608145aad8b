"""Fused Triton depth-routing kernels (import name ``mhar_kernels``); no Megatron imports."""
