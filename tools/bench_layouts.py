#!/usr/bin/env python
"""Per-expert against stacked routed experts: the same conversion on two sources of the same
size, one storing experts per expert (Qwen3-MoE: `mlp.experts.E.{gate,up,down}_proj.weight`) and
one stacked (Qwen3-VL-MoE: `mlp.experts.gate_up_proj` / `down_proj`, read one expert's slice at a
time), side by side in one run, alternating, each in its own process. Both models are built by
transformers from the same text dimensions (Qwen3-30B-A3B's expert shape, 2048 x 768, a reduced
expert and layer count) and saved by its save_pretrained; the vision tower of the stacked one is
tiny, so the two inputs differ by < 1 %.

    python tools/bench_layouts.py                      # 2 layers x 48 experts, ~0.9 GB each
    python tools/bench_layouts.py --experts 16 --repeat 1 --work-dir /tmp/bl
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEXT = dict(vocab_size=4096, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
            num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts_per_tok=8)


def build(kind: str, layers: int, experts: int, out: Path) -> None:
    import torch
    import transformers as T

    torch.manual_seed(0)
    if kind == "per_expert":
        cfg = T.Qwen3MoeConfig(**TEXT, num_hidden_layers=layers, num_experts=experts)
        model = T.Qwen3MoeForCausalLM(cfg)
    else:
        cfg = T.Qwen3VLMoeConfig(text_config=dict(**TEXT, num_hidden_layers=layers, num_experts=experts),
                                 vision_config=dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2,
                                                    out_hidden_size=2048, deepstack_visual_indexes=[0]))
        model = T.Qwen3VLMoeForConditionalGeneration(cfg)
    model.to(torch.bfloat16).save_pretrained(out, max_shard_size="500MB")


def size(d: Path) -> int:
    return sum(p.stat().st_size for p in d.glob("*.safetensors"))


def convert(src: Path, out: Path) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    t0, c0 = time.perf_counter(), os.times()
    rc = subprocess.run([sys.executable, "-m", "inkling_quant.cli", "convert", str(src), str(out), "--scheme", "default",
                         "--default-activation-amax", "4", "--max-shard-size", "500MB", "--quiet"], cwd=ROOT).returncode
    c1 = os.times()
    if rc:
        raise SystemExit(f"convert {src} failed: exit {rc}")
    return {"wall_s": time.perf_counter() - t0, "cpu_s": (c1.children_user - c0.children_user)
            + (c1.children_system - c0.children_system)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=48)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--work-dir", default=str(ROOT / "bench-out" / "layouts"))
    p.add_argument("--json", metavar="OUT")
    args = p.parse_args(argv)
    work = Path(args.work_dir)
    srcs = {k: work / k for k in ("per_expert", "stacked")}
    for kind, d in srcs.items():
        if not (d / "config.json").exists():
            print(f"building the {kind} source ...", flush=True)
            subprocess.run([sys.executable, __file__, "--child", json.dumps([kind, args.layers, args.experts, str(d)])],
                           check=True)
    rows: dict[str, list[dict]] = {k: [] for k in srcs}
    for rep in range(args.repeat):
        for kind, d in srcs.items():  # alternating: a busy moment hits both
            r = convert(d, work / "out")
            r["mb_per_s"] = size(d) / 1e6 / r["wall_s"]
            rows[kind].append(r)
            print(f"rep {rep + 1} {kind:10} {size(d) / 1e9:.2f} GB  wall {r['wall_s']:6.1f} s  cpu {r['cpu_s']:6.1f} s  "
                  f"{r['mb_per_s']:6.0f} MB/s", flush=True)
    best = {k: min(v, key=lambda r: r["wall_s"]) for k, v in rows.items()}
    ratio = best["stacked"]["mb_per_s"] / best["per_expert"]["mb_per_s"]
    print(f"stacked / per-expert throughput (best of {args.repeat}): {ratio:.2f}  "
          f"(load average {os.getloadavg()[0]:.1f})")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "ratio": ratio, "sizes": {k: size(d) for k, d in srcs.items()}},
                                              indent=2))
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        kind, layers, experts, out = json.loads(sys.argv[2])
        build(kind, layers, experts, Path(out))
        sys.exit(0)
    sys.exit(main())
