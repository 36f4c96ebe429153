"""What convert accepts as a source: its tensors checked, in one loop, against what its config
requires (`layout.expected_tensors`: Inkling 2's strict spec under the checkpoint's naming, a
Hugging Face MoE's routed experts), a quantized source's stored tensors against its format
(names, dtypes, shapes, scale grids), and every refusal worded in the source's terms, naming
the file and the tensor. verify asks the same validator of a checkpoint stored as a source
(verify/sources.py)."""
from __future__ import annotations

from ..errors import CheckpointError, ConfigError, short_repr
from ..formats import SCALE_SUFFIXES, get_format
from ..io.checkpoint import CONFIG_NAME
from ..io.safetensors import DTYPE_NAMES, DTYPES
from ..model.inkling2 import RELEASE_EXPERT_FORMAT, Inkling2Config, Spec
from ..model.layout import INDEX_DTYPES, Layout, MoEConfig, detect, expected_tensors, expert_tensor_count, oriented
from ..model.sources import converted_experts
from ..model.tensors import TensorName
from ..export import INKLING
from ..export.inkling import projection_specs
from ..formats import FORMATS
from .planner import FLOAT_SOURCES, Listing, SrcTensor


def validate_source(cfg: Inkling2Config | MoEConfig, listing: Listing, root: str) -> tuple[list[SrcTensor], Layout]:
    """The source's tensors and its detected layout (the stacked orientation settled): every
    tensor placed (inkling_quant.model.layout); every tensor the config requires (`expected_tensors`:
    for Inkling 2 all of them, under the checkpoint's naming; otherwise the routed experts)
    present with its shape; float (Inkling's interleaved experts also as the MXFP8 release stores
    them); for Inkling 2, nothing else."""
    if (algo := converted_experts(cfg.raw)) is not None:
        raise ConfigError(f"quantization_config.moe_quant_algo is {algo!r}: its routed experts were converted already "
                          f"(ModelOpt's DeepSeek-V4 form), not a source convert reads", path=f"{root}/{CONFIG_NAME}")
    entries = {name: (shard, dtype, tuple(shape)) for shard, e in listing.items() for name, (dtype, shape) in e.items()}
    layout = oriented(detect(list(entries), cfg, root), {n: e[2] for n, e in entries.items()}, cfg)
    implied = expert_tensor_count(layout, MoEConfig.of(cfg))
    if implied > 4 * len(entries) + 64:  # before listing them: the work stays bounded by the files
        raise ConfigError(f"config.json implies {implied} routed-expert weights, the checkpoint holds {len(entries)} "
                          f"tensors in all: they disagree (expert or layer counts?)", path=f"{root}/{CONFIG_NAME}")
    expected = expected_tensors(cfg, layout)
    if layout.original_names:  # the MXFP8 release's experts are read under the original names
        _release_experts(layout, expected, entries)
    _source_experts(layout, expected, entries)
    kept = _source_modules(layout, entries, root)
    strict = layout.naming is not None  # Inkling 2: every tensor listed by the config
    tensors, unexpected = [], []
    for name, (shard, dtype, shape) in entries.items():
        path, spec = f"{root}/{shard}", expected.get(name)
        if spec is None and strict:
            unexpected.append(name)
            continue
        if spec is None and name in kept:  # a quantized source's module outside the routed experts (checked)
            tensors.append(SrcTensor(name, shard, dtype, shape))
            continue
        quantized = spec.dtype not in FLOAT_SOURCES if spec is not None else False
        if spec is None and DTYPES[dtype] in INDEX_DTYPES and layout.part_of(name).part == "router":
            tensors.append(SrcTensor(name, shard, dtype, shape))  # a router's lookup table: as it is
            continue
        if (DTYPES[dtype] != spec.dtype) if quantized else (DTYPES[dtype] not in FLOAT_SOURCES):
            why = _source_dtype_problem(layout, name, dtype, shape, spec, entries)
            if why is not None:
                raise CheckpointError(f"tensor {name!r}: {why}", path=path, tensor=name)
            why = "the source is already quantized, in a form convert does not take" \
                if DTYPES[dtype].itemsize == 1 else "not a dtype convert takes"  # an 8/4-bit type: quantized
            raise CheckpointError(f"tensor {name!r}: dtype {dtype}: {why}; it takes BF16/FP16/FP32 tensors, with "
                                  f"Inkling's routed experts also as the MXFP8 release stores them (e4m3 weight + "
                                  f"uint8 e8m0 scale)", path=path, tensor=name)
        if spec is None:
            _check_unlisted(cfg, layout.classify(name), path)
        elif shape != spec.shape:
            raise CheckpointError(f"tensor {name!r}: shape {list(shape)} disagrees with config.json (expected "
                                  f"{list(spec.shape)})", path=path, tensor=name)
        tensors.append(SrcTensor(name, shard, dtype, shape))
    missing = [n for n in expected if n not in entries]
    if unexpected:
        raise CheckpointError(_unexpected(layout, unexpected, missing), path=f"{root}/{entries[unexpected[0]][0]}",
                              tensor=unexpected[0])
    if missing:
        raise CheckpointError(_missing(cfg, layout, missing), path=root, tensor=missing[0])
    return tensors, layout


def _release_experts(layout: Layout, expected: dict[str, Spec], entries: dict) -> None:
    """Interleaved experts stored as the MXFP8 release stores them (a `_scale` beside the weight)
    expected in that form: e4m3 weight + uint8 e8m0 scale of the same shape."""
    for name, spec in list(expected.items()):
        rec = layout.classify(name)
        if rec.part == "expert" and name + "_scale" in entries:
            release = INKLING.stacked(None, layout, name, rec.projection, RELEASE_EXPERT_FORMAT)
            for k, o in projection_specs(FORMATS[RELEASE_EXPERT_FORMAT], release.proj, spec.shape).items():
                expected[release.prefix + k] = Spec(release.prefix + k, tuple(o.shape), o.dtype)


def _source_experts(layout: Layout, expected: dict[str, Spec], entries: dict) -> None:
    """A quantized source's routed experts expected as it stores them (model.sources names; the
    source format's shapes, and its dtypes: an FP8 scale may be stored bf16). An FP8 source's
    expert stored as a float weight (no scale beside it) stays expected as a float weight."""
    q = layout.source
    if q is None:
        return
    fmt = get_format(q.expert_format, source=True)
    for name, spec in list(expected.items()):
        rec = layout.part_of(name)
        if rec is None or rec.part != "expert":
            continue
        stored = layout.stored(name)
        if not (q.experts_only or stored.keys() - {"weight"} <= {k for k, n in stored.items() if n in entries}):
            continue
        del expected[name]
        for suffix, o in fmt.out_specs(spec.shape).items():
            got = entries.get(stored[suffix])
            ok = got is not None and DTYPES[got[1]] in fmt.stored_dtypes.get(suffix, ())
            expected[stored[suffix]] = Spec(stored[suffix], tuple(o.shape), DTYPES[got[1]] if ok else o.dtype)


def _source_dtype_problem(layout: Layout, name: str, dtype: str, shape: tuple, spec: Spec | None,
                          entries: dict) -> str | None:
    """Why a quantized source's routed-expert tensor `name` of `dtype` is not read, in the source's
    terms (None where `name` is not one of its stored tensors): a companion missing beside a
    1-byte weight, or the dtypes its format stores that tensor in."""
    q = layout.source
    if q is None:
        return None
    own = layout.owner(name)
    weight, suffix = own if own is not None else (name, "weight")
    stored = layout.stored(weight)
    if stored.get(suffix) != name:
        return None
    src = layout.source_format(weight)
    fmt = get_format(src, source=True)
    missing = [n for n in stored.values() if n not in entries]
    if missing and own is None and DTYPES[dtype].itemsize == 1:
        return f"{dtype} {list(shape)}, but its {src} companion {missing[0]!r} is missing ({q.describe()})"
    if spec is None and q.experts_only:
        rec = layout.part_of(weight)
        if rec is not None and rec.part == "draft" and rec.layer is not None:  # an MTP layer past the decoder's
            return (f"{dtype} {list(shape)}: stored {src} in layer {rec.layer}, past the config's "
                    f"{layout.num_layers} decoder layers (an MTP layer?); convert reads a quantized source's "
                    f"routed experts in the decoder layers only ({q.describe()})")
        return f"{dtype} {list(shape)}: stored {src} outside the routed experts, where only they are ({q.describe()})"
    if spec is None or (own is None and spec.dtype in FLOAT_SOURCES):
        return None
    wants = "/".join(DTYPE_NAMES[d] for d in fmt.stored_dtypes.get(suffix) or (spec.dtype,))
    return f"{dtype} {list(shape)}; the {src} {suffix} of {weight!r} is stored {wants} ({q.describe()})"


def _source_modules(layout: Layout, entries: dict, root: str) -> set[str]:
    """The stored tensors (weight and scale) of a quantized source's modules outside the routed
    experts (an FP8 source's attention, shared experts, dense MLPs, draft layers), each pair
    checked: the weight in the format's dtype with its scale beside it, the scale grid of the
    weight's shape in a dtype the format reads. CheckpointError naming the file and tensor."""
    q = layout.source
    if q is None or q.experts_only:
        return set()
    out = set()
    for name, (shard, dtype, shape) in entries.items():
        own = layout.owner(name)
        weight = own[0] if own is not None else name
        rec = layout.part_of(weight)
        if rec is None or rec.part == "expert" or (own is None and DTYPES[dtype].itemsize != 1):
            continue  # a float or an index table (DeepSeek-V4's tid2eid): passes through
        stored, src = layout.stored(weight), layout.source_format(weight)  # an MTP block's experts: theirs
        fmt = get_format(src, source=True)
        missing = [n for n in stored.values() if n not in entries]
        if missing:
            raise CheckpointError(f"tensor {name!r}: its {src} {'scale' if own is None else 'weight'} "
                                  f"{missing[0]!r} is missing ({q.describe()})", path=f"{root}/{shard}", tensor=name)
        wshape = fmt.weight_shape({k: entries[n][2] for k, n in stored.items()})
        for suffix, o in fmt.out_specs(wshape).items():
            t = stored[suffix]
            tdtype, tshape = DTYPES[entries[t][1]], entries[t][2]
            wants = fmt.stored_dtypes.get(suffix, (o.dtype,))
            if tdtype not in wants or tshape != tuple(o.shape):
                raise CheckpointError(f"tensor {t!r}: {entries[t][1]} {list(tshape)}; the {src} weight "
                                      f"{stored['weight']!r} of shape {list(wshape)} needs "
                                      f"{'/'.join(DTYPE_NAMES[d] for d in wants)} {list(o.shape)} there",
                                      path=f"{root}/{entries[t][0]}", tensor=t)
        out.update(stored.values())
    return out


def _check_unlisted(cfg: MoEConfig, rec: TensorName, path: str) -> None:
    """A tensor of a family without a strict spec passes through, unless it is a routed expert's
    the config does not require (a quantized source's scales, an expert past the count)."""
    if rec.part != "expert":
        return
    if rec.suffix in SCALE_SUFFIXES:
        raise CheckpointError(f"tensor {rec.name!r}: the source is already quantized; convert takes BF16/FP16/FP32 "
                              f"checkpoints of this family{_quant_hint(cfg)}", path=path, tensor=rec.name)
    if rec.suffix != "weight":
        raise CheckpointError(f"tensor {rec.name!r}: a routed expert's {rec.suffix}: convert takes routed experts "
                              f"with weights only (as the family's transformers model holds them)"
                              f"{_quant_hint(cfg)}", path=path, tensor=rec.name)
    if rec.expert is None:  # a stacked experts tensor where the config's layout stores them otherwise
        raise CheckpointError(f"tensor {rec.name!r}: routed experts stored as this config does not describe"
                              f"{_quant_hint(cfg)}", path=path, tensor=rec.name)
    raise CheckpointError(f"tensor {rec.name!r}: expert {rec.expert}, config.json has {cfg.num_experts}", path=path,
                          tensor=rec.name)


def _quant_hint(cfg: MoEConfig) -> str:
    """What config.json says of a quantized source convert did not recognise (model/sources.py
    reads quant_method 'fp8' with [128, 128] blocks and 'mxfp4', exactly as their writers spell them)."""
    q = cfg.raw.get("quantization_config") if isinstance(cfg.raw, dict) else None
    if not isinstance(q, dict):
        return "; config.json has no quantization_config that says how"
    method = q.get("quant_method")
    if method in ("fp8", "mxfp4"):
        return f"; config.json's quantization_config (quant_method {method!r}) says its weights are stored quantized"
    return (f"; config.json's quantization_config.quant_method is {short_repr(method)}, not one "
            f"convert reads ('fp8' with [128, 128] blocks, 'mxfp4')")


def _more(names: list[str]) -> str:
    return ", ".join(repr(n) for n in names[:5]) + (f" (and {len(names) - 5} more)" if len(names) > 5 else "")


def _unexpected(layout: Layout, names: list[str], missing: list[str]) -> str:
    naming = layout.naming.description
    return (f"{len(names)} tensor(s) not a tensor of the Inkling 2 layout with this config, in {naming}: "
            f"{_more(names)}" + (f"; the layout's tensors missing from the checkpoint: {_more(missing)}" if missing
                                 else "") + " (docs/layout.md)")


def _missing(cfg: Inkling2Config | MoEConfig, layout: Layout, missing: list[str]) -> str:
    more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
    rec = layout.part_of(missing[0])
    if rec is None or rec.part != "expert":
        return f"tensor {missing[0]!r}{more} required by config.json is missing"
    what = f"layer {rec.layer}" + (f" expert {rec.expert}" if rec.expert is not None else "")
    return (f"{what}: the routed expert's {rec.projection} weight is missing: {missing[0]!r}{more} (config.json: "
            f"{MoEConfig.of(cfg).num_experts} experts)")


# --------------------------------------------------------------------------- units and shards
