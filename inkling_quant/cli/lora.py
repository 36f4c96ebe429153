"""`inkling-quant lora check|merge`: the command line of inkling_quant.lora."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..errors import InklingQuantError
from ..io.output import check_paths, write_report
from ..lora import DTYPES, __doc__ as DESCRIPTION, check, merge
from .options import add_output_options

__all__ = ["DESCRIPTION", "add_arguments", "run"]  # DESCRIPTION: the command's --help (cli.build_parser)


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
        add_output_options(q, report="the plan/report", quiet="no progress bar or summary")
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

