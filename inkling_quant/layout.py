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

from .errors import ConfigError, UnknownTensorError
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
