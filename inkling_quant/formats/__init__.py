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


def value_violation(x, rule: str | None):
    """(flat index, the value as shown) of the first element of tensor `x` its value rule
    (VALUE_RULES' key, or None: finite only) refuses, or None. Every float dtype is held to
    finiteness on its bits (an e4m3 NaN byte, an e8m0 255); "e8m0" holds uint8 exponent bytes to
    not 0xFF; "positive" and "nonnegative" hold scales. What verify's values[F] and convert's
    copies of a quantized source's tensors ask alike (one pass; on a failure, a second)."""
    import torch

    if x.dtype == torch.uint8 or x.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu):
        b = x.contiguous().view(torch.uint8).reshape(-1)
        if x.dtype == torch.float8_e4m3fn:
            bad = {"positive": (b - 1) > 0x7D, "nonnegative": b > 0x7E}.get(rule, (b & 0x7F) == 0x7F)
        elif x.dtype == torch.float8_e8m0fnu or rule == "e8m0":
            bad = b == 0xFF
        else:
            return None  # codes: any byte
    elif x.dtype.is_floating_point:
        f = x.reshape(-1).float()
        bad = ~torch.isfinite(f)
        if rule == "positive":
            bad |= ~(f >= MIN_INVERTIBLE_SCALE)
        elif rule == "nonnegative":
            bad |= f < 0
    else:
        return None
    if not bool(bad.any()):
        return None
    idx = int(bad.nonzero()[0, 0])
    v = x.reshape(-1)[idx]
    shown = f"0x{int(v.view(torch.uint8)):02X}" if v.dtype in (torch.uint8, torch.float8_e4m3fn,
                                                                 torch.float8_e8m0fnu) else f"{float(v)}"
    if v.dtype == torch.float8_e4m3fn:
        shown += f" ({float(v.float())})"
    return idx, shown


def source_value_rule(layout, name: str) -> str | None:
    """The value rule (VALUE_RULES' key) a quantized source's format puts on its stored tensor
    `name` (the layout's `owner` / `source_format` say which weight and format): FP8 block scales
    finite and positive, MXFP4's e8m0 bytes not 0xFF; None for the weight's own bytes (its dtype's
    finiteness) and for a float tensor."""
    own = layout.owner(name)
    weight, suffix = own if own is not None else (name, "weight")
    fmt = layout.source_format(weight)
    return None if fmt is None else get_format(fmt, source=True).value_rule(suffix)


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
           "detect", "format_for_quant_algo", "get_format", "source_value_rule", "value_violation"]
