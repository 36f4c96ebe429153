"""One merge target and the merge of one weight (planned by plan.py, merged by merge.py).

A target is one checkpoint tensor. An attention projection (or other nn.Linear) is one tensor
per adapter module. A routed-expert parameter (PEFT's `target_parameters`, a ParamWrapper whose
factors stack one rank-r pair per expert) lands wherever the layout keeps its experts: a stacked
[E, ...] tensor merged one expert slice at a time (`sliced`), or one 2-D tensor per expert and
projection (`expert`; transformers' gate_up_proj rows [gate; up] split in `half`s). Either way
the checkpoint holds each expert as transformers does in memory, [out, in]: the layout the
ParamWrapper's delta has."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..io.safetensors import DTYPE_NAMES

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Piece:
    """Where (part of) an adapter module's delta goes: a checkpoint tensor, as the layout names
    and stores it (the layout's naming builds these; plan.py checks and plans them)."""

    tensor: str
    experts: int | None = None   # a per-expert tensor: the expert count E (B's columns stride); a stack: its shape[0]
    expert: int | None = None    # a per-expert 2-D tensor: its expert; None: a stack [E, ...] or a Linear
    half: int | None = None      # gate_up_proj into separate gate (0) / up (1) tensors: that half of B's rows
    interleaved: bool = False    # a stack whose rows interleave gate/up (Inkling's w13: 2j gate j, 2j+1 up j)


@dataclass(frozen=True)
class Target:
    module: str
    part: str           # the layout's part: "attention", "expert", ...
    layer: int
    tensor: str         # the checkpoint tensor merged into, as the checkpoint names it
    shard: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    rank: int
    alpha: float
    scaling: float      # PEFT's scaling (alpha/r or alpha/sqrt(r))
    scale: float        # scaling * --scale: what multiplies B @ A
    factors: str | None = None  # the adapter's module holding lora_A/lora_B, when not `module`
    param: str | None = None    # the expert parameter (PEFT target_parameters), None for a Linear
    experts: int = 1            # expert parameters: E, the ParamWrapper's factor count
    expert: int | None = None   # (Piece's fields)
    half: int | None = None
    interleaved: bool = False

    @property
    def adapter_module(self) -> str:
        return self.factors or self.module

    @property
    def sliced(self) -> bool:
        """A stacked expert tensor, merged one expert slice at a time."""
        return self.param is not None and self.expert is None

    @property
    def delta_shape(self) -> tuple[int, int]:
        """[out, in] of the delta B @ A this tensor takes (per expert for an expert parameter)."""
        if self.param is None:
            return tuple(self.shape)
        if self.expert is not None:
            return (self.shape[0] * (1 if self.half is None else 2), self.shape[1])
        return tuple(self.shape[1:])

    def row(self) -> dict:
        return {"module": self.module, "part": self.part, "tensor": self.tensor, "shard": self.shard, "shape": list(self.shape),
                "dtype": DTYPE_NAMES[self.dtype], "rank": self.rank, "alpha": self.alpha,
                "scaling": self.scaling, "scale": self.scale}


def merged_weight(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """W + scale * (B @ A), computed in FP32 and rounded once (to nearest even) to W's dtype.

    The same operations, in the same order, as PEFT's merge with FP32 adapter weights
    (`get_delta_weight`: (B @ A) * scaling in FP32; then `weight.data += delta`, which adds in FP32
    and rounds once), so the bits match PEFT's `merge_and_unload()` exactly. (PEFT's ParamWrapper,
    the routed experts, casts the delta to BF16 before adding: two roundings, at most one ulp
    from this; docs/lora.md.)"""
    delta = b.float() @ a.float()
    delta.mul_(scale)
    delta.add_(w)  # FP32 += BF16: the weight is widened exactly, the sum is FP32
    return delta.to(w.dtype)


def interleave_rows(b: torch.Tensor) -> torch.Tensor:
    """Rows [gate; up] (transformers' gate_up_proj) as Inkling's w13 stores them,
    [gate_0, up_0, gate_1, up_1, ...]."""
    half = b.shape[0] // 2
    return b.reshape(2, half, *b.shape[1:]).transpose(0, 1).reshape(b.shape)


def merged_expert(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, tgt: Target, i: int) -> torch.Tensor:
    """Expert i's weight `w` (a stack's slice or a per-expert tensor) with its delta merged:
    PEFT's ParamWrapper gives expert i the factors A[i*r:(i+1)*r] and B[:, i::E]. Selecting,
    or permuting B's rows is no arithmetic, so it adds no rounding."""
    r = tgt.rank
    a_i, b_i = a[i * r:(i + 1) * r], b[:, i::tgt.experts]
    if tgt.half is not None:
        n = b_i.shape[0] // 2
        b_i = b_i[tgt.half * n:(tgt.half + 1) * n]
    if tgt.interleaved:
        b_i = interleave_rows(b_i)
    return merged_weight(w, a_i, b_i, tgt.scale)
