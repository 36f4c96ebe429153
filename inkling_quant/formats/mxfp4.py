"""MXFP4 (OCP MX): e2m1 values, one power-of-two (e8m0) scale per 32 inputs. A *source* format
(`source_only`): the routed experts of OpenAI's gpt-oss releases are stored in it; read, checked,
dequantized and requantized into a format we write, never written (formats.SOURCE_FORMATS).

Tensors for a weight ``W [..., out, in]`` (``in`` divisible by 32), as transformers 5.25 reads
gpt-oss's ``*_blocks`` / ``*_scales`` (integrations/mxfp4.py ``convert_moe_packed_tensors``):

================  =======  =============================  ====================================
suffix            dtype    shape                          value
================  =======  =============================  ====================================
``weight``        uint8    ``[..., out, in/32, 16]``      two e2m1 codes per byte, element 2j
                                                          in the LOW nibble (``[..., out, in/2]``
                                                          also read)
``weight_scale``  uint8    ``[..., out, in/32]``          ``E``, the biased exponent (bias 127)
================  =======  =============================  ====================================

**Dequantize** (exact in fp32 and in bf16): ``e2m1(code) * 2^(E - 127)`` with the e2m1 table
``[0, .5, 1, 1.5, 2, 3, 4, 6]`` and bit 3 the sign (code 8 is -0.0): transformers 5.25
integrations/mxfp4.py (``FP4_VALUES``, ``torch.ldexp(lut[idx], scales - 127)``), nvidia-modelopt
0.47.0 qtensor/mxfp4_tensor.py ``MXFP4QTensor.dequantize``. The factor ``2^(E - 127)`` is taken
from an exact table (``E = 0`` is the fp32 subnormal 2^-127). ``E = 255`` is NaN in the OCP
spec and is refused (`check_stored`, naming the scale tensor); so is a block whose values pass
fp32's range (``E >= 253`` with a large code).

**Quantize** (tests and completeness: releases come quantized) is ModelOpt's
``MXFP4QTensor.quantize`` rule, bit for bit: per 32-block ``E = ceil(max(log2(fp32(amax) / 6),
-127)) + 127``, ``y = w / 2^(E-127)``, magnitude = how many of ``[.25, .75, 1.25, 1.75, 2.5, 3.5, 5]``
lie strictly below ``|y|`` (ties round down), sign bit ``(2 - sign(y)) // 2``, which sets it for
``y == 0`` too (ModelOpt writes zeros as code 8, -0). OpenAI's own quantizer (triton_kernels
``downcast_to_mxfp``) is not public here; only the stored bytes matter for a source.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np
import torch

from ..errors import FormatError
from ._cpu import _check_dtype, _check_shape, _nonfinite, _where
from .base import Format, OutSpec

__all__ = ["MXFP4", "MXFP4Rows", "BLOCK_SIZE", "E2M1_MAGNITUDES", "E2M1_SIGNED", "e8m0_factor", "blocks_of", "SCALE_NAN"]

BLOCK_SIZE = 32
BYTES_PER_BLOCK = BLOCK_SIZE // 2
SCALE_NAN = 0xFF
E2M1_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float32)
#: code (0..15) -> value, bit 3 the sign (code 8 is -0.0)
E2M1_SIGNED = torch.cat([E2M1_MAGNITUDES, -E2M1_MAGNITUDES])
_BOUNDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float32)
#: e8m0 byte -> 2^(E - 127) in fp32, exact (np.ldexp); 255 -> NaN
with np.errstate(over="ignore"):
    _FACTOR = torch.from_numpy(np.where(np.arange(256) == SCALE_NAN, np.float32(np.nan),
                                        np.ldexp(np.float32(1), np.arange(256) - 127).astype(np.float32)))


def e8m0_factor(e8: torch.Tensor) -> torch.Tensor:
    """``2^(E - 127)`` of e8m0 bytes, fp32, exact (NaN for 255)."""
    return _FACTOR.to(e8.device)[e8.view(torch.uint8).long()]


def blocks_of(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The packed codes as ``[..., out, in/32, 16]`` bytes (gpt-oss's blocks, or a ``[..., out,
    in/2]`` packing viewed so)."""
    p = packed.view(torch.uint8) if packed.dtype != torch.uint8 else packed
    if p.dim() == scale.dim() + 1:
        return p
    return p.reshape(*p.shape[:-1], -1, BYTES_PER_BLOCK)


class MXFP4(Format):
    """MXFP4: e2m1 codes, one e8m0 scale per 32 inputs (gpt-oss's routed experts)."""

    name = "mxfp4"
    quant_algo = None
    quant_algos = ()
    suffixes = ("weight", "weight_scale")
    block_shape = (1, BLOCK_SIZE)
    source_only = True
    # no verify thresholds (base: nothing passes): a source-only format is never checked as an output

    def out_specs(self, shape, dtype=torch.bfloat16, activation_scale=True):
        shape = tuple(shape)
        _check_shape(shape, BLOCK_SIZE, self.name, "")
        g = shape[-1] // BLOCK_SIZE
        return {"weight": OutSpec((*shape[:-1], g, BYTES_PER_BLOCK), torch.uint8),
                "weight_scale": OutSpec((*shape[:-1], g), torch.uint8)}

    def weight_shape(self, stored: Mapping[str, tuple[int, ...]]) -> tuple[int, ...]:
        """The weight's shape ``[..., out, in]`` from its stored tensors' shapes (suffix -> shape)."""
        s = tuple(stored["weight_scale"])
        return (*s[:-1], s[-1] * BLOCK_SIZE)

    def _stored(self, tensors: Mapping[str, torch.Tensor], name: str = "") -> tuple[torch.Tensor, torch.Tensor]:
        """(codes as ``[..., out, in/32, 16]`` uint8, e8m0 ``[..., out, in/32]`` uint8), shapes checked."""
        if "weight" not in tensors or "weight_scale" not in tensors:
            raise FormatError(f"{_where(name)}mxfp4 needs weight (blocks) and weight_scale (scales), got "
                              f"{sorted(tensors)}", tensor=name or None)
        e8 = tensors["weight_scale"]
        if e8.dtype not in (torch.uint8, getattr(torch, "float8_e8m0fnu", torch.uint8)):
            raise FormatError(f"{_where(name)}mxfp4 scales must be uint8 (e8m0), got {e8.dtype}", tensor=name or None)
        e8 = e8.view(torch.uint8)
        w = tensors["weight"]
        if w.dtype not in (torch.uint8, torch.int8):
            raise FormatError(f"{_where(name)}mxfp4 blocks must be uint8, got {w.dtype}", tensor=name or None)
        b = blocks_of(w, e8)
        if b.shape[-1] != BYTES_PER_BLOCK or tuple(b.shape[:-1]) != tuple(e8.shape):
            raise FormatError(f"{_where(name)}mxfp4 blocks {tuple(w.shape)} and scales {tuple(e8.shape)} do not "
                              f"match (one scale per {BYTES_PER_BLOCK} bytes, 32 values)", tensor=name or None)
        return b, e8

    def dequantize(self, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``e2m1(code) * 2^(E - 127)`` per 32-block, exact in fp32, cast to ``dtype``."""
        b, e8 = self._stored(tensors)
        lut = E2M1_SIGNED.to(b.device)
        vals = torch.empty((*b.shape[:-1], BLOCK_SIZE), dtype=torch.float32, device=b.device)
        vals[..., 0::2] = lut[(b & 0x0F).long()]
        vals[..., 1::2] = lut[(b >> 4).long()]
        vals *= e8m0_factor(e8).unsqueeze(-1)
        return vals.reshape(*e8.shape[:-1], e8.shape[-1] * BLOCK_SIZE).to(dtype)

    def amax(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """From the bytes: per block the largest code magnitude times its factor (exact); NaN where
        a scale is 255, Inf where a value passes fp32's range."""
        b, e8 = self._stored(tensors)
        if e8.numel() == 0:
            return torch.zeros((), dtype=torch.float32)
        top = torch.maximum(b & 0x07, (b >> 4) & 0x07).amax(dim=-1)
        return (E2M1_MAGNITUDES.to(b.device)[top.long()] * e8m0_factor(e8)).amax()

    def check_stored(self, tensors: Mapping[str, torch.Tensor], name: str = "",
                     names: Mapping[str, str] | None = None) -> torch.Tensor:
        """FormatError naming the tensor unless stored tensors are a valid weight: dtypes and
        matching shapes, no scale byte 255 (NaN), no value past fp32's range. `names` (suffix ->
        checkpoint name) names the scale tensor in its error; else `name` is named. Returns the
        weight's amax (exact)."""
        b, e8 = self._stored(tensors, name)
        bad = e8 == SCALE_NAN
        if bool(bad.any()):
            at = tuple(int(i) for i in bad.nonzero()[0])
            sname = (names or {}).get("weight_scale") or name
            raise FormatError(f"{_where(sname)}{int(bad.sum())} e8m0 scale(s) are 255 (NaN), the first at block {at}",
                              tensor=sname or None)
        amax = self.amax(tensors)
        if not bool(torch.isfinite(amax)):  # the scale is at fault: named as the 255 case is
            sname = (names or {}).get("weight_scale") or name
            raise FormatError(f"{_where(sname)}dequantizes past the fp32 range (an e8m0 scale too large)",
                              tensor=sname or None)
        return amax

    def quantize(self, weight, *, global_amax=None, input_amax=None, name: str = "", encoder: str = "modelopt"):
        """ModelOpt's ``MXFP4QTensor.quantize`` rule (module doc), bit for bit; suffix -> tensor
        (blocks ``[..., out, in/32, 16]``, scales). ``global_amax``, ``input_amax`` and
        ``encoder`` do not apply."""
        _check_dtype(weight, self.name, name)
        _check_shape(weight.shape, BLOCK_SIZE, self.name, name)
        shape = tuple(weight.shape)
        x = weight.detach().reshape(-1, BLOCK_SIZE)
        if x.numel() and not bool(torch.isfinite(x).all()):
            raise _nonfinite(name)
        amax = x.float().abs().amax(dim=-1, keepdim=True)
        e = torch.ceil(torch.maximum(torch.log2(amax / 6.0), torch.tensor(-127.0)))
        y = x / torch.exp2(e)
        sign_bit = ((2 - torch.sign(y)) // 2).to(torch.uint8)
        mag = ((y.abs().unsqueeze(-1) - _BOUNDS.to(y.device)) > 0).sum(-1).to(torch.uint8)
        codes = (sign_bit << 3) | mag
        packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
        g = shape[-1] // BLOCK_SIZE
        return {"weight": packed.reshape(*shape[:-1], g, BYTES_PER_BLOCK).contiguous(),
                "weight_scale": (e + 127).to(torch.uint8).reshape(*shape[:-1], g).contiguous()}

    def value_rule(self, suffix, encoder="modelopt"):
        return "e8m0" if suffix == "weight_scale" else None


class MXFP4Rows(MXFP4):
    """MXFP4 as DeepSeek-V4 stores its routed experts, one 2-D weight per expert projection: the
    same bits as `MXFP4`, in other shapes and dtypes.

    ================  ================  =====================  ===============================
    suffix            dtype             shape                  stored as
    ================  ================  =====================  ===============================
    ``weight``        int8              ``[..., out, in/2]``   ``<module>.weight``
    ``weight_scale``  float8_e8m0fnu    ``[..., out, in/32]``  ``<module>.scale``
    ================  ================  =====================  ===============================

    transformers 5.25 integrations/finegrained_fp8.py ``FP8Experts`` with ``expert_dtype`` "fp4"
    (weight int8 with the input dim halved, one scale per 32 inputs of a row) and ``Fp8Dequantize``
    (``_unpack_fp4``: the low nibble first); NVIDIA Model-Optimizer examples/deepseek/
    cast_mxfp4_to_nvfp4.py reads DeepSeek-V4-Flash's experts so (``F8_E8M0`` scales, uint8 also
    read)."""

    name = "mxfp4_rows"
    stored_dtypes = {"weight": (torch.int8, torch.uint8),
                     "weight_scale": (torch.float8_e8m0fnu, torch.uint8)}

    def out_specs(self, shape, dtype=torch.bfloat16, activation_scale=True):
        shape = tuple(shape)
        _check_shape(shape, BLOCK_SIZE, self.name, "")
        return {"weight": OutSpec((*shape[:-1], shape[-1] // 2), torch.int8),
                "weight_scale": OutSpec((*shape[:-1], shape[-1] // BLOCK_SIZE), torch.float8_e8m0fnu)}

    def quantize(self, weight, *, global_amax=None, input_amax=None, name: str = "", encoder: str = "modelopt"):
        """`MXFP4.quantize`'s bits in this form's shapes and dtypes."""
        q = super().quantize(weight, name=name)
        shape = tuple(weight.shape)
        return {"weight": q["weight"].reshape(*shape[:-1], shape[-1] // 2).view(torch.int8),
                "weight_scale": q["weight_scale"].view(torch.float8_e8m0fnu)}
