"""Writing a checkpoint safely: the output guard (`check_paths`: never write or remove what a
command reads), the output lock (one writer per OUT), a staged output directory renamed into
place, shards hard-linked or copied with their sha256 checked, sha256sum-style checksum files,
and report files. Shared by every command that writes (docs/safety.md)."""
from __future__ import annotations

import os
import re
import shutil
import socket
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Sequence

from ..errors import CheckpointError, OutputError, UsageError
from .checkpoint import CHECKSUMS
from .files import TEMP_SUFFIX, atomic_file, check_line_safe
from .safetensors import ByteWriter, open_regular, sha256_file

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
                raise CheckpointError("larger than 64 MiB: not a checksum file", path=path)
            text = f.read().decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"cannot read: {e}", path=path) from None
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        m = _SUM_LINE.fullmatch(line)
        bad = (f"not a '<sha256>  <file>' line: {line[:80]!r}" if not m
               else f"{m.group(2)} listed twice" if m.group(2) in out else None)
        if bad is not None:
            if problem is None:
                raise CheckpointError(bad, path=f"{path}:{n}")  # file:line, as `problem` names it
            problem(f"{path}:{n}", bad)
            continue
        out[m.group(2)] = m.group(1).lower()
    return out


def write_checksums(path: Path, sums: dict[str, str]) -> None:
    for name in sums:
        check_line_safe(name, path, "file")  # a newline in a name would forge a line
    with atomic_file(path, "w") as f:
        f.write("".join(f"{sums[name]}  {name}\n" for name in sorted(sums)))


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


# --------------------------------------------------------------------------- the output guard
STAGING, BACKUP = TEMP_SUFFIX, ".old"  # OUT is built in OUT.partial; a replaced OUT waits in OUT.old


def _real(p: str | Path) -> Path:
    return Path(os.path.realpath(p))


def check_paths(out: str | Path | None, sources: Sequence[str | Path | None] = (), *,
                reports: Sequence[str | None] = ()) -> None:
    """Refuse, before anything is created or removed, every way a command could write or remove
    what it reads: OUT that is a source, lies inside one or holds one; a staging or backup name
    (OUT.partial, OUT.old) that is or holds a source; OUT that is a symlink or not a directory;
    a report file (--json, --junit) that is a source, lies inside one, or is a directory.
    Paths are compared resolved (realpath), so `a/../b` and symlinked spellings are caught."""
    srcs = [(s, _real(s)) for s in sources if s is not None]
    if out is not None:
        out = Path(out)
        if out.is_symlink():
            raise UsageError("is a symlink; give the real output directory", path=out)
        if out.exists() and not out.is_dir():
            raise UsageError("exists and is not a directory", path=out)
        o = _real(out)
        for given, s in srcs:
            why = ("is the source" if o == s else "lies inside the source" if o.is_relative_to(s)
                   else "holds the source" if s.is_relative_to(o) else None)
            if why:
                raise UsageError(f"the output {why} {given}; it must be outside the source (and not hold it)", path=out)
            for suffix in (STAGING, BACKUP):
                n = o.with_name(o.name + suffix)
                if n == s or s.is_relative_to(n):
                    raise UsageError(f"its {'staging' if suffix == STAGING else 'backup'} directory "
                                     f"{n.name} is or holds the source {given}; rename the source or choose "
                                     f"another output", path=out)
    outs = [] if out is None else [_real(out).with_name(_real(out).name + x) for x in ("", STAGING, BACKUP)]
    for r in reports:
        if r is None or r == "-":
            continue
        if Path(r).is_dir():
            raise UsageError("is a directory; name a file for the report", path=r)
        rr = _real(r)
        for given, s in srcs:
            if rr == s or rr.is_relative_to(s):
                raise UsageError(f"the report would be written into the source {given}; name a file "
                                 f"outside it", path=r)
        if any(rr == o or rr.is_relative_to(o) for o in outs):  # it would replace a file of the output
            raise UsageError(f"the report would be written into the output {out}; name a file outside it", path=r)
        parent = rr.parent
        if not (parent.is_dir() and os.access(parent, os.W_OK)):  # found now, not after an hour of work
            raise UsageError(f"cannot write the report: {'no such directory' if not parent.is_dir() else 'its directory is not writable'}"
                             f" ({parent})", path=r)


def write_report(dest: str | None, text: str) -> None:
    """--json/--junit FILE|-: `-` is standard output; a file is written atomically."""
    if not dest:
        return
    if dest == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    try:
        with atomic_file(Path(dest), "w") as f:
            f.write(text)
    except OSError as e:
        raise OutputError(f"cannot write the report: {e.strerror or e}", path=dest) from None


class OutputLock:
    """One writer per output directory: a lock file beside OUT, holding host and pid, taken with
    O_EXCL. Beside, not inside: the staged commands (draft, lora, synth) create OUT only at the end,
    and convert --overwrite removes OUT under it. A lock whose process is gone (same host) is stale
    and taken over.

    `part=(i, n)` takes a part's lock instead (`convert --part I/N`): the parts of one split share
    OUT (several machines on one file system), but no part runs beside a whole writer (a whole
    conversion, --overwrite, --finalize, draft/lora/synth, verify --write-checksums), nor beside a
    part of another split (another N). Each side creates its own file first and then looks for the
    other's, so of two that start together at least one sees the other and gives way."""

    SUFFIX = ".inkling-quant.lock"

    def __init__(self, out: str | Path, part: tuple[int, int] | None = None):
        out = Path(out)
        self.dir, self.name, self.part = out.parent, out.name, part
        tag = f"-part-{part[0]}-of-{part[1]}" if part else ""
        self.path = self.dir / f".{out.name}{tag}{self.SUFFIX}"
        self.held = False

    def acquire(self) -> "OutputLock":
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OutputError(f"cannot create the output's directory: {e.strerror or e}", path=self.dir) from None
        self._create()
        try:
            self._refuse_others()
        except BaseException:
            self.release()
            raise
        return self

    def _create(self) -> None:
        me = f"{socket.gethostname()} {os.getpid()}\n"
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0), 0o644)
            except FileExistsError:
                holder = _live_holder(self.path)
                if holder is None:
                    continue  # stale (its owner died: kill -9, reboot) and removed
                raise UsageError(f"{self._what(self.part)} ({holder}) is writing this output; wait for it, or "
                                 f"remove {self.path.name} if that process is gone", path=self.dir / self.name) from None
            except OSError as e:
                raise OutputError(f"cannot take the output lock: {e.strerror or e}", path=self.path) from None
            with os.fdopen(fd, "w") as f:
                f.write(me)
            self.held = True
            return
        raise UsageError("could not take the lock", path=self.path)

    def _refuse_others(self) -> None:
        """The other kind's live locks (and, for a part, parts of another split) refuse this one."""
        for path, part in self._others():
            if self.part is not None and part is not None and part[1] == self.part[1]:
                continue  # a sibling part of the same split
            holder = _live_holder(path)
            if holder is not None:
                raise UsageError(f"{self._what(part)} ({holder}) is writing this output; wait for it, or remove "
                                 f"{path.name} if that process is gone", path=self.dir / self.name)

    def _others(self) -> list[tuple[Path, tuple[int, int] | None]]:
        parts = re.compile(rf"\.{re.escape(self.name)}-part-(\d+)-of-(\d+){re.escape(self.SUFFIX)}")
        found: list[tuple[Path, tuple[int, int] | None]] = []
        if self.part is not None:
            found.append((self.dir / f".{self.name}{self.SUFFIX}", None))
        for p in self.dir.iterdir():
            m = parts.fullmatch(p.name)
            if m and p != self.path:
                found.append((p, (int(m[1]), int(m[2]))))
        return found

    @staticmethod
    def _what(part: tuple[int, int] | None) -> str:
        if part is None:
            return "another conversion, merge or extraction"
        return f"a convert --part {part[0]}/{part[1]} run"

    def release(self) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False

    def __enter__(self) -> "OutputLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _live_holder(path: Path) -> str | None:
    """'pid P on HOST' of a lock file whose owner may be alive; None when there is no such file or
    its owner is gone (same host: the stale file is removed). A lock of another host is live."""
    try:
        host, pid = path.read_text().split()
        pid = int(pid)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        host, pid = "?", -1  # being written, or damaged: not ours to judge
    if host == socket.gethostname() and not _alive(pid):
        path.unlink(missing_ok=True)
        return None
    return f"pid {pid} on {host}"


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextmanager
def staged_output(out: str | Path, sources: Sequence[str | Path | None], overwrite: bool):
    """Yield OUT.partial to build in; rename it to OUT when the block completes. Checks the paths
    (`check_paths`) and takes the output lock first. Refuses an existing OUT (an empty directory
    excepted) unless `overwrite`. On any failure the partial directory is removed and OUT is
    untouched."""
    out = Path(out)
    check_paths(out, sources)
    if out.exists():
        empty_dir = out.is_dir() and not any(out.iterdir())
        if not (empty_dir or overwrite):
            raise UsageError("already exists (pass --overwrite to replace it)", path=out)
    tmp = out.with_name(out.name + STAGING)
    with OutputLock(out):
        try:
            remove_path(tmp)  # left by a killed run (the lock says none is running)
            tmp.mkdir(parents=True)
            yield tmp
            fsync_dir(tmp)
            if out.exists() or out.is_symlink():
                old = out.with_name(out.name + BACKUP)
                remove_path(old)
                os.replace(out, old)
                os.replace(tmp, out)
                remove_path(old)
            else:
                os.replace(tmp, out)
            fsync_dir(out.parent)
        except OSError as e:
            remove_path(tmp)
            raise OutputError(f"writing failed: {e.strerror or e}", path=out) from e
        except BaseException:
            remove_path(tmp)
            raise


def hashed_copy(src: Path, dst: Path, expected: str | None, bar) -> str:
    """Copy src to dst (O_DIRECT where the file system takes it, fsync'd, atomic), returning its
    sha256; raise on a digest mismatch (dst is then not created)."""
    buf = bytearray(_CHUNK)
    mv = memoryview(buf)

    def check(size: int, digest: str) -> None:
        if expected is not None and digest != expected:
            raise CheckpointError(f"sha256 {digest} does not match {CHECKSUMS} ({expected}): the shard is corrupt",
                                  path=src)
    with open(src, "rb", buffering=0) as fi, ByteWriter(dst, direct=True) as fo:
        while n := fi.readinto(buf):
            fo.write(mv[:n])
            bar.update(n)
        return fo.commit(check=check)


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
