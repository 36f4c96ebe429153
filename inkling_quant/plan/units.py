"""The units the plans count in, and the rounding-up division every split and page uses: a module
of its own so that placement, kvcache and moe_checks share it without importing one another."""
from __future__ import annotations

GiB = 1 << 30
MiB = 1 << 20
GB = 10 ** 9


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


UNIT_BYTES = {"GiB": GiB, "GB": GB}


def in_units(n: int, unit: str) -> str:
    """`n` bytes as the plan prints them, two decimals and no unit name: GiB as vLLM's `format_gib`
    prints them (so a verdict reads like vLLM's own message), GB decimal as the recipe states them."""
    return f"{n / UNIT_BYTES[unit]:.2f}"
