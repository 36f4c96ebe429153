"""Quantized sources: what a checkpoint's config.json says its weights are stored in, and the
names its stored tensors have. The bits belong to the formats (`fp8_block`, `mxfp4` in
formats.SOURCE_FORMATS); the names and the config keys are the checkpoint's, so they are here.

Two kinds of source are read (docs/convert.md, "Sources we accept"):

- **FP8 block-scaled** (`quantization_config.quant_method` "fp8" with `weight_block_size`
  [128, 128]: DeepSeek-V3/R1, Kimi-K2, Qwen3's FP8 releases). A Linear weight `X.weight` is
  float8_e4m3fn with its scale `X.weight_scale_inv` beside it (deepseek-ai/DeepSeek-V3
  inference/fp8_cast_bf16.py: ``scale_inv_name = f"{weight_name}_scale_inv"``); which weights are
  FP8 is decided per tensor by its dtype and that scale, not by `modules_to_not_convert`
  (transformers 5.25 utils/quantization_config.py `FineGrainedFP8Config`: routed experts, shared
  experts, dense MLPs and attention are; embeddings, norms, routers and the LM head are not).
- **MXFP4 routed experts** (`quant_method` "mxfp4": OpenAI's gpt-oss). The stacked expert tensor
  `X` (transformers' `experts.gate_up_proj` / `experts.down_proj`) is stored as `X_blocks` (uint8
  codes) and `X_scales` (e8m0), the blocks along the input dimension of an [E, out, in] weight
  (transformers 5.25 quantizers/quantizer_mxfp4.py ``serialized_names``, integrations/mxfp4.py
  ``convert_moe_packed_tensors``); everything else is BF16.

Any other `quant_method` is not a source kind read here (None): convert then refuses the
quantized tensors it finds, naming them.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from ..errors import short_repr as _short

FP8_BLOCK = "fp8_block"   # formats.SOURCE_FORMATS names
MXFP4 = "mxfp4"
FP8_BLOCK_SIZE = [128, 128]
FP8_SCALE = "weight_scale_inv"
MXFP4_TENSORS = (("weight", "_blocks"), ("weight_scale", "_scales"))  # format suffix -> name suffix

__all__ = ["SourceQuant", "source_quant", "FP8_BLOCK", "MXFP4", "FP8_SCALE"]


@dataclass(frozen=True)
class SourceQuant:
    """How a quantized source stores its weights: the format (`format`, a formats.SOURCE_FORMATS
    name), what its config calls it (`method`), and whether only routed experts are stored so
    (`experts_only`: gpt-oss's MXFP4) or any Linear weight may be (FP8)."""

    method: str
    format: str
    experts_only: bool

    def stored(self, weight: str) -> dict[str, str]:
        """format suffix -> checkpoint name of each tensor holding the weight that a BF16
        checkpoint names `weight` (`X.weight`; a stacked `...experts.gate_up_proj`)."""
        if self.format == MXFP4:
            return {suffix: weight + tail for suffix, tail in MXFP4_TENSORS}
        return {"weight": weight, FP8_SCALE: weight[: -len("weight")] + FP8_SCALE}

    def owner(self, name: str) -> tuple[str, str] | None:
        """(the weight a BF16 checkpoint would name, format suffix) of the stored tensor `name`
        when its name is one of the format's companions (a scale, MXFP4's blocks); None for
        any other name (an FP8 weight is named as its BF16 weight: its dtype tells)."""
        if self.format == MXFP4:
            return next(((name[: -len(tail)], suffix) for suffix, tail in MXFP4_TENSORS if name.endswith(tail)), None)
        if name.endswith("." + FP8_SCALE):
            return name[: -len(FP8_SCALE)] + "weight", FP8_SCALE
        return None

    def describe(self) -> str:
        what = "routed experts" if self.experts_only else "Linear weights"
        return f"{what} stored {self.format} (quantization_config.quant_method {self.method!r})"


def source_quant(config: dict, path: str) -> SourceQuant | None:
    """The quantized source a config.json describes (its top-level `quantization_config`), or
    None: no quantization config, or one of a kind not read here. ConfigError naming the file and
    the key for an FP8 config whose blocks or activations this reader does not take."""
    q = config.get("quantization_config") if isinstance(config, dict) else None
    if not isinstance(q, dict):
        return None
    method = q.get("quant_method")
    if method == "mxfp4":
        return SourceQuant("mxfp4", MXFP4, experts_only=True)
    if method != "fp8":
        return None
    block = q.get("weight_block_size")
    if block != FP8_BLOCK_SIZE:
        raise ConfigError(f"quantization_config.weight_block_size is {_short(block)}: FP8 sources are read with "
                          f"128x128 blocks only (DeepSeek-V3's layout, [128, 128]); per-tensor or per-channel FP8 "
                          f"is not a source convert takes", path=path)
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError(f"quantization_config.fmt is {_short(fmt)}: FP8 sources are read as float8_e4m3fn "
                          f"('e4m3')", path=path)
    act = q.get("activation_scheme", "dynamic")
    if act != "dynamic":
        raise ConfigError(f"quantization_config.activation_scheme is {_short(act)}: FP8 sources with static "
                          f"activation scales are not read (only 'dynamic', DeepSeek-V3's)", path=path)
    return SourceQuant("fp8", FP8_BLOCK, experts_only=False)
