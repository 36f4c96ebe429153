"""Kernels (inkling_kernels, the top-level kernels/) against the torch reference (reference.py).

Without a GPU, conftest.py sets TRITON_INTERPRET=1 and the kernels run in the Triton CPU
interpreter; the sm100 ``tl.dot_scaled`` kernels are emulated there too, and
``compile_check`` compiles the GPU kernels for sm90 (PTX + cubin, no GPU needed). GPU-only tests
skip with a reason elsewhere and run at full size on one.

Shapes: Inkling 2 Small's experts (hidden 4608, moe_intermediate 2304: gate_up N = 4608,
K = 4608; down N = 4608, K = 2304; 384 experts, top-8), with K or the intermediate size reduced
in the interpreter where it would be slow; plus small edge shapes (K tails, ragged N).

Tolerances: inkling_kernels/checks.py (docs/kernels.md, "Error bounds").
"""
from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import inkling_kernels as K
from inkling_quant.formats import FORMATS
from inkling_kernels import checks as C
from inkling_kernels import dequant_gemm as dg
from inkling_kernels import launch_table as LT
from inkling_kernels import paths as P
from inkling_kernels import reference as R

BACKEND = K.backend()
INTERP = BACKEND == "triton-interpreter"
GPU = BACKEND == "triton-gpu"
DEV = "cuda" if GPU else "cpu"
SHAPES = LT.real_shapes()                       # {"gate_up": (4608, 4608), "down": (4608, 2304)}
HIDDEN, INTER = SHAPES["down"]
LC = K.LaunchConfig

needs_triton = pytest.mark.skipif(BACKEND == "torch-reference",
                                  reason="Triton cannot run here (no GPU, TRITON_INTERPRET unset)")
needs_interp = pytest.mark.skipif(not INTERP, reason="emulation test: needs the Triton CPU interpreter")


def _gpu_cap():
    return torch.cuda.get_device_capability() if GPU else None


needs_gpu = pytest.mark.skipif(not (GPU and _gpu_cap()[0] >= 8),
                               reason="needs a CUDA GPU with bf16 MMA (sm80+); none here")


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


def _quant(fmt, n, k, seed, outlier=True):
    return FORMATS[fmt].quantize(_weight(n, k, seed, outlier))


def _dev(t):
    return {k: v.to(DEV) for k, v in t.items()}


def _stack(ts):
    return {k: torch.stack([t[k] for t in ts]) for k in ts[0]}


def _gemm(fmt, x, t, **kw):
    return getattr(K, FORMATS[fmt].kernel)(x, *(t[s] for s in FORMATS[fmt].kernel_inputs), **kw)


def _ref(fmt, x, t):
    return R.matmul_ref(x, C.dequantized(fmt, {s: v.cpu() for s, v in t.items()}))


def _check(y, ref, tol, label):
    ok, err, worst = C.within(y, ref, tol)
    assert ok, f"{label}: max err {err:.3g}, worst err/bound {worst:.3g}"
    return err, worst


def _check_gemm(fmt, x, t, y, out_dtype, label):
    ref = _ref(fmt, x.cpu(), t)
    w = C.dequantized(fmt, {s: v.cpu() for s, v in t.items()})
    assert y.shape == ref.shape and y.dtype == out_dtype
    return _check(y, ref, C.gemm_bound(x.cpu(), w, out_dtype, ref, gpu=GPU), label)


# ------------------------------------------------------------------------------------------------
# the reference and the decoders
# ------------------------------------------------------------------------------------------------
def test_reference_is_its_definition():
    x = _acts(7, 64, 0)
    t = _quant("nvfp4", 72, 64, 0)
    w = FORMATS["nvfp4"].dequantize(t, torch.float32)
    y = R.nvfp4_gemm(x, t["weight"], t["weight_scale"], t["weight_scale_2"])
    assert y.dtype == torch.float32 and torch.equal(y, x.float() @ w.T)
    t8 = _quant("mxfp8", 72, 64, 0)
    assert torch.equal(R.mxfp8_gemm(x, t8["weight"], t8["weight_scale"]),
                       x.float() @ FORMATS["mxfp8"].dequantize(t8, torch.float32).T)
    offs = torch.tensor([0, 3, 3, 7])
    ts = [_quant("nvfp4", 72, 64, s) for s in range(3)]
    st = _stack(ts)
    yg = R.nvfp4_grouped_gemm(x, st["weight"], st["weight_scale"], st["weight_scale_2"], offs)
    exp = torch.cat([x[0:3].float() @ FORMATS["nvfp4"].dequantize(ts[0], torch.float32).T,
                     x[3:7].float() @ FORMATS["nvfp4"].dequantize(ts[2], torch.float32).T])
    assert torch.equal(yg, exp)


def test_reference_activation_is_transformers():
    """reference.gated_activation equals transformers' Inkling2SoftcappedSwiGLU (5.25,
    models/inkling2/modeling_inkling2.py:786-797) bit for bit."""
    mod = pytest.importorskip("transformers.models.inkling2.modeling_inkling2")
    cfg = type("Cfg", (), {"mlp_gate_softcap": 4.0, "mlp_up_softcap": 25.0})()
    act = mod.Inkling2SoftcappedSwiGLU(cfg)
    g, u = torch.randn(64, 96) * 8, torch.randn(64, 96) * 40
    assert torch.equal(act(g, u), R.gated_activation(g, u, "softcapped-swiglu", 4.0, 25.0))


@needs_interp
def test_round_e4m3_matches_torch():
    """The in-register fp32 -> e4m3 rounding equals torch's cast (all grid points, midpoints,
    their neighbours and random values)."""
    g = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    g = g[torch.isfinite(g)].sort().values
    mid = (g[1:] + g[:-1]) / 2
    v = torch.cat([g, mid, torch.nextafter(mid, g[1:]), torch.nextafter(mid, g[:-1]),
                   (torch.rand(20000) * 2 - 1) * 448, torch.randn(20000) * 1e-2]).clamp(-448, 448)
    assert torch.equal(C.probe_round_e4m3(v), v.to(torch.float8_e4m3fn).float())


@needs_interp
def test_decoders_all_codes():
    """The e4m3 decoder gives torch's value for all 254 finite codes; the word decoders (two
    codes per integer op) give e2m1 * 2^-14 / e4m3 * 2^-8 for every byte value in every
    position of a word, in K order."""
    b = torch.arange(256, dtype=torch.uint8)
    out = C.probe_e4m3_decode(b)
    ref = b.view(torch.float8_e4m3fn).float()
    fin = torch.isfinite(ref)
    assert fin.sum() == 254 and torch.equal(out[fin], ref[fin])
    b = torch.arange(256, dtype=torch.uint8).repeat(2)           # every byte at every offset mod 4
    q = torch.cat([b, b.roll(1), b.roll(2), b.roll(3)]).view(torch.int32).reshape(8, -1)
    y = C.probe_words(q, "nvfp4")
    from inkling_quant.formats.nvfp4 import E2M1_VALUES, unpack_e2m1  # the formats own the codes

    ref = E2M1_VALUES[unpack_e2m1(q.view(torch.uint8).reshape(8, -1)).long()] * 2.0 ** -14
    assert torch.equal(y, ref)
    y8 = C.probe_words(q, "mxfp8")
    ref8 = q.view(torch.uint8).reshape(8, -1).view(torch.float8_e4m3fn).float() * 2.0 ** -8
    fin = torch.isfinite(ref8)
    assert torch.equal(y8[fin], ref8[fin]) and torch.equal(y8[~fin].abs(), torch.full_like(y8[~fin], 480 / 256))


@needs_interp
@pytest.mark.parametrize("act", ["silu", "softcapped-swiglu"])
def test_activation_kernel_matches_reference(act):
    g = torch.cat([torch.linspace(-40, 40, 4096), torch.randn(4095) * 1e-3, torch.zeros(1)])  # 2^13 values
    u = torch.linspace(-120, 120, g.numel())[torch.randperm(g.numel(), generator=torch.Generator().manual_seed(0))]
    h = C.probe_activation(g, u, act)
    ref = R.gated_activation(g, u, act, 4.0, 25.0)
    assert ((h - ref).abs() <= 2.0 ** -20 * ref.abs() + 1e-30).all()


# ------------------------------------------------------------------------------------------------
# dense kernels: the path this machine picks, and every kernel shape forced by a config
# ------------------------------------------------------------------------------------------------
EDGE_SHAPES = [(7, 72, 64), (33, 72, 128), (5, 72, 160), (3, 24, 608), (1, 40, 96), (2, 24, 224)]
FORCED = {  # (path, config): GEMV FMA with split-K and K tails, split-K MMA, MMA tiles
    "fma-m1-split3": (K.PATH_SPLITK, LC(1, 16, 64, 3, "fma")),
    "fma-m2-split2": (K.PATH_SPLITK, LC(2, 32, 64, 2, "fma")),
    "dot-split2": (K.PATH_SPLITK, LC(16, 32, 64, 2, "dot")),
    "mma": (None, LC(16, 64, 64, 1, "dot")),
}


def _mma_path():
    return K.PATH_INTERPRETER if INTERP else K.PATH_BF16_MMA


@needs_triton
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
@pytest.mark.parametrize("m,n,k", EDGE_SHAPES)
def test_dense_default_path(fmt, m, n, k):
    x, t = _acts(m, k, m), _quant(fmt, n, k, k)
    for out_dtype in (torch.float32, torch.bfloat16):
        y = _gemm(fmt, x.to(DEV), _dev(t), out_dtype=out_dtype)
        assert torch.all(y[0].float() == 0)  # zero activation row
        _check_gemm(fmt, x, t, y, out_dtype, f"{fmt} {m}x{n}x{k}")


@needs_triton
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
@pytest.mark.parametrize("variant", sorted(FORCED))
def test_dense_forced_configs(fmt, variant):
    path, cfg = FORCED[variant]
    for m, n, k in [(cfg.block_m, 72, 160), (3, 40, 608)]:
        x, t = _acts(m, k, m), _quant(fmt, n, k, k + 1)
        y = _gemm(fmt, x.to(DEV), _dev(t), out_dtype=torch.float32, path=path or _mma_path(), config=cfg)
        _check_gemm(fmt, x, t, y, torch.float32, f"{fmt} {variant} {m}x{n}x{k}")


@needs_triton
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
@pytest.mark.parametrize("proj,m", [("gate_up", 1), ("gate_up", 16), ("down", 2), ("down", 5)])
def test_dense_real_shapes(fmt, proj, m):
    """The published expert shapes (N = 4608; K = 4608 for gate_up, reduced to 1152 in the
    interpreter; down's K = 2304 in full) at decode batch sizes, on the path select_path picks
    (split-K: FMA for m <= 2, 16-row MMA above)."""
    n, k = SHAPES[proj]
    if INTERP and proj == "gate_up":
        k = k // 4
    assert K.select_path(DEV, m) == (K.PATH_SPLITK if not (GPU and _gpu_cap()[0] == 10) else K.PATH_SM100)
    x, t = _acts(m, k, 7 + m), C.random_encoded(fmt, None, n, k, seed=m)
    y = _gemm(fmt, x.to(DEV), _dev(t), out_dtype=torch.bfloat16, path=K.PATH_SPLITK)
    _check_gemm(fmt, x, t, y, torch.bfloat16, f"{fmt} {proj} m={m} {n}x{k}")


# ------------------------------------------------------------------------------------------------
# grouped (experts over tokens sorted by expert)
# ------------------------------------------------------------------------------------------------
COUNTS = [5, 0, 17, 11]  # an expert with zero tokens; 17 rows span two 16-row tiles


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
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
@pytest.mark.parametrize("exact,cfg", [(True, None), (False, None), (True, LC(2, 32, 64, 2, "fma")),
                                       (False, LC(16, 32, 64, 3, "dot"))],
                         ids=["exact", "upper-bound", "fma-split", "dot-split-upper-bound"])
def test_grouped(fmt, exact, cfg, monkeypatch):
    if not exact:
        monkeypatch.setattr(dg, "moe_tile_map", functools.partial(K.moe_tile_map, exact=False))
    n, k = 72, 160
    offs = torch.tensor([0] + COUNTS).cumsum(0)
    x = _acts(int(offs[-1]), k, 3, zero_rows=(0, 6))
    st = _stack([_quant(fmt, n, k, 10 + e, outlier=(e == 2)) for e in range(len(COUNTS))])
    args = [st[s] for s in FORMATS[fmt].kernel_inputs]
    grouped = K.nvfp4_grouped_gemm if fmt == "nvfp4" else K.mxfp8_grouped_gemm
    ref = (R.nvfp4_grouped_gemm if fmt == "nvfp4" else R.mxfp8_grouped_gemm)(x, *args, offs)
    y = grouped(x.to(DEV), *(a.to(DEV) for a in args), offs.to(DEV), out_dtype=torch.bfloat16,
                path=K.PATH_SPLITK if cfg else _mma_path(), config=cfg)
    tol = torch.cat([C.gemm_bound(x[offs[e]:offs[e + 1]], C.dequantized(fmt, st, e), torch.bfloat16,
                                  ref[offs[e]:offs[e + 1]], GPU) for e in range(len(COUNTS))])
    _check(y, ref, tol, f"{fmt} grouped")


# ------------------------------------------------------------------------------------------------
# the fused MoE layer
# ------------------------------------------------------------------------------------------------
def test_moe_align_block_size():
    """vLLM's documented example (moe_align_block_size.py docstring), and the no-sync form."""
    ids = torch.tensor([[2, 3, 4], [1, 2, 4], [1, 3, 4], [1, 2, 3]])
    s, e, n = K.moe_align_block_size(ids, 4, 5)
    assert s.tolist() == [3, 6, 9, 12, 0, 4, 10, 12, 1, 7, 11, 12, 2, 5, 8, 12]
    assert e.tolist() == [1, 2, 3, 4] and n.tolist() == [16]
    s2, e2, n2 = K.moe_align_block_size(ids, 4, 5, exact=False)  # cdiv(12, 4) + min(5, 12) blocks
    assert e2.numel() == 8 and e2[:4].tolist() == e.tolist() and (e2[4:] == -1).all()
    assert s2[:16].tolist() == s.tolist() and (s2[16:] == 12).all() and n2.tolist() == [16]
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(384, generator=g)[:8] for _ in range(37)])
    s, e, _ = K.moe_align_block_size(ids, 16, 384)
    flat = ids.reshape(-1)
    real = s[s < flat.numel()].long()
    assert sorted(real.tolist()) == list(range(flat.numel()))           # every pair once
    assert torch.equal(flat[real], e.repeat_interleave(16)[s < flat.numel()].long())  # in its expert's block


def _check_moe(fmt, x, ids, w, gate_up, down, out_dtype, label, **kw):
    y = K.fused_moe(fmt, x.to(DEV), ids.to(DEV), w.to(DEV), _dev(gate_up), _dev(down), out_dtype=out_dtype, **kw)
    act = {k: v for k, v in kw.items() if k == "activation"}
    ref = R.fused_moe(fmt, x, ids, w, gate_up, down, **act)
    tol = C.moe_bound(fmt, x, ids, w, gate_up, down, out_dtype, gpu=GPU, **act)
    assert y.shape == ref.shape and y.dtype == out_dtype
    return _check(y, ref, tol, label)


@needs_triton
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
@pytest.mark.parametrize("tokens,configs,act", [
    (1, None, "softcapped-swiglu"), (5, None, "silu"),
    (3, (LC(2, 128, 128, 2, "fma"), LC(1, 128, 64, 2, "fma")), "softcapped-swiglu"),
    (6, (LC(16, 64, 128, 2, "dot"), LC(16, 64, 64, 1, "dot")), "softcapped-swiglu"),
], ids=["t1-default", "t5-silu", "fma-split", "dot-split"])
def test_fused_moe(fmt, tokens, configs, act):
    x, ids, w, gu, dn = C.random_moe_layer(fmt, 12, 256, 96, tokens, tokens)
    _check_moe(fmt, x, ids, w, gu, dn, torch.float32, f"{fmt} fused t={tokens}", configs=configs, activation=act,
               path=K.PATH_SPLITK if configs else None)


@needs_triton
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
@pytest.mark.parametrize("tokens", [1, 3])
def test_fused_moe_real_shapes(fmt, tokens):
    """384 experts, top-8, hidden 4608; the intermediate size reduced to 64 in the interpreter
    (the GPU test below runs 2304)."""
    inter = 64 if INTERP else INTER
    x, ids, w, gu, dn = C.random_moe_layer(fmt, 384, HIDDEN, inter, tokens, 40 + tokens)
    _check_moe(fmt, x, ids, w, gu, dn, torch.bfloat16, f"{fmt} fused 384x{HIDDEN}x{inter} t={tokens}")


def test_fused_moe_reference_is_transformers():
    """The reference's layer equals transformers' Inkling2Experts.forward on the dequantized
    weights, up to that module's own bf16 roundings of gate_up and of the down output."""
    mod = pytest.importorskip("transformers.models.inkling2.modeling_inkling2")
    cfg = type("Cfg", (), dict(n_routed_experts=6, hidden_size=64, moe_intermediate_size=32, mlp_gate_softcap=4.0,
                               mlp_up_softcap=25.0, _experts_implementation="eager"))()
    x, ids, w, gu, dn = C.random_moe_layer("mxfp8", 6, 64, 32, 5, 3, top_k=2)
    experts = mod.Inkling2Experts(cfg)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.stack([C.dequantized("mxfp8", gu, e) for e in range(6)]))
        experts.down_proj.copy_(torch.stack([C.dequantized("mxfp8", dn, e) for e in range(6)]))
        hf = experts.to(torch.bfloat16).forward(x, ids, w).float()
    ref = R.fused_moe("mxfp8", x, ids, w, gu, dn)
    assert ((hf - ref).norm() / ref.norm()).item() < 2e-2


# ------------------------------------------------------------------------------------------------
# the sm100 dot_scaled kernels, emulated in the interpreter
# ------------------------------------------------------------------------------------------------
@pytest.fixture
def e4m3_dot_scaled_scales(monkeypatch):
    """The interpreter decodes every dot_scaled scale as e8m0 (exponent byte); tcgen05 decodes
    NVFP4's float8_e4m3fn scales as e4m3. Teach the interpreter the hardware's rule."""
    import numpy as np
    import triton
    import triton.runtime.interpreter as interp

    orig = getattr(interp, "_dot_scaled_scale_to_f32", None)
    if orig is None:
        pytest.skip("this Triton's interpreter has no _dot_scaled_scale_to_f32 to teach e4m3 scales")

    def decode(scale_handle, compute_type):
        if scale_handle.dtype == triton.language.float8e4nv:
            raw = np.ascontiguousarray(scale_handle.data).view(np.uint8).copy()
            return torch.from_numpy(raw).view(torch.float8_e4m3fn).float().numpy()
        return orig(scale_handle, compute_type)

    monkeypatch.setattr(interp, "_dot_scaled_scale_to_f32", decode)


@needs_interp
@pytest.mark.parametrize("m,n,k", [(7, 72, 64), (33, 72, 160)])
def test_nvfp4_w4a4_dot_scaled_emulated(m, n, k, e4m3_dot_scaled_scales):
    x, t = _acts(m, k, m), _quant("nvfp4", n, k, k)
    args = (t["weight"], t["weight_scale"], t["weight_scale_2"])
    y = K.nvfp4_dequant_gemm(x, *args, out_dtype=torch.float32, path=K.PATH_SM100)
    ref = R.nvfp4_w4a4_gemm(x, *args)
    xq = R.fake_quant_nvfp4_activations(x)
    _check(y, ref, C.gemm_bound(xq, R.dequantize_nvfp4(*args), torch.float32, ref), "w4a4")
    y16 = R.nvfp4_gemm(x, *args)  # the on-the-fly activation quantization error
    assert ((y - y16).norm() / y16.norm()).item() < 0.15


def test_activation_scale_is_the_formats_rule():
    """The kernel's per-tensor NVFP4 activation scale equals the weight_scale_2 the formats
    derive from the same amax, so kernel and oracle quantize x alike."""
    x = _acts(7, 64, 1)
    for input_scale in (None, torch.tensor(0.0123)):
        amax = R.nvfp4_activation_amax(x, input_scale)
        t = FORMATS["nvfp4"].quantize(x, global_amax=amax)
        assert torch.equal(R.nvfp4_activation_scale(x, input_scale), t["weight_scale_2"])


@needs_interp
def test_nvfp4_w4a4_static_input_scale_emulated(e4m3_dot_scaled_scales):
    m, n, k = 9, 40, 64
    x, t = _acts(m, k, 2), _quant("nvfp4", n, k, 5)
    s_in = (x.float().abs().amax() / (6 * 448) / 4).reshape(())
    args = (t["weight"], t["weight_scale"], t["weight_scale_2"])
    y = K.nvfp4_dequant_gemm(x, *args, input_scale=s_in, out_dtype=torch.float32, path=K.PATH_SM100)
    ref = R.nvfp4_w4a4_gemm(x, *args, input_scale=s_in)
    xq = R.fake_quant_nvfp4_activations(x, s_in)
    _check(y, ref, C.gemm_bound(xq, R.dequantize_nvfp4(*args), torch.float32, ref), "w4a4 static")
    z = K.nvfp4_dequant_gemm(torch.zeros_like(x), *args, out_dtype=torch.float32, path=K.PATH_SM100)
    assert torch.equal(z, torch.zeros_like(z))


@needs_interp
@pytest.mark.parametrize("m,n,k", [(7, 72, 64), (33, 72, 160)])
def test_mxfp8_w8a8_dot_scaled_emulated(m, n, k):
    x, t = _acts(m, k, m), _quant("mxfp8", n, k, k)
    x[2, :32] = (torch.linspace(-1.0, 0.9, 32) * 1e-36).to(torch.bfloat16)  # amax/448: fp32 subnormal
    y = K.mxfp8_dequant_gemm(x, t["weight"], t["weight_scale"], out_dtype=torch.float32, path=K.PATH_SM100)
    ref = R.mxfp8_w8a8_gemm(x, t["weight"], t["weight_scale"])
    xq = R.fake_quant_mxfp8_activations(x)
    _check(y, ref, C.gemm_bound(xq, R.dequantize_mxfp8(t["weight"], t["weight_scale"]), torch.float32, ref), "w8a8")
    y8 = R.mxfp8_gemm(x, t["weight"], t["weight_scale"])
    assert ((y - y8).norm() / y8.norm()).item() < 0.05


@needs_interp
def test_grouped_dot_scaled_emulated(e4m3_dot_scaled_scales):
    n, k = 72, 64
    offs = torch.tensor([0] + COUNTS).cumsum(0)
    x = _acts(int(offs[-1]), k, 5, zero_rows=(0, 6))
    for fmt in ("nvfp4", "mxfp8"):
        st = _stack([_quant(fmt, n, k, 30 + e) for e in range(len(COUNTS))])
        args = [st[s] for s in FORMATS[fmt].kernel_inputs]
        grouped = K.nvfp4_grouped_gemm if fmt == "nvfp4" else K.mxfp8_grouped_gemm
        y = grouped(x, *args, offs, out_dtype=torch.float32, path=K.PATH_SM100)
        ref = (R.nvfp4_w4a4_grouped_gemm if fmt == "nvfp4" else R.mxfp8_w8a8_grouped_gemm)(x, *args, offs)
        xq = R.fake_quant_nvfp4_activations(x) if fmt == "nvfp4" else R.fake_quant_mxfp8_activations(x)
        tol = torch.cat([C.gemm_bound(xq[offs[e]:offs[e + 1]], C.dequantized(fmt, st, e), torch.float32, None)
                         for e in range(len(COUNTS))])
        _check(y, ref, tol, f"{fmt} dot_scaled grouped")


# ------------------------------------------------------------------------------------------------
# paths, launch configurations, fallback
# ------------------------------------------------------------------------------------------------
def test_path_table():
    assert K.path_for((10, 0), False) == "sm100-dot-scaled"
    assert K.path_for((10, 3), False, 1) == "sm100-dot-scaled"   # one numerics at every m
    assert K.path_for((9, 0), False) == "dequant-bf16-mma"
    assert K.path_for((9, 0), False, 16) == "dequant-splitk" == K.path_for((8, 0), False, 1)
    assert K.path_for((9, 0), False, 17) == "dequant-bf16-mma"
    assert K.path_for((12, 0), False) == "dequant-bf16-mma"
    assert K.path_for((7, 5), False, 1) == "torch-reference" == K.path_for(None, False)
    for cap in [None, (8, 0), (9, 0), (10, 0)]:
        assert K.path_for(cap, True) == "interpreter-fp32" and K.path_for(cap, True, 4) == "dequant-splitk"


def test_select_path_this_machine():
    assert BACKEND in ("triton-interpreter", "triton-gpu", "torch-reference") and K.backend_note()
    if INTERP:
        assert K.select_path("cpu") == K.select_path(torch.device("cpu")) == "interpreter-fp32"
        assert K.select_path("cpu", 1) == "dequant-splitk"
    elif GPU:
        assert K.select_path("cuda") == K.path_for(_gpu_cap(), False)
    else:
        assert K.select_path("cpu") == "torch-reference"


def test_select_path_on_gpus(monkeypatch):
    """Compiled (not interpreted) kernels on CUDA: paths by capability and m; the interpreter's
    fp32 workaround is never used there."""
    monkeypatch.setattr(P, "interpreted", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for cap, m, want in [((9, 0), None, "dequant-bf16-mma"), ((9, 0), 8, "dequant-splitk"),
                         ((8, 6), 300, "dequant-bf16-mma"), ((10, 0), 1, "sm100-dot-scaled")]:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None, c=cap: c)
        assert K.select_path("cuda:0", m) == want
        cfg = K.launch_config(want, "nvfp4", "dense", *SHAPES["gate_up"], m or 64, capability=cap)
        assert dg._inner_code(want, cfg) != 1  # never the interpreter's fp32 dot


def test_launch_table():
    """The committed table loads, holds every real shape and m bucket of the H200 (sm90) for
    both paths, formats and kinds, and is what launch_config returns there; elsewhere the
    heuristic fills in; every config is valid."""
    table = LT.load_table(str(LT.TABLE_FILE))
    for path, buckets in [(K.PATH_SPLITK, (1, 2, 4, 8, 16)), (K.PATH_BF16_MMA, (32, 64, 128, 256, 512))]:
        for fmt in ("nvfp4", "mxfp8"):
            for kind in LT.KINDS:
                for n, k in SHAPES.values():
                    for m in buckets:
                        key = LT.table_key((9, 0), path, fmt, kind, n, k, m)
                        assert key in table, key
                        assert K.launch_config(path, fmt, kind, n, k, m, capability=(9, 0)) == table[key]
    assert LT.m_bucket(3) == 4 and LT.m_bucket(17) == 32 and LT.m_bucket(10 ** 6) == 512
    for cap in [(8, 0), (10, 0), (12, 0)]:
        for m in (1, 7, 64, 1000):
            path = K.path_for(cap, False, m)
            cfg = K.launch_config(path, "mxfp8", "moe", 4608, 2304, m, capability=cap, sm_count=108)
            assert cfg.check(32) and (path != K.PATH_SPLITK or cfg.inner == ("fma" if m <= 2 else "dot"))
    with pytest.raises(ValueError, match="tl.dot needs"):
        LC(1, 16, 64, 1, "dot").check(16)


@needs_interp
def test_bf16_mma_refused_in_interpreter():
    x, t = _acts(7, 64, 0), _quant("nvfp4", 72, 64, 0)
    with pytest.raises(ValueError, match="11584"):
        _gemm("nvfp4", x, t, path=K.PATH_BF16_MMA)


def test_reference_fallback_without_triton(monkeypatch):
    monkeypatch.setattr(P, "interpreted", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    P.warn_fallback.cache_clear()
    assert K.backend() == "torch-reference" and "falling back to the torch reference" in K.backend_note()
    assert K.select_path("cpu") == "torch-reference"
    x, t = _acts(7, 64, 0), _quant("nvfp4", 72, 64, 0)
    with pytest.warns(RuntimeWarning, match="torch reference"):
        y = _gemm("nvfp4", x, t, out_dtype=torch.float32)
    assert torch.equal(y, R.nvfp4_gemm(x, t["weight"], t["weight_scale"], t["weight_scale_2"]))
    t8 = _quant("mxfp8", 72, 64, 0)
    y8 = _gemm("mxfp8", x, t8)
    assert y8.dtype == torch.bfloat16 and torch.equal(y8, R.mxfp8_gemm(x, t8["weight"], t8["weight_scale"]).bfloat16())
    xm, ids, w, gu, dn = C.random_moe_layer("nvfp4", 6, 64, 32, 3, 0, top_k=2)
    assert torch.equal(K.fused_moe("nvfp4", xm, ids, w, gu, dn, out_dtype=torch.float32),
                       R.fused_moe("nvfp4", xm, ids, w, gu, dn))
    P.warn_fallback.cache_clear()


def _ptxas_available() -> bool:
    try:
        import triton as _t
    except Exception:
        return False
    return (Path(_t.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").is_file()


@pytest.mark.skipif(not _ptxas_available(), reason="this triton wheel ships no ptxas to compile for GPUs with")
def test_kernels_compile_for_hopper():
    """The GPU kernels compile for sm90 (Triton's NVIDIA backend and the wheel's ptxas, no GPU
    needed), and the decode kernels' packed weights load 16 bytes at a time."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1] / "kernels"), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-m", "inkling_kernels.compile_check", "--arch", "90", "--quick"],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "all compiled" in r.stdout


# ------------------------------------------------------------------------------------------------
# real GPUs, full size (skip with a reason elsewhere)
# ------------------------------------------------------------------------------------------------
@needs_gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
@pytest.mark.parametrize("proj", ["gate_up", "down"])
def test_gpu_real_shapes(fmt, proj):
    n, k = SHAPES[proj]
    t = C.random_encoded(fmt, None, n, k, seed=11)
    for m in (1, 2, 4, 16, 64, 256):
        x = _acts(m, k, m)
        for path in (None, K.PATH_BF16_MMA if _gpu_cap()[0] != 10 else K.PATH_SM100):
            if path == K.PATH_SM100:
                continue  # test_sm100_dot_scaled_native
            y = _gemm(fmt, x.cuda(), _dev(t), path=path)
            _check_gemm(fmt, x, t, y, torch.bfloat16, f"gpu {fmt} {proj} m={m} path={path}")


@needs_gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
@pytest.mark.parametrize("tokens", [1, 16, 64])
def test_gpu_fused_moe_real_shapes(fmt, tokens):
    x, ids, w, gu, dn = C.random_moe_layer(fmt, 384, HIDDEN, INTER, tokens, 90 + tokens)
    _check_moe(fmt, x, ids, w, gu, dn, torch.bfloat16, f"gpu fused {fmt} t={tokens}")


@pytest.mark.skipif(not (GPU and _gpu_cap()[0] == 10),
                    reason="needs an sm100 GPU (compute capability 10.x) for native tl.dot_scaled; none here")
def test_sm100_dot_scaled_native():
    m, (n, k) = 33, SHAPES["gate_up"]
    x = _acts(m, k, 8)
    t, t8 = _quant("nvfp4", n, k, 8), _quant("mxfp8", n, k, 8)
    assert K.select_path("cuda") == K.PATH_SM100
    args = (t["weight"], t["weight_scale"], t["weight_scale_2"])
    ref = R.nvfp4_w4a4_gemm(x, *args)
    y = K.nvfp4_dequant_gemm(x.cuda(), *(a.cuda() for a in args), out_dtype=torch.float32)
    bound = C.gemm_bound(R.fake_quant_nvfp4_activations(x), R.dequantize_nvfp4(*args), torch.float32, ref, gpu=True)
    _check(y, ref, bound, "sm100 w4a4")
    ref8 = R.mxfp8_w8a8_gemm(x, t8["weight"], t8["weight_scale"])
    y8 = K.mxfp8_dequant_gemm(x.cuda(), t8["weight"].cuda(), t8["weight_scale"].cuda(), out_dtype=torch.float32)
    w8 = R.dequantize_mxfp8(t8["weight"], t8["weight_scale"])
    _check(y8, ref8, C.gemm_bound(R.fake_quant_mxfp8_activations(x), w8, torch.float32, ref8, gpu=True), "sm100 w8a8")
