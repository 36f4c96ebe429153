"""An independent reference for the *release* encoders of Inkling 2 checkpoints (NVFP4
`nvfp4_nearest` with `amax_denominator` scales, MXFP8 `mxfp8_nearest` with `ue8m0` scales), and
their decoders, written only from the documented text (NeMo AutoModel
`nemo_automodel.components.models.inkling2.quantization`, Megatron-Bridge
`bridge.models.inkling.inkling2_quantization`; transformers 5.25 `Inkling2LoopDequantizeExperts`
decodes the same bytes). It deliberately shares no code with `inkling_quant/formats/`: the tests
in test_release_encoders.py hold that implementation to this one bit for bit.

Readable rather than fast: plain numpy on fp32 arrays (numpy's fp32 operations are IEEE, correctly
rounded, with subnormals), each documented operation one fp32 operation, evaluated left to right:

NVFP4, one `amax` per tensor (an expert), one block scale per 16 input columns:
    bs   = e4m3( min( fp32( fp32(bmax / 6) * fp32(den / amax) ), 448 ) )
    d    = fp32( fp32(bs * amax) / den )
    code = e2m1( fp32(w / d) )  (+ 8 when w's sign bit is set, also for -0.0)
    decode: (e2m1(code) * fp32(bs)) * fp32(amax / den)
MXFP8, one ue8m0 byte per 32 input columns:
    s     = the smallest integer with bmax / 2**s <= 464 (exact), clamped into [-127, 127]
    value = e4m3( fp32(w / 2**s) ), keeping w's sign (also for zero)
    decode: e4m3(value) * 2**(byte - 127)

Both roundings (to E4M3 and to E2M1) are "the nearest grid value, ties to the even code", done
here by comparing against the exact midpoints of the grid (float64 holds every fp32 value and
every midpoint exactly, so the comparisons are exact).

Where the documents are silent the project made choices; each is marked "OUR choice" below.
"""
from __future__ import annotations

import numpy as np
import torch

from inkling_quant.errors import FormatError

DENOMINATOR = 2688.0  # = 6 * 448: not public; OUR choice of the released per-tensor denominator
NVFP4_BLOCK = 16
MXFP8_BLOCK = 32
MXFP8_LIMIT = 464.0  # the largest |x| that still rounds to a finite E4M3 value (to 448, ties to even)

F32 = np.float32


# ------------------------------------------------------------------------------ the two grids
def _e4m3_magnitudes() -> np.ndarray:
    """float8_e4m3fn from its definition: byte b = s eeee mmm, bias 7; exponent field 0 holds the
    subnormals m * 2**-9; 0x7f (and 0xff) is NaN, so bytes 0..126 are the finite non-negative
    values, ascending (the order of the bytes is the order of the values)."""
    vals = []
    for b in range(127):
        e, m = b >> 3, b & 7
        vals.append(m * 2.0**-9 if e == 0 else (1.0 + m / 8.0) * 2.0 ** (e - 7))
    return np.array(vals, dtype=np.float64)


E4M3_MAGNITUDES = _e4m3_magnitudes()  # index = byte, 0..126; E4M3_MAGNITUDES[126] == 448
E2M1_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # index = code, 0..7
# codes 8..15 are the same magnitudes negated (code 8 is -0.0)
E2M1_VALUES = np.concatenate([E2M1_MAGNITUDES, -E2M1_MAGNITUDES]).astype(np.float32)


def round_to_grid(a: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """Index of the grid value nearest to each non-negative `a` (ascending `grid`), ties to the
    even index; above the top of the grid, the top index. `a`'s fp32 values and the midpoints
    are exact in float64, so every comparison here is exact."""
    a = np.asarray(a, dtype=np.float64)
    mids = (grid[:-1] + grid[1:]) / 2.0
    i = np.searchsorted(mids, a, side="left")  # how many midpoints lie strictly below a
    on_mid = np.zeros(a.shape, dtype=bool)
    inside = i < len(mids)
    on_mid[inside] = mids[i[inside]] == a[inside]  # exactly halfway between grid[i] and grid[i+1]
    return np.where(on_mid & (i % 2 == 1), i + 1, i)


def e4m3_byte(a: np.ndarray) -> np.ndarray:
    """Round non-negative fp32 magnitudes (at most 464) to E4M3, nearest, ties to even: the byte
    (0..126). Below 2**-10 (and at it, a tie with 0) gives 0; 464 gives 448."""
    a = np.asarray(a, dtype=np.float64)
    assert not np.isnan(a).any() and (a >= 0).all() and (a <= MXFP8_LIMIT).all(), "outside E4M3's range"
    return round_to_grid(a, E4M3_MAGNITUDES).astype(np.uint8)


def e2m1_code(a: np.ndarray) -> np.ndarray:
    """Round non-negative magnitudes to E2M1, nearest, ties to even (0.25->0, 0.75->1, 1.25->1,
    1.75->2, 2.5->2, 3.5->4, 5->4), saturating at 6 (inf included): the code 0..7."""
    return round_to_grid(a, E2M1_MAGNITUDES).astype(np.uint8)


def e4m3_value(byte: np.ndarray) -> np.ndarray:
    """The fp32 value of E4M3 bytes (the sign bit included; no NaN expected)."""
    byte = np.asarray(byte, dtype=np.uint8)
    mag = byte & 0x7F
    assert (mag != 0x7F).all(), "E4M3 NaN"
    v = E4M3_MAGNITUDES[mag].astype(np.float32)
    return np.where(byte & 0x80, -v, v).astype(np.float32)


# ------------------------------------------------------------------------------ helpers
def widen(w) -> np.ndarray:
    """`w` (bf16, fp16 or fp32 tensor, or a numpy array of those) as an fp32 numpy array: exact.
    NaN or Inf anywhere: FormatError (OUR choice, both formats)."""
    if isinstance(w, torch.Tensor):
        if w.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise TypeError(f"reference encoders take bf16, fp16 or fp32, not {w.dtype}")
        x = w.detach().cpu().to(torch.float32).numpy()
    else:
        x = np.asarray(w)
        if x.dtype not in (np.float16, np.float32):
            raise TypeError(f"reference encoders take fp16 or fp32 arrays, not {x.dtype}")
        x = x.astype(np.float32)
    if not np.isfinite(x).all():
        raise FormatError("NaN or Inf in the weight")
    return np.ascontiguousarray(x)


def _fp32_scalar(v) -> np.float32:
    if isinstance(v, torch.Tensor):
        assert v.numel() == 1
        v = v.detach().cpu().to(torch.float32).reshape(()).item()
    return F32(v)


def _bytes_as(arr: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(arr.astype(np.uint8))).view(dtype)


def _resolve_amax(x: np.ndarray, amax) -> np.float32:
    """The expert's largest magnitude unless the caller passes one (then fp32 of it)."""
    if amax is None:
        return F32(np.abs(x).max()) if x.size else F32(0.0)
    a = _fp32_scalar(amax)
    if not np.isfinite(a) or a < 0:
        raise FormatError(f"amax {a!r} is not a finite non-negative number")  # reference only
    return a


# ------------------------------------------------------------------------------ NVFP4
def _invertible_global(a: np.float32, den: float) -> bool:
    with np.errstate(over="ignore", divide="ignore"):
        g = F32(a) / F32(den)
        return bool(g > 0 and np.isfinite(F32(1.0) / g))


def min_amax(den: float = DENOMINATOR) -> np.float32:
    """The smallest fp32 amax whose global scale fp32(amax / den) has a finite fp32 reciprocal:
    a bisection over the fp32 bit patterns (the predicate grows with the amax)."""
    lo, hi = 0, int(np.array(1.0, dtype=F32).view(np.uint32))
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if _invertible_global(np.array(mid, dtype=np.uint32).view(F32), den) else (mid, hi)
    return np.array(hi, dtype=np.uint32).view(F32)


def nvfp4_block_scale_prescale(x: np.ndarray, amax: np.float32, den: float = DENOMINATOR) -> np.ndarray:
    """fp32( fp32(bmax / 6) * fp32(den / amax) ) per 16-block, before the 448 cap and the E4M3
    rounding (exposed so that tests can check that an adversarial input hits what it aims at)."""
    blocks = x.reshape(*x.shape[:-1], -1, NVFP4_BLOCK)
    bmax = np.abs(blocks).max(axis=-1)
    return (bmax / F32(6.0)) * (F32(den) / amax)


def nvfp4_nearest(w, amax=None, den: float = DENOMINATOR):
    """Encode `w` ([..., in], in % 16 == 0) with the release rule: (packed uint8 [..., in/2] with
    the even element in the low nibble, block scales float8_e4m3fn [..., in/16], amax fp32 0-d)."""
    x = widen(w)
    if x.ndim == 0 or x.shape[-1] % NVFP4_BLOCK:
        raise ValueError(f"NVFP4 needs a last dimension divisible by {NVFP4_BLOCK}, got {tuple(x.shape)}")
    a = _resolve_amax(x, amax)
    if 0 < a < min_amax(den) and (x.size == 0 or np.abs(x).max() <= a):
        # OUR choice: a weight below the smallest amax NVFP4 encodes is written as the all-zero weight
        x, a = np.zeros_like(x), F32(0.0)
    blocks = x.reshape(*x.shape[:-1], -1, NVFP4_BLOCK)
    negative = np.signbit(blocks)  # the sign bit: -0.0 included
    sign_code = np.where(negative, 8, 0).astype(np.uint8)

    if a == 0:
        # OUR choice (amax 0, the all-zero tensor): every block scale byte 0, codes 0 or 8 by sign.
        scale_bytes = np.zeros(blocks.shape[:-1], dtype=np.uint8)
        codes = sign_code
    else:
        with np.errstate(over="ignore"):
            den_over_amax = F32(den) / a
            cap_times_amax = F32(448.0) * a
        if not np.isfinite(den_over_amax) or not np.isfinite(cap_times_amax):
            # OUR choice: an amax for which fp32(den / amax) or fp32(448 * amax) overflows.
            raise FormatError(f"NVFP4 amax {float(a)!r} is out of range for the denominator {den!r}")
        bmax = np.abs(blocks).max(axis=-1)
        prescale = (bmax / F32(6.0)) * den_over_amax  # left to right, each step fp32
        prescale = np.minimum(prescale, F32(448.0))  # saturated at 448
        scale_bytes = e4m3_byte(prescale)
        bs = E4M3_MAGNITUDES[scale_bytes].astype(np.float32)
        d = (bs * a) / F32(den)  # fp32(fp32(bs * amax) / den)
        with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
            y = blocks / d[..., None]  # fp32(w / d); may overflow to inf: saturates to 6 below
        live = (d > 0)[..., None] & np.ones_like(negative)
        magnitude = np.zeros(blocks.shape, dtype=np.uint8)
        magnitude[live] = e2m1_code(np.abs(y[live]))
        # OUR choice: a block whose scale is 0 (or whose d is 0) gets codes 0 or 8 by sign.
        codes = (magnitude | sign_code).astype(np.uint8)

    codes = codes.reshape(x.shape)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)  # even element in the LOW nibble
    return (_bytes_as(packed, torch.uint8), _bytes_as(scale_bytes, torch.float8_e4m3fn),
            torch.tensor(a, dtype=torch.float32))


def unpack_e2m1(packed) -> np.ndarray:
    p = np.asarray(packed.cpu().numpy() if isinstance(packed, torch.Tensor) else packed, dtype=np.uint8)
    codes = np.empty(p.shape[:-1] + (p.shape[-1] * 2,), dtype=np.uint8)
    codes[..., 0::2] = p & 0xF
    codes[..., 1::2] = p >> 4
    return codes


def decode_nvfp4(packed, scale, amax, den: float = DENOMINATOR) -> torch.Tensor:
    """(e2m1(code) * fp32(bs)) * fp32(amax / den), fp32; one amax for the whole tensor."""
    codes = unpack_e2m1(packed)
    e2m1 = E2M1_VALUES[codes].reshape(*codes.shape[:-1], -1, NVFP4_BLOCK)
    bs = e4m3_value(scale.view(torch.uint8).cpu().numpy())
    factor = _fp32_scalar(amax) / F32(den)
    out = (e2m1 * bs[..., None]) * factor
    return torch.from_numpy(out.reshape(codes.shape).astype(np.float32))


# ------------------------------------------------------------------------------ MXFP8
def mxfp8_exponent(bmax: np.ndarray) -> np.ndarray:
    """The smallest integer s with bmax / 2**s <= 464, exactly, clamped into [-127, 127].
    With bmax = m * 2**e (frexp, 0.5 <= m < 1): bmax / 2**(e-9) = 512 m <= 464 iff m <= 29/32,
    and bmax / 2**(e-10) = 1024 m > 464 always; so s = e - 9 if m <= 29/32 else e - 8.
    OUR choice: an all-zero block gets -127 (the smallest representable, byte 0)."""
    m, e = np.frexp(np.asarray(bmax, dtype=np.float64))
    s = np.where(m <= MXFP8_LIMIT / 512.0, e - 9, e - 8)
    s = np.where(np.asarray(bmax) == 0, -127, s)
    return np.clip(s, -127, 127).astype(np.int64)


def mxfp8_exponent_by_search(bmax: float) -> int:
    """The same, found by counting up (slow; for cross-checking). Python floats (binary64)
    divide an fp32 value by 2**s exactly for every s in [-127, 127]."""
    for s in range(-127, 128):
        if bmax / 2.0**s <= MXFP8_LIMIT:
            return s
    raise AssertionError("unreachable for finite fp32 bmax")


def mxfp8_nearest(w):
    """Encode `w` ([..., in], in % 32 == 0) with the release rule: (values float8_e4m3fn, same
    shape; scale uint8 [..., in/32], the biased exponent s + 127)."""
    x = widen(w)
    if x.ndim == 0 or x.shape[-1] % MXFP8_BLOCK:
        raise ValueError(f"MXFP8 needs a last dimension divisible by {MXFP8_BLOCK}, got {tuple(x.shape)}")
    blocks = x.reshape(*x.shape[:-1], -1, MXFP8_BLOCK)
    bmax = np.abs(blocks).max(axis=-1)
    s = mxfp8_exponent(bmax)
    two_s = np.ldexp(np.ones(s.shape, dtype=np.float32), s.astype(np.int32)).astype(np.float32)  # 2**s, exact in fp32
    with np.errstate(under="ignore"):
        y = blocks / two_s[..., None]  # fp32(w / 2**s)
    byte = e4m3_byte(np.abs(y)) | np.where(np.signbit(blocks), 0x80, 0).astype(np.uint8)  # sign kept, -0.0 too
    return (_bytes_as(byte.reshape(x.shape), torch.float8_e4m3fn), _bytes_as(s + 127, torch.uint8))


def decode_mxfp8(values, scale) -> torch.Tensor:
    """e4m3(value) * 2**(scale - 127), fp32 (exact: at least 2**-136, inside fp32's subnormals)."""
    v = e4m3_value(values.view(torch.uint8).cpu().numpy())
    blocks = v.reshape(*v.shape[:-1], -1, MXFP8_BLOCK)
    s = scale.cpu().numpy().astype(np.int32) - 127
    two_s = np.ldexp(np.ones(s.shape, dtype=np.float32), s).astype(np.float32)
    return torch.from_numpy((blocks * two_s[..., None]).reshape(v.shape).astype(np.float32))


# ------------------------------------------------------------------------------ transformers' decoder
class _Param:
    """Stands in for the model `Inkling2LoopDequantizeExperts.convert` asks for the target dtype."""

    def __init__(self, dtype):
        self.dtype = dtype

    def get_parameter(self, name):
        return torch.empty((), dtype=self.dtype)


_HF_PATTERNS = ["weight", "weight_scale", "weight_amax", "weight_outer_scale_denominator"]


def hf_decode_nvfp4(packed, scale, amax, den) -> torch.Tensor:
    """transformers 5.25's own decoder, on stacked experts: packed [E, out, in/2], scale
    [E, out, in/16], amax [E], den [E] (or 0-d); fp32 out."""
    from transformers.core_model_loading import Inkling2LoopDequantizeExperts

    inputs = dict(zip(_HF_PATTERNS, ([packed], [scale], [amax], [den])))
    out = Inkling2LoopDequantizeExperts().convert(inputs, _HF_PATTERNS, ["out"], model=_Param(torch.float32),
                                                  full_layer_name="out")
    return out["out"]


def hf_decode_mxfp8(values, scale) -> torch.Tensor:
    """transformers 5.25's own decoder, on stacked experts: values float8 [E, out, in], scale
    uint8 [E, out, in/32]; fp32 out."""
    from transformers.core_model_loading import Inkling2LoopDequantizeExperts

    inputs = {"weight": [values], "weight_scale": [scale]}
    out = Inkling2LoopDequantizeExperts().convert(inputs, _HF_PATTERNS, ["out"], model=_Param(torch.float32),
                                                  full_layer_name="out")
    return out["out"]
