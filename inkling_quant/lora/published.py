"""`lora check/merge` on the published Inkling 2 layout (inkling2.py, docs/layout.md).

The adapter is what PEFT writes for transformers' Inkling2ForConditionalGeneration (module names
`model.language_model.layers.N...`) or Inkling2ForCausalLM (`model.layers.N...`); the checkpoint
holds the original names (`model.llm.layers.N.attn.wq_du.weight`, stacked experts). A PEFT module
is mapped to its checkpoint tensor with `inkling2.original_name`, the one home for names.

Mergeable (docs/lora.md says why):
- the attention projections, every nn.Linear of the attention (ATTENTION_PROJECTIONS), from
  `target_modules`;
- the routed experts, from `target_parameters` (`mlp.experts.gate_up_proj` / `down_proj`: PEFT's
  ParamWrapper on the 3-D parameters), when the checkpoint's experts are BF16. PEFT saves such a
  factor pair as lora_A [r*E, in] and lora_B [out, r*E] (ParamWrapper.get_delta_weight: expert e
  is A[e*r:(e+1)*r] and B[:, e::E]); transformers' gate_up_proj rows are [gate; up] while the
  checkpoint's w13 rows interleave them (row 2j gate j, 2j+1 up j), so B's rows are interleaved
  before the product (a permutation: no arithmetic, so no rounding).
"""
from __future__ import annotations

import json

import torch

from ..errors import CheckpointError, ConfigError, UnknownTensorError, UsageError
from ..export import format_of
from ..formats import FORMATS
from ..inkling2 import Inkling2Config, classify, experts_module, original_name, transformers_name
from ..io.safetensors import DTYPE_NAMES, ShardReader, TensorEntry
from .peft import quantized_refusal, read_lora
from .target import DTYPES, Target, merged_weight

# The attention nn.Linears of Inkling 2 (original names), all mergeable: q/k/v/r are vLLM's packed
# `qkvr` LoRA module and wo_ud its `wo_ud`; gate_attn and attn_sink_proj are Inkling 2's own
# (no vLLM LoRA module exists for them yet), merged like the others: a merge needs no LoRA kernel.
ATTENTION_PROJECTIONS = ("wq_du", "wk_dv", "wv_dv", "wr_du", "wo_ud", "gate_attn", "attn_sink_proj")
# Inkling2Experts registers gate_up_proj then down_proj; PEFT wraps a module's targeted parameters
# in that order, each ParamWrapper around the previous, so the first is the innermost: saved
# under `experts.base_layer.` when both are targeted (tuners_utils._inject_parameters).
EXPERT_PARAMS = ("gate_up_proj", "down_proj")
MERGEABLE = (f"the decoder's attention projections ({', '.join(ATTENTION_PROJECTIONS)}) and, when they are BF16, "
             f"the routed experts (target_parameters {', '.join('mlp.experts.' + p for p in EXPERT_PARAMS)})")
_TEXT_ONLY, _FULL = "model.layers.", "model.language_model.layers."  # Inkling2ForCausalLM vs ...ConditionalGeneration
_BASE = ".base_layer"


def hf_module(module: str) -> str:
    """`module` as Inkling2ForConditionalGeneration names it (a text-only model's `model.layers.`
    is its `model.language_model.layers.`)."""
    return _FULL + module[len(_TEXT_ONLY):] if module.startswith(_TEXT_ONLY) else module


def resolve(plan, module: str) -> tuple[str, str | None, str] | None:
    """(checkpoint tensor, targeted parameter or None, PEFT's key for rank/alpha patterns) of the
    adapter module `module`; None when it names nothing of the layout."""
    base, depth = module, 0
    while base.endswith(_BASE):
        base, depth = base[: -len(_BASE)], depth + 1
    param = None
    if base.endswith(".mlp.experts"):
        params = [p for p in EXPERT_PARAMS if plan.adapter.config.targets_parameter(f"{base}.{p}")]
        if depth >= len(params):
            return None
        param = params[len(params) - 1 - depth]
        key = f"{base}.{param}"
    elif depth:
        return None
    else:
        key = module
    try:
        return original_name(hf_module(key) + ("" if param else ".weight")), param, key
    except UnknownTensorError:
        return None


def _quantized(plan, tensor: str, t) -> str | None:
    """The quant_algo (or dtype) of `tensor` when the checkpoint holds it quantized, else None."""
    module = experts_module(t.layer) if t.part == "expert" else tensor[: -len(".weight")]
    declared = format_of(plan.quantization, module)
    if declared is not None:
        return declared.quant_algo
    shard = plan.ckpt.weight_map.get(tensor)
    e = plan.headers[shard].tensors.get(tensor) if shard is not None else None
    if e is not None and e.dtype not in FORMATS["passthrough"].source_dtypes:
        return DTYPE_NAMES[e.dtype]
    return None


def _mergeable(plan, module: str, where: str):
    """(tensor, parameter, key, TensorName) of adapter module `module`; raise unless it is a
    mergeable, unquantized tensor of this checkpoint that the adapter config selects."""
    cfg: Inkling2Config = plan.cfg
    found = resolve(plan, module)
    if found is None:
        raise ConfigError(f"{where} is not a module of the Inkling 2 layout (expected e.g. 'base_model.model."
                          f"{_FULL}0.self_attn.q_proj.linear.lora_A.weight'): adapter for another model?",
                          path=plan.adapter.path)
    tensor, param, key = found
    t = classify(tensor)
    if t.part != "expert" and not (t.part == "attention" and t.projection in ATTENTION_PROJECTIONS):
        raise ConfigError(f"{where} ({tensor}, {t.part}): LoRA merges only into {MERGEABLE}", path=plan.adapter.path)
    if t.layer >= cfg.text.num_hidden_layers:
        raise ConfigError(f"{where} is in layer {t.layer}, but config.json has {cfg.text.num_hidden_layers} layers: "
                          f"adapter for another model", path=plan.adapter.path)
    acfg = plan.adapter.config
    if not (acfg.targets_parameter(key) if param else acfg.targets(module, _is_linear)):
        raise ConfigError(f"{where} has LoRA weights, but the adapter config's target_modules="
                          f"{json.dumps(acfg.target_modules)} / target_parameters={json.dumps(acfg.target_parameters)} "
                          f"does not select it: adapter files do not match", path=plan.adapter.path)
    fmt = _quantized(plan, tensor, t)
    if fmt is not None:
        raise quantized_refusal(where, t.part, fmt, plan.adapter.path)
    return tensor, param, key, t


def _is_linear(module: str) -> bool:
    """For target_modules="all-linear": a module whose weight is a tensor of the layout."""
    try:
        original_name(hf_module(module) + ".weight")
        return True
    except UnknownTensorError:
        return False


def _shape_problem(param: str | None, shape: tuple[int, ...], a: TensorEntry, b: TensorEntry, r: int) -> str | None:
    """Why factors a [r(*E), in] and b [out, r(*E)] do not fit the weight, None when they do."""
    if param is None:
        out_f, in_f = shape
        if a.shape[1] != in_f or b.shape[0] != out_f:
            return f"B @ A is [{b.shape[0]}, {a.shape[1]}] but the checkpoint's weight is {list(shape)}"
        return None if a.shape[0] == r else f"lora_A has rank {a.shape[0]}, the adapter config gives r={r}"
    n_exp, out_f, in_f = shape
    if a.shape[1] != in_f or b.shape[0] != out_f:
        return (f"{param} factors give an [{b.shape[0]}, {a.shape[1]}] delta per expert but the checkpoint's "
                f"stacked weight is {list(shape)}")
    if a.shape[0] != r * n_exp:
        return (f"lora_A has {a.shape[0]} rows, expected r * experts = {r} * {n_exp} (PEFT's ParamWrapper "
                f"stacks one rank-{r} factor per expert)")
    return None


def _target(plan, module: str, a: TensorEntry, b: TensorEntry, dtype: str, scale: float):
    where = f"module {module!r}"
    tensor, param, key, t = _mergeable(plan, module, where)
    shard = plan.ckpt.weight_map.get(tensor)
    if shard is None:
        raise CheckpointError(f"tensor {tensor!r} (targeted by the adapter's {module!r}) is not in the checkpoint",
                              path=plan.ckpt.root, tensor=tensor)
    e = plan.headers[shard].tensors[tensor]
    if e.dtype != DTYPES[dtype]:
        stored = next((k for k, v in DTYPES.items() if v == e.dtype), None)
        hint = f"; pass --dtype {stored} to merge into {stored} weights" if stored else ""
        raise UsageError(f"tensor {tensor!r} is {DTYPE_NAMES[e.dtype]}, not {dtype}: the merge rounds to the "
                         f"stored dtype and never changes it{hint}", path=plan.ckpt.root / shard, tensor=tensor)
    r, alpha, scaling = plan.adapter.config.scaling(key)
    if len(e.shape) != (3 if param else 2):
        raise CheckpointError(f"tensor {tensor!r} has shape {list(e.shape)}", path=plan.ckpt.root / shard,
                              tensor=tensor)
    problem = _shape_problem(param, tuple(e.shape), a, b, r)
    if problem is not None:
        raise ConfigError(f"{where}: {problem}: adapter for another model (or r / rank_pattern wrong, "
                          f"so alpha/r would be)", path=plan.adapter.path)
    return Target(key, t.part, t.layer, tensor, shard, tuple(e.shape), e.dtype, r, alpha, scaling, scaling * scale,
                  factors=module, param=param)


def _selected(plan) -> list[str]:
    """PEFT keys (modules, or experts' module.parameter) target_modules / target_parameters select
    among this checkpoint's mergeable tensors, named as the adapter names its modules."""
    acfg = plan.adapter.config
    text_only = any(m.startswith(_TEXT_ONLY) for m in plan.adapter.modules)
    keys = []
    for tensor in plan.ckpt.weight_map:
        try:
            t = classify(tensor)
            hf = transformers_name(tensor)
        except UnknownTensorError:
            continue
        if text_only and hf.startswith(_FULL):
            hf = _TEXT_ONLY + hf[len(_FULL):]
        if t.part == "attention" and t.projection in ATTENTION_PROJECTIONS:
            module = hf[: -len(".weight")]
            if acfg.targets(module, _is_linear):
                keys.append(module)
        elif t.part == "expert" and t.suffix == "weight" and acfg.targets_parameter(hf):
            keys.append(hf)
    return keys


def plan_targets(plan, dtype: str, scale: float) -> None:
    """Fill plan.targets from the adapter's modules; raise on anything refused."""
    acfg = plan.adapter.config
    selected = _selected(plan)
    if not selected:
        raise ConfigError(f"target_modules={json.dumps(acfg.target_modules)} / target_parameters="
                          f"{json.dumps(acfg.target_parameters)} match no attention projection or routed expert of "
                          f"{plan.ckpt.root}: adapter for another model", path=plan.adapter.root / "adapter_config.json")
    by_tensor = {}
    for module, (a, b) in plan.adapter.modules.items():
        tgt = _target(plan, module, a, b, dtype, scale)
        if tgt.tensor in by_tensor:
            raise ConfigError(f"modules {by_tensor[tgt.tensor]!r} and {module!r} both merge into {tgt.tensor!r}",
                              path=plan.adapter.path)
        by_tensor[tgt.tensor] = module
        plan.targets.append(tgt)
    have = {t.module for t in plan.targets}
    missing = [k for k in selected if k not in have]
    if missing:
        raise ConfigError(f"target_modules / target_parameters select {len(missing)} tensor(s) of this checkpoint "
                          f"the adapter has no weights for, e.g. {missing[0]!r}: incomplete adapter or another model "
                          f"(fewer layers)", path=plan.adapter.path)


# --------------------------------------------------------------------------- merge
def interleave_rows(b: torch.Tensor) -> torch.Tensor:
    """Rows [gate; up] (transformers' gate_up_proj) as the checkpoint's w13 stores them,
    [gate_0, up_0, gate_1, up_1, ...]."""
    half = b.shape[0] // 2
    return b.reshape(2, half, *b.shape[1:]).transpose(0, 1).reshape(b.shape)


def sliced_merge(plan, factors: ShardReader):
    """rewrite_shard's `sliced`: for a targeted stacked expert tensor, the function merging
    expert e's delta (B_e @ A_e) into its slice; None for every other tensor."""
    targets = {t.tensor: t for t in plan.targets if t.param is not None}

    def per_tensor(e: TensorEntry):
        tgt = targets.get(e.name)
        if tgt is None:
            return None
        a_e, b_e = plan.adapter.modules[tgt.factors]
        a, b = read_lora(factors, a_e), read_lora(factors, b_e)
        n_exp, r = tgt.shape[0], tgt.rank

        def merge_one(i: int, w: torch.Tensor) -> torch.Tensor:
            b_i = b[:, i::n_exp]
            if tgt.param == "gate_up_proj":
                b_i = interleave_rows(b_i)
            merged = merged_weight(w, a[i * r:(i + 1) * r], b_i, tgt.scale)
            if not bool(torch.isfinite(merged).all()):
                raise CheckpointError(f"tensor {e.name!r} expert {i}: the merged weight has Inf/NaN (overflow of "
                                      f"{DTYPE_NAMES[e.dtype]}; is --scale too large?)", tensor=e.name)
            return merged
        return merge_one
    return per_tensor
