"""ModelOpt's FP8-release form (`--output-format modelopt-hf` for a family whose record says
`moe_quant_algo`: DeepSeek-V4), as NVIDIA Model-Optimizer examples/deepseek/deepseek_v4/
quantize_to_nvfp4.py writes it: the source's names and FP8 Linears kept as stored (UE8M0 scales
included), each routed-expert projection NVFP4 (`weight`, `weight_scale`, `weight_scale_2`,
`input_scale`, the source's `scale` dropped), config.json's FP8 `quantization_config` kept with
`moe_quant_algo` added, hf_quant_config.json listing every expert projection. The rest of the
form (per-expert modules, the writers) is export/modelopt.py's."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import UsageError
from ..io.checkpoint import CONFIG_NAME, HF_QUANT_CONFIG
from ..model.layout import Layout
from .form import Outputs, Spec, Writing


@dataclass(frozen=True)
class AsStored(Writing):
    """A quantized source's module written as the source stores it, every tensor under its own
    name (DeepSeek-V4's FP8 weights and UE8M0 `scale`s: ModelOpt's DeepSeek-V4 export copies them,
    its config keeping the source's FP8 quantization_config)."""

    def specs(self, u) -> list[Spec]:
        return [(s.name, s.dtype, s.shape) for s in u.sources]

    def write_kept(self, u, stored, path) -> Outputs:
        return [(s.name, stored[k], True) for s, k in zip(u.sources, u.stored_suffixes)]


def check_units(layout: Layout, units: list) -> None:
    """The form is read by one rule for every routed expert, the MTP block's included: vLLM's
    DeepseekV4FP8Config (vllm/models/deepseek_v4/quant_config.py `get_quant_method`) builds NVFP4
    experts where `moe_quant_algo` is "NVFP4" and `expert_dtype` "fp4", MXFP4 ones otherwise, and
    reads every other Linear as FP8. So its experts must all be NVFP4 with an activation scale
    (W4A4), as Model-Optimizer's script writes them, and its FP8 Linears stay FP8 (no
    --dequantize-fp8): UsageError naming a tensor otherwise, before anything is written."""
    bf16 = next((u for u in units if u.storage is None and u.source_format and u.format == "passthrough"), None)
    if bf16 is not None:
        raise UsageError(f"--dequantize-fp8: ModelOpt's {layout.family.name} form keeps its FP8 Linears as the "
                         f"source stores them (config.json's FP8 quantization_config covers every Linear, "
                         f"{bf16.sources[0].name!r} among them)", tensor=bf16.sources[0].name)
    odd = next((u for u in units if u.storage is not None and (u.format != "nvfp4" or not u.activation_scale)), None)
    if odd is not None:
        what = "NVFP4 weight-only (W4A16)" if odd.format == "nvfp4" else odd.format.upper()
        raise UsageError(f"{odd.sources[0].name!r} would be {what}: ModelOpt's {layout.family.name} form holds "
                         f"NVFP4 (W4A4) routed experts only, the one expert format its loader reads "
                         f"(quantization_config.moe_quant_algo 'NVFP4'; vLLM's DeepseekV4FP8Config reads any "
                         f"other as MXFP4): use --scheme nvfp4 without --weight-only", tensor=odd.sources[0].name)


# ModelOpt's DeepSeek-V4 export (NVIDIA Model-Optimizer examples/deepseek/deepseek_v4/
# quantize_to_nvfp4.py `_write_index_and_manifest`): the modules it leaves as the source has them
FP8_RELEASE_EXCLUDES = {"deepseek_v4": [
    "*.attn.*", "*.attn_norm.*", "*.ffn.shared_experts.*", "*.ffn.gate.*", "*.ffn_norm.*", "embed.weight",
    "head.weight", "*.hc_*", "*.h_proj.*", "*.e_proj.*", "*.enorm.*", "*.hnorm.*", "mtp.*.norm.*", "norm.weight"]}


def configs(cfg, q: dict, converter: dict, encoder: str, producer: dict) -> dict[str, dict]:
    """The config files of a family ModelOpt writes as its FP8 release with quantized experts
    (`Family.moe_quant_algo`; Model-Optimizer examples/deepseek/deepseek_v4/quantize_to_nvfp4.py):
    config.json keeps the source's FP8 `quantization_config` (and the top-level `expert_dtype`,
    which vLLM reads beside it) and adds `moe_quant_algo`, the experts' one quant_algo
    (`check_units`: NVFP4), "which vLLM and SGLang detect the hybrid expert format from", that
    script says; hf_quant_config.json (MIXED_PRECISION `q`, `producer` ModelOpt's) lists every
    expert projection (`quantized_layers`) beside the family's exclusions, with the NVFP4 group
    size."""
    (algo,) = {e["quant_algo"] for e in q["quantized_layers"].values()}
    source_q = cfg.raw.get("quantization_config") if isinstance(cfg.raw.get("quantization_config"), dict) else {}
    qc = {"activation_scheme": "dynamic", "weight_block_size": [128, 128], **source_q, "quant_method": "fp8",
          "moe_quant_algo": algo}
    quantization = {"quant_algo": q["quant_algo"], "kv_cache_quant_algo": None,  # MIXED_PRECISION
                    "group_size": next(iter(q["quantized_layers"].values()))["group_size"],
                    "quantized_layers": q["quantized_layers"],
                    "exclude_modules": FP8_RELEASE_EXCLUDES.get(cfg.family.name, [])}
    hq = {"producer": producer, "quantization": quantization}
    if converter.get("encoder", encoder) != encoder:
        hq["converter"] = converter
    return {HF_QUANT_CONFIG: hq, CONFIG_NAME: {**cfg.raw, "quantization_config": qc}}
