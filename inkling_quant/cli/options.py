"""Option types shared by every command: each numeric option is range-checked when it is parsed,
so a value like `nan`, `inf`, `1e308` or `2**80` ends in argparse's usage error (exit 2), never
in a traceback deep inside a command; and the one spelling of `--quiet` and `--json FILE|-`.
Light: no torch import."""
from __future__ import annotations

import argparse
import math

_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30,
          "TIB": 2**40, "B": 1}
MAX_SIZE = 2**50  # 1 PiB: past any shard size a file system takes


def parse_size(text: str) -> int:
    """'5GB', '500MB', '4GiB', '1000000' -> bytes: a positive integer up to 1 PiB."""
    t = text.strip().upper()
    number, mult = t, 1
    for u, m in sorted(_UNITS.items(), key=lambda kv: -len(kv[0])):
        if t.endswith(u):
            number, mult = t[: -len(u)], m
            break
    try:
        value = float(number) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 5GB, 500MB)") from None
    if not (math.isfinite(value) and 1 <= value <= MAX_SIZE):
        raise argparse.ArgumentTypeError(f"size {text!r} must be between 1 byte and 1 PiB")
    return int(value)


def int_range(lo: int, hi: int):
    """An integer option in [lo, hi]."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"{text} is out of range: must be between {lo} and {hi}")
        return v
    parse.__name__ = "integer"  # argparse names the type in its messages
    return parse


def float_range(lo: float, hi: float, *, lo_open: bool = False):
    """A finite float option in [lo, hi] (or (lo, hi] with `lo_open`)."""
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not (math.isfinite(v) and (v > lo if lo_open else v >= lo) and v <= hi):
            raise argparse.ArgumentTypeError(f"{text} is out of range: must be {'>' if lo_open else '>='} {lo:g} "
                                             f"and <= {hi:g}")
        return v
    parse.__name__ = "number"
    return parse


positive_float = float_range(0.0, 3.0e38, lo_open=True)  # finite, > 0, and representable in fp32


def device(text: str) -> str:
    """--device: `cpu`, `cuda` or `cuda:N` (what the converter and the kernels run on)."""
    kind, sep, index = text.partition(":")
    if (kind == "cpu" and not sep) or (kind == "cuda" and (not sep or (index.isascii() and index.isdigit()))):
        return text
    raise argparse.ArgumentTypeError(f"{text!r}: expected cpu, cuda or cuda:N")


def add_output_options(p: argparse.ArgumentParser, report: str = "the summary",
                       quiet: str = "no progress bars or summary") -> None:
    """`--quiet` and `--json FILE|-`, with one meaning in every command: `--json -` writes the
    report to standard output (and nothing else there), a file is written atomically."""
    p.add_argument("--quiet", action="store_true", help=quiet)
    p.add_argument("--json", metavar="REPORT", help=f"write {report} as JSON to REPORT ('-': standard output)")

