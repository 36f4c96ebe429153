"""Checks against the BF16 source (--against): `passthrough` (a stream visitor: pass-through
tensors byte-identical to the source) and what `numerics[layer L]` (published.check_numerics for
the Inkling 2 layout, hf.check_numerics for other families) computes with: the deterministic
sample and activations, `Gemm` (one module's y = x @ W^T through the dequant-GEMM kernels against
the BF16 weights), and `judge` (one module's errors against its format's thresholds, recorded)."""
from __future__ import annotations

import math
import os
import random
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import CheckpointError, KernelError
from ..formats import FORMATS, Format
from ..io.checkpoint import safe_child
from ..io.safetensors import DTYPE_NAMES, Header, ShardReader, TensorBuffer
from .inventory import SKIPPED, Inventory, Located, listing
from .report import Check, Recorder
from .stream import Seen

ACT_ROWS = 32              # rows of the deterministic activations for the numerics check
_SCALE_ABOVE = 2.0 ** 64   # a weight past this is judged on activations scaled down by a power of two
PASSTHROUGH = FORMATS["passthrough"]


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


# ============================================================================ passthrough
class Passthrough:
    """The `passthrough` check, as a stream visitor: each pass-through tensor's bytes against the
    source's, read with pread beside the stream (the source is not streamed)."""

    def __init__(self, run: Recorder, inv: Inventory):
        self.inv = inv
        self.check = run.new("passthrough", "numerics", "pass-through tensors, and quantized ones kept from a quantized "
                             "source, are byte-identical to the source")
        self.check.figures.update(tensors_compared=0, bytes_compared=0)
        self.fds: dict[str, int] = {}
        self.readers: dict[str, ShardReader] = {}
        self.buf = TensorBuffer()

    @classmethod
    def start(cls, run: Recorder, inv: Inventory) -> "Passthrough | None":
        """The visitor, when there is a source that passed its check and a shard to read."""
        ok = inv.source is not None and inv.source.ok and inv.files.readable_shards
        return cls(run, inv) if ok else None

    def visit(self, seen: Seen):
        if seen.fmt != "passthrough":
            return self._kept(seen)
        if seen.name in self.inv.expected.dequantized:  # a quantized source's module written BF16
            return dequantized_sink(self, seen)
        renamed = self.inv.expected.source_of.get(seen.name)  # ModelOpt's form: transformers' names
        src = self.inv.source.tensors.get(renamed or seen.name)
        e = seen.entry
        if src is None:
            self.check.fail(seen.path, seen.name, "pass-through tensor has no counterpart in the source" +
                            (f" ({renamed})" if renamed else ""))
            return None
        got, has = tuple(e.shape), tuple(src.entry.shape)
        prefix = renamed is not None and got[1:] == has[1:] and got and 0 < got[0] <= has[0]  # lm_head: the first rows
        # a kept scale viewed with unit dims (ModelOpt's FP8_PB_WO [gm, 1, gn, 1] of the source's [gm, gn])
        viewed = renamed is not None and [d for d in got if d != 1] == [d for d in has if d != 1] \
            and math.prod(got) == math.prod(has)
        widened = (got == has or viewed) and PASSTHROUGH.widens(src.entry.dtype, e.dtype)
        if not widened and (src.entry.dtype != e.dtype or not (got == has or prefix or viewed)):
            self.check.fail(seen.path, seen.name, f"is {DTYPE_NAMES[e.dtype]} {list(e.shape)}, the source"
                            f"{f' ({renamed})' if renamed else ''} has "
                            f"{DTYPE_NAMES[src.entry.dtype]} {list(src.entry.shape)}")
            return None
        if widened:  # another writer's lossless widening: every value must be equal
            self.check.figures.setdefault("widened", []).append(
                f"{seen.name}: {DTYPE_NAMES[src.entry.dtype]} -> {DTYPE_NAMES[e.dtype]}")
        return _SameBytes(self, seen, src)

    def reader(self, name: str) -> ShardReader:
        """A reader of the source shard holding `name` (kept open for the read)."""
        shard = self.inv.source.tensors[name].shard
        r = self.readers.get(shard)
        if r is None:
            r = self.readers[shard] = ShardReader(safe_child(self.inv.source.root, shard, "shard"))
        return r

    def _kept(self, seen: Seen) -> "_SameBytes | None":
        """A quantized tensor the source holds as it is (same name, dtype and shape, a quantized
        dtype: the MXFP8 release's experts kept MXFP8) must be its bytes, not a re-encoding. A source
        stored in a source-only format (FP8 block, MXFP4) keeps nothing here: its e4m3 bytes under
        another format's name are requantized (its kept modules are verify/sources.py's); unless the
        checkpoint is itself stored so (a copy: `Expected.stored_as`), when each of its tensors in
        that format is the source's tensor of the same name, dtype and shape, byte for byte."""
        if self.inv.expected.stored_as is not None and seen.fmt == self.inv.expected.stored_as:
            return self._copied(seen)
        quant = self.inv.source.layout.source if self.inv.source.layout is not None else None
        if quant is not None:
            return None
        src = self.inv.source.tensors.get(seen.name)
        if src is None or src.entry.dtype != seen.entry.dtype or tuple(src.entry.shape) != tuple(seen.entry.shape) \
                or src.entry.dtype.is_floating_point and src.entry.dtype.itemsize > 1:
            return None
        self.check.figures["kept_quantized"] = self.check.figures.get("kept_quantized", 0) + 1
        return _SameBytes(self, seen, src)

    def _copied(self, seen: Seen) -> "_SameBytes | None":
        """A tensor of a copy in the source's format: the source's of that name, dtype and shape."""
        src = self.inv.source.tensors.get(seen.name)
        if src is None or src.entry.dtype != seen.entry.dtype or tuple(src.entry.shape) != tuple(seen.entry.shape):
            has = "no such tensor" if src is None else f"{DTYPE_NAMES[src.entry.dtype]} {list(src.entry.shape)}"
            self.check.fail(seen.path, seen.name, f"is {DTYPE_NAMES[seen.entry.dtype]} {list(seen.entry.shape)}, the "
                            f"source has {has}: a {seen.fmt} tensor copied from the source must be its bytes")
            return None
        self.check.figures["kept_quantized"] = self.check.figures.get("kept_quantized", 0) + 1
        return _SameBytes(self, seen, src)

    def fd(self, shard: str) -> int:
        fd = self.fds.get(shard)
        if fd is None:
            fd = self.fds[shard] = os.open(safe_child(self.inv.source.root, shard, "shard"), os.O_RDONLY)
        return fd

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()
        for r in self.readers.values():
            r.close()
        self.readers.clear()


class _SameBytes:
    """One pass-through tensor compared piece by piece until the first differing byte."""

    def __init__(self, pt: Passthrough, seen: Seen, src: Located):
        self.pt, self.seen, self.src, self.same = pt, seen, src, True

    def feed(self, piece: memoryview, offset: int) -> None:
        if not self.same:
            return
        src, src_root = self.src, self.pt.inv.source.root
        ratio = self.seen.entry.dtype.itemsize // src.entry.dtype.itemsize  # 2: a widened tensor's, else 1
        size, at = len(piece) // ratio, offset // ratio
        fd = self.pt.fd(src.shard)
        mv = self.pt.buf.view(size)
        got = 0
        while got < size:
            n = os.preadv(fd, [mv[got:]], src.entry.begin + at + got)
            if n == 0:
                raise CheckpointError(f"tensor {self.seen.name!r}: source file ended early", path=src_root / src.shard,
                                      tensor=self.seen.name)
            got += n
        if ratio == 1:
            a, b = torch.frombuffer(piece, dtype=torch.uint8), torch.frombuffer(mv, dtype=torch.uint8)
        else:  # the widened values' bits against the source's, widened exactly
            a = torch.frombuffer(piece, dtype=torch.int32)
            b = torch.frombuffer(mv, dtype=src.entry.dtype).to(self.seen.entry.dtype).view(torch.int32)
        if torch.equal(a, b):
            return
        first = int((a != b).nonzero()[0, 0])
        where = f"byte {first + offset}" if ratio == 1 else f"element {first + offset // a.element_size()}"
        what = "pass-through" if self.seen.fmt == "passthrough" else f"a {self.seen.fmt} tensor kept from the source"
        self.pt.check.fail(self.seen.path, self.seen.name, f"differs from the source ({src_root / src.shard}) at "
                           f"{where} of the tensor: {what} must be bit-exact"
                           + (" (or its exact widening)" if ratio > 1 else ""))
        self.same = False

    def done(self) -> None:
        self.pt.check.figures["tensors_compared"] += 1
        self.pt.check.figures["bytes_compared"] += self.seen.entry.nbytes


def dequantized_sink(pt: Passthrough, seen: Seen) -> "_SameDequantized | None":
    """The comparison of a BF16 weight convert dequantized from a quantized source's module
    (--dequantize-fp8) with the source's stored tensors dequantized exactly and rounded once."""
    from .sources import stored_of
    names = stored_of(pt.inv.source, seen.name)
    if names is None or tuple(seen.entry.shape) != tuple(pt.inv.source.tensors[names["weight"]].entry.shape) \
            or seen.entry.dtype != torch.bfloat16:
        pt.check.fail(seen.path, seen.name, f"is {DTYPE_NAMES[seen.entry.dtype]} {list(seen.entry.shape)}: not the "
                      f"BF16 dequantization of the source's quantized weight of that name")
        return None
    return _SameDequantized(pt, seen, names)


class _SameDequantized:
    """A dequantized weight, compared at `done` with bf16(exact fp32 dequantization) of the source."""

    def __init__(self, pt: Passthrough, seen: Seen, names: dict[str, str]):
        self.pt, self.seen, self.names = pt, seen, names
        self.got = bytearray(seen.entry.nbytes)

    def feed(self, piece: memoryview, offset: int) -> None:
        self.got[offset:offset + len(piece)] = piece

    def done(self) -> None:
        from .sources import read_weight
        src = self.pt.inv.source
        want = read_weight(src, self.seen.name, lambda n: self.pt.reader(n).get(n)).to(torch.bfloat16)
        got = torch.frombuffer(self.got, dtype=torch.bfloat16).reshape(want.shape)
        self.pt.check.figures["tensors_compared"] += 1
        self.pt.check.figures["bytes_compared"] += self.seen.entry.nbytes
        if not torch.equal(got.view(torch.int16), want.view(torch.int16)):
            first = int((got.view(torch.int16) != want.view(torch.int16)).reshape(-1).nonzero()[0, 0])
            self.pt.check.fail(self.seen.path, self.seen.name, f"differs at element {first} from the BF16 rounding of "
                               f"the source's exactly dequantized weight ({', '.join(self.names.values())})")


# ============================================================================ numerics[layer L]
@contextmanager
def kernel_errors():
    """The kernels' own KernelError (a ValueError) raised as ours, errors.KernelError: a check
    reports it, and the command line prints it, as a message, never a traceback."""
    import inkling_kernels as kernels

    try:
        yield
    except kernels.KernelError as e:
        raise KernelError(str(e)) from e


def start(run: Recorder, inv: Inventory, device: str) -> "Gemm | None":
    """What the numerics checks compute with, or None when they cannot run (no source: no
    check; a failed source check or no usable config: a skipped `numerics` check)."""
    if inv.source is None:
        return None
    if not inv.source.ok:
        run.new("numerics", "numerics", "sampled experts against the source").skip("the source check failed")
        return None
    if not inv.conf.usable or inv.expected.status == SKIPPED:
        run.new("numerics", "numerics", "sampled experts against the source").skip("no usable config")
        return None
    if inv.expected.stored_as is not None:
        run.new("numerics", "numerics", "sampled experts against the source").skip(
            f"the checkpoint is stored as the source stores it ({inv.expected.stored_as}): nothing quantized by "
            f"convert to compare; `passthrough` holds every tensor to the source's bytes")
        return None
    import inkling_kernels as kernels

    dev = torch.device(device)
    # cpu: the torch reference. cuda: the Triton kernel, weight-only (dequantize in registers,
    # bf16 MMA); the sm100 path also quantizes the activations (W4A4/W8A8), an error the
    # thresholds (weights vs their BF16 source) do not budget for.
    with kernel_errors():
        path = kernels.PATH_REFERENCE if dev.type == "cpu" else kernels.select_path(dev)
    if path == kernels.PATH_SM100:
        path = kernels.PATH_BF16_MMA
    run.report.kernel_path = path
    return Gemm(inv, dev, path)


@dataclass
class Gemm:
    """y = x @ W^T of one module from its quantized tensors (the kernels) and from the source, and
    the shard readers the numerics checks share."""

    inv: Inventory
    dev: torch.device
    path: str

    def __post_init__(self) -> None:
        self.readers: dict[tuple[str, str], ShardReader] = {}

    def errors(self, module: str, w: torch.Tensor, q: dict[str, torch.Tensor], fmt: Format) -> tuple[float, float]:
        """(relative error, cosine) of y = x @ W^T from the quantized tensors `q` (by suffix)
        against the source weight `w`, x the module's deterministic activations."""
        x = activations(module, ACT_ROWS, w.shape[-1])
        top = float(w.abs().amax()) if w.numel() else 0.0
        if top > _SCALE_ABOVE:  # products near fp32's top would overflow: a power of two scales both sides exactly
            x = x * 2.0 ** -(math.frexp(top)[1] - math.frexp(_SCALE_ABOVE)[1])
        ref = x.float() @ w.float().T
        y = self._quantized(x, q, fmt).float().cpu().double()
        r64 = ref.double()
        num, den = float(torch.linalg.vector_norm(y - r64)), float(torch.linalg.vector_norm(r64))
        rel = num / den if den > 0 else (0.0 if num == 0 else math.inf)
        ny = float(torch.linalg.vector_norm(y))
        cos = float((y * r64).sum()) / (ny * den) if ny > 0 and den > 0 else (1.0 if num == 0 else 0.0)
        if not math.isfinite(rel):
            rel = math.inf
        if not math.isfinite(cos):
            cos = -1.0
        return rel, cos

    def _quantized(self, x: torch.Tensor, q: dict[str, torch.Tensor], fmt: Format) -> torch.Tensor:
        import inkling_kernels as kernels

        if fmt.kernel is not None:  # the kernel the format names, on the tensors it names
            gemm = getattr(kernels, fmt.kernel)
            with kernel_errors():
                return gemm(x.to(self.dev), *(q[s].to(self.dev) for s in fmt.kernel_inputs),
                            out_dtype=torch.float32, path=self.path)
        # a format without a kernel: its own dequantize (formats/) and a plain matmul
        return x.float() @ fmt.dequantize(q, torch.float32).T

    def reader(self, root: Path, headers: dict[str, Header], shard: str) -> ShardReader:
        """The open reader of one shard (of the checkpoint or the source), kept for the run."""
        key = (str(root), shard)
        r = self.readers.get(key)
        if r is None:
            r = self.readers[key] = ShardReader(root / shard, headers[shard])
        return r

    def close(self) -> None:
        for r in self.readers.values():
            r.close()


def judge(run: Recorder, c: Check, inv: Inventory, fmt: Format, where: tuple[int, int, str], tensor: str,
          errors: tuple[float, float], blame: str, head: str, tail: str, flushed: bool | None = None) -> None:
    """One module's (relative error, cosine) against `fmt`'s thresholds: a numerics entry for
    `tensor` (expert `where` = (layer, expert, module)), and on failure a problem naming `blame`:
    "<head>: relative error ... cosine ...: <tail>". A source weight below the format's smallest
    amax (`Format.flushes`) is held instead to the encoding convert writes for it, the all-zero
    weight: `flushed` says whether its tensors decode to zero (None: not such a weight)."""
    (layer, e, mod), (rel, cos) = where, errors
    ok = rel <= fmt.max_rel_error and cos >= fmt.min_cosine if flushed is None else flushed
    entry = {"tensor": tensor, "expert": e, "module": mod, "format": fmt.name, "layer": layer, "rel_error": rel,
             "cosine": cos, "max_rel_error": fmt.max_rel_error, "min_cosine": fmt.min_cosine, "pass": ok,
             "shard": inv.files.tensors[tensor].shard}
    run.report.numerics.append(entry | ({} if flushed is None else {"written_as_zero": True}))
    if ok:
        return
    if flushed is None:
        c.fail(inv.root / inv.files.tensors[blame].shard, blame,
               f"{head}: relative error {rel:.4g} (max {fmt.max_rel_error:g}), cosine {cos:.6f} "
               f"(min {fmt.min_cosine:g}): {tail}")
    else:
        c.fail(inv.root / inv.files.tensors[blame].shard, blame,
               f"{head}: the source weight is below {fmt.name}'s smallest amax, which convert writes as the "
               f"all-zero weight, but its tensors decode to nonzero values: {tail}")


def moe_figures(c: Check, gemm: "Gemm", fmt: Format, module: str, source: list[dict[str, torch.Tensor]],
                quantized: list[dict[str, dict[str, torch.Tensor]]], activation: str) -> None:
    """The sampled experts as one MoE layer, through the fused MoE entry point (kernels.fused_moe:
    tokens sorted by expert, gate_up then the gated activation then down, one launch each; on a
    GPU the Triton kernels, on the CPU the torch reference) against the same layer computed from
    the BF16 source experts: ACT_ROWS tokens, each routed to up to 8 of them with equal weights.
    `source`: per expert {"gate", "up", "down"} weights; `quantized`: per expert the gate, up and
    down modules' tensors (in that order). The error compounds gate/up's and down's through the
    activation: a figure, a failure only past twice the format's per-GEMM bound (a broken kernel
    or layout, not the format's own error)."""
    import inkling_kernels as kernels

    S, H = len(source), source[0]["gate"].shape[-1]
    top_k = min(S, 8)
    ids = (torch.arange(ACT_ROWS)[:, None] + torch.arange(top_k)[None, :]) % S
    weights = torch.full((ACT_ROWS, top_k), 1.0 / top_k)
    x = activations(f"{module}.moe", ACT_ROWS, H)
    with kernel_errors():
        ref = kernels.reference.fused_moe(
            kernels.reference.UNQUANTIZED, x, ids, weights,
            {"weight": torch.stack([torch.cat((w["gate"], w["up"])) for w in source])},
            {"weight": torch.stack([w["down"] for w in source])}, activation=activation).double()
    if not bool(torch.isfinite(ref).all()):  # the source's own layer overflows on unit activations: nothing to judge
        c.figures.update(moe_rel_error=None, moe_note="the BF16 source's own MoE output overflows fp32 on these "
                         "activations: the per-GEMM figures judge its experts")
        return
    gate_up, down = ({k: torch.stack([_fused(q, mods, k) for q in quantized]).to(gemm.dev) for k in fmt.kernel_inputs}
                     for mods in ((0, 1), (2,)))
    with kernel_errors():
        y = kernels.fused_moe(fmt.name, x.to(gemm.dev), ids.to(gemm.dev), weights.to(gemm.dev), gate_up, down,
                              activation=activation, path=gemm.path).double().cpu()
    num, den = float(torch.linalg.vector_norm(y - ref)), float(torch.linalg.vector_norm(ref))
    rel = num / den if den > 0 else (0.0 if num == 0 else math.inf)
    c.figures.update(moe_rel_error=round(rel, 6), moe_experts=S, moe_top_k=top_k, moe_path=gemm.path)
    if not rel <= 2 * fmt.max_rel_error:
        c.fail(listing(gemm.inv.root), f"{module}", f"the sampled experts as one MoE layer (fused MoE, {gemm.path}) "
               f"have relative error {rel:.4g} against the BF16 source's (max {2 * fmt.max_rel_error:g})")


def _fused(q: dict[str, dict[str, torch.Tensor]], mods: tuple[int, ...], suffix: str) -> torch.Tensor:
    """One expert's `suffix` tensor of gate and up stacked (gate rows first, as the fused MoE
    reads gate_up), or down's; a per-tensor scalar (the global scale) is gate's, which up shares."""
    ts = [list(q.values())[i][suffix] for i in mods]
    return torch.cat(ts) if ts[0].dim() else ts[0].reshape(())


def layer_figures(c: Check, entries: list[dict], experts: list[int]) -> None:
    """A numerics[layer L] check's figures from the entries `judge` recorded for it."""
    c.figures.update(tensors=len(entries), worst_rel_error=max((n["rel_error"] for n in entries), default=0.0),
                     worst_cosine=min((n["cosine"] for n in entries), default=1.0), experts=experts)


def module_tensors(inv: Inventory, gemm: "Gemm", names: list[str], prefix: str) -> dict[str, dict[str, torch.Tensor]]:
    """The per-expert modules under `prefix` (`<experts module>.<e>.`) as ModelOpt's export
    stores them: module -> suffix -> tensor."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for n in names:
        if n.startswith(prefix):
            mod, suffix = n[len(prefix):].split(".", 1)
            where = inv.files.tensors[n]
            out.setdefault(mod, {})[suffix] = gemm.reader(inv.root, inv.files.headers, where.shard).get(n)
    return out


def stored_ok(c: Check, inv: Inventory, names: list[str]) -> bool:
    """Whether a layer's quantized tensors are all present with the dtype and shape the layout
    expects, so the numerics can run on them (else the reason, in `c`)."""
    files, expected = inv.files, inv.expected
    miss = [n for n in names if n not in files.tensors or files.tensors[n].shard not in files.headers]
    if miss:
        c.fail(listing(inv.root), miss[0], "cannot run the numerics check: tensor missing")
        return False
    wrong = [n for n in names if (tuple(files.tensors[n].entry.shape), files.tensors[n].entry.dtype)
             != expected.tensors[n]]
    if wrong:
        c.fail(inv.root / files.tensors[wrong[0]].shard, wrong[0],
               "cannot run the numerics check: wrong dtype or shape (see the layout check)")
        return False
    return True
