"""The deepest lookahead group of each model: the inputs the kernel tools time.

The group with the most old rows (the auto group size, ``auto_group_size``, over the full
variant's sites) is where phase 1 costs most; ``OWING_GROUPS`` is how many groups' deferred
row gradients a block of rows receives in the middle of the 1B stack.
"""

import torch

from megatron_mhar.ops.schedules import auto_group_size

OWING_GROUPS = 5


def deepest_group(case, heads: int, device="cuda", dtype=torch.bfloat16):
    """(G, n0, rows [T, n0, D], their fp32 gradients (zeros), queries, norm weights [G, D],
    output gradients [G, T, D]) of the deepest lookahead group of ``case`` (a
    ``benchmarks.common.StepCase``) with the auto group size, random in ``dtype``
    (seeded); the queries scaled for ``heads``."""
    sites = len(case.site_sources())
    group = auto_group_size(sites)
    n0 = sites - group + 1
    head_dim = case.d // heads
    kw = dict(device=device, generator=torch.Generator(device=device).manual_seed(0))
    buf = torch.randn(case.t, n0, case.d, **kw).to(dtype)
    gbuf = torch.zeros(case.t, n0, case.d, device=device)
    qs = (2.0 / head_dim**0.5 * torch.randn(group, case.d, **kw)).to(dtype)
    ws = (1 + 0.3 * torch.randn(group, case.d, **kw)).to(dtype)
    grad_outs = torch.randn(group, case.t, case.d, **kw).to(dtype)
    return group, n0, buf, gbuf, qs, ws, grad_outs
