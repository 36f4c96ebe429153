"""What `lora check/merge` merges where in an Inkling 2 checkpoint (inkling2.py, docs/layout.md).

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

from .. import dspark
from ..errors import CheckpointError, ConfigError, UnknownTensorError, UsageError
from ..export import format_of
from ..formats import FORMATS
from ..inkling2 import Inkling2Config, classify, experts_module, original_name, transformers_name
from ..io.safetensors import DTYPE_NAMES, ShardReader, TensorEntry
from ..tensors import TensorName
from .peft import ADAPTER_CONFIG, quantized_refusal, read_lora
from .target import DTYPES, Target, merged_weight

# The attention nn.Linears of Inkling 2 (original names), all mergeable: q/k/v/r are vLLM's packed
# `qkvr` LoRA module and wo_ud its `wo_ud`; gate_attn and attn_sink_proj are Inkling 2's own
# (no vLLM LoRA module exists for them yet), merged like the others: a merge needs no LoRA kernel.
ATTENTION_PROJECTIONS = ("wq_du", "wk_dv", "wv_dv", "wr_du", "wo_ud", "gate_attn", "attn_sink_proj")
# Inkling2Experts registers gate_up_proj then down_proj; PEFT wraps a module's targeted parameters
# in that order, each ParamWrapper around the previous, so the first is the innermost: saved
# under `experts.base_layer.` when both are targeted (tuners_utils._inject_parameters).
EXPERT_PARAMS = ("gate_up_proj", "down_proj")
MERGEABLE_PARTS = ("attention", "expert")  # the parts (inkling2.classify) LoRA merges into
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
    if dspark.is_draft(module):  # bundled beside the model, not a module of it
        raise ConfigError(f"{where} is the DSpark draft: LoRA merges only into {MERGEABLE}", path=plan.adapter.path)
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


def _check_factors(plan, where: str, t: TensorName, param: str | None, shape: tuple[int, ...],
                   a: TensorEntry, b: TensorEntry, r: int) -> None:
    """Raise unless factors a [r(*E), in] and b [out, r(*E)] fit the weight of `shape` ([out, in],
    or [E, out, in] for a stacked expert parameter)."""
    n_exp, (out_f, in_f) = (shape[0] if param else 1), shape[-2:]
    if a.shape[1] != in_f or b.shape[0] != out_f:
        hint, hidden = "", plan.cfg.text.hidden_size
        reads_hidden = param == "gate_up_proj" or (param is None and t.projection != "wo_ud")
        if reads_hidden and a.shape[1] != in_f:  # lora_A's columns are the hidden size it was trained on
            hint = f" (trained on hidden_size {a.shape[1]}; this checkpoint has {hidden})"
        delta = f"the {param} factors give an [{b.shape[0]}, {a.shape[1]}] delta per expert" if param else \
            f"B @ A is [{b.shape[0]}, {a.shape[1]}]"
        raise ConfigError(f"{where}: shape mismatch: {delta} but the checkpoint's weight is {list(shape)}{hint}: "
                          f"adapter for another model", path=plan.adapter.path)
    if a.shape[0] != r * n_exp:
        want = f"r * experts = {r} * {n_exp} rows (PEFT's ParamWrapper stacks one rank-r factor per expert)" \
            if param else f"r={r}"
        raise ConfigError(f"{where}: lora_A has rank {a.shape[0]} but the adapter config gives {want} for this "
                          f"module (r / rank_pattern): the scale alpha/r would be wrong, or the adapter is for "
                          f"another model", path=plan.adapter.path)


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
    _check_factors(plan, where, t, param, tuple(e.shape), a, b, r)
    return Target(key, t.part, t.layer, tensor, shard, tuple(e.shape), e.dtype, r, alpha, scaling, scaling * scale,
                  factors=module, param=param)


def _peft_name(tensor: str, text_only: bool) -> str | None:
    """The name an adapter gives checkpoint tensor `tensor` (transformers' name; a text-only
    model's `model.layers.`; the bundled draft, no module of the model, its own), None for none."""
    if dspark.is_draft(tensor):
        return tensor
    try:
        hf = transformers_name(tensor)
    except UnknownTensorError:  # a quantized tensor's scales
        return None
    return _TEXT_ONLY + hf[len(_FULL):] if text_only and hf.startswith(_FULL) else hf


def _selected(plan) -> list[tuple[str, int]]:
    """(PEFT key, layer) of the mergeable tensors target_modules / target_parameters select (keys:
    modules, or experts' module.parameter, named as the adapter names its modules); raise when they
    select none, naming what they select instead."""
    acfg = plan.adapter.config
    text_only = any(m.startswith(_TEXT_ONLY) for m in plan.adapter.modules)
    keys, elsewhere = [], []
    for tensor in plan.ckpt.weight_map:
        try:
            t = classify(tensor)
        except UnknownTensorError:
            continue
        hf = _peft_name(tensor, text_only)
        if hf is None:
            continue
        if t.part == "expert":
            if t.suffix == "weight" and acfg.targets_parameter(hf):
                keys.append((hf, t.layer))
        elif hf.endswith(".weight") and acfg.targets(hf[: -len(".weight")], _is_linear):
            mergeable = t.part == "attention" and t.projection in ATTENTION_PROJECTIONS
            (keys if mergeable else elsewhere).append((hf[: -len(".weight")], t.layer if mergeable else t.part))
    where = plan.adapter.root / ADAPTER_CONFIG
    config = f"target_modules={json.dumps(acfg.target_modules)} / target_parameters={json.dumps(acfg.target_parameters)}"
    if not keys and elsewhere:
        module, part = elsewhere[0]
        raise ConfigError(f"{config} select only modules LoRA cannot be merged into (e.g. {module!r}, {part}): "
                          f"LoRA merges only into {MERGEABLE}", path=where)
    if not keys:
        raise ConfigError(f"{config} match no attention projection or routed expert of {plan.ckpt.root}: adapter "
                          f"for another model", path=where)
    return keys


def _span(layers: list[int]) -> str:
    return f"{layers[0]}-{layers[-1]}" if len(layers) > 1 else str(layers[0])


def plan_targets(plan, dtype: str, scale: float) -> None:
    """Fill plan.targets from the adapter's modules; raise on anything refused."""
    selected = _selected(plan)
    by_tensor = {}
    for module, (a, b) in plan.adapter.modules.items():
        tgt = _target(plan, module, a, b, dtype, scale)
        if tgt.tensor in by_tensor:
            raise ConfigError(f"modules {by_tensor[tgt.tensor]!r} and {module!r} both merge into {tgt.tensor!r}",
                              path=plan.adapter.path)
        by_tensor[tgt.tensor] = module
        plan.targets.append(tgt)
    # what target_modules / target_parameters select here but the adapter lacks: another (smaller) model
    have = {t.module for t in plan.targets}
    missing = [(k, layer) for k, layer in selected if k not in have]
    if missing:
        had, lack = sorted({t.layer for t in plan.targets}), sorted({layer for _, layer in missing})
        if had and lack[0] > had[-1]:
            raise ConfigError(f"LoRA weights for layers {_span(had)} only, but target_modules / target_parameters "
                              f"select layers up to {lack[-1]} of this {plan.cfg.text.num_hidden_layers}-layer "
                              f"checkpoint: adapter for another model (fewer layers)", path=plan.adapter.path)
        raise ConfigError(f"target_modules / target_parameters select {len(missing)} tensor(s) of this checkpoint "
                          f"the adapter has no weights for, e.g. {missing[0][0]!r}: incomplete adapter or another "
                          f"model", path=plan.adapter.path)


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
