"""Integrity: `checksums` (checksums.sha256 against the digests of the single read) and
`--write-checksums` (written only when every other check passed). The file format is
io/output's (`read_checksums`, `write_checksums`)."""
from __future__ import annotations

from pathlib import Path

from ..errors import InklingQuantError, OutputError, UsageError
from ..io.checkpoint import safe_child
from ..io.output import CHECKSUMS, OutputLock, read_checksums, write_checksums
from .inventory import Inventory
from .report import ERROR, FAIL, PASS, Check, Recorder


def files_to_hash(inv: Inventory, writing: bool) -> list[str]:
    """Files the single read hashes besides the shards it checks: shards whose header is bad,
    the files checksums.sha256 lists, and (`writing` checksums) every other checksummable file."""
    root, shards = inv.root, inv.files.readable_shards
    others = [s for s in inv.files.shards if s not in inv.files.headers and (root / s).is_file()]
    others += [n for n in _listed(root) if n not in shards and n not in others]
    if writing:
        others += [p.name for p in sorted(root.iterdir()) if _checksummable(p)
                   and p.name not in shards and p.name not in others]
    return others


def _listed(root: Path) -> dict[str, str]:
    """What checksums.sha256 lists, leniently (the checksums check reports its defects)."""
    p = root / CHECKSUMS
    if not p.is_file():
        return {}
    try:
        return read_checksums(p, problem=lambda where, msg: None)
    except (InklingQuantError, OSError):
        return {}


def _checksummable(p: Path) -> bool:
    return p.is_file() and not p.is_symlink() and not p.name.startswith(".") and p.name != CHECKSUMS \
        and not p.name.endswith(".partial")


def required(inv: Inventory) -> bool:
    """Whether a missing checksums.sha256 fails without --require-checksums: for an Inkling 2
    checkpoint under its original names (the release and convert's Inkling form record one).
    Under transformers' or ModelOpt's names, as for other families, the tools that write such
    checkpoints record none."""
    conf, lay = inv.conf, inv.expected.layout
    if not conf.strict:
        return False
    return lay.original_names if lay is not None else not conf.modelopt_hf


def check_checksums(run: Recorder, root: Path, digests: dict[str, str], writing: bool, required: bool) -> None:
    """The `checksums` check: every listed file exists and matches; no shard left out. Without
    the file: a failure when `required`, else skipped with the reason."""
    c = run.new("checksums", "integrity", f"{CHECKSUMS} matches every file")
    run.guard(c, _check, c, root, digests, writing, required)


def _check(c: Check, root: Path, digests: dict[str, str], writing: bool, required: bool) -> None:
    p = root / CHECKSUMS
    if p.exists() and not p.is_file():
        c.fail(p, None, f"{CHECKSUMS} is not a regular file")
        return
    if not p.is_file():
        if writing:
            c.skip(f"no {CHECKSUMS} yet (--write-checksums writes one)")
        elif not required:
            c.skip(f"no {CHECKSUMS}: the tools that write this family's checkpoints (transformers, ModelOpt's "
                   f"exporter) record none; --require-checksums makes its absence a failure")
        else:
            c.fail(p, None, f"{CHECKSUMS} not found (create one with `inkling-quant verify --write-checksums`)")
        return
    sums = read_checksums(p, problem=lambda where, msg: c.fail(where, None, msg))
    for name, digest in sums.items():
        try:
            safe_child(root, name, "file")
        except InklingQuantError as e:
            c.fail(p, None, str(e))
            continue
        got = digests.get(name)
        if got is None:
            if not (root / name).is_file():
                c.fail(root / name, None, f"listed in {CHECKSUMS} but missing")
            continue
        if got != digest:
            c.fail(root / name, None, f"sha256 {got} does not match {CHECKSUMS} ({digest}): the file "
                   f"changed after it was written")
    listed = set(sums)
    unlisted = [q.name for q in sorted(root.iterdir()) if _checksummable(q) and q.name not in listed]
    for name in unlisted:
        if name.endswith(".safetensors"):
            c.fail(root / name, None, f"shard is not listed in {CHECKSUMS}")
    c.figures.update(files=len(sums), matched=sum(digests.get(n) == d for n, d in sums.items()),
                     unlisted=unlisted)


def write_checksums_file(run: Recorder, root: Path, digests: dict[str, str]) -> None:
    """--write-checksums: checksums.sha256 from the digests of the single read, only if every
    other check passed (a broken checkpoint is never blessed)."""
    r = run.report
    bad = [c for c in r.checks if c.status in (FAIL, ERROR)]
    c = run.new("write_checksums", "integrity", f"write {CHECKSUMS}")
    if bad:
        c.fail(root / CHECKSUMS, None, f"not written: the checkpoint failed verification "
               f"({', '.join(x.id for x in bad[:5])})")
        return
    files = [q.name for q in sorted(root.iterdir()) if _checksummable(q)]
    for name in files:  # a name no line can hold (not UTF-8, a control character): the stream skipped it
        try:
            safe_child(root, name, "file")
        except InklingQuantError as e:
            c.fail(e.path or root, None, e.message)
    if c.status != PASS:
        return
    missing = [f for f in files if f not in digests]
    if missing:
        c.fail(root / missing[0], None, "appeared while verifying; not written")
        return
    path = root / CHECKSUMS
    try:
        with OutputLock(root):  # the lock every writer of a checkpoint takes
            write_checksums(path, {n: digests[n] for n in files})
    except (OutputError, UsageError) as e:  # the file system (read-only, full) or a live writer: not the checkpoint's fault
        c.error(path, str(e))
        return
    except InklingQuantError as e:  # a name that would forge a line, a symlink where the file goes
        c.fail(path, None, str(e))
        return
    except OSError as e:
        c.error(path, f"cannot write: {e.strerror or e}")
        return
    r.checksums_written = str(path)
    c.figures["files"] = len(files)
