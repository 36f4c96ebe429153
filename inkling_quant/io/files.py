"""How every file of ours comes into being: under an unpredictable temporary name beside its
final name, created new (O_CREAT|O_EXCL|O_NOFOLLOW: never an existing file, never through a
symlink someone planted), then renamed into place, never onto or through a symlink.

So a reader never sees a half-written file, an interrupted write leaves no file that looks
complete, and a hostile directory cannot redirect a write elsewhere (docs/safety.md)."""
from __future__ import annotations

import errno
import os
import secrets
import unicodedata
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Iterator

from ..errors import UnsafePathError, printable

TEMP_SUFFIX = ".partial"  # every temporary file and directory of ours ends so (and is .gitignore'd)
_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def create_temp(path: Path, flags: int = 0) -> tuple[int, Path]:
    """A new, empty file `<name>.<random>.partial` beside `path`: (write fd, its path)."""
    for _ in range(16):
        tmp = path.with_name(f"{path.name}.{secrets.token_hex(8)}{TEMP_SUFFIX}")
        try:
            return os.open(tmp, _NEW | flags, 0o644), tmp
        except FileExistsError:  # 2^-64 by chance, or someone planted names: draw again
            continue
        except OSError:  # some file systems create the file before refusing a flag (O_DIRECT)
            tmp.unlink(missing_ok=True)
            raise
    raise OSError(errno.EEXIST, "could not create a temporary file", str(path))


def temps_of(path: Path) -> list[Path]:
    """The temporary files `create_temp(path)` may have left (a killed run)."""
    return sorted(path.parent.glob(f"{_glob_escape(path.name)}.*{TEMP_SUFFIX}"))


def _glob_escape(name: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


def replace_into(tmp: Path, path: Path) -> None:
    """Rename `tmp` onto `path`, refusing a `path` that is a symlink (the rename would replace
    the link, but a symlink where our file belongs means someone else is writing here)."""
    if path.is_symlink():
        raise UnsafePathError("is a symlink; refusing to write there (remove it)", path=path)
    os.replace(tmp, path)


@contextmanager
def atomic_file(path: Path, mode: str = "wb") -> Iterator[IO]:
    """An open file that becomes `path` (fsync'd) when the block ends; on any exception (a
    SIGTERM turned into KeyboardInterrupt included) the temporary file is removed instead."""
    fd, tmp = create_temp(path)
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        replace_into(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def check_line_safe(name: str, path, what: str, tensor: str | None = None) -> None:
    """Refuse a name holding a control character (a newline, a carriage return, an escape): it
    would forge lines in a line-based file (checksums) or a report. The error names `path` and
    `what` (and `tensor`, where the name is a tensor's file)."""
    if any(unicodedata.category(c) == "Cc" for c in name):
        raise UnsafePathError(f"{what}: refusing name {printable(name)}: it holds control characters", path=path,
                              tensor=tensor)
