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

from . import dspark, inkling2
from .families import FAMILIES, GENERIC, Family, family_of
from .fields import MAX_LAYERS, ConfigFields
from ..errors import CheckpointError, ConfigError, InklingQuantError
from ..errors import short_repr as _short
from .inkling2 import Inkling2Config
from .naming import MODELOPT, Naming, naming_of
from .naming import described as described_namings
from .sources import FP8_BLOCK, MXFP4_ROWS, SourceQuant, source_quant
from .storage import CANONICAL, PER_EXPERT_NAMES, STORAGES, ExpertStorage, Interleaved, PerExpert, Stacked
from .tensors import TensorName, TensorSpec


def natural_key(name: str) -> list[tuple[int, int, str]]:
    """Sort key for tensor/module names: numeric components as numbers (layer 2 before 10)."""
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.split(".")]


def model_config(d: dict, source: str) -> "Inkling2Config | MoEConfig":
    """A checkpoint's config.json: the published Inkling 2 model's when it nests `text_config`
    with Inkling's keys (inkling2), else a Hugging Face MoE model's. The one place a command
    decides which."""
    return Inkling2Config.from_dict(d, source) if Inkling2Config.describes(d) else MoEConfig.from_dict(d, source)

# The text model's prefix, longest first (a `model.language_model.` name also starts `model.`);
# "" last: DeepSeek-V4's original names (`layers.N.`, `embed.weight`, `head.weight`: transformers
# 5.25 conversion_mapping.py "deepseek_v4"), taken only for a family whose record says so
# (`Family.bare_names`).
TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "model.llm.", "model.", "")
# Where a multimodal model keeps its vision tower and projector (ModelOpt excludes them).
VISION_PREFIXES = ("model.visual.", "model.vision_tower.", "vision_model.", "vision_tower.", "visual.")
PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.", "mm_projector.")  # Kimi-K3's last
DRAFT_PREFIXES = (dspark.PREFIX,)  # a bundled speculator (`mtp.*`: Inkling's, dspark.py), passed through
# integer tensors a router may hold, passed through: lookup tables (DeepSeek-V4's hash-routed
# layers' `ffn.gate.tid2eid`, token -> experts, int64); anywhere else an integer tensor is a
# quantized weight's (GPTQ's qweight, g_idx) and is refused
INDEX_DTYPES = (torch.int64, torch.int32, torch.int16)
LM_HEADS = ("lm_head.weight", "language_model.lm_head.weight", "model.llm.unembed.weight", "head.weight")


_LIMITS = {"num_hidden_layers": MAX_LAYERS, "num_experts": 1 << 16}
_EXPERT_ALIASES = ("num_experts", "num_local_experts", "n_routed_experts")
# Kimi-K3's text config (vLLM 0.33 transformers_utils/configs/kimi_linear.py) says num_experts_per_token
_TOP_K_ALIASES = ("num_experts_per_tok", "num_experts_per_token")


@dataclass(frozen=True)
class MoEConfig:
    """The text model's MoE settings, from config.json (top level or `text_config`)."""

    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_experts: int
    num_experts_per_tok: int
    expert_width: int                  # moe_intermediate_size, or intermediate_size where that is it
    expert_hidden_size: int            # the width routed experts act on (Kimi-K3's latent MoE: not hidden_size)
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
        top_k = next((k for k in _TOP_K_ALIASES if k in t.obj), _TOP_K_ALIASES[0])
        _check_layer_types(t, n)
        hidden = t.int("hidden_size")
        # Kimi-K3's latent MoE: its routed experts act on routed_expert_hidden_size, between a
        # down and an up projection of the hidden state (vLLM 0.33 models/kimi_k3/nvidia/model.py
        # KimiMoE: `moe_hidden_size`)
        latent = t.int("routed_expert_hidden_size") if t.obj.get("routed_expert_hidden_size") is not None else hidden
        return cls(model_type=t.string("model_type") or top.string("model_type") or "?",
                   hidden_size=hidden, num_hidden_layers=n, num_experts=experts,
                   num_experts_per_tok=t.int(top_k, hi=experts), expert_width=t.int(width_key),
                   expert_hidden_size=latent, dense_layers=_dense_layers(t, n), nested=nested, raw=dict(d))

    @property
    def family(self) -> Family:
        """The record of its family (model/families.py): the text config's model_type, else the top level's."""
        return family_of(self.model_type, self.raw.get("model_type"))

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
                   expert_hidden_size=t.hidden_size, dense_layers=frozenset(), nested=True, raw=cfg.raw)


def _check_layer_types(t: ConfigFields, n: int) -> None:
    """layer_types, where given: one string per layer, as transformers 5.25's validate_layer_type
    requires (configuration_utils.py:709-723; which kinds plan models is plan's to say)."""
    v = t.obj.get("layer_types")
    if v is None:
        return
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise ConfigError(f"{t.where}layer_types must be a list of strings, got {_short(v)}", path=t.source)
    if len(v) != n:
        raise ConfigError(f"{t.where}layer_types has {len(v)} entries, num_hidden_layers is {n}: one per layer",
                          path=t.source)


def _dense_layers(t: ConfigFields, n: int) -> frozenset[int] | None:
    """The layers without routed experts by the family's rule, or None when the config has none
    (detection then trusts the tensors). Every key a rule reads is checked where present, whichever
    rule applies: a malformed one is refused, not skipped by the order of the rules."""
    o = t.obj
    first = t.int("first_k_dense_replace", lo=0, hi=n) if "first_k_dense_replace" in o else None  # DeepSeek-V3
    # DeepSeek-V2, Kimi-K3: MoE where i >= first_k_dense_replace (default 0) and i % moe_layer_freq == 0
    freq = t.int("moe_layer_freq") if o.get("moe_layer_freq") is not None else 1
    only, step = t.layer_list("mlp_only_layers", n), t.int("decoder_sparse_step", 1)  # Qwen2/3-MoE
    moe = t.layer_list("moe_layers", n) if o.get("moe_layers") is not None else None  # Llama 4
    every = t.int("interleave_moe_layer_step") if "interleave_moe_layer_step" in o else None
    if first is not None or freq != 1:
        return frozenset(i for i in range(n) if i < (first or 0) or i % freq)
    if "mlp_only_layers" in o or "decoder_sparse_step" in o:  # modeling_qwen3_moe.py
        return frozenset(i for i in range(n) if i in only or (i + 1) % step)
    if moe is not None:
        return frozenset(range(n)) - frozenset(moe)
    if every is not None:
        return frozenset(i for i in range(n) if (i + 1) % every)
    return None


_LAYER = re.compile(r"(?P<prefix>.*?)layers\.(?P<layer>\d+)\.(?P<rest>.+)")
_SHARED = re.compile(r"(?:mlp|feed_forward|ffn|block_sparse_moe)\.(?:shared_experts?|shared_expert_gate)\..+")
# DeepSeek-V4's hash-routed layers hold a token -> experts table (`ffn.gate.tid2eid`) in the router
_ROUTER = re.compile(r"(?:mlp|block_sparse_moe|ffn)\.gate\.(?:weight|bias|e_score_correction_bias|tid2eid)"
                     r"|(?:feed_forward|mlp)\.router\..+")
_DENSE = re.compile(r"(?:mlp|feed_forward)\.(?:gate_proj|up_proj|down_proj)\..+")
_MTP = re.compile(r"mtp\.(?P<block>\d{1,3})\.(?P<rest>.+)")  # DeepSeek-V4's MTP blocks (Family.mtp_experts)
_ATTENTION = re.compile(r"(?:self_attn|attn)\..+")
_PER_EXPERT_MODULE = re.compile(r"(?P<experts>.+\.experts)\.(?P<expert>\d{1,9})\.(?P<proj>"
                                + "|".join(n for names in PER_EXPERT_NAMES for n in names) + ")")


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
    naming: Naming | None = None   # an Inkling 2 checkpoint's naming (model.naming); None for other families
    source: SourceQuant | None = None  # a quantized source's storage (model/sources.py); None: float weights
    family: Family = GENERIC           # the config's family record (model/families.py)

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

    # --- a quantized source's stored tensors (model/sources.py), per weight ---------------
    def source_format(self, weight: str) -> str:
        """The format a quantized source stores the weight `weight` in (its routed experts' or its
        other Linears'; DeepSeek-V4 has one of each)."""
        return self.source.format_of(self.expert_weight(weight))

    def stored(self, weight: str) -> dict[str, str]:
        """format suffix -> checkpoint name of the tensors a quantized source stores `weight` in."""
        return self.source.stored(weight, self.expert_weight(weight))

    def owner(self, name: str) -> tuple[str, str] | None:
        """(the weight a BF16 checkpoint would name, format suffix) of a quantized source's stored
        tensor `name` when its name is a companion's (a scale, MXFP4's blocks); None otherwise."""
        weight = self.source.owner(name) if self.source is not None else None
        if weight is None:
            return None
        return weight, next((k for k, n in self.stored(weight).items() if n == name), "weight")

    def kept_format(self, weight: str) -> str:
        """The source format of a module an output keeps as the source stored it, where the
        output's layout has no source to ask (ModelOpt's FP8-release form, export/fp8_release.py):
        an MTP block's expert MXFP4, any other Linear FP8 block-scaled."""
        return MXFP4_ROWS if self.expert_weight(weight) else FP8_BLOCK

    def expert_weight(self, weight: str) -> bool:
        """Whether `weight` is a routed expert's, as a source stores it: the decoder's, or one of an
        MTP block's experts (`Family.mtp_experts`: stored as the decoder's are, though passed
        through as draft tensors)."""
        rec = self.part_of(weight)
        if rec is not None and rec.part == "draft" and self.family.mtp_experts:
            m = _MTP.fullmatch(weight)
            return m is not None and self.experts.match(m["rest"]) is not None
        return rec is not None and rec.part == "expert"

    @property
    def original_names(self) -> bool:
        """An Inkling 2 checkpoint under its original names: the only naming `--output-format
        inkling` writes and ModelOpt's export renames."""
        return self.naming is not None and self.naming.is_original

    def stacked_tensor_of(self, module: str) -> tuple[str, int] | None:
        """(the stacked tensor holding the per-expert module `module`, its expert) for a stacked
        layout: `<experts>.<e>.gate_proj` -> `<experts>.gate_up_proj` (Inkling 2's original
        `...w13_weight`, its experts module under its own or ModelOpt's names); None for any
        other name or a per-expert layout."""
        m = _PER_EXPERT_MODULE.fullmatch(module)
        if m is None or not self.experts.stacked:
            return None
        layer = self._experts_layers().get(m["experts"])
        if layer is None:
            return None
        proj = CANONICAL[next(i for names in PER_EXPERT_NAMES for i, n in enumerate(names) if n == m["proj"])]
        return self.experts.tensor(self.experts_modules[layer], int(m["expert"]), proj), int(m["expert"])

    def _experts_layers(self) -> dict[str, int]:
        """experts module -> layer, under this layout's names and, for Inkling 2, ModelOpt's."""
        out = {m: i for i, m in self.experts_modules.items()}
        if self.naming is not None:
            out.update({MODELOPT.experts_module(i): i for i in self.expert_layers})
        return out

    def activation_key(self, rec: TensorName) -> str | None:
        """The module a routed expert's activation amax is keyed by (None for other tensors and for
        a quantized source's scales): `ExpertStorage.activation_key`, of the weight a quantized
        source's stored tensor holds (an MXFP4 source's `..._blocks`: its stacked weight)."""
        if rec.part != "expert":
            return None
        own = self.owner(rec.name)
        if own is not None:
            return self.experts.activation_key(own[0].rsplit(".", 1)[0], own[0]) if own[1] == "weight" else None
        if rec.suffix != "weight":
            return None
        return self.experts.activation_key(rec.module, rec.name)

    def describe(self) -> str:
        return (f"text model under {self.text_prefix!r}, routed experts {self.experts.describe()}"
                f" in {len(self.expert_layers)} layers"
                + (f", vision tower under {self.vision_prefix!r}" if self.vision_prefix else "")
                + (f", projector under {self.projector_prefix!r}" if self.projector_prefix else "")
                + (f"; {self.source.describe()}" if self.source else ""))


def _classify(lay: Layout, name: str) -> TensorName | None:
    rec = _classify_generic(lay, name)
    if rec is None or lay.naming is None or rec.part in ("expert", "lm_head"):
        return rec
    try:  # Inkling 2: every tensor by its own table, whichever naming holds it (inspect's parts alike)
        own = lay.naming.classify(name)
    except InklingQuantError:
        return rec
    return replace(rec, part=own.part) if own.part != "expert" else rec


def _classify_generic(lay: Layout, name: str) -> TensorName | None:
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
    if (e := lay.experts.match(rest)) is not None:
        return TensorName(name, "expert", layer, *e)
    for regex, part in ((_SHARED, "shared_expert"), (_ROUTER, "router"), (_DENSE, "dense_mlp"),
                        (_ATTENTION, "attention")):
        if regex.fullmatch(rest):
            return TensorName(name, part, layer, suffix=rest.rsplit(".", 1)[-1])
    return TensorName(name, "other", layer, suffix=rest.rsplit(".", 1)[-1])


def oriented(lay: Layout, shapes: dict[str, tuple[int, ...]], cfg: "MoEConfig | Inkling2Config") -> Layout:
    """`lay` with its storage's orientation settled from the shapes (name -> shape) of its first
    expert layer (`ExpertStorage.oriented`: a stacked storage's [E, out, in] or [E, in, out])."""
    if not lay.expert_layers:
        return lay
    cfg = MoEConfig.of(cfg)
    first = lay.experts_modules[lay.expert_layers[0]]
    return replace(lay, experts=lay.experts.oriented(shapes, first, cfg.expert_hidden_size, cfg.expert_width))


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
    family = MoEConfig.of(cfg).family if cfg is not None else GENERIC
    if prefix is None or (prefix == "" and not family.bare_names):  # bare `layers.N.`: only where the family's are
        raise CheckpointError(f"no decoder layers found: expected tensors under one of "
                              f"{', '.join(p + 'layers.N.' for p in TEXT_PREFIXES if p)} (bare 'layers.N.' "
                              f"only for {', '.join(f.name for f in FAMILIES if f.bare_names)}; first names: "
                              f"{', '.join(repr(n) for n in names[:5])})", path=source)
    kinds: dict[tuple[type[ExpertStorage], str], set[int]] = {}
    names_seen: set[str] = set()
    for n in names:
        m = _LAYER.fullmatch(n[len(prefix):]) if n.startswith(prefix) else None
        if m is None or m["prefix"] or (cfg is not None and int(m["layer"]) >= cfg.num_hidden_layers):
            continue
        for storage in STORAGES:
            if (e := storage.pattern.fullmatch(m["rest"])) is not None:
                kinds.setdefault((storage, e["block"]), set()).add(int(m["layer"]))
                if storage is PerExpert:
                    names_seen.add(e["proj"])
    if len(kinds) != 1:
        what = "none" if not kinds else ", ".join(f"{k.kind} under {b}" for k, b in kinds)
        raise CheckpointError(f"routed experts: expected one storage (per-expert "
                              f"'layers.N.mlp.experts.E.gate_proj.weight' or 'block_sparse_moe.experts.E.w1.weight', "
                              f"stacked 'layers.N.mlp.experts.gate_up_proj', Inkling 'mlp.experts.w13_weight'); "
                              f"found {what}", path=source)
    (kind, block), layers = next(iter(kinds.items()))
    if cfg is not None and not isinstance(cfg, Inkling2Config) and (kind is Interleaved
                                                                     or prefix == inkling2.TEXT_PREFIX):
        raise ConfigError(f"the tensors are Inkling 2's under its original names ({prefix}layers.N..., routed "
                          f"experts mlp.experts.w13_weight/w2_weight), but config.json describes a "
                          f"{cfg.model_type!r} model: the config and the tensors must agree (Inkling 2's "
                          f"config.json nests text_config with model_type 'inkling2')", path=source)
    storage = kind(block)
    if kind is Stacked and cfg is not None and MoEConfig.of(cfg).family.gate_up_interleaved:
        storage = Stacked(block, interleaved=True)
    if kind is PerExpert:
        proj = next((p for p in PER_EXPERT_NAMES if names_seen <= set(p)), None)
        if proj is None:
            raise CheckpointError(f"per-expert projections {sorted(names_seen)} mix naming schemes "
                                  f"(expected gate_proj/up_proj/down_proj or w1/w3/w2)", path=source)
        storage = PerExpert(block, proj)
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
    naming = naming_of(prefix, storage) if isinstance(cfg, Inkling2Config) else None
    if isinstance(cfg, Inkling2Config) and naming is None:
        raise CheckpointError(f"an Inkling 2 config, but the tensors are laid out as no Inkling 2 checkpoint is "
                              f"(text model under {prefix!r}, routed experts {storage.describe()}); expected one "
                              f"of: {described_namings()}", path=source)
    quant = source_quant(cfg.raw, f"{source}/config.json", names) if cfg is not None else None
    lay = Layout(prefix, storage, tuple(sorted(layers)), vision, projector, head,
                 cfg.num_hidden_layers if cfg is not None else None, naming, quant, family)
    unplaced = [n for n in names if _classify(lay, n) is None]
    if unplaced:
        raise CheckpointError(f"{len(unplaced)} tensor(s) fit no part of the detected layout "
                              f"({lay.describe()}): {', '.join(repr(n) for n in unplaced[:5])}"
                              + (" ..." if len(unplaced) > 5 else ""), path=source, tensor=unplaced[0])
    return lay


# --------------------------------------------------------------------------- what a config requires
def expected_tensors(cfg: "MoEConfig | Inkling2Config", lay: Layout) -> dict[str, TensorSpec]:
    """name -> spec of the tensors `cfg` requires of a checkpoint laid out as `lay`: for an
    Inkling 2 checkpoint every tensor (inkling2.checkpoint_tensors, the strict spec) under its
    naming (`Layout.naming`); for another family its routed experts' weights (the rest passes
    through as it is). Float specs are BF16: any float dtype fits them."""
    specs = [lay.naming.spec(cfg, s) for s in inkling2.checkpoint_tensors(cfg, include_experts=False)] \
        if lay.naming is not None else []
    return {s.name: s for s in (*specs, *expert_specs(lay, MoEConfig.of(cfg)))}


def expert_tensor_count(lay: Layout, moe: MoEConfig) -> int:
    """How many weights `expert_specs` lists, counted without listing them: what bounds the work a
    config's expert count may ask for by what a checkpoint holds (verify, convert)."""
    return lay.experts.weights_per_layer(moe.num_experts) * len(lay.expert_layers)


# What a checkpoint of a config can hold at most, whatever its naming, expert storage and formats
# (max_tensors): each stored weight with up to 6 tensors (the weight, block and global scales, an
# activation scale, an AWQ pre-quant scale, a bias); per decoder layer up to 128 more (attention,
# norms, router, shared experts or a dense MLP, each quantized too); 8192 for the rest (embeddings,
# heads, a vision tower, a draft); two layers more for a draft's or an MTP layer's experts.
TENSORS_PER_WEIGHT, TENSORS_PER_LAYER, TENSORS_ELSEWHERE, EXTRA_LAYERS = 6, 128, 8192, 2


def max_tensors(cfg: "MoEConfig | Inkling2Config") -> int:
    """The most tensors a checkpoint of `cfg` can hold: every routed expert's weights stored apart
    (PerExpert, the storage with the most), each with its scales. What bounds the work a shard's
    header or an index can ask for before its entries are built (verify, inspect, convert); a real
    checkpoint holds far fewer (Inkling 2 Small per expert, NVFP4: ~222k of its ~360k)."""
    moe = MoEConfig.of(cfg)
    per_layer = PerExpert().weights_per_layer(moe.num_experts) * TENSORS_PER_WEIGHT + TENSORS_PER_LAYER
    return (moe.num_hidden_layers + EXTRA_LAYERS) * per_layer + TENSORS_ELSEWHERE


def expert_specs(lay: Layout, moe: MoEConfig) -> Iterator[TensorSpec]:
    """The routed experts' weights of every expert layer as `lay` stores them
    (`ExpertStorage.weight_shapes`)."""
    for module in lay.experts_modules.values():
        for name, shape in lay.experts.weight_shapes(module, moe.num_experts, moe.expert_hidden_size,
                                                     moe.expert_width).items():
            yield TensorSpec(name, shape, torch.bfloat16)
