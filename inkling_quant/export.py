"""The ModelOpt MIXED_PRECISION export contract, the only place its keys and file name are
spelled: what `convert` writes (config.json's `quantization_config` and `hf_quant_config.json`),
how a reader finds it again, which module has which format, and vLLM's exclusion rule.

vLLM's ModelOpt config classes resolve a layer's format from `quantized_layers[<module>]`
(`quant_algo`, `group_size`) and skip modules `exclude_modules` names (docs/formats.md)."""
from __future__ import annotations

import fnmatch
import re
from pathlib import Path
from typing import Callable, Iterable

from .errors import ConfigError, short_repr
from .formats import Format, format_for_quant_algo
from .io.checkpoint import HF_QUANT_CONFIG
from .layout import natural_key

MIXED_PRECISION = "MIXED_PRECISION"
QUANT_METHOD = "modelopt"
PRODUCER_VERSION = "0.47.0"  # the ModelOpt export whose layout we write (docs/formats.md)
#: what convert leaves unquantized, as ModelOpt names it: everything but the routed experts
EXCLUDE_MODULES = ["lm_head", "model.embed_tokens", "model.layers.*.self_attn*", "model.layers.*.mlp.gate",
                   "model.layers.*.mlp.input_conv", "model.visual*", "dspark*"]


def quantization(module_formats: Iterable[tuple[str, Format]], weight_only: bool) -> dict:
    """The MIXED_PRECISION config: every quantized module listed with its format's entry."""
    layers = {m: e for m, f in module_formats if (e := f.layer_config(weight_only)) is not None}
    return {"quant_algo": MIXED_PRECISION, "kv_cache_quant_algo": None, "exclude_modules": list(EXCLUDE_MODULES),
            "quantized_layers": dict(sorted(layers.items(), key=lambda kv: natural_key(kv[0])))}


def config_with_quantization(config: dict, q: dict) -> dict:
    """config.json with `quantization_config` as vLLM's ModelOpt loader reads it."""
    return {**config, "quantization_config": {"quant_method": QUANT_METHOD, **q}}


def hf_quant_config(q: dict, converter: dict) -> dict:
    """hf_quant_config.json: ModelOpt's producer record, the config, and who converted it."""
    return {"producer": {"name": QUANT_METHOD, "version": PRODUCER_VERSION}, "quantization": q,
            "converter": converter}


def read_quantization(root: Path, config: dict) -> dict | None:
    """The quantization a checkpoint declares: config.json's `quantization_config`, else
    `hf_quant_config.json`'s `quantization`; None when it declares none. Types are checked."""
    from .io.checkpoint import read_json, safe_child

    q = config.get("quantization_config")
    where = f"{root / 'config.json'}: quantization_config"
    if q is None:
        path = root / HF_QUANT_CONFIG
        if not path.is_file():
            return None
        q = read_json(safe_child(root, HF_QUANT_CONFIG), HF_QUANT_CONFIG).get("quantization")
        where = f"{path}: quantization"
        if q is None:
            return None
    if not isinstance(q, dict):
        raise ConfigError(f"{where} must be an object, got {short_repr(q)}")
    inner = q.get("quantization")  # some writers nest hf_quant_config's form inside config.json
    algo = q.get("quant_algo") or (inner.get("quant_algo") if isinstance(inner, dict) else None) \
        or q.get("quant_method")
    if algo is not None and not isinstance(algo, str):
        raise ConfigError(f"{where}.quant_algo must be a string, got {short_repr(algo)}")
    return {**q, "quant_algo": algo}


def format_of(q: dict | None, module: str) -> Format | None:
    """The format `q` declares for `module` (None: unquantized), as vLLM resolves it: an
    exclusion wins, then `quantized_layers[module]`, then a single-algorithm config's algo."""
    if not q:
        return None
    if exclusion_matcher(q.get("exclude_modules") or [])(module) is not None:
        return None
    layers = q.get("quantized_layers")
    if isinstance(layers, dict) and isinstance(layers.get(module), dict):
        return format_for_quant_algo(layers[module].get("quant_algo"))
    return None if q.get("quant_algo") == MIXED_PRECISION else format_for_quant_algo(q.get("quant_algo"))


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
