"""Triton GEMMs on NVFP4 / MXFP8 weights in ModelOpt's HF export layout: y = x @ dequant(W)^T.

Weights are read in their packed checkpoint form (NVFP4: uint8 [N, K/2] + e4m3 [N, K/16] + fp32
global scale; MXFP8: e4m3 [N, K] + uint8 e8m0 [N, K/32]); every byte and every scale is loaded
once per (M-tile, N-tile) program and dequantized in registers: no dequantized weight ever
reaches global memory. Accumulation is fp32; the output is bf16 unless `out_dtype` says otherwise.

Three code paths, one kernel per format (a constexpr MODE switches between them):

* ``"interpreter-fp32"`` (MODE 0): the Triton CPU interpreter. Dequantized weight tile and
  activations are cast to fp32 before ``tl.dot`` because the interpreter's ``tl.dot`` on bf16
  operands silently returns wrong results (triton-lang/triton#11584).
* ``"dequant-bf16-mma"`` (MODE 1): CUDA GPUs other than sm100 (Hopper, Ampere). The weight
  tile is dequantized to bf16 (exact, see below) and multiplied on the bf16 tensor cores.
* ``"sm100-dot-scaled"`` (MODE 2): compute capability 10.x. Activations are quantized on the
  fly, per tile, to the weight's format (NVFP4 W4A4 with e4m3 per-16 scales and a per-tensor
  fp32 activation scale; MXFP8 W8A8 with e8m0 per-32 scales) and fed with the packed weights
  to ``tl.dot_scaled`` (tcgen05 block-scaled MMA).

Exactness of the dequantized tile: an e2m1 value has at most 2 significant bits, an e4m3 scale
at most 4, so e2m1 * e4m3 has at most 6 and is exact in bf16 (8) and fp32; an e4m3 value times
a power of two (MXFP8) is exact as long as it stays normal. The per-tensor NVFP4 factor
``weight_scale_2`` is applied once to the fp32 accumulator in the epilogue.

If Triton cannot run at all (no CUDA GPU and ``TRITON_INTERPRET`` was not set when this module
was imported), every entry point falls back to the torch reference (``backend()`` says which).
"""
from __future__ import annotations

import functools
import warnings

import torch

from ..errors import KernelError
from ..formats import mxfp8, nvfp4
from . import reference as _ref

try:  # triton is a declared dependency, but keep the reference usable without it
    import triton
    import triton.language as tl

    _TRITON_IMPORT_ERROR: str | None = None
except Exception as exc:  # pragma: no cover - exercised only without triton
    triton = None
    tl = None
    _TRITON_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

PATH_INTERPRETER = "interpreter-fp32"
PATH_BF16_MMA = "dequant-bf16-mma"
PATH_SM100 = "sm100-dot-scaled"
PATH_REFERENCE = "torch-reference"
PATHS = (PATH_INTERPRETER, PATH_BF16_MMA, PATH_SM100, PATH_REFERENCE)
_MODE = {PATH_INTERPRETER: 0, PATH_BF16_MMA: 1, PATH_SM100: 2}

# The formats own block sizes and maxima; the launchers pass them to the jitted bodies as
# constexpr arguments (SB: elements per scale, VMAX: largest element, SMAX/SMIN: block-scale range).
NVFP4_BLOCK = nvfp4.BLOCK_SIZE
MXFP8_BLOCK = mxfp8.BLOCK_SIZE
E2M1_MAX = nvfp4.E2M1_MAX
E4M3_MAX = nvfp4.E4M3_MAX
NVFP4_MIN_SCALE = nvfp4.MIN_BLOCK_SCALE


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _e2m1_decode(code):
        """int32 e2m1 code (sign bit 3, magnitude index bits 0-2) -> exact fp32 value."""
        mag = code & 7
        e = mag >> 1
        m = mag & 1
        # e == 0: 0 or 0.5 (0x3F000000); else 2^(e-1) * (1 + m/2) = fp32 bits (e+126, m<<22)
        bits = tl.where(e == 0, m * 0x3F000000, ((e + 126) << 23) | (m << 22))
        bits = bits | ((code & 8) << 28)
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _e4m3_decode(b):
        """uint8 float8_e4m3fn bits -> exact fp32, with integer ops only: no fp8 type needed,
        so the same code runs on Ampere (no fp8 support in Triton before sm89), Hopper and the
        interpreter. NaN codes (0x7F/0xFF) are not special-cased: checkpoints hold none."""
        b = b.to(tl.int32)
        ex = (b >> 3) & 0xF
        m = b & 7
        normal = (((ex + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
        val = tl.where(ex == 0, m.to(tl.float32) * 0.001953125, normal)  # subnormal: m * 2^-9
        return tl.where((b & 0x80) != 0, -val, val)

    @triton.jit
    def _e2m1_encode(v):
        """fp32 (already divided by its scale) -> int32 e2m1 code: round half to even on the
        grid [0, .5, 1, 1.5, 2, 3, 4, 6], saturating at 6 (ModelOpt's _cast_fp4 rule)."""
        a = tl.abs(v)
        idx = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
               + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
               + (a > 5.0).to(tl.int32))
        return idx | ((v < 0).to(tl.int32) << 3)

    @triton.jit
    def _round_e4m3(v):
        """fp32 -> fp32 on the float8_e4m3fn grid, round half to even (|v| <= 448 assumed).
        Done on the fp32 bits so the following .to(tl.float8e4nv) is exact: the interpreter's
        fp32->fp8 cast loses the mantissa carry (0.49 -> 0.25), and on GPUs this costs a few
        integer ops per activation element, on the sm100 path only."""
        bits = v.to(tl.int32, bitcast=True)
        mag = bits & 0x7FFFFFFF
        sign = bits ^ mag
        ex = (mag >> 23) - 127
        d = tl.where(ex >= -6, 20, 14 - ex)  # fp32 mantissa bits dropped: 3 kept, fewer if subnormal
        d = tl.minimum(tl.maximum(d, 20), 23)
        lsb = tl.where(d == 23, 1, (mag >> d) & 1)  # at 2^-9 the kept lsb is the implicit 1
        r = (mag + (1 << (d - 1)) - 1 + lsb) & (-(1 << d))
        tiny = tl.where(mag > 0x3A800000, 0x3B000000, 0)  # |v| < 2^-9: 2^-9 above 2^-10, else 0
        r = tl.where(ex < -9, tiny, r)
        return (r | sign).to(tl.float32, bitcast=True)

    @triton.jit
    def _round_bf16(v):
        """fp32 -> fp32 on the bf16 grid, round half to even (NaN kept). The interpreter's
        fp32->bf16 cast truncates; GPUs round to nearest even. Used on the interpreter path so
        its bf16 outputs round like the GPU's."""
        bits = v.to(tl.int32, bitcast=True)
        r = (bits + 0x7FFF + ((bits >> 16) & 1)) & (-65536)
        return tl.where(v != v, v, r.to(tl.float32, bitcast=True))

    @triton.jit
    def _store_out(y_ptr, offs_m, offs_n, stride_ym, acc, mask, MODE: tl.constexpr):
        if MODE == 0:
            if y_ptr.dtype.element_ty == tl.bfloat16:
                acc = _round_bf16(acc)
        y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _tile_rows(tile_e_ptr, tile_s_ptr, tile_end_ptr, M, pid_m,
                   BLOCK_M: tl.constexpr, GROUPED: tl.constexpr):
        if GROUPED:
            e = tl.load(tile_e_ptr + pid_m)
            row0 = tl.load(tile_s_ptr + pid_m)
            row_end = tl.load(tile_end_ptr + pid_m)
        else:
            e = pid_m * 0
            row0 = pid_m * BLOCK_M
            row_end = M
        return e, row0, row_end

    @triton.jit
    def _nvfp4_gemm_kernel(
        x_ptr, w_ptr, ws_ptr, ws2_ptr, as2_ptr, y_ptr,
        tile_e_ptr, tile_s_ptr, tile_end_ptr,
        M, N, K,
        stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_ym,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        MODE: tl.constexpr, GROUPED: tl.constexpr,
        SB: tl.constexpr, VMAX: tl.constexpr, SMAX: tl.constexpr, SMIN: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        e, row0, row_end = _tile_rows(tile_e_ptr, tile_s_ptr, tile_end_ptr, M, pid_m, BLOCK_M, GROUPED)
        if e >= 0:  # grouped launches are sized by an upper bound: spare tiles carry e == -1
            e64 = e.to(tl.int64)
            offs_m = row0 + tl.arange(0, BLOCK_M)
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            m_mask = offs_m < row_end
            n_mask = offs_n < N
            w_base = w_ptr + e64 * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
            s_base = ws_ptr + e64 * stride_se + offs_n[:, None].to(tl.int64) * stride_sn
            x_base = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
            if MODE == 2:
                a_s2 = tl.load(as2_ptr)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                x = tl.load(x_base + offs_k[None, :], mask=m_mask[:, None] & (offs_k < K)[None, :], other=0.0)
                offs_kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
                wq = tl.load(w_base + offs_kb[None, :], mask=n_mask[:, None] & (offs_kb < K // 2)[None, :], other=0)
                offs_ks = k0 // SB + tl.arange(0, BLOCK_K // SB)
                ws = tl.load(s_base + offs_ks[None, :], mask=n_mask[:, None] & (offs_ks < K // SB)[None, :], other=0)
                if MODE == 2:
                    # W4A4: quantize the activation tile to NVFP4 (per-16 e4m3 scales under the
                    # per-tensor activation scale a_s2), then one block-scaled MMA.
                    xb = tl.reshape(x.to(tl.float32), (BLOCK_M, BLOCK_K // SB, SB))
                    amax = tl.max(tl.abs(xb), axis=2)
                    bs = tl.math.div_rn(amax, VMAX * a_s2)
                    bs = tl.where(bs == 0.0, 1.0, bs)
                    bs = tl.minimum(tl.maximum(bs, SMIN), SMAX)
                    bs8 = _round_e4m3(bs).to(tl.float8e4nv)
                    denom = bs8.to(tl.float32) * a_s2
                    xq = tl.math.div_rn(xb, denom[:, :, None])
                    codes = tl.reshape(_e2m1_encode(xq), (BLOCK_M, BLOCK_K // 2, 2))
                    lo, hi = tl.split(codes)
                    xp = (lo | (hi << 4)).to(tl.uint8)
                    acc = tl.dot_scaled(xp, bs8, "e2m1", tl.trans(wq), ws.to(tl.float8e4nv, bitcast=True),
                                        "e2m1", acc)
                else:
                    codes = tl.reshape(tl.join((wq & 0xF).to(tl.int32), (wq >> 4).to(tl.int32)),
                                       (BLOCK_N, BLOCK_K))
                    wv = tl.reshape(_e2m1_decode(codes), (BLOCK_N, BLOCK_K // SB, SB))
                    wv = wv * _e4m3_decode(ws)[:, :, None]
                    w = tl.reshape(wv, (BLOCK_N, BLOCK_K))
                    if MODE == 0:
                        acc = tl.dot(x.to(tl.float32), tl.trans(w), acc, input_precision="ieee")
                    else:
                        acc = tl.dot(x.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)), acc)
            acc = acc * tl.load(ws2_ptr + e64)
            if MODE == 2:
                acc = acc * a_s2
            _store_out(y_ptr, offs_m, offs_n, stride_ym, acc, m_mask[:, None] & n_mask[None, :], MODE)

    @triton.jit
    def _mxfp8_gemm_kernel(
        x_ptr, w_ptr, ws_ptr, y_ptr,
        tile_e_ptr, tile_s_ptr, tile_end_ptr,
        M, N, K,
        stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_ym,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        MODE: tl.constexpr, GROUPED: tl.constexpr,
        SB: tl.constexpr, VMAX: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        e, row0, row_end = _tile_rows(tile_e_ptr, tile_s_ptr, tile_end_ptr, M, pid_m, BLOCK_M, GROUPED)
        if e >= 0:
            e64 = e.to(tl.int64)
            offs_m = row0 + tl.arange(0, BLOCK_M)
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            m_mask = offs_m < row_end
            n_mask = offs_n < N
            w_base = w_ptr + e64 * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
            s_base = ws_ptr + e64 * stride_se + offs_n[:, None].to(tl.int64) * stride_sn
            x_base = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                k_mask = (offs_k < K)[None, :]
                x = tl.load(x_base + offs_k[None, :], mask=m_mask[:, None] & k_mask, other=0.0)
                w8 = tl.load(w_base + offs_k[None, :], mask=n_mask[:, None] & k_mask, other=0)  # e4m3 bits
                offs_ks = k0 // SB + tl.arange(0, BLOCK_K // SB)
                ws = tl.load(s_base + offs_ks[None, :], mask=n_mask[:, None] & (offs_ks < K // SB)[None, :], other=0)
                if MODE == 2:
                    # W8A8: quantize the activation tile to MXFP8 with ModelOpt's scale rule
                    # E = ceil(log2(amax/VMAX)) (taken exactly from the fp32 bits), then one
                    # block-scaled MMA on e4m3 x e4m3 with e8m0 scales.
                    xb = tl.reshape(x.to(tl.float32), (BLOCK_M, BLOCK_K // SB, SB))
                    amax = tl.max(tl.abs(xb), axis=2)
                    bits = tl.math.div_rn(amax, VMAX).to(tl.int32, bitcast=True)
                    ef = (bits >> 23) & 0xFF
                    mant = bits & 0x7FFFFF
                    ex = ef - 127 + (mant != 0).to(tl.int32)
                    ex = tl.where(ef == 0, tl.where(mant > 0x400000, -126, -127), ex)  # subnormal amax/VMAX
                    ex = tl.where(amax == 0.0, -127, ex)
                    ex = tl.minimum(tl.maximum(ex, -127), 127)
                    inv = ((127 - ex) << 23).to(tl.float32, bitcast=True)  # 2^-ex, ex <= 120 for finite x
                    xs = tl.minimum(tl.maximum(xb * inv[:, :, None], -VMAX), VMAX)
                    x8 = tl.reshape(_round_e4m3(xs), (BLOCK_M, BLOCK_K)).to(tl.float8e4nv)
                    xe = (ex + 127).to(tl.uint8)
                    acc = tl.dot_scaled(x8, xe, "e4m3", tl.trans(w8.to(tl.float8e4nv, bitcast=True)), ws,
                                        "e4m3", acc)
                else:
                    sb = ws.to(tl.int32) << 23
                    sf = tl.where(sb == 0, 0x00400000, sb).to(tl.float32, bitcast=True)  # 2^(E-127)
                    wv = tl.reshape(_e4m3_decode(w8), (BLOCK_N, BLOCK_K // SB, SB)) * sf[:, :, None]
                    w = tl.reshape(wv, (BLOCK_N, BLOCK_K))
                    if MODE == 0:
                        acc = tl.dot(x.to(tl.float32), tl.trans(w), acc, input_precision="ieee")
                    else:
                        acc = tl.dot(x.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)), acc)
            _store_out(y_ptr, offs_m, offs_n, stride_ym, acc, m_mask[:, None] & n_mask[None, :], MODE)


# ----------------------------------------------------------------------------------------------
# Backend and path selection
# ----------------------------------------------------------------------------------------------
def _interpreted() -> bool:
    """True when the kernels were decorated for the Triton CPU interpreter (TRITON_INTERPRET=1
    at import time); that, not the variable's current value, decides how they run."""
    if triton is None:
        return False
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_nvfp4_gemm_kernel, InterpretedFunction)


def backend() -> str:
    """How the kernels run in this process: "triton-interpreter", "triton-gpu" or
    "torch-reference" (Triton cannot run: no CUDA GPU and TRITON_INTERPRET unset at import, or
    triton missing; every entry point then computes the torch reference instead)."""
    if _interpreted():
        return "triton-interpreter"
    if triton is not None and torch.cuda.is_available():
        return "triton-gpu"
    return "torch-reference"


def backend_note() -> str:
    b = backend()
    if b == "triton-interpreter":
        return "Triton CPU interpreter (TRITON_INTERPRET=1): correct but slow; fp32 tl.dot."
    if b == "triton-gpu":
        return "Triton on CUDA."
    why = (f"triton failed to import ({_TRITON_IMPORT_ERROR})" if triton is None else
           "no CUDA GPU and TRITON_INTERPRET was not set to 1 before inkling_quant.kernels was imported")
    return f"Triton cannot run ({why}): falling back to the torch reference (dequantize + fp32 matmul)."


@functools.lru_cache(maxsize=None)
def _warn_fallback() -> None:
    warnings.warn(backend_note(), RuntimeWarning, stacklevel=3)


def path_for(capability: tuple[int, int] | None, interpreted: bool) -> str:
    """Pure decision table (tested): interpreter -> fp32 tl.dot; sm100 (major 10) -> dot_scaled;
    other CUDA GPUs with bf16 MMA (sm80+) -> dequant + bf16 MMA; anything else -> reference."""
    if interpreted:
        return PATH_INTERPRETER
    if capability is None:
        return PATH_REFERENCE
    if capability[0] == 10:
        return PATH_SM100
    if capability[0] >= 8:
        return PATH_BF16_MMA
    return PATH_REFERENCE


def select_path(device: torch.device | str | None = None) -> str:
    """The path the kernels take for tensors on `device` in this process."""
    device = torch.device("cpu" if device is None else device)
    if triton is None:
        return PATH_REFERENCE
    if _interpreted():
        return PATH_INTERPRETER
    if device.type == "cuda" and torch.cuda.is_available():
        return path_for(torch.cuda.get_device_capability(device), False)
    return PATH_REFERENCE


def _resolve_path(path: str | None, device: torch.device) -> str:
    if path is None:
        path = select_path(device)
        if path == PATH_REFERENCE:
            _warn_fallback()
        return path
    if path not in PATHS:
        raise KernelError(f"unknown path {path!r}; known: {PATHS}")
    if path == PATH_REFERENCE:
        return path
    if triton is None or backend() == "torch-reference":
        raise KernelError(f"path {path!r} needs Triton: {backend_note()}")
    if _interpreted() and path == PATH_BF16_MMA:
        raise KernelError("dequant-bf16-mma cannot run in the Triton interpreter: its bf16 tl.dot returns "
                         "wrong results (triton-lang/triton#11584); use 'interpreter-fp32'")
    if not _interpreted() and device.type != "cuda":
        raise KernelError(f"path {path!r} needs CUDA tensors, got {device}")
    return path


# ----------------------------------------------------------------------------------------------
# Tile choices
# ----------------------------------------------------------------------------------------------
def _pow2_clamp(n: int, lo: int, hi: int) -> int:
    p = lo
    while p < n and p < hi:
        p *= 2
    return p


def tile_config(path: str, rows_per_tile: int, K: int) -> dict:
    """BLOCK_M/N/K and launch options per path. `rows_per_tile`: M (dense) or the mean number
    of tokens per non-empty expert (grouped)."""
    if path == PATH_INTERPRETER:
        # interpreter cost ~ one numpy op per tl op per program: big tiles, few programs
        return dict(BLOCK_M=_pow2_clamp(rows_per_tile, 16, 64), BLOCK_N=128,
                    BLOCK_K=_pow2_clamp(K, 32, 128), num_warps=4, num_stages=1)
    if path == PATH_SM100:
        # tcgen05 block-scaled MMA is 128 rows tall; 128 K elements = 8 NVFP4 / 4 MXFP8 scales
        return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=3)
    # Hopper/Ampere bf16 MMA: decode-sized M tiles for small batches (weight-bandwidth bound)
    bm = _pow2_clamp(rows_per_tile, 16, 128)
    return dict(BLOCK_M=bm, BLOCK_N=128, BLOCK_K=128,
                num_warps=4 if bm <= 64 else 8, num_stages=4 if bm <= 64 else 3)


# ----------------------------------------------------------------------------------------------
# Grouped (MoE) tile map
# ----------------------------------------------------------------------------------------------
def moe_tile_map(expert_offsets: torch.Tensor, block_m: int, num_tokens: int, exact: bool | None = None):
    """Per-M-tile (expert_id, row_start, row_end) for tokens sorted by expert, in the spirit of
    vLLM's moe_align_block_size (there: padded sorted_token_ids + expert_ids per block; here
    rows are already contiguous per expert, so a tile is a row range).

    expert_offsets: int [E+1], expert e owns rows [offsets[e], offsets[e+1]), offsets[-1] ==
    num_tokens. Computed on the offsets' device without a host sync: unless `exact` (default:
    offsets on the CPU, where reading the count costs nothing), the tile count is the upper
    bound cdiv(T, block_m) + E and the spare tiles get expert -1 (the kernel skips them).
    """
    offs = expert_offsets.to(torch.int64)
    E = offs.numel() - 1
    counts = offs[1:] - offs[:-1]
    tiles = (counts + block_m - 1) // block_m
    cum = torch.cumsum(tiles, 0)
    if exact is None:
        exact = offs.device.type == "cpu"
    if exact:
        n_tiles = int(cum[-1]) if E > 0 else 0
    else:
        n_tiles = -(-num_tokens // block_m) + E
    t = torch.arange(n_tiles, device=offs.device, dtype=torch.int64)
    e = torch.searchsorted(cum, t, right=True)
    valid = e < E
    ec = e.clamp(max=max(E - 1, 0))
    first = cum[ec] - tiles[ec]
    start = offs[ec] + (t - first) * block_m
    end = offs[ec + 1]
    tile_e = torch.where(valid, ec, torch.full_like(ec, -1)).to(torch.int32)
    return tile_e, start.to(torch.int32), end.to(torch.int32)


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------
def _check_x(x: torch.Tensor, K: int) -> torch.Tensor:
    if x.dim() != 2 or x.shape[1] != K:
        raise KernelError(f"x must be [M, {K}], got {tuple(x.shape)}")
    if x.dtype != torch.bfloat16:
        x = x.to(torch.bfloat16)
    if x.stride(1) != 1:
        x = x.contiguous()
    return x


def _u8(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def _nvfp4_launch(x, w_packed, w_scale, w_scale_2, input_scale, out_dtype, path, grouped, expert_offsets):
    N, K = w_packed.shape[-2], w_packed.shape[-1] * 2
    if K % NVFP4_BLOCK:
        raise KernelError(f"NVFP4 needs K % 16 == 0, got K={K}")
    if w_scale.shape[-1] != K // NVFP4_BLOCK or w_scale.shape[-2] != N:
        raise KernelError(f"weight_scale must be [.., {N}, {K // NVFP4_BLOCK}], got {tuple(w_scale.shape)}")
    x = _check_x(x, K)
    M = x.shape[0]
    E = w_packed.shape[0] if grouped else 1
    w_packed = _u8(w_packed)
    w_scale = _u8(w_scale)  # e4m3 bits, decoded in-kernel
    ws2 = w_scale_2.to(device=x.device, dtype=torch.float32).reshape(-1).contiguous()
    if ws2.numel() != E:
        raise KernelError(f"weight_scale_2 needs {E} value(s), got {ws2.numel()}")
    y = torch.empty((M, N), dtype=out_dtype, device=x.device)
    mode = _MODE[path]
    as2 = ws2  # unused unless MODE 2
    if mode == 2:
        as2 = _activation_scale_nvfp4(x, input_scale)
    rows = M if not grouped else max(1, M // max(1, E))
    cfg = tile_config(path, rows, K)
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    if grouped:
        tile_e, tile_s, tile_end = moe_tile_map(expert_offsets.to(x.device), bm, M)
        n_m = tile_e.numel()
    else:
        tile_e = tile_s = tile_end = ws2  # dummies, never read when GROUPED is False
        n_m = triton.cdiv(M, bm)
    if M == 0 or n_m == 0:
        return y.zero_() if grouped else y
    sw = (lambda t: t.stride(0)) if grouped else (lambda t: 0)
    grid = (n_m, triton.cdiv(N, bn))
    _nvfp4_gemm_kernel[grid](
        x, w_packed, w_scale, ws2, as2, y, tile_e, tile_s, tile_end,
        M, N, K,
        x.stride(0), sw(w_packed), w_packed.stride(-2), sw(w_scale), w_scale.stride(-2), y.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=cfg["BLOCK_K"], MODE=mode, GROUPED=grouped,
        SB=NVFP4_BLOCK, VMAX=E2M1_MAX, SMAX=E4M3_MAX, SMIN=NVFP4_MIN_SCALE,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return y


def _mxfp8_launch(x, w, w_scale, out_dtype, path, grouped, expert_offsets):
    N, K = w.shape[-2], w.shape[-1]
    if K % MXFP8_BLOCK:
        raise KernelError(f"MXFP8 needs K % 32 == 0, got K={K}")
    if w_scale.shape[-1] != K // MXFP8_BLOCK or w_scale.shape[-2] != N:
        raise KernelError(f"weight_scale must be [.., {N}, {K // MXFP8_BLOCK}], got {tuple(w_scale.shape)}")
    x = _check_x(x, K)
    M = x.shape[0]
    E = w.shape[0] if grouped else 1
    w = _u8(w)  # e4m3 bits, decoded in-kernel
    w_scale = _u8(w_scale)
    y = torch.empty((M, N), dtype=out_dtype, device=x.device)
    rows = M if not grouped else max(1, M // max(1, E))
    cfg = tile_config(path, rows, K)
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    if grouped:
        tile_e, tile_s, tile_end = moe_tile_map(expert_offsets.to(x.device), bm, M)
        n_m = tile_e.numel()
    else:
        tile_e = tile_s = tile_end = w_scale  # dummies
        n_m = triton.cdiv(M, bm)
    if M == 0 or n_m == 0:
        return y.zero_() if grouped else y
    sw = (lambda t: t.stride(0)) if grouped else (lambda t: 0)
    grid = (n_m, triton.cdiv(N, bn))
    _mxfp8_gemm_kernel[grid](
        x, w, w_scale, y, tile_e, tile_s, tile_end,
        M, N, K,
        x.stride(0), sw(w), w.stride(-2), sw(w_scale), w_scale.stride(-2), y.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=cfg["BLOCK_K"], MODE=_MODE[path], GROUPED=grouped,
        SB=MXFP8_BLOCK, VMAX=E4M3_MAX,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return y


def _activation_scale_nvfp4(x: torch.Tensor, input_scale) -> torch.Tensor:
    """Per-tensor NVFP4 activation scale (fp32 [1]) from the checkpoint's static `input_scale`
    (as amax = input_scale*6*448, so kernel and reference derive it identically) or, if None,
    dynamic amax(x)/(6*448) (ModelOpt's get_activation_scaling_factor rule); computed on the
    device without a sync; all-zero x gets 1.0."""
    return _ref.nvfp4_activation_scale(x, input_scale).reshape(1).contiguous()


# ----------------------------------------------------------------------------------------------
# Public entry points
# ----------------------------------------------------------------------------------------------
def nvfp4_dequant_gemm(x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor,
                       w_scale_2: torch.Tensor, *, input_scale=None,
                       out_dtype: torch.dtype = torch.bfloat16, path: str | None = None) -> torch.Tensor:
    """y[M, N] = x[M, K] @ dequant_nvfp4(W)[N, K]^T. `input_scale` (the checkpoint's NVFP4
    activation scale) is used by the sm100 W4A4 path only; None there means dynamic."""
    path = _resolve_path(path, x.device)
    if path == PATH_REFERENCE:
        return _ref.nvfp4_gemm(x, w_packed, w_scale, w_scale_2).to(out_dtype)
    return _nvfp4_launch(x, w_packed, w_scale, w_scale_2, input_scale, out_dtype, path, False, None)


def mxfp8_dequant_gemm(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, *,
                       out_dtype: torch.dtype = torch.bfloat16, path: str | None = None) -> torch.Tensor:
    """y[M, N] = x[M, K] @ dequant_mxfp8(W)[N, K]^T."""
    path = _resolve_path(path, x.device)
    if path == PATH_REFERENCE:
        return _ref.mxfp8_gemm(x, w, w_scale).to(out_dtype)
    return _mxfp8_launch(x, w, w_scale, out_dtype, path, False, None)


def nvfp4_grouped_gemm(x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor,
                       w_scale_2: torch.Tensor, expert_offsets: torch.Tensor, *, input_scale=None,
                       out_dtype: torch.dtype = torch.bfloat16, path: str | None = None) -> torch.Tensor:
    """One launch over all experts of a layer. x [T, K] sorted by expert; w_packed [E, N, K/2],
    w_scale [E, N, K/16], w_scale_2 [E]; expert_offsets int [E+1] (rows of expert e are
    offsets[e]:offsets[e+1]). Returns y [T, N]."""
    path = _resolve_path(path, x.device)
    if path == PATH_REFERENCE:
        return _ref.nvfp4_grouped_gemm(x, w_packed, w_scale, w_scale_2, expert_offsets).to(out_dtype)
    return _nvfp4_launch(x, w_packed, w_scale, w_scale_2, input_scale, out_dtype, path, True, expert_offsets)


def mxfp8_grouped_gemm(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                       expert_offsets: torch.Tensor, *, out_dtype: torch.dtype = torch.bfloat16,
                       path: str | None = None) -> torch.Tensor:
    """Grouped MXFP8: w [E, N, K] e4m3, w_scale [E, N, K/32] uint8; see nvfp4_grouped_gemm."""
    path = _resolve_path(path, x.device)
    if path == PATH_REFERENCE:
        return _ref.mxfp8_grouped_gemm(x, w, w_scale, expert_offsets).to(out_dtype)
    return _mxfp8_launch(x, w, w_scale, out_dtype, path, True, expert_offsets)
