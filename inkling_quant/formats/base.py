"""The contract every number format implements. A format owns its bits: quantize, dequantize,
pack, the checkpoint tensors it produces (names, dtypes, shapes), its ModelOpt config entry and
the error thresholds `verify` holds it to. Nothing outside formats/ re-derives any of these."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np
import torch

from ..errors import FormatError
from ._cpu import _check_shape

# The smallest fp32 scale a serving engine can divide by: 1/x rounds to the largest finite fp32
# below 2**128 * (1 - 2**-25); any smaller positive x (a deep subnormal) has an infinite reciprocal.
MIN_INVERTIBLE_SCALE = float(np.nextafter(np.float32(1 / 3.4028235677973366e38), np.float32(1)))


def invertible(x: float) -> bool:
    """A scale that is finite, > 0 and has a finite fp32 reciprocal (engines compute 1/scale)."""
    return MIN_INVERTIBLE_SCALE <= x < float("inf")


_ERROR_CHUNK = 1 << 20  # elements per float64 piece of weight_error: its memory stays small


def weight_error(weight: torch.Tensor, approx: torch.Tensor) -> tuple[float, float]:
    """(relative error, cosine) of `approx` against `weight`: ||approx - weight|| / ||weight|| and
    their cosine, the quantities verify's numerics estimate through Gaussian activations (the
    expectation of its squared error ratio). In float64 pieces: the squares of fp32 subnormals
    underflow in fp32. A zero weight: (0, 1) if `approx` is zero too."""
    num = den = na = dot = 0.0
    for w, a in zip(weight.reshape(-1).split(_ERROR_CHUNK), approx.reshape(-1).split(_ERROR_CHUNK)):
        w, a = w.double(), a.to(w.device).double()
        num += float(torch.square(a - w).sum())
        den += float(torch.square(w).sum())
        na += float(torch.square(a).sum())
        dot += float((a * w).sum())
    if den == 0:
        return (0.0, 1.0) if num == 0 else (float("inf"), 0.0)
    return (num / den) ** 0.5, dot / (den * na) ** 0.5 if na > 0 else 0.0


#: Format-to-format fast paths, (source name, target name) -> fn(tensors, source, target, *,
#: global_amax, input_amax, name, encoder) returning the target's tensors, or None where it does not apply (another
#: device). Filled by formats/transcode.py, their one home; kept here because `Format.requantize`
#: reads it and transcode.py imports the formats (base importing it would be a cycle).
Transcoder = Callable[..., "dict[str, torch.Tensor] | None"]
TRANSCODERS: dict[tuple[str, str], Transcoder] = {}


@dataclass(frozen=True)
class OutSpec:
    """One checkpoint tensor a format writes for a source weight, keyed by its name suffix."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n


class Format:
    """Base class. Subclasses are stateless singletons registered in formats.FORMATS (the formats
    we write) or formats.SOURCE_FORMATS (`source_only`: read from a source, never written)."""

    name: str                  # "nvfp4", "mxfp8", "passthrough", "fp8_block"
    quant_algo: str | None     # ModelOpt quant_algo string, None for pass-through
    quant_algos: tuple[str, ...] = ()  # every quant_algo a ModelOpt config may name this format by
    suffixes: tuple[str, ...] = ("weight",)  # every tensor-name suffix it may write for a module
    block_shape: tuple[int, int] = (1, 1)  # (rows, cols) of the elements one scale covers
    block_size: int = 1        # block_shape's cols: elements per scale along the input (last) dim
    partial_tiles: bool = False  # an edge block may be partial: ceil(M/rows) x ceil(N/cols) scales
    source_only: bool = False  # only ever read from a source (formats.SOURCE_FORMATS)
    #: suffix -> the dtypes a source may store that tensor in, where more than out_specs' one
    stored_dtypes: Mapping[str, tuple[torch.dtype, ...]] = {}
    kernel: str | None = None  # the inkling_kernels entry point computing x @ dequant(W)^T
    kernel_inputs: tuple[str, ...] = ()  # the tensors (suffixes) it takes after x, in order
    fuses_gate_up: bool = False        # an expert's gate and up share a scale (`fused_global_amax`)
    global_scale: str | None = None    # the suffix of that shared per-tensor scale
    static_activation_scale: bool = False  # writes an activation scale from a calibrated amax
    # verify's numerics thresholds for y = x @ W^T against the BF16 source weight
    max_rel_error: float = 0.0
    min_cosine: float = 1.0
    # quant_algo -> (weight bits, activation bits or None) of its config.json `config_groups` entry
    _group_bits: Mapping[str, tuple[int, int | None]] = {}
    #: encoder ("modelopt", "release") -> the name of its rule as a quantization config records it;
    #: a format with one way to write its bits (pass-through) has none
    encoders: Mapping[str, str] = {}
    encoder_scales: Mapping[str, str] = {}  # encoder -> how its config names its scales' kind

    def __init_subclass__(cls, **kwargs):
        """`block_size` is derived from `block_shape` (an older subclass may give block_size only)."""
        super().__init_subclass__(**kwargs)
        own = cls.__dict__
        if "block_size" in own and "block_shape" not in own:
            cls.block_shape = (1, cls.block_size)
        elif "block_size" in own and own["block_size"] != cls.block_shape[1]:
            raise TypeError(f"{cls.__name__}: block_size {own['block_size']} is not block_shape's cols "
                            f"{cls.block_shape}")
        cls.block_size = cls.block_shape[1]

    @property
    def row_blocked(self) -> bool:
        """Whether every block scale lies along one row (block_shape rows == 1). Only then may a
        caller quantize a slab whose rows interleave two projections (Inkling's w13: gate row j at
        2j, up row j at 2j+1) as stored and split the rows of weight and scales afterwards. A
        format with 2-D blocks puts neighbouring rows under one scale, so gate and up would share
        scales: callers must de-interleave the slab first and quantize each projection alone."""
        return self.block_shape[0] == 1

    def check_shape(self, shape: tuple[int, ...], name: str = "") -> None:
        """FormatError naming `name` unless a weight of `shape` fits the blocks: each dim a block
        spans divisible by it, or any size where the format takes partial edge tiles."""
        _check_shape(tuple(shape), self.block_shape, self.name, name, self.partial_tiles)

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The grid of block scales for a weight of `shape` (checked): `[..., M, N/cols]` for
        row blocks, `[..., ceil(M/rows), ceil(N/cols)]` for 2-D ones."""
        self.check_shape(shape)
        rows, cols = self.block_shape
        shape = tuple(shape)
        if rows == 1:
            return (*shape[:-1], -(-shape[-1] // cols))
        return (*shape[:-2], -(-shape[-2] // rows), -(-shape[-1] // cols))

    def config_group_bits(self, quant_algo: str | None = None) -> tuple[int, int | None]:
        """(weight bits, activation bits or None for weight-only) of the compressed-tensors
        `config_groups` entry ModelOpt's config.json gives `quant_algo` (default: this format's;
        nvidia-modelopt 0.47.0 modelopt/torch/export/convert_hf_config.py
        `_quant_algo_to_group_config`). KeyError for a quant_algo this format has no entry for."""
        algo = self.quant_algo if quant_algo is None else quant_algo
        try:
            return self._group_bits[algo]
        except KeyError:
            raise KeyError(f"{self.name} has no config_groups entry for quant_algo {algo!r}") from None

    def encoder_rule(self, encoder: str) -> str:
        """The rule `encoder` names for this format (`encoders`); ValueError for one it has not.
        A format without encoders takes any (its bits have one way to be written)."""
        if not self.encoders:
            return encoder
        try:
            return self.encoders[encoder]
        except KeyError:
            raise ValueError(f"{self.name} has no encoder {encoder!r}; known: {sorted(self.encoders)}") from None

    def out_specs(self, shape: tuple[int, ...], dtype: torch.dtype,
                  activation_scale: bool = True) -> dict[str, OutSpec]:
        """suffix -> OutSpec of every tensor written for a source weight of `shape`/`dtype`."""
        raise NotImplementedError

    def tensor_name(self, weight_name: str, suffix: str) -> str:
        """The checkpoint name of the tensor `suffix` written for the source tensor `weight_name`
        (`<module>.weight`): ModelOpt's `<module>.<suffix>`."""
        return f"{weight_name[: -len('.weight')]}.{suffix}"

    def out_tensors(self, weight_name: str, shape: tuple[int, ...], dtype: torch.dtype,
                    activation_scale: bool = True) -> dict[str, OutSpec]:
        """`out_specs` keyed by checkpoint name (`tensor_name`)."""
        return {self.tensor_name(weight_name, k): o for k, o in self.out_specs(shape, dtype, activation_scale).items()}

    def weight_shape(self, stored: Mapping[str, tuple[int, ...]]) -> tuple[int, ...]:
        """The weight's shape ``[..., out, in]`` from the shapes of its stored tensors (suffix ->
        shape): the `weight` tensor's, unless the format packs it otherwise (MXFP4's blocks)."""
        return tuple(stored["weight"])

    def nbytes(self, shape: tuple[int, ...], dtype: torch.dtype = torch.bfloat16,
               activation_scale: bool = True) -> int:
        return sum(s.nbytes for s in self.out_specs(shape, dtype, activation_scale).values())

    def quantize(self, weight: torch.Tensor, *, global_amax: torch.Tensor | None = None,
                 input_amax: float | None = None, name: str = "", encoder: str = "modelopt") -> dict[str, torch.Tensor]:
        """suffix -> tensor: the out_specs, plus whatever the encoder adds for a form that stores
        it (NVFP4's release rule: `weight_amax`). `global_amax` (NVFP4) is the amax shared by fused
        projections; `input_amax` the calibrated activation amax (None: weight-only); `encoder`
        one of `encoders`. `name` (optional) is the tensor's name, quoted in FormatError messages."""
        raise NotImplementedError

    def dequantize(self, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the stored tensors hold, in `dtype`."""
        raise NotImplementedError

    def amax(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """max |dequantize(tensors)| as a float32 0-d tensor, exact; NaN or Inf where the
        dequantized weight holds one."""
        return self.dequantize(tensors, torch.float32).abs().amax()

    def check_stored(self, tensors: Mapping[str, torch.Tensor], name: str = "",
                     names: Mapping[str, str] | None = None) -> torch.Tensor:
        """FormatError naming `name` unless stored tensors of this format are a valid weight (what a
        quantized source's weight must be before it is requantized or kept); the source formats
        check more and name the scale tensor at fault (`names`: suffix -> checkpoint name).
        Returns the weight's amax (exact, `amax`), which a caller may share (gate and up)."""
        amax = self.amax(tensors)
        if not bool(torch.isfinite(amax)):
            raise FormatError(f"{'tensor ' + repr(name) + ': ' if name else ''}holds NaN or Inf once dequantized "
                              f"({self.name})", tensor=name or None)
        return amax

    def all_finite(self, tensors: Mapping[str, torch.Tensor]) -> bool:
        """Whether stored tensors of this format dequantize to finite values only (a NaN code or
        scale shows there): what a quantized tensor copied as it is must still be."""
        return bool(torch.isfinite(self.amax(tensors)))

    def requantize(self, tensors: Mapping[str, torch.Tensor], source: "Format", *, global_amax=None,
                   input_amax: float | None = None, name: str = "", encoder: str = "modelopt",
                   parts: tuple | None = None) -> dict[str, torch.Tensor]:
        """This format's tensors for the weight `tensors` store in `source`'s format: bit for bit
        ``quantize(source.dequantize(tensors, float32), global_amax=global_amax)`` (exact for the
        formats here: each stored value is an fp32 number), unless the encoder publishes its own
        cast for the pair (transcode.py: ModelOpt's MXFP4 -> NVFP4). A fast path for the pair
        (`TRANSCODERS`, filled by formats/transcode.py) runs first and may read the stored bytes
        directly; where there is none, or it declines (None), the weight is dequantized and
        quantized. Only its source-format checks' errors name the stored tensors (`name`).
        `parts` (row indexers of the slab: a gate/up slab's gate rows and up rows) says which
        weights the slab holds, for an encoder's cast that takes its shared scale per weight; the
        plain path's shared amax, the slab's, is the same either way."""
        fast = TRANSCODERS.get((source.name, self.name))
        out = None if fast is None else fast(tensors, source, self, global_amax=global_amax, input_amax=input_amax,
                                             name=name, encoder=encoder, parts=parts)
        if out is not None:
            return out
        return self.quantize(source.dequantize(tensors, torch.float32), global_amax=global_amax,
                             input_amax=input_amax, name=name, encoder=encoder)

    def fixed_point_misses(self, stored: Mapping[str, torch.Tensor], encoder: str = "release",
                           name: str = "") -> dict[str, int]:
        """suffix -> how many elements of the stored tensor `suffix` differ from encoding again,
        by `encoder`'s rule, the values they decode to ({}: every byte comes back). The release's
        rules are fixed points (decode + encode reproduces released bytes); ModelOpt's are not
        (-0.0 codes, MXFP8 blocks at 224 x their scale), so only the release's can be asked."""
        if self.encoder_rule(encoder) == "modelopt":
            raise ValueError(f"{self.name}: ModelOpt's encoder is not a fixed point of decoding")
        again = self.quantize(self.dequantize(stored, torch.float32), encoder=encoder, name=name)
        return _misses(stored, again)

    def layer_config(self, weight_only: bool = False, encoder: str = "modelopt") -> dict | None:
        """The `quantized_layers` entry of a MIXED_PRECISION config, None if unquantized: ModelOpt's
        (quant_algo, group_size); another encoder's adds its rule's name and its scales' kind
        (the release's: `encoder` nvfp4_nearest / mxfp8_nearest, `scales` amax_denominator / ue8m0)."""
        return None

    def modelopt_quantizers(self, quant_algo: str) -> dict[str, dict] | None:
        """The quantizers of a module written as `quant_algo` in ModelOpt's recipe terms:
        {"weight": attributes, "input": attributes}, what a `quant_cfg` holds under
        `*weight_quantizer` / `*input_quantizer` (num_bits as (exponent, mantissa) bits,
        block_sizes by dim, scale_bits; {"enable": False} for none). None if unquantized."""
        return None

    def _with_encoder(self, entry: dict, encoder: str) -> dict:
        rule = self.encoder_rule(encoder)
        return entry if rule == "modelopt" else {**entry, "encoder": rule, "scales": self.encoder_scales[encoder]}

    # --- rules the commands ask the format instead of re-deriving them -------------------
    def fused_global_amax(self, weights: list[torch.Tensor]) -> torch.Tensor | None:
        """The amax fused projections (an expert's gate and up) share, or None where the
        format has no per-tensor global scale."""
        return None

    def activation_scale(self, amax: float, name: str = "") -> torch.Tensor | None:
        """The static activation scale written for a calibrated amax, or None (dynamic)."""
        return None

    def activation_amax(self, scale: float) -> float:
        """The inverse of `activation_scale`: the amax a stored activation scale stands for."""
        raise NotImplementedError(f"{self.name} stores no activation scale")

    def magnitude_problem(self, tensors: Mapping[str, torch.Tensor], weight: torch.Tensor | None = None) -> str | None:
        """Why `tensors`, this format's encoding of `weight`, would fail verify for the weight's
        magnitude alone, or None: a stored scale verify refuses (NVFP4's global scale), or, where
        the scales reach the end of their range, an error past `max_rel_error` / `min_cosine`
        (MXFP8's smallest e8m0 scale). convert asks it of every weight it quantizes, reading the
        scales quantize returned; anything more is computed only for a weight at that end.
        `weight` None: a weight requantized from stored bytes, not at hand."""
        return None

    def flushes(self, amax: float) -> bool:
        """Whether a weight of this largest magnitude is written as the format's all-zero weight
        (`quantize` does it, and verify expects it): a nonzero amax below anything the format's
        scales can encode, whose values are zero at any precision that serves. No format but
        NVFP4 has such a floor (MXFP8's smallest scale holds every bf16 subnormal)."""
        return False

    def value_rule(self, suffix: str, encoder: str = "modelopt") -> str | None:
        """What the values of the tensor `suffix` must be when `encoder` wrote them, as one of
        VALUE_RULES' keys (the checks live in verify/values.py), or None when only finiteness applies."""
        return None

    def matches(self, observed: Mapping[str, tuple[tuple[int, ...], torch.dtype]], shape: tuple[int, ...],
                dtype: torch.dtype) -> bool:
        """Whether a module's tensors (suffix -> (shape, dtype)) are what this format writes for a
        source weight of `shape`/`dtype`, with or without an activation scale."""
        for act in (True, False):
            try:
                want = {k: (tuple(o.shape), o.dtype) for k, o in self.out_specs(shape, dtype, act).items()}
            except Exception:  # noqa: BLE001 - a shape this format cannot hold: not a match
                continue
            if set(want) == set(observed) and all(
                    tuple(observed[k][0]) == w[0] and (observed[k][1] == w[1] or observed[k][1] in
                                                       self.stored_dtypes.get(k, ())) for k, w in want.items()):
                return True
        return False


def _misses(stored: Mapping[str, torch.Tensor], again: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """suffix -> elements whose bytes differ, over the per-element tensors (weight, block scales)."""
    out = {}
    for k in ("weight", "weight_scale"):
        a, b = stored[k].contiguous(), again[k].contiguous()
        a, b = a.view(torch.uint8) if a.element_size() == 1 else a, b.view(torch.uint8) if b.element_size() == 1 else b
        n = int((a.reshape(-1) != b.reshape(-1).to(a.device)).sum()) if a.numel() == b.numel() else a.numel()
        if n:
            out[k] = n
    return out


class Passthrough(Format):
    """BF16/FP16/FP32 tensors copied bit-exactly, in the dtype the source stores them."""

    name = "passthrough"
    quant_algo = None
    source_dtypes = (torch.bfloat16, torch.float16, torch.float32)  # what a source may hold; kept as is

    @staticmethod
    def widens(source_dtype: torch.dtype, dtype: torch.dtype) -> bool:
        """Whether `dtype` holds every value of `source_dtype` exactly (BF16/FP16 -> FP32): another
        writer's lossless widening of a pass-through tensor (ModelOpt 0.47 stores DeepSeek-V3's
        e_score_correction_bias as FP32), accepted when every value is equal."""
        return dtype == torch.float32 and source_dtype in (torch.bfloat16, torch.float16)

    def out_specs(self, shape, dtype, activation_scale=True):
        return {"weight": OutSpec(tuple(shape), dtype)}

    def tensor_name(self, weight_name, suffix):
        return weight_name  # every tensor keeps its own name (a bias, a sink, a norm's weight)

    def quantize(self, weight, *, global_amax=None, input_amax=None, name="", encoder="modelopt"):
        return {"weight": weight}

    def dequantize(self, tensors, dtype=torch.float32):
        return tensors["weight"].to(dtype)
