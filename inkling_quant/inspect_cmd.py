"""Summarize a checkpoint from its safetensors headers alone: parts, number formats per layer
range, bytes, whether the DSpark draft is there. No tensor byte is read: the index, the
config files and each shard's JSON header are all this command opens, so it takes seconds on
a multi-hundred-GB checkpoint. Nothing about a format is re-derived here: each layer's stacked
w13 / w2 is recognized by asking every format in `formats` which stacked tensors (names,
shapes, dtypes: `export.inkling.projection_specs`) it would write for the source shape (from
config.json), and checked against the format the quantization config declares for
`model.llm.layers.N.mlp.experts`; everything else passes through.

Two kinds of checkpoint (layout.model_config): the published Inkling 2 layout under its original
names (inkling_quant.model.inkling2, the bundled DSpark draft of inkling_quant.model.dspark; a config.json
without text_config is refused with a ConfigError), and every other checkpoint (Inkling 2 under
transformers' names too: a state_dict save, ModelOpt's export of it), as transformers saves it
and as ModelOpt's exporter (or our convert) writes it. For those the layout is detected from the names
(layout.detect: text prefix, routed-expert storage and layers, vision tower and projector, shown
first), and each expert module's tensors are recognized by asking every format which tensors it
writes for the module's source shape (`formats.detect`), against the format the quantization
config declares for the layer's experts module.

Exit status 0, or 1 when a tensor is outside the layout, matches no format or not the format
the quantization config declares, or a layer lacks experts (listed)."""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import hub
from .units import human_bytes
from .errors import ConfigError, InklingQuantError, printable
from .export.modelopt import format_of, read_quantization
from .formats import FORMATS, SCALE_SUFFIXES, format_for_quant_algo, get_format
from .formats import detect as detect_format
from .export.inkling import projection_specs
from .model.inkling2 import Inkling2Config, checkpoint_tensors, classify, experts_module
from .model.layout import INDEX_DTYPES, Layout, MoEConfig, detect, max_tensors, model_config, oriented, text_prefix
from .model.naming import ORIGINAL, original_names
from .model.sources import scale_beside
from .io.checkpoint import CONFIG_NAME, HF_QUANT_CONFIG, Checkpoint, read_json, safe_child
from .io.safetensors import TensorEntry

UNRECOGNIZED = "unrecognized"
SOURCE_DTYPES = FORMATS["passthrough"].source_dtypes


@dataclass
class Summary:
    root: str
    shards: int
    file_bytes: int
    tensors: int
    quant_algo: str | None
    parts: dict[str, dict] = field(default_factory=dict)        # part -> tensors, params, bytes, formats
    expert_layers: list[dict] = field(default_factory=list)     # ranges of layers with one expert format
    draft: dict = field(default_factory=dict)
    unknown: list[str] = field(default_factory=list)            # names outside the layout
    unrecognized: list[str] = field(default_factory=list)       # modules no format would write
    mismatched: list[str] = field(default_factory=list)         # format found != format declared
    layout: str = "original"                                     # the published Inkling 2 layout, or a model_type
    detected: dict | None = None                                 # other families: the detected layout
    incomplete: list[str] = field(default_factory=list)         # expert layers missing modules
    disagreeing: list[str] = field(default_factory=list)        # Inkling 2: tensors config.json requires, missing or reshaped
    calibration: dict | None = None                             # the activation scales' provenance (calibrate's)

    @property
    def ok(self) -> bool:
        return not (self.unknown or self.unrecognized or self.mismatched or self.incomplete or self.disagreeing)

    def to_dict(self) -> dict:
        return {"checkpoint": self.root, "shards": self.shards, "file_bytes": self.file_bytes,
                "tensors": self.tensors, "quant_algo": self.quant_algo, "parts": self.parts,
                "expert_layers": self.expert_layers, "draft": self.draft,
                "unknown_tensors": self.unknown, "unrecognized_modules": self.unrecognized,
                "format_mismatches": self.mismatched, "layout": self.layout, "detected": self.detected,
                "incomplete_layers": self.incomplete, "disagreeing_tensors": self.disagreeing,
                "calibration": self.calibration}


def summarize(root: str | Path) -> Summary:
    """Read the index, config.json and every shard header (never tensor data) and summarize."""
    root, ckpt = hub.open_checkpoint(str(root))  # a hub repo id: its headers, no shard downloaded
    path = safe_child(root, CONFIG_NAME)
    cfg = model_config(read_json(path, CONFIG_NAME, ConfigError), str(path))
    if original_names(cfg, text_prefix(list(ckpt.weight_map))):
        s = _summarize(root, ckpt, cfg)
    else:
        s = _summarize_moe(root, ckpt, cfg)  # Inkling 2 too under transformers' names
    s.calibration = _calibration(root)
    return s


def _calibration(root: Path) -> dict | None:
    """The provenance of the activation scales convert recorded (hf_quant_config.json's
    converter.calibration, from a calibrate file), or None."""
    if not (root / HF_QUANT_CONFIG).is_file():
        return None
    hq = read_json(safe_child(root, HF_QUANT_CONFIG), HF_QUANT_CONFIG, ConfigError)
    conv = hq.get("converter") if isinstance(hq, dict) else None
    cal = conv.get("calibration") if isinstance(conv, dict) else None
    return cal if isinstance(cal, dict) else None


def _stacked_format(proj: str, shape: tuple[int, ...], observed: dict[str, TensorEntry]) -> tuple[str, bool | None]:
    """(format, carries an activation scale) whose stacked tensors for a source `<proj>_weight`
    of `shape` are exactly `observed` (name under the experts module -> entry)."""
    w = observed.get(f"{proj}_weight")
    dtype = w.dtype if w is not None and w.dtype in SOURCE_DTYPES else torch.bfloat16
    got = {k: (tuple(e.shape), e.dtype) for k, e in observed.items()}
    for fmt in FORMATS.values():
        for act in (True, False):
            try:
                want = projection_specs(fmt, proj, shape, dtype=dtype, activation_scale=act)
            except InklingQuantError:
                continue
            if {k: (tuple(o.shape), o.dtype) for k, o in want.items()} == got:
                return fmt.name, (act if fmt.quant_algo else None)
    return UNRECOGNIZED, None


def _label(fmt: str, act: bool | None) -> str:
    return fmt if act is None else f"{fmt}{'' if act else ' (weight-only)'}"


def _summarize(root: Path, ckpt: Checkpoint, cfg: Inkling2Config) -> Summary:
    """Each layer's stacked w13 / w2 recognized as a unit, everything else float and passed through."""
    headers = ckpt.headers(max_tensors(cfg))  # a header of 400k empty tensors: refused, not listed
    entries = [e for h in headers.values() for e in h.tensors.values()]
    q = read_quantization(root, cfg.raw)
    s = Summary(str(root), len(headers), sum(h.file_size for h in headers.values()), len(entries),
                q["quant_algo"] if q else None)
    t = cfg.text
    shapes = {"w13": (t.n_routed_experts, 2 * t.moe_intermediate_size, t.hidden_size),
              "w2": (t.n_routed_experts, t.hidden_size, t.moe_intermediate_size)}
    stacked: dict[tuple[int, str], dict[str, TensorEntry]] = defaultdict(dict)
    parts: dict[str, dict] = defaultdict(lambda: {"tensors": 0, "params": 0, "bytes": 0, "formats": defaultdict(int)})
    for e in entries:
        try:
            n = classify(e.name)
        except InklingQuantError:
            s.unknown.append(e.name)
            continue
        if n.part == "expert":
            stacked[(n.layer, n.projection)][f"{n.projection}_{n.suffix}"] = e
            continue
        label = "passthrough" if e.dtype in SOURCE_DTYPES else UNRECOGNIZED
        if label == UNRECOGNIZED:
            s.unrecognized.append(f"{e.name} ({e.dtype} {list(e.shape)})")
        p = parts[n.part]
        p["tensors"], p["bytes"], p["params"] = p["tensors"] + 1, p["bytes"] + e.nbytes, p["params"] + math.prod(e.shape)
        p["formats"][label] += e.nbytes
    per_layer: dict[int, set[str]] = defaultdict(set)
    for (layer, proj), observed in sorted(stacked.items()):
        fmt, act = _stacked_format(proj, shapes[proj], observed)
        label, module = _label(fmt, act), experts_module(layer)
        if fmt == UNRECOGNIZED:
            found = ", ".join(f"{k} {e.dtype} {list(e.shape)}" for k, e in sorted(observed.items()))
            s.unrecognized.append(f"{module}.{proj} ({found})")
        else:
            declared = format_of(q, module)
            if (declared.name if declared is not None else "passthrough") != fmt:
                s.mismatched.append(f"{module}.{proj}: tensors are {fmt}, the quantization config declares "
                                    f"{declared.name if declared is not None else 'none (unquantized)'}")
        nbytes = sum(e.nbytes for e in observed.values())
        p = parts["expert"]
        p["tensors"], p["bytes"], p["params"] = p["tensors"] + len(observed), p["bytes"] + nbytes, \
            p["params"] + math.prod(shapes[proj])
        p["formats"][label] += nbytes
        per_layer[layer].add(label)
    _finish(s, parts, {i: (" + ".join(sorted(f)), t.n_routed_experts) for i, f in per_layer.items()},
            cfg.draft is not None)
    s.incomplete += [f"{experts_module(i)}: no routed experts, config.json implies {t.n_routed_experts}"
                     for i in range(t.num_hidden_layers) if i not in per_layer][:_LISTED]
    unknown = set(s.unknown)
    s.disagreeing = _disagreeing(cfg, ORIGINAL, {e.name: tuple(e.shape) for e in entries
                                                 if e.name not in unknown and classify(e.name).part != "expert"})
    return s


_LISTED = 1000  # problems listed at most: a config claiming 4096 layers over 4 is one disagreement, not 4092 lines


def _disagreeing(cfg: Inkling2Config, naming, shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """The checkpoint's tensors besides the routed experts (`shapes`: name -> shape) against what an
    Inkling 2 config requires of them (its strict spec, under the checkpoint's naming): each one
    missing, of another shape, or not in the spec (a vision tower with no vision_config): what
    convert and verify refuse."""
    out, spec = [], set()
    for want in checkpoint_tensors(cfg, include_experts=False):
        s = naming.spec(cfg, want)
        spec.add(s.name)
        got = shapes.get(s.name)
        if got != s.shape and len(out) < _LISTED:
            out.append(f"{s.name} ({'missing' if got is None else f'shape {list(got)}'}, config.json implies "
                       f"{list(s.shape)})")
    out += [f"{n} (not a tensor of config.json's layout)" for n in shapes if n not in spec][:_LISTED]
    return out


# ============================================================================ other families
def _summarize_moe(root: Path, ckpt: Checkpoint, config: MoEConfig | Inkling2Config) -> Summary:
    """The layout detected from the names; each routed-expert module (an expert's projection, or
    a stacked tensor) recognized as the format whose tensors it holds, everything else float and
    passed through. An Inkling 2 checkpoint under transformers' names is read this way too."""
    cfg = MoEConfig.of(config)
    headers = ckpt.headers(max_tensors(cfg))
    entries = [e for h in headers.values() for e in h.tensors.values()]
    lay = oriented(detect([e.name for e in entries], config, str(root)), {e.name: tuple(e.shape) for e in entries},
                   config)  # an Inkling 2 config: its naming detected too, its tensors classified by its own table
    q = read_quantization(root, cfg.raw)
    s = Summary(str(root), len(headers), sum(h.file_size for h in headers.values()), len(entries),
                q["quant_algo"] if q else None, layout=str(cfg.raw.get("model_type") or cfg.model_type),
                detected=_detected(lay, cfg))
    modules: dict[tuple[int, int, str], dict[str, TensorEntry]] = defaultdict(dict)
    parts: dict[str, dict] = defaultdict(lambda: {"tensors": 0, "params": 0, "bytes": 0, "formats": defaultdict(int)})
    names = {e.name for e in entries}
    for e in entries:
        t = lay.classify(e.name)
        own = lay.owner(e.name)  # a quantized source's stored tensor
        if t.part == "expert":
            modules[(t.layer, -1 if t.expert is None else t.expert, t.projection)][own[1] if own else t.suffix] = e
            continue
        if (kept := _source_module(lay, e, own, names)) is not None:  # e.g. FP8 attention: weight + scale
            _add(parts[t.part], 1, e.nbytes, 0 if own else math.prod(e.shape), kept)
            continue
        if (kept := _kept_module(q, t, e)) is not None:  # a converted FP8 source's FP8_PB_WO module
            _add(parts[t.part], 1, e.nbytes, math.prod(e.shape) if t.suffix == "weight" else 0, kept)
            continue
        label = "passthrough" if (e.dtype in SOURCE_DTYPES and t.suffix not in SCALE_SUFFIXES) \
            or (t.part == "router" and e.dtype in INDEX_DTYPES) else UNRECOGNIZED
        if label == UNRECOGNIZED:
            s.unrecognized.append(f"{e.name} ({e.dtype} {list(e.shape)})")
        _add(parts[t.part], 1, e.nbytes, math.prod(e.shape), label)
    per_layer: dict[int, set[str]] = defaultdict(set)
    counts: dict[int, set[int]] = defaultdict(set)
    for (layer, expert, proj), observed in sorted(modules.items()):
        shape = _expert_shape(lay, cfg, proj)
        fmt, act = _module_format(observed, shape, lay)
        experts = lay.experts_modules[layer]
        if fmt == UNRECOGNIZED:
            found = ", ".join(f"{k} {e.dtype} {list(e.shape)}" for k, e in sorted(observed.items()))
            s.unrecognized.append(f"{experts}.{'' if expert < 0 else f'{expert}.'}{proj} ({found})")
        else:
            declared = lay.source.expert_format if lay.source is not None else \
                getattr(format_of(q, experts), "name", "none (unquantized)")
            note = f"{experts}: tensors are {fmt}, the quantization config declares {declared}"
            if declared.replace("none (unquantized)", "passthrough") != fmt and note not in s.mismatched:
                s.mismatched.append(note)
        _add(parts["expert"], len(observed), sum(e.nbytes for e in observed.values()), math.prod(shape),
             _label(fmt, act))
        per_layer[layer].add(_label(fmt, act))
        counts[layer].add(expert)
    for layer in lay.expert_layers:
        modules_held = sum(1 for k in modules if k[0] == layer)
        want = lay.experts.weights_per_layer(cfg.num_experts)
        if modules_held != want:
            s.incomplete.append(f"{lay.experts_modules[layer]}: {modules_held} expert module(s), config.json "
                                f"implies {want}")
    n = {i: cfg.num_experts if lay.experts.stacked else len(c) for i, c in counts.items()}
    _finish(s, parts, {i: (" + ".join(sorted(f)), n[i]) for i, f in per_layer.items()},
            lay.naming is not None and config.draft is not None)
    if lay.naming is not None:  # Inkling 2 under transformers' names: its strict spec applies
        s.disagreeing = _disagreeing(config, lay.naming, {e.name: tuple(e.shape) for e in entries
                                                          if lay.classify(e.name).part != "expert"})
    return s


def _add(p: dict, tensors: int, nbytes: int, params: int, label: str) -> None:
    p["tensors"], p["bytes"], p["params"] = p["tensors"] + tensors, p["bytes"] + nbytes, p["params"] + params
    p["formats"][label] += nbytes


def _expert_shape(lay: Layout, cfg: MoEConfig, proj: str) -> tuple[int, ...]:
    """The source shape of one routed-expert module: an expert's [out, in]; a stacked tensor's
    [E, out, in] (or [E, in, out] where the checkpoint stores it so)."""
    H, I = cfg.expert_hidden_size, cfg.expert_width
    out, inp = {"down": (H, I), "gate_up": (2 * I, H)}.get(proj, (I, H))
    if not lay.experts.stacked:
        return out, inp
    return (cfg.num_experts, inp, out) if lay.experts.transposed else (cfg.num_experts, out, inp)


def _kept_module(q: dict | None, t, e: TensorEntry) -> str | None:
    """The format of a module a quantization config declares in a format only sources store,
    written as they store it (ModelOpt's FP8_PB_WO: convert keeps an FP8 source's attention so),
    for its tensors of that format's ModelOpt form; else None."""
    entry = ((q or {}).get("quantized_layers") or {}).get(t.module)
    fmt = format_for_quant_algo(entry.get("quant_algo"), source=True) if isinstance(entry, dict) else None
    if fmt is None or not fmt.source_only:
        return None
    spec = fmt.modelopt_specs((1, 1)).get(t.suffix)  # the form's tensors and dtypes (shapes aside)
    return fmt.name if spec is not None and spec.dtype == e.dtype else None


def _source_module(lay: Layout, e: TensorEntry, own: tuple[str, str] | None, names: set[str]) -> str | None:
    """The source format of a quantized source's stored tensor outside the routed experts (an FP8
    weight, or its scale, with its pair present), else None."""
    q = lay.source
    if q is None and lay.family.moe_quant_algo:  # ModelOpt's FP8-release form: kept as the source stores them
        return _as_stored(lay, e, names)
    if q is None or q.experts_only or (own is None and e.dtype in SOURCE_DTYPES):
        return None
    weight = own[0] if own is not None else e.name
    return lay.source_format(weight) if set(lay.stored(weight).values()) <= names else None


def _as_stored(lay: Layout, e: TensorEntry, names: set[str]) -> str | None:
    """The source format of a module kept as the source stores it (a 1-byte `<module>.weight`
    with its scale beside it, `sources.scale_beside`: an MTP block's expert MXFP4, anything else
    FP8 block-scaled), for the weight and for its scale; else None."""
    weight = f"{e.name.rpartition('.')[0]}.weight"
    kept = scale_beside(weight, names) == e.name if e.name != weight else \
        e.dtype.itemsize == 1 and scale_beside(weight, names) is not None
    return lay.kept_format(weight) if kept and weight in names else None


def _module_format(observed: dict[str, TensorEntry], shape: tuple[int, ...],
                   lay: Layout | None = None) -> tuple[str, bool | None]:
    """(format, carries an activation scale) whose tensors for a source weight of `shape` are
    exactly `observed` (suffix -> entry), as the formats say (a quantized source's format too)."""
    w = observed.get("weight")
    dtype = w.dtype if w is not None and w.dtype in SOURCE_DTYPES else torch.bfloat16
    got = {k: (tuple(e.shape), e.dtype) for k, e in observed.items()}
    fmt = detect_format(got, shape, dtype)
    if fmt is None and lay is not None and lay.source is not None:
        src = get_format(lay.source.expert_format, source=True)
        return (src.name, None) if src.matches(got, shape, dtype) else (UNRECOGNIZED, None)
    if fmt is None:
        return UNRECOGNIZED, None
    return fmt.name, (set(got) == set(fmt.out_specs(shape, dtype, True)) if fmt.quant_algo else None)


def _detected(lay: Layout, cfg: MoEConfig) -> dict:
    stacked = lay.experts.stacked
    return {"model_type": str(cfg.raw.get("model_type") or cfg.model_type), "text_config": cfg.nested,
            "text_prefix": lay.text_prefix,
            "experts_module": f"{lay.text_prefix}layers.N.{lay.experts.block}.experts",
            "expert_storage": lay.experts.kind, "transposed": lay.experts.transposed if stacked else None,
            "projections": list(lay.experts.stored_names),
            "expert_layers": list(lay.expert_layers), "experts": cfg.num_experts,
            "vision_prefix": lay.vision_prefix, "projector_prefix": lay.projector_prefix, "lm_head": lay.lm_head,
            "source_format": lay.source.format if lay.source is not None else None,
            "gate_up_interleaved": lay.experts.interleaved if stacked else None}


def _render_layout(d: dict) -> list[str]:
    layers = _ranges({i: ("", 0) for i in d["expert_layers"]})
    spans = ", ".join(f"{r['first']}" if r["first"] == r["last"] else f"{r['first']}-{r['last']}" for r in layers)
    storage = d["expert_storage"] + {True: " [E, in, out]", False: " [E, out, in]", None: ""}[d["transposed"]]
    return [f"layout: {d['model_type']}" + (" (text model settings under text_config)" if d["text_config"] else ""),
            f"  text model      {d['text_prefix']}",
            f"  routed experts  {storage} ({'/'.join(d['projections'])}) in {d['experts_module']}, "
            f"layers {spans or 'none'}",
            f"  vision tower    {d['vision_prefix'] or 'none'}",
            f"  projector       {d['projector_prefix'] or 'none'}",
            f"  lm_head         {d['lm_head'] or 'none'}"] \
        + ([f"  stored          {d['source_format']} (a quantized source: convert requantizes its routed experts)"]
           if d.get("source_format") else []) + [""]


def _finish(s: Summary, parts: dict, per_layer: dict[int, tuple[str, int]], draft_expected: bool) -> None:
    s.parts = {k: {**v, "formats": dict(v["formats"])} for k, v in
               sorted(parts.items(), key=lambda kv: -kv[1]["bytes"])}
    s.expert_layers = _ranges(per_layer)
    d = s.parts.get("draft")
    s.draft = {"present": d is not None, "tensors": d["tensors"] if d else 0, "bytes": d["bytes"] if d else 0,
               "expected_by_config": draft_expected}


def _ranges(per_layer: dict[int, tuple[str, int]]) -> list[dict]:
    """Consecutive layers with the same (format, expert count) merged into one range."""
    out: list[dict] = []
    for i in sorted(per_layer):
        fmt, n = per_layer[i]
        if out and out[-1]["format"] == fmt and out[-1]["experts"] == n and out[-1]["last"] == i - 1:
            out[-1]["last"] = i
        else:
            out.append({"first": i, "last": i, "format": fmt, "experts": n})
    return out


def render(s: Summary) -> str:
    source = (s.detected or {}).get("source_format")
    out = [f"{s.root}: {s.tensors:,} tensors in {s.shards} shard(s), {human_bytes(s.file_bytes, 2)}"
           + (f", quant_algo {s.quant_algo}" if s.quant_algo else
              f", a source's quantization_config ({source})" if source else ", no quantization_config")]
    out.append("")
    if s.detected:
        out += _render_layout(s.detected)
    hdr = f"{'part':<12} {'tensors':>8} {'params':>15} {'bytes':>10}  formats"
    out += [hdr, "-" * len(hdr)]
    for part, p in s.parts.items():
        fm = ", ".join(f"{f} {human_bytes(b, 2)}" for f, b in sorted(p["formats"].items()))
        out.append(f"{part:<12} {p['tensors']:>8,} {p['params']:>15,} {human_bytes(p['bytes'], 2):>10}  {fm}")
    out.append("")
    if s.expert_layers:
        out.append("routed experts:")
        for r in s.expert_layers:
            span = f"{r['first']}" if r["first"] == r["last"] else f"{r['first']}-{r['last']}"
            out.append(f"  layers {span:<7} {r['format']} ({r['experts']} experts per layer)")
    else:
        out.append("routed experts: none")
    d = s.draft
    if d["present"] or not s.detected:  # other families: a draft is ours (Inkling's DSpark) only
        label = "DSpark draft" if not s.detected else "draft / MTP tensors (past the decoder layers)"
        out.append(f"{label}: " + (f"present, {d['tensors']} tensors, {human_bytes(d['bytes'], 2)}" if d["present"]
                                      else "absent" + (" (config.json has a dspark_config)" if d["expected_by_config"]
                                                       else "")))
    if s.calibration:
        c, data = s.calibration, s.calibration.get("data") or {}
        out.append(f"calibration: {c.get('policy')}, {data.get('samples')} samples of {c.get('seq_len')} tokens, "
                   f"{data.get('tokens')} tokens ({data.get('packing')}), data {str(data.get('digest'))[:19]}..., "
                   f"from {', '.join(map(str, data.get('files') or []))}")
    for what, items in (("tensor(s) outside the layout", s.unknown),
                        ("module(s) no format would write", s.unrecognized),
                        ("module(s) not in the format the quantization config declares", s.mismatched),
                        ("expert layer(s) missing modules", s.incomplete),
                        ("tensor(s) that disagree with config.json", s.disagreeing)):
        if items:
            out.append(f"{len(items)} {what}: " + "; ".join(items[:5]) + (" ..." if len(items) > 5 else ""))
    return "\n".join(printable(line) for line in out)  # a name read from a file cannot forge a line
