"""`lora check` and `lora merge` against a checkpoint: the plan (which tensor of which shard
each adapter module merges into, at what scale, and every refusal that depends on the
checkpoint) and the merge, a checkpoint derived with `io.derive`: shards holding a merged tensor
rewritten, the others hardlinked (or copied), checksums carried over."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from .. import __version__
from ..errors import CheckpointError, ConfigError, UsageError
from ..export import format_of, read_quantization
from ..formats import FORMATS, SCALE_SUFFIXES
from ..io.checkpoint import HF_QUANT_CONFIG, INDEX_NAME, Checkpoint, read_json, safe_child, write_json_atomic
from ..io.derive import carry_checksums, copy_other_files, rewrite_shard, source_checksums
from ..io.output import link_or_copy, staged_output
from ..io.safetensors import DTYPE_NAMES, Header, ShardReader, TensorEntry
from ..io.shards import ShardReaders
from ..inkling2 import Inkling2Config
from ..layout import ModelConfig, TensorName, model_config
from .published import plan_targets, sliced_merge
from .target import DTYPES, Target, merged_weight
from .peft import (ADAPTER_CONFIG, MERGEABLE, MERGEABLE_PARTS, PEFT_PREFIX, Adapter, classify_module,
                   open_adapter, quantized_refusal, read_lora)

QUANT_CONFIG = HF_QUANT_CONFIG
PROVENANCE_KEY = "lora_merged"          # config.json: the adapters merged into this checkpoint


# --------------------------------------------------------------------------- plan
@dataclass
class Plan:
    ckpt: Checkpoint
    headers: dict[str, Header]
    config: dict
    cfg: ModelConfig | Inkling2Config
    adapter: Adapter
    targets: list[Target]
    user_scale: float
    warnings: list[str]
    quantization: dict | None = None  # what the checkpoint declares (export.read_quantization)

    @property
    def published(self) -> bool:
        """The published Inkling 2 layout (lora/published.py), not the legacy invented one."""
        return isinstance(self.cfg, Inkling2Config)

    @property
    def rewrite(self) -> list[str]:
        shards = {t.shard for t in self.targets}
        return [s for s in self.ckpt.shards if s in shards]

    def summary(self) -> dict:
        a = self.adapter.config
        return {
            "checkpoint": str(self.ckpt.root), "adapter": self.adapter.source,
            "adapter_sha256": self.adapter.sha256, "base_model_name_or_path": a.base_model,
            "r": a.r, "lora_alpha": a.lora_alpha, "use_rslora": a.use_rslora, "user_scale": self.user_scale,
            "modules": len(self.targets),
            "by_part": {p: sum(t.part == p for t in self.targets) for p in MERGEABLE_PARTS},
            "shards_rewritten": len(self.rewrite), "shards_unchanged": len(self.ckpt.shards) - len(self.rewrite),
            "warnings": self.warnings, "targets": [t.row() for t in self.targets],
        }


def _quantized_format(plan: "Plan", module: str) -> str | None:
    """The quant_algo of `module` when the checkpoint holds it quantized, else None: what its
    quantization config declares (export.format_of), else what its tensors show (a scale
    tensor, or a weight in no unquantized dtype)."""
    declared = format_of(plan.quantization, module)
    if declared is not None:
        return declared.quant_algo
    ckpt = plan.ckpt
    if any(f"{module}.{suffix}" in ckpt.weight_map for suffix in SCALE_SUFFIXES):
        return "quantized"
    shard = ckpt.weight_map.get(module + ".weight")
    e = plan.headers[shard].tensors.get(module + ".weight") if shard is not None else None
    if e is not None and e.dtype not in FORMATS["passthrough"].source_dtypes:
        return DTYPE_NAMES[e.dtype]
    return None


def _span(layers: list[int]) -> str:
    return f"{min(layers)}-{max(layers)}" if layers else "none"


def _selected_modules(plan: Plan) -> list[tuple[str, TensorName]]:
    """The mergeable modules of the checkpoint that target_modules selects; raise when none is."""
    acfg, ckpt = plan.adapter.config, plan.ckpt
    selected, elsewhere = [], []
    for tensor in ckpt.weight_map:
        if not tensor.endswith(".weight"):
            continue
        module = tensor[: -len(".weight")]
        t = classify_module(module)
        if t is not None and acfg.targets(module):
            (selected if t.part in MERGEABLE_PARTS else elsewhere).append((module, t))
    where = plan.adapter.root / ADAPTER_CONFIG
    if not selected and elsewhere:
        m, t = elsewhere[0]
        raise ConfigError(f"target_modules={json.dumps(acfg.target_modules)} selects only modules LoRA cannot be "
                          f"merged into (e.g. {m!r}, {t.part}): LoRA merges only into {MERGEABLE}", path=where)
    if not selected:
        raise ConfigError(f"target_modules={json.dumps(acfg.target_modules)} matches no attention "
                          f"projection or routed expert of {ckpt.root}: adapter for another model", path=where)
    return selected


def _mergeable(plan: Plan, module: str, where: str) -> TensorName:
    """`module`'s layout record; raise unless it is a mergeable, unquantized module of this
    model that the adapter config selects."""
    cfg = plan.cfg
    t = classify_module(module)
    if t is None:
        raise ConfigError(f"{where} is not a module of the Inkling 2 Small layout (expected e.g. "
                          f"'{PEFT_PREFIX}model.layers.0.self_attn.q_proj.lora_A.weight'): adapter for "
                          f"another model?", path=plan.adapter.path)
    if t.part not in MERGEABLE_PARTS:
        raise ConfigError(f"{where} ({t.part}): LoRA merges only into {MERGEABLE}", path=plan.adapter.path)
    if t.layer >= cfg.num_hidden_layers:
        raise ConfigError(f"{where} is in layer {t.layer}, but config.json has {cfg.num_hidden_layers} layers: "
                          f"adapter for another model", path=plan.adapter.path)
    if t.part == "expert" and t.expert >= cfg.num_experts:
        raise ConfigError(f"{where} is expert {t.expert}, but config.json has {cfg.num_experts} routed experts: "
                          f"adapter for another model", path=plan.adapter.path)
    if not plan.adapter.config.targets(module):
        raise ConfigError(f"{where} has LoRA weights, but the adapter config's target_modules="
                          f"{json.dumps(plan.adapter.config.target_modules)} does not select it: adapter files do "
                          f"not match", path=plan.adapter.path)
    fmt = _quantized_format(plan, module)
    if fmt is not None:
        raise quantized_refusal(where, t.part, fmt, plan.adapter.path)
    return t


def _target(plan: Plan, module: str, a: TensorEntry, b: TensorEntry, dtype: str, scale: float) -> Target:
    """The merge of adapter module `module` (factors a, b) into the checkpoint; raise when the
    checkpoint's weight is missing, of another dtype or shape, or the rank is not the config's."""
    ckpt, where = plan.ckpt, f"module {module!r}"
    t = _mergeable(plan, module, where)
    tensor = module + ".weight"
    shard = ckpt.weight_map.get(tensor)
    if shard is None:
        raise CheckpointError(f"tensor {tensor!r} (targeted by the adapter) is not in the checkpoint",
                              path=ckpt.root, tensor=tensor)
    e = plan.headers[shard].tensors[tensor]
    if e.dtype != DTYPES[dtype]:
        stored = next((k for k, v in DTYPES.items() if v == e.dtype), None)
        hint = f"; pass --dtype {stored} to merge into {stored} weights" if stored else ""
        raise UsageError(f"tensor {tensor!r} is {DTYPE_NAMES[e.dtype]}, not {dtype}: the merge rounds to the "
                         f"stored dtype and never changes it{hint}", path=ckpt.root / shard, tensor=tensor)
    out_f, in_f = e.shape
    if a.shape[1] != in_f or b.shape[0] != out_f:
        hint = ""
        if t.part == "attention" and t.projection != "o_proj" and a.shape[1] != in_f:
            hint = f" (trained on hidden_size {a.shape[1]}; this checkpoint has {plan.cfg.hidden_size})"
        raise ConfigError(f"{where}: shape mismatch: B @ A is [{b.shape[0]}, {a.shape[1]}] but the checkpoint's "
                          f"weight is {list(e.shape)}{hint}: adapter for another model", path=plan.adapter.path)
    r, alpha, scaling = plan.adapter.config.scaling(module)
    if a.shape[0] != r:
        raise ConfigError(f"{where}: lora_A has rank {a.shape[0]} but the adapter config gives r={r} for this "
                          f"module (r / rank_pattern): the scale alpha/r would be wrong", path=plan.adapter.path)
    return Target(module, t.part, t.layer, tensor, shard, tuple(e.shape), e.dtype, r, alpha, scaling, scaling * scale)


def _check_complete(plan: Plan, selected: list[tuple[str, TensorName]]) -> None:
    """Raise when target_modules selects modules here that the adapter lacks: another (smaller) model."""
    aw, cfg = plan.adapter.path, plan.cfg
    missing = [(m, t) for m, t in selected if m not in plan.adapter.modules]
    if missing:
        have = sorted({t.layer for t in plan.targets})
        miss_layers = sorted({t.layer for _, t in missing})
        if have and min(miss_layers) > max(have):
            raise ConfigError(f"LoRA weights for layers {_span(have)} only, but target_modules selects layers up "
                              f"to {max(miss_layers)} of this {cfg.num_hidden_layers}-layer checkpoint: adapter for "
                              f"another model (fewer layers)", path=aw)
        raise ConfigError(f"target_modules selects {len(missing)} module(s) the adapter has no weights for, e.g. "
                          f"{missing[0][0]!r}: incomplete adapter or another model", path=aw)


def _legacy_targets(plan: Plan, dtype: str, scale: float) -> None:
    """The legacy layout's plan (one Linear per projection and per expert)."""
    acfg = plan.adapter.config
    if acfg.target_parameters:
        raise ConfigError(f"target_parameters={json.dumps(acfg.target_parameters)} is not supported on this "
                          f"layout, which has one Linear per expert projection (LoRA on fused nn.Parameter experts "
                          f"belongs to the published layout's stacked experts)", path=plan.adapter.root / ADAPTER_CONFIG)
    # 1. target_modules must select some mergeable module of this checkpoint
    selected = _selected_modules(plan)
    # 2. every adapter module is a mergeable module of this model, which target_modules selects
    for module, (a, b) in plan.adapter.modules.items():
        plan.targets.append(_target(plan, module, a, b, dtype, scale))
    # 3. modules target_modules selects here but the adapter lacks: another (smaller) model
    _check_complete(plan, selected)


def check(ckpt_dir: str | Path, adapter_spec: str | Path, *, scale: float = 1.0, dtype: str = "bf16") -> Plan:
    """Validate the adapter against the checkpoint and plan the merge; raise on anything we refuse."""
    if not (isinstance(scale, (int, float)) and math.isfinite(scale)):
        raise UsageError(f"--scale must be a finite number, got {scale!r}")
    if dtype not in DTYPES:
        raise UsageError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    ckpt = Checkpoint.open(ckpt_dir)
    headers = ckpt.headers()
    config_path = safe_child(ckpt.root, "config.json")
    config = read_json(config_path, "config.json")
    cfg = model_config(config, str(config_path))
    published = isinstance(cfg, Inkling2Config)
    adapter = open_adapter(adapter_spec)
    acfg = adapter.config
    plan = Plan(ckpt, headers, config, cfg, adapter, [], float(scale), [], read_quantization(ckpt.root, config))
    if acfg.fan_in_fan_out:
        plan.warnings.append("fan_in_fan_out=true ignored, as PEFT does for nn.Linear layers: the projections are "
                             "stored [out, in], so the delta is B @ A")
    if published:  # the published layout's names and stacked experts
        plan_targets(plan, dtype, scale)
    else:
        _legacy_targets(plan, dtype, scale)
    # 4. adapter values: finite (one tensor at a time; adapters are small beside the model)
    with ShardReader(adapter.path, adapter.header) as reader:
        for a, b in adapter.modules.values():
            read_lora(reader, a)
            read_lora(reader, b)

    if acfg.base_model:
        plan.warnings.append(f"adapter trained on {acfg.base_model!r} (base_model_name_or_path; shapes and layer "
                             f"count were checked against this checkpoint, the name is not)")
    order = {n: i for i, n in enumerate(ckpt.weight_map)}
    shard_pos = {s: i for i, s in enumerate(ckpt.shards)}
    plan.targets.sort(key=lambda t: (shard_pos[t.shard], order[t.tensor]))
    return plan


# --------------------------------------------------------------------------- merge
def _merge_into(plan: Plan, factors: ShardReader):
    """rewrite_shard's transform: a targeted weight merged (W + scale * B @ A), any other as it is."""
    targets = {t.tensor: t for t in plan.targets}

    def transform(e: TensorEntry, t: torch.Tensor) -> torch.Tensor:
        tgt = targets.get(e.name)
        if tgt is None or tgt.param is not None:  # stacked experts: merged slice by slice (published.py)
            return t
        a_e, b_e = plan.adapter.modules[tgt.adapter_module]
        merged = merged_weight(t, read_lora(factors, a_e), read_lora(factors, b_e), tgt.scale)
        if not bool(torch.isfinite(merged).all()):
            raise CheckpointError(f"tensor {e.name!r}: the merged weight has Inf/NaN (overflow of "
                                  f"{DTYPE_NAMES[e.dtype]}; is --scale too large?)", path=plan.headers[tgt.shard].path,
                                  tensor=e.name)
        return merged
    return transform


def merged_config(plan: Plan) -> dict:
    """config.json with the merge recorded under PROVENANCE_KEY (appended: merges stack)."""
    config = dict(plan.config)
    record = {
        "adapter": plan.adapter.source, "adapter_sha256": plan.adapter.sha256,
        "base_model_name_or_path": plan.adapter.config.base_model,
        "r": plan.adapter.config.r, "lora_alpha": plan.adapter.config.lora_alpha,
        "use_rslora": plan.adapter.config.use_rslora, "scale": plan.user_scale,
        "modules": len(plan.targets), "tool": f"inkling-quant {__version__}",
    }
    prior = config.get(PROVENANCE_KEY)
    config[PROVENANCE_KEY] = (list(prior) if isinstance(prior, list) else []) + [record]
    return config


def merge(ckpt_dir: str | Path, adapter_spec: str | Path, out: str | Path, *, scale: float = 1.0,
          dtype: str = "bf16", overwrite: bool = False, copy: bool = False, progress: bool = False) -> dict:
    """Write CKPT with the adapter merged to OUT; return a report."""
    plan = check(ckpt_dir, adapter_spec, scale=scale, dtype=dtype)
    ckpt, headers = plan.ckpt, plan.headers
    root = ckpt.root
    sums_in = source_checksums(root)
    rewrite = set(plan.rewrite)
    sums: dict[str, str] = {}
    counts = {"rewritten": 0, "linked": 0, "copied": 0}
    bar_total = sum(h.file_size for h in headers.values())
    with staged_output(out, [root, plan.adapter.root], overwrite) as tmp, ShardReaders(root, headers) as readers, \
            ShardReader(plan.adapter.path, plan.adapter.header) as factors, \
            tqdm(total=bar_total, unit="B", unit_scale=True, desc="lora merge", disable=not progress) as bar:
        transform = _merge_into(plan, factors)
        sliced = None
        if plan.published:
            sliced = sliced_merge(plan, factors)
        for s in ckpt.shards:
            expected = sums_in.get(s) if sums_in is not None else None
            if s in rewrite:
                digest = rewrite_shard(readers.get(s), tmp / s, transform=transform, sliced=sliced,
                                       expected=expected, bar=bar)
                counts["rewritten"] += 1
            else:
                digest, how = link_or_copy(safe_child(root, s, "shard"), tmp / s, copy, expected, False, bar)
                counts[how] += 1
            if digest is not None:
                sums[s] = digest
        write_json_atomic(tmp / "config.json", merged_config(plan))
        copy_other_files(ckpt, tmp, also=[INDEX_NAME, QUANT_CONFIG])
        if sums_in is not None:
            # the files the source lists, as OUT has them: merged shards with the writer's digest,
            # linked shards with the source's (same inode), config.json and copied files re-hashed
            carry_checksums(sums_in, tmp, sums)
    return {"action": "merge", "output": str(out), **counts, "checksums": sums_in is not None,
            **plan.summary()}
