"""The published Inkling 2 model: its config and the tensors its checkpoints hold on disk.

The source of truth is transformers >= 5.24 (line numbers below: 5.25.0), `models/inkling2/`
(configuration_inkling2.py, modeling_inkling2.py) and `conversion_mapping.py` (entries
"inkling2" / "inkling2_text", which map the original on-disk names to transformers' names;
`save_pretrained` writes the original names back). `Inkling2Config` reads a config.json as those
classes write it (`text_config` and `vision_config` nested); `checkpoint_tensors(cfg)` lists every
tensor, with shape and dtype, that `Inkling2ForConditionalGeneration(cfg).save_pretrained` writes
(tests/test_inkling2.py compares them). docs/layout.md cites the file and line each rule follows.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterator

import torch

from . import dspark
from .families import INKLING2
from .fields import MAX_LAYERS, ConfigFields
from ..errors import ConfigError, UnknownTensorError
from .tensors import TensorName
from ..errors import short_repr as _short
from .tensors import TensorSpec as Spec

REFERENCE_CONFIG = Path(__file__).parents[1] / "configs" / "inkling-2-small.json"

FULL = "hybrid"              # full-attention layers (configuration_inkling2.py: layer_types)
SLIDING = "hybrid_sliding"   # sliding-window layers
TEXT_PREFIX = "model.llm."   # conversion_mapping.py "inkling2": model.llm. <-> model.language_model.
# how Inkling-2-Small-MXFP8 (the release) stores every routed expert: e4m3 + e8m0 per 32,
# stacked like the BF16 ones (conversion_mapping.py inkling2_text; docs/layout.md)
RELEASE_EXPERT_FORMAT = "mxfp8"
NOT_PUBLISHED = ("no 'text_config': not the published Inkling 2 layout; the flat layout this project invented before "
                 "the model was published is no longer supported (docs/layout.md)")
VISION_PREFIX = "model.visual."
BF16, FP32 = torch.bfloat16, torch.float32

# Bounds on config values: a config is untrusted input, and shapes and loops come from it.
_MAX_EXPERT_MODULES = 1 << 20
_LIMITS = {"num_hidden_layers": MAX_LAYERS, "n_routed_experts": 1 << 16, "max_position_embeddings": 1 << 40,
           "sliding_window_size": 1 << 40, "rel_extent": 1 << 40}


def default_layer_types(num_layers: int) -> list[str]:
    """Inkling2TextConfig's rule when layer_types is unset (configuration_inkling2.py:123-128):
    every 6th layer full attention, the rest sliding."""
    return [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(num_layers)]


@dataclass(frozen=True)
class TextConfig:
    """Inkling2TextConfig's dimensions (configuration_inkling2.py:83-121)."""

    vocab_size: int                 # rows of embed and of the padded unembed on disk
    unpadded_vocab_size: int        # rows of transformers' lm_head (Inkling2UnpadVocab)
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]    # FULL or SLIDING per layer
    num_attention_heads: int        # full-attention ("hybrid") layers
    num_key_value_heads: int
    head_dim: int
    swa_num_attention_heads: int    # sliding ("hybrid_sliding") layers
    swa_num_key_value_heads: int
    swa_head_dim: int
    sliding_window_size: int
    rel_extent: int                 # relative-bias extent of full layers (sliding: the window)
    d_rel: int
    conv_kernel_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_layers_per_attn_res_block: int
    max_position_embeddings: int

    def is_full(self, layer: int) -> bool:
        return self.layer_types[layer] == FULL

    def attention_dims(self, layer: int) -> tuple[int, int, int]:
        """(heads, kv heads, head_dim) of `layer` (modeling_inkling2.py:599-601)."""
        if self.is_full(layer):
            return self.num_attention_heads, self.num_key_value_heads, self.head_dim
        return self.swa_num_attention_heads, self.swa_num_key_value_heads, self.swa_head_dim

    def layer_rel_extent(self, layer: int) -> int:
        return self.rel_extent if self.is_full(layer) else self.sliding_window_size

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)

    @property
    def expert_hidden(self) -> int:
        """The width routed experts act on: hidden_size (the plans ask it of every family's text model)."""
        return self.hidden_size


@dataclass(frozen=True)
class VisionConfig:
    """Inkling2VisionConfig's dimensions (configuration_inkling2.py:150-169)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_channels: int
    patch_size: int
    spatial_merge_size: int
    posemb_grid_size: int
    projection_hidden_dim: int
    projector_bias: bool
    text_hidden_size: int


@dataclass(frozen=True)
class Inkling2Config:
    """A config.json of Inkling2ForConditionalGeneration, validated (every dimension an integer
    in a sane range, so no shape derived from it is negative or absurd)."""

    text: TextConfig
    vision: VisionConfig | None
    raw: dict = field(default_factory=dict, compare=False, repr=False)
    draft: dspark.DSparkConfig | None = None  # a bundled DSpark draft (`dspark_config`; ours, not published)

    @classmethod
    def from_dict(cls, d: dict, source: str = "config.json") -> "Inkling2Config":
        if isinstance(d, dict) and d.get("model_type", "inkling2") != "inkling2":
            raise ConfigError(f"model_type {_short(d['model_type'])}: not an Inkling 2 checkpoint ('inkling2'); "
                              f"this command reads the Inkling 2 layout only", path=source)
        if isinstance(d, dict) and "text_config" not in d:
            raise ConfigError(NOT_PUBLISHED, path=source)
        top = ConfigFields(d, "", source, _LIMITS)
        t = ConfigFields(top.need("text_config"), "text_config.", source, _LIMITS)
        n = t.int("num_hidden_layers")
        types = t.need("layer_types")
        if not isinstance(types, list) or not all(isinstance(x, str) for x in types):
            raise ConfigError(f"text_config.layer_types must be a list of strings, got {_short(types)}", path=source)
        if len(types) != n:
            raise ConfigError(f"text_config.layer_types has {len(types)} entries, "
                              f"num_hidden_layers is {n}", path=source)
        if bad := sorted(set(types) - {FULL, SLIDING}):
            raise ConfigError(f"text_config.layer_types: unknown {_short(bad)} (expected "
                              f"{FULL!r} or {SLIDING!r})", path=source)
        dims = {k: t.int(k) for k in TextConfig.__dataclass_fields__
                if k not in ("num_hidden_layers", "layer_types")}
        text = TextConfig(num_hidden_layers=n, layer_types=tuple(types), **dims)
        if text.unpadded_vocab_size > text.vocab_size:
            raise ConfigError(f"text_config.unpadded_vocab_size ({text.unpadded_vocab_size}) exceeds "
                              f"vocab_size ({text.vocab_size})", path=source)
        if text.num_experts_per_tok > text.n_routed_experts:
            raise ConfigError(f"text_config.num_experts_per_tok ({text.num_experts_per_tok}) exceeds "
                              f"n_routed_experts ({text.n_routed_experts})", path=source)
        if n * text.n_routed_experts > _MAX_EXPERT_MODULES:
            raise ConfigError(f"{n} layers x {text.n_routed_experts} experts is more than "
                              f"{_MAX_EXPERT_MODULES} expert modules", path=source)
        vision = None
        if d.get("vision_config") is not None:
            v = ConfigFields(d["vision_config"], "vision_config.", source, _LIMITS)
            vd = {k: v.int(k) for k in VisionConfig.__dataclass_fields__ if k != "projector_bias"}
            vision = VisionConfig(projector_bias=v.bool("projector_bias", False), **vd)
            if vision.text_hidden_size != text.hidden_size:  # Inkling2Config.validate_architecture
                raise ConfigError(f"vision_config.text_hidden_size ({vision.text_hidden_size}) must "
                                  f"match text_config.hidden_size ({text.hidden_size})", path=source)
        draft = None
        if d.get(dspark.CONFIG_KEY) is not None:
            draft = dspark.DSparkConfig.from_dict(d[dspark.CONFIG_KEY], source, dspark.CONFIG_KEY + ".")
            draft.check_target(text, source)
        return cls(text, vision, dict(d), draft)

    family = INKLING2

    @property
    def num_hidden_layers(self) -> int:  # what a scheme's layer ranges are fractions of
        return self.text.num_hidden_layers

    @staticmethod
    def describes(d) -> bool:
        """Whether a config.json object is an Inkling 2 model's (`model_type` "inkling2", as
        transformers writes it, or only its text config's "inkling2_text"), not another family's
        (which may nest `text_config` too). The one place that decides (layout.model_config)."""
        if not isinstance(d, dict):
            return False
        t = d.get("text_config")
        text_type = t.get("model_type") if isinstance(t, dict) else None
        return d.get("model_type") == "inkling2" or ("model_type" not in d and text_type == "inkling2_text")

    @classmethod
    def load(cls, path: str | Path) -> "Inkling2Config":
        from ..io.checkpoint import CONFIG_NAME, read_json, safe_child

        path = Path(path)
        if path.is_dir():
            path = safe_child(path, CONFIG_NAME)
        return cls.from_dict(read_json(path, CONFIG_NAME, ConfigError), str(path))

    @classmethod
    def reference(cls) -> "Inkling2Config":
        """The published defaults (Inkling2Config() of transformers, documented against
        thinkingmachines/Inkling-2-Small-MXFP8), as configs/inkling-2-small.json holds them."""
        return cls.load(REFERENCE_CONFIG)


# --------------------------------------------------------------------------- tensors on disk
def _layer(t: TextConfig, i: int) -> Iterator[Spec]:
    """Decoder layer `i` under its original names (conversion_mapping.py:429-480 renames them
    to transformers'; modeling_inkling2.py:905-980 defines them)."""
    H, k, E, inter = t.hidden_size, t.conv_kernel_size, t.n_routed_experts, t.moe_intermediate_size
    nh, nkv, hd = t.attention_dims(i)
    q, kv = nh * hd, nkv * hd
    p = f"{TEXT_PREFIX}layers.{i}."
    yield Spec(p + "attn.wq_du.weight", (q, H), BF16)
    yield Spec(p + "attn.q_l2_clip.scale", (nh, hd), BF16)
    for kind in ("k", "v"):
        yield Spec(p + f"attn.w{kind}_dv.weight", (kv, H), BF16)
        if t.is_full(i):  # Inkling2DynamicShortConvolution: static taps + per-token projected taps
            yield Spec(p + f"attn.{kind}_sconv.static_w", (k, kv), BF16)
            yield Spec(p + f"attn.{kind}_sconv.weight_proj", (nkv * k, H), BF16)
        else:             # Inkling2ShortConvolution, kept in fp32 (_keep_in_fp32_modules_strict "sconv.conv1d")
            yield Spec(p + f"attn.{kind}_sconv.weight", (kv, 1, k), FP32)
    yield Spec(p + "attn.gate_attn.weight", (q, H), BF16)
    yield Spec(p + "attn.wo_ud.weight", (H, q), BF16)
    yield Spec(p + "attn.attn_sink_proj.weight", (nh, H), BF16)
    yield Spec(p + "attn.wr_du.weight", (nh * t.d_rel, H), BF16)
    yield Spec(p + "attn.rel_l2_clip.scale", (nh, t.d_rel), BF16)
    yield Spec(p + "attn.rel_logits_proj.proj", (t.d_rel, t.layer_rel_extent(i)), BF16)
    if t.is_full(i):
        for kind in ("q", "k", "v"):
            yield Spec(p + f"{kind}_input_norm.weight", (H,), BF16)
    else:
        yield Spec(p + "attn_norm.weight", (H,), BF16)
    yield Spec(p + "mlp_norm.weight", (H,), BF16)
    yield Spec(p + "attn_sconv.weight", (H, 1, k), FP32)
    yield Spec(p + "mlp_sconv.weight", (H, 1, k), FP32)
    yield Spec(p + "mlp.gate.weight", (E, H), FP32)
    yield Spec(p + "mlp.gate.bias", (E,), FP32)  # e_score_correction_bias
    # stacked experts: w13 rows interleave gate and up (row 2j = gate_j, 2j+1 = up_j:
    # core_model_loading.py Interleave); w2 is down_proj as is
    yield Spec(p + "mlp.experts.w13_weight", (E, 2 * inter, H), BF16)
    yield Spec(p + "mlp.experts.w2_weight", (E, H, inter), BF16)


def text_tensors(t: TextConfig, include_experts: bool = True) -> Iterator[Spec]:
    H = t.hidden_size
    yield Spec(TEXT_PREFIX + "embed.weight", (t.vocab_size, H), BF16)
    yield Spec(TEXT_PREFIX + "embed_norm.weight", (H,), BF16)
    for i in range(t.num_hidden_layers):
        # block attention residual queries (fp32): one before each sublayer; the attention's of
        # a full layer has 3 queries (q, k, v inputs), layer 0 has none (modeling_inkling2.py:877-881, 911, 968)
        if i > 0:
            yield Spec(TEXT_PREFIX + f"attn_res.attn_queries.{i - 1}", (3, H) if t.is_full(i) else (H,), FP32)
        yield Spec(TEXT_PREFIX + f"attn_res.mlp_queries.{i}", (H,), FP32)
        for s in _layer(t, i):
            if include_experts or ".mlp.experts." not in s.name:
                yield s
    yield Spec(TEXT_PREFIX + "attn_res.output_query", (H,), FP32)
    yield Spec(TEXT_PREFIX + "norm.weight", (H,), BF16)
    # unembed is stored padded to vocab_size; transformers' lm_head drops the padding rows
    yield Spec(TEXT_PREFIX + "unembed.weight", (t.vocab_size, H), BF16)


def vision_tensors(v: VisionConfig) -> Iterator[Spec]:
    """The ViT and its projector (conversion_mapping.py:385-425; modeling_inkling2.py:1104-1304)."""
    Hv, Iv, p = v.hidden_size, v.intermediate_size, VISION_PREFIX
    b = p + "backbone."
    yield Spec(b + "embeddings.class_embedding", (Hv,), BF16)
    yield Spec(b + "embeddings.cls_position_embedding", (Hv,), BF16)
    yield Spec(b + "embeddings.patch_embedding.weight", (Hv, v.num_channels * v.patch_size ** 2), BF16)
    yield Spec(b + "embeddings.position_embedding", (v.posemb_grid_size ** 2, Hv), BF16)
    yield Spec(b + "ln_pre.weight", (Hv,), BF16)
    yield Spec(b + "ln_pre.bias", (Hv,), BF16)
    for j in range(v.num_hidden_layers):
        lp = f"{b}layers.{j}."
        for name, shape in (("ln_1.weight", (Hv,)), ("ln_1.bias", (Hv,)), ("ln_2.weight", (Hv,)),
                            ("ln_2.bias", (Hv,)), ("ls_1.gamma", (Hv,)), ("ls_2.gamma", (Hv,)),
                            ("mlp.c_fc.weight", (Iv, Hv)), ("mlp.c_fc.bias", (Iv,)),
                            ("mlp.c_proj.weight", (Hv, Iv)), ("mlp.c_proj.bias", (Hv,))):
            yield Spec(lp + name, shape, BF16)
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            yield Spec(lp + f"self_attn.{proj}.weight", (Hv, Hv), BF16)
            yield Spec(lp + f"self_attn.{proj}.bias", (Hv,), BF16)
    merged = v.spatial_merge_size ** 2 * Hv
    for name, (out, inp) in (("proj_in", (v.projection_hidden_dim, merged)),
                             ("proj_out", (v.text_hidden_size, v.projection_hidden_dim))):
        yield Spec(p + f"{name}.weight", (out, inp), BF16)
        if v.projector_bias:
            yield Spec(p + f"{name}.bias", (out,), BF16)


def checkpoint_tensors(cfg: Inkling2Config, include_experts: bool = True, include_draft: bool = True) -> Iterator[Spec]:
    """Every tensor of a BF16 checkpoint in the original layout, text model then vision tower,
    then the DSpark draft when the config bundles one (`dspark.draft_tensors`, docs/draft.md)."""
    yield from text_tensors(cfg.text, include_experts)
    if cfg.vision is not None:
        yield from vision_tensors(cfg.vision)
    if include_draft and cfg.draft is not None:
        yield from dspark.draft_tensors(cfg.draft, dspark.PREFIX)


# --------------------------------------------------------------------------- files on disk
VISION_FILE = "vision.safetensors"  # our name: the release keeps its vision weights apart, under a name not public
_FILE_RULES = [(re.compile(p), k) for p, k in [
    (r"model\.llm\.layers\.(\d+)\..+", 0),                      # layer i's own tensors
    (r"model\.llm\.attn_res\.mlp_queries\.(\d+)", 0),           # layer i's MLP input query
    (r"model\.llm\.attn_res\.attn_queries\.(\d+)", 1),          # layer i+1's attention input query
    (r"model\.llm\.(?:embed|embed_norm)\.weight", None),        # before layer 0: with it
    (r"model\.llm\.(?:norm\.weight|unembed\.weight|attn_res\.output_query)", -1),  # after the last
]]


def release_file(t: TextConfig, name: str) -> str | int:
    """The weight file tensor `name` (an original name, BF16 or quantized: any suffix) lives in,
    in the release's file layout (docs/layout.md "Files"): decoder layer i's shard (group i,
    `io.shards.plan_files`) with the layer's attention-residual queries; the embedding and its
    norm with layer 0, the final norm, output query and unembedding with the last layer (48
    target shards, as the release has); the vision tower in VISION_FILE; the draft in
    `dspark.FILE`."""
    if dspark.is_draft(name):
        return dspark.FILE
    if name.startswith(VISION_PREFIX):
        return VISION_FILE
    for rx, k in _FILE_RULES:
        if m := rx.fullmatch(name):
            layer = 0 if k is None else t.num_hidden_layers - 1 if k == -1 else int(m.group(1)) + k
            if layer < t.num_hidden_layers:
                return layer
    raise UnknownTensorError(f"tensor {name!r}: no file of the Inkling 2 layout holds it (docs/layout.md)",
                             tensor=name)


# --------------------------------------------------------------------------- parameter counts
@dataclass(frozen=True)
class ParamCounts:
    """Parameters as the modeling code counts them (`model.parameters()`: lm_head unpadded, the
    router's correction bias a buffer), by part."""

    routed_experts: int
    embed: int           # embed table (padded vocab, as stored)
    lm_head: int         # unpadded_vocab_size x hidden
    text_other: int      # attention, norms, convs, routers, attention-residual queries
    vision: int
    active_experts: int  # num_experts_per_tok of n_routed_experts, every layer

    @property
    def total(self) -> int:
        return self.routed_experts + self.embed + self.lm_head + self.text_other + self.vision

    @property
    def active(self) -> int:
        """Per token in the text model, without the embedding tables (the recipe's 17B)."""
        return self.active_experts + self.text_other


def param_counts(cfg: Inkling2Config) -> ParamCounts:
    t = cfg.text
    per_expert = 3 * t.hidden_size * t.moe_intermediate_size
    tables = {TEXT_PREFIX + "embed.weight", TEXT_PREFIX + "unembed.weight"}
    # mlp.gate.bias (e_score_correction_bias) is a registered buffer there, not a parameter
    other = sum(s.numel for s in text_tensors(t, include_experts=False)
                if s.name not in tables and not s.name.endswith(".mlp.gate.bias"))
    vision = sum(s.numel for s in vision_tensors(cfg.vision)) if cfg.vision is not None else 0
    return ParamCounts(
        routed_experts=t.num_hidden_layers * t.n_routed_experts * per_expert, embed=t.vocab_size * t.hidden_size,
        lm_head=t.unpadded_vocab_size * t.hidden_size, text_other=other, vision=vision,
        active_experts=t.num_hidden_layers * t.num_experts_per_tok * per_expert)


# --------------------------------------------------------------------------- transformers' names
# (original, transformers) per tensor, from conversion_mapping.py's "inkling2" (377-428) and
# "inkling2_text" (429-491) renames. {L}: decoder layer, {J}: vision layer. Two entries change
# values, not only names: w13_weight <-> gate_up_proj (rows interleaved <-> [gate; up], the
# Interleave op) and unembed <-> lm_head (padded <-> unpadded rows, Inkling2UnpadVocab).
_LAYER_NAMES = [
    ("attn.wq_du.weight", "self_attn.q_proj.linear.weight"),
    ("attn.q_l2_clip.scale", "self_attn.q_proj.norm.scale"),
    ("attn.wk_dv.weight", "self_attn.k_proj.linear.weight"),
    ("attn.wv_dv.weight", "self_attn.v_proj.linear.weight"),
    ("attn.k_sconv.weight", "self_attn.k_proj.sconv.conv1d.weight"),
    ("attn.v_sconv.weight", "self_attn.v_proj.sconv.conv1d.weight"),
    ("attn.k_sconv.static_w", "self_attn.k_proj.sconv.static_weight"),
    ("attn.v_sconv.static_w", "self_attn.v_proj.sconv.static_weight"),
    ("attn.k_sconv.weight_proj", "self_attn.k_proj.sconv.weight_proj.weight"),
    ("attn.v_sconv.weight_proj", "self_attn.v_proj.sconv.weight_proj.weight"),
    ("attn.gate_attn.weight", "self_attn.o_proj.gate_proj.weight"),
    ("attn.wo_ud.weight", "self_attn.o_proj.linear.weight"),
    ("attn.attn_sink_proj.weight", "self_attn.sink_proj.weight"),
    ("attn.wr_du.weight", "self_attn.relative_position_bias.linear.weight"),
    ("attn.rel_l2_clip.scale", "self_attn.relative_position_bias.norm.scale"),
    ("attn.rel_logits_proj.proj", "self_attn.relative_position_bias.proj"),
    ("attn_norm.weight", "input_layernorm.weight"),
    ("q_input_norm.weight", "q_input_layernorm.weight"),
    ("k_input_norm.weight", "k_input_layernorm.weight"),
    ("v_input_norm.weight", "v_input_layernorm.weight"),
    ("mlp_norm.weight", "post_attention_layernorm.weight"),
    ("attn_sconv.weight", "post_attention_convolution.conv1d.weight"),
    ("mlp_sconv.weight", "post_mlp_convolution.conv1d.weight"),
    ("mlp.gate.weight", "mlp.gate.weight"),
    ("mlp.gate.bias", "mlp.gate.e_score_correction_bias"),
    ("mlp.experts.w13_weight", "mlp.experts.gate_up_proj"),
    ("mlp.experts.w2_weight", "mlp.experts.down_proj"),
]
_VISION_LAYER_NAMES = [
    ("ln_1.", "layernorm_before."), ("ln_2.", "layernorm_after."), ("ls_1.gamma", "lambda_1"),
    ("ls_2.gamma", "lambda_2"), ("mlp.c_fc.", "mlp.fc1."), ("mlp.c_proj.", "mlp.fc2."), ("self_attn.", "self_attn."),
]
_NAME_PAIRS = [
    ("model.llm.embed.weight", "model.language_model.embed_tokens.weight"),
    ("model.llm.embed_norm.weight", "model.language_model.embed_tokens.embed_norm.weight"),
    ("model.llm.norm.weight", "model.language_model.norm.weight"),
    ("model.llm.unembed.weight", "lm_head.weight"),
    ("model.llm.attn_res.mlp_queries.{L}", "model.language_model.layers.{L}.mlp_input.query"),
    ("model.llm.attn_res.output_query", "model.language_model.final_input.query"),
    *((f"model.llm.layers.{{L}}.{o}", f"model.language_model.layers.{{L}}.{t}") for o, t in _LAYER_NAMES),
    ("model.visual.backbone.embeddings.position_embedding", "model.vision_tower.embeddings.position_embedding.weight"),
    ("model.visual.backbone.embeddings.{R}", "model.vision_tower.embeddings.{R}"),
    ("model.visual.backbone.ln_pre.{R}", "model.vision_tower.pre_layernorm.{R}"),
    *((f"model.visual.backbone.layers.{{J}}.{o}{{R}}", f"model.vision_tower.layers.{{J}}.{t}{{R}}")
      for o, t in _VISION_LAYER_NAMES),
    ("model.visual.proj_in.{R}", "model.vision_tower.merger.linear_1.{R}"),
    ("model.visual.proj_out.{R}", "model.vision_tower.merger.linear_2.{R}"),
]


def _compile(template: str) -> re.Pattern:
    rx = re.escape(template).replace(r"\{L\}", r"(?P<L>\d+)").replace(r"\{J\}", r"(?P<J>\d+)")
    return re.compile(rx.replace(r"\{R\}", r"(?P<R>[A-Za-z0-9_.]*)"))


_TO_HF = [(_compile(o), t) for o, t in _NAME_PAIRS]
_TO_ORIGINAL = [(_compile(t), o) for o, t in _NAME_PAIRS]
_ATTN_QUERY_ORIGINAL = re.compile(r"model\.llm\.attn_res\.attn_queries\.(\d+)")
_ATTN_QUERY_HF = re.compile(r"model\.language_model\.layers\.(\d+)\.attention_input\.query")


def _rename(name: str, rules) -> str | None:
    for rx, template in rules:
        if m := rx.fullmatch(name):
            return template.format(**m.groupdict())
    return None


def transformers_name(original: str) -> str:
    """transformers' name for a tensor of the original layout (what `from_pretrained` calls it);
    UnknownTensorError for a name outside the layout."""
    if m := _ATTN_QUERY_ORIGINAL.fullmatch(original):  # attn_queries.i is layer i+1's
        return f"model.language_model.layers.{int(m.group(1)) + 1}.attention_input.query"
    if (hf := _rename(original, _TO_HF)) is not None:
        return hf
    raise UnknownTensorError(f"tensor {original!r} is not a tensor of the Inkling 2 layout (docs/layout.md)")


def original_name(hf: str) -> str:
    """The original on-disk name of a tensor transformers names `hf` (the inverse)."""
    if m := _ATTN_QUERY_HF.fullmatch(hf):
        if int(m.group(1)) > 0:
            return f"model.llm.attn_res.attn_queries.{int(m.group(1)) - 1}"
    elif (o := _rename(hf, _TO_ORIGINAL)) is not None:
        return o
    raise UnknownTensorError(f"tensor {hf!r} is not a transformers tensor of Inkling 2 (docs/layout.md)")


# --------------------------------------------------------------------------- what a name is
# (regex on the original name, part); `layout.TensorName` records with the legacy parts where
# one exists. Stacked experts: projection "w13" / "w2", suffix as export.inkling writes it.
_L = r"model\.llm\.layers\.(?P<layer>\d+)\."
_EXPERT_SUFFIX = r"(?P<suffix>weight(?:_scale|_amax|_outer_scale_denominator|\.input_amax)?)"
_RULES = [(re.compile(p), part) for p, part in [
    (_L + r"mlp\.experts\.(?P<proj>w13|w2)_" + _EXPERT_SUFFIX, "expert"),
    (_L + r"mlp\.gate\.(?P<suffix>weight|bias)", "router"),
    (_L + r"attn\.(?P<proj>wq_du|wk_dv|wv_dv|wo_ud|gate_attn|wr_du|attn_sink_proj)\.(?P<suffix>weight)", "attention"),
    (_L + r"attn\.(?P<proj>q_l2_clip|rel_l2_clip|rel_logits_proj)\.(?P<suffix>scale|proj)", "attention_aux"),
    (_L + r"(?P<proj>attn\.[kv]_sconv|attn_sconv|mlp_sconv)\.(?P<suffix>weight|static_w|weight_proj)", "short_conv"),
    (_L + r"(?P<proj>attn_norm|[qkv]_input_norm|mlp_norm)\.(?P<suffix>weight)", "norm"),
    (r"model\.llm\.attn_res\.(?P<proj>attn_queries|mlp_queries)\.(?P<layer>\d+)", "attn_res"),
    (r"model\.llm\.attn_res\.(?P<proj>output_query)", "attn_res"),
    (r"model\.llm\.(?P<proj>embed_norm|norm)\.(?P<suffix>weight)", "norm"),
    (r"model\.llm\.embed\.(?P<suffix>weight)", "embed"),
    (r"model\.llm\.unembed\.(?P<suffix>weight)", "lm_head"),
    (r"model\.visual\..+", "vision"),
]]


def classify(name: str):
    """What the original-layout tensor `name` is (a `layout.TensorName`); UnknownTensorError for
    a name outside the layout."""
    if dspark.is_draft(name):
        return dspark.classify(name)
    for rx, part in _RULES:
        if m := rx.fullmatch(name):
            g = m.groupdict()
            layer = int(g["layer"]) if g.get("layer") is not None else None
            return TensorName(name, part, layer, None, g.get("proj"), g.get("suffix") or name.rsplit(".", 1)[-1])
    raise UnknownTensorError(f"tensor {name!r} is not a tensor of the Inkling 2 layout (docs/layout.md)")


def experts_module(layer: int) -> str:
    """The MoE module of `layer` as quantization configs key it (vLLM maps model.llm.layers.)."""
    return f"{TEXT_PREFIX}layers.{layer}.mlp.experts"


# --------------------------------------------------------------------------- ModelOpt's export
# What NVIDIA ModelOpt's exporter (and `convert --output-format modelopt-hf`) writes for this
# model: transformers' names, lm_head cut to the unpadded vocabulary, the routed experts as
# per-expert modules `<experts module>.<e>.<gate_proj|up_proj|down_proj>.<suffix>`, a bundled
# DSpark draft under its own names.
_MODELOPT_TENSOR = re.compile(r"model\.language_model\.layers\.(?P<layer>\d+)\.mlp\.experts\.(?P<expert>\d+)\."
                              r"(?P<proj>gate_proj|up_proj|down_proj)\.(?P<suffix>[A-Za-z0-9_]+)")


#: modules of transformers' Inkling 2 that ModelOpt 0.47 puts no quantizer on, so that its one-format
#: export does not list them as excluded: its QuantModuleRegistry takes nn.Embedding
#: (quantization/nn/modules/quant_embedding.py:31) and subclasses that keep its forward
#: (opt/dynamic.py:930-939), and transformers 5.25's text embedding, Inkling2NormedEmbedding,
#: overrides forward (models/inkling2/modeling_inkling2.py:1360-1365)
MODELOPT_UNWRAPPED = ("model.language_model.embed_tokens",)


def modelopt_tensor(cfg: Inkling2Config, original: str) -> tuple[str, int | None]:
    """(name, rows kept or None for all) of the pass-through tensor `original` in ModelOpt's
    export: transformers' name, the unembedding cut to the rows transformers' lm_head keeps
    (core_model_loading.py Inkling2UnpadVocab); a draft tensor (not a transformers module)
    keeps its own name."""
    if dspark.is_draft(original):
        return original, None
    rows = cfg.text.unpadded_vocab_size if original == TEXT_PREFIX + "unembed.weight" else None
    return transformers_name(original), rows


def transformers_spec(cfg: Inkling2Config, spec: Spec) -> Spec:
    """A tensor of the original layout as transformers' model holds it (what its `state_dict()`
    saves): transformers' name, the unembedding as `lm_head.weight` of the unpadded rows
    (modeling_inkling2.py:1817); a draft tensor as it is. The routed experts are the storage's
    (layout.expert_specs)."""
    name, rows = modelopt_tensor(cfg, spec.name)
    return Spec(name, spec.shape if rows is None else (rows, *spec.shape[1:]), spec.dtype)


def modelopt_experts_module(layer: int) -> str:
    """The MoE module of `layer` as ModelOpt's export names it (and its quantization config keys it)."""
    return transformers_name(f"{experts_module(layer)}.w13_weight").rsplit(".", 1)[0]


def classify_modelopt(name: str):
    """What a tensor of ModelOpt's export is (a `layout.TensorName` under that name): a per-expert
    module's tensor (part "expert", with layer, expert and projection), else what its original
    name is. Original-layout names classify as `classify` does."""
    if m := _MODELOPT_TENSOR.fullmatch(name):
        return TensorName(name, "expert", int(m["layer"]), int(m["expert"]), m["proj"], m["suffix"])
    if dspark.is_draft(name) or name.startswith((TEXT_PREFIX, VISION_PREFIX)):
        return classify(name)
    return replace(classify(original_name(name)), name=name, suffix=name.rsplit(".", 1)[-1])
