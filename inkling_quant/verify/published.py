"""The Inkling 2 layout (inkling2.py) in `verify`: the `layout` check, what the `config` check
holds the quantization configs to, and `numerics[layer L]`, for checkpoints under the original
names (`model.llm.*`, `model.visual.*`) whose routed experts are stacked per layer
(`mlp.experts.w13_weight` [E, 2I, H] with gate/up rows interleaved, `w2_weight` [E, H, I]):
BF16 sources and their conversions into the Inkling stacked form (formats/stacked.py).

Each layer's experts have one format: the one the checkpoint's quantization config declares for
`model.llm.layers.N.mlp.experts` (export.read_quantization / format_of; with no quantization
config, the scheme's: `none` for a BF16 source), cross-checked with the format whose stacked
tensors (`projection_specs`) the layer holds exactly (`_stored`, the dtype and shape evidence).
Where the tensors are exactly one format's, the layout follows them and the config check names
the declaration that disagrees; a scheme given by --scheme or recorded by the converter must
agree with them too. Everything else passes through: the source's name, shape and dtype.

ModelOpt's form of the same model (convert --output-format modelopt-hf; `Conf.modelopt_hf`: its
quantization config keys the experts modules by transformers' names) is checked the same way
under that form's names: pass-through tensors renamed (`inkling2.modelopt_tensor`, lm_head cut to
the unpadded vocabulary; `Expected.source_of` maps them back for `passthrough`), each layer's
experts as per-expert modules (`formats.stacked.expert_module_specs`) compared in `numerics`
with the source's rows (gate = w13[e, 0::2], up = w13[e, 1::2], down = w2[e]).

The other checks do not depend on the layout: index and headers (structure.py), the single read
(value rules per tensor suffix, formats.value_rules; pass-through bytes against the source),
checksums. `gate_up` applies to ModelOpt's per-expert modules only: the stacked form stores one
global scale per expert's w13, so gate and up cannot disagree."""
from __future__ import annotations

from typing import Callable

import torch

from ..errors import FormatError, InklingQuantError
from ..export import format_of, read_quantization
from ..formats import FORMATS, Format
from ..formats.stacked import PROJECTIONS, expert_module_specs, projection_specs, unstack_expert
from ..inkling2 import (RELEASE_EXPERT_FORMAT, checkpoint_tensors, experts_module, modelopt_experts_module,
                        modelopt_tensor)
from ..io.checkpoint import INDEX_NAME
from ..io.safetensors import DTYPE_NAMES
from ..layout import natural_key
from .inventory import (CHECKED, DISAGREES, FAILED, SKIPPED, Conf, Expected, Files, Inventory, Shape, Source,
                        config_shape, listing, weight_only_vote)
from .numerics import Gemm, judge, layer_figures, module_tensors, sample_experts, start, stored_ok
from .report import Check, Recorder
from .stream import torch_threads

_PASS = FORMATS["passthrough"]
_EXPERTS = ".mlp.experts."
FUSED = PROJECTIONS["w13"]  # the modules vLLM fuses into one w13 (gate_proj, up_proj): the gate_up check

# a layer's stacked source tensors: projection -> (name, shape, dtype)
Sources = dict[str, tuple[str, tuple[int, ...], torch.dtype]]


# ============================================================================ layout
def check_layout(run: Recorder, files: Files, conf: Conf, source: Source | None, body=None) -> Expected:
    """The `layout` check: every tensor of `checkpoint_tensors(config)`, each layer's experts as
    the stacked tensors of their format, present with its dtype and shape, and no other.
    Returns what it expected (nothing when it could not check). `body(c, files, conf, source)`
    computes and compares what is expected: the Inkling 2 spec's here, another family's in hf.py."""
    c = run.new("layout", "structure",
                "every tensor the layout and the quantization config require is present with its dtype and "
                "shape; no other")
    if not conf.usable:
        c.skip("config.json could not be used")
    elif not files.index_ok and not files.tensors:
        c.skip("the index could not be read")
    else:
        expected = run.guard(c, body or _check, c, files, conf, source)
        return expected if expected is not None else Expected(FAILED)
    return Expected(SKIPPED)


def _check(c: Check, files: Files, conf: Conf, source: Source | None) -> Expected:
    declared, hf = _declared(conf), conf.modelopt_hf
    rest: dict[str, Shape] = {}
    source_of: dict[str, str] = {}  # ModelOpt's form: output name -> source name
    layers: dict[int, Sources] = {}
    bound = 4 * (len(files.weight_map) or len(files.tensors)) + 64
    for k, s in enumerate(checkpoint_tensors(conf.cfg)):
        if k > bound:  # each source tensor is at least one stored tensor: bound the work by the files
            c.fail(conf.root / "config.json", None, f"config.json implies more than {bound} tensors, the "
                   f"checkpoint holds {len(files.tensors)}: they disagree (layer counts?); not checked tensor by tensor")
            return Expected(DISAGREES)
        t = conf.classify(s.name)
        out, rows = modelopt_tensor(conf.cfg, s.name) if hf and t.part != "expert" else (s.name, None)
        dtype = _source_dtype(s.name, out, s.dtype, files, source)
        if t.part == "expert":
            layers.setdefault(t.layer, {})[t.projection] = (s.name, s.shape, dtype)
        else:
            rest[out] = ((rows, *s.shape[1:]) if rows is not None else tuple(s.shape), dtype)
            if out != s.name:
                source_of[out] = s.name
    held = _held_by_layer(files)
    fmts = {i: _layer_format(c, files, conf, i, srcs, held.get(_module(conf, i), {}), declared(i))
            for i, srcs in layers.items()}
    weight_only = _weight_only(conf, layers, fmts, held)
    tensors, fmt_of, module_tensors = dict(rest), dict.fromkeys(rest, _PASS.name), {}
    for i, srcs in layers.items():
        want = {f"{_module(conf, i)}.{k}": v for k, v in _stacked(srcs, fmts[i], not weight_only, conf, hf).items()}
        tensors.update(want)
        fmt_of.update(dict.fromkeys(want, fmts[i].name))
        if fmts[i] is not _PASS:
            module_tensors[_module(conf, i)] = list(want)
    expected = Expected(CHECKED, weight_only, tensors, fmt_of, module_tensors, source_of)
    compare(c, files, conf, expected, lambda n: _why(conf, n))
    return expected


def _module(conf: Conf, layer: int) -> str:
    """Layer `layer`'s experts module as the checkpoint names it (ModelOpt's form: transformers' name)."""
    return modelopt_experts_module(layer) if conf.modelopt_hf else experts_module(layer)


def _declared(conf: Conf) -> Callable[[int], Format]:
    """layer -> the format the quantization config declares for its experts (none: pass-through);
    without a quantization config, the scheme's. A malformed config counts as none here (the
    config check reports it)."""
    try:
        q = read_quantization(conf.root, conf.config)
    except InklingQuantError:
        q = None
    if q is None:
        return lambda i: conf.format_for(conf.classify(f"{experts_module(i)}.w13_weight"))

    def of(i: int) -> Format:
        try:
            return format_of(q, _module(conf, i)) or _PASS
        except (TypeError, AttributeError):  # exclude_modules of the wrong types: the config check says so
            return _PASS
    return of


def _source_dtype(name: str, out: str, dtype: torch.dtype, files: Files, source: Source | None) -> torch.dtype:
    """The dtype the source holds `name` in: the source's (--against), else the one stored (as
    `out`) where a source may hold it (pass-through keeps it), else the layout's."""
    if source is not None and name in source.tensors:
        return source.tensors[name].entry.dtype
    got = files.tensors.get(out)
    return got.entry.dtype if got is not None and got.entry.dtype in _PASS.source_dtypes else dtype


def _held_by_layer(files: Files) -> dict[str, dict[str, Shape]]:
    """experts module -> {stacked key (`w13_weight_scale`...; ModelOpt's form: `<e>.gate_proj.weight`...):
    (shape, dtype)} as the headers hold them."""
    out: dict[str, dict[str, Shape]] = {}
    for n, where in files.tensors.items():
        head, sep, key = n.partition(_EXPERTS)
        if sep:
            out.setdefault(head + _EXPERTS[:-1], {})[key] = (tuple(where.entry.shape), where.entry.dtype)
    return out


def _stacked(srcs: Sources, fmt: Format, activation_scale: bool, conf: Conf | None = None,
             per_expert: bool = False) -> dict[str, Shape]:
    """{stacked key: (shape, dtype)} of one layer's experts in `fmt`; `per_expert`: ModelOpt's
    per-expert modules (`<e>.<module>.<suffix>`). FormatError (naming the source tensor) when the
    format cannot hold the config's shapes."""
    out: dict[str, Shape] = {}
    for proj, (name, shape, dtype) in srcs.items():
        with config_shape(conf, name, shape, fmt):
            if per_expert:
                specs = {f"{e}.{m}.{k}": o for (e, m, k), o in
                         expert_module_specs(fmt, proj, shape, dtype=dtype, activation_scale=activation_scale).items()}
            else:
                specs = projection_specs(fmt, proj, shape, dtype=dtype, activation_scale=activation_scale)
        out.update({k: (tuple(o.shape), o.dtype) for k, o in specs.items()})
    return out


def _stored(srcs: Sources, held: dict[str, Shape], per_expert: bool) -> Format | None:
    """The format whose stacked (or per-expert) tensors, with or without an activation scale, the
    layer holds exactly, or None."""
    for fmt in FORMATS.values():
        for act in (True, False) if fmt.static_activation_scale else (True,):
            try:
                if _stacked(srcs, fmt, act, per_expert=per_expert) == held:
                    return fmt
            except FormatError:
                break
    return None


def _layer_format(c: Check, files: Files, conf: Conf, layer: int, srcs: Sources, held: dict[str, Shape],
                  declared: Format) -> Format:
    """The format layer `layer`'s experts are checked as: the one their tensors are, else the
    declared one. A scheme given (--scheme, the converter's record) must agree with the tensors."""
    stored = _stored(srcs, held, conf.modelopt_hf)
    if stored is not None and conf.scheme_given:
        name = srcs["w13"][0]
        prescribed = conf.format_for(conf.classify(name))
        if prescribed is not stored:
            where = files.tensors.get(name) or files.tensors.get(f"{_module(conf, layer)}.0.gate_proj.weight")
            c.fail(conf.root / (where.shard if where else INDEX_NAME), name,
                   f"the experts of layer {layer} are stored as {stored.name}; scheme {conf.scheme.name!r} "
                   f"prescribes {prescribed.name}")
    return stored or declared


def _weight_only(conf: Conf, layers: dict[int, Sources], fmts: dict[int, Format],
                 held: dict[str, dict[str, Shape]]) -> bool:
    """W4A16 or W4A4 (inventory.weight_only_vote): does each layer whose format has a static
    activation scale hold one?"""
    holds, hf = [], conf.modelopt_hf
    for i, fmt in fmts.items():
        if fmt.static_activation_scale:
            act = set(_stacked(layers[i], fmt, True, conf, hf)) - set(_stacked(layers[i], fmt, False, conf, hf))
            holds.append(bool(act & set(held.get(_module(conf, i), {}))))
    return weight_only_vote(conf, holds)


def _why(conf: Conf, name: str) -> str:
    """Why a tensor the layout does not expect is unexpected."""
    try:
        conf.classify(name)
        return "not part of the layout for this config.json (a layer past its count, or a tensor its " \
               "layer's format does not write)"
    except InklingQuantError:
        return "not a tensor of the Inkling 2 layout (docs/layout.md)"


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
        elif (tuple(got.entry.shape), got.entry.dtype) != (shape, dtype):
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
    return {m: FORMATS[expected.fmt_of[names[0]]].layer_config(expected.weight_only)
            for m, names in expected.module_tensors.items()}


def scheme_layers(conf: Conf, weight_only: bool) -> dict[str, dict]:
    """experts module -> the `quantized_layers` entry the scheme prescribes for it: what the
    config check holds the quantization configs to without any tensor (check_config_files)."""
    out = {}
    for i in range(conf.cfg.text.num_hidden_layers):
        entry = conf.format_for(conf.classify(f"{experts_module(i)}.w13_weight")).layer_config(weight_only)
        if entry is not None:
            out[_module(conf, i)] = entry
    return out


def tensor_namer(expected: Expected) -> Callable[[str], str]:
    """How the config check names an experts module's tensor (the Inkling 2 layout: named_tensor)."""
    return named_tensor


def named_tensor(module: str) -> str:
    """The tensor a config problem about an experts module names: its stacked w13 (ModelOpt's
    form: its first expert's gate_proj weight)."""
    if module.startswith("model.language_model."):
        return f"{module}.0.gate_proj.weight"
    return f"{module}.w13_weight"


# ============================================================================ numerics[layer L]
def check_numerics(run: Recorder, inv: Inventory, sample: int, device: str) -> None:
    """A `numerics[layer L]` check per quantized layer (--against): for the sampled experts,
    each one's slices of the stacked tensors (ShardReader.get_slice) unstacked into gate, up and
    down (formats.stacked.unstack_expert), y = x @ W^T against the fp32 product with the same
    rows of the source's stacked BF16 weights."""
    gemm = start(run, inv, device)
    if gemm is None:
        return
    t = inv.conf.cfg.text
    sources = {s.name: tuple(s.shape) for s in checkpoint_tensors(inv.conf.cfg) if _EXPERTS in s.name}
    small = t.hidden_size * t.moe_intermediate_size < (1 << 22)
    try:
        with torch_threads(1 if small else torch.get_num_threads()):
            for layer in range(t.num_hidden_layers):
                names = inv.expected.module_tensors.get(_module(inv.conf, layer))
                if names:
                    c = run.new(f"numerics[layer {layer}]", "numerics",
                                f"layer {layer}: sampled experts' dequant-GEMM vs the BF16 source")
                    run.guard(c, _check_layer, run, c, inv, gemm, layer, names, sources, sample)
    finally:
        gemm.close()


def _check_layer(run: Recorder, c: Check, inv: Inventory, gemm: Gemm, layer: int, names: list[str],
                 sources: dict[str, tuple[int, ...]], sample: int) -> None:
    fmt, prefix = FORMATS[inv.expected.fmt_of[names[0]]], experts_module(layer) + "."
    hf = _module(inv.conf, layer) + "." if inv.conf.modelopt_hf else None  # ModelOpt's per-expert modules
    if not _readable(c, inv, prefix, names, sources):
        return
    experts = sample_experts(layer, inv.conf.cfg.text.n_routed_experts, sample)
    first = len(run.report.numerics)
    for e in experts:
        per = module_tensors(inv, gemm, names, f"{hf}{e}.") if hf else _unstacked(c, inv, gemm, fmt, names, prefix, e)
        if per is None:
            continue
        for proj, mods in PROJECTIONS.items():
            sname = f"{prefix}{proj}_weight"
            w = _source_slab(gemm, inv, sname, e)
            for i, mod in enumerate(mods):
                errors = gemm.errors(f"{prefix}{e}.{mod}", w[i::len(mods)], per[mod], fmt)
                tensor, scale = (f"{hf}{e}.{mod}.weight", f"{hf}{e}.{mod}.weight_scale") if hf else \
                    (sname, f"{prefix}{proj}_weight_scale")
                what = f"its {mod} tensors" if hf else f"expert {e}'s slices of the stacked {proj} tensors"
                judge(run, c, inv, fmt, (layer, e, mod), tensor, errors, scale,
                      f"expert {e} {mod} ({fmt.name}) y = x @ W^T vs the BF16 source (rows of {sname})",
                      f"{what} do not reproduce the source")
    layer_figures(c, run.report.numerics[first:], experts)


def _source_slab(gemm: Gemm, inv: Inventory, sname: str, e: int) -> torch.Tensor:
    """Expert e's slab of the source's stacked tensor, in float: an MXFP8 release's (e4m3 + its
    `_scale`) dequantized exactly, as convert reads it."""
    src = inv.source.tensors[sname]
    w = gemm.reader(inv.source.root, inv.source.headers, src.shard).get_slice(sname, e)
    scale = inv.source.tensors.get(sname + "_scale")
    if scale is None:  # a float source
        return w
    s = gemm.reader(inv.source.root, inv.source.headers, scale.shard).get_slice(sname + "_scale", e)
    return FORMATS[RELEASE_EXPERT_FORMAT].dequantize({"weight": w, "weight_scale": s}, torch.float32)


def _unstacked(c: Check, inv: Inventory, gemm: Gemm, fmt: Format, names: list[str], prefix: str,
               e: int) -> dict[str, dict[str, torch.Tensor]] | None:
    """Expert `e`'s modules from its slices of the stacked tensors (None: recorded in `c`)."""
    got = {n[len(prefix):]: _reader(gemm, inv, n).get_slice(n, e).unsqueeze(0) for n in names}
    try:
        return unstack_expert(fmt, got, 0)
    except FormatError as err:  # a scale the format cannot read back (a bad input_amax)
        c.fail(inv.root / inv.files.tensors[names[0]].shard, names[0], f"expert {e}: {err.message}")
        return None


def _reader(gemm: Gemm, inv: Inventory, name: str):
    return gemm.reader(inv.root, inv.files.headers, inv.files.tensors[name].shard)


def _readable(c: Check, inv: Inventory, prefix: str, names: list[str], sources: dict[str, tuple[int, ...]]) -> bool:
    """Whether the numerics can run on this layer: the source's stacked weights of the config's
    shapes, the layer's tensors present with their dtype and shape (else the reason, in `c`)."""
    for proj in PROJECTIONS:
        sname = f"{prefix}{proj}_weight"
        src = inv.source.tensors.get(sname)
        if src is None:
            c.fail(inv.source.root / INDEX_NAME, sname, "source lacks this tensor")
            return False
        if tuple(src.entry.shape) != sources[sname]:
            c.fail(inv.source.root / src.shard, sname, f"source has shape {list(src.entry.shape)}, config.json "
                   f"implies {list(sources[sname])}")
            return False
    return stored_ok(c, inv, names)
