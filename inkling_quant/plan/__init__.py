"""Planning a vLLM deployment (`inkling-quant plan`; docs/budget.md): parameters, bytes on disk,
weights and KV cache per GPU, MoE divisibility, whether it fits.

`inkling2` plans Inkling 2 (the official checkpoints: `VARIANTS`) and, through `hf`, a standard
Hugging Face MoE config; `placement` (TP/EP splits, the `Weights` tally), `kvcache` (vLLM's
KV-cache allocation), `moe_checks` (what vLLM's MoE kernels need of the experts on a GPU
generation) and `units` are what both plans share; `variants` reads which official checkpoint a
directory holds and sets SGLang's cookbook's figures beside ours; `cli.plan` is the command. The
names below are the public API. Importing them is cheap (torch comes in where a plan computes), so `plan --help` answers at once.

Sources cited by file and line are vLLM 0.33.0 (paths under its `vllm/` package) and
transformers 5.25.0 unless a docstring names another; docs/budget.md gives the full paths."""
from __future__ import annotations

from .hf import HFModel, is_hf_moe
from .inkling2 import GPU, GPUS, VARIANTS, ServingPlan, Variant, load_config, plan, recipe_rows
from .kvcache import KVLayout, KVSpec
from .moe_checks import ARCHS, Check, moe_checks
from .placement import Weights
from ..units import GB, GiB
from .units import in_units
from .variants import choose_variant, cookbook_rows, stored_variant

__all__ = ["ARCHS", "GB", "GPU", "GPUS", "Check", "GiB", "HFModel", "KVLayout", "KVSpec", "ServingPlan", "VARIANTS",
           "Variant", "Weights", "choose_variant", "cookbook_rows", "in_units", "is_hf_moe", "load_config", "moe_checks",
           "plan", "recipe_rows", "stored_variant"]
