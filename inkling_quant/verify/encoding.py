"""The `encoder` check: an Inkling checkpoint's quantized experts are what their encoder writes.

The release's encoders (`nvfp4_nearest`, `mxfp8_nearest`: formats/nvfp4.py, formats/mxfp8.py)
are fixed points of decoding: decoding a released expert and encoding it again with its stored
amax gives back its codes and block scales. No source is needed to hold a checkpoint to that: for
the sampled experts of every quantized layer stored stacked (Inkling's form), each projection's
slab is decoded and encoded again and every byte must come back. A layer whose quantization
config names ModelOpt's encoder (`--encoder modelopt`) is not held to it: ModelOpt's rules are
not fixed points (its bytes are checked against the source by `numerics`); a layer whose config
names no encoder (another writer's checkpoint) must be a fixed point of the release's rules, the
only documented ones that are, and the check names them as the encoder that wrote it."""
from __future__ import annotations

from typing import Callable

import torch

from ..errors import FormatError
from ..export.inkling import PROJECTIONS, declared_encoder, stored_projection
from ..formats import FORMATS
from ..io.safetensors import ShardReader
from ..model.layout import MoEConfig
from ..model.tensors import TensorName
from .inventory import CHECKED, Inventory
from .numerics import sample_experts
from .report import Check, Recorder

__all__ = ["check_encoder", "encoder_of", "read_stacked_expert"]
_WHAT = {"weight": "stored values", "weight_scale": "block scales"}


def read_stacked_expert(reader_of, inv: Inventory, module: str, names: list[str], e: int) -> dict[str, torch.Tensor]:
    """Expert e's slices ([1, ...]) of a layer's stacked tensors, keyed without the module; a
    per-tensor scalar (the NVFP4 denominator) whole. `reader_of(shard)` gives the shard's reader."""
    out = {}
    for n in names:
        loc = inv.files.tensors[n]
        r = reader_of(loc.shard)
        out[n[len(module) + 1:]] = r.get(n) if not inv.files.headers[loc.shard].tensors[n].shape \
            else r.get_slice(n, e).unsqueeze(0)
    return out


def _declared(inv: Inventory, fmt, module: str) -> str | None:
    """The encoder rule the checkpoint's quantization config names for `module` (export.inkling.declared_encoder)."""
    return declared_encoder(inv.conf.config, inv.conf.hf_quant, module, fmt)


def encoder_of(inv: Inventory) -> Callable[[TensorName | None], str]:
    """t -> whose rules ("release", "modelopt") wrote the routed-expert tensor t, for its value
    rules: what its module's quantization config entry names; where it names none, the release's
    in the stacked form (the `encoder` check holds that form to them), ModelOpt's elsewhere."""
    lay = inv.expected.layout
    modules = lay.experts_modules if lay is not None and lay.experts.stacked else None
    release = {f.encoder_rule("release") for f in FORMATS.values() if f.encoders}
    seen: dict[str, str] = {}

    def key(module: str) -> str:
        named = {_declared(inv, f, module) for f in FORMATS.values() if f.encoders} - {None}
        return ("release" if modules is not None else "modelopt") if not named else \
            "release" if named & release else "modelopt"

    def of(t: TensorName | None) -> str:
        if t is None or not t.is_expert or lay is None:
            return "modelopt"
        module = modules.get(t.layer) if modules is not None else t.module
        if module is None:
            return "modelopt"
        if module not in seen:
            seen[module] = key(module)
        return seen[module]
    return of


def check_encoder(run: Recorder, inv: Inventory, sample: int) -> None:
    lay = inv.expected.layout
    if inv.expected.status != CHECKED or lay is None or not lay.experts.stacked:
        return
    layers = [(layer, module, names) for layer, module in lay.experts_modules.items()
              if (names := inv.expected.module_tensors.get(module))]
    if not layers:
        return
    c = run.new("encoder", "encoder", "sampled quantized experts are a fixed point of the release's encoders "
                "(decoded and encoded again, every byte comes back)")
    readers: dict[str, ShardReader] = {}

    def reader_of(shard: str) -> ShardReader:
        if shard not in readers:
            readers[shard] = ShardReader(inv.root / shard, inv.files.headers[shard])
        return readers[shard]
    try:
        run.guard(c, _check, c, inv, layers, sample, reader_of)
    finally:
        for r in readers.values():
            r.close()


def _check(c: Check, inv: Inventory, layers, sample: int, reader_of) -> None:
    num_experts = MoEConfig.of(inv.conf.cfg).num_experts
    held, modelopt, unreadable = {}, [], []
    for layer, module, names in layers:
        fmt = FORMATS[inv.expected.fmt_of[names[0]]]
        declared = _declared(inv, fmt, module)
        if declared is not None and declared == fmt.encoders.get("modelopt"):
            modelopt.append(layer)
            continue
        rule = fmt.encoder_rule("release")
        for e in sample_experts(layer, num_experts, sample):
            got = read_stacked_expert(reader_of, inv, module, names, e)
            for proj in PROJECTIONS:
                try:
                    misses = fmt.fixed_point_misses(stored_projection(fmt, got, 0, proj), "release")
                except FormatError:  # values that decode to NaN/Inf: the values[F] check names them
                    unreadable.append(f"{module}.{proj}_weight expert {e}")
                    continue
                if misses:
                    tensor = f"{module}.{proj}_weight"
                    what = ", ".join(f"{n} of its {_WHAT[k]}" for k, n in misses.items())
                    c.fail(inv.root / inv.files.tensors[tensor].shard, tensor,
                           f"expert {e}: {what} are not what {rule} writes for the values they decode to"
                           + ("" if declared else " (no documented encoder reproduces these bytes)"))
        held[layer] = rule
    if not held:
        c.skip("every quantized layer's config names ModelOpt's encoder, which is not a fixed point of "
               "decoding (numerics --against checks its bytes against the source)")
    c.figures.update(encoder={str(k): v for k, v in held.items()}, modelopt_layers=modelopt, sample=sample,
                     not_decodable=unreadable)
