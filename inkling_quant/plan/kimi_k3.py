"""Kimi-K3 in `plan`: its text tensors as vLLM 0.33's loader reads them and places them at TP / EP,
and the KV cache and recurrent state vLLM 0.33 allocates for it (`vllm/models/kimi_k3/nvidia/`
model.py, kda.py, mla.py, read; its spec and grouping code was also run on CPU once,
docs/budget.md "Kimi-K3"). Its config is vLLM 0.33's KimiK3Config with a KimiLinearConfig
text_config (transformers 5.25 has no Kimi-K3).

Layers (text_config.linear_attn_config, its layer lists 1-based): KDA layers (Kimi Delta
Attention: q/k/v/g and b, f_a/f_b gate projections, short convolutions, a recurrent state per
head) and MLA layers (DeepSeek's latent attention without RoPE applied, with an output gate);
layer 0 (first_k_dense_replace) a dense MLP, the rest a latent MoE: a router and shared experts
on the hidden state, the routed experts on routed_expert_hidden_size between two replicated
projections. With attn_res_block_size, attention-residual norms and [1, H] projections per layer.

Caches: a KDA layer's state is a `MambaSpec` split by TP, a short-conv state (K - 1 rows of
3 x heads x head_dim, bf16) and a recurrent state (heads x head_dim x head_dim, fp32:
mamba_utils.py:296-320, kda.py:571-591); an MLA layer's cache an `MLAAttentionSpec` of
kv_lora_rank + qk_rope_head_dim per token in the model's dtype on every rank (mla.py:421-437).
vLLM sizes the attention block so one MLA page holds a KDA state (`_align_hybrid_block_size`,
platforms/interface.py:940-1131: a multiple of 128 for MLA) and pads the KDA page to it; with
prefix caching on (vLLM's default for hybrid models) the KDA state is kept in "align" mode,
2 blocks a request plus FlashKDA's prefill checkpoint block where vLLM picks FlashKDA (head_dim
128 with a gate_lower_bound, bf16, SM90/SM100: kda.py:363-380, 901-909), whatever the length.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from ..errors import ConfigError, UsageError
from ..errors import short_repr as _short
from ..model.fields import ConfigFields
from ..units import cdiv
from .kvcache import KDA, MLA, KVSpec
from .placement import HEADS, REPLICATED, TP_SPLIT, VOCAB

MLA_ALIGN = 128          # interface.py:1086-1088: the block a hybrid MLA model's is a multiple of
# "align" mode: 2 blocks, and FlashKDA's prefill checkpoint where vLLM picks FlashKDA (kda.py:363-380:
# head_dim 128, a gate_lower_bound, bf16; kv_cache_interface.py:1135-1141)
ALIGN_STATE_BLOCKS = 2
MIN_RANK_WIDTH = 256     # model.py:419-428: without EP, an expert's width per rank padded up to 256
# held in fp32 by vLLM (kda.py: the conv weights, A_log, dt_bias; the router's bias)
FP32_SUFFIXES = ("_conv1d.weight", ".A_log", ".dt_bias", ".e_score_correction_bias")


@dataclass(frozen=True)
class K3Dims:
    kda_layers: frozenset[int]      # 0-based
    kda_heads: int
    kda_head_dim: int
    conv_kernel: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    output_gate: bool
    latent: int                     # routed_expert_hidden_size
    latent_norm: bool
    attn_res: bool
    flash_kda: bool                 # FlashKDA prefill (its checkpoint block): head_dim 128 with a gate_lower_bound


def dims(t: ConfigFields, n: int) -> K3Dims:
    """The text config's keys as vLLM 0.33's KimiLinearConfig reads them (kimi_linear.py:11-161):
    `is_kda_layer(i) = i + 1 in kda_layers`."""
    lin = t.obj.get("linear_attn_config")
    if not isinstance(lin, dict):
        raise ConfigError(f"{t.where}linear_attn_config must be an object, got {_short(lin)}", path=t.source)
    a = ConfigFields(lin, f"{t.where}linear_attn_config.", t.source)
    kda = a.layer_list("kda_layers", n + 1)
    if 0 in kda:
        raise ConfigError(f"{a.where}kda_layers lists layers from 1 (vLLM's is_kda_layer: i + 1 in it), got 0",
                          path=t.source)
    if not a.bool("use_full_rank_gate", False):
        raise ConfigError(f"{a.where}use_full_rank_gate must be true: vLLM 0.33's Kimi-K3 KDA asserts it "
                          f"(kda.py:625-627)", path=t.source)
    latent = t.int("routed_expert_hidden_size") if t.obj.get("routed_expert_hidden_size") is not None \
        else t.int("hidden_size")
    return K3Dims(frozenset(i - 1 for i in kda), a.int("num_heads"), a.int("head_dim"),
                  a.int("short_conv_kernel_size", 4), t.int("q_lora_rank"), t.int("kv_lora_rank"),
                  t.int("qk_nope_head_dim"), t.int("qk_rope_head_dim", 0, lo=0), t.int("v_head_dim"),
                  t.bool("mla_use_output_gate", False), latent, t.bool("latent_moe_use_norm", False),
                  t.obj.get("attn_res_block_size") is not None,
                  a.int("head_dim") == 128 and lin.get("gate_lower_bound") is not None)


def held_dtype(name: str, dtype):
    """The dtype the tensor `name` (not quantized) is held in: fp32 for FP32_SUFFIXES, else `dtype`."""
    import torch

    return torch.float32 if name.endswith(FP32_SUFFIXES) else dtype


def tensors(t) -> Iterator[tuple[str, str, str, tuple[int, ...]]]:
    """(name, part, split, shape) of every text tensor but the routed experts, under the
    checkpoint's names without `language_model.model.`, split as vLLM 0.33 shards them
    (model.py, kda.py, mla.py): KDA's q/k/v/g/b, f_b and o by heads, f_a replicated, its
    convolutions and state parameters by heads; MLA's q_a and kv_a replicated, g/q_b/kv_b/o by
    heads; the dense MLP and shared experts by width; the router, latent projections and
    attention-residual projections replicated."""
    k, H = t.k3, t.hidden_size
    P, D, nh = k.kda_heads * k.kda_head_dim, k.kda_head_dim, t.num_attention_heads
    yield "embed_tokens.weight", "embed", VOCAB, (t.vocab_size, H)
    for i in range(t.num_hidden_layers):
        p, a = f"layers.{i}.", f"layers.{i}.self_attn."
        yield p + "input_layernorm.weight", "norm", REPLICATED, (H,)
        yield p + "post_attention_layernorm.weight", "norm", REPLICATED, (H,)
        if k.attn_res:
            for s in ("self_attention_res", "mlp_res"):
                yield p + f"{s}_norm.weight", "norm", REPLICATED, (H,)
                yield p + f"{s}_proj.weight", "other", REPLICATED, (1, H)
        if i in k.kda_layers:
            for n in ("q_proj", "k_proj", "v_proj", "g_proj"):
                yield a + f"{n}.weight", "attention", HEADS, (P, H)
            yield a + "b_proj.weight", "attention", HEADS, (k.kda_heads, H)
            yield a + "f_a_proj.weight", "attention", REPLICATED, (D, H)
            yield a + "f_b_proj.weight", "attention", HEADS, (P, D)
            for n in "qkv":
                yield a + f"{n}_conv1d.weight", "attention", HEADS, (P, 1, k.conv_kernel)
            yield a + "A_log", "attention", HEADS, (k.kda_heads,)
            yield a + "dt_bias", "attention", HEADS, (P,)
            yield a + "o_norm.weight", "norm", REPLICATED, (D,)
            yield a + "o_proj.weight", "attention", HEADS, (H, P)
        else:
            qk = k.qk_nope_head_dim + k.qk_rope_head_dim
            yield a + "q_a_proj.weight", "attention", REPLICATED, (k.q_lora_rank, H)
            yield a + "q_a_layernorm.weight", "norm", REPLICATED, (k.q_lora_rank,)
            yield a + "q_b_proj.weight", "attention", HEADS, (nh * qk, k.q_lora_rank)
            yield a + "kv_a_proj_with_mqa.weight", "attention", REPLICATED, (k.kv_lora_rank + k.qk_rope_head_dim, H)
            yield a + "kv_a_layernorm.weight", "norm", REPLICATED, (k.kv_lora_rank,)
            yield a + "kv_b_proj.weight", "attention", HEADS, (nh * (k.qk_nope_head_dim + k.v_head_dim), k.kv_lora_rank)
            yield a + "o_proj.weight", "attention", HEADS, (H, nh * k.v_head_dim)
            if k.output_gate:
                yield a + "g_proj.weight", "attention", HEADS, (nh * k.v_head_dim, H)
        if i in t.dense_layers:
            for n, shape in (("gate_proj", (t.dense_width, H)), ("up_proj", (t.dense_width, H)),
                             ("down_proj", (H, t.dense_width))):
                yield f"{p}mlp.{n}.weight", "dense_mlp", TP_SPLIT, shape
            continue
        m = p + "block_sparse_moe."
        yield m + "gate.weight", "router", REPLICATED, (t.n_routed_experts, H)
        yield m + "gate.e_score_correction_bias", "router", REPLICATED, (t.n_routed_experts,)
        if t.shared_width:
            for n, shape in (("gate_proj", (t.shared_width, H)), ("up_proj", (t.shared_width, H)),
                             ("down_proj", (H, t.shared_width))):
                yield f"{m}shared_experts.{n}.weight", "shared_expert", TP_SPLIT, shape
        yield m + "routed_expert_down_proj.weight", "other", REPLICATED, (k.latent, H)
        yield m + "routed_expert_up_proj.weight", "other", REPLICATED, (H, k.latent)
        if k.latent_norm:
            yield m + "routed_expert_norm.weight", "norm", REPLICATED, (k.latent,)
    yield "norm.weight", "norm", REPLICATED, (H,)
    if k.attn_res:
        yield "output_attn_res_norm.weight", "norm", REPLICATED, (H,)
        yield "output_attn_res_proj.weight", "other", REPLICATED, (1, H)
    yield "lm_head.weight", "lm_head", VOCAB, (t.vocab_size, H)


def check_parallel(t, tp: int) -> None:
    """What vLLM 0.33 asserts of TP for Kimi-K3 (config/model.py:1557-1563, mla.py:200-203,
    kda.py:613, and `divide` in its parallel layers)."""
    k = t.k3
    needs = [("num_attention_heads", t.num_attention_heads), ("linear_attn_config.num_heads", k.kda_heads)]
    needs += [("dense MLP width (intermediate_size)", t.dense_width)] if t.dense_width else []
    needs += [("shared-expert width", t.shared_width)] if t.shared_width else []
    for key, n in needs:
        if n % tp:
            raise UsageError(f"--tp {tp} does not divide {key} ({n}): vLLM splits it evenly across TP ranks")


def kv_specs(t, tp: int, block_size: int) -> tuple[list[KVSpec], int]:
    """Every cache spec of one GPU at TP = tp, and the attention block size vLLM 0.33 sets: the
    smallest multiple of max(128, --block-size) tokens whose MLA page holds a layer's KDA state
    (interface.py:1098-1112); every page that size, the KDA one padded up (l.1118-1131)."""
    k = t.k3
    token = (k.kv_lora_rank + k.qk_rope_head_dim) * t.dtype_bytes   # mla.py:160: the latent and the rope slice
    conv = (k.conv_kernel - 1) * 3 * k.kda_heads * k.kda_head_dim // tp * t.dtype_bytes  # mamba_cache_dtype auto
    state = k.kda_heads // tp * k.kda_head_dim ** 2 * 4                                # mamba_ssm_cache_dtype auto: fp32
    align = max(MLA_ALIGN, block_size)
    block = max(block_size, align * cdiv(conv + state, align * token)) if k.kda_layers else block_size
    blocks = ALIGN_STATE_BLOCKS + (k.flash_kda and t.dtype == "bfloat16")
    page = block * token
    out = []
    for i in range(t.num_hidden_layers):
        if i in k.kda_layers:
            out.append(KVSpec(KDA, 1, 0, 0, block, None, page, 1, block, conv + state, blocks))
        else:
            out.append(KVSpec(MLA, 1, k.kv_lora_rank + k.qk_rope_head_dim, 0, block, dtype_bytes=t.dtype_bytes))
    return out, block
