"""The fused MoE layer on quantized experts, as serving and verify run it: tokens routed top-k,
aligned per expert (vLLM's ``moe_align_block_size`` form), then for all active experts of the
layer one gate_up launch, the gated activation, one down launch and the weighted top-k sum.

    y = nvfp4_fused_moe(x, topk_ids, topk_weights, w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2)
    y = mxfp8_fused_moe(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale)
    y = fused_moe("nvfp4", x, topk_ids, topk_weights, gate_up_tensors, down_tensors)

Layout and semantics follow transformers' ``Inkling2Experts`` (transformers 5.25,
models/inkling2/modeling_inkling2.py:801-837): ``gate_up_proj`` [E, 2I, H] with the gate rows
first (``gate_up.chunk(2, dim=-1)``, l.836), ``down_proj`` [E, H, I], the activation
``Inkling2SoftcappedSwiGLU`` (l.786-797): ``softcap(gate, 4) * sigmoid(gate) * softcap(up, 25)``
in fp32 with ``softcap(z, c) = tanh(z / c) * c`` (l.776-783; the caps are the config's
``mlp_gate_softcap`` / ``mlp_up_softcap``), and the top-k outputs times their router weights
summed in fp32 (l.830-833). ``activation="silu"`` gives the usual SwiGLU (silu(gate) * up).

Precision (docs/kernels.md): gate_up and down accumulate in fp32; the activation runs on the
fp32 sums and h is rounded once to bf16 (the down GEMM's input, as in vLLM's fused_moe and in
transformers); down outputs are weighted and summed in fp32. transformers additionally rounds
gate_up and the down output to bf16 (its F.linear outputs); the reference here
(reference.fused_moe) defines the fp32 semantics the kernels implement.

The alignment follows vLLM (vllm/model_executor/layers/fused_moe/moe_align_block_size.py and
the fused_moe_kernel in fused_moe.py): flat pair ids ``t * top_k + k`` sorted by expert (stable),
each expert's list padded to a multiple of BLOCK_M with the id ``T * top_k``, one expert id per
block; computed here with torch ops and no host sync (the block count is the upper bound
``cdiv(T*top_k, BLOCK_M) + min(E, T*top_k)``; spare blocks carry expert -1 and do nothing).
"""
from __future__ import annotations

from typing import Mapping

import torch

from .errors import KernelError
from . import gemm_kernels as gk
from . import paths as _paths
from . import reference as _ref
from .dequant_gemm import QuantWeight, Rows, _activation_scale_nvfp4, _check_x, choose_config, run_gemm, split_layout
from .launch_table import LaunchConfig
from .paths import PATH_REFERENCE, PATH_SM100, resolve_path
from .triton_ops import ACTIVATIONS, triton

__all__ = ["fused_moe", "moe_align_block_size", "mxfp8_fused_moe", "nvfp4_fused_moe", "rows_per_expert_hint"]

INKLING_GATE_SOFTCAP = 4.0   # Inkling2TextConfig.mlp_gate_softcap (configs/inkling-2-small.json)
INKLING_UP_SOFTCAP = 25.0    # Inkling2TextConfig.mlp_up_softcap


def moe_align_block_size(topk_ids: torch.Tensor, block_m: int, num_experts: int, exact: bool | None = None):
    """(sorted_token_ids int32 [blocks * block_m], expert_ids int32 [blocks],
    num_tokens_post_padded int32 [1]) as vLLM's moe_align_block_size returns them: the flat ids
    of topk_ids [T, top_k] grouped by expert in token order, each expert's group padded with
    the id T*top_k to a multiple of block_m; expert_ids[b] owns block b (-1: a spare block).
    No host sync unless `exact` (default: on the CPU, where the exact block count is free)."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    numel = flat.numel()
    dev = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.index_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    pad_start = pad_end - padded
    cnt_start = torch.cumsum(counts, 0) - counts
    sorted_e, order = torch.sort(flat, stable=True)
    dest = pad_start[sorted_e] + torch.arange(numel, device=dev) - cnt_start[sorted_e]
    if exact is None:
        exact = dev.type == "cpu"
    if exact:
        blocks = int(pad_end[-1]) // block_m if num_experts else 0
    else:
        blocks = -(-numel // block_m) + min(num_experts, numel)
    sorted_ids = torch.full((blocks * block_m,), numel, dtype=torch.int32, device=dev)
    sorted_ids[dest] = order.to(torch.int32)
    starts = torch.arange(blocks, device=dev, dtype=torch.int64) * block_m
    expert_ids = torch.searchsorted(pad_end, starts, right=True)
    total = pad_end[-1:] if num_experts else torch.zeros(1, dtype=torch.int64, device=dev)
    expert_ids = torch.where(starts < total, expert_ids, torch.full_like(expert_ids, -1)).to(torch.int32)
    return sorted_ids, expert_ids, total.to(torch.int32)


def rows_per_expert_hint(num_tokens: int, top_k: int, num_experts: int) -> int:
    """Rows an M-block should expect, without looking at the routing (no host sync): the
    number of tokens while that is a decode batch (<= 16: in the worst case all of them go to
    the same experts), else the mean pairs per expert (at least 16)."""
    if num_tokens <= 16:
        return max(1, num_tokens)
    return max(16, num_tokens * top_k // max(1, num_experts))


def _sorted_rows(topk_ids: torch.Tensor, block_m: int, num_experts: int, x_row_div: int) -> Rows:
    ids, experts, _ = moe_align_block_size(topk_ids, block_m, num_experts)
    return Rows(gk.ROWS_SORTED_IDS, experts.numel(), block_m, topk_ids.numel(), experts, ids, None, x_row_div)


def _weights(fmt: str, t: Mapping[str, torch.Tensor]) -> QuantWeight:
    if fmt == "nvfp4":
        return QuantWeight.nvfp4(t["weight"], t["weight_scale"], t["weight_scale_2"], True)
    if fmt == "mxfp8":
        return QuantWeight.mxfp8(t["weight"], t["weight_scale"], True)
    raise KernelError(f"fused_moe: no kernel for format {fmt!r} (nvfp4, mxfp8)")


def _check_routing(x, topk_ids, topk_weights, w13: QuantWeight, w2: QuantWeight) -> None:
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise KernelError(f"topk_ids / topk_weights must both be [T={x.shape[0]}, top_k], got "
                          f"{tuple(topk_ids.shape)} / {tuple(topk_weights.shape)}")
    if w13.n != 2 * w2.k or w2.n != w13.k or w13.experts != w2.experts:
        raise KernelError(f"gate_up [E, 2I, H] and down [E, H, I] disagree: gate_up {w13.experts}x{w13.n}x{w13.k}, "
                          f"down {w2.experts}x{w2.n}x{w2.k}")
    if topk_ids.device.type == "cpu" and topk_ids.numel() and (int(topk_ids.min()) < 0 or
                                                               int(topk_ids.max()) >= w13.experts):
        raise KernelError(f"topk_ids must lie in [0, {w13.experts})")


def _gemm_partials(a, qw: QuantWeight, rows: Rows, cfg: LaunchConfig, path: str, n_rows: int) -> torch.Tensor:
    """fp32 partials [S, n_rows, N] of one MoE GEMM (every row is some block's: no zero fill)."""
    _, splits = split_layout(qw.k, cfg)
    out = torch.empty((splits, n_rows, qw.n), dtype=torch.float32, device=a.device)
    scale = _activation_scale_nvfp4(a, None) if (path == PATH_SM100 and qw.fmt == "nvfp4") else None
    run_gemm(a, qw, rows, out, cfg, path, scale)
    return out


def _epilogue_blocks():
    return (16, 256) if _paths.interpreted() else (16, 128)


def fused_moe(fmt: str, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
              gate_up: Mapping[str, torch.Tensor], down: Mapping[str, torch.Tensor], *,
              activation: str = "softcapped-swiglu", gate_softcap: float = INKLING_GATE_SOFTCAP,
              up_softcap: float = INKLING_UP_SOFTCAP, out_dtype: torch.dtype = torch.bfloat16,
              path: str | None = None, configs: tuple[LaunchConfig, LaunchConfig] | None = None) -> torch.Tensor:
    """y[T, H] = sum_k topk_weights[t, k] * down_e(act(gate_up_e(x[t]))), e = topk_ids[t, k].

    gate_up / down: the format's tensors by suffix (formats' kernel_inputs), stacked over the
    layer's E experts: NVFP4 ``weight`` uint8 [E, 2I, H/2], ``weight_scale`` e4m3 [E, 2I, H/16],
    ``weight_scale_2`` fp32 [E]; MXFP8 ``weight`` e4m3 [E, 2I, H], ``weight_scale`` uint8
    [E, 2I, H/32]; down likewise with [E, H, I]. `configs` forces the two launches' configs
    (gate_up, down). The sm100 path quantizes x and h on the fly (dynamic
    per-tensor scales). Each launch aligns the routing to its own block_m."""
    if activation not in ACTIVATIONS:
        raise KernelError(f"unknown activation {activation!r}; known: {sorted(ACTIVATIONS)}")
    w13, w2 = _weights(fmt, gate_up), _weights(fmt, down)
    x = _check_x(x, w13.k)
    _check_routing(x, topk_ids, topk_weights, w13, w2)
    T, top_k = topk_ids.shape
    m = rows_per_expert_hint(T, top_k, w13.experts)
    path = resolve_path(path, x.device, m)
    if path == PATH_REFERENCE:
        return _ref.fused_moe(fmt, x, topk_ids, topk_weights, gate_up, down, activation=activation,
                              gate_softcap=gate_softcap, up_softcap=up_softcap).to(out_dtype)
    if configs is None:
        configs = (choose_config(path, fmt, "moe", w13.n, w13.k, m, x.device),
                   choose_config(path, fmt, "moe", w2.n, w2.k, m, x.device))
    c1, c2 = (c.check(w.scale_block) for c, w in zip(configs, (w13, w2)))
    y = torch.empty((T, w2.n), dtype=out_dtype, device=x.device)
    if T == 0:
        return y
    pairs = T * top_k
    rows1 = _sorted_rows(topk_ids, c1.block_m, w13.experts, top_k)
    rows2 = (Rows(**{**rows1.__dict__, "x_row_div": 1}) if c2.block_m == c1.block_m
             else _sorted_rows(topk_ids, c2.block_m, w2.experts, 1))
    p1 = _gemm_partials(x, w13, rows1, c1, path, pairs)
    inter = w2.k
    h = torch.empty((pairs, inter), dtype=torch.bfloat16, device=x.device)
    br, bn = _epilogue_blocks()
    gk._moe_activation_kernel[(triton.cdiv(pairs, br), triton.cdiv(inter, bn))](
        p1, h, pairs, inter, p1.shape[0], p1.stride(0), p1.stride(1), h.stride(0),
        ACT=ACTIVATIONS[activation], GATE_CAP=float(gate_softcap), UP_CAP=float(up_softcap),
        BLOCK_R=br, BLOCK_N=bn, ROUND_BF16=_paths.interpreted())
    p2 = _gemm_partials(h, w2, rows2, c2, path, pairs)
    tw = topk_weights.to(device=x.device, dtype=torch.float32).reshape(-1).contiguous()
    gk._moe_combine_kernel[(triton.cdiv(T, br), triton.cdiv(w2.n, bn))](
        p2, tw, y, T, w2.n, p2.shape[0], p2.stride(0), p2.stride(1), y.stride(0),
        TOP_K=top_k, BLOCK_R=br, BLOCK_N=bn, ROUND_BF16=_paths.interpreted() and out_dtype == torch.bfloat16)
    return y


def nvfp4_fused_moe(x, topk_ids, topk_weights, w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2,
                    **kw) -> torch.Tensor:
    """fused_moe on NVFP4 experts: w13 uint8 [E, 2I, H/2], w13_scale e4m3 [E, 2I, H/16],
    w13_scale_2 fp32 [E] (gate and up share it), w2 [E, H, I/2], w2_scale [E, H, I/16],
    w2_scale_2 [E]."""
    return fused_moe("nvfp4", x, topk_ids, topk_weights,
                     {"weight": w13, "weight_scale": w13_scale, "weight_scale_2": w13_scale_2},
                     {"weight": w2, "weight_scale": w2_scale, "weight_scale_2": w2_scale_2}, **kw)


def mxfp8_fused_moe(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, **kw) -> torch.Tensor:
    """fused_moe on MXFP8 experts: w13 e4m3 [E, 2I, H], w13_scale uint8 e8m0 [E, 2I, H/32],
    w2 [E, H, I], w2_scale [E, H, I/32]."""
    return fused_moe("mxfp8", x, topk_ids, topk_weights, {"weight": w13, "weight_scale": w13_scale},
                     {"weight": w2, "weight_scale": w2_scale}, **kw)
