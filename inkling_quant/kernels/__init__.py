"""GEMM kernels on quantized expert weights (NVFP4 / MXFP8, ModelOpt HF export layout).

``inkling_quant.kernels``. See docs/kernels.md.
"""
from __future__ import annotations

from . import reference
from .dequant_gemm import (
    PATH_BF16_MMA,
    PATH_INTERPRETER,
    PATH_REFERENCE,
    PATH_SM100,
    PATHS,
    backend,
    backend_note,
    moe_tile_map,
    mxfp8_dequant_gemm,
    mxfp8_grouped_gemm,
    nvfp4_dequant_gemm,
    nvfp4_grouped_gemm,
    path_for,
    select_path,
    tile_config,
)

__all__ = [
    "PATHS", "PATH_BF16_MMA", "PATH_INTERPRETER", "PATH_REFERENCE", "PATH_SM100",
    "backend", "backend_note", "moe_tile_map", "mxfp8_dequant_gemm", "mxfp8_grouped_gemm",
    "nvfp4_dequant_gemm", "nvfp4_grouped_gemm", "path_for", "reference", "select_path",
    "tile_config",
]
