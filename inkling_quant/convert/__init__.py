"""Convert a BF16/FP32 Inkling 2 Small checkpoint: routed experts to NVFP4/MXFP8 per the scheme,
everything else passed through bit-exact, in ModelOpt's MIXED_PRECISION Hugging Face layout.

A pipeline read top to bottom: validate the source against the layout -> plan output shards
(fused gate/up pairs kept together so they share one NVFP4 global scale) -> convert shards in
parallel, one tensor in memory at a time, each shard written under a temporary name and
recorded in a resume manifest -> finalize (configs, non-weight files, checksums, index last).
A killed run leaves no index, so nothing looks complete; `--resume` redoes only unfinished shards.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import hashlib
import json
import multiprocessing as mp
import os
import resource
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from .. import __version__, hub
from ..cli_common import int_range, parse_size, positive_float
from ..errors import (CheckpointError, FormatError, InklingQuantError, Interrupted, OutputError, UnsafePathError,
                      UsageError, WorkerDied, printable)
from ..formats import FORMATS
from ..formats.nvfp4 import GLOBAL_DIV, nvfp4_input_scale
from ..formats.nvfp4 import amax as tensor_amax
from ..io.checkpoint import (INDEX_NAME, Checkpoint, copy_file_atomic, read_json, safe_child, shard_name,
                             write_json_atomic)
from ..io.files import temps_of
from ..io.output import CHECKSUMS, OutputLock, check_paths, write_checksums, write_report
from ..io.safetensors import (DTYPE_NAMES, DTYPES, ShardReader, ShardWriter, TensorBuffer, fsync_files, sha256_file,
                              shard_file_size)
from ..layout import ModelConfig, classify, expected_tensors, natural_key, source_spec, source_tensor_count
from ..schemes import Scheme, get_scheme

MANIFEST = ".inkling-quant-convert.json"
MANIFEST_GLOB = ".inkling-quant-convert*.json"
FLOAT_SOURCES = FORMATS["passthrough"].source_dtypes
SHARD_METADATA = {"format": "pt"}
MODELOPT_FORMAT_VERSION = "0.47.0"  # the ModelOpt export whose layout we write (docs/formats.md)


# --------------------------------------------------------------------------- plan
@dataclass(frozen=True)
class SrcTensor:
    name: str
    shard: str
    dtype: str  # safetensors dtype name (picklable, hashable)
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Unit:
    """Tensors converted together: one tensor, or an NVFP4 expert's gate+up sharing a global scale."""

    sources: tuple[SrcTensor, ...]
    format: str
    input_amax: tuple[float | None, ...]
    amax_origin: tuple[str | None, ...] = ()  # per source: "calibrated", "source" or "default"


@dataclass(frozen=True)
class ShardJob:
    index: int
    file: str
    units: tuple[Unit, ...]
    specs: tuple[tuple[str, str, tuple[int, ...]], ...]  # output (name, dtype name, shape) in order
    src_bytes: int
    out_bytes: int


@dataclass
class Options:
    scheme: str = "default"
    weight_only: bool = False
    default_activation_amax: float | None = None
    activation_scales: str | None = None
    max_shard_bytes: int = 5 * 10**9
    workers: int = 1
    device: str = "cpu"
    buffered_io: bool = False  # how the bytes are written, not which: left out of the resume fingerprint


def _out_names(src: SrcTensor, fmt_name: str, weight_only: bool) -> list[tuple[str, str, tuple[int, ...]]]:
    fmt = FORMATS[fmt_name]
    specs = fmt.out_specs(src.shape, DTYPES[src.dtype], activation_scale=not weight_only)
    module = src.name[: -len(".weight")] if fmt_name != "passthrough" else None
    return [(src.name if module is None else f"{module}.{suffix}", DTYPE_NAMES[s.dtype], tuple(s.shape))
            for suffix, s in specs.items()]


def validate_source(cfg: ModelConfig, listing: dict[str, dict[str, tuple[str, tuple[int, ...]]]],
                    root: str) -> list[SrcTensor]:
    """Every tensor must be in the layout, float, with the shape the config implies; nothing missing."""
    tensors, seen = [], set()
    for shard, entries in listing.items():
        for name, (dtype, shape) in entries.items():
            where = f"{root}/{shard}: tensor {name!r}"
            try:
                t = classify(name)
                spec = source_spec(cfg, name if t.suffix != "input_scale" else f"{t.module}.weight")
            except InklingQuantError as e:
                raise CheckpointError(f"{root}/{shard}: {e}") from None
            if t.suffix in ("weight_scale", "weight_scale_2") or DTYPES[dtype] not in FLOAT_SOURCES:
                raise CheckpointError(f"{where}: source is already quantized ({dtype}); convert takes "
                                      f"BF16/FP16/FP32 checkpoints (dequantize first)")
            if t.suffix == "input_scale":
                if tuple(shape) not in ((), (1,)):
                    raise CheckpointError(f"{where}: input_scale must be a scalar, got shape {list(shape)}")
            elif tuple(shape) != spec.shape:
                raise CheckpointError(f"{where}: shape {list(shape)} disagrees with config.json "
                                      f"(expected {list(spec.shape)})")
            tensors.append(SrcTensor(name, shard, dtype, tuple(shape)))
            seen.add(name)
    # every tensor seen is one of the config's (source_spec checked it), so the count says how
    # many are missing; the first is found without listing a config's claimed 16,384 experts
    n_missing = source_tensor_count(cfg) - sum(not n.endswith(".input_scale") for n in seen)
    if n_missing:
        first = next(s.name for s in expected_tensors(cfg) if s.name not in seen)
        more = f" (and {n_missing - 1} more)" if n_missing > 1 else ""
        raise CheckpointError(f"{root}: tensor {first!r}{more} required by config.json is missing")
    return tensors


def load_activation_amax(path: str | None) -> dict[str, float]:
    """module -> activation amax from a calibration file (JSON {module: amax} or safetensors
    {module + '.input_amax': one-element float tensor})."""
    out: dict[str, float] = {}
    if not path:
        return out
    from ..io.safetensors import _short, read_header

    p = Path(path)
    if p.suffix == ".safetensors":
        with ShardReader(p, read_header(p)) as r:
            for name, e in r.header.tensors.items():
                module = name[: -len(".input_amax")]
                where = f"{p}: tensor {name[:200]!r}"
                if not name.endswith(".input_amax") or not module:
                    raise CheckpointError(f"{where}: expected '<module>.input_amax' names")
                if not e.dtype.is_floating_point or e.nbytes != e.dtype.itemsize:
                    raise CheckpointError(f"{where}: an amax is one floating-point value, got dtype "
                                          f"{DTYPE_NAMES[e.dtype]} shape {list(e.shape)}")
                out[module] = float(r.get(name).float().reshape(-1)[0])
    else:
        obj = read_json(p, "activation scales file")
        for k, v in obj.items():
            if not k:
                raise CheckpointError(f"{p}: an empty module name")
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                raise CheckpointError(f"{p}: module {k[:200]!r}: amax must be a number, got {_short(v)}")
            try:
                out[k] = float(v)
            except OverflowError:  # an integer past the float range
                raise CheckpointError(f"{p}: module {k[:200]!r}: activation amax must be finite and positive, "
                                      f"got an integer too large for a float") from None
    for k, v in out.items():
        if not (v > 0 and v < float("inf")):
            raise CheckpointError(f"{path}: module {k[:200]!r}: activation amax must be finite and positive, got {v}")
    return out


def plan(cfg: ModelConfig, tensors: list[SrcTensor], scheme: Scheme, opts: Options,
         calibrated: dict[str, float], from_source: dict[str, float] | None = None, root: str = ".") -> list[ShardJob]:
    """Units (a tensor, or an NVFP4 gate/up pair) packed into output shards. An NVFP4 module's
    activation amax comes from `calibrated` (--activation-scales), else `from_source` (the
    source's own input_scale), else --default-activation-amax. Every tensor is checked against
    its format (block divisibility) here, before any byte is written."""
    from_source = from_source or {}
    units: list[Unit] = []
    by_name = {t.name: t for t in tensors}
    done: set[str] = set()
    missing_amax: list[str] = []
    for t in tensors:
        if t.name in done:
            continue
        rec = classify(t.name)
        if rec.suffix == "input_scale":  # calibration carried in the source: consumed, not copied
            continue
        fmt = scheme.format_name(cfg, rec)
        group = [t]
        if fmt == "nvfp4" and rec.projection in ("gate_proj", "up_proj"):
            partner = "up_proj" if rec.projection == "gate_proj" else "gate_proj"
            p = by_name[f"model.layers.{rec.layer}.mlp.experts.{rec.expert}.{partner}.weight"]
            group = [t, p] if rec.projection == "gate_proj" else [p, t]
        amax: list[float | None] = []
        origin: list[str | None] = []
        for g in group:
            done.add(g.name)
            try:
                _out_names(g, fmt, opts.weight_only)
            except FormatError as e:
                raise FormatError(f"{root}/{g.shard}: tensor {g.name!r}: {e}") from None
            module = g.name[: -len(".weight")]
            a, o = None, None
            if fmt == "nvfp4" and not opts.weight_only:
                for o, a in (("calibrated", calibrated.get(module)), ("source", from_source.get(module)),
                             ("default", opts.default_activation_amax)):
                    if a is not None:
                        break
                if a is None:
                    missing_amax.append(module)
                else:
                    _check_activation_amax(a, o, module, opts)
            amax.append(a)
            origin.append(o if a is not None else None)
        if fmt == "nvfp4" and len(group) == 2 and None not in amax:
            amax = [max(amax)] * 2  # gate and up read the same activations: one input scale
        units.append(Unit(tuple(group), fmt, tuple(amax), tuple(origin)))
    if missing_amax:
        raise UsageError(
            f"NVFP4 (W4A4) needs an activation scale per expert projection; none for {missing_amax[0]!r}"
            f" and {len(missing_amax) - 1} more. Pass --activation-scales FILE (calibration amax per module),"
            f" --default-activation-amax X, or --weight-only for W4A16 output")
    jobs, cur, cur_out, cur_src = [], [], 0, 0

    def flush():
        if cur:
            specs = tuple(s for u in cur for src in u.sources for s in _out_names(src, u.format, opts.weight_only))
            jobs.append((tuple(cur), specs, cur_src, cur_out))

    for u in units:
        out_b = sum(_nbytes(s) for src in u.sources for s in _out_names(src, u.format, opts.weight_only))
        if cur and cur_out + out_b > opts.max_shard_bytes:
            flush()
            cur, cur_out, cur_src = [], 0, 0
        cur.append(u)
        cur_out += out_b
        cur_src += sum(_nbytes((s.name, s.dtype, s.shape)) for s in u.sources)
    flush()
    return [ShardJob(i, shard_name(i, len(jobs)), *j) for i, j in enumerate(jobs)]


def _check_activation_amax(amax: float, origin: str, module: str, opts: Options) -> None:
    """The input_scale this amax gives must be finite and > 0: checked before any byte is written."""
    try:
        nvfp4_input_scale(amax, module + ".input_scale")
    except FormatError as e:
        where = {"calibrated": opts.activation_scales, "source": "the source's input_scale",
                 "default": "--default-activation-amax"}[origin]
        raise UsageError(f"{where}: {e}") from None


def _nbytes(spec: tuple[str, str, tuple[int, ...]]) -> int:
    n = DTYPES[spec[1]].itemsize
    for s in spec[2]:
        n *= s
    return n


# --------------------------------------------------------------------------- work
@dataclass
class ShardResult:
    file: str
    sha256: str
    out_bytes: int
    src_bytes: int
    counts: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0


class _Sources:
    """Open source shards on demand (downloading hub shards when first needed)."""

    def __init__(self, root: Path, repo: str | None, revision: str | None):
        self.root, self.repo, self.revision = root, repo, revision
        self.readers: dict[str, ShardReader] = {}

    def get(self, shard: str) -> ShardReader:
        r = self.readers.get(shard)
        if r is None:
            path = hub.fetch_shard(self.repo, self.revision, shard) if self.repo else safe_child(self.root, shard, "shard")
            r = self.readers[shard] = ShardReader(path)
        return r

    def close(self):
        for r in self.readers.values():
            r.close()


def _check_finite(t: torch.Tensor, where: str) -> None:
    """NaN/Inf anywhere ends the run. One fused min/max pass: NaN propagates through both and
    an Inf is the min or the max (~7 GB/s on bf16, no temporaries)."""
    if t.numel() == 0:
        return
    lo, hi = torch.aminmax(t.reshape(-1))
    if not (bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))):
        raise FormatError(f"{where}: contains NaN or Inf")


def convert_shard(job: ShardJob, src_root: str, repo: str | None, revision: str | None, out_dir: str,
                  device: str = "cpu", buffered_io: bool = False, progress=None) -> ShardResult:
    """One output shard. Writing (sha256 + write, both GIL-free) runs on a second thread one unit
    behind the reading and quantizing, so the I/O of unit k overlaps the arithmetic of unit k+1.
    Two sets of read buffers alternate: pass-through outputs are views into them, and the write
    of unit k has finished before unit k+2 reads into its set."""
    start = time.perf_counter()
    sources = _Sources(Path(src_root), repo, revision)
    buffer_sets = ((TensorBuffer(), TensorBuffer()), (TensorBuffer(), TensorBuffer()))
    counts: dict[str, int] = {}
    writer = ShardWriter(Path(out_dir) / job.file, [(n, DTYPES[d], s) for n, d, s in job.specs], SHARD_METADATA,
                         direct=not buffered_io)
    io = cf.ThreadPoolExecutor(1, thread_name_prefix="inkling-quant-write")
    pending: cf.Future | None = None
    try:
        with writer:
            try:
                for k, u in enumerate(job.units):
                    _STOP.check()
                    outputs = _convert_unit(u, sources, buffer_sets[k % 2], device, counts, progress)
                    if pending is not None:
                        pending.result()  # an I/O error of the previous unit surfaces here
                    pending = io.submit(_write_all, writer, outputs)
                if pending is not None:
                    pending.result()
            finally:
                io.shutdown(wait=True)  # never close the file under a running write
            # No fsync per shard: O_DIRECT bytes are already on the device and buffered ones
            # survive a kill -9 in the page cache; --resume re-hashes every recorded shard anyway,
            # and finalize fsyncs all shards once (sizes, metadata) before the index exists.
            sha = writer.commit(durable=False)
    finally:
        sources.close()
    return ShardResult(job.file, sha, job.out_bytes, job.src_bytes, counts, time.perf_counter() - start)


def _convert_unit(u, sources: "_Sources", buffers, device: str, counts: dict[str, int],
                  progress) -> list[tuple[str, torch.Tensor]]:
    """Read and quantize one unit (a tensor, or a fused gate/up pair); return (name, tensor) to write."""
    fmt = FORMATS[u.format]
    ws = []
    for k, src in enumerate(u.sources):
        reader = sources.get(src.shard)
        w = reader.get(src.name, buffers[k])
        where = f"{reader.path}: tensor {src.name!r}"
        if u.format == "passthrough":  # the quantizers check their own input
            _check_finite(w, where)
        ws.append((src, w if device == "cpu" else w.to(device), where))
    global_amax = None
    if u.format == "nvfp4":
        global_amax = torch.maximum(*[tensor_amax(w) for _, w, _ in ws]) if len(ws) == 2 else None
    outputs = []
    for (src, w, where), ia in zip(ws, u.input_amax):
        try:
            out = fmt.quantize(w, global_amax=global_amax, input_amax=ia)
        except FormatError as e:
            raise FormatError(f"{where}: {e}") from None
        module = src.name[: -len(".weight")]
        for suffix, t in out.items():
            name = src.name if u.format == "passthrough" else f"{module}.{suffix}"
            outputs.append((name, t.cpu() if device != "cpu" else t))
        counts[u.format] = counts.get(u.format, 0) + 1
        if progress is not None:
            progress(_nbytes((src.name, src.dtype, src.shape)))
    return outputs


def _write_all(writer: ShardWriter, outputs: list[tuple[str, torch.Tensor]]) -> None:
    for name, t in outputs:
        writer.write(name, t)


def _worker_init(threads: int) -> None:
    torch.set_num_threads(threads)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides; it terminates us on interrupt
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a file-size limit becomes an OSError


# --------------------------------------------------------------------------- driver
def _fingerprint(jobs: list[ShardJob], opts: Options, stat: dict) -> str:
    blob = json.dumps({"version": __version__, "opts": asdict(opts) | {"workers": None, "buffered_io": None},
                       "jobs": [[j.file, list(j.specs)] for j in jobs], "sources": stat}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def quant_config(cfg: ModelConfig, jobs: list[ShardJob], weight_only: bool) -> dict:
    """ModelOpt MIXED_PRECISION config: every quantized expert projection listed, the rest excluded."""
    layers: dict[str, dict] = {}
    for j in jobs:
        for u in j.units:
            entry = FORMATS[u.format].layer_config(weight_only)
            if entry is not None:
                for s in u.sources:
                    layers[s.name[: -len(".weight")]] = entry
    return {
        "quant_algo": "MIXED_PRECISION",
        "kv_cache_quant_algo": None,
        "exclude_modules": ["lm_head", "model.embed_tokens", "model.layers.*.self_attn*",
                            "model.layers.*.mlp.gate", "model.layers.*.mlp.input_conv", "model.visual*", "dspark*"],
        "quantized_layers": dict(sorted(layers.items(), key=lambda kv: natural_key(kv[0]))),
    }


def _peak_rss_mb() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(own, kids) / 1024


@dataclass
class Prepared:
    """Everything decided before any byte is written: the same for every part and every resume."""

    root: Path
    repo: str | None
    revision: str | None
    cfg: ModelConfig
    jobs: list[ShardJob]
    other_files: list[Path]
    fingerprint: str


def prepare(src: str, opts: Options) -> Prepared:
    root, repo, revision = hub.resolve(str(src))
    cfg = ModelConfig.load(root)
    scheme = get_scheme(opts.scheme)
    if repo:
        listing = {s: {n: (d, tuple(sh)) for n, (d, sh) in e.items()} for s, e in hub.tensor_listing(repo, revision).items()}
        other, stat = [], {"repo": repo, "revision": revision}
    else:
        ckpt = Checkpoint.open(root)
        headers = ckpt.headers()
        listing = {s: {n: (DTYPE_NAMES[e.dtype], e.shape) for n, e in h.tensors.items()} for s, h in headers.items()}
        other = ckpt.other_files()
        stat = {s: [h.file_size, os.stat(h.path).st_mtime_ns] for s, h in headers.items()}
    tensors = validate_source(cfg, listing, str(src))
    from_source: dict[str, float] = {}
    calibrated: dict[str, float] = {}
    if not opts.weight_only:
        scale_names = [t for t in tensors if t.name.endswith(".input_scale")]
        if scale_names:
            srcs = _Sources(root, repo, revision)
            try:
                for t in scale_names:  # the inverse of the format's input_scale rule
                    module = t.name[: -len(".input_scale")]
                    from_source[module] = float(srcs.get(t.shard).get(t.name).float().reshape(-1)[0]) * GLOBAL_DIV
            finally:
                srcs.close()
        calibrated = load_activation_amax(opts.activation_scales)
        modules = {t.name[: -len(".weight")] for t in tensors if t.name.endswith(".weight")}
        unknown = sorted(k for k in calibrated if k not in modules)
        if unknown:
            raise CheckpointError(f"{opts.activation_scales}: {len(unknown)} of {len(calibrated)} module name(s) match "
                                  f"no module of {src} (first: {printable(unknown[0][:200])!r}); calibration for "
                                  f"another model or another naming?")
    jobs = plan(cfg, tensors, scheme, opts, calibrated, from_source, str(src))
    return Prepared(root, repo, revision, cfg, jobs, other, _fingerprint(jobs, opts, stat))


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


_STOP = _StopRequest()  # in worker processes no handler is installed: check() never raises


def _part_tag(part: tuple[int, int] | None) -> str:
    return f"-part-{part[0]}-of-{part[1]}" if part else ""


def _manifests(out: Path) -> list[Path]:
    return sorted(out.glob(MANIFEST_GLOB))


def convert(src: str, out: str | Path, opts: Options, *, resume: bool = False, overwrite: bool = False,
            quiet: bool = False, part: tuple[int, int] | None = None, reports: tuple[str | None, ...] = ()) -> dict:
    """Convert SRC into OUT. With `part=(i, n)` only every n-th shard (from the i-th) is
    converted and nothing is finalized: `finalize(src, out, opts)` does that once all parts ran.
    `reports`: the report files the caller will write (checked with the output paths)."""
    t0 = time.perf_counter()
    out = Path(out)
    if opts.device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available")
    prep = prepare(src, opts)
    jobs = [j for j in prep.jobs if part is None or j.index % part[1] == part[0] - 1]

    # output directory: refuse, resume or replace; one writer per part
    check_paths(out, [prep.root, opts.activation_scales], reports=reports)
    tag = _part_tag(part)
    manifest_path = out / f".inkling-quant-convert{tag}.json"
    lock = OutputLock(out, tag).acquire()  # before anything is removed: never under a live writer
    _STOP.signame = None
    old_handlers = {s: signal.signal(s, _STOP.handler) for s in (signal.SIGINT, signal.SIGTERM)}
    old_xfsz = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # file-size limit: an error, not a kill
    try:
        if out.exists() and any(out.iterdir()) and not part:
            if not resume:
                if not overwrite:
                    raise UsageError(f"{out}: exists and is not empty; pass --resume to continue an interrupted "
                                     f"conversion or --overwrite to replace it")
                shutil.rmtree(out)
            elif (out / INDEX_NAME).exists() and not manifest_path.exists():
                return _confirm_complete(src, out, opts, prep, t0)
        out.mkdir(parents=True, exist_ok=True)
        _refuse_symlinks(out)
        done = _load_done(manifest_path, prep.fingerprint, out) if resume else {}
        for j in jobs:  # unfinished shards (and temporaries) of this part: redo them
            for p in temps_of(out / j.file) + ([out / j.file] if j.file not in done else []):
                p.unlink(missing_ok=True)
        (out / INDEX_NAME).unlink(missing_ok=True)
        write_json_atomic(manifest_path, {"fingerprint": prep.fingerprint, "done": done})
        todo = [j for j in jobs if j.file not in done]
        _run_jobs(prep, todo, jobs, done, manifest_path, out, opts, quiet)
        report = _report(src, out, opts, jobs if part else prep.jobs, todo, t0)
        if part is None:
            finalize(src, out, opts, prep=prep, quiet=True)
        else:
            report["part"] = f"{part[0]}/{part[1]}"
        return report
    finally:
        for s, h in old_handlers.items():
            signal.signal(s, h)
        signal.signal(signal.SIGXFSZ, old_xfsz)
        lock.release()


def _refuse_symlinks(out: Path) -> None:
    """Every file in OUT is one a conversion wrote: a symlink there was planted, and writing
    beside it (or resuming over it) could reach a file elsewhere."""
    links = [p.name for p in out.iterdir() if p.is_symlink()]
    if links:
        raise UnsafePathError(f"{out / links[0]}: a symlink in the output directory"
                              f"{f' (and {len(links) - 1} more)' if len(links) > 1 else ''}; "
                              f"remove it (a conversion writes only regular files)")


def _confirm_complete(src, out: Path, opts: Options, prep: "Prepared", t0: float) -> dict:
    """`--resume` on a finished OUT: confirm it is this conversion's result (its index lists
    exactly the planned tensors in the planned shards, with the planned sizes), then succeed,
    so a retried job (a Slurm requeue) passes. Nothing is rewritten or re-hashed."""
    _refuse_symlinks(out)
    index = read_json(out / INDEX_NAME, "index")
    planned = {name: j.file for j in prep.jobs for name, _, _ in j.specs}
    sizes_ok = all((out / j.file).is_file() and (out / j.file).stat().st_size == _shard_file_size(j)
                   for j in prep.jobs)
    if index.get("weight_map") != planned or not sizes_ok:
        raise UsageError(f"{out}: holds a finished conversion with another source, scheme or options; "
                         f"use --overwrite to replace it")
    report = _report(src, out, opts, prep.jobs, [], t0)
    report["already_complete"] = True
    return report


def _shard_file_size(j: ShardJob) -> int:
    return shard_file_size([(n, DTYPES[d], s) for n, d, s in j.specs], SHARD_METADATA)


def _load_done(manifest_path: Path, fp: str, out: Path) -> dict[str, str]:
    if not manifest_path.exists():
        return {}
    m = read_json(manifest_path, "resume manifest")
    if m.get("fingerprint") != fp:
        raise UsageError(f"{out}: was started with another source, scheme or options; "
                         f"cannot --resume (use --overwrite to start again)")
    done = {}
    for f, sha in (m.get("done") or {}).items():
        p = safe_child(out, f, "shard")
        if p.is_file() and sha256_file(p) == sha:
            done[f] = sha
    return done


def _run_jobs(prep: Prepared, todo: list[ShardJob], jobs: list[ShardJob], done: dict[str, str],
              manifest_path: Path, out: Path, opts: Options, quiet: bool) -> None:
    bar_bytes = tqdm(total=sum(j.src_bytes for j in jobs), unit="B", unit_scale=True, desc="convert",
                     disable=quiet, smoothing=0.1)
    bar_bytes.update(sum(j.src_bytes for j in jobs if j.file in done))
    bar_shards = tqdm(total=len(jobs), unit="shard", desc="shards", disable=quiet, position=1, leave=False)
    bar_shards.update(len(jobs) - len(todo))

    def record(r: ShardResult):
        done[r.file] = r.sha256
        write_json_atomic(manifest_path, {"fingerprint": prep.fingerprint, "done": done})
        bar_shards.update(1)

    args = (str(prep.root), prep.repo, prep.revision, str(out), opts.device, opts.buffered_io)
    pool = None
    try:
        if opts.workers <= 1 or len(todo) <= 1:
            for j in todo:
                _STOP.check()
                record(convert_shard(j, *args, progress=bar_bytes.update))
        else:
            threads = max(1, (os.cpu_count() or 1) // opts.workers)
            ctx = mp.get_context("spawn")  # no fork after torch/OpenMP threads exist
            pool = cf.ProcessPoolExecutor(opts.workers, mp_context=ctx, initializer=_worker_init, initargs=(threads,))
            futs = [pool.submit(convert_shard, j, *args) for j in todo]
            finished = cf.as_completed(futs)
            while True:
                _STOP.check()
                _STOP.waiting = True  # only waiting: a signal may raise right here
                try:
                    f = next(finished, None)
                finally:
                    _STOP.waiting = False
                if f is None:
                    break
                r = f.result()
                bar_bytes.update(r.src_bytes)
                record(r)
            pool.shutdown()
        _STOP.check()  # a signal during the last shard: stop before finalizing
    except KeyboardInterrupt as e:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)  # a second ^C must not cut the clean-up short
        _stop(pool, out, todo, done)
        raise Interrupted(f"{out}: interrupted ({e or 'SIGINT'}) after {len(done)} of {len(jobs)} shards; "
                          f"rerun the same command with --resume to finish") from None
    except OSError as e:
        _stop(pool, out, todo, done)
        raise OutputError(f"{out}: cannot write ({e.strerror or e}); {len(done)} of {len(jobs)} shards are "
                          f"done: free space and rerun with --resume") from None
    except cf.process.BrokenProcessPool:
        _stop(pool, out, todo, done)
        raise WorkerDied(f"{out}: a worker process died (killed, or out of memory) after {len(done)} of "
                         f"{len(jobs)} shards; rerun the same command with --resume to finish") from None
    except BaseException:
        _stop(pool, out, todo, done)
        raise
    finally:
        bar_bytes.close()
        bar_shards.close()


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


def finalize(src: str, out: str | Path, opts: Options, *, prep: Prepared | None = None, quiet: bool = False,
             reports: tuple[str | None, ...] = ()) -> dict:
    """Write configs, non-weight files, checksums and, last, the index; then drop the resume
    manifests. Checks that every planned shard is present (and matches its recorded checksum)
    first. Called by `convert` (which holds the output lock) or alone after --part runs."""
    out = Path(out)
    if prep is not None:
        return _finalize_io(out, prep, opts)
    prep = prepare(src, opts)
    check_paths(out, [prep.root, opts.activation_scales], reports=reports)
    if not out.is_dir():
        raise UsageError(f"{out}: no such output directory: run the --part conversions first")
    with OutputLock(out):
        _refuse_symlinks(out)
        return _finalize_io(out, prep, opts)


def _finalize_io(out: Path, prep: "Prepared", opts: Options) -> dict:
    try:
        return _finalize(out, prep, opts)
    except OSError as e:  # a full disk, a lost mount: the shards are kept, the manifest says so
        raise OutputError(f"{out}: finalizing failed: {e.strerror or e}"
                          f"{f' ({e.filename})' if e.filename else ''}; the converted shards are kept: "
                          f"free space and rerun with --resume (or --finalize after --part runs)") from None


def _finalize(out: Path, prep: "Prepared", opts: Options) -> dict:
    recorded: dict[str, str] = {}
    for m in _manifests(out):
        obj = read_json(m, "part manifest")
        if obj.get("fingerprint") != prep.fingerprint:
            raise UsageError(f"{m}: written by a conversion with another source, scheme or options")
        recorded.update(obj.get("done") or {})
    sums: dict[str, str] = {}
    missing = [j.file for j in prep.jobs if j.file not in recorded or not (out / j.file).is_file()]
    if missing:
        raise UsageError(f"{out}: {len(missing)} of {len(prep.jobs)} shards are not converted yet "
                         f"(first: {missing[0]}); run the missing --part(s) first")
    for j in prep.jobs:
        sums[j.file] = recorded[j.file]
    fsync_files(out / j.file for j in prep.jobs)
    if len(_manifests(out)) > 1:  # shards from other machines: check what they recorded
        for f, h in sums.items():
            if sha256_file(out / f) != h:
                raise CheckpointError(f"{out / f}: checksum differs from the one its part recorded")
    config = dict(prep.cfg.raw)
    qc = quant_config(prep.cfg, prep.jobs, opts.weight_only)
    config["quantization_config"] = {"quant_method": "modelopt", **qc}
    write_json_atomic(out / "hf_quant_config.json", {
        "producer": {"name": "modelopt", "version": MODELOPT_FORMAT_VERSION},
        "quantization": qc,
        "converter": {"name": "inkling-quant", "version": __version__, "scheme": opts.scheme,
                      "weight_only": opts.weight_only}})
    write_json_atomic(out / "config.json", config)
    for p in prep.other_files:
        copy_file_atomic(p, out / p.name)
    files = sorted(list(sums) + ["config.json", "hf_quant_config.json"] + [p.name for p in prep.other_files])
    for f in files:
        if f not in sums:
            sums[f] = sha256_file(out / f)
    write_checksums(out / CHECKSUMS, {f: sums[f] for f in files})
    weight_map = {name: j.file for j in prep.jobs for name, _, _ in j.specs}
    write_json_atomic(out / INDEX_NAME, {"metadata": {"total_size": sum(j.out_bytes for j in prep.jobs)},
                                         "weight_map": weight_map})
    for m in _manifests(out):
        m.unlink()
    return {"output": str(out), "shards": len(prep.jobs), "finalized": True}


def _report(src, out: Path, opts: Options, jobs: list[ShardJob], todo: list[ShardJob], t0: float) -> dict:
    seconds = time.perf_counter() - t0
    counts: dict[str, int] = {}
    act = {"calibrated": 0, "source": 0, "default": 0}  # where each module's activation amax came from
    for j in jobs:
        for u in j.units:
            counts[u.format] = counts.get(u.format, 0) + len(u.sources)
            for o in u.amax_origin:
                if o is not None:
                    act[o] += 1
    return {
        "source": str(src), "output": str(out), "scheme": opts.scheme, "weight_only": opts.weight_only,
        "shards": len(jobs), "shards_resumed": len(jobs) - len(todo), "tensors_by_format": counts,
        "activation_scales": act,
        "bytes_in": sum(j.src_bytes for j in jobs), "bytes_out": sum(j.out_bytes for j in jobs),
        "seconds": round(seconds, 3),
        "source_mb_per_s": round(sum(j.src_bytes for j in todo) / 1e6 / max(seconds, 1e-9), 1),
        "workers": opts.workers, "peak_rss_mb": round(_peak_rss_mb(), 1),
    }


# --------------------------------------------------------------------------- CLI
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="source checkpoint: a local HF directory or a hub repo id org/name[@revision]")
    p.add_argument("out", help="output directory (must not exist, unless --resume or --overwrite)")
    p.add_argument("--scheme", default="default", help="conversion scheme (see `inkling-quant schemes`)")
    p.add_argument("--workers", type=int_range(1, 1024), default=1, help="shards converted in parallel processes")
    p.add_argument("--device", default="cpu", help="cpu or cuda (bit-identical results)")
    p.add_argument("--max-shard-size", type=parse_size, default=5 * 10**9, help="output shard size (default 5GB)")
    p.add_argument("--buffered-io", action="store_true",
                   help="write shards through the page cache instead of O_DIRECT (docs/convert.md)")
    a = p.add_argument_group("NVFP4 activation scales (W4A4 needs one input_scale per expert projection)")
    a.add_argument("--activation-scales", metavar="FILE",
                   help="calibration amax per module: JSON {module: amax} or safetensors {module.input_amax}")
    a.add_argument("--default-activation-amax", type=positive_float, metavar="X",
                   help="use amax X for every module without a calibrated value")
    a.add_argument("--weight-only", action="store_true", help="W4A16 NVFP4 (no input_scale; vLLM's W4A16_NVFP4)")
    p.add_argument("--resume", action="store_true", help="continue an interrupted conversion in OUT")
    m = p.add_argument_group("several machines sharing one OUT (docs/scale.md)")
    m.add_argument("--part", type=_part, metavar="I/N", help="convert only part I of N (a deterministic shard subset); "
                   "no index is written until --finalize")
    m.add_argument("--finalize", action="store_true", help="check all parts are there and write configs, checksums, index")
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    p.add_argument("--quiet", action="store_true", help="no progress bars or summary")
    p.add_argument("--json", metavar="REPORT", help="write the summary as JSON to REPORT ('-' for standard output)")


def run(args) -> int:
    quiet = args.quiet or args.json == "-"
    if args.weight_only and (args.activation_scales or args.default_activation_amax is not None):
        raise UsageError("--weight-only writes no activation scales; drop --activation-scales/--default-activation-amax")
    opts = Options(scheme=args.scheme, weight_only=args.weight_only,
                   default_activation_amax=args.default_activation_amax,
                   activation_scales=args.activation_scales, max_shard_bytes=args.max_shard_size,
                   workers=args.workers, device=args.device, buffered_io=args.buffered_io)
    if args.finalize:
        if args.part:
            raise UsageError("--finalize runs once, after all --part runs: drop --part")
        report = finalize(args.src, args.out, opts, reports=(args.json,))
        write_report(args.json, json.dumps(report, indent=2) + "\n")
        if not quiet:
            print(f"finalized {report['output']}: {report['shards']} shards")
        return 0
    if args.part and args.overwrite:
        raise UsageError("--overwrite with --part would delete the other parts' shards")
    report = convert(args.src, args.out, opts, resume=args.resume, overwrite=args.overwrite, quiet=quiet,
                     part=args.part, reports=(args.json,))
    write_report(args.json, json.dumps(report, indent=2) + "\n")
    if not quiet:
        print_summary(report)
    return 0


def _part(text: str) -> tuple[int, int]:
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--part takes I/N, e.g. 3/8, got {text!r}") from None
    if not 1 <= i <= n:
        raise argparse.ArgumentTypeError(f"--part {text}: need 1 <= I <= N")
    return i, n


def print_summary(r: dict, file=sys.stdout) -> None:
    if r.get("already_complete"):
        print(f"{r['output']}: already complete ({r['shards']} shards of this conversion); nothing to do", file=file)
        return
    fmts = ", ".join(f"{k} {v}" for k, v in sorted(r["tensors_by_format"].items()))
    print(f"converted {r['source']} -> {r['output']} (scheme {r['scheme']}{', weight-only' if r['weight_only'] else ''})",
          file=file)
    print(f"  tensors: {fmts}", file=file)
    act = r.get("activation_scales") or {}
    if any(act.values()):
        print("  NVFP4 activation scales: " + ", ".join(f"{v} {k}" for k, v in act.items() if v), file=file)
    print(f"  bytes: {r['bytes_in'] / 1e9:.3f} GB in, {r['bytes_out'] / 1e9:.3f} GB out in {r['shards']} shards"
          f" ({r['shards_resumed']} resumed)", file=file)
    print(f"  time: {r['seconds']:.2f} s, {r['source_mb_per_s']:.0f} MB/s of source, peak RSS {r['peak_rss_mb']:.0f} MB,"
          f" {r['workers']} worker(s)", file=file)
