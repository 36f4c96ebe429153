"""The Inkling 2 Small tensor layout: model dimensions and the tensor-name grammar.

This is the only module that parses tensor names. `classify(name)` turns a checkpoint name
into a `TensorName` record; `expected_tensors(cfg)` lists every tensor of a BF16 source
checkpoint with its shape and dtype. Both read dimensions from `config.json` (a `ModelConfig`),
never from literals, so a checkpoint with other dimensions works unchanged.
docs/layout.md is the human-readable version of this file.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Iterator

import torch

from .config_fields import MAX_LAYERS, ConfigFields
from .errors import CheckpointError, ConfigError, UnknownTensorError
from .errors import short_repr as _short
from .formats import SCALE_SUFFIXES
from .inkling2 import Inkling2Config
from .tensors import TensorName, TensorSpec  # noqa: F401 (the commands import them from here too)

# the invented layout the commands still use until they move to inkling2 (issue 14)
REFERENCE_CONFIG = Path(__file__).parent / "configs" / "inkling-2-small-legacy.json"

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
FUSED_PROJECTIONS = ("gate_proj", "up_proj")  # an expert's pair vLLM fuses into one w13, in w13's order
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "g_proj")
QUANT_SUFFIXES = SCALE_SUFFIXES  # what a quantized checkpoint adds beside `weight`: the formats' vocabulary


# --------------------------------------------------------------------------- config
# Bounds on config.json values: a config is untrusted input, and shapes and loops come from it.
_MAX_DIM = 1 << 24                 # any one tensor dimension (vocab, hidden, heads, ...)
_MAX_LAYERS = 1 << 12              # decoder layers, vision blocks, draft layers
_MAX_EXPERT_MODULES = 1 << 20      # layers x experts
_LIMITS = {"num_hidden_layers": _MAX_LAYERS, "depth": _MAX_LAYERS, "num_experts": 1 << 16,
           "max_position_embeddings": 1 << 40, "sliding_window": 1 << 40}




@dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    patch_size: int
    in_channels: int
    spatial_merge_size: int
    out_hidden_size: int


@dataclass(frozen=True)
class DraftConfig:
    num_hidden_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_speculative_tokens: int
    num_target_hidden_states: int
    markov_hidden_size: int


@dataclass(frozen=True)
class ModelConfig:
    """The dimensions of an Inkling 2 Small-shaped model, read from its config.json."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    full_attention_num_key_value_heads: int
    full_attention_head_dim: int
    layer_types: tuple[str, ...]
    sliding_window: int
    relative_attention_num_buckets: int
    short_conv_kernel_size: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    vision: VisionConfig | None
    draft: DraftConfig | None
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_dict(cls, d: dict, source: str = "config.json") -> "ModelConfig":
        """Validate an (untrusted) config.json: every dimension an integer in a sane range (no bool,
        float or string coerced), so no shape computed from it is negative or absurd and no loop over
        layers or experts runs unbounded; any defect is a ConfigError naming the key."""
        if not isinstance(d, dict):
            raise ConfigError(f"expected a JSON object, got {type(d).__name__}", path=source)

        def need(obj: dict, key: str, where: str = ""):
            if key not in obj:
                raise ConfigError(f"missing key {where}{key!r}", path=source)
            return obj[key]

        def section(key: str, where: str = "", obj: dict = d) -> dict | None:
            v = obj.get(key)
            if v is not None and not isinstance(v, dict):
                raise ConfigError(f"{where}{key} must be an object, got {_short(v)}", path=source)
            return v

        def integer(v, key: str, lo: int = 1, hi: int = _MAX_DIM) -> int:
            if type(v) is not int:  # not bool, not 4096.0, not "4096"
                raise ConfigError(f"{key} must be an integer, got {_short(v)}", path=source)
            if not lo <= v <= hi:
                raise ConfigError(f"{key} must be between {lo} and {hi}, got {_short(v)}", path=source)
            return v

        def ints(obj: dict, keys, where: str = "") -> dict[str, int]:
            return {k: integer(need(obj, k, where), where + k, 1, _LIMITS.get(k, _MAX_DIM)) for k in keys}

        n_layers = integer(need(d, "num_hidden_layers"), "num_hidden_layers", 1, _MAX_LAYERS)
        layer_types = need(d, "layer_types")
        if not isinstance(layer_types, list) or not all(isinstance(t, str) for t in layer_types):
            raise ConfigError(f"layer_types must be a list of strings, got {_short(layer_types)}", path=source)
        layer_types = tuple(layer_types)
        if len(layer_types) != n_layers:
            raise ConfigError(f"layer_types has {len(layer_types)} entries, "
                              f"num_hidden_layers is {n_layers}", path=source)
        bad = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
        if bad:
            raise ConfigError(f"unknown layer_types {_short(bad)}", path=source)
        vision = None
        if (v := section("vision_config")) is not None:
            vision = VisionConfig(**ints(v, VisionConfig.__dataclass_fields__, "vision_config."))
        draft = None
        if (s := section("dspark_config")) is not None:
            markov = need(s, "markov_head", "dspark_config.")
            if not isinstance(markov, dict):
                raise ConfigError(f"dspark_config.markov_head must be an object, got {_short(markov)}", path=source)
            draft = DraftConfig(
                markov_hidden_size=integer(need(markov, "hidden_size", "dspark_config.markov_head."),
                                           "dspark_config.markov_head.hidden_size"),
                **ints(s, [k for k in DraftConfig.__dataclass_fields__ if k != "markov_hidden_size"],
                       "dspark_config."))
        top = ints(d, ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                       "sliding_window", "relative_attention_num_buckets", "short_conv_kernel_size",
                       "num_experts", "num_experts_per_tok", "moe_intermediate_size", "max_position_embeddings"))
        if top["num_experts_per_tok"] > top["num_experts"]:
            raise ConfigError(f"num_experts_per_tok ({top['num_experts_per_tok']}) exceeds "
                              f"num_experts ({top['num_experts']})", path=source)
        if n_layers * top["num_experts"] > _MAX_EXPERT_MODULES:
            raise ConfigError(f"{n_layers} layers x {top['num_experts']} experts is more than "
                              f"{_MAX_EXPERT_MODULES} expert modules", path=source)
        full_kv = integer(d.get("full_attention_num_key_value_heads", top["num_key_value_heads"]),
                          "full_attention_num_key_value_heads")
        full_hd = integer(d.get("full_attention_head_dim", top["head_dim"]), "full_attention_head_dim")
        tie = d.get("tie_word_embeddings", False)
        if tie is None:
            tie = False
        if not isinstance(tie, bool):
            raise ConfigError(f"tie_word_embeddings must be true or false, got {_short(tie)}", path=source)
        return cls(num_hidden_layers=n_layers, layer_types=layer_types, full_attention_num_key_value_heads=full_kv,
                   full_attention_head_dim=full_hd, tie_word_embeddings=tie, vision=vision, draft=draft,
                   raw=dict(d), **top)

    @classmethod
    def load(cls, path: str | Path) -> "ModelConfig":
        from .io.checkpoint import read_json, safe_child  # the one untrusted-JSON reader (size cap, FIFO, depth)

        path = Path(path)
        if path.is_dir():  # a checkpoint's config.json: a symlink leaving the checkpoint is refused, as for shards
            path = safe_child(path, "config.json")
        return cls.from_dict(read_json(path, "config.json", ConfigError), str(path))

    @classmethod
    def reference(cls) -> "ModelConfig":
        return cls.load(REFERENCE_CONFIG)

    # Attention geometry per layer: full-attention layers use their own head_dim / KV heads.
    def is_full_attention(self, layer: int) -> bool:
        return self.layer_types[layer] == "full_attention"

    def attention_dims(self, layer: int) -> tuple[int, int, int]:
        """(num_heads, num_kv_heads, head_dim) of decoder layer `layer`."""
        if self.is_full_attention(layer):
            return self.num_attention_heads, self.full_attention_num_key_value_heads, self.full_attention_head_dim
        return self.num_attention_heads, self.num_key_value_heads, self.head_dim

    @cached_property
    def full_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if self.is_full_attention(i))


def model_config(d: dict, source: str) -> "ModelConfig | Inkling2Config":
    """A checkpoint's config.json in either layout: the published model's when it nests
    `text_config` (inkling2), else the legacy layout's. The one place a command decides which."""
    return Inkling2Config.from_dict(d, source) if Inkling2Config.describes(d) else ModelConfig.from_dict(d, source)


# --------------------------------------------------------------------------- names
PARTS = ("embed", "attention", "attn_sink", "rel_bias", "short_conv", "attn_res", "norm", "router",
         "expert", "vision", "draft", "lm_head")

_L = r"(?P<layer>\d+)"
_W = rf"(?P<suffix>weight|{'|'.join(SCALE_SUFFIXES)})"
# Every tensor name of the layout, as (pattern, part); named groups give layer, expert,
# projection and suffix. Quantized checkpoints add weight_scale/_2 and input_scale suffixes.
_RULES: list[tuple[re.Pattern, str]] = [(re.compile(p), part) for p, part in [
    (rf"model\.layers\.{_L}\.mlp\.experts\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.{_W}", "expert"),
    (rf"model\.layers\.{_L}\.mlp\.gate\.(?P<suffix>weight|e_score_correction_bias)", "router"),
    (rf"model\.layers\.{_L}\.self_attn\.(?P<proj>[qkvog]_proj)\.{_W}", "attention"),
    (rf"model\.layers\.{_L}\.self_attn\.(?P<suffix>sinks)", "attn_sink"),
    (rf"model\.layers\.{_L}\.self_attn\.rel_bias\.(?P<suffix>weight)", "rel_bias"),
    (rf"model\.layers\.{_L}\.(?:self_attn|mlp)\.(?P<proj>[qkv]_conv|input_conv)\.(?P<suffix>weight)", "short_conv"),
    (rf"model\.layers\.{_L}\.attn_res\.(?P<suffix>attn_query|mlp_query)", "attn_res"),
    (rf"model\.layers\.{_L}\.(?P<proj>input_layernorm|post_attention_layernorm)\.(?P<suffix>weight)", "norm"),
    (r"model\.attn_res\.(?P<suffix>final_query)", "attn_res"),
    (r"model\.norm\.(?P<suffix>weight)", "norm"),
    (r"model\.embed_tokens\.(?P<suffix>weight)", "embed"),
    (r"lm_head\.(?P<suffix>weight)", "lm_head"),
    (rf"model\.visual\.blocks\.{_L}\.(?P<proj>norm1|norm2|attn\.qkv|attn\.proj|mlp\.fc1|mlp\.fc2)\.(?P<suffix>weight|bias)", "vision"),
    (r"model\.visual\.(?P<proj>patch_embed\.proj|merger\.ln_q|merger\.mlp\.0|merger\.mlp\.2)\.(?P<suffix>weight|bias)", "vision"),
    (rf"dspark\.layers\.{_L}\.(?P<proj>self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj|input_layernorm|post_attention_layernorm)\.(?P<suffix>weight)", "draft"),
    (r"dspark\.(?P<proj>fc|norm|markov_head\.lm_head)\.(?P<suffix>weight)", "draft"),
    (r"dspark\.(?P<proj>markov_head\.rnn)\.(?P<suffix>weight_ih|weight_hh|bias_ih|bias_hh)", "draft"),
]]


def natural_key(name: str) -> list[tuple[int, int, str]]:
    """Sort key for tensor/module names: numeric components as numbers (layer 2 before 10)."""
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.split(".")]


def classify(name: str) -> TensorName:
    """Classify a checkpoint tensor name; raise UnknownTensorError for a name outside the layout."""
    for pattern, part in _RULES:
        m = pattern.fullmatch(name)
        if m:
            g = m.groupdict()
            as_int = lambda k: int(g[k]) if g.get(k) is not None else None  # noqa: E731
            return TensorName(name, part, as_int("layer"), as_int("expert"), g.get("proj"), g["suffix"])
    raise UnknownTensorError(f"tensor {name!r} is not part of the Inkling 2 Small layout (docs/layout.md)", tensor=name)


# --------------------------------------------------------------------------- expected tensors
BF16, FP32 = torch.bfloat16, torch.float32


def expert_shape(cfg: ModelConfig, projection: str) -> tuple[int, int]:
    """[out, in] of a routed-expert projection."""
    if projection == "down_proj":
        return (cfg.hidden_size, cfg.moe_intermediate_size)
    return (cfg.moe_intermediate_size, cfg.hidden_size)


def _decoder_layer(cfg: ModelConfig, i: int, experts: bool = True) -> Iterator[TensorSpec]:
    H, k = cfg.hidden_size, cfg.short_conv_kernel_size
    nh, nkv, hd = cfg.attention_dims(i)
    q, kv = nh * hd, nkv * hd
    p = f"model.layers.{i}."
    yield TensorSpec(p + "attn_res.attn_query", (H,), FP32)
    yield TensorSpec(p + "input_layernorm.weight", (H,), BF16)
    for name, shape in (("q_proj", (q, H)), ("k_proj", (kv, H)), ("v_proj", (kv, H)),
                        ("o_proj", (H, q)), ("g_proj", (q, H))):
        yield TensorSpec(p + f"self_attn.{name}.weight", shape, BF16)
    yield TensorSpec(p + "self_attn.q_conv.weight", (q, 1, k), BF16)
    yield TensorSpec(p + "self_attn.k_conv.weight", (kv, 1, k), BF16)
    yield TensorSpec(p + "self_attn.v_conv.weight", (kv, 1, k), BF16)
    yield TensorSpec(p + "self_attn.rel_bias.weight", (cfg.relative_attention_num_buckets, nh), BF16)
    yield TensorSpec(p + "self_attn.sinks", (nh,), FP32)
    yield TensorSpec(p + "attn_res.mlp_query", (H,), FP32)
    yield TensorSpec(p + "post_attention_layernorm.weight", (H,), BF16)
    yield TensorSpec(p + "mlp.input_conv.weight", (H, 1, k), BF16)
    yield TensorSpec(p + "mlp.gate.weight", (cfg.num_experts, H), BF16)
    yield TensorSpec(p + "mlp.gate.e_score_correction_bias", (cfg.num_experts,), FP32)
    for e in range(cfg.num_experts if experts else 0):
        for proj in PROJECTIONS:
            yield TensorSpec(p + f"mlp.experts.{e}.{proj}.weight", expert_shape(cfg, proj), BF16)


def _vision(cfg: ModelConfig) -> Iterator[TensorSpec]:
    v = cfg.vision
    if v is None:
        return
    Hv, Iv, m = v.hidden_size, v.intermediate_size, v.hidden_size * v.spatial_merge_size ** 2
    yield TensorSpec("model.visual.patch_embed.proj.weight", (Hv, v.in_channels, v.patch_size, v.patch_size), BF16)
    for j in range(v.depth):
        p = f"model.visual.blocks.{j}."
        for mod, w in (("norm1", (Hv,)), ("attn.qkv", (3 * Hv, Hv)), ("attn.proj", (Hv, Hv)),
                       ("norm2", (Hv,)), ("mlp.fc1", (Iv, Hv)), ("mlp.fc2", (Hv, Iv))):
            yield TensorSpec(p + mod + ".weight", w, BF16)
            yield TensorSpec(p + mod + ".bias", (w[0],), BF16)
    for mod, w in (("merger.ln_q", (Hv,)), ("merger.mlp.0", (m, m)), ("merger.mlp.2", (v.out_hidden_size, m))):
        yield TensorSpec(f"model.visual.{mod}.weight", w, BF16)
        yield TensorSpec(f"model.visual.{mod}.bias", (w[0],), BF16)


def draft_tensors(cfg: ModelConfig) -> Iterator[TensorSpec]:
    """The bundled DSpark speculator: parallel block drafter + recurrent (RNN) Markov head."""
    d = cfg.draft
    if d is None:
        return
    H, q, kv, R = d.hidden_size, d.num_attention_heads * d.head_dim, d.num_key_value_heads * d.head_dim, d.markov_hidden_size
    yield TensorSpec("dspark.fc.weight", (H, d.num_target_hidden_states * cfg.hidden_size), BF16)
    for j in range(d.num_hidden_layers):
        p = f"dspark.layers.{j}."
        for mod, shape in (("input_layernorm", (H,)), ("self_attn.q_proj", (q, H)), ("self_attn.k_proj", (kv, H)),
                           ("self_attn.v_proj", (kv, H)), ("self_attn.o_proj", (H, q)),
                           ("post_attention_layernorm", (H,)), ("mlp.gate_proj", (d.intermediate_size, H)),
                           ("mlp.up_proj", (d.intermediate_size, H)), ("mlp.down_proj", (H, d.intermediate_size))):
            yield TensorSpec(p + mod + ".weight", shape, BF16)
    yield TensorSpec("dspark.norm.weight", (H,), BF16)
    yield TensorSpec("dspark.markov_head.rnn.weight_ih", (R, H), BF16)
    yield TensorSpec("dspark.markov_head.rnn.weight_hh", (R, R), BF16)
    yield TensorSpec("dspark.markov_head.rnn.bias_ih", (R,), BF16)
    yield TensorSpec("dspark.markov_head.rnn.bias_hh", (R,), BF16)
    yield TensorSpec("dspark.markov_head.lm_head.weight", (cfg.vocab_size, R), BF16)


def expected_tensors(cfg: ModelConfig, include_draft: bool = True,
                     include_experts: bool = True) -> Iterator[TensorSpec]:
    """Every tensor of a BF16 source checkpoint, in canonical (file) order."""
    yield TensorSpec("model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size), BF16)
    for i in range(cfg.num_hidden_layers):
        yield from _decoder_layer(cfg, i, include_experts)
    yield TensorSpec("model.attn_res.final_query", (cfg.hidden_size,), FP32)
    yield TensorSpec("model.norm.weight", (cfg.hidden_size,), BF16)
    if not cfg.tie_word_embeddings:
        yield TensorSpec("lm_head.weight", (cfg.vocab_size, cfg.hidden_size), BF16)
    yield from _vision(cfg)
    if include_draft:
        yield from draft_tensors(cfg)


def source_tensor_count(cfg: ModelConfig) -> int:
    """len(list(expected_tensors(cfg))) without listing the routed experts: a reader compares it
    with what the files hold before doing work that grows with the config's counts, so a small
    checkpoint whose config claims 16,384 experts fails at once."""
    return sum(1 for _ in expected_tensors(cfg, include_experts=False)) + \
        cfg.num_hidden_layers * cfg.num_experts * len(PROJECTIONS)


def source_spec(cfg: ModelConfig, name: str) -> TensorSpec:
    """The source (BF16 checkpoint) spec of one tensor, without listing the whole model."""
    t = classify(name)
    if t.is_expert:
        return TensorSpec(name, expert_shape(cfg, t.projection), BF16)
    index = _NON_EXPERT_SPECS.get(id(cfg))
    if index is None or index[0] is not cfg:
        index = (cfg, {s.name: s for s in expected_tensors(cfg, include_experts=False)})
        _NON_EXPERT_SPECS.clear()
        _NON_EXPERT_SPECS[id(cfg)] = index
    try:
        return index[1][name]
    except KeyError:
        raise UnknownTensorError(f"tensor {name!r} does not exist in a model with this config "
                                 f"(e.g. a layer index past num_hidden_layers)", tensor=name) from None


_NON_EXPERT_SPECS: dict[int, tuple[ModelConfig, dict[str, TensorSpec]]] = {}


# =========================================================================== Hugging Face MoE layouts

# The text model's prefix, longest first (a `model.language_model.` name also starts `model.`).
TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "model.llm.", "model.")
# Where a multimodal model keeps its vision tower and projector (ModelOpt excludes them).
VISION_PREFIXES = ("model.visual.", "model.vision_tower.", "vision_model.", "vision_tower.", "visual.")
PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")
LM_HEADS = ("lm_head.weight", "language_model.lm_head.weight", "model.llm.unembed.weight")

CANONICAL = ("gate", "up", "down")  # an expert's projections, whatever a family calls them
PER_EXPERT_NAMES = {("gate_proj", "up_proj", "down_proj"): "proj", ("w1", "w3", "w2"): "w"}

_LIMITS = {"num_hidden_layers": MAX_LAYERS, "num_experts": 1 << 16}
_EXPERT_ALIASES = ("num_experts", "num_local_experts", "n_routed_experts")


@dataclass(frozen=True)
class MoEConfig:
    """The text model's MoE settings, from config.json (top level or `text_config`)."""

    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_experts: int
    num_experts_per_tok: int
    expert_width: int                  # moe_intermediate_size, or intermediate_size where that is it
    dense_layers: frozenset[int] | None  # layers without routed experts, when the config says
    nested: bool                       # the settings were under text_config

    @classmethod
    def from_dict(cls, d: dict, source: str = "config.json") -> "MoEConfig":
        top = ConfigFields(d, "", source, _LIMITS)
        nested = isinstance(d.get("text_config"), dict)
        t = ConfigFields(d["text_config"], "text_config.", source, _LIMITS) if nested else top
        key = next((k for k in _EXPERT_ALIASES if k in t.obj), None)
        if key is None:
            raise ConfigError(f"no routed-expert count in {t.where or 'config'} (one of "
                              f"{', '.join(_EXPERT_ALIASES)}): not a mixture-of-experts model?", path=source)
        n, experts = t.int("num_hidden_layers"), t.int(key, hi=_LIMITS["num_experts"])
        width_key = "moe_intermediate_size" if "moe_intermediate_size" in t.obj else "intermediate_size"
        return cls(model_type=str(t.obj.get("model_type") or d.get("model_type") or "?"),
                   hidden_size=t.int("hidden_size"), num_hidden_layers=n, num_experts=experts,
                   num_experts_per_tok=t.int("num_experts_per_tok", hi=experts), expert_width=t.int(width_key),
                   dense_layers=_dense_layers(t, n), nested=nested)

    def has_experts(self, layer: int) -> bool | None:
        return None if self.dense_layers is None else layer not in self.dense_layers


def _dense_layers(t: ConfigFields, n: int) -> frozenset[int] | None:
    """The layers without routed experts by the family's rule, or None when the config has none
    (detection then trusts the tensors)."""
    o = t.obj
    if "first_k_dense_replace" in o:  # DeepSeek-V3
        k = t.int("first_k_dense_replace", lo=0, hi=n)
        return frozenset(range(k))
    if "mlp_only_layers" in o or "decoder_sparse_step" in o:  # Qwen2/3-MoE: modeling_qwen3_moe.py
        only = o.get("mlp_only_layers") or []
        if not isinstance(only, list) or not all(type(i) is int for i in only):
            raise ConfigError(f"{t.where}mlp_only_layers must be a list of layer indices", path=t.source)
        step = t.int("decoder_sparse_step", 1)
        return frozenset(i for i in range(n) if i in only or (i + 1) % step)
    if "moe_layers" in o and isinstance(o["moe_layers"], list):  # Llama 4
        return frozenset(range(n)) - frozenset(o["moe_layers"])
    if "interleave_moe_layer_step" in o:
        step = t.int("interleave_moe_layer_step")
        return frozenset(i for i in range(n) if (i + 1) % step)
    return None


# --------------------------------------------------------------------------- expert storage
@dataclass(frozen=True)
class ExpertStorage:
    """How a checkpoint stores routed experts.

    - `per_expert`: one 2D tensor per expert and projection, `<block>.experts.<e>.<name>.weight`
      ([I, H] for gate/up, [H, I] for down); `names` are the family's projection names.
    - `stacked`: transformers' fused form, `<block>.experts.gate_up_proj` [E, H, 2I] (gate then
      up along the last axis) and `<block>.experts.down_proj` [E, I, H] (Qwen3-VL-MoE, Llama 4).
    - `interleaved`: Inkling's, `mlp.experts.w13_weight` [E, 2I, H] (row 2i gate_i, 2i+1 up_i)
      and `mlp.experts.w2_weight` [E, H, I] (formats/stacked.py).
    """

    kind: str
    block: str                     # "mlp", "block_sparse_moe" or "feed_forward"
    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")


_LAYER = re.compile(r"(?P<prefix>.*?)layers\.(?P<layer>\d+)\.(?P<rest>.+)")
_PER_EXPERT = re.compile(r"(?P<block>mlp|block_sparse_moe|feed_forward)\.experts\.(?P<expert>\d+)\."
                         r"(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)\.(?P<suffix>.+)")
_STACKED = re.compile(r"(?P<block>mlp|feed_forward)\.experts\.(?P<proj>gate_up_proj|down_proj)(?P<suffix>)")
_INTERLEAVED = re.compile(r"(?P<block>mlp)\.experts\.(?P<proj>w13|w2)_(?P<suffix>weight.*)")
_SHARED = re.compile(r"(?:mlp|feed_forward)\.(?:shared_experts?|shared_expert_gate)\..+")
_ROUTER = re.compile(r"(?:mlp|block_sparse_moe)\.gate\.(?:weight|bias|e_score_correction_bias)|feed_forward\.router\..+")
_DENSE = re.compile(r"(?:mlp|feed_forward)\.(?:gate_proj|up_proj|down_proj)\..+")
_ATTENTION = re.compile(r"(?:self_attn|attn)\..+")


@dataclass(frozen=True)
class Layout:
    """Where a checkpoint's text model, experts, vision tower and projector are."""

    text_prefix: str
    experts: ExpertStorage
    expert_layers: tuple[int, ...]
    vision_prefix: str | None
    projector_prefix: str | None
    lm_head: str | None

    def classify(self, name: str) -> TensorName:
        """What `name` is (part, layer, expert, canonical projection gate/up/down, suffix)."""
        rec = _classify(self, name)
        if rec is None:
            raise CheckpointError(f"tensor {name!r} is not part of the detected layout ({self.describe()})",
                                  tensor=name)
        return rec

    def describe(self) -> str:
        return (f"text model under {self.text_prefix!r}, routed experts {self.experts.kind} under "
                f"'layers.N.{self.experts.block}.experts' in {len(self.expert_layers)} layers"
                + (f", vision tower under {self.vision_prefix!r}" if self.vision_prefix else "")
                + (f", projector under {self.projector_prefix!r}" if self.projector_prefix else ""))


def _projection(storage: ExpertStorage, name: str) -> str:
    if storage.kind == "per_expert":
        return CANONICAL[storage.names.index(name)]
    return {"gate_up_proj": "gate_up", "w13": "gate_up"}.get(name, "down")


def _classify(lay: Layout, name: str) -> TensorName | None:
    if name == lay.lm_head:
        return TensorName(name, "lm_head")
    for prefix, part in ((lay.vision_prefix, "vision"), (lay.projector_prefix, "projector")):
        if prefix and name.startswith(prefix):
            return TensorName(name, part, suffix=name.rsplit(".", 1)[-1])
    if not name.startswith(lay.text_prefix):
        return None
    m = _LAYER.fullmatch(name[len(lay.text_prefix):])
    if m is None or m["prefix"]:
        rest = name[len(lay.text_prefix):]
        part = "embed" if rest.startswith(("embed_tokens.", "embed.")) else "other"
        return TensorName(name, part, suffix=rest.rsplit(".", 1)[-1])
    layer, rest = int(m["layer"]), m["rest"]
    pattern = {"per_expert": _PER_EXPERT, "stacked": _STACKED, "interleaved": _INTERLEAVED}[lay.experts.kind]
    if (e := pattern.fullmatch(rest)) is not None and e["block"] == lay.experts.block:
        expert = int(e["expert"]) if "expert" in e.groupdict() else None
        return TensorName(name, "expert", layer, expert, _projection(lay.experts, e["proj"]),
                          e["suffix"] or "weight")
    for regex, part in ((_SHARED, "shared_expert"), (_ROUTER, "router"), (_DENSE, "dense_mlp"),
                        (_ATTENTION, "attention")):
        if regex.fullmatch(rest):
            return TensorName(name, part, layer, suffix=rest.rsplit(".", 1)[-1])
    return TensorName(name, "other", layer, suffix=rest.rsplit(".", 1)[-1])


def _prefix_of(names: list[str]) -> str | None:
    counts: dict[str, int] = {}
    for n in names:
        for p in TEXT_PREFIXES:
            if n.startswith(p + "layers."):
                counts[p] = counts.get(p, 0) + 1
                break
    return max(counts, key=counts.get) if counts else None


def detect(names: list[str], cfg: MoEConfig | None = None, source: str = "checkpoint") -> Layout:
    """The layout of a checkpoint holding `names`; CheckpointError listing what could not be
    placed (and what was expected) when it is not one this module knows."""
    prefix = _prefix_of(names)
    if prefix is None:
        raise CheckpointError(f"no decoder layers found: expected tensors under one of "
                              f"{', '.join(p + 'layers.N.' for p in TEXT_PREFIXES)} (first names: "
                              f"{', '.join(repr(n) for n in names[:5])})", path=source)
    kinds: dict[tuple[str, str], set[int]] = {}
    names_seen: set[str] = set()
    for n in names:
        m = _LAYER.fullmatch(n[len(prefix):]) if n.startswith(prefix) else None
        if m is None or m["prefix"]:
            continue
        for kind, pattern in (("per_expert", _PER_EXPERT), ("stacked", _STACKED), ("interleaved", _INTERLEAVED)):
            if (e := pattern.fullmatch(m["rest"])) is not None:
                kinds.setdefault((kind, e["block"]), set()).add(int(m["layer"]))
                if kind == "per_expert":
                    names_seen.add(e["proj"])
    if len(kinds) != 1:
        what = "none" if not kinds else ", ".join(f"{k} under {b}" for k, b in kinds)
        raise CheckpointError(f"routed experts: expected one storage (per-expert "
                              f"'layers.N.mlp.experts.E.gate_proj.weight' or 'block_sparse_moe.experts.E.w1.weight', "
                              f"stacked 'layers.N.mlp.experts.gate_up_proj', Inkling 'mlp.experts.w13_weight'); "
                              f"found {what}", path=source)
    (kind, block), layers = next(iter(kinds.items()))
    storage = ExpertStorage(kind, block)
    if kind == "per_expert":
        proj = next((p for p in PER_EXPERT_NAMES if names_seen <= set(p)), None)
        if proj is None:
            raise CheckpointError(f"per-expert projections {sorted(names_seen)} mix naming schemes "
                                  f"(expected gate_proj/up_proj/down_proj or w1/w3/w2)", path=source)
        storage = ExpertStorage(kind, block, proj)
    if cfg is not None and cfg.dense_layers is not None:
        expected = set(range(cfg.num_hidden_layers)) - cfg.dense_layers
        if expected != layers:
            odd = sorted(expected ^ layers)
            raise CheckpointError(f"config.json puts routed experts in {len(expected)} layers, the tensors in "
                                  f"{len(layers)} (layers that disagree: {odd[:8]})", path=source)
    vision = next((p for p in VISION_PREFIXES if any(n.startswith(p) for n in names)), None)
    projector = next((p for p in PROJECTOR_PREFIXES if any(n.startswith(p) for n in names)), None)
    head = next((h for h in LM_HEADS if h in set(names)), None)
    lay = Layout(prefix, storage, tuple(sorted(layers)), vision, projector, head)
    unplaced = [n for n in names if _classify(lay, n) is None]
    if unplaced:
        raise CheckpointError(f"{len(unplaced)} tensor(s) fit no part of the detected layout "
                              f"({lay.describe()}): {', '.join(repr(n) for n in unplaced[:5])}"
                              + (" ..." if len(unplaced) > 5 else ""), path=source, tensor=unplaced[0])
    return lay
