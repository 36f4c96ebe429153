"""The model's own forward, layer by layer from the shards (used by calibrate and eval):
weights.py reads a checkpoint's tensors as transformers' modules hold them, forward.py runs
transformers' Inkling 2 modules one decoder layer at a time, the routed experts expert by expert."""
from __future__ import annotations

from .forward import Context, Engine, Experts, MicroBatch, Observer, Routed, build_layer, post_moe, pre_moe, text_config
from .weights import ExpertWeights, Weights

__all__ = ["Context", "Engine", "ExpertWeights", "Experts", "MicroBatch", "Observer", "Routed", "Weights",
           "build_layer", "post_moe", "pre_moe", "text_config"]
