"""Compile the kernels for a GPU without one: Triton's front end, its NVIDIA backend and the
ptxas that ships inside the triton wheel turn each kernel variant into PTX and a cubin for a
given compute capability (sm90 Hopper, sm100 Blackwell, sm80 Ampere) on any machine. Catches
what the CPU interpreter cannot (layouts, dot shapes, fp8 types, register and shared-memory
limits) and shows what the GPU will execute: ``wide_loads`` counts the 16-byte vector loads
(``ld.global.v4.b32`` or 16-byte ``cp.async``) that the decode kernels' packed-weight rows should compile to.

    python -m inkling_kernels.compile_check [--arch 90] [--quick] [--ptx-dir DIR]

Must run without TRITON_INTERPRET (the kernels must be decorated as GPU kernels); the tests
start it in a subprocess. Exit status 0 when every variant compiled.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time
from dataclasses import dataclass, field

from . import gemm_kernels as gk
from .formats import E4M3_MAX, MXFP8, NVFP4, NVFP4_MIN_SCALE

_ARGS_PTR = {"x_ptr": "*bf16", "w_ptr": "*u8", "ws_ptr": "*u8", "ws2_ptr": "*fp32", "as2_ptr": "*fp32",
             "blk_expert_ptr": "*i32", "blk_rows_ptr": "*i32", "blk_end_ptr": "*i32",
             "p_ptr": "*fp32", "tw_ptr": "*fp32"}
# integer arguments the runtime specializes as multiples of 16 at the real shapes (strides of
# 4608- and 2304-wide rows, K and N): the divisibility the vectorizer relies on
_DIV16 = {"N", "K", "stride_xm", "stride_we", "stride_wn", "stride_se", "stride_sn",
          "stride_os", "stride_om", "stride_ps", "stride_pm", "stride_ym", "stride_hm", "I"}


@dataclass
class Variant:
    name: str
    kernel: str
    constexprs: dict
    out: str = "*bf16"          # dtype of out_ptr / y_ptr / h_ptr
    num_warps: int = 4
    num_stages: int = 3
    archs: tuple = (80, 90, 100)
    expect_wide_loads: bool = False
    quick: bool = False
    extra: dict = field(default_factory=dict)


def _gemm(name, fmt, inner, rows, bm, bn, bk, even_k=True, warps=4, stages=3, out="*bf16", archs=(80, 90, 100),
          wide=False, quick=False):
    kf = NVFP4 if fmt == gk.FMT_NVFP4 else MXFP8
    epu = (1 if inner == gk.INNER_DOT_SCALED else 4) * kf.codes_per_byte
    c = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, FMT=fmt, INNER=inner, ROWS=rows, X_ROW_DIV=8 if rows == 2 else 1,
             EPU=epu, EVEN_K=even_k, ROUND_BF16=False, SB=kf.scale_block, VMAX=kf.vmax, SMAX=E4M3_MAX,
             SMIN=NVFP4_MIN_SCALE)
    v = Variant(name, "_dequant_gemm_kernel", c, out, warps, stages, archs, wide, quick)
    v.extra["w_ptr"] = "*u8" if inner == gk.INNER_DOT_SCALED else "*i32"
    return v


def variants() -> list[Variant]:
    NV, MX = gk.FMT_NVFP4, gk.FMT_MXFP8
    FMA, DOT, DS = gk.INNER_FMA, gk.INNER_DOT_BF16, gk.INNER_DOT_SCALED
    D, R, S = gk.ROWS_DENSE, gk.ROWS_RANGES, gk.ROWS_SORTED_IDS
    v = [
        _gemm("nvfp4 gemv fma m1 dense", NV, FMA, D, 1, 16, 256, out="*fp32", wide=True, quick=True),
        _gemm("nvfp4 gemv fma m2 sorted-ids", NV, FMA, S, 2, 16, 256, out="*fp32", wide=True),
        _gemm("nvfp4 splitk dot m16 sorted-ids", NV, DOT, S, 16, 32, 256, out="*fp32", wide=True, quick=True),
        _gemm("nvfp4 mma 64x128x128 ranges k-tail", NV, DOT, R, 64, 128, 128, even_k=False),
        _gemm("nvfp4 mma 128x128x128 dense", NV, DOT, D, 128, 128, 128, warps=8, stages=3),
        _gemm("mxfp8 gemv fma m1 dense", MX, FMA, D, 1, 16, 256, out="*fp32", wide=True, quick=True),
        _gemm("mxfp8 splitk dot m16 sorted-ids", MX, DOT, S, 16, 32, 256, out="*fp32", wide=True),
        _gemm("mxfp8 mma 64x64x128 dense", MX, DOT, D, 64, 64, 128),
        _gemm("nvfp4 sm100 dot_scaled 128x128x128", NV, DS, D, 128, 128, 128, archs=(100,)),
        _gemm("mxfp8 sm100 dot_scaled 128x128x128", MX, DS, R, 128, 128, 128, archs=(100,)),
        Variant("split-K sum", "_splitk_sum_kernel", dict(BLOCK_R=16, BLOCK_N=128, ROUND_BF16=False)),
        Variant("moe activation (softcapped swiglu)", "_moe_activation_kernel",
                dict(ACT=1, GATE_CAP=4.0, UP_CAP=25.0, BLOCK_R=16, BLOCK_N=128, ROUND_BF16=False), quick=True),
        Variant("moe activation (silu)", "_moe_activation_kernel",
                dict(ACT=0, GATE_CAP=4.0, UP_CAP=25.0, BLOCK_R=16, BLOCK_N=128, ROUND_BF16=False)),
        Variant("moe combine top-8", "_moe_combine_kernel", dict(TOP_K=8, BLOCK_R=16, BLOCK_N=128, ROUND_BF16=False)),
    ]
    return v


def _signature(fn, v: Variant):
    sig, attrs = {}, {}
    for i, a in enumerate(fn.arg_names):
        if a in v.constexprs:
            sig[a] = "constexpr"
        elif a in ("out_ptr", "y_ptr", "h_ptr"):
            sig[a] = v.out
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif a in v.extra:
            sig[a] = v.extra[a]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif a in _ARGS_PTR:
            sig[a] = _ARGS_PTR[a]
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[a] = "i32"
            if a in _DIV16:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def compile_variant(v: Variant, arch: int):
    """(compiled kernel, seconds) for one variant and compute capability `arch` (e.g. 90)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(gk, v.kernel)
    sig, attrs = _signature(fn, v)
    t = time.perf_counter()
    k = triton.compile(ASTSource(fn, sig, v.constexprs, attrs), target=GPUTarget("cuda", arch, 32),
                       options=dict(num_warps=v.num_warps, num_stages=v.num_stages))
    return k, time.perf_counter() - t


def wide_loads(ptx: str) -> int:
    """Number of 16-byte global loads in a PTX listing: vector loads into registers
    (ld.global.v4.b32) and the 16-byte asynchronous copies (cp.async ... 0x10) through which
    Triton's software pipeline (num_stages > 1) brings tiles into shared memory."""
    return len(re.findall(r"ld\.global(?:\.\w+)*\.v4\.(?:b32|u32|f32|s32)"
                          r"|cp\.async\.c[ag]\.shared\.global[^;]*,\s*0x10\b", ptx))


def run(arch: int, quick: bool, ptx_dir: str | None = None, out=sys.stdout) -> int:
    from .paths import interpreted

    if interpreted():
        print("compile_check: TRITON_INTERPRET=1 is set: the kernels are interpreter functions; "
              "run without it", file=out)
        return 2
    failures = 0
    for v in variants():
        if arch not in v.archs or (quick and not v.quick):
            continue
        try:
            k, secs = compile_variant(v, arch)
        except Exception as exc:  # report every variant, then fail
            failures += 1
            print(f"FAIL sm{arch} {v.name}: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}", file=out)
            continue
        ptx = k.asm["ptx"]
        wl = wide_loads(ptx)
        md = k.metadata
        regs = getattr(k, "n_regs", None)
        note = ""
        if v.expect_wide_loads and wl == 0:
            failures += 1
            note = "  <- expected 16-byte weight loads"
        print(f"ok   sm{arch} {v.name}: {secs:.1f}s, shared {md.shared} B, 16-byte loads {wl}"
              + (f", regs {regs}" if regs else "") + note, file=out)
        if ptx_dir:
            os.makedirs(ptx_dir, exist_ok=True)
            safe = re.sub(r"[^A-Za-z0-9]+", "_", v.name)
            with open(os.path.join(ptx_dir, f"sm{arch}_{safe}.ptx"), "w") as f:
                f.write(ptx)
    print(f"compile_check sm{arch}: {'FAILED ' + str(failures) if failures else 'all compiled'}", file=out)
    return 1 if failures else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, action="append", help="compute capability x10 (default: 90 and 100)")
    ap.add_argument("--quick", action="store_true", help="only the variants the tests compile")
    ap.add_argument("--ptx-dir", help="write each variant's PTX here")
    args = ap.parse_args(argv)
    rc = 0
    for arch in args.arch or [90, 100]:
        rc |= run(arch, args.quick, args.ptx_dir)
    return rc


if __name__ == "__main__":
    sys.exit(main())
