"""MXFP8 in NVIDIA ModelOpt's Hugging Face export layout (quant_algo "MXFP8").

Checkpoint tensors for a weight ``W [..., out, in]`` (``in`` divisible by 32):

================  =============  =====================  =========================================
suffix            dtype          shape                  value
================  =============  =====================  =========================================
``weight``        float8_e4m3fn  ``[..., out, in]``     ``sat448(W * 2^(127 - E))``
``weight_scale``  uint8 (e8m0)   ``[..., out, in/32]``  ``E = clamp(ceil(log2(amax32/448)), -127, 127) + 127``
================  =============  =====================  =========================================

No ``input_scale`` and no ``weight_scale_2``, ever (activations are quantized dynamically).
The scale rule is ModelOpt's "round up" (``MXFP8QTensor._compute_e8m0_exponent``), which keeps
``amax / 2^e <= 448`` so nothing clips; it is *not* the OCP MX v1.0 rule
``floor(log2(amax)) - 8``, which can clip a block's largest values (docs/formats.md).

**Two encoders** (``quantize(..., encoder=)``; ``ENCODERS``): ``"modelopt"``, the rule above, and
``"release"``, the rule Thinking Machines' Inkling 2 release names ``mxfp8_nearest`` (scales
``ue8m0``; NeMo AutoModel ``nemo_automodel.components.models.inkling2.quantization`` and
Megatron-Bridge ``bridge.models.inkling.inkling2_quantization``, nightly API docs): per 32 inputs
the smallest power of two ``2^s`` with ``bmax / 2^s <= 464`` (464 is where E4M3's round to
nearest even stops giving 448), each value the nearest E4M3 of ``w / 2^s``, ties to even, the
sign of zero kept. It differs from ModelOpt's on blocks whose ``bmax / 2^s`` falls in
(448, 464] (a few per cent of Gaussian blocks) and, unlike it, is a fixed point: decoding a
block and encoding it again gives the same bytes. Computed exactly on bmax's bits
(``release_exponent``); our choice where the documents are silent: an all-zero block, or one
below 2^-119, takes the smallest scale byte, 0 (s = -127).

Bit-identical to ``modelopt.torch.quantization.qtensor.MXFP8QTensor.quantize`` (0.47.0, CPU).
The CPU path is a compiled kernel (formats/_jit.py: numba, chunks of whole blocks on
torch.get_num_threads() threads) evaluating the same fp32 operations; its e4m3 rounding equals
torch's fp32 -> float8_e4m3fn cast, the one ModelOpt uses (tests/test_formats.py).
"""
from __future__ import annotations

import threading
from typing import Mapping

import numpy as np
import torch

from ..errors import FormatError
from .base import Format, OutSpec, weight_error
from . import _jit
from ._cpu import _BITS, _E4M3_TO_F32, _buf, _check_dtype, _check_shape, _nonfinite, _run_chunks, _source_bits

__all__ = ["MXFP8", "BLOCK_SIZE", "E4M3_MAX", "FLOOR_AMAX", "e8m0_exponent", "release_exponent", "ENCODERS"]

BLOCK_SIZE = 32
E4M3_MAX = 448.0
_MX_CHUNK_BLOCKS = 2048      # 64 Ki elements per chunk: its scratch stays in the L2 cache
#: blocks of amax below this take e8m0's smallest scale, 2^-127 (byte 0; ModelOpt's rule: at or
#: below 448 * 2^-127, the release's: below 464 * 2^-127), and below this their values no longer
#: reach e4m3's top binade: e4m3's fixed steps there (2^-136 among its subnormals) are an absolute
#: error the block's own magnitude does not scale (`MXFP8.magnitude_problem`)
FLOOR_AMAX = E4M3_MAX * 2.0 ** -128
#: encoder -> the name of its rule as a checkpoint's quantization config records it
ENCODERS = {"modelopt": "modelopt", "release": "mxfp8_nearest"}


def e8m0_exponent(block_amax: torch.Tensor) -> torch.Tensor:
    """ModelOpt's biased e8m0 exponent (uint8) of per-block amax values, computed exactly as
    ``MXFP8QTensor._compute_e8m0_exponent`` does (fp32 divide by 448, log2, ceil, clamp)."""
    descale = block_amax.float() / E4M3_MAX
    log2 = torch.where(descale > 0, torch.log2(descale), torch.tensor(-127.0, device=descale.device))
    return (torch.clamp(torch.ceil(log2), min=-127, max=127) + 127).to(torch.uint8)


def release_exponent(block_amax: torch.Tensor) -> torch.Tensor:
    """The release rule's biased exponent (uint8) of per-block amax values (fp32, finite, >= 0):
    the smallest E with amax / 2^(E - 127) <= 464, from amax's bits: its exponent field less 8,
    or less 7 where the mantissa exceeds 464's (0x680000); at least 0 (_jit._mxfp8_chunk's rule)."""
    bits = block_amax.float().contiguous().view(torch.int32)
    e = (bits >> 23) - torch.where((bits & 0x7FFFFF) <= 0x680000, 8, 7)
    return e.clamp(min=0).to(torch.uint8)


def _e8m0_doc() -> None:
    """Why the CPU kernel's integer exponent rule equals ModelOpt's ``torch.log2`` form.

    For bf16/fp16 weights ``amax/448`` is never within 2^-9 (relative) of a power of two unless
    it is one, so ``ceil(log2(.))`` is exact whatever log2's last-bit error: the integer form
    (the fp32 exponent of amax/448, plus one if any mantissa bit is set; 0 at or below 2^-127)
    equals ModelOpt's. tests/test_formats.py checks it on every bf16 and fp16 amax pattern.
    fp32 weights take ModelOpt's own expression (`e8m0_exponent`), given to the kernel."""


def _mxfp8_cpu(w: torch.Tensor, name: str, release: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [numel], e8m0 uint8 [numel/32]) for a contiguous CPU weight: the compiled kernel
    (_jit.mxfp8_blocks) on chunks of whole blocks, on torch.get_num_threads() threads."""
    src, shift, mask = _source_bits(w)
    nblk = src.size // BLOCK_SIZE
    q = torch.empty(nblk * BLOCK_SIZE, dtype=torch.float8_e4m3fn)
    scale = torch.empty(nblk, dtype=torch.uint8)
    given = w.dtype == torch.float32 and not release  # fp32: ModelOpt's log2 form, not the integer rule
    rule = _jit.RELEASE if release else _jit.GIVEN if given else _jit.MODELOPT
    if given and nblk:
        bm = w.detach().reshape(-1, BLOCK_SIZE).abs().amax(dim=1)
        if not bool(torch.isfinite(bm).all()):
            raise _nonfinite(name)
        scale.copy_(e8m0_exponent(bm))
    q_np, scale_np = q.view(torch.uint8).numpy(), scale.numpy()

    def chunk(b0: int, b1: int) -> None:
        M = _MX_CHUNK_BLOCKS  # the kernel's chunk: its scratch stays in the L2 cache
        scratch = (_buf("mx:tmp", (M * 32,), src.dtype), _buf("mx:top", (M,), np.uint32),
                   _buf("mx:u", (M * 32,), np.uint32), _buf("mx:f", (M * 32,), np.float32))
        if _jit.mxfp8_blocks(src[b0 * 32: b1 * 32], shift, mask, rule, scale_np[b0:b1], q_np[b0 * 32: b1 * 32],
                             *scratch) == _jit.NONFINITE:
            raise _nonfinite(name)

    _run_chunks(chunk, nblk, _MX_CHUNK_BLOCKS)
    return q, scale


def _mxfp8_torch(w: torch.Tensor, name: str, release: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The same formulas with plain torch ops (any device); the CPU tests' second opinion."""
    bits_t, mask, inf_bits, _ = _BITS[w.dtype]
    blocks = w.reshape(-1, BLOCK_SIZE)
    bm = (blocks.view(bits_t) & mask).amax(dim=1)
    if blocks.shape[0] and int(bm.max()) >= inf_bits:
        raise _nonfinite(name)
    e8 = (release_exponent if release else e8m0_exponent)(bm.view(w.dtype))
    factor = torch.exp2(127 - e8.float())
    y = (blocks * factor.unsqueeze(-1)).clamp(min=-E4M3_MAX, max=E4M3_MAX)
    return y.to(torch.float8_e4m3fn).reshape(-1), e8


def _stored(tensors: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight as float8_e4m3fn, weight_scale as uint8) of stored MXFP8 tensors, checked to match."""
    w, e8 = tensors["weight"], tensors["weight_scale"].view(torch.uint8)
    if w.dtype == torch.uint8:
        w = w.view(torch.float8_e4m3fn)
    if e8.shape[-1] * BLOCK_SIZE != w.shape[-1] or e8.shape[:-1] != w.shape[:-1]:
        raise FormatError(f"mxfp8: weight {tuple(w.shape)} and weight_scale {tuple(e8.shape)} do not match")
    return w, e8


def stored_bytes(tensors: Mapping[str, torch.Tensor]) -> tuple[np.ndarray, np.ndarray, tuple[int, ...]]:
    """(e4m3 bytes, e8m0 bytes, the weight's shape) of stored MXFP8 CPU tensors, flat, as the
    compiled kernels read them."""
    w, e8 = _stored(tensors)
    return (w.contiguous().view(torch.uint8).reshape(-1).numpy(), e8.contiguous().reshape(-1).numpy(),
            tuple(w.shape))


def _amax_of_bytes(q: np.ndarray, e8: np.ndarray) -> np.float32:
    """max |dequantized weight| of stored bytes (`stored_bytes`), every block read
    (_jit.mxfp8_amax_bits, the values never written); NaN or Inf where one is held."""
    parts, lock = [0], threading.Lock()

    def chunk(b0: int, b1: int) -> None:
        top = _jit.mxfp8_amax_bits(q[b0 * 32: b1 * 32], e8[b0:b1], _E4M3_TO_F32,
                                   _buf("mx:tmp8", (_MX_CHUNK_BLOCKS * 32,), np.uint8),
                                   _buf("mx:top", (_MX_CHUNK_BLOCKS,), np.uint32))
        with lock:
            parts.append(int(top))

    _run_chunks(chunk, e8.size, _MX_CHUNK_BLOCKS)
    return np.array(max(parts), dtype=np.uint32).view(np.float32)[()]


def amax_before_reading(q: np.ndarray, e8: np.ndarray) -> np.float32:
    """max |dequantized weight| of stored bytes (`stored_bytes`), exact where they are finite,
    read from the few blocks whose exponent can hold it (_jit.mxfp8_amax_by_scale; every block
    when those are not few). A NaN byte in a block not read is not seen: for a caller that reads
    every value next anyway (formats.transcode's NVFP4 from MXFP8, whose kernel checks each block)."""
    g = _jit.mxfp8_amax_by_scale(q, e8, _E4M3_TO_F32, 4)
    return _amax_of_bytes(q, e8) if g < 0 else g  # < 0: the maximum could be in many blocks


class MXFP8(Format):
    """MXFP8: e4m3 weights, one power-of-two (e8m0) scale per 32 inputs."""

    name = "mxfp8"
    quant_algo = "MXFP8"
    quant_algos = ("MXFP8",)
    suffixes = ("weight", "weight_scale")
    block_shape = (1, BLOCK_SIZE)
    kernel = "mxfp8_dequant_gemm"
    kernel_inputs = ("weight", "weight_scale")
    # verify's thresholds for y = x @ W^T vs the BF16 source (docs/formats.md "Error statistics",
    # tools/bench_formats.py --errors): relative error ~0.027 typical, worst 0.053 and cosine
    # >= 0.9993 over 1200 Gaussian + outlier weights (an e4m3 element is off by <= 2^-4 relative).
    max_rel_error = 0.08
    min_cosine = 0.996
    _group_bits = {"MXFP8": (8, 8)}  # ModelOpt 0.47 convert_hf_config.py (dynamic activations, 8 bits)

    def out_specs(self, shape, dtype=torch.bfloat16, activation_scale=True):
        shape = tuple(shape)
        _check_shape(shape, BLOCK_SIZE, self.name, "")
        return {"weight": OutSpec(shape, torch.float8_e4m3fn),
                "weight_scale": OutSpec((*shape[:-1], shape[-1] // BLOCK_SIZE), torch.uint8)}

    encoders = ENCODERS
    encoder_scales = {"release": "ue8m0"}  # the release's hf_quant_config.json (NeMo AutoModel's docs)

    def quantize(self, weight, *, global_amax=None, input_amax=None, name: str = "", encoder: str = "modelopt"):
        """suffix -> tensor. ``global_amax`` and ``input_amax`` do not apply to MXFP8 and are
        ignored (no weight_scale_2, no input_scale); ``encoder`` picks the scale rule (module
        doc). Raises FormatError for a last dim not divisible by 32 or NaN/Inf."""
        release = self.encoder_rule(encoder) != "modelopt"
        _check_dtype(weight, self.name, name)
        _check_shape(weight.shape, BLOCK_SIZE, self.name, name)
        w = weight.detach()
        if not w.is_contiguous():
            w = w.contiguous()
        q, e8 = (_mxfp8_cpu if w.device.type == "cpu" else _mxfp8_torch)(w, name, release)
        shape = tuple(w.shape)
        return {"weight": q.reshape(shape),
                "weight_scale": e8.reshape(*shape[:-1], shape[-1] // BLOCK_SIZE)}

    def dequantize(self, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``fp32(weight) * 2^(weight_scale - 127)`` per 32-block, cast to ``dtype`` (ModelOpt
        ``MXFP8QTensor.dequantize``); on CPU the compiled kernel (_jit.mxfp8_dequantize)."""
        w, e8 = _stored(tensors)
        if w.device.type != "cpu":
            deq = w.float().view(*w.shape[:-1], -1, BLOCK_SIZE) * torch.exp2(e8.float() - 127).unsqueeze(-1)
            return deq.reshape(w.shape).to(dtype)
        q, sc, _ = stored_bytes(tensors)
        out = torch.empty(w.shape, dtype=torch.float32)
        o = out.reshape(-1).numpy()

        def chunk(b0: int, b1: int) -> None:
            _jit.mxfp8_dequantize(q[b0 * 32: b1 * 32], sc[b0:b1], _E4M3_TO_F32,
                                  _buf("mx:factor", (_MX_CHUNK_BLOCKS,), np.uint32), o[b0 * 32: b1 * 32])

        _run_chunks(chunk, sc.size, _MX_CHUNK_BLOCKS)
        return out.to(dtype)

    def amax(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """On CPU from the bytes alone (`_amax_of_bytes`), the values never written."""
        if tensors["weight"].device.type != "cpu":
            return super().amax(tensors)
        q, e8, _ = stored_bytes(tensors)
        return torch.tensor(_amax_of_bytes(q, e8), dtype=torch.float32)

    def magnitude_problem(self, tensors, weight=None):
        """A weight with a block at the smallest scale (byte 0) holding a nonzero value: its
        relative error and cosine against `weight`, held to verify's thresholds. No amax alone
        decides it: how far the error grows depends on how the values spread below the amax
        (docs/formats.md). Real weights have no such block (bf16 values that small are zero), so
        for them this reads the scale bytes only; zero blocks encode exactly."""
        q, e8 = _stored(tensors)
        floor = e8 == 0
        if weight is None or not bool(floor.any()):
            return None
        if not bool((q.view(torch.uint8).reshape(*e8.shape, BLOCK_SIZE)[floor] & 0x7F).any()):
            return None
        rel, cos = weight_error(weight, self.dequantize(tensors))
        if rel <= self.max_rel_error and cos >= self.min_cosine:
            return None
        return (f"amax {float(weight.abs().max()):g} is too small for MXFP8: blocks below {FLOOR_AMAX:.3g} take "
                f"e8m0's smallest scale, 2^-127, where e4m3's steps (2^-136 at the bottom) leave relative error "
                f"{rel:.3g}, cosine {cos:.4f} (verify's limits: {self.max_rel_error:g}, {self.min_cosine:g})")

    def layer_config(self, weight_only: bool = False, encoder: str = "modelopt") -> dict:
        return self._with_encoder({"quant_algo": "MXFP8", "group_size": BLOCK_SIZE}, encoder)

    def modelopt_quantizers(self, quant_algo):
        # nvidia-modelopt 0.47 quantization/config.py MXFP8_DEFAULT_CFG (e4m3, e8m0 scale per 32; activations too)
        q = {"num_bits": [4, 3], "block_sizes": {"-1": BLOCK_SIZE, "type": "dynamic", "scale_bits": [8, 0]},
             "axis": None, "enable": True}
        return {"weight": q, "input": dict(q)}

    def value_rule(self, suffix, encoder="modelopt"):
        return "e8m0" if suffix == "weight_scale" else None  # a biased exponent byte; 0xFF is NaN
