"""Format-to-format fast paths: the one home of every "target from a source's stored bytes".

`Format.requantize(tensors, source)` is by contract bit for bit ``quantize(source.dequantize(
tensors, float32))``. A pair that can do better (read the stored bytes once, never build the fp32
weight) registers a transcoder here, keyed by (source name, target name), in `TRANSCODERS`
(defined in base.py, which reads it; this module imports the formats, so it fills it instead):

    @transcoder("mxfp8", "nvfp4")
    def nvfp4_from_mxfp8(tensors, source, target, *, input_amax=None, name="", encoder="modelopt"): ...

A transcoder returns the target's tensors, or None where it does not apply (a tensor on another
device), and then the dequantize + quantize fallback runs. It must equal that fallback bit for
bit, errors included (tests/test_formats.py holds every registered pair to it). Formats never
import each other for this: nvfp4.py knows nothing of mxfp8.py.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np
import torch

from . import _jit
from ._cpu import _E4M3_TO_F32, _buf, _nonfinite
from .base import TRANSCODERS, Format, Transcoder
from .mxfp8 import amax_before_reading, stored_bytes
from .nvfp4 import (_MODELOPT, _NV_CHUNK_BLOCKS, BLOCK_SIZE, GLOBAL_DIV, RELEASE_DENOMINATOR, _global_scale,
                    _nvfp4_chunks, _tensors, release_rule)

__all__ = ["TRANSCODERS", "transcoder", "find", "nvfp4_from_mxfp8"]


def transcoder(source: str, target: str):
    """Register the decorated function as the fast path from format `source` to `target`."""
    def register(fn: Transcoder) -> Transcoder:
        if (source, target) in TRANSCODERS:
            raise ValueError(f"a transcoder from {source} to {target} is registered already")
        TRANSCODERS[(source, target)] = fn
        return fn
    return register


def find(source: Format | str, target: Format | str) -> Transcoder | None:
    """The fast path from `source` to `target` (formats or their names), or None: requantize then
    dequantizes and quantizes."""
    key = tuple(f if isinstance(f, str) else f.name for f in (source, target))
    return TRANSCODERS.get(key)


# ============================================================================ MXFP8 -> NVFP4
def _nvfp4_blocks_from_mxfp8(q: np.ndarray, e8: np.ndarray, s2: torch.Tensor, rel: np.ndarray,
                             name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed, scale) NVFP4 bytes of the weight stored MXFP8 bytes hold (e4m3 q, e8m0 e8), read
    once, never dequantized whole: per chunk the NVFP4 block maxima from the bytes (two per MXFP8
    block), the values decoded into an fp32 scratch that stays in the L2 cache, then NVFP4's own
    encoder (_jit.nvfp4_from_mxfp8), on nvfp4's chunking and threads."""
    def blocks(b0: int, b1: int, s2f, out, scratch) -> int:  # b0, b1 even: whole 32-blocks
        return _jit.nvfp4_from_mxfp8(q[b0 * 16: b1 * 16], e8[b0 // 2: b1 // 2], s2f, rel, _E4M3_TO_F32, *out,
                                     _buf("nv:tmp8", (_NV_CHUNK_BLOCKS * 16,), np.uint8), *scratch,
                                     _buf("nv:x", (_NV_CHUNK_BLOCKS * 16,), np.float32))
    return _nvfp4_chunks(blocks, q.size // BLOCK_SIZE, s2, name)


@transcoder("mxfp8", "nvfp4")
def nvfp4_from_mxfp8(tensors: Mapping[str, torch.Tensor], source: Format, target: Format, *,
                     input_amax: float | None = None, name: str = "",
                     encoder: str = "modelopt") -> dict[str, torch.Tensor] | None:
    """NVFP4 of an MXFP8 release's weight on CPU, its bytes read once: the global amax from the
    blocks of the largest exponents (`mxfp8.amax_before_reading`, exact), then each chunk decoded
    and quantized while it is in the cache, no fp32 copy of the weight made (85 MB for a
    [4608, 4608] w13). Bit-identical to quantizing the dequantized weight, and to ModelOpt's NVFP4
    of it (tests/test_formats.py). None off the CPU."""
    if tensors["weight"].device.type != "cpu":
        return None
    q, e8, shape = stored_bytes(tensors)
    g = amax_before_reading(q, e8)
    if not np.isfinite(g):
        raise _nonfinite(name)
    release = target.encoder_rule(encoder) != "modelopt"
    rel = release_rule(g, RELEASE_DENOMINATOR, name) if release else _MODELOPT
    s2 = _global_scale(g, name, RELEASE_DENOMINATOR if release else GLOBAL_DIV)
    packed, scale = _nvfp4_blocks_from_mxfp8(q, e8, s2, rel, name)
    out = _tensors(shape, packed, scale, s2, input_amax, name)
    if release:
        out["weight_amax"] = torch.tensor(g, dtype=torch.float32)
    return out
