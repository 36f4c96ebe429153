"""`inkling-quant calibrate` at the published layer shapes, side by side with nvidia-modelopt's
max calibration of the same layers and with the floors it streams against.

    python tools/bench_calibrate.py                         # bench preset: 2 and 4 layers x 4 and 8 experts
    python tools/bench_calibrate.py --rows 8 --seq-len 256 --json out.json
    python tools/bench_calibrate.py --smoke                  # tiny shapes: a check of this script

Cases (synth's `bench` preset: hidden 4608, expert width 2304, the real attention; every layer
NVFP4 W4A4 with `--scheme nvfp4`, so every layer is calibrated), each a measured process (wall,
CPU, peak RSS of the process):
  ours        `inkling-quant calibrate SRC OUT.json --data D --scheme nvfp4` (the layer-streaming
              engine: one layer's non-expert weights and one expert, read ahead, in memory)
  modelopt    transformers' `from_pretrained` of the whole model, then ModelOpt 0.47's
              `mtq.quantize(..., forward_loop)` with an NVFP4 W4A4 experts config (what its hf_ptq
              does), on the same token rows in the same micro-batches
  read floor  reading every byte of the shards once (page cache warm), the bytes calibrate reads
Per layer: ours' seconds, its read GB/s against the floor's, tokens/s. Peak RSS must stay flat in
layers and experts (the engine's bound); ModelOpt's grows with the model. The projection for
Inkling 2 Small on one GPU takes the measured streaming overhead (ours' per-layer time over
max(read, compute)) and the published layer (384 experts: 24.5 GB of BF16 experts, 0.2 GB else).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import ROOT, args_or_child, helper, ours_env, run_measured  # noqa: E402

NVFP4 = {"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (4, 3)}}


def _child(spec: dict) -> None:
    """Run in a fresh process: ModelOpt's calibration of the whole model, or the compute of the
    same forward with every weight in memory (transformers' whole model, eager experts)."""
    import torch

    sys.path.insert(0, str(ROOT))
    from transformers import Inkling2ForConditionalGeneration

    rows = [json.loads(line)["input_ids"] for line in Path(spec["data"]).read_text().splitlines()]
    batches = [torch.tensor(rows[i:i + spec["batch"]]) for i in range(0, len(rows), spec["batch"])]
    t0 = time.perf_counter()
    model = Inkling2ForConditionalGeneration.from_pretrained(spec["src"], dtype=torch.bfloat16,
                                                             experts_implementation="eager").eval()
    loaded = time.perf_counter() - t0

    def loop(m):
        with torch.no_grad():
            for b in batches:
                m(input_ids=b)
    t1 = time.perf_counter()
    if spec["what"] == "modelopt":
        import warnings
        warnings.simplefilter("ignore")
        import modelopt.torch.quantization as mtq
        cfg = {"quant_cfg": [{"quantizer_name": "*", "enable": False},
                             {"quantizer_name": "*language_model.layers.*.mlp.experts.*weight_quantizer", "cfg": NVFP4},
                             {"quantizer_name": "*language_model.layers.*.mlp.experts.*input_quantizer", "cfg": NVFP4}],
               "algorithm": {"method": "max"}}
        mtq.quantize(model, cfg, loop)
    else:
        loop(model)
    Path(spec["result"]).write_text(json.dumps({"load_s": round(loaded, 3), "run_s": round(time.perf_counter() - t1, 3)}))


def _read_floor(src: Path) -> tuple[float, int]:
    """(seconds, bytes) to read every shard once, page cache warm (read once before)."""
    files = sorted(src.glob("*.safetensors"))
    for f in files:
        f.read_bytes()
    t, n = time.perf_counter(), 0
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while chunk := fh.read(64 << 20):
                n += len(chunk)
    return time.perf_counter() - t, n


def _case(work: Path, preset: str, layers: int, experts: int, rows: int, seq: int, batch: int) -> dict:
    from inkling_quant.synth import write_checkpoint

    src = work / f"{preset}-L{layers}-E{experts}"
    if not (src / "model.safetensors.index.json").exists():
        write_checkpoint(src, preset, layers=layers, experts=experts, overwrite=True)
    cfg = json.loads((src / "config.json").read_text())["text_config"]
    import random
    rng = random.Random(0)
    data = work / f"rows-{rows}x{seq}.jsonl"
    data.write_text("".join(json.dumps({"input_ids": [rng.randrange(cfg["unpadded_vocab_size"]) for _ in range(seq)]})
                            + "\n" for _ in range(rows)))
    floor_s, nbytes = _read_floor(src)
    out = work / "cal.json"
    report = work / "cal-report.json"
    ours = run_measured([sys.executable, "-m", "inkling_quant.cli", "calibrate", str(src), str(out), "--data",
                         str(data), "--seq-len", str(seq), "--batch-size", str(batch), "--scheme", "nvfp4",
                         "--overwrite", "--quiet", "--json", str(report)], work / "ours.log", ours_env())
    r = json.loads(report.read_text())
    per = r["per_layer"]
    spec = {"src": str(src), "data": str(data), "batch": batch}
    mo = run_measured([sys.executable, __file__, "--child", json.dumps({**spec, "what": "modelopt",
                                                                        "result": str(work / "mo.json")})],
                      work / "mo.log", ours_env())
    mo.update(json.loads((work / "mo.json").read_text()))
    compute = helper(__file__, {**spec, "what": "compute"}, work / "compute.json", ours_env())
    layer_s = sum(p["seconds"] for p in per) / len(per)
    layer_bytes = sum(p["bytes_read"] for p in per) / len(per)
    floor_gbs = nbytes / floor_s / 1e9
    compute_layer_s = compute["run_s"] / layers
    tokens = rows * seq
    return {"preset": preset, "layers": layers, "experts": experts, "tokens": tokens,
            "ours": {**ours, "layer_s": round(layer_s, 3), "layer_read_gb_s": round(layer_bytes / layer_s / 1e9, 3),
                     "tokens_per_s": round(tokens / layer_s, 1)},
            "modelopt": mo, "read_floor_gb_s": round(floor_gbs, 2), "bytes": nbytes,
            "compute_layer_s": round(compute_layer_s, 3),
            "overhead_vs_max_floor": round(layer_s / max(layer_bytes / (floor_gbs * 1e9), compute_layer_s), 3)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", help="keep the checkpoints here (default: a temporary directory)")
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--smoke", action="store_true", help="tiny shapes, one case: a check of this script")
    p.add_argument("--json", help="write the figures here")
    args = args_or_child(p, argv, _child)
    if args is None:
        return 0
    sys.path.insert(0, str(ROOT))
    with tempfile.TemporaryDirectory(prefix="bench-calibrate-") as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        shapes = [("tiny", 4, 4)] if args.smoke else [("bench", 2, 4), ("bench", 4, 4), ("bench", 2, 8)]
        cases = [_case(work, pre, L, E, args.rows, args.seq_len, args.batch_size) for pre, L, E in shapes]
    print(f"{'case':<16} {'ours s/layer':>12} {'read GB/s':>10} {'floor GB/s':>10} {'compute s/layer':>15} "
          f"{'overhead':>8} {'ours RSS MB':>11} {'ModelOpt s':>10} {'ModelOpt RSS MB':>15}")
    for c in cases:
        o, m = c["ours"], c["modelopt"]
        print(f"{c['preset']} L{c['layers']} E{c['experts']:<6} {o['layer_s']:>12.3f} {o['layer_read_gb_s']:>10.3f} "
              f"{c['read_floor_gb_s']:>10.2f} {c['compute_layer_s']:>15.3f} {c['overhead_vs_max_floor']:>8.2f} "
              f"{o['peak_rss_mb']:>11.0f} {m['load_s'] + m['run_s']:>10.2f} {m['peak_rss_mb']:>15.0f}")
    if not args.smoke:
        full = 384 * 3 * 4608 * 2304 * 2 + 0.2e9
        worst = max(c["overhead_vs_max_floor"] for c in cases)
        print(f"projection, Inkling 2 Small on one GPU: per layer {full / 1e9:.1f} GB read; at the host's read rate R GB/s "
              f"a layer takes {full / 1e9:.1f}/R s x {worst:.2f} (the measured overhead), 40 NVFP4 layers "
              f"{40 * full / 1e9:.0f}/R s x {worst:.2f} (R = 5: {40 * full / 5e9 * worst / 60:.0f} min), when the "
              f"GPU's compute per layer is below the read's")
    if args.json:
        Path(args.json).write_text(json.dumps(cases, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
