"""Writing a derived checkpoint safely: a staged output directory renamed into place,
shards hard-linked or copied with their sha256 checked, and sha256sum-style checksum files.
Shared by `draft` and `lora` (convert writes shard by shard with its own resume manifest)."""
from __future__ import annotations

import hashlib
import os
import re
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from ..errors import CheckpointError, UsageError
from .checkpoint import atomic_path
from .safetensors import open_regular, sha256_file

CHECKSUMS = "checksums.sha256"
_CHUNK = 8 << 20

_SUM_LINE = re.compile(r"([0-9a-fA-F]{64}) [ *](.+)")


def read_checksums(path: Path, problem: Callable[[str, str], None] | None = None) -> dict[str, str]:
    """A sha256sum file: {file name: hex digest}. A malformed or repeated line raises
    CheckpointError, or, given ``problem(where, message)``, is reported there and skipped
    (verify lists every bad line instead of stopping at the first)."""
    out: dict[str, str] = {}
    try:
        fd = open_regular(path)  # a FIFO would block forever
        with os.fdopen(fd, "rb") as f:
            if os.fstat(f.fileno()).st_size > 64 << 20:
                raise CheckpointError(f"{path}: larger than 64 MiB: not a checksum file")
            text = f.read().decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read: {e}") from None
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        m = _SUM_LINE.fullmatch(line)
        bad = (f"not a '<sha256>  <file>' line: {line[:80]!r}" if not m
               else f"{m.group(2)} listed twice" if m.group(2) in out else None)
        if bad is not None:
            if problem is None:
                raise CheckpointError(f"{path}:{n}: {bad}")
            problem(f"{path}:{n}", bad)
            continue
        out[m.group(2)] = m.group(1).lower()
    return out


def write_checksums(path: Path, sums: dict[str, str]) -> None:
    with atomic_path(path) as tmp, open(tmp, "w") as f:
        f.write("".join(f"{sums[name]}  {name}\n" for name in sorted(sums)))
        f.flush()
        os.fsync(f.fileno())


def remove_path(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    elif p.exists() or p.is_symlink():
        p.unlink()


def fsync_dir(p: Path) -> None:
    try:
        fd = os.open(p, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextmanager
def staged_output(out: str | Path, src: Path, overwrite: bool):
    """Yield OUT.partial to build in; rename it to OUT when the block completes. Refuses an
    existing OUT (an empty directory excepted) unless `overwrite`, and an OUT that is, holds or
    lies inside SRC. On any failure the partial directory is removed and OUT is untouched."""
    out = Path(out)
    if out.exists() or out.is_symlink():
        empty_dir = out.is_dir() and not out.is_symlink() and not any(out.iterdir())
        if not (empty_dir or overwrite):
            raise UsageError(f"{out}: already exists (pass --overwrite to replace it)")
    o, s = out.resolve(), Path(src).resolve()
    if o == s or s in o.parents or o in s.parents:
        raise UsageError(f"{out}: output must be outside the source checkpoint {src} (and not contain it)")
    tmp = out.with_name(out.name + ".partial")
    try:
        remove_path(tmp)  # left by a killed run
        tmp.mkdir(parents=True)
        yield tmp
        fsync_dir(tmp)
        if out.exists() or out.is_symlink():
            old = out.with_name(out.name + ".old")
            remove_path(old)
            os.replace(out, old)
            os.replace(tmp, out)
            remove_path(old)
        else:
            os.replace(tmp, out)
        fsync_dir(out.parent)
    except OSError as e:
        remove_path(tmp)
        raise CheckpointError(f"{out}: writing failed: {e}") from e
    except BaseException:
        remove_path(tmp)
        raise


def hashed_copy(src: Path, dst: Path, expected: str | None, bar) -> str:
    """Copy src to dst (fsync'd, atomic), returning its sha256; raise on a digest mismatch."""
    h = hashlib.sha256()
    buf = bytearray(_CHUNK)
    mv = memoryview(buf)
    with atomic_path(dst) as tmp:
        with open(src, "rb", buffering=0) as fi, open(tmp, "wb") as fo:
            while n := fi.readinto(buf):
                h.update(mv[:n])
                fo.write(mv[:n])
                bar.update(n)
            fo.flush()
            os.fsync(fo.fileno())
        digest = h.hexdigest()
        if expected is not None and digest != expected:
            raise CheckpointError(f"{src}: sha256 {digest} does not match {CHECKSUMS} ({expected}): the shard is corrupt")
    return digest


def link_or_copy(src: Path, dst: Path, copy: bool, expected: str | None, want_digest: bool, bar) -> tuple[str | None, str]:
    """Hardlink src to dst (falling back to a copy across file systems); (sha256 or None, how)."""
    if not copy:
        try:
            os.link(src, dst)
        except OSError:
            pass
        else:
            bar.update(dst.stat().st_size)
            if expected is not None:
                return expected, "linked"  # the same inode: its bytes are the ones the source lists
            return (sha256_file(dst) if want_digest else None), "linked"
    return hashed_copy(src, dst, expected, bar), "copied"
