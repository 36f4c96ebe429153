"""Model families as data: what each family's transformers modeling code, ModelOpt's export and
vLLM make of its checkpoints, one record per family (in the style of transformers 5.25
`conversion_mapping.py`, which maps a model_type to its renames and operations, and of
ModelOpt 0.47's per-family export tables). A command asks the record of the checkpoint's family
(`family_of(model_type)`) instead of testing which family it is.

Layout detection itself stays generic (model/layout.py and model/storage.py know every text
prefix, expert block and projection naming the families use), so an untested family spelled like
a known one is read as well; its record is `GENERIC` and `tested` says so.

Adding a family: a record here (the facts its modeling file gives, each cited), a tiny model of
it in tests/hf_moe_reference.py, its expected layout in tests/test_layout.py (docs/architecture.md).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...] = ()     # config.json model_type values it covers (top level or text_config)
    tested: bool = False                  # counted, converted and exported against transformers and ModelOpt in tests
    strict: bool = False                  # config.json lists every tensor (a published spec: Inkling 2), not only experts
    recipe: str | None = None             # the serving recipe whose figures `plan` shows beside its own
    qk_norm: bool = False                 # per-head q_norm/k_norm [head_dim] in the attention
    qkv_bias: bool = False                # q/k/v biases by default (config qkv_bias)
    score_bias: bool = False              # the router's e_score_correction_bias buffer
    memory_block: str = "mlp"             # the MoE block's name in transformers' in-memory model (PEFT's names)
    dense_width_key: str = "intermediate_size"  # a dense layer's MLP width
    shared_expert_per_layer: bool = False  # one shared expert of the expert width in every MoE layer
    gate_up_interleaved: bool = False     # stacked gate_up_proj rows alternate gate/up (not gate then up)
    expert_activation: str = "silu"       # how an expert gates up by gate (kernels' ACTIVATIONS): SwiGLU
    mtp_experts: bool = False             # `mtp.K.` blocks hold routed experts stored as the decoder's (kept so)
    bare_names: bool = False              # its checkpoints name the text model with no prefix (`layers.N.`)
    # ModelOpt writes it as its FP8 release with NVFP4 experts: config.json's FP8
    # quantization_config kept with `moe_quant_algo` and the experts' manifest, the FP8 modules and
    # the MTP block as stored (export/fp8_release.py)
    moe_quant_algo: bool = False
    # ModelOpt writes it as its Kimi-K3 script does: a MIXED_PRECISION manifest keyed by every
    # spelling of a module its loaders probe, config.json's own quantization_config replaced
    # (export/kimi_k3.py)
    modelopt_aliases: bool = False


# transformers 5.25 models/inkling2: softcapped SwiGLU experts (mlp_gate_softcap, mlp_up_softcap)
INKLING2 = Family("inkling2", ("inkling2", "inkling2_text"), tested=True, strict=True,
                  recipe="thinkingmachines/Inkling-2-Small (seed recipe)", expert_activation="softcapped-swiglu")
GENERIC = Family("generic")
FAMILIES: tuple[Family, ...] = (
    INKLING2,
    # transformers 5.25 models/qwen3_moe/modeling_qwen3_moe.py Qwen3MoeAttention: q_norm/k_norm
    Family("qwen3_moe", ("qwen3_moe",), tested=True, qk_norm=True),
    # models/qwen2_moe/configuration_qwen2_moe.py: qkv_bias defaults to true
    Family("qwen2_moe", ("qwen2_moe",), tested=True, qkv_bias=True),
    Family("mixtral", ("mixtral",), tested=True),
    # models/deepseek_v3/modeling_deepseek_v3.py DeepseekV3TopkRouter: e_score_correction_bias buffer
    Family("deepseek_v3", ("deepseek_v3",), tested=True, score_bias=True),
    Family("qwen3_vl_moe", ("qwen3_vl_moe", "qwen3_vl_moe_text"), tested=True, qk_norm=True),
    # models/llama4/modeling_llama4.py: feed_forward experts, intermediate_size_mlp dense width,
    # a shared expert of the expert width in every MoE layer
    Family("llama4", ("llama4", "llama4_text"), tested=True, memory_block="feed_forward",
           dense_width_key="intermediate_size_mlp", shared_expert_per_layer=True),
    Family("qwen3_omni_moe", ("qwen3_omni_moe",), qk_norm=True),
    # models/gpt_oss/modeling_gpt_oss.py: experts stacked [E, H, 2I] / [E, I, H] (in, out) with
    # biases, gate/up interleaved along 2I (`gate, up = gate_up[..., ::2], gate_up[..., 1::2]`,
    # l.82), attention sinks and q/k/v/o biases; the MXFP4 release stores the experts as
    # `*_blocks` / `*_scales` [E, out, in/32, 16] (model/sources.py). Its clamped SwiGLU (alpha
    # 1.702, limit 7) is not among the kernels' activations: verify's MoE figure uses SiLU for it,
    # the same on both sides of the comparison
    Family("gpt_oss", ("gpt_oss",), qkv_bias=True, gate_up_interleaved=True),
    # transformers 5.25 models/deepseek_v4 and conversion_mapping.py "deepseek_v4": checkpoints keep
    # DeepSeek's original names (`layers.N.ffn.experts.E.w1`, `attn.wq_a`, hyper-connection `hc_*`,
    # `embed`/`head`), the router's `ffn.gate.bias` is its e_score_correction_bias; routed experts
    # are MXFP4 beside FP8 Linears (model/sources.py), the MTP block's (`mtp.0.ffn.experts`) too.
    # NVIDIA Model-Optimizer examples/deepseek/deepseek_v4/quantize_to_nvfp4.py (main at a2fbac7,
    # 2026-08-21) writes the FP8 release's form (`moe_quant_algo`), the MTP block left in the
    # source format. Its experts' SwiGLU clamps at
    # swiglu_limit (10), not among the kernels' activations: verify's MoE figure uses SiLU for it
    Family("deepseek_v4", ("deepseek_v4",), tested=True, score_bias=True, mtp_experts=True, bare_names=True,
           moe_quant_algo=True),
    # Kimi-K3 (model_type "kimi_k3", its text_config vLLM 0.33's KimiLinearConfig "kimi_linear";
    # transformers 5.25 has no such model): KDA and MLA attention, a latent MoE whose routed
    # experts act on routed_expert_hidden_size (`block_sparse_moe.experts.E.w1/w3/w2`, MXFP4
    # `weight_packed`/`weight_scale`: model/sources.py), a router e_score_correction_bias, shared
    # experts. Model-Optimizer's Kimi-K3 script writes its own manifest (export/kimi_k3.py). Its
    # experts' activation (SiTU) is not among the kernels': verify's MoE figure uses SiLU for it
    Family("kimi_k3", ("kimi_k3",), tested=True, score_bias=True, modelopt_aliases=True),
)
_BY_TYPE = {t: f for f in FAMILIES for t in f.model_types}


def family_of(*model_types: str | None) -> Family:
    """The record of the first model_type a family covers (a config's text_config's, then its
    top level's), else GENERIC."""
    return next((_BY_TYPE[t] for t in model_types if isinstance(t, str) and t in _BY_TYPE), GENERIC)


def tested_names() -> tuple[str, ...]:
    """The model_types whose families the tests check (plan's note names them)."""
    return tuple(f.name for f in FAMILIES if f.tested and not f.strict)
