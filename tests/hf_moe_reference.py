"""Tiny random MoE models of real Hugging Face families, saved by transformers' own
`save_pretrained` (the BF16 sources) and quantized + exported by NVIDIA ModelOpt's own
`mtq.quantize` + `export_hf_checkpoint` on CPU (the reference our converter must equal).

Families, chosen to cover every layout rule (docs/layout.md, "Supported layouts"):

| family         | text prefix              | routed experts                         | also                          |
|----------------|--------------------------|----------------------------------------|-------------------------------|
| qwen3_moe      | `model.`                 | per expert, gate_proj/up_proj/down_proj | dense first layer (mlp_only_layers) |
| mixtral        | `model.`                 | per expert, block_sparse_moe w1/w3/w2   |                               |
| deepseek_v3    | `model.`                 | per expert                              | shared experts, dense first layer (first_k_dense_replace), e_score_correction_bias |
| qwen3_vl_moe   | `model.language_model.`  | stacked gate_up_proj [E, 2I, H], down_proj [E, H, I] (5.25's save_pretrained; the Hub's are transposed) | nested text_config, vision tower |

Dimensions: hidden 64, expert width 32 (MXFP8's 32-blocks divide both), 4 experts, 3 layers (the
default scheme's 5/6 then gives NVFP4 to layers 0-1 and MXFP8 to layer 2, ModelOpt's config here).
Weights get row scales spread over two decades, so per-block and per-tensor scale rules are
exercised (a plain random init is too uniform). ModelOpt's config: its experts-only NVFP4
(`NVFP4_EXPERTS_ONLY_CFG`, W4A4 with static input scales) and MXFP8 for the last layer's experts,
calibrated on a few random batches; ~5-10 s per family on CPU.
"""
from __future__ import annotations

import copy
from pathlib import Path

import torch

from modelopt_reference import quant_config, quantize_and_export

FAMILIES = ("qwen3_moe", "mixtral", "deepseek_v3", "qwen3_vl_moe")
_TEXT = dict(vocab_size=96, hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
             num_experts_per_tok=2)


def build(family: str, seed: int = 0) -> torch.nn.Module:
    """The tiny model of `family` in BF16, weights with row scales that differ by ~100x."""
    import transformers as T

    if family in ("qwen3_moe", "qwen3_moe_tied"):  # _tied: lm_head tied to the embedding
        cfg = T.Qwen3MoeConfig(**_TEXT, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                               num_experts=4, mlp_only_layers=[0], tie_word_embeddings=family.endswith("_tied"))
        cls = T.Qwen3MoeForCausalLM
    elif family == "mixtral":
        cfg = T.MixtralConfig(**_TEXT, intermediate_size=32, num_hidden_layers=3, num_local_experts=4)
        cls = T.MixtralForCausalLM
    elif family == "deepseek_v3":
        cfg = T.DeepseekV3Config(**{**_TEXT, "num_key_value_heads": 2, "head_dim": 16}, intermediate_size=96,
                                 moe_intermediate_size=32, num_hidden_layers=3, n_routed_experts=4,
                                 n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=32,
                                 qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, n_group=2, topk_group=1)
        cls = T.DeepseekV3ForCausalLM
    elif family == "qwen3_vl_moe":
        cfg = T.Qwen3VLMoeConfig(
            text_config=dict(**_TEXT, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                             num_experts=4),
            vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                               deepstack_visual_indexes=[0]))
        cls = T.Qwen3VLMoeForConditionalGeneration
    elif family == "llama4":  # not exported by ModelOpt here: a layout for detection tests only
        cfg = T.Llama4Config(
            text_config=dict(**_TEXT, intermediate_size=32, intermediate_size_mlp=96, num_hidden_layers=2,
                             num_local_experts=4, interleave_moe_layer_step=1),
            vision_config=dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                               vision_output_dim=64, projector_input_dim=64, projector_output_dim=64,
                               image_size=28, patch_size=14))
        cls = T.Llama4ForConditionalGeneration
    else:
        raise ValueError(f"unknown family {family!r}; known: {FAMILIES} and llama4")
    torch.manual_seed(seed)
    model = cls(cfg).to(torch.bfloat16)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:  # rows (the last dim is the input) scaled 10^U(-1, 1)
                rows = torch.rand(*p.shape[:-1], 1, generator=g) * 2 - 1
                p.mul_((10.0 ** rows).to(p.dtype))
    model.config.architectures = [cls.__name__]  # ModelOpt's export iterates it (None after _from_config)
    return model


def save(family: str, out: Path, seed: int = 0) -> Path:
    """The BF16 model of `family` written by transformers' save_pretrained."""
    build(family, seed).save_pretrained(out)
    return out


def text_layers(model: torch.nn.Module) -> int:
    return model.config.get_text_config().num_hidden_layers


def export(family: str, out: Path, source: Path, seed: int = 0, batches: int = 3, seq: int = 24,
           reload: bool = False, max_shard_size: str | None = None, mxfp8: str = "last",
           weight_only: bool = False) -> Path:
    """Save the BF16 model of `family` to `source` (save_pretrained) and ModelOpt's quantized
    export of it to `out`. `reload`: export the model as a user has it, loaded back from `source`
    by from_pretrained (which keeps DeepSeek-V3's e_score_correction_bias in FP32).
    `max_shard_size`: both sharded (an index beside the shards), else one model.safetensors each.
    `mxfp8`: which layers' routed experts are MXFP8, the rest NVFP4: "last" (the default
    scheme's split here), "none" or "all" (one format: ModelOpt's one-format config).
    `weight_only`: every input quantizer off (NVFP4 becomes W4A16_NVFP4)."""
    import transformers as T

    shards = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model = build(family, seed)
    copy.deepcopy(model).save_pretrained(source, **shards)  # on a copy: save_pretrained rewrites config.dtype
    if reload:
        model = T.AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
        model.config.architectures = [type(model).__name__]
    g = torch.Generator().manual_seed(seed + 2)
    ids = [torch.randint(0, 90, (1, seq), generator=g) for _ in range(batches)]
    # routed experts only: `.experts.` (a shared_experts module is no match)
    n = text_layers(model)
    layers = {"last": [n - 1], "none": [], "all": list(range(n))}[mxfp8]
    recipe = quant_config(layers, "*layers.{i}.*.experts.*")
    if weight_only:
        recipe["quant_cfg"].append({"quantizer_name": "*input_quantizer", "enable": False})
    return quantize_and_export(model, recipe, ids, out, **shards)
