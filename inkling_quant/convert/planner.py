"""Planning: everything decided before any byte is written. The source is listed, its layout
detected and its tensors checked (convert/validation.py), each NVFP4 expert gets its activation
amax, tensors become units (a pass-through tensor, an expert's gate and up sharing one global
scale, or a stacked expert tensor converted expert by expert) and the units are packed into
output shards."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from .. import hub
from ..errors import ConfigError, FormatError, UsageError
from ..export import Copy, OutputForm, Writing
from ..export.inkling import declared_encoder
from ..formats import FORMATS, get_format, source_value_rule
from ..io.checkpoint import CONFIG_NAME, HF_QUANT_CONFIG, Checkpoint, read_json, safe_child, shard_name
from ..io.safetensors import DTYPE_NAMES, DTYPES
from ..io.shards import plan_files, plan_shards
from ..model.inkling2 import RELEASE_EXPERT_FORMAT, Inkling2Config
from ..model.layout import Layout, MoEConfig, model_config
from ..model.storage import ExpertStorage
from ..model.tensors import TensorName
from ..schemes import Scheme

FLOAT_SOURCES = FORMATS["passthrough"].source_dtypes

# shard -> tensor name -> (safetensors dtype name, shape)
Listing = dict[str, dict[str, tuple[str, tuple[int, ...]]]]


@dataclass(frozen=True)
class SrcTensor:
    name: str
    shard: str
    dtype: str  # safetensors dtype name (picklable, hashable)
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Unit:
    """What is converted as one: a pass-through tensor; an expert's gate and up (per-expert
    sources, one NVFP4 global scale for both) or one expert projection; or a stacked expert tensor
    (all experts of a layer's gate/up or down; with the MXFP8 release's scale beside it),
    converted expert by expert. `input_amax` and `amax_origin` have one entry per source tensor
    (one for a stacked unit). `storage` is the source's expert storage (None: a tensor copied as
    it is), `writing` how the output form names and lays out what is written (export)."""

    sources: tuple[SrcTensor, ...]
    format: str
    input_amax: tuple[float | None, ...]
    amax_origin: tuple[str | None, ...] = ()  # "calibrated" or "default" (None: no activation scale)
    source_format: str | None = None  # a quantized source's format (the MXFP8 release, FP8, MXFP4); None: float
    storage: ExpertStorage | None = None
    writing: Writing = Copy()
    encoder: str = "modelopt"  # which rule writes a quantized unit's bits (formats' `encoders`)
    # a quantized source's stored tensors per weight, in `sources` order (("weight", "weight_scale_inv"):
    # sources are weight, scale, weight, scale, ...); () : each source is one weight
    stored_suffixes: tuple[str, ...] = ()
    shapes: tuple[tuple[int, ...], ...] = ()  # each weight's shape where its stored tensors' differ (MXFP4)
    projection: str | None = None  # a stacked unit's canonical projection: "gate_up" or "down"
    # each weight's name as a float checkpoint has it (`<module>.weight`) where its stored weight
    # tensor is named otherwise (Kimi-K3's `<module>.weight_packed`); () : the stored names
    weight_names: tuple[str, ...] = ()
    # a quantized source's tensor copied as it is: the value rule its source format puts on its bytes
    # (formats.source_value_rule: a scale's, FP8 positive, MXFP4 e8m0), which verify holds the copy to
    value_rule: str | None = None

    @property
    def activation_scale(self) -> bool:
        """Whether its outputs carry an activation scale: decided once, by the planner, in setting
        input_amax (a W4A4 NVFP4 unit has one; weight-only and MXFP8 units none)."""
        return any(a is not None for a in self.input_amax)

    @property
    def stacked(self) -> bool:
        """A stacked expert tensor, converted expert by expert."""
        return self.storage is not None and self.storage.stacked

    @property
    def weights(self) -> tuple[SrcTensor, ...]:
        """The weights it converts: each source, or the first of each weight's stored tensors."""
        return self.sources[::len(self.stored_suffixes)] if self.stored_suffixes else self.sources

    def weight_name(self, i: int = 0) -> str:
        """Weight i's name as a float checkpoint has it: what the output's tensors are named by."""
        return self.weight_names[i] if self.weight_names else self.weights[i].name

    def weight_shape(self, i: int = 0) -> tuple[int, ...]:
        """Weight i's shape as a float weight ([..., out, in]; an MXFP4 weight's, not its blocks')."""
        return self.shapes[i] if self.shapes else self.weights[i].shape

    def stored(self, tensors: list) -> list[dict]:
        """Read tensors (one per source, in order) as one dict per weight, by the source format's
        suffixes (for `Format.requantize` / `dequantize` / `check_stored`)."""
        n = len(self.stored_suffixes)
        return [dict(zip(self.stored_suffixes, tensors[i:i + n])) for i in range(0, len(tensors), n)]

    def specs(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """Every output tensor (name, dtype name, shape), in write order (the form's writing)."""
        return self.writing.specs(self)


@dataclass(frozen=True)
class ShardJob:
    index: int
    file: str
    units: tuple[Unit, ...]
    specs: tuple[tuple[str, str, tuple[int, ...]], ...]  # output (name, dtype name, shape) in order
    src_bytes: int
    out_bytes: int


@dataclass
class Options:
    scheme: str = "default"
    weight_only: bool = False
    default_activation_amax: float | None = None
    activation_scales: str | None = None
    max_shard_bytes: int | None = None  # --max-shard-size; None: the form's files (_pack)
    workers: int = 1
    device: str = "cpu"
    buffered_io: bool = False  # how the bytes are written, not which: left out of the resume fingerprint
    output_format: str | None = None  # "inkling" (stacked, original names) or "modelopt-hf"; None: the source's
    encoder: str | None = None  # "release" or "modelopt"; None: the output form's own (OutputForm.encoder)
    dequantize_fp8: bool = False  # an FP8 source's modules outside the routed experts written BF16, not kept FP8


@dataclass
class Prepared:
    """Everything decided before any byte is written: the same for every part and every resume."""

    root: Path
    repo: str | None
    revision: str | None
    cfg: Inkling2Config | MoEConfig
    layout: Layout
    jobs: list[ShardJob]
    other_files: list[Path]
    fingerprint: str  # what a resume or a part must share, the source files included (runner.fingerprint)
    conversion: str   # the same without the source files: what a finished OUT records of the conversion
    source_id: str    # the source files' identity (runner.source_id), which a finished OUT records too
    form: OutputForm  # settled: the one asked for, else the source's own (export.form_for)
    scheme: Scheme
    # output experts module -> the encoder whose bytes a layer copied as the source stores it holds
    kept_encoders: dict[str, str] = dataclasses.field(default_factory=dict)
    calibration: dict = dataclasses.field(default_factory=dict)  # a calibrate file's provenance, recorded


def kept_encoders(root: Path, cfg, layout: Layout, jobs: list[ShardJob]) -> dict[str, str]:
    """Output experts module -> the encoder ("release", "modelopt") that wrote each quantized layer
    convert copies as the source stores it (the MXFP8 release's layers a scheme keeps MXFP8): what
    the source's quantization config declares for it (export.inkling.declared_encoder), the
    release's where it declares none, as verify reads such a layer. The output names it, so a
    copied layer carries the encoder of its bytes, not the run's. ConfigError naming the file
    for a rule no format here has."""
    kept = [u for j in jobs for u in j.units if u.stacked and u.source_format is not None and u.source_format == u.format]
    if not kept:
        return {}
    path = root / HF_QUANT_CONFIG
    hq = read_json(safe_child(root, HF_QUANT_CONFIG), HF_QUANT_CONFIG, ConfigError) if path.is_file() else None
    out = {}
    for u in kept:
        fmt = FORMATS[u.format]
        module = layout.experts_modules[layout.classify(u.sources[0].name).layer]
        rule = declared_encoder(cfg.raw, hq, module, fmt)
        by_rule = {r: e for e, r in fmt.encoders.items()}
        if rule is not None and rule not in by_rule:
            raise ConfigError(f"the quantization config names encoder {rule!r} for {module!r}, whose {fmt.name} "
                              f"experts convert copies as stored; {fmt.name}'s encoders are "
                              f"{sorted(fmt.encoders.values())}", path=path if hq is not None else root / CONFIG_NAME)
        out[u.writing.quantized_module(u, layout)] = by_rule.get(rule, "release")
    return out


# --------------------------------------------------------------------------- the source
def list_source(root: Path, repo: str | None, revision: str | None,
                max_tensors: int | None = None) -> tuple[Listing, list[Path], dict]:
    """The source's tensors from its shard headers, its non-weight files, and what identifies its
    files for the resume fingerprint (size and mtime; a hub repo by its revision). A local index or
    headers holding more than `max_tensors` (model.layout.max_tensors of the config) are refused."""
    if repo:
        listing = {s: {n: (d, tuple(sh)) for n, (d, sh) in e.items()} for s, e in hub.tensor_listing(repo, revision, root).items()}
        return listing, hub.other_files(root), {"repo": repo, "revision": revision}
    ckpt = Checkpoint.open(root)
    headers = ckpt.headers(max_tensors)
    listing = {s: {n: (DTYPE_NAMES[e.dtype], e.shape) for n, e in h.tensors.items()} for s, h in headers.items()}
    stat = {s: [h.file_size, os.stat(h.path).st_mtime_ns] for s, h in headers.items()}
    return listing, ckpt.other_files(), stat


def load_config(root: Path) -> Inkling2Config | MoEConfig:
    """The source's config.json: the published Inkling 2 model's or a Hugging Face MoE model's."""
    path = safe_child(root, CONFIG_NAME)
    return model_config(read_json(path, CONFIG_NAME, ConfigError), str(path))


def plan(cfg: Inkling2Config | MoEConfig, layout: Layout, tensors: list[SrcTensor], scheme: Scheme, form: OutputForm,
         opts: Options, calibrated: dict[str, float], root: str = ".") -> list[ShardJob]:
    """Units packed into output shards, written in the output `form`. An NVFP4 expert's
    activation amax comes from `calibrated` (--activation-scales), else --default-activation-amax.
    Every tensor is checked against its format (block divisibility) here, before any byte is
    written."""
    units = _units(cfg, layout, tensors, scheme, form, opts, calibrated, root)
    form.check_units(layout, units)
    return _pack(units, opts, form.file_of(cfg, layout))


def _units(cfg: Inkling2Config | MoEConfig, layout: Layout, tensors: list[SrcTensor], scheme: Scheme, form: OutputForm,
           opts: Options, calibrated: dict[str, float], root: str) -> list[Unit]:
    """Each tensor's unit, format and activation amax, in source order; a format error names the
    tensor at once, missing activation amaxes are reported together at the end. A quantized
    source's stored tensors (a scale, MXFP4's scales) go with their weight's unit; where the
    scheme quantizes nothing such a source is copied as it is."""
    units: list[Unit] = []
    by_name = {t.name: t for t in tensors}
    done: set[str] = set()
    missing_amax: list[str] = []
    copy = layout.source is not None and not any(
        scheme.format_name(cfg, TensorName(m, "expert", i)) != "passthrough" for i, m in layout.experts_modules.items())
    if opts.dequantize_fp8 and (copy or layout.source is None or layout.source.format != "fp8_block"):
        what = ("the scheme quantizes nothing, so the source is copied as it is" if copy else
                f"the source holds no FP8 block-scaled weights ({layout.source.describe() if layout.source else 'float weights'})")
        raise UsageError(f"--dequantize-fp8 does not apply: {what}")
    for t in tensors:
        if t.name in done:
            continue
        if copy:  # a quantized source the scheme leaves alone: every tensor as it is, its values checked
            units.append(Unit((t,), "passthrough", (None,), (None,), writing=Copy(),
                              value_rule=source_value_rule(layout, t.name)))
            continue
        rec = layout.classify(t.name)
        fmt = scheme.format_name(cfg, rec)
        stored = _stored_of(layout, t, by_name)
        if stored is None:  # a companion of a quantized source's weight (a scale): its weight's unit has it
            continue
        if rec.part != "expert":
            if fmt != "passthrough":  # the schemes quantize routed experts only
                raise UsageError(f"convert quantizes routed experts only; the scheme gives {t.name!r} {fmt}",
                                 tensor=t.name)
            units.append(_kept_unit(layout, form, stored, opts) if len(stored) > 1 else
                         Unit((t,), fmt, (None,), (None,), writing=form.copy(cfg, layout, t.name)))
        elif not layout.experts.stacked:
            group = _group(layout, t, rec, fmt, by_name)
            done.update(g.name for g in group)
            if fmt == "passthrough" and len(stored) > 1:
                raise UsageError(f"the scheme leaves layer {rec.layer}'s routed experts unquantized, and the source "
                                 f"stores them {_source_format(layout, stored)}: a scheme must quantize every expert "
                                 f"layer of a quantized source, or none (--scheme none copies it)", tensor=t.name)
            units.append(_expert_unit(layout, form, group, fmt, opts, calibrated, root, missing_amax, by_name))
        else:
            units.append(_stacked_unit(cfg, layout, form, stored, rec.projection, fmt, opts, calibrated, root,
                                       missing_amax))
    if missing_amax:
        raise UsageError(
            f"NVFP4 (W4A4) needs an activation scale per expert projection; none for {missing_amax[0]!r}"
            f" and {len(missing_amax) - 1} more. Pass --activation-scales FILE (calibration amax per module),"
            f" --default-activation-amax X, or --weight-only for W4A16 output")
    return units


def _weight_name(layout: Layout, t: SrcTensor) -> str:
    """The name a float checkpoint gives the weight `t` stores (a quantized source's codes under
    another name: Kimi-K3's `weight_packed`)."""
    own = layout.owner(t.name)
    return own[0] if own is not None else t.name


def _stored_of(layout: Layout, t: SrcTensor, by_name: dict[str, SrcTensor]) -> list[SrcTensor] | None:
    """The stored tensors of the weight `t` holds, the weight first (a float weight: itself alone;
    an FP8 weight and its scale; MXFP4's blocks and scales; the MXFP8 release's weight and
    `_scale`), or None when `t` is a companion (a scale, taken with its weight)."""
    if layout.source is not None:
        own = layout.owner(t.name)
        if own is not None and own[1] != "weight":
            return None
        if own is not None or DTYPES[t.dtype].itemsize == 1:  # a quantized weight (floats, lookup tables: alone)
            return [by_name[n] for n in layout.stored(own[0] if own is not None else t.name).values()]
        return [t]
    rec = layout.classify(t.name)
    if rec.part == "expert" and layout.experts.stacked and rec.suffix != "weight":
        return None  # the MXFP8 release's scale: with its weight
    scale = by_name.get(t.name + "_scale") if DTYPES[t.dtype] not in FLOAT_SOURCES else None
    return [t] if scale is None else [t, scale]


def _source_format(layout: Layout, stored: list[SrcTensor]) -> str | None:
    """The format a weight's stored tensors are in (None: a float weight)."""
    if len(stored) == 1:
        return None
    if layout.source is None:
        return RELEASE_EXPERT_FORMAT
    own = layout.owner(stored[0].name)
    return layout.source_format(own[0] if own is not None else stored[0].name)


def _kept_unit(layout: Layout, form: OutputForm, stored: list[SrcTensor], opts: Options) -> Unit:
    """A quantized source's module outside the routed experts: written as the output form writes
    that source format (ModelOpt's FP8_PB_WO: the bytes kept), or with --dequantize-fp8
    dequantized to BF16 (`form.kept`)."""
    src = _source_format(layout, stored)
    fmt = get_format(src, source=True)
    weight = stored[0]
    writing = form.kept(layout, weight.name, src, opts.dequantize_fp8)
    return Unit(tuple(stored), "passthrough" if opts.dequantize_fp8 else src, (None,), (None,), source_format=src,
                writing=writing, stored_suffixes=tuple(fmt.suffixes))


def _group(layout: Layout, t: SrcTensor, rec: TensorName, fmt: str, by_name: dict[str, SrcTensor]) -> list[SrcTensor]:
    """A per-expert source's unit: an expert's gate and up (in that order) share one global scale
    in a format that fuses them (NVFP4; ModelOpt and vLLM's fused w13), so they are converted
    together wherever the source put them; down, or any projection of another format, alone."""
    if not (FORMATS[fmt].fuses_gate_up and rec.projection in ("gate", "up")):
        return [t]
    gate, up = layout.experts.names[:2]
    own = gate if rec.projection == "gate" else up
    return [by_name[t.name.replace(f".{own}.", f".{p}.")] for p in (gate, up)]


def _expert_unit(layout: Layout, form: OutputForm, group: list[SrcTensor], fmt: str, opts: Options,
                 calibrated: dict[str, float], root: str, missing_amax: list[str],
                 by_name: dict[str, SrcTensor]) -> Unit:
    """An expert's projection(s) of a per-expert source (the form's writing: under their own names
    with the format's suffixes, what ModelOpt exports); gate and up read the same activations:
    one amax. A quantized source's expert reads each weight's stored tensors (an FP8 weight and
    its scale)."""
    amax, origin = [], []
    for g in group:
        a, o = None, None
        if FORMATS[fmt].static_activation_scale and not opts.weight_only:
            a, o = _activation_amax(layout.activation_key(layout.classify(g.name)), fmt, opts, calibrated)
            if a is None:
                missing_amax.append(_weight_name(layout, g)[: -len(".weight")])
        amax.append(a)
        origin.append(o)
    if len(group) == 2 and None not in amax:
        amax = [max(amax)] * 2
    stored = [_stored_of(layout, g, by_name) for g in group]
    src = _source_format(layout, stored[0])
    src_fmt = get_format(src, source=True) if src else None
    shapes = tuple(src_fmt.weight_shape({k: x.shape for k, x in zip(src_fmt.suffixes, st)}) for st in stored) \
        if src_fmt else ()
    u = Unit(tuple(x for st in stored for x in st), fmt, tuple(amax), tuple(origin), source_format=src,
             storage=layout.experts, writing=form.per_expert(layout), encoder=opts.encoder or form.encoder,
             stored_suffixes=tuple(src_fmt.suffixes) if src_fmt else (), shapes=shapes,
             weight_names=tuple(_weight_name(layout, g) for g in group))
    for i, g in enumerate(group):  # the weight's own checks (block divisibility), naming it
        try:
            Unit((g,), fmt, (None,), writing=u.writing, shapes=shapes[i:i + 1]).specs()
        except FormatError as e:
            raise FormatError(f"tensor {g.name!r}: {e}", path=f"{root}/{g.shard}", tensor=g.name) from None
    return u


def _stacked_unit(cfg, layout: Layout, form: OutputForm, stored: list[SrcTensor], projection: str, fmt: str,
                  opts: Options, calibrated: dict[str, float], root: str, missing_amax: list[str]) -> Unit:
    """One stacked expert tensor (all experts of a layer's gate/up or down; for a quantized source
    its stored tensors: the MXFP8 release's weight and `_scale`, MXFP4's blocks and scales), its
    activation amax keyed by the stacked weight's name; its format checked against every
    expert's shape here. A source kept in its format (the MXFP8 release kept MXFP8, or left as
    is) is copied bit-exact; a stacked tensor the scheme leaves alone is written as the form
    writes it (ModelOpt's form: transformers' stacked tensor as it is)."""
    t, source_format = stored[0], _source_format(layout, stored)
    if source_format is not None and fmt == "passthrough":
        fmt = source_format  # nothing to quantize: the stored experts pass through
    own = layout.owner(t.name)
    weight = own[0] if own is not None else t.name  # the stacked weight (MXFP4: what `_blocks` holds)
    writing = form.stacked(cfg, layout, weight, projection, fmt)
    if isinstance(writing, Copy):
        return Unit((t,), fmt, (None,), (None,), writing=writing)
    a, o = None, None
    if FORMATS[fmt].static_activation_scale and not opts.weight_only:
        a, o = _activation_amax(weight, fmt, opts, calibrated)
        if a is None:
            missing_amax.append(weight)
    src_fmt = get_format(source_format, source=True) if source_format else None
    shapes = (src_fmt.weight_shape({k: x.shape for k, x in zip(src_fmt.suffixes, stored)}),) if src_fmt else ()
    u = Unit(tuple(stored), fmt, (a,), (o,), source_format=source_format, storage=layout.experts, writing=writing,
             encoder=opts.encoder or form.encoder, shapes=shapes, projection=projection,
             stored_suffixes=tuple(src_fmt.suffixes) if src_fmt is not None else ())
    try:
        u.specs()
    except FormatError as e:
        raise FormatError(f"tensor {t.name!r}: {e}", path=f"{root}/{t.shard}", tensor=t.name) from None
    return u


def _activation_amax(module: str, fmt: str, opts: Options,
                     calibrated: dict[str, float]) -> tuple[float | None, str | None]:
    """(amax, where it came from) by precedence, checked; (None, None) when there is none."""
    for origin, a in (("calibrated", calibrated.get(module)), ("default", opts.default_activation_amax)):
        if a is not None:
            _check_activation_amax(a, origin, module, fmt, opts)
            return a, origin
    return None, None


def _check_activation_amax(amax: float, origin: str, module: str, fmt: str, opts: Options) -> None:
    """The activation scale this amax gives must be finite and > 0 (the format's rule refuses
    others): asked before any byte is written."""
    try:
        FORMATS[fmt].activation_scale(amax, module + ".input_scale")
    except FormatError as e:
        where = {"calibrated": opts.activation_scales, "default": "--default-activation-amax"}[origin]
        if origin == "calibrated":  # a file: named as the error's path
            raise UsageError(str(e), path=where, tensor=e.tensor) from None
        raise UsageError(f"{where}: {e}", tensor=e.tensor) from None


DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # HF's "5GB": the size-packed forms' default


def _pack(units: list[Unit], opts: Options, file_of=None) -> list[ShardJob]:
    """Units into output shards (docs/convert.md "Shards"). A form with a file layout (`file_of`:
    output tensor name -> file, the Inkling form's per-layer files) puts each unit in its file,
    a layer's shard cut further only by an explicit --max-shard-size; otherwise units in order
    into shards of at most --max-shard-size (default 5GB) of output (a larger unit alone)."""
    def size(u: Unit) -> int:
        return sum(spec_nbytes(s) for s in u.specs())

    if file_of is not None:
        files = plan_files(units, lambda u: file_of(u.specs()[0][0]), opts.max_shard_bytes, size)
    else:
        shards = [s for s in plan_shards(units, opts.max_shard_bytes or DEFAULT_MAX_SHARD_BYTES, size) if s]
        files = [(shard_name(i, len(shards)), s) for i, s in enumerate(shards)]  # no units, no shard
    return [_job(i, f, s) for i, (f, s) in enumerate(files)]


def _job(index: int, file: str, units: list[Unit]) -> ShardJob:
    specs = tuple(s for u in units for s in u.specs())
    src_bytes = sum(spec_nbytes((s.name, s.dtype, s.shape)) for u in units for s in u.sources)
    return ShardJob(index, file, tuple(units), specs, src_bytes, sum(spec_nbytes(s) for s in specs))


def spec_nbytes(spec: tuple[str, str, tuple[int, ...]]) -> int:
    n = DTYPES[spec[1]].itemsize
    for s in spec[2]:
        n *= s
    return n
