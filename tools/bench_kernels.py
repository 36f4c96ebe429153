#!/usr/bin/env python
"""Benchmark the NVFP4 / MXFP8 kernels at Inkling 2 Small's expert shapes against BF16, with the
issue-27 targets as PASS/FAIL lines.

Cases (shapes from inkling_quant/configs/inkling-2-small.json: gate_up N = 2 * 2304, K = 4608;
down N = 4608, K = 2304; 384 experts, top-8):

* dense: one expert's gate_up / down at m tokens, on the path select_path picks for m, against
  BF16 cuBLAS (x @ W_bf16^T);
* fused MoE decode: m tokens routed to the same 8 of 384 experts (m rows per expert), the
  whole layer (alignment, gate_up, activation, down, top-8 sum) against the BF16 grouped
  GEMMs of those 8 experts alone (torch.bmm or torch._grouped_mm, the faster; gate_up then
  down on a ready h: no activation, gather or sum counted for the baseline).

Per case: time (CUDA graph replay, triton.testing.do_bench_cudagraph: GPU time without Python
launch overhead, as CUDA-graph decode serving sees it; eager do_bench beside it), speed-up,
achieved bandwidth and % of the device's HBM roofline (bytes the kernel must move: packed
weights + scales + activations + outputs, each once), and the result checked against the
torch reference within the documented bound. Targets are judged on the graph times.

    python tools/bench_kernels.py [--quick] [--json PATH]     (a CUDA GPU; --quick < 3 min)
    python tools/bench_kernels.py --smoke                      (tiny shapes, any backend)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "kernels"))  # inkling_kernels, the repository's kernels/, installed or not

CONFIG = ROOT / "inkling_quant" / "configs" / "inkling-2-small.json"
PEAK_HBM = {"H200": 4.8e12, "H100": 3.35e12, "B200": 8.0e12}   # bytes/s by device-name substring
DENSE_M = {"quick": (1, 2, 4, 8, 16, 256), "full": (1, 2, 4, 8, 16, 32, 64, 128, 256, 512), "smoke": (1, 7)}
MOE_M = {"quick": (1, 4, 16), "full": (1, 2, 4, 8, 16, 64), "smoke": (1, 3)}
TARGETS = [  # name, which rows, measure, threshold
    ("NVFP4 weight-only decode m=1..16 >= 1.5x BF16 cuBLAS", lambda r: r["kind"] == "dense" and r["fmt"] == "nvfp4"
     and r["m"] <= 16, "speedup", 1.5),
    ("NVFP4 weight-only decode m=1..16 >= 40% of HBM roofline", lambda r: r["kind"] == "dense"
     and r["fmt"] == "nvfp4" and r["m"] <= 16, "roofline", 0.40),
    ("MXFP8 weight-only decode m=1..16 >= 1.2x BF16 cuBLAS", lambda r: r["kind"] == "dense" and r["fmt"] == "mxfp8"
     and r["m"] <= 16, "speedup", 1.2),
    ("fused MoE decode (NVFP4, 8 of 384 experts, m=1..16) >= 1.5x BF16 grouped GEMMs",
     lambda r: r["kind"] == "moe" and r["fmt"] == "nvfp4" and r["m"] <= 16, "speedup", 1.5),
    ("NVFP4 m=256 >= 0.7x BF16 cuBLAS", lambda r: r["kind"] == "dense" and r["fmt"] == "nvfp4" and r["m"] == 256,
     "speedup", 0.7),
    ("MXFP8 m=256 >= 0.7x BF16 cuBLAS", lambda r: r["kind"] == "dense" and r["fmt"] == "mxfp8" and r["m"] == 256,
     "speedup", 0.7),
]


def load_shapes(path: Path = CONFIG) -> dict:
    t = json.loads(path.read_text())["text_config"]  # the published Inkling2Config
    return {"hidden_size": t["hidden_size"], "moe_intermediate_size": t["moe_intermediate_size"],
            "num_experts": t["n_routed_experts"], "num_experts_per_tok": t["num_experts_per_tok"],
            "gate_softcap": t["mlp_gate_softcap"], "up_softcap": t["mlp_up_softcap"]}


def peak_bandwidth(name: str) -> float | None:
    for key, bw in PEAK_HBM.items():
        if key in name:
            return bw
    return None


def weight_bytes(fmt: str, n: int, k: int) -> int:
    return n * k // 2 + n * k // 16 + 4 if fmt == "nvfp4" else n * k + n * k // 32


class Timer:
    """Graph-replay and eager GPU times (seconds); plain wall time on CPU (--smoke)."""

    def __init__(self, device: str, quick: bool):
        self.cuda = device == "cuda"
        self.rep = 20 if quick else 50

    def eager(self, fn) -> float:
        if not self.cuda:
            fn()
            t = time.perf_counter()
            fn()
            return time.perf_counter() - t
        import triton.testing

        return triton.testing.do_bench(fn, warmup=5, rep=self.rep) * 1e-3

    def graph(self, fn) -> float:
        if not self.cuda:
            return self.eager(fn)
        import torch
        import triton.testing

        try:
            with torch.cuda.stream(torch.cuda.Stream()):
                return triton.testing.do_bench_cudagraph(fn, rep=self.rep) * 1e-3
        except Exception as exc:  # not capturable: say so, fall back to eager
            print(f"  (CUDA graph capture failed: {type(exc).__name__}: {str(exc)[:120]}; eager time used)")
            return self.eager(fn)


def _row(kind, fmt, proj, m, n, k, t_graph, t_eager, t_base, base_eager, nbytes, peak, ok, worst, path, **extra):
    r = dict(kind=kind, fmt=fmt, proj=proj, m=m, n=n, k=k, kernel_us=t_graph * 1e6, kernel_eager_us=t_eager * 1e6,
             baseline_us=t_base * 1e6, baseline_eager_us=base_eager * 1e6, speedup=t_base / t_graph,
             speedup_eager=base_eager / t_eager, bytes=nbytes, gbs=nbytes / t_graph / 1e9,
             roofline=(nbytes / t_graph / peak) if peak else None, correct=ok, err_over_bound=worst, path=path)
    r.update(extra)
    roof = f"{r['roofline'] * 100:5.1f}%" if peak else "   n/a"
    print(f"{fmt:6} {proj:8} m={m:<4d}| {r['kernel_us']:8.1f} us ({r['kernel_eager_us']:7.1f}) | "
          f"{r['baseline_us']:8.1f} us ({r['baseline_eager_us']:7.1f}) | x{r['speedup']:5.2f} (x{r['speedup_eager']:5.2f}) | "
          f"{r['gbs']:6.0f} GB/s {roof} | {'ok  ' if ok else 'FAIL'} {worst:.2g} | {path}")
    return r


def bench_dense(fmt, proj, n, k, ms, timer, dev, peak) -> list[dict]:
    import torch

    import inkling_kernels as K
    from inkling_kernels import checks

    t = checks.random_encoded(fmt, None, n, k, device=dev, seed=n + k)
    args = [t[s] for s in (("weight", "weight_scale", "weight_scale_2") if fmt == "nvfp4" else ("weight", "weight_scale"))]
    gemm = K.nvfp4_dequant_gemm if fmt == "nvfp4" else K.mxfp8_dequant_gemm
    w = checks.dequantized(fmt, t)
    wbf = w.to(torch.bfloat16)
    rows = []
    for m in ms:
        x = (torch.randn(m, k, device=dev) * 0.5).to(torch.bfloat16)
        y = gemm(x, *args)
        ref = x.float() @ w.T
        ok, _, worst = checks.within(y, ref, checks.gemm_bound(x, w, torch.bfloat16, ref, gpu=timer.cuda))
        tg, te = timer.graph(lambda: gemm(x, *args)), timer.eager(lambda: gemm(x, *args))
        bg, be = timer.graph(lambda: x @ wbf.T), timer.eager(lambda: x @ wbf.T)
        nbytes = weight_bytes(fmt, n, k) + m * k * 2 + m * n * 2
        rows.append(_row("dense", fmt, proj, m, n, k, tg, te, bg, be, nbytes, peak, ok, worst, K.select_path(dev, m)))
    return rows


def _bf16_grouped(x8, w13, w2, h8):
    """The faster of torch.bmm and torch._grouped_mm for gate_up then down over the same 8
    experts (h given: the activation is not counted)."""
    import torch

    def bmm():
        torch.bmm(x8, w13.transpose(1, 2))
        return torch.bmm(h8, w2.transpose(1, 2))

    fns = [("torch.bmm", bmm)]
    if hasattr(torch, "_grouped_mm"):
        e, m = x8.shape[0], x8.shape[1]
        offs = torch.arange(1, e + 1, device=x8.device, dtype=torch.int32) * m
        xa, ha = x8.reshape(e * m, -1), h8.reshape(e * m, -1)
        b13, b2 = w13.transpose(1, 2), w2.transpose(1, 2)

        def grouped():
            torch._grouped_mm(xa, b13, offs=offs)
            return torch._grouped_mm(ha, b2, offs=offs)
        try:
            grouped()
            fns.append(("torch._grouped_mm", grouped))
        except Exception as exc:
            print(f"  (torch._grouped_mm unavailable here: {type(exc).__name__}: {str(exc)[:100]})")
    return fns


def bench_moe(fmt, shp, ms, timer, dev, peak, smoke) -> list[dict]:
    import torch

    import inkling_kernels as K
    from inkling_kernels import checks

    E, H, I, top_k = shp["num_experts"], shp["hidden_size"], shp["moe_intermediate_size"], shp["num_experts_per_tok"]
    gu = checks.random_encoded(fmt, E, 2 * I, H, device=dev, seed=1)
    dn = checks.random_encoded(fmt, E, H, I, device=dev, seed=2)
    active = torch.randperm(E, generator=torch.Generator().manual_seed(0))[:top_k].to(dev)
    w13 = torch.stack([checks.dequantized(fmt, gu, int(e)) for e in active]).to(torch.bfloat16)
    w2 = torch.stack([checks.dequantized(fmt, dn, int(e)) for e in active]).to(torch.bfloat16)
    rows = []
    for m in ms:
        x = (torch.randn(m, H, device=dev) * 0.5).to(torch.bfloat16)
        ids = active[None, :].repeat(m, 1)
        tw = torch.softmax(torch.randn(m, top_k, device=dev), -1)
        run = lambda: K.fused_moe(fmt, x, ids, tw, gu, dn)  # noqa: E731
        y = run()
        ref = K.reference.fused_moe(fmt, x, ids, tw, gu, dn)
        ok, _, worst = checks.within(y, ref, checks.moe_bound(fmt, x, ids, tw, gu, dn, torch.bfloat16, gpu=timer.cuda))
        tg, te = timer.graph(run), timer.eager(run)
        x8 = x[None].expand(top_k, m, H).contiguous()
        h8 = torch.randn(top_k, m, I, device=dev).to(torch.bfloat16)
        base = [(name, timer.graph(fn), timer.eager(fn)) for name, fn in _bf16_grouped(x8, w13, w2, h8)]
        name, bg, be = min(base, key=lambda b: b[1])
        nbytes = top_k * (weight_bytes(fmt, 2 * I, H) + weight_bytes(fmt, H, I)) + m * H * 4 + top_k * m * I * 2
        rows.append(_row("moe", fmt, "layer", m, 2 * I, H, tg, te, bg, be, nbytes, peak, ok, worst,
                         K.select_path(dev, m), baseline=name, experts=E, active=top_k))
    return rows


def judge(rows: list[dict]) -> list[dict]:
    """PASS/FAIL per target (and every result within its bound)."""
    out = []
    for name, sel, measure, thr in TARGETS:
        got = [r for r in rows if sel(r)]
        if not got:
            out.append(dict(target=name, status="NOT RUN", detail="no case measured"))
            continue
        vals = [r[measure] for r in got if r[measure] is not None]
        if not vals:
            out.append(dict(target=name, status="NOT RUN", detail=f"{measure} unknown on this device"))
            continue
        worst = min(vals)
        fails = [f"{r['proj']} m={r['m']}: {r[measure]:.2f}" for r in got if r[measure] is not None and r[measure] < thr]
        out.append(dict(target=name, status="PASS" if not fails else "FAIL", worst=worst,
                        detail=f"min {worst:.2f} (>= {thr})" + (f"; below: {', '.join(fails)}" if fails else "")))
    bad = [f"{r['fmt']} {r['proj']} m={r['m']}" for r in rows if not r["correct"]]
    out.append(dict(target="every result equals the torch reference within the documented bound",
                    status="PASS" if not bad else "FAIL", detail=f"{len(rows)} cases" + (f"; off: {bad}" if bad else "")))
    for t in out:
        print(f"{t['status']:7} {t['target']}: {t['detail']}")
    return out


def run(args) -> int:
    import torch

    from inkling_kernels import backend, backend_note

    device = "cuda" if torch.cuda.is_available() else "cpu"
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    shp = load_shapes()
    if args.smoke:
        shp.update(hidden_size=256, moe_intermediate_size=96, num_experts=12)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    peak = peak_bandwidth(name)
    import triton

    print(f"device: {name} (peak HBM {peak / 1e12 if peak else float('nan'):.2f} TB/s); backend: {backend()} "
          f"({backend_note()}); torch {torch.__version__}, triton {triton.__version__}; mode {mode}")
    timer = Timer(device, args.quick or args.smoke)
    t0 = time.time()
    H, I = shp["hidden_size"], shp["moe_intermediate_size"]
    print("\nkind   case     m    | kernel graph (eager) | BF16 graph (eager) | speed-up (eager) | bandwidth roofline | "
          "check err/bound | path")
    rows = []
    for fmt in ("nvfp4", "mxfp8"):
        for proj, (n, k) in {"gate_up": (2 * I, H), "down": (H, I)}.items():
            rows += bench_dense(fmt, proj, n, k, DENSE_M[mode], timer, device, peak)
    for fmt in ("nvfp4", "mxfp8"):
        rows += bench_moe(fmt, shp, MOE_M[mode], timer, device, peak, args.smoke)
    print(f"\nmeasured {len(rows)} cases in {time.time() - t0:.0f} s\n")
    targets = judge(rows) if not args.smoke else []
    if args.json:
        Path(args.json).write_text(json.dumps(dict(device=name, peak_hbm=peak, torch=torch.__version__,
                                                   triton=triton.__version__, mode=mode, rows=rows,
                                                   targets=targets), indent=1))
        print(f"wrote {args.json}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="decode sizes and m=256 only (< 3 minutes on one GPU)")
    ap.add_argument("--json", help="also write the measurements and target verdicts here")
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
