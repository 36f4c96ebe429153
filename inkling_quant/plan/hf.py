"""`inkling-quant plan` on a standard Hugging Face MoE config.json (Qwen3-MoE, Qwen2-MoE, Mixtral,
DeepSeek-V2/V3, Qwen3-VL-MoE, Llama 4, and others spelled the same way): the text model's
tensors, parameters, bytes on disk and per GPU, computed from the config alone. `plan.inkling2.plan`
plans with it as it does with the published Inkling 2 config; the KV cache specs are
`kvcache.hf_layer_specs`. docs/budget.md, "Standard Hugging Face MoE configs", lists what is
counted and where each split comes from.

Tensors counted, per the families' transformers modeling code (the tests compare with
`sum(p.numel() for p in model.parameters())` of models transformers builds):
embed [V, H]; per layer the attention (q/k/v/o with num_key_value_heads and head_dim, biases
where attention_bias / qkv_bias say, Qwen3's per-head q_norm/k_norm; or DeepSeek's MLA
projections), two norms, and either a dense MLP (intermediate_size; Llama 4's
intermediate_size_mlp) or the router [E, H] (+ DeepSeek-V3's e_score_correction_bias, a buffer),
the routed experts E x 3 x H x I, and shared experts (n_shared_experts x moe_intermediate_size,
or shared_expert_intermediate_size with its [1, H] gate, or Llama 4's one of intermediate_size);
the final norm; lm_head [V, H] unless tie_word_embeddings. The vision tower and projector are
not derived from a config: they are read from the checkpoint's shard headers when there is one.
DeepSeek-V4's tensors and caches follow their own rules (plan/deepseek_v4.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from ..model.families import family_of, tested_names
from ..model.fields import ConfigFields
from ..model.sources import source_quant
from ..errors import ConfigError, UsageError
from ..errors import short_repr as _short
from . import deepseek_v4, kimi_k3
from .placement import HEADS, KV_HEADS, REPLICATED, TP_SPLIT, VOCAB, Weights, add_experts, rank_bytes

# Keys that announce an attention or state kind the plan does not model (the first found is named).
UNMODELLED_KEYS = {
    "linear_num_value_heads": "linear attention (Gated DeltaNet) layers",
    "linear_num_key_heads": "linear attention (Gated DeltaNet) layers",
    "attn_type_list": "linear (lightning) attention layers",
    "layers_block_type": "Mamba / hybrid SSM layers",
    "hybrid_override_pattern": "Mamba / hybrid SSM layers",
    "attn_layer_period": "Mamba / hybrid SSM layers",
    "ssm_state_size": "SSM state",
    "mamba_d_state": "SSM state",
    "index_topk": "DeepSeek sparse attention's indexer cache",
    "linear_attn_config": "Kimi Delta Attention (KDA) layers outside Kimi-K3 (plan.kimi_k3)",
}
FULL_TYPES = ("full_attention", "attention")
DTYPES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class MLADims:
    """DeepSeek's multi-head latent attention (modeling_deepseek_v3.py DeepseekV3Attention)."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class HFText:
    """The text model's dimensions. The names that `plan.inkling2`, `moe_checks` and the schemes read
    are those of Inkling's TextConfig (n_routed_experts, moe_intermediate_size, ...)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int            # the expert width, whatever the config calls it
    dense_layers: frozenset[int]          # layers with a dense MLP instead of routed experts
    dense_width: int | None
    shared_width: int                     # 0: no shared experts
    shared_gate: bool                     # shared_expert_gate [1, H] (Qwen2-MoE's form)
    qk_norm: bool
    qkv_bias: bool
    o_bias: bool
    score_bias: bool                      # DeepSeek-V3's e_score_correction_bias [E] per MoE layer
    mla: MLADims | None
    sliding_window: int | None            # every layer's window, or None (full attention)
    tie_word_embeddings: bool
    dtype: str
    max_position_embeddings: int
    source_format: str | None = None      # a quantized source's format (model.sources: fp8_block, mxfp4)
    source_experts_only: bool = True      # only its routed experts are stored so (MXFP4), else its Linears (FP8)
    source_expert_format: str | None = None  # its routed experts' (DeepSeek-V4's MXFP4 beside FP8 Linears)
    v4: "deepseek_v4.V4Dims | None" = None  # DeepSeek-V4's attention and hyper-connections (plan.deepseek_v4)
    k3: "kimi_k3.K3Dims | None" = None      # Kimi-K3's KDA/MLA layers and latent MoE (plan.kimi_k3)

    @property
    def dtype_bytes(self) -> int:
        return DTYPES[self.dtype]

    @property
    def rules(self):
        """The plan module of a family planned by its own rules (plan.deepseek_v4, plan.kimi_k3:
        its tensors, TP checks and held dtypes), else None."""
        return deepseek_v4 if self.v4 is not None else kimi_k3 if self.k3 is not None else None

    @property
    def expert_hidden(self) -> int:
        """The width routed experts act on (Kimi-K3's latent MoE: routed_expert_hidden_size)."""
        return self.k3.latent if self.k3 is not None else self.hidden_size

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if i not in self.dense_layers]


@dataclass(frozen=True)
class HFModel:
    """A standard HF MoE config.json: `raw` as read, `text` its text model, `vision` the vision
    tower's and projector's (name, shape, bytes) from the shard headers (None: not counted)."""

    raw: dict
    text: HFText
    source: str
    vision: tuple[tuple[str, tuple[int, ...], int], ...] | None = None
    notes: tuple[str, ...] = field(default=())

    @classmethod
    def from_dict(cls, d: dict, source: str = "config.json", vision=None) -> "HFModel":
        text, notes = _text(d, source)
        if isinstance(d.get("vision_config"), dict) and not vision:
            notes.append("vision tower not counted: " + (
                "no checkpoint weights to read its shapes from (give the checkpoint directory)" if vision is None
                else "no tensor of the checkpoint is under a known vision-tower or projector prefix"))
        return cls(d, text, source, vision, tuple(notes))

    @property
    def family(self):
        """The record of its family (model/families.py)."""
        return family_of(self.text.model_type, self.raw.get("model_type"))

    @classmethod
    def from_config(cls, d: dict, source: str, root: Path | None = None) -> "HFModel":
        """From config.json's object; `root`, a checkpoint directory, adds its vision tower."""
        return cls.from_dict(d, source, _vision_from_headers(root) if root else None)


def is_hf_moe(d) -> bool:
    """Whether `plan` reads a config.json as a standard HF config rather than Inkling 2's."""
    from ..model.inkling2 import Inkling2Config  # imports torch: here, so that `plan --help` need not

    return isinstance(d, dict) and not Inkling2Config.describes(d)


# --------------------------------------------------------------------------- reading the config
def _text(d: dict, source: str) -> tuple[HFText, list[str]]:
    from ..model.layout import MoEConfig

    moe = MoEConfig.from_dict(d, source)  # the one check of what the config holds; then what plan models
    t = ConfigFields(d["text_config"] if moe.nested else d, "text_config." if moe.nested else "", source)
    o, mt, notes, family = t.obj, moe.model_type, [], moe.family
    v4 = deepseek_v4.dims(t, moe.num_hidden_layers) if family.name == "deepseek_v4" else None
    k3 = kimi_k3.dims(t, moe.num_hidden_layers) if family.name == "kimi_k3" else None
    if v4 is None and k3 is None:  # their attention is modelled by their own rules
        _refuse_unmodelled(d, source)
    if v4 is not None:
        notes.append("DeepSeek-V4: the KV caches vLLM 0.33 allocates for it (fp8_ds_mla, packed block-outermost, "
                     "the same on every TP rank); its compressor states' windows grow with the tokens in flight, "
                     "not with --max-model-len (docs/budget.md)")
    if k3 is not None:
        notes.append("Kimi-K3: its KDA layers' state as vLLM 0.33 keeps it with prefix caching on (its default for "
                     "hybrid models: 2 blocks a request per group, 3 with FlashKDA's checkpoint), its MLA layers' "
                     "latent on every TP rank (docs/budget.md)")
    heads = t.int("num_attention_heads")
    kv = heads if o.get("num_key_value_heads") is None else t.int("num_key_value_heads", hi=heads)
    if o.get("head_dim") is None and moe.hidden_size % heads and k3 is None:  # K3's widths are its MLA/KDA keys
        raise ConfigError(f"{t.where}num_attention_heads {heads} does not divide hidden_size {moe.hidden_size} and "
                          f"there is no head_dim: the attention's width is not in the config", path=source)
    head_dim = moe.hidden_size // heads if o.get("head_dim") is None else t.int("head_dim")
    if o.get("moe_layer_freq") not in (None, 1):  # null is 1, as convert, verify and the layout read it
        raise ConfigError(f"{t.where}moe_layer_freq {_short(o['moe_layer_freq'])}: MoE layers other than "
                          f"every layer after first_k_dense_replace are not modelled", path=source)
    dense = moe.dense_layers or frozenset()
    dense_key = family.dense_width_key
    dense_width = t.int(dense_key) if dense else None
    if dense and dense_key == "intermediate_size" and "moe_intermediate_size" not in o:
        raise ConfigError(f"{t.where}intermediate_size is the expert width here, and the config names dense "
                          f"layers {sorted(dense)}: their width is not in the config", path=source)
    shared, gate = _shared(t, moe.expert_width, family.shared_expert_per_layer)
    mla = _mla(t) if o.get("kv_lora_rank") is not None and k3 is None else None
    if mla is not None:
        notes.append("MLA: vLLM's MLAAttentionSpec caches one latent of kv_lora_rank + qk_rope_head_dim per token "
                     "and layer on every GPU (not split by TP)")
    if _count(t, "num_nextn_predict_layers"):
        notes.append("num_nextn_predict_layers: the MTP layer(s) are not counted (transformers does not build "
                     "them; vLLM loads them only for MTP speculative decoding)")
    window, bias = (None if v4 else _window(t, notes)), t.bool("attention_bias", False)
    sq = source_quant(d, source)
    text = HFText(
        model_type=mt, vocab_size=t.int("vocab_size"), hidden_size=moe.hidden_size,
        num_hidden_layers=moe.num_hidden_layers, num_attention_heads=heads, num_key_value_heads=kv,
        head_dim=head_dim, n_routed_experts=moe.num_experts, num_experts_per_tok=moe.num_experts_per_tok,
        moe_intermediate_size=moe.expert_width, dense_layers=dense, dense_width=dense_width, shared_width=shared,
        shared_gate=gate, qk_norm=family.qk_norm, qkv_bias=t.bool("qkv_bias", family.qkv_bias) or bias,
        o_bias=bias,
        score_bias=family.score_bias or o.get("topk_method") == "noaux_tc", mla=mla, sliding_window=window,
        tie_word_embeddings=_tie(d, t, source), dtype=_dtype(d, t, source),
        max_position_embeddings=t.int("max_position_embeddings", hi=1 << 40),
        source_format=sq.format if sq else None, source_experts_only=sq.experts_only if sq else True,
        source_expert_format=sq.expert_format if sq else None, v4=v4, k3=k3)
    if not family.tested:
        notes.append(f"model_type {mt!r}: not one of the families whose counts were checked against transformers "
                     f"({', '.join(tested_names())}); the generic rules apply (docs/budget.md)")
    if sq is not None:
        notes.append(f"a quantized source ({sq.describe()}): the figures are for what convert writes from it: "
                     + ("" if sq.experts_only else "the FP8 projections outside the routed experts kept FP8 (ModelOpt's "
                        "FP8_PB_WO: 1 byte per weight and an fp32 scale per 128x128 tile; DeepSeek-V4's form keeps "
                        "its UE8M0 scales, 1 byte each), ")
                     + "the routed experts per --scheme (as stored where it leaves them alone)")
    elif isinstance(d.get("quantization_config"), dict) or isinstance(o.get("quantization_config"), dict):
        notes.append("config.json has a quantization_config: the figures are for converting the BF16 model "
                     "with --scheme, not for this checkpoint's own quantization")
    return text, notes


def _refuse_unmodelled(d: dict, source: str) -> None:
    t = d["text_config"] if isinstance(d.get("text_config"), dict) else d
    where = "text_config." if t is not d else ""
    for key, what in UNMODELLED_KEYS.items():
        if t.get(key) is not None:
            raise ConfigError(f"{where}{key} is set: {what} are not modelled by plan (full attention, sliding "
                              f"window and DeepSeek MLA are)", path=source)
    types = t.get("layer_types")
    if types is None:
        return
    if not isinstance(types, list) or not all(isinstance(x, str) for x in types):
        raise ConfigError(f"{where}layer_types must be a list of strings, got {_short(types)}", path=source)
    known = {*FULL_TYPES, "sliding_attention", "chunked_attention"}
    for i, kind in enumerate(types):
        if kind not in known:
            raise ConfigError(f"{where}layer_types[{i}] is {kind!r}: that attention kind is not modelled by plan "
                              f"(only {', '.join(sorted(known))})", path=source)
    if "sliding_attention" in types and set(types) != {"sliding_attention"}:
        raise ConfigError(f"{where}layer_types mixes sliding_attention with other kinds: per-layer sliding "
                          f"windows are not modelled by plan (a window in every layer, or none, is)", path=source)


def _window(t: ConfigFields, notes: list[str]) -> int | None:
    """The one sliding window of every layer, as vLLM 0.33 sets CacheConfig.sliding_window: from
    hf_text_config.sliding_window when layer_types is absent or all sliding (engine/arg_utils.py:
    2288-2294); 0 means none (config/model.py:815-821); use_sliding_window false means none
    (transformers' Qwen configs null the window then)."""
    o = t.obj
    types = o.get("layer_types") or []
    if "chunked_attention" in types or o.get("attention_chunk_size") is not None:
        notes.append("chunked local attention (attention_chunk_size) is allocated as full attention: vLLM "
                     "disables the hybrid KV cache manager for it by default (config/vllm.py:2236-2255, "
                     "v1/core/kv_cache_planning.py:744-876)")
    if o.get("sliding_window") is None or o.get("use_sliding_window") is False or o["sliding_window"] == 0:
        return None
    if types and set(types) != {"sliding_attention"}:
        return None  # a window beside full-attention layer_types: vLLM leaves CacheConfig's unset
    w = t.int("sliding_window", hi=1 << 40)
    notes.append(f"sliding window {w} in every layer (sliding_window; vLLM's SlidingWindowSpec)")
    return w


def _count(t: ConfigFields, key: str) -> int:
    """An optional non-negative integer key (absent or null: 0)."""
    return 0 if t.obj.get(key) is None else t.int(key, lo=0)


def _shared(t: ConfigFields, width: int, per_layer: bool) -> tuple[int, bool]:
    # DeepSeek (Kimi-K3: num_shared_experts, kimi_linear.py:35): one MLP of n x moe_intermediate_size
    if n := _count(t, "n_shared_experts") or _count(t, "num_shared_experts"):
        return n * width, False
    if w := _count(t, "shared_expert_intermediate_size"):  # Qwen2-MoE (and vLLM's Qwen3-MoE)
        return w, True
    return (width, False) if per_layer else (0, False)  # Llama 4: one shared expert per MoE layer


def _mla(t: ConfigFields) -> MLADims:
    o = t.obj
    return MLADims(None if o.get("q_lora_rank") is None else t.int("q_lora_rank"), t.int("kv_lora_rank"),
                   t.int("qk_nope_head_dim"), t.int("qk_rope_head_dim"), t.int("v_head_dim"))


def _tie(d: dict, t: ConfigFields, source: str) -> bool:
    """transformers ties on the top-level key (Qwen3-VL-MoE's text_config says true, its top level
    false, and its lm_head is a separate tensor); absent everywhere: false."""
    for obj, where in ((d, ""), (t.obj, t.where)):
        if "tie_word_embeddings" in obj:
            v = obj["tie_word_embeddings"]
            if not isinstance(v, bool):
                raise ConfigError(f"{where}tie_word_embeddings must be true or false, got {_short(v)}", path=source)
            return v
    return False


def _dtype(d: dict, t: ConfigFields, source: str) -> str:
    for fields in (t, ConfigFields(d, "", source)):
        for key in ("dtype", "torch_dtype"):
            if fields.obj.get(key) is not None:
                return fields.choice(key, DTYPES, "bfloat16")
    return "bfloat16"


def _vision_from_headers(root: Path):
    """(name, shape, bytes) of every vision-tower and projector tensor in the checkpoint's shard
    headers, or None when the directory holds no weights."""
    from ..io.checkpoint import INDEX_NAME, SINGLE_NAME, Checkpoint
    from ..model.layout import PROJECTOR_PREFIXES, VISION_PREFIXES

    if not ((root / INDEX_NAME).exists() or (root / SINGLE_NAME).exists()):
        return None
    out = []
    for h in Checkpoint.open(root).headers().values():
        out += [(e.name, e.shape, e.nbytes) for e in h.tensors.values()
                if e.name.startswith(VISION_PREFIXES + PROJECTOR_PREFIXES)]
    return tuple(sorted(out))


def _kept_by_source(t: HFText, name: str, part: str) -> bool:
    """Whether a quantized source stores this tensor in its format and convert keeps it so: an
    FP8 source's projections outside the routed experts (attention, dense MLPs, shared experts;
    FineGrainedFP8's Linear modules, not the routers, norms, embeddings or LM head)."""
    if t.source_format is None or t.source_experts_only:
        return False
    if t.v4 is not None:
        return deepseek_v4.is_fp8(name)
    return part in ("attention", "dense_mlp", "shared_expert") and name.endswith(("_proj.weight", "_mqa.weight"))


# --------------------------------------------------------------------------- tensors
def text_tensors(t: HFText) -> Iterator[tuple[str, str, str, tuple[int, ...]]]:
    """(name, part, split, shape) of every text tensor but the routed experts, under
    transformers' names without the model prefix. Splits as vLLM 0.33's generic layers shard them."""
    if t.rules is not None:
        yield from t.rules.tensors(t)
        return
    H, V = t.hidden_size, t.vocab_size
    yield "embed_tokens.weight", "embed", VOCAB, (V, H)       # VocabParallelEmbedding (qwen3_moe.py:468)
    for i in range(t.num_hidden_layers):
        p = f"layers.{i}."
        yield from _attention(t, p)
        for n in ("input_layernorm", "post_attention_layernorm"):
            yield f"{p}{n}.weight", "norm", REPLICATED, (H,)
        if i in t.dense_layers:  # MergedColumnParallel gate/up + RowParallel down: 1/TP each
            for n, shape in _mlp(H, t.dense_width):
                yield f"{p}mlp.{n}.weight", "dense_mlp", TP_SPLIT, shape
            continue
        yield f"{p}mlp.gate.weight", "router", REPLICATED, (t.n_routed_experts, H)   # GateLinear: replicated
        if t.score_bias:
            yield f"{p}mlp.gate.e_score_correction_bias", "router", REPLICATED, (t.n_routed_experts,)
        if t.shared_width:
            for n, shape in _mlp(H, t.shared_width):
                yield f"{p}mlp.shared_experts.{n}.weight", "shared_expert", TP_SPLIT, shape
            if t.shared_gate:
                yield f"{p}mlp.shared_expert_gate.weight", "shared_expert", REPLICATED, (1, H)
    yield "norm.weight", "norm", REPLICATED, (H,)
    if not t.tie_word_embeddings:
        yield "lm_head.weight", "lm_head", VOCAB, (V, H)       # ParallelLMHead (qwen3_moe.py:580)


def _mlp(H: int, width: int):
    return (("gate_proj", (width, H)), ("up_proj", (width, H)), ("down_proj", (H, width)))


def _attention(t: HFText, p: str):
    H, nh, a = t.hidden_size, t.num_attention_heads, f"{p}self_attn."
    if t.mla is not None:  # deepseek_v2.py:494-540: the a-projections replicated, b/o by heads
        m = t.mla
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        if m.q_lora_rank is None:
            yield f"{a}q_proj.weight", "attention", HEADS, (nh * qk, H)
        else:
            yield f"{a}q_a_proj.weight", "attention", REPLICATED, (m.q_lora_rank, H)
            yield f"{a}q_a_layernorm.weight", "norm", REPLICATED, (m.q_lora_rank,)
            yield f"{a}q_b_proj.weight", "attention", HEADS, (nh * qk, m.q_lora_rank)
        yield f"{a}kv_a_proj_with_mqa.weight", "attention", REPLICATED, (m.kv_lora_rank + m.qk_rope_head_dim, H)
        yield f"{a}kv_a_layernorm.weight", "norm", REPLICATED, (m.kv_lora_rank,)
        yield f"{a}kv_b_proj.weight", "attention", HEADS, (nh * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank)
        yield f"{a}o_proj.weight", "attention", HEADS, (H, nh * m.v_head_dim)
        if t.o_bias:  # DeepseekV3Attention: attention_bias on q_a (or q), kv_a and o
            first = "q_proj" if m.q_lora_rank is None else "q_a_proj"
            yield f"{a}{first}.bias", "attention", HEADS if m.q_lora_rank is None else REPLICATED, \
                (nh * qk if m.q_lora_rank is None else m.q_lora_rank,)
            yield f"{a}kv_a_proj_with_mqa.bias", "attention", REPLICATED, (m.kv_lora_rank + m.qk_rope_head_dim,)
            yield f"{a}o_proj.bias", "attention", REPLICATED, (H,)
        return
    hd, kv = t.head_dim, t.num_key_value_heads
    # QKVParallelLinear (q by heads, k/v by KV heads, replicated below TP), RowParallelLinear o
    yield f"{a}q_proj.weight", "attention", HEADS, (nh * hd, H)
    yield f"{a}k_proj.weight", "attention", KV_HEADS, (kv * hd, H)
    yield f"{a}v_proj.weight", "attention", KV_HEADS, (kv * hd, H)
    yield f"{a}o_proj.weight", "attention", HEADS, (H, nh * hd)
    if t.qkv_bias:
        yield f"{a}q_proj.bias", "attention", HEADS, (nh * hd,)
        yield f"{a}k_proj.bias", "attention", KV_HEADS, (kv * hd,)
        yield f"{a}v_proj.bias", "attention", KV_HEADS, (kv * hd,)
    if t.o_bias:  # RowParallelLinear's bias: whole on every rank
        yield f"{a}o_proj.bias", "attention", REPLICATED, (H,)
    if t.qk_norm:
        yield f"{a}q_norm.weight", "norm", REPLICATED, (hd,)
        yield f"{a}k_norm.weight", "norm", REPLICATED, (hd,)


# --------------------------------------------------------------------------- parameters and bytes
def param_counts(m: HFModel):
    """Parameters as transformers counts them (`model.parameters()`: e_score_correction_bias is a
    buffer; a tied lm_head counted once, as the embedding)."""
    from ..model.inkling2 import ParamCounts

    t = m.text
    per_expert = 3 * t.expert_hidden * t.moe_intermediate_size
    counts = {"embed": 0, "lm_head": 0, "other": 0}
    for name, part, _, shape in text_tensors(t):
        if not name.endswith("e_score_correction_bias") and not deepseek_v4.is_buffer(name):
            counts[part if part in counts else "other"] += math.prod(shape)
    n_moe = len(t.moe_layers)
    return ParamCounts(routed_experts=n_moe * t.n_routed_experts * per_expert, embed=counts["embed"],
                       lm_head=counts["lm_head"], text_other=counts["other"],
                       vision=sum(math.prod(s) for _, s, _ in m.vision or ()),
                       active_experts=n_moe * t.num_experts_per_tok * per_expert)


def check_parallel(t: HFText, tp: int) -> None:
    """What vLLM's parallel layers assert of the text model at TP = tp."""
    if tp < 1:
        raise UsageError(f"--tp must be at least 1, got {tp}")
    if t.rules is not None:
        return t.rules.check_parallel(t, tp)
    needs = [("num_attention_heads", t.num_attention_heads)]
    needs += [("dense MLP width (intermediate_size)", t.dense_width)] if t.dense_width else []
    needs += [("shared-expert width", t.shared_width)] if t.shared_width else []
    for key, n in needs:
        if n % tp:
            raise UsageError(f"--tp {tp} does not divide {key} ({n}): vLLM splits it evenly across TP ranks")
    kv = t.num_key_value_heads
    if t.mla is None and (kv % tp if kv >= tp else tp % kv):
        raise UsageError(f"--tp {tp} and num_key_value_heads ({kv}): vLLM needs one to divide the other "
                         f"(KV heads split, or replicated, over TP ranks; qwen3_moe.py:268-275)")


def weight_bytes(m: HFModel, scheme_name: str, tp: int, ep: bool = True) -> Weights:
    """Bytes on disk per (part, format) and on the fullest rank at TP = tp (experts: EP = tp, or
    TP-sharded without EP). The scheme names each routed-expert layer's format; everything else
    is as stored, in the config's dtype; the vision tower and projector as their headers say."""
    import torch

    from ..formats import FORMATS, get_format
    from ..model.layout import PROJECTOR_PREFIXES
    from ..schemes import get_scheme

    scheme, t, w = get_scheme(scheme_name), m.text, Weights()
    dtype, stored = getattr(torch, t.dtype), FORMATS["passthrough"]  # schemes quantize routed experts only
    src = get_format(t.source_format, source=True) if t.source_format else None
    for name, part, split, shape in text_tensors(t):
        fmt = src if _kept_by_source(t, name, part) else stored
        nbytes = deepseek_v4.fp8_bytes(fmt, shape) if t.v4 and fmt is src else fmt.nbytes(shape, t.rules.held_dtype(name, dtype) if t.rules else dtype)
        w.add(part, fmt.name, nbytes, rank_bytes(nbytes, shape[0], split, tp, t.num_key_value_heads),
              math.prod(shape), split)

    # experts the scheme leaves alone stay as the source stores them
    kept = get_format(t.source_expert_format or t.source_format, source=True) if t.source_format else None
    add_experts(w, t, scheme, t.moe_layers, tp, ep, dtype, kept=kept,
                min_rank_width=kimi_k3.MIN_RANK_WIDTH if t.k3 is not None else 0)
    for name, shape, nbytes in m.vision or ():  # replicated: the upper bound
        part = "projector" if name.startswith(PROJECTOR_PREFIXES) else "vision"
        w.add(part, stored.name, nbytes, nbytes, math.prod(shape), REPLICATED)
    return w

