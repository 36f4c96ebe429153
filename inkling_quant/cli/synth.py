"""`inkling-quant synth`: the command line of inkling_quant.synth."""
from __future__ import annotations

import argparse
import json

from ..io.output import check_paths, write_report
from ..synth import PRESETS, SEED_MAX, __doc__ as DESCRIPTION, write_checkpoint
from .options import add_output_options, int_range, parse_size

__all__ = ["DESCRIPTION", "add_arguments", "run"]  # DESCRIPTION: the command's --help (cli.build_parser)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("out", help="output directory")
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--layers", type=int_range(1, 4096), help="number of decoder layers (default: the preset's)")
    p.add_argument("--experts", type=int_range(1, 65536), help="routed experts per layer (default: the preset's)")
    p.add_argument("--seed", type=int_range(0, SEED_MAX), default=0)
    p.add_argument("--max-shard-size", type=parse_size,
                   help="cut a layer's shard further when over this, e.g. 1MB, 5GB (default: one shard per layer)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    add_output_options(p, report="a JSON summary", quiet="no progress bar or summary")


def run(args) -> int:
    check_paths(args.out, reports=[args.json])
    quiet = args.quiet or args.json == "-"
    out = write_checkpoint(args.out, args.preset, args.seed, args.layers, args.experts,
                           args.max_shard_size, progress=not quiet, overwrite=args.overwrite)
    write_report(args.json, json.dumps({"output": str(out), "preset": args.preset, "seed": args.seed}, indent=2) + "\n")
    if not quiet:
        print(f"wrote {out}")
    return 0

