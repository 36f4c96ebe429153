#!/usr/bin/env python
"""Speed (and error statistics) of inkling_quant's NVFP4 / MXFP8 quantizers vs NVIDIA ModelOpt's.

Speed: quantizes the same bf16 tensor (default one routed-expert gate/up projection,
[3488, 3072], Gaussian with outlier rows and elements) with our format and with ModelOpt's
``NVFP4QTensor.quantize`` / ``MXFP8QTensor.quantize`` in one process, checks the two agree bit
for bit, and prints MB/s of bf16 input (best of --repeat runs; the machine is shared, so the best
run is the one least disturbed). "MB per CPU-second" divides by the process's CPU time instead:
with T threads on T otherwise idle cores, wall MB/s approaches T times it. Also times ``amax``
(the extra pass the converter makes for the gate/up shared global scale), and the paths from
quantized sources' bytes (`Format.requantize`, which takes formats/transcode.py's fast paths:
NVFP4 from the MXFP8 release; NVFP4 and MXFP8 from an FP8 block-scaled weight, and its checks)
against dequantize + quantize.

    python tools/bench_formats.py                      # 2 threads, both formats
    python tools/bench_formats.py --threads 1 --rows 1024
    python tools/bench_formats.py --errors             # the error table of docs/formats.md

--errors prints the dequantization error statistics behind the formats' verify thresholds:
relative Frobenius error and cosine of y = x @ W^T (x: 32 standard-Gaussian bf16 rows, as
`verify` draws them) against the BF16 weight, for weights made like inkling_quant.synth's
(Gaussian / sqrt(fan_in), 1% of rows x8, rare elements x40) and harsher variants.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inkling_quant.formats import FORMATS, SOURCE_FORMATS, transcode  # noqa: E402
from inkling_quant.formats.nvfp4 import amax as tensor_amax  # noqa: E402


def make_weight(rows: int, cols: int, seed: int = 0, outlier_rows: float = 0.01, row_mult: float = 8.0,
                spike_every: int = 50_000, spike_mult: float = 40.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g).mul_(cols ** -0.5)
    n_rows = max(1, int(rows * outlier_rows))
    x[torch.randint(0, rows, (n_rows,), generator=g)] *= row_mult
    flat = x.view(-1)
    n_spikes = max(1, flat.numel() // spike_every)
    flat[torch.randint(0, flat.numel(), (n_spikes,), generator=g)] *= spike_mult
    return x.to(torch.bfloat16)


def best_of(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def best_cpu(fn, repeat: int) -> float:
    """Best process CPU time (all threads): what the work costs when no core is shared."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.process_time()
        fn()
        best = min(best, time.process_time() - t0)
    return best


def speed(args) -> None:
    torch.set_num_threads(args.threads)
    w = make_weight(args.rows, args.cols, seed=0)
    mb = w.numel() * 2 / 1e6
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"tensor bf16 [{args.rows}, {args.cols}] = {mb:.1f} MB, torch threads {args.threads}, "
          f"load average {load:.2f} (a busy machine lowers every number)")
    mo = None
    if not args.no_modelopt:
        t0 = time.perf_counter()
        from modelopt.torch.quantization.qtensor import MXFP8QTensor, NVFP4QTensor
        mo = {"nvfp4": NVFP4QTensor, "mxfp8": MXFP8QTensor}
        print(f"(import modelopt: {time.perf_counter() - t0:.1f} s)")

    t = best_of(lambda: tensor_amax(w), args.repeat)
    print(f"{'amax':<8} ours {mb / t:9.1f} MB/s")
    rows = []
    for name in args.formats.split(","):
        fmt = FORMATS[name]
        fmt.quantize(w)  # warm the buffers
        t_ours = best_of(lambda: fmt.quantize(w), args.repeat)
        c_ours = best_cpu(lambda: fmt.quantize(w), args.repeat)
        line = f"{name:<8} ours {mb / t_ours:9.1f} MB/s ({mb / c_ours:6.1f} MB per CPU-second)"
        if mo is not None:
            if name == "nvfp4":
                def run_mo():
                    return mo["nvfp4"].quantize(w, 16)
            else:
                def run_mo():
                    return mo["mxfp8"].quantize(w)
            res = run_mo()
            t_mo = best_of(run_mo, max(1, args.mo_repeat))
            ours = fmt.quantize(w)
            if name == "nvfp4":
                qt, s, s2 = res
                same = (torch.equal(ours["weight"], qt._quantized_data)
                        and torch.equal(ours["weight_scale"].view(torch.uint8), s.view(torch.uint8))
                        and torch.equal(ours["weight_scale_2"], s2))
            else:
                qt, s = res
                same = (torch.equal(ours["weight"].view(torch.uint8), qt._quantized_data.view(torch.uint8))
                        and torch.equal(ours["weight_scale"], s))
            line += f"   modelopt {mb / t_mo:8.1f} MB/s   x{t_mo / t_ours:5.1f}   bit-exact: {same}"
            if not same:
                rows.append(name)
        print(line)
    if {"nvfp4", "mxfp8"} <= set(args.formats.split(",")):
        requantize_speed(w, mb, args.repeat)
    if rows:
        raise SystemExit(f"NOT bit-exact with ModelOpt: {rows}")


def requantize_speed(w: torch.Tensor, mb: float, repeat: int) -> None:
    """The converter's paths from a quantized source's bytes (`Format.requantize`, which takes
    formats/transcode.py's fast path): NVFP4 of the weight an MXFP8 release stores, NVFP4 and MXFP8
    of it stored FP8 block-scaled (DeepSeek-V3's weight_quant), each against dequantizing to fp32
    and quantizing that; and the FP8 checks the converter runs first (`FP8Block.check_stored`).
    MB/s of the bf16 weight."""
    fp8 = SOURCE_FORMATS["fp8_block"]
    for src, dst in ((FORMATS["mxfp8"], FORMATS["nvfp4"]), (fp8, FORMATS["nvfp4"]), (fp8, FORMATS["mxfp8"])):
        if transcode.find(src, dst) is None:
            raise SystemExit(f"no fast path from {src.name} to {dst.name} is registered (formats/transcode.py)")
        stored = src.quantize(w)
        fused, plain = dst.requantize(stored, src), dst.quantize(src.dequantize(stored))
        same = all(torch.equal(fused[k].reshape(-1).view(torch.uint8), plain[k].reshape(-1).view(torch.uint8))
                   for k in plain) and set(fused) == set(plain)
        t_fused = best_of(lambda: dst.requantize(stored, src), repeat)
        t_plain = best_of(lambda: dst.quantize(src.dequantize(stored)), repeat)
        print(f"{src.name + '->' + dst.name:<16} ours {mb / t_fused:9.1f} MB/s   dequantize + quantize "
              f"{mb / t_plain:8.1f} MB/s   x{t_plain / t_fused:5.1f}   bit-identical: {same}")
        if not same:
            raise SystemExit(f"{dst.name}.requantize differs from quantizing the dequantized weight")
    stored = fp8.quantize(w)
    print(f"{'fp8_block checks':<16} ours {mb / best_of(lambda: fp8.check_stored(stored), repeat):9.1f} MB/s")


def errors(args) -> None:
    torch.set_num_threads(args.threads)
    variants = {
        "synth": {},                                            # inkling_quant.synth's recipe
        "heavy outliers": {"outlier_rows": 0.05, "row_mult": 30.0, "spike_every": 5_000, "spike_mult": 200.0},
        "plain gaussian": {"row_mult": 1.0, "spike_mult": 1.0},
    }
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    seeds = range(args.seeds)
    print(f"{'format':<7} {'weights':<15} {'shape':<12} {'rel.err mean':>12} {'max':>8} {'cos min':>9}")
    for name in args.formats.split(","):
        fmt = FORMATS[name]
        worst_rel, worst_cos = 0.0, 1.0
        for vname, kw in variants.items():
            for shape in shapes:
                rels, coss = [], []
                for seed in seeds:
                    w = make_weight(*shape, seed=seed, **kw)
                    g = torch.Generator().manual_seed(1000 + seed)
                    x = torch.randn(32, shape[1], generator=g).to(torch.bfloat16)
                    ref = (x.double() @ w.double().T)
                    y = x.double() @ fmt.dequantize(fmt.quantize(w), torch.float32).double().T
                    rel = float(torch.linalg.vector_norm(y - ref) / torch.linalg.vector_norm(ref))
                    cos = float((y * ref).sum() / (torch.linalg.vector_norm(y) * torch.linalg.vector_norm(ref)))
                    rels.append(rel)
                    coss.append(cos)
                worst_rel, worst_cos = max(worst_rel, max(rels)), min(worst_cos, min(coss))
                print(f"{name:<7} {vname:<15} {str(list(shape)):<12} {sum(rels) / len(rels):12.4f} "
                      f"{max(rels):8.4f} {min(coss):9.5f}")
        print(f"{name:<7} worst: relative error {worst_rel:.4f}, cosine {worst_cos:.5f}; thresholds: "
              f"max_rel_error {fmt.max_rel_error}, min_cosine {fmt.min_cosine}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=3488)
    p.add_argument("--cols", type=int, default=3072)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat", type=int, default=7, help="runs of ours (best is reported)")
    p.add_argument("--mo-repeat", type=int, default=2, help="runs of ModelOpt's (it is slow)")
    p.add_argument("--formats", default="nvfp4,mxfp8")
    p.add_argument("--no-modelopt", action="store_true", help="time ours only")
    p.add_argument("--errors", action="store_true", help="print the error statistics table instead")
    p.add_argument("--seeds", type=int, default=5, help="--errors: weights per (variant, shape)")
    p.add_argument("--shapes", default="3488x3072,3072x3488,96x64,64x96",
                   help="--errors: weight shapes (real experts, the tiny preset's experts)")
    args = p.parse_args(argv)
    errors(args) if args.errors else speed(args)


if __name__ == "__main__":
    main()
