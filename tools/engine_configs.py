#!/usr/bin/env python
"""What SGLang 0.5.23's own config parsers make of a checkpoint's quantization config (issue 26):
run in a scratch venv that has SGLang, never in ours or in CI (SGLang pins another transformers).

    python -m venv /tmp/venv-sg && . /tmp/venv-sg/bin/activate
    pip install torch==2.13.0                       # the CPU build first
    pip install --no-deps sglang==0.5.23 apache-tvm-ffi==0.1.11
    pip install -c <(echo torch==2.13.0) transformers==5.19.0 huggingface_hub numpy pydantic requests \\
        packaging psutil regex orjson msgspec einops tqdm pybase64 setproctitle pyzmq triton zstandard \\
        pillow scipy starlette IPython aiohttp dill sentencepiece gguf loguru
    pip install --no-deps torchvision==0.28.0 compressed-tensors==0.18.0
    python tools/engine_configs.py CKPT [CKPT ...] [--json OUT]

Two parsers, each as the engine calls it, on the checkpoint's config.json `quantization_config`
(read first, as both do) or else its hf_quant_config.json:
  inkling  srt/models/inkling_common/quantization/config.py `get_quantization_config` (the first
           Inkling generation's loader: reads `modelopt_quant_config.quant_cfg["*weight_quantizer"]`);
  generic  srt/configs/model_config.py `ModelConfig._parse_quant_hf_config` (the quant_method any
           other model gets; Inkling falls back to it where the first returns None).
Prints what each returned, or the exception it raised. torchvision 0.28 from PyPI is a CUDA build
whose ops cannot load beside CPU torch: the two op schemas its meta registrations need are
defined before SGLang is imported."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace


def _boot() -> None:
    import torch
    lib = torch.library.Library("torchvision", "DEF")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _boot.lib = lib  # keep the registration alive


def inkling(ckpt: Path, qc: dict | None) -> dict:
    from sglang.srt.models.inkling_common.quantization import config as C
    from sglang.srt.runtime_context import get_parallel
    mc = SimpleNamespace(hf_config=SimpleNamespace(quantization_config=qc, text_config=None), model_path=str(ckpt))
    with get_parallel().override(moe_ep_size=1):
        q = C.get_quantization_config(mc)
    if q is None:
        return {"returned": None}
    return {"returned": type(q).__name__, "group_size": q.group_size, "scales_2d": q.dim1_group_size != 1,
            "exclude_modules": sorted(q.exclude_modules),
            "excluded": {p: q.exclude_layer(p) for p in ("llm.layers.0.attn.qkv", "llm.layers.0.mlp.experts",
                                                           "llm.layers.0.mlp.gate", "lm_head", "visual.blocks.0")}}


def generic(ckpt: Path, qc: dict | None) -> dict:
    from sglang.srt.configs.model_config import ModelConfig
    me = SimpleNamespace(hf_config=SimpleNamespace(quantization_config=qc), model_path=str(ckpt))
    me._parse_modelopt_quant_config = lambda d: ModelConfig._parse_modelopt_quant_config(me, d)
    got = ModelConfig._parse_quant_hf_config(me)
    return {"returned": {k: got.get(k) for k in ("quant_method", "quant_algo", "weight_block_size", "scale_fmt")}
            if isinstance(got, dict) else got}


def run(ckpt: Path) -> dict:
    qc = json.loads((ckpt / "config.json").read_text()).get("quantization_config")
    out = {}
    for name, parser in (("inkling", inkling), ("generic", generic)):
        try:
            out[name] = parser(ckpt, qc)
        except Exception as e:  # noqa: BLE001 - what the engine raises is the finding
            out[name] = {"raised": f"{type(e).__name__}: {e}"}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("checkpoints", nargs="+", type=Path)
    p.add_argument("--json", metavar="OUT", help="write the results as JSON")
    args = p.parse_args()
    _boot()
    import sglang
    results = {"sglang": sglang.__version__, "checkpoints": {}}
    for ckpt in args.checkpoints:
        results["checkpoints"][str(ckpt)] = r = run(ckpt)
        print(f"== {ckpt}")
        for name, got in r.items():
            print(f"  {name}: {json.dumps(got)}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    sys.exit(0)


if __name__ == "__main__":
    main()
