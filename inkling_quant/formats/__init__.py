"""Number formats, looked up by name: the single source of truth for every bit we write (FORMATS)
and for the source formats we only read (SOURCE_FORMATS)."""
from __future__ import annotations

from . import transcode
from .base import MIN_INVERTIBLE_SCALE, TRANSCODERS, Format, OutSpec, Passthrough, invertible
from .fp8_block import FP8Block
from .mxfp4 import MXFP4, MXFP4Rows
from .mxfp8 import MXFP8
from .nvfp4 import NVFP4

FORMATS: dict[str, Format] = {f.name: f for f in (NVFP4(), MXFP8(), Passthrough())}
#: formats only ever read from a source (`Format.source_only`), kept out of FORMATS: everything
#: that iterates FORMATS (schemes, detect, value_rules, SCALE_SUFFIXES, quant_algo lookups, verify)
#: is about what we write
SOURCE_FORMATS: dict[str, Format] = {f.name: f for f in (FP8Block(), MXFP4(), MXFP4Rows())}

#: every suffix a quantized module adds beside `weight` (the tensor-name vocabulary of the formats)
SCALE_SUFFIXES: tuple[str, ...] = tuple(dict.fromkeys(s for f in FORMATS.values() for s in f.suffixes
                                                      if s != "weight"))
#: every value rule a format may name (`Format.value_rule`): what verify checks the bytes for
VALUE_RULES = {"positive": "finite and positive, with a finite fp32 reciprocal (a scale)",
               "nonnegative": "finite and >= 0 (a block scale the release's rule rounds to 0 where the block is ~0)",
               "e8m0": "e8m0 exponent in range (not 0xFF)"}


def format_for_quant_algo(quant_algo, *, source: bool = False) -> Format | None:
    """The format a ModelOpt `quant_algo` string names (NVFP4, W4A16_NVFP4, MXFP8; with `source`
    also a source format written as it is stored: fp8_pb_wo, FP8Block), or None."""
    known = [*FORMATS.values(), *SOURCE_FORMATS.values()] if source else FORMATS.values()
    return next((f for f in known if quant_algo in f.quant_algos), None)


def detect(observed, shape: tuple[int, ...], dtype) -> Format | None:
    """The format whose tensors a module holds (suffix -> (shape, dtype)) for a source weight of
    `shape`/`dtype`, or None when no format writes exactly those."""
    return next((f for f in FORMATS.values() if f.matches(observed, shape, dtype)), None)


def get_format(name: str, *, source: bool = False) -> Format:
    """The format called `name`: one we write, or with `source` also one we only read."""
    known = {**FORMATS, **SOURCE_FORMATS} if source else FORMATS
    try:
        return known[name]
    except KeyError:
        raise KeyError(f"unknown format {name!r}; known: {sorted(known)}") from None


__all__ = ["FORMATS", "Format", "MIN_INVERTIBLE_SCALE", "OutSpec", "Passthrough", "NVFP4", "MXFP8", "SCALE_SUFFIXES",
           "VALUE_RULES", "invertible", "SOURCE_FORMATS", "FP8Block", "MXFP4", "MXFP4Rows", "TRANSCODERS", "transcode",
           "detect", "format_for_quant_algo", "get_format"]
