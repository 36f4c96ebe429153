"""What `lora check/merge` merges where: each adapter module mapped to the checkpoint tensor(s)
it merges into, checked (mergeable, unquantized, selected by the adapter config, shapes, ranks),
and the routed experts' per-expert merge. One plan for every layout; what depends on the layout
(names, what is mergeable, how experts are stored) is asked of its naming: inkling.Inkling2Naming
for the published Inkling 2 layout, hf.HFNaming for the Hugging Face MoE families.

PEFT's side, the same for every layout: an nn.Linear's adapter is `<module>.lora_{A,B}.weight`;
routed experts are 3-D parameters reached with `target_parameters` (PEFT's ParamWrapper), saved
as lora_A [r*E, in] and lora_B [out, r*E] (ParamWrapper.get_delta_weight: expert e is
A[e*r:(e+1)*r] and B[:, e::E]). The experts module registers gate_up_proj then down_proj; PEFT
wraps a module's targeted parameters in that order, each ParamWrapper around the previous, so
the first is the innermost: saved under `experts.base_layer.` when both are targeted
(tuners_utils._inject_parameters).
"""
from __future__ import annotations

import json

import torch

from ..model import dspark
from ..errors import CheckpointError, ConfigError, UsageError
from ..export.modelopt import format_of
from ..formats import FORMATS
from ..io.safetensors import DTYPE_NAMES, ShardReader, TensorEntry
from ..model.tensors import TensorName
from .peft import ADAPTER_CONFIG, quantized_refusal, read_lora
from .target import DTYPES, Piece, Target, merged_expert

EXPERT_PARAMS = ("gate_up_proj", "down_proj")  # in the experts module's registration order
_BASE = ".base_layer"


def resolve(plan, module: str) -> tuple[list[Piece], str | None, str] | None:
    """(checkpoint pieces, targeted parameter or None, PEFT's key for rank/alpha patterns) of the
    adapter module `module`; None when it names nothing of the layout."""
    base, depth = module, 0
    while base.endswith(_BASE):
        base, depth = base[: -len(_BASE)], depth + 1
    param = None
    if plan.naming.is_experts_module(base):
        params = [p for p in EXPERT_PARAMS if plan.adapter.config.targets_parameter(f"{base}.{p}")]
        if depth >= len(params):
            return None
        param = params[len(params) - 1 - depth]
        key = f"{base}.{param}"
    elif depth:
        return None
    else:
        key = module
    pieces = plan.naming.pieces(base if param else module, param)
    return None if not pieces else (pieces, param, key)


def _quantized(plan, tensor: str, t) -> str | None:
    """The quant_algo (or dtype) of `tensor` when the checkpoint holds it quantized, else None."""
    module = plan.naming.experts_module(t.layer) if t.part == "expert" else tensor[: -len(".weight")]
    declared = format_of(plan.quantization, module)
    if declared is not None:
        return declared.quant_algo
    shard = plan.ckpt.weight_map.get(tensor)
    e = plan.headers[shard].tensors.get(tensor) if shard is not None else None
    if e is not None and e.dtype not in FORMATS["passthrough"].source_dtypes:
        return DTYPE_NAMES[e.dtype]
    return None


def _mergeable(plan, module: str, where: str):
    """(pieces, parameter, key) of adapter module `module` with each piece's TensorName; raise
    unless every piece is a mergeable, unquantized tensor of this checkpoint that the adapter
    config selects."""
    naming = plan.naming
    if dspark.is_draft(module):  # bundled beside the model, not a module of it
        raise ConfigError(f"{where} is the DSpark draft: LoRA merges only into {naming.mergeable_text}",
                          path=plan.adapter.path)
    found = resolve(plan, module)
    if found is None:
        raise ConfigError(f"{where} is not a module of {naming.layout} (expected e.g. 'base_model.model."
                          f"{naming.example}.lora_A.weight'): adapter for another model?", path=plan.adapter.path)
    pieces, param, key = found
    named = []
    for piece in pieces:
        t = naming.classify(piece.tensor)
        if t is None:
            raise ConfigError(f"{where} ({piece.tensor}) is not a module of {naming.layout}: adapter for another "
                              f"model?", path=plan.adapter.path)
        if not naming.mergeable(t):
            raise ConfigError(f"{where} ({piece.tensor}, {t.part}): LoRA merges only into {naming.mergeable_text}",
                              path=plan.adapter.path)
        if t.layer >= naming.num_layers:
            raise ConfigError(f"{where} is in layer {t.layer}, but config.json has {naming.num_layers} layers: "
                              f"adapter for another model", path=plan.adapter.path)
        named.append((piece, t))
    acfg = plan.adapter.config
    if not (acfg.targets_parameter(key) if param else acfg.targets(module, naming.is_linear)):
        raise ConfigError(f"{where} has LoRA weights, but the adapter config's target_modules="
                          f"{json.dumps(acfg.target_modules)} / target_parameters={json.dumps(acfg.target_parameters)} "
                          f"does not select it: adapter files do not match", path=plan.adapter.path)
    for piece, t in named:
        fmt = _quantized(plan, piece.tensor, t)
        if fmt is not None:
            raise quantized_refusal(where, t.part, fmt, plan.adapter.path, naming.expert_rule)
    return named, param, key


def _check_factors(plan, where: str, tgt: Target, t: TensorName, a: TensorEntry, b: TensorEntry) -> None:
    """Raise unless factors a [r(*E), in] and b [out, r(*E)] fit the target's delta ([out, in],
    per expert for an expert parameter)."""
    param, shape, r = tgt.param, list(tgt.shape), tgt.rank
    out_f, in_f = tgt.delta_shape
    if a.shape[1] != in_f or b.shape[0] != out_f:
        hint, hidden = "", plan.naming.hidden_size
        if plan.naming.reads_hidden(t, param) and a.shape[1] != in_f:  # lora_A's columns: the hidden size it knew
            hint = f" (trained on hidden_size {a.shape[1]}; this checkpoint has {hidden})"
        delta = f"the {param} factors give an [{b.shape[0]}, {a.shape[1]}] delta per expert" if param else \
            f"B @ A is [{b.shape[0]}, {a.shape[1]}]"
        if tgt.half is not None:
            shape = f"{shape} for each of gate and up (together [{out_f}, {in_f}])"
        raise ConfigError(f"{where}: shape mismatch: {delta} but the checkpoint's weight is {shape}{hint}: "
                          f"adapter for another model", path=plan.adapter.path)
    if a.shape[0] != r * tgt.experts:
        want = f"r * experts = {r} * {tgt.experts} rows (PEFT's ParamWrapper stacks one rank-r factor per expert)" \
            if param else f"r={r}"
        raise ConfigError(f"{where}: lora_A has rank {a.shape[0]} but the adapter config gives {want} for this "
                          f"module (r / rank_pattern): the scale alpha/r would be wrong, or the adapter is for "
                          f"another model", path=plan.adapter.path)


def _targets(plan, module: str, a: TensorEntry, b: TensorEntry, dtype: str, scale: float) -> list[Target]:
    where = f"module {module!r}"
    named, param, key = _mergeable(plan, module, where)
    r, alpha, scaling = plan.adapter.config.scaling(key)
    out = []
    for piece, t in named:
        tensor = piece.tensor
        shard = plan.ckpt.weight_map.get(tensor)
        if shard is None:
            raise CheckpointError(f"tensor {tensor!r} (targeted by the adapter's {module!r}) is not in the checkpoint: "
                                  f"adapter for another model?",
                                  path=plan.ckpt.root, tensor=tensor)
        e = plan.headers[shard].tensors[tensor]
        if e.dtype != DTYPES[dtype]:
            stored = next((k for k, v in DTYPES.items() if v == e.dtype), None)
            hint = f"; pass --dtype {stored} to merge into {stored} weights" if stored else ""
            raise UsageError(f"tensor {tensor!r} is {DTYPE_NAMES[e.dtype]}, not {dtype}: the merge rounds to the "
                             f"stored dtype and never changes it{hint}", path=plan.ckpt.root / shard, tensor=tensor)
        stacked = param is not None and piece.expert is None
        if len(e.shape) != (3 if stacked else 2):
            raise CheckpointError(f"tensor {tensor!r} has shape {list(e.shape)}", path=plan.ckpt.root / shard,
                                  tensor=tensor)
        experts = e.shape[0] if stacked else (piece.experts or 1)
        tgt = Target(key, t.part, t.layer, tensor, shard, tuple(e.shape), e.dtype, r, alpha, scaling,
                     scaling * scale, factors=module, param=param, experts=experts, expert=piece.expert,
                     half=piece.half, interleaved=piece.interleaved)
        _check_factors(plan, where, tgt, t, a, b)
        out.append(tgt)
    return out


def _selected(plan) -> list[tuple[str, int]]:
    """(PEFT key, layer) of the mergeable tensors target_modules / target_parameters select (keys:
    modules, or experts' module.parameter, named as the adapter names its modules); raise when they
    select none, naming what they select instead."""
    acfg, naming = plan.adapter.config, plan.naming
    keys, elsewhere = {}, []
    for key, t, is_param in naming.selectable(plan.adapter.modules):
        if is_param:
            if acfg.targets_parameter(key):
                keys.setdefault(key, t.layer)
        elif acfg.targets(key, naming.is_linear):
            if naming.mergeable(t):
                keys.setdefault(key, t.layer)
            else:
                elsewhere.append((key, t.part))
    where = plan.adapter.root / ADAPTER_CONFIG
    config = f"target_modules={json.dumps(acfg.target_modules)} / target_parameters={json.dumps(acfg.target_parameters)}"
    if not keys and elsewhere:
        module, part = elsewhere[0]
        raise ConfigError(f"{config} select only modules LoRA cannot be merged into (e.g. {module!r}, {part}): "
                          f"LoRA merges only into {naming.mergeable_text}", path=where)
    if not keys:
        raise ConfigError(f"{config} match no attention projection or routed expert of {plan.ckpt.root}: adapter "
                          f"for another model", path=where)
    return list(keys.items())


def _span(layers: list[int]) -> str:
    return f"{layers[0]}-{layers[-1]}" if len(layers) > 1 else str(layers[0])


def plan_targets(plan, dtype: str, scale: float) -> None:
    """Fill plan.targets from the adapter's modules; raise on anything refused."""
    selected = _selected(plan)
    by_tensor = {}
    for module, (a, b) in plan.adapter.modules.items():
        for tgt in _targets(plan, module, a, b, dtype, scale):
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
                              f"select layers up to {lack[-1]} of this {plan.naming.num_layers}-layer "
                              f"checkpoint: adapter for another model (fewer layers)", path=plan.adapter.path)
        raise ConfigError(f"target_modules / target_parameters select {len(missing)} tensor(s) of this checkpoint "
                          f"the adapter has no weights for, e.g. {missing[0][0]!r}: incomplete adapter or another "
                          f"model", path=plan.adapter.path)


# --------------------------------------------------------------------------- merge
class Factors:
    """An adapter module's factors (FP32), read once per layer: a per-expert layout visits each
    expert's gate, up and down tensors in turn, all from the same two modules."""

    def __init__(self, plan, reader: ShardReader):
        self.plan, self.reader, self.layer, self.cache = plan, reader, None, {}

    def __call__(self, tgt: Target) -> tuple[torch.Tensor, torch.Tensor]:
        if tgt.layer != self.layer:
            self.layer, self.cache = tgt.layer, {}
        m = tgt.adapter_module
        if m not in self.cache:
            a_e, b_e = self.plan.adapter.modules[m]
            self.cache[m] = (read_lora(self.reader, a_e), read_lora(self.reader, b_e))
        return self.cache[m]


def finite_merge(t: torch.Tensor, name: str, what: str, dtype, path=None) -> torch.Tensor:
    if not bool(torch.isfinite(t).all()):
        raise CheckpointError(f"tensor {name!r}{what}: the merged weight has Inf/NaN (overflow of "
                              f"{DTYPE_NAMES[dtype]}; is --scale too large?)", path=path, tensor=name)
    return t


def sliced_merge(plan, factors: Factors):
    """rewrite_shard's `sliced`: for a targeted stacked expert tensor, the function merging
    expert e's delta into its slice; None for every other tensor."""
    targets = {t.tensor: t for t in plan.targets if t.sliced}

    def per_tensor(e: TensorEntry):
        tgt = targets.get(e.name)
        if tgt is None:
            return None
        a, b = factors(tgt)
        return lambda i, w: finite_merge(merged_expert(w, a, b, tgt, i), e.name, f" expert {i}", e.dtype)
    return per_tensor
