"""Checkpoint layouts: which model a config.json describes, and where a checkpoint keeps its
text model, routed experts, vision tower and projector.

`model_config(d)` reads a config.json: the published Inkling 2 model's (inkling2.Inkling2Config,
the strict spec: every tensor present with its shape) or a Hugging Face MoE model's (`MoEConfig`:
the text model's settings, top level or under `text_config`, with the aliases the families use).
`detect(names, cfg)` decides, from the tensor names alone, where the text model lives (its
prefix), how routed experts are stored and what every other tensor is; `Layout.classify(name)`
then answers per tensor. `expected_tensors(cfg, layout)` is what the config requires of such a
checkpoint: Inkling 2's every tensor under the checkpoint's naming (original or transformers'),
another family's routed experts. Only routed experts are quantized by the schemes: shared
experts, dense MLPs, routers and everything else pass through. docs/layout.md has the table of supported
layouts and the families each was tested on.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Iterator

import torch

from . import inkling2
from .config_fields import MAX_LAYERS, ConfigFields
from .errors import CheckpointError, ConfigError
from .inkling2 import Inkling2Config
from .tensors import TensorName, TensorSpec


def natural_key(name: str) -> list[tuple[int, int, str]]:
    """Sort key for tensor/module names: numeric components as numbers (layer 2 before 10)."""
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.split(".")]


def model_config(d: dict, source: str) -> "Inkling2Config | MoEConfig":
    """A checkpoint's config.json: the published Inkling 2 model's when it nests `text_config`
    with Inkling's keys (inkling2), else a Hugging Face MoE model's. The one place a command
    decides which."""
    return Inkling2Config.from_dict(d, source) if Inkling2Config.describes(d) else MoEConfig.from_dict(d, source)

# The text model's prefix, longest first (a `model.language_model.` name also starts `model.`).
TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "model.llm.", "model.")
# Where a multimodal model keeps its vision tower and projector (ModelOpt excludes them).
VISION_PREFIXES = ("model.visual.", "model.vision_tower.", "vision_model.", "vision_tower.", "visual.")
PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")
DRAFT_PREFIXES = ("dspark.",)  # a bundled speculator (ours for Inkling: dspark.py), passed through
LM_HEADS = ("lm_head.weight", "language_model.lm_head.weight", "model.llm.unembed.weight")

CANONICAL = ("gate", "up", "down")  # an expert's projections, whatever a family calls them
PER_EXPERT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))  # gate, up, down per family

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
    raw: dict = field(default_factory=dict, compare=False, repr=False)  # the whole config.json

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
                   dense_layers=_dense_layers(t, n), nested=nested, raw=dict(d))

    @classmethod
    def of(cls, cfg: "MoEConfig | Inkling2Config") -> "MoEConfig":
        """The MoE settings of either kind of config: itself, or an Inkling 2 model's text model's
        (routed experts in every layer), so detection, orientation and the expert shapes are one
        rule for both."""
        if isinstance(cfg, MoEConfig):
            return cfg
        t = cfg.text
        return cls(model_type=str(cfg.raw.get("model_type") or "inkling2"), hidden_size=t.hidden_size,
                   num_hidden_layers=t.num_hidden_layers, num_experts=t.n_routed_experts,
                   num_experts_per_tok=t.num_experts_per_tok, expert_width=t.moe_intermediate_size,
                   dense_layers=frozenset(), nested=True, raw=cfg.raw)


def _dense_layers(t: ConfigFields, n: int) -> frozenset[int] | None:
    """The layers without routed experts by the family's rule, or None when the config has none
    (detection then trusts the tensors)."""
    o = t.obj
    if "first_k_dense_replace" in o:  # DeepSeek-V3
        k = t.int("first_k_dense_replace", lo=0, hi=n)
        return frozenset(range(k))
    if "mlp_only_layers" in o or "decoder_sparse_step" in o:  # Qwen2/3-MoE: modeling_qwen3_moe.py
        only = t.layer_list("mlp_only_layers")
        step = t.int("decoder_sparse_step", 1)
        return frozenset(i for i in range(n) if i in only or (i + 1) % step)
    if "moe_layers" in o and o["moe_layers"] is not None:  # Llama 4
        return frozenset(range(n)) - frozenset(t.layer_list("moe_layers"))
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
    - `stacked`: transformers' fused form, `<block>.experts.gate_up_proj` and `.down_proj`, gate
      then up along the 2I axis: as the Hub's Qwen3-VL-MoE and Llama 4 checkpoints store them,
      [E, H, 2I] and [E, I, H] (`transposed`: [E, in, out]), or as transformers 5.25's
      save_pretrained writes Qwen3-VL-MoE, [E, 2I, H] and [E, H, I] (its in-memory form).
    - `interleaved`: Inkling's, `mlp.experts.w13_weight` [E, 2I, H] (row 2i gate_i, 2i+1 up_i)
      and `mlp.experts.w2_weight` [E, H, I] (formats/stacked.py).
    """

    kind: str
    block: str                     # "mlp", "block_sparse_moe" or "feed_forward"
    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    transposed: bool = False       # stacked as [E, in, out] (decided from the shapes: `stacked_orientation`)


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
    num_layers: int | None = None  # the config's decoder layers: layers past them are MTP/draft layers

    def classify(self, name: str) -> TensorName:
        """What `name` is (part, layer, expert, canonical projection gate/up/down, suffix)."""
        rec = self.part_of(name)
        if rec is None:
            raise CheckpointError(f"tensor {name!r} is not part of the detected layout ({self.describe()})",
                                  tensor=name)
        return rec

    def part_of(self, name: str) -> TensorName | None:
        """`classify`, or None for a name outside the layout (e.g. a missing lm_head's, which
        detection could not see)."""
        return _classify(self, name)

    @property
    def experts_modules(self) -> dict[int, str]:
        """layer -> the module that holds its routed experts, as ModelOpt keys `quantized_layers`."""
        return {i: f"{self.text_prefix}layers.{i}.{self.experts.block}.experts" for i in self.expert_layers}

    def activation_key(self, rec: TensorName) -> str | None:
        """The module a routed expert's activation amax is keyed by (None for other tensors and for
        a quantized source's scales): per expert its module, stacked the tensor (vLLM reads one
        input scale per layer and projection there)."""
        if rec.part != "expert" or rec.suffix != "weight":
            return None
        return rec.module if self.experts.kind == "per_expert" else rec.name

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
    if name.startswith(DRAFT_PREFIXES):
        return TensorName(name, "draft", suffix=name.rsplit(".", 1)[-1])
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
    if lay.num_layers is not None and layer >= lay.num_layers:  # e.g. DeepSeek-V3's MTP layer 61: passed through
        return TensorName(name, "draft", layer, suffix=rest.rsplit(".", 1)[-1])
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


def stacked_orientation(down_shape: tuple[int, ...], gate_up_shape: tuple[int, ...], hidden: int,
                        width: int) -> bool | None:
    """Whether transformers-stacked experts are stored [E, in, out] (True) or [E, out, in]
    (False), from the shapes: down_proj tells unless H == I, gate_up_proj unless H == 2I (never
    both). None: neither shape fits the config."""
    for shape, out_in in ((down_shape, (hidden, width)), (gate_up_shape, (2 * width, hidden))):
        if out_in[0] != out_in[1] and len(shape) == 3:
            if tuple(shape[1:]) == out_in:
                return False
            if tuple(shape[1:]) == out_in[::-1]:
                return True
    return None


def oriented(lay: Layout, shapes: dict[str, tuple[int, ...]], cfg: "MoEConfig | Inkling2Config") -> Layout:
    """`lay` with a stacked storage's orientation settled from the shapes (name -> shape) of its
    first expert layer (`stacked_orientation`); any other storage as it is."""
    if lay.experts.kind != "stacked" or not lay.expert_layers:
        return lay
    cfg = MoEConfig.of(cfg)
    first = lay.experts_modules[lay.expert_layers[0]]
    t = stacked_orientation(tuple(shapes.get(f"{first}.down_proj", ())), tuple(shapes.get(f"{first}.gate_up_proj", ())),
                            cfg.hidden_size, cfg.expert_width)
    return replace(lay, experts=replace(lay.experts, transposed=bool(t)))


def text_prefix(names: list[str]) -> str | None:
    """The text model's prefix: the one of TEXT_PREFIXES most names sit under (None: no layers)."""
    counts: dict[str, int] = {}
    for n in names:
        for p in TEXT_PREFIXES:
            if n.startswith(p + "layers."):
                counts[p] = counts.get(p, 0) + 1
                break
    return max(counts, key=counts.get) if counts else None


def detect(names: list[str], cfg: "MoEConfig | Inkling2Config | None" = None, source: str = "checkpoint") -> Layout:
    """The layout of a checkpoint holding `names`; CheckpointError listing what could not be
    placed (and what was expected) when it is not one this module knows."""
    prefix = text_prefix(names)
    if prefix is None:
        raise CheckpointError(f"no decoder layers found: expected tensors under one of "
                              f"{', '.join(p + 'layers.N.' for p in TEXT_PREFIXES)} (first names: "
                              f"{', '.join(repr(n) for n in names[:5])})", path=source)
    kinds: dict[tuple[str, str], set[int]] = {}
    names_seen: set[str] = set()
    for n in names:
        m = _LAYER.fullmatch(n[len(prefix):]) if n.startswith(prefix) else None
        if m is None or m["prefix"] or (cfg is not None and int(m["layer"]) >= cfg.num_hidden_layers):
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
    if cfg is not None and not isinstance(cfg, Inkling2Config) and (kind == "interleaved"
                                                                     or prefix == inkling2.TEXT_PREFIX):
        raise ConfigError(f"the tensors are Inkling 2's under its original names ({prefix}layers.N..., routed "
                          f"experts mlp.experts.w13_weight/w2_weight), but config.json describes a "
                          f"{cfg.model_type!r} model: the config and the tensors must agree (Inkling 2's "
                          f"config.json nests text_config with model_type 'inkling2')", path=source)
    storage = ExpertStorage(kind, block)
    if kind == "per_expert":
        proj = next((p for p in PER_EXPERT_NAMES if names_seen <= set(p)), None)
        if proj is None:
            raise CheckpointError(f"per-expert projections {sorted(names_seen)} mix naming schemes "
                                  f"(expected gate_proj/up_proj/down_proj or w1/w3/w2)", path=source)
        storage = ExpertStorage(kind, block, proj)
    dense = MoEConfig.of(cfg).dense_layers if cfg is not None else None
    if dense is not None:
        expected = set(range(cfg.num_hidden_layers)) - dense
        if expected != layers:
            odd = sorted(expected ^ layers)
            raise CheckpointError(f"config.json puts routed experts in {len(expected)} layers, the tensors in "
                                  f"{len(layers)} (layers that disagree: {odd[:8]})", path=source)
    vision = next((p for p in VISION_PREFIXES if any(n.startswith(p) for n in names)), None)
    projector = next((p for p in PROJECTOR_PREFIXES if any(n.startswith(p) for n in names)), None)
    head = next((h for h in LM_HEADS if h in set(names)), None)
    lay = Layout(prefix, storage, tuple(sorted(layers)), vision, projector, head,
                 cfg.num_hidden_layers if cfg is not None else None)
    unplaced = [n for n in names if _classify(lay, n) is None]
    if unplaced:
        raise CheckpointError(f"{len(unplaced)} tensor(s) fit no part of the detected layout "
                              f"({lay.describe()}): {', '.join(repr(n) for n in unplaced[:5])}"
                              + (" ..." if len(unplaced) > 5 else ""), path=source, tensor=unplaced[0])
    return lay


# --------------------------------------------------------------------------- what a config requires
# The namings an Inkling 2 checkpoint may use: (text prefix, expert storage) -> what it is.
INKLING_NAMINGS = {
    (inkling2.TEXT_PREFIX, ExpertStorage("interleaved", "mlp")):
        "the original names (model.llm.*, model.visual.*; experts mlp.experts.w13_weight [E, 2I, H] gate/up rows "
        "interleaved and w2_weight [E, H, I]): what save_pretrained and the release write",
    ("model.language_model.", ExpertStorage("stacked", "mlp")):
        "transformers' in-memory names (model.language_model.*, model.vision_tower.*, lm_head.weight unpadded; "
        "experts mlp.experts.gate_up_proj [E, 2I, H] gate then up, and down_proj [E, H, I]): what state_dict() holds",
    ("model.language_model.", ExpertStorage("per_expert", "mlp")):
        "transformers' names with per-expert experts as ModelOpt names them "
        "(mlp.experts.E.{gate,up,down}_proj.weight [I, H], [I, H], [H, I])",
}


def original_names(cfg: "MoEConfig | Inkling2Config", prefix: str | None) -> bool:
    """Whether a checkpoint with text prefix `prefix` is an Inkling 2 model's under its original
    names, the only naming `--output-format inkling` writes and ModelOpt's export renames."""
    return isinstance(cfg, Inkling2Config) and prefix == inkling2.TEXT_PREFIX


def expected_tensors(cfg: "MoEConfig | Inkling2Config", lay: Layout) -> dict[str, TensorSpec]:
    """name -> spec of the tensors `cfg` requires of a checkpoint laid out as `lay`: for an
    Inkling 2 config every tensor (inkling2.checkpoint_tensors, the strict spec) under the
    checkpoint's naming (INKLING_NAMINGS); for another family its routed experts' weights (the
    rest passes through as it is). Float specs are BF16: any float dtype fits them."""
    specs = list(_inkling_specs(cfg, lay)) if isinstance(cfg, Inkling2Config) else []
    return {s.name: s for s in (*specs, *expert_specs(lay, MoEConfig.of(cfg)))}


def _inkling_specs(cfg: Inkling2Config, lay: Layout) -> Iterator[TensorSpec]:
    """Every tensor but the routed experts, under the checkpoint's naming."""
    if (lay.text_prefix, replace(lay.experts, transposed=False)) not in INKLING_NAMINGS:
        raise CheckpointError(f"an Inkling 2 config, but the tensors are laid out as no Inkling 2 checkpoint is "
                              f"({lay.describe()}); expected one of: " + "; ".join(INKLING_NAMINGS.values()))
    for s in inkling2.checkpoint_tensors(cfg, include_experts=False):
        yield s if original_names(cfg, lay.text_prefix) else inkling2.transformers_spec(cfg, s)


def expert_tensor_count(lay: Layout, moe: MoEConfig) -> int:
    """How many weights `expert_specs` lists, counted without listing them: what bounds the work a
    config's expert count may ask for by what a checkpoint holds (verify)."""
    return (3 * moe.num_experts if lay.experts.kind == "per_expert" else 2) * len(lay.expert_layers)


def expert_specs(lay: Layout, moe: MoEConfig) -> Iterator[TensorSpec]:
    """The routed experts' weights of every expert layer as `lay` stores them: per expert
    gate/up [I, H] and down [H, I]; stacked or interleaved gate_up [E, 2I, H] and down [E, H, I]
    ([E, in, out] where transposed)."""
    E, H, I, s = moe.num_experts, moe.hidden_size, moe.expert_width, lay.experts
    for module in lay.experts_modules.values():
        if s.kind == "per_expert":
            for e in range(E):
                for name, shape in zip(s.names, ((I, H), (I, H), (H, I))):
                    yield TensorSpec(f"{module}.{e}.{name}.weight", shape, torch.bfloat16)
            continue
        names = ("w13_weight", "w2_weight") if s.kind == "interleaved" else ("gate_up_proj", "down_proj")
        for name, (out, inp) in zip(names, ((2 * I, H), (H, I))):
            yield TensorSpec(f"{module}.{name}", (E, inp, out) if s.transposed else (E, out, inp), torch.bfloat16)
