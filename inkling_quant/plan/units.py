"""How the plans print byte counts (the units themselves: inkling_quant.units)."""
from __future__ import annotations

from ..units import GB, GiB

UNIT_BYTES = {"GiB": GiB, "GB": GB}


def in_units(n: int, unit: str) -> str:
    """`n` bytes as the plan prints them, two decimals and no unit name: GiB as vLLM's `format_gib`
    prints them (so a verdict reads like vLLM's own message), GB decimal as the recipe states them."""
    return f"{n / UNIT_BYTES[unit]:.2f}"
