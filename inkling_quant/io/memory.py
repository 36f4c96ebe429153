"""Keep freed memory in the process for reuse (glibc's malloc), so that each expert's large
temporaries (an MXFP8 slab dequantized to fp32: 85 MB at the real shapes; the quantizers'
outputs) do not come back as fresh pages every time. By default glibc serves blocks above
32 MB with mmap and unmaps them on free; the next one then page-faults every page again, which
on the VMs these figures come from costs more than the arithmetic (MXFP8 dequantize of a
[4608, 4608] slab: 0.97 -> 3.5 GB/s with this, docs/benchmarks.md). Peak memory is unchanged:
what is kept is what the process already used. A no-op where mallopt is not available."""
from __future__ import annotations

import ctypes
import ctypes.util

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3   # glibc's mallopt parameters (malloc.h)
_KEEP = 1 << 30
_done = False


def keep_freed_memory() -> None:
    """Serve allocations up to 1 GB from the heap and keep up to 1 GB freed at its top (once per
    process)."""
    global _done
    if _done:
        return
    _done = True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, _KEEP)
        libc.mallopt(_M_TRIM_THRESHOLD, _KEEP)
    except (OSError, AttributeError):  # not glibc (musl, macOS): their allocators decide
        pass
