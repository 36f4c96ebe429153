"""The work on one output shard: read each unit's source tensors, check them, quantize them per
their format and stream the results into the shard. Runs in the converting process or in a
worker process of the pool (inkling_quant.convert.runner); knows nothing of signals or manifests."""
from __future__ import annotations

import concurrent.futures as cf
import itertools
import math
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch

from .. import hub
from ..errors import FormatError
from ..export.form import Outputs
from ..formats import FORMATS, VALUE_RULES, get_format, value_violation
from ..formats.fp8_block import has_nan_byte
from ..formats.transcode import STATS
from ..io.safetensors import DTYPES, ShardWriter, TensorBuffer
from ..io.shards import ShardReaders
from .planner import ShardJob, Unit

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
    # busy seconds of each pipeline stage (reading, converting, writing): the largest bounds the shard
    stages: dict[str, float] = field(default_factory=dict)
    # source tensor -> [MXFP4 blocks read, of them cast losslessly] (MXFP4 -> NVFP4: transcode.STATS)
    source_blocks: dict[str, list[int]] = field(default_factory=dict)
    flushed: list[str] = field(default_factory=list)  # weights written as zero (Format.flushes), named


@dataclass
class Tallies:
    """What a shard's steps count as they convert: units per format, a cast's block figures per
    source tensor (transcode.STATS), and the weights written as the format's all-zero weight."""
    counts: dict[str, int] = field(default_factory=dict)
    blocks: dict[str, list[int]] = field(default_factory=dict)
    flushed: list[str] = field(default_factory=list)

    def count(self, fmt: str, n: int = 1) -> None:
        self.counts[fmt] = self.counts.get(fmt, 0) + n

    def take_stats(self, name: str, q: dict[str, torch.Tensor]) -> None:
        """Take a transcoder's figures (transcode.STATS) out of its tensors, adding them to `blocks`."""
        if STATS[0] in q:
            got = self.blocks.setdefault(name, [0, 0])
            for i, k in enumerate(STATS):
                got[i] += int(q.pop(k))

    def flush(self, fmt, amax, what: str) -> None:
        """Note `what` when a weight of this amax is written as `fmt`'s all-zero weight."""
        if amax is not None and fmt.flushes(float(amax)):
            self.flushed.append(what)


def _sources(root: Path, repo: str | None, revision: str | None) -> ShardReaders:
    """Readers of the source's shards, kept open for the job (downloading a hub shard when first needed)."""
    fetch = (lambda shard: hub.fetch_shard(repo, revision, shard)) if repo else None
    return ShardReaders(root, fetch=fetch, keep_open=True)


def convert_shard(job: ShardJob, src_root: str, repo: str | None, revision: str | None, out_dir: str,
                  device: str = "cpu", buffered_io: bool = False, progress=None,
                  stop: Callable[[], None] | None = None) -> ShardResult:
    """One output shard, as a pipeline of three threads over its steps (a step: one expert of a
    stacked tensor, one unit of a per-expert source, or a piece of at most PIECE bytes of a
    pass-through tensor): a reader thread reads step k+1 (and downloads a hub shard when first
    needed) while this thread checks and quantizes step k and the writer thread hashes and
    writes step k-1. The three run side by side (pread, the quantizer kernels, sha256 and the
    write all release the GIL), so a shard costs about its slowest stage, not their sum. Memory:
    four sets of read buffers (one per stage, one queued), each bounded by a step, not by the
    largest tensor. `stop` is called before each step (it raises to stop the shard: a signal in
    the converting process)."""
    start, fetched = time.perf_counter(), hub.fetch_seconds()
    tallies = Tallies()
    writer = ShardWriter(Path(out_dir) / job.file, [(n, DTYPES[d], s) for n, d, s in job.specs], SHARD_METADATA,
                         direct=not buffered_io)
    sources = _sources(Path(src_root), repo, revision)
    steps = _ReadAhead(_job_steps(job, sources, device, tallies, progress, Path(out_dir)))
    io = cf.ThreadPoolExecutor(1, thread_name_prefix="inkling-quant-write")
    pending: cf.Future | None = None
    busy = {"read": 0.0, "convert": 0.0, "write": 0.0}
    try:
        with writer:
            try:
                for step, tensors in steps:
                    if stop is not None:
                        stop()
                    t = time.perf_counter()
                    outputs = step.compute(tensors)
                    busy["convert"] += time.perf_counter() - t
                    if pending is not None:
                        busy["write"] += pending.result()  # an I/O error of the previous step surfaces here
                    pending = io.submit(_write_all, writer, outputs)
                if pending is not None:
                    busy["write"] += pending.result()
            finally:
                busy["read"] = steps.close()
                io.shutdown(wait=True)  # never close the file under a running write
                steps.recycle()         # no write uses the read buffers any more
            # No fsync per shard: O_DIRECT bytes are already on the device and buffered ones
            # survive a kill -9 in the page cache; --resume re-hashes every recorded shard anyway,
            # and finalize fsyncs all shards once (sizes, metadata) before the index exists.
            sha = writer.commit(durable=False)
    finally:
        sources.close()
    return ShardResult(job.file, sha, job.out_bytes, job.src_bytes, tallies.counts, time.perf_counter() - start,
                       hub.fetch_seconds() - fetched, {k: round(v, 3) for k, v in busy.items()}, tallies.blocks,
                       tallies.flushed)


# ---------------------------------------------------------------------------- the pipeline
PIECE = 64 << 20  # a pass-through tensor is read, checked and written in pieces of at most this
STAGES = 4        # read buffer sets in flight: reading, queued, computing, writing


@dataclass
class _Step:
    """What a step reads (each read fills the buffer it is given; run on the reader thread) and
    what it makes of the tensors read (run on the converting thread)."""
    reads: list[Callable[[TensorBuffer], torch.Tensor]]
    compute: Callable[[list[torch.Tensor]], Outputs]


_SPARE_SETS: list[list[list[TensorBuffer]]] = []   # read buffers of finished shards, for the next
_SPARE_LOCK = threading.Lock()


def drop_spare_read_buffers() -> None:
    """Free the read buffers finished shards left for the next: at the end of a run, so that a
    process converting in-process does not keep a run's buffers (hundreds of MB) afterwards."""
    with _SPARE_LOCK:
        _SPARE_SETS.clear()


class _ReadAhead:
    """Iterates (step, tensors read) with the reads of the next step already under way on a
    reader thread, one step queued at most. The buffer sets cycle through STAGES so that a set is
    reused only once the write of the step that used it has finished (convert_shard waits for
    each write before submitting the next). An error of the reader is raised to the consumer.
    The sets are a finished shard's where there is one (`recycle`): fresh ones would have every
    page faulted in and zeroed again, shard after shard (seconds per GB on some VMs)."""

    _DONE = object()

    def __init__(self, steps: Iterator[_Step]):
        with _SPARE_LOCK:
            self._sets = _SPARE_SETS.pop() if _SPARE_SETS else [[] for _ in range(STAGES)]
        self._queue: queue.Queue = queue.Queue(maxsize=1)
        self._cancel = threading.Event()
        self.seconds = 0.0  # busy reading
        self._thread = threading.Thread(target=self._run, args=(steps,), name="inkling-quant-read", daemon=True)
        self._thread.start()

    def _run(self, steps: Iterator[_Step]) -> None:
        sets = itertools.cycle(self._sets)  # each grows to the most reads of a step
        try:
            for step in steps:
                bufs = next(sets)
                bufs += [TensorBuffer() for _ in range(len(step.reads) - len(bufs))]
                t = time.perf_counter()
                item = (step, [read(b) for read, b in zip(step.reads, bufs)])
                self.seconds += time.perf_counter() - t
                if not self._put(item):
                    return
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which raises it
            self._put(e)
            return
        self._put(self._DONE)

    def _put(self, item) -> bool:
        while not self._cancel.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self):
        while True:
            item = self._queue.get()
            if item is self._DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def close(self) -> float:
        """Stop reading ahead; returns the seconds spent reading. A read under way (a hub
        download) is not waited for long: its result is dropped, and the reader exits at its next step."""
        self._cancel.set()
        self._thread.join(timeout=5)
        return self.seconds

    def recycle(self) -> None:
        """Hand the buffers on to the next shard: call once nothing reads or writes them."""
        if not self._thread.is_alive():  # else a late read may still fill one
            with _SPARE_LOCK:
                _SPARE_SETS.append(self._sets)


def _job_steps(job: ShardJob, sources: ShardReaders, device: str, tallies: Tallies,
               progress, out_dir: Path) -> Iterator[_Step]:
    for u in job.units:
        if u.storage is None and u.source_format is not None:
            yield _kept_step(u, sources, tallies, progress)
        elif u.storage is None:
            yield from _passthrough_steps(u, sources, tallies, progress)
        elif u.stacked:
            yield from _stacked_steps(u, sources, device, tallies, progress, out_dir)
        else:
            yield _per_expert_unit(u, sources, device, tallies, progress)


def _passthrough_steps(u: Unit, sources: ShardReaders, tallies: Tallies, progress) -> Iterator[_Step]:
    """A pass-through tensor, checked finite, under the name its writing gives (export.Copy), in
    pieces of whole rows of at most PIECE bytes (a row larger than that is a piece); only the
    leading rows the writing keeps, where it cuts them (only those bytes are read)."""
    src, copy = u.sources[0], u.writing
    reader, name = sources.get(src.shard), copy.name or src.name
    rows = copy.rows if copy.rows is not None else (src.shape[0] if src.shape else None)
    if rows is None:  # a scalar
        pieces = [(None, None)]
    else:
        row = math.prod(src.shape[1:]) * DTYPES[src.dtype].itemsize
        per = max(1, PIECE // row) if row else max(rows, 1)
        pieces = [(r, min(rows, r + per)) for r in range(0, max(rows, 1), per)]

    def compute(t: list[torch.Tensor], first: bool, lo: int | None) -> Outputs:
        if u.value_rule is None:
            _check_finite(t[0], reader.path, src.name)
        else:
            _check_values(t[0], reader.path, src.name, u.value_rule, (lo or 0) * math.prod(src.shape[1:]))
        if first:
            tallies.count(u.format)
        if progress is not None:
            progress(t[0].numel() * t[0].element_size())
        return [(name, t[0], False)]

    for k, (lo, hi) in enumerate(pieces):
        read = (lambda b: reader.get(src.name, b)) if lo is None else \
            (lambda b, lo=lo, hi=hi: reader.get_rows(src.name, hi, b, start=lo))
        yield _Step([read], lambda t, first=k == 0, lo=lo: compute(t, first, lo))


def _kept_step(u: Unit, sources: ShardReaders, tallies: Tallies, progress) -> _Step:
    """A quantized source's module written without requantizing (`OutputForm.kept`: ModelOpt's
    FP8_PB_WO, the bytes kept; or dequantized to BF16): its stored tensors read whole and checked
    (NaN bytes, scales not finite and > 0, a wrong scale grid: named), then the writing's tensors."""
    w = u.weights[0]
    path = sources.get(w.shard).path
    src = get_format(u.source_format, source=True)

    def compute(ts: list[torch.Tensor]) -> Outputs:
        stored = u.stored(ts)[0]
        try:
            src.check_stored(stored, w.name, _stored_names(u)[0])
        except FormatError as e:
            raise FormatError(e.message, path=sources.get(_blamed(u, e).shard).path, tensor=e.tensor or w.name) from None
        tallies.count(u.format)
        if progress is not None:
            progress(sum(t.numel() * t.element_size() for t in ts))
        return u.writing.write_kept(u, stored, path)

    return _Step([lambda b, s=s: sources.get(s.shard).get(s.name, b) for s in u.sources], compute)


def _blamed(u: Unit, e: FormatError):
    """The source tensor a format error names (a scale, else the weight)."""
    return next((s for s in u.sources if s.name == e.tensor), u.sources[0])


def _stacked_steps(u: Unit, sources: ShardReaders, device: str, tallies: Tallies,
                   progress, out_dir: Path) -> Iterator[_Step]:
    """A stacked expert tensor ([E, ...]), one expert at a time: read only its slice, quantize it
    as stored (gate/up rows stay as the source holds them: every block scale lies along a row) and
    hand the result to the output form's writer (export: Inkling's stacked form writes the weight
    slice as the next piece and spools the scales until the last expert; ModelOpt's form splits
    the slab into its per-expert modules). Memory: one expert, whatever the expert count."""
    src = u.sources[0]
    path = sources.get(src.shard).path
    writer = u.writing.open(u, out_dir)
    for e in range(src.shape[0]):
        def piece(t: list[torch.Tensor], e=e) -> Outputs:
            return writer.expert(e, _quantize_slab(u, t, e, path, device, tallies, progress), path)
        yield _Step(_slab_reads(u, sources, e), piece)
    for back in writer.after():
        yield _Step([], lambda t, back=back: back())


def _slab_reads(u: Unit, sources: ShardReaders, e: int) -> list[Callable[[TensorBuffer], torch.Tensor]]:
    """Expert e's slice of the stacked tensor (and of its stored companions: the MXFP8 release's
    e8m0 scale, MXFP4's scales)."""
    return [lambda b, s=s: sources.get(s.shard).get_slice(s.name, e, b) for s in u.sources]


def _quantize_slab(u: Unit, t: list[torch.Tensor], e: int, path, device: str, tallies: Tallies,
                   progress) -> dict[str, torch.Tensor]:
    """Expert e's slab of a stacked unit in the unit's format, as `Format.quantize` returns it:
    a float slab quantized as stored; a quantized source's slab (the MXFP8 release, MXFP4) copied
    bit-exact when its format is kept, else requantized (`Format.requantize`: exactly what its
    dequantized weight gives, or the encoder's published cast: transcode.py). A cast's figures
    (transcode.STATS) are tallied per source tensor."""
    src, slab = u.sources[0], t[0]
    nbytes = sum(x.numel() * x.element_size() for x in t)
    if u.storage.transposed:  # an [in, out] slab: quantized as [out, in], blocks along `in`
        slab = slab.t()
    fmt = get_format(u.format, source=True)
    stored = None if u.source_format is None else u.stored([slab, *t[1:]])[0]
    if stored is not None and u.source_format == u.format:
        _check_stored(fmt, stored, path, src.name, e)
        q = stored  # kept: copied bit-exact
    else:
        if u.format == "passthrough":
            _check_finite(slab, path, src.name)
        try:
            if stored is not None:
                a = get_format(u.source_format, source=True).check_stored(
                    stored, src.name, dict(zip(u.stored_suffixes, (x.name for x in u.sources))))
                q = fmt.requantize({k: v.to(device) for k, v in stored.items()},
                                   get_format(u.source_format, source=True), input_amax=u.input_amax[0],
                                   encoder=u.encoder, name=src.name, parts=_gate_up_rows(u, slab))
                tallies.take_stats(src.name, q)
            else:
                x = slab if device == "cpu" else slab.to(device)
                a = fmt.fused_global_amax([x])
                q = fmt.quantize(x, global_amax=a, input_amax=u.input_amax[0], encoder=u.encoder)
        except FormatError as err:
            blamed = err.tensor if err.tensor in {x.name for x in u.sources} else src.name
            where = next((x for x in u.sources if x.name == blamed), src)
            why = err.message.removeprefix(f"tensor {err.tensor!r}: ")   # the format named it: named once here
            raise FormatError(f"tensor {blamed!r}, expert {e}: {why}", path=path.parent / where.shard,
                              tensor=blamed) from None
        q = {k: v.cpu() for k, v in q.items()}
        _check_magnitude(u, fmt, q, None if stored is not None else slab, path, f"tensor {src.name!r}, expert {e}")
        tallies.flush(fmt, a, f"{src.name} expert {e}")
    tallies.count(u.format)
    if progress is not None:
        progress(nbytes)
    return q


def _gate_up_rows(u: Unit, slab: torch.Tensor) -> tuple | None:
    """The gate rows and the up rows of a stacked unit's gate/up slab as stored (row indexers, for
    a cast that takes its shared scale per weight: `Format.requantize`'s `parts`); None for down."""
    if u.projection != "gate_up":
        return None
    rows = torch.arange(slab.shape[0])
    return tuple(u.storage.split_gate_up(rows, slab.shape[0] // 2))


def _per_expert_unit(u: Unit, sources: ShardReaders, device: str, tallies: Tallies, progress) -> _Step:
    """One unit of a per-expert source (an expert's gate and up sharing one global scale, or one
    projection): read, quantize, written under the source's names. A quantized source's weights
    (FP8: weight and scale) are checked, their shared amax taken from the stored bytes (exact), and
    each requantized alone: one expert's projection in fp32 at a time."""
    fmt = FORMATS[u.format]
    paths = [sources.get(s.shard).path for s in u.weights]

    def compute(ts: list[torch.Tensor]) -> Outputs:
        if u.source_format is not None:
            return _requantize_expert(u, fmt, ts, {x.name: sources.get(x.shard).path for x in u.sources}, device,
                                      tallies, progress)
        ws = []
        for src, w, path in zip(u.sources, ts, paths):
            if u.format == "passthrough":  # the quantizers check their own input
                _check_finite(w, path, src.name)
            ws.append(w if device == "cpu" else w.to(device))
        shared = fmt.fused_global_amax(ws) if len(ws) > 1 else None
        outputs = []
        for src, w, path, ia in zip(u.sources, ws, paths, u.input_amax):
            try:
                # gate and up's shared amax, or the weight's own (what quantize would take): either says a flush
                global_amax = shared if shared is not None else fmt.fused_global_amax([w])
                out = fmt.quantize(w, global_amax=global_amax, input_amax=ia, encoder=u.encoder)
            except FormatError as e:
                raise FormatError(f"tensor {src.name!r}: {e.message}", path=path, tensor=src.name) from None
            _refuse_too_small(fmt, {k: t.cpu() for k, t in out.items()}, w.cpu(), path, src.name)
            tallies.flush(fmt, global_amax, src.name)
            # the format's own tensors: what a per-module (ModelOpt) form names; an encoder's extra
            # (the release rule's weight_amax) is for the stacked form, and weight_scale_2 carries it here
            outputs += [(fmt.tensor_name(src.name, suffix), t.cpu() if device != "cpu" else t, True)
                        for suffix, t in out.items() if suffix in fmt.suffixes]
            tallies.count(u.format)
            if progress is not None:
                progress(w.numel() * w.element_size())
        return outputs

    return _Step([lambda b, s=s: sources.get(s.shard).get(s.name, b) for s in u.sources], compute)


def _requantize_expert(u: Unit, fmt, ts: list[torch.Tensor], path_of: dict, device: str,
                       tallies: Tallies, progress) -> Outputs:
    """A per-expert unit of a quantized source (an FP8 expert's gate and up, or its down): each
    weight's stored tensors checked (errors name the weight or its scale and its file), the
    amax gate and up share taken from the bytes (`Format.amax`: exact, no dequantized copy), then
    each weight requantized alone (`Format.requantize`: bit for bit the format of its exact fp32
    dequantization). The checks' amax (one pass over the bytes) is the global amax passed on: the
    weight's own, or gate and up's larger, so no pass is made twice. A source whose blocks lie
    along rows (MXFP4) is requantized as a stacked source's slab is instead (`_requantize_rows`)."""
    src = get_format(u.source_format, source=True)
    stored = [{k: v if device == "cpu" else v.to(device) for k, v in st.items()} for st in u.stored(ts)]
    amax = []
    for w, st, names in zip(u.weights, stored, _stored_names(u)):
        try:
            amax.append(src.check_stored(st, w.name, names))  # exact: what quantize(dequantize(...)) takes anyway
        except FormatError as e:
            raise FormatError(e.message, path=path_of.get(e.tensor, path_of[w.name]), tensor=e.tensor) from None
    if src.row_blocked:
        outputs = _requantize_rows(u, fmt, src, stored, path_of, tallies)
        tallies.flush(fmt, max(amax), u.weights[0].name)
        tallies.count(u.format, len(u.weights))
        if progress is not None:
            progress(sum(t.numel() * t.element_size() for t in ts))
        return outputs
    shared = torch.maximum(*amax) if fmt.fuses_gate_up and len(amax) > 1 else None
    outputs: Outputs = []
    for i, (w, st, ia, a) in enumerate(zip(u.weights, stored, u.input_amax, amax)):
        g = (shared if shared is not None else a) if fmt.fuses_gate_up else None
        try:
            out = fmt.requantize(st, src, global_amax=g, input_amax=ia, encoder=u.encoder, name=w.name)
        except FormatError as e:
            raise FormatError(f"tensor {w.name!r}: {e.message}", path=path_of[w.name], tensor=w.name) from None
        _refuse_too_small(fmt, out, None, path_of[w.name], w.name)  # from stored bytes: only the scales are asked
        tallies.flush(fmt, g if g is not None else a, w.name)
        outputs += [(fmt.tensor_name(u.weight_name(i), k), t.cpu(), True) for k, t in out.items() if k in fmt.suffixes]
        tallies.count(u.format)
    if progress is not None:
        progress(sum(t.numel() * t.element_size() for t in ts))
    return outputs


def _requantize_rows(u: Unit, fmt, src, stored: list[dict], path_of: dict, tallies: Tallies) -> Outputs:
    """A per-expert unit of a row-blocked source (DeepSeek-V4's MXFP4) requantized as a stacked
    source's slab is (gpt-oss): one call, gate and up's rows stacked (`parts`), no global amax
    given, so the target's encoder takes its own rule over the pair (ModelOpt's MXFP4 cast: one
    k_max for w1 and w3, examples/deepseek/cast_mxfp4_to_nvfp4.py `prepass`; the plain path: the
    larger amax). Row tensors are split back per weight, scalars shared; the cast's block counts
    (transcode.STATS) are tallied under the first weight."""
    gate = u.weights[0]
    slab = {k: torch.cat([st[k] for st in stored]) for k in stored[0]}
    rows = [st["weight"].shape[0] for st in stored]
    parts = tuple(torch.arange(sum(rows)).split(rows)) if len(rows) > 1 else None
    try:
        q = fmt.requantize(slab, src, input_amax=u.input_amax[0], encoder=u.encoder, name=gate.name, parts=parts)
    except FormatError as e:
        raise FormatError(f"tensor {gate.name!r}: {e.message}", path=path_of[gate.name], tensor=gate.name) from None
    tallies.take_stats(gate.name, q)
    _refuse_too_small(fmt, q, None, path_of[gate.name], gate.name)
    outputs: Outputs = []
    for i in range(len(u.weights)):
        for k, t in q.items():
            if k in fmt.suffixes:
                part = t.split(rows)[i] if t.dim() >= 2 else t.clone()
                outputs.append((fmt.tensor_name(u.weight_name(i), k), part.cpu().contiguous(), True))
    return outputs


def _stored_names(u: Unit) -> list[dict[str, str]]:
    """Per weight of a quantized source's unit: format suffix -> the checkpoint name of each stored
    tensor (what a format's error names: DeepSeek-V4's `<module>.scale`, not `weight_scale_inv`)."""
    return [{k: x.name for k, x in st.items()} for st in u.stored(list(u.sources))]


def _check_magnitude(u: Unit, fmt, q: dict[str, torch.Tensor], slab: torch.Tensor | None, path, where: str) -> None:
    """A weight too small for its format (`Format.magnitude_problem`) ends the run, naming it:
    a gate/up slab's gate and up each on its own, as verify judges them (unless they share their
    scales). `slab` None: requantized from stored bytes (only the scales are asked)."""
    parts = [(q, slab)]
    if u.projection == "gate_up" and slab is not None and fmt.row_blocked and not fmt.fuses_gate_up:
        width = slab.shape[-2] // 2  # per-row tensors split by rows; scalars are shared
        parts = [({k: v if v.dim() < 2 else u.storage.split_gate_up(v, width)[i] for k, v in q.items()},
                  u.storage.split_gate_up(slab, width)[i]) for i in (0, 1)]
    for i, (tensors, weight) in enumerate(parts):
        _refuse_too_small(fmt, tensors, weight, path, u.sources[0].name,
                          where if len(parts) == 1 else f"{where}: {('gate', 'up')[i]}")


def _refuse_too_small(fmt, q: dict[str, torch.Tensor], weight: torch.Tensor | None, path, name: str,
                      where: str | None = None) -> None:
    """FormatError naming `name` (after `where`, by default the tensor) when `q`, the format's
    encoding of `weight`, would fail verify for its magnitude alone (`Format.magnitude_problem`)."""
    problem = fmt.magnitude_problem(q, weight)
    if problem is not None:
        raise FormatError(f"{where or f'tensor {name!r}'}: {problem}", path=path, tensor=name)


def _check_stored(fmt, stored: dict[str, torch.Tensor], path, name: str, e: int) -> None:
    """A quantized expert copied as it is must still be valid: its dequantization finite (a NaN
    e4m3 byte or an e8m0 255 shows there) — what the quantizers assure of every other path."""
    if not fmt.all_finite(stored):
        raise FormatError(f"tensor {name!r}, expert {e}: holds NaN or Inf (an e4m3 NaN byte or an e8m0 255 "
                          f"scale)", path=path, tensor=name)


def _check_values(t: torch.Tensor, path, name: str, rule: str, start: int) -> None:
    """A copied quantized source's tensor held to its source format's value rule (a scale finite
    and positive with a finite reciprocal, an e8m0 byte not 255): the copy verify would fail ends
    the run, naming the tensor and its first bad element (`start`: the piece's first element)."""
    bad = value_violation(t, rule)
    if bad is not None:
        raise FormatError(f"tensor {name!r}: must be {VALUE_RULES[rule]}, as its source format stores it: element "
                          f"{start + bad[0]} is {bad[1]}", path=path, tensor=name)


def _check_finite(t: torch.Tensor, path, name: str) -> None:
    """NaN/Inf anywhere ends the run. One fused min/max pass: NaN propagates through both and
    an Inf is the min or the max (~7 GB/s on bf16, no temporaries)."""
    if t.numel() == 0 or not t.dtype.is_floating_point:  # a quantized source's codes and e8m0 bytes: no NaN here
        return
    if t.dtype == torch.float8_e4m3fn:  # an FP8 source copied as it is: 0x7F / 0xFF are NaN
        if has_nan_byte(t):
            raise FormatError(f"tensor {name!r}: contains NaN", path=path, tensor=name)
        return
    if t.dtype == torch.float8_e8m0fnu:  # a UE8M0 scale copied as it is (DeepSeek-V4's): 0xFF is NaN
        if bool((t.view(torch.uint8) == 0xFF).any()):
            raise FormatError(f"tensor {name!r}: contains NaN (an e8m0 255)", path=path, tensor=name)
        return
    lo, hi = torch.aminmax(t.reshape(-1))
    if not (bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))):
        raise FormatError(f"tensor {name!r}: contains NaN or Inf", path=path, tensor=name)


def _write_all(writer: ShardWriter, outputs: Outputs) -> float:
    """Hash and write the outputs of a step; returns the seconds it took."""
    t0 = time.perf_counter()
    for name, t, whole in outputs:
        if whole:
            writer.write(name, t)
        else:
            writer.write_part(name, t)
    return time.perf_counter() - t0
