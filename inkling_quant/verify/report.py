"""The report: checks and their problems, the summary rows, and the three renderings (text,
JSON, JUnit XML). `Recorder` is how a step adds a check and runs its body so that any error ends
as a problem of that check, never as a traceback."""
from __future__ import annotations

import json
import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator
from xml.etree import ElementTree as ET

from .. import __version__
from ..units import human_bytes
from ..errors import InklingQuantError, printable, short_repr, utf8_safe
from ..formats import FORMATS

MAX_PROBLEMS = 200         # per check, in the report (the count is always exact)
DEFAULT_SAMPLE = 2         # experts per layer checked numerically (0 = all)

PASS, FAIL, SKIP, ERROR = "pass", "fail", "skip", "error"


# ============================================================================ model
@dataclass
class Problem:
    file: str
    tensor: str | None
    message: str

    def __str__(self) -> str:
        # `tensor` is the whole name (megabytes in a hostile header): shown cut short, as messages show it
        shown = None if self.tensor is None else short_repr(self.tensor, 200)
        named = shown is None or shown in self.message or repr(self.tensor) in self.message
        return f"{self.file}: {self.message}" if named else f"{self.file}: tensor {shown}: {self.message}"


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

    def note(self, message: str) -> None:
        """A remark the report shows on a check that passes (a figure that does not add up but
        decides nothing): its `message`."""
        self.message = f"{self.message}; {message}" if self.message else message

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
        from ..errors import CheckpointError

        bad = self.failures()
        if bad:
            lines = [f"{c.id}: {c.summary()}" for c in bad[:5]]
            raise CheckpointError(f"verification failed ({len(bad)} check(s)): " + "; ".join(lines),
                                  path=self.checkpoint)

    @property
    def throughput_mb_s(self) -> float:
        return self.bytes_read / 1e6 / self.stream_seconds if self.stream_seconds > 0 else 0.0

    def counts(self) -> dict[str, int]:
        return {s: sum(c.status == s for c in self.checks) for s in (PASS, FAIL, SKIP, ERROR)}

    def to_dict(self) -> dict:
        return {"tool": "inkling-quant verify", "version": self.version, "checkpoint": self.checkpoint,
                "against": self.against, "scheme": self.scheme, "device": self.device,
                "kernel_path": self.kernel_path, "sample": self.sample, "ok": self.ok,
                "exit_code": self.exit_code, "counts": self.counts(), "seconds": round(self.seconds, 3),
                "bytes_read": self.bytes_read, "files_read": self.files_read,
                "stream_seconds": round(self.stream_seconds, 3),
                "stream_mb_per_s": round(self.throughput_mb_s, 1),
                "checksums_written": self.checksums_written,
                "summary": [r.to_dict() for r in self.rows],
                "checks": [c.to_dict() for c in self.checks], "numerics": self.numerics}

    def to_json(self) -> str:
        return json.dumps(_finite(self.to_dict()), indent=2, default=str, allow_nan=False) + "\n"

    def to_junit(self) -> str:
        return render_junit(self)

    def format_summary(self) -> str:
        return render_text(self)


# ============================================================================ renderings
def render_junit(r: VerifyReport) -> str:
    """One <testsuite>, one <testcase> per check (failure, error or skipped; figures as system-out)."""
    counts = r.counts()
    suites = ET.Element("testsuites", name="inkling-quant verify", tests=str(len(r.checks)),
                        failures=str(counts[FAIL]), errors=str(counts[ERROR]), time=f"{r.seconds:.3f}")
    suite = ET.SubElement(suites, "testsuite", name=_xml_safe(f"verify {r.checkpoint}"), tests=str(len(r.checks)),
                          failures=str(counts[FAIL]), errors=str(counts[ERROR]), skipped=str(counts[SKIP]),
                          time=f"{r.seconds:.3f}")
    props = ET.SubElement(suite, "properties")
    for k in ("checkpoint", "against", "scheme", "device", "kernel_path", "sample", "version"):
        ET.SubElement(props, "property", name=k, value=_xml_safe(str(getattr(r, k))))
    for c in r.checks:
        case = ET.SubElement(suite, "testcase", classname=f"inkling_quant.verify.{c.category}", name=_xml_safe(c.id),
                             time=f"{c.seconds:.4f}")
        if c.status in (FAIL, ERROR):
            body = "\n".join(str(p) for p in c.problems)
            if c.problem_count > len(c.problems):
                body += f"\n... and {c.problem_count - len(c.problems)} more"
            ET.SubElement(case, "failure" if c.status == FAIL else "error",
                          message=_xml_safe(c.summary())[:1000], type=c.category).text = _xml_safe(body)
        elif c.status == SKIP:
            ET.SubElement(case, "skipped", message=_xml_safe(c.message))
        note = f"note: {c.message}\n" if c.status == PASS and c.message else ""
        if c.figures or note:
            ET.SubElement(case, "system-out").text = _xml_safe(note + json.dumps(_finite(c.figures), default=str))
    ET.indent(suites)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(suites, encoding="unicode") + "\n"


def render_text(r: VerifyReport) -> str:
    """The terminal summary: the rows table, the failing checks with up to ten problems each,
    the bytes read and the result line."""
    lines = [f"inkling-quant verify {r.checkpoint}" + (f" --against {r.against}" if r.against else "")
             + f"  (scheme {r.scheme}, device {r.device}"
             + (f", kernel {r.kernel_path}" if r.kernel_path else "") + ")"]
    if r.rows:
        lines += _table(r.rows)
    counts = r.counts()
    lines.append(f"  checks: {counts[PASS]} passed, {counts[FAIL]} failed, {counts[ERROR]} could not run, "
                 f"{counts[SKIP]} skipped")
    for c in r.checks:
        if c.status in (FAIL, ERROR):
            lines.append(f"  {c.status.upper()} {c.id}: {c.problem_count} problem(s)")
            for p in c.problems[:10]:
                lines.append(f"    {p}")
            if c.problem_count > 10:
                lines.append(f"    ... and {c.problem_count - 10} more (see --json)")
        elif c.status == SKIP and c.id not in ("source", "passthrough"):
            lines.append(f"  skip {c.id}: {c.message}")
        elif c.status == PASS and c.message:
            lines.append(f"  note {c.id}: {c.message}")
    if r.bytes_read:
        lines.append(f"  read {human_bytes(r.bytes_read)} in {r.files_read} files once (hash + values) in "
                     f"{r.stream_seconds:.2f} s: {r.throughput_mb_s:.0f} MB/s; total {r.seconds:.2f} s")
    if r.checksums_written:
        lines.append(f"  wrote {r.checksums_written}")
    verdict = {0: "PASS", 1: "FAIL", 2: "INCOMPLETE (usage error or unreadable input)"}[r.exit_code]
    lines.append(f"  result: {verdict} (exit {r.exit_code})")
    return "\n".join(printable(line) for line in lines)  # a name read from a file cannot forge a line


def _table(rows: list[Row]) -> list[str]:
    lines = [f"  {'part':<8} {'layers':<7} {'format':<12} {'tensors':>7} {'bytes':>10} {'checked':>7}  "
             f"{'worst rel.err':>13} {'worst cos':>10}  threshold"]
    for r in rows:
        if r.worst_rel_error is not None:
            err, cos = f"{r.worst_rel_error:13.4g}", f"{r.worst_cosine:10.6f}"
            thr = f"rel.err <= {r.max_rel_error:g}, cos >= {r.min_cosine:g}"
        elif r.format == "passthrough" and r.checked:
            err, cos, thr = f"{'0 (bytes)':>13}", f"{'1':>10}", "byte-identical"
        else:
            err, cos, thr = f"{'-':>13}", f"{'-':>10}", "-"
        lines.append(f"  {r.part:<8} {r.layers:<7} {r.format:<12} {r.tensors:>7} {human_bytes(r.bytes):>10} "
                     f"{r.checked:>7}  {err} {cos}  {thr}")
    return lines


def _finite(o):
    """JSON any strict reader takes: non-finite floats (not JSON) become strings, and strings
    with lone surrogates (a file name that is not UTF-8) are escaped (`errors.utf8_safe`)."""
    if isinstance(o, float) and not math.isfinite(o):
        return str(o)
    if isinstance(o, (str, os.PathLike)):
        return utf8_safe(os.fspath(o))
    if isinstance(o, dict):
        return {_finite(k) if isinstance(k, str) else k: _finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite(v) for v in o]
    return o


_XML_BAD = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


def _xml_safe(s: str) -> str:
    return _XML_BAD.sub("?", utf8_safe(s))


# ============================================================================ summary rows
class Tally:
    """Counts and bytes of the tensors the stream reads, per (format, layer) of the quantized
    experts and per format for everything else: the summary rows' left half. A stream visitor."""

    def __init__(self) -> None:
        self.by_key: dict[tuple[str, int | None], list[int]] = {}

    def visit(self, seen) -> None:
        t, fmt = seen.t, seen.fmt
        quantized_expert = t is not None and t.is_expert and fmt not in (None, "passthrough")
        stats = self.by_key.setdefault((fmt or "unexpected", t.layer if quantized_expert else None), [0, 0])
        stats[0] += 1
        stats[1] += seen.entry.nbytes
        return None


def summary_rows(tally: Tally | None, numerics: list[dict], passthrough: Check | None) -> list[Row]:
    """One row per format and run of consecutive expert layers (figures from the stream's tally
    and the numerics entries), then the pass-through and unexpected tensors."""
    stats = {k: [n, b, 0] for k, (n, b) in (tally.by_key.items() if tally is not None else ())}
    for n in numerics:
        stats.setdefault((n["format"], n["layer"]), [0, 0, 0])[2] += 1
    by_fmt: dict[str, list[int]] = {}
    for (fmt, layer) in stats:
        if layer is not None:
            by_fmt.setdefault(fmt, []).append(layer)
    rows = []
    for fmt, layers in by_fmt.items():
        for a, b in _span(layers):
            row = Row("experts", f"{a}-{b}" if a != b else str(a), fmt)
            for layer in range(a, b + 1):
                st = stats.get((fmt, layer))
                if st:
                    row.tensors += st[0]
                    row.bytes += st[1]
                    row.checked += st[2]
            errs = [n for n in numerics if n["format"] == fmt and a <= n["layer"] <= b]
            if errs:
                f = FORMATS.get(fmt)
                row.worst_rel_error = max(n["rel_error"] for n in errs)
                row.worst_cosine = min(n["cosine"] for n in errs)
                row.max_rel_error, row.min_cosine = f.max_rel_error, f.min_cosine
            rows.append(row)
    rows.sort(key=lambda r: int(r.layers.split("-")[0]))
    for fmt, label in (("passthrough", "other"), ("unexpected", "?")):
        st = stats.get((fmt, None))
        if st:
            row = Row(label, "all" if fmt == "passthrough" else "-", fmt, st[0], st[1])
            if fmt == "passthrough" and passthrough is not None:
                row.checked = passthrough.figures.get("tensors_compared", 0) if passthrough.status == PASS else 0
            rows.append(row)
    return rows


def _span(layers: list[int]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for i in sorted(set(layers)):
        if out and out[-1][1] == i - 1:
            out[-1] = (out[-1][0], i)
        else:
            out.append((i, i))
    return out


# ============================================================================ recording checks
class Recorder:
    """Adds checks to the report in the order they are created, and runs their bodies."""

    def __init__(self, report: VerifyReport, root: Path):
        self.report = report
        self.root = root

    def new(self, id: str, category: str, description: str) -> Check:
        c = Check(id, category, description)
        self.report.checks.append(c)
        return c

    def guard(self, c: Check, fn, *args):
        """Run a check body: our errors become problems, I/O errors make it ERROR (exit 2), and
        anything unexpected is reported as a failure with its type, never a traceback."""
        t = time.perf_counter()
        try:
            return fn(*args)
        except InklingQuantError as e:
            c.fail(*locate(e, str(self.root)))
        except PermissionError as e:
            c.error(getattr(e, "filename", None) or str(self.root), f"cannot read: {e.strerror}")
        except OSError as e:
            c.error(getattr(e, "filename", None) or str(self.root), f"I/O error: {e.strerror or e}")
        except EOFError as e:  # not from our readers (they raise CheckpointError naming the file)
            c.fail(str(self.root), None, str(e))
        except Exception as e:  # a bug in a check must still end in a report, not a traceback
            if os.environ.get("INKLING_QUANT_DEBUG"):
                raise
            c.fail(str(self.root), None, f"internal error while checking ({type(e).__name__}: {e})")
        finally:
            c.seconds += time.perf_counter() - t
        return None


def locate(e: InklingQuantError, default_file: str) -> tuple[str, str | None, str]:
    """(file, tensor, message) of one of our errors, from its fields: `default_file` where the
    raiser named no file."""
    return (e.path or default_file), e.tensor, e.message
