"""A quantized source in `verify`: what its tensors become in a converted checkpoint, and its
weights read back exactly.

- `kept_modules`: an FP8 source's modules outside the routed experts (attention, shared experts,
  dense MLPs), which convert keeps in ModelOpt's FP8_PB_WO form or dequantizes to BF16
  (docs/convert.md): what the layout check expects of them, and what the `passthrough` check
  compares them with (the weight's bytes; the scale renamed and viewed; a dequantized weight's
  values);
- `stored_as` / `copy_expected`: a checkpoint that is itself in a source's format (`convert
  --scheme none` of an FP8 or MXFP4 source copies it as it is): its tensors validated as convert
  validates a source (convert.validation.validate_source), and what the layout, config, values and
  passthrough checks hold them to;
- `source_weight`: a source's weight (an expert's, or one expert's slice of a stacked tensor) as
  fp32, its stored tensors dequantized exactly (model.sources names them, the source format
  decodes them): what `numerics[layer L]` compares a quantized expert with."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..convert.validation import validate_source  # the one validator of a quantized source's tensors
from ..errors import CheckpointError, InklingQuantError
from ..export.modelopt import read_quantization
from ..formats import FORMATS, Format, format_for_quant_algo, get_format, source_value_rule
from ..io.safetensors import DTYPE_NAMES
from ..model.sources import SourceQuant, scale_beside, source_quant
from ..model.layout import Layout
from .inventory import CHECKED, FAILED, Conf, Expected, Files, Shape, Source, listing
from .report import Check

_FLOAT = (torch.bfloat16, torch.float16, torch.float32)


@dataclass
class Kept:
    """A quantized source's modules outside the routed experts as the output holds them."""

    tensors: dict[str, Shape] = field(default_factory=dict)     # expected output tensors
    source_of: dict[str, str] = field(default_factory=dict)     # renamed: the kept scale -> the source's
    dropped: list[str] = field(default_factory=list)            # the source's tensors the output has not
    modules: dict[str, str] = field(default_factory=dict)       # kept module -> its format
    dequantized: dict[str, str] = field(default_factory=dict)   # BF16 output weight -> its source format


def kept_modules(files: Files, conf: Conf, source: Source | None, lay: Layout) -> Kept:
    """A quantized source's modules outside the routed experts (an FP8 source's attention, shared
    experts, dense MLPs), as convert writes them: kept in ModelOpt's entry for their format
    (FP8_PB_WO: the weight's bytes, its scale viewed [gm, 1, gn, 1] under `weight_scale`,
    `FP8Block.modelopt_specs`), or dequantized to BF16 (--dequantize-fp8). With --against, every
    such module of the source, the output's dtype saying which way; alone, the modules the
    quantization config declares in a format only sources store (fp8_pb_wo). ModelOpt's
    FP8-release form (DeepSeek-V4) keeps them as the source stores them instead (`_as_stored`)."""
    out = Kept()
    q = source.layout.source if source is not None else None
    as_stored = conf.cfg.family.moe_quant_algo
    if as_stored and source is None:
        return _as_stored(out, files, lay)
    if source is not None:
        if q is None or q.experts_only:
            return out
        fmt = get_format(q.format, source=True)
        for name in source.tensors:
            own = source.layout.owner(name)
            rec = source.layout.part_of(own[0]) if own is not None else None
            if rec is None or rec.part == "expert" or own[0] not in source.tensors:
                continue
            weight, shape = own[0], tuple(source.tensors[own[0]].entry.shape)
            got = files.tensors.get(weight)
            if got is not None and got.entry.dtype in _FLOAT:  # dequantized
                out.tensors[weight], out.dequantized[weight] = (shape, torch.bfloat16), q.format
                out.dropped.append(name)
                continue
            if as_stored:  # the source's tensors, as the pass-through compares them
                continue
            for k, written in _kept_module(out, fmt, weight, shape).items():
                if k != "weight":  # the scale, renamed and viewed: compared with the source's
                    out.source_of[written] = name
            out.dropped.append(name)
        return out
    try:
        declared = (read_quantization(conf.root, conf.config) or {}).get("quantized_layers") or {}
    except InklingQuantError:
        return out  # the config check reports it
    for module, entry in declared.items():
        fmt = format_for_quant_algo(entry.get("quant_algo"), source=True)
        w = files.tensors.get(f"{module}.weight")
        if fmt is not None and fmt.source_only and w is not None:
            _kept_module(out, fmt, f"{module}.weight", tuple(w.entry.shape))
    return out


def _as_stored(out: Kept, files: Files, lay: Layout) -> Kept:
    """Without the source, what ModelOpt's FP8-release form (DeepSeek-V4) keeps as the source
    stores it: each 1-byte `<module>.weight` with its scale beside it (`sources.scale_beside`),
    FP8 block-scaled, or an MTP block's expert stored MXFP4 (`Layout.expert_weight`), expected
    in that format's shapes for the weight its scale implies, in the dtypes it stores them in."""
    for name, w in files.tensors.items():
        scale = scale_beside(name, files.tensors) if name.endswith(".weight") else None
        if scale is None or w.entry.dtype.itemsize != 1:
            continue  # not kept so: the layout check names it where it is unexpected
        fmt = get_format(lay.kept_format(name), source=True)
        names = dict(zip(fmt.suffixes, (name, scale)))
        shape = fmt.weight_shape({k: tuple(files.tensors[n].entry.shape) for k, n in names.items()})
        for k, o in fmt.out_specs(shape).items():
            got = files.tensors[names[k]].entry.dtype
            out.tensors[names[k]] = (tuple(o.shape), got if got in fmt.stored_dtypes.get(k, (o.dtype,)) else o.dtype)
    return out


def _kept_module(out: Kept, fmt: Format, weight: str, shape: tuple[int, ...]) -> dict[str, str]:
    """Expect the kept module of `weight` in ModelOpt's form of `fmt`; suffix -> name written."""
    names = {}
    for k, o in fmt.modelopt_specs(shape).items():
        names[k] = fmt.tensor_name(weight, k)
        out.tensors[names[k]] = (tuple(o.shape), o.dtype)
    out.modules[weight[: -len(".weight")]] = fmt.name
    return names




# ============================================================================ a checkpoint in a source's format
def stored_as(conf: Conf) -> SourceQuant | None:
    """The source format the checkpoint's own config.json describes (model.sources.source_quant:
    FP8 block-scaled or MXFP4), or None. ConfigError for an FP8 config convert does not read."""
    return source_quant(conf.config, str(conf.root / "config.json")) if conf.config is not None else None


def copy_expected(c: Check, files: Files, conf: Conf, source: Source | None) -> Expected:
    """The `layout` check of a checkpoint stored in a source's format (a `--scheme none` copy):
    its tensors are what convert accepts as such a source (convert.validation.validate_source: names,
    dtypes, shapes, scale grids; the first problem fails it, naming the tensor), and with
    --against exactly the source's tensors, each with the source's dtype and shape. Each stored
    weight's tensors are expected in the source format, everything else passes through. The
    caller compares the files with it."""
    listed = {shard: {n: (DTYPE_NAMES[e.dtype], tuple(e.shape)) for n, e in h.tensors.items()}
              for shard, h in files.headers.items()}
    try:
        _, lay = validate_source(conf.cfg, listed, str(conf.root))
    except CheckpointError as e:
        c.fail(e.path or listing(conf.root), e.tensor, f"{e.message} (stored as a quantized source: held to what "
               f"convert accepts of one)")
        return Expected(FAILED)
    q = lay.source
    held = source.tensors if source is not None and source.ok else files.tensors
    tensors = {n: (tuple(w.entry.shape), w.entry.dtype) for n, w in held.items()}
    fmt_of = {n: _copy_format(lay, n, tensors) for n in tensors}
    c.figures.update(detected=lay.describe(), stored_as=q.describe())
    return Expected(CHECKED, False, tensors, fmt_of, layout=lay, stored_as=q.format)


def _copy_format(lay: Layout, name: str, tensors: dict[str, Shape]) -> str:
    """The format tensor `name` of a checkpoint in a source format (`lay.source`) is held to: the
    source format for each stored weight's tensors (a weight quantized, with every companion
    present), pass-through for the rest."""
    own = lay.owner(name)
    weight = own[0] if own is not None else name
    stored = lay.stored(weight)
    if name in stored.values() and all(n in tensors for n in stored.values()) \
            and tensors[stored["weight"]][1] not in _FLOAT:
        return lay.source_format(weight)
    return FORMATS["passthrough"].name


def copy_value_rules(lay: Layout, name: str) -> set[str]:
    """The value rules (formats.VALUE_RULES keys) the source format puts on stored tensor `name`
    (formats.source_value_rule: its scale finite and positive for FP8, e8m0 not 0xFF for MXFP4);
    a weight's own bytes are held to its dtype's rule (no e4m3 NaN)."""
    rule = source_value_rule(lay, name)
    return {rule} if rule is not None else set()


# ============================================================================ a source's weights, exactly
def stored_of(src: Source, weight: str) -> dict[str, str] | None:
    """suffix -> source tensor of each stored tensor that holds `weight` (as a BF16 checkpoint
    names it) when the source stores it quantized (FP8: the weight and its `weight_scale_inv`;
    MXFP4: `_blocks` and `_scales`); None for a float weight (read as it is)."""
    q = src.layout.source if src.layout is not None else None
    if q is None:
        return None
    names = src.layout.stored(weight)
    if len(names) < 2 or any(n not in src.tensors for n in names.values()):
        return None
    return None if src.tensors[names["weight"]].entry.dtype in _FLOAT else names


def stored_shapes(src: Source, weight: str, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """source tensor -> the shape config.json implies for it, of the tensors holding `weight` of
    `shape` (a float weight: itself; a quantized one: its format's stored tensors)."""
    names = stored_of(src, weight)
    if names is None:
        q = src.layout.source if src.layout is not None else None
        if q is None or not q.experts_only:
            return {weight: tuple(shape)}
        names = src.layout.stored(weight)  # MXFP4 experts: stored so or missing
    fmt = get_format(src.layout.source_format(weight), source=True)
    return {names[k]: tuple(o.shape) for k, o in fmt.out_specs(shape).items()}


def read_weight(src: Source, weight: str, read) -> torch.Tensor:
    """`weight` as fp32 (float: as stored; quantized: its stored tensors dequantized exactly by the
    source format), `read(name)` reading one source tensor (or one expert's slice of it)."""
    names = stored_of(src, weight)
    if names is None:
        return read(weight)
    fmt = get_format(src.layout.source_format(weight), source=True)
    return fmt.dequantize({k: read(n) for k, n in names.items()}, torch.float32)
