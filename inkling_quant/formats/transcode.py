"""Format-to-format fast paths: the one home of every "target from a source's stored bytes".

`Format.requantize(tensors, source)` is by contract bit for bit ``quantize(source.dequantize(
tensors, float32))``. A pair that can do better (read the stored bytes once, never build the fp32
weight) registers a transcoder here, keyed by (source name, target name), in `TRANSCODERS`
(defined in base.py, which reads it; this module imports the formats, so it fills it instead):

    @transcoder("mxfp8", "nvfp4")
    def nvfp4_from_mxfp8(tensors, source, target, *, global_amax=None, input_amax=None, name="",
                         encoder="modelopt", parts=None): ...

A transcoder returns the target's tensors, or None where it does not apply (a tensor on another
device), and then the dequantize + quantize fallback runs. It must equal that fallback bit for
bit, errors included (tests/test_formats.py holds every registered pair to it), with one kind of
exception: where the target's encoder has published its own cast for that source, the
transcoder is that cast, bit for bit, and says so. Registered: MXFP8 -> NVFP4 and FP8 block ->
NVFP4 / MXFP8 (the fallback's bits, read from the bytes), MXFP4 -> NVFP4 (ModelOpt's
``quantize_mxfp4_to_nvfp4_lossless`` for its encoder; the fallback for the release's; also for
DeepSeek-V4's per-expert form). `parts` (`Format.requantize`) tells a cast that takes its shared
scale per weight which rows of a gate/up slab are whose; the others ignore it. A transcoder may
report figures beside the tensors (`STATS` keys), which callers take out before writing. Formats never import each other
for this: nvfp4.py knows nothing of mxfp8.py or mxfp4.py.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np
import torch

from ..errors import FormatError
from . import _jit
from ._cpu import _E4M3_TO_F32, _buf, _nonfinite, _run_chunks, _where
from .base import TRANSCODERS, Format, Transcoder
from .fp8_block import TILE as FP8_TILE
from .mxfp8 import _MX_CHUNK_BLOCKS, amax_before_reading, e8m0_exponent, stored_bytes
from .mxfp8 import BLOCK_SIZE as MX_BLOCK
from .mxfp4 import E2M1_MAGNITUDES
from .nvfp4 import (_MODELOPT, _NV_CHUNK_BLOCKS, BLOCK_SIZE, E2M1_MAX, E4M3_MAX, GLOBAL_DIV, MIN_BLOCK_SCALE,
                    RELEASE_DENOMINATOR, _as_amax, _e2m1_codes_torch, _global_scale, _nvfp4_chunks, _tensors,
                    nvfp4_input_scale, release_rule, release_weight_amax)

__all__ = ["TRANSCODERS", "transcoder", "find", "nvfp4_from_mxfp8", "nvfp4_from_mxfp4", "nvfp4_from_fp8_block",
           "mxfp8_from_fp8_block", "STATS"]


def transcoder(source: str, target: str):
    """Register the decorated function as the fast path from format `source` to `target`."""
    def register(fn: Transcoder) -> Transcoder:
        if (source, target) in TRANSCODERS:
            raise ValueError(f"a transcoder from {source} to {target} is registered already")
        TRANSCODERS[(source, target)] = fn
        return fn
    return register


def find(source: Format | str, target: Format | str) -> Transcoder | None:
    """The fast path from `source` to `target` (formats or their names), or None: requantize then
    dequantizes and quantizes."""
    key = tuple(f if isinstance(f, str) else f.name for f in (source, target))
    return TRANSCODERS.get(key)


# ============================================================================ MXFP8 -> NVFP4
def _nvfp4_blocks_from_mxfp8(q: np.ndarray, e8: np.ndarray, s2: torch.Tensor, rel: np.ndarray,
                             name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed, scale) NVFP4 bytes of the weight stored MXFP8 bytes hold (e4m3 q, e8m0 e8), read
    once, never dequantized whole: per chunk the NVFP4 block maxima from the bytes (two per MXFP8
    block), the values decoded into an fp32 scratch that stays in the L2 cache, then NVFP4's own
    encoder (_jit.nvfp4_from_mxfp8), on nvfp4's chunking and threads."""
    def blocks(b0: int, b1: int, s2f, out, scratch) -> int:  # b0, b1 even: whole 32-blocks
        return _jit.nvfp4_from_mxfp8(q[b0 * 16: b1 * 16], e8[b0 // 2: b1 // 2], s2f, rel, _E4M3_TO_F32, *out,
                                     _buf("nv:tmp8", (_NV_CHUNK_BLOCKS * 16,), np.uint8), *scratch,
                                     _buf("nv:x", (_NV_CHUNK_BLOCKS * 16,), np.float32))
    return _nvfp4_chunks(blocks, q.size // BLOCK_SIZE, s2, name)


@transcoder("mxfp8", "nvfp4")
def nvfp4_from_mxfp8(tensors: Mapping[str, torch.Tensor], source: Format, target: Format, *, global_amax=None,
                     input_amax: float | None = None, name: str = "", encoder: str = "modelopt",
                     parts=None) -> dict[str, torch.Tensor] | None:
    """NVFP4 of an MXFP8 release's weight on CPU, its bytes read once: the global amax from the
    blocks of the largest exponents (`mxfp8.amax_before_reading`, exact), then each chunk decoded
    and quantized while it is in the cache, no fp32 copy of the weight made (85 MB for a
    [4608, 4608] w13). Bit-identical to quantizing the dequantized weight, and to ModelOpt's NVFP4
    of it (tests/test_formats.py). None off the CPU."""
    if tensors["weight"].device.type != "cpu" or global_amax is not None:  # a shared amax: the plain path
        return None
    q, e8, shape = stored_bytes(tensors)
    g = amax_before_reading(q, e8)
    if not np.isfinite(g):
        raise _nonfinite(name)
    if target.flushes(g):
        return _zero_weight(target, shape, input_amax, name, encoder)
    release = target.encoder_rule(encoder) != "modelopt"
    rel = release_rule(g, RELEASE_DENOMINATOR, name) if release else _MODELOPT
    s2 = _global_scale(g, name, RELEASE_DENOMINATOR if release else GLOBAL_DIV)
    packed, scale = _nvfp4_blocks_from_mxfp8(q, e8, s2, rel, name)
    out = _tensors(shape, packed, scale, s2, input_amax, name)
    if release:
        out["weight_amax"] = release_weight_amax(g)
    return out


# ============================================================================ MXFP4 -> NVFP4
#: what `nvfp4_from_mxfp4` reports beside the tensors (0-d int64): the MXFP4 blocks it read and
#: how many of them ModelOpt counts lossless (`quantize_mxfp4_to_nvfp4_lossless`'s n_lossless)
STATS = ("mxfp4_blocks", "mxfp4_lossless_blocks")
_E4M3_KMAX, _E4M3_KMIN = 8, -9   # E4M3 holds 2^k exactly for k in [-9, 8] (ModelOpt numeric_utils.py)


def _mxfp4_kmax(e8: torch.Tensor) -> int:
    """ModelOpt's k_max of one weight's e8m0 bytes (shard_cast_utils.py ``mxfp4_kmax``): the
    largest exponent over its non-zero bytes, 0 where it has none."""
    nonzero = e8 > 0
    return int(e8[nonzero].to(torch.int32).max()) - 127 if bool(nonzero.any()) else 0


def _pow2_e4m3(k: torch.Tensor) -> torch.Tensor:
    """The float8_e4m3fn byte of 2^k for integer k in [-9, 8], exact: subnormals 2^-9..2^-7 are
    1, 2, 4; normals (k + 7) << 3."""
    return torch.where(k < -6, torch.bitwise_left_shift(torch.ones_like(k), k + 9), (k + 7) << 3).to(torch.uint8)


@transcoder("mxfp4_rows", "nvfp4")   # DeepSeek-V4's experts: the same bits, stored per expert
@transcoder("mxfp4", "nvfp4")
def nvfp4_from_mxfp4(tensors: Mapping[str, torch.Tensor], source: Format, target: Format, *, global_amax=None,
                     input_amax: float | None = None, name: str = "", encoder: str = "modelopt",
                     parts=None) -> dict[str, torch.Tensor] | None:
    """NVFP4 of an MXFP4 weight (one expert's slab, gate and up rows together) by ModelOpt's own
    cast, bit for bit: nvidia-modelopt 0.47.0 export/shard_cast_utils.py
    ``quantize_mxfp4_to_nvfp4_lossless`` with ``k_max`` = the weight's largest exponent over
    non-zero e8m0 bytes, 0 where it has none (``mxfp4_kmax``); for a fused gate/up pair (`parts`:
    the slab's gate rows and up rows) ``build_w13_kmax_overrides``' shared ``max(k1, k3)``, each
    taken so (a gate without one non-zero byte counts as 0, not as absent). ``weight_scale_2 =
    2^(k_max - 8)``; a block whose exponent ``k`` lies in E4M3's window (``k >= k_max - 17``)
    gets the scale ``2^(k - k_max + 8)`` exactly and its codes back verbatim (-0 becomes +0:
    ModelOpt's sign is ``y < 0``); any other block is requantized from its values (block amax
    ``6 * 2^k`` or ``max_code * 2^k`` as ``numeric_utils.py`` ``mxfp4_to_nvfp4_per_block_amax``
    picks it, scale clamped to [2^-9, 448], then NVFP4's rounding). Those two cases are read from
    the bytes here without a float pass for the first. Reported beside the tensors (`STATS`): the
    MXFP4 blocks and those ModelOpt counts lossless (``(k >= k_max - 17) | (e8m0 == 0)``).
    Per-projection calls with the shared k_max give the same bytes (per_block_amax's window is
    the projection's own there, but a block outside the shared window clamps to 2^-9 whichever
    amax it takes). One departure: a weight below NVFP4's smallest amax (`NVFP4.flushes`: e8m0
    bytes all 0, or tiny ones) is NVFP4's all-zero weight, as every other path writes it; ModelOpt's
    cast gives it a global scale 2^(k_max - 8) (2^-8 for all-zero bytes, a deep subnormal for tiny
    ones, which no engine can divide by) over codes that decode to +-0 or nearly. None (the plain
    path: quantize the dequantized weight) for the release's encoder or a caller's shared amax."""
    if target.encoder_rule(encoder) != "modelopt" or global_amax is not None:
        return None
    amax = source.check_stored(tensors, name)
    b, e8 = source._stored(tensors, name)
    shape = source.weight_shape({k: tuple(v.shape) for k, v in (("weight", b), ("weight_scale", e8))})
    if target.flushes(float(amax)):  # ModelOpt's cast would write a global scale 2^(k_max - 8) of no reciprocal
        return _zero_weight(target, shape, input_amax, name, encoder)
    k = e8.to(torch.int32) - 127
    nonzero = e8 > 0
    k_max = max(_mxfp4_kmax(e8[p]) for p in parts) if parts else _mxfp4_kmax(e8)  # build_w13_kmax_overrides
    inner_max = int(k[nonzero].max()) if bool(nonzero.any()) else -127   # mxfp4_to_nvfp4_per_block_amax
    s2 = torch.tensor(2.0 ** (k_max - _E4M3_KMAX), dtype=torch.float32)
    delta = k - (inner_max - _E4M3_KMAX)
    in_range = (delta >= _E4M3_KMIN) & (delta <= _E4M3_KMAX)
    exact = (k >= k_max - (_E4M3_KMAX - _E4M3_KMIN)) & nonzero     # codes verbatim, scale 2^(k - k_max + 8)
    scale = torch.empty((*e8.shape, 2), dtype=torch.uint8)    # two NVFP4 16-blocks per MXFP4 32-block
    packed = b.clone()
    # -0 (code 8) -> +0 in both nibbles; every other code as it is
    packed &= ~(((packed & 0x0F) == 0x08).to(torch.uint8) * 0x0F) & ~(((packed >> 4) == 0x08).to(torch.uint8) * 0xF0)
    scale[...] = _pow2_e4m3(torch.clamp(k - k_max + _E4M3_KMAX, _E4M3_KMIN, _E4M3_KMAX)).unsqueeze(-1)
    if not bool(exact.all()):
        _requantize_blocks(b, e8, k, in_range, ~exact, s2, packed, scale, source)
    lossless = int(((k >= k_max - (_E4M3_KMAX - _E4M3_KMIN)) | ~nonzero).sum())
    out = {"weight": packed.reshape(*shape[:-1], shape[-1] // 2),
           "weight_scale": scale.reshape(*shape[:-1], shape[-1] // BLOCK_SIZE).view(torch.float8_e4m3fn),
           "weight_scale_2": s2}
    if input_amax is not None:
        out["input_scale"] = nvfp4_input_scale(input_amax, name)
    out[STATS[0]], out[STATS[1]] = torch.tensor(e8.numel()), torch.tensor(lossless)
    return out


def _zero_weight(target: Format, shape, input_amax, name: str, encoder: str) -> dict[str, torch.Tensor]:
    """The target's encoding of an all-zero weight of `shape`: what it writes for a weight below
    its smallest amax (`Format.flushes`), whichever path reads the source."""
    return target.quantize(torch.zeros(shape, dtype=torch.bfloat16), input_amax=input_amax, name=name, encoder=encoder)


def _requantize_blocks(b: torch.Tensor, e8: torch.Tensor, k: torch.Tensor, in_range: torch.Tensor,
                       todo: torch.Tensor, s2: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                       source: Format) -> None:
    """The MXFP4 blocks `todo` (outside the window, or e8m0 0) by ModelOpt's arithmetic, in place:
    block amax ``6 * 2^k`` in the window else ``max_code * 2^k`` (per_block_amax), scale
    ``e4m3(clamp(amax / (6 * s2), 2^-9, 448))`` for both 16-halves, values ``w / (scale * s2)``
    rounded as NVFP4QTensor.quantize rounds (nvfp4._e2m1_codes_torch)."""
    bt, et, kt, rt = b[todo], e8[todo], k[todo], in_range[todo]          # [n, 16], [n], ...
    pow2 = torch.exp2(kt.float())
    top = torch.maximum(bt & 0x07, (bt >> 4) & 0x07).amax(dim=-1)
    amax = torch.where(rt, E2M1_MAX * pow2, E2M1_MAGNITUDES[top.long()] * pow2)
    sc = (amax / (E2M1_MAX * s2)).clamp(min=MIN_BLOCK_SCALE, max=E4M3_MAX).to(torch.float8_e4m3fn)
    vals = source.dequantize({"weight": bt.unsqueeze(1), "weight_scale": et.unsqueeze(1)}, torch.float32)  # [n, 32]
    y = vals / (sc.to(torch.float32) * s2).unsqueeze(-1)
    codes = _e2m1_codes_torch(y.reshape(-1)).reshape(y.shape)
    packed[todo] = codes[:, 0::2] | (codes[:, 1::2] << 4)
    scale[todo] = sc.view(torch.uint8).unsqueeze(-1).expand(-1, 2)


# ============================================================================ FP8 block-scaled -> NVFP4, MXFP8
def _fp8_bytes(tensors, source: Format, per: int, name: str):
    """(e4m3 bytes flat, fp32 scale grid, (m, n)) of a non-empty 2-D CPU weight whose blocks of
    `per` fit its last dim and whose scales are finite and > 0; None otherwise (the plain path then
    decides, errors included)."""
    w, s = source._stored(tensors, name)
    if (w.device.type != "cpu" or w.dim() != 2 or w.numel() == 0 or w.shape[-1] % per
            or not bool(((s > 0) & (s < np.inf)).all())):
        return None
    return w.contiguous().view(torch.uint8).reshape(-1).numpy(), s.contiguous(), tuple(w.shape)


def _band_pairs(n: int) -> int:
    """The (tile column, block maximum byte) pairs a band of a weight of `n` columns can hold: the
    by-table kernels' slots."""
    return -(-n // FP8_TILE) * 128


def _slot_scratch(n: int) -> tuple[np.ndarray, ...]:
    """Per-thread scratch of _jit._band_slots for a weight of `n` columns: top8 and block_slot
    (one per block of a band), slot (one per pair a band can hold: _band_pairs), slot_tile and
    slot_top (one per pair), a row's bytes."""
    slots, blocks = _band_pairs(n), FP8_TILE * n // 16
    return (_buf("fp8:top8", (blocks,), np.uint8), _buf("fp8:block_slot", (blocks,), np.int32),
            _buf("fp8:slot", (slots,), np.int32), _buf("fp8:slot_tile", (slots,), np.int32),
            _buf("fp8:slot_top", (slots,), np.uint8), _buf("fp8:row", (n,), np.uint8))


def _tables(n: int) -> np.ndarray:
    """Per-thread scratch of the by-table kernels' tables: 256 bytes for each pair a band can hold."""
    return _buf("fp8:table", (_band_pairs(n) * 256,), np.uint8)


@transcoder("fp8_block", "nvfp4")
def nvfp4_from_fp8_block(tensors: Mapping[str, torch.Tensor], source: Format, target: Format, *, global_amax=None,
                         input_amax: float | None = None, name: str = "", encoder: str = "modelopt",
                         parts=None) -> dict[str, torch.Tensor] | None:
    """NVFP4 of an FP8 block-scaled weight (one expert's projection) on CPU from its bytes, by
    table: per band of 128 rows, for each (tile, block maximum byte) that occurs the codes of
    all 256 bytes made by the NVFP4 kernel's own encoder, then each element a lookup
    (_jit.nvfp4_from_fp8_bands); the global amax the caller's (gate and up's shared one) or the
    weight's, from the bytes (`FP8Block.amax`, exact). Bit for bit ``quantize(dequantize(tensors,
    float32), global_amax=...)``; no fp32 copy of the weight."""
    got = _fp8_bytes(tensors, source, BLOCK_SIZE, name)
    if got is None:
        return None
    q, s, (m, n) = got
    release = target.encoder_rule(encoder) != "modelopt"
    g = None if global_amax is None else _as_amax(global_amax, "global_amax", name)
    if g is None or g == 0:  # the weight's own amax (a NaN byte or an overflow otherwise shows in the kernel)
        true_amax = source.amax(tensors)
        if not bool(torch.isfinite(true_amax)):
            raise _nonfinite(name)
        if g == 0 and float(true_amax) != 0.0:
            raise FormatError(f"{_where(name)}global_amax is 0 but the tensor is not all zero", tensor=name or None)
        g = np.float32(true_amax.item()) if g is None else g
    if target.flushes(g):
        return _zero_weight(target, (m, n), input_amax, name, encoder)
    rel = release_rule(g, RELEASE_DENOMINATOR, name) if release else _MODELOPT
    s2 = _global_scale(g, name, RELEASE_DENOMINATOR if release else GLOBAL_DIV)
    factor, gn, band = s.numpy().reshape(-1), s.shape[1], FP8_TILE * n // BLOCK_SIZE   # band: a tile row's blocks

    def bands(b0: int, b1: int, s2f, out, scratch) -> int:   # b0: a band's first block
        return _jit.nvfp4_from_fp8_bands(q[b0 * 16: b1 * 16], n, factor[b0 // band * gn: -(-b1 // band) * gn], s2f,
                                         rel, _E4M3_TO_F32, *out, *_slot_scratch(n), _tables(n),
                                         _buf("fp8:slot_scale", (_band_pairs(n),), np.uint8), *scratch,
                                         _buf("nv:x", (_NV_CHUNK_BLOCKS * 16,), np.float32),
                                         _buf("nv:scale", (_NV_CHUNK_BLOCKS,), np.uint8),
                                         _buf("nv:tmp8", (_NV_CHUNK_BLOCKS * 16,), np.uint8)[: _NV_CHUNK_BLOCKS * 8])
    packed, scale = _nvfp4_chunks(bands, q.size // BLOCK_SIZE, s2, name, unit=band, units_per_call=1)
    out = _tensors((m, n), packed, scale, s2, input_amax, name)
    if release:
        out["weight_amax"] = release_weight_amax(g)
    return out


@transcoder("fp8_block", "mxfp8")
def mxfp8_from_fp8_block(tensors: Mapping[str, torch.Tensor], source: Format, target: Format, *, global_amax=None,
                         input_amax: float | None = None, name: str = "", encoder: str = "modelopt",
                         parts=None) -> dict[str, torch.Tensor] | None:
    """MXFP8 (ModelOpt's rule) of an FP8 block-scaled weight on CPU from its bytes, by table: per
    band of 128 rows, the (tile, block maximum byte) pairs that occur and their maxima (exact:
    largest byte times scale; _jit.fp8_band_maxima), ModelOpt's exponent of each (its fp32
    ``log2`` expression, `mxfp8.e8m0_exponent`, as MXFP8 quantizes any fp32 weight: on the
    pairs, a few per tile, not on every block), then the bytes of all 256 values of each pair by
    MXFP8's own encoder and each element a lookup (_jit.mxfp8_from_fp8_bands). Bit for bit
    ``quantize(dequantize(tensors, float32))``. None for the release's rule."""
    got = _fp8_bytes(tensors, source, MX_BLOCK, name)
    if got is None or target.encoder_rule(encoder) != "modelopt":
        return None
    q, s, (m, n) = got
    factor, (gm, gn), slots = s.numpy().reshape(-1), s.shape, _band_pairs(n)
    amax, counts = np.empty((gm, slots), np.float32), np.zeros(gm, np.int64)

    def maxima(g0: int, g1: int) -> None:
        if _jit.fp8_band_maxima(q[g0 * FP8_TILE * n: g1 * FP8_TILE * n], n, MX_BLOCK, factor[g0 * gn: g1 * gn],
                                _E4M3_TO_F32, amax[g0:g1], counts[g0:g1], *_slot_scratch(n)) != _jit.OK:
            raise _nonfinite(name)

    _run_chunks(maxima, gm, 1, 1)
    found = np.arange(slots) < counts[:, None]   # each band's first counts[band] slots
    slot_e8 = np.empty((gm, slots), np.uint8)
    slot_e8[found] = e8m0_exponent(torch.from_numpy(amax[found])).numpy()
    out, e8 = np.empty(q.size, np.uint8), np.empty(q.size // MX_BLOCK, np.uint8)

    def bands(g0: int, g1: int) -> None:
        M, rows = _MX_CHUNK_BLOCKS, FP8_TILE * n
        if _jit.mxfp8_from_fp8_bands(q[g0 * rows: g1 * rows], n, factor[g0 * gn: g1 * gn], slot_e8[g0:g1],
                                     _E4M3_TO_F32, out[g0 * rows: g1 * rows],
                                     e8[g0 * rows // MX_BLOCK: g1 * rows // MX_BLOCK], *_slot_scratch(n), _tables(n),
                                     _buf("mx:u", (M * 32,), np.uint32), _buf("mx:scale", (M,), np.uint8),
                                     _buf("mx:top", (M,), np.uint32), _buf("mx:f", (M * 32,), np.float32),
                                     _buf("mx:tmp8", (M * 32,), np.uint8)) != _jit.OK:
            raise _nonfinite(name)

    _run_chunks(bands, gm, 1, 1)
    return {"weight": torch.from_numpy(out).view(torch.float8_e4m3fn).reshape(m, n),
            "weight_scale": torch.from_numpy(e8).reshape(m, n // MX_BLOCK)}
