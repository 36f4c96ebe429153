"""Byte units and their printing, for every command and report."""
from __future__ import annotations

GiB = 1 << 30
MiB = 1 << 20
GB = 10 ** 9


def cdiv(a: int, b: int) -> int:
    """Division rounding up (splits, pages, blocks)."""
    return -(-a // b)


def human_bytes(n: float, digits: int = 1) -> str:
    """1234567 -> '1.2 MB' (decimal units, as disks and `ls -h --si` count)."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.{digits}f} {unit}"
        n /= 1000
    return str(n)  # pragma: no cover - the loop returns at TB
