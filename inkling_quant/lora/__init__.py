"""LoRA: merge a PEFT adapter into the BF16 attention projections (and BF16 routed experts) of a checkpoint.

  inkling-quant lora check CKPT ADAPTER          what would be merged where (module, shard,
                                                 rank, alpha, scale); writes nothing
  inkling-quant lora merge CKPT ADAPTER OUT      OUT = CKPT with W' = W + scale * B @ A merged
                                                 into every module the adapter targets

CKPT is a converted checkpoint (NVFP4/MXFP8 routed experts, BF16 attention; ours or ModelOpt's
export) or a BF16 source: Inkling 2 (inkling2.py) or a Hugging Face MoE family (layout.py:
Qwen3-MoE, Mixtral, DeepSeek-V3, Qwen3-VL-MoE, ...). ADAPTER is a PEFT LoRA adapter directory
(adapter_config.json + adapter_model.safetensors) or a hub repo id org/name[@revision], as PEFT
writes it for the transformers model, routed experts via target_parameters (lora/plan.py: which
module merges where; lora/inkling.py and lora/hf.py: the layouts' names). The merge is computed
in FP32 and rounded once to the stored dtype. Routed-expert adapters are merged only where the
experts are BF16 (a source, before conversion): "expert adapters need BF16 expert weights". Only shards holding
a merged tensor are rewritten; the others are hardlinked (or copied). OUT is built in
OUT.partial and renamed into place when complete. docs/lora.md has the workflow and the
reasons for every refusal.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..errors import InklingQuantError
from ..io.output import check_paths, read_checksums, write_report
from .merge import DTYPES, PROVENANCE_KEY, QUANT_CONFIG, Plan, Target, check, merge, merged_config, merged_weight
from .peft import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, PATTERN_TIMEOUT_S, PEFT_PREFIX, Adapter, AdapterConfig,
                   open_adapter, resolve_adapter)
from .inkling import MERGEABLE_PARTS

# The library API, as `inkling_quant.lora` offered it when it was one module (read_checksums too:
# callers and tests read OUT's checksums through it).
__all__ = [
    "ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "DTYPES", "MERGEABLE_PARTS", "PATTERN_TIMEOUT_S", "PEFT_PREFIX",
    "PROVENANCE_KEY", "QUANT_CONFIG", "Adapter", "AdapterConfig", "Plan", "Target", "add_arguments", "check",
    "merge", "merged_config", "merged_weight", "open_adapter", "print_plan", "read_checksums",
    "resolve_adapter", "run",
]


# --------------------------------------------------------------------------- CLI
def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    c = sub.add_parser("check", help="report what would be merged where, without writing",
                       description="Validate ADAPTER against CKPT and list every module it would merge: "
                                   "module, shard, rank, alpha, scale. Exit 0 when the merge would succeed.")
    m = sub.add_parser("merge", help="merge a PEFT LoRA adapter into the checkpoint's BF16 attention projections",
                       description="Write CKPT with ADAPTER merged (W' = W + scale * B @ A, FP32, rounded once) to OUT; "
                                   "shards without a merged tensor are hardlinked (or copied with --copy).")
    for q in (c, m):
        q.add_argument("ckpt", help="checkpoint directory: converted (NVFP4/MXFP8 experts; ours or ModelOpt's) or a "
                                    "BF16 source, of Inkling 2 or a Hugging Face MoE family")
        q.add_argument("adapter", help="PEFT adapter directory (adapter_config.json + adapter_model.safetensors) "
                                       "or hub repo id org/name[@revision]")
    m.add_argument("out", help="output directory (built in OUT.partial, renamed when complete)")
    for q in (c, m):
        q.add_argument("--scale", type=float, default=1.0,
                       help="multiplies the adapter's own scale (lora_alpha/r, or /sqrt(r) with rsLoRA); default 1")
        q.add_argument("--dtype", default="bf16", choices=sorted(DTYPES),
                       help="dtype of the merged projections: must be the stored dtype, which the merge keeps "
                            "(default bf16)")
        q.add_argument("--json", metavar="REPORT", help="write the plan/report as JSON to REPORT ('-' for stdout)")
        q.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    m.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    m.add_argument("--copy", action="store_true", help="copy unchanged shards instead of hardlinking them")


def print_plan(s: dict) -> None:
    rs = " (rsLoRA: alpha/sqrt(r))" if s["use_rslora"] else ""
    print(f"adapter {s['adapter']}: LoRA r={s['r']} alpha={s['lora_alpha']}{rs}, --scale {s['user_scale']:g}")
    for w in s["warnings"]:
        print(f"  note: {w}")
    parts = ", ".join(f"{n} {p}" for p, n in s["by_part"].items() if n)
    print(f"{s['modules']} module(s) ({parts}) into {s['checkpoint']}: {s['shards_rewritten']} shard(s) rewritten, "
          f"{s['shards_unchanged']} unchanged")
    rows: dict[str, list[dict]] = {}  # module -> its tensors (several: an expert parameter stored per expert)
    for t in s["targets"]:
        rows.setdefault(t["module"], []).append(t)
    width = max(len(m) for m in rows)
    swidth = max(len(t["shard"]) for t in s["targets"])
    print(f"  {'module':<{width}}  {'shard':<{swidth}}  {'rank':>4}  {'alpha':>7}  {'scale':>10}")
    for module, ts in rows.items():
        t, more = ts[0], f"  ({len(ts)} tensors, per expert)" if len(ts) > 1 else ""
        print(f"  {module:<{width}}  {t['shard']:<{swidth}}  {t['rank']:>4}  {t['alpha']:>7g}  {t['scale']:>10.6g}{more}")


def run(args) -> int:
    quiet = args.quiet or args.json == "-"
    check_paths(getattr(args, "out", None), [args.ckpt, args.adapter if Path(args.adapter).exists() else None],
                reports=[args.json])
    if args.action == "check":
        plan = check(args.ckpt, args.adapter, scale=args.scale, dtype=args.dtype)
        report = {"action": "check", **plan.summary()}
        if not quiet:
            print_plan(report)
    elif args.action == "merge":
        report = merge(args.ckpt, args.adapter, args.out, scale=args.scale, dtype=args.dtype,
                       overwrite=args.overwrite, copy=args.copy, progress=not quiet)
        if not quiet:
            print_plan(report)
            print(f"merged into {report['output']}: {report['rewritten']} shard(s) rewritten, {report['linked']} "
                  f"linked, {report['copied']} copied" + ("" if report["checksums"] else
                                                           " (source had no checksums.sha256: none written)"))
    else:  # pragma: no cover - argparse refuses other actions
        raise InklingQuantError(f"unknown action {args.action!r}")
    write_report(args.json, json.dumps(report, indent=2) + "\n")
    return 0
