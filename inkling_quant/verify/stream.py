"""The single read: every file front to back, each byte once. sha256 of each file runs on a
helper thread while visitors look at each tensor's bytes in the same buffers (value rules, the
gate/up scales, the pass-through comparison with the source, the summary tally).

A visitor has `visit(seen) -> sink or None`, called once per tensor in file order (and may have
`close()`, called once the read is over); a sink has `feed(piece, offset)` (the tensor's bytes,
in pieces of whole elements) and `done()` (after the last piece)."""
from __future__ import annotations

import hashlib
import os
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Protocol

import torch

from ..errors import CheckpointError, InklingQuantError
from ..io.checkpoint import safe_child
from ..io.safetensors import Header, TensorEntry
from ..model.tensors import TensorName
from .inventory import Inventory
from .report import PASS, Check, Recorder

CHUNK = 32 << 20           # bytes per read: big sequential reads, hashed on a helper thread


@dataclass(frozen=True)
class Seen:
    """One tensor as the stream meets it."""

    path: Path                  # its shard
    name: str
    entry: TensorEntry
    t: TensorName | None        # None: a name outside the layout
    fmt: str | None             # the format it belongs to, None if the layout expects no such tensor
    check: Check                # values[shard]: where problems with its bytes go


class Sink(Protocol):
    def feed(self, piece: memoryview, offset: int) -> None: ...

    def done(self) -> None: ...


class Visitor(Protocol):
    def visit(self, seen: Seen) -> Sink | None: ...


def read_all(run: Recorder, inv: Inventory, others: list[str], visitors: list[Visitor],
             progress: bool) -> dict[str, str]:
    """Read every shard with a well-formed header (a `values[F]` check each, the visitors on
    every tensor) and hash the `others` (files listed in checksums.sha256, shards whose header is
    bad...). Returns file name -> sha256; sets the report's read figures."""
    shards = inv.files.readable_shards
    if not shards:
        run.new("values", "values", "no NaN/Inf; scales finite and positive").skip("no readable shard")
    digests: dict[str, str] = {}
    t0 = time.perf_counter()
    hasher = ThreadPoolExecutor(1, thread_name_prefix="verify-sha256")
    biggest = max([h.file_size for h in inv.files.headers.values()] + [1 << 20])
    size = min(CHUNK, biggest)
    bufs = [bytearray(size + 64), bytearray(size + 64)]  # reused for every file
    bar = _progress_bar(inv, shards, others) if progress else None
    reader = _Reader(run.report, hasher, bufs, bar.update if bar is not None else None, digests)
    try:
        with torch_threads(1):
            for name in shards:
                c = run.new(f"values[{name}]", "values", f"{name}: no NaN/Inf; scales finite and positive")
                run.guard(c, reader.read_shard, inv, name, c, visitors)
            io = Check("read", "integrity", "every listed file can be read")
            for name in others:
                try:
                    path = safe_child(inv.root, name, "file")
                except InklingQuantError:
                    continue  # the checksums check reports the name
                if path.is_file():
                    run.guard(io, reader.hash_file, path)
            if io.status != PASS:
                run.report.checks.append(io)
    finally:
        if bar is not None:
            bar.close()
        hasher.shutdown(wait=True)
        for v in visitors:
            close = getattr(v, "close", None)
            if close is not None:
                close()
    run.report.stream_seconds = time.perf_counter() - t0
    return digests


def _progress_bar(inv: Inventory, shards: list[str], others: list[str]):
    from tqdm import tqdm

    total = sum(inv.files.headers[n].file_size for n in shards) + sum(_size(inv.root, n) for n in others)
    return tqdm(total=total, unit="B", unit_scale=True, desc="verify", leave=False)


def _size(root: Path, name: str) -> int:
    try:
        p = safe_child(root, name, "file")
        return p.stat().st_size if p.is_file() else 0
    except (InklingQuantError, OSError):
        return 0


class _Reader:
    """Reads files one after the other with shared buffers and hash thread."""

    def __init__(self, report, hasher: ThreadPoolExecutor, bufs: list[bytearray], progress, digests: dict):
        self.report, self.hasher, self.bufs, self.progress, self.digests = report, hasher, bufs, progress, digests

    def read_shard(self, inv: Inventory, name: str, c: Check, visitors: list) -> None:
        h: Header = inv.files.headers[name]
        path = inv.root / name
        st = _Stream(path, self.hasher, self.bufs, self.progress)
        try:
            st.skip(h.data_start)
            for tname, e in h.tensors.items():  # file order
                _visit(st, Seen(path, tname, e, _classify(inv, tname), inv.expected.fmt_of.get(tname), c), visitors)
            c.figures.update(tensors=len(h.tensors), bytes=h.file_size)
            self._finish(name, st)
        finally:
            st.close()

    def hash_file(self, path: Path) -> None:
        st = _Stream(path, self.hasher, self.bufs, self.progress)
        try:
            self._finish(path.name, st)
        finally:
            st.close()

    def _finish(self, name: str, st: "_Stream") -> None:
        self.digests[name] = st.finish()
        self.report.bytes_read += st.read
        self.report.files_read += 1


def _classify(inv: Inventory, name: str) -> TensorName | None:
    try:
        return inv.classify(name)
    except InklingQuantError:
        return None


def _visit(st: "_Stream", seen: Seen, visitors: list) -> None:
    """One tensor: each visitor may take a sink for its bytes; read them once for all sinks."""
    sinks = [s for s in (v.visit(seen) for v in visitors) if s is not None]
    if not sinks:
        st.skip(seen.entry.nbytes)
        return
    offset = 0
    for piece in st.pieces(seen.entry.nbytes, seen.entry.dtype.itemsize):
        for s in sinks:
            s.feed(piece, offset)
        offset += len(piece)
    for s in sinks:
        s.done()


@contextmanager
def torch_threads(n: int):
    """Run with `n` intra-op threads, then restore. The streaming pass checks values on one
    thread while sha256 runs on another; tiny GEMMs are much slower on several OpenMP threads
    (barrier cost), badly so on a loaded machine."""
    prev = torch.get_num_threads()
    if n != prev:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if n != prev:
            torch.set_num_threads(prev)


class _Stream:
    """One file read front to back in CHUNK-sized reads, each byte once. sha256 runs on a helper
    thread (hashlib releases the GIL) over each chunk as soon as it is read, while the caller
    checks values in the same bytes. Two buffers alternate; a buffer is reused only after its
    hash is done. `pieces(n, item)` yields the next n bytes as memoryviews whose lengths are
    multiples of `item` (a tensor larger than a chunk comes in several pieces)."""

    def __init__(self, path: Path, hasher: ThreadPoolExecutor, bufs: list[bytearray], progress=None):
        self.progress = progress
        self.path = path
        self.f = open(path, "rb", buffering=0)
        self.size = os.fstat(self.f.fileno()).st_size
        self.chunk = len(bufs[0]) - 64  # room to carry a partial element over to the next chunk
        self.bufs = bufs
        self.pending: list = [None, None]
        self.cur = 0
        self.mv = memoryview(self.bufs[0])
        self.lo = self.hi = 0
        self.hash = hashlib.sha256()
        self.hasher = hasher
        self.read = 0

    def _fill(self) -> None:
        left = self.mv[self.lo:self.hi]
        self.cur ^= 1
        if self.pending[self.cur] is not None:
            self.pending[self.cur].result()
            self.pending[self.cur] = None
        mv = memoryview(self.bufs[self.cur])
        k = len(left)
        mv[:k] = left
        got = self.f.readinto(mv[k:k + self.chunk])
        if not got:
            raise CheckpointError(f"file ended at byte {self.read} (changed while being read?)", path=self.path)
        self.pending[self.cur] = self.hasher.submit(self.hash.update, mv[k:k + got])
        self.read += got
        if self.progress is not None:
            self.progress(got)
        self.mv, self.lo, self.hi = mv, 0, k + got

    def pieces(self, nbytes: int, item: int = 1) -> Iterator[memoryview]:
        left = nbytes
        while left:
            avail = self.hi - self.lo
            take = min(left, avail)
            if take < left:
                take -= take % item
            if take == 0:
                self._fill()
                continue
            yield self.mv[self.lo:self.lo + take]
            self.lo += take
            left -= take

    def skip(self, nbytes: int) -> None:
        for _ in self.pieces(nbytes):
            pass

    def finish(self) -> str:
        """Hash whatever was not consumed yet; return the file's sha256."""
        self.skip(self.size - (self.read - (self.hi - self.lo)))
        extra = self.f.read(1)
        if extra:  # grew while being read: hash the rest too so the digest matches the file
            self.hash_rest(extra)
        for p in self.pending:
            if p is not None:
                p.result()
        self.pending = [None, None]
        return self.hash.hexdigest()

    def hash_rest(self, first: bytes) -> None:
        for p in self.pending:
            if p is not None:
                p.result()
        self.hash.update(first)
        self.read += len(first)
        while b := self.f.read(self.chunk):
            self.hash.update(b)
            self.read += len(b)

    def close(self) -> None:
        self.f.close()
