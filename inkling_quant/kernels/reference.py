"""Plain-torch reference for the dequant GEMMs: the test oracle and the fallback when Triton
cannot run. Dequantization is delegated to inkling_quant.formats (the single source of truth for
the bits); the product is ``x.float() @ W.T`` in fp32 and the result is fp32.

The ``*_w4a4`` / ``*_w8a8`` variants model the sm100 ``tl.dot_scaled`` path, which also quantizes
the activations on the fly: they fake-quantize x with the same format (quantize + dequantize via
inkling_quant.formats) and then run the weight-only reference.
"""
from __future__ import annotations

import torch

from ..formats import FORMATS
from ..formats.nvfp4 import GLOBAL_DIV, nvfp4_global_scale


def _fmt(name: str):
    return FORMATS[name]


# --- dequantization (formats) -------------------------------------------------------------------
def dequantize_nvfp4(w_packed: torch.Tensor, w_scale: torch.Tensor, w_scale_2: torch.Tensor) -> torch.Tensor:
    """fp32 W [.., N, K] from weight uint8 [.., N, K/2], weight_scale e4m3 [.., N, K/16] and
    weight_scale_2 fp32 (scalar)."""
    return _fmt("nvfp4").dequantize(
        {"weight": w_packed, "weight_scale": w_scale, "weight_scale_2": w_scale_2}, torch.float32)


def dequantize_mxfp8(w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """fp32 W [.., N, K] from weight e4m3 [.., N, K] and weight_scale uint8 e8m0 [.., N, K/32]."""
    return _fmt("mxfp8").dequantize({"weight": w, "weight_scale": w_scale}, torch.float32)


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
    ``input_scale * GLOBAL_DIV`` (the format's e2m1 max x e4m3 max) for a static input_scale."""
    if input_scale is None:
        return x.detach().abs().amax().float()
    # the inverse of the format's input_scale rule (Format.activation_amax), kept on the device
    return torch.as_tensor(input_scale, dtype=torch.float32, device=x.device).reshape(()) * GLOBAL_DIV


def nvfp4_activation_scale(x: torch.Tensor, input_scale=None) -> torch.Tensor:
    """Per-tensor NVFP4 activation scale the sm100 kernel uses, fp32 0-d: amax / GLOBAL_DIV, the
    same expression inkling_quant.formats' NVFP4 uses for weight_scale_2 (a test checks they are
    bit-equal), 1.0 for an all-zero x. No host sync."""
    amax = nvfp4_activation_amax(x, input_scale)
    s = nvfp4_global_scale(amax)
    return torch.where(amax > 0, s, torch.ones_like(s))


def fake_quant_nvfp4_activations(x: torch.Tensor, input_scale=None) -> torch.Tensor:
    """x -> dequant(quant_nvfp4(x)) in fp32 via inkling_quant.formats: per-16 blocks along K
    under one per-tensor scale derived from ``nvfp4_activation_amax`` (dynamic amax(x) when
    input_scale is None)."""
    amax = nvfp4_activation_amax(x, input_scale)
    if not bool(amax > 0):
        return torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    fmt = _fmt("nvfp4")
    return fmt.dequantize(fmt.quantize(x.to(torch.bfloat16), global_amax=amax), torch.float32)


def fake_quant_mxfp8_activations(x: torch.Tensor) -> torch.Tensor:
    fmt = _fmt("mxfp8")
    return fmt.dequantize(fmt.quantize(x.to(torch.bfloat16)), torch.float32)


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
    return _fmt(fmt).dequantize(one, torch.float32)


def fused_moe(fmt: str, x, topk_ids, topk_weights, gate_up, down, *, activation: str = "softcapped-swiglu",
              gate_softcap: float = 4.0, up_softcap: float = 25.0) -> torch.Tensor:
    """fp32 [T, H]: for each token t and slot k, e = topk_ids[t, k]: gate_up = x[t] @ W13_e^T
    (fp32; gate = its first half, up = the second, as chunk(2, dim=-1)), h = act(gate, up)
    rounded to bf16, y = h @ W2_e^T (fp32); out[t] = sum over k = 0, 1, ... in order of
    topk_weights[t, k] * y (fp32). Weights dequantized with inkling_quant.formats."""
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
