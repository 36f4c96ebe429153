"""The layout in `verify`, one path for every layout: the `layout` check, what the `config` check
holds the quantization configs to, and `numerics[layer L]`.

The checkpoint's layout is detected once from its tensor names (layout.detect: the text prefix,
where the routed experts are and how they are stored). The storage says what each layer's
experts are, asked of the format for that storage:
  interleaved  Inkling's stacked form `<module>.w13_*` / `w2_*` (export.inkling.projection_specs)
  per_expert   ModelOpt's export form (and a BF16 source's): `<module>.<e>.<proj>.<suffix>` under
               the family's projection names (Format.out_tensors)
  stacked      transformers' fused `gate_up_proj` / `down_proj`, unquantized only
with the shapes from config.json (E experts of width I over hidden size H). Everything else
passes through: for an Inkling 2 config its strict spec (inkling2.checkpoint_tensors without
the experts) under the checkpoint's naming (layout.INKLING_NAMINGS: the original names, or
transformers' with lm_head cut to the unpadded vocabulary, inkling2.transformers_spec), and
--against under the source's naming (`Expected.source_of` maps one to the other); for other
families the source's other tensors (--against), else any float tensor the layout places
outside the routed experts that is not named as a scale.

Each layer's experts have one format: the one whose tensors the layer holds exactly (with or
without an activation scale), else the one the quantization config declares for the experts
module (export.format_of; without a config, the scheme's). A scheme given (--scheme, the
converter's record) must agree with the tensors; the config check names a declaration that
disagrees.

`numerics` compares each sampled expert's quantized modules (ModelOpt's per-expert tensors, or
its slices of the stacked ones: export.inkling.unstack_expert) with the source expert's weights,
read for the source's storage (`_source_expert`)."""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch

from ..errors import FormatError, InklingQuantError
from ..export.modelopt import format_of, read_quantization
from ..formats import FORMATS, SCALE_SUFFIXES, Format, get_format
from ..export import form_of
from ..export.inkling import unstack_expert
from ..model.inkling2 import RELEASE_EXPERT_FORMAT, Inkling2Config, checkpoint_tensors
from ..io.safetensors import DTYPE_NAMES
from ..model.layout import CANONICAL, INDEX_DTYPES, Layout, MoEConfig, detect, expert_tensor_count, natural_key, oriented
from ..model.tensors import TensorName, TensorSpec
from .inventory import (CHECKED, DISAGREES, FAILED, SKIPPED, Conf, Expected, Files, Inventory, Shape, Source,
                        config_shape, listing, weight_only_vote)
from .encoding import read_stacked_expert
from .sources import copy_expected, kept_modules, read_weight, stored_as, stored_shapes
from .numerics import Gemm, moe_figures, judge, layer_figures, module_tensors, sample_experts, start, stored_ok
from .report import Check, Recorder
from .stream import torch_threads

_PASS = FORMATS["passthrough"]
# a layer's routed-expert weights as the checkpoint names them -> (source shape, source dtype)
Weights = dict[str, tuple[tuple[int, ...], torch.dtype]]


def dims(cfg) -> tuple[int, int, int]:
    """(experts E, the width H experts act on, expert width I) of an Inkling 2 or another family's config."""
    moe = MoEConfig.of(cfg)
    return moe.num_experts, moe.expert_hidden_size, moe.expert_width


# ============================================================================ layout
def check_layout(run: Recorder, files: Files, conf: Conf, source: Source | None) -> Expected:
    """The `layout` check: every tensor the layout and the quantization config require, present
    with its dtype and shape, and no other. Returns what it expected (nothing when it could not check)."""
    c = run.new("layout", "structure",
                "every tensor the layout and the quantization config require is present with its dtype and "
                "shape; no other")
    if not conf.usable:
        c.skip("config.json could not be used")
    elif not files.index_ok and not files.tensors:
        c.skip("the index could not be read")
    else:
        expected = run.guard(c, _check, c, files, conf, source)
        return expected if expected is not None else Expected(FAILED)
    return Expected(SKIPPED)


def _check(c: Check, files: Files, conf: Conf, source: Source | None) -> Expected:
    if stored_as(conf) is not None:  # stored as a quantized source stores it (a --scheme none copy)
        expected = copy_expected(c, files, conf, source)
        if expected.status == CHECKED:
            compare(c, files, conf, expected, lambda n: "the source has no such tensor (a copy holds exactly its tensors)")
        return expected
    spec = None
    if conf.strict:  # Inkling 2: its strict spec but the routed experts
        spec = _spec(c, files, conf)
        if spec is None:
            return Expected(DISAGREES)
    lay = _layout(files, conf)
    src = source.layout if source is not None and source.ok else None
    lay = _expert_layers(c, conf, lay, src)
    if not _bounded(c, files, conf, len(spec or ()) + expert_tensor_count(lay, MoEConfig.of(conf.cfg))):
        return Expected(DISAGREES)
    if spec is not None:
        tensors, source_of = _spec_tensors(spec, lay, conf, files, source)
    else:
        tensors, source_of = _others(files, source if src else None, lay), {}
    kept = kept_modules(files, conf, source if src else None, lay)
    tensors.update(kept.tensors)
    for n in kept.dropped:
        tensors.pop(n, None)
    source_of.update(kept.source_of)
    fmt_of, module_tensors = dict.fromkeys(tensors, _PASS.name), {}
    weights = {i: _weights(lay, conf, i, files, source) for i in lay.expert_layers}
    held, declared = _held(files, lay), _declared(conf, lay)
    fmts = {i: _layer_format(c, files, conf, lay, i, w, held.get(lay.experts_modules[i], {}), declared)
            for i, w in weights.items()}
    weight_only = _weight_only(conf, lay, weights, fmts, held)
    for i, w in weights.items():
        want = _specs(lay, w, fmts[i], not weight_only, conf)
        tensors.update(want)
        fmt_of.update(dict.fromkeys(want, fmts[i].name))
        if fmts[i] is not _PASS:
            module_tensors[lay.experts_modules[i]] = list(want)
    expected = Expected(CHECKED, weight_only, tensors, fmt_of, module_tensors, source_of, layout=lay,
                        kept_modules=kept.modules, dequantized=kept.dequantized)
    compare(c, files, conf, expected, _why(lay, files, src is not None, spec is not None))
    c.figures["detected"] = lay.describe()
    return expected


def _spec(c: Check, files: Files, conf: Conf) -> list[TensorSpec] | None:
    """An Inkling 2 config's strict spec but the routed experts; None (the reason in `c`) when the
    config implies far more tensors than the files hold."""
    out = []
    for s in checkpoint_tensors(conf.cfg, include_experts=False):
        if not _bounded(c, files, conf, len(out)):  # generated lazily: stop at the bound, not at the claim
            return None
        out.append(s)
    return out


def _bounded(c: Check, files: Files, conf: Conf, implied: int) -> bool:
    """Whether the `implied` tensors (each at least one stored tensor) can be what the files hold:
    more than 4x their count is a config that disagrees with them (layer or expert counts?), and
    is failed before anything is listed tensor by tensor, so the work stays bounded by the files."""
    bound = 4 * (len(files.weight_map) or len(files.tensors)) + 64
    if implied <= bound:
        return True
    c.fail(conf.root / "config.json", None, f"config.json implies more than {bound} tensors, the checkpoint holds "
           f"{len(files.tensors)}: they disagree (layer or expert counts?); not checked tensor by tensor")
    return False


def _layout(files: Files, conf: Conf) -> Layout:
    """The checkpoint's layout, detected from its names (a stacked storage's orientation settled)."""
    names = list(dict.fromkeys([*files.weight_map, *files.tensors]))
    lay = detect(names, conf.cfg, str(conf.root))  # config and tensors agree, Inkling 2 under one of its namings
    return oriented(lay, {n: tuple(w.entry.shape) for n, w in files.tensors.items()}, conf.cfg)


def _expert_layers(c: Check, conf: Conf, lay: Layout, src: Layout | None) -> Layout:
    """The layers that must hold routed experts: the source's (--against), else every layer the
    config does not make dense (Inkling 2: every layer); for a config without a dense-layer rule
    (Mixtral) the tensors decide, as layout.detect and convert decide (docs/layout.md, "How
    detection decides", step 4). Layers with experts beyond them fail; missing ones are expected
    (the comparison names each missing tensor)."""
    n = conf.cfg.num_hidden_layers
    dense = MoEConfig.of(conf.cfg).dense_layers
    want = set(src.expert_layers) if src is not None else set(range(n)) - dense if dense is not None \
        else set(lay.expert_layers)
    by = "the source" if src is not None else "config.json"
    for i in sorted(set(lay.expert_layers) - want):
        c.fail(listing(conf.root), _named(lay, lay.experts_modules[i]),
               f"layer {i} holds routed experts; {by} has none there" + ("" if src else f" (num_hidden_layers {n})"))
    return replace(lay, expert_layers=tuple(sorted(want | set(lay.expert_layers))))


def _spec_tensors(spec: list[TensorSpec], lay: Layout, conf: Conf, files: Files,
                  source: Source | None) -> tuple[dict[str, Shape], dict[str, str]]:
    """The strict spec's tensors as the checkpoint names them (layout.INKLING_NAMINGS), and output
    name -> the source's name where the two namings differ (--against: the source's layout
    decides its naming)."""
    src = source.layout if source is not None else None
    tensors, source_of = {}, {}
    for s in spec:
        out = _named_as(conf.cfg, lay, s)
        src_name = _named_as(conf.cfg, src, s).name if src is not None else out.name
        tensors[out.name] = (tuple(out.shape), _source_dtype(out.name, files, source, src_name, s.dtype))
        if out.name != src_name:
            source_of[out.name] = src_name
    return tensors, source_of


def _named_as(cfg: Inkling2Config, lay: Layout, spec: TensorSpec) -> TensorSpec:
    """A tensor of the original layout as a checkpoint of layout `lay` holds it (`Naming.spec`)."""
    return lay.naming.spec(cfg, spec)


def _others(files: Files, source: Source | None, lay: Layout) -> dict[str, Shape]:
    """What passes through: the source's tensors but its routed experts (--against); without a
    source, every float tensor the layout places outside the routed experts, none named as a
    scale, and a router's lookup table (layout.INDEX_DTYPES)."""
    if source is not None:
        return {n: (tuple(w.entry.shape), w.entry.dtype) for n, w in source.tensors.items()
                if source.layout.classify(n).part != "expert"}
    out = {}
    for n, w in files.tensors.items():
        t = lay.classify(n)
        if t.part != "expert" and (w.entry.dtype in _PASS.source_dtypes and t.suffix not in SCALE_SUFFIXES
                                   or t.part == "router" and w.entry.dtype in INDEX_DTYPES):
            out[n] = (tuple(w.entry.shape), w.entry.dtype)
    return out


def _why(lay: Layout, files: Files, against: bool, spec: bool) -> Callable[[str], str]:
    def why(name: str) -> str:
        t = lay.classify(name)
        if t.part == "expert":
            return ("not a tensor of its layer's routed experts in their format (an expert or layer past "
                    "config.json's counts, or a tensor the format does not write)")
        if spec:
            return "not a tensor of the Inkling 2 layout for this config.json (docs/layout.md)"
        if against:
            return "the source has no such tensor (everything but the routed experts passes through as it is)"
        dtype = DTYPE_NAMES[files.tensors[name].entry.dtype]
        return (f"a {t.part} tensor stored as {dtype}{' named as a scale' if t.suffix in SCALE_SUFFIXES else ''}: "
                f"only routed experts are quantized, everything else passes through as the source stores it")
    return why


def source_tensor(lay: Layout, layer: int, e: int, proj: str) -> str:
    """The tensor holding expert `e`'s projection `proj` (gate, up, down) in a checkpoint of
    layout `lay` (`ExpertStorage.tensor`)."""
    return lay.experts.tensor(lay.experts_modules[layer], e, proj)


def _source_dtype(name: str, files: Files, source: Source | None, src_name: str | None,
                  default: torch.dtype = torch.bfloat16) -> torch.dtype:
    """The dtype the source holds a weight in: the source's (--against), else the one stored
    where it is float (pass-through keeps it), else `default`."""
    if source is not None and src_name in source.tensors:
        return source.tensors[src_name].entry.dtype
    got = files.tensors.get(name)
    return got.entry.dtype if got is not None and got.entry.dtype in _PASS.source_dtypes else default


def _weights(lay: Layout, conf: Conf, layer: int, files: Files, source: Source | None) -> Weights:
    """Layer `layer`'s expert weights as the checkpoint stores them (per expert, or the layer's
    two stacked tensors in their orientation), with their source shape and dtype."""
    module, (E, H, I) = lay.experts_modules[layer], dims(conf.cfg)
    src = source.layout if source is not None else None
    shapes = lay.experts.weight_shapes(module, E, H, I)
    if lay.experts.stacked:
        return {w: (shape, _source_dtype(w, files, source, w)) for w, shape in shapes.items()}
    out: Weights = {}
    for e in range(E):  # per expert: each weight's dtype is its source tensor's (the source's own storage)
        for proj in CANONICAL:
            w = lay.experts.tensor(module, e, proj)
            s = source_tensor(src, layer, e, proj) if src is not None and layer in src.expert_layers else None
            out[w] = (shapes[w], _source_dtype(w, files, source, s))
    return out


def _specs(lay: Layout, weights: Weights, fmt: Format, activation_scale: bool,
           conf: Conf | None = None) -> dict[str, Shape]:
    """name -> (shape, dtype) of every tensor `fmt` writes for the weights in the layout's
    storage. FormatError (naming config.json and the weight; without `conf`, the format's own)
    when a shape cannot be `fmt`."""
    out: dict[str, Shape] = {}
    form = form_of(lay)  # the form a checkpoint of this layout is in
    for w, (shape, dtype) in weights.items():
        with config_shape(conf, w, shape, fmt):
            specs = form.expert_specs(lay, w, shape, dtype, fmt, activation_scale)
        out.update({n: (tuple(o.shape), o.dtype) for n, o in specs.items()})
    return out


def _held(files: Files, lay: Layout) -> dict[str, dict[str, Shape]]:
    """experts module -> {name: (shape, dtype)} of the routed-expert tensors the headers hold."""
    modules = set(lay.experts_modules.values())
    out: dict[str, dict[str, Shape]] = {}
    for n, w in files.tensors.items():
        head, sep, _ = n.partition(".experts.")
        if sep and head + ".experts" in modules:
            out.setdefault(head + ".experts", {})[n] = (tuple(w.entry.shape), w.entry.dtype)
    return out


def _stored(lay: Layout, weights: Weights, held: dict[str, Shape]) -> Format | None:
    """The format whose tensors (with or without an activation scale) the layer holds exactly."""
    for fmt in FORMATS.values():
        for act in (True, False) if fmt.static_activation_scale else (True,):
            try:
                if _specs(lay, weights, fmt, act) == held:
                    return fmt
            except FormatError:
                break
    return None


def _declared(conf: Conf, lay: Layout) -> Callable[[str, int], Format]:
    """(experts module, layer) -> the format the quantization config declares for it (none:
    pass-through); without a quantization config, the scheme's. A malformed config counts as
    none here (the config check reports it)."""
    try:
        q = read_quantization(conf.root, conf.config)
    except InklingQuantError:
        q = {}
    if q is None:
        return lambda module, layer: conf.format_for(TensorName(f"{module}.0", "expert", layer))

    return lambda module, layer: format_of(q, module) or _PASS  # read_quantization checked the types


def _layer_format(c: Check, files: Files, conf: Conf, lay: Layout, layer: int, weights: Weights,
                  held: dict[str, Shape], declared: Callable[[str, int], Format]) -> Format:
    """The format layer `layer`'s experts are checked as: the one their tensors are, else the
    declared one. A scheme given (--scheme, the converter's record) must agree with the tensors."""
    stored, module = _stored(lay, weights, held), lay.experts_modules[layer]
    if stored is not None and conf.scheme_given:
        prescribed = conf.format_for(TensorName(f"{module}.0", "expert", layer))
        if prescribed is not stored:
            name = next(iter(weights))
            where = files.tensors.get(name)
            c.fail(conf.root / where.shard if where else listing(conf.root), name,
                   f"the experts of layer {layer} are stored as {stored.name}; scheme {conf.scheme.name!r} "
                   f"prescribes {prescribed.name}")
    return stored or declared(module, layer)


def _weight_only(conf: Conf, lay: Layout, weights: dict[int, Weights], fmts: dict[int, Format],
                 held: dict[str, dict[str, Shape]]) -> bool:
    """W4A16 or W4A4 (inventory.weight_only_vote): does each layer whose format has a static
    activation scale hold one?"""
    holds = []
    for i, fmt in fmts.items():
        if fmt.static_activation_scale:
            act = set(_specs(lay, weights[i], fmt, True, conf)) - set(_specs(lay, weights[i], fmt, False, conf))
            holds.append(bool(act & set(held.get(lay.experts_modules[i], {}))))
    return weight_only_vote(conf, holds)


def compare(c: Check, files: Files, conf: Conf, expected: Expected, why: Callable[[str], str]) -> None:
    """The tensors against `expected`: each present with its dtype and shape; none other (`why`
    says why one is unexpected)."""
    root, unreadable = conf.root, {}
    for n, (shape, dtype) in expected.tensors.items():
        got, fmt = files.tensors.get(n), expected.fmt_of[n]
        if got is None:
            shard = files.weight_map.get(n)
            if shard is not None and shard not in files.headers:
                unreadable.setdefault(shard, []).append(n)  # its header check failed
            else:
                c.fail(listing(root), n, f"missing: {fmt} requires it ({DTYPE_NAMES[dtype]} {list(shape)})")
        elif tuple(got.entry.shape) != shape or (got.entry.dtype != dtype and not (
                fmt == _PASS.name and _PASS.widens(dtype, got.entry.dtype))):  # widened: passthrough compares values
            c.fail(root / got.shard, n, f"is {DTYPE_NAMES[got.entry.dtype]} {list(got.entry.shape)}, "
                   f"{fmt} prescribes {DTYPE_NAMES[dtype]} {list(shape)}")
    for n in sorted(set(files.tensors) - set(expected.tensors), key=natural_key):
        c.fail(root / files.tensors[n].shard, n, f"unexpected tensor: {why(n)}")
    for shard, names in unreadable.items():
        c.fail(root / shard, names[0], f"{len(names)} tensor(s) the index puts in this shard could "
               f"not be checked: its header is malformed (see header[{shard}])")
    c.figures.update(expected=len(expected.tensors), present=len(files.tensors),
                     quantized_experts={m: expected.fmt_of[ts[0]] for m, ts in expected.module_tensors.items()})


# ============================================================================ config
def quantized_layers(expected: Expected) -> dict[str, dict] | None:
    """module -> the `quantized_layers` entry the tensors imply (None: the layout check could
    not list them)."""
    if expected.status != CHECKED:
        return None
    return {**{m: FORMATS[expected.fmt_of[names[0]]].layer_config(expected.weight_only)
               for m, names in expected.module_tensors.items()},
            **{m: get_format(f, source=True).layer_config() for m, f in expected.kept_modules.items()}}


def unquantized(expected: Expected) -> dict[str, str]:
    """module -> the tensor a problem names, for each module the tensors leave unquantized that a
    quantization config of one format must exclude, as engines quantize under one (Linear,
    LM-head and MoE layers only: vLLM 0.33 quantization/modelopt.py:254-264): each pass-through
    2D `<module>.weight` but an embedding's (per-expert weights among them); the experts module
    of stacked routed experts passed through; and transformers' `lm_head` where it is tied to
    the embedding (no head tensor written: the engine builds the Linear all the same)."""
    lay = expected.layout
    out: dict[str, str] = {}
    for n, (shape, _) in expected.tensors.items():
        if expected.fmt_of[n] != _PASS.name:
            continue
        part = lay.part_of(n) if lay is not None else None
        if part is not None and part.part == "expert" and len(shape) > 2:  # stacked [E, ...]
            out.setdefault(lay.experts_modules[part.layer], n)
        elif n.endswith(".weight") and len(shape) == 2 and n[:-len(".weight")] not in expected.kept_modules \
                and (part is None or part.part != "embed"):
            out.setdefault(n[:-len(".weight")], n)
    if lay is not None and lay.lm_head is None:  # tied: no head tensor under any name (layout.LM_HEADS)
        out.setdefault("lm_head", "lm_head.weight")
    return out


def tensor_namer(expected: Expected) -> Callable[[str], str] | None:
    """How the config check names an experts module's tensor (None: no layout was detected)."""
    lay = expected.layout
    return (lambda m: _named(lay, m)) if lay is not None else None


def _named(lay: Layout, module: str) -> str:
    """The tensor a problem about an experts module names: its first expert's gate weight, or
    the stacked tensor holding it."""
    return lay.experts.named(module)


# ============================================================================ numerics[layer L]
def check_numerics(run: Recorder, inv: Inventory, sample: int, device: str) -> None:
    """A `numerics[layer L]` check per quantized layer (--against): for the sampled experts,
    each module (gate, up, down) y = x @ W^T through its format's kernel against the fp32 product
    with the source expert's weight."""
    gemm = start(run, inv, device)
    if gemm is None:
        return
    lay, (_, H, I) = inv.expected.layout, dims(inv.conf.cfg)
    try:
        with torch_threads(1 if H * I < (1 << 22) else torch.get_num_threads()):
            for layer, module in (lay.experts_modules.items() if lay is not None else ()):
                names = inv.expected.module_tensors.get(module)
                if names:
                    c = run.new(f"numerics[layer {layer}]", "numerics",
                                f"layer {layer}: sampled experts' dequant-GEMM vs the source")
                    run.guard(c, _check_layer, run, c, inv, gemm, layer, names, sample)
    finally:
        gemm.close()


def _check_layer(run: Recorder, c: Check, inv: Inventory, gemm: Gemm, layer: int, names: list[str],
                 sample: int) -> None:
    lay, src = inv.expected.layout, inv.source.layout
    fmt, module = FORMATS[inv.expected.fmt_of[names[0]]], lay.experts_modules[layer]
    if src is None or layer not in src.expert_layers:
        c.fail(listing(inv.source.root), None, f"the source has no routed experts in layer {layer}")
        return
    if not stored_ok(c, inv, names):
        return
    experts = sample_experts(layer, dims(inv.conf.cfg)[0], sample)
    first = len(run.report.numerics)
    layer_src, layer_q = [], []  # the sampled experts as one MoE layer (moe_figures)
    for e in experts:
        weights = _source_expert(c, inv, gemm, layer, e)
        if weights is None:
            return
        per = _quantized_expert(c, inv, gemm, fmt, lay, names, module, e)
        if per is None:
            continue
        mods = {}
        flushed = _flushed(fmt, {p: w for p, (w, _) in weights.items()})
        for proj, mod in lay.experts.projections(e):
            (w, what), (tensor, blame, tail) = weights[proj], _judged(lay, module, e, mod, proj)
            zero = fmt.dequantize(per[mod]).count_nonzero() == 0 if proj in flushed else None
            judge(run, c, inv, fmt, (layer, e, mod), tensor, gemm.errors(f"{module}.{e}.{mod}", w, per[mod], fmt),
                  blame, f"expert {e} {mod} ({fmt.name}) y = x @ W^T vs the source ({what})", tail,
                  flushed=None if zero is None else bool(zero))
            mods[proj] = per[mod]
        layer_src.append({p: weights[p][0] for p in CANONICAL})
        layer_q.append({p: mods[p] for p in CANONICAL})
    layer_figures(c, run.report.numerics[first:], experts)
    if layer_q and len(layer_q) == len(experts) and fmt.kernel is not None:
        moe_figures(c, gemm, fmt, module, layer_src, layer_q, inv.conf.cfg.family.expert_activation)


def _flushed(fmt: Format, weights: dict[str, torch.Tensor]) -> set[str]:
    """The projections of one expert that convert writes as the format's all-zero weight
    (`Format.flushes`), judged by the amax their encoding takes: gate and up's larger where the
    format fuses them (NVFP4's shared global scale, the stacked w13's slab), else each its own."""
    amax = {p: float(w.abs().amax()) if w.numel() else 0.0 for p, w in weights.items()}
    if fmt.fuses_gate_up:
        amax["gate"] = amax["up"] = max(amax["gate"], amax["up"])
    return {p for p, a in amax.items() if fmt.flushes(a)}


def _judged(lay: Layout, module: str, e: int, mod: str, proj: str) -> tuple[str, str, str]:
    """(the numerics entry's tensor, the tensor a failure names, why) for expert e's module."""
    if lay.experts.stacked:  # Inkling's stacked form (the only quantized stacked one)
        stacked = lay.experts.tensor(module, e, proj)
        return (stacked, f"{stacked}_scale", f"expert {e}'s slices of the stacked "
                f"{stacked.rsplit('.', 1)[-1].removesuffix('_weight')} tensors do not reproduce the source")
    tensor = f"{module}.{e}.{mod}.weight"
    return tensor, tensor, "its tensors do not reproduce the source"


def _quantized_expert(c: Check, inv: Inventory, gemm: Gemm, fmt: Format, lay: Layout, names: list[str],
                      module: str, e: int) -> dict[str, dict[str, torch.Tensor]] | None:
    """Expert e's quantized modules (module -> suffix -> tensor): ModelOpt's per-expert tensors,
    or its slices of the stacked ones unstacked (None: a scale the format cannot read back, in `c`)."""
    if not lay.experts.stacked:
        return module_tensors(inv, gemm, names, f"{module}.{e}.")
    got = read_stacked_expert(lambda shard: gemm.reader(inv.root, inv.files.headers, shard), inv, module, names, e)
    try:
        return unstack_expert(fmt, got, 0)
    except FormatError as err:  # a bad input_amax
        c.fail(inv.root / inv.files.tensors[names[0]].shard, names[0], f"expert {e}: {err.message}")
        return None


def _source_expert(c: Check, inv: Inventory, gemm: Gemm, layer: int,
                   e: int) -> dict[str, tuple[torch.Tensor, str]] | None:
    """proj -> (expert e's source weight [out, in], what it is) for gate, up and down, read for
    the source's storage: per expert by name; stacked gate then up along 2I (transposed where
    stored [E, in, out]); interleaved gate = w13[e, 0::2], up = w13[e, 1::2]; a quantized source's
    stored tensors (the MXFP8 release's e4m3 + `_scale`, FP8's weight + scale, MXFP4's blocks +
    scales) dequantized exactly, as convert reads them. None (the reason in `c`) when the source
    does not hold them in the config's shapes."""
    src, (E, H, I) = inv.source, dims(inv.conf.cfg)
    storage, module = src.layout.experts, src.layout.experts_modules[layer]
    shapes = storage.weight_shapes(module, E, H, I)
    out: dict[str, tuple[torch.Tensor, str]] = {}
    slabs: dict[str, torch.Tensor] = {}  # gate and up share one stacked slice: read it once
    for proj in CANONICAL:
        name = storage.tensor(module, e, proj)
        for stored, want in stored_shapes(src, name, shapes[name]).items():
            where = src.tensors.get(stored)
            if where is None:
                c.fail(listing(src.root), stored, "source lacks this tensor")
                return None
            if tuple(where.entry.shape) != want:
                c.fail(src.root / where.shard, stored, f"source has shape {list(where.entry.shape)}, config.json "
                       f"implies {list(want)}")
                return None
        if not storage.stacked:
            out[proj] = (read_weight(src, name, lambda n: gemm.reader(src.root, src.headers,
                                                                        src.tensors[n].shard).get(n)), name)
            continue
        if name not in slabs:
            slabs[name] = _source_slab(gemm, inv, name, e, storage.transposed)
        w = slabs[name] if proj == "down" else storage.split_gate_up(slabs[name], I)[CANONICAL.index(proj)]
        out[proj] = (w, f"{name}[{e}], {proj} rows")
    return out


def _source_slab(gemm: Gemm, inv: Inventory, name: str, e: int, transposed: bool) -> torch.Tensor:
    """Expert e's slice [out, in] of the source's stacked tensor `name`: an MXFP8 release's
    (e4m3 + its `_scale`, Inkling's interleaved form) dequantized exactly, as convert reads it."""
    src = inv.source
    w = read_weight(src, name, lambda n: gemm.reader(src.root, src.headers, src.tensors[n].shard).get_slice(n, e))
    scale = src.tensors.get(name + "_scale") if src.layout.original_names else None  # the MXFP8 release
    if scale is not None:
        s = gemm.reader(src.root, src.headers, scale.shard).get_slice(name + "_scale", e)
        w = FORMATS[RELEASE_EXPERT_FORMAT].dequantize({"weight": w, "weight_scale": s}, torch.float32)
    return w.T if transposed else w
