"""GEMMs on NVFP4 / MXFP8 weights in ModelOpt's HF export layout: y = x @ dequant(W)^T, one
matrix (``*_dequant_gemm``) or the experts of a MoE layer over tokens sorted by expert
(``*_grouped_gemm``); the fused MoE layer is fused_moe.py.

Weights are read in their packed checkpoint form (NVFP4: uint8 [N, K/2] + e4m3 [N, K/16] + fp32
global scale; MXFP8: e4m3 [N, K] + uint8 e8m0 [N, K/32]); every weight and scale byte is loaded
once per (M-block, N-slice, K-slice) program and dequantized in registers: no dequantized weight
ever reaches global memory. Accumulation is fp32; the output is bf16 unless ``out_dtype`` says
otherwise. The path (paths.py) and the launch configuration (launch_table.py: a committed
per-shape table, heuristics elsewhere) are chosen per device and shape; ``config=`` forces one.

Exactness of the dequantized tile: an e2m1 value has at most 2 significant bits, an e4m3 scale
at most 4, so e2m1 * e4m3 has at most 6 and is exact in bf16 (8) and fp32; an e4m3 value times
a power of two (MXFP8) is exact as long as it stays normal. Per-tensor factors (NVFP4's
``weight_scale_2``; MXFP8's 2^8, see triton_ops._e4m3_words_to_f32) are applied once to the fp32
accumulator.

If Triton cannot run at all (no CUDA GPU and ``TRITON_INTERPRET`` was not set when this module
was imported), every entry point falls back to the torch reference (``backend()`` says which).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import gemm_kernels as gk
from . import paths as _paths
from . import reference as _ref
from .errors import KernelError
from .formats import E4M3_MAX, MXFP8, NVFP4, NVFP4_MIN_SCALE, kernel_format
from .launch_table import LaunchConfig, launch_config
from .paths import (DECODE_MAX_M, PATH_BF16_MMA, PATH_INTERPRETER, PATH_REFERENCE, PATH_SM100, PATH_SPLITK,
                    PATHS, backend, backend_note, device_facts, path_for, resolve_path,
                    select_path)
from .triton_ops import triton

__all__ = [
    "DECODE_MAX_M", "PATHS", "PATH_BF16_MMA", "PATH_INTERPRETER", "PATH_REFERENCE", "PATH_SM100", "PATH_SPLITK",
    "QuantWeight", "Rows", "backend", "backend_note", "choose_config", "moe_tile_map", "mxfp8_dequant_gemm",
    "mxfp8_grouped_gemm", "nvfp4_dequant_gemm", "nvfp4_grouped_gemm", "path_for", "run_gemm", "select_path",
    "tile_config",
]

# Block sizes and maxima come from the kernels' format table (formats.py); the launchers pass
# them to the jitted bodies as constexpr arguments (SB: elements per scale, VMAX: largest
# element, SMAX/SMIN: block-scale range).
NVFP4_BLOCK = NVFP4.scale_block
MXFP8_BLOCK = MXFP8.scale_block


# ----------------------------------------------------------------------------------------------
# Launch configuration
# ----------------------------------------------------------------------------------------------
def choose_config(path: str, fmt: str, kind: str, n: int, k: int, m: int, device: torch.device) -> LaunchConfig:
    """The launch config for this process and device (launch_table.launch_config)."""
    if _paths.interpreted() or device.type != "cuda":
        return launch_config(path, fmt, kind, n, k, m, interpreted=True)
    cap, sms, _ = device_facts(device.index if device.index is not None else torch.cuda.current_device())
    return launch_config(path, fmt, kind, n, k, m, capability=cap, sm_count=sms)


def tile_config(path: str, rows_per_tile: int, K: int, N: int = 4608, fmt: str = "nvfp4") -> dict:
    """The heuristic (or interpreter) launch config as the old dict of Triton meta-parameters:
    BLOCK_M/N/K, SPLIT_K, INNER, num_warps, num_stages."""
    cfg = launch_config(path, fmt, "dense", N, K, rows_per_tile, interpreted=_paths.interpreted())
    return dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k,
                INNER=cfg.inner, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _inner_code(path: str, cfg: LaunchConfig) -> int:
    if path == PATH_SM100:
        return gk.INNER_DOT_SCALED
    if cfg.inner == "fma":
        return gk.INNER_FMA
    if path == PATH_INTERPRETER or _paths.interpreted():
        return gk.INNER_DOT_F32
    return gk.INNER_DOT_BF16


# ----------------------------------------------------------------------------------------------
# Weights and row blocks
# ----------------------------------------------------------------------------------------------
def _u8(t: torch.Tensor) -> torch.Tensor:
    t = t if t.is_contiguous() else t.contiguous()
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


@dataclass
class QuantWeight:
    """One quantized matrix [N, K] or a stack of experts [E, N, K] as the kernel reads it: weight
    and scale bytes (uint8 views) and, for NVFP4, the fp32 per-tensor scale per expert."""

    fmt: str
    w: torch.Tensor
    ws: torch.Tensor
    ws2: torch.Tensor | None
    n: int
    k: int
    experts: int
    stacked: bool

    @property
    def scale_block(self) -> int:
        return kernel_format(self.fmt).scale_block

    @classmethod
    def nvfp4(cls, w_packed, w_scale, w_scale_2, stacked: bool) -> "QuantWeight":
        n, k = w_packed.shape[-2], w_packed.shape[-1] * 2
        if k % NVFP4_BLOCK:
            raise KernelError(f"NVFP4 needs K % 16 == 0, got K={k}")
        if w_scale.shape[-1] != k // NVFP4_BLOCK or w_scale.shape[-2] != n:
            raise KernelError(f"weight_scale must be [.., {n}, {k // NVFP4_BLOCK}], got {tuple(w_scale.shape)}")
        e = w_packed.shape[0] if stacked else 1
        ws2 = w_scale_2.to(device=w_packed.device, dtype=torch.float32).reshape(-1)
        if ws2.numel() != e:
            raise KernelError(f"weight_scale_2 needs {e} value(s), got {ws2.numel()}")
        return cls("nvfp4", _u8(w_packed), _u8(w_scale), ws2.contiguous(), n, k, e, stacked)

    @classmethod
    def mxfp8(cls, w, w_scale, stacked: bool) -> "QuantWeight":
        n, k = w.shape[-2], w.shape[-1]
        if k % MXFP8_BLOCK:
            raise KernelError(f"MXFP8 needs K % 32 == 0, got K={k}")
        if w_scale.shape[-1] != k // MXFP8_BLOCK or w_scale.shape[-2] != n:
            raise KernelError(f"weight_scale must be [.., {n}, {k // MXFP8_BLOCK}], got {tuple(w_scale.shape)}")
        return cls("mxfp8", _u8(w), _u8(w_scale), None, n, k, w.shape[0] if stacked else 1, stacked)


@dataclass
class Rows:
    """Which rows each M-block of a launch owns (gemm_kernels.ROWS_*): `count` blocks; `expert`
    [count] (-1: a spare block of an upper-bound grid); `rows` (ranges: first row per block;
    sorted ids: the padded id list); `end` (ranges: end row per block); `valid`: dense M or the
    number of (token, k) pairs; `x_row_div`: activation row = id // x_row_div."""

    mode: int
    count: int
    block_m: int
    valid: int
    expert: torch.Tensor | None = None
    rows: torch.Tensor | None = None
    end: torch.Tensor | None = None
    x_row_div: int = 1

    @classmethod
    def dense(cls, m: int, block_m: int) -> "Rows":
        return cls(gk.ROWS_DENSE, -(-m // block_m), block_m, m)

    @classmethod
    def ranges(cls, expert_offsets: torch.Tensor, block_m: int, num_tokens: int) -> "Rows":
        te, ts, tend = moe_tile_map(expert_offsets, block_m, num_tokens)
        return cls(gk.ROWS_RANGES, te.numel(), block_m, num_tokens, te, ts, tend)


def _activation_scale_nvfp4(x: torch.Tensor, input_scale) -> torch.Tensor:
    """Per-tensor NVFP4 activation scale (fp32 [1]) from the checkpoint's static `input_scale`
    (as amax = input_scale*6*448, so kernel and reference derive it identically) or, if None,
    dynamic amax(x)/(6*448) (ModelOpt's get_activation_scaling_factor rule); computed on the
    device without a sync; all-zero x gets 1.0."""
    return _ref.nvfp4_activation_scale(x, input_scale).reshape(1).contiguous()


def run_gemm(x: torch.Tensor, qw: QuantWeight, rows: Rows, out: torch.Tensor, cfg: LaunchConfig, path: str,
             act_scale: torch.Tensor | None = None) -> int:
    """Launch _dequant_gemm_kernel: out[s] (out [S, R, N] fp32 partials, or out [R, N] when the
    config has one K slice) = rows of x times expert weights over K slice s. Returns the number
    of K slices S actually launched (the launcher sizes `out` with split_count())."""
    if rows.count == 0 or x.shape[0] == 0:
        return 0
    inner = _inner_code(path, cfg)
    k_per_split, splits = split_layout(qw.k, cfg)
    # weight units the kernel loads: int32 words (8 e2m1 / 4 e4m3 codes) for the in-register
    # decode, bytes for tl.dot_scaled, which takes the packed operand as it is
    epu_bytes = 1 if inner == gk.INNER_DOT_SCALED else 4
    wv = qw.w if epu_bytes == 1 else qw.w.view(torch.int32)
    epu = epu_bytes * kernel_format(qw.fmt).codes_per_byte
    dummy = qw.ws2 if qw.ws2 is not None else qw.ws
    as2 = act_scale if (act_scale is not None and inner == gk.INNER_DOT_SCALED) else dummy
    idx = rows.expert if rows.expert is not None else dummy
    grid = (rows.count, triton.cdiv(qw.n, cfg.block_n), splits)
    gk._dequant_gemm_kernel[grid](
        x, wv, qw.ws, dummy, as2, out, idx,
        rows.rows if rows.rows is not None else idx, rows.end if rows.end is not None else idx,
        rows.valid, qw.n, qw.k, k_per_split // cfg.block_k,
        x.stride(0), wv.stride(0) if qw.stacked else 0, wv.stride(-2),
        qw.ws.stride(0) if qw.stacked else 0, qw.ws.stride(-2),
        out.stride(0) if out.dim() == 3 else 0, out.stride(-2),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        FMT=gk.FMT_NVFP4 if qw.fmt == "nvfp4" else gk.FMT_MXFP8, INNER=inner, ROWS=rows.mode,
        X_ROW_DIV=rows.x_row_div, EPU=epu, EVEN_K=qw.k % cfg.block_k == 0,
        ROUND_BF16=_paths.interpreted() and out.dtype == torch.bfloat16,
        SB=qw.scale_block, VMAX=kernel_format(qw.fmt).vmax, SMAX=E4M3_MAX, SMIN=NVFP4_MIN_SCALE,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return splits


def split_layout(k: int, cfg: LaunchConfig) -> tuple[int, int]:
    """(K elements per slice, number of slices): slices are whole K steps, none empty."""
    steps = -(-k // cfg.block_k)
    per = -(-steps // max(1, min(cfg.split_k, steps)))
    return per * cfg.block_k, -(-steps // per)


def reduce_splits(partials: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """y = partials.sum(0) in fixed order (deterministic split-K), stored in y's dtype."""
    s, r, n = partials.shape
    br, bn = (16, 256) if _paths.interpreted() else (16, 128)
    gk._splitk_sum_kernel[(triton.cdiv(r, br), triton.cdiv(n, bn))](
        partials, y, r, n, s, partials.stride(0), partials.stride(1), y.stride(0),
        BLOCK_R=br, BLOCK_N=bn, ROUND_BF16=_paths.interpreted() and y.dtype == torch.bfloat16)
    return y


# ----------------------------------------------------------------------------------------------
# Grouped (MoE) tile map
# ----------------------------------------------------------------------------------------------
def moe_tile_map(expert_offsets: torch.Tensor, block_m: int, num_tokens: int, exact: bool | None = None):
    """Per-M-tile (expert_id, row_start, row_end) for tokens sorted by expert, in the spirit of
    vLLM's moe_align_block_size (there: padded sorted_token_ids + expert_ids per block, which
    fused_moe.moe_align_block_size builds; here rows are already contiguous per expert, so a
    tile is a row range).

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


def _launch(x, qw: QuantWeight, out_dtype, path, expert_offsets, input_scale, config) -> torch.Tensor:
    x = _check_x(x, qw.k)
    M = x.shape[0]
    kind = "moe" if qw.stacked else "dense"
    m = M if not qw.stacked else max(1, M // max(1, qw.experts))
    cfg = config or choose_config(path, qw.fmt, kind, qw.n, qw.k, m, x.device)
    cfg.check(qw.scale_block)
    if qw.stacked:
        rows = Rows.ranges(expert_offsets.to(x.device), cfg.block_m, M)
    else:
        rows = Rows.dense(M, cfg.block_m)
    y = torch.empty((M, qw.n), dtype=out_dtype, device=x.device)
    if M == 0 or rows.count == 0:
        return y.zero_()
    act_scale = _activation_scale_nvfp4(x, input_scale) if (path == PATH_SM100 and qw.fmt == "nvfp4") else None
    _, splits = split_layout(qw.k, cfg)
    if splits == 1:
        run_gemm(x, qw, rows, y, cfg, path, act_scale)
        return y
    partials = torch.empty((splits, M, qw.n), dtype=torch.float32, device=x.device)
    run_gemm(x, qw, rows, partials, cfg, path, act_scale)
    return reduce_splits(partials, y)


def _rows_hint(x: torch.Tensor, experts: int | None) -> int:
    return x.shape[0] if experts is None else max(1, x.shape[0] // max(1, experts))


# ----------------------------------------------------------------------------------------------
# Public entry points
# ----------------------------------------------------------------------------------------------
def nvfp4_dequant_gemm(x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor,
                       w_scale_2: torch.Tensor, *, input_scale=None, out_dtype: torch.dtype = torch.bfloat16,
                       path: str | None = None, config: LaunchConfig | None = None) -> torch.Tensor:
    """y[M, N] = x[M, K] @ dequant_nvfp4(W)[N, K]^T. `input_scale` (the checkpoint's NVFP4
    activation scale) is used by the sm100 W4A4 path only; None there means dynamic. `config`
    forces a launch configuration (tests, tuning)."""
    path = resolve_path(path, x.device, _rows_hint(x, None))
    if path == PATH_REFERENCE:
        return _ref.nvfp4_gemm(x, w_packed, w_scale, w_scale_2).to(out_dtype)
    return _launch(x, QuantWeight.nvfp4(w_packed, w_scale, w_scale_2, False), out_dtype, path, None,
                   input_scale, config)


def mxfp8_dequant_gemm(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, *,
                       out_dtype: torch.dtype = torch.bfloat16, path: str | None = None,
                       config: LaunchConfig | None = None) -> torch.Tensor:
    """y[M, N] = x[M, K] @ dequant_mxfp8(W)[N, K]^T."""
    path = resolve_path(path, x.device, _rows_hint(x, None))
    if path == PATH_REFERENCE:
        return _ref.mxfp8_gemm(x, w, w_scale).to(out_dtype)
    return _launch(x, QuantWeight.mxfp8(w, w_scale, False), out_dtype, path, None, None, config)


def nvfp4_grouped_gemm(x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor,
                       w_scale_2: torch.Tensor, expert_offsets: torch.Tensor, *, input_scale=None,
                       out_dtype: torch.dtype = torch.bfloat16, path: str | None = None,
                       config: LaunchConfig | None = None) -> torch.Tensor:
    """One launch over all experts of a layer. x [T, K] sorted by expert; w_packed [E, N, K/2],
    w_scale [E, N, K/16], w_scale_2 [E]; expert_offsets int [E+1] (rows of expert e are
    offsets[e]:offsets[e+1]). Returns y [T, N]."""
    path = resolve_path(path, x.device, _rows_hint(x, w_packed.shape[0]))
    if path == PATH_REFERENCE:
        return _ref.nvfp4_grouped_gemm(x, w_packed, w_scale, w_scale_2, expert_offsets).to(out_dtype)
    return _launch(x, QuantWeight.nvfp4(w_packed, w_scale, w_scale_2, True), out_dtype, path, expert_offsets,
                   input_scale, config)


def mxfp8_grouped_gemm(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                       expert_offsets: torch.Tensor, *, out_dtype: torch.dtype = torch.bfloat16,
                       path: str | None = None, config: LaunchConfig | None = None) -> torch.Tensor:
    """Grouped MXFP8: w [E, N, K] e4m3, w_scale [E, N, K/32] uint8; see nvfp4_grouped_gemm."""
    path = resolve_path(path, x.device, _rows_hint(x, w.shape[0]))
    if path == PATH_REFERENCE:
        return _ref.mxfp8_grouped_gemm(x, w, w_scale, expert_offsets).to(out_dtype)
    return _launch(x, QuantWeight.mxfp8(w, w_scale, True), out_dtype, path, expert_offsets, None, config)
