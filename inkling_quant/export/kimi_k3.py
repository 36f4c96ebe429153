"""ModelOpt's Kimi-K3 form (`--output-format modelopt-hf` for a family whose record says
`modelopt_aliases`: Kimi-K3), as NVIDIA Model-Optimizer's examples/kimi/kimi_k3/quantize_to_nvfp4.py
writes it with `--cast_mxfp4_to_nvfp4` (branch agent/kimi-k3-nvfp4-fp8-pb-recipe at 575c27ae1,
2026-08-21; the stored snapshot of main, a2fbac7, does not have it yet): each routed expert
projection NVFP4 under its own module (`weight`, `weight_scale`, `weight_scale_2`, `input_scale`;
the source's `weight_packed` gone), everything else as stored (BF16); hf_quant_config.json a
MIXED_PRECISION manifest keyed by every spelling of a module that SGLang's and vLLM's loaders probe
(`aliases`), with the script's exclusions; config.json's `quantization_config` that manifest in
ModelOpt's config.json form with quant_method "modelopt_mixed" (what the loaders' mixed-precision
path is gated on), placed at the top level, and text_config's own (the compressed-tensors MXFP4
one) removed. The tensors themselves are export/modelopt.py's per-expert modules.

Its published recipe also quantizes the attention projections to FP8 in 128x128 blocks
(`--attn_fp8_pb`, FP8_PB_WO); that part is not written here (docs/convert.md)."""
from __future__ import annotations

import copy
from typing import Callable

from ..io.checkpoint import CONFIG_NAME, HF_QUANT_CONFIG

# quantize_to_nvfp4.py `_EXCLUDE_MODULES`: the modules it leaves BF16. Its dense layer-0 MLP is
# written `language_model.model.layers.0.mlp.*`; here each dense layer of the config is
_EXCLUDES = ["*block_sparse_moe.gate*", "*block_sparse_moe.routed_expert_up_proj*",
             "*block_sparse_moe.routed_expert_down_proj*", "*block_sparse_moe.routed_expert_norm*",
             "*block_sparse_moe.shared_experts*", "*self_attn.q_conv1d*", "*self_attn.k_conv1d*",
             "*self_attn.v_conv1d*", "*self_attn.f_b_proj*", "*self_attn.o_norm*", "*self_attn.q_a_layernorm*",
             "*self_attn.kv_a_layernorm*", "*_res_proj*", "*_res_norm*", "*layernorm*"]
_EXCLUDES_AFTER_DENSE = ["language_model.lm_head", "vision_tower*", "mm_projector*"]
QUANT_METHOD = "modelopt_mixed"


def aliases(name: str) -> list[str]:
    """Every spelling of the module `name` a loader may look it up by (quantize_to_nvfp4.py
    `_module_name_aliases`): SGLang maps `block_sparse_moe` to `mlp` and keeps
    `language_model.`'s `model.` prefix; vLLM strips `language_model.model.`."""
    names = {name}
    if "block_sparse_moe" in name:
        names.add(name.replace("block_sparse_moe", "mlp"))
    for n in list(names):
        if n.startswith("language_model.model."):
            names |= {"model." + n[len("language_model.model."):], n[len("language_model.model."):]}
        elif n.startswith("language_model."):
            names.add(n[len("language_model."):])
    return sorted(names)


def configs(cfg, q: dict, converter: dict, encoder: str, config_json_form: Callable[[dict], dict]) -> dict[str, dict]:
    """The config files of the Kimi-K3 form (module doc) for the MIXED_PRECISION `q` convert made
    (each layer's experts module with its format's entry); `config_json_form` is ModelOpt's
    hf_quant_config -> config.json conversion (export/modelopt.py)."""
    layers = {alias: entry for bank, entry in sorted(q["quantized_layers"].items()) for alias in aliases(bank)}
    dense = [f"language_model.model.layers.{i}.mlp.*" for i in sorted(cfg.dense_layers or ())]
    excludes = list(dict.fromkeys(a for p in (*_EXCLUDES, *dense, *_EXCLUDES_AFTER_DENSE) for a in aliases(p)))
    quantization = {"quant_algo": q["quant_algo"], "kv_cache_quant_algo": None, "group_size": 16,
                    "quantized_layers": layers, "exclude_modules": excludes}
    qc = config_json_form(quantization)
    hq = {"producer": dict(qc["producer"]), "quantization": quantization}   # the script stamps modelopt's version
    if converter.get("encoder", encoder) != encoder:
        hq["converter"] = converter
    raw = copy.deepcopy(cfg.raw)
    if isinstance(raw.get("text_config"), dict):
        raw["text_config"].pop("quantization_config", None)
    raw["quantization_config"] = {**qc, "quant_method": QUANT_METHOD}
    return {HF_QUANT_CONFIG: hq, CONFIG_NAME: raw}
