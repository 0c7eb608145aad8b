"""The history's row copies (``mhar_kernels.rows``) against torch's ``copy_``: exact.

CPU through the Triton interpreter in fp32; CUDA also in bf16 and casting fp32 to bf16
(a row's gradient handed to its sublayer), as the model calls them.
"""

import pytest
import torch

from mhar_kernels.rows import copy_rows

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"

# (tokens, rows in the buffer, width): the 1B and 100M widths, a width under the tile,
# and one that is not a multiple of 16 (a padded, masked tile).
SHAPES = [(37, 5, 1280), (19, 3, 512), (9, 2, 16), (11, 4, 24)]
DTYPES = [(torch.float32, torch.float32)] + (
    [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)] if CUDA else [])  # fmt: skip


@pytest.mark.parametrize("src_dtype,dst_dtype", DTYPES, ids=lambda t: str(t).split(".")[-1])
@pytest.mark.parametrize("t,r,d", SHAPES, ids=lambda x: str(x))
def test_copy_rows_into_and_out_of_a_row(t, r, d, src_dtype, dst_dtype):
    generator = torch.Generator(device=DEVICE).manual_seed(t * d)
    buffer = torch.randn(t, r, d, device=DEVICE, generator=generator).to(src_dtype)
    source = torch.randn(t, d, device=DEVICE, generator=generator).to(src_dtype)
    # Into a row: the other rows are untouched.
    expected = buffer.clone()
    expected[:, 1] = source
    copy_rows(source, buffer[:, 1])
    assert torch.equal(buffer, expected)
    # Out of a row, cast to the destination's dtype.
    out = torch.empty(t, d, device=DEVICE, dtype=dst_dtype)
    copy_rows(buffer[:, r - 1], out)
    assert torch.equal(out, buffer[:, r - 1].to(dst_dtype))


def test_copy_rows_errors():
    buffer = torch.zeros(4, 3, 16, device=DEVICE)
    with pytest.raises(ValueError, match="one shape"):
        copy_rows(buffer[:, 0], torch.zeros(4, 8, device=DEVICE))
    with pytest.raises(ValueError, match="unit stride over D"):
        copy_rows(buffer[:, :, 0].t(), torch.zeros(3, 4, device=DEVICE))
