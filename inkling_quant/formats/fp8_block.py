"""FP8 E4M3 with one fp32 scale per 128x128 tile: the weight format of DeepSeek-V3's release and
of the checkpoints that copy its layout. A *source* format (`source_only`): read, checked,
dequantized and requantized into a format we write; never written, so it is registered in
formats.SOURCE_FORMATS, not formats.FORMATS (which schemes, `formats.detect`, value rules and
quant_algo lookups iterate).

Tensors for a weight ``W [M, N]`` (``[..., M, N]`` also accepted):

====================  =============  ===================================  =======================
suffix                dtype          shape                                value
====================  =============  ===================================  =======================
``weight``            float8_e4m3fn  ``[..., M, N]``                      ``e4m3(W / s)``
``weight_scale_inv``  float32        ``[..., ceil(M/128), ceil(N/128)]``  ``s``, one per tile
====================  =============  ===================================  =======================

Edge tiles are partial (the grid is a ceiling; deepseek-ai/DeepSeek-V3 at commit 0623163, inference/kernel.py
`weight_dequant` launches ``cdiv(M, 128) x cdiv(N, 128)`` programs and masks the edges). Despite
its name ``weight_scale_inv`` is the multiplier: **dequantize** is ``fp32(weight) * s`` of the
element's tile, computed in fp32 (`weight_dequant_kernel`: ``x = load(...).to(float32)``,
``y = x * s``), returned in fp32 or cast to the dtype asked for (DeepSeek stores ``y`` in the
default dtype, bf16 in its inference/generate.py).

**quantize** (for tests and completeness: releases come quantized) follows DeepSeek's
`weight_quant_kernel` in the same file: per tile ``s = fp32(max |w|) / 448`` in fp32, values
``e4m3(fp32(w) / s)`` (round to nearest even). Two choices where that kernel writes a scale no
reader can use: an all-zero tile takes ``s = 1.0`` (DeepSeek computes 0/0 = NaN; our NVFP4 makes
the same choice), and a tile whose ``amax / 448`` is below `base.MIN_INVERTIBLE_SCALE` (only
deep-subnormal tiles, amax < ~1.3e-36) takes that scale, so every scale is finite, > 0 and has a
finite fp32 reciprocal. There is no floor of 1e-4 on the amax: that floor belongs to the FP8
*activation* quantizer of later DeepSeek code (deepseek-ai/DeepSeek-V3.2-Exp inference/kernel.py
`act_quant_kernel`), and on weights it would move every small tile's scale off weight_quant's rule.

Scales may be stored as float32 (DeepSeek-V3), bfloat16 / float16 (Qwen3's FP8 releases
store ``weight_scale_inv`` in bf16) or UE8M0 (``F8_E8M0``, a power of two ``2^(E - 127)``:
DeepSeek-V4's, transformers 5.25 utils/quantization_config.py ``FineGrainedFP8Config.scale_fmt``
"ue8m0"): every one widens to fp32 exactly (e8m0's 255 to NaN, which the checks refuse), and the
fp32 value is the multiplier (transformers 5.25 integrations/finegrained_fp8.py ``Fp8Dequantize``:
``scales.to(torch.float32)``, then ``q * s``).

**Written as ModelOpt's FP8_PB_WO.** The same numbers are what nvidia-modelopt 0.47.0's HF
exporter writes for a 128x128 block-FP8 weight-only module (`quant_utils.py`
``get_quantization_format``: an fp8 weight quantizer with ``block_sizes`` and ``fake_quant`` is
``QUANTIZATION_FP8_PB_WO = "fp8_pb_wo"``, model_config.py; its ``quantized_layers`` entry is
``{"quant_algo": "fp8_pb_wo"}``, the generic ``else`` of ``process_layer_quant_config``; observed
on an export made with the ``fp8_2d_blockwise_weight_only`` preset's block sizes): ``weight``
float8_e4m3fn ``[M, N]`` and ``weight_scale`` float32 ``[ceil(M/128), 1, ceil(N/128), 1]``, a
multiplier (``FP8QTensor.dequantize``: ``quantized_data * scales``). So a stored weight is
written in that form with its bytes untouched and its scales only reshaped (and widened to fp32
where stored narrower): `modelopt_tensors`. vLLM 0.33 reads exactly that form (modelopt.py
``KFp8Block128``: ``weight_scale`` registered ``[cdiv(out, 128), 1, in // 128, 1]`` float32, the
input width a multiple of 128, a partial last output block padded by ``_Fp8PbWoPartialBlock``).
ModelOpt's config_groups has no entry for it (convert_hf_config.py ``_quant_algo_to_group_config``
warns and writes ``{"quant_algo": ...}`` alone): `config_group_bits` is None.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np
import torch

from ..errors import FormatError
from . import _jit
from ._cpu import _E4M3_TO_F32, _buf, _check_dtype, _nonfinite, _run_chunks, _where
from .base import MIN_INVERTIBLE_SCALE, Format, OutSpec

__all__ = ["FP8Block", "TILE", "E4M3_MAX", "SCALE_SUFFIX", "MODELOPT_SCALE", "QUANT_ALGO", "SCALE_DTYPES", "tile_max",
           "has_nan_byte"]

TILE = 128                 # rows and cols of the elements one scale covers
E4M3_MAX = 448.0           # largest float8_e4m3fn magnitude
SCALE_SUFFIX = "weight_scale_inv"
MODELOPT_SCALE = "weight_scale"   # the scale's suffix in ModelOpt's FP8_PB_WO form
QUANT_ALGO = "fp8_pb_wo"          # nvidia-modelopt 0.47.0 export/model_config.py QUANTIZATION_FP8_PB_WO
#: the dtypes a stored scale may have: each widens to fp32 exactly (Qwen3's FP8 releases: bf16;
#: DeepSeek-V4's: UE8M0)
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e8m0fnu)
_E4M3_VALUES = torch.from_numpy(_E4M3_TO_F32)  # byte -> fp32 value; 0x7F and 0xFF are NaN


def _tiles(x: torch.Tensor, fill=0) -> torch.Tensor:
    """`x [..., M, N]` padded with `fill` to whole tiles, viewed ``[..., ceil(M/128), 128,
    ceil(N/128), 128]`` (zeros leave every tile maximum as it is)."""
    *lead, m, n = x.shape
    gm, gn = -(-m // TILE), -(-n // TILE)
    if (gm * TILE, gn * TILE) != (m, n):
        padded = x.new_full((*lead, gm * TILE, gn * TILE), fill)
        padded[..., :m, :n] = x
        x = padded
    return x.contiguous().reshape(*lead, gm, TILE, gn, TILE)


def _untile(t: torch.Tensor, m: int, n: int) -> torch.Tensor:
    """The inverse of `_tiles`: ``[..., M, N]``, the padding cropped."""
    *lead, gm, _, gn, _ = t.shape
    return t.reshape(*lead, gm * TILE, gn * TILE)[..., :m, :n].contiguous()


def tile_max(w: torch.Tensor) -> torch.Tensor:
    """The largest magnitude byte (sign cleared; 0x7F: a NaN) of each 128x128 tile of e4m3 bytes
    ``[..., M, N]``, uint8 ``[..., ceil(M/128), ceil(N/128)]``: on CPU one pass of the compiled
    kernel (_jit.fp8_tile_max) per matrix, elsewhere torch."""
    if w.device.type != "cpu":
        return _tiles(w.view(torch.uint8) & 0x7F).amax(dim=(-3, -1))
    *lead, m, n = w.shape
    gm = -(-m // TILE)
    out = np.zeros((*lead, gm, -(-n // TILE)), dtype=np.uint8)
    flat = w.contiguous().view(torch.uint8).reshape(-1, m * n).numpy()
    grids = out.reshape(-1, *out.shape[-2:])
    for i in range(flat.shape[0]):  # bands of tiles in turn on the threads (_cpu._run_chunks)
        _run_chunks(lambda t0, t1, q=flat[i], g=grids[i]: _jit.fp8_tile_max(
            q[t0 * TILE * n: t1 * TILE * n], n, g[t0:t1], _buf("fp8:acc", (n,), np.uint8)), gm, 1, 4)
    return torch.from_numpy(out)


def _tile_amax(tm: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Each tile's max |value| from its largest magnitude byte (`tile_max`) and its scale s:
    exact, since a positive scale keeps the bytes' order."""
    return _E4M3_VALUES.to(s.device)[tm.long().to(s.device)] * s


def has_nan_byte(w: torch.Tensor) -> bool:
    """Whether e4m3 bytes hold a NaN (0x7F / 0xFF; e4m3fn has no Inf): one compiled pass on CPU
    (what a converter copying FP8 bytes as they are checks them for)."""
    b = w.reshape(-1).view(torch.uint8)
    if b.device.type != "cpu":
        return bool(((b & 0x7F) == 0x7F).any())
    return b.numel() > 0 and int(_jit.e4m3_max_magnitude(b.numpy())) == 0x7F


def _scale_name(name: str) -> str:
    """The checkpoint name of the scale beside the weight `name` (`<module>.weight_scale_inv`)."""
    if not name:
        return ""
    return f"{name[: -len('.weight')]}.{SCALE_SUFFIX}" if name.endswith(".weight") else f"{name}_scale_inv"


class FP8Block(Format):
    """FP8 E4M3 weights, one fp32 multiplier per 128x128 tile (DeepSeek-V3's release)."""

    name = "fp8_block"
    quant_algo = QUANT_ALGO    # ModelOpt's FP8_PB_WO, the form it is written in (module doc)
    quant_algos = (QUANT_ALGO, QUANT_ALGO.upper())  # vLLM and SGLang upper-case it; Kimi-K3's script writes it so
    suffixes = ("weight", SCALE_SUFFIX)
    block_shape = (TILE, TILE)
    partial_tiles = True
    source_only = True
    stored_dtypes = {"weight": (torch.float8_e4m3fn,), SCALE_SUFFIX: SCALE_DTYPES}
    # no verify thresholds (base: nothing passes): verify never checks a checkpoint written in a
    # source-only format

    def out_specs(self, shape, dtype=torch.bfloat16, activation_scale=True):
        shape = tuple(shape)
        return {"weight": OutSpec(shape, torch.float8_e4m3fn),
                SCALE_SUFFIX: OutSpec(self.scale_shape(shape), torch.float32)}

    def quantize(self, weight, *, global_amax=None, input_amax=None, name: str = "", encoder: str = "modelopt"):
        """suffix -> tensor (the module doc's rule). ``global_amax`` and ``input_amax`` do not
        apply (no global scale, no activation scale) and are ignored, as is ``encoder`` (one rule).
        Raises FormatError for a
        weight of fewer than two dims, another dtype, or NaN/Inf."""
        _check_dtype(weight, self.name, name)
        self.check_shape(weight.shape, name)
        w = weight.detach().to(torch.float32)  # exact for bf16/fp16
        if not bool(torch.isfinite(w).all()):
            raise _nonfinite(name)
        m, n = w.shape[-2:]
        t = _tiles(w)
        amax = t.abs().amax(dim=(-3, -1))
        scale = torch.where(amax == 0, torch.ones_like(amax),
                            (amax / E4M3_MAX).clamp(min=MIN_INVERTIBLE_SCALE))
        q = (t / scale[..., :, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        return {"weight": _untile(q, m, n), SCALE_SUFFIX: scale}

    def _stored(self, tensors: Mapping[str, torch.Tensor], name: str = "") -> tuple[torch.Tensor, torch.Tensor]:
        """(weight as float8_e4m3fn, weight_scale_inv) of stored tensors, their dtypes and the
        scale grid's shape checked against the weight's (FormatError naming the tensor)."""
        if "weight" not in tensors or SCALE_SUFFIX not in tensors:
            raise FormatError(f"{_where(name)}fp8_block needs weight and {SCALE_SUFFIX}, got {sorted(tensors)}",
                              tensor=name or None)
        w, s = tensors["weight"], tensors[SCALE_SUFFIX]
        if w.dtype == torch.uint8:
            w = w.view(torch.float8_e4m3fn)
        if w.dtype != torch.float8_e4m3fn:
            raise FormatError(f"{_where(name)}fp8_block weight must be float8_e4m3fn, got {w.dtype}",
                              tensor=name or None)
        self.check_shape(tuple(w.shape), name)
        want, sname = self.scale_shape(tuple(w.shape)), _scale_name(name)
        if s.dtype not in SCALE_DTYPES or tuple(s.shape) != want:
            raise FormatError(f"{_where(sname)}{SCALE_SUFFIX} is {s.dtype} {tuple(s.shape)}; a weight of shape "
                              f"{tuple(w.shape)} needs float32 {want} (one scale per {TILE}x{TILE} tile, "
                              f"edge tiles partial; bfloat16, float16 or float8_e8m0fnu also read)", tensor=sname or None)
        return w, s.to(torch.float32)  # exact widening

    def dequantize(self, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``fp32(weight) * weight_scale_inv`` of each element's tile, in fp32, then cast to
        ``dtype`` (DeepSeek-V3 inference/kernel.py `weight_dequant_kernel`)."""
        w, s = self._stored(tensors)
        m, n = w.shape[-2:]
        deq = _tiles(w.to(torch.float32)) * s.to(w.device)[..., :, None, :, None]
        return _untile(deq, m, n).to(dtype)

    def amax(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """From the bytes: per tile the largest magnitude byte (e4m3 magnitudes order as their
        bytes; 0x7F is NaN, the largest) times |scale|, exact since rounding keeps that order;
        NaN where the dequantized weight holds one (a NaN byte or scale, 0 x Inf), else Inf where
        it does (an infinite scale, overflow), as ``dequantize(tensors).abs().amax()``."""
        w, s = self._stored(tensors)
        if w.numel() == 0:
            return torch.zeros((), dtype=torch.float32)
        s = s.to(w.device).abs()
        per_tile = _tile_amax(tile_max(w), s)
        if bool(torch.isinf(s).any()):  # a zero in a tile of infinite scale is 0 x Inf = NaN
            zero = _tiles(w.view(torch.uint8) & 0x7F, fill=0x7E).amin(dim=(-3, -1)) == 0
            per_tile = torch.where(zero & torch.isinf(s), torch.full_like(s, float("nan")), per_tile)
        return per_tile.amax()

    def check_stored(self, tensors: Mapping[str, torch.Tensor], name: str = "",
                     names: Mapping[str, str] | None = None) -> torch.Tensor:
        """FormatError naming the tensor unless stored tensors are a valid weight: dtypes and the
        scale grid's shape, no NaN byte (0x7F/0xFF; e4m3fn has no Inf), every scale finite and
        > 0 with a finite fp32 reciprocal (`base.invertible`: what its FP8_PB_WO form is held to), and no value past the fp32 range once dequantized. The scale is named as `name`'s
        `weight_scale_inv` (`names`: suffix -> checkpoint name, where it is named otherwise).
        Returns the weight's amax (exact; `amax`), from the same one pass over the bytes."""
        w, s = self._stored(tensors, name)
        tm = tile_max(w) if w.numel() else None
        if tm is not None and int(tm.max()) == 0x7F:  # the first NaN byte, only on the error path
            nan = (w.view(torch.uint8) & 0x7F) == 0x7F
            at = tuple(int(i) for i in nan.nonzero()[0])
            raise FormatError(f"{_where(name)}holds {int(nan.sum())} NaN e4m3 byte(s), the first at {at}",
                              tensor=name or None)
        bad = ~torch.isfinite(s) | (s < MIN_INVERTIBLE_SCALE)   # a deep subnormal: no finite 1/s (base.invertible)
        if bool(bad.any()):
            sname = (names or {}).get(SCALE_SUFFIX) or _scale_name(name)
            at = tuple(int(i) for i in bad.nonzero()[0])
            raise FormatError(f"{_where(sname)}{int(bad.sum())} scale(s) not finite and > 0 with a finite fp32 "
                              f"reciprocal, the first {float(s[at]):g} at tile {at}", tensor=sname or None)
        if tm is None:
            return torch.zeros((), dtype=torch.float32)
        amax = _tile_amax(tm, s.to(w.device)).amax()
        if not bool(torch.isfinite(amax)):
            raise FormatError(f"{_where(name)}dequantizes past the fp32 range (a scale too large)",
                              tensor=name or None)
        return amax

    def value_rule(self, suffix, encoder="modelopt"):
        return "positive" if suffix in (SCALE_SUFFIX, MODELOPT_SCALE) else None

    # --- ModelOpt's FP8_PB_WO form (module doc) ------------------------------------------
    def layer_config(self, weight_only: bool = False, encoder: str = "modelopt") -> dict:
        """Its `quantized_layers` entry as ModelOpt 0.47's exporter writes it (no group_size)."""
        return {"quant_algo": QUANT_ALGO}

    def modelopt_quantizers(self, quant_algo):
        # nvidia-modelopt 0.47 quantization/config.py FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG
        return {"weight": {"num_bits": [4, 3], "block_sizes": {"-1": TILE, "-2": TILE}, "axis": None, "enable": True},
                "input": {"enable": False}}

    def config_group_bits(self, quant_algo: str | None = None):
        """None: ModelOpt's config.json has no config_groups bits for FP8_PB_WO (its group is
        ``{"quant_algo": ...}`` alone)."""
        return None

    def modelopt_specs(self, shape: tuple[int, ...]) -> dict[str, OutSpec]:
        """suffix -> OutSpec of ModelOpt's FP8_PB_WO tensors for a stored weight of `shape`."""
        shape = tuple(shape)
        *lead, gm, gn = self.scale_shape(shape)
        return {"weight": OutSpec(shape, torch.float8_e4m3fn),
                MODELOPT_SCALE: OutSpec((*lead, gm, 1, gn, 1), torch.float32)}

    def modelopt_tensors(self, tensors: Mapping[str, torch.Tensor], name: str = "") -> dict[str, torch.Tensor]:
        """Stored tensors in ModelOpt's FP8_PB_WO form: the weight's bytes as they are, the scales
        widened to fp32 (exact) and viewed ``[ceil(M/128), 1, ceil(N/128), 1]``."""
        w, s = self._stored(tensors, name)
        *lead, gm, gn = s.shape
        return {"weight": w, MODELOPT_SCALE: s.contiguous().reshape(*lead, gm, 1, gn, 1)}
