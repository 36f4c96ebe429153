"""The number formats as the kernels read them: the facts a launcher, a launch config or the
reference needs (elements per scale, largest element, block-scale range, the e2m1 code values),
one table for both formats. Written apart from inkling_quant.formats, which owns every rule of
the bits; tests/test_kernels_formats.py holds the two to each other bit for bit.

NVFP4 (ModelOpt's HF export): ``weight`` uint8 [N, K/2] e2m1 codes (element 2j in the low
nibble), ``weight_scale`` e4m3 [N, K/16], ``weight_scale_2`` fp32; value ``e2m1 * (fp32(scale) *
weight_scale_2)``. MXFP8: ``weight`` e4m3 [N, K], ``weight_scale`` uint8 e8m0 [N, K/32]; value
``fp32(e4m3) * 2^(E - 127)``.
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import KernelError

E2M1_MAX = 6.0                   # largest e2m1 magnitude
E4M3_MAX = 448.0                 # largest float8_e4m3fn magnitude
NVFP4_GLOBAL_DIV = E2M1_MAX * E4M3_MAX  # 2688: a per-tensor NVFP4 scale is amax / 2688
NVFP4_MIN_SCALE = 2.0 ** -9      # smallest e4m3 subnormal: the floor of ModelOpt's NVFP4 block scales
#: the smallest amax whose NVFP4 per-tensor scale amax / 2688 has a finite fp32 reciprocal: below
#: it a tensor is written (and here fake-quantized) as all zero, as inkling_quant.formats does
NVFP4_MIN_AMAX = 7.899324e-36
#: e2m1 magnitude of each 3-bit code (bit 3 of a nibble is the sign; code 8 is -0.0)
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


@dataclass(frozen=True)
class KernelFormat:
    """What the kernels need of one format: `scale_block` elements of a row share one scale;
    `vmax` is the largest element magnitude; `codes_per_byte` packed codes per weight byte."""

    name: str
    scale_block: int
    vmax: float
    codes_per_byte: int


NVFP4 = KernelFormat("nvfp4", 16, E2M1_MAX, 2)
MXFP8 = KernelFormat("mxfp8", 32, E4M3_MAX, 1)
FORMATS = {f.name: f for f in (NVFP4, MXFP8)}


def kernel_format(fmt: str) -> KernelFormat:
    """The table's entry for `fmt` ("nvfp4", "mxfp8"); KernelError for another."""
    try:
        return FORMATS[fmt]
    except KeyError:
        raise KernelError(f"no kernel for format {fmt!r} ({', '.join(FORMATS)})") from None


def scale_block(fmt: str) -> int:
    """Elements per scale along K: 16 (NVFP4), 32 (MXFP8)."""
    return kernel_format(fmt).scale_block
