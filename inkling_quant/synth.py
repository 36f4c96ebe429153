"""Write a synthetic Inkling-2-Small-shaped BF16 checkpoint from the layout spec.

The published model's layout (inkling_quant.model.inkling2: the names, shapes and dtypes
`Inkling2ForConditionalGeneration.save_pretrained` writes, stacked experts), plus a DSpark
draft named as vLLM's drafter loads it (inkling_quant.model.dspark), in the release's files
(docs/layout.md "Files"): one shard per decoder layer (`model-0000k-of-000NN.safetensors`, a
layer's cut further only by an explicit --max-shard-size), the vision tower in
`vision.safetensors`, the draft in `mtp.safetensors`, every file listed in the index.

Presets: `tiny` keeps all 48 layers with toy dimensions (seconds to make, for tests and the
demo); `bench` keeps the reference config's real expert and attention shapes with fewer layers
and experts (and a small vocabulary and vision/draft depth, since those pass through), so
benchmarks see real tensor sizes. Values are deterministic per (seed, tensor name): a scaled
Gaussian with a few outlier rows and outlier elements, as trained weights have. Generation
streams: one tensor in memory at a time, one expert of a stacked expert tensor.
"""
from __future__ import annotations

import json
import zlib
from pathlib import Path

import torch
from tqdm import tqdm

from .errors import UsageError
from .io.checkpoint import INDEX_NAME, copy_file_atomic, write_index, write_json_atomic
from .io.output import staged_output
from .io.safetensors import ShardWriter
from .io.shards import plan_files
from .model import dspark, inkling2
from .model.tensors import TensorSpec

FILES = Path(__file__).parent / "configs" / "files"  # tokenizer, chat template, ... (tiny stand-ins)

# Presets: overrides of text_config / vision_config of the reference config (configs/inkling-2-small.json).
PRESETS: dict[str, dict] = {
    "tiny": {
        "text_config": {"vocab_size": 512, "unpadded_vocab_size": 500, "hidden_size": 64,
                        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                        "swa_num_attention_heads": 4, "swa_num_key_value_heads": 2, "swa_head_dim": 16,
                        "sliding_window_size": 128, "rel_extent": 128, "d_rel": 8, "n_routed_experts": 4,
                        "num_experts_per_tok": 2, "moe_intermediate_size": 96, "max_position_embeddings": 4096,
                        "eos_token_id": 498},
        "vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                          "num_attention_heads": 2, "patch_size": 4, "posemb_grid_size": 4,
                          "projection_hidden_dim": 64, "text_hidden_size": 64},
        "image_token_id": 499,
    },
    "bench": {  # real expert (4608 x 2304) and attention shapes
        "text_config": {"num_hidden_layers": 6, "n_routed_experts": 4, "num_experts_per_tok": 2,
                        "vocab_size": 16384, "unpadded_vocab_size": 16000, "eos_token_id": 15998},
        "vision_config": {"num_hidden_layers": 1},
        "image_token_id": 15999,
    },
}
# The bundled DSpark draft's own choices per preset (dspark.DRAFT_DEFAULTS otherwise); its
# target-derived dimensions follow text_config (docs/draft.md)
DRAFT_PRESETS: dict[str, dict] = {
    "tiny": {"markov_rank": 16},
    "bench": {"num_hidden_layers": 1},
}


def make_config(preset: str, layers: int | None = None, experts: int | None = None,
                         draft: bool = True) -> dict:
    """config.json of the published model (Inkling2Config's keys) for a preset, with a bundled
    DSpark draft (`dspark_config`, our naming: docs/draft.md) unless `draft` is false."""
    if preset not in PRESETS:
        raise UsageError(f"unknown preset {preset!r}; known: {', '.join(PRESETS)}")
    cfg = json.loads(inkling2.REFERENCE_CONFIG.read_text())
    for k, v in PRESETS[preset].items():
        cfg[k] = {**cfg[k], **v} if isinstance(v, dict) else v
    text = cfg["text_config"]
    if layers is not None:
        text["num_hidden_layers"] = layers
    if experts is not None:
        text["n_routed_experts"] = experts
        text["num_experts_per_tok"] = min(text["num_experts_per_tok"], experts)
    text["layer_types"] = inkling2.default_layer_types(text["num_hidden_layers"])
    if draft:
        target = inkling2.Inkling2Config.from_dict(cfg, f"preset {preset}").text
        cfg[dspark.CONFIG_KEY] = dspark.make_draft_config(target, text, DRAFT_PRESETS.get(preset))
    return cfg


# norm modules, whose weights sit around 1 (LayerNorm biases stay near 0): the text model's,
# the vision tower's and the draft's
_NORMS = {"norm", "embed_norm", "attn_norm", "mlp_norm", "q_input_norm", "k_input_norm", "v_input_norm",
          "ln_1", "ln_2", "ln_pre", "q_norm", "k_norm", "hidden_norm", "input_layernorm", "post_attention_layernorm"}


def _is_stacked(spec: TensorSpec) -> bool:
    """A stacked routed-expert tensor [E, out, in]."""
    return ".mlp.experts.w" in spec.name and len(spec.shape) == 3


def synth_tensor(spec: TensorSpec, seed: int) -> torch.Tensor:
    """Deterministic realistic values for one tensor, independent of generation order."""
    g = torch.Generator().manual_seed((zlib.crc32(spec.name.encode()) << 16) ^ seed)
    stacked = ".mlp.experts.w" in spec.name  # an expert's [out, in] (or a stack of them): rows are matrix rows
    module, _, leaf = spec.name.rpartition(".")
    last = module.rpartition(".")[2]
    if last in _NORMS and leaf == "weight":
        x = 1.0 + 0.05 * torch.randn(spec.shape, generator=g)
    elif len(spec.shape) == 1:
        x = 0.02 * torch.randn(spec.shape, generator=g)
    else:
        fan_in = 1
        for s in (spec.shape[-1:] if stacked else spec.shape[1:]):
            fan_in *= s
        x = torch.randn(spec.shape, generator=g).mul_(fan_in ** -0.5)
        rows = x.reshape(-1, spec.shape[-1]) if stacked else x.reshape(spec.shape[0], -1)
        n_out_rows = max(1, rows.shape[0] // 100)  # ~1% outlier rows, x8
        idx = torch.randint(0, rows.shape[0], (n_out_rows,), generator=g)
        rows[idx] *= 8.0
        n_spikes = max(1, rows.numel() // 50_000)  # rare single-element spikes, x40
        flat = rows.reshape(-1)
        flat[torch.randint(0, flat.numel(), (n_spikes,), generator=g)] *= 40.0
    return x.to(spec.dtype)


SEED_MAX = 2**32 - 1


def write_checkpoint(out: str | Path, preset: str = "tiny", seed: int = 0, layers: int | None = None,
                     experts: int | None = None, max_shard_bytes: int | None = None,
                     progress: bool = False, overwrite: bool = False) -> Path:
    """Built in OUT.partial and renamed at the end (`staged_output`): a killed synth leaves
    nothing that looks complete. The release's files (`inkling2.release_file`); with
    `max_shard_bytes`, a layer's shard over it is cut further."""
    out = Path(out)
    if not 0 <= seed <= SEED_MAX:
        raise UsageError(f"--seed must be between 0 and {SEED_MAX}, got {seed}")
    cfg_dict = make_config(preset, layers, experts)
    cfg = inkling2.Inkling2Config.from_dict(cfg_dict, f"preset {preset}")
    specs = list(inkling2.checkpoint_tensors(cfg))
    files = plan_files(specs, lambda s: inkling2.release_file(cfg.text, s.name), max_shard_bytes)
    weight_map = {}
    total = sum(s.nbytes for s in specs)
    with staged_output(out, (), overwrite) as tmp, \
            tqdm(total=total, unit="B", unit_scale=True, desc="synth", disable=not progress) as bar:
        for name, shard in files:
            with ShardWriter(tmp / name, [(s.name, s.dtype, s.shape) for s in shard], {"format": "pt"}) as w:
                for s in shard:
                    if _is_stacked(s):  # expert by expert: a real-size stack is tens of GB
                        for e in range(s.shape[0]):
                            w.write_part(s.name, synth_tensor(TensorSpec(f"{s.name}.{e}", s.shape[1:], s.dtype), seed))
                    else:
                        w.write(s.name, synth_tensor(s, seed))
                    weight_map[s.name] = name
                    bar.update(s.nbytes)
                w.commit()
        write_index(tmp / INDEX_NAME, weight_map, total)
        write_json_atomic(tmp / "config.json", cfg_dict)
        for f in sorted(FILES.iterdir()):
            copy_file_atomic(f, tmp / f.name)
    return out
