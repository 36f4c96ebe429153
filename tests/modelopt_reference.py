"""A tiny Inkling 2 quantized and exported by NVIDIA ModelOpt itself (the reference for the
per-expert tensors and values ModelOpt writes), and ModelOpt's own dequantization of them.

`export_tiny(out)`: transformers builds the tiny model of tests/inkling2_reference.py (I = 64 so
MXFP8's 32-blocks divide both expert dims), `mtq.quantize` with NVFP4 routed experts (weights
and a static input scale, `NVFP4_EXPERTS_ONLY_CFG`) in every layer but the last and MXFP8 in the
last, calibrated on a few random batches (fixed seeds), then `export_hf_checkpoint`. CPU, ~10 s.

ModelOpt 0.47 on CPU needs one workaround: `export_hf_checkpoint` raises
`TypeError: 'NoneType' object is not iterable` in `modelopt/torch/export/model_utils.py:112`
(`is_multimodal_model` iterates `config.architectures`, which `_from_config` leaves None), so we
set `config.architectures`. It also warns that it skips the reverse weight conversion
(`Inkling2UnpadVocab`, unsupported) and so writes the in-memory names
(`model.language_model.layers.N.mlp.experts.E.{gate,up,down}_proj.*`), which is what we read.
"""
from __future__ import annotations

import copy
import warnings
from pathlib import Path

import torch

from inkling2_reference import inkling2, tiny_config

MODULES = ("gate_proj", "up_proj", "down_proj")
MXFP8_CFG = {"num_bits": (4, 3), "block_sizes": {-1: 32, "type": "dynamic", "scale_bits": (8, 0)}}


def tiny_modelopt_config():
    return tiny_config(moe_intermediate_size=64)


def quant_config(mxfp8_layers, experts: str = "*layers.{i}.mlp.experts*"):
    """ModelOpt's experts-only NVFP4 config with MXFP8 for the routed experts of `mxfp8_layers`
    (`experts`: the pattern of a layer's routed experts' quantizer names)."""
    import modelopt.torch.quantization as mtq

    cfg = copy.deepcopy(mtq.NVFP4_EXPERTS_ONLY_CFG)
    for i in mxfp8_layers:
        for q in ("weight_quantizer", "input_quantizer"):
            cfg["quant_cfg"].append({"quantizer_name": experts.format(i=i) + f"{q}*", "cfg": MXFP8_CFG})
    return cfg


def export_tiny(out: Path, seed: int = 0, batches: int = 3, seq: int = 24, source: Path | None = None,
                mxfp8_last: bool = True) -> Path:
    """Quantize the tiny Inkling 2 with ModelOpt (NVFP4 experts, MXFP8 in the last layer unless
    not `mxfp8_last`) and export it to `out` with `export_hf_checkpoint`; with `source`, the BF16
    model is first saved there by transformers' save_pretrained (the original layout our
    converter reads)."""
    cfg = tiny_modelopt_config()
    torch.manual_seed(seed)
    model = inkling2.Inkling2ForConditionalGeneration._from_config(cfg, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("static_weight", ".query")) or "conv1d" in name:
                p.normal_(0.0, 0.02)
    model.config.architectures = [type(model).__name__]  # see the module doc (TypeError otherwise)
    if source is not None:  # on a copy: save_pretrained turns config.dtype into a string ModelOpt's export
        copy.deepcopy(model).save_pretrained(source)  # then passes to Tensor.to ("Invalid device string")
    g = torch.Generator().manual_seed(seed + 1)
    ids = [torch.randint(0, cfg.text_config.unpadded_vocab_size - 2, (1, seq), generator=g) for _ in range(batches)]
    mxfp8 = [cfg.text_config.num_hidden_layers - 1] if mxfp8_last else []
    return quantize_and_export(model, quant_config(mxfp8), ids, out)


def quantize_and_export(model, config: dict, ids: list[torch.Tensor], out: Path, **export_args) -> Path:
    """ModelOpt's own `mtq.quantize` (calibrated on the batches `ids`) and `export_hf_checkpoint`
    (`export_args`: its other arguments, such as max_shard_size)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import modelopt.torch.quantization as mtq
        from modelopt.torch.export import export_hf_checkpoint

    def forward_loop(m):
        with torch.no_grad():
            for x in ids:
                m(input_ids=x)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = mtq.quantize(model, config, forward_loop)
        export_hf_checkpoint(model, export_dir=str(out), **export_args)
    return out


def read_tensors(root: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a directory's safetensors files, by name (a checkpoint or an export)."""
    from safetensors.torch import load_file

    return {k: v for f in sorted(Path(root).glob("*.safetensors")) for k, v in load_file(f).items()}


def layer_experts(sd: dict[str, torch.Tensor], layer: int) -> list[dict[str, dict[str, torch.Tensor]]]:
    """ModelOpt's per-expert tensors of one layer: [expert] -> module -> suffix -> tensor."""
    prefix = f"model.language_model.layers.{layer}.mlp.experts."
    out: dict[int, dict[str, dict[str, torch.Tensor]]] = {}
    for k, v in sd.items():
        if k.startswith(prefix):
            e, mod, suffix = k[len(prefix):].split(".", 2)
            out.setdefault(int(e), {}).setdefault(mod, {})[suffix] = v
    return [out[e] for e in range(len(out))]


def modelopt_dequantize(t: dict[str, torch.Tensor]) -> torch.Tensor:
    """ModelOpt's own dequantization (fp32) of one exported module: `NVFP4QTensor.dequantize`
    (e2m1 x (weight_scale x weight_scale_2)) or `MXFP8QTensor.dequantize` (e4m3 x 2^(e - 127))."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from modelopt.torch.quantization.qtensor import MXFP8QTensor, NVFP4QTensor

    w = t["weight"]
    if w.dtype == torch.uint8:  # NVFP4: two e2m1 codes per byte
        shape = torch.Size((*w.shape[:-1], w.shape[-1] * 2))
        return NVFP4QTensor(shape, torch.float32, w).dequantize(
            dtype=torch.float32, scale=t["weight_scale"], double_scale=t["weight_scale_2"], block_sizes={-1: 16})
    return MXFP8QTensor(w.shape, torch.float32, w).dequantize(dtype=torch.float32, scale=t["weight_scale"])
