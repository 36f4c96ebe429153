"""The ModelOpt output form (`--output-format modelopt-hf`): exactly what NVIDIA ModelOpt 0.47's
`export_hf_checkpoint` writes, and its MIXED_PRECISION config contract, the only place its keys
and file name are spelled: what `convert` writes (config.json's `quantization_config` and
`hf_quant_config.json`), how a reader finds it again, which module has which format, and vLLM's
exclusion rule.

Tensors: per-expert modules `<experts module>.<e>.<gate_proj|up_proj|down_proj>.<suffix>` (a
per-expert source's under its own projection names; a stacked source's unstacked, as ModelOpt
does for Qwen3-VL-MoE), pass-through tensors under the source's names (Inkling 2's original
names renamed to transformers', lm_head without the vocabulary padding).

vLLM's ModelOpt config classes resolve a layer's format from `quantized_layers[<module>]`
(`quant_algo`, `group_size`) and skip modules `exclude_modules` names (docs/formats.md)."""
from __future__ import annotations

import fnmatch
import json
import re
from collections import Counter
from pathlib import Path
from typing import Callable, Iterable, Mapping

from dataclasses import dataclass

import torch

from ..errors import ConfigError, FormatError, UsageError, short_repr
from ..formats import FORMATS, Format, format_for_quant_algo, get_format
from ..io.checkpoint import CONFIG_NAME, HF_QUANT_CONFIG, read_json, safe_child
from ..io.safetensors import DTYPE_NAMES, DTYPES
from ..model.inkling2 import MODELOPT_UNWRAPPED, Inkling2Config, modelopt_tensor, transformers_name
from ..model.layout import Layout, natural_key
from ..model.sources import converted_experts
from ..model.storage import ExpertStorage
from . import fp8_release, kimi_k3
from .form import Copy, ExpertWriter, OutputForm, Outputs, Spec, Writing, out_specs, row_suffixes

MIXED_PRECISION = "MIXED_PRECISION"
QUANT_METHOD = "modelopt"
PRODUCER_VERSION = "0.47.0"  # the ModelOpt export whose layout we write (docs/formats.md)
_NVFP4 = FORMATS["nvfp4"]
def quantization(module_formats: Iterable[tuple[str, Format]], weight_only: bool,
                 exclude: Iterable[str] = (), encoder: str = "modelopt", encoders: Mapping[str, str] = {}) -> dict:
    """The MIXED_PRECISION config: every quantized module listed with its format's entry (which
    names the encoder where it is not ModelOpt's). `encoders`: a module whose bits another encoder
    than the run's `encoder` wrote (a layer kept as the source stores it) -> that encoder, named
    in its entry, ModelOpt's too where the run's is another."""
    layers = {}
    for m, f in module_formats:
        enc = encoders.get(m, encoder)
        e = f.layer_config(weight_only, enc)
        if e is not None and enc != encoder and "encoder" not in e:
            e = {**e, "encoder": f.encoder_rule(enc)}
        if e is not None:
            layers[m] = e
    return {"quant_algo": MIXED_PRECISION, "kv_cache_quant_algo": None, "exclude_modules": list(exclude),
            "quantized_layers": dict(sorted(layers.items(), key=lambda kv: natural_key(kv[0])))}


def one_format(q: dict, exclude: list[str]) -> dict:
    """A MIXED_PRECISION `q` whose quantized modules all share one entry, in the form ModelOpt 0.47
    writes for a single format (export/quant_utils.py:780-790: the entry's keys at the top, then
    the exclusions `exclude`, no quantized_layers); `q` itself otherwise."""
    entries = list(q["quantized_layers"].values())
    if not entries or any(e != entries[0] for e in entries):
        return q
    return {"quant_algo": None, "kv_cache_quant_algo": q["kv_cache_quant_algo"], **entries[0],  # ModelOpt's key order
            "exclude_modules": exclude}


def summarize_exclusions(unquantized: Iterable[str], quantized: Iterable[str]) -> list[str]:
    """ModelOpt 0.47's `exclude_modules` of a one-format export: the modules it left unquantized,
    each as the shortest prefix wildcard cut at a dot (`model.layers.0*`, or `prefix.*` where
    `prefix*` would also match a longer sibling) that matches no quantized module, the module's
    own name where none does; sorted. export/quant_utils.py:609-681
    `_prefix_wildcard_summarize_exclude_modules`, evaluated in its order."""
    negative = set()
    for layer in quantized:
        negative.add(layer)
        negative.update(layer[:i] + "*" for i in range(len(layer) + 1))
    summary: set[str] = set()
    for layer in unquantized:
        found: list[str] = []
        options = [w for i, ch in enumerate(layer) if ch == "."
                   for w in ([layer[:i] + "*"], [layer[:i], layer[:i] + ".*"])]
        for wildcards in options + [[layer]]:
            if any(w in negative for w in wildcards):
                continue
            found = [] if all(w in summary for w in wildcards) else wildcards
            break
        if len(found) == 2 and found[1] == found[0] + ".*":
            summary.add(found[1])  # a pair [prefix, prefix.*]: ModelOpt writes prefix.* alone
        else:
            summary.update(found)
    return sorted(summary)


def recipe_quant_cfg(layers: dict[str, dict]) -> dict[str, dict]:
    """ModelOpt's recipe for the quantized modules (module -> quantized_layers entry) as a
    `quant_cfg` of its dict form: wildcard -> quantizer attributes (`Format.modelopt_quantizers`),
    a later wildcard overriding an earlier one for the quantizers it matches, as ModelOpt applies
    them. The most common entry's quantizers stand under `*weight_quantizer` / `*input_quantizer`
    (what SGLang 0.5.23's Inkling parser reads: srt/models/inkling_common/quantization/config.py
    `is_nvfp4`), each module of another entry's under `<module>.*`. Which modules are left
    unquantized is `exclude_modules`' to say, as in that parser."""
    quantizers = {m: format_for_quant_algo(e["quant_algo"], source=True).modelopt_quantizers(e["quant_algo"])
                  for m, e in layers.items()}
    keys = {m: repr(sorted(v.items())) for m, v in quantizers.items()}
    counts = Counter(keys.values())
    common = max(counts, key=counts.get)  # ties: the first module's
    first = next(v for m, v in quantizers.items() if keys[m] == common)
    cfg = {"*weight_quantizer": first["weight"], "*input_quantizer": first["input"]}
    for m, v in quantizers.items():
        if keys[m] != common:
            cfg.update({f"{m}.*weight_quantizer": v["weight"], f"{m}.*input_quantizer": v["input"]})
    return cfg


def quantizer_of(quant_cfg: dict, module: str, kind: str):
    """The attributes `quant_cfg` (recipe_quant_cfg's form) gives `module`'s `kind` ("weight",
    "input") quantizer: its last wildcard matching `<module>.<kind>_quantizer`; None if none."""
    name, got = f"{module}.{kind}_quantizer", None
    for pattern, attrs in quant_cfg.items():
        if fnmatch.fnmatchcase(name, pattern):
            got = attrs
    return got


def modelopt_quantization_config(q: dict) -> dict:
    """config.json's `quantization_config` exactly as ModelOpt's exporter writes it for `q`
    (hf_quant_config.json's `quantization`): MIXED_PRECISION layers grouped by their entry into
    compressed-tensors `config_groups`, `ignore` from exclude_modules (ModelOpt 0.47
    export/convert_hf_config.py:236-282); a one-format `q` as `_modelopt_one_format_config`."""
    if "quantized_layers" not in q:
        return _modelopt_one_format_config(q)
    by_entry: dict[tuple, list[str]] = {}
    for layer, entry in q["quantized_layers"].items():
        by_entry.setdefault(tuple(sorted(entry.items())), []).append(layer)
    groups = {}
    for i, (key, layers) in enumerate(by_entry.items()):
        entry = dict(key)
        algo = entry["quant_algo"]
        bits = format_for_quant_algo(algo, source=True).config_group_bits(algo)  # ModelOpt 0.47 convert_hf_config.py:23-118
        if bits is None:  # an algo ModelOpt has no bits for (fp8_pb_wo): its `else` branch, the algo alone
            groups[f"group_{i}"] = {"quant_algo": algo, "targets": sorted(layers)}
            continue
        wbits, abits = bits
        gs = entry.get("group_size")
        group = {"input_activations": {"dynamic": False, "num_bits": abits, "type": "float", "group_size": gs}} \
            if abits is not None else {}
        group["weights"] = {"dynamic": False, "num_bits": wbits, "type": "float", "group_size": gs}
        groups[f"group_{i}"] = {**group, "targets": sorted(layers)}
    return {"config_groups": groups, "quantized_layers": q["quantized_layers"], "ignore": q.get("exclude_modules") or [],
            "quant_algo": q["quant_algo"], "producer": {"name": QUANT_METHOD, "version": PRODUCER_VERSION},
            "quant_method": QUANT_METHOD}


#: the one-format quant_algos ModelOpt 0.47's config.json gives a config_groups entry targeting
#: every Linear (export/convert_hf_config.py:185-215; MXFP8 has none there)
_ONE_FORMAT_GROUPS = ("NVFP4", "W4A16_NVFP4")


def _nvfp4_config_group(algo: str, gs: int = 16) -> dict:
    """ModelOpt's config_groups entry of an NVFP4 / W4A16_NVFP4 format over every Linear
    (export/convert_hf_config.py:185-215)."""
    wbits, abits = format_for_quant_algo(algo).config_group_bits(algo)
    group = {"input_activations": {"dynamic": False, "num_bits": abits, "type": "float", "group_size": gs}} \
        if abits is not None else {}
    return {**group, "weights": {"dynamic": False, "num_bits": wbits, "type": "float", "group_size": gs},
            "targets": ["Linear"]}


def _modelopt_one_format_config(q: dict) -> dict:
    """config.json's quantization_config as ModelOpt's exporter derives it from a one-format `q`
    (export/convert_hf_config.py:185-285): a config_groups entry for NVFP4 / W4A16_NVFP4 alone,
    the exclusions as `ignore`, no group_size of its own."""
    algo, out = q["quant_algo"], {}
    if algo in _ONE_FORMAT_GROUPS:
        out["config_groups"] = {"group_0": _nvfp4_config_group(algo, q.get("group_size", 16))}
    return {**out, "ignore": q.get("exclude_modules") or [], "quant_algo": algo,
            "producer": {"name": QUANT_METHOD, "version": PRODUCER_VERSION}, "quant_method": QUANT_METHOD}


def modelopt_hf_quant_config(q: dict) -> dict:
    """hf_quant_config.json as ModelOpt's exporter writes it: MIXED_PRECISION with no exclusions
    (a module not in quantized_layers is unquantized), or `one_format`'s form as it is."""
    quantization = {k: q[k] for k in ("quant_algo", "kv_cache_quant_algo", "quantized_layers")} \
        if "quantized_layers" in q else q
    return {"producer": {"name": QUANT_METHOD, "version": PRODUCER_VERSION}, "quantization": quantization}


def read_quantization(root: Path, config: dict) -> dict | None:
    """The quantization a checkpoint declares: config.json's `quantization_config`, else
    `hf_quant_config.json`'s `quantization`; None when it declares none. Types are checked."""
    q = config.get("quantization_config")
    file, where = root / "config.json", "quantization_config"
    if converted_experts(config) is not None:  # ModelOpt's FP8-release form: its experts are listed there
        q = None
    if q is None:
        path = root / HF_QUANT_CONFIG
        if not path.is_file():
            return None
        q = read_json(safe_child(root, HF_QUANT_CONFIG), HF_QUANT_CONFIG).get("quantization")
        file, where = path, "quantization"
        if q is None:
            return None
    if not isinstance(q, dict):
        raise ConfigError(f"{where} must be an object, got {short_repr(q)}", path=file)
    inner = q.get("quantization")  # some writers nest hf_quant_config's form inside config.json
    algo = q.get("quant_algo") or (inner.get("quant_algo") if isinstance(inner, dict) else None) \
        or q.get("quant_method")
    if algo is not None and not isinstance(algo, str):
        raise ConfigError(f"{where}.quant_algo must be a string, got {short_repr(algo)}", path=file)
    for key in ("exclude_modules", "ignore"):
        v = q.get(key)
        if v is not None and not (isinstance(v, list) and all(isinstance(p, str) for p in v)):
            raise ConfigError(f"{where}.{key} must be a list of module names or patterns, got {short_repr(v)}",
                              path=file)
    layers = q.get("quantized_layers")
    if layers is not None and not (isinstance(layers, dict) and all(isinstance(e, dict) for e in layers.values())):
        raise ConfigError(f"{where}.quantized_layers must map module names to objects, got {short_repr(layers)}",
                          path=file)
    return {**q, "quant_algo": algo}


def exclusions_key(q: dict) -> str:
    """Where `q` lists the modules it leaves unquantized: `exclude_modules` (hf_quant_config.json's
    form), or `ignore` where that is the form (config.json's, as ModelOpt writes it:
    export/convert_hf_config.py:262-264); vLLM reads either (docs/ci.md)."""
    return "exclude_modules" if "exclude_modules" in q or "ignore" not in q else "ignore"


def format_of(q: dict | None, module: str) -> Format | None:
    """The format `q` declares for `module` (None: unquantized), as vLLM resolves it: an
    exclusion (exclusions_key) wins, then `quantized_layers[module]`, then a single-algorithm
    config's algo."""
    if not q:
        return None
    if exclusion_matcher(q.get(exclusions_key(q)) or [])(module) is not None:
        return None
    layers = q.get("quantized_layers")
    if isinstance(layers, dict) and isinstance(layers.get(module), dict):
        return format_for_quant_algo(layers[module].get("quant_algo"))
    return None if q.get("quant_algo") == MIXED_PRECISION else format_for_quant_algo(q.get("quant_algo"))


def quantization_problems(q: dict, want: dict[str, dict], key: str,
                          tensor_of: Callable[[str], str] = lambda m: f"{m}.weight",
                          unquantized: Mapping[str, str] | None = None) -> list[tuple[str | None, str]]:
    """(tensor or None, message) for every way the quantization config `q` (config.json's
    `quantization_config` or hf_quant_config.json's `quantization`, named `key` in messages)
    disagrees with `want` (module -> the `quantized_layers` entry its tensors imply), as vLLM's
    ModelOpt config classes would resolve it. `tensor_of(module)` is the tensor a problem names
    (`<module>.weight`; the published layout's stacked `<module>.w13_weight`). Two forms, as
    ModelOpt 0.47 writes them (export/quant_utils.py:780-790): MIXED_PRECISION, every quantized
    module in `quantized_layers`; or one format's quant_algo (NVFP4, W4A16_NVFP4, MXFP8) with
    `group_size` and exclusions, where every module not excluded is that format, so each of
    `unquantized` (module -> the tensor a problem names: the modules the tensors leave
    unquantized that an engine would quantize) must be excluded. vLLM
    reads the exclusions as `exclude_modules` (hf_quant_config.json) or `ignore` (config.json)."""
    out: list[tuple[str | None, str]] = []

    def fail(tensor: str | None, message: str) -> None:
        out.append((tensor, message))
    algo = q.get("quant_algo")
    single = algo != MIXED_PRECISION and format_for_quant_algo(algo) is not None
    if algo != MIXED_PRECISION and not single:
        fail(None, f"{key}.quant_algo is {algo!r}, expected '{MIXED_PRECISION}' or one format's "
               f"({', '.join(a for f in FORMATS.values() for a in f.quant_algos)})")
    if q.get("kv_cache_quant_algo") is not None:
        fail(None, f"{key}.kv_cache_quant_algo is {q['kv_cache_quant_algo']!r} but the checkpoint "
               f"has no KV-cache scales (expected null)")
    layers = q.get("quantized_layers")
    if single:
        for module, entry in want.items():
            if entry.get("quant_algo") != algo:
                fail(tensor_of(module), f"{key}.quant_algo is {algo!r} for every module not excluded, the "
                     f"tensors of {module!r} are {entry.get('quant_algo')!r}" + _activation_note(entry.get("quant_algo")))
    elif not isinstance(layers, dict) or not layers:
        fail(None, f"{key}.quantized_layers must be a non-empty object (vLLM refuses an empty one)")
        return out
    else:
        for module, entry in want.items():
            _check_layer(fail, key, module, tensor_of(module), entry, layers.get(module))
        for module in layers:
            if module not in want:
                fail(tensor_of(module), f"{key}.quantized_layers names {module!r}, which the tensors "
                       f"do not quantize")
    ekey = exclusions_key(q)
    excl = q.get(ekey, [])
    if not isinstance(excl, list) or not all(isinstance(p, str) for p in excl):
        fail(None, f"{key}.{ekey} must be a list of strings")
        return out
    excluded = exclusion_matcher(excl)
    hit: set[str] = set()
    for module in want:
        pat = excluded(module)
        if pat is not None and pat not in hit:  # one problem per pattern
            hit.add(pat)
            fail(tensor_of(module), f"{key}.{ekey} pattern {pat!r} excludes the "
                   f"quantized module {module!r} (vLLM would load it as BF16)")
    for module, tensor in (unquantized or {}).items() if single else ():
        if excluded(module) is None:
            fail(tensor, f"{key}.{ekey} does not exclude {module!r}, which the tensors leave "
                 f"unquantized (vLLM would load it as {algo})")
    if "group_size" in q:  # ModelOpt's top-level group_size is the NVFP4 block (single format: its block)
        fmt = format_for_quant_algo(algo) if single else _NVFP4
        gs = [e.get("group_size") for e in want.values() if format_for_quant_algo(e.get("quant_algo")) is fmt]
        if gs and q["group_size"] != gs[0]:
            fail(None, f"{key}.group_size is {q['group_size']}, the {fmt.name.upper()} tensors use {gs[0]}")
    if "modelopt_quant_config" in q:
        _check_recipe(fail, key, q["modelopt_quant_config"], want, tensor_of)
    return out


def _check_recipe(fail: Callable[[str | None, str], None], key: str, mq, want: dict[str, dict],
                  tensor_of: Callable[[str], str]) -> None:
    """`modelopt_quant_config.quant_cfg` (recipe_quant_cfg's form) against the tensors: each
    quantized module's weight and input quantizers as its format's are; one problem per kind of
    disagreement, naming its first module."""
    cfg = mq.get("quant_cfg") if isinstance(mq, dict) else None
    if not isinstance(cfg, dict) or not all(isinstance(v, dict) for v in cfg.values()):
        fail(None, f"{key}.modelopt_quant_config.quant_cfg must be an object of quantizer attributes")
        return
    wrong: dict[tuple, list[str]] = {}
    for module, entry in want.items():
        algo = entry.get("quant_algo")
        fmt = format_for_quant_algo(algo, source=True)
        expected = fmt.modelopt_quantizers(algo) if fmt is not None else None
        for kind in expected or ():
            got = quantizer_of(cfg, module, kind)
            if _quantizer(got) != _quantizer(expected[kind]):
                wrong.setdefault((kind, short_repr(got, 200), algo, short_repr(expected[kind], 200)), []).append(module)
    for (kind, got, algo, expected), modules in wrong.items():
        more = f" (and {len(modules) - 1} more modules)" if len(modules) > 1 else ""
        fail(tensor_of(modules[0]), f"{key}.modelopt_quant_config.quant_cfg gives {modules[0]!r}{more} the {kind} "
             f"quantizer {got}; the tensors are {algo}: {expected}")


def _quantizer(attrs) -> str | None:
    """What a quantizer's attributes in a recipe make it, as ModelOpt reads them: None when
    disabled or absent (no entry: ModelOpt's presets give W4A16_NVFP4 no `*input_quantizer`),
    else its num_bits and block_sizes (scale_bits and type among them; keys as JSON writes them;
    `enable` defaults to True; `effective_bits`, `axis` and the like do not change the format)."""
    if not isinstance(attrs, dict) or attrs.get("enable", True) is False:
        return None
    blocks = attrs.get("block_sizes")
    if isinstance(blocks, dict):  # "type" defaults to static in ModelOpt's block_sizes
        blocks = {str(k): v for k, v in blocks.items() if (k, v) != ("type", "static")}
    return json.dumps({"num_bits": attrs.get("num_bits"), "block_sizes": blocks}, sort_keys=True, default=str)


def _check_layer(fail: Callable[[str | None, str], None], key: str, module: str, tensor: str, entry: dict,
                 got) -> None:
    """One module's quantized_layers entry `got` against the entry its tensors imply."""
    if got is None:
        fail(tensor, f"{key}.quantized_layers lacks {module!r} "
               f"(the tensors are {entry['quant_algo']}: vLLM would load them as BF16)")
        return
    if not isinstance(got, dict):
        fail(tensor, f"{key}.quantized_layers[{module!r}] must be an object")
        return
    if got.get("quant_algo") != entry.get("quant_algo"):
        fail(tensor, f"{key}.quantized_layers[{module!r}].quant_algo is "
               f"{got.get('quant_algo')!r}, the tensors are {entry.get('quant_algo')!r}"
               + _activation_note(entry.get("quant_algo")))
        return
    gs = got.get("group_size")
    fmt = format_for_quant_algo(entry.get("quant_algo"))
    block = entry.get("group_size", fmt.block_size if fmt else None)
    if gs is not None and gs != block:
        fail(tensor, f"{key}.quantized_layers[{module!r}].group_size is {gs}, "
               f"the tensors use blocks of {block}")
    rule = got.get("encoder")
    if rule is not None and fmt is not None:  # the release form's entries name the encoder and its scales
        by_rule = {r: e for e, r in fmt.encoders.items()}
        if rule not in by_rule:
            fail(tensor, f"{key}.quantized_layers[{module!r}].encoder is {rule!r}; {fmt.name} is written by "
                 f"{', '.join(repr(r) for r in by_rule)}")
        elif got.get("scales") != fmt.encoder_scales.get(by_rule[rule]):
            fail(tensor, f"{key}.quantized_layers[{module!r}].scales is {got.get('scales')!r}; {rule} writes "
                 f"{fmt.encoder_scales.get(by_rule[rule])!r} scales")


def _activation_note(quant_algo) -> str:
    """Why a format's quant_algo is what it is: with or without a static activation scale."""
    fmt = format_for_quant_algo(quant_algo)
    if fmt is None or not fmt.static_activation_scale:
        return ""
    return " (input_scale present)" if quant_algo == fmt.quant_algo else " (no input_scale)"



def exclusion_matcher(patterns: list[str]) -> Callable[[str], str | None]:
    """vLLM's is_layer_excluded, applied to a projection and to its MoE layer prefix
    (`model.layers.L.mlp.experts`): fnmatch wildcards (a trailing `*` also as `prefix.*`),
    otherwise exact or (legacy) substring. Returns the first pattern that excludes a module."""
    compiled = []
    for pat in patterns:
        if any(ch in pat for ch in "*?["):
            pats = [pat] + ([pat[:-1].rstrip(".")] if pat.endswith("*") else [])
            rx = re.compile("|".join(f"(?:{fnmatch.translate(p)})" for p in pats))
            compiled.append((pat, lambda name, rx=rx: rx.match(name) is not None))
        elif pat:
            compiled.append((pat, lambda name, pat=pat: pat in name))

    def match(module: str) -> str | None:
        names = (module, module.rsplit(".", 2)[0]) if ".experts." in module else (module,)
        for pat, fn in compiled:
            if any(fn(n) for n in names):
                return pat
        return None
    return match


# ============================================================================ the output form
@dataclass(frozen=True)
class Modules(Writing):
    """A per-expert source's unit (an expert's gate and up, or one projection): each weight's
    format tensors under its own module (`Format.tensor_name`)."""

    def specs(self, u) -> list[Spec]:
        return [s for i, src in enumerate(u.weights)
                for s in out_specs(FORMATS[u.format], u.weight_name(i), u.weight_shape(i), _float(src.dtype),
                                   u.activation_scale)]

    def quantized_module(self, u, layout: Layout) -> str | None:
        return layout.experts_modules[layout.classify(u.sources[0].name).layer]


@dataclass(frozen=True)
class ExpertModules(Writing):
    """A stacked expert tensor ([E, 2I, H] gate/up or [E, H, I] down, as `storage` holds it)
    written as ModelOpt's per-expert modules `<module>.<e>.<name>.<suffix>`: each expert's slab
    quantized as stored, then its rows split into gate and up (`ExpertStorage.split_gate_up`)."""

    module: str               # ModelOpt's experts module (transformers' name for Inkling 2)
    projection: str           # "gate_up" or "down"
    storage: ExpertStorage    # the source's

    def _names(self) -> tuple[str, ...]:
        gate, up, down = self.storage.names
        return (gate, up) if self.projection == "gate_up" else (down,)

    def per_module(self, u) -> tuple[int, dict]:
        """(experts, suffix -> OutSpec of one expert's module) of unit `u`."""
        src, names, shape = u.sources[0], self._names(), u.weight_shape(0)
        E, rows, cols = (shape[0], shape[2], shape[1]) if self.storage.transposed else shape
        if rows % len(names):
            raise FormatError(f"{self.projection} of shape {list(shape)}: {rows} rows do not split into "
                              f"{'/'.join(names)}")
        return E, FORMATS[u.format].out_specs((rows // len(names), cols), DTYPES[_float(src.dtype)], u.activation_scale)

    def specs(self, u) -> list[Spec]:
        E, per = self.per_module(u)
        return [(f"{self.module}.{e}.{m}.{k}", DTYPE_NAMES[o.dtype], tuple(o.shape))
                for e in range(E) for m in self._names() for k, o in per.items()]

    def quantized_module(self, u, layout: Layout) -> str | None:
        return self.module

    def open(self, u, out_dir) -> "_ModulesWriter":
        return _ModulesWriter(self, u)


class _ModulesWriter(ExpertWriter):
    def __init__(self, w: ExpertModules, u):
        self.w, self.names = w, w._names()
        self.suffixes = list(w.per_module(u)[1])
        self.rows = set(row_suffixes(FORMATS[u.format]))

    def expert(self, e: int, q: dict[str, torch.Tensor], path) -> Outputs:
        """Expert e's modules: row tensors (weight, block scales) split into gate and up, each
        module's scalars shared (what ModelOpt exports)."""
        out: Outputs = []
        for i, m in enumerate(self.names):
            for k in self.suffixes:
                t = q[k]
                if k not in self.rows:
                    t = t.clone()
                elif len(self.names) > 1:
                    t = self.w.storage.split_gate_up(t, t.shape[0] // 2)[i].contiguous()
                out.append((f"{self.w.module}.{e}.{m}.{k}", t, True))
        return out


def _float(dtype: str) -> str:
    """A source weight's dtype as a pass-through of it would be (a quantized source's: BF16)."""
    return dtype if DTYPES[dtype] in FORMATS["passthrough"].source_dtypes else "BF16"


@dataclass(frozen=True)
class KeptModule(Writing):
    """A quantized source's module written in ModelOpt's entry for its format, its bytes kept (an
    FP8 block-scaled weight as FP8_PB_WO: `FP8Block.modelopt_tensors`)."""

    def _fmt(self, u):
        return get_format(u.source_format, source=True)

    def specs(self, u) -> list[Spec]:
        w = u.weights[0]
        return [(self._fmt(u).tensor_name(w.name, k), DTYPE_NAMES[o.dtype], tuple(o.shape))
                for k, o in self._fmt(u).modelopt_specs(w.shape).items()]

    def quantized_module(self, u, layout: Layout) -> str | None:
        return u.weights[0].name[: -len(".weight")]

    def write_kept(self, u, stored, path) -> Outputs:
        fmt, w = self._fmt(u), u.weights[0]
        return [(fmt.tensor_name(w.name, k), t, True) for k, t in fmt.modelopt_tensors(stored, w.name).items()]


@dataclass(frozen=True)
class Dequantized(Writing):
    """A quantized source's module written as a BF16 weight under its own name: the exact fp32
    dequantization rounded once (DeepSeek-V3 inference/fp8_cast_bf16.py's output; ModelOpt's
    examples/deepseek dequantizes so before quantizing)."""

    def specs(self, u) -> list[Spec]:
        w = u.weights[0]
        return [(w.name, "BF16", tuple(u.weight_shape(0)))]

    def write_kept(self, u, stored, path) -> Outputs:
        return [(u.weights[0].name, get_format(u.source_format, source=True).dequantize(stored, torch.bfloat16), True)]


class ModelOptForm(OutputForm):
    name = "modelopt-hf"

    def check_units(self, layout: Layout, units: list) -> None:
        if layout.family.moe_quant_algo:
            fp8_release.check_units(layout, units)

    def kept(self, layout: Layout, weight: str, source_format: str, dequantize: bool) -> Writing:
        if dequantize:
            return Dequantized()
        return fp8_release.AsStored() if layout.family.moe_quant_algo else KeptModule()

    def copy(self, cfg, layout: Layout, name: str) -> Copy:
        # Inkling 2 under its original names: transformers' names, lm_head cut to the unpadded rows
        return Copy(*modelopt_tensor(cfg, name)) if layout.original_names else Copy()

    def per_expert(self, layout: Layout) -> Writing:
        return Modules()

    def stacked(self, cfg, layout: Layout, name: str, projection: str, fmt: str) -> Writing:
        if fmt not in FORMATS:  # a source-only format the scheme leaves alone (MXFP4)
            raise UsageError(f"{name!r} is stored {fmt}, which ModelOpt's form has no entry for: the scheme must "
                             f"quantize every layer's routed experts (or none: --scheme none copies the source)",
                             tensor=name)
        if fmt == "passthrough":
            if layout.original_names:  # the interleaved w13 has no ModelOpt form unquantized
                raise UsageError(f"--output-format modelopt-hf writes quantized experts as ModelOpt exports them; the "
                                 f"scheme leaves {name!r} unquantized: use --output-format inkling", tensor=name)
            return Copy()  # transformers' stacked tensor, as it is
        module = (transformers_name(name) if layout.original_names else name).rsplit(".", 1)[0]
        return ExpertModules(module, projection, layout.experts)

    def config_files(self, cfg, layers: dict, weight_only: bool, converter: dict,
                     unquantized: list[str]) -> dict[str, dict]:
        """Exactly ModelOpt's two files, nothing of ours; where another encoder than ModelOpt's
        wrote the bits (--encoder release), hf_quant_config.json says so in a `converter` entry.
        One format: ModelOpt's one-format form, its exclusions summarized from `unquantized`. A
        family ModelOpt writes as its FP8 release: `fp8_release.configs`; Kimi-K3: `kimi_k3.configs`."""
        q = quantization(layers.items(), weight_only)
        if not q["quantized_layers"]:
            return {}
        family = getattr(cfg, "family", None)
        if family is not None and family.moe_quant_algo:
            return fp8_release.configs(cfg, q, converter, self.encoder, _nvfp4_config_group("NVFP4"))
        if family is not None and family.modelopt_aliases:
            return kimi_k3.configs(cfg, q, converter, self.encoder, modelopt_quantization_config)
        # the modules ModelOpt put a quantizer on and left off: lm_head's Linear even when tied to
        # the embedding (no lm_head.weight written; export/quant_utils.py:1635-1715)
        wrapped = [m for m in unquantized if not (isinstance(cfg, Inkling2Config) and m in MODELOPT_UNWRAPPED)]
        wrapped += [] if any(m.rsplit(".", 1)[-1] == "lm_head" for m in wrapped) else ["lm_head"]
        q = one_format(q, summarize_exclusions(wrapped, q["quantized_layers"]))
        hq = modelopt_hf_quant_config(q)
        if converter.get("encoder", self.encoder) != self.encoder or converter.get("layers") or \
                converter.get("calibration"):
            hq["converter"] = converter  # whose rules wrote the bits where ModelOpt's did not; the calibration
        return {HF_QUANT_CONFIG: hq,
                CONFIG_NAME: {**cfg.raw, "quantization_config": modelopt_quantization_config(hq["quantization"])}}

    def expert_specs(self, layout: Layout, weight: str, shape, dtype, fmt, activation_scale: bool) -> dict:
        if fmt is not FORMATS["passthrough"] and layout.experts.stacked:
            raise FormatError(f"transformers' stacked experts have no {fmt.name} form (quantized experts are "
                              f"per-expert modules, as ModelOpt writes them)")
        return fmt.out_tensors(weight, shape, dtype, activation_scale)


MODELOPT = ModelOptForm()
