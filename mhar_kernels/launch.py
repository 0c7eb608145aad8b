"""Launch rules of the routing kernels: tiles, warps, pipeline stages and grids by shape.

Every rule is a function of the shapes (the tile's padded width, the head count, a
group's size), cached, and returns a :class:`LoopConfig`. The tables in the docstrings
give what each rule picks at the paper's model widths (100M: D = 512, 350M: 1024, 1B:
1280, 8B delta: 4096, eight routing heads unless said) and why; the measurements behind
them are in docs/performance.md. Tools that sweep launches (tools/perf) and tests set
other launches for a block of code with :func:`overridden`; the kernel functions take no
launch arguments.
"""

import contextlib
import contextvars
import functools
import types
from typing import Any, Dict, Iterator, Mapping, NamedTuple, Optional, Tuple

import torch
import triton

from .primitives import SLOTS


def tile(d: int, num_heads: int) -> Tuple[int, int, int]:
    """(head width, padded head count, padded head width) of a one-chunk register tile."""
    head_dim = d // num_heads
    return head_dim, triton.next_power_of_2(num_heads), triton.next_power_of_2(head_dim)


@functools.lru_cache(maxsize=None)
def chunked_tile(d: int, num_heads: int) -> Tuple[int, int, int, int]:
    """(head width, padded head count, chunk width, chunks) of the per-site kernels' tile.

    A head width that is not a power of two is held as ``chunks`` power-of-two chunks of
    equal width (160 = 5 x 32 at the 1B shape, 96 = 3 x 32) instead of one chunk padded
    to the next power of two (256: 37.5% idle lanes). Chunks narrower than 32 (64-byte
    loads) or more than 8 of them fall back to the padded chunk.
    """
    head_dim, bh, padded = tile(d, num_heads)
    width = head_dim & -head_dim  # the largest power of two dividing the head width
    if width == head_dim or width < 32 or head_dim // width > 8:
        return head_dim, bh, padded, 1
    return head_dim, bh, width, head_dim // width


def tile_width(d: int, num_heads: int) -> int:
    """Width the per-site launch configs are keyed on: the tile's, rounded up to a power
    of two (a chunked 1280-wide tile takes the 2048-wide padded tile's token count)."""
    _, bh, bhd, chunks = chunked_tile(d, num_heads)
    return triton.next_power_of_2(bh * bhd * chunks)


class LoopConfig(NamedTuple):
    """Launch parameters of a routing kernel."""

    block_t: int  # tokens per program
    num_warps: int
    stages: int  # source loads pipelined through shared memory (tl.range num_stages)
    l2_reuse: bool = False  # L2 eviction hints: keep what a later read of this program needs
    programs_per_sm: int = 4  # backward grid cap (programs stride over the token tiles)

    def override(self, **fields) -> "LoopConfig":
        """This config with the given fields replaced (None keeps the default)."""
        if not fields:
            return self  # the model's path: no new tuple per launch
        return self._replace(**{k: v for k, v in fields.items() if v is not None})


_LOOP = LoopConfig._fields
_SITES = ("sites_per_program",)  # sites held by one program of a group's phase 1 (row loop)
OVERRIDABLE: Dict[str, Tuple[str, ...]] = {
    "route_fwd": _LOOP,
    "route_bwd": _LOOP,
    "group_fwd": _LOOP + _SITES,
    "group_bwd": _LOOP + _SITES,
    "merge_fwd": _LOOP,
    "merge_bwd": _LOOP,
    "merge_row_grad": _LOOP,
    "add_row_grads": ("num_warps", "stages", "programs_per_sm"),
}
"""The kernels whose launch :func:`overridden` may change, and the fields of each."""
_POSITIVE = ("block_t", "num_warps", "programs_per_sm", "sites_per_program")
_NONE: Mapping[str, Any] = types.MappingProxyType({})
_overrides: contextvars.ContextVar[Mapping[str, Mapping[str, Any]]] = contextvars.ContextVar(
    "mhar_kernels_launch_overrides", default=_NONE
)


@contextlib.contextmanager
def overridden(**kernels: Mapping[str, Any]) -> Iterator[None]:
    """Launch the named kernels with other settings than the rules' while the block runs,
    e.g. ``overridden(group_fwd=dict(sites_per_program=2, num_warps=16))``: for launch
    sweeps (tools/perf) and tests; the model never sets any. A kernel family that cannot
    take a field (the tensor-core phase 1: only ``num_warps``) refuses it when it runs."""
    for kernel, fields in kernels.items():
        if kernel not in OVERRIDABLE:
            raise ValueError(f"no kernel {kernel!r} to override; one of {', '.join(OVERRIDABLE)}")
        unknown = sorted(set(fields) - set(OVERRIDABLE[kernel]))
        if unknown:
            raise ValueError(f"{kernel} takes no launch field {', '.join(unknown)}; "
                             f"its fields: {', '.join(OVERRIDABLE[kernel])}")  # fmt: skip
        for name in _POSITIVE:
            if fields.get(name) is not None and fields[name] < 1:
                raise ValueError(f"{kernel}: {name} must be at least 1, got {fields[name]}")
    fixed = {kernel: types.MappingProxyType(dict(fields)) for kernel, fields in kernels.items()}
    token = _overrides.set(types.MappingProxyType({**_overrides.get(), **fixed}))
    try:
        yield
    finally:
        _overrides.reset(token)


def overrides(kernel: str) -> Mapping[str, Any]:
    """The launch fields :func:`overridden` set for ``kernel``, read-only: none on the
    model's path, where a launch reads them without copying anything."""
    return _overrides.get().get(kernel, _NONE)


@functools.lru_cache(maxsize=None)
def route_fwd_config(padded_d: int) -> LoopConfig:
    """Per-site forward (``route_fwd_kernel``), keyed on :func:`tile_width`: about 4K fp32
    of the token tile in registers, the source loads pipelined through shared memory.

        tile width   tokens  warps  stages   model
        512          8       2      3        100M
        1024         4       2      3        350M
        2048         2       1      4        1B (1280: five chunks of 256)
        4096         1       2      3        8B

    The loop streams every source once: the tile is sized for 64 fp32 per thread at two
    warps with three loads in flight. At 2048 one warp holds the whole 4K tile (128 per
    thread), so every head's sums stay inside the warp, with four loads in flight."""
    if padded_d == 2048:
        return LoopConfig(2, 1, 4)
    block_t = max(1, 4096 // padded_d)
    return LoopConfig(block_t, max(2, min(8, block_t * padded_d // 2048)), 3)


@functools.lru_cache(maxsize=None)
def route_bwd_config(padded_d: int, one_head: bool = False) -> LoopConfig:
    """Per-site backward (``route_bwd_kernel``), keyed on the padded one-chunk width
    ``BH * BHD``: a tile holds dout, v, the gradient and the dL/dw accumulator, so it takes
    1K fp32 at two warps and more programs per SM to hide the latency of the two passes.

        padded width  heads   tokens  warps  stages  programs/SM  L2 hints   model
        512           any     2       2      2       8            -          100M
        1024          H > 1   1       2      2       8            -          350M
        2048          H > 1   1       2      3       4            -          1B
        1024 / 2048   H = 1   4 / 2   2      2       4            -          AttnRes 350M / 1B
        4096          any     1       8      1       2            yes        8B

    One head (AttnRes) spans both warps, so every sum over it is a trip through shared
    memory; a 4K tile lets each trip's barriers serve several tokens. At 4096 one token
    fills eight warps; pass 2 rereads what pass 1 read, so pass 1 asks L2 to keep those lines
    (evict_last) and everything read or written once streams (evict_first)."""
    if padded_d > 2048:
        return LoopConfig(1, 8, 1, l2_reuse=True, programs_per_sm=2)
    if one_head and padded_d >= 1024:
        return LoopConfig(4096 // padded_d, 2, 2, programs_per_sm=4)
    block_t = max(1, 1024 // padded_d)
    stages = 3 if padded_d == 2048 else 2
    return LoopConfig(block_t, 2, stages, programs_per_sm=8 if block_t * padded_d <= 1024 else 4)


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (4 off CUDA: the interpreter's grids)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def backward_programs(num_tiles: int, device: torch.device, programs_per_sm: int) -> int:
    """Programs of a grid-stride backward: one per tile, at most ``programs_per_sm`` per SM."""
    return max(1, min(num_tiles, num_sms(device) * programs_per_sm))


def head_programs(t: int, num_heads: int, device: torch.device, programs_per_sm: int = 4) -> int:
    """Token programs of the per-head kernels: ``programs_per_sm * SMs / H`` over the H heads."""
    return max(1, min(t, triton.cdiv(programs_per_sm * num_sms(device), num_heads)))


@functools.lru_cache(maxsize=None)
def group_fwd_config(padded_d: int, sites: int) -> Tuple[int, LoopConfig]:
    """(sites per program, launch config) of the row-loop phase 1 (``group_fwd_kernel``):
    a program holds the online-softmax states of its sites for its token tile, about 4K fp32
    of accumulators as the per-site forward's tile; sites that do not fit go to sibling
    programs of the same token tile, which read the same rows through L2.

        padded width  sites G  sites/program  tokens  warps  stages   model
        512           5        5              1       1      3        100M
        1024          6        4              1       2      3        350M
        2048          8        2              1       2      3        1B

    Up to width 512 one warp holds a token's heads, so every head's dot stays in the warp."""
    sites_per_program = max(1, min(sites, 4096 // padded_d))
    num_warps = 1 if padded_d <= 512 else 2
    return sites_per_program, LoopConfig(group_fwd_tokens(sites_per_program, padded_d), num_warps, 3)


def group_fwd_tokens(sites_per_program: int, padded_d: int) -> int:
    """Tokens of the row-loop phase 1's tile: as many as 4K accumulators hold, rounded down
    to a power of two (a tile axis must be one; three sites of 256 would give 5)."""
    tokens = max(1, 4096 // (sites_per_program * padded_d))
    return 1 << (tokens.bit_length() - 1)


LOOKAHEAD_KERNELS = ("auto", "row_loop", "tensor_cores")
"""The kernel families of phase 1 (``lookahead_kernels`` of the phase-1 entry points, the
model's ``mhar.lookahead_kernels``): the row loops (the sites in registers, one row at a
time), the tensor-core dots per token and head, or per group and direction the family
:func:`use_tensor_cores` picks."""


def use_tensor_cores(lookahead_kernels: str, sites: int, head_dim: int, backward: bool, *,
                     dtype: torch.dtype) -> bool:
    """Whether phase 1 runs the tensor-core kernels: ``lookahead_kernels`` names the family
    (``row_loop`` or ``tensor_cores``) or, ``auto``, picks by the group's size and the dot
    heads' width (``head_dim``, :func:`dot_heads`):

                        dots forward where              dots backward where
        group size G    G > SLOTS / 2 = 4               G > 4
        head width      64 < width, padded <= 256      128 < width, padded <= 256

    so 100M (heads of 64) runs the row loops both ways, 350M (128) dots forward and row loops
    backward, 1B (160) dots both ways; one head is eight dot heads of D / 8. With at most half
    the slots filled half of every dot idles; narrow heads give the dots too little work per
    row block against the row loop's register sums; heads padded past 256 columns outgrow
    registers and shared memory. Decided by the group's size, never a split's: a recomputed
    chunk runs the kernels of the whole group. The dots take bf16 or fp32 rows: fp16 rows run
    the row loops (``lookahead_kernels='tensor_cores'`` over them is an error)."""
    if lookahead_kernels not in LOOKAHEAD_KERNELS:
        raise ValueError(f"lookahead_kernels must be one of {list(LOOKAHEAD_KERNELS)}, got {lookahead_kernels!r}")
    if dtype == torch.float16:
        if lookahead_kernels == "tensor_cores":
            raise ValueError("lookahead_kernels='tensor_cores' takes bf16 or fp32 rows, got float16; "
                             "use 'auto' or 'row_loop', which run the row loops")
        return False
    if lookahead_kernels != "auto":
        return lookahead_kernels == "tensor_cores"
    wide_enough = head_dim > (128 if backward else 64)
    return sites > SLOTS // 2 and triton.next_power_of_2(head_dim) <= 256 and wide_enough


# The dot kernels tile a row as at least this many heads: a model with fewer (Attention
# Residuals: one) runs each head as DOT_HEADS // H dot heads whose dots are summed, so
# its tiles, launches and measured choices are those of eight heads and its heads cost
# what eight do (docs/kernels.md, "Dot heads").
DOT_HEADS = 8


@functools.lru_cache(maxsize=None)
def dot_heads(d: int, num_heads: int) -> Tuple[int, int, int, int]:
    """(dot heads per model head GH, dot heads, their width, dot heads padded to a power of
    two) of the tensor-core kernels at width ``d``: GH = DOT_HEADS // num_heads where
    num_heads divides DOT_HEADS and d divides into DOT_HEADS heads, otherwise 1."""
    split = 1
    if num_heads < DOT_HEADS and DOT_HEADS % num_heads == 0 and d % DOT_HEADS == 0:
        split = DOT_HEADS // num_heads
    heads = num_heads * split
    return split, heads, d // heads, triton.next_power_of_2(heads)


@functools.lru_cache(maxsize=None)
def head_chunks(head_dim: int) -> Tuple[int, int]:
    """(KA, KB) channel chunks of a head for the dot kernels: the largest power of two in
    the head width and the rest padded to a power of two (160 = 128 + 32; KB = 0 when the
    width is a power of two), each at least the dots' 16."""
    ka = max(16, 1 << (head_dim.bit_length() - 1))
    rest = head_dim - ka
    return ka, (max(16, triton.next_power_of_2(rest)) if rest > 0 else 0)


@functools.lru_cache(maxsize=None)
def group_fwd_dots_config(padded_heads: int, head_dim: int) -> Optional[LoopConfig]:
    """Launch config of the tensor-core phase 1 (``group_fwd_dots_kernel``): 4 warps, row
    blocks unpipelined, two programs per SM striding over the tokens; None (the row loop
    runs) where the accumulators ``[BH, 2 * SLOTS, KA + KB]`` fp32 per program would pass 32K
    elements, i.e. eight dot heads wider than 256 columns."""
    ka, kb = head_chunks(head_dim)
    if padded_heads * 2 * SLOTS * (ka + kb) > 32768:
        return None
    return LoopConfig(1, 4, 1, programs_per_sm=2)


# Shared memory of one Hopper SM (228 KB) and what the driver reserves per program: two
# programs per SM may each use (233472 - 2 * 1024) / 2 bytes.
_SM_SHARED_BYTES, _PROGRAM_RESERVED_BYTES = 233472, 1024


@functools.lru_cache(maxsize=None)
def queries_left(padded_heads: int, head_dim: int, element_size: int) -> bool:
    """Which form the tensor-core forward's first dot takes. Rows left (X @ W) holds the
    row block twice in shared memory, once per dot's operand layout, next to the queries:
    BH (KA + KB) (2 SLOTS + 2 BR) elements; queries left (W^T @ X^T) feeds both dots from one
    copy but transposes the block in registers. Queries left where rows left would not fit
    two programs per SM:

        rows    heads x width   rows left needs   form
        bf16    8 x 128         96 KB             rows left     (350M)
        bf16    8 x 160         120 KB            queries left  (1B)
        fp32    any             -                 rows left     (one program per SM either way)"""
    ka, kb = head_chunks(head_dim)
    rows_left = element_size * padded_heads * (ka + kb) * (2 * SLOTS + 2 * 16)
    return bool(element_size == 2 and rows_left > _SM_SHARED_BYTES // 2 - _PROGRAM_RESERVED_BYTES)


@functools.lru_cache(maxsize=None)
def group_bwd_dots_config(padded_heads: int, head_dim: int) -> Tuple[LoopConfig, LoopConfig]:
    """Launch configs of the tensor-core phase-1 backward's (rows, heads) kernels. Rows
    kernel (``group_bwd_rows_kernel``, one program per token, every head at once): 4 warps
    up to 1K channels over its heads' chunks, 8 above (the 1B width: 8 x 160), unpipelined,
    two programs per SM striding over the tokens. Heads kernel (``group_bwd_heads_kernel``,
    dL/dw per head): 4 warps, :func:`head_programs` token programs per head, its one loop
    over (token, row block) pipelined four deep, so the loads cross from one token's few
    row blocks into the next token's."""
    ka, kb = head_chunks(head_dim)
    rows = LoopConfig(1, 4 if padded_heads * (ka + kb) <= 1024 else 8, 1, programs_per_sm=2)
    return rows, LoopConfig(1, 4, 4)


@functools.lru_cache(maxsize=None)
def group_bwd_config(padded_d: int, sites: int, padded_heads: int) -> Tuple[int, LoopConfig]:
    """(sites per launch, launch config) of the row-loop phase-1 backward
    (``group_bwd_kernel``). A program holds, per site, w, do and a dL/dw accumulator of its
    token tile, up to 64 fp32 of each kind per thread; sites beyond that run in further
    launches over the rows, last chunk first.

        padded width  tokens   warps  sites/launch  stages  programs/SM   model
                                      (at most)
        256           2        2      8             3       4
        512           1        2      8             3       4            100M
        1024          1        4      8             4 (3)   2            350M (AttnRes)
        2048          1        8      4             3       4            1B

    At 1024 the eight heads take a fourth stage and one head stays at three."""
    stages, programs_per_sm = 3, 4
    if padded_d >= 1024:
        block_t, num_warps, per_kind = 1, 8 if padded_d >= 2048 else 4, 8192
        if padded_d == 1024:
            stages, programs_per_sm = (4 if padded_heads > 1 else 3), 2
    else:
        block_t, num_warps, per_kind = max(1, 512 // padded_d), 2, 4096
    sites_per_launch = max(1, min(sites, per_kind // (block_t * padded_d)))
    return sites_per_launch, LoopConfig(block_t, num_warps, stages, programs_per_sm=programs_per_sm)


@functools.lru_cache(maxsize=None)
def merge_fwd_config(padded_d: int) -> LoopConfig:
    """Merge forward (``merge_fwd_kernel``): 2K fp32 per tile at one warp (every head's sums
    inside the warp), the new rows' loads pipelined three deep: 4 / 2 / 1 tokens at the
    100M / 350M / 1B widths."""
    return LoopConfig(max(1, 2048 // padded_d), 1, 3)


@functools.lru_cache(maxsize=None)
def merge_bwd_config(padded_d: int) -> LoopConfig:
    """Merge backward (``merge_bwd_kernel``): 2K fp32 per tile at 4 warps (8 above 2K, one
    token of 4096), 4 programs per SM striding over the tiles, the new rows' loop unpipelined."""
    block_t = max(1, 2048 // padded_d)
    return LoopConfig(block_t, 8 if block_t * padded_d > 2048 else 4, 1, programs_per_sm=4)


@functools.lru_cache(maxsize=None)
def merge_row_grad_config(padded_d: int) -> LoopConfig:
    """A new row's gradient (``merge_bwd_row_grad_kernel``): 4K fp32 per tile at 4 warps,
    the sites' loop unpipelined."""
    return LoopConfig(max(1, 4096 // padded_d), 4, 1)


# Entries of one group_bwd_row_grads_kernel launch (chunks of phase-1 backwards owing a
# block of rows); more run in further launches, in order.
ROW_GRADS_ENTRIES = 16


@functools.lru_cache(maxsize=None)
def row_grads_config() -> LoopConfig:
    """The deferred row gradients (``group_bwd_row_grads_kernel``, ``add_row_grads``): blocks
    of 16 rows (the dots' smallest M; a block between group starts has G rows), four warps,
    two stages (an entry's loads overlap the previous entry's dots) and four token programs
    per SM and head."""
    return LoopConfig(block_t=16, num_warps=4, stages=2, programs_per_sm=4)


@functools.lru_cache(maxsize=None)
def copy_tile(d: int) -> Tuple[int, int]:
    """(tokens, channels) of a row copy's tile (``copy_rows_kernel``, 4 warps): the channels
    the largest power of two that divides D, up to 1024 (1280 = 5 x 256: no masked lane),
    or D padded where D is not a multiple of 16; 8K elements per tile."""
    block_d = min(1024, d & -d if d % 16 == 0 else triton.next_power_of_2(d))
    return max(1, 8192 // block_d), block_d
