"""Planning: everything decided before any byte is written. The source is listed and checked
against the layout, each NVFP4 module gets its activation amax, tensors are grouped into units
(an NVFP4 expert's gate and up together, so they share one global scale) and the units are
packed into output shards."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .. import hub
from ..errors import CheckpointError, ConfigError, FormatError, InklingQuantError, UsageError, printable
from ..formats import FORMATS, SCALE_SUFFIXES
from ..formats.stacked import expert_module_specs, projection_specs
from ..inkling2 import (RELEASE_EXPERT_FORMAT, Inkling2Config, Spec, checkpoint_tensors, modelopt_tensor,
                        transformers_name)
from ..inkling2 import classify as classify_original
from ..io.checkpoint import CONFIG_NAME, Checkpoint, read_json, safe_child, shard_name
from ..io.safetensors import DTYPE_NAMES, DTYPES, ShardReader
from ..io.shards import ShardReaders, plan_shards
from ..layout import (FUSED_PROJECTIONS, ModelConfig, TensorName, classify, expected_tensors, model_config, source_spec,
                      source_tensor_count)
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
    """Tensors converted together: one tensor, an NVFP4 expert's gate+up sharing a global scale
    (legacy layout), or one stacked expert tensor of the published layout, converted expert by
    expert (`stacked` names its projection, "w13" or "w2")."""

    sources: tuple[SrcTensor, ...]
    format: str
    input_amax: tuple[float | None, ...]
    amax_origin: tuple[str | None, ...] = ()  # per source: "calibrated", "source" or "default"
    stacked: str | None = None
    # modelopt-hf output: the name the tensor is written under (transformers'), and for the
    # unembedding the rows kept (transformers' lm_head drops the vocabulary padding)
    out_name: str | None = None
    rows: int | None = None
    per_expert: bool = False  # a stacked unit written as ModelOpt's per-expert modules
    source_format: str | None = None  # a quantized source's format (the MXFP8 release); None: float


@dataclass(frozen=True)
class ShardJob:
    index: int
    file: str
    units: tuple[Unit, ...]
    specs: tuple[tuple[str, str, tuple[int, ...]], ...]  # output (name, dtype name, shape) in order
    src_bytes: int
    out_bytes: int


OUTPUT_FORMATS = ("inkling", "modelopt-hf")


@dataclass
class Options:
    scheme: str = "default"
    weight_only: bool = False
    default_activation_amax: float | None = None
    activation_scales: str | None = None
    max_shard_bytes: int = 5 * 10**9
    workers: int = 1
    device: str = "cpu"
    buffered_io: bool = False  # how the bytes are written, not which: left out of the resume fingerprint
    output_format: str = "inkling"  # published layout: "inkling" (stacked, original names) or "modelopt-hf"


@dataclass
class Prepared:
    """Everything decided before any byte is written: the same for every part and every resume."""

    root: Path
    repo: str | None
    revision: str | None
    cfg: ModelConfig | Inkling2Config
    jobs: list[ShardJob]
    other_files: list[Path]
    fingerprint: str


# --------------------------------------------------------------------------- the source
def list_source(root: Path, repo: str | None, revision: str | None) -> tuple[Listing, list[Path], dict]:
    """The source's tensors from its shard headers, its non-weight files, and what identifies its
    files for the resume fingerprint (size and mtime; a hub repo by its revision)."""
    if repo:
        listing = {s: {n: (d, tuple(sh)) for n, (d, sh) in e.items()} for s, e in hub.tensor_listing(repo, revision, root).items()}
        return listing, hub.other_files(root), {"repo": repo, "revision": revision}
    ckpt = Checkpoint.open(root)
    headers = ckpt.headers()
    listing = {s: {n: (DTYPE_NAMES[e.dtype], e.shape) for n, e in h.tensors.items()} for s, h in headers.items()}
    stat = {s: [h.file_size, os.stat(h.path).st_mtime_ns] for s, h in headers.items()}
    return listing, ckpt.other_files(), stat


def load_config(root: Path) -> ModelConfig | Inkling2Config:
    """The source's config.json: the published model's (text_config nested) or the legacy layout's."""
    path = safe_child(root, CONFIG_NAME)
    d = read_json(path, CONFIG_NAME, ConfigError)
    return model_config(d, str(path))


def _classify(cfg: ModelConfig | Inkling2Config, name: str) -> TensorName:
    return classify_original(name) if isinstance(cfg, Inkling2Config) else classify(name)


def validate_source(cfg: ModelConfig | Inkling2Config, listing: Listing, root: str) -> list[SrcTensor]:
    """Every tensor must be in the layout, float, with the shape the config implies; nothing missing."""
    if isinstance(cfg, Inkling2Config):
        return _validate_original(cfg, listing, root)
    tensors, seen = [], set()
    for shard, entries in listing.items():
        for name, (dtype, shape) in entries.items():
            path, where = f"{root}/{shard}", f"tensor {name!r}"
            try:
                t = classify(name)
                spec = source_spec(cfg, name if t.suffix != "input_scale" else f"{t.module}.weight")
            except InklingQuantError as e:
                raise CheckpointError(str(e), path=path, tensor=name) from None
            if (t.suffix in SCALE_SUFFIXES and t.suffix != "input_scale") or DTYPES[dtype] not in FLOAT_SOURCES:
                raise CheckpointError(f"{where}: source is already quantized ({dtype}); convert takes "
                                      f"BF16/FP16/FP32 checkpoints (dequantize first)", path=path, tensor=name)
            if t.suffix == "input_scale":
                if tuple(shape) not in ((), (1,)):
                    raise CheckpointError(f"{where}: input_scale must be a scalar, got shape {list(shape)}",
                                          path=path, tensor=name)
            elif tuple(shape) != spec.shape:
                raise CheckpointError(f"{where}: shape {list(shape)} disagrees with config.json "
                                      f"(expected {list(spec.shape)})", path=path, tensor=name)
            tensors.append(SrcTensor(name, shard, dtype, tuple(shape)))
            seen.add(name)
    # every tensor seen is one of the config's (source_spec checked it), so the count says how
    # many are missing; the first is found without listing a config's claimed 16,384 experts
    n_missing = source_tensor_count(cfg) - sum(not n.endswith(".input_scale") for n in seen)
    if n_missing:
        first = next(s.name for s in expected_tensors(cfg) if s.name not in seen)
        more = f" (and {n_missing - 1} more)" if n_missing > 1 else ""
        raise CheckpointError(f"tensor {first!r}{more} required by config.json is missing", path=root, tensor=first)
    return tensors


def _validate_original(cfg: Inkling2Config, listing: Listing, root: str) -> list[SrcTensor]:
    """The published layout: every tensor one of `checkpoint_tensors(cfg)` (a list bounded by
    layers, not experts), float, of its shape; none missing."""
    expected = {s.name: s for s in checkpoint_tensors(cfg)}
    listed = {name for entries in listing.values() for name in entries}
    for name, spec in list(expected.items()):  # experts stored as the MXFP8 release stores them
        rec = classify_original(name)
        if rec.part == "expert" and name + "_scale" in listed:
            prefix = name[: -len(f"{rec.projection}_weight")]
            for k, o in projection_specs(FORMATS[RELEASE_EXPERT_FORMAT], rec.projection, spec.shape).items():
                expected[prefix + k] = Spec(prefix + k, tuple(o.shape), o.dtype)
    tensors = []
    for shard, entries in listing.items():
        for name, (dtype, shape) in entries.items():
            spec = expected.get(name)
            if spec is None:
                raise CheckpointError(f"tensor {name!r} is not a tensor of the Inkling 2 layout with this config "
                                      f"(docs/layout.md)", path=f"{root}/{shard}", tensor=name)
            if (DTYPES[dtype] not in FLOAT_SOURCES) if spec.dtype in FLOAT_SOURCES else DTYPES[dtype] != spec.dtype:
                raise CheckpointError(f"tensor {name!r}: dtype {dtype}; convert takes BF16/FP16/FP32 tensors, with the "
                                      f"routed experts also as the MXFP8 release stores them (e4m3 weight + uint8 "
                                      f"e8m0 scale)", path=f"{root}/{shard}", tensor=name)
            if tuple(shape) != spec.shape:
                raise CheckpointError(f"tensor {name!r}: shape {list(shape)} disagrees with config.json (expected "
                                      f"{list(spec.shape)})", path=f"{root}/{shard}", tensor=name)
            tensors.append(SrcTensor(name, shard, dtype, tuple(shape)))
    seen = {t.name for t in tensors}
    missing = [n for n in expected if n not in seen]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"tensor {missing[0]!r}{more} required by config.json is missing", path=root,
                              tensor=missing[0])
    return tensors


def activation_module(cfg: ModelConfig | Inkling2Config, name: str) -> str | None:
    """The module an activation amax is keyed by for the source tensor `name`: `<module>` of a
    legacy `<module>.weight`, the stacked tensor's own name in the published layout (vLLM reads
    its scale as `<name>.input_amax`); None for tensors that take none."""
    if isinstance(cfg, Inkling2Config):
        return name if classify_original(name).part == "expert" else None
    return name[: -len(".weight")] if name.endswith(".weight") else None


# --------------------------------------------------------------------------- calibration
def load_activation_amax(path: str | None) -> dict[str, float]:
    """module -> activation amax from a calibration file (JSON {module: amax} or safetensors
    {module + '.input_amax': one-element float tensor})."""
    if not path:
        return {}
    p = Path(path)
    if p.is_dir():
        out = _amax_from_checkpoint(p)
    else:
        out = _amax_from_safetensors(p) if p.suffix == ".safetensors" else _amax_from_json(p)
    for k, v in out.items():
        if not (v > 0 and v < float("inf")):
            raise CheckpointError(f"module {k[:200]!r}: activation amax must be finite and positive, got {v}",
                                  path=path)
    return out


def _amax_from_safetensors(p: Path) -> dict[str, float]:
    from ..io.safetensors import read_header

    out: dict[str, float] = {}
    with ShardReader(p, read_header(p)) as r:
        for name, e in r.header.tensors.items():
            module = name[: -len(".input_amax")]
            where = f"tensor {name[:200]!r}"
            if not name.endswith(".input_amax") or not module:
                raise CheckpointError(f"{where}: expected '<module>.input_amax' names", path=p, tensor=name)
            if not e.dtype.is_floating_point or e.nbytes != e.dtype.itemsize:
                raise CheckpointError(f"{where}: an amax is one floating-point value, got dtype "
                                      f"{DTYPE_NAMES[e.dtype]} shape {list(e.shape)}", path=p, tensor=name)
            out[module] = float(r.get(name).float().reshape(-1)[0])
    return out


def _amax_from_checkpoint(root: Path) -> dict[str, float]:
    """module -> amax from a quantized checkpoint's own activation scales, taken verbatim (the
    format's exact inverse, so the scale is written back bit for bit): ModelOpt's per-module
    `<module>.input_scale` (its per-expert export of the published model keyed by the stacked
    tensor that holds the expert: one scale per layer and projection) and the Inkling form's
    `<stacked>.input_amax` [E]. Where experts differ, the largest (vLLM takes the max)."""
    from ..inkling2 import stacked_of_expert_module

    scaled = next(f for f in FORMATS.values() if f.static_activation_scale)
    out: dict[str, float] = {}
    ckpt = Checkpoint.open(root)
    headers = ckpt.headers()
    with ShardReaders(root, headers) as readers:
        for shard, h in headers.items():
            for name, e in h.tensors.items():
                if name.endswith(".input_scale"):
                    module = name[: -len(".input_scale")]
                    module = stacked_of_expert_module(module) or module
                    values = [scaled.activation_amax(v) for v in _floats(readers.get(shard), name, e)]
                elif name.endswith(".input_amax"):
                    module, values = name[: -len(".input_amax")], _floats(readers.get(shard), name, e)
                else:
                    continue
                out[module] = max(out.get(module, 0.0), *values)
    if not out:
        raise CheckpointError("holds no activation scales (no '.input_scale' or '.input_amax' tensor)", path=root)
    return out


def _floats(reader: ShardReader, name: str, e) -> list[float]:
    """An activation scale tensor's values, each finite and > 0 (a corrupt one is named, never
    lost in a max)."""
    if not e.dtype.is_floating_point or e.nbytes == 0:
        raise CheckpointError(f"tensor {name!r}: an activation scale is a floating-point value", path=reader.path,
                              tensor=name)
    values = [float(v) for v in reader.get(name).float().reshape(-1)]
    if not all(0 < v < float("inf") for v in values):
        raise CheckpointError(f"tensor {name!r}: activation scales must be finite and > 0, got "
                              f"{next(v for v in values if not 0 < v < float('inf'))}", path=reader.path, tensor=name)
    return values


def _amax_from_json(p: Path) -> dict[str, float]:
    from ..io.safetensors import _short

    out: dict[str, float] = {}
    obj = read_json(p, "activation scales file")
    for k, v in obj.items():
        if not k:
            raise CheckpointError("an empty module name", path=p)
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise CheckpointError(f"module {k[:200]!r}: amax must be a number, got {_short(v)}", path=p)
        try:
            out[k] = float(v)
        except OverflowError:  # an integer past the float range
            raise CheckpointError(f"module {k[:200]!r}: activation amax must be finite and positive, "
                                  f"got an integer too large for a float", path=p) from None
    return out


def load_calibration(path: str | None, cfg: ModelConfig | Inkling2Config, tensors: list[SrcTensor],
                     src: str) -> dict[str, float]:
    """--activation-scales: every module it names must be one of the source's."""
    calibrated = load_activation_amax(path)
    modules = {m for t in tensors if (m := activation_module(cfg, t.name)) is not None}
    unknown = sorted(k for k in calibrated if k not in modules)
    if unknown:
        raise CheckpointError(f"{len(unknown)} of {len(calibrated)} module name(s) match "
                              f"no module of {src} (first: {printable(unknown[0][:200])!r}); calibration for "
                              f"another model or another naming?", path=path)
    return calibrated


# --------------------------------------------------------------------------- units and shards
def plan(cfg: ModelConfig | Inkling2Config, tensors: list[SrcTensor], scheme: Scheme, opts: Options,
         calibrated: dict[str, float], from_source: dict[str, float] | None = None, root: str = ".") -> list[ShardJob]:
    """Units (a tensor, or an NVFP4 gate/up pair) packed into output shards. An NVFP4 module's
    activation amax comes from `calibrated` (--activation-scales), else `from_source` (the
    source's own input_scale), else --default-activation-amax. Every tensor is checked against
    its format (block divisibility) here, before any byte is written."""
    units = _units(cfg, tensors, scheme, opts, calibrated, from_source or {}, root)
    return _pack(units, opts)


def _units(cfg: ModelConfig | Inkling2Config, tensors: list[SrcTensor], scheme: Scheme, opts: Options,
           calibrated: dict[str, float], from_source: dict[str, float], root: str) -> list[Unit]:
    """Each tensor's unit, format and activation amax, in source order; a format error names the
    tensor at once, missing activation amaxes are reported together at the end."""
    units: list[Unit] = []
    by_name = {t.name: t for t in tensors}
    done: set[str] = set()
    missing_amax: list[str] = []
    for t in tensors:
        if t.name in done:
            continue
        rec = _classify(cfg, t.name)
        if rec.suffix == "input_scale":  # calibration carried in the source: consumed, not copied
            continue
        fmt = scheme.format_name(cfg, rec)
        if isinstance(cfg, Inkling2Config) and rec.part == "expert":
            if rec.suffix == "weight":  # a quantized source's scales go with their weight
                scale = by_name.get(t.name + "_scale") if DTYPES[t.dtype] not in FLOAT_SOURCES else None
                units.append(_stacked_unit(t, scale, rec.projection, fmt, opts, calibrated, from_source, root,
                                           missing_amax))
            continue
        if isinstance(cfg, Inkling2Config) and opts.output_format == "modelopt-hf":
            units.append(_renamed_unit(cfg, t, fmt))
            continue
        group = _group(t, rec, fmt, by_name)
        amax: list[float | None] = []
        origin: list[str | None] = []
        for g in group:
            done.add(g.name)
            try:
                _out_names(g, fmt, opts.weight_only)
            except FormatError as e:
                raise FormatError(f"tensor {g.name!r}: {e}", path=f"{root}/{g.shard}", tensor=g.name) from None
            module = g.name[: -len(".weight")]
            a, o = None, None
            if FORMATS[fmt].static_activation_scale and not opts.weight_only:
                a, o = _activation_amax(module, fmt, opts, calibrated, from_source)
                if a is None:
                    missing_amax.append(module)
            amax.append(a)
            origin.append(o)
        if len(group) == 2 and None not in amax:
            amax = [max(amax)] * 2  # gate and up read the same activations: one input scale
        units.append(Unit(tuple(group), fmt, tuple(amax), tuple(origin)))
    if missing_amax:
        raise UsageError(
            f"NVFP4 (W4A4) needs an activation scale per expert projection; none for {missing_amax[0]!r}"
            f" and {len(missing_amax) - 1} more. Pass --activation-scales FILE (calibration amax per module),"
            f" --default-activation-amax X, or --weight-only for W4A16 output")
    return units


def _stacked_unit(t: SrcTensor, scale: SrcTensor | None, proj: str, fmt: str, opts: Options,
                  calibrated: dict[str, float], from_source: dict[str, float], root: str,
                  missing_amax: list[str]) -> Unit:
    """One stacked expert tensor (all experts of a layer's w13 or w2; with `scale`, stored in the
    MXFP8 release form), its activation amax keyed by its own name; its format checked against
    every expert's shape here. An MXFP8 source kept MXFP8 (or left as is) is copied bit-exact."""
    source_format = None if scale is None else RELEASE_EXPERT_FORMAT
    if source_format is not None and fmt == "passthrough":
        fmt = source_format  # nothing to quantize: the stored experts pass through
    if opts.output_format == "modelopt-hf" and fmt == "passthrough":
        raise UsageError(f"--output-format modelopt-hf writes quantized experts as ModelOpt exports them; the "
                         f"scheme leaves {t.name!r} unquantized: use --output-format inkling", tensor=t.name)
    try:
        _stacked_names(t, proj, fmt, opts.weight_only, opts.output_format == "modelopt-hf")
    except FormatError as e:
        raise FormatError(f"tensor {t.name!r}: {e}", path=f"{root}/{t.shard}", tensor=t.name) from None
    a, o = None, None
    if FORMATS[fmt].static_activation_scale and not opts.weight_only:
        a, o = _activation_amax(t.name, fmt, opts, calibrated, from_source)
        if a is None:
            missing_amax.append(t.name)
    return Unit((t,) if scale is None else (t, scale), fmt, (a,), (o,), stacked=proj,
                per_expert=opts.output_format == "modelopt-hf", source_format=source_format)


def _stacked_names(src: SrcTensor, proj: str, fmt: str, weight_only: bool,
                   per_expert: bool = False) -> list[tuple[str, str, tuple[int, ...]]]:
    """The tensors written for a stacked source: the Inkling stacked form (formats.stacked names
    them under its module), or ModelOpt's per-expert modules under transformers' names
    (`<experts module>.<e>.<gate_proj|up_proj|down_proj>.<suffix>`, expert by expert)."""
    if not per_expert:
        prefix = src.name[: -len(f"{proj}_weight")]
        specs = projection_specs(FORMATS[fmt], proj, src.shape, dtype=DTYPES[src.dtype],
                                 activation_scale=not weight_only)
        return [(prefix + k, DTYPE_NAMES[o.dtype], tuple(o.shape)) for k, o in specs.items()]
    return [spec for _, _, _, spec in expert_modules(src, proj, fmt, weight_only)]


def expert_modules(src: SrcTensor, proj: str, fmt: str,
                   weight_only: bool) -> list[tuple[int, str, str, tuple[str, str, tuple[int, ...]]]]:
    """(expert, module, suffix, output spec) of every tensor ModelOpt exports for a stacked
    source, in write order: per expert, its modules, each module's tensors in the format's order."""
    prefix = transformers_name(src.name).rsplit(".", 1)[0]  # model.language_model.layers.N.mlp.experts
    specs = expert_module_specs(FORMATS[fmt], proj, src.shape, dtype=DTYPES[src.dtype],
                                activation_scale=not weight_only)
    return [(e, m, k, (f"{prefix}.{e}.{m}.{k}", DTYPE_NAMES[o.dtype], tuple(o.shape))) for (e, m, k), o in specs.items()]


def _renamed_unit(cfg: Inkling2Config, t: SrcTensor, fmt: str) -> Unit:
    """A pass-through tensor of a modelopt-hf output: transformers' name; the unembedding cut to
    the rows transformers' lm_head keeps (core_model_loading.py Inkling2UnpadVocab). A bundled
    DSpark draft, which transformers' model (and so ModelOpt's export) does not have, keeps its
    own names: nothing of the source is dropped."""
    if fmt != "passthrough":  # the schemes quantize routed experts only
        raise UsageError(f"--output-format modelopt-hf quantizes routed experts only; the scheme gives "
                         f"{t.name!r} {fmt}", tensor=t.name)
    out, rows = modelopt_tensor(cfg, t.name)
    return Unit((t,), fmt, (None,), (None,), out_name=out, rows=rows)


def _group(t: SrcTensor, rec: TensorName, fmt: str, by_name: dict[str, SrcTensor]) -> list[SrcTensor]:
    """The tensors of t's unit: an expert's gate and up (in that order) share one global scale in
    a format that fuses them (NVFP4), so they are converted together even when the source put
    them in different shards."""
    if FORMATS[fmt].fuses_gate_up and rec.projection in FUSED_PROJECTIONS:
        return [t if p == rec.projection else by_name[t.name.replace(f".{rec.projection}.", f".{p}.")]
                for p in FUSED_PROJECTIONS]
    return [t]


def _activation_amax(module: str, fmt: str, opts: Options, calibrated: dict[str, float],
                     from_source: dict[str, float]) -> tuple[float | None, str | None]:
    """(amax, where it came from) by precedence, checked; (None, None) when there is none."""
    for origin, a in (("calibrated", calibrated.get(module)), ("source", from_source.get(module)),
                      ("default", opts.default_activation_amax)):
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
        where = {"calibrated": opts.activation_scales, "source": "the source's input_scale",
                 "default": "--default-activation-amax"}[origin]
        if origin == "calibrated":  # a file: named as the error's path
            raise UsageError(str(e), path=where, tensor=e.tensor) from None
        raise UsageError(f"{where}: {e}", tensor=e.tensor) from None


def _pack(units: list[Unit], opts: Options) -> list[ShardJob]:
    """Units in order into shards of at most --max-shard-size of output (a larger unit alone)."""
    shards = plan_shards(units, opts.max_shard_bytes,
                         size=lambda u: sum(spec_nbytes(s) for s in _unit_specs(u, opts.weight_only)))
    shards = [s for s in shards if s]  # no units, no shard
    return [_job(i, len(shards), s, opts.weight_only) for i, s in enumerate(shards)]


def _job(index: int, count: int, units: list[Unit], weight_only: bool) -> ShardJob:
    specs = tuple(s for u in units for s in _unit_specs(u, weight_only))
    src_bytes = sum(spec_nbytes((s.name, s.dtype, s.shape)) for u in units for s in u.sources)
    return ShardJob(index, shard_name(index, count), tuple(units), specs, src_bytes, sum(spec_nbytes(s) for s in specs))


def _unit_specs(u: Unit, weight_only: bool) -> list[tuple[str, str, tuple[int, ...]]]:
    if u.stacked is not None:
        return _stacked_names(u.sources[0], u.stacked, u.format, weight_only, u.per_expert)
    if u.out_name is not None:
        src = u.sources[0]
        return [(u.out_name, src.dtype, (u.rows, *src.shape[1:]) if u.rows is not None else src.shape)]
    return [s for src in u.sources for s in _out_names(src, u.format, weight_only)]


def _out_names(src: SrcTensor, fmt_name: str, weight_only: bool) -> list[tuple[str, str, tuple[int, ...]]]:
    out = FORMATS[fmt_name].out_tensors(src.name, src.shape, DTYPES[src.dtype], activation_scale=not weight_only)
    return [(name, DTYPE_NAMES[o.dtype], tuple(o.shape)) for name, o in out.items()]


def spec_nbytes(spec: tuple[str, str, tuple[int, ...]]) -> int:
    n = DTYPES[spec[1]].itemsize
    for s in spec[2]:
        n *= s
    return n
