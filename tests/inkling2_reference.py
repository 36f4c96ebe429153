"""Tiny Inkling 2 checkpoints written by transformers' own code (the reference for names, shapes
and dtypes). Needs transformers >= 5.24 (models/inkling2); tests skip without it."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

inkling2 = pytest.importorskip("transformers.models.inkling2", reason="transformers >= 5.24 has models/inkling2")


def tiny_config(**text):
    """Every dimension distinct where the layout derives a shape from it (heads x head_dim is
    not hidden, full and sliding layers differ, kv heads x kernel is no other size), so a rule
    that picks the wrong dimension shows as a shape mismatch."""
    t = dict(vocab_size=160, unpadded_vocab_size=150, hidden_size=96, num_hidden_layers=4,
             layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid"],
             num_attention_heads=3, num_key_value_heads=1, head_dim=40,
             swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=24,
             sliding_window_size=20, rel_extent=28, d_rel=8, conv_kernel_size=3,
             n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
             n_layers_per_attn_res_block=2, max_position_embeddings=512, eos_token_id=148)
    t.update(text)
    vision = inkling2.Inkling2VisionConfig(
        hidden_size=32, intermediate_size=80, num_hidden_layers=2, num_attention_heads=2, patch_size=4,
        posemb_grid_size=3, projection_hidden_dim=48, projector_bias=True, text_hidden_size=t["hidden_size"])
    return inkling2.Inkling2Config(text_config=inkling2.Inkling2TextConfig(**t), vision_config=vision,
                                   image_token_id=149)


def save_tiny(out: Path, config=None, seed: int = 0) -> Path:
    """`Inkling2ForConditionalGeneration(config).save_pretrained(out)` in bf16 (its fp32 modules
    stay fp32), with the zero-initialized parameters randomized so values are non-trivial."""
    torch.manual_seed(seed)
    model = inkling2.Inkling2ForConditionalGeneration._from_config(config or tiny_config(), dtype=torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("static_weight", ".query")) or "conv1d" in name:
                p.normal_(0.0, 0.02)
    model.save_pretrained(out)
    return out


def per_expert(sd: dict[str, torch.Tensor], inter: int) -> dict[str, torch.Tensor]:
    """A transformers state dict with each stacked expert tensor split into ModelOpt's per-expert
    modules (gate_up_proj [E, 2I, H]: gate rows then up rows, modeling_inkling2.py:809, 836)."""
    out = {}
    for k, v in sd.items():
        if k.endswith(".mlp.experts.gate_up_proj"):
            for e in range(v.shape[0]):
                out[k.replace("gate_up_proj", f"{e}.gate_proj.weight")] = v[e, :inter].clone()
                out[k.replace("gate_up_proj", f"{e}.up_proj.weight")] = v[e, inter:].clone()
        elif k.endswith(".mlp.experts.down_proj"):
            for e in range(v.shape[0]):
                out[k.replace("down_proj", f"{e}.down_proj.weight")] = v[e].clone()
        else:
            out[k] = v
    return out


def save_like(sd: dict[str, torch.Tensor], like: Path, out: Path) -> Path:
    """`sd` as one safetensors file beside `like`'s config files (what a training script writes)."""
    import shutil

    from safetensors.torch import save_file

    out.mkdir()
    for f in like.glob("*.json"):
        if not f.name.endswith("index.json"):
            shutil.copyfile(f, out / f.name)
    save_file({k: v.contiguous() for k, v in sd.items()}, out / "model.safetensors", metadata={"format": "pt"})
    return out
