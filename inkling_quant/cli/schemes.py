"""`inkling-quant schemes`: the scheme table (inkling_quant.schemes), or a scheme file's rules."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..io.output import check_paths, write_report
from ..model.inkling2 import Inkling2Config
from ..schemes import SCHEMES, __doc__ as DESCRIPTION, get_scheme
from .options import add_output_options

__all__ = ["DESCRIPTION", "add_arguments", "run"]  # DESCRIPTION: the command's --help (cli.build_parser)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="config.json (or checkpoint dir) whose layer count to use; default: the reference config")
    p.add_argument("--scheme", help="show only this scheme: a built-in name or a scheme file (.json/.toml)")
    add_output_options(p, report="the tables", quiet="print no table")


def run(args) -> int:
    check_paths(None, [args.config], reports=[args.json])
    cfg = _config(args.config) if args.config else Inkling2Config.reference()
    schemes = {args.scheme: get_scheme(args.scheme)} if getattr(args, "scheme", None) else SCHEMES
    tables = {name: s.table(cfg) for name, s in schemes.items()}
    write_report(args.json, json.dumps(tables, indent=2) + "\n")
    if args.quiet or args.json == "-":
        return 0
    print(f"{'scheme':<9} {'part':<16} {'layers':<8} {'format':<12} quant_algo")
    for name, rows in tables.items():
        for r in rows:
            print(f"{name:<9} {r['part']:<16} {r['layers']:<8} {r['format']:<12} {r['quant_algo'] or '-'}")
    return 0


def _config(path: str):
    """The layer count's source: a config.json (or a checkpoint directory holding one)."""
    from ..errors import ConfigError
    from ..io.checkpoint import CONFIG_NAME, read_json, safe_child
    from ..model.layout import model_config

    p = Path(path)
    p = safe_child(p, CONFIG_NAME) if p.is_dir() else p
    return model_config(read_json(p, CONFIG_NAME, ConfigError), str(p))

