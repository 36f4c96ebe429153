"""`inkling-quant inspect`: the command line of inkling_quant.inspect_cmd."""
from __future__ import annotations

import argparse
import json

from ..inspect_cmd import __doc__ as DESCRIPTION, render, summarize
from ..io.output import check_paths, write_report
from .options import add_output_options

__all__ = ["DESCRIPTION", "add_arguments", "run"]  # DESCRIPTION: the command's --help (cli.build_parser)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="a local checkpoint directory or a hub repo id org/name[@revision] (its "
                   "headers read over HTTP: no shard is downloaded)")
    add_output_options(p, report="the summary", quiet="print nothing (the exit code says whether it is clean)")


def run(args) -> int:
    check_paths(None, [args.checkpoint], reports=[args.json])
    s = summarize(args.checkpoint)
    write_report(args.json, json.dumps(s.to_dict(), indent=2) + "\n")
    if not (args.quiet or args.json == "-"):
        print(render(s))
    return 0 if s.ok else 1

