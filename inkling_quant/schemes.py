"""Conversion schemes: which tensors become which number format. A scheme is data, a list of
rules over the layout's parts and layer ranges; everything no rule names passes through
bit-exact. Layer ranges are fractions of the config's layer count, so the default scheme's
"NVFP4 for layers 0-39, MXFP8 for 40-47" holds for 48 layers and scales with other depths."""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from fractions import Fraction

from .errors import UsageError
from .formats import FORMATS, Format
from .io.output import check_paths, write_report
from .layout import ModelConfig, TensorName


@dataclass(frozen=True)
class Rule:
    part: str
    start: Fraction  # first layer, as a fraction of num_hidden_layers
    stop: Fraction   # one past the last layer, likewise
    format: str

    def layers(self, n_layers: int) -> range:
        return range(round(self.start * n_layers), round(self.stop * n_layers))


@dataclass(frozen=True)
class Scheme:
    name: str
    description: str
    rules: tuple[Rule, ...]

    def format_name(self, cfg: ModelConfig, t: TensorName) -> str:
        for r in self.rules:
            if r.part == t.part and t.layer is not None and t.layer in r.layers(cfg.num_hidden_layers):
                return r.format
        return "passthrough"

    def format_for(self, cfg: ModelConfig, t: TensorName) -> Format:
        return FORMATS[self.format_name(cfg, t)]

    def table(self, cfg: ModelConfig) -> list[dict]:
        rows = [{"part": r.part, "layers": _span(r.layers(cfg.num_hidden_layers)), "format": r.format,
                 "quant_algo": FORMATS[r.format].quant_algo} for r in self.rules]
        rows.append({"part": "everything else", "layers": "all", "format": "passthrough", "quant_algo": None})
        return rows


def _span(r: range) -> str:
    return f"{r.start}-{r.stop - 1}" if len(r) else "none"


F = Fraction
SCHEMES: dict[str, Scheme] = {s.name: s for s in (
    Scheme("default", "the serving recipe: routed experts NVFP4 in the first 5/6 of layers, MXFP8 in the rest",
           (Rule("expert", F(0), F(5, 6), "nvfp4"), Rule("expert", F(5, 6), F(1), "mxfp8"))),
    Scheme("nvfp4", "every routed expert NVFP4", (Rule("expert", F(0), F(1), "nvfp4"),)),
    Scheme("mxfp8", "every routed expert MXFP8", (Rule("expert", F(0), F(1), "mxfp8"),)),
    Scheme("none", "nothing quantized: every tensor passes through (an unquantized checkpoint; the copy floor)",
           ()),
)}


def get_scheme(name: str) -> Scheme:
    try:
        return SCHEMES[name]
    except KeyError:
        raise UsageError(f"unknown scheme {name!r}; known: {', '.join(SCHEMES)}") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="config.json (or checkpoint dir) whose layer count to use; default: the reference config")
    p.add_argument("--json", metavar="FILE", help="also write the tables as JSON to FILE ('-': standard output only)")
    p.add_argument("--quiet", action="store_true", help="print no table")


def run(args) -> int:
    check_paths(None, [args.config], reports=[args.json])
    cfg = ModelConfig.load(args.config) if args.config else ModelConfig.reference()
    tables = {name: s.table(cfg) for name, s in SCHEMES.items()}
    write_report(args.json, json.dumps(tables, indent=2) + "\n")
    if args.quiet or args.json == "-":
        return 0
    print(f"{'scheme':<9} {'part':<16} {'layers':<8} {'format':<12} quant_algo")
    for name, rows in tables.items():
        for r in rows:
            print(f"{name:<9} {r['part']:<16} {r['layers']:<8} {r['format']:<12} {r['quant_algo'] or '-'}")
    return 0
