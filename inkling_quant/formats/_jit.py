"""Compiled CPU kernels of the NVFP4 and MXFP8 quantizers (numba: nopython, GIL released, cached
on disk). Each evaluates ModelOpt's formulas in ModelOpt's fp32 operation order, so the results
are bit-identical to its quantizers (tests/test_formats.py). Private to formats/: nvfp4.py and
mxfp8.py document the rules and their sources; this module only evaluates them, fast.

A kernel works on one chunk of whole blocks: the source as unsigned bit patterns (bf16 as
uint16, `shift` 16 turning one into the fp32 pattern of the same value; fp32 as uint32, shift 0)
and the caller's scratch arrays (per thread, reused: fresh ones would page-fault on every chunk).
It runs as flat loops over whole arrays, indexed by the loop variable only, so that LLVM
vectorizes each (a computed index costs numba's negative-index check, which blocks that; so does
Python's zero-division check, hence error_model "numpy"). It returns OK or a status its caller
turns into a FormatError naming the tensor."""
from __future__ import annotations

import math

import numba as nb
import numpy as np

_jit = nb.njit(cache=True, nogil=True, boundscheck=False, error_model="numpy")

OK, NONFINITE, SCALE_UNDERFLOW = 0, 1, 2
_INF_BITS = 0x7F800000
_MIN_NORMAL_BITS = 0x3C800000    # 2^-6, the smallest normal float8_e4m3fn
E4M3_MAX = np.float32(448.0)


@_jit
def block_top(src, shift, mask, tmp, top):
    """top[b] = the fp32 pattern of max |x| over block b (a pairwise max tree on the source's own
    bits, `mask` clearing the sign; bf16's 16-bit lanes vectorize twice as wide). tmp: like src."""
    for i in range(src.size):
        tmp[i] = src[i] & mask
    n = src.size
    while n > top.size:
        n //= 2
        for i in range(n):
            tmp[i] = max(tmp[2 * i], tmp[2 * i + 1])
    for b in range(top.size):
        top[b] = np.uint32(tmp[b]) << shift


@_jit
def fp32_bits(src, shift, u):
    for i in range(src.size):
        u[i] = np.uint32(src[i]) << shift


@_jit
def e4m3_bytes(a, out):
    """out[i] = the float8_e4m3fn byte of the float32 whose bits are a[i] (0 <= value <= 448):
    torch's fp32 -> e4m3fn cast. Normal values: the fp32 mantissa rounded to 3 bits half to even
    on the bit pattern (a carry moves into the exponent); below 2^-6 a multiple of 2^-9 (rint)."""
    v = a.view(np.float32)
    for i in range(a.size):
        b = a[i]
        normal = np.uint8(((b + np.uint32(0x7FFFF) + ((b >> np.uint32(20)) & np.uint32(1))) >> np.uint32(20))
                          - np.uint32(960))
        sub = np.uint8(np.rint(min(v[i], np.float32(2.0 ** -6)) * np.float32(512.0)))
        out[i] = normal if b >= _MIN_NORMAL_BITS else sub


@_jit
def e2m1_code(y):
    """ModelOpt's `_cast_fp4` of one float32: bounds strictly below |y| (searchsorted) plus one on
    the odd bounds 0.75, 1.75, 3.5 (its tie fix): round half to even onto {0, .5, 1, 1.5, 2, 3, 4, 6},
    saturating at 6; bit 3 the sign of y (-0.0 gives 0)."""
    a = abs(y)
    c = ((a > np.float32(0.25)) + (a >= np.float32(0.75)) + (a > np.float32(1.25)) + (a >= np.float32(1.75))
         + (a > np.float32(2.5)) + (a >= np.float32(3.5)) + (a > np.float32(5.0)))
    return np.uint8(c + 8 * (y < 0))


@_jit
def nvfp4_blocks(src, shift, mask, s2, e4m3_values, packed, scale, tmp, top, pbs, d, dd, u):
    """The blocks of 16 in src: scale[b] = e4m3(clamp(amax / (6 * s2), 2^-9, 448)) (amax 0 -> 1),
    packed[8b + j] = code(x[2j] / d) | code(x[2j+1] / d) << 4 with d = fp32(scale) * s2.
    Scratch: tmp like src; top, pbs (uint32) and d (float32) one per block; dd (float32) one per
    output byte; u (uint32) one per source element."""
    block_top(src, shift, mask, tmp, top)
    if top.max() >= _INF_BITS:
        return NONFINITE
    amax, p = top.view(np.float32), pbs.view(np.float32)
    denom = np.float32(6.0) * s2
    for b in range(scale.size):
        q = amax[b] / denom
        p[b] = min(max(np.float32(1.0) if q == 0 else q, np.float32(2.0 ** -9)), E4M3_MAX)
    e4m3_bytes(pbs, scale)
    for b in range(scale.size):
        d[b] = e4m3_values[scale[b]] * s2
    if d.min() == 0:
        return SCALE_UNDERFLOW
    for i in range(packed.size):
        dd[i] = d[i >> 3]
    if shift:  # bf16: widened into u; fp32 sources are read as they are
        fp32_bits(src, shift, u)
        x = u.view(np.float32)
    else:
        x = src.view(np.float32)
    for i in range(packed.size):
        packed[i] = e2m1_code(x[2 * i] / dd[i]) | (e2m1_code(x[2 * i + 1] / dd[i]) << 4)
    return OK


@_jit
def mxfp8_blocks(src, shift, mask, given, scale, q, tmp, top, u, f):
    """The blocks of 32 in src: scale[b] = E = ceil(log2(amax / 448)) + 127 by the integer rule
    (exact for bf16/fp16 sources: mxfp8._e8m0_from_bits), or as given when `given`; q = e4m3
    bytes of x * 2^(127 - E), clamped to +-448 (a no-op for bf16/fp16, ModelOpt's clamp for fp32).
    Scratch: tmp like src; top (uint32) one per block; u (uint32) and f (float32) one per element."""
    m = scale.size
    block_top(src, shift, mask, tmp, top)
    if top.max() >= _INF_BITS:
        return NONFINITE
    if not given:
        amax, dv = top.view(np.float32), f[:m]
        for b in range(m):
            dv[b] = amax[b] / E4M3_MAX                 # fp32, as ModelOpt; then its bits
        db = dv.view(np.uint32)
        for b in range(m):
            scale[b] = 0 if db[b] <= 0x400000 else np.uint8((db[b] + np.uint32(0x7FFFFF)) >> 23)
    fb = top                                           # 2^(127 - E) as fp32 bits (E = 254: 2^-127)
    for b in range(m):
        e = np.uint32(scale[b])
        fb[b] = np.uint32(0x400000) if e == 254 else (np.uint32(254) - e) << 23
    factor = fb.view(np.float32)
    for i in range(f.size):
        f[i] = factor[i >> 5]
    fp32_bits(src, shift, u)
    x = u.view(np.float32)
    for i in range(f.size):
        f[i] = min(max(x[i] * f[i], -E4M3_MAX), E4M3_MAX)
    a = f.view(np.uint32)
    for i in range(a.size):
        a[i] &= np.uint32(0x7FFFFFFF)
    e4m3_bytes(a, q)
    for i in range(q.size):
        q[i] |= np.uint8((u[i] >> 24) & 0x80)       # the sign of x (torch keeps -0.0's)
    return OK


@_jit
def mxfp8_dequantize(q, scale, e4m3_values, out):
    """out = fp32(e4m3 q) * 2^(E - 127) per block of 32, a float32 product as ModelOpt's
    `MXFP8QTensor.dequantize` (E = 255 gives an infinite factor, as torch.exp2(128) does)."""
    for b in range(scale.size):
        f = np.float32(math.ldexp(1.0, np.int64(scale[b]) - 127))
        for k in range(32):
            i = np.uint64(b * 32 + k)
            out[i] = e4m3_values[q[i]] * f


@_jit
def mxfp8_all_finite(q, scale, e4m3_values):
    """Whether mxfp8_dequantize would give finite values only, without writing them: per block
    the largest magnitude byte (e4m3 bytes order as their magnitudes; 0x7F is NaN) times the
    block's factor."""
    for b in range(scale.size):
        top = np.uint8(0)
        for k in range(32):
            top = max(top, q[np.uint64(b * 32 + k)] & np.uint8(0x7F))
        f = np.float32(math.ldexp(1.0, np.int64(scale[b]) - 127))
        if top == 0x7F or not abs(e4m3_values[top] * f) < np.inf:
            return False
    return True
