"""Process control of a conversion: the output directory (one writer per part, refuse / replace /
resume), the resume manifest and its fingerprint, signals turned into a clean stop, the worker
process pool, and what a stop leaves behind (no half-written shard, a manifest to resume from)."""
from __future__ import annotations

import concurrent.futures as cf
import hashlib
import json
import multiprocessing as mp
import os
import shutil
import signal
import threading
import time
from concurrent.futures.process import BrokenProcessPool  # imported here: cf.process exists only once a pool ran
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Iterator

import torch
from tqdm import tqdm

from .. import __version__, hub
from ..errors import CheckpointError, Interrupted, OutputError, UnsafePathError, UsageError, WorkerDied
from ..io.checkpoint import (CONVERSION_KEY, INDEX_NAME, RESUME_MANIFEST, SOURCE_KEY, read_json, safe_child,
                               write_json_atomic)
from ..io.files import temps_of
from ..io.output import CHECKSUMS, OutputLock, read_checksums
from ..io.safetensors import DTYPES, sha256_file, shard_file_size
from ..schemes import Scheme
from .planner import Options, Prepared, ShardJob
from .worker import SHARD_METADATA, ShardResult, convert_shard, drop_spare_read_buffers

MANIFEST = RESUME_MANIFEST  # a part's: the same name with its part tag before ".json"
MANIFEST_GLOB = MANIFEST.removesuffix(".json") + "*.json"


# --------------------------------------------------------------------------- parts and manifests
def part_tag(part: tuple[int, int] | None) -> str:
    return f"-part-{part[0]}-of-{part[1]}" if part else ""


def part_jobs(jobs: list[ShardJob], part: tuple[int, int] | None) -> list[ShardJob]:
    """--part I/N: every N-th shard, from the I-th (all of them without --part)."""
    return [j for j in jobs if part is None or j.index % part[1] == part[0] - 1]


def manifest_path(out: Path, part: tuple[int, int] | None) -> Path:
    return out / f"{MANIFEST.removesuffix('.json')}{part_tag(part)}.json"


def manifests(out: Path) -> list[Path]:
    return sorted(out.glob(MANIFEST_GLOB))


def fingerprint(jobs: list[ShardJob], opts: Options, scheme: Scheme, stat: dict) -> str:
    """What a resume or a part must share: version, options (not how many workers or how the bytes
    are written), the scheme's rules (a scheme file's may change behind its path), the plan (with
    every activation amax, which a calibration file or checkpoint behind the same path could
    change) and the source files."""
    blob = json.dumps({"version": __version__, "opts": asdict(opts) | {"workers": None, "buffered_io": None},
                       "scheme": scheme.record(),
                       "jobs": [[j.file, list(j.specs), [[u.input_amax, u.source_format] for u in j.units]]
                                for j in jobs], "sources": stat}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def source_id(stat: dict) -> str:
    """The source files' identity (sizes and modification times; a hub repo's revision)."""
    return hashlib.sha256(json.dumps(stat, sort_keys=True, default=str).encode()).hexdigest()


def _write_manifest(path: Path, fp: str, done: dict[str, str]) -> None:
    write_json_atomic(path, {"fingerprint": fp, "done": done})


def _load_done(path: Path, fp: str, out: Path) -> dict[str, str]:
    """Shards a previous run recorded and that still hash to what it recorded."""
    if not path.exists():
        return {}
    m = read_json(path, "resume manifest")
    if m.get("fingerprint") != fp:
        raise UsageError("was started with another source, scheme or options; "
                         "cannot --resume (use --overwrite to start again)", path=out)
    done = {}
    for f, sha in (m.get("done") or {}).items():
        p = safe_child(out, f, "shard")
        if p.is_file() and sha256_file(p) == sha:
            done[f] = sha
    return done


def recorded_checksums(out: Path, prep: Prepared) -> dict[str, str]:
    """shard -> sha256 as the parts' manifests recorded it; every planned shard must be there."""
    recorded: dict[str, str] = {}
    for m in manifests(out):
        obj = read_json(m, "part manifest")
        if obj.get("fingerprint") != prep.fingerprint:
            raise UsageError("written by a conversion with another source, scheme or options", path=m)
        recorded.update(obj.get("done") or {})
    missing = [j.file for j in prep.jobs if j.file not in recorded or not (out / j.file).is_file()]
    if missing:
        raise UsageError(f"{len(missing)} of {len(prep.jobs)} shards are not converted yet "
                         f"(first: {missing[0]}); run the missing --part(s) first", path=out)
    return {j.file: recorded[j.file] for j in prep.jobs}


# --------------------------------------------------------------------------- signals and the lock
class _StopRequest:
    """SIGINT/SIGTERM during a conversion. The handler only records the signal; the converter
    acts on it at the next unit boundary. An exception raised by a handler lands at an arbitrary
    bytecode, and that can be inside a weakref callback or a finalizer, where Python swallows
    it, or inside a callback from torch's C++ code, where it aborts the process (both seen in
    CI). While the main thread only waits for worker processes, it is raised at once."""

    def __init__(self):
        self.signame: str | None = None
        self.waiting = False

    def handler(self, signum, frame) -> None:
        self.signame = signal.Signals(signum).name
        if self.waiting:
            raise KeyboardInterrupt(self.signame)

    def check(self) -> None:
        if self.signame is not None:
            raise KeyboardInterrupt(self.signame)

    def wait(self, fn: Callable, *args):
        """fn(*args), a wait on the workers only: a signal raises at once."""
        self.waiting = True  # only waiting: a signal may raise right here
        try:
            return fn(*args)
        finally:
            self.waiting = False


_STOP = _StopRequest()  # in worker processes no handler is installed: check() never raises


@contextmanager
def writing(out: Path, part: tuple[int, int] | None) -> Iterator[None]:
    """Hold OUT's lock (a whole run's, or a part's: parts of one split run side by side, nothing
    else beside them; taken before anything is removed: never under a live writer) and turn
    SIGINT/SIGTERM into a stop at the next unit, a file-size limit into an error."""
    lock = OutputLock(out, part).acquire()
    _STOP.signame = None
    old_handlers = {s: signal.signal(s, _STOP.handler) for s in (signal.SIGINT, signal.SIGTERM)}
    old_xfsz = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # file-size limit: an error, not a kill
    try:
        yield
    finally:
        for s, h in old_handlers.items():
            signal.signal(s, h)
        signal.signal(signal.SIGXFSZ, old_xfsz)
        lock.release()


# --------------------------------------------------------------------------- the output directory
def finished(out: Path) -> bool:
    """OUT holds a finalized conversion: its index and no manifest (finalize writes the index last
    and removes the manifests after it; a kill between the two leaves both: not finished)."""
    return (out / INDEX_NAME).exists() and not manifests(out)


def previous_output(out: Path, part: tuple[int, int] | None, resume: bool, overwrite: bool) -> bool:
    """A non-empty OUT: refused, removed (--overwrite) or kept (--resume; a part's OUT is shared).
    True when a kept OUT holds a finished conversion: it is confirmed, never converted into again
    (a requeued part must not reopen a finalized checkpoint)."""
    if not (out.exists() and any(out.iterdir())):
        return False
    if not (resume or part):
        if not overwrite:
            raise UsageError("exists and is not empty; pass --resume to continue an interrupted "
                             "conversion or --overwrite to replace it", path=out)
        shutil.rmtree(out)
        return False
    return finished(out)


def start_output(out: Path, prep: Prepared, jobs: list[ShardJob], manifest: Path, resume: bool) -> dict[str, str]:
    """Create OUT, keep the shards a resumed run finished (shard -> sha256, returned), remove this
    part's unfinished shards and temporaries and any index, and write the manifest."""
    out.mkdir(parents=True, exist_ok=True)
    refuse_symlinks(out)
    refuse_other_conversions(out, prep, manifest)
    done = _load_done(manifest, prep.fingerprint, out) if resume else {}
    for j in jobs:  # unfinished shards (and temporaries) of this part: redo them
        for p in temps_of(out / j.file) + ([out / j.file] if j.file not in done else []):
            p.unlink(missing_ok=True)
    remove_temps(out, [manifest.name])  # a kill while the manifest was rewritten
    (out / INDEX_NAME).unlink(missing_ok=True)
    _write_manifest(manifest, prep.fingerprint, done)
    return done


def refuse_other_conversions(out: Path, prep: Prepared, own: Path) -> None:
    """Another part's manifest of another conversion (other source, scheme or options): its shards
    and ours would mix in one OUT."""
    for m in manifests(out):
        if m != own and read_json(m, "part manifest").get("fingerprint") != prep.fingerprint:
            raise UsageError(f"holds shards of another conversion (other source, scheme or options; recorded in "
                             f"{m.name}); convert into another OUT, or remove it first", path=out)


def remove_temps(out: Path, names) -> None:
    """Remove the temporaries a killed run left for these files of ours (random names: a rerun
    does not overwrite them). Only ours: other parts' shards may be in flight in a shared OUT."""
    for name in names:
        for p in temps_of(out / name):
            p.unlink(missing_ok=True)


def refuse_symlinks(out: Path) -> None:
    """Every file in OUT is one a conversion wrote: a symlink there was planted, and writing
    beside it (or resuming over it) could reach a file elsewhere."""
    links = [p.name for p in out.iterdir() if p.is_symlink()]
    if links:
        raise UnsafePathError(f"a symlink in the output directory"
                              f"{f' (and {len(links) - 1} more)' if len(links) > 1 else ''}; "
                              f"remove it (a conversion writes only regular files)", path=out / links[0])


def confirm_complete(out: Path, prep: Prepared) -> None:
    """A finished OUT met again (`--resume`, a part, a second `--finalize`): confirm it is this
    conversion's result (its index lists exactly the planned tensors in the planned shards, with
    the planned sizes), so that a retried job (a Slurm requeue) passes. Nothing is rewritten."""
    refuse_symlinks(out)
    index = read_json(out / INDEX_NAME, "index")
    planned = {name: j.file for j in prep.jobs for name, _, _ in j.specs}
    sizes_ok = all((out / j.file).is_file() and (out / j.file).stat().st_size == _shard_file_size(j)
                   for j in prep.jobs)
    meta = index.get("metadata") if isinstance(index.get("metadata"), dict) else {}
    same = (meta.get(CONVERSION_KEY), meta.get(SOURCE_KEY)) == (prep.conversion, prep.source_id)
    if index.get("weight_map") != planned or not sizes_ok or not same:
        raise UsageError("holds a finished conversion of another source, or with another scheme or options; it "
                         "is left as it is: convert into another OUT, or replace it with a whole run (--overwrite)",
                         path=out)
    _check_small_files(out, prep)


def _check_small_files(out: Path, prep: Prepared) -> None:
    """A finished OUT still holds what finalize wrote beside the shards, as checksums.sha256
    recorded it (configs and copied files: small, so hashed here; the shards' sizes are checked)."""
    try:
        sums = read_checksums(safe_child(out, CHECKSUMS, "checksums"))
    except CheckpointError as e:
        raise UsageError(f"holds this conversion's shards and index, but {e.message}: it is damaged; replace "
                         f"it with a whole run (--overwrite)", path=e.path or out) from None
    for name in [n for n in sums if n not in {j.file for j in prep.jobs}] + [p.name for p in prep.other_files]:
        p = out / name
        if not p.is_file() or sha256_file(p) != sums.get(name):
            raise UsageError(f"holds this conversion's shards and index, but {name} is missing or changed since it "
                             f"was written: it is damaged; replace it with a whole run (--overwrite)", path=out)


def confirm_finalized(out: Path, prep: Prepared) -> int:
    """A second `--finalize`: the finished OUT is this conversion's, and every file its
    checksums.sha256 lists still has those bytes. Returns how many files were checked."""
    confirm_complete(out, prep)
    sums = read_checksums(safe_child(out, CHECKSUMS, "checksums"))
    missing = [j.file for j in prep.jobs if j.file not in sums]
    if missing:
        raise CheckpointError(f"{CHECKSUMS} does not list the shard {missing[0]}", path=out / CHECKSUMS)
    for name, digest in sums.items():
        if sha256_file(safe_child(out, name, "file")) != digest:
            raise CheckpointError(f"finalized, but its sha256 differs from {CHECKSUMS}: changed since",
                                  path=out / name)
    return len(sums)


def _shard_file_size(j: ShardJob) -> int:
    return shard_file_size([(n, DTYPES[d], s) for n, d, s in j.specs], SHARD_METADATA)


# --------------------------------------------------------------------------- the shards
def run_jobs(prep: Prepared, todo: list[ShardJob], jobs: list[ShardJob], done: dict[str, str],
             manifest: Path, out: Path, opts: Options, quiet: bool) -> dict:
    """Convert `todo` (here, or in `opts.workers` spawned processes), recording each finished shard
    in `done` and the manifest. Any stop (a signal, a full disk, a dead worker, an error) stops the
    workers and removes what they left half-written, and says how to resume. Returns the hub
    source's timings for the report ({} for a local source) and `stage_seconds`: the busy seconds
    of each pipeline stage (read, convert, write; worker.convert_shard) summed over the shards,
    the largest being the stage that bounds the run."""
    args = (str(prep.root), prep.repo, prep.revision, str(out), opts.device, opts.buffered_io)
    pool = None
    pooled = min(opts.workers, len(todo)) if opts.workers > 1 and len(todo) > 1 else 0  # no idle workers
    needs = [[s.shard for u in j.units for s in u.sources] for j in todo]  # what a hub source prefetches
    stages: dict[str, float] = {}
    blocks: dict[str, list[int]] = {}  # source tensor -> [MXFP4 blocks, of them lossless] (worker.ShardResult)
    flushed: list[str] = []            # weights written as their format's all-zero weight (worker.Tallies)
    with _progress_bars(jobs, todo, done, quiet) as (bar_bytes, bar_shards), \
            hub.shard_source(prep.repo, prep.revision, needs, pooled) as source:
        def record(r: ShardResult):
            done[r.file] = r.sha256
            _write_manifest(manifest, prep.fingerprint, done)
            for k, v in r.stages.items():
                stages[k] = round(stages.get(k, 0.0) + v, 3)
            for k, (n, ok) in r.source_blocks.items():
                got = blocks.setdefault(k, [0, 0])
                got[0], got[1] = got[0] + n, got[1] + ok
            flushed.extend(r.flushed)
            bar_shards.update(1)
            source.finished(r)

        try:
            if not pooled:
                _convert_here(todo, args, record, bar_bytes.update)
            else:
                pool = _start_pool(pooled)
                _convert_in_pool(pool, todo, args, record, bar_bytes.update)
            _STOP.check()  # a signal during the last shard: stop before finalizing
        except KeyboardInterrupt as e:
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, signal.SIG_IGN)  # a second ^C must not cut the clean-up short
            _stop(pool, out, todo, done)
            raise Interrupted(f"interrupted ({e or 'SIGINT'}) after {len(done)} of {len(jobs)} shards; "
                              f"rerun the same command with --resume to finish", path=out) from None
        except OSError as e:
            _stop(pool, out, todo, done)
            raise OutputError(f"cannot write ({e.strerror or e}); {len(done)} of {len(jobs)} shards are "
                              f"done: free space and rerun with --resume", path=out) from None
        except BrokenProcessPool:
            _stop(pool, out, todo, done)
            raise WorkerDied(f"a worker process died (killed, or out of memory) after {len(done)} of "
                             f"{len(jobs)} shards; rerun the same command with --resume to finish", path=out) from None
        except BaseException:
            _stop(pool, out, todo, done)
            raise
    return source.report() | {"stage_seconds": stages} | ({"source_blocks": blocks} if blocks else {}) | \
        ({"flushed_to_zero": sorted(flushed)} if flushed else {})


@contextmanager
def _progress_bars(jobs: list[ShardJob], todo: list[ShardJob], done: dict[str, str], quiet: bool):
    """A byte bar (source bytes, with throughput) and a shard bar, starting at what is done."""
    bar_bytes = tqdm(total=sum(j.src_bytes for j in jobs), unit="B", unit_scale=True, desc="convert",
                     disable=quiet, smoothing=0.1)
    bar_bytes.update(sum(j.src_bytes for j in jobs if j.file in done))
    bar_shards = tqdm(total=len(jobs), unit="shard", desc="shards", disable=quiet, position=1, leave=False)
    bar_shards.update(len(jobs) - len(todo))
    try:
        yield bar_bytes, bar_shards
    finally:
        bar_bytes.close()
        bar_shards.close()


def _convert_here(todo: list[ShardJob], args: tuple, record, progress) -> None:
    """In this process, one shard after another; a signal stops it at the next unit."""
    try:
        for j in todo:
            _STOP.check()
            record(convert_shard(j, *args, progress=progress, stop=_STOP.check))
    finally:
        drop_spare_read_buffers()


def _start_pool(workers: int) -> cf.ProcessPoolExecutor:
    threads = max(1, (os.cpu_count() or 1) // workers)
    ctx = mp.get_context("spawn")  # no fork after torch/OpenMP threads exist
    return cf.ProcessPoolExecutor(workers, mp_context=ctx, initializer=_worker_init, initargs=(threads, os.getpid()))


def _worker_init(threads: int, parent: int) -> None:
    torch.set_num_threads(threads)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides; it terminates us on interrupt
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a file-size limit becomes an OSError
    threading.Thread(target=_exit_with, args=(parent,), name="inkling-quant-parent-watch", daemon=True).start()


def _exit_with(parent: int) -> None:
    """A parent killed with -9 (the OOM killer, a scheduler) cannot stop its workers: each exits
    on its own once its parent is gone, instead of holding its memory for ever."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def _convert_in_pool(pool: cf.ProcessPoolExecutor, todo: list[ShardJob], args: tuple, record, progress) -> None:
    """Every shard submitted at once; each recorded as it finishes, in any order."""
    futs = [pool.submit(convert_shard, j, *args) for j in todo]
    finished = cf.as_completed(futs)
    while True:
        _STOP.check()
        f = _STOP.wait(next, finished, None)
        if f is None:
            break
        r = f.result()
        progress(r.src_bytes)
        record(r)
    pool.shutdown()


def _stop(pool, out: Path, todo: list[ShardJob], done: dict[str, str]) -> None:
    """Stop the workers, then remove what they left half-written: a terminated worker (or a
    signal landing between opening a shard and entering its `with`) cannot clean up itself."""
    if pool is not None:
        for p in list(getattr(pool, "_processes", {}).values()):
            p.terminate()
        pool.shutdown(wait=True, cancel_futures=True)
    for j in todo:
        if j.file not in done:
            for p in temps_of(out / j.file):
                p.unlink(missing_ok=True)
