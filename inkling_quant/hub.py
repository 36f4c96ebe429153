"""Sources on the Hugging Face Hub. `org/name[@revision]` resolves, once, to a commit and a local
snapshot of its small files (config, index, tokenizer...): every later read names that commit,
so a branch that moves during a conversion cannot mix two revisions. Planning reads the shard
headers (from the cache, else over HTTP, a few bytes each); each shard is downloaded when the
conversion reaches it, one shard ahead of the reader (`shard_source`), so the network and the
converter work at the same time. Everything lands in huggingface_hub's cache (HF_HOME,
HF_HUB_CACHE): a rerun, a `--resume` or a `verify --against` of the same repo downloads nothing
twice, and HF_HUB_OFFLINE=1 works from it. docs/hub.md has the details."""
from __future__ import annotations

import os
import re
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from .errors import CheckpointError, HubError, UsageError
from .io.checkpoint import INDEX_NAME, SINGLE_NAME, Checkpoint, read_json, safe_child
from .io.safetensors import DTYPE_NAMES, MAX_HEADER_BYTES, Header, check_count, parse_header, read_header

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")
WEIGHTS = ["*.safetensors", "*.bin", "*.pt"]
PREFETCH_ENV = "INKLING_QUANT_HUB_PREFETCH"  # "0": download each shard only when it is read (benchmarks)
_HEADER_THREADS = 8


def is_repo_id(src: str) -> bool:
    return not Path(src).exists() and bool(REPO_ID.match(src))


# --------------------------------------------------------------------------- resolving
def resolve(src: str) -> tuple[Path, str | None, str | None]:
    """(local dir, repo id or None, commit or None). For a repo id: its snapshot holding the
    non-weight files, and the commit the revision names now."""
    if not is_repo_id(src):
        p = Path(src)
        if not p.exists():
            raise UsageError("no such directory (and not a hub repo id org/name[@revision])", path=src)
        return p, None, None
    root = _snapshot(src, ignore_patterns=WEIGHTS)
    return root, src.partition("@")[0], root.name  # the snapshot's directory is named by its commit


def snapshot(src: str, allow_patterns: list[str] | None = None) -> Path:
    """A local directory for SRC: SRC itself, or the snapshot of the hub repo with every file
    (or those `allow_patterns` match) downloaded (`verify --against`, `lora merge`'s adapter)."""
    if not is_repo_id(src):
        return Path(src)
    return _snapshot(src, allow_patterns=allow_patterns)


def _snapshot(src: str, **patterns) -> Path:
    repo, _, rev = src.partition("@")
    from huggingface_hub import snapshot_download  # lazy: only hub sources need it

    _quiet_client()

    try:
        return Path(snapshot_download(repo, revision=rev or None, **patterns))
    except Exception as e:  # it may be a mistyped local path: say that it is none either
        raise hub_error(src, e, doing="no such local directory; as a hub repo id: ") from None


def _quiet_client() -> None:
    """No progress bars of huggingface_hub's own: `convert` draws its own, by bytes of source."""
    from huggingface_hub.utils import disable_progress_bars

    disable_progress_bars()


def hub_error(src: str, e: BaseException, doing: str = "") -> HubError:
    """One line that says what went wrong and what to do, from whatever huggingface_hub raised
    (servers differ: a missing branch is a 404 on the Hub and a 401 elsewhere)."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError, OfflineModeIsEnabled,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    rev = src.partition("@")[2]
    cause = e.__cause__ or e.__context__
    first = (str(e).strip().splitlines() or [""])[0]
    if isinstance(e, RevisionNotFoundError):
        why = f"no revision {rev!r} (branch, tag or commit) in the repository"
    elif isinstance(e, GatedRepoError):
        why = "the repository is gated: accept its terms on the Hub and log in (`hf auth login` or HF_TOKEN)"
    elif isinstance(e, RepositoryNotFoundError):
        why = (f"not found on {constants.ENDPOINT}: no such repository{f', no revision {rev!r} in it' if rev else ''}"
               f", or no access to it (a private repository needs `hf auth login` or HF_TOKEN)")
    elif constants.HF_HUB_OFFLINE or isinstance(e, OfflineModeIsEnabled):
        why = f"HF_HUB_OFFLINE is set and the cache ({constants.HF_HUB_CACHE}) holds no copy of it"
    elif isinstance(e, LocalEntryNotFoundError) and cause is not None and not hasattr(cause, "response"):
        why = (f"cannot reach {constants.ENDPOINT} ({type(cause).__name__}: {str(cause).strip()[:200]}) and the "
               f"cache holds no copy: check the network or HF_ENDPOINT (HF_HUB_OFFLINE=1 uses the cache only)")
    elif isinstance(e, LocalEntryNotFoundError):  # the server answered no, and nothing is cached
        status = getattr(getattr(cause, "response", None), "status_code", "?")
        why = (f"not found on {constants.ENDPOINT} (HTTP {status}): "
               f"{f'no revision {rev!r} in the repository, or ' if rev else ''}no such repository")
    else:
        why = f"{type(e).__name__}: {first}"
    return HubError(f"{src}: {doing}{why}")


# --------------------------------------------------------------------------- planning: the headers
def tensor_listing(repo: str, commit: str, root: Path) -> dict[str, dict[str, tuple[str, list[int]]]]:
    """shard -> {tensor: (safetensors dtype, shape)} from the shard headers: a cached shard's from
    the file, the others' over HTTP (the header bytes only), each checked as `read_header` does."""
    return {s: {n: (DTYPE_NAMES[e.dtype], list(e.shape)) for n, e in h.tensors.items()}
            for s, h in headers(repo, commit, root).items()}


def headers(repo: str, commit: str, root: Path) -> dict[str, Header]:
    from huggingface_hub import constants, try_to_load_from_cache

    out: dict[str, Header | None] = {}
    for s in shard_names(root):
        cached = try_to_load_from_cache(repo, s, revision=commit)
        out[s] = read_header(cached) if isinstance(cached, str) else None
    missing = [s for s, h in out.items() if h is None]
    if missing and constants.HF_HUB_OFFLINE:
        raise HubError(f"{repo}@{commit}: HF_HUB_OFFLINE is set and the cache ({constants.HF_HUB_CACHE}) lacks "
                       f"{len(missing)} of its {len(out)} shards (first: {missing[0]})")
    with ThreadPoolExecutor(_HEADER_THREADS, thread_name_prefix="inkling-quant-header") as pool:
        for s, h in zip(missing, pool.map(lambda s: _remote_header(repo, commit, s), missing)):
            out[s] = h
    return out


def shard_names(root: Path) -> list[str]:
    """The shards a snapshot's index names (or the one model.safetensors), in index order."""
    wm = _weight_map(root)
    return list(dict.fromkeys(wm.values())) if wm is not None else [SINGLE_NAME]


def _weight_map(root: Path) -> dict[str, str] | None:
    """The snapshot's index (None without one), every shard name checked to stay inside it."""
    index = safe_child(root, INDEX_NAME)
    if not index.exists():
        return None
    wm = read_json(index, "index").get("weight_map")
    if not isinstance(wm, dict) or not wm or not all(isinstance(f, str) for f in wm.values()):
        raise CheckpointError("'weight_map' must map tensor names to shard file names", path=index)
    for s in set(wm.values()):
        safe_child(root, s, "shard")
    return wm


class _HubCheckpoint(Checkpoint):
    """A hub snapshot as a Checkpoint whose shards need not be there: its headers were read by
    `headers` (from the cache or over HTTP), and `Checkpoint.headers` cross-checks them."""

    fetched: dict[str, Header]

    def header(self, shard: str, max_tensors: int | None = None) -> Header:
        h = self.fetched[shard]
        if max_tensors is not None:  # read before the config was: bounded only by the header cap
            check_count(len(h.tensors), max_tensors, h.path)
        return h


def open_checkpoint(src: str) -> tuple[Path, Checkpoint]:
    """(directory, Checkpoint) of a local directory or of a hub repo id, whose shards' headers
    are read without downloading the shards (`inspect`)."""
    if not is_repo_id(src):
        return Path(src), Checkpoint.open(src)
    root, repo, commit = resolve(src)
    found = headers(repo, commit, root)
    wm = _weight_map(root) or {n: SINGLE_NAME for n in found[SINGLE_NAME].tensors}
    ckpt = _HubCheckpoint(root, wm, list(found), {})
    ckpt.fetched = found
    return root, ckpt


def _remote_header(repo: str, commit: str, shard: str) -> Header:
    """The shard's header over HTTP: read from the start of the file and stop after the header,
    so a server that ignores Range (olah) costs no more than one that honours it."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.utils import build_hf_headers, hf_raise_for_status, http_stream_backoff

    where, url = Path(f"{repo}@{commit}/{shard}"), hf_hub_url(repo, shard, revision=commit)
    try:
        with http_stream_backoff("GET", url, headers={**build_hf_headers(), "Range": "bytes=0-"}) as r:
            hf_raise_for_status(r)
            total = r.headers.get("Content-Range", "").rpartition("/")[2] or r.headers.get("Content-Length", "")
            size = int(total) if total.isdigit() else None
            blob, need = bytearray(), None
            for chunk in r.iter_bytes():
                blob += chunk
                if need is None and len(blob) >= 8:
                    (n,) = struct.unpack("<Q", bytes(blob[:8]))
                    if n > MAX_HEADER_BYTES:
                        raise CheckpointError(f"header length {n} exceeds the {MAX_HEADER_BYTES}-byte cap", path=where)
                    need = 8 + n
                if need is not None and len(blob) >= need:
                    break
        if size is None:  # a chunked answer: the size is in the HEAD's headers
            size = get_hf_file_metadata(url).size
    except CheckpointError:
        raise
    except Exception as e:
        raise hub_error(f"{repo}@{commit}", e, f"reading the header of {shard}: ") from None
    if size is None:
        raise HubError(f"{where}: the server sent no file size")
    if need is None or len(blob) < need:
        raise CheckpointError(f"truncated: {len(blob)} bytes, no complete safetensors header", path=where)
    if need > size:
        raise CheckpointError(f"truncated: header claims {need - 8} bytes, file has {size}", path=where)
    return parse_header(bytes(blob[8:need]), size, where)


def other_files(root: Path) -> list[Path]:
    """The snapshot's non-weight files to carry over, exactly as for a local source (the cached
    snapshot holds no shards yet, so no Checkpoint can be opened on it)."""
    return Checkpoint(root, {}, [], {}).other_files()


# --------------------------------------------------------------------------- the shards
_fetch_seconds = 0.0  # this process's time in fetch_shard: waiting for or downloading shards
_active: "_Prefetcher | None" = None  # the converting process's prefetcher, while one runs


def fetch_seconds() -> float:
    return _fetch_seconds


def fetch_shard(repo: str, commit: str, filename: str) -> Path:
    """The shard's path in the cache: from the prefetcher when one runs in this process, else
    downloaded now (a worker process finds the prefetcher's downloads in the cache; if one is
    still under way, huggingface_hub's file lock makes this call wait for it)."""
    global _fetch_seconds
    t = time.perf_counter()
    try:
        p = _active.get(filename) if _active is not None and _active.serves(repo, commit, filename) else None
        return p or _download(repo, commit, filename)
    finally:
        _fetch_seconds += time.perf_counter() - t


def _download(repo: str, commit: str, filename: str) -> Path:
    from huggingface_hub import hf_hub_download

    _quiet_client()  # in a worker process too
    try:
        return Path(hf_hub_download(repo, filename, revision=commit))
    except Exception as e:
        err = hub_error(f"{repo}@{commit}", e, f"downloading {filename}: ")
        raise HubError(f"{err}; a conversion keeps the shards it finished: rerun it with --resume") from None


class _Prefetcher:
    """A thread that downloads the shards in the order the conversion reads them, at most one
    shard past the last one in use: the highest one a reader asked for here, or, with worker
    processes, the last one the jobs they may be running read (the first `pooled` unfinished)."""

    def __init__(self, repo: str, commit: str, needs: list[list[str]], pooled: int):
        self.repo, self.commit, self.pooled = repo, commit, pooled
        self.order = list(dict.fromkeys(s for shards in needs for s in shards))
        pos = {s: i for i, s in enumerate(self.order)}
        self.pos = pos
        last, self.job_last = -1, []  # per job: the last position it or an earlier job reads
        for shards in needs:
            last = max([last] + [pos[s] for s in shards])
            self.job_last.append(last)
        self.finished, self.in_use, self.closed = 0, -1, False
        self.results: dict[str, Path | BaseException] = {}
        self.seconds = 0.0
        self.cond = threading.Condition()
        self._note_jobs()
        self.thread = threading.Thread(target=self._run, name="inkling-quant-prefetch", daemon=True)
        self.thread.start()

    def serves(self, repo: str, commit: str, shard: str) -> bool:
        return (repo, commit) == (self.repo, self.commit) and shard in self.pos

    def _note_jobs(self) -> None:
        running = min(self.finished + self.pooled, len(self.job_last))
        if running:
            self.in_use = max(self.in_use, self.job_last[running - 1])

    def _run(self) -> None:
        for i, shard in enumerate(self.order):
            with self.cond:
                self.cond.wait_for(lambda: self.closed or i <= self.in_use + 1)
                if self.closed:
                    return
            t = time.perf_counter()
            try:
                result: Path | BaseException = _download(self.repo, self.commit, shard)
            except BaseException as e:  # the reader downloads it again itself, and reports the error
                result = e
            with self.cond:
                self.results[shard] = result
                self.seconds += time.perf_counter() - t
                self.cond.notify_all()

    def get(self, shard: str) -> Path | None:
        """The downloaded shard, once the thread has it (None if its download failed)."""
        with self.cond:
            self.in_use = max(self.in_use, self.pos[shard])
            self.cond.notify_all()
            self.cond.wait_for(lambda: shard in self.results)
            r = self.results[shard]
        return r if isinstance(r, Path) else None

    def job_finished(self) -> None:
        with self.cond:
            self.finished += 1
            self._note_jobs()
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        self.thread.join(timeout=1)  # a download under way cannot be cut short: it ends with the process


class ShardSource:
    """What a conversion's runner keeps of a hub source while the shards convert: the
    prefetcher, and the time spent downloading, waiting and converting (the `--json` report's
    `hub` entry). For a local source it does nothing and reports nothing."""

    def __init__(self, repo: str | None, commit: str | None, prefetcher: _Prefetcher | None):
        self.repo, self.commit, self.prefetcher = repo, commit, prefetcher
        self.fetch = self.convert = 0.0

    def finished(self, result) -> None:
        """A shard is done (a convert.worker.ShardResult)."""
        self.fetch += result.fetch_seconds
        self.convert += result.seconds - result.fetch_seconds
        if self.prefetcher is not None:
            self.prefetcher.job_finished()

    def report(self) -> dict:
        if self.repo is None:
            return {}
        p = self.prefetcher
        return {"hub": {"repo": self.repo, "commit": self.commit, "prefetch": p is not None,
                        "download_seconds": round(p.seconds if p else self.fetch, 3),
                        "waiting_seconds": round(self.fetch, 3), "convert_seconds": round(self.convert, 3)}}


@contextmanager
def shard_source(repo: str | None, commit: str | None, needs: list[list[str]], pooled: int) -> Iterator[ShardSource]:
    """`needs[k]`: the shards job k reads, in the order the jobs run; `pooled`: the number of
    worker processes running them (0: this process). Prefetching unless INKLING_QUANT_HUB_PREFETCH=0."""
    global _active
    if repo is None or commit is None or os.environ.get(PREFETCH_ENV, "1") == "0":
        yield ShardSource(repo, commit, None)
        return
    prefetcher = _active = _Prefetcher(repo, commit, needs, pooled)
    try:
        yield ShardSource(repo, commit, prefetcher)
    finally:
        _active = None
        prefetcher.close()
