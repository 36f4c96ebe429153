"""Planning a vLLM deployment (`inkling-quant plan`; docs/budget.md): parameters, bytes on disk,
weights and KV cache per GPU, MoE divisibility, whether it fits.

`inkling2` plans Inkling 2 and, through `hf`, a standard Hugging Face MoE config; `placement`
(TP/EP splits, the `Weights` tally), `kvcache` (vLLM's KV-cache allocation), `moe_checks` and
`units` are what both plans share; `cli` is the command. The names below are the public API.
Importing them is cheap (torch comes in where a plan computes), so `plan --help` answers at once.

Sources cited by file and line are vLLM 0.33.0 (paths under its `vllm/` package) and
transformers 5.25.0 unless a docstring names another; docs/budget.md gives the full paths."""
from __future__ import annotations

from .hf import HFModel, is_hf_moe
from .inkling2 import GPU, GPUS, ServingPlan, load_config, plan, recipe_rows
from .kvcache import KVLayout, KVSpec
from .moe_checks import Check, moe_checks
from .placement import Weights
from ..units import GB, GiB
from .units import in_units

__all__ = ["GB", "GPU", "GPUS", "Check", "GiB", "HFModel", "KVLayout", "KVSpec", "ServingPlan", "Weights", "in_units",
           "is_hf_moe", "load_config", "moe_checks", "plan", "recipe_rows"]
