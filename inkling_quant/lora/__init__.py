"""LoRA: merge a PEFT adapter into the BF16 attention projections (and BF16 routed experts) of a checkpoint.

  inkling-quant lora check CKPT ADAPTER          what would be merged where (module, shard,
                                                 rank, alpha, scale); writes nothing
  inkling-quant lora merge CKPT ADAPTER OUT      OUT = CKPT with W' = W + scale * B @ A merged
                                                 into every module the adapter targets

CKPT is a converted checkpoint (NVFP4/MXFP8 routed experts, BF16 attention; ours or ModelOpt's
export) or a BF16 source: Inkling 2 (inkling2.py) or a Hugging Face MoE family (layout.py:
Qwen3-MoE, Mixtral, DeepSeek-V3, Qwen3-VL-MoE, ...). ADAPTER is a PEFT LoRA adapter directory
(adapter_config.json + adapter_model.safetensors) or a hub repo id org/name[@revision], as PEFT
writes it for the transformers model, routed experts via target_parameters (lora/plan.py: which
module merges where; lora/inkling.py and lora/hf.py: the layouts' names). The merge is computed
in FP32 and rounded once to the stored dtype. Routed-expert adapters are merged only where the
experts are BF16 (a source, before conversion): "expert adapters need BF16 expert weights". Only shards holding
a merged tensor are rewritten; the others are hardlinked (or copied). OUT is built in
OUT.partial and renamed into place when complete. docs/lora.md has the workflow and the
reasons for every refusal.
"""
from __future__ import annotations

from ..io.output import read_checksums
from .merge import DTYPES, PROVENANCE_KEY, QUANT_CONFIG, Plan, Target, check, merge, merged_config, merged_weight
from .peft import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, PATTERN_TIMEOUT_S, PEFT_PREFIX, Adapter, AdapterConfig,
                   open_adapter, resolve_adapter)
from .inkling import MERGEABLE_PARTS

# The library API, as `inkling_quant.lora` offered it when it was one module (read_checksums too:
# callers and tests read OUT's checksums through it).
__all__ = [
    "ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "DTYPES", "MERGEABLE_PARTS", "PATTERN_TIMEOUT_S", "PEFT_PREFIX",
    "PROVENANCE_KEY", "QUANT_CONFIG", "Adapter", "AdapterConfig", "Plan", "Target", "check",
    "merge", "merged_config", "merged_weight", "open_adapter", "read_checksums", "resolve_adapter",
]
