"""Number formats, looked up by name: the single source of truth for every bit we write."""
from __future__ import annotations

from .base import Format, OutSpec, Passthrough
from .mxfp8 import MXFP8
from .nvfp4 import NVFP4

FORMATS: dict[str, Format] = {f.name: f for f in (NVFP4(), MXFP8(), Passthrough())}


def get_format(name: str) -> Format:
    try:
        return FORMATS[name]
    except KeyError:
        raise KeyError(f"unknown format {name!r}; known: {sorted(FORMATS)}") from None


__all__ = ["FORMATS", "Format", "OutSpec", "Passthrough", "NVFP4", "MXFP8", "get_format"]
