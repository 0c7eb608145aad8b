"""The routing schedules' choices and the lookahead schedule's groups: pure Python.

The configuration (:class:`~megatron_mhar.models.mhar_config.MHARConfig`) reads its choice
lists here without importing the schedule's torch code; the depth stream
(``models/routing.py``) and the benchmarks plan the lookahead groups with the same
functions.
"""

import math
from typing import List

ROUTING_SCHEDULES = ("per_site", "lookahead")
"""``mhar.routing_schedule``: ``per_site`` (every site reads all its sources) or
``lookahead`` (full, block and delta variants: groups of sites read the older sources once,
:mod:`megatron_mhar.ops.lookahead`)."""

LOOKAHEAD_KERNELS = ("auto", "row_loop", "tensor_cores")
"""``mhar.lookahead_kernels``, passed as is to the Triton kernels of phase 1
(``mhar_kernels.lookahead``): the row loops (the sites in registers, one row at a time),
the tensor-core dots per token and head, or per group and direction the family the launch
rules pick (``auto``, the default everywhere)."""


def phase1_kernels(lookahead_kernels: str, block_size: int) -> str:
    """The phase-1 kernels a layout with blocks of ``block_size`` sites (1: the full variant)
    runs for ``mhar.lookahead_kernels``: with blocks, ``auto`` is the row loops. Every
    completed block starts a group there, so the rows' gradients fall due one at a time,
    and the tensor-core backward, which defers them, rereads every owing site's output
    gradient for each row (block variant at 1B, H100: 113 ms of routing per step against
    85 on the row loops, which add each group's share at once)."""
    return "row_loop" if block_size > 1 and lookahead_kernels == "auto" else lookahead_kernels


def auto_group_size(num_sites: int) -> int:
    """Sites per group for ``lookahead_group = 0``: the integer nearest sqrt(0.84 * sites),
    i.e. 5 / 6 / 8 at 100M / 350M / 1B (25 / 49 / 73 sites).

    Bytes alone put the optimum at about sqrt(sites) (phase 1 reads ~S^2 / 2G rows, the
    merges ~S G / 2: benchmarks/routing_bytes.py), but a merge's row costs more than a
    phase-1 row (the merges are short, latency-bound kernels), which moves it lower. The
    factor 0.84 is fitted to the H200's training steps at the three sizes
    (docs/performance.md); any factor in [0.81, 0.86) picks the same three sizes. The fit
    does not reach past 1B: ``lookahead_group`` sets G by hand."""
    return max(1, round(math.sqrt(0.84 * max(1, num_sites))))


def group_ranges(first_site: int, last_site: int, group_size: int) -> List[range]:
    """The lookahead groups of sites ``first_site..last_site``: consecutive runs of
    ``group_size`` sites, the remainder (if any) first. A group's phase 1 reads every row
    written before its first site, so the short group goes where there are fewest rows: at
    the 1B shape the 73 sites are 1 + 9 x 8 and the one-site group reads one row, where as
    the last group it read 72 rows on the row-loop kernels (it has too few sites for the
    dots)."""
    if group_size < 1 or last_site < first_site:
        raise ValueError(f"no groups of {group_size} over sites {first_site}..{last_site}")
    remainder = (last_site - first_site + 1) % group_size
    starts = ([first_site] if remainder else []) + list(range(first_site + remainder, last_site + 1, group_size))
    return [range(a, b) for a, b in zip(starts, starts[1:] + [last_site + 1])]


def block_ranges(first_site: int, last_site: int, block_size: int) -> List[range]:
    """The block and delta variants' lookahead groups of sites ``first_site..last_site``: the
    sites of each block (``block_size`` sublayers; the block variant's final site starts a
    block of its own when the blocks divide the sublayers), cut at the chunk's ends. A
    block's sites read the same completed blocks, so its phase 1 reads each of them once
    for the whole block."""
    if block_size < 1 or last_site < first_site:
        raise ValueError(f"no blocks of {block_size} over sites {first_site}..{last_site}")
    starts = [first_site] + [j for j in range(first_site + 1, last_site + 1) if (j - 1) % block_size == 0]
    return [range(a, b) for a, b in zip(starts, starts[1:] + [last_site + 1])]


def lookahead_groups(first_site: int, last_site: int, num_sites: int, block_size: int,
                     group_size: int = 0) -> List[range]:
    """The lookahead groups of a chunk's sites ``first_site..last_site`` in a model of
    ``num_sites`` sites: the full variant's (``block_size`` 1) runs of ``group_size`` sites
    (0: :func:`auto_group_size`) or the blocks of ``block_size`` sites of the block and
    delta variants (``block_ranges``)."""
    if block_size > 1:
        return block_ranges(first_site, last_site, block_size)
    return group_ranges(first_site, last_site, group_size or auto_group_size(num_sites))
