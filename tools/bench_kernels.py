#!/usr/bin/env python
"""Benchmark the NVFP4 / MXFP8 dequant-GEMM kernels at Inkling 2 Small's expert shapes.

For each format and projection (gate_up: N = 2*moe_intermediate, K = hidden; down: N = hidden,
K = moe_intermediate) and tokens-per-expert m in 1..512 it times

* the Triton kernel on the path select_path() picks for this GPU,
* a BF16 torch matmul on the unquantized weight (x @ W_bf16^T),
* dequantize-then-matmul in torch (formats' dequantize to bf16, then x @ W^T),

and prints TFLOP/s, achieved GB/s (bytes the kernel must move: packed weight + scales +
activations + output, each once) and the kernel's speed-up over both baselines. A grouped run
(one launch over several experts, m tokens each) follows, against torch.bmm on BF16 weights.

Shapes come from inkling_quant/configs/inkling-2-small.json (hidden_size,
moe_intermediate_size, n_routed_experts, num_experts_per_tok of text_config: 4608 x 2304). Without a CUDA GPU it says so and
exits 0 (``--smoke`` instead runs tiny shapes through whatever backend exists, to check the
script itself). Budget: well under 5 minutes on one GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIG = ROOT / "inkling_quant" / "configs" / "inkling-2-small.json"
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def load_shapes(path: Path = CONFIG) -> dict:
    t = json.loads(path.read_text())["text_config"]  # the published Inkling2Config
    return {"hidden_size": t["hidden_size"], "moe_intermediate_size": t["moe_intermediate_size"],
            "num_experts": t["n_routed_experts"], "num_experts_per_tok": t["num_experts_per_tok"]}


def _timer(device):
    import torch

    if device == "cuda":
        import triton.testing

        def bench(fn):
            return triton.testing.do_bench(fn, warmup=10, rep=40) * 1e-3  # seconds
    else:
        def bench(fn):
            fn()
            t = time.perf_counter()
            fn()
            return time.perf_counter() - t
    torch.manual_seed(0)
    return bench


def _random_nvfp4(e, n, k, device):
    """Random but valid NVFP4 tensors (benchmarks need bytes, not a trained weight)."""
    import torch

    shape = (e, n) if e else (n,)
    w = torch.randint(0, 256, (*shape, k // 2), dtype=torch.uint8, device=device)
    s = (torch.rand(*shape, k // 16, device=device) * 2 + 0.5).to(torch.float8_e4m3fn)
    s2 = torch.full((e,) if e else (), 1e-3, dtype=torch.float32, device=device)
    return w, s, s2


def _random_mxfp8(e, n, k, device):
    import torch

    shape = (e, n) if e else (n,)
    w = (torch.randn(*shape, k, device=device) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.randint(118, 124, (*shape, k // 32), dtype=torch.uint8, device=device)
    return w, s


def _bytes(fmt, e, n, k, m_total):
    wb = n * k // 2 + n * k // 16 + 4 if fmt == "nvfp4" else n * k + n * k // 32
    return max(e, 1) * wb + m_total * k * 2 + m_total * n * 2


def run(args) -> int:
    import torch

    from inkling_quant.formats import FORMATS
    from inkling_quant.kernels import (backend, backend_note, mxfp8_dequant_gemm, mxfp8_grouped_gemm,
                                       nvfp4_dequant_gemm, nvfp4_grouped_gemm, select_path)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    shp = load_shapes()
    hidden, inter = shp["hidden_size"], shp["moe_intermediate_size"]
    batches = BATCHES
    n_grouped = args.experts
    if args.smoke:
        hidden, inter, batches, n_grouped = 128, 96, (1, 7), 3
    print(f"device: {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}; backend: {backend()} "
          f"({backend_note()}); path: {select_path(device)}")
    print(f"shapes from {CONFIG.name}: hidden={shp['hidden_size']} moe_intermediate={shp['moe_intermediate_size']} "
          f"experts={shp['num_experts']} top-k={shp['num_experts_per_tok']}"
          + (" (--smoke: shrunk)" if args.smoke else ""))
    bench = _timer(device)
    projs = {"gate_up": (2 * inter, hidden), "down": (hidden, inter)}
    rows = []
    hdr = (f"{'fmt':6} {'proj':7} {'m':>4} | {'kernel us':>9} {'TFLOP/s':>7} {'GB/s':>7} | "
           f"{'bf16 us':>8} {'deq+mm us':>9} | {'x bf16':>6} {'x deq+mm':>8}")
    print("\n== dense (one expert) ==\n" + hdr)
    for fmt in ("nvfp4", "mxfp8"):
        for proj, (n, k) in projs.items():
            wbf = (torch.randn(n, k, device=device) * 0.02).to(torch.bfloat16)
            if fmt == "nvfp4":
                w, s, s2 = _random_nvfp4(0, n, k, device)
                kern = lambda x: nvfp4_dequant_gemm(x, w, s, s2)  # noqa: E731
                deq = lambda: FORMATS["nvfp4"].dequantize(  # noqa: E731
                    {"weight": w, "weight_scale": s, "weight_scale_2": s2}, torch.bfloat16)
            else:
                w, s = _random_mxfp8(0, n, k, device)
                kern = lambda x: mxfp8_dequant_gemm(x, w, s)  # noqa: E731
                deq = lambda: FORMATS["mxfp8"].dequantize({"weight": w, "weight_scale": s}, torch.bfloat16)
            for m in batches:
                x = torch.randn(m, k, device=device).to(torch.bfloat16)
                t_k = bench(lambda: kern(x))
                t_b = bench(lambda: x @ wbf.T)
                try:
                    t_d = bench(lambda: x @ deq().T)
                except Exception as exc:  # formats' dequantize not usable on this device
                    print(f"  (dequantize-then-matmul baseline failed: {type(exc).__name__}: {exc})")
                    t_d = float("nan")
                flop = 2.0 * m * n * k
                gbs = _bytes(fmt, 0, n, k, m) / t_k / 1e9
                r = dict(kind="dense", fmt=fmt, proj=proj, m=m, n=n, k=k, kernel_s=t_k, bf16_s=t_b,
                         deq_mm_s=t_d, tflops=flop / t_k / 1e12, gbs=gbs)
                rows.append(r)
                print(f"{fmt:6} {proj:7} {m:4d} | {t_k * 1e6:9.1f} {r['tflops']:7.2f} {gbs:7.0f} | "
                      f"{t_b * 1e6:8.1f} {t_d * 1e6:9.1f} | {t_b / t_k:6.2f} {t_d / t_k:8.2f}")
            wbf = None  # free it (the timed lambdas are done with it)
    print(f"\n== grouped: one launch over {n_grouped} experts, m tokens each "
          f"(baseline: torch.bmm on BF16 weights) ==")
    print(f"{'fmt':6} {'proj':7} {'m':>4} | {'kernel us':>9} {'TFLOP/s':>7} {'GB/s':>7} | {'bmm us':>8} | {'x bmm':>6}")
    for fmt in ("nvfp4", "mxfp8"):
        for proj, (n, k) in projs.items():
            wbf = (torch.randn(n_grouped, n, k, device=device) * 0.02).to(torch.bfloat16)
            if fmt == "nvfp4":
                w, s, s2 = _random_nvfp4(n_grouped, n, k, device)
                kern = lambda x, o: nvfp4_grouped_gemm(x, w, s, s2, o)  # noqa: E731
            else:
                w, s = _random_mxfp8(n_grouped, n, k, device)
                kern = lambda x, o: mxfp8_grouped_gemm(x, w, s, o)  # noqa: E731
            for m in batches[::2] if not args.smoke else batches:
                x = torch.randn(n_grouped * m, k, device=device).to(torch.bfloat16)
                offs = torch.arange(n_grouped + 1, device=device, dtype=torch.int32) * m
                xb = x.view(n_grouped, m, k)
                t_k = bench(lambda: kern(x, offs))
                t_b = bench(lambda: torch.bmm(xb, wbf.transpose(1, 2)))
                flop = 2.0 * n_grouped * m * n * k
                gbs = _bytes(fmt, n_grouped, n, k, n_grouped * m) / t_k / 1e9
                r = dict(kind="grouped", fmt=fmt, proj=proj, m=m, experts=n_grouped, n=n, k=k,
                         kernel_s=t_k, bmm_s=t_b, tflops=flop / t_k / 1e12, gbs=gbs)
                rows.append(r)
                print(f"{fmt:6} {proj:7} {m:4d} | {t_k * 1e6:9.1f} {r['tflops']:7.2f} {gbs:7.0f} | "
                      f"{t_b * 1e6:8.1f} | {t_b / t_k:6.2f}")
            wbf = None  # free it (the timed lambdas are done with it)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(device=torch.cuda.get_device_name() if device == "cuda"
                                                   else "cpu", path=select_path(device), rows=rows), indent=1))
        print(f"wrote {args.json}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=32,
                    help="experts in the grouped run (default 32: ~0.7-1.4 GB of BF16 baseline weights)")
    ap.add_argument("--json", help="also write the measurements here")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes on whatever backend exists (CPU interpreter too): checks the script")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available() and not args.smoke:
        print("bench_kernels: needs a CUDA GPU (none found); nothing measured. "
              "Use --smoke to exercise the script on CPU with tiny shapes.")
        return 0
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
