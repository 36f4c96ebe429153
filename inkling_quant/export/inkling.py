"""The Inkling output form (`--output-format inkling`): Inkling 2's original names, its routed
experts in the stacked form the original Inkling checkpoints store them in, built from (and
turned back into) the per-expert tensors our formats produce in ModelOpt's per-module form.

Per expert ``e`` the formats give three dicts ``{"gate_proj": {suffix: tensor}, "up_proj": ...,
"down_proj": ...}`` (``weight``, ``weight_scale``[, ``weight_scale_2``, ``input_scale``]). The
stacked form keys every tensor by its name under the layer's ``mlp.experts.`` module (the
caller adds ``model.llm.layers.N.mlp.experts.``). ``E`` experts, ``I`` = moe_intermediate_size,
``H`` = hidden_size:

======================================  =============  ===============  ===========================
name                                    dtype          shape            read by
======================================  =============  ===============  ===========================
NVFP4 ``w13_weight``                    uint8          ``[E, 2I, H/2]``   transformers, vLLM
NVFP4 ``w13_weight_scale``              float8_e4m3fn  ``[E, 2I, H/16]``  transformers, vLLM
NVFP4 ``w13_weight_amax``               float32        ``[E]``            transformers
NVFP4 ``w13_weight_outer_scale_denominator``  float32  ``[]``             transformers
NVFP4 ``w13_weight.input_amax``         float32        ``[E]``            vLLM (transformers ignores)
NVFP4 ``w2_weight``                     uint8          ``[E, H, I/2]``    transformers, vLLM
NVFP4 ``w2_weight_scale``               float8_e4m3fn  ``[E, H, I/16]``   transformers, vLLM
NVFP4 ``w2_weight_amax`` / ``w2_weight_outer_scale_denominator`` / ``w2_weight.input_amax``: as w13
MXFP8 ``w13_weight``                    float8_e4m3fn  ``[E, 2I, H]``     transformers, vLLM
MXFP8 ``w13_weight_scale``              uint8 (e8m0)   ``[E, 2I, H/32]``  transformers, vLLM
MXFP8 ``w2_weight``                     float8_e4m3fn  ``[E, H, I]``      transformers, vLLM
MXFP8 ``w2_weight_scale``               uint8 (e8m0)   ``[E, H, I/32]``   transformers, vLLM
pass-through ``w13_weight``/``w2_weight``  source dtype  ``[E, 2I, H]`` / ``[E, H, I]``  (the BF16 checkpoint)
======================================  =============  ===============  ===========================

Rules (line numbers: transformers 5.25.0 ``TF``, vLLM 0.33.0 ``VL``):

* **Rows.** ``w13`` row ``2j`` is gate row ``j``, row ``2j+1`` up row ``j``; the block scales
  (``w13_weight_scale``) are interleaved the same way (transformers: ``[Inkling2LoopDequantize
  Experts(), Interleave(dim=1)]`` on the four w13 sources, TF/conversion_mapping.py:2748-2768,
  Interleave at TF/core_model_loading.py:232-256; vLLM de-interleaves ``slab[0::2]`` /
  ``slab[1::2]`` for every ``w13*`` key, VL/models/inkling/nvidia/moe.py:599-612). ``w2`` is
  ``down_proj`` as is. Packed NVFP4 bytes keep ModelOpt's nibble order (even element low,
  TF/core_model_loading.py:803); MXFP8 scales are the raw biased e8m0 bytes as uint8
  (transformers applies ``2 ** (scale - 127)``, TF/core_model_loading.py:810, and its ue8m0 FP8
  quantizer reinterprets uint8 ``*scale_inv`` as e8m0, TF/quantizers/quantizer_finegrained_fp8.py:
  142-148; vLLM's MXFP8 scales are uint8, VL/model_executor/layers/quantization/utils/mxfp8_utils.py:9-11).
* **Global scale (NVFP4).** One ``amax`` per expert (gate and up share it: the w13 slab's) and
  one ``outer_scale_denominator`` per tensor (NeMo AutoModel's and Megatron-Bridge's documents of
  the release: "one amax per expert and one denominator per tensor"): transformers multiplies
  each expert by ``amax.float() / denominator.float()`` (TF/core_model_loading.py:804, 814). The
  denominator is ``6 * 448`` (its released value is not public). The release encoder (the form's
  default) stores the amax it encoded with; ModelOpt's (``--encoder modelopt``) gives
  ``weight_scale_2``, stored as the ``amax`` with ``fp32(amax / 2688) == weight_scale_2`` bit for
  bit (every ``weight_scale_2`` ModelOpt or our formats compute is such a quotient; of several,
  the shortest mantissa, i.e. a BF16 weight's true amax). The inverse is transformers' own division.
* **Activation scale (NVFP4 W4A4).** ``input_scale`` becomes ``<w13|w2>_weight.input_amax``
  ``[E]`` with ``fp32(input_amax / 2688) == input_scale``: vLLM takes ``max(input_amax) /
  (448 * 6)`` for any key ending in ``.input_amax`` (VL/models/inkling/nvidia/moe.py:57,
  565-573). transformers has no such source and reports it as an unexpected key (facts §4).
  gate and up must share one input scale (ModelOpt's one input quantizer per projection).
* **MXFP8** has neither (dynamic activations, no global scale).

Readers differ in one place: transformers computes ``(e2m1 * scale) * (amax / den)``, ModelOpt
(and our ``dequantize``) ``e2m1 * (scale * weight_scale_2)``; for codes +-1.5/3/6 the fp32
results can differ by one ulp (tests/test_stacked.py; docs/formats.md "The Inkling stacked
expert form" has the evidence). vLLM 0.33's Inkling loader reads the
global scale only as ``w13_weight_scale_2`` / ``.scale2`` (moe.py:581-595) and would fail on
``w13_weight_amax`` (``getattr(experts, key)``, moe.py:575): no tensor set satisfies both readers.
vLLM's and transformers' reading of the activation amax: transformers 5.25 has no source for
``input_amax`` (it reports it as an unexpected key).

Memory: ``stacked_specs`` gives every stacked tensor's shape and dtype without data;
``expert_slices`` gives one expert's slice of each (index ``e`` of dim 0), and ``write_expert``
copies them into preallocated stacked tensors, so a converter streams one expert at a time.
"""
from __future__ import annotations

import functools
import math
import tempfile
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, MutableMapping, Sequence

import torch

from ..errors import FormatError, UsageError
from ..formats import FORMATS, Format, OutSpec
from ..formats._cpu import fp32_preimage
from ..formats.nvfp4 import GLOBAL_DIV, RELEASE_DENOMINATOR
from ..io.checkpoint import CONFIG_NAME, HF_QUANT_CONFIG
from ..io.safetensors import DTYPE_NAMES, DTYPES
from ..model.inkling2 import release_file
from ..model.layout import Layout
from .form import ExpertWriter, OutputForm, Outputs, Spec, Writing, row_suffixes
from .modelopt import QUANT_METHOD, quantization, recipe_quant_cfg

__all__ = ["declared_encoder", "PROJECTIONS", "OUTER_SCALE_DENOMINATOR", "INKLING", "InklingForm", "InklingStacked", "stacked_specs",
           "projection_specs", "expert_slices", "slab_slices", "stored_projection", "write_expert", "stack_experts",
           "unstack_expert",
           "unstack_experts", "value_rule"]

#: stacked projection -> the per-expert modules it holds, in row-interleave order
PROJECTIONS: dict[str, tuple[str, ...]] = {"w13": ("gate_proj", "up_proj"), "w2": ("down_proj",)}
#: the denominator stored beside NVFP4 amaxes, one per tensor (6 * 448: the release rule's, ours)
OUTER_SCALE_DENOMINATOR = RELEASE_DENOMINATOR
_AMAX, _DEN, _INPUT = "_weight_amax", "_weight_outer_scale_denominator", "_weight.input_amax"
_F32 = torch.float32

PerExpert = Mapping[str, Mapping[str, torch.Tensor]]


def stacked_specs(fmt: Format, num_experts: int, intermediate: int, hidden: int, *,
                  dtype: torch.dtype = torch.bfloat16, activation_scale: bool = True,
                  projections: Sequence[str] = tuple(PROJECTIONS)) -> dict[str, OutSpec]:
    """name -> OutSpec of every stacked tensor of one layer (see the module doc), from the sizes
    alone. ``dtype`` is the source weights' dtype (the pass-through format keeps it);
    ``activation_scale`` adds NVFP4's ``.input_amax`` (W4A4); ``projections`` picks w13, w2."""
    E = num_experts
    out: dict[str, OutSpec] = {}
    for proj, shape in (("w13", (intermediate, hidden)), ("w2", (hidden, intermediate))):
        if proj not in projections:
            continue
        rows = len(PROJECTIONS[proj]) * shape[0]
        for suffix, o in fmt.out_specs(shape, dtype, activation_scale).items():
            if o.shape:
                out[f"{proj}_{suffix}"] = OutSpec((E, rows, *o.shape[1:]), o.dtype)
            elif suffix == fmt.global_scale:
                out[proj + _AMAX] = OutSpec((E,), _F32)
                out[proj + _DEN] = OutSpec((), _F32)  # one per tensor
            elif suffix == "input_scale":
                out[proj + _INPUT] = OutSpec((E,), _F32)
            else:
                raise FormatError(f"{fmt.name}: no stacked form for the per-tensor {suffix!r}")
    return out


def projection_specs(fmt: Format, proj: str, shape: Sequence[int], *, dtype: torch.dtype = torch.bfloat16,
                     activation_scale: bool = True) -> dict[str, OutSpec]:
    """The stacked tensors written for one source tensor ``<proj>_weight`` of ``shape`` (w13:
    [E, 2I, H], w2: [E, H, I]), the stored weight first, then its scales in stacked_specs' order."""
    if proj not in PROJECTIONS or len(shape) != 3 or shape[1] % len(PROJECTIONS[proj]):
        raise FormatError(f"{proj}_weight of shape {list(shape)} is not a stacked expert tensor "
                          f"(w13 [E, 2I, H], w2 [E, H, I])")
    E, rows, cols = shape
    inter, hidden = (rows // 2, cols) if proj == "w13" else (cols, rows)
    return stacked_specs(fmt, E, inter, hidden, dtype=dtype, activation_scale=activation_scale, projections=(proj,))



def value_rule(fmt: Format, suffix: str, encoder: str = "modelopt") -> str | None:
    """The value rule (formats.VALUE_RULES' key) of a stacked tensor ``<proj>_<suffix>`` of
    ``fmt``: a per-row tensor's (weight, block scales) is the format's own; ``weight_amax`` and
    ``weight_outer_scale_denominator`` encode the global scale (amax / denominator) and
    ``weight.input_amax`` the activation scale, so they follow those scales' rule."""
    per = {_AMAX[1:]: fmt.global_scale, _DEN[1:]: fmt.global_scale, _INPUT[1:]: "input_scale"}.get(suffix, suffix)
    return fmt.value_rule(per, encoder) if per is not None else None


def _global_pair(s2: torch.Tensor, amax: torch.Tensor | None, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(amax, denominator) with transformers' ``amax.float() / denominator.float()`` == s2: the
    release encoder's own amax, or for ModelOpt's the amax whose quotient s2 is."""
    den = torch.tensor(OUTER_SCALE_DENOMINATOR, dtype=_F32)
    if amax is not None:
        return amax.reshape(()).to(_F32), den
    a = fp32_preimage(s2, lambda x: x / den, GLOBAL_DIV)
    if a is None:  # not a scale ModelOpt or our formats compute (each is some amax / 2688)
        raise FormatError(f"{name}weight_scale_2 {float(s2):.9g} is no fp32 amax / {OUTER_SCALE_DENOMINATOR:g}: the "
                          f"stacked form's amax and per-tensor denominator cannot hold it")
    return a, den


def _shared(expert: PerExpert, mods: tuple[str, ...], suffix: str, name: str) -> torch.Tensor:
    """The one scalar ``suffix`` the modules of a fused projection share, bit-identical."""
    vals = [torch.as_tensor(expert[m][suffix]).reshape(()).to(_F32) for m in mods]
    if any(not torch.equal(v.view(torch.int32), vals[0].view(torch.int32)) for v in vals[1:]):
        raise FormatError(f"{name}{'/'.join(mods)} have different {suffix} "
                          f"({', '.join(f'{float(v):.9g}' for v in vals)}): the stacked form stores one")
    return vals[0]


def expert_slices(fmt: Format, expert: PerExpert, *, name: str = "") -> dict[str, torch.Tensor]:
    """name -> this expert's slice of each stacked tensor (``stacked[name][e]``) from its
    per-expert dicts; ``name`` (e.g. ``"layers.3 expert 7: "``) prefixes error messages."""
    out: dict[str, torch.Tensor] = {}
    for proj, mods in PROJECTIONS.items():
        first = expert[mods[0]]
        for suffix in row_suffixes(fmt):
            parts = [expert[m][suffix] for m in mods]
            if any(p.shape != parts[0].shape or p.dtype != parts[0].dtype for p in parts):
                raise FormatError(f"{name}{'/'.join(mods)} {suffix}: shapes/dtypes differ "
                                  f"{[(tuple(p.shape), p.dtype) for p in parts]}")
            rows = torch.empty((len(parts) * parts[0].shape[0], *parts[0].shape[1:]), dtype=parts[0].dtype)
            for i, p in enumerate(parts):
                rows[i::len(parts)] = p
            out[f"{proj}_{suffix}"] = rows
        out.update(_scalar_slices(fmt, proj,
                                  _shared(expert, mods, fmt.global_scale, name) if fmt.global_scale else None,
                                  _shared(expert, mods, "weight_amax", name) if "weight_amax" in first else None,
                                  _shared(expert, mods, "input_scale", name) if "input_scale" in first else None,
                                  name))
    return out


def _scalar_slices(fmt: Format, proj: str, scale2: torch.Tensor | None, amax: torch.Tensor | None,
                   input_scale: torch.Tensor | None, name: str) -> dict[str, torch.Tensor]:
    """The scalars of one stacked projection: the global scale as (this expert's amax, the
    tensor's denominator) and the activation scale as its input_amax."""
    out: dict[str, torch.Tensor] = {}
    if scale2 is not None:
        out[proj + _AMAX], out[proj + _DEN] = _global_pair(scale2, amax, name)
    if input_scale is not None:
        a = fp32_preimage(input_scale, lambda x: fmt.activation_scale(float(x), name), GLOBAL_DIV)
        if a is None:
            raise FormatError(f"{name}{proj} input_scale {float(input_scale):.9g} is no fp32 amax / 2688: "
                              f"the stacked form's input_amax cannot hold it")
        out[proj + _INPUT] = a
    return out


def slab_slices(fmt: Format, proj: str, quantized: Mapping[str, torch.Tensor], *,
                name: str = "") -> dict[str, torch.Tensor]:
    """One expert's slices of the stacked `proj` tensors from `fmt.quantize` of its slab as
    stored (w13: gate and up rows already interleaved, quantized under their shared global
    scale). Every block scale lies along a row, so quantizing the interleaved slab gives exactly
    the interleaved rows of quantizing gate and up apart: no de-interleaving copy is needed."""
    out = {f"{proj}_{suffix}": quantized[suffix] for suffix in row_suffixes(fmt)}
    scale2 = quantized[fmt.global_scale].reshape(()).to(_F32) if fmt.global_scale else None
    inp = quantized["input_scale"].reshape(()).to(_F32) if "input_scale" in quantized else None
    out.update(_scalar_slices(fmt, proj, scale2, quantized.get("weight_amax"), inp, name))
    return out


def stored_projection(fmt: Format, stacked: Mapping[str, torch.Tensor], e: int, proj: str) -> dict[str, torch.Tensor]:
    """Expert ``e``'s tensors of the stacked projection ``proj`` as the format names them, the slab
    as stored (w13: gate and up rows interleaved, as it was encoded): the weight, its block scales,
    and for NVFP4 the expert's ``weight_amax`` and the tensor's ``weight_outer_scale_denominator``
    (what `Format.fixed_point_misses` reads). ``stacked`` maps names without the module (as
    stacked_specs) to the tensors or to expert e's slices kept as [1, ...] (e = 0 then); a
    per-tensor scalar is 0-d either way."""
    out = {suffix: stacked[f"{proj}_{suffix}"][e] for suffix in row_suffixes(fmt)}
    if fmt.global_scale is not None:
        out["weight_amax"] = stacked[proj + _AMAX][e]
        out[_DEN[1:]] = stacked[proj + _DEN].reshape(-1)[0 if stacked[proj + _DEN].dim() == 0 else e]
    return out


def write_expert(stacked: MutableMapping[str, torch.Tensor], e: int, slices: Mapping[str, torch.Tensor]) -> None:
    """``stacked[name][e] = slices[name]`` for every stacked tensor (preallocated, e.g. from
    ``stacked_specs``); names, shapes and dtypes must match exactly (no silent cast). A per-tensor
    scalar (the denominator, one constant) is copied whole."""
    if set(stacked) != set(slices):
        raise FormatError(f"stacked tensors {sorted(stacked)} and expert slices {sorted(slices)} differ")
    for k, s in slices.items():
        dst = stacked[k]
        if dst.dim() == 0 and s.dim() == 0 and dst.dtype == s.dtype:
            dst.copy_(s)
            continue
        if tuple(dst.shape[1:]) != tuple(s.shape) or dst.dtype != s.dtype:
            raise FormatError(f"{k}: slice {tuple(s.shape)} {s.dtype} does not fit {tuple(dst.shape)} {dst.dtype}")
        dst[e] = s


def stack_experts(fmt: Format, experts: Sequence[PerExpert], *, name: str = "") -> dict[str, torch.Tensor]:
    """All experts of a layer at once (tests, small layers): ``write_expert`` into tensors shaped
    by the first expert."""
    if not experts:
        raise FormatError(f"{name}no experts to stack")
    first = expert_slices(fmt, experts[0], name=name)
    out = {k: torch.empty((len(experts), *v.shape) if k[-len(_DEN):] != _DEN else (), dtype=v.dtype)
           for k, v in first.items()}
    write_expert(out, 0, first)
    for e in range(1, len(experts)):
        write_expert(out, e, expert_slices(fmt, experts[e], name=f"{name}expert {e}: "))
    return out


def unstack_expert(fmt: Format, stacked: Mapping[str, torch.Tensor], e: int) -> dict[str, dict[str, torch.Tensor]]:
    """The inverse: expert ``e``'s per-expert dicts (ModelOpt's per-module form)."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for proj, mods in PROJECTIONS.items():
        per = {m: {} for m in mods}
        for suffix in row_suffixes(fmt):
            rows = stacked[f"{proj}_{suffix}"][e]
            for i, m in enumerate(mods):
                per[m][suffix] = rows[i::len(mods)].contiguous()
        if fmt.global_scale is not None:
            den = stacked[proj + _DEN]
            s2 = stacked[proj + _AMAX][e].to(_F32) / (den if den.dim() == 0 else den[e]).to(_F32)  # transformers' division
            for m in mods:
                per[m][fmt.global_scale] = s2.clone()
        if proj + _INPUT in stacked:
            s = fmt.activation_scale(float(stacked[proj + _INPUT][e]), f"{proj}{_INPUT}[{e}]")
            for m in mods:
                per[m]["input_scale"] = s.clone()
        out.update(per)
    return out


def unstack_experts(fmt: Format, stacked: Mapping[str, torch.Tensor]) -> list[dict[str, dict[str, torch.Tensor]]]:
    n = next(iter(stacked.values())).shape[0]
    return [unstack_expert(fmt, stacked, e) for e in range(n)]


# ============================================================================ the output form
#: what convert leaves unquantized (exclude_modules), under Inkling 2's original names: everything but the routed experts
EXCLUDE_MODULES_ORIGINAL = ["model.llm.unembed", "model.llm.embed", "model.llm.layers.*.attn*",
                            "model.llm.layers.*.mlp.gate", "model.visual*", "mtp*"]



def declared_encoder(config: dict | None, hf_quant: dict | None, module: str, fmt: Format) -> str | None:
    """The encoder rule a checkpoint's quantization config declares for the experts `module`
    (`nvfp4_nearest`, "modelopt", or whatever another writer put there): its quantized_layers
    entry's in hf_quant_config.json or config.json (in the one-format form the entry's keys stand
    at the top), else inkling-quant's converter record (a layer it names under `layers`, else its
    run's `encoder`; ModelOpt's rule adds nothing to an entry); None when none names one (another
    writer's checkpoint, which the release's rules are the only documented fixed points for)."""
    for q in (hf_quant.get("quantization") if isinstance(hf_quant, dict) else None,
              (config or {}).get("quantization_config")):
        if not isinstance(q, dict):
            continue
        layers = q.get("quantized_layers")
        entry = layers.get(module) if isinstance(layers, dict) else q  # one format: its entry at the top
        if isinstance(entry, dict) and entry.get("encoder") is not None:
            return str(entry["encoder"])
    conv = hf_quant.get("converter") if isinstance(hf_quant, dict) else None
    if not isinstance(conv, dict):
        return None
    per = conv.get("layers")
    name = per.get(module) if isinstance(per, dict) and per.get(module) is not None else conv.get("encoder")
    return fmt.encoders.get(name) if isinstance(name, str) else None


def config_with_quantization(config: dict, q: dict) -> dict:
    """config.json with `quantization_config` as vLLM's ModelOpt loader reads it."""
    return {**config, "quantization_config": {"quant_method": QUANT_METHOD, **q}}


def hf_quant_config(q: dict, converter: dict) -> dict:
    """hf_quant_config.json: who produced it (inkling-quant and its version), the config, and how
    (the scheme, the encoder)."""
    return {"producer": {"name": converter["name"], "version": converter["version"]}, "quantization": q,
            "converter": converter}



SPOOL = 4 << 20   # a stacked tensor's scales beyond this go to an unnamed file while its weight is written


@dataclass(frozen=True)
class InklingStacked(Writing):
    """One stacked expert tensor `<prefix><proj>_weight` in the stacked form: its weight, then its
    scales (stacked_specs' order), all under the layer's experts module."""

    prefix: str   # the experts module and a dot
    proj: str     # "w13" or "w2"

    def specs(self, u) -> list[Spec]:
        src = u.sources[0]
        specs = projection_specs(FORMATS[u.format], self.proj, src.shape, dtype=DTYPES[src.dtype],
                                 activation_scale=u.activation_scale)
        return [(self.prefix + k, DTYPE_NAMES[o.dtype], tuple(o.shape)) for k, o in specs.items()]

    def quantized_module(self, u, layout: Layout) -> str | None:
        return self.prefix[:-1]

    def open(self, u, out_dir) -> "_Spooled":
        return _Spooled(self, u, out_dir)


class _Spooled(ExpertWriter):
    """Each expert's weight slice written as the next piece of the stacked weight; its scale slices
    appended to spools (in memory up to SPOOL, then an unnamed file in the output directory) and
    written after the last expert, SPOOL by SPOOL: the scales follow the weight in the file, and
    memory stays one expert, whatever the expert count."""

    def __init__(self, w: InklingStacked, u, out_dir):
        src = u.sources[0]
        self.w, self.fmt, self.name = w, FORMATS[u.format], src.name
        self.weight = f"{w.proj}_weight"
        self.specs = projection_specs(self.fmt, w.proj, src.shape, dtype=DTYPES[src.dtype],
                                      activation_scale=u.activation_scale)
        self.spools = {k: tempfile.SpooledTemporaryFile(SPOOL, dir=out_dir) for k, o in self.specs.items()
                       if k != self.weight and o.shape}
        self.whole: dict[str, torch.Tensor] = {}  # per-tensor scalars (the denominator): one value, checked per expert

    def expert(self, e: int, q: dict[str, torch.Tensor], path) -> Outputs:
        try:
            slices = slab_slices(self.fmt, self.w.proj, q, name=f"expert {e}: ")
        except FormatError as err:
            raise FormatError(f"tensor {self.name!r}, expert {e}: {err.message}", path=path, tensor=self.name) from None
        for k, spool in self.spools.items():
            spool.write(slices[k].contiguous().reshape(-1).view(torch.uint8).numpy())
        for k in self.specs.keys() - self.spools.keys() - {self.weight}:
            if self.whole.setdefault(k, slices[k]) is not slices[k] and not torch.equal(self.whole[k], slices[k]):
                raise FormatError(f"tensor {self.name!r}, expert {e}: {k} {float(slices[k]):g} differs from the "
                                  f"tensor's one value {float(self.whole[k]):g}", path=path, tensor=self.name)
        return [(self.w.prefix + self.weight, slices[self.weight], False)]

    def after(self) -> Iterator[Callable[[], Outputs]]:
        for k, o in self.specs.items():  # in the specs' order, which the shard's header has
            if k in self.whole:
                yield lambda k=k: [(self.w.prefix + k, self.whole[k].clone(), True)]
            if k not in self.spools:
                continue
            spool = self.spools[k]
            per = math.prod(o.shape[1:]) * o.dtype.itemsize  # one expert's slice
            n = max(1, SPOOL // max(per, 1))  # experts per piece read back: memory stays at SPOOL
            for a in range(0, o.shape[0], n):
                yield lambda k=k, spool=spool, a=a, b=min(o.shape[0], a + n), o=o, per=per: self._back(k, spool, a, b, o, per)

    def _back(self, k: str, spool, a: int, b: int, o: OutSpec, per: int) -> Outputs:
        spool.seek(a * per)
        data = bytearray(spool.read((b - a) * per))
        if b == o.shape[0]:
            spool.close()
        return [(self.w.prefix + k, torch.frombuffer(data, dtype=o.dtype).reshape(b - a, *o.shape[1:]), False)]


class InklingForm(OutputForm):
    name = "inkling"
    encoder = "release"  # the release's own encoders (nvfp4_nearest, mxfp8_nearest): its bytes

    def check_source(self, cfg, layout: Layout) -> None:
        if layout.original_names:
            return
        if layout.naming is not None:
            # The original names would need lm_head's vocabulary padding rows, which transformers' model
            # drops (Inkling2UnpadVocab): there is nothing to write them from.
            raise UsageError("--output-format inkling writes the original names (model.llm.*); this source is under "
                             "transformers' names (model.language_model.*, lm_head.weight without the vocabulary "
                             "padding rows the original unembed holds): it is written as ModelOpt exports it "
                             "(--output-format modelopt-hf)")
        raise UsageError(f"--output-format inkling is the Inkling 2 layout's stacked form; a {cfg.model_type} "
                         f"checkpoint is written as ModelOpt exports it (--output-format modelopt-hf)")

    def file_of(self, cfg, layout: Layout) -> Callable[[str], str | int]:
        """The release's files (docs/layout.md "Files"): one shard per decoder layer, the vision
        tower and the draft (`mtp.safetensors`) in files of their own."""
        return functools.partial(release_file, cfg.text)

    def stacked(self, cfg, layout: Layout, name: str, projection: str, fmt: str) -> Writing:
        proj = "w2" if projection == "down" else "w13"
        return InklingStacked(name[: -len(f"{proj}_weight")], proj)

    def config_files(self, cfg, layers: dict, weight_only: bool, converter: dict,
                     unquantized: list[str]) -> dict[str, dict]:
        """config.json's `quantization_config` and hf_quant_config.json's `quantization` alike:
        ModelOpt's MIXED_PRECISION keyed by the original experts modules, each entry naming its
        encoder, with the recipe as the first Inkling generation's loaders read it
        (`modelopt_quant_config`: recipe_quant_cfg); hf_quant_config.json adds a `converter`
        entry naming who wrote it. MIXED_PRECISION even for one format: why, docs/formats.md."""
        q = quantization(layers.items(), weight_only, EXCLUDE_MODULES_ORIGINAL, converter.get("encoder", self.encoder),
                         converter.get("layers", {}))
        if not q["quantized_layers"]:
            return {}
        q["modelopt_quant_config"] = {"quant_cfg": recipe_quant_cfg(q["quantized_layers"])}
        return {CONFIG_NAME: config_with_quantization(cfg.raw, q), HF_QUANT_CONFIG: hf_quant_config(q, converter)}

    def expert_specs(self, layout: Layout, weight: str, shape, dtype, fmt, activation_scale: bool) -> dict:
        if fmt is FORMATS["passthrough"] or not layout.experts.stacked:
            return fmt.out_tensors(weight, shape, dtype, activation_scale)
        module, key = weight.rsplit(".", 1)
        return {f"{module}.{k}": o for k, o in projection_specs(
            fmt, key.removesuffix("_weight"), shape, dtype=dtype, activation_scale=activation_scale).items()}


INKLING = InklingForm()

