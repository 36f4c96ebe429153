"""Regenerate the launch table (launch_table.json) by measurement on the GPU this runs on.

    python -m inkling_kernels.autotune --out launch_table.json [--quick]
    (tools/gpu_check.sh --tune runs it and keeps the table under $OUT)

For each path, format, kind (dense: one expert; moe: 8 experts of m rows each, one launch), real
expert shape (N, K) and m bucket it times a small candidate set around the heuristic (tile
widths, K steps, split-K slices, FMA vs MMA for m <= 2, warps), with triton.testing.do_bench,
checks the winner against the torch reference within the documented bound, and writes every
entry with its time and the BF16 matmul time for the same shape. Candidates that fail to
compile or run (shared memory, registers) are skipped. Needs a CUDA GPU.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from . import checks
from .dequant_gemm import choose_config, mxfp8_grouped_gemm, nvfp4_grouped_gemm
from .launch_table import (DECODE_MAX_M, KINDS, M_BUCKETS, MOE_DECODE_EXPERTS, LaunchConfig, _block_k,
                           heuristic_config, real_shapes, table_entry, write_table)
from .formats import scale_block
from .paths import PATH_BF16_MMA, PATH_SM100, PATH_SPLITK, device_facts


def candidates(path: str, fmt: str, kind: str, n: int, k: int, m: int, sm_count: int, quick: bool) -> list:
    """The heuristic's config first, then variations of it (deduplicated, all valid)."""
    base = heuristic_config(path, fmt, kind, n, k, m, sm_count)
    sb = scale_block(fmt)
    out = [base]
    bks = sorted({_block_k(k, w) for w in (128, 256, 512)})
    if path == PATH_SPLITK:
        inners = [("fma", m if m <= 2 else 1), ("dot", 16)] if m <= 2 else [("dot", 16)]
        bns = (16, 32, 64) if not quick else (16, 32)
        splits = (1, 2, 3, 4, 6) if not quick else (1, 2, 3)
        for inner, bm in inners:
            for bn in bns:
                for bk in bks:
                    for sp in splits:
                        for warps in ((4, 8) if not quick else (4,)):
                            out.append(LaunchConfig(bm, bn, bk, sp, inner, warps, 3))
    else:
        bm0 = base.block_m
        for bm in sorted({bm0, max(16, bm0 // 2), min(128, bm0 * 2)}):
            for bn in (64, 128, 256) if not quick else (64, 128):
                for sp in (1, 2, 4) if not quick else (1, 2):
                    for stages in (3, 4):
                        out.append(LaunchConfig(bm, bn, 128 if k % 128 == 0 else 64, sp, "dot",
                                                8 if bm * bn >= 128 * 128 else 4, stages))
    seen, uniq = set(), []
    for c in out:
        key = tuple(c.as_dict().values())
        if key not in seen:
            try:
                c.check(sb)
            except ValueError:
                continue
            seen.add(key)
            uniq.append(c)
    return uniq


def _runner(fmt: str, kind: str, n: int, k: int, m: int, dev):
    """(fn(config, path) -> y, x, weights, offsets): one dense matrix, or 8 experts of m rows."""
    experts = MOE_DECODE_EXPERTS if kind == "moe" else None
    t = checks.random_encoded(fmt, experts, n, k, device=dev, seed=m)
    rows = m * (experts or 1)
    x = (torch.randn(rows, k, device=dev) * 0.5).to(torch.bfloat16)
    offs = torch.arange((experts or 0) + 1, device=dev, dtype=torch.int32) * m
    from . import dequant_gemm as dg

    def fn(cfg, path):
        if experts is None:
            args = [t[s] for s in (("weight", "weight_scale", "weight_scale_2") if fmt == "nvfp4"
                                   else ("weight", "weight_scale"))]
            gemm = dg.nvfp4_dequant_gemm if fmt == "nvfp4" else dg.mxfp8_dequant_gemm
            return gemm(x, *args, path=path, config=cfg)
        if fmt == "nvfp4":
            return nvfp4_grouped_gemm(x, t["weight"], t["weight_scale"], t["weight_scale_2"], offs, path=path,
                                      config=cfg)
        return mxfp8_grouped_gemm(x, t["weight"], t["weight_scale"], offs, path=path, config=cfg)
    return fn, x, t, offs


def _correct(fmt, y, x, t, m, experts) -> bool:
    if experts is None:
        w = checks.dequantized(fmt, t)
        ref = x.float() @ w.T
        return checks.within(y, ref, checks.gemm_bound(x, w, torch.bfloat16, ref, gpu=True))[0]
    ok = True
    for e in range(experts):
        w = checks.dequantized(fmt, t, e)
        xe, ye = x[e * m:(e + 1) * m], y[e * m:(e + 1) * m]
        ref = xe.float() @ w.T
        ok &= checks.within(ye, ref, checks.gemm_bound(xe, w, torch.bfloat16, ref, gpu=True))[0]
    return ok


def tune_key(path, fmt, kind, n, k, m, cap, sms, quick, log=print) -> dict | None:
    import triton.testing

    dev = torch.device("cuda")
    fn, x, t, _ = _runner(fmt, kind, n, k, m, dev)
    best = None
    for cfg in candidates(path, fmt, kind, n, k, m, sms, quick):
        try:
            secs = triton.testing.do_bench(lambda: fn(cfg, path), warmup=5, rep=15) * 1e-3
        except Exception as exc:  # too much shared memory, registers, ...
            log(f"    skip {cfg}: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
            continue
        if best is None or secs < best[1]:
            best = (cfg, secs)
    if best is None:
        return None
    cfg, secs = best
    experts = MOE_DECODE_EXPERTS if kind == "moe" else None
    ok = _correct(fmt, fn(cfg, path), x, t, m, experts)
    wbf = (torch.randn(experts or 1, n, k, device=dev) * 0.02).to(torch.bfloat16)
    xb = x.view(experts or 1, m, k)
    bf16 = triton.testing.do_bench(lambda: torch.bmm(xb, wbf.transpose(1, 2)), warmup=5, rep=15) * 1e-3
    heur = choose_config(path, fmt, kind, n, k, m, dev)
    log(f"  {path} {fmt} {kind} n={n} k={k} m={m}: best {secs * 1e6:.1f} us {cfg} "
        f"(bf16 {bf16 * 1e6:.1f} us; heuristic {heur == cfg}; correct {ok})")
    if not ok:
        return None
    return table_entry(cap, path, fmt, kind, n, k, m, cfg, f"tuned on {device_facts(dev.index or 0)[2]}",
                       us=round(secs * 1e6, 2), bf16_us=round(bf16 * 1e6, 2))


def tune(quick: bool = False, log=print) -> dict:
    cap, sms, name = device_facts(torch.cuda.current_device())
    paths = [PATH_SM100] if cap[0] == 10 else [PATH_SPLITK, PATH_BF16_MMA]
    buckets = (1, 2, 4, 8, 16, 64, 256) if quick else M_BUCKETS
    entries = []
    t0 = time.time()
    for path in paths:
        for fmt in ("nvfp4", "mxfp8"):
            for kind in KINDS:
                for n, k in real_shapes().values():
                    for m in buckets:
                        if path != PATH_SM100 and (path == PATH_SPLITK) != (m <= DECODE_MAX_M):
                            continue
                        e = tune_key(path, fmt, kind, n, k, m, cap, sms, quick, log)
                        if e is not None:
                            entries.append(e)
    log(f"tuned {len(entries)} entries in {time.time() - t0:.0f} s")
    return dict(version=1, device=name, note=f"tuned by inkling_kernels.autotune (quick={quick})",
                entries=entries)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="where to write the table (JSON)")
    ap.add_argument("--quick", action="store_true", help="fewer candidates and m buckets")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("autotune: needs a CUDA GPU (none found); nothing tuned")
        return 2
    write_table(tune(args.quick), Path(args.out))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
