"""Compiled CPU kernels of the NVFP4 and MXFP8 quantizers (numba: nopython, GIL released, cached
on disk). Each evaluates ModelOpt's formulas in ModelOpt's fp32 operation order, so the results
are bit-identical to its quantizers (tests/test_formats.py). Private to formats/: nvfp4.py and
mxfp8.py document the rules and their sources; this module only evaluates them, fast.

A kernel works on a range of whole blocks, in chunks the size of the caller's scratch arrays
(per thread, reused: fresh ones would page-fault on every chunk; sized to stay in the L2 cache),
so that numba's call overhead is paid once per range, not per chunk. It reads the source as
unsigned bit patterns (bf16 as uint16, `shift` 16 turning one into the fp32 pattern of the same
value; fp32 as uint32, shift 0). Each chunk runs as flat loops over whole arrays, indexed by the
loop variable only, so that LLVM vectorizes each (a computed index costs numba's negative-index
check, which blocks that; so does Python's zero-division check, hence error_model "numpy"). It
returns OK or a status its caller turns into a FormatError naming the tensor.

Two encoders per format share the kernels (an argument picks the block rule; the per-element
loops stay branch-free): ModelOpt's, and the release's (`nvfp4_nearest` / `mxfp8_nearest`, whose
rules nvfp4.py and mxfp8.py document)."""
from __future__ import annotations

import math

import numba as nb
import numpy as np

_jit = nb.njit(cache=True, nogil=True, boundscheck=False, error_model="numpy")

OK, NONFINITE, SCALE_UNDERFLOW = 0, 1, 2
MODELOPT, GIVEN, RELEASE = 0, 1, 2  # the MXFP8 block rule: ModelOpt's, the caller's scales, the release's
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
def e2m1_magnitude(a):
    """The e2m1 magnitude index (0..7) of |y| = a: round half to even onto {0, .5, 1, 1.5, 2, 3, 4,
    6}, saturating at 6 (strictly above the even-below midpoints, at or above the odd-below ones)."""
    return np.uint32((a > np.float32(0.25)) + (a >= np.float32(0.75)) + (a > np.float32(1.25))
                     + (a >= np.float32(1.75)) + (a > np.float32(2.5)) + (a >= np.float32(3.5)) + (a > np.float32(5.0)))


@_jit
def e2m1_code(y):
    """ModelOpt's `_cast_fp4` of one float32: bounds strictly below |y| (searchsorted) plus one on
    the odd bounds 0.75, 1.75, 3.5 (its tie fix): round half to even onto {0, .5, 1, 1.5, 2, 3, 4, 6},
    saturating at 6; bit 3 the sign of y (-0.0 gives 0). In uint32 lanes, which vectorize best."""
    return e2m1_magnitude(abs(y)) + np.uint32(8) * np.uint32(y < 0)


@_jit
def nvfp4_blocks(src, shift, mask, s2, rel, e4m3_values, packed, scale, tmp, top, pbs, d, dd, codes, u):
    """_nvfp4_chunk over src in chunks of top.size blocks (the scratch's size). rel: the release
    rule's (amax, denominator, denominator / amax) as float32[3], or an empty array for ModelOpt's."""
    M = top.size
    for b0 in range(0, scale.size, M):
        m = min(M, scale.size - b0)
        a, n = b0 * 16, m * 16
        status = _nvfp4_chunk(src[a: a + n], shift, mask, s2, rel, e4m3_values, packed[a // 2: (a + n) // 2],
                              scale[b0: b0 + m], tmp[:n], top[:m], pbs[:m], d[:m], dd[:n], codes[:n], u[:n])
        if status != OK:
            return status
    return OK


@_jit
def _nvfp4_chunk(src, shift, mask, s2, rel, e4m3_values, packed, scale, tmp, top, pbs, d, dd, codes, u):
    """The blocks of 16 in src: scale[b] = e4m3(clamp(amax / (6 * s2), 2^-9, 448)) (amax 0 -> 1),
    packed[8b + j] = code(x[2j] / d) | code(x[2j+1] / d) << 4 with d = fp32(scale) * s2.
    Scratch: tmp like src; top, pbs (uint32) and d (float32) one per block; dd (float32), u and
    codes (uint32) one per element. With `rel` the release's rule instead (nvfp4_encode)."""
    block_top(src, shift, mask, tmp, top)
    if top.max() >= _INF_BITS:
        return NONFINITE
    if shift:  # bf16: widened into u; fp32 sources are read as they are
        fp32_bits(src, shift, u)
        x = u.view(np.float32)
    else:
        x = src.view(np.float32)
    return nvfp4_encode(x, top, s2, rel, e4m3_values, packed, scale, pbs, d, dd, codes)


@_jit
def nvfp4_from_mxfp8(q, e8, s2, rel, e4m3_values, packed, scale, tmp, top, pbs, d, dd, codes, x):
    """_nvfp4_from_mxfp8_chunk over q in chunks of top.size blocks of 16 (even: whole 32-blocks)."""
    M = top.size
    for b0 in range(0, scale.size, M):
        m = min(M, scale.size - b0)
        a, n = b0 * 16, m * 16
        status = _nvfp4_from_mxfp8_chunk(q[a: a + n], e8[a // 32: (a + n) // 32], s2, rel, e4m3_values,
                                         packed[a // 2: (a + n) // 2], scale[b0: b0 + m], tmp[:n], top[:m],
                                         pbs[:m], d[:m], dd[:n], codes[:n], x[:n])
        if status != OK:
            return status
    return OK


@_jit
def _nvfp4_from_mxfp8_chunk(q, e8, s2, rel, e4m3_values, packed, scale, tmp, top, pbs, d, dd, codes, x):
    """nvfp4_blocks of the fp32 weight that MXFP8 bytes q (e4m3) and e8 (e8m0, one per 32 of q)
    hold, reading the bytes once: each block's maximum from its largest byte, each value decoded
    as mxfp8_dequantize does. Scratch: tmp like q; x (float32) one per element; the rest as in
    nvfp4_blocks."""
    top8 = byte_block_max(q, tmp, top.size)
    f = pbs[: e8.size]  # pbs is free until nvfp4_encode fills it
    e8m0_factor_bits(e8, f)
    factor, amax = f.view(np.float32), top.view(np.float32)
    for b in range(top.size):
        amax[b] = e4m3_values[top8[b]] * factor[b >> 1]
    if top.max() >= _INF_BITS:  # a NaN byte, or Inf/NaN from an infinite factor (as uint32)
        return NONFINITE
    for i in range(x.size):
        x[i] = e4m3_values[q[i]] * factor[i >> 5]
    return nvfp4_encode(x, top, s2, rel, e4m3_values, packed, scale, pbs, d, dd, codes)


@_jit
def nvfp4_encode(x, top, s2, rel, e4m3_values, packed, scale, pbs, d, dd, codes):
    """The rest of nvfp4_blocks, from the blocks' maxima (top: fp32 patterns, finite) and the
    values x (float32). codes: uint32 scratch, one per element (a code per element first, then
    packed in pairs: faster than coding the pairs directly, and fastest in uint32 lanes).

    ModelOpt's rule (rel empty): scale = e4m3(clamp(bmax / (6 * s2), 2^-9, 448)), bmax 0 -> 1;
    divisor fp32(scale) * s2; code sign y < 0. The release's (rel = amax, den, den / amax): scale
    = e4m3(min(bmax / 6 * (den / amax), 448)), subnormal scales kept, 0 where it rounds there;
    divisor (fp32(scale) * amax) / den, left to right; code sign the sign bit of x (-0.0 -> code
    8); a block whose divisor is 0 holds sign-only zero codes (its values decode to +-0 whatever
    the codes: these are the ones decoding and encoding again reproduces)."""
    amax, p = top.view(np.float32), pbs.view(np.float32)
    release = rel.size > 0
    if release:
        k = rel[2]
        for b in range(scale.size):
            p[b] = min(amax[b] / np.float32(6.0) * k, E4M3_MAX)
    else:
        denom = np.float32(6.0) * s2
        for b in range(scale.size):
            r = amax[b] / denom
            p[b] = min(max(np.float32(1.0) if r == 0 else r, np.float32(2.0 ** -9)), E4M3_MAX)
    e4m3_bytes(pbs, scale)
    if release:
        for b in range(scale.size):
            v = e4m3_values[scale[b]] * rel[0] / rel[1]
            d[b] = v if v > 0 else np.float32(np.inf)  # x / inf: a zero code of x's sign
    else:
        for b in range(scale.size):
            d[b] = e4m3_values[scale[b]] * s2
        if d.min() == 0:
            return SCALE_UNDERFLOW
    for i in range(dd.size):
        dd[i] = d[i >> 4]
    if release:
        xb = x.view(np.uint32)
        for i in range(x.size):
            codes[i] = e2m1_magnitude(abs(x[i] / dd[i])) | ((xb[i] >> np.uint32(28)) & np.uint32(8))
    else:
        for i in range(x.size):
            codes[i] = e2m1_code(x[i] / dd[i])
    for i in range(packed.size):
        packed[i] = np.uint8(codes[2 * i] | (codes[2 * i + 1] << 4))
    return OK


@_jit
def mxfp8_blocks(src, shift, mask, rule, scale, q, tmp, top, u, f):
    """_mxfp8_chunk over src in chunks of top.size blocks (the scratch's size)."""
    M = top.size
    for b0 in range(0, scale.size, M):
        m = min(M, scale.size - b0)
        a, n = b0 * 32, m * 32
        if _mxfp8_chunk(src[a: a + n], shift, mask, rule, scale[b0: b0 + m], q[a: a + n], tmp[:n], top[:m],
                        u[:n], f[:n]) != OK:
            return NONFINITE
    return OK


@_jit
def _mxfp8_chunk(src, shift, mask, rule, scale, q, tmp, top, u, f):
    """The blocks of 32 in src: scale[b] = E, by `rule`: MODELOPT ceil(log2(amax / 448)) + 127 by
    the integer rule (exact for bf16/fp16 sources: mxfp8._e8m0_from_bits); GIVEN as the caller
    filled it; RELEASE the smallest E with amax / 2^(E - 127) <= 464, exact on amax's bits
    (mxfp8.release_exponent). q = e4m3 bytes of x * 2^(127 - E), clamped to +-448 (a no-op for
    bf16/fp16 under ModelOpt's rule, its clamp for fp32; under the release's, values in (448, 464]
    round to 448 either way). Scratch: tmp like src; top (uint32) one per block; u (uint32) and f
    (float32) one per element."""
    m = scale.size
    block_top(src, shift, mask, tmp, top)
    if top.max() >= _INF_BITS:
        return NONFINITE
    if rule == RELEASE:
        for b in range(m):
            t = top[b]
            e = np.int64(t >> np.uint32(23)) - (np.int64(8) if (t & np.uint32(0x7FFFFF)) <= 0x680000 else np.int64(7))
            scale[b] = np.uint8(max(e, np.int64(0)))  # 0x680000: 464's mantissa; below 2^-119: E 0 (s = -127)
    elif rule == MODELOPT:
        amax, dv = top.view(np.float32), f[:m]
        for b in range(m):
            dv[b] = amax[b] / E4M3_MAX                 # fp32, as ModelOpt; then its bits
        db = dv.view(np.uint32)
        for b in range(m):
            scale[b] = 0 if db[b] <= 0x400000 else np.uint8((db[b] + np.uint32(0x7FFFFF)) >> 23)
    fp32_bits(src, shift, u)
    mxfp8_encode(u, scale, q, top, f)
    return OK


@_jit
def mxfp8_encode(u, scale, q, fb, f):
    """q = the e4m3 bytes of x * 2^(127 - E), clamped to +-448, for the blocks of 32 whose
    exponents `scale` holds; u: x's fp32 bits. Scratch: fb (uint32) one per block, f (float32)
    one per element."""
    for b in range(scale.size):                        # 2^(127 - E) as fp32 bits (E = 254: 2^-127)
        e = np.uint32(scale[b])
        fb[b] = np.uint32(0x400000) if e == 254 else (np.uint32(254) - e) << 23
    factor = fb.view(np.float32)
    for i in range(f.size):
        f[i] = factor[i >> 5]
    x = u.view(np.float32)
    for i in range(f.size):
        f[i] = min(max(x[i] * f[i], -E4M3_MAX), E4M3_MAX)
    a = f.view(np.uint32)
    for i in range(a.size):
        a[i] &= np.uint32(0x7FFFFFFF)
    e4m3_bytes(a, q)
    for i in range(q.size):
        q[i] |= np.uint8((u[i] >> 24) & 0x80)       # the sign of x (torch keeps -0.0's)


@_jit
def e8m0_factor_bits(e8, out):
    """out[b] = the fp32 pattern of 2^(e8[b] - 127): the exponent field itself, 2^-127 (a
    subnormal) for 0 and Inf for 255, as torch.exp2 gives in fp32."""
    for b in range(e8.size):
        e = np.uint32(e8[b])
        out[b] = (e << 23) if e else np.uint32(0x400000)


@_jit
def byte_block_max(q, tmp, nblk):
    """The largest magnitude (sign bit cleared) of each of nblk blocks of e4m3 bytes q, in
    tmp[:nblk]: e4m3 bytes order as their magnitudes, 0x7F (NaN) last. A pairwise max tree."""
    for i in range(q.size):
        tmp[i] = q[i] & np.uint8(0x7F)
    n = q.size
    while n > nblk:
        n //= 2
        for i in range(n):
            tmp[i] = max(tmp[2 * i], tmp[2 * i + 1])
    return tmp[:nblk]


@_jit
def mxfp8_dequantize(q, e8, e4m3_values, f, out):
    """out = fp32(e4m3 q) * 2^(E - 127) per block of 32, a float32 product as ModelOpt's
    `MXFP8QTensor.dequantize`. Scratch: f (uint32), the blocks of a chunk."""
    M = f.size
    for b0 in range(0, e8.size, M):
        m = min(M, e8.size - b0)
        e8m0_factor_bits(e8[b0: b0 + m], f[:m])
        factor, o, qq = f[:m].view(np.float32), out[b0 * 32: (b0 + m) * 32], q[b0 * 32: (b0 + m) * 32]
        for i in range(o.size):
            o[i] = e4m3_values[qq[i]] * factor[i >> 5]


@_jit
def mxfp8_amax_bits(q, e8, e4m3_values, tmp, top):
    """The fp32 pattern of max |mxfp8_dequantize(q, e8)|, exact, without writing the values: per
    block its largest magnitude byte times its factor (a positive factor keeps the bytes'
    order). At or above the Inf pattern where a dequantized value is NaN or Inf (compared as
    uint32, a NaN of either sign is). Scratch: tmp (uint8) and top (uint32), a chunk's bytes and
    blocks."""
    M, amax = top.size, np.uint32(0)
    for b0 in range(0, e8.size, M):
        m = min(M, e8.size - b0)
        top8 = byte_block_max(q[b0 * 32: (b0 + m) * 32], tmp[: m * 32], m)
        bits = top[:m]
        e8m0_factor_bits(e8[b0: b0 + m], bits)
        v = bits.view(np.float32)
        for b in range(m):
            v[b] = e4m3_values[top8[b]] * v[b]
        amax = max(amax, bits.max())
    return amax


@_jit
def mxfp8_amax_by_scale(q, e8, e4m3_values, levels):
    """max |mxfp8_dequantize(q, e8)|, exact, reading only the blocks whose exponent can hold it:
    those of the largest exponent E first, then of E - 1 and so on while a block there could
    still beat the maximum found (a block's values are at most 448 x its factor). A block of
    ModelOpt's rule holds a value above 224 x its factor, so only the largest exponent's blocks
    are read. Returns -1 after `levels` exponents (the caller then reads every block). A NaN or
    Inf in a block read is returned as it is; a NaN byte in a block not read is not seen (for a
    caller that reads every value afterwards anyway)."""
    emax = np.int64(e8.max()) if e8.size else np.int64(0)
    best = np.float32(0.0)
    for e in range(emax, max(emax - levels, -1), -1):
        f = np.float32(math.ldexp(1.0, e - 127))  # as e8m0_factor_bits: 2^-127 for 0, Inf for 255
        for b in range(e8.size):
            if e8[b] == e:
                top = np.uint8(0)
                for k in range(32):
                    top = max(top, q[np.uint64(b * 32 + k)] & np.uint8(0x7F))
                v = e4m3_values[top] * f
                if not v < np.inf:
                    return v
                best = max(best, v)
        if e == 0 or best >= E4M3_MAX * np.float32(math.ldexp(1.0, e - 1 - 127)):
            return best
    return np.float32(-1.0)


# ============================================================================ FP8 block-scaled sources
@_jit
def fp8_tile_max(q, n, out, acc):
    """out[r // 128, c // 128] = the largest magnitude byte (sign cleared; 0x7F is NaN, the
    largest) of the e4m3 bytes q of an [m, n] weight (q flat, row-major), per 128x128 tile: per
    band of 128 rows each column's maximum over the band (acc: uint8 [n]; a flat loop over a row,
    which vectorizes), then the maximum of each 128 columns. out: uint8 [ceil(m/128), ceil(n/128)]."""
    m = q.size // n if n else 0
    for g in range(out.shape[0]):
        for c in range(n):
            acc[c] = 0
        for r in range(g * 128, min(m, g * 128 + 128)):
            row = q[np.uint64(r * n): np.uint64(r * n + n)]
            for c in range(n):
                acc[c] = max(acc[c], row[c] & np.uint8(0x7F))
        grid = out[g]
        for j in range(out.shape[1]):
            t = np.uint8(0)
            for c in range(j * 128, min(n, j * 128 + 128)):
                t = max(t, acc[c])
            grid[j] = t


@_jit
def _band_slots(qb, n, per, top8, block_slot, slot, slot_tile, slot_top, tmp):
    """Which tables one band of an FP8 block-scaled weight needs (qb: the bytes of its rows;
    blocks of `per` elements, 16 or 32, each inside one 128x128 tile): each block's largest
    magnitude byte into top8 (row by row), and one slot per (tile column, largest byte) pair that
    occurs, numbered in order of first occurrence (the same order on every call):
    slot[column * 128 + byte] (-1: none), slot_tile and slot_top its column and byte, block_slot
    each block's. Returns the number of slots, or -1 if a byte is NaN."""
    nbr, gn = n // per, (n + 127) // 128
    rows = qb.size // n
    for r in range(rows):
        tops = byte_block_max(qb[np.uint64(r * n): np.uint64(r * n + n)], tmp, nbr)
        dst = top8[np.uint64(r * nbr): np.uint64(r * nbr + nbr)]
        for b in range(nbr):
            dst[b] = tops[b]
    if top8[: rows * nbr].max() == 0x7F:
        return -1
    for i in range(gn * 128):
        slot[i] = -1
    k = 0
    for r in range(rows):
        tops = top8[np.uint64(r * nbr): np.uint64(r * nbr + nbr)]
        for b in range(nbr):
            key = ((b * per) >> 7) * 128 + tops[b]
            if slot[key] < 0:
                slot[key], slot_tile[k], slot_top[k] = k, (b * per) >> 7, tops[b]
                k += 1
            block_slot[r * nbr + b] = slot[key]
    return k


@_jit
def nvfp4_from_fp8_bands(q, n, factor, s2, rel, e4m3_values, packed, scale, top8, block_slot, slot, slot_tile,
                         slot_top, tmp, table, slot_scale, top, pbs, d, dd, codes, x, enc_scale, enc_packed):
    """nvfp4_blocks of the fp32 weight an FP8 block-scaled weight's bytes hold (q: e4m3 bytes of
    whole 128-row bands of an [m, n] weight, flat; factor: their tiles' fp32 scales, [bands, gn]
    flat), by table. Every 16-block lies in one 128x128 tile, so each of its codes is a function of
    its byte, its tile's factor, s2 and the block's largest magnitude byte t (which fixes its
    maximum e4m3(t) * factor, hence its scale and divisor). Per band: for each (tile column, t)
    pair that occurs (_band_slots) a table of the codes of all 256 bytes, made by nvfp4_encode
    itself, then each element one lookup. A table is encoded from the 128 negative values: a
    code's magnitude does not depend on the sign (fp32 rounding is symmetric), so a positive byte
    takes the magnitude bits and a negative one the code with the sign bit the encoder gave it
    (ModelOpt's: off where the quotient is 0). Tables are encoded a batch at a time (enc_scale.size
    // 8 of them), in the scratch of nvfp4_encode (top, pbs, d: a batch's blocks; dd, codes, x: its
    values; enc_packed: its packed bytes). Scratch per band: _band_slots' (top8, block_slot, slot,
    slot_tile, slot_top, tmp), table (uint8, 256 per slot), slot_scale (one per slot)."""
    nbr, gn = n // 16, (n + 127) // 128
    per_batch = enc_scale.size // 8
    amax = top.view(np.float32)
    for g in range(0, (q.size // n + 127) // 128 if n else 0):
        qb = q[np.uint64(g * 128 * n): np.uint64(min(q.size, (g + 1) * 128 * n))]
        k = _band_slots(qb, n, 16, top8, block_slot, slot, slot_tile, slot_top, tmp)
        if k < 0:
            return NONFINITE
        fg = factor[np.uint64(g * gn): np.uint64(g * gn + gn)]
        for k0 in range(0, k, per_batch):
            kn = min(per_batch, k - k0)
            for j in range(kn):
                f = fg[slot_tile[k0 + j]]
                bm = e4m3_values[slot_top[k0 + j]] * f
                if not bm < np.inf:   # the block's values overflow fp32 (every block has a slot)
                    return NONFINITE
                for b in range(8):
                    amax[j * 8 + b] = bm
                xr = x[np.uint64(j * 128): np.uint64(j * 128 + 128)]
                for i in range(128):
                    xr[i] = e4m3_values[128 + i] * f
            status = nvfp4_encode(x[: kn * 128], top[: kn * 8], s2, rel, e4m3_values, enc_packed[: kn * 64],
                                  enc_scale[: kn * 8], pbs[: kn * 8], d[: kn * 8], dd[: kn * 128], codes[: kn * 128])
            if status != OK:
                return status
            for j in range(kn):
                slot_scale[k0 + j] = enc_scale[j * 8]
                c = codes[np.uint64(j * 128): np.uint64(j * 128 + 128)]
                t = table[np.uint64((k0 + j) * 256): np.uint64((k0 + j) * 256 + 256)]
                for i in range(128):
                    t[i] = np.uint8(c[i] & np.uint32(7))
                    t[128 + i] = np.uint8(c[i])
        pb = packed[np.uint64(g * 128 * n // 2): np.uint64(g * 128 * n // 2 + qb.size // 2)]
        sb = scale[np.uint64(g * 128 * nbr): np.uint64(g * 128 * nbr + qb.size // 16)]
        pairs = qb.view(np.uint16)   # a packed byte: the codes of a byte pair (little-endian: low byte first)
        for blk in range(sb.size):   # block by block, its table found once (~25 % faster than per byte)
            sb[blk] = slot_scale[block_slot[blk]]
            t, o = np.uint64(block_slot[blk]) * np.uint64(256), np.uint64(blk * 8)
            for j in range(8):
                v = pairs[o + j]
                pb[o + j] = table[t + (v & np.uint16(0xFF))] | (table[t + (v >> np.uint16(8))] << np.uint8(4))
    return OK


@_jit
def fp8_band_maxima(q, n, per, factor, e4m3_values, amax, counts, top8, block_slot, slot, slot_tile, slot_top,
                    tmp):
    """For each band of 128 rows of q (e4m3 bytes of an [m, n] weight, flat; factor: its tiles'
    fp32 scales, [bands, gn] flat) and blocks of `per`: its slots (_band_slots) and each one's
    maximum e4m3(t) * factor (exact: a positive factor keeps the bytes' order) into amax[band,
    :k], k into counts[band]. NONFINITE for a NaN byte or a maximum past fp32."""
    gn = (n + 127) // 128
    for g in range(counts.size):
        qb = q[np.uint64(g * 128 * n): np.uint64(min(q.size, (g + 1) * 128 * n))]
        k = _band_slots(qb, n, per, top8, block_slot, slot, slot_tile, slot_top, tmp)
        if k < 0:
            return NONFINITE
        fg, row = factor[np.uint64(g * gn): np.uint64(g * gn + gn)], amax[g]
        for j in range(k):
            row[j] = e4m3_values[slot_top[j]] * fg[slot_tile[j]]
            if not row[j] < np.inf:
                return NONFINITE
        counts[g] = k
    return OK


@_jit
def mxfp8_from_fp8_bands(q, n, factor, slot_e8, e4m3_values, out, e8, top8, block_slot, slot, slot_tile, slot_top,
                         tmp, table, u, scale, fb, f, enc):
    """MXFP8 (ModelOpt's rule) of the fp32 weight an FP8 block-scaled weight's bytes hold (q,
    factor as in nvfp4_from_fp8_bands), by table: a 32-block's bytes are a function of its bytes,
    its tile's factor and its exponent, itself a function of its maximum e4m3(t) * factor; so per
    (tile column, t) pair of a band (_band_slots, in the order fp8_band_maxima found them, whose
    maxima give slot_e8[band, slot]: the exponents) mxfp8_encode itself makes the bytes of all 256
    values, then each element is one lookup and each block's exponent (e8) its slot's. It encodes
    the 128 positive values: a negative value's byte is its magnitude's with the sign bit set (the
    encoder's: the e4m3 byte of |x| scaled, or'ed with x's sign). Tables are made a batch at a
    time (scale.size // 4 of them) in mxfp8_encode's scratch (u: the values' fp32 bits, f: one per
    value, enc: their bytes; scale and fb: one per 32 of them). Other scratch as in
    nvfp4_from_fp8_bands."""
    nbr, gn = n // 32, (n + 127) // 128
    per_batch = scale.size // 4
    x = u.view(np.float32)
    for g in range(slot_e8.shape[0]):
        qb = q[np.uint64(g * 128 * n): np.uint64(min(q.size, (g + 1) * 128 * n))]
        k = _band_slots(qb, n, 32, top8, block_slot, slot, slot_tile, slot_top, tmp)
        if k < 0:
            return NONFINITE
        fg, exps = factor[np.uint64(g * gn): np.uint64(g * gn + gn)], slot_e8[g]
        for k0 in range(0, k, per_batch):
            kn = min(per_batch, k - k0)
            for j in range(kn):
                f0 = fg[slot_tile[k0 + j]]
                for b in range(4):
                    scale[j * 4 + b] = exps[k0 + j]
                xr = x[np.uint64(j * 128): np.uint64(j * 128 + 128)]
                for i in range(128):
                    xr[i] = e4m3_values[i] * f0
            mxfp8_encode(u[: kn * 128], scale[: kn * 4], enc[: kn * 128], fb[: kn * 4], f[: kn * 128])
            for j in range(kn):
                e = enc[np.uint64(j * 128): np.uint64(j * 128 + 128)]
                t = table[np.uint64((k0 + j) * 256): np.uint64((k0 + j) * 256 + 256)]
                for i in range(128):
                    t[i] = e[i]
                    t[128 + i] = e[i] | np.uint8(0x80)
        ob = out[np.uint64(g * 128 * n): np.uint64(g * 128 * n + qb.size)]
        eb = e8[np.uint64(g * 128 * nbr): np.uint64(g * 128 * nbr + qb.size // 32)]
        for blk in range(eb.size):
            eb[blk] = exps[block_slot[blk]]
        for i in range(ob.size):
            ob[i] = table[np.uint64(block_slot[i >> 5]) * np.uint64(256) + qb[i]]
    return OK


@_jit
def e4m3_max_magnitude(q):
    """The largest magnitude byte (sign cleared) of e4m3 bytes q: 0x7F when one is NaN."""
    m = np.uint8(0)
    for i in range(q.size):
        m = max(m, q[i] & np.uint8(0x7F))
    return m
