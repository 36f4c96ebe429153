"""GEMM kernels on quantized expert weights (NVFP4 / MXFP8, ModelOpt HF export layout): dense,
grouped over the experts of a layer, and the fused MoE layer (gate_up, gated activation, down,
top-k combine).

``inkling_kernels``, the repository's top-level ``kernels/``: a package of its own, which imports
nothing of inkling_quant (inkling_quant's verify imports it). See docs/kernels.md.
"""
from __future__ import annotations

from . import reference
from .dequant_gemm import (
    DECODE_MAX_M,
    PATH_BF16_MMA,
    PATH_INTERPRETER,
    PATH_REFERENCE,
    PATH_SM100,
    PATH_SPLITK,
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
from .errors import KernelError
from .fused_moe import fused_moe, moe_align_block_size, mxfp8_fused_moe, nvfp4_fused_moe
from .launch_table import LaunchConfig, launch_config

__all__ = [
    "DECODE_MAX_M", "KernelError", "LaunchConfig", "PATHS", "PATH_BF16_MMA", "PATH_INTERPRETER", "PATH_REFERENCE", "PATH_SM100",
    "PATH_SPLITK", "backend", "backend_note", "fused_moe", "launch_config", "moe_align_block_size", "moe_tile_map",
    "mxfp8_dequant_gemm", "mxfp8_fused_moe", "mxfp8_grouped_gemm", "nvfp4_dequant_gemm", "nvfp4_fused_moe",
    "nvfp4_grouped_gemm", "path_for", "reference", "select_path", "tile_config",
]
