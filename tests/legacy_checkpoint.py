"""A checkpoint of the layout this project invented before Inkling 2 was published (flat
config.json, per-expert 2-D expert tensors, `g_proj`, a `dspark.*` draft), written by hand:
the commands no longer read that layout, and the tests check that they say so."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def write_legacy_checkpoint(out: Path) -> Path:
    H, inter = 64, 96
    shapes = {"model.embed_tokens.weight": (512, H), "model.layers.0.self_attn.q_proj.weight": (64, H),
              "model.layers.0.self_attn.g_proj.weight": (64, H), "model.layers.0.mlp.experts.0.gate_proj.weight":
              (inter, H), "model.layers.0.mlp.experts.0.down_proj.weight": (H, inter), "lm_head.weight": (512, H),
              "dspark.fc.weight": (H, 3 * H)}
    out.mkdir(parents=True)
    save_file({n: torch.zeros(s, dtype=torch.bfloat16) for n, s in shapes.items()}, out / "model.safetensors",
              metadata={"format": "pt"})
    config = {"architectures": ["Inkling2ForConditionalGeneration"], "model_type": "inkling2", "vocab_size": 512,
              "hidden_size": H, "num_hidden_layers": 1, "layer_types": ["sliding_attention"], "num_experts": 1,
              "moe_intermediate_size": inter,
              "dspark_config": {"num_hidden_layers": 0, "hidden_size": H, "num_target_hidden_states": 3,
                                "markov_head": {"type": "rnn", "hidden_size": H}}}
    (out / "config.json").write_text(json.dumps(config))
    return out
