"""ModelOpt's FP8-release form (`--output-format modelopt-hf` for a family whose record says
`moe_quant_algo`: DeepSeek-V4), as NVIDIA Model-Optimizer examples/deepseek/deepseek_v4/
quantize_to_nvfp4.py writes it (main at a2fbac7, 2026-08-21, with `--cast_mxfp4_to_nvfp4`): the
source's names; its FP8 Linears and its MTP block (MXFP4 experts included) kept as stored,
UE8M0 scales and all; each decoder layer's routed-expert projections NVFP4 (`weight`,
`weight_scale`, `weight_scale_2`, `input_scale`, the source's `scale` dropped); config.json's
FP8 `quantization_config` kept with `moe_quant_algo` and the experts' manifest added,
hf_quant_config.json holding that manifest. The rest of the form (per-expert modules, the
writers) is export/modelopt.py's. Earlier revisions of that script differ (0fd7b4c, 2026-05-28:
each expert projection listed, the MTP block's experts converted too)."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import UsageError
from ..io.checkpoint import CONFIG_NAME, HF_QUANT_CONFIG
from ..model.layout import Layout
from ..model.sources import MXFP4_ROWS
from .form import Outputs, Spec, Writing


@dataclass(frozen=True)
class AsStored(Writing):
    """A quantized source's module written as the source stores it, every tensor under its own
    name (DeepSeek-V4's FP8 weights and UE8M0 `scale`s, its MTP block's MXFP4 experts: ModelOpt's
    DeepSeek-V4 export copies them, its config keeping the source's FP8 quantization_config)."""

    def specs(self, u) -> list[Spec]:
        return [(s.name, s.dtype, s.shape) for s in u.sources]

    def write_kept(self, u, stored, path) -> Outputs:
        return [(s.name, stored[k], True) for s, k in zip(u.sources, u.stored_suffixes)]


def check_units(layout: Layout, units: list) -> None:
    """The form is read by one rule for every routed expert: vLLM's
    DeepseekV4FP8Config (vllm/models/deepseek_v4/quant_config.py `get_quant_method`) builds NVFP4
    experts where `moe_quant_algo` is "NVFP4" and `expert_dtype` "fp4", MXFP4 ones otherwise, and
    reads every other Linear as FP8, with UE8M0 scales (`is_scale_e8m0`), both only where
    `expert_dtype` is "fp4". So the source must be that release (MXFP4 experts beside FP8
    Linears), its experts all NVFP4 with an activation scale (W4A4), as Model-Optimizer's script
    writes them, and its FP8 Linears stay FP8 (no --dequantize-fp8): UsageError, naming a tensor
    where one is at fault, before anything is written."""
    if not any(u.storage is not None and u.format != "passthrough" for u in units):
        return  # nothing converted (--scheme none): the source copied as it is
    q = layout.source
    if q is None or q.expert_format != MXFP4_ROWS:
        stored = "float" if q is None else q.expert_format
        raise UsageError(f"ModelOpt's {layout.family.name} form is written from the release that stores its routed "
                         f"experts MXFP4 (expert_dtype 'fp4'): vLLM's DeepseekV4FP8Config reads moe_quant_algo, and "
                         f"the Linears' scales as UE8M0, only with expert_dtype 'fp4'; this source stores its "
                         f"routed experts {stored}, so no form here writes what that loader reads of it")
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


def config_problems(config: dict) -> list[str]:
    """What the form's loader would misread in a checkpoint's config.json (the read side of
    `configs`): vLLM 0.33's DeepseekV4FP8Config (vllm/models/deepseek_v4/quant_config.py) builds
    NVFP4 experts and UE8M0 Linear scales only where `expert_dtype` is "fp4" (transformers 5.25
    reads a missing one as "fp8"), and reads the Linears as 128x128-block e4m3 FP8 with dynamic
    activations (its Fp8Config; transformers' FineGrainedFP8Config with `scale_fmt` "ue8m0" for
    the power-of-two scales the form keeps as stored). Each problem names its key."""
    q = config.get("quantization_config") if isinstance(config.get("quantization_config"), dict) else {}
    problems = []
    experts = q.get("expert_dtype", config.get("expert_dtype"))
    if experts != "fp4":
        problems.append(f"expert_dtype is {experts!r}: this form's loader reads NVFP4 experts (moe_quant_algo) and "
                        f"UE8M0 Linear scales only with expert_dtype 'fp4' (transformers reads a missing one as 'fp8')")
    wanted = {"weight_block_size": [128, 128], "fmt": "e4m3", "activation_scheme": "dynamic", "scale_fmt": "ue8m0"}
    optional = {"fmt", "activation_scheme"}  # absent: the readers' defaults, which are these
    for key, want in wanted.items():
        if q.get(key, want if key in optional else None) != want:
            problems.append(f"quantization_config.{key} is {q.get(key)!r}, expected {want!r}: the FP8 Linears the "
                            f"form keeps as stored are 128x128-block e4m3 with UE8M0 scales and dynamic activations")
    return problems


# The modules ModelOpt's DeepSeek-V4 export leaves as the source has them (quantize_to_nvfp4.py
# `_build_moe_quantization`): attention and shared experts FP8, the head BF16, the MTP block in
# the source format
FP8_RELEASE_EXCLUDES = {"deepseek_v4": ["*.attn.*", "*.ffn.shared_experts.*", "head", "mtp.*"]}
PRODUCER = {"name": "modelopt", "version": "dsv4-nvfp4-experts"}   # that script's own


def configs(cfg, q: dict, converter: dict, encoder: str, nvfp4_group: dict) -> dict[str, dict]:
    """The config files of a family ModelOpt writes as its FP8 release with NVFP4 experts
    (`Family.moe_quant_algo`), as Model-Optimizer examples/deepseek/deepseek_v4/
    quantize_to_nvfp4.py (main at a2fbac7) writes them: hf_quant_config.json's `quantization`
    MIXED_PRECISION, group_size 16, each layer's experts module in `quantized_layers` (`q`'s),
    the family's exclusions; config.json's `quantization_config` the source's FP8 one (and the
    top-level `expert_dtype`, which vLLM reads beside it) with `quant_method` "fp8",
    `moe_quant_algo` "NVFP4" ("which vLLM and SGLang detect the hybrid expert format from"),
    and that manifest again "for loaders that prefer config.json", its exclusions as `ignore`
    and `config_groups` one NVFP4 group over Linear (`nvfp4_group`)."""
    (algo,) = {e["quant_algo"] for e in q["quantized_layers"].values()}   # NVFP4: check_units
    excludes = FP8_RELEASE_EXCLUDES.get(cfg.family.name, [])
    quantization = {"quant_algo": q["quant_algo"], "kv_cache_quant_algo": None, "group_size": 16,
                    "quantized_layers": q["quantized_layers"], "exclude_modules": excludes}
    hq = {"producer": dict(PRODUCER), "quantization": quantization}
    if converter.get("encoder", encoder) != encoder:
        hq["converter"] = converter
    source_q = cfg.raw.get("quantization_config") if isinstance(cfg.raw.get("quantization_config"), dict) else {}
    qc = {"activation_scheme": "dynamic", "weight_block_size": [128, 128], **source_q, "quant_method": "fp8",
          "moe_quant_algo": algo, "producer": dict(PRODUCER), "quant_algo": q["quant_algo"],
          "kv_cache_quant_algo": None, "group_size": 16, "config_groups": {"group_0": nvfp4_group},
          "quantized_layers": q["quantized_layers"], "ignore": excludes}
    qc.pop("exclude_modules", None)
    return {HF_QUANT_CONFIG: hq, CONFIG_NAME: {**cfg.raw, "quantization_config": qc}}
