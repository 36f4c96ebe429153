"""Plain-torch reference for the dequant GEMMs: the test oracle and the fallback when Triton
cannot run. Dequantization is written here in plain torch from the formats' definitions
(formats.py; ModelOpt's ``NVFP4QTensor.dequantize`` / ``MXFP8QTensor.dequantize``), apart from
inkling_quant.formats, which tests/test_kernels_formats.py holds it to bit for bit; the product
is ``x.float() @ W.T`` in fp32 and the result is fp32.

The ``*_w4a4`` / ``*_w8a8`` variants model the sm100 ``tl.dot_scaled`` path, which also quantizes
the activations on the fly: they fake-quantize x with the same format (ModelOpt's rules for a
bf16 tensor, quantize + dequantize, written here too) and then run the weight-only reference.
"""
from __future__ import annotations

import torch

from .errors import KernelError
from .formats import E2M1_MAGNITUDES, E2M1_MAX, E4M3_MAX, MXFP8, NVFP4, NVFP4_GLOBAL_DIV, NVFP4_MIN_AMAX, NVFP4_MIN_SCALE

#: the formats dequantize() takes: the kernels' two, and unquantized weights (verify's BF16
#: source, which inkling_quant names "passthrough")
UNQUANTIZED = "passthrough"


# --- dequantization --------------------------------------------------------------------------------
def _e2m1_pairs(device) -> torch.Tensor:
    """fp32 [256, 2]: the two e2m1 values of each packed byte, low nibble first; in a nibble
    bit 3 is the sign (code 8 is -0.0)."""
    mags = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=device)
    values = torch.cat((mags, -mags))
    byte = torch.arange(256, device=device)
    return torch.stack((values[byte & 0x0F], values[byte >> 4]), dim=-1)


def _e8m0_pow2(e8: torch.Tensor) -> torch.Tensor:
    """fp32 2^(E - 127) of uint8 e8m0 exponents, from the bits: E in the fp32 exponent field
    (E = 255 gives inf), E = 0 the subnormal 2^-127."""
    e = e8.to(torch.int32)
    bits = torch.where(e == 0, torch.full_like(e, 1 << 22), e << 23)
    return bits.view(torch.float32)


def dequantize_nvfp4(w_packed: torch.Tensor, w_scale: torch.Tensor, w_scale_2: torch.Tensor) -> torch.Tensor:
    """fp32 W [.., N, K] from weight uint8 [.., N, K/2] (element 2j in the low nibble),
    weight_scale e4m3 [.., N, K/16] and weight_scale_2 fp32 (one scalar, or one per leading
    index): ``e2m1 * (fp32(weight_scale) * weight_scale_2)`` per 16-block."""
    packed = w_packed if w_packed.dtype == torch.uint8 else w_packed.view(torch.uint8)
    sc = w_scale.view(torch.float8_e4m3fn) if w_scale.dtype == torch.uint8 else w_scale
    k, block = packed.shape[-1] * 2, NVFP4.scale_block
    if sc.shape[-1] * block != k or sc.shape[:-1] != packed.shape[:-1]:
        raise KernelError(f"nvfp4 dequantize: weight {tuple(packed.shape)} and weight_scale "
                          f"{tuple(sc.shape)} do not match")
    s2 = torch.as_tensor(w_scale_2).to(device=packed.device, dtype=torch.float32)
    s2 = s2.reshape(()) if s2.numel() == 1 else s2.reshape(*s2.shape, *([1] * (sc.dim() - s2.dim())))
    per_block = sc.to(torch.float32) * s2
    vals = _e2m1_pairs(packed.device)[packed.long()].view(*packed.shape[:-1], -1, block)
    return vals.mul_(per_block.unsqueeze(-1)).view(*packed.shape[:-1], k)


def dequantize_mxfp8(w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """fp32 W [.., N, K] from weight e4m3 [.., N, K] and weight_scale uint8 e8m0 [.., N, K/32]:
    ``fp32(weight) * 2^(weight_scale - 127)`` per 32-block."""
    q = w.view(torch.float8_e4m3fn) if w.dtype == torch.uint8 else w
    e8 = w_scale if w_scale.dtype == torch.uint8 else w_scale.view(torch.uint8)
    block = MXFP8.scale_block
    if e8.shape[-1] * block != q.shape[-1] or e8.shape[:-1] != q.shape[:-1]:
        raise KernelError(f"mxfp8 dequantize: weight {tuple(q.shape)} and weight_scale "
                          f"{tuple(e8.shape)} do not match")
    vals = q.to(torch.float32, copy=True).reshape(*q.shape[:-1], -1, block)  # mul_ below: never the caller's
    return vals.mul_(_e8m0_pow2(e8).unsqueeze(-1)).view(q.shape)


def dequantize(fmt: str, tensors) -> torch.Tensor:
    """fp32 W of one weight's tensors by suffix: "nvfp4" (weight, weight_scale, weight_scale_2),
    "mxfp8" (weight, weight_scale) or "passthrough" (weight, unquantized)."""
    if fmt == NVFP4.name:
        return dequantize_nvfp4(tensors["weight"], tensors["weight_scale"], tensors["weight_scale_2"])
    if fmt == MXFP8.name:
        return dequantize_mxfp8(tensors["weight"], tensors["weight_scale"])
    if fmt == UNQUANTIZED:
        return tensors["weight"].to(torch.float32)
    raise KernelError(f"the reference has no format {fmt!r} (nvfp4, mxfp8, {UNQUANTIZED})")


# --- dense -----------------------------------------------------------------------------------------
def matmul_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The reference's own definition: fp32 ``x @ W^T`` with W already dequantized."""
    return x.float() @ w.float().T


def nvfp4_gemm(x, w_packed, w_scale, w_scale_2) -> torch.Tensor:
    return matmul_ref(x, dequantize_nvfp4(w_packed, w_scale, w_scale_2))


def mxfp8_gemm(x, w, w_scale) -> torch.Tensor:
    return matmul_ref(x, dequantize_mxfp8(w, w_scale))


# --- grouped (per-expert loop) --------------------------------------------------------------------
def _offsets(expert_offsets: torch.Tensor) -> list[int]:
    return [int(v) for v in expert_offsets.detach().cpu().tolist()]


def nvfp4_grouped_gemm(x, w_packed, w_scale, w_scale_2, expert_offsets) -> torch.Tensor:
    """Loop over experts: rows offsets[e]:offsets[e+1] of x times expert e's weight."""
    offs = _offsets(expert_offsets)
    s2 = w_scale_2.reshape(-1)
    y = torch.zeros(x.shape[0], w_packed.shape[-2], dtype=torch.float32, device=x.device)
    for e in range(len(offs) - 1):
        if offs[e + 1] > offs[e]:
            y[offs[e]:offs[e + 1]] = nvfp4_gemm(x[offs[e]:offs[e + 1]], w_packed[e], w_scale[e], s2[e])
    return y


def mxfp8_grouped_gemm(x, w, w_scale, expert_offsets) -> torch.Tensor:
    offs = _offsets(expert_offsets)
    y = torch.zeros(x.shape[0], w.shape[-2], dtype=torch.float32, device=x.device)
    for e in range(len(offs) - 1):
        if offs[e + 1] > offs[e]:
            y[offs[e]:offs[e + 1]] = mxfp8_gemm(x[offs[e]:offs[e + 1]], w[e], w_scale[e])
    return y


# --- activation quantization (model of the sm100 path) -------------------------------------------
def nvfp4_activation_amax(x: torch.Tensor, input_scale=None) -> torch.Tensor:
    """The amax an NVFP4 activation scale is derived from (fp32 0-d): amax(x) (dynamic), or
    ``input_scale * 2688`` (e2m1 max x e4m3 max) for a static input_scale."""
    if input_scale is None:
        return x.detach().abs().amax().float()
    # the inverse of the input_scale rule (amax / 2688), kept on the device
    return torch.as_tensor(input_scale, dtype=torch.float32, device=x.device).reshape(()) * NVFP4_GLOBAL_DIV


def nvfp4_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """A per-tensor NVFP4 scale from an amax: fp32 amax / 2688 (ModelOpt's
    ``get_weights_scaling_factor_2``, its weight_scale_2)."""
    return amax.float() / NVFP4_GLOBAL_DIV


def nvfp4_activation_scale(x: torch.Tensor, input_scale=None) -> torch.Tensor:
    """Per-tensor NVFP4 activation scale the sm100 kernel uses, fp32 0-d: amax / 2688, the
    expression of the weight_scale_2 inkling_quant.formats' NVFP4 writes for that amax (a test
    checks they are bit-equal), 1.0 for an all-zero x. No host sync."""
    amax = nvfp4_activation_amax(x, input_scale)
    s = nvfp4_global_scale(amax)
    return torch.where(amax > 0, s, torch.ones_like(s))


def _nearest_e2m1(y: torch.Tensor) -> torch.Tensor:
    """fp32 y -> the nearest e2m1 value, ties to the even code, saturated at 6; a negative y
    keeps its sign (also when it rounds to 0: -0.0), +-0.0 gives +0.0 (ModelOpt's ``_cast_fp4``).
    Below 6 the distances to the two grid points around |y| are exact in fp32 (Sterbenz), so
    ties are found exactly."""
    grid = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=y.device)
    a = y.abs().clamp(max=E2M1_MAX).unsqueeze(-1)
    d = (a - grid).abs()
    best = d.min(dim=-1, keepdim=True).values
    tied = d == best
    even = tied & (torch.arange(grid.numel(), device=y.device) % 2 == 0)
    idx = torch.where(even.any(-1), even.int().argmax(-1), tied.int().argmax(-1))
    mag = grid[idx]
    return torch.where(y < 0, -mag, mag)


def fake_quant_nvfp4_activations(x: torch.Tensor, input_scale=None) -> torch.Tensor:
    """x -> dequant(quant_nvfp4(x)) in fp32 by ModelOpt's NVFP4 rule, as inkling_quant.formats
    encodes it: per-16 blocks along K under one per-tensor scale s2 = amax / 2688 of
    ``nvfp4_activation_amax`` (dynamic amax(x) when input_scale is None); block scale
    ``e4m3(clamp(bmax / (6 * s2), 2^-9, 448))`` (1 for an all-zero block), each value the nearest
    e2m1 of ``x / (scale * s2)``, decoded as ``e2m1 * (scale * s2)``."""
    amax = nvfp4_activation_amax(x, input_scale)
    if not bool(amax >= NVFP4_MIN_AMAX):  # zero, or too small for any NVFP4 scale: the all-zero tensor
        return torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    block = NVFP4.scale_block
    s2 = nvfp4_global_scale(amax)
    blocks = x.to(torch.bfloat16).float().reshape(-1, block)
    bmax = blocks.abs().amax(dim=1)
    pbs = bmax / (E2M1_MAX * s2)
    pbs = torch.where(pbs == 0, torch.ones_like(pbs), pbs)
    scale = pbs.clamp(min=NVFP4_MIN_SCALE, max=E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32)
    per_block = (scale * s2).unsqueeze(-1)
    return (_nearest_e2m1(blocks / per_block) * per_block).reshape(x.shape)


def fake_quant_mxfp8_activations(x: torch.Tensor) -> torch.Tensor:
    """x -> dequant(quant_mxfp8(x)) in fp32 by ModelOpt's MXFP8 rule, as inkling_quant.formats
    encodes it: per 32-block E = clamp(ceil(log2(bmax / 448)), -127, 127) + 127 (0 for an
    all-zero block), values e4m3(clamp(x * 2^(127 - E), +-448)), decoded times 2^(E - 127)."""
    block = MXFP8.scale_block
    blocks = x.to(torch.bfloat16).float().reshape(-1, block)
    descale = blocks.abs().amax(dim=1) / E4M3_MAX
    log2 = torch.where(descale > 0, torch.log2(descale), torch.full_like(descale, -127.0))
    e8 = (torch.clamp(torch.ceil(log2), min=-127, max=127) + 127).to(torch.uint8)
    inv = _e8m0_pow2(254 - e8.to(torch.int32))  # 2^(127 - E): E' = 254 - E, E in [0, 254]
    q = (blocks * inv.unsqueeze(-1)).clamp(min=-E4M3_MAX, max=E4M3_MAX).to(torch.float8_e4m3fn)
    return (q.to(torch.float32) * _e8m0_pow2(e8).unsqueeze(-1)).reshape(x.shape)


def nvfp4_w4a4_gemm(x, w_packed, w_scale, w_scale_2, input_scale=None) -> torch.Tensor:
    return nvfp4_gemm(fake_quant_nvfp4_activations(x, input_scale), w_packed, w_scale, w_scale_2)


def mxfp8_w8a8_gemm(x, w, w_scale) -> torch.Tensor:
    return mxfp8_gemm(fake_quant_mxfp8_activations(x), w, w_scale)


def nvfp4_w4a4_grouped_gemm(x, w_packed, w_scale, w_scale_2, expert_offsets, input_scale=None):
    """One activation scale over the whole launch (all experts), as the kernel does."""
    return nvfp4_grouped_gemm(fake_quant_nvfp4_activations(x, input_scale), w_packed, w_scale,
                              w_scale_2, expert_offsets)


def mxfp8_w8a8_grouped_gemm(x, w, w_scale, expert_offsets):
    return mxfp8_grouped_gemm(fake_quant_mxfp8_activations(x), w, w_scale, expert_offsets)


# --- the fused MoE layer --------------------------------------------------------------------------
def softcap(z: torch.Tensor, cap: float) -> torch.Tensor:
    """tanh(z / cap) * cap: transformers' Inkling2Softcap (models/inkling2/modeling_inkling2.py:776-783)."""
    return torch.tanh(z / cap) * cap


def gated_activation(gate: torch.Tensor, up: torch.Tensor, activation: str = "softcapped-swiglu",
                     gate_softcap: float = 4.0, up_softcap: float = 25.0) -> torch.Tensor:
    """h in fp32 from fp32 gate / up. "softcapped-swiglu": Inkling2SoftcappedSwiGLU
    (modeling_inkling2.py:794-797), softcap(gate, 4) * sigmoid(gate) * softcap(up, 25), the
    sigmoid on the raw gate; "silu": silu(gate) * up."""
    gate, up = gate.float(), up.float()
    if activation == "silu":
        return torch.nn.functional.silu(gate) * up
    if activation == "softcapped-swiglu":
        return softcap(gate, gate_softcap) * torch.sigmoid(gate) * softcap(up, up_softcap)
    raise ValueError(f"unknown activation {activation!r}")


def _expert(fmt: str, tensors, e: int) -> torch.Tensor:
    """fp32 W [N, K] of expert e of stacked tensors (the format's suffixes)."""
    one = {k: (v.reshape(-1)[e] if k == "weight_scale_2" else v[e]) for k, v in tensors.items()}
    return dequantize(fmt, one)


def fused_moe(fmt: str, x, topk_ids, topk_weights, gate_up, down, *, activation: str = "softcapped-swiglu",
              gate_softcap: float = 4.0, up_softcap: float = 25.0) -> torch.Tensor:
    """fp32 [T, H]: for each token t and slot k, e = topk_ids[t, k]: gate_up = x[t] @ W13_e^T
    (fp32; gate = its first half, up = the second, as chunk(2, dim=-1)), h = act(gate, up)
    rounded to bf16, y = h @ W2_e^T (fp32); out[t] = sum over k = 0, 1, ... in order of
    topk_weights[t, k] * y (fp32). Weights dequantized by ``dequantize``."""
    T, top_k = topk_ids.shape
    n_out = down["weight"].shape[-2]
    ys = torch.zeros(T, top_k, n_out, dtype=torch.float32, device=x.device)
    for e in torch.unique(topk_ids).tolist():
        t_idx, k_idx = torch.where(topk_ids == e)
        gu = matmul_ref(x[t_idx], _expert(fmt, gate_up, e))
        inter = gu.shape[-1] // 2
        h = gated_activation(gu[:, :inter], gu[:, inter:], activation, gate_softcap, up_softcap).to(torch.bfloat16)
        ys[t_idx, k_idx] = matmul_ref(h, _expert(fmt, down, e))
    out = torch.zeros(T, n_out, dtype=torch.float32, device=x.device)
    w = topk_weights.float()
    for k in range(top_k):
        out += w[:, k, None] * ys[:, k]
    return out
