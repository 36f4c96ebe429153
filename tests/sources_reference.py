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

- DeepSeek-V4 (FP8 Linears with UE8M0 scales, MXFP4 routed experts, an MTP block): transformers'
  DeepseekV4ForCausalLM saved, its names then put back to the release's original ones (no
  `model.` prefix, `embed.weight`, `hc_head_fn`: the anchored renames of conversion_mapping.py
  "deepseek_v4", which save_pretrained does not reverse), an MTP block `mtp.0.*` added (names as
  Model-Optimizer examples/deepseek/deepseek_v4/quantize_to_nvfp4.py lists them: its experts,
  `e_proj`, `h_proj`, `enorm`, `hnorm`, `norm`); Linear weights by DeepGEMM's
  `per_block_cast_to_fp8(use_ue8m0=True)` (the tile scale rounded up to a power of two; the
  compressors and the indexer's `weights_proj` stay BF16, as vLLM 0.33 loads them), scale
  `<module>.scale` float8_e8m0fnu; experts by ModelOpt's `MXFP4QTensor.quantize`, weight int8
  [out, in/2] and `<module>.scale` float8_e8m0fnu [out, in/32] (transformers 5.25
  integrations/finegrained_fp8.py `FP8Experts` with expert_dtype "fp4"); config `expert_dtype`
  "fp4" at the top level, `scale_fmt` "ue8m0".

- Kimi-K3 (MXFP4 routed experts, everything else BF16; no transformers class to write it): the
  tensors under the names and shapes vLLM 0.33's loader reads (models/kimi_k3/nvidia/model.py
  `load_weights`, kda.py, mla.py: KDA layers, an MLA layer, a dense layer 0, a latent MoE whose
  experts act on routed_expert_hidden_size, shared experts, attention-residual projections, a
  vision tower and `mm_projector`) written here, seeded normal; the experts by ModelOpt's
  `MXFP4QTensor.quantize` as compressed-tensors stores them, `<module>.weight_packed` uint8
  [out, in/2] and `<module>.weight_scale` uint8 E8M0 [out, in/32]; config.json as vLLM 0.33's
  KimiK3Config / KimiLinearConfig read it, the quantization_config in `text_config` with the
  MXFP4 group vLLM's `_is_mxfp4` requires (the release's own JSON is not in the sources read).

References: `fp8_dequantize` (DeepSeek-V3 inference/kernel.py `weight_dequant`: fp32 value x
its tile's scale, written apart from formats/), ModelOpt's `NVFP4QTensor` / `MXFP8QTensor` and
`quantize_mxfp4_to_nvfp4_lossless`.
"""
from __future__ import annotations

import json
import math
import shutil
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
    """DeepGEMM's per_block_cast_to_fp8 on a 2-D weight, ceil grid; with a bf16 `scale_dtype` the
    scale is rounded first and the values divided by the stored one; with float8_e8m0fnu
    (use_ue8m0=True) it is rounded up to a power of two (``ceil_to_ue8m0``)."""
    m, n = x.shape
    pm, pn = math.ceil(m / TILE) * TILE, math.ceil(n / TILE) * TILE
    xp = torch.zeros(pm, pn, dtype=torch.float32)
    xp[:m, :n] = x.float()
    v = xp.view(pm // TILE, TILE, pn // TILE, TILE)
    sf = v.abs().amax(dim=(1, 3), keepdim=True).clamp(1e-4) / 448.0
    if scale_dtype == torch.float8_e8m0fnu:
        sf = torch.exp2(torch.ceil(torch.log2(sf)))
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


def deepseek_v4(out: Path, seed: int = 0) -> Path:
    import transformers as T
    cfg = T.DeepseekV4Config(vocab_size=96, hidden_size=256, moe_intermediate_size=160, num_hidden_layers=3,
                             num_attention_heads=2, num_key_value_heads=1, head_dim=192, q_lora_rank=192,
                             n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, o_groups=2, o_lora_rank=160,
                             index_n_heads=2, index_head_dim=64, index_topk=4, sliding_window=16,
                             max_position_embeddings=256, hc_mult=2, mlp_layer_types=["hash_moe", "moe", "moe"],
                             layer_types=["sliding_attention", "compressed_sparse_attention",
                                          "heavily_compressed_attention"], partial_rotary_factor=64 / 192)
    return _save(T.DeepseekV4ForCausalLM, cfg, out, seed)


_V4_ANCHORED = {"embed_tokens.weight": "embed.weight", "hc_head.hc_fn": "hc_head_fn", "hc_head.hc_base": "hc_head_base",
                "hc_head.hc_scale": "hc_head_scale"}
# kept BF16 in the release (vLLM 0.33 builds them with no quantization: compressor.py `fused_wkv_wgate`,
# attention.py the indexer's `weights_proj`), besides embeddings, norms, routers, hyper-connections
_V4_NOT_FP8 = ("embed", "head.weight", "norm", "ffn.gate.", "hc_", ".ape", "compressor.", "indexer.weights_proj")


def to_v4_release(bf16: Path, out: Path) -> Path:
    """transformers' DeepSeek-V4 under the release's names and storage (module doc)."""
    from modelopt.torch.quantization.qtensor import MXFP4QTensor

    sd = {}
    for k, t in load_file(bf16 / "model.safetensors").items():
        k = k.removeprefix("model.")
        # save_pretrained reverses conversion_mapping's `.norm.` -> `.kv_norm.` for the attention's
        # own kv_norm too, which the release (and vLLM 0.33's attention.py `kv_norm`) names so
        k = k.replace(".attn.norm.", ".attn.kv_norm.")
        sd[_V4_ANCHORED.get(k, k)] = t
    g = torch.Generator().manual_seed(7)
    for k in [k for k in sd if k.startswith("layers.2.") and not k.startswith("layers.2.hc_")]:
        sd["mtp.0." + k[len("layers.2."):]] = sd[k].clone()
    for name in ("e_proj", "h_proj"):
        sd[f"mtp.0.{name}.weight"] = (torch.randn(256, 256, generator=g) * 0.02).to(torch.bfloat16)
    for name in ("enorm", "hnorm", "norm"):
        sd[f"mtp.0.{name}.weight"] = torch.ones(256, dtype=torch.bfloat16)
    res = {}
    for k, t in sd.items():
        module = k[: -len(".weight")]
        if ".ffn.experts." in k:
            w = t.float()
            if k == "layers.0.ffn.experts.1.w1.weight":
                w[3, 32:64] *= 2.0 ** -40   # far below the expert's largest exponent: the cast re-rounds it
            q, e8 = MXFP4QTensor.quantize(w, 32)
            res[k] = q._quantized_data.view(torch.int8).contiguous()
            res[module + ".scale"] = e8.reshape(w.shape[0], -1).view(torch.float8_e8m0fnu).contiguous()
        elif t.dim() == 2 and k.endswith(".weight") and not any(s in k for s in _V4_NOT_FP8):
            res[k], res[module + ".scale"] = per_block_cast_to_fp8(t, torch.float8_e8m0fnu)
        else:
            res[k] = t
    _write(bf16, out, res, {**FP8_CONFIG, "scale_fmt": "ue8m0"})
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "expert_dtype": "fp4"}, indent=2))
    return out


K3_CONFIG = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized", "quantization_status": "compressed",
             "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                           "weights": {"num_bits": 4, "type": "float", "strategy": "group",
                                                       "group_size": 32, "symmetric": True, "dynamic": False,
                                                       "scale_dtype": "torch.uint8", "observer": "minmax"}}},
             "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
                        "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"]}
K3_TEXT = {"model_type": "kimi_linear", "vocab_size": 96, "hidden_size": 256, "intermediate_size": 320,
           "num_hidden_layers": 3, "num_attention_heads": 2, "num_key_value_heads": 2, "moe_intermediate_size": 160,
           "num_experts": 4, "num_experts_per_token": 2, "num_shared_experts": 1, "first_k_dense_replace": 1,
           "moe_layer_freq": 1, "routed_expert_hidden_size": 192, "latent_moe_use_norm": True, "q_lora_rank": 64,
           "kv_lora_rank": 64, "qk_nope_head_dim": 64, "qk_rope_head_dim": 0, "v_head_dim": 64, "mla_use_nope": True,
           "mla_use_output_gate": True, "attn_res_block_size": 2, "tie_word_embeddings": False,
           "linear_attn_config": {"kda_layers": [1, 2], "full_attn_layers": [3], "num_heads": 2, "head_dim": 64,
                                  "short_conv_kernel_size": 4, "gate_lower_bound": -5.0, "use_full_rank_gate": True},
           "hidden_act": "situ", "torch_dtype": "bfloat16", "max_position_embeddings": 4096}


def kimi_k3_release(out: Path, seed: int = 0) -> Path:
    """A tiny Kimi-K3 release (module doc)."""
    from modelopt.torch.quantization.qtensor import MXFP4QTensor

    t = K3_TEXT
    H, I, L, E, V = t["hidden_size"], t["moe_intermediate_size"], t["routed_expert_hidden_size"], t["num_experts"], t["vocab_size"]
    kda, P, Dk = t["linear_attn_config"], 2 * 64, 64
    nh, qk, v = t["num_attention_heads"], t["qk_nope_head_dim"] + t["qk_rope_head_dim"], t["v_head_dim"]
    g = torch.Generator().manual_seed(seed)
    shapes: dict[str, tuple[int, ...]] = {"language_model.model.embed_tokens.weight": (V, H),
                                          "language_model.model.norm.weight": (H,), "language_model.lm_head.weight": (V, H),
                                          "language_model.model.output_attn_res_norm.weight": (H,),
                                          "language_model.model.output_attn_res_proj.weight": (1, H),
                                          "vision_tower.patch_embed.proj.weight": (32, 3, 2, 2),
                                          "mm_projector.proj.0.weight": (H, 32)}
    for i in range(t["num_hidden_layers"]):
        p = f"language_model.model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                       p + "self_attention_res_norm.weight": (H,), p + "self_attention_res_proj.weight": (1, H),
                       p + "mlp_res_norm.weight": (H,), p + "mlp_res_proj.weight": (1, H)})
        a = p + "self_attn."
        if i + 1 in kda["kda_layers"]:   # vLLM 0.33 models/kimi_k3/nvidia/kda.py
            shapes.update({a + n + ".weight": (P, H) for n in ("q_proj", "k_proj", "v_proj", "g_proj")})
            shapes.update({a + "f_a_proj.weight": (Dk, H), a + "b_proj.weight": (kda["num_heads"], H),
                           a + "f_b_proj.weight": (P, Dk), a + "o_norm.weight": (Dk,), a + "o_proj.weight": (H, P),
                           a + "A_log": (kda["num_heads"],), a + "dt_bias": (P,)})
            shapes.update({a + f"{n}_conv1d.weight": (P, 1, kda["short_conv_kernel_size"]) for n in "qkv"})
        else:                            # mla.py
            shapes.update({a + "q_a_proj.weight": (t["q_lora_rank"], H), a + "q_a_layernorm.weight": (t["q_lora_rank"],),
                           a + "q_b_proj.weight": (nh * qk, t["q_lora_rank"]),
                           a + "kv_a_proj_with_mqa.weight": (t["kv_lora_rank"] + t["qk_rope_head_dim"], H),
                           a + "kv_a_layernorm.weight": (t["kv_lora_rank"],),
                           a + "kv_b_proj.weight": (nh * (t["qk_nope_head_dim"] + v), t["kv_lora_rank"]),
                           a + "o_proj.weight": (H, nh * v), a + "g_proj.weight": (nh * v, H)})
        if i < t["first_k_dense_replace"]:
            dense = t["intermediate_size"]
            shapes.update({p + "mlp.gate_proj.weight": (dense, H), p + "mlp.up_proj.weight": (dense, H),
                           p + "mlp.down_proj.weight": (H, dense)})
            continue
        m = p + "block_sparse_moe."
        shared = I * t["num_shared_experts"]
        shapes.update({m + "gate.weight": (E, H), m + "gate.e_score_correction_bias": (E,),
                       m + "shared_experts.gate_proj.weight": (shared, H), m + "shared_experts.up_proj.weight": (shared, H),
                       m + "shared_experts.down_proj.weight": (H, shared), m + "routed_expert_down_proj.weight": (L, H),
                       m + "routed_expert_up_proj.weight": (H, L), m + "routed_expert_norm.weight": (L,)})
        for e in range(E):
            shapes.update({f"{m}experts.{e}.w1.weight": (I, L), f"{m}experts.{e}.w3.weight": (I, L),
                           f"{m}experts.{e}.w2.weight": (L, I)})
    res = {}
    for k, shape in shapes.items():
        w = torch.randn(shape, generator=g) * (1.0 if k.endswith(("norm.weight", "A_log", "dt_bias")) else 0.02)
        if k.endswith("e_score_correction_bias"):
            res[k] = w.float()
            continue
        if ".experts." not in k:
            res[k] = w.to(torch.bfloat16)
            continue
        w = w.to(torch.bfloat16).float()
        if k.endswith("layers.1.block_sparse_moe.experts.1.w1.weight"):
            w[3, 32:64] *= 2.0 ** -40   # far below the expert's largest exponent: the cast re-rounds it
        q, e8 = MXFP4QTensor.quantize(w, 32)
        module = k[: -len(".weight")]
        res[module + ".weight_packed"] = q._quantized_data.view(torch.uint8).contiguous()
        res[module + ".weight_scale"] = e8.reshape(w.shape[0], -1).view(torch.uint8).contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(res, out / "model.safetensors", metadata={"format": "pt"})
    cfg = {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
           "text_config": {**K3_TEXT, "quantization_config": K3_CONFIG},
           "vision_config": {"model_type": "kimi_k3_vision", "vt_hidden_size": 32, "text_hidden_size": H},
           "media_placeholder_token_id": 95, "pad_token_id": 0}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def edited_copy(src: Path, dst: Path, file: str, edit) -> Path:
    """A copy of the checkpoint `src` at `dst` whose JSON `file` is changed by `edit(obj)`."""
    shutil.copytree(src, dst)
    d = json.loads((dst / file).read_text())
    edit(d)
    (dst / file).write_text(json.dumps(d))
    return dst


def tampered_copy(src: Path, dst: Path, edit) -> Path:
    """A copy of the one-file checkpoint `src` at `dst` whose state dict `edit(sd)` changed in place."""
    shutil.copytree(src, dst)
    sd = load_file(dst / "model.safetensors")
    edit(sd)
    save_file(sd, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def mxfp4_dequantize(packed: torch.Tensor, e8: torch.Tensor) -> torch.Tensor:
    """transformers 5.25 integrations/finegrained_fp8.py `Fp8Dequantize._dequantize_one` on an
    int8-packed FP4 weight and its e8m0 scale, in fp32 (its own code, not ours)."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize
    return Fp8Dequantize(None)._dequantize_one(packed, e8, torch.float32)


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
