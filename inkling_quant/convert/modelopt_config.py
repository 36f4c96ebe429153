"""The ModelOpt MIXED_PRECISION description of a converted checkpoint: `quantization_config` in
config.json and hf_quant_config.json (docs/formats.md). Kept apart from the converter so that it
can move to the shared export module that verify, inspect and lora will read it back with."""
from __future__ import annotations

from pathlib import Path

from ..formats import FORMATS
from ..io.checkpoint import write_json_atomic
from ..layout import ModelConfig, natural_key

MODELOPT_FORMAT_VERSION = "0.47.0"  # the ModelOpt export whose layout we write (docs/formats.md)
HF_QUANT_CONFIG = "hf_quant_config.json"
EXCLUDE_MODULES = ["lm_head", "model.embed_tokens", "model.layers.*.self_attn*", "model.layers.*.mlp.gate",
                   "model.layers.*.mlp.input_conv", "model.visual*", "dspark*"]


def quant_config(cfg: ModelConfig, jobs, weight_only: bool) -> dict:
    """ModelOpt MIXED_PRECISION config: every quantized expert projection listed, the rest excluded.
    `jobs`: the planned shards (inkling_quant.convert.plan.ShardJob)."""
    layers: dict[str, dict] = {}
    for j in jobs:
        for u in j.units:
            entry = FORMATS[u.format].layer_config(weight_only)
            if entry is not None:
                for s in u.sources:
                    layers[s.name[: -len(".weight")]] = entry
    return {
        "quant_algo": "MIXED_PRECISION",
        "kv_cache_quant_algo": None,
        "exclude_modules": list(EXCLUDE_MODULES),
        "quantized_layers": dict(sorted(layers.items(), key=lambda kv: natural_key(kv[0]))),
    }


def write_quant_configs(out: Path, cfg: ModelConfig, jobs, weight_only: bool, converter: dict) -> list[str]:
    """Write hf_quant_config.json (with a `converter` entry naming who wrote it), then config.json
    with `quantization_config`; return the names written."""
    config = dict(cfg.raw)
    qc = quant_config(cfg, jobs, weight_only)
    config["quantization_config"] = {"quant_method": "modelopt", **qc}
    write_json_atomic(out / HF_QUANT_CONFIG, {
        "producer": {"name": "modelopt", "version": MODELOPT_FORMAT_VERSION},
        "quantization": qc,
        "converter": converter})
    write_json_atomic(out / "config.json", config)
    return ["config.json", HF_QUANT_CONFIG]
