"""Tiny quantized sources in the layouts users download, and the references the tests hold our
conversions of them to.

The BF16 models are written by transformers 5.25's own `save_pretrained` (DeepseekV3ForCausalLM,
Qwen3MoeForCausalLM, GptOssForCausalLM); transformers' FP8 and MXFP4 writers do not run on this
CPU machine (`FineGrainedFP8HfQuantizer.validate_environment` raises without a GPU; its MXFP4
writer needs the hub's triton kernels), so the weights are then quantized in the released
layouts by the published quantizers:

- FP8 block-scaled (DeepSeek-V3, Qwen3's FP8 releases): deepseek-ai/DeepGEMM
  `deep_gemm/utils/math.py` `per_block_cast_to_fp8` (zero-pad to 128x128 tiles, amax per tile,
  ``clamp(1e-4)``, ``sf = amax / 448``, ``x * (1 / sf)`` cast to e4m3, crop), every 2-D Linear
  weight but embeddings, norms, routers and the LM head, scale beside it as `weight_scale_inv`
  (float32 for DeepSeek; Qwen3's releases store it bfloat16: the scale is rounded to bf16 first
  and the values divided by that); config `quantization_config` as DeepSeek-V3's README_WEIGHTS.md
  gives it. Dimensions give several tiles per tensor and partial edge tiles (expert width 160,
  MLA's 160- and 192-row projections).
- MXFP4 experts (gpt-oss): nvidia-modelopt 0.47.0 `MXFP4QTensor.quantize` on each stacked
  expert tensor transposed to [E, out, in] (blocks along the input dimension), written as
  `*_blocks` [E, out, in/32, 16] / `*_scales` [E, out, in/32] (transformers 5.25
  integrations/mxfp4.py `convert_moe_packed_tensors` reads them so), config as transformers'
  `convert_gpt_oss_weights_to_hf.py` writes it. One expert block is made tiny before quantizing,
  so that ModelOpt's lossless MXFP4 -> NVFP4 cast must re-round it.

References: `fp8_dequantize` (DeepSeek-V3 inference/kernel.py `weight_dequant`: fp32 value x
its tile's scale, written apart from formats/), ModelOpt's `NVFP4QTensor` / `MXFP8QTensor` and
`quantize_mxfp4_to_nvfp4_lossless`.
"""
from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

TILE = 128
FP8_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
GPT_OSS_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
_NOT_FP8 = ("embed_tokens", "lm_head", "norm", "mlp.gate.")


def per_block_cast_to_fp8(x: torch.Tensor, scale_dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepGEMM's per_block_cast_to_fp8 (use_ue8m0=False) on a 2-D weight, ceil grid; with a
    bf16 `scale_dtype` the scale is rounded first and the values divided by the stored one."""
    m, n = x.shape
    pm, pn = math.ceil(m / TILE) * TILE, math.ceil(n / TILE) * TILE
    xp = torch.zeros(pm, pn, dtype=torch.float32)
    xp[:m, :n] = x.float()
    v = xp.view(pm // TILE, TILE, pn // TILE, TILE)
    sf = v.abs().amax(dim=(1, 3), keepdim=True).clamp(1e-4) / 448.0
    sf = sf.to(scale_dtype).float()
    q = (v * (1.0 / sf)).to(torch.float8_e4m3fn).view(pm, pn)[:m, :n].contiguous()
    return q, sf.view(pm // TILE, pn // TILE).to(scale_dtype).contiguous()


def fp8_dequantize(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """fp32(q) x fp32(s) of each element's tile (DeepSeek-V3 inference/kernel.py weight_dequant)."""
    m, n = q.shape
    full = s.float().repeat_interleave(TILE, 0).repeat_interleave(TILE, 1)[:m, :n]
    return q.float() * full


def _rows_spread(model: torch.nn.Module, seed: int) -> None:
    """Rows scaled 10^U(-1, 1) (as tests/hf_moe_reference.py), so per-tile scales differ."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_((10.0 ** (torch.rand(*p.shape[:-1], 1, generator=g) * 2 - 1)).to(p.dtype))


def deepseek_v3(out: Path, seed: int = 0) -> Path:
    import transformers as T
    cfg = T.DeepseekV3Config(vocab_size=96, hidden_size=256, intermediate_size=384, moe_intermediate_size=160,
                             num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=4, n_shared_experts=1,
                             num_experts_per_tok=2, n_group=2, topk_group=1, num_attention_heads=2,
                             num_key_value_heads=2, q_lora_rank=192, kv_lora_rank=128, qk_rope_head_dim=32,
                             qk_nope_head_dim=64, v_head_dim=64, max_position_embeddings=256)
    return _save(T.DeepseekV3ForCausalLM, cfg, out, seed)


def qwen3_moe(out: Path, seed: int = 0) -> Path:
    import transformers as T
    cfg = T.Qwen3MoeConfig(vocab_size=96, hidden_size=256, intermediate_size=384, moe_intermediate_size=160,
                           num_hidden_layers=2, num_experts=4, num_experts_per_tok=2, num_attention_heads=2,
                           num_key_value_heads=1, head_dim=128, max_position_embeddings=256)
    return _save(T.Qwen3MoeForCausalLM, cfg, out, seed)


def gpt_oss(out: Path, seed: int = 0) -> Path:
    import transformers as T
    cfg = T.GptOssConfig(vocab_size=96, hidden_size=256, intermediate_size=192, num_hidden_layers=2,
                         num_local_experts=4, num_experts_per_tok=2, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=64, sliding_window=64, max_position_embeddings=256,
                         layer_types=["sliding_attention", "full_attention"])
    return _save(T.GptOssForCausalLM, cfg, out, seed)


def _save(cls, cfg, out: Path, seed: int) -> Path:
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = cls(cfg).to(torch.bfloat16)
        with torch.no_grad():  # gpt-oss's experts are torch.empty: give every expert real values
            for n, p in model.named_parameters():
                if ".experts." in n:
                    p.normal_(0, 0.02)
        _rows_spread(model, seed + 1)
        model.save_pretrained(out)
    return out


def to_fp8(bf16: Path, out: Path, scale_dtype=torch.float32, extra_config: dict | None = None) -> Path:
    """The BF16 checkpoint's 2-D Linear weights (not embeddings, norms, routers, LM head) as FP8
    with a `weight_scale_inv` beside each; everything else as it is."""
    sd = load_file(bf16 / "model.safetensors")
    res = {}
    for k, t in sd.items():
        if t.dim() == 2 and k.endswith(".weight") and not any(s in k for s in _NOT_FP8):
            res[k], res[k + "_scale_inv"] = per_block_cast_to_fp8(t, scale_dtype)
        else:
            res[k] = t
    return _write(bf16, out, res, {**FP8_CONFIG, **(extra_config or {})})


def to_mxfp4(bf16: Path, out: Path, tiny_block: bool = True) -> Path:
    """gpt-oss's stacked experts ([E, in, out] in BF16) as MXFP4 blocks and scales ([E, out, ...])."""
    from modelopt.torch.quantization.qtensor import MXFP4QTensor

    sd = load_file(bf16 / "model.safetensors")
    res = {}
    for k, t in sd.items():
        if k.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            w = t.transpose(1, 2).contiguous()
            if tiny_block and k.endswith("layers.0.mlp.experts.gate_up_proj"):
                w[1, 6, 32:64] *= 2.0 ** -40   # expert 1, gate row 3: far below the expert's largest exponent
            q, e8 = MXFP4QTensor.quantize(w, 32)
            E, rows, cols = w.shape
            res[k + "_blocks"] = q._quantized_data.reshape(E, rows, cols // 32, 16).contiguous()
            res[k + "_scales"] = e8.reshape(E, rows, cols // 32).contiguous()
        else:
            res[k] = t
    return _write(bf16, out, res, GPT_OSS_CONFIG)


def _write(bf16: Path, out: Path, tensors: dict, qcfg: dict) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((bf16 / "config.json").read_text())
    cfg["quantization_config"] = qcfg
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out
