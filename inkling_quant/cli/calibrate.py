"""`inkling-quant calibrate`: the command line of inkling_quant.calibrate."""
from __future__ import annotations

import argparse
import json

from ..calibrate import POLICIES, Options, __doc__ as DESCRIPTION
from .options import add_output_options, int_range

__all__ = ["DESCRIPTION", "add_arguments", "run"]  # DESCRIPTION: the command's --help (cli.build_parser)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="the checkpoint to calibrate (a local directory or a hub id org/name[@revision]): "
                               "BF16, or the MXFP8 release, in any naming convert reads")
    p.add_argument("out", help="the calibration file to write (OUT.json; convert --activation-scales reads it)")
    p.add_argument("--data", nargs="+", required=True, metavar="FILE",
                   help="JSONL (text, chat messages, or pre-tokenized input_ids per line) or plain-text files")
    p.add_argument("--samples", type=int_range(1, 1 << 30), help="rows to use (default: all the data gives)")
    p.add_argument("--seq-len", type=int_range(1, 1 << 24), default=2048, help="tokens per row (default 2048)")
    p.add_argument("--pack", action="store_true",
                   help="pack text samples into rows of --seq-len (EOS between them) instead of one row per "
                        "sample truncated to --seq-len")
    p.add_argument("--batch-size", type=int_range(1, 1 << 20), default=8, help="rows per micro-batch (default 8)")
    p.add_argument("--experts", choices=POLICIES, default="routed",
                   help="routed: the router's top-k tokens (an expert without any takes its layer's maximum); "
                        "all: every token through every expert for the statistics")
    p.add_argument("--scheme", default="default", help="which layers need activation scales (default: default)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]: where the weights and activations live")
    p.add_argument("--resume", action="store_true", help="go on from the last layer a stopped run finished")
    p.add_argument("--overwrite", action="store_true", help="replace OUT (and a stopped run's state)")
    add_output_options(p, report="the report (coverage, timings)", quiet="no progress bar or summary")


def run(args) -> int:
    from ..calibrate import calibrate
    from ..io.output import check_paths, write_report

    check_paths(None, [args.src, *args.data], reports=[args.json, args.out])
    quiet = args.quiet or args.json == "-"
    opts = Options(data=args.data, samples=args.samples, seq_len=args.seq_len, batch_size=args.batch_size,
                   device=args.device, experts=args.experts, scheme=args.scheme, pack=args.pack)
    r = calibrate(args.src, args.out, opts, resume=args.resume, overwrite=args.overwrite, quiet=quiet)
    write_report(args.json, json.dumps(r, indent=2) + "\n")
    if not quiet:
        print_summary(r)
    return 0


def print_summary(r: dict, rows: int = 6) -> None:
    """The run and its coverage per layer (the first and last `rows` // 2 layers where there are
    more, and every layer with a fallback; --json has them all)."""
    print(f"calibrated {r['source']} -> {r['output']}: {r['samples']} samples, {r['tokens']:,} tokens, policy "
          f"{r['policy']}, {r['layers']} layer(s) in {r['seconds']:.2f} s")
    cov = r["coverage"]
    keys = list(cov)
    shown = keys if len(keys) <= rows else [k for i, k in enumerate(keys) if i < rows // 2 or i >= len(keys) - rows // 2
                                            or cov[k]["fallback_experts"]]
    print("  layer  experts with tokens  tokens min/median/max  fallbacks")
    for i, layer in enumerate(shown):
        if i and keys.index(layer) != keys.index(shown[i - 1]) + 1:
            print("    ...")
        c, fb = cov[layer], cov[layer]["fallback_experts"]
        span = f"{c['tokens_min']}/{c['tokens_median']:g}/{c['tokens_max']}"
        print(f"  {layer:>5}  {c['experts_with_tokens']:>6} of {c['experts']:<12} {span:<22} "
              f"{len(fb)}{' (' + ', '.join(map(str, fb[:8])) + (', ...' if len(fb) > 8 else '') + ')' if fb else ''}")
    total = sum(len(c["fallback_experts"]) for c in cov.values())
    print(f"  {len(keys)} layer(s); experts without a token (their layer's maximum taken): {total}")
