"""One merge target and the merge of one weight (planned by published.py, merged by merge.py)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..io.safetensors import DTYPE_NAMES

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Target:
    module: str
    part: str           # "attention" or "expert"
    layer: int
    tensor: str         # the checkpoint tensor merged into: its original name (inkling2.original_name
    #                     of the module's transformers name)
    shard: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    rank: int
    alpha: float
    scaling: float      # PEFT's scaling (alpha/r or alpha/sqrt(r))
    scale: float        # scaling * --scale: what multiplies B @ A
    factors: str | None = None  # the adapter's module holding lora_A/lora_B, when not `module`
    param: str | None = None    # the stacked expert parameter (PEFT target_parameters), None for a Linear

    @property
    def adapter_module(self) -> str:
        return self.factors or self.module

    def row(self) -> dict:
        return {"module": self.module, "part": self.part, "tensor": self.tensor, "shard": self.shard, "shape": list(self.shape),
                "dtype": DTYPE_NAMES[self.dtype], "rank": self.rank, "alpha": self.alpha,
                "scaling": self.scaling, "scale": self.scale}


def merged_weight(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """W + scale * (B @ A), computed in FP32 and rounded once (to nearest even) to W's dtype.

    The same operations, in the same order, as PEFT's merge with FP32 adapter weights
    (`get_delta_weight`: (B @ A) * scaling in FP32; then `weight.data += delta`, which adds in FP32
    and rounds once), so the bits match PEFT's `merge_and_unload()` exactly. (PEFT's ParamWrapper,
    the stacked experts, casts the delta to BF16 before adding: two roundings, at most one ulp
    from this; docs/lora.md.)"""
    delta = b.float() @ a.float()
    delta.mul_(scale)
    delta.add_(w)  # FP32 += BF16: the weight is widened exactly, the sum is FP32
    return delta.to(w.dtype)
