"""`lora check` and `lora merge` against a checkpoint: the plan (which tensor of which shard
each adapter module merges into, at what scale, and every refusal that depends on the
checkpoint) and the merge, a checkpoint derived with `io.derive`: shards holding a merged tensor
rewritten, the others hardlinked (or copied), checksums carried over."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from .. import __version__
from ..errors import UsageError
from ..export.modelopt import read_quantization
from ..model.sources import source_quant
from ..io.checkpoint import HF_QUANT_CONFIG, INDEX_NAME, MERGE_RECORD_KEY, Checkpoint, read_json, safe_child, write_json_atomic
from ..io.derive import carry_checksums, copy_other_files, rewrite_shard, source_checksums
from ..io.output import link_or_copy, staged_output
from ..io.safetensors import Header, ShardReader, TensorEntry
from ..io.shards import ShardReaders
from ..model.families import INKLING2
from ..model.inkling2 import Inkling2Config
from ..model.layout import MoEConfig, max_tensors, model_config
from .hf import HFNaming
from .inkling import Inkling2Naming
from .plan import Factors, finite_merge, plan_targets, sliced_merge
from .target import DTYPES, Target, merged_expert, merged_weight
from .peft import Adapter, open_adapter, read_lora

QUANT_CONFIG = HF_QUANT_CONFIG
NAMINGS = {INKLING2: Inkling2Naming}  # a family's own adapter naming; every other family's is HFNaming (lora/hf.py)
DELTA_LIMIT = float(torch.finfo(torch.bfloat16).max) / 2  # a merged weight W + delta stays finite in BF16
PROVENANCE_KEY = MERGE_RECORD_KEY       # config.json: the adapters merged into this checkpoint


# --------------------------------------------------------------------------- plan
@dataclass
class Plan:
    ckpt: Checkpoint
    headers: dict[str, Header]
    config: dict
    cfg: Inkling2Config | MoEConfig
    naming: Inkling2Naming | HFNaming  # the layout's side of the plan (lora/plan.py)
    adapter: Adapter
    targets: list[Target]
    user_scale: float
    warnings: list[str]
    quantization: dict | None = None  # what the checkpoint declares (export.read_quantization)

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
            "modules": len({t.module for t in self.targets}), "tensors": len(self.targets),
            "by_part": {p: len({t.module for t in self.targets if t.part == p}) for p in self.naming.parts},
            "shards_rewritten": len(self.rewrite), "shards_unchanged": len(self.ckpt.shards) - len(self.rewrite),
            "warnings": self.warnings, "targets": [t.row() for t in self.targets],
        }


def check(ckpt_dir: str | Path, adapter_spec: str | Path, *, scale: float = 1.0, dtype: str = "bf16") -> Plan:
    """Validate the adapter against the checkpoint and plan the merge; raise on anything we refuse."""
    if not (isinstance(scale, (int, float)) and math.isfinite(scale)):
        raise UsageError(f"--scale must be a finite number, got {scale!r}")
    if dtype not in DTYPES:
        raise UsageError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    ckpt = Checkpoint.open(ckpt_dir)
    config_path = safe_child(ckpt.root, "config.json")
    config = read_json(config_path, "config.json")
    quantized = source_quant(config, str(config_path))
    if quantized is not None:  # the projections a LoRA targets are stored quantized (FP8), or the experts (MXFP4)
        first = ("`inkling-quant convert` writes its routed experts NVFP4/MXFP8 under a ModelOpt config, its "
                 "BF16 tensors as they are" if quantized.experts_only else
                 "`inkling-quant convert --dequantize-fp8` writes its attention BF16, where the output form allows "
                 "it: not DeepSeek-V4's")
        raise UsageError(f"the base checkpoint is a quantized source ({quantized.describe()}): lora merge adds a "
                         f"BF16 delta to BF16 weights and reads the quantization configs ModelOpt writes, not "
                         f"{quantized.method!r}'s. Convert it first ({first}) and merge into the converted checkpoint",
                         path=config_path)
    cfg = model_config(config, str(config_path))
    headers = ckpt.headers(max_tensors(cfg))  # the config's bound, before any header's entries are built
    naming = NAMINGS[cfg.family](cfg, ckpt.weight_map) if cfg.family in NAMINGS else \
        HFNaming(cfg, ckpt.weight_map, headers, str(ckpt.root))
    adapter = open_adapter(adapter_spec)
    plan = Plan(ckpt, headers, config, cfg, naming, adapter, [], float(scale), [],
                read_quantization(ckpt.root, config))
    if adapter.config.fan_in_fan_out:
        plan.warnings.append("fan_in_fan_out=true ignored, as PEFT does for nn.Linear layers: the projections are "
                             "stored [out, in], so the delta is B @ A")
    plan_targets(plan, dtype, scale)
    # adapter values: finite, and a delta that stays in the checkpoint dtype's range (one module at a time;
    # adapters are small beside the model): |scale * B @ A| <= |scale| * r * max|B| * max|A|
    scales = {}
    for t in plan.targets:
        scales[t.adapter_module] = max(scales.get(t.adapter_module, 0.0), abs(t.scale) * t.rank)
    with ShardReader(adapter.path, adapter.header) as reader:
        for module, (a, b) in adapter.modules.items():
            bound = scales.get(module, 0.0) * float(read_lora(reader, a).abs().max()) * float(read_lora(reader, b).abs().max())
            if not bound <= DELTA_LIMIT:
                raise UsageError(f"module {module!r}: its delta scale * B @ A can reach {bound:.3g}, past what the "
                                 f"checkpoint's BF16 holds ({DELTA_LIMIT:.3g}): lora_alpha or --scale too large?",
                                 path=adapter.path)

    if adapter.config.base_model:
        plan.warnings.append(f"adapter trained on {adapter.config.base_model!r} (base_model_name_or_path; shapes and "
                             f"layer count were checked against this checkpoint, the name is not)")
    order = {n: i for i, n in enumerate(ckpt.weight_map)}
    shard_pos = {s: i for i, s in enumerate(ckpt.shards)}
    plan.targets.sort(key=lambda t: (shard_pos[t.shard], order[t.tensor]))
    return plan


# --------------------------------------------------------------------------- merge
def _merge_into(plan: Plan, factors: Factors):
    """rewrite_shard's transform: a targeted weight merged (W + scale * B @ A; a per-expert tensor
    its expert's delta), any other as it is."""
    targets = {t.tensor: t for t in plan.targets}

    def transform(e: TensorEntry, t: torch.Tensor) -> torch.Tensor:
        tgt = targets.get(e.name)
        if tgt is None or tgt.sliced:  # stacked experts: merged slice by slice (plan.sliced_merge)
            return t
        a, b = factors(tgt)
        merged = merged_weight(t, a, b, tgt.scale) if tgt.param is None else merged_expert(t, a, b, tgt, tgt.expert)
        return finite_merge(merged, e.name, "", e.dtype, plan.headers[tgt.shard].path)
    return transform


def merged_config(plan: Plan) -> dict:
    """config.json with the merge recorded under PROVENANCE_KEY (appended: merges stack)."""
    config = dict(plan.config)
    record = {
        "adapter": plan.adapter.source, "adapter_sha256": plan.adapter.sha256,
        "base_model_name_or_path": plan.adapter.config.base_model,
        "r": plan.adapter.config.r, "lora_alpha": plan.adapter.config.lora_alpha,
        "use_rslora": plan.adapter.config.use_rslora, "scale": plan.user_scale,
        "modules": len({t.module for t in plan.targets}), "tool": f"inkling-quant {__version__}",
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
        reads = Factors(plan, factors)
        transform, sliced = _merge_into(plan, reads), sliced_merge(plan, reads)
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
