"""Quantized sources: what a checkpoint's config.json says its weights are stored in, and the
names its stored tensors have. The bits belong to the formats (`fp8_block`, `mxfp4` in
formats.SOURCE_FORMATS); the names and the config keys are the checkpoint's, so they are here.

Four kinds of source are read (docs/convert.md, "Sources we accept"):

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

- **Kimi-K3** (compressed-tensors, `quant_method` "compressed-tensors" with `format`
  "mxfp4-pack-quantized", in `text_config.quantization_config`: vLLM 0.33
  transformers_utils/configs/kimi_k3.py copies it up from there). Its routed experts are MXFP4 per
  expert, `X.weight_packed` uint8 [out, in/2] (the low nibble first) and `X.weight_scale` uint8
  E8M0 [out, in/32] (vLLM 0.33 models/kimi_k3/nvidia/model.py `load_weights` renames
  `.weight_packed` to `.weight` for its Mxfp4MoEMethod); everything else is BF16. The experts are
  found by these names, not by the config's `targets`/`ignore` (llm-compressor patches the
  release's ignore list as incomplete; Model-Optimizer's Kimi-K3 script matches names too).

- **DeepSeek-V4** (`quant_method` "fp8" with `expert_dtype` "fp4", at the top level or in
  `quantization_config`: transformers 5.25 models/deepseek_v4/configuration_deepseek_v4.py). Its
  Linears are FP8 block-scaled as above with UE8M0 scales, its routed experts MXFP4 per expert
  (`mxfp4_rows`: `X.weight` int8 [out, in/2]); every scale is stored as `X.scale` (Model-Optimizer
  examples/deepseek/cast_mxfp4_to_nvfp4.py reads DeepSeek-V4-Flash so), which `source_quant`
  tells from the tensor names.

Any other `quant_method` is not a source kind read here (None): convert then refuses the
quantized tensors it finds, naming them; so is an FP8 config with `moe_quant_algo`, a converted
checkpoint (`converted_experts`).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from ..errors import short_repr as _short

FP8_BLOCK = "fp8_block"   # formats.SOURCE_FORMATS names
MXFP4 = "mxfp4"
MXFP4_ROWS = "mxfp4_rows"
FP8_BLOCK_SIZE = [128, 128]
FP8_SCALE = "weight_scale_inv"
# DeepSeek-V4's name for a weight's scale, FP8 or MXFP4 (`<module>.scale`: transformers 5.25
# quantizers/quantizer_finegrained_fp8.py renames ``^(.+)\.scale`` to weight_scale_inv on load)
SHORT_SCALE = "scale"
MXFP4_TENSORS = (("weight", "_blocks"), ("weight_scale", "_scales"))  # format suffix -> name suffix
COMPRESSED_TENSORS = "compressed-tensors"
CT_MXFP4 = "mxfp4-pack-quantized"   # compressed-tensors' MXFP4 format name

__all__ = ["SourceQuant", "source_quant", "converted_experts", "scale_beside", "FP8_BLOCK", "MXFP4", "MXFP4_ROWS", "FP8_SCALE"]


@dataclass(frozen=True)
class SourceQuant:
    """How a quantized source stores its weights: the format of its Linear weights (`format`, a
    formats.SOURCE_FORMATS name) and of its routed experts (`expert_format`: the same, or
    DeepSeek-V4's MXFP4 experts beside FP8 Linears), what its config calls it (`method`), whether
    only routed experts are stored so (`experts_only`: gpt-oss's MXFP4) or any Linear weight may
    be (FP8), the name a weight's scale is stored under beside it (`scale`: `<module>.<scale>`,
    DeepSeek-V3's weight_scale_inv, DeepSeek-V4's scale, Kimi-K3's weight_scale) and the name of
    its codes (`packed`: `<module>.weight`, Kimi-K3's `<module>.weight_packed`)."""

    method: str
    format: str
    experts_only: bool
    expert_format: str = ""
    scale: str = FP8_SCALE
    packed: str = "weight"

    def __post_init__(self):
        if not self.expert_format:
            object.__setattr__(self, "expert_format", self.format)

    def format_of(self, expert: bool) -> str:
        """The format a weight is stored in: a routed expert's, or any other Linear's."""
        return self.expert_format if expert else self.format

    def stored(self, weight: str, expert: bool) -> dict[str, str]:
        """format suffix -> checkpoint name of each tensor holding the weight that a BF16
        checkpoint names `weight` (`X.weight`; a stacked `...experts.gate_up_proj`), a routed
        expert's (`expert`) or another Linear's."""
        fmt = self.format_of(expert)
        if fmt == MXFP4:
            return {suffix: weight + tail for suffix, tail in MXFP4_TENSORS}
        scale = "weight_scale" if fmt == MXFP4_ROWS else FP8_SCALE
        module = weight[: -len("weight")]
        return {"weight": module + self.packed, scale: module + self.scale}

    def owner(self, name: str) -> str | None:
        """The weight a BF16 checkpoint would name of the stored tensor `name` when its name is
        one of the formats' companions (a scale, MXFP4's blocks); None for any other name (an FP8
        weight is named as its BF16 weight: its dtype tells)."""
        if self.format == MXFP4:
            return next((name[: -len(tail)] for _, tail in MXFP4_TENSORS if name.endswith(tail)), None)
        for stored in {self.scale, self.packed} - {"weight"}:
            if name.endswith("." + stored):
                return name[: -len(stored)] + "weight"
        return None

    def describe(self) -> str:
        if self.experts_only:
            return f"routed experts stored {self.format} (quantization_config.quant_method {self.method!r})"
        experts = f", routed experts {self.expert_format}" if self.expert_format != self.format else ""
        return f"Linear weights stored {self.format}{experts} (quantization_config.quant_method {self.method!r})"


def scale_beside(weight: str, names) -> str | None:
    """The FP8 scale stored beside the weight `weight` among `names` (`<module>.weight_scale_inv`,
    or DeepSeek-V4's `<module>.scale`), or None: what a checkpoint that keeps FP8 Linears as stored
    (ModelOpt's DeepSeek-V4 form, export/fp8_release.py) pairs them by."""
    module = weight[: -len("weight")]
    return next((module + s for s in (FP8_SCALE, SHORT_SCALE) if module + s in names), None)


def converted_experts(config: dict) -> str | None:
    """The experts' quant_algo of an FP8 checkpoint whose routed experts were converted already
    (`quantization_config.moe_quant_algo`: ModelOpt's DeepSeek-V4 form, export/fp8_release.py),
    else None. Such a checkpoint is an output, not a source."""
    q = config.get("quantization_config") if isinstance(config, dict) else None
    if not isinstance(q, dict) or q.get("quant_method") != "fp8" or "moe_quant_algo" not in q:
        return None
    return str(q["moe_quant_algo"])


def source_quant(config: dict, path: str, names=()) -> SourceQuant | None:
    """The quantized source a config.json describes (its top-level `quantization_config`), or
    None: no quantization config, or one of a kind not read here. ConfigError naming the file and
    the key for an FP8 config whose blocks or activations this reader does not take. `names` (the
    checkpoint's tensors) tell which name an FP8 scale has: `weight_scale_inv`, or DeepSeek-V4's
    `scale`."""
    q = config.get("quantization_config") if isinstance(config, dict) else None
    text = config.get("text_config") if isinstance(config, dict) else None
    nested = text.get("quantization_config") if isinstance(text, dict) else None
    if not isinstance(q, dict) and isinstance(nested, dict) and nested.get("quant_method") == COMPRESSED_TENSORS:
        return _compressed_tensors(nested, path, "text_config.")  # Kimi-K3's place: only such a config is read there
    if not isinstance(q, dict):
        return None
    method = q.get("quant_method")
    if method == "mxfp4":
        return SourceQuant("mxfp4", MXFP4, experts_only=True)
    if method == COMPRESSED_TENSORS:
        return _compressed_tensors(q, path)
    if method != "fp8" or converted_experts(config) is not None:
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
    # DeepSeek-V4 says `expert_dtype` at the top level, V4.1 in quantization_config (transformers
    # 5.25 models/deepseek_v4/configuration_deepseek_v4.py __post_init__ moves the first into the second)
    experts = q.get("expert_dtype", config.get("expert_dtype", "fp8"))
    if experts not in ("fp8", "fp4"):
        raise ConfigError(f"expert_dtype is {_short(experts)}: FP8 sources store routed experts 'fp8' or 'fp4' "
                          f"(transformers 5.25 FineGrainedFP8Config)", path=path)
    scale = SHORT_SCALE if any(n.endswith("." + SHORT_SCALE) for n in names) and not any(
        n.endswith("." + FP8_SCALE) for n in names) else FP8_SCALE
    return SourceQuant("fp8", FP8_BLOCK, experts_only=False, expert_format=MXFP4_ROWS if experts == "fp4" else FP8_BLOCK,
                       scale=scale)


def _compressed_tensors(q: dict, path: str, where: str = "") -> SourceQuant | None:
    """Kimi-K3's compressed-tensors MXFP4 experts (module doc); any other compressed-tensors
    format is not read here (None: convert refuses its tensors by name). ConfigError naming the
    key where an MXFP4 group is not the one vLLM 0.33 reads as MXFP4
    (compressed_tensors/compressed_tensors.py `_is_mxfp4`: 4-bit float, groups of 32)."""
    if q.get("format") != CT_MXFP4:
        return None
    groups = q.get("config_groups")
    key = f"{where}quantization_config.config_groups"
    if not isinstance(groups, dict) or not groups:
        raise ConfigError(f"{key} is {_short(groups)}: {CT_MXFP4} needs an object of groups, each with its "
                          f"'weights' (vLLM 0.33 compressed_tensors.py reads the scheme from them)", path=path)
    for name, group in groups.items():
        w = group.get("weights") if isinstance(group, dict) else None
        if not isinstance(w, dict):
            raise ConfigError(f"{key}.{name} is {_short(group)}: a group is an object whose 'weights' is an object "
                              f"(num_bits, type, group_size)", path=path)
        got = {k: w.get(k) for k in ("num_bits", "type", "group_size")}
        if got != {"num_bits": 4, "type": "float", "group_size": 32}:
            raise ConfigError(f"{where}quantization_config.config_groups.{name}.weights is {_short(got)}: {CT_MXFP4} "
                              f"is read as 4-bit float in groups of 32 (MXFP4)", path=path)
    return SourceQuant(COMPRESSED_TENSORS, MXFP4_ROWS, experts_only=True, scale="weight_scale",
                       packed="weight_packed")
