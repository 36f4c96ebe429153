"""What vLLM 0.33's ModelOpt MoE methods and their backends need of the per-rank routed-expert
shapes of an Inkling 2 checkpoint (or of a standard HF MoE config) at a given TP, with or without
expert parallelism (the research notes' section 7; docs/budget.md, "MoE divisibility").
`plan.inkling2.plan` reports them. Light: torch only through `formats`, imported where it checks."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ..units import cdiv


class ExpertDims(Protocol):
    """What the checks read of a text model: Inkling's TextConfig names, which `plan.hf.HFText`
    shares. A Protocol, so that this module imports neither plan."""

    @property
    def hidden_size(self) -> int: ...
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
    level: str     # "error": vLLM refuses to load; "warning": some backends refuse or pad
    message: str


def moe_checks(cfg: MoEModel, tp: int, ep: bool, formats: set[str], recipe: bool = True) -> list[Check]:
    """What vLLM's ModelOpt MoE methods and their backends need of the per-rank expert shapes
    (the research notes' section 7). `cfg.text` names the dimensions as Inkling's TextConfig does
    (a standard HF config's `plan.hf.HFText` too); `recipe`: the EP advice cites Inkling's recipe."""
    from ..formats import FORMATS

    t, out = cfg.text, []
    H, inter = t.hidden_size, t.moe_intermediate_size
    if not ep and inter % tp:
        return [Check("error", f"TP{tp} does not divide moe_intermediate_size {inter}: experts cannot be "
                               f"TP-sharded; use EP")]
    i_r = inter if ep else inter // tp
    where = f"per-rank expert width ({'EP: whole experts' if ep else f'{inter} / TP{tp}'})"
    for name in sorted(formats & {"mxfp8", "nvfp4"}):
        block = FORMATS[name].block_size
        for dim, n in (("hidden_size", H), (where, i_r)):
            if n % block:
                cite = "modelopt.py:1320-1329 raises" if name == "mxfp8" else "modelopt.py:937-980 shapes mismatch"
                out.append(Check("error", f"{name}: {dim} {n} is not a multiple of the {block}-element scale "
                                          f"block ({cite}): block scales would straddle ranks"))
        if name == "mxfp8":
            for dim, n in (("hidden_size", H), (where, i_r)):
                if n % 128:
                    out.append(Check("warning", f"mxfp8: {dim} {n} is not a multiple of 128: the TRITON_MXFP8 "
                                                f"MoE backend asserts K % 128 (mxfp8_native_moe.py:189)"))
            if t.n_routed_experts % 4:
                out.append(Check("warning", "mxfp8: n_routed_experts not a multiple of 4: the TRT-LLM FP8 MoE "
                                            "asserts it (trtllm_fp8_moe.py:464)"))
        if name == "nvfp4" and i_r % 64:
            out.append(Check("warning", f"nvfp4: {where} {i_r} is not a multiple of 64: the CUTLASS / FlashInfer-"
                                        f"CUTLASS NVFP4 MoE raise NotImplementedError (flashinfer_fp4_moe.py:441-449); "
                                        f"FLASHINFER_TRTLLM pads it to {cdiv(i_r, 64) * 64} (l.418-425)"))
    if ep and t.n_routed_experts % tp:
        out.append(Check("warning", f"EP{tp} does not divide {t.n_routed_experts} experts: vLLM pads to "
                                    f"{cdiv(t.n_routed_experts, tp) * tp} (moe.py:440)"))
    if not ep and out:
        cite = f"the recipe's TP{tp} = " if recipe else ""
        out.append(Check("warning", f"pure TP{tp} splits every expert's intermediate dim to {i_r}; "
                                    f"recommend EP ({cite}TP{tp} attention + EP{tp} experts), "
                                    f"which keeps whole experts and whole scale blocks on each rank"))
    return out
