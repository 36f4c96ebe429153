"""The kernels' one error: a kernel called with inputs it cannot take (shapes, devices, a
launch config, a path this machine lacks). A ValueError, which callers of the kernels caught
before the kernels had their own error. inkling_quant's verify re-raises it as
``inkling_quant.errors.KernelError`` (one of its errors: a message in the report and on the
command line, never a traceback)."""
from __future__ import annotations


class KernelError(ValueError):
    """Inputs a kernel cannot take; the message says which and why."""
