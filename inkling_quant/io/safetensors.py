"""safetensors, read and written one tensor at a time.

We parse and validate headers ourselves (the format is a paragraph: an 8-byte little-endian
header length, a JSON header of {name: {dtype, shape, data_offsets}}, then the bytes) so every
defect is reported with its file and tensor. Tensor bytes are read with `os.pread` into a
buffer the caller may reuse, not through `safetensors.safe_open`: safe_open mmaps the whole
file, and the touched pages of a mapped shard count toward the process's RSS, so memory would
grow with the shard instead of the tensor. The `safetensors` library has no streaming writer
(it serializes a whole dict at once), so `ShardWriter` writes the header first and then each
tensor as it is produced, hashing on the way, under a temporary name renamed when complete
(`files.create_temp`).
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import math
import mmap
import os
import stat
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import torch

from ..errors import CheckpointError
from .files import create_temp, replace_into
from ..errors import short_repr as _short

MAX_HEADER_BYTES = 100_000_000  # the cap safetensors itself applies
_PARALLEL_HASH_BYTES = 4 << 20  # below this, a thread hand-off costs more than it saves
_DIRECT_CHUNK = 4 << 20  # O_DIRECT write size: the fastest of 4/16/64 MB on virtio-blk here
_DIRECT_ALIGN = 4096  # O_DIRECT offset/length/address alignment that every Linux block device accepts

DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
    "I32": torch.int32, "U32": torch.uint32, "I64": torch.int64, "U64": torch.uint64,
    "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute file offsets
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class Header:
    path: Path
    tensors: dict[str, TensorEntry]  # in file order
    metadata: dict[str, str]
    data_start: int
    file_size: int


MAX_RANK = 64  # no checkpoint tensor has more dimensions; bounds the work a shape list can cause
_INT64_MAX = (1 << 63) - 1


class _Duplicate(Exception):
    pass


def _no_duplicates(pairs: list) -> dict:
    """json object_pairs_hook: a key given twice is ambiguous (which one does a reader use?)."""
    d = {}
    for k, v in pairs:
        if k in d:
            raise _Duplicate(k)
        d[k] = v
    return d


def parse_json_bytes(blob: bytes, path, what: str, error: type[Exception] = CheckpointError):
    """JSON from untrusted bytes: every way it can be malformed becomes `error` naming `path` and
    `what` (invalid UTF-8, syntax, a key given twice, nesting too deep, an integer too long to
    convert)."""
    try:
        return json.loads(blob.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except _Duplicate as e:
        raise error(f"{what}: key {e.args[0]!r} appears more than once", path=path) from None
    except RecursionError:
        raise error(f"{what}: not valid JSON: nested too deeply", path=path) from None
    except (UnicodeDecodeError, ValueError) as e:  # JSONDecodeError, and int() past its digit limit
        raise error(f"{what}: not valid JSON: {e}", path=path) from None


def _encodable(s: str) -> bool:
    """False for strings with lone surrogates (JSON "\\ud800"): no file system or terminal takes them."""
    try:
        s.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def open_regular(path: Path) -> int:
    """A read-only fd of `path`, refusing anything but a regular file (a FIFO would block the
    open and every read; a device has no size). O_NONBLOCK: the open itself cannot hang."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CheckpointError("not a regular file", path=path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _numel(shape: list[int], limit: int) -> int | None:
    """Product of `shape`, or None when the nonzero dims multiply past `limit` (so a list of huge
    dims costs no big-integer arithmetic, and no zero dim can hide an overflowing one)."""
    n, zero = 1, False
    for s in shape:
        if s == 0:
            zero = True
            continue
        n *= s
        if n > limit:
            return None
    return 0 if zero else n


def _header_blob(path: Path) -> tuple[bytearray, int]:
    """(the header's JSON bytes, the file size), its length checked against the cap and the file."""
    try:
        fd = open_regular(path)
        try:
            size = os.fstat(fd).st_size
            raw = os.pread(fd, 8, 0)
            if len(raw) < 8:
                raise CheckpointError(f"truncated: {size} bytes, no safetensors header", path=path)
            (n,) = struct.unpack("<Q", raw)
            if n > MAX_HEADER_BYTES:
                raise CheckpointError(f"header length {n} exceeds the {MAX_HEADER_BYTES}-byte cap", path=path)
            if 8 + n > size:
                raise CheckpointError(f"truncated: header claims {n} bytes, file has {size}", path=path)
            blob, got = bytearray(n), 0  # n is within the file: read in place, never copied
            while got < n:
                k = os.preadv(fd, [memoryview(blob)[got:]], 8 + got)
                if not k:
                    raise CheckpointError(f"truncated while reading the {n}-byte header", path=path)
                got += k
        finally:
            os.close(fd)
    except OSError as e:
        raise CheckpointError(f"cannot read: {e.strerror or e}", path=path) from None
    return blob, size


def read_header(path: str | Path, max_tensors: int | None = None) -> Header:
    """Read and validate a safetensors header; raise CheckpointError naming file and tensor.
    Nothing is allocated from a length or shape in the file before it is checked against the
    file's size, nor an entry built for a header holding more than `max_tensors` tensors."""
    path = Path(path)
    blob, size = _header_blob(path)
    return parse_header(blob, size, path, max_tensors)


def parse_header(blob: bytes | bytearray, size: int, path: Path, max_tensors: int | None = None) -> Header:
    """The checks of `read_header` on a header's JSON bytes and its file's size, read elsewhere
    (inkling_quant.hub reads them over HTTP); `path` names the file in messages."""
    n = len(blob)
    if max_tensors is not None:  # counted before parsing: 400k entries parse into ~0.5 GB of objects
        check_count(blob.count(b'"data_offsets"'), max_tensors, path)
    obj = parse_json_bytes(blob, path, "header")
    if not isinstance(obj, dict):
        raise CheckpointError("header is not a JSON object", path=path)
    metadata = obj.pop("__metadata__", None)
    if max_tensors is not None:  # again, exactly: a key may be spelled with escapes ("\\u0064ata_offsets")
        check_count(len(obj), max_tensors, path)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError("__metadata__ must map strings to strings", path=path)
    if not all(_encodable(k) and _encodable(v) for k, v in metadata.items()):
        raise CheckpointError("__metadata__ holds a string that is not valid Unicode (lone surrogate)", path=path)
    data_start = 8 + n
    entries = []
    for name, e in obj.items():
        where = f"tensor {_short(name, 200)}"
        if not _encodable(name):
            raise CheckpointError(f"{where}: name is not valid Unicode (lone surrogate)", path=path, tensor=name)
        if not isinstance(e, dict) or set(e) != {"dtype", "shape", "data_offsets"}:
            raise CheckpointError(f"{where}: entry must have exactly dtype, shape, data_offsets", path=path,
                                  tensor=name)
        dtype = DTYPES.get(e["dtype"]) if isinstance(e["dtype"], str) else None
        if dtype is None:
            raise CheckpointError(f"{where}: unknown dtype {_short(e['dtype'])}", path=path, tensor=name)
        shape, offs = e["shape"], e["data_offsets"]
        if not (isinstance(shape, list) and all(type(s) is int and s >= 0 for s in shape)):
            raise CheckpointError(f"{where}: shape must be a list of non-negative integers, got {_short(shape)}",
                                  path=path, tensor=name)
        if len(shape) > MAX_RANK:
            raise CheckpointError(f"{where}: shape has {len(shape)} dimensions (at most {MAX_RANK})", path=path,
                                  tensor=name)
        if not (isinstance(offs, list) and len(offs) == 2 and all(type(o) is int and o >= 0 for o in offs)
                and offs[0] <= offs[1]):
            raise CheckpointError(f"{where}: data_offsets must be [begin, end] with 0 <= begin <= end, "
                                  f"got {_short(offs)}", path=path, tensor=name)
        numel = _numel(shape, _INT64_MAX)
        if numel is None:
            raise CheckpointError(f"{where}: shape {_short(shape)} has more elements than a tensor can hold",
                                  path=path, tensor=name)
        expected = numel * dtype.itemsize
        if offs[1] - offs[0] != expected:
            raise CheckpointError(f"{where}: {offs[1] - offs[0]} bytes for dtype {e['dtype']} "
                                  f"shape {_short(shape)} (expected {expected})", path=path, tensor=name)
        entries.append(TensorEntry(name, dtype, tuple(shape), data_start + offs[0], data_start + offs[1]))
    entries.sort(key=lambda t: (t.begin, t.end))
    pos = data_start
    for t in entries:
        if t.begin != pos:
            kind = "overlaps the previous tensor" if t.begin < pos else "leaves a gap before it"
            raise CheckpointError(f"tensor {_short(t.name, 200)} at offset {_short(t.begin - data_start)} {kind}",
                                  path=path, tensor=t.name)
        pos = t.end
    if pos != size:
        what = "truncated" if pos > size else "has trailing bytes"
        last = _short(entries[-1].name, 200) if entries else "(none)"
        raise CheckpointError(f"{what}: tensors end at byte {_short(pos)}, file has {size} (last tensor {last})",
                              path=path, tensor=entries[-1].name if entries else None)
    return Header(path, {t.name: t for t in entries}, metadata, data_start, size)


def check_count(n: int, max_tensors: int, path: Path, what: str = "header holds") -> None:
    """Refuse `n` tensors past `max_tensors` (model.layout.max_tensors, less what other shards hold)."""
    if n > max_tensors:
        raise CheckpointError(f"{what} {n} tensors, more than the {max_tensors} the checkpoint's config.json "
                              f"leaves room for (its layers and experts, every weight stored apart with its "
                              f"scales): refused before reading them", path=path)


class ShardReader:
    """Reads tensors of one shard by name with pread, into fresh or reused memory."""

    def __init__(self, path: str | Path, header: Header | None = None):
        self.header = header or read_header(path)
        self.path = self.header.path
        try:
            self._fd = open_regular(self.path)
        except OSError as e:
            raise CheckpointError(f"cannot open: {e.strerror or e}", path=self.path) from None
        if hasattr(os, "posix_fadvise"):  # tensors are mostly read in file order: a wider read-ahead
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def read_bytes(self, entry: TensorEntry, out: memoryview | None = None, *, start: int = 0,
                   nbytes: int | None = None) -> memoryview:
        """`nbytes` bytes of `entry` from byte `start` of its data (default: all of it)."""
        want = entry.nbytes - start if nbytes is None else nbytes
        buf = out if out is not None else memoryview(bytearray(want))
        got = 0
        while got < want:
            n = os.preadv(self._fd, [buf[got:want]], entry.begin + start + got)
            if n == 0:
                raise CheckpointError(f"tensor {entry.name!r}: file ended while reading (truncated after the "
                                      f"header was read?)", path=self.path, tensor=entry.name)
            got += n
        return buf[:want]

    def get(self, name: str, buffer: "TensorBuffer | None" = None) -> torch.Tensor:
        """The tensor `name`. With `buffer`, its memory is reused (valid until the next get)."""
        try:
            entry = self.header.tensors[name]
        except KeyError:
            raise CheckpointError(f"no tensor {name!r} in this shard", path=self.path, tensor=name) from None
        if entry.nbytes == 0:
            return torch.empty(entry.shape, dtype=entry.dtype)
        mv = self.read_bytes(entry, buffer.view(entry.nbytes) if buffer is not None else None)
        return torch.frombuffer(mv, dtype=entry.dtype).reshape(entry.shape)

    def get_rows(self, name: str, rows: int, buffer: "TensorBuffer | None" = None, start: int = 0) -> torch.Tensor:
        """`tensor[start:rows]` along the first dimension, reading only those bytes (a piece of
        a large tensor, or the leading rows of one)."""
        entry = self.header.tensors.get(name)
        if entry is None:
            raise CheckpointError(f"no tensor {name!r} in this shard", path=self.path, tensor=name)
        if not entry.shape or not 0 <= start <= rows <= entry.shape[0]:
            raise CheckpointError(f"tensor {name!r} {list(entry.shape)} has no rows {start}:{rows}", path=self.path,
                                  tensor=name)
        shape = (rows - start, *entry.shape[1:])
        row = math.prod(entry.shape[1:]) * entry.dtype.itemsize
        n = shape[0] * row
        if n == 0:
            return torch.empty(shape, dtype=entry.dtype)
        mv = self.read_bytes(entry, buffer.view(n) if buffer is not None else None, start=start * row, nbytes=n)
        return torch.frombuffer(mv, dtype=entry.dtype).reshape(shape)

    def get_slice(self, name: str, index: int, buffer: "TensorBuffer | None" = None) -> torch.Tensor:
        """`tensor[index]` along the first dimension, reading only its bytes: one expert of a
        stacked [E, ...] expert tensor, so memory is bounded by an expert, not the stack."""
        entry = self.header.tensors.get(name)
        if entry is None:
            raise CheckpointError(f"no tensor {name!r} in this shard", path=self.path, tensor=name)
        if not entry.shape or not 0 <= index < entry.shape[0]:
            raise CheckpointError(f"tensor {name!r} {list(entry.shape)} has no slice {index}", path=self.path,
                                  tensor=name)
        shape = entry.shape[1:]
        step = math.prod(shape) * entry.dtype.itemsize
        if step == 0:
            return torch.empty(shape, dtype=entry.dtype)
        mv = self.read_bytes(entry, buffer.view(step) if buffer is not None else None, start=index * step, nbytes=step)
        return torch.frombuffer(mv, dtype=entry.dtype).reshape(shape)


class TensorBuffer:
    """A growable byte buffer reused across reads so steady-state reading allocates nothing.
    Uninitialized (every byte handed out is read into first) and grown by at least 1.5x, so a
    sequence of growing tensors costs few allocations and no zero-filling pass."""

    def __init__(self):
        self._buf = np.empty(0, np.uint8)

    def view(self, nbytes: int) -> memoryview:
        if self._buf.size < nbytes:
            grown = max(nbytes, self._buf.size * 3 // 2)
            self._buf = np.empty(0, np.uint8)  # free the old one first
            self._buf = np.empty(grown, np.uint8)
        return memoryview(self._buf)[:nbytes]


def _header_bytes(specs: Iterable[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str] | None):
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    order = []
    for name, dtype, shape in specs:
        if name in header:
            raise CheckpointError(f"duplicate tensor {name!r} in one output shard", tensor=name)
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        order.append((name, dtype, tuple(shape), nbytes))
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # align the data section to 8 bytes, as safetensors does
    return struct.pack("<Q", len(blob)) + blob, order, offset


def shard_file_size(specs: Iterable[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str] | None) -> int:
    """The size of the file ShardWriter writes for these specs and metadata."""
    head, _, data_bytes = _header_bytes(specs, metadata)
    return len(head) + data_bytes


class ByteWriter:
    """A new file written as a stream of bytes, hashed on the way (sha256, so nothing is read
    back). It lives under `<name>.<random>.partial` until `commit()` renames it into place;
    `abort()` (or an exception inside `with`) removes it.

    `direct=True` writes with O_DIRECT: the bytes go from one reused, page-aligned staging
    buffer to the device without passing through the page cache. A converter writes hundreds of
    GB that nobody reads back soon; buffered, each of those bytes first takes a fresh page-cache
    page (counted against a container's memory limit, and costly in a VM: 0.3-0.5 GB/s here, see
    docs/convert.md), then waits for writeback. Where the file system refuses O_DIRECT (EINVAL at
    open or at the first write) the writer falls back to buffered writes, same bytes."""

    def __init__(self, path: str | Path, *, direct: bool = False):
        self.path = Path(path)
        self._hash = hashlib.sha256()
        self._hasher: ThreadPoolExecutor | None = None
        self._fd, self.tmp, self.direct = _open_for_write(self.path, direct)
        self._stage: np.ndarray | None = None  # the O_DIRECT staging buffer, page-aligned
        self._staged = 0
        self.written = 0

    def write(self, b: memoryview) -> None:
        # sha256 and the write both release the GIL: for a large piece they run side by side
        # (hashing is the slower of the two, ~2 GB/s with SHA-NI). Both are done on return, so
        # the caller may reuse the memory at once.
        if len(b) < _PARALLEL_HASH_BYTES:
            self._hash.update(b)
            self._emit(b)
            return
        if self._hasher is None:
            self._hasher = ThreadPoolExecutor(1, thread_name_prefix="inkling-quant-sha256")
        hashed = self._hasher.submit(self._hash.update, b)
        try:
            self._emit(b)
        finally:
            hashed.result()

    def _emit(self, b: memoryview) -> None:
        if not self.direct:
            _write_fully(self._fd, b)
            self.written += len(b)
            return
        if self._stage is None:
            self._stage = np.frombuffer(mmap.mmap(-1, _DIRECT_CHUNK), np.uint8)  # mmap: page-aligned
        src = np.frombuffer(b, np.uint8)
        pos = 0
        while pos < len(src):
            n = min(len(src) - pos, _DIRECT_CHUNK - self._staged)
            np.copyto(self._stage[self._staged:self._staged + n], src[pos:pos + n])  # GIL released
            self._staged += n
            pos += n
            if self._staged == _DIRECT_CHUNK:
                self._flush_stage(_DIRECT_CHUNK)

    def _flush_stage(self, nbytes: int) -> None:
        """Write the first `nbytes` (a multiple of the O_DIRECT alignment) of the staging buffer."""
        view = memoryview(self._stage)[:nbytes]
        try:
            _write_fully(self._fd, view)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            # The file system took the open but not the write (some FUSE and network mounts):
            # drop O_DIRECT on this fd and go on buffered from the same (block-aligned) offset.
            fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            self.direct = False
            _write_fully(self._fd, view)
        self.written += nbytes
        self._staged = 0

    def _stop_hasher(self) -> None:
        if self._hasher is not None:
            self._hasher.shutdown(wait=True)
            self._hasher = None

    def commit(self, durable: bool = True, check: Callable[[int, str], None] | None = None) -> str:
        """Finish, fsync (unless the caller syncs later, see `fsync_files`), rename into place;
        return the file's sha256 hex digest. `check(size, digest)` may raise to refuse the file
        before it is renamed (the writer is then aborted)."""
        self._stop_hasher()
        if self._staged:
            # O_DIRECT writes whole blocks: pad the tail with zeros, then cut the file to size.
            tail = self._staged
            padded = -(-tail // _DIRECT_ALIGN) * _DIRECT_ALIGN
            self._stage[tail:padded] = 0
            self._flush_stage(padded)
            self.written -= padded - tail
            os.ftruncate(self._fd, self.written)
        digest = self._hash.hexdigest()
        if check is not None:
            try:
                check(self.written, digest)
            except BaseException:
                self.abort()
                raise
        if durable:
            os.fsync(self._fd)
        os.close(self._fd)
        self._fd = -1
        replace_into(self.tmp, self.path)
        return digest

    def abort(self) -> None:
        self._stop_hasher()
        try:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
        finally:
            self.tmp.unlink(missing_ok=True)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *rest):
        if exc_type is not None:
            self.abort()


class ShardWriter:
    """Streams one safetensors file (a ByteWriter: hashed on the way, O_DIRECT with `direct`,
    atomic): the header is written from the declared specs, then each tensor in declared order,
    whole (`write`) or in consecutive pieces (`write_part`)."""

    def __init__(self, path: str | Path, specs: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None, *, direct: bool = False):
        self.path = Path(path)
        head, self._order, self.data_bytes = _header_bytes(specs, metadata)
        self._next = 0
        self._part = 0  # bytes of tensor _next written so far by write_part
        self._out = ByteWriter(self.path, direct=direct)
        self.tmp = self._out.tmp
        self._out.write(memoryview(head))
        self.nbytes = len(head) + self.data_bytes

    @property
    def direct(self) -> bool:
        return self._out.direct

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._next >= len(self._order):
            raise CheckpointError(f"tensor {name!r} was not declared", path=self.path, tensor=name)
        want, dtype, shape, nbytes = self._order[self._next]
        if name != want or tensor.dtype != dtype or tuple(tensor.shape) != shape or self._part:
            raise CheckpointError(f"got {name!r} {tensor.dtype} {tuple(tensor.shape)}, declared {want!r} {dtype} "
                                  f"{shape}", path=self.path, tensor=name)
        t = tensor.contiguous()
        if nbytes:
            self._out.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        self._next += 1

    def write_part(self, name: str, piece: torch.Tensor) -> None:
        """The next consecutive piece of the declared tensor `name` (e.g. one expert's slice of a
        stacked [E, ...] tensor), so a tensor is written without ever being whole in memory; the
        tensor is complete when its pieces add up to its declared size."""
        if self._next >= len(self._order):
            raise CheckpointError(f"tensor {name!r} was not declared", path=self.path, tensor=name)
        want, dtype, shape, nbytes = self._order[self._next]
        n = piece.numel() * piece.element_size()
        if name != want or piece.dtype != dtype or self._part + n > nbytes:
            raise CheckpointError(f"got a {n}-byte {piece.dtype} piece of {name!r}, declared {want!r} {dtype} "
                                  f"{shape} with {nbytes - self._part} bytes left", path=self.path, tensor=name)
        if n:
            self._out.write(memoryview(piece.contiguous().reshape(-1).view(torch.uint8).numpy()))
        self._part += n
        if self._part == nbytes:
            self._next, self._part = self._next + 1, 0

    def commit(self, durable: bool = True) -> str:
        """Finish, fsync (unless the caller syncs later, see `fsync_files`), rename into place;
        return the file's sha256 hex digest."""
        if self._next != len(self._order):  # also a tensor whose pieces stopped short
            missing = self._order[self._next][0]
            raise CheckpointError(f"closed before tensor {missing!r} was written", path=self.path, tensor=missing)

        def size_ok(size: int, digest: str) -> None:  # an internal invariant: the header promised this size
            if size != self.nbytes:
                raise CheckpointError(f"wrote {size} bytes, header declares {self.nbytes}", path=self.path)
        return self._out.commit(durable, size_ok)

    def abort(self) -> None:
        self._out.abort()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *rest):
        if exc_type is not None:
            self.abort()


def _open_for_write(path: Path, direct: bool) -> tuple[int, Path, bool]:
    """(fd, temporary path, direct) of a new temporary file for `path`, with O_DIRECT when asked
    for and the file system takes it."""
    if direct and hasattr(os, "O_DIRECT"):
        try:
            fd, tmp = create_temp(path, os.O_DIRECT)
            return fd, tmp, True
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
    fd, tmp = create_temp(path)
    return fd, tmp, False


def _write_fully(fd: int, b: memoryview) -> None:
    while b:
        n = os.write(fd, b)
        b = b[n:]


def fsync_files(paths) -> None:
    """Make finished files durable in one pass (the kernel has been writing them back meanwhile)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def sha256_file(path: str | Path, chunk: int = 8 << 20) -> str:
    h = hashlib.sha256()
    buf = bytearray(chunk)
    mv = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(mv[:n])
    return h.hexdigest()
