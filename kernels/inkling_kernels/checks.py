"""What the tests and tools/bench_kernels.py share: random but valid encoded expert weights (any
size, any device, without quantizing a BF16 tensor first) and the documented error bounds
(docs/kernels.md, "Error bounds") as elementwise tolerances.

With u = 2^-24 (fp32 unit roundoff) and A = |x| @ |W|^T (exact, fp64): kernel and reference
compute the same exact products and differ in fp32 summation order and in where per-tensor
factors are applied, so |y_kernel - y_ref| <= (2K + 8) * u * A (doubled on GPUs, whose MMA
accumulation order is not specified); a bf16 output adds 2^-8 * |y| (one rounding).
"""
from __future__ import annotations

import torch

from . import reference as _ref
from .triton_ops import ACTIVATIONS, tl, triton

U32 = 2.0 ** -24     # fp32 unit roundoff
U_BF16 = 2.0 ** -8   # bf16 unit roundoff (8 significant bits, round to nearest even)
ULP_BF16 = 2.0 ** -7  # bf16 spacing relative to the value (upper bound)


def random_encoded(fmt: str, experts: int | None, n: int, k: int, device="cpu", seed: int = 0) -> dict:
    """Valid checkpoint tensors by suffix, filled at random on `device`: every e2m1 code / finite
    e4m3 value (NaN codes replaced by 0), NVFP4 block scales in [0.5, 2.5) as e4m3 and
    weight_scale_2 around 1e-3, MXFP8 e8m0 exponents 118..123. experts None: one [n, k] matrix.
    Stacks of more than 8 experts repeat 8 experts' weight bytes (cheap at 384 experts) under
    scales drawn for every expert, so that each expert still computes something different."""
    g = torch.Generator(device=device).manual_seed(seed)
    lead = (experts,) if experts else ()
    uniq = (min(experts, 8),) if experts else ()

    def tiled(t):
        return t.repeat(-(-experts // uniq[0]), *([1] * (t.dim() - 1)))[:experts] if experts else t

    def randint(lo, hi, shape):
        return torch.randint(lo, hi, shape, dtype=torch.uint8, generator=g, device=device)

    if fmt == "nvfp4":
        w = tiled(randint(0, 256, (*uniq, n, k // 2)))
        s = (torch.rand(*lead, n, k // 16, generator=g, device=device) * 2 + 0.5).to(torch.float8_e4m3fn)
        s2 = 1e-3 * (1 + torch.rand(lead, generator=g, device=device))
        return {"weight": w, "weight_scale": s, "weight_scale_2": s2}
    b = randint(0, 256, (*uniq, n, k))
    b = tiled(torch.where((b & 0x7F) == 0x7F, torch.zeros_like(b), b))  # no NaN codes
    return {"weight": b.view(torch.float8_e4m3fn), "weight_scale": randint(118, 124, (*lead, n, k // 32))}


def dequantized(fmt: str, tensors: dict, expert: int | None = None) -> torch.Tensor:
    """fp32 W [n, k] (of one expert of a stack) through the reference's dequantization."""
    if expert is not None:
        tensors = {s: (t.reshape(-1)[expert] if s == "weight_scale_2" else t[expert]) for s, t in tensors.items()}
    if fmt == "nvfp4":
        return _ref.dequantize_nvfp4(tensors["weight"], tensors["weight_scale"], tensors["weight_scale_2"])
    return _ref.dequantize_mxfp8(tensors["weight"], tensors["weight_scale"])


def gemm_bound(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype, ref: torch.Tensor | None,
               gpu: bool = False) -> torch.Tensor:
    """Elementwise tolerance of y = x @ w^T (fp64): (2K+8)*u*A, doubled on GPUs, plus the bf16
    output rounding 2^-8 * (|ref| + that) for a bf16 output."""
    a = x.double().abs() @ w.double().abs().T
    tol = (2 * w.shape[-1] + 8) * U32 * a * (2.0 if gpu else 1.0)
    if out_dtype == torch.bfloat16:
        tol = tol + U_BF16 * (ref.double().abs() + tol)
    return tol


def within(y: torch.Tensor, ref: torch.Tensor, tol: torch.Tensor) -> tuple[bool, float, float]:
    """(every element within tol and finite, max abs error, max error / tol)."""
    y, ref, tol = y.double().cpu(), ref.double().cpu(), tol.double().cpu()
    err = (y - ref).abs()
    ok = bool(torch.isfinite(y).all()) and bool((err <= tol).all())
    return ok, float(err.max()) if err.numel() else 0.0, float((err / tol.clamp_min(1e-300)).max()) if err.numel() else 0.0


def _activation_slopes(g: torch.Tensor, u: torch.Tensor, activation: str, gate_cap: float, up_cap: float):
    """Upper bounds of |d act / d gate| and |d act / d up| at (g, u), elementwise."""
    sig = torch.sigmoid(g)
    if activation == "silu":
        return (sig * (1 + g.abs())) * u.abs(), (g * sig).abs()
    scg, scu = _ref.softcap(g, gate_cap), _ref.softcap(u, up_cap)
    return (sig + scg.abs() / 4) * scu.abs(), (scg * sig).abs()


def moe_bound(fmt: str, x, topk_ids, topk_weights, gate_up: dict, down: dict, out_dtype, *,
              activation="softcapped-swiglu", gate_cap=4.0, up_cap=25.0, gpu=False) -> torch.Tensor:
    """Elementwise tolerance [T, H] of the fused MoE against reference.fused_moe (fp64).

    Per (t, k) with expert e: gate / up differ by at most dg = (2H+8)u*A1 (A1 = |x| @ |W13_e|^T);
    h before rounding by at most dh = Lg*dg_gate + Lu*dg_up + 2^-20|h| (the slopes of the
    activation and its transcendental functions' error); after rounding to bf16 by at most
    1.01*dh + 2^-7|h_ref| (a rounding that falls the other way is one bf16 ulp). y_k then
    differs by (2I+8)u*A2 + |dH| @ |W2_e|^T, and the output by sum_k |w_k| * that, plus the
    combine's roundings (2*top_k*u*sum|w_k y_k|) and a bf16 output rounding."""
    g2 = 2.0 if gpu else 1.0
    T, top_k = topk_ids.shape
    dev = x.device
    xf = x.double()
    tol = torch.zeros(T, down["weight"].shape[-2], dtype=torch.float64, device=dev)
    mag = torch.zeros_like(tol)
    for e in torch.unique(topk_ids).tolist():
        t_idx, k_idx = torch.where(topk_ids.to(dev) == e)
        w13, w2 = dequantized(fmt, gate_up, e).double().to(dev), dequantized(fmt, down, e).double().to(dev)
        inter = w13.shape[0] // 2
        gu = (xf[t_idx] @ w13.T).float()
        a1 = xf[t_idx].abs() @ w13.abs().T
        dg = (2 * w13.shape[1] + 8) * U32 * a1 * g2
        lg, lu = _activation_slopes(gu[:, :inter], gu[:, inter:], activation, gate_cap, up_cap)
        h = _ref.gated_activation(gu[:, :inter], gu[:, inter:], activation, gate_cap, up_cap).double()
        dh = lg.double() * dg[:, :inter] + lu.double() * dg[:, inter:] + 2.0 ** -20 * h.abs()
        dH = 1.01 * dh + ULP_BF16 * h.to(torch.bfloat16).double().abs()
        hb = h.to(torch.bfloat16).double()
        a2 = hb.abs() @ w2.abs().T
        ek = (2 * inter + 8) * U32 * a2 * g2 + dH @ w2.abs().T
        wk = topk_weights.double().to(dev)[t_idx, k_idx].abs()[:, None]
        tol.index_add_(0, t_idx, wk * ek)
        mag.index_add_(0, t_idx, wk * (hb @ w2.T).abs())
    tol = tol + 2 * top_k * U32 * mag
    if out_dtype == torch.bfloat16:
        tol = tol + U_BF16 * (mag + tol)
    return tol


def random_moe_layer(fmt: str, experts: int, hidden: int, inter: int, tokens: int, seed: int, top_k: int = 8):
    """(x [T, H] bf16, topk_ids [T, top_k], topk_weights [T, top_k] (softmax), gate_up tensors
    [E, 2I, H], down tensors [E, H, I]) at random: distinct experts per token."""
    g = torch.Generator().manual_seed(seed)
    gate_up = random_encoded(fmt, experts, 2 * inter, hidden, seed=seed)
    down = random_encoded(fmt, experts, hidden, inter, seed=seed + 1)
    if fmt == "nvfp4":  # gate / up of a few units: where the softcaps act
        gate_up["weight_scale_2"] = gate_up["weight_scale_2"] * 2
    x = (torch.randn(tokens, hidden, generator=g) * 0.5).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    w = torch.softmax(torch.randn(tokens, top_k, generator=g), -1)
    return x, ids, w, gate_up, down


# --- probes: the jitted building blocks (triton_ops) run on plain tensors, for the tests ------------
if triton is not None:
    from . import triton_ops as _ops

    @triton.jit
    def _probe_round_kernel(x_ptr, y_ptr, n, B: tl.constexpr):
        o = tl.program_id(0) * B + tl.arange(0, B)
        msk = o < n
        v = tl.load(x_ptr + o, mask=msk)
        tl.store(y_ptr + o, _ops._round_e4m3(v).to(tl.float8e4nv).to(tl.float32), mask=msk)

    @triton.jit
    def _probe_decode_kernel(b_ptr, y_ptr, B: tl.constexpr):
        o = tl.arange(0, B)
        tl.store(y_ptr + o, _ops._e4m3_decode(tl.load(b_ptr + o)))

    @triton.jit
    def _probe_words_kernel(q_ptr, y_ptr, ROWS: tl.constexpr, WORDS: tl.constexpr, EPW: tl.constexpr):
        r = tl.arange(0, ROWS)[:, None]
        q = tl.load(q_ptr + r * WORDS + tl.arange(0, WORDS)[None, :])
        if EPW == 8:
            v = _ops._e2m1_words_to_f32(q, ROWS, WORDS * EPW)
        else:
            v = _ops._e4m3_words_to_f32(q, ROWS, WORDS * EPW)
        tl.store(y_ptr + r * (WORDS * EPW) + tl.arange(0, WORDS * EPW)[None, :], v)

    @triton.jit
    def _probe_act_kernel(g_ptr, u_ptr, h_ptr, B: tl.constexpr, ACT: tl.constexpr):
        o = tl.arange(0, B)
        tl.store(h_ptr + o, _ops._gated_activation(tl.load(g_ptr + o), tl.load(u_ptr + o), ACT, 4.0, 25.0))


def probe_round_e4m3(v: torch.Tensor) -> torch.Tensor:
    """fp32 -> the kernels' in-register e4m3 rounding (then the fp8 cast) -> fp32."""
    out = torch.empty_like(v)
    _probe_round_kernel[(triton.cdiv(v.numel(), 8192),)](v, out, v.numel(), B=8192)
    return out


def probe_e4m3_decode(b: torch.Tensor) -> torch.Tensor:
    """uint8 [2^j] -> the kernels' integer e4m3 decode."""
    out = torch.empty(b.numel())
    _probe_decode_kernel[(1,)](b, out, B=b.numel())
    return out


def probe_words(q: torch.Tensor, fmt: str) -> torch.Tensor:
    """int32 words [rows, words] -> the kernels' word decoder (e2m1 * 2^-14 / e4m3 * 2^-8)."""
    epw = 8 if fmt == "nvfp4" else 4
    out = torch.empty(q.shape[0], q.shape[1] * epw)
    _probe_words_kernel[(1,)](q, out, ROWS=q.shape[0], WORDS=q.shape[1], EPW=epw)
    return out


def probe_activation(g: torch.Tensor, u: torch.Tensor, activation: str) -> torch.Tensor:
    """The MoE kernels' gated activation (caps 4 and 25) on fp32 vectors of 2^j elements."""
    h = torch.empty_like(g)
    _probe_act_kernel[(1,)](g, u, h, B=g.numel(), ACT=ACTIVATIONS[activation])
    return h
