"""Dequant-GEMM kernels (kernels/dequant_gemm.py) against the torch reference (kernels/reference.py).

Without a GPU, conftest.py sets TRITON_INTERPRET=1 and the kernels run in the Triton CPU
interpreter ("interpreter-fp32" path). The sm100 ``tl.dot_scaled`` kernels are also run in the
interpreter (emulated); real-GPU checks skip with a reason when there is no such GPU.

Tolerance (see docs/kernels.md, "Error bounds"): the kernel and the reference compute the same
exact products (dequantized weights are exact in fp32/bf16) and differ only in fp32 summation
order and in where NVFP4's per-tensor scale is multiplied in. With u = 2^-24 and
A = |x| @ |W|^T (fp64), both errors are bounded by the recursive-summation bound K*u*A each,
plus a few u*A for the scale placement:  |y_kernel - y_ref| <= (2K + 8) * u * A.
A bf16 output adds one rounding, 2^-8 relative (bf16 unit roundoff).
"""
from __future__ import annotations

import functools

import pytest
import torch

import inkling_quant.kernels as K
from inkling_quant.formats import FORMATS
from inkling_quant.kernels import dequant_gemm as dg
from inkling_quant.kernels import reference as R

BACKEND = K.backend()
INTERP = BACKEND == "triton-interpreter"
GPU = BACKEND == "triton-gpu"
DEV = "cuda" if GPU else "cpu"
U32 = 2.0 ** -24
U_BF16 = 2.0 ** -8  # bf16 unit roundoff (8-bit significand, round to nearest even)

needs_triton = pytest.mark.skipif(BACKEND == "torch-reference",
                                  reason="Triton cannot run here (no GPU, TRITON_INTERPRET unset)")
needs_interp = pytest.mark.skipif(not INTERP, reason="emulation test: needs the Triton CPU interpreter")


def _gpu_cap():
    return torch.cuda.get_device_capability() if GPU else None


# ------------------------------------------------------------------------------------------------
# data
# ------------------------------------------------------------------------------------------------
def _weight(n, k, seed, outlier=True):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    if outlier:
        w[3 % n, 16:32] *= 40.0      # one NVFP4 block (and half an MXFP8 block) of outliers
        w[n // 2, k - 5] = 3.0       # one huge element near the K tail: sets the global scale
    return w.to(torch.bfloat16)


def _acts(m, k, seed, zero_rows=(0,)):
    g = torch.Generator().manual_seed(1000 + seed)
    x = torch.randn(m, k, generator=g)
    x[min(1, m - 1), 32:64] *= 30.0  # an outlier activation block
    for r in zero_rows:
        if r < m:
            x[r] = 0.0
    return x.to(torch.bfloat16)


def _nvfp4(n, k, seed, outlier=True):
    return FORMATS["nvfp4"].quantize(_weight(n, k, seed, outlier))


def _mxfp8(n, k, seed, outlier=True):
    return FORMATS["mxfp8"].quantize(_weight(n, k, seed, outlier))


def _dev(t):
    return {k: v.to(DEV) for k, v in t.items()}


def _bound(x, w_deq, k, out_dtype, ref, gpu=False):
    """Elementwise tolerance: (2K+8)*u*A (+ bf16 rounding of the output)."""
    a = x.double().abs() @ w_deq.double().abs().T
    tol = (2 * k + 8) * U32 * a * (2.0 if gpu else 1.0)
    if out_dtype == torch.bfloat16:
        tol = tol + U_BF16 * (ref.double().abs() + tol)
    return tol


def _check(y, ref, tol, label):
    y, ref = y.double().cpu(), ref.double().cpu()
    err = (y - ref).abs()
    tol = tol.cpu()
    worst = (err / tol.clamp_min(1e-30)).max().item()
    assert torch.isfinite(y).all(), label
    assert (err <= tol).all(), f"{label}: max err {err.max().item():.3g}, worst err/bound {worst:.3g}"
    return err.max().item(), worst


# ------------------------------------------------------------------------------------------------
# the reference itself
# ------------------------------------------------------------------------------------------------
def test_reference_is_its_definition():
    x = _acts(7, 64, 0)
    t = _nvfp4(72, 64, 0)
    w = FORMATS["nvfp4"].dequantize(t, torch.float32)
    y = R.nvfp4_gemm(x, t["weight"], t["weight_scale"], t["weight_scale_2"])
    assert y.dtype == torch.float32 and torch.equal(y, x.float() @ w.T)
    t8 = _mxfp8(72, 64, 0)
    w8 = FORMATS["mxfp8"].dequantize(t8, torch.float32)
    y8 = R.mxfp8_gemm(x, t8["weight"], t8["weight_scale"])
    assert torch.equal(y8, x.float() @ w8.T)
    # grouped reference == explicit per-expert products
    offs = torch.tensor([0, 3, 3, 7])
    ts = [_nvfp4(72, 64, s) for s in range(3)]
    st = {k: torch.stack([t[k] for t in ts]) for k in ts[0]}
    yg = R.nvfp4_grouped_gemm(x, st["weight"], st["weight_scale"], st["weight_scale_2"], offs)
    exp = torch.cat([x[0:3].float() @ FORMATS["nvfp4"].dequantize(ts[0], torch.float32).T,
                     x[3:7].float() @ FORMATS["nvfp4"].dequantize(ts[2], torch.float32).T])
    assert torch.equal(yg, exp)


# ------------------------------------------------------------------------------------------------
# dense kernels on this machine's path (interpreter-fp32 on CPU, bf16 MMA / sm100 on GPUs)
# ------------------------------------------------------------------------------------------------
SHAPES = [(7, 72, 64), (33, 72, 128), (5, 72, 160), (3, 24, 3488)]


def _weight_only_path():
    return dg.PATH_INTERPRETER if INTERP else dg.PATH_BF16_MMA


@needs_triton
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_nvfp4_dense(m, n, k, out_dtype):
    x, t = _acts(m, k, m), _nvfp4(n, k, k)
    ref = R.nvfp4_gemm(x, t["weight"], t["weight_scale"], t["weight_scale_2"])
    t = _dev(t)
    y = K.nvfp4_dequant_gemm(x.to(DEV), t["weight"], t["weight_scale"], t["weight_scale_2"],
                             out_dtype=out_dtype, path=_weight_only_path())
    assert y.shape == (m, n) and y.dtype == out_dtype
    assert torch.all(y[0].float() == 0)  # zero activation row
    w = R.dequantize_nvfp4(*(t[s].cpu() for s in ("weight", "weight_scale", "weight_scale_2")))
    _check(y, ref, _bound(x, w, k, out_dtype, ref, gpu=GPU), f"nvfp4 {m}x{n}x{k}")


@needs_triton
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_mxfp8_dense(m, n, k, out_dtype):
    x, t = _acts(m, k, m), _mxfp8(n, k, k)
    ref = R.mxfp8_gemm(x, t["weight"], t["weight_scale"])
    t = _dev(t)
    y = K.mxfp8_dequant_gemm(x.to(DEV), t["weight"], t["weight_scale"], out_dtype=out_dtype,
                             path=_weight_only_path())
    assert y.shape == (m, n) and y.dtype == out_dtype
    assert torch.all(y[0].float() == 0)
    w = R.dequantize_mxfp8(t["weight"].cpu(), t["weight_scale"].cpu())
    _check(y, ref, _bound(x, w, k, out_dtype, ref, gpu=GPU), f"mxfp8 {m}x{n}x{k}")


# ------------------------------------------------------------------------------------------------
# grouped (MoE) kernels
# ------------------------------------------------------------------------------------------------
COUNTS = [5, 0, 17, 11]  # an expert with zero tokens; 17 rows span two 16-row tiles


def _stack(ts):
    return {k: torch.stack([t[k] for t in ts]) for k in ts[0]}


def test_moe_tile_map():
    offs = torch.tensor([0, 5, 5, 22, 33])
    te, ts, tend = K.moe_tile_map(offs, 16, 33)
    assert te.tolist() == [0, 2, 2, 3]
    assert ts.tolist() == [0, 5, 21, 22] and tend.tolist() == [5, 22, 22, 33]
    te2, ts2, tend2 = K.moe_tile_map(offs, 16, 33, exact=False)  # the GPU (no-sync) form
    assert te2.numel() == 3 + 4 and te2[:4].tolist() == te.tolist() and (te2[4:] == -1).all()
    assert ts2[:4].tolist() == ts.tolist() and tend2[:4].tolist() == tend.tolist()
    assert K.moe_tile_map(torch.tensor([0, 0, 0]), 16, 0)[0].numel() == 0


@needs_triton
@pytest.mark.parametrize("exact", [True, False], ids=["exact-tiles", "upper-bound-tiles"])
def test_nvfp4_grouped(exact, monkeypatch):
    if not exact:
        monkeypatch.setattr(dg, "moe_tile_map", functools.partial(K.moe_tile_map, exact=False))
    n, k = 72, 128
    offs = torch.tensor([0] + COUNTS).cumsum(0)
    x = _acts(int(offs[-1]), k, 3, zero_rows=(0, 6))
    st = _stack([_nvfp4(n, k, 10 + e, outlier=(e == 2)) for e in range(len(COUNTS))])
    ref = R.nvfp4_grouped_gemm(x, st["weight"], st["weight_scale"], st["weight_scale_2"], offs)
    st = _dev(st)
    y = K.nvfp4_grouped_gemm(x.to(DEV), st["weight"], st["weight_scale"], st["weight_scale_2"],
                             offs.to(DEV), out_dtype=torch.float32, path=_weight_only_path())
    w = R.dequantize_nvfp4(st["weight"].cpu(), st["weight_scale"].cpu(),
                           st["weight_scale_2"].cpu()[:, None, None])
    tol = torch.cat([_bound(x[offs[e]:offs[e + 1]], w[e], k, torch.float32, None, GPU)
                     for e in range(len(COUNTS))])
    _check(y, ref, tol, "nvfp4 grouped")


@needs_triton
def test_mxfp8_grouped():
    n, k = 72, 160
    offs = torch.tensor([0] + COUNTS).cumsum(0)
    x = _acts(int(offs[-1]), k, 4, zero_rows=(0, 6))
    st = _stack([_mxfp8(n, k, 20 + e, outlier=(e == 3)) for e in range(len(COUNTS))])
    ref = R.mxfp8_grouped_gemm(x, st["weight"], st["weight_scale"], offs)
    st = _dev(st)
    y = K.mxfp8_grouped_gemm(x.to(DEV), st["weight"], st["weight_scale"], offs.to(DEV),
                             out_dtype=torch.bfloat16, path=_weight_only_path())
    w = R.dequantize_mxfp8(st["weight"].cpu(), st["weight_scale"].cpu())
    tol = torch.cat([_bound(x[offs[e]:offs[e + 1]], w[e], k, torch.bfloat16,
                            ref[offs[e]:offs[e + 1]], GPU) for e in range(len(COUNTS))])
    _check(y, ref, tol, "mxfp8 grouped")


# ------------------------------------------------------------------------------------------------
# the sm100 dot_scaled kernels, emulated in the interpreter
# ------------------------------------------------------------------------------------------------
@pytest.fixture
def e4m3_dot_scaled_scales(monkeypatch):
    """The interpreter decodes every dot_scaled scale as e8m0 (exponent byte); tcgen05 decodes
    NVFP4's float8_e4m3fn scales as e4m3. Teach the interpreter the hardware's rule."""
    import numpy as np
    import triton.language as tl
    import triton.runtime.interpreter as interp

    orig = getattr(interp, "_dot_scaled_scale_to_f32", None)
    if orig is None:
        pytest.skip("this Triton's interpreter has no _dot_scaled_scale_to_f32 to teach e4m3 scales")

    def decode(scale_handle, compute_type):
        if scale_handle.dtype == tl.float8e4nv:
            raw = np.ascontiguousarray(scale_handle.data).view(np.uint8).copy()
            return torch.from_numpy(raw).view(torch.float8_e4m3fn).float().numpy()
        return orig(scale_handle, compute_type)

    monkeypatch.setattr(interp, "_dot_scaled_scale_to_f32", decode)


@needs_interp
def test_round_e4m3_matches_torch():
    """The kernels' in-register fp32 -> e4m3 rounding equals torch's cast (all grid points,
    midpoints, their neighbours and random values)."""
    g = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    g = g[torch.isfinite(g)].sort().values
    mid = (g[1:] + g[:-1]) / 2
    v = torch.cat([g, mid, torch.nextafter(mid, g[1:]), torch.nextafter(mid, g[:-1]),
                   (torch.rand(20000) * 2 - 1) * 448, torch.randn(20000) * 1e-2]).clamp(-448, 448)
    out = torch.empty_like(v)
    _round_kernel[(triton.cdiv(v.numel(), 8192),)](v, out, v.numel(), B=8192)
    assert torch.equal(out, v.to(torch.float8_e4m3fn).float())


try:
    import triton
    import triton.language as tl  # the name `tl` matters: annotations are strings here

    @triton.jit
    def _round_kernel(x_ptr, y_ptr, n, B: tl.constexpr):
        o = tl.program_id(0) * B + tl.arange(0, B)
        msk = o < n
        v = tl.load(x_ptr + o, mask=msk)
        tl.store(y_ptr + o, dg._round_e4m3(v).to(tl.float8e4nv).to(tl.float32), mask=msk)

    @triton.jit
    def _decode_kernel(b_ptr, y_ptr, B: tl.constexpr):
        o = tl.arange(0, B)
        tl.store(y_ptr + o, dg._e4m3_decode(tl.load(b_ptr + o)))
except Exception:  # pragma: no cover
    _round_kernel = _decode_kernel = None


@needs_interp
def test_e4m3_decode_all_codes():
    """The kernels' integer-only e4m3 decode equals torch for all 254 finite codes."""
    b = torch.arange(256, dtype=torch.uint8)
    out = torch.empty(256)
    _decode_kernel[(1,)](b, out, B=256)
    ref = b.view(torch.float8_e4m3fn).float()
    fin = torch.isfinite(ref)
    assert fin.sum() == 254 and torch.equal(out[fin], ref[fin])


@needs_interp
@pytest.mark.parametrize("m,n,k", [(7, 72, 64), (33, 72, 160)])
def test_nvfp4_w4a4_dot_scaled_emulated(m, n, k, e4m3_dot_scaled_scales):
    x, t = _acts(m, k, m), _nvfp4(n, k, k)
    y = K.nvfp4_dequant_gemm(x, t["weight"], t["weight_scale"], t["weight_scale_2"],
                             out_dtype=torch.float32, path=K.PATH_SM100)
    ref = R.nvfp4_w4a4_gemm(x, t["weight"], t["weight_scale"], t["weight_scale_2"])
    xq = R.fake_quant_nvfp4_activations(x)
    w = R.dequantize_nvfp4(t["weight"], t["weight_scale"], t["weight_scale_2"])
    _check(y, ref, _bound(xq, w, k, torch.float32, ref), "w4a4")
    # and the on-the-fly activation quantization error against the weight-only product
    y16 = R.nvfp4_gemm(x, t["weight"], t["weight_scale"], t["weight_scale_2"])
    rel = ((y - y16).norm() / y16.norm()).item()
    assert rel < 0.15, rel


def test_activation_scale_is_the_formats_rule():
    """The kernel's per-tensor NVFP4 activation scale equals the weight_scale_2 that
    inkling_quant.formats derives from the same amax, so kernel and oracle quantize x alike."""
    x = _acts(7, 64, 1)
    for input_scale in (None, torch.tensor(0.0123)):
        amax = R.nvfp4_activation_amax(x, input_scale)
        t = FORMATS["nvfp4"].quantize(x, global_amax=amax)
        assert torch.equal(R.nvfp4_activation_scale(x, input_scale), t["weight_scale_2"])


@needs_interp
def test_nvfp4_w4a4_static_input_scale_emulated(e4m3_dot_scaled_scales):
    """Static (checkpoint) input_scale below the batch's amax: blocks saturate alike; and an
    all-zero batch gives zeros."""
    m, n, k = 9, 40, 64
    x, t = _acts(m, k, 2), _nvfp4(n, k, 5)
    s_in = (x.float().abs().amax() / (6 * 448) / 4).reshape(())
    args = (t["weight"], t["weight_scale"], t["weight_scale_2"])
    y = K.nvfp4_dequant_gemm(x, *args, input_scale=s_in, out_dtype=torch.float32, path=K.PATH_SM100)
    ref = R.nvfp4_w4a4_gemm(x, *args, input_scale=s_in)
    xq = R.fake_quant_nvfp4_activations(x, s_in)
    _check(y, ref, _bound(xq, R.dequantize_nvfp4(*args), k, torch.float32, ref), "w4a4 static")
    z = K.nvfp4_dequant_gemm(torch.zeros_like(x), *args, out_dtype=torch.float32, path=K.PATH_SM100)
    assert torch.equal(z, torch.zeros_like(z))


@needs_interp
@pytest.mark.parametrize("m,n,k", [(7, 72, 64), (33, 72, 160)])
def test_mxfp8_w8a8_dot_scaled_emulated(m, n, k):
    x, t = _acts(m, k, m), _mxfp8(n, k, k)
    x[2, :32] = (torch.linspace(-1.0, 0.9, 32) * 1e-36).to(torch.bfloat16)  # amax/448: fp32 subnormal
    y = K.mxfp8_dequant_gemm(x, t["weight"], t["weight_scale"], out_dtype=torch.float32,
                             path=K.PATH_SM100)
    ref = R.mxfp8_w8a8_gemm(x, t["weight"], t["weight_scale"])
    xq = R.fake_quant_mxfp8_activations(x)
    w = R.dequantize_mxfp8(t["weight"], t["weight_scale"])
    _check(y, ref, _bound(xq, w, k, torch.float32, ref), "w8a8")
    y8 = R.mxfp8_gemm(x, t["weight"], t["weight_scale"])
    assert ((y - y8).norm() / y8.norm()).item() < 0.05


@needs_interp
def test_grouped_dot_scaled_emulated(e4m3_dot_scaled_scales):
    n, k = 72, 64
    offs = torch.tensor([0] + COUNTS).cumsum(0)
    x = _acts(int(offs[-1]), k, 5, zero_rows=(0, 6))
    st = _stack([_nvfp4(n, k, 30 + e) for e in range(len(COUNTS))])
    y = K.nvfp4_grouped_gemm(x, st["weight"], st["weight_scale"], st["weight_scale_2"], offs,
                             out_dtype=torch.float32, path=K.PATH_SM100)
    ref = R.nvfp4_w4a4_grouped_gemm(x, st["weight"], st["weight_scale"], st["weight_scale_2"], offs)
    xq = R.fake_quant_nvfp4_activations(x)
    w = R.dequantize_nvfp4(st["weight"], st["weight_scale"], st["weight_scale_2"][:, None, None])
    tol = torch.cat([_bound(xq[offs[e]:offs[e + 1]], w[e], k, torch.float32, None)
                     for e in range(len(COUNTS))])
    _check(y, ref, tol, "w4a4 grouped")
    s8 = _stack([_mxfp8(n, k, 40 + e) for e in range(len(COUNTS))])
    y8 = K.mxfp8_grouped_gemm(x, s8["weight"], s8["weight_scale"], offs, out_dtype=torch.float32,
                              path=K.PATH_SM100)
    ref8 = R.mxfp8_w8a8_grouped_gemm(x, s8["weight"], s8["weight_scale"], offs)
    xq8 = R.fake_quant_mxfp8_activations(x)
    w8 = R.dequantize_mxfp8(s8["weight"], s8["weight_scale"])
    tol8 = torch.cat([_bound(xq8[offs[e]:offs[e + 1]], w8[e], k, torch.float32, None)
                      for e in range(len(COUNTS))])
    _check(y8, ref8, tol8, "w8a8 grouped")


# ------------------------------------------------------------------------------------------------
# path selection and fallback
# ------------------------------------------------------------------------------------------------
def test_path_table():
    assert K.path_for((10, 0), False) == "sm100-dot-scaled"
    assert K.path_for((10, 3), False) == "sm100-dot-scaled"
    assert K.path_for((9, 0), False) == "dequant-bf16-mma"
    assert K.path_for((8, 0), False) == "dequant-bf16-mma"
    assert K.path_for((12, 0), False) == "dequant-bf16-mma"
    assert K.path_for((7, 5), False) == "torch-reference"
    assert K.path_for(None, False) == "torch-reference"
    for cap in [None, (8, 0), (9, 0), (10, 0)]:
        assert K.path_for(cap, True) == "interpreter-fp32"


def test_select_path_this_machine():
    if INTERP:
        assert K.select_path("cpu") == "interpreter-fp32"
        assert K.select_path(torch.device("cpu")) == "interpreter-fp32"
    elif GPU:
        assert K.select_path("cuda") == K.path_for(_gpu_cap(), False)
    else:
        assert K.select_path("cpu") == "torch-reference"


def test_select_path_on_gpus(monkeypatch):
    """On a real GPU (kernels compiled, not interpreted) the bf16-MMA / dot_scaled paths are
    chosen by compute capability; the interpreter's fp32 workaround is never used there."""
    monkeypatch.setattr(dg, "_interpreted", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for cap, want in [((9, 0), "dequant-bf16-mma"), ((8, 6), "dequant-bf16-mma"),
                      ((10, 0), "sm100-dot-scaled")]:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None, c=cap: c)
        assert K.select_path("cuda:0") == want
        assert dg._MODE[want] != dg._MODE["interpreter-fp32"]


@needs_interp
def test_bf16_mma_refused_in_interpreter():
    x, t = _acts(7, 64, 0), _nvfp4(72, 64, 0)
    with pytest.raises(ValueError, match="11584"):
        K.nvfp4_dequant_gemm(x, t["weight"], t["weight_scale"], t["weight_scale_2"],
                             path=K.PATH_BF16_MMA)


def test_reference_fallback_without_triton(monkeypatch):
    monkeypatch.setattr(dg, "_interpreted", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    dg._warn_fallback.cache_clear()
    assert K.backend() == "torch-reference"
    assert "falling back to the torch reference" in K.backend_note()
    assert K.select_path("cpu") == "torch-reference"
    x, t = _acts(7, 64, 0), _nvfp4(72, 64, 0)
    with pytest.warns(RuntimeWarning, match="torch reference"):
        y = K.nvfp4_dequant_gemm(x, t["weight"], t["weight_scale"], t["weight_scale_2"],
                                 out_dtype=torch.float32)
    assert torch.equal(y, R.nvfp4_gemm(x, t["weight"], t["weight_scale"], t["weight_scale_2"]))
    t8 = _mxfp8(72, 64, 0)
    y8 = K.mxfp8_dequant_gemm(x, t8["weight"], t8["weight_scale"])
    assert y8.dtype == torch.bfloat16
    assert torch.equal(y8, R.mxfp8_gemm(x, t8["weight"], t8["weight_scale"]).bfloat16())
    dg._warn_fallback.cache_clear()


def test_backend_reported():
    assert BACKEND in ("triton-interpreter", "triton-gpu", "torch-reference")
    assert K.backend_note()


# ------------------------------------------------------------------------------------------------
# real GPUs (skip with a reason elsewhere)
# ------------------------------------------------------------------------------------------------
@pytest.mark.skipif(not (GPU and _gpu_cap() and _gpu_cap()[0] >= 8),
                    reason="needs a CUDA GPU with bf16 MMA (sm80+); none here")
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
def test_gpu_bf16_mma_real_shapes(fmt):
    m, n, k = 33, 3488, 3072
    x = _acts(m, k, 7)
    if fmt == "nvfp4":
        t = _nvfp4(n, k, 7)
        ref = R.nvfp4_gemm(x, t["weight"], t["weight_scale"], t["weight_scale_2"])
        w = R.dequantize_nvfp4(t["weight"], t["weight_scale"], t["weight_scale_2"])
        t = _dev(t)
        y = K.nvfp4_dequant_gemm(x.cuda(), t["weight"], t["weight_scale"], t["weight_scale_2"],
                                 path=K.PATH_BF16_MMA)
    else:
        t = _mxfp8(n, k, 7)
        ref = R.mxfp8_gemm(x, t["weight"], t["weight_scale"])
        w = R.dequantize_mxfp8(t["weight"], t["weight_scale"])
        t = _dev(t)
        y = K.mxfp8_dequant_gemm(x.cuda(), t["weight"], t["weight_scale"], path=K.PATH_BF16_MMA)
    _check(y, ref, _bound(x, w, k, torch.bfloat16, ref, gpu=True), f"gpu {fmt}")


@pytest.mark.skipif(not (GPU and _gpu_cap() and _gpu_cap()[0] == 10),
                    reason="needs an sm100 GPU (compute capability 10.x) for native tl.dot_scaled; none here")
def test_sm100_dot_scaled_native():
    m, n, k = 33, 3488, 3072
    x = _acts(m, k, 8)
    t, t8 = _nvfp4(n, k, 8), _mxfp8(n, k, 8)
    assert K.select_path("cuda") == K.PATH_SM100
    ref = R.nvfp4_w4a4_gemm(x, t["weight"], t["weight_scale"], t["weight_scale_2"])
    xq = R.fake_quant_nvfp4_activations(x)
    w = R.dequantize_nvfp4(t["weight"], t["weight_scale"], t["weight_scale_2"])
    tg = _dev(t)
    y = K.nvfp4_dequant_gemm(x.cuda(), tg["weight"], tg["weight_scale"], tg["weight_scale_2"],
                             out_dtype=torch.float32)
    _check(y, ref, _bound(xq, w, k, torch.float32, ref, gpu=True), "sm100 w4a4")
    ref8 = R.mxfp8_w8a8_gemm(x, t8["weight"], t8["weight_scale"])
    xq8 = R.fake_quant_mxfp8_activations(x)
    w8 = R.dequantize_mxfp8(t8["weight"], t8["weight_scale"])
    tg8 = _dev(t8)
    y8 = K.mxfp8_dequant_gemm(x.cuda(), tg8["weight"], tg8["weight_scale"], out_dtype=torch.float32)
    _check(y8, ref8, _bound(xq8, w8, k, torch.float32, ref8, gpu=True), "sm100 w8a8")
