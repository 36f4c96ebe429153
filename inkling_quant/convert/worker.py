"""The work on one output shard: read each unit's source tensors, check them, quantize them per
their format and stream the results into the shard. Runs in the converting process or in a
worker process of the pool (inkling_quant.convert.runner); knows nothing of signals or manifests."""
from __future__ import annotations

import concurrent.futures as cf
import itertools
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch

from .. import hub
from ..errors import FormatError
from ..formats import FORMATS
from ..formats.stacked import projection_specs, slab_modules, slab_slices
from ..io.safetensors import DTYPES, ShardWriter, TensorBuffer
from ..io.shards import ShardReaders
from .planner import ShardJob, Unit, expert_modules

SHARD_METADATA = {"format": "pt"}


@dataclass
class ShardResult:
    file: str
    sha256: str
    out_bytes: int
    src_bytes: int
    counts: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    fetch_seconds: float = 0.0  # of `seconds`, waiting for hub downloads


def _sources(root: Path, repo: str | None, revision: str | None) -> ShardReaders:
    """Readers of the source's shards, kept open for the job (downloading a hub shard when first needed)."""
    fetch = (lambda shard: hub.fetch_shard(repo, revision, shard)) if repo else None
    return ShardReaders(root, fetch=fetch, keep_open=True)


def convert_shard(job: ShardJob, src_root: str, repo: str | None, revision: str | None, out_dir: str,
                  device: str = "cpu", buffered_io: bool = False, progress=None,
                  stop: Callable[[], None] | None = None) -> ShardResult:
    """One output shard. Writing (sha256 + write, both GIL-free) runs on a second thread one step
    behind the reading and quantizing (a step: a unit, or one expert of a stacked unit), so the
    I/O of step k overlaps the arithmetic of step k+1. Two sets of read buffers alternate:
    pass-through outputs are views into them, and the write of step k has finished before step
    k+2 reads into its set. `stop` is called before each unit
    (it raises to stop the shard: a signal in the converting process)."""
    start, fetched = time.perf_counter(), hub.fetch_seconds()
    sources = _sources(Path(src_root), repo, revision)
    buffer_sets = itertools.cycle(((TensorBuffer(), TensorBuffer()), (TensorBuffer(), TensorBuffer())))
    counts: dict[str, int] = {}
    writer = ShardWriter(Path(out_dir) / job.file, [(n, DTYPES[d], s) for n, d, s in job.specs], SHARD_METADATA,
                         direct=not buffered_io)
    io = cf.ThreadPoolExecutor(1, thread_name_prefix="inkling-quant-write")
    pending: cf.Future | None = None
    try:
        with writer:
            try:
                for u in job.units:
                    if stop is not None:
                        stop()
                    for outputs in _steps(u, sources, buffer_sets, device, counts, progress):
                        if pending is not None:
                            pending.result()  # an I/O error of the previous step surfaces here
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
    return ShardResult(job.file, sha, job.out_bytes, job.src_bytes, counts, time.perf_counter() - start,
                       hub.fetch_seconds() - fetched)


def _steps(u: Unit, sources: ShardReaders, buffer_sets, device: str, counts: dict[str, int],
           progress) -> Iterator[list[tuple[str, torch.Tensor, bool]]]:
    """The unit's writes, step by step: (name, tensor, whole) where `whole` is False for the next
    piece of a tensor written in pieces."""
    if u.stacked is not None:
        yield from _stacked_steps(u, sources, buffer_sets, device, counts, progress)
    elif u.storage == "per_expert":
        yield [(n, t, True) for n, t in _convert_unit(u, sources, next(buffer_sets), device, counts, progress)]
    else:
        yield [_passthrough(u, sources, next(buffer_sets)[0], counts, progress)]


def _passthrough(u: Unit, sources: ShardReaders, buffer, counts: dict[str, int],
                 progress) -> tuple[str, torch.Tensor, bool]:
    """A pass-through tensor, checked finite, under its own name or `u.out_name`; its leading
    `u.rows` rows only when set (only those bytes are read)."""
    src = u.sources[0]
    reader = sources.get(src.shard)
    if u.rows is None:
        t = reader.get(src.name, buffer)
    else:
        t = reader.get_rows(src.name, u.rows, buffer)
    _check_finite(t, reader.path, src.name)
    counts[u.format] = counts.get(u.format, 0) + 1
    if progress is not None:
        progress(t.numel() * t.element_size())
    return u.out_name or src.name, t, True


def _stacked_steps(u: Unit, sources: ShardReaders, buffer_sets, device: str, counts: dict[str, int],
                   progress) -> Iterator[list[tuple[str, torch.Tensor, bool]]]:
    """A stacked expert tensor ([E, ...], published layout), one expert at a time: read only its
    slice, quantize it as stored (formats.stacked.slab_slices: gate/up rows stay interleaved),
    write its weight slice as the next piece; the scales (an eighth of the weight or less) are
    gathered and written after the last expert. Memory: one expert plus the layer's scales."""
    src, fmt, proj = u.sources[0], FORMATS[u.format], u.stacked
    if u.unstacked:
        yield from _per_expert_steps(u, sources, buffer_sets, device, counts, progress)
        return
    reader = sources.get(src.shard)
    prefix, weight = src.name[: -len(f"{proj}_weight")], f"{proj}_weight"
    specs = projection_specs(fmt, proj, src.shape, dtype=DTYPES[src.dtype],
                             activation_scale=u.activation_scale)
    gathered = {k: torch.empty(o.shape, dtype=o.dtype) for k, o in specs.items() if k != weight}
    for e in range(src.shape[0]):
        q = _expert(u, sources, e, next(buffer_sets), device, counts, progress)
        try:
            slices = slab_slices(fmt, proj, q, name=f"expert {e}: ")
        except FormatError as err:
            raise FormatError(f"tensor {src.name!r}, expert {e}: {err.message}", path=reader.path,
                              tensor=src.name) from None
        for k, t in slices.items():
            if k != weight:
                gathered[k][e] = t
        yield [(prefix + weight, slices[weight], False)]
    yield [(prefix + k, t, True) for k, t in gathered.items()]


def _expert(u: Unit, sources: ShardReaders, e: int, buffers, device: str, counts: dict[str, int],
            progress) -> dict[str, torch.Tensor]:
    """Expert e's slab of a stacked unit in the unit's format, as `Format.quantize` returns it:
    a float slab quantized as stored; an MXFP8-release slab copied bit-exact when the format is
    kept, else dequantized exactly (e4m3 x 2^k is exact in fp32) and quantized."""
    src = u.sources[0]
    reader = sources.get(src.shard)
    slab = reader.get_slice(src.name, e, buffers[0])
    nbytes = slab.numel() * slab.element_size()
    if u.transposed:  # an [in, out] slab: quantized as [out, in], blocks along `in`
        slab = slab.t()
    q = None
    if u.source_format is not None:  # the MXFP8 release: weight + e8m0 scale
        scale = u.sources[1]
        stored = {"weight": slab, "weight_scale": sources.get(scale.shard).get_slice(scale.name, e, buffers[1])}
        nbytes += stored["weight_scale"].numel()
        if u.source_format == u.format:
            _check_stored(FORMATS[u.format], stored, reader.path, src.name, e)
            q = stored  # kept: copied bit-exact
        else:
            slab = FORMATS[u.source_format].dequantize(stored, torch.float32)
    elif u.format == "passthrough":
        _check_finite(slab, reader.path, src.name)
    if q is None:
        fmt = FORMATS[u.format]
        x = slab if device == "cpu" else slab.to(device)
        try:
            q = {k: t.cpu() for k, t in fmt.quantize(x, global_amax=fmt.fused_global_amax([x]),
                                                      input_amax=u.input_amax[0]).items()}
        except FormatError as err:
            raise FormatError(f"tensor {src.name!r}, expert {e}: {err.message}", path=reader.path,
                              tensor=src.name) from None
    counts[u.format] = counts.get(u.format, 0) + 1
    if progress is not None:
        progress(nbytes)
    return q


def _per_expert_steps(u: Unit, sources: ShardReaders, buffer_sets, device: str, counts: dict[str, int],
                      progress) -> Iterator[list[tuple[str, torch.Tensor, bool]]]:
    """A stacked expert tensor written as ModelOpt exports it (--output-format modelopt-hf): per
    expert, its slab quantized as stored, then split into ModelOpt's modules (gate_proj, up_proj
    from w13's interleaved rows; down_proj from w2), in the order the plan declared them."""
    src, fmt, proj = u.sources[0], FORMATS[u.format], u.stacked
    layout = expert_modules(u)
    per = len(layout) // src.shape[0]  # tensors per expert
    for e in range(src.shape[0]):
        mods = slab_modules(fmt, proj, _expert(u, sources, e, next(buffer_sets), device, counts, progress),
                            interleaved=u.storage == "interleaved")
        yield [(spec[0], mods[m][k], True) for _, m, k, spec in layout[e * per:(e + 1) * per]]


def _convert_unit(u: Unit, sources: ShardReaders, buffers, device: str, counts: dict[str, int],
                  progress) -> list[tuple[str, torch.Tensor]]:
    """One unit of a per-expert source (an expert's gate and up sharing one global scale, or one
    projection): read, quantize, return (name, tensor) to write under the source's names."""
    fmt = FORMATS[u.format]
    ws = []
    for k, src in enumerate(u.sources):
        reader = sources.get(src.shard)
        w = reader.get(src.name, buffers[k])
        if u.format == "passthrough":  # the quantizers check their own input
            _check_finite(w, reader.path, src.name)
        ws.append((src, w if device == "cpu" else w.to(device), reader.path))
    global_amax = fmt.fused_global_amax([w for _, w, _ in ws]) if len(ws) > 1 else None
    outputs = []
    for (src, w, path), ia in zip(ws, u.input_amax):
        try:
            out = fmt.quantize(w, global_amax=global_amax, input_amax=ia)
        except FormatError as e:
            raise FormatError(f"tensor {src.name!r}: {e.message}", path=path, tensor=src.name) from None
        outputs += [(fmt.tensor_name(src.name, suffix), t.cpu() if device != "cpu" else t) for suffix, t in out.items()]
        counts[u.format] = counts.get(u.format, 0) + 1
        if progress is not None:
            progress(w.numel() * w.element_size())
    return outputs


def _check_stored(fmt, stored: dict[str, torch.Tensor], path, name: str, e: int) -> None:
    """A quantized expert copied as it is must still be valid: its dequantization finite (a NaN
    e4m3 byte or an e8m0 255 shows there) — what the quantizers assure of every other path."""
    if not bool(torch.isfinite(fmt.dequantize(stored, torch.float32)).all()):
        raise FormatError(f"tensor {name!r}, expert {e}: holds NaN or Inf (an e4m3 NaN byte or an e8m0 255 "
                          f"scale)", path=path, tensor=name)


def _check_finite(t: torch.Tensor, path, name: str) -> None:
    """NaN/Inf anywhere ends the run. One fused min/max pass: NaN propagates through both and
    an Inf is the min or the max (~7 GB/s on bf16, no temporaries)."""
    if t.numel() == 0:
        return
    lo, hi = torch.aminmax(t.reshape(-1))
    if not (bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))):
        raise FormatError(f"tensor {name!r}: contains NaN or Inf", path=path, tensor=name)


def _write_all(writer: ShardWriter, outputs: list[tuple[str, torch.Tensor, bool]]) -> None:
    for name, t, whole in outputs:
        if whole:
            writer.write(name, t)
        else:
            writer.write_part(name, t)
