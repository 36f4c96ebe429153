"""Which code path the kernels take: the backend (Triton on a GPU, the Triton CPU interpreter, or
the torch reference), the path per device and shape (``select_path``), and the checks on a path
a caller forces.

Paths (plain strings, compared with ``==`` by callers such as verify):

* ``interpreter-fp32``: the Triton CPU interpreter, MMA tiles with fp32 ``tl.dot`` (its bf16
  ``tl.dot`` is wrong, triton-lang/triton#11584).
* ``dequant-splitk``: decode shapes (m <= 16) on weight-only GPUs and in the interpreter:
  narrow N slices, split-K with deterministic fp32 partials, GEMV-style fp32 FMA for m <= 2
  and a 16-row MMA above (fp32 ``tl.dot`` in the interpreter).
* ``dequant-bf16-mma``: CUDA sm80+ except 10.x, m > 16: dequantize in registers, bf16 MMA.
* ``sm100-dot-scaled``: compute capability 10.x: activations quantized on the fly, ``tl.dot_scaled``.
* ``torch-reference``: Triton cannot run (no GPU, no interpreter, CUDA < sm80): reference.py.
"""
from __future__ import annotations

import functools
import warnings

import torch

from .errors import KernelError
from . import gemm_kernels
from .triton_ops import TRITON_IMPORT_ERROR, triton

PATH_INTERPRETER = "interpreter-fp32"
PATH_SPLITK = "dequant-splitk"
PATH_BF16_MMA = "dequant-bf16-mma"
PATH_SM100 = "sm100-dot-scaled"
PATH_REFERENCE = "torch-reference"
PATHS = (PATH_INTERPRETER, PATH_SPLITK, PATH_BF16_MMA, PATH_SM100, PATH_REFERENCE)
DECODE_MAX_M = 16  # m <= this: decode shapes (the split-K path on weight-only GPUs and the interpreter)

def interpreted() -> bool:
    """True when the kernels were decorated for the Triton CPU interpreter (TRITON_INTERPRET=1
    at import time); that, not the variable's current value, decides how they run."""
    if triton is None:
        return False
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(gemm_kernels._dequant_gemm_kernel, InterpretedFunction)


def backend() -> str:
    """How the kernels run in this process: "triton-interpreter", "triton-gpu" or
    "torch-reference" (Triton cannot run: no CUDA GPU and TRITON_INTERPRET unset at import, or
    triton missing; every entry point then computes the torch reference instead)."""
    if interpreted():
        return "triton-interpreter"
    if triton is not None and torch.cuda.is_available():
        return "triton-gpu"
    return "torch-reference"


def backend_note() -> str:
    b = backend()
    if b == "triton-interpreter":
        return "Triton CPU interpreter (TRITON_INTERPRET=1): correct but slow; fp32 tl.dot."
    if b == "triton-gpu":
        return "Triton on CUDA."
    why = (f"triton failed to import ({TRITON_IMPORT_ERROR})" if triton is None else
           "no CUDA GPU and TRITON_INTERPRET was not set to 1 before inkling_kernels was imported")
    return f"Triton cannot run ({why}): falling back to the torch reference (dequantize + fp32 matmul)."


@functools.lru_cache(maxsize=None)
def warn_fallback() -> None:
    warnings.warn(backend_note(), RuntimeWarning, stacklevel=4)


def path_for(capability: tuple[int, int] | None, interpreted: bool, m: int | None = None) -> str:
    """Pure decision table (tested). Interpreter: split-K for decode shapes, else fp32-dot
    tiles. sm100 (major 10): dot_scaled at every m (one numerics for all batch sizes). Other
    CUDA GPUs with bf16 MMA (sm80+): split-K for decode shapes (m <= 16), else bf16-MMA tiles.
    Anything else: the reference. m None (shape unknown) never picks split-K."""
    decode = m is not None and m <= DECODE_MAX_M
    if interpreted:
        return PATH_SPLITK if decode else PATH_INTERPRETER
    if capability is None:
        return PATH_REFERENCE
    if capability[0] == 10:
        return PATH_SM100
    if capability[0] >= 8:
        return PATH_SPLITK if decode else PATH_BF16_MMA
    return PATH_REFERENCE


def select_path(device: torch.device | str | None = None, m: int | None = None) -> str:
    """The path the kernels take for tensors on `device` in this process; with `m` (rows per
    expert of the launch), the shape-specific one (split-K for decode shapes)."""
    device = torch.device("cpu" if device is None else device)
    if triton is None:
        return PATH_REFERENCE
    if interpreted():
        return path_for(None, True, m)
    if device.type == "cuda" and torch.cuda.is_available():
        return path_for(torch.cuda.get_device_capability(device), False, m)
    return PATH_REFERENCE


def resolve_path(path: str | None, device: torch.device, m: int | None = None) -> str:
    """`path` checked against this process (None: select_path(device, m))."""
    if path is None:
        path = select_path(device, m)
        if path == PATH_REFERENCE:
            warn_fallback()
        return path
    if path not in PATHS:
        raise KernelError(f"unknown path {path!r}; known: {PATHS}")
    if path == PATH_REFERENCE:
        return path
    if triton is None or backend() == "torch-reference":
        raise KernelError(f"path {path!r} needs Triton: {backend_note()}")
    if interpreted() and path == PATH_BF16_MMA:
        raise KernelError("dequant-bf16-mma cannot run in the Triton interpreter: its bf16 tl.dot returns "
                          "wrong results (triton-lang/triton#11584); use 'interpreter-fp32'")
    if not interpreted() and device.type != "cuda":
        raise KernelError(f"path {path!r} needs CUDA tensors, got {device}")
    return path


@functools.lru_cache(maxsize=None)
def device_facts(index: int) -> tuple[tuple[int, int], int, str]:
    """(capability, SM count, name) of CUDA device `index`, cached (launchers ask per call)."""
    p = torch.cuda.get_device_properties(index)
    return (p.major, p.minor), p.multi_processor_count, p.name
