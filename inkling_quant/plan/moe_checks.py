"""What vLLM 0.33.0 needs of a checkpoint's routed experts on a given GPU generation, at a given TP,
with or without expert parallelism: which expert datapaths the GPU has (native NVFP4 / MXFP8 on
Blackwell, weight-only Marlin on Hopper) and which per-rank shapes its MoE kernels reject, pad or
split (docs/budget.md, "Engine checks"). `plan.inkling2.plan` runs them for every plan, Inkling 2
and HF configs alike, and prints each as PASS / WARN / FAIL with its reason and source.

FAIL: vLLM 0.33.0 refuses to load or run the experts as requested (a TP split that cuts a
format's scale groups, a TP that does not divide the expert width): `plan` says DOES NOT LOAD and
exits 1. WARN: it loads, but not as the checkpoint was made to run (weight-only on Hopper), or
only because 0.33.0 pads a shape that a kernel or an older engine rejects. PASS: nothing to do.
Light: torch only through `formats`, imported where it checks."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ..units import cdiv

PASS, WARN, FAIL = "pass", "warn", "fail"
ENGINE = "vLLM 0.33.0"
_VL = "vllm 0.33.0 vllm/model_executor/layers/"   # the PyPI wheel's package directory
_MOE = _VL + "fused_moe/"


@dataclass(frozen=True)
class Arch:
    """A GPU generation as vLLM's MoE kernels ask for it: `family` is what
    `is_device_capability_family` compares (the major compute capability x 10)."""

    name: str          # "sm90"
    generation: str    # "Hopper"
    family: int        # 90, 100


#: compute capabilities: NVIDIA's CUDA GPU table (developer.nvidia.com/cuda-gpus): H100/H200 9.0,
#: B200/GB200 10.0, B300/GB300 10.3; vllm/platforms/interface.py is_device_capability_family
#: treats every 10.x as one family
ARCHS: dict[str, Arch] = {a.name: a for a in (
    Arch("sm90", "Hopper", 90), Arch("sm100", "Blackwell", 100), Arch("sm103", "Blackwell Ultra", 100))}


class ExpertDims(Protocol):
    """What the checks read of a text model: Inkling's TextConfig names, which `plan.hf.HFText`
    shares. A Protocol, so that this module imports neither plan."""

    @property
    def expert_hidden(self) -> int: ...
    @property
    def moe_intermediate_size(self) -> int: ...
    @property
    def n_routed_experts(self) -> int: ...


class MoEModel(Protocol):
    """`Inkling2Config` or `plan.hf.HFModel`: a config with a text model."""

    @property
    def text(self) -> ExpertDims: ...


@dataclass(frozen=True)
class Check:
    level: str          # PASS, WARN or FAIL (module doc)
    message: str
    rule: str = ""      # which rule: "datapath", "scale groups", "kernel tiles", "experts per rank", ...
    source: str = ""    # the package, version and file, or the issue / PR it follows

    def to_dict(self) -> dict:
        return {"level": self.level, "rule": self.rule, "message": self.message, "source": self.source}


# --------------------------------------------------------------------------- the rules
_DATAPATH = {  # (format, native?) -> (level, what vLLM 0.33.0 runs, source)
    ("nvfp4", True): (PASS, "native NVFP4 MoE: FLASHINFER_TRTLLM first, then FLASHINFER_CUTEDSL, FLASHINFER_CUTLASS, "
                      "VLLM_CUTLASS, W4A4 (a weight-only W4A16_NVFP4 checkpoint runs on MARLIN instead)",
                      _MOE + "oracle/nvfp4.py select_nvfp4_moe_backend; experts/trtllm_nvfp4_moe.py "
                      "_supports_current_device (is_device_capability_family(100))"),
    ("nvfp4", False): (WARN, "no native NVFP4 MoE kernel: every native backend needs the sm100 family "
                       "(FLASHINFER_TRTLLM, FLASHINFER_CUTEDSL, FLASHINFER_CUTLASS's NVFP4, VLLM_CUTLASS); vLLM "
                       "runs the experts weight-only, W4A16, through MARLIN (HUMMING first where the humming "
                       "package is installed) or EMULATION: activations stay BF16, the checkpoint's activation "
                       "scales are unused, the numerics are not the W4A4 the checkpoint was made for",
                       _MOE + "oracle/nvfp4.py NvFp4MoeBackend (MARLIN, HUMMING, EMULATION); experts/"
                       "trtllm_nvfp4_moe.py, experts/flashinfer_cutedsl_moe.py, experts/flashinfer_cutlass_moe.py, "
                       "experts/cutlass_moe.py _supports_current_device / _supports_quant_scheme; "
                       + _VL + "quantization/utils/marlin_utils_fp4.py prepare_nvfp4_moe_layer_for_marlin"),
    ("mxfp8", True): (PASS, "native MXFP8 MoE: FLASHINFER_TRTLLM first, then DEEPGEMM (W8A8: activations "
                      "quantized to MXFP8 per 32)",
                      _MOE + "oracle/mxfp8.py _SUPPORTED_BACKENDS; experts/trtllm_fp8_moe.py "
                      "_supports_current_device; experts/deep_gemm_moe.py _supports_quant_scheme"),
    ("mxfp8", False): (WARN, "no native MXFP8 MoE kernel: FLASHINFER_TRTLLM and DEEPGEMM's MXFP8 need the sm100 "
                       "family, TRITON_MXFP8 is ROCm only; vLLM runs the experts weight-only, W8A16, through "
                       "MARLIN (vLLM PR #34664) or EMULATION",
                       _MOE + "oracle/mxfp8.py _SUPPORTED_BACKENDS; experts/trtllm_fp8_moe.py, "
                       "experts/deep_gemm_moe.py, experts/mxfp8_native_moe.py _supports_current_device; "
                       "vLLM PR #34664"),
}
_GROUPS_SOURCE = {
    "nvfp4": "vLLM issue #49949 (open; fix PR #49951 not merged): a TP shard that cuts 16-value groups fails "
             "in Marlin on Hopper; " + _VL + "quantization/modelopt.py ModelOptNvFp4FusedMoE.create_weights "
             "allocates whole groups per rank",
    "mxfp8": _VL + "quantization/modelopt.py ModelOptMxFp8FusedMoE.create_weights raises ValueError "
             "(intermediate_size_per_partition divisible by 32)",
}
_TRTLLM_ROWS = ("vLLM issue #46879 (FlashInfer's `assert M % 128 == 0` at -tp 4); fixed in vLLM 0.33.0 by "
                "PR #46880: " + _VL + "quantization/utils/flashinfer_fp4_moe.py "
                "prepare_nvfp4_moe_layer_for_fi_or_cutlass (min_alignment = 64 if gated)")
_MARLIN_PAD = {"nvfp4": _VL + "quantization/utils/marlin_utils_fp4.py prepare_nvfp4_moe_layer_for_marlin",
               "mxfp8": _VL + "quantization/utils/marlin_utils.py marlin_moe_padded_intermediate"}


def arch_of(name: str) -> Arch:
    try:
        return ARCHS[name]
    except KeyError:
        raise ValueError(f"unknown GPU architecture {name!r}; known: {', '.join(ARCHS)}") from None


def moe_checks(cfg: MoEModel, tp: int, ep: bool, formats: set[str], recipe: bool = True,
               arch: str = "sm100") -> list[Check]:
    """Every rule for the expert formats in `formats` at TP = tp (EP = tp, or the expert width
    split by TP without EP) on a GPU of `arch`; `cfg.text` names the dimensions as Inkling's
    TextConfig does (a standard HF config's `plan.hf.HFText` too); `recipe`: the EP advice cites
    Inkling's recipe."""
    t, a = cfg.text, arch_of(arch)
    H, inter = t.expert_hidden, t.moe_intermediate_size
    if not ep and inter % tp:
        return [Check(FAIL, f"TP{tp} does not divide moe_intermediate_size {inter}: experts cannot be "
                            f"TP-sharded; use EP", "expert width",
                      _MOE + "config.py (intermediate_size_per_partition = intermediate_size // tp_size)")]
    i_r = inter if ep else inter // tp
    where = (f"EP{tp}: whole experts on each rank (width {inter}, w13 rows {2 * inter})" if ep else
             f"pure TP{tp}: every expert's width {inter} / {tp} = {i_r} per rank (w13 rows {2 * i_r})")
    out: list[Check] = []
    for name in sorted(formats & {"nvfp4", "mxfp8"}):
        level, what, source = _DATAPATH[(name, a.family >= 100)]
        out.append(Check(level, f"{name} on {a.generation} ({a.name}): {what}", "datapath", source))
        out.append(_scale_groups(name, H, i_r, where, ep))
        out.append(_kernel_tiles(name, i_r, where, a))
        if name == "mxfp8" and a.family >= 100 and t.n_routed_experts % 4:
            out.append(Check(WARN, f"mxfp8: {t.n_routed_experts} experts, not a multiple of 4: the TRT-LLM FP8 MoE "
                                   f"asserts it", "experts", _MOE + "experts/trtllm_fp8_moe.py:464"))
    if ep and t.n_routed_experts % tp:
        out.append(Check(WARN, f"EP{tp} does not divide {t.n_routed_experts} experts: vLLM pads to "
                               f"{cdiv(t.n_routed_experts, tp) * tp}", "experts per rank",
                         _MOE + "expert_map_manager.py"))
    if not ep and any(c.level != PASS for c in out if c.rule != "datapath"):
        cite = f"the recipe's TP{tp} = " if recipe else ""
        out.append(Check(WARN, f"pure TP{tp} splits every expert's width to {i_r}; recommend EP ({cite}TP{tp} "
                               f"attention + EP{tp} experts), which keeps whole experts and whole scale groups "
                               f"on each rank", "expert parallelism", "the recipe's guide" if recipe else ENGINE))
    return out


def _scale_groups(name: str, H: int, i_r: int, where: str, ep: bool) -> Check:
    """FAIL when a scale group (16 NVFP4, 32 MXFP8 values along the input dim) would straddle
    ranks: in the hidden size (any split) or in the per-rank expert width (pure TP)."""
    from ..formats import FORMATS

    block = FORMATS[name].block_size
    bad = [f"{dim} {n}" for dim, n in (("expert hidden width", H), ("per-rank expert width", i_r)) if n % block]
    if bad:
        return Check(FAIL, f"{name}: {' and '.join(bad)} not a multiple of the {block}-value scale group ({where}): "
                           f"groups would straddle ranks, and no fix is in {ENGINE}", "scale groups",
                     _GROUPS_SOURCE[name])
    if ep:
        return Check(PASS, f"{name}: {where}: the TP-split rules (vLLM #49949, #46879) do not apply", "scale groups",
                     _MOE + "expert_map_manager.py (EP places whole experts on each rank)")
    return Check(PASS, f"{name}: {where}: whole {block}-value scale groups on each rank", "scale groups",
                 _GROUPS_SOURCE[name])


def _kernel_tiles(name: str, i_r: int, where: str, a: Arch) -> Check:
    """What the kernel vLLM picks first needs of the per-rank width, and what 0.33.0 pads."""
    padded = cdiv(i_r, 64) * 64
    if a.family < 100:  # Marlin: w13 2 x width % 128 and w2 width % 64, zero-padded at load
        if i_r % 64 == 0:
            return Check(PASS, f"{name}: Marlin tiles: width {i_r} is a multiple of 64", "kernel tiles",
                         _MARLIN_PAD[name])
        return Check(WARN, f"{name}: {where}: Marlin zero-pads the width {i_r} to {padded} at load (memory and work "
                           f"for {padded - i_r} zero rows per expert)", "kernel tiles", _MARLIN_PAD[name])
    if name != "nvfp4":
        return Check(PASS, f"{name}: {where}: no per-rank width rule known for FLASHINFER_TRTLLM's MXFP8",
                     "kernel tiles", _MOE + "experts/trtllm_fp8_moe.py")
    if (2 * i_r) % 128 == 0:
        return Check(PASS, f"nvfp4: {where}: w13 rows {2 * i_r} are a multiple of 128 (FlashInfer TRT-LLM)",
                     "kernel tiles", _TRTLLM_ROWS)
    return Check(WARN, f"nvfp4: {where}: w13 rows {2 * i_r} are not a multiple of 128, which FlashInfer's TRT-LLM "
                       f"NVFP4 MoE asserts; {ENGINE} pads the width {i_r} to {padded} (zero rows) and loads, an "
                       f"engine without PR #46880 does not; the CUTLASS NVFP4 backends raise NotImplementedError "
                       f"(flashinfer_fp4_moe.py, 'Intermediate size padding ... not currently supported')",
                 "kernel tiles", _TRTLLM_ROWS)
