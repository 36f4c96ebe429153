"""--activation-scales: the calibrated activation amax per module, from a JSON or safetensors
file or taken verbatim from a quantized checkpoint (ModelOpt's export, ours), mapped
onto the source's activation modules (a per-expert source's expert modules, a stacked source's
stacked tensors)."""
from __future__ import annotations

from pathlib import Path

from ..errors import CheckpointError, printable
from ..formats import FORMATS
from ..io.checkpoint import Checkpoint, read_json
from ..io.safetensors import DTYPE_NAMES, ShardReader
from ..io.shards import ShardReaders
from ..model.layout import Layout, natural_key
from .planner import SrcTensor


def load_activation_amax(path: str | None) -> dict[str, float]:
    """module -> activation amax from a calibration file (JSON {module: amax} or safetensors
    {module + '.input_amax': one-element float tensor}) or a quantized checkpoint."""
    return _load(path)[0]


def _load(path: str | None, provenance: dict | None = None) -> tuple[dict[str, float], dict[str, int]]:
    """(module -> amax, stacked module -> how many experts its values stood for: a quantized
    checkpoint's stacked `.input_amax` [E]). A calibration file `inkling-quant calibrate` wrote
    puts its provenance into `provenance`."""
    if not path:
        return {}, {}
    p = Path(path)
    experts: dict[str, int] = {}
    if p.is_dir():
        out = _amax_from_checkpoint(p, experts)
    else:
        out = _amax_from_safetensors(p) if p.suffix == ".safetensors" else _amax_from_json(p, provenance)
    if not out:  # as a checkpoint without scales: every module would silently take the default
        raise CheckpointError("holds no activation amax (an empty calibration file)", path=path)
    for k, v in out.items():
        if not (v > 0 and v < float("inf")):
            raise CheckpointError(f"module {k[:200]!r}: activation amax must be finite and positive, got {v}",
                                  path=path)
    return out, experts


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


def _amax_from_checkpoint(root: Path, experts: dict[str, int]) -> dict[str, float]:
    """module -> amax from a quantized checkpoint's own activation scales, taken verbatim (the
    format's exact inverse, so the scale is written back bit for bit): ModelOpt's per-module
    `<module>.input_scale` and the Inkling form's `<stacked>.input_amax` [E] (the largest of its
    experts: vLLM takes the max; E recorded in `experts`). `load_calibration` maps the modules
    onto the source's."""
    scaled = next(f for f in FORMATS.values() if f.static_activation_scale)
    out: dict[str, float] = {}
    ckpt = Checkpoint.open(root)
    headers = ckpt.headers()
    with ShardReaders(root, headers) as readers:
        for shard, h in headers.items():
            for name, e in h.tensors.items():
                if name.endswith(".input_scale"):
                    module = name[: -len(".input_scale")]
                    values = [scaled.activation_amax(v) for v in _floats(readers.get(shard), name, e)]
                elif name.endswith(".input_amax"):
                    module, values = name[: -len(".input_amax")], _floats(readers.get(shard), name, e)
                    if len(e.shape) == 1:
                        experts[module] = e.shape[0]
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


def _amax_from_json(p: Path, provenance: dict | None = None) -> dict[str, float]:
    """A JSON {module: amax}, or calibrate's file (its `activation_amax`, provenance aside)."""
    from ..calibrate import FORMAT, read_calibration
    from ..io.safetensors import _short

    out: dict[str, float] = {}
    obj = read_json(p, "activation scales file")
    if isinstance(obj, dict) and obj.get("format") == FORMAT:
        obj, prov = read_calibration(obj, p)
        if provenance is not None:
            provenance.update(prov)
    if not isinstance(obj, dict):
        raise CheckpointError(f"an activation scales file is a JSON object {{module: amax}}, got {_short(obj)}", path=p)
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


def _own_key(k: str, modules, layout: Layout) -> tuple[str | None, int | None]:
    """(the source's activation module, the expert it names or None) for a calibration's module
    name `k`: the source's own (a stacked tensor, a per-expert module), ModelOpt's per-expert
    module (`<experts>.<e>.gate_proj`), transformers' stacked parameter of an Inkling 2 source under
    its original names (`model.language_model.layers.N.mlp.experts.gate_up_proj`), or one of those
    with ModelOpt's quantizer suffix (`..._input_quantizer`); (None, None) for none."""
    from ..model.inkling2 import original_name

    k = k.removesuffix("_input_quantizer").removesuffix(".input_quantizer")
    if k in modules:
        return k, None
    got = layout.stacked_tensor_of(k)
    if got is not None:
        return got
    if layout.original_names:
        try:
            own = original_name(k)
        except Exception:  # noqa: BLE001 - not a transformers name of this model
            own = None
        if own in modules:
            return own, None
    return None, None


def accepted_forms(modules, layout: Layout) -> str:
    """The module names a calibration may use for this source, with an example each."""
    first = sorted(modules, key=natural_key)[0] if modules else "?"
    forms = [f"the source's own ({first!r})"]
    if layout.experts_modules:
        i = min(layout.experts_modules)
        forms.append(f"ModelOpt's per-expert modules ('{_modelopt_module(layout, i)}.0.gate_proj')")
        if layout.original_names:
            forms.append(f"transformers' stacked parameters ('model.language_model.layers.{i}.mlp.experts.gate_up_proj'"
                         f", '.down_proj')")
    return "; ".join(forms) + ", each optionally with ModelOpt's '_input_quantizer' suffix"


def _modelopt_module(layout: Layout, i: int) -> str:
    from ..model.naming import MODELOPT

    return MODELOPT.experts_module(i) if layout.naming is not None else layout.experts_modules[i]


def load_calibration(path: str | None, tensors: list[SrcTensor], layout: Layout, src: str,
                     provenance: dict | None = None) -> dict[str, float]:
    """--activation-scales, keyed by the source's activation modules: a per-expert source's
    `<experts>.<e>.<proj>` modules, a stacked source's stacked tensors (vLLM reads one input
    scale per layer and projection there: the largest of the experts' calibrated values). Every
    module the file names must map onto one of the source's, but an MTP block's routed expert a
    layout keeps as stored (DeepSeek-V4's: Model-Optimizer's quantize_to_nvfp4.py
    `_load_merged_amax` skips those keys of its calibration dumps), which is skipped."""
    calibrated, counted = _load(path, provenance)
    # activation module -> the experts it holds (a stacked tensor: its E; a per-expert module: 1)
    modules = {key: (t.shape[0] if layout.experts.stacked else 1)
               for t in tensors if (key := layout.activation_key(layout.classify(t.name))) is not None}
    out: dict[str, float] = {}
    unknown = []
    for k, v in calibrated.items():
        key, expert = _own_key(k, modules, layout)
        if key is None and layout.expert_weight(k + ".weight"):
            continue  # an MTP block's expert, kept as stored (ModelOpt's DeepSeek-V4 export skips them too)
        if key not in modules:
            unknown.append(k)
            continue
        n = modules[key]
        if (expert is not None and expert >= n) or counted.get(k, n) != n:
            what = f"expert {expert}" if expert is not None else f"{counted[k]} experts"
            raise CheckpointError(f"module {printable(k[:200])!r} names {what}; {src} has {n} in {key!r}: calibration "
                                  f"for another model?", path=path)
        out[key] = max(out.get(key, 0.0), v)
    if unknown:
        unknown.sort()
        raise CheckpointError(f"{len(unknown)} of {len(calibrated)} module name(s) match "
                              f"no module of {src} (first: {printable(unknown[0][:200])!r}); calibration for "
                              f"another model or another naming? Accepted: {accepted_forms(modules, layout)}",
                              path=path)
    return out
