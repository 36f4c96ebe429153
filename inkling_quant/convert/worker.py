"""The work on one output shard: read each unit's source tensors, check them, quantize them per
their format and stream the results into the shard. Runs in the converting process or in a
worker process of the pool (inkling_quant.convert.runner); knows nothing of signals or manifests."""
from __future__ import annotations

import concurrent.futures as cf
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from .. import hub
from ..errors import FormatError
from ..formats import FORMATS
from ..io.safetensors import DTYPES, ShardWriter, TensorBuffer
from ..io.shards import ShardReaders
from .planner import ShardJob, SrcTensor, Unit, spec_nbytes

SHARD_METADATA = {"format": "pt"}
# the format whose activation-scale rule a source's own input_scale tensors follow (ModelOpt's NVFP4)
_SCALED = next(f for f in FORMATS.values() if f.static_activation_scale)


@dataclass
class ShardResult:
    file: str
    sha256: str
    out_bytes: int
    src_bytes: int
    counts: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0


def _sources(root: Path, repo: str | None, revision: str | None) -> ShardReaders:
    """Readers of the source's shards, kept open for the job (downloading a hub shard when first needed)."""
    fetch = (lambda shard: hub.fetch_shard(repo, revision, shard)) if repo else None
    return ShardReaders(root, fetch=fetch, keep_open=True)


def source_input_amax(tensors: list[SrcTensor], root: Path, repo: str | None, revision: str | None) -> dict[str, float]:
    """module -> activation amax from the source's own input_scale tensors (the inverse of the
    format's input_scale rule); read while planning."""
    from_source: dict[str, float] = {}
    scale_names = [t for t in tensors if t.name.endswith(".input_scale")]
    if scale_names:
        srcs = _sources(root, repo, revision)
        try:
            for t in scale_names:
                module = t.name[: -len(".input_scale")]
                scale = float(srcs.get(t.shard).get(t.name).float().reshape(-1)[0])
                from_source[module] = _SCALED.activation_amax(scale)
        finally:
            srcs.close()
    return from_source


def convert_shard(job: ShardJob, src_root: str, repo: str | None, revision: str | None, out_dir: str,
                  device: str = "cpu", buffered_io: bool = False, progress=None,
                  stop: Callable[[], None] | None = None) -> ShardResult:
    """One output shard. Writing (sha256 + write, both GIL-free) runs on a second thread one unit
    behind the reading and quantizing, so the I/O of unit k overlaps the arithmetic of unit k+1.
    Two sets of read buffers alternate: pass-through outputs are views into them, and the write
    of unit k has finished before unit k+2 reads into its set. `stop` is called before each unit
    (it raises to stop the shard: a signal in the converting process)."""
    start = time.perf_counter()
    sources = _sources(Path(src_root), repo, revision)
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
                    if stop is not None:
                        stop()
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


def _convert_unit(u: Unit, sources: ShardReaders, buffers, device: str, counts: dict[str, int],
                  progress) -> list[tuple[str, torch.Tensor]]:
    """Read and quantize one unit (a tensor, or a fused gate/up pair); return (name, tensor) to write."""
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
            raise FormatError(f"tensor {src.name!r}: {e}", path=path, tensor=src.name) from None
        for suffix, t in out.items():
            outputs.append((fmt.tensor_name(src.name, suffix), t.cpu() if device != "cpu" else t))
        counts[u.format] = counts.get(u.format, 0) + 1
        if progress is not None:
            progress(spec_nbytes((src.name, src.dtype, src.shape)))
    return outputs


def _check_finite(t: torch.Tensor, path, name: str) -> None:
    """NaN/Inf anywhere ends the run. One fused min/max pass: NaN propagates through both and
    an Inf is the min or the max (~7 GB/s on bf16, no temporaries)."""
    if t.numel() == 0:
        return
    lo, hi = torch.aminmax(t.reshape(-1))
    if not (bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))):
        raise FormatError(f"tensor {name!r}: contains NaN or Inf", path=path, tensor=name)


def _write_all(writer: ShardWriter, outputs: list[tuple[str, torch.Tensor]]) -> None:
    for name, t in outputs:
        writer.write(name, t)
