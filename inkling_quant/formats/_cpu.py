"""CPU helpers shared by the format kernels (nvfp4, mxfp8, fp8_block): dtype bit layouts, input checks,
the thread pool that runs chunks of whole blocks, and per-thread scratch buffers. Private to
formats/: nothing here is a format rule."""
from __future__ import annotations

import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np
import torch

from ..errors import FormatError

# dtype -> (signed int view of the same width, abs mask, smallest Inf/NaN pattern, log2 of the
# smallest positive subnormal). Any IEEE value with |bits| >= the Inf pattern is Inf or NaN.
_BITS = {
    torch.bfloat16: (torch.int16, 0x7FFF, 0x7F80, -133),
    torch.float16: (torch.int16, 0x7FFF, 0x7C00, -24),
    torch.float32: (torch.int32, 0x7FFFFFFF, 0x7F800000, -149),
}


def _where(name: str) -> str:
    return f"tensor {name!r}: " if name else ""


def _check_dtype(w: torch.Tensor, fmt: str, name: str) -> None:
    if w.dtype not in _BITS:
        raise FormatError(f"{_where(name)}{fmt} quantizes bf16/fp16/fp32 weights, got {w.dtype}", tensor=name or None)


def _check_shape(shape, block, fmt: str, name: str, partial: bool = False) -> None:
    """`block`: the elements one scale covers, an int along the last dim or (rows, cols). A 2-D
    block needs a weight of two dims or more; each dim it spans must be divisible by it unless
    `partial` (the format takes partial edge tiles: a ceil grid of scales)."""
    rows, cols = (1, block) if isinstance(block, int) else block
    if rows == 1:
        if len(shape) < 1 or (not partial and shape[-1] % cols != 0):
            raise FormatError(f"{_where(name)}{fmt} needs the last (input) dimension divisible by "
                              f"{cols}, got shape {tuple(shape)}", tensor=name or None)
        return
    if len(shape) < 2:
        raise FormatError(f"{_where(name)}{fmt} needs a weight of two dimensions or more (one scale per "
                          f"{rows}x{cols} tile), got shape {tuple(shape)}", tensor=name or None)
    if not partial and (shape[-2] % rows != 0 or shape[-1] % cols != 0):
        raise FormatError(f"{_where(name)}{fmt} needs the last two dimensions divisible by {rows}x{cols}, "
                          f"got shape {tuple(shape)}", tensor=name or None)


def _nonfinite(name: str) -> FormatError:
    return FormatError(f"{_where(name)}contains NaN or Inf: cannot be quantized", tensor=name or None)


_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()
_TLS = threading.local()


def _forget_pool() -> None:  # in a forked child the parent's worker threads do not exist
    global _POOL, _POOL_LOCK
    _POOL, _POOL_LOCK = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def _pool(n: int) -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL._max_workers < n:  # grow only; old idle threads just exit
            _POOL = ThreadPoolExecutor(max_workers=n, thread_name_prefix="inkling-quant-formats")
        return _POOL


def _run_chunks(fn: Callable[[int, int], object], n_items: int, unit: int, units_per_call: int = 16) -> None:
    """fn(lo, hi) over [0, n_items) in ranges of `units_per_call` x `unit` items, on
    torch.get_num_threads() threads, the caller's among them. Each thread takes the next range
    when it finishes one, so one slowed down by the pipeline's other stages (or other work on
    the machine) takes fewer instead of holding up the rest; a range is many kernel chunks, so
    the call overhead is paid rarely. The first error is raised once every thread has stopped."""
    step = unit * units_per_call
    ranges = iter([(lo, min(n_items, lo + step)) for lo in range(0, n_items, step)])
    nt = min(max(1, torch.get_num_threads()), -(-n_items // step))
    lock, errors = threading.Lock(), []

    def work() -> None:
        while True:
            with lock:
                r = None if errors else next(ranges, None)
            if r is None:
                return
            try:
                fn(*r)
            except BaseException as e:  # noqa: BLE001 - re-raised below
                with lock:
                    errors.append(e)

    futs = [_pool(nt - 1).submit(work) for _ in range(nt - 1)] if nt > 1 else []
    work()
    for f in futs:
        f.result()
    if errors:
        raise errors[0]


def _buf(key: str, shape: tuple[int, ...], dtype) -> np.ndarray:
    """A per-thread scratch array of `shape`, reused across calls: a view of a flat buffer that
    only grows, so that calls alternating between sizes (an expert's w13 and w2) reuse the pages
    they touched instead of faulting in fresh ones."""
    d = getattr(_TLS, "bufs", None)
    if d is None:
        d = _TLS.bufs = {}
    size = math.prod(shape)
    a = d.get(key)
    if a is None or a.dtype != dtype or a.size < size:
        a = d[key] = np.empty(size, dtype)
    return a[:size].reshape(shape)


# float8_e4m3fn byte -> its fp32 value (exact), the kernels' table
_E4M3_TO_F32 = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float().numpy()


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().numpy()


def _source_bits(w: torch.Tensor) -> tuple[np.ndarray, np.uint32, np.unsignedinteger]:
    """A contiguous CPU weight as the compiled kernels read it (formats/_jit.py): (bits, shift,
    abs mask): bf16 as its uint16 patterns (shift 16 makes each the fp32 pattern of the same
    value), fp32 as uint32 (shift 0), fp16 converted to fp32 first (exact)."""
    flat = w.detach().reshape(-1)
    if w.dtype == torch.bfloat16:
        return _np(flat.view(torch.int16)).view(np.uint16), np.uint32(16), np.uint16(0x7FFF)
    return _np(flat.float().view(torch.int32)).view(np.uint32), np.uint32(0), np.uint32(0x7FFFFFFF)


def fp32_preimage(target: torch.Tensor, quotient: Callable[[torch.Tensor], torch.Tensor],
                  divisor: float) -> torch.Tensor | None:
    """An fp32 ``a`` with ``quotient(a) == target`` bit for bit, where ``quotient`` divides by
    ``divisor`` (e.g. amax -> amax / 2688), searched from ``target * divisor`` two ulps either way
    (``a -> a / 2688`` moves less than 1.6 ulp per ulp of ``a``), or None. Of several, the one
    with the shortest mantissa: a BF16 weight's amax comes back as itself."""
    t = target.reshape(()).to(torch.float32)
    start = t * torch.tensor(divisor, dtype=torch.float32)
    cands, up, down = [start], start, start
    for _ in range(2):
        up, down = torch.nextafter(up, up + 1), torch.nextafter(down, down - 1)
        cands += [up, down]
    ok = [a for a in cands
          if torch.isfinite(a) and torch.equal(quotient(a).reshape(()).view(torch.int32), t.view(torch.int32))]
    return max(ok, key=lambda a: _trailing_zeros(int(a.view(torch.int32))), default=None)


def _trailing_zeros(b: int) -> int:
    return (b & -b).bit_length() if b else 32
