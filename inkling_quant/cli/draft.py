"""`inkling-quant draft extract|strip`: the command line of inkling_quant.draft."""
from __future__ import annotations

import argparse
import json

from ..draft import DEFAULT_MAX_SHARD_BYTES, __doc__ as DESCRIPTION, extract, strip
from ..errors import InklingQuantError
from ..io.output import check_paths, write_report
from .options import add_output_options, parse_size

__all__ = ["DESCRIPTION", "add_arguments", "run"]  # DESCRIPTION: the command's --help (cli.build_parser)


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    e = sub.add_parser("extract", help="write the bundled DSpark drafter as a standalone checkpoint",
                       description="Write the `mtp.*` tensors of SRC (its mtp.safetensors), with a drafter "
                                   "config.json, to OUT.")
    e.add_argument("src", help="source checkpoint directory (BF16 or converted)")
    e.add_argument("out", help="output directory for the drafter")
    e.add_argument("--max-shard-size", type=parse_size, default=DEFAULT_MAX_SHARD_BYTES,
                   help="largest output shard, e.g. 5GB (default: 5GB, one shard for the reference draft)")
    s = sub.add_parser("strip", help="write the target checkpoint without its DSpark draft",
                       description="Write SRC without `mtp.*` tensors (mtp.safetensors) and without dspark_config "
                                   "to OUT; "
                                   "shards holding no draft tensor are hardlinked (or copied with --copy).")
    s.add_argument("src", help="source checkpoint directory (BF16 or converted)")
    s.add_argument("out", help="output directory for the target without the draft")
    s.add_argument("--copy", action="store_true",
                   help="copy unchanged shards instead of hardlinking them (checks them against checksums.sha256)")
    for q in (e, s):
        q.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
        add_output_options(q, report="the report", quiet="no progress bar or summary")


def run(args) -> int:
    check_paths(args.out, [args.src], reports=[args.json])
    progress = not (args.quiet or args.json == "-")
    if args.action == "extract":
        r = extract(args.src, args.out, overwrite=args.overwrite, progress=progress,
                    max_shard_bytes=args.max_shard_size)
        if progress:
            print(f"extracted {r['tensors']} draft tensors ({r['bytes'] / 1e9:.3f} GB, {r['shards']} shard(s)) "
                  f"to {r['output']}; shared with the target by reference: {', '.join(r['shared_by_reference'])}")
    elif args.action == "strip":
        r = strip(args.src, args.out, overwrite=args.overwrite, progress=progress, copy=args.copy)
        if progress:
            print(f"stripped {r['tensors_removed']} draft tensors ({r['bytes_removed'] / 1e9:.3f} GB) to "
                  f"{r['output']}: {r['shards']} shard(s): {r['linked']} linked, {r['copied']} copied, "
                  f"{r['rewritten']} rewritten, {r['dropped']} dropped")
    else:  # pragma: no cover - argparse refuses other actions
        raise InklingQuantError(f"unknown action {args.action!r}")
    write_report(args.json, json.dumps(r, indent=2) + "\n")
    return 0

