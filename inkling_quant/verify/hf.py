"""Hugging Face MoE families in `verify` (layout.MoEConfig, layout.detect): the `layout` check,
the tensor the `config` check names for an experts module, and `numerics[layer L]`, for
checkpoints as transformers' save_pretrained writes them (BF16: routed experts per expert or
stacked) and as ModelOpt's exporter writes them (our convert's output is the same): a quantized
layer's routed experts as per-expert modules `<prefix>layers.N.<block>.experts.<e>.<proj>.<suffix>`
under the family's own projection names, in the format the quantization config declares for the
experts module `<prefix>layers.N.<block>.experts`.

One path for every family. The layout is detected from the tensor names; the shapes come from
config.json (E experts of width I over hidden size H: gate and up [I, H], down [H, I]); what a
format writes for such a weight is the format's own (`Format.out_tensors`). A layer's experts are
checked as the format whose tensors they are exactly (with or without an activation scale), else
as the declared one; the config check then names a declaration that disagrees with the tensors.
Everything else passes through: with --against exactly the source's other tensors (name, shape,
dtype), without it any float tensor the layout places, but no scale outside the routed experts.
`numerics` compares each sampled expert's modules with the source's expert: per-expert sources
by name, stacked ones sliced per expert (gate then up along 2I; transposed where the source stores
[E, in, out]), through the same Gemm and thresholds as the Inkling 2 layout's."""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch

from ..errors import CheckpointError, FormatError, InklingQuantError
from ..export import format_of, read_quantization
from ..formats import FORMATS, SCALE_SUFFIXES, Format
from ..io.safetensors import DTYPE_NAMES
from ..layout import CANONICAL, Layout, detect, oriented
from ..tensors import TensorName
from . import published
from .inventory import CHECKED, Conf, Expected, Files, Inventory, Shape, Source, config_shape, listing, weight_only_vote
from .numerics import Gemm, judge, layer_figures, module_tensors, sample_experts, start, stored_ok
from .report import Check, Recorder
from .stream import torch_threads

_PASS = FORMATS["passthrough"]
FUSED = CANONICAL[:2]  # gate, up: what vLLM fuses under one global scale (the gate_up check)

# a layer's routed-expert weights: output weight name -> (source shape [out, in], source dtype)
Weights = dict[str, tuple[tuple[int, int], torch.dtype]]


# ============================================================================ layout
def check_layout(run: Recorder, files: Files, conf: Conf, source: Source | None) -> Expected:
    """The `layout` check for a detected layout (published.check_layout's frame, this body)."""
    return published.check_layout(run, files, conf, source, body=_check)


def _check(c: Check, files: Files, conf: Conf, source: Source | None) -> Expected:
    names = list(dict.fromkeys([*files.weight_map, *files.tensors]))
    lay = oriented(detect(names, conf.cfg, str(conf.root)), _shapes(files), conf.cfg)
    if lay.experts.kind == "interleaved":
        raise CheckpointError(f"routed experts stored as Inkling's w13_weight/w2_weight under a config.json of "
                              f"model_type {conf.cfg.model_type!r}: not a layout of this family",
                              path=conf.root / "config.json")
    src = source.layout if source is not None and source.ok else None
    lay = _expert_layers(c, conf, lay, src)
    tensors, module_tensors = _others(files, source if src else None, lay), {}
    if lay.experts.kind == "stacked":  # unquantized experts as transformers stacks them
        for layer in lay.expert_layers:
            tensors.update(_stacked(lay, conf, layer, files, source))
        fmt_of, weight_only = dict.fromkeys(tensors, _PASS.name), False
    else:
        fmt_of = dict.fromkeys(tensors, _PASS.name)
        weights = {i: _weights(lay, conf, i, files, source) for i in lay.expert_layers}
        held, declared = _held(files, lay), _declared(conf)
        fmts = {i: _layer_format(c, files, conf, lay, i, w, held.get(lay.experts_modules[i], {}), declared)
                for i, w in weights.items()}
        weight_only = _weight_only(conf, lay, weights, fmts, held)
        for i, w in weights.items():
            want = _specs(w, fmts[i], not weight_only, conf)
            tensors.update(want)
            fmt_of.update(dict.fromkeys(want, fmts[i].name))
            if fmts[i] is not _PASS:
                module_tensors[lay.experts_modules[i]] = list(want)
    expected = Expected(CHECKED, weight_only, tensors, fmt_of, module_tensors, layout=lay)
    published.compare(c, files, conf, expected, _why(lay, files, src is not None))
    c.figures["detected"] = lay.describe()
    return expected


def _shapes(files: Files) -> dict[str, tuple[int, ...]]:
    return {n: tuple(w.entry.shape) for n, w in files.tensors.items()}


def _expert_layers(c: Check, conf: Conf, lay: Layout, src: Layout | None) -> Layout:
    """The layers that must hold routed experts: the source's (--against), else every layer the
    config does not make dense. Layers with experts beyond them fail; missing ones are expected
    (the comparison names each missing tensor)."""
    n = conf.cfg.num_hidden_layers
    want = set(src.expert_layers) if src is not None else set(range(n)) - set(conf.cfg.dense_layers or ())
    by = "the source" if src is not None else "config.json"
    for i in sorted(set(lay.expert_layers) - want):
        c.fail(listing(conf.root), _named(lay, lay.experts_modules[i]),
               f"layer {i} holds routed experts; {by} has none there" + ("" if src else f" (num_hidden_layers {n})"))
    return replace(lay, expert_layers=tuple(sorted(want | set(lay.expert_layers))))


def _others(files: Files, source: Source | None, lay: Layout) -> dict[str, Shape]:
    """What passes through: the source's tensors but its routed experts (--against); without a
    source, every float tensor the layout places outside the routed experts, none named as a scale."""
    if source is not None:
        return {n: (tuple(w.entry.shape), w.entry.dtype) for n, w in source.tensors.items()
                if source.layout.classify(n).part != "expert"}
    out = {}
    for n, w in files.tensors.items():
        t = lay.classify(n)
        if t.part != "expert" and w.entry.dtype in _PASS.source_dtypes and t.suffix not in SCALE_SUFFIXES:
            out[n] = (tuple(w.entry.shape), w.entry.dtype)
    return out


def _why(lay: Layout, files: Files, against: bool) -> Callable[[str], str]:
    def why(name: str) -> str:
        t = lay.classify(name)
        if t.part == "expert":
            return ("not a tensor of its layer's routed experts in their format (an expert or layer past "
                    "config.json's counts, or a tensor the format does not write)")
        if against:
            return "the source has no such tensor (everything but the routed experts passes through as it is)"
        dtype = DTYPE_NAMES[files.tensors[name].entry.dtype]
        return (f"a {t.part} tensor stored as {dtype}{' named as a scale' if t.suffix in SCALE_SUFFIXES else ''}: "
                f"only routed experts are quantized, everything else passes through as the source stores it")
    return why


def source_tensor(lay: Layout, layer: int, e: int, proj: str) -> str:
    """The tensor holding expert `e`'s projection `proj` (gate, up, down) in a checkpoint of
    layout `lay`: per expert its own weight; stacked the layer's gate_up_proj or down_proj."""
    module = lay.experts_modules[layer]
    if lay.experts.kind == "per_expert":
        return f"{module}.{e}.{lay.experts.names[CANONICAL.index(proj)]}.weight"
    return f"{module}.{'down_proj' if proj == 'down' else 'gate_up_proj'}"


def _source_dtype(name: str, files: Files, source: Source | None, src_name: str | None) -> torch.dtype:
    """The dtype the source holds a weight in: the source's (--against), else the one stored
    where it is float (pass-through keeps it), else BF16."""
    if source is not None and src_name in source.tensors:
        return source.tensors[src_name].entry.dtype
    got = files.tensors.get(name)
    return got.entry.dtype if got is not None and got.entry.dtype in _PASS.source_dtypes else torch.bfloat16


def _weights(lay: Layout, conf: Conf, layer: int, files: Files, source: Source | None) -> Weights:
    """Layer `layer`'s per-expert weights as the output names them, with their source shape and dtype."""
    cfg, module = conf.cfg, lay.experts_modules[layer]
    H, I = cfg.hidden_size, cfg.expert_width
    src = source.layout if source is not None else None
    out: Weights = {}
    for e in range(cfg.num_experts):
        for proj, name in zip(CANONICAL, lay.experts.names):
            w = f"{module}.{e}.{name}.weight"
            s = source_tensor(src, layer, e, proj) if src is not None and layer in src.expert_layers else None
            out[w] = ((H, I) if proj == "down" else (I, H), _source_dtype(w, files, source, s))
    return out


def _stacked(lay: Layout, conf: Conf, layer: int, files: Files, source: Source | None) -> dict[str, Shape]:
    """A stacked layer's two tensors (unquantized), in the orientation the checkpoint uses."""
    cfg, module = conf.cfg, lay.experts_modules[layer]
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.expert_width
    out = {}
    for key, (rows, cols) in (("gate_up_proj", (2 * I, H)), ("down_proj", (H, I))):
        name = f"{module}.{key}"
        shape = (E, cols, rows) if lay.experts.transposed else (E, rows, cols)
        out[name] = (shape, _source_dtype(name, files, source, name))
    return out


def _specs(weights: Weights, fmt: Format, activation_scale: bool, conf: Conf | None = None) -> dict[str, Shape]:
    """name -> (shape, dtype) of every tensor `fmt` writes for the weights. FormatError (naming
    config.json and the weight; without `conf`, the format's own) when a shape cannot be `fmt`."""
    out: dict[str, Shape] = {}
    for w, (shape, dtype) in weights.items():
        with config_shape(conf, w, shape, fmt):
            specs = fmt.out_tensors(w, shape, dtype, activation_scale)
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


def _stored(weights: Weights, held: dict[str, Shape]) -> Format | None:
    """The format whose tensors (with or without an activation scale) the layer holds exactly."""
    for fmt in FORMATS.values():
        for act in (True, False) if fmt.static_activation_scale else (True,):
            try:
                if _specs(weights, fmt, act) == held:
                    return fmt
            except FormatError:
                break
    return None


def _declared(conf: Conf) -> Callable[[str, int], Format]:
    """(experts module, layer) -> the format the quantization config declares for it (none:
    pass-through); without a quantization config, the scheme's. A malformed config counts as
    none here (the config check reports it)."""
    try:
        q = read_quantization(conf.root, conf.config)
    except InklingQuantError:
        return lambda module, layer: _PASS
    if q is None:
        return lambda module, layer: conf.format_for(TensorName(f"{module}.0", "expert", layer))

    def of(module: str, layer: int) -> Format:
        try:
            return format_of(q, module) or _PASS
        except (TypeError, AttributeError):  # exclude_modules of the wrong types
            return _PASS
    return of


def _layer_format(c: Check, files: Files, conf: Conf, lay: Layout, layer: int, weights: Weights,
                  held: dict[str, Shape], declared: Callable[[str, int], Format]) -> Format:
    """The format layer `layer`'s experts are checked as: the one their tensors are, else the
    declared one. A scheme given (--scheme, the converter's record) must agree with the tensors."""
    stored, module = _stored(weights, held), lay.experts_modules[layer]
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
            act = set(_specs(weights[i], fmt, True, conf)) - set(_specs(weights[i], fmt, False, conf))
            holds.append(bool(act & set(held.get(lay.experts_modules[i], {}))))
    return weight_only_vote(conf, holds)


# ============================================================================ config
def tensor_namer(expected: Expected) -> Callable[[str], str]:
    """How the config check names an experts module's tensor: its first expert's gate weight."""
    lay = expected.layout
    return (lambda m: _named(lay, m)) if lay is not None else (lambda m: f"{m}.0.gate_proj.weight")


def _named(lay: Layout, module: str) -> str:
    if lay.experts.kind == "stacked":
        return f"{module}.gate_up_proj"
    return f"{module}.0.{lay.experts.names[0]}.weight"


# ============================================================================ numerics[layer L]
def check_numerics(run: Recorder, inv: Inventory, sample: int, device: str) -> None:
    """A `numerics[layer L]` check per quantized layer (--against): for the sampled experts,
    each module (gate, up, down) y = x @ W^T through its format's kernel against the fp32 product
    with the source expert's weight (a stacked source's slice of the expert)."""
    gemm = start(run, inv, device)
    if gemm is None:
        return
    lay, cfg = inv.expected.layout, inv.conf.cfg
    small = cfg.hidden_size * cfg.expert_width < (1 << 22)
    try:
        with torch_threads(1 if small else torch.get_num_threads()):
            for layer, module in (lay.experts_modules.items() if lay is not None else ()):
                names = inv.expected.module_tensors.get(module)
                if names:
                    c = run.new(f"numerics[layer {layer}]", "numerics",
                                f"layer {layer}: sampled experts' dequant-GEMM vs the BF16 source")
                    run.guard(c, _check_layer, run, c, inv, gemm, layer, names, sample)
    finally:
        gemm.close()


def _check_layer(run: Recorder, c: Check, inv: Inventory, gemm: Gemm, layer: int, names: list[str],
                 sample: int) -> None:
    lay, src = inv.expected.layout, inv.source.layout
    fmt, module = FORMATS[inv.expected.fmt_of[names[0]]], lay.experts_modules[layer]
    if layer not in src.expert_layers:
        c.fail(listing(inv.source.root), None, f"the source has no routed experts in layer {layer}")
        return
    if not stored_ok(c, inv, names):
        return
    experts = sample_experts(layer, inv.conf.cfg.num_experts, sample)
    first = len(run.report.numerics)
    for e in experts:
        weights = _source_expert(c, inv, gemm, layer, e)
        if weights is None:
            return
        per = module_tensors(inv, gemm, names, f"{module}.{e}.")
        for proj, mod in zip(CANONICAL, lay.experts.names):
            w, sname = weights[proj]
            tensor = f"{module}.{e}.{mod}.weight"
            judge(run, c, inv, fmt, (layer, e, mod), tensor, gemm.errors(f"{module}.{e}.{mod}", w, per[mod], fmt),
                  tensor, f"expert {e} {mod} ({fmt.name}) y = x @ W^T vs the BF16 source ({sname})",
                  "its tensors do not reproduce the source")
    layer_figures(c, run.report.numerics[first:], experts)


def _source_expert(c: Check, inv: Inventory, gemm: Gemm, layer: int,
                   e: int) -> dict[str, tuple[torch.Tensor, str]] | None:
    """proj -> (expert e's source weight [out, in], what it is) for gate, up and down; None (the
    reason in `c`) when the source does not hold them in the config's shapes."""
    src, cfg = inv.source, inv.conf.cfg
    lay, (E, H, I) = src.layout, (cfg.num_experts, cfg.hidden_size, cfg.expert_width)
    stacked = lay.experts.kind == "stacked"
    out: dict[str, tuple[torch.Tensor, str]] = {}
    slabs: dict[str, torch.Tensor] = {}  # gate and up share one stacked slice: read it once
    for proj in CANONICAL:
        name = source_tensor(lay, layer, e, proj)
        rows, cols = ((H, I) if proj == "down" else (2 * I if stacked else I, H))
        want = ((E, cols, rows) if lay.experts.transposed else (E, rows, cols)) if stacked else (rows, cols)
        where = src.tensors.get(name)
        if where is None:
            c.fail(listing(src.root), name, "source lacks this tensor")
            return None
        if tuple(where.entry.shape) != want:
            c.fail(src.root / where.shard, name, f"source has shape {list(where.entry.shape)}, config.json implies "
                   f"{list(want)}")
            return None
        reader = gemm.reader(src.root, src.headers, where.shard)
        if not stacked:
            out[proj] = (reader.get(name), name)
            continue
        if name not in slabs:
            w = reader.get_slice(name, e)
            slabs[name] = w.T if lay.experts.transposed else w  # [out, in]
        w = slabs[name]
        if proj != "down":  # gate then up along 2I
            w = w[:I] if proj == "gate" else w[I:]
        out[proj] = (w, f"{name}[{e}], {proj} rows")
    return out
