"""What a checkpoint tensor is, for every layout: `TensorName` (a name parsed by a layout's
classify: part, layer, expert, projection, suffix) and `TensorSpec` (name, shape, dtype)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TensorName:
    """What a checkpoint tensor is. `module` is the name without its last component."""

    name: str
    part: str                 # what it is: "expert", "attention", "router", ... (layout.classify, inkling2.classify)
    layer: int | None = None  # decoder layer, vision block or draft layer
    expert: int | None = None
    projection: str | None = None
    suffix: str = "weight"    # weight, bias, weight_scale, weight_scale_2, input_scale, ...

    @property
    def module(self) -> str:
        return self.name[: -len(self.suffix) - 1] if self.name.endswith("." + self.suffix) else self.name

    @property
    def is_expert(self) -> bool:
        return self.part == "expert"


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize
