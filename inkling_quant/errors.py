"""Error types. Every error a user can cause is one of these, with the file and tensor named."""


def short_repr(v, limit: int = 80) -> str:
    """repr of an untrusted value for a message, cut short (a shape list can be megabytes)."""
    try:
        r = repr(v)
    except RecursionError:  # JSON nested nearly to the parser's limit
        return f"<{type(v).__name__} nested too deeply>"
    return r if len(r) <= limit else r[: limit - 3] + "..."


def printable(s: str) -> str:
    """`s` with control characters escaped (\\n, \\x1b, ...), so a name read from a file cannot
    forge lines in a message, a report or a terminal. A byte of a file name that is not UTF-8
    (os.listdir hands it over as a lone surrogate, U+DC80-U+DCFF) is shown as the byte, \\xff:
    no terminal, JSON reader or XML file takes the surrogate itself."""
    if s.isprintable():
        return s
    return "".join(_escaped(c) for c in s)


def utf8_safe(s: str) -> str:
    """`s` with its lone surrogates escaped as `printable` escapes them and nothing else changed:
    for a JSON or XML report, whose format escapes control characters itself."""
    try:
        s.encode("utf-8")
        return s
    except UnicodeEncodeError:
        return "".join(_escaped(c) if "\ud800" <= c <= "\udfff" else c for c in s)


def _escaped(c: str) -> str:
    if c.isprintable() or c == " ":
        return c
    if "\udc80" <= c <= "\udcff":  # surrogateescape's stand-in for one undecodable byte
        return f"\\x{ord(c) - 0xDC00:02x}"
    return c.encode("unicode_escape").decode("ascii")


class InklingQuantError(Exception):
    """Base class: the CLI prints the message and exits non-zero, without a traceback.
    `path` and `tensor`, where the raiser knows them, name the file and tensor as data (a
    report lists them without parsing the message). The text is "<path>: <message>" given a
    path, else the message; `message` keeps the text without the path."""

    exit_code = 2

    def __init__(self, message: str = "", *, path=None, tensor: str | None = None):
        self.message = message
        self.path = None if path is None else str(path)
        self.tensor = tensor
        super().__init__(message if self.path is None else f"{self.path}: {message}")


def prefixed(prefix: str, e: InklingQuantError, cls: type[InklingQuantError] | None = None) -> InklingQuantError:
    """`e` as a `cls` (default: its own type) whose text is `prefix` + e's text: its path and
    tensor fields are kept, its `message` is the whole text (which no longer starts with the path)."""
    out = (cls or type(e))(f"{prefix}{e}")
    out.path, out.tensor = e.path, e.tensor
    return out


class ConfigError(InklingQuantError):
    """config.json / hf_quant_config.json / adapter config missing keys or malformed."""


class UnknownTensorError(InklingQuantError):
    """A tensor name outside the layout spec."""


class CheckpointError(InklingQuantError):
    """A malformed checkpoint: bad safetensors header, index, shapes, values."""


class UnsafePathError(CheckpointError):
    """A file name that escapes the checkpoint directory."""


class FormatError(InklingQuantError):
    """A tensor a number format cannot represent (shape not divisible by the block, NaN/Inf)."""


class UsageError(InklingQuantError):
    """Bad command-line usage (missing flag, existing output, ...)."""


class HubError(InklingQuantError):
    """A hub source or adapter that cannot be had: no such repository or revision, no access,
    no network (and no cached copy), or a download that failed."""


class OutputError(InklingQuantError):
    """The output could not be written (disk full, file-size limit, permissions)."""


class Interrupted(InklingQuantError):
    """SIGINT/SIGTERM: finished work is kept; `--resume` continues."""

    exit_code = 130


class WorkerDied(InklingQuantError):
    """A worker process ended without a result (SIGKILL, the OOM killer): finished shards are kept."""


class KernelError(InklingQuantError, ValueError):
    """A kernel called with inputs it cannot take (shapes, devices, a path this machine lacks):
    the kernels' own KernelError, which verify re-raises as this (verify.numerics.kernel_errors).
    Also a ValueError, as the kernels' is."""
