"""Verify a converted checkpoint: structure, values, integrity and (with --against) numerics.

The check a CI job runs after `inkling-quant convert`. Checks (docs/ci.md has the full list):
  index        index.json covers every shard and every tensor exactly once; no stray shard
  header[F]    shard F's safetensors header is well formed (offsets, dtypes, sizes)
  config       config.json parses; quantization_config / hf_quant_config.json agree with the
               tensors (algorithm per layer, exclude_modules, group sizes, input_scale presence)
  layout       every tensor the layout and the scheme require, with its dtype and shape; no other
  values[F]    no NaN/Inf in shard F; scales finite and positive; e8m0 exponents not 0xFF
  gate_up      the gate and up projections of each NVFP4 expert share weight_scale_2
  checksums    checksums.sha256 matches the bytes (hashed in the same single read as `values`)
  source       (--against) the source opens and has the same config
  passthrough  (--against) BF16/FP32 pass-through tensors are byte-identical to the source
  numerics[L]  (--against) sampled experts of layer L through the dequant-GEMM kernels against
               the BF16 weights: relative error and cosine within the format's thresholds

Exit codes: 0 every check passed; 1 a check failed (the checkpoint is wrong); 2 the input could
not be read (bad usage, no such directory, an I/O error) so verification is incomplete.
`--json REPORT` writes every check and figure, `--junit FILE` a JUnit XML (one testcase per check).
Python: `verify(ckpt, against=...) -> VerifyReport` (`.ok`, `.exit_code`, `.checks`, `.to_dict()`).
"""
from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import math
import os
import random
import re
import stat
import sys
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator
from xml.etree import ElementTree as ET

import numpy as np
import torch

from . import __version__
from .errors import InklingQuantError, UsageError, printable
from .formats import FORMATS, Format
from .io.checkpoint import INDEX_NAME, SINGLE_NAME, MAX_JSON_BYTES, safe_child
from .io.output import CHECKSUMS, check_paths, read_checksums, write_checksums, write_report
from .io.safetensors import DTYPE_NAMES, Header, ShardReader, TensorBuffer, TensorEntry, read_header
from .layout import (QUANT_SUFFIXES, ModelConfig, TensorName, TensorSpec, classify, expected_tensors, natural_key,
                     source_tensor_count)
from .schemes import SCHEMES, Scheme, get_scheme

QUANT_CONFIG = "hf_quant_config.json"
CONVERT_MANIFEST = ".inkling-quant-convert.json"  # present only while a conversion is unfinished
CHUNK = 32 << 20           # bytes per read: big sequential reads, hashed on a helper thread
SLICE = 2 << 20            # value checks run on cache-sized slices of a chunk
MAX_PROBLEMS = 200         # per check, in the report (the count is always exact)
ACT_ROWS = 32              # rows of the deterministic activations for the numerics check
DEFAULT_SAMPLE = 2         # experts per layer checked numerically (0 = all)
UNQUANTIZED = "none"       # pseudo-scheme: a checkpoint with no quantization config (a BF16 source)

PASS, FAIL, SKIP, ERROR = "pass", "fail", "skip", "error"


# ============================================================================ report
@dataclass
class Problem:
    file: str
    tensor: str | None
    message: str

    def __str__(self) -> str:
        named = self.tensor is None or repr(self.tensor) in self.message
        return f"{self.file}: {self.message}" if named else f"{self.file}: tensor {self.tensor!r}: {self.message}"


@dataclass
class Check:
    """One check; a testcase in JUnit. status: pass, fail, skip (not applicable or blocked by an
    earlier failure: `message` says why) or error (its input could not be read: exit 2)."""

    id: str
    category: str
    description: str
    status: str = PASS
    message: str = ""
    problems: list[Problem] = field(default_factory=list)
    problem_count: int = 0
    figures: dict = field(default_factory=dict)
    seconds: float = 0.0

    def fail(self, file: str, tensor: str | None, message: str) -> None:
        self.problem_count += 1
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append(Problem(str(file), tensor, message))
        if self.status == PASS:
            self.status = FAIL

    def error(self, file: str, message: str) -> None:
        self.fail(file, None, message)
        self.status = ERROR

    def skip(self, why: str) -> "Check":
        self.status, self.message = SKIP, why
        return self

    def summary(self) -> str:
        if self.status in (PASS, SKIP):
            return self.message
        more = f" (and {self.problem_count - 1} more)" if self.problem_count > 1 else ""
        return f"{self.problems[0]}{more}" if self.problems else self.message

    def to_dict(self) -> dict:
        return {"id": self.id, "category": self.category, "description": self.description,
                "status": self.status, "message": self.summary(), "problem_count": self.problem_count,
                "problems": [{"file": p.file, "tensor": p.tensor, "message": p.message} for p in self.problems],
                "figures": self.figures, "seconds": round(self.seconds, 4)}


@dataclass
class Row:
    """One line of the summary table: a format over a range of layers."""

    part: str
    layers: str
    format: str
    tensors: int = 0
    bytes: int = 0
    checked: int = 0                    # tensors compared numerically / byte for byte
    worst_rel_error: float | None = None
    worst_cosine: float | None = None
    max_rel_error: float | None = None
    min_cosine: float | None = None

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class VerifyReport:
    checkpoint: str
    against: str | None
    scheme: str
    device: str
    kernel_path: str | None = None
    sample: int = DEFAULT_SAMPLE
    checks: list[Check] = field(default_factory=list)
    rows: list[Row] = field(default_factory=list)
    numerics: list[dict] = field(default_factory=list)
    bytes_read: int = 0
    files_read: int = 0
    stream_seconds: float = 0.0
    seconds: float = 0.0
    checksums_written: str | None = None
    version: str = __version__

    @property
    def exit_code(self) -> int:
        if any(c.status == ERROR for c in self.checks):
            return 2
        return 1 if any(c.status == FAIL for c in self.checks) else 0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def check(self, id: str) -> Check:
        for c in self.checks:
            if c.id == id:
                return c
        raise KeyError(id)

    def failures(self) -> list[Check]:
        return [c for c in self.checks if c.status in (FAIL, ERROR)]

    def problems(self) -> Iterator[tuple[Check, Problem]]:
        for c in self.checks:
            for p in c.problems:
                yield c, p

    def raise_for_failure(self) -> None:
        """For callers in Python (demo, LoRA merge): raise CheckpointError on any failure."""
        from .errors import CheckpointError

        bad = self.failures()
        if bad:
            lines = [f"{c.id}: {c.summary()}" for c in bad[:5]]
            raise CheckpointError(f"{self.checkpoint}: verification failed ({len(bad)} check(s)): " + "; ".join(lines))

    @property
    def throughput_mb_s(self) -> float:
        return self.bytes_read / 1e6 / self.stream_seconds if self.stream_seconds > 0 else 0.0

    def to_dict(self) -> dict:
        counts = {s: sum(c.status == s for c in self.checks) for s in (PASS, FAIL, SKIP, ERROR)}
        return {"tool": "inkling-quant verify", "version": self.version, "checkpoint": self.checkpoint,
                "against": self.against, "scheme": self.scheme, "device": self.device,
                "kernel_path": self.kernel_path, "sample": self.sample, "ok": self.ok,
                "exit_code": self.exit_code, "counts": counts, "seconds": round(self.seconds, 3),
                "bytes_read": self.bytes_read, "files_read": self.files_read,
                "stream_seconds": round(self.stream_seconds, 3),
                "stream_mb_per_s": round(self.throughput_mb_s, 1),
                "checksums_written": self.checksums_written,
                "summary": [r.to_dict() for r in self.rows],
                "checks": [c.to_dict() for c in self.checks], "numerics": self.numerics}

    def to_json(self) -> str:
        return json.dumps(_finite(self.to_dict()), indent=2, default=str, allow_nan=False) + "\n"

    def to_junit(self) -> str:
        counts = {s: sum(c.status == s for c in self.checks) for s in (FAIL, SKIP, ERROR)}
        suites = ET.Element("testsuites", name="inkling-quant verify", tests=str(len(self.checks)),
                            failures=str(counts[FAIL]), errors=str(counts[ERROR]), time=f"{self.seconds:.3f}")
        suite = ET.SubElement(suites, "testsuite", name=f"verify {self.checkpoint}", tests=str(len(self.checks)),
                              failures=str(counts[FAIL]), errors=str(counts[ERROR]), skipped=str(counts[SKIP]),
                              time=f"{self.seconds:.3f}")
        props = ET.SubElement(suite, "properties")
        for k in ("checkpoint", "against", "scheme", "device", "kernel_path", "sample", "version"):
            ET.SubElement(props, "property", name=k, value=str(getattr(self, k)))
        for c in self.checks:
            case = ET.SubElement(suite, "testcase", classname=f"inkling_quant.verify.{c.category}", name=c.id,
                                 time=f"{c.seconds:.4f}")
            if c.status in (FAIL, ERROR):
                body = "\n".join(str(p) for p in c.problems)
                if c.problem_count > len(c.problems):
                    body += f"\n... and {c.problem_count - len(c.problems)} more"
                ET.SubElement(case, "failure" if c.status == FAIL else "error",
                              message=_xml_safe(c.summary())[:1000], type=c.category).text = _xml_safe(body)
            elif c.status == SKIP:
                ET.SubElement(case, "skipped", message=_xml_safe(c.message))
            if c.figures:
                ET.SubElement(case, "system-out").text = _xml_safe(json.dumps(_finite(c.figures), default=str))
        ET.indent(suites)
        return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(suites, encoding="unicode") + "\n"

    def format_summary(self) -> str:
        lines = [f"inkling-quant verify {self.checkpoint}" + (f" --against {self.against}" if self.against else "")
                 + f"  (scheme {self.scheme}, device {self.device}"
                 + (f", kernel {self.kernel_path}" if self.kernel_path else "") + ")"]
        if self.rows:
            head = f"  {'part':<8} {'layers':<7} {'format':<12} {'tensors':>7} {'bytes':>10} {'checked':>7}  " \
                   f"{'worst rel.err':>13} {'worst cos':>10}  threshold"
            lines.append(head)
            for r in self.rows:
                if r.worst_rel_error is not None:
                    err, cos = f"{r.worst_rel_error:13.4g}", f"{r.worst_cosine:10.6f}"
                    thr = f"rel.err <= {r.max_rel_error:g}, cos >= {r.min_cosine:g}"
                elif r.format == "passthrough" and r.checked:
                    err, cos, thr = f"{'0 (bytes)':>13}", f"{'1':>10}", "byte-identical"
                else:
                    err, cos, thr = f"{'-':>13}", f"{'-':>10}", "-"
                lines.append(f"  {r.part:<8} {r.layers:<7} {r.format:<12} {r.tensors:>7} {_human(r.bytes):>10} "
                             f"{r.checked:>7}  {err} {cos}  {thr}")
        counts = {s: sum(c.status == s for c in self.checks) for s in (PASS, FAIL, SKIP, ERROR)}
        lines.append(f"  checks: {counts[PASS]} passed, {counts[FAIL]} failed, {counts[ERROR]} could not run, "
                     f"{counts[SKIP]} skipped")
        for c in self.checks:
            if c.status in (FAIL, ERROR):
                lines.append(f"  {c.status.upper()} {c.id}: {c.problem_count} problem(s)")
                for p in c.problems[:10]:
                    lines.append(f"    {p}")
                if c.problem_count > 10:
                    lines.append(f"    ... and {c.problem_count - 10} more (see --json)")
            elif c.status == SKIP and c.id not in ("source", "passthrough"):
                lines.append(f"  skip {c.id}: {c.message}")
        if self.bytes_read:
            lines.append(f"  read {_human(self.bytes_read)} in {self.files_read} files once (hash + values) in "
                         f"{self.stream_seconds:.2f} s: {self.throughput_mb_s:.0f} MB/s; total {self.seconds:.2f} s")
        if self.checksums_written:
            lines.append(f"  wrote {self.checksums_written}")
        verdict = {0: "PASS", 1: "FAIL", 2: "INCOMPLETE (usage error or unreadable input)"}[self.exit_code]
        lines.append(f"  result: {verdict} (exit {self.exit_code})")
        return "\n".join(printable(line) for line in lines)  # a name read from a file cannot forge a line


def _finite(o):
    """JSON without NaN/Infinity (not JSON): non-finite floats become strings."""
    if isinstance(o, float) and not math.isfinite(o):
        return str(o)
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite(v) for v in o]
    return o


_XML_BAD = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


def _xml_safe(s: str) -> str:
    return _XML_BAD.sub("?", s)


def _human(n: int) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


# ============================================================================ streaming reader
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
            raise EOFError(f"{self.path}: file ended at byte {self.read} (changed while being read?)")
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


# ============================================================================ value rules
def _value_rule(t: TensorName | None, entry: TensorEntry) -> tuple[str, Callable[[memoryview], bool]] | None:
    """(what is checked, bad(bytes of whole elements) -> bool) for one tensor. Driven by dtype and
    name suffix: block and global scales must be finite and positive, e8m0 exponents must not be
    0xFF (NaN), every float tensor must be finite. Each test is one or two passes over the bytes
    with no per-element Python (min/max propagate NaN and show Inf), ~1.5-3 GB/s on one core."""
    suffix = t.suffix if t is not None else ""
    is_scale = suffix in ("weight_scale", "weight_scale_2", "input_scale")
    dt = entry.dtype
    if dt in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        if is_scale:
            def bad_scale(b, dt=dt):
                mn, mx = torch.aminmax(torch.frombuffer(b, dtype=dt))
                return not (float(mn) > 0 and math.isfinite(float(mx)))
            return "finite and positive", bad_scale

        def bad_float(b, dt=dt):
            mn, mx = torch.aminmax(torch.frombuffer(b, dtype=dt))
            return not (math.isfinite(float(mn)) and math.isfinite(float(mx)))
        return "finite (no NaN/Inf)", bad_float
    if dt == torch.float8_e4m3fn:
        if is_scale:  # positive finite e4m3 <=> byte in [0x01, 0x7E]; (b - 1) wraps 0 to 255
            return "finite and positive (e4m3 scale)", lambda b: int(_u8_op(b, np.subtract, 1).max()) > 0x7D
        return "finite (no e4m3 NaN)", lambda b: int(_u8_op(b, np.bitwise_and, 0x7F).max()) == 0x7F
    if dt == torch.float8_e5m2:
        return "finite (no NaN/Inf)", lambda b: int(_u8_op(b, np.bitwise_and, 0x7C).max()) == 0x7C
    if (dt == torch.uint8 or dt == torch.float8_e8m0fnu) and suffix == "weight_scale":
        return "e8m0 exponent in range (not 0xFF)", lambda b: int(np.frombuffer(b, np.uint8).max()) == 0xFF
    return None


_U8_TMP = threading.local()


def _u8_op(b: memoryview, op, value: int) -> np.ndarray:
    """op(bytes, value) into a reused scratch buffer (uint8 arithmetic wraps)."""
    a = np.frombuffer(b, np.uint8)
    tmp = getattr(_U8_TMP, "buf", None)
    if tmp is None or tmp.size < a.size:
        tmp = _U8_TMP.buf = np.empty(max(a.size, SLICE), np.uint8)
    return op(a, np.uint8(value), out=tmp[:a.size])


def _first_bad(x: torch.Tensor, rule: str) -> tuple[int, str]:
    """Index and value of the first offending element (only on the failure path)."""
    if x.dtype == torch.uint8 or "e8m0" in rule:
        b = x.view(torch.uint8).reshape(-1)
        bad = (b == 0xFF)
    elif x.dtype == torch.float8_e4m3fn:
        b = x.view(torch.uint8).reshape(-1)
        bad = ((b - 1) > 0x7D) if "positive" in rule else ((b & 0x7F) == 0x7F)
    else:
        f = x.reshape(-1).float()
        bad = ~torch.isfinite(f)
        if "positive" in rule:
            bad |= f <= 0
    idx = int(bad.nonzero()[0, 0]) if bool(bad.any()) else 0
    v = x.reshape(-1)[idx]
    shown = f"0x{int(v.view(torch.uint8)):02X}" if v.dtype in (torch.uint8, torch.float8_e4m3fn,
                                                                 torch.float8_e8m0fnu) else f"{float(v)}"
    if v.dtype == torch.float8_e4m3fn:
        shown += f" ({float(v.float())})"
    return idx, shown


# ============================================================================ helpers
@contextmanager
def _torch_threads(n: int):
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


def _load_json(path: Path, what: str, check: Check) -> dict | None:
    try:
        safe_child(path.parent, path.name, what)  # a symlink leaving the checkpoint: refused, as for shards
    except InklingQuantError as e:
        check.fail(path, None, str(e))
        return None
    try:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode):  # a FIFO or device would block or never end
            check.fail(path, None, f"{what} is not a regular file")
            return None
        if st.st_size > MAX_JSON_BYTES:
            check.fail(path, None, f"{what} larger than {MAX_JSON_BYTES} bytes")
            return None

        def no_dupes(pairs):
            d = {}
            for k, v in pairs:
                if k in d:
                    check.fail(path, k if what == "index" else None, f"{what}: key {k!r} appears more than once")
                d[k] = v
            return d
        obj = json.loads(path.read_text(encoding="utf-8"), object_pairs_hook=no_dupes)
    except FileNotFoundError:
        check.fail(path, None, f"{what} not found")
        return None
    except PermissionError as e:
        check.error(path, f"cannot read {what}: {e.strerror}")
        return None
    except (UnicodeDecodeError, ValueError) as e:  # JSONDecodeError, int digit limit
        check.fail(path, None, f"{what} is not valid JSON: {e}")
        return None
    except RecursionError:
        check.fail(path, None, f"{what} is not valid JSON: nested too deeply")
        return None
    except OSError as e:
        check.error(path, f"cannot read {what}: {e.strerror or e}")
        return None
    if not isinstance(obj, dict):
        check.fail(path, None, f"{what} must be a JSON object")
        return None
    return obj


def _span(layers: list[int]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for i in sorted(set(layers)):
        if out and out[-1][1] == i - 1:
            out[-1] = (out[-1][0], i)
        else:
            out.append((i, i))
    return out


class _Unquantized:
    """The scheme of a checkpoint without quantization config: every tensor passes through."""

    name = UNQUANTIZED

    def format_for(self, cfg, t) -> Format:
        return FORMATS["passthrough"]

    def format_name(self, cfg, t) -> str:
        return "passthrough"


def sample_experts(layer: int, num_experts: int, sample: int) -> list[int]:
    """Deterministic per layer: the same experts on every run and machine (sample 0 = all)."""
    if sample <= 0 or sample >= num_experts:
        return list(range(num_experts))
    return sorted(random.Random(1_000_003 * (layer + 1)).sample(range(num_experts), sample))


def activations(module: str, rows: int, k: int) -> torch.Tensor:
    """Deterministic bf16 activations [rows, k] for one module: standard Gaussian, seeded by the
    module's name (so a report is reproducible and independent of the sample's order)."""
    g = torch.Generator().manual_seed(zlib.crc32(module.encode()))
    return torch.randn(rows, k, generator=g).to(torch.bfloat16)


# ============================================================================ the verifier
@dataclass
class _Tensor:
    shard: str
    entry: TensorEntry


class Verifier:
    def __init__(self, ckpt: str | Path, against: str | Path | None = None, *, scheme: str | None = None,
                 sample: int = DEFAULT_SAMPLE, device: str = "cpu", write_checksums: bool = False,
                 progress: bool = False):
        self.root = Path(ckpt)
        self.src_root = Path(against) if against is not None else None
        self.scheme_arg = scheme
        self.sample = sample
        self.device = device
        self.write_checksums = write_checksums
        self.progress = progress
        self.report = VerifyReport(str(ckpt), str(against) if against is not None else None,
                                   scheme or "?", device, sample=sample)
        self.cfg: ModelConfig | None = None
        self.config: dict | None = None
        self.hf_quant: dict | None = None
        self.scheme: Scheme | _Unquantized | None = None
        self.weight_only = False
        self.headers: dict[str, Header] = {}          # shard -> header (well-formed ones)
        self.weight_map: dict[str, str] = {}
        self.tensors: dict[str, _Tensor] = {}         # name -> where (from well-formed headers)
        self.fmt_of: dict[str, str] = {}              # tensor name -> format it belongs to (expected)
        self.expected: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        self.module_tensors: dict[str, list[str]] = {}  # quantized module -> its expected tensors
        self.digests: dict[str, str] = {}
        self.scale2: dict[tuple[int, int], dict[str, float]] = {}
        self.src_headers: dict[str, Header] = {}
        self.src_tensors: dict[str, _Tensor] = {}
        self.row_stats: dict[tuple[str, int | None], list] = {}
        self.index_ok = False
        self._names: dict[str, TensorName] = {}
        self._formats: dict[tuple, Format] = {}

    def _classify(self, name: str) -> TensorName:
        t = self._names.get(name)
        if t is None:
            t = self._names[name] = classify(name)
        return t

    def _format(self, t: TensorName) -> Format:
        """scheme.format_for, memoized per (part, layer): the scheme's rules are layer ranges."""
        key = (t.part, t.layer)
        f = self._formats.get(key)
        if f is None:
            f = self._formats[key] = self.scheme.format_for(self.cfg, t)
        return f

    # ------------------------------------------------------------------ driver
    def run(self) -> VerifyReport:
        t0 = time.perf_counter()
        r = self.report
        if not self._check_input():
            r.seconds = time.perf_counter() - t0
            return r
        steps = [self._index, self._config, self._source, self._layout, self._stream, self._gate_up,
                 self._checksums, self._numerics]
        for step in steps:
            step()
        self._rows()
        if self.write_checksums:
            self._write_checksums()
        r.seconds = time.perf_counter() - t0
        return r

    def _new(self, id: str, category: str, description: str) -> Check:
        c = Check(id, category, description)
        self.report.checks.append(c)
        return c

    def _guard(self, c: Check, fn, *args):
        """Run a check body: our errors become problems, I/O errors make it ERROR (exit 2), and
        anything unexpected is reported as a failure with its type, never a traceback."""
        t = time.perf_counter()
        try:
            return fn(*args)
        except InklingQuantError as e:
            c.fail(*_split_error(str(e), str(self.root)))
        except PermissionError as e:
            c.error(getattr(e, "filename", None) or str(self.root), f"cannot read: {e.strerror}")
        except OSError as e:
            c.error(getattr(e, "filename", None) or str(self.root), f"I/O error: {e.strerror or e}")
        except EOFError as e:
            c.fail(*_split_error(str(e), str(self.root)))
        except Exception as e:  # a bug in a check must still end in a report, not a traceback
            if os.environ.get("INKLING_QUANT_DEBUG"):
                raise
            c.fail(str(self.root), None, f"internal error while checking ({type(e).__name__}: {e})")
        finally:
            c.seconds += time.perf_counter() - t
        return None

    def _check_input(self) -> bool:
        """False when the checkpoint cannot be read at all. An unreadable source only drops the
        --against checks (the report still ends in exit 2)."""
        c = self._new("input", "input", "the checkpoint (and source) directories can be read")
        ok = True
        for what, p in (("checkpoint", self.root), ("source", self.src_root)):
            if p is None:
                continue
            problem = ("directory does not exist" if not p.exists() else "is not a directory" if not p.is_dir()
                       else "directory is not readable" if not os.access(p, os.R_OK | os.X_OK) else None)
            if problem:
                c.error(str(p), f"{what} {problem}")
                if what == "checkpoint":
                    ok = False
                else:
                    self.src_root = None
        return ok

    # ------------------------------------------------------------------ index + headers
    def _index(self) -> None:
        c = self._new("index", "structure", "the index covers every shard and every tensor exactly once")
        self._guard(c, self._index_body, c)
        self.index_ok = c.status == PASS

    def _index_body(self, c: Check) -> None:
        root = self.root
        if (root / CONVERT_MANIFEST).exists():
            c.fail(root / CONVERT_MANIFEST, None, "a conversion into this directory is unfinished "
                   "(resume manifest present): run `inkling-quant convert --resume`")
        index = root / INDEX_NAME
        if index.exists():
            obj = _load_json(index, "index", c)
            if obj is None:
                return
            wm = obj.get("weight_map")
            if not isinstance(wm, dict) or not wm:
                c.fail(index, None, "'weight_map' must be a non-empty object")
                return
            safe: dict[str, bool] = {}
            for name, fname in wm.items():
                if not isinstance(fname, str):
                    c.fail(index, name, f"maps to non-string {fname!r}")
                    continue
                if fname not in safe:
                    try:
                        safe_child(root, fname, f"shard (for tensor {name!r})")
                        safe[fname] = True
                    except InklingQuantError as e:
                        safe[fname] = False
                        c.fail(index, name, str(e))
                        continue
                if not safe[fname]:
                    c.fail(index, name, f"maps to the unsafe file name {fname!r}")
                    continue
                self.weight_map[name] = fname
            total = (obj.get("metadata") or {}).get("total_size") if isinstance(obj.get("metadata"), dict) else None
            c.figures["index_total_size"] = total
        elif (root / SINGLE_NAME).exists():
            h = self._header(SINGLE_NAME)
            for p in sorted(root.glob("*.safetensors")):
                if p.name != SINGLE_NAME:
                    c.fail(p, None, f"shard beside {SINGLE_NAME} without an index")
            if h is not None:
                self.headers[SINGLE_NAME] = h
                self.weight_map = {n: SINGLE_NAME for n in h.tensors}
                self.tensors = {n: _Tensor(SINGLE_NAME, e) for n, e in h.tensors.items()}
            return
        else:
            c.fail(root, None, f"neither {INDEX_NAME} nor {SINGLE_NAME} found")
            return
        shards = list(dict.fromkeys(self.weight_map.values()))
        present = []
        for s in shards:
            p = root / s
            if not p.is_file():
                bad = [n for n, f in self.weight_map.items() if f == s]
                c.fail(index, bad[0], f"shard {s} named in the index does not exist "
                       f"({len(bad)} tensor(s) point to it)")
            else:
                present.append(s)
        for p in sorted(root.glob("*.safetensors")):
            if p.name not in shards:
                c.fail(p, None, "shard is not referenced by the index (a stray or renamed file)")
        # every shard's header, and the index against them: each tensor exactly once
        owner: dict[str, str] = {}
        for s in present:
            h = self._header(s)
            if h is None:
                continue
            self.headers[s] = h
            for name, e in h.tensors.items():
                if name in owner:
                    c.fail(root / s, name, f"tensor also stored in {owner[name]} (must appear exactly once)")
                    continue
                owner[name] = s
                indexed = self.weight_map.get(name)
                if indexed is None:
                    c.fail(root / s, name, "tensor is not in the index")
                elif indexed != s:
                    c.fail(root / s, name, f"tensor is indexed under {indexed}")
                self.tensors[name] = _Tensor(s, e)
        for name, s in self.weight_map.items():
            if s in self.headers and name not in self.headers[s].tensors:
                c.fail(root / s, name, "index lists this tensor, the shard lacks it")
        data = sum(e.entry.nbytes for e in self.tensors.values())
        c.figures.update(shards=len(shards), tensors=len(self.weight_map), tensor_bytes=data)
        if c.figures.get("index_total_size") is not None:  # informational: HF does not enforce it
            c.figures["index_total_size_matches"] = c.figures["index_total_size"] == data

    def _header(self, shard: str) -> Header | None:
        hc = self._new(f"header[{shard}]", "structure", f"{shard}: safetensors header well-formed")
        h = self._guard(hc, read_header, safe_child(self.root, shard, "shard"))
        if h is not None:
            hc.figures.update(tensors=len(h.tensors), bytes=h.file_size)
        return h

    # ------------------------------------------------------------------ config
    def _config(self) -> None:
        c = self._new("config", "config", "config.json / hf_quant_config.json agree with the tensors")
        self._guard(c, self._config_load, c)
        if self.scheme is not None:
            self.report.scheme = self.scheme.name

    def _config_load(self, c: Check) -> None:
        path = self.root / "config.json"
        self.config = _load_json(path, "config.json", c)
        if self.config is None:
            return
        try:
            self.cfg = ModelConfig.from_dict(self.config, str(path))
        except InklingQuantError as e:
            c.fail(path, None, str(e))
            return
        qpath = self.root / QUANT_CONFIG
        if qpath.exists():
            self.hf_quant = _load_json(qpath, QUANT_CONFIG, c)
        # the scheme: --scheme, else the converter's record, else default (none if unquantized)
        name = self.scheme_arg
        converter = (self.hf_quant or {}).get("converter") if isinstance(self.hf_quant, dict) else None
        if name is None and isinstance(converter, dict) and isinstance(converter.get("scheme"), str):
            name = converter["scheme"]
        if name is None:
            quantized = "quantization_config" in self.config or self.hf_quant is not None
            name = "default" if quantized else UNQUANTIZED
        if name == UNQUANTIZED:
            self.scheme = _Unquantized()
        elif name in SCHEMES:
            self.scheme = SCHEMES[name]
        else:
            c.fail(qpath, None, f"converter.scheme {name!r} is not a known scheme ({', '.join(SCHEMES)}); "
                   f"pass --scheme")
        c.figures["scheme"] = name
        if isinstance(converter, dict) and self.scheme_arg and converter.get("scheme") not in (None, self.scheme_arg):
            c.figures["converter_scheme"] = converter.get("scheme")

    def _config_check(self, c: Check) -> None:
        """After the layout check (which decides weight_only from the tensors)."""
        cfg = self.cfg
        path, qpath = self.root / "config.json", self.root / QUANT_CONFIG
        want: dict[str, dict] = {}
        for s in expected_tensors(cfg):
            t = self._classify(s.name)
            entry = self._format(t).layer_config(self.weight_only)
            if entry is not None:
                want[s.name[: -len(".weight")]] = entry
        qc = self.config.get("quantization_config")
        if not want:
            if qc is not None:
                c.fail(path, None, "has a quantization_config but the scheme quantizes nothing")
            return
        if not isinstance(qc, dict):
            c.fail(path, None, "missing 'quantization_config' (vLLM would load the checkpoint unquantized)")
            return
        if not str(qc.get("quant_method", "")).startswith("modelopt"):
            c.fail(path, None, f"quantization_config.quant_method is {qc.get('quant_method')!r}, expected 'modelopt'")
        self._check_quant_dict(c, path, "quantization_config", qc, want)
        hq = self.hf_quant
        if hq is None:
            c.fail(qpath, None, f"{QUANT_CONFIG} missing")
        elif not isinstance(hq.get("quantization"), dict):
            c.fail(qpath, None, "missing the 'quantization' object")
        else:
            q = hq["quantization"]
            self._check_quant_dict(c, qpath, "quantization", q, want)
            for k in sorted(set(q) | set(qc) - {"quant_method"}):
                if k != "quant_method" and q.get(k) != qc.get(k):
                    c.fail(qpath, None, f"quantization.{k} disagrees with config.json quantization_config.{k}")
            if not isinstance(hq.get("producer"), dict):
                c.fail(qpath, None, "missing the 'producer' object")
            conv = hq.get("converter")
            if isinstance(conv, dict) and "weight_only" in conv and bool(conv["weight_only"]) != self.weight_only:
                c.fail(qpath, None, f"converter.weight_only is {conv['weight_only']} but the NVFP4 tensors "
                       f"{'lack' if self.weight_only else 'have'} input_scale")
        c.figures.update(quantized_layers=len(want), weight_only=self.weight_only)

    def _check_quant_dict(self, c: Check, path: Path, key: str, q: dict, want: dict[str, dict]) -> None:
        if q.get("quant_algo") != "MIXED_PRECISION":
            c.fail(path, None, f"{key}.quant_algo is {q.get('quant_algo')!r}, expected 'MIXED_PRECISION'")
        if q.get("kv_cache_quant_algo") is not None:
            c.fail(path, None, f"{key}.kv_cache_quant_algo is {q['kv_cache_quant_algo']!r} but the checkpoint "
                   f"has no KV-cache scales (expected null)")
        layers = q.get("quantized_layers")
        if not isinstance(layers, dict) or not layers:
            c.fail(path, None, f"{key}.quantized_layers must be a non-empty object (vLLM refuses an empty one)")
            return
        algos = {f.quant_algo: f for f in FORMATS.values() if f.quant_algo}
        for module, entry in want.items():
            got = layers.get(module)
            if got is None:
                c.fail(path, f"{module}.weight", f"{key}.quantized_layers lacks {module!r} "
                       f"(the tensors are {entry['quant_algo']}: vLLM would load them as BF16)")
                continue
            if not isinstance(got, dict):
                c.fail(path, f"{module}.weight", f"{key}.quantized_layers[{module!r}] must be an object")
                continue
            if got.get("quant_algo") != entry.get("quant_algo"):
                c.fail(path, f"{module}.weight", f"{key}.quantized_layers[{module!r}].quant_algo is "
                       f"{got.get('quant_algo')!r}, the tensors are {entry.get('quant_algo')!r}"
                       + (" (input_scale present)" if entry.get("quant_algo") == "NVFP4" else
                          " (no input_scale)" if "NVFP4" in str(entry.get("quant_algo")) else ""))
                continue
            gs = got.get("group_size")
            fmt = algos.get(entry.get("quant_algo"))
            block = entry.get("group_size", fmt.block_size if fmt else None)
            if gs is not None and gs != block:
                c.fail(path, f"{module}.weight", f"{key}.quantized_layers[{module!r}].group_size is {gs}, "
                       f"the tensors use blocks of {block}")
        for module in layers:
            if module not in want:
                c.fail(path, f"{module}.weight", f"{key}.quantized_layers names {module!r}, which the tensors "
                       f"do not quantize")
        excl = q.get("exclude_modules", [])
        if not isinstance(excl, list) or not all(isinstance(p, str) for p in excl):
            c.fail(path, None, f"{key}.exclude_modules must be a list of strings")
            return
        excluded = _exclusion_matcher(excl)
        hit: set[str] = set()
        for module in want:
            pat = excluded(module)
            if pat is not None and pat not in hit:  # one problem per pattern
                hit.add(pat)
                c.fail(path, f"{module}.weight", f"{key}.exclude_modules pattern {pat!r} excludes the "
                       f"quantized module {module!r} (vLLM would load it as BF16)")
        if "group_size" in q:
            nv = [e.get("group_size") for e in want.values() if "NVFP4" in str(e.get("quant_algo"))]
            if nv and q["group_size"] != nv[0]:
                c.fail(path, None, f"{key}.group_size is {q['group_size']}, the NVFP4 tensors use {nv[0]}")

    # ------------------------------------------------------------------ layout
    def _layout(self) -> None:
        c = self._new("layout", "structure",
                      "every tensor the layout and the scheme require is present with its dtype and shape; no other")
        cc = self.report.check("config")
        if self.cfg is None or self.scheme is None:
            c.skip("config.json could not be used")
        elif not self.index_ok and not self.tensors:
            c.skip("the index could not be read")
        elif not self._counts_agree(c):
            return  # the config check would list the same implied tensors
        else:
            self._guard(c, self._layout_body, c)
        if self.cfg is not None and self.scheme is not None and cc.status != ERROR:
            self._guard(cc, self._config_check, cc)

    def _counts_agree(self, c: Check) -> bool:
        """The layout and config checks list every tensor config.json implies: bound that work
        by what the files hold. Each source tensor becomes at least one output tensor, so a
        config implying many more than the checkpoint holds disagrees with it (a 1 MB checkpoint
        whose config claims 16,384 experts a layer fails here at once, not after minutes)."""
        implied, held = source_tensor_count(self.cfg), len(self.weight_map) or len(self.tensors)
        if implied > 4 * held + 64:
            c.fail(self.root / "config.json", None, f"config.json implies {implied} source tensors, the checkpoint "
                   f"holds {held}: they disagree (layer or expert counts?); not checked tensor by tensor")
            return False
        return True

    def _layout_body(self, c: Check) -> None:
        cfg, scheme = self.cfg, self.scheme
        specs = list(expected_tensors(cfg))
        # weight-only (W4A16) or W4A4: decided by the NVFP4 tensors themselves; config is checked against it
        with_scale = without = 0
        for s in specs:
            t = self._classify(s.name)
            fmt = self._format(t)
            if "input_scale" in fmt.out_specs(s.shape, s.dtype, True) and \
                    "input_scale" not in fmt.out_specs(s.shape, s.dtype, False):
                if f"{t.module}.input_scale" in self.tensors:
                    with_scale += 1
                else:
                    without += 1
        if with_scale or without:
            self.weight_only = without > with_scale
        else:
            conv = (self.hf_quant or {}).get("converter") or {}
            self.weight_only = bool(conv.get("weight_only", False)) if isinstance(conv, dict) else False
        seen: set[str] = set()
        unreadable: dict[str, list[str]] = {}
        for s in specs:
            t = self._classify(s.name)
            fmt = self._format(t)
            src_dtype = s.dtype
            if fmt.name == "passthrough" and s.name in self.src_tensors:
                src_dtype = self.src_tensors[s.name].entry.dtype  # pass-through keeps the source dtype
            elif fmt.name == "passthrough" and s.name in self.tensors and \
                    self.tensors[s.name].entry.dtype in fmt.source_dtypes:
                src_dtype = self.tensors[s.name].entry.dtype  # no source to ask: any dtype a source may hold
            out = fmt.out_specs(s.shape, src_dtype, not self.weight_only)
            if fmt.name == "passthrough":
                want = {s.name: (tuple(o.shape), o.dtype) for o in out.values()}
            else:
                want = {f"{t.module}.{k}": (tuple(o.shape), o.dtype) for k, o in out.items()}
            for n, w in want.items():
                self.expected[n] = w
                self.fmt_of[n] = fmt.name
            if fmt.name != "passthrough":
                self.module_tensors[t.module] = list(want)
            module = t.module if s.name.endswith(".weight") else None
            got_names = [n for n in want if n in self.tensors]
            if module is not None:  # a module may be stored in another format: name that
                got_names = [f"{module}.{x}" for x in ("weight",) + QUANT_SUFFIXES
                             if f"{module}.{x}" in self.tensors]
            seen.update(got_names)
            got = {n: self.tensors[n] for n in got_names}
            if {n: (e.entry.shape, e.entry.dtype) for n, e in got.items()} == want:
                continue
            if module is not None and got:
                other = _detect_format(module, {n[len(module) + 1:]: (e.entry.shape, e.entry.dtype)
                                                for n, e in got.items()}, s, src_dtype)
                if other is not None and other != fmt.name:
                    first = got[sorted(got)[0]]
                    c.fail(self.root / first.shard, got_names[0],
                           f"module {module!r} is stored as {other}; scheme {scheme.name!r} prescribes "
                           f"{fmt.name} for {t.part} tensors of layer {t.layer}")
                    continue
            for n, (shape, dtype) in want.items():
                if n not in got:
                    shard = self.weight_map.get(n)
                    if shard is not None and shard not in self.headers:
                        unreadable.setdefault(shard, []).append(n)  # its header check failed
                        continue
                    c.fail(self.root / INDEX_NAME, n, f"missing: {fmt.name} requires it "
                           f"({DTYPE_NAMES[dtype]} {list(shape)})")
                    continue
                e = got[n].entry
                if (e.shape, e.dtype) != (shape, dtype):
                    c.fail(self.root / got[n].shard, n, f"is {DTYPE_NAMES[e.dtype]} {list(e.shape)}, "
                           f"{fmt.name} prescribes {DTYPE_NAMES[dtype]} {list(shape)}")
            for n in got:
                if n not in want:
                    c.fail(self.root / got[n].shard, n, f"unexpected: {fmt.name} writes no such tensor")
        for n in sorted(set(self.tensors) - seen, key=natural_key):
            try:
                classify(n)
                why = "not part of the layout for this config.json (e.g. a layer or expert past its counts)"
            except InklingQuantError:
                why = "not a tensor of the Inkling 2 Small layout (docs/layout.md)"
            if isinstance(scheme, _Unquantized) and n.endswith(".input_scale") and self.tensors[n].entry.nbytes <= 4:
                continue  # a BF16 source may carry calibrated activation scales
            c.fail(self.root / self.tensors[n].shard, n, f"unexpected tensor: {why}")
        for shard, names in unreadable.items():
            c.fail(self.root / shard, names[0], f"{len(names)} tensor(s) the index puts in this shard could "
                   f"not be checked: its header is malformed (see header[{shard}])")
        c.figures.update(expected=len(self.expected), present=len(self.tensors))

    # ------------------------------------------------------------------ source
    def _source(self) -> None:
        if self.src_root is not None:
            c = self._new("source", "numerics", "the source checkpoint opens and has the same config")
            self._guard(c, self._source_body, c)

    def _source_body(self, c: Check) -> None:
        root = self.src_root
        from .io.checkpoint import Checkpoint

        try:
            ck = Checkpoint.open(root)
            hs = ck.headers()
        except InklingQuantError as e:
            c.error(root, f"source cannot be read: {e}")
            return
        self.src_headers = hs
        for s, h in hs.items():
            for n, e in h.tensors.items():
                self.src_tensors[n] = _Tensor(s, e)
        probe = Check("source-config", "numerics", "")
        src_cfg = _load_json(root / "config.json", "source config.json", probe)
        if src_cfg is None:
            for p in probe.problems:
                c.error(p.file, p.message)  # the source is an input: unreadable means exit 2
            return
        if self.config is not None:
            mine = {k: v for k, v in self.config.items() if k != "quantization_config"}
            theirs = {k: v for k, v in src_cfg.items() if k != "quantization_config"}
            for k in sorted(set(mine) | set(theirs)):
                if mine.get(k) != theirs.get(k):
                    c.fail(self.root / "config.json", None, f"key {k!r} differs from the source's config.json "
                           f"({_short(mine.get(k))} vs {_short(theirs.get(k))})")
        c.figures.update(shards=len(hs), tensors=len(self.src_tensors))

    # ------------------------------------------------------------------ values + hashes (one read)
    def _stream(self) -> None:
        """One pass over every file: sha256 of each (for checksums), value checks of each tensor,
        and (--against) pass-through tensors compared byte for byte with the source."""
        shards = [s for s in dict.fromkeys(self.weight_map.values()) if s in self.headers]
        # files hashed without value checks: listed in checksums.sha256, or shards whose header is bad
        others = [s for s in dict.fromkeys(self.weight_map.values()) if s not in self.headers
                  and (self.root / s).is_file()]
        others += [n for n in self._read_checksum_names() if n not in shards and n not in others]
        if self.write_checksums:
            others += [p.name for p in sorted(self.root.iterdir()) if _checksummable(p)
                       and p.name not in shards and p.name not in others]
        if not shards:
            self._new("values", "values", "no NaN/Inf; scales finite and positive").skip("no readable shard")
        pt = None
        if self.src_root is not None and self.report.check("source").status == PASS and shards:
            pt = self._new("passthrough", "numerics", "pass-through tensors are byte-identical to the source")
            pt.figures.update(tensors_compared=0, bytes_compared=0)
        t0 = time.perf_counter()
        hasher = ThreadPoolExecutor(1, thread_name_prefix="verify-sha256")
        biggest = max([h.file_size for h in self.headers.values()] + [1 << 20])
        size = min(CHUNK, biggest)
        self._bufs = [bytearray(size + 64), bytearray(size + 64)]  # reused for every file
        fds: dict[str, int] = {}
        threads = _torch_threads(1)
        threads.__enter__()  # exited in the finally below, with the hasher
        self._bar = None
        if self.progress:
            from tqdm import tqdm

            total = sum(self.headers[n].file_size for n in shards) + sum(self._size(n) for n in others)
            self._bar = tqdm(total=total, unit="B", unit_scale=True, desc="verify", leave=False)
        try:
            for name in shards:
                c = self._new(f"values[{name}]", "values", f"{name}: no NaN/Inf; scales finite and positive")
                self._guard(c, self._stream_file, name, self.headers[name], c, pt, fds, hasher)
            io = Check("read", "integrity", "every listed file can be read")
            for name in others:
                try:
                    path = safe_child(self.root, name, "file")
                except InklingQuantError:
                    continue  # the checksums check reports the name
                if path.is_file():
                    self._guard(io, self._stream_file, name, None, None, None, fds, hasher)
            if io.status != PASS:
                self.report.checks.append(io)
        finally:
            threads.__exit__(None, None, None)
            if self._bar is not None:
                self._bar.close()
            hasher.shutdown(wait=True)
            for fd in fds.values():
                os.close(fd)
        self.report.stream_seconds = time.perf_counter() - t0

    def _size(self, name: str) -> int:
        try:
            p = safe_child(self.root, name, "file")
            return p.stat().st_size if p.is_file() else 0
        except (InklingQuantError, OSError):
            return 0

    def _stream_file(self, name: str, h: Header | None, c: Check | None, pt: Check | None, fds: dict,
                     hasher: ThreadPoolExecutor) -> None:
        st = _Stream(self.root / name, hasher, self._bufs, self._bar.update if self._bar is not None else None)
        try:
            if h is not None:
                st.skip(h.data_start)
                buf = TensorBuffer()
                for tname, e in h.tensors.items():  # file order
                    self._stream_tensor(st, name, tname, e, c, pt, fds, buf)
                c.figures.update(tensors=len(h.tensors), bytes=h.file_size)
            self.digests[name] = st.finish()
            self.report.bytes_read += st.read
            self.report.files_read += 1
        finally:
            st.close()

    def _stream_tensor(self, st: _Stream, shard: str, name: str, e: TensorEntry, c: Check, pt: Check | None,
                       fds: dict, buf: TensorBuffer) -> None:
        try:
            t = self._classify(name)
        except InklingQuantError:
            t = None
        rule = _value_rule(t, e)
        fmt = self.fmt_of.get(name)
        quantized_expert = t is not None and t.is_expert and fmt not in (None, "passthrough")
        stats = self.row_stats.setdefault((fmt or "unexpected", t.layer if quantized_expert else None), [0, 0, 0])
        stats[0] += 1
        stats[1] += e.nbytes
        scale2 = (t is not None and t.is_expert and t.suffix == "weight_scale_2" and e.dtype == torch.float32
                  and e.nbytes == 4 and t.projection in ("gate_proj", "up_proj"))
        src = None
        if pt is not None and fmt == "passthrough":
            src = self.src_tensors.get(name)
            if src is None:
                pt.fail(self.root / shard, name, "pass-through tensor has no counterpart in the source")
            elif (src.entry.dtype, src.entry.shape) != (e.dtype, e.shape):
                pt.fail(self.root / shard, name, f"is {DTYPE_NAMES[e.dtype]} {list(e.shape)}, the source has "
                        f"{DTYPE_NAMES[src.entry.dtype]} {list(src.entry.shape)}")
                src = None
        item = e.dtype.itemsize
        offset = 0
        bad = False
        same = True
        for piece in st.pieces(e.nbytes, item):
            if scale2:
                self.scale2.setdefault((t.layer, t.expert), {})[t.projection] = \
                    float(torch.frombuffer(piece, dtype=torch.float32)[0])
            if rule is not None and not bad and e.dtype == torch.float32 and len(piece) <= 64:
                vals = piece.cast("f")  # scalars (global and input scales): no torch op per value
                positive = "positive" in rule[0]
                for i, v in enumerate(vals):
                    if not math.isfinite(v) or (positive and v <= 0):
                        where = f" ({t.suffix} of {t.module})" if t is not None and t.suffix != "weight" else ""
                        c.fail(self.root / shard, name, f"must be {rule[0]}{where}: element "
                               f"{offset // item + i} is {v}")
                        bad = True
                        break
            elif rule is not None and not bad:
                for lo in range(0, len(piece), SLICE):
                    if rule[1](piece[lo:lo + SLICE]):
                        idx, val = _first_bad(torch.frombuffer(piece[lo:lo + SLICE], dtype=e.dtype), rule[0])
                        where = f" ({t.suffix} of {t.module})" if t is not None and t.suffix != "weight" else ""
                        c.fail(self.root / shard, name, f"must be {rule[0]}{where}: element "
                               f"{(offset + lo) // item + idx} is {val}")
                        bad = True
                        break
            if src is not None and same:
                same = self._compare(pt, shard, name, src, piece, offset, fds, buf)
            offset += len(piece)
        if src is not None:
            pt.figures["tensors_compared"] += 1
            pt.figures["bytes_compared"] += e.nbytes

    def _compare(self, pt: Check, shard: str, name: str, src: _Tensor, piece: memoryview, offset: int,
                 fds: dict, buf: TensorBuffer) -> bool:
        fd = fds.get(src.shard)
        if fd is None:
            fd = fds[src.shard] = os.open(safe_child(self.src_root, src.shard, "shard"), os.O_RDONLY)
        mv = buf.view(len(piece))
        got = 0
        while got < len(piece):
            n = os.preadv(fd, [mv[got:]], src.entry.begin + offset + got)
            if n == 0:
                raise EOFError(f"{self.src_root / src.shard}: tensor {name!r}: source file ended early")
            got += n
        a = torch.frombuffer(piece, dtype=torch.uint8)
        b = torch.frombuffer(mv, dtype=torch.uint8)
        if torch.equal(a, b):
            return True
        first = int((a != b).nonzero()[0, 0]) + offset
        pt.fail(self.root / shard, name, f"differs from the source ({self.src_root / src.shard}) at byte "
                f"{first} of the tensor: pass-through must be bit-exact")
        return False

    def _read_checksum_names(self) -> dict[str, str]:
        p = self.root / CHECKSUMS
        if not p.is_file():
            return {}
        try:
            return read_checksums(p, problem=lambda where, msg: None)
        except (InklingQuantError, OSError):
            return {}

    # ------------------------------------------------------------------ gate/up shared scale
    def _gate_up(self) -> None:
        nvfp4 = [n for n, f in self.fmt_of.items() if n.endswith(".weight_scale_2")]
        if not nvfp4:
            return
        c = self._new("gate_up", "values", "gate and up of each NVFP4 expert share weight_scale_2")
        n = 0
        for (layer, expert), d in sorted(self.scale2.items()):
            if "gate_proj" in d and "up_proj" in d:
                n += 1
                g, u = d["gate_proj"], d["up_proj"]
                if not (g == u or (math.isnan(g) and math.isnan(u))):
                    name = f"model.layers.{layer}.mlp.experts.{expert}.up_proj.weight_scale_2"
                    where = self.tensors.get(name)
                    c.fail(self.root / (where.shard if where else INDEX_NAME), name,
                           f"{u!r} differs from gate_proj's {g!r}: vLLM fuses gate and up (w13) under one "
                           f"weight_scale_2 and would use gate's for both")
        c.figures["experts"] = n

    # ------------------------------------------------------------------ checksums
    def _checksums(self) -> None:
        c = self._new("checksums", "integrity", f"{CHECKSUMS} matches every file")
        self._guard(c, self._checksums_body, c)

    def _checksums_body(self, c: Check) -> None:
        p = self.root / CHECKSUMS
        if p.exists() and not p.is_file():
            c.fail(p, None, f"{CHECKSUMS} is not a regular file")
            return
        if not p.is_file():
            if self.write_checksums:
                c.skip(f"no {CHECKSUMS} yet (--write-checksums writes one)")
            else:
                c.fail(p, None, f"{CHECKSUMS} not found (create one with `inkling-quant verify --write-checksums`)")
            return
        sums = read_checksums(p, problem=lambda where, msg: c.fail(where, None, msg))
        for name, digest in sums.items():
            try:
                safe_child(self.root, name, "file")
            except InklingQuantError as e:
                c.fail(p, None, str(e))
                continue
            got = self.digests.get(name)
            if got is None:
                if not (self.root / name).is_file():
                    c.fail(self.root / name, None, f"listed in {CHECKSUMS} but missing")
                continue
            if got != digest:
                c.fail(self.root / name, None, f"sha256 {got} does not match {CHECKSUMS} ({digest}): the file "
                       f"changed after it was written")
        listed = set(sums)
        unlisted = [q.name for q in sorted(self.root.iterdir()) if _checksummable(q) and q.name not in listed]
        for name in unlisted:
            if name.endswith(".safetensors"):
                c.fail(self.root / name, None, f"shard is not listed in {CHECKSUMS}")
        c.figures.update(files=len(sums), matched=sum(self.digests.get(n) == d for n, d in sums.items()),
                         unlisted=unlisted)

    def _write_checksums(self) -> None:
        r = self.report
        bad = [c for c in r.checks if c.status in (FAIL, ERROR)]
        c = self._new("write_checksums", "integrity", f"write {CHECKSUMS}")
        if bad:
            c.fail(self.root / CHECKSUMS, None, f"not written: the checkpoint failed verification "
                   f"({', '.join(x.id for x in bad[:5])})")
            return
        files = [q.name for q in sorted(self.root.iterdir()) if _checksummable(q)]
        missing = [f for f in files if f not in self.digests]
        if missing:
            c.fail(self.root / missing[0], None, "appeared while verifying; not written")
            return
        path = self.root / CHECKSUMS
        try:
            write_checksums(path, {n: self.digests[n] for n in files})
        except InklingQuantError as e:  # a name that would forge a line, a symlink where the file goes
            c.fail(path, None, str(e))
            return
        except OSError as e:
            c.error(path, f"cannot write: {e.strerror or e}")
            return
        r.checksums_written = str(path)
        c.figures["files"] = len(files)

    # ------------------------------------------------------------------ numerics
    def _numerics(self) -> None:
        if self.src_root is None:
            return
        src = self.report.check("source")
        layout = self.report.check("layout")
        if src.status != PASS:
            self._new("numerics", "numerics", "sampled experts against the source").skip(
                "the source check failed")
            return
        if self.cfg is None or self.scheme is None or layout.status == SKIP:
            self._new("numerics", "numerics", "sampled experts against the source").skip("no usable config")
            return
        from . import kernels

        dev = torch.device(self.device)
        # cpu: the torch reference. cuda: the Triton kernel, weight-only (dequantize in registers,
        # bf16 MMA); the sm100 path also quantizes the activations (W4A4/W8A8), an error the
        # thresholds (weights vs their BF16 source) do not budget for.
        path = kernels.PATH_REFERENCE if dev.type == "cpu" else kernels.select_path(dev)
        if path == kernels.PATH_SM100:
            path = kernels.PATH_BF16_MMA
        self.report.kernel_path = path
        cfg = self.cfg
        by_layer: dict[int, list[tuple[str, str]]] = {}
        for i in range(cfg.num_hidden_layers):
            for e in sample_experts(i, cfg.num_experts, self.sample):
                for proj in ("gate_proj", "up_proj", "down_proj"):
                    module = f"model.layers.{i}.mlp.experts.{e}.{proj}"
                    fmt = self._format(self._classify(module + ".weight")).name
                    if fmt != "passthrough":
                        by_layer.setdefault(i, []).append((module, fmt))
        readers: dict[tuple[str, str], ShardReader] = {}
        small = cfg.hidden_size * cfg.moe_intermediate_size < (1 << 22)
        threads = _torch_threads(1 if small else torch.get_num_threads())
        try:
            with threads:
                for layer, modules in by_layer.items():
                    c = self._new(f"numerics[layer {layer}]", "numerics",
                                  f"layer {layer}: sampled experts' dequant-GEMM vs the BF16 source")
                    self._guard(c, self._numerics_layer, c, layer, modules, readers, dev, path)
        finally:
            for r in readers.values():
                r.close()

    def _reader(self, readers, root: Path, shard: str, header: Header) -> ShardReader:
        key = (str(root), shard)
        r = readers.get(key)
        if r is None:
            r = readers[key] = ShardReader(root / shard, header)
        return r

    def _numerics_layer(self, c: Check, layer: int, modules: list[tuple[str, str]], readers, dev, path) -> None:
        from . import kernels

        worst_err, worst_cos = 0.0, 1.0
        for module, fmt_name in modules:
            fmt = FORMATS[fmt_name]
            wname = module + ".weight"
            src = self.src_tensors.get(wname)
            if src is None:
                c.fail(self.src_root / INDEX_NAME, wname, "source lacks this tensor")
                continue
            names = [n for n in self.module_tensors.get(module, []) if self.fmt_of.get(n) == fmt_name]
            if not names:
                c.fail(self.root / INDEX_NAME, wname, "cannot run the numerics check: not in the layout")
                continue
            miss = [n for n in names if n not in self.tensors or self.tensors[n].shard not in self.headers]
            if miss:
                c.fail(self.root / INDEX_NAME, miss[0], "cannot run the numerics check: tensor missing")
                continue
            wrong = [n for n in names if (self.tensors[n].entry.shape, self.tensors[n].entry.dtype) != self.expected[n]]
            if wrong:
                c.fail(self.root / self.tensors[wrong[0]].shard, wrong[0],
                       "cannot run the numerics check: wrong dtype or shape (see the layout check)")
                continue
            q = {}
            for n in names:
                where = self.tensors[n]
                q[n[len(module) + 1:]] = self._reader(readers, self.root, where.shard,
                                                      self.headers[where.shard]).get(n)
            w = self._reader(readers, self.src_root, src.shard, self.src_headers[src.shard]).get(wname)
            k = w.shape[-1]
            x = activations(module, ACT_ROWS, k)
            ref = x.float() @ w.float().T
            xd = x.to(dev)
            if fmt_name == "nvfp4":
                y = kernels.nvfp4_dequant_gemm(xd, q["weight"].to(dev), q["weight_scale"].to(dev),
                                               q["weight_scale_2"].to(dev), out_dtype=torch.float32, path=path)
            elif fmt_name == "mxfp8":
                y = kernels.mxfp8_dequant_gemm(xd, q["weight"].to(dev), q["weight_scale"].to(dev),
                                               out_dtype=torch.float32, path=path)
            else:  # a format without a kernel: its own dequantize (formats/) and a plain matmul
                y = x.float() @ fmt.dequantize(q, torch.float32).T
            y = y.float().cpu().double()
            r64 = ref.double()
            num, den = float(torch.linalg.vector_norm(y - r64)), float(torch.linalg.vector_norm(r64))
            rel = num / den if den > 0 else (0.0 if num == 0 else math.inf)
            ny = float(torch.linalg.vector_norm(y))
            cos = float((y * r64).sum()) / (ny * den) if ny > 0 and den > 0 else (1.0 if num == 0 else 0.0)
            if not math.isfinite(rel):
                rel = math.inf
            if not math.isfinite(cos):
                cos = -1.0
            ok = rel <= fmt.max_rel_error and cos >= fmt.min_cosine
            self.report.numerics.append({"tensor": wname, "format": fmt_name, "layer": layer,
                                         "rel_error": rel, "cosine": cos, "max_rel_error": fmt.max_rel_error,
                                         "min_cosine": fmt.min_cosine, "pass": ok,
                                         "shard": self.tensors[wname].shard if wname in self.tensors else None})
            worst_err, worst_cos = max(worst_err, rel), min(worst_cos, cos)
            stats = self.row_stats.setdefault((fmt_name, layer), [0, 0, 0])
            stats[2] += 1
            if not ok:
                shard = self.tensors[names[0]].shard
                c.fail(self.root / shard, f"{module}.weight_scale",
                       f"{module} ({fmt_name}) y = x @ W^T vs the BF16 source: relative error {rel:.4g} "
                       f"(max {fmt.max_rel_error:g}), cosine {cos:.6f} (min {fmt.min_cosine:g}): the weight or "
                       f"its scales ({', '.join(sorted(q))}) do not reproduce the source")
        c.figures.update(tensors=len(modules), worst_rel_error=worst_err, worst_cosine=worst_cos,
                         experts=sample_experts(layer, self.cfg.num_experts, self.sample))

    # ------------------------------------------------------------------ summary rows
    def _rows(self) -> None:
        by_fmt: dict[str, list[int]] = {}
        for (fmt, layer) in self.row_stats:
            if layer is not None:
                by_fmt.setdefault(fmt, []).append(layer)
        rows = []
        for fmt, layers in by_fmt.items():
            for a, b in _span(layers):
                row = Row("experts", f"{a}-{b}" if a != b else str(a), fmt)
                f = FORMATS.get(fmt)
                for layer in range(a, b + 1):
                    st = self.row_stats.get((fmt, layer))
                    if st:
                        row.tensors += st[0]
                        row.bytes += st[1]
                        row.checked += st[2]
                errs = [n for n in self.report.numerics if n["format"] == fmt and a <= n["layer"] <= b]
                if errs:
                    row.worst_rel_error = max(n["rel_error"] for n in errs)
                    row.worst_cosine = min(n["cosine"] for n in errs)
                    row.max_rel_error, row.min_cosine = f.max_rel_error, f.min_cosine
                rows.append(row)
        rows.sort(key=lambda r: int(r.layers.split("-")[0]))
        for fmt, label in (("passthrough", "other"), ("unexpected", "?")):
            st = self.row_stats.get((fmt, None))
            if st:
                row = Row(label, "all" if fmt == "passthrough" else "-", fmt, st[0], st[1])
                if fmt == "passthrough":
                    try:
                        pt = self.report.check("passthrough")
                        row.checked = pt.figures.get("tensors_compared", 0) if pt.status == PASS else 0
                    except KeyError:
                        pass
                rows.append(row)
        self.report.rows = rows


_TENSOR_IN_MESSAGE = re.compile(r"tensor '([^']*)'")


def _split_error(msg: str, default_file: str) -> tuple[str, str | None, str]:
    """(file, tensor, message) of one of our error messages, which start with the file."""
    file, rest = default_file, msg
    head, sep, tail = msg.partition(": ")
    if sep and ("/" in head or head.endswith((".json", ".safetensors", ".sha256"))):
        file, rest = head, tail
    m = _TENSOR_IN_MESSAGE.search(rest)
    return file, (m.group(1) if m else None), rest


def _exclusion_matcher(patterns: list[str]) -> Callable[[str], str | None]:
    """vLLM's is_layer_excluded, applied to a projection and to its MoE layer prefix
    (`model.layers.L.mlp.experts`): fnmatch wildcards (a trailing `*` also as `prefix.*`),
    otherwise exact or (legacy) substring. Returns the first pattern that excludes a module."""
    compiled = []
    for pat in patterns:
        if any(ch in pat for ch in "*?["):
            pats = [pat] + ([pat[:-1].rstrip(".")] if pat.endswith("*") else [])
            rx = re.compile("|".join(f"(?:{fnmatch.translate(p)})" for p in pats))
            compiled.append((pat, lambda name, rx=rx: rx.match(name) is not None))
        elif pat:
            compiled.append((pat, lambda name, pat=pat: pat in name))

    def match(module: str) -> str | None:
        names = (module, module.rsplit(".", 2)[0]) if ".experts." in module else (module,)
        for pat, fn in compiled:
            if any(fn(n) for n in names):
                return pat
        return None
    return match


def _detect_format(module: str, got: dict[str, tuple], s: TensorSpec, src_dtype) -> str | None:
    """The format whose tensors `got` (suffix -> (shape, dtype)) are, if any."""
    for f in FORMATS.values():
        for act in (True, False):
            try:
                want = {k: (tuple(o.shape), o.dtype) for k, o in f.out_specs(s.shape, src_dtype, act).items()}
            except Exception:
                continue
            if want == got:
                return f.name
    return None


def _short(v) -> str:
    s = json.dumps(v, default=str)
    return s if len(s) <= 60 else s[:57] + "..."


def _checksummable(p: Path) -> bool:
    return p.is_file() and not p.is_symlink() and not p.name.startswith(".") and p.name != CHECKSUMS \
        and not p.name.endswith(".partial")


# ============================================================================ API
def verify(ckpt: str | Path, against: str | Path | None = None, *, scheme: str | None = None,
           sample: int = DEFAULT_SAMPLE, device: str = "cpu", write_checksums: bool = False,
           progress: bool = False) -> VerifyReport:
    """Verify checkpoint `ckpt` (and, with `against`, its numerics against the BF16 source).
    Never raises for a defect of the checkpoint: the report says what failed (`report.ok`,
    `report.exit_code`, `report.failures()`; `report.raise_for_failure()` to turn it into an
    exception). Raises UsageError for bad arguments (unknown scheme, no CUDA, negative sample)."""
    if scheme is not None and scheme != UNQUANTIZED:
        get_scheme(scheme)
    if sample < 0:
        raise UsageError(f"--sample must be >= 0 (0 = every expert), got {sample}")
    if not (device == "cpu" or device.startswith("cuda")):
        raise UsageError(f"--device must be cpu or cuda, got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available")
    return Verifier(ckpt, against, scheme=scheme, sample=sample, device=device,
                    write_checksums=write_checksums, progress=progress).run()


def check_config_files(ckpt: str | Path, *, scheme: str | None = None, weight_only: bool = False) -> VerifyReport:
    """The `config` check alone, on config.json and hf_quant_config.json without any tensor:
    what `verify` checks once the tensors have decided `weight_only` (given here). Returns a
    report holding that one check."""
    v = Verifier(ckpt, scheme=scheme)
    v.weight_only = weight_only
    v._config()
    cc = v.report.check("config")
    if v.cfg is not None and v.scheme is not None and cc.status != ERROR:
        v._guard(cc, v._config_check, cc)
    return v.report


# ============================================================================ CLI
EPILOG = """exit codes:
  0  every check passed
  1  a check failed: the checkpoint is wrong (the report names file and tensor)
  2  the input could not be read (usage error, missing directory, I/O error): verification
     is incomplete; 2 wins over 1 when both happen

thresholds (numerics, per format, from inkling_quant.formats):
""" + "".join(f"  {f.name:<6} relative error <= {f.max_rel_error:g}, cosine >= {f.min_cosine:g}\n"
              for f in FORMATS.values() if f.quant_algo) + """
docs/ci.md has every check, the report formats and a GitHub Actions workflow."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = EPILOG
    p.add_argument("ckpt", metavar="CKPT", help="the converted checkpoint directory")
    p.add_argument("--against", metavar="SRC", help="the BF16 source: run the numerics and byte-identity checks")
    p.add_argument("--scheme", help="the conversion scheme (default: hf_quant_config.json's converter entry, else "
                   f"'default'; '{UNQUANTIZED}' for an unquantized checkpoint)")
    p.add_argument("--sample", type=int, default=DEFAULT_SAMPLE, metavar="N",
                   help=f"experts per layer checked numerically, chosen deterministically (0 = all; default {DEFAULT_SAMPLE})")
    p.add_argument("--device", default="cpu", help="cpu (torch reference GEMM) or cuda (the Triton kernels)")
    p.add_argument("--json", metavar="REPORT", help="write the full report (every check and figure) as JSON ('-': standard output)")
    p.add_argument("--junit", metavar="FILE", help="write a JUnit XML report (one testcase per check) for CI ('-': standard output)")
    p.add_argument("--quiet", action="store_true", help="print only failures and the result line")
    p.add_argument("--write-checksums", action="store_true",
                   help=f"write {CHECKSUMS} for the checkpoint if every other check passes")


def run(args) -> int:
    check_paths(args.ckpt if args.write_checksums else None, [args.against], reports=[args.json, args.junit])
    if args.json == "-" and args.junit == "-":
        raise UsageError("--json - and --junit - would both write to standard output: give one a file")
    try:
        report = verify(args.ckpt, args.against, scheme=args.scheme, sample=args.sample, device=args.device,
                        write_checksums=args.write_checksums, progress=not args.quiet and sys.stderr.isatty())
    except UsageError as e:  # still write the reports: CI looks for them
        report = VerifyReport(args.ckpt, args.against, args.scheme or "?", args.device, sample=args.sample)
        usage = Check("usage", "input", "the command line is valid")
        usage.error("inkling-quant verify", str(e))
        report.checks.append(usage)
    for dest, text in ((args.json, report.to_json), (args.junit, report.to_junit)):
        if dest:
            write_report(dest, text())  # an OutputError: exit 2, the message names the file
    if "-" in (args.json, args.junit):
        return report.exit_code  # standard output holds the report: no summary mixed into it
    out = report.format_summary()
    if args.quiet:
        out = "\n".join(line for line in out.splitlines()
                        if line.lstrip().startswith(("FAIL", "ERROR", "result")) or line.startswith("    "))
    print(out)
    return report.exit_code
