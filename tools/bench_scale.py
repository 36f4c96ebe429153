#!/usr/bin/env python
"""Does conversion time grow linearly with the checkpoint and peak memory stay flat? And what does
that project for the full Inkling 2 Small (~1.19 TB of bf16)?

Converts ``synth --preset bench`` checkpoints of growing size (default ~1, 2, 4 GB) with
``inkling_quant.convert`` (scheme default: NVFP4 W4A4 with a constant activation amax, MXFP8 in the
last sixth of the layers). The layer count is fixed (default 3: two NVFP4 layers, one MXFP8) and
the routed-expert count grows, so the pass-through part (embeddings, vision tower, draft, attention)
is the same in every run and only expert bytes grow, as they do up to the real model. Each run is
its own process (tools/bench_convert.py's measurement: os.wait4 peak RSS of the largest process,
/proc-sampled sum over the process tree, CPU seconds). Prints a table, a least-squares line
seconds = a + b * GB with its residuals, and the projection of the full conversion on N machines x
W workers (one core each) from the measured per-core throughput (1/b divided by the cores used).

    python tools/bench_scale.py                       # sizes 1,2,4 GB on ./bench-out (disk)
    python tools/bench_scale.py --sizes 1,2,3,4 --work-dir /dev/shm/ib
    python tools/bench_scale.py --convert-json bench-out/convert.json   # + per-format projection

With --convert-json (the --json of tools/bench_convert.py) a second projection charges each part of
the real model at its own measured rate: NVFP4 experts at ours' nvfp4 net expert rate, MXFP8 experts
at the mxfp8 one, pass-through at the copy floor (all at the same worker count, divided per worker).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_convert as bc  # noqa: E402  (the process measurement and the child runner)


def bench_sizes(layers: int, experts: int) -> tuple[int, int]:
    """(total bf16 bytes, routed-expert bytes) of the bench preset at layers x experts."""
    from inkling_quant.inkling2 import Inkling2Config, checkpoint_tensors, classify
    from inkling_quant.synth import make_config

    specs = list(checkpoint_tensors(Inkling2Config.from_dict(make_config("bench", layers, experts))))
    return sum(s.nbytes for s in specs), sum(s.nbytes for s in specs if classify(s.name).part == "expert")


def child(spec: dict) -> None:
    """Helpers that import torch run in a child, so that the measuring process stays lean (see
    bench_convert.helper)."""
    if spec["kind"] == "sizes":
        res = {"sizes": [[e, *bench_sizes(spec["layers"], e)] for e in range(1, spec["max_experts"] + 1)]}
    elif spec["kind"] == "reference":
        res = reference_bytes(spec["scheme"])
    else:
        raise SystemExit(f"unknown child kind {spec['kind']!r}")
    Path(spec["result"]).write_text(json.dumps(res))


def reference_bytes(scheme_name: str = "default") -> dict:
    """bytes of the real model by what the scheme makes of them."""
    from inkling_quant.inkling2 import Inkling2Config, checkpoint_tensors, classify
    from inkling_quant.schemes import get_scheme

    cfg = Inkling2Config.reference()
    scheme = get_scheme(scheme_name)
    out = {"passthrough": 0, "nvfp4": 0, "mxfp8": 0}
    for s in checkpoint_tensors(cfg):
        out[scheme.format_name(cfg, classify(s.name))] += s.nbytes
    out["total"] = sum(out.values())
    return out


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    a = my - b * mx
    ss_res = sum((y - a - b * x) ** 2 for x, y in zip(xs, ys))
    ss_tot = sum((y - my) ** 2 for y in ys)
    return a, b, (1 - ss_res / ss_tot) if ss_tot else 1.0


def hours(s: float) -> str:
    return f"{s / 3600:.1f} h" if s >= 3600 else f"{s / 60:.0f} min"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1,2,4", help="target source sizes in GB (comma list)")
    p.add_argument("--layers", type=int, default=3, help="decoder layers, fixed across sizes (default 3)")
    p.add_argument("--scheme", default="default", help="conversion scheme (default: default)")
    p.add_argument("--activation-amax", type=float, default=8.0, help="constant activation amax (NVFP4 W4A4)")
    p.add_argument("--workers", type=int, default=2, help="converter workers (default 2 = the CPUs here)")
    p.add_argument("--max-shard-size", default="500MB", help="output shard size")
    p.add_argument("--work-dir", default=str(ROOT / "bench-out" / "scale"))
    p.add_argument("--machines", default="1,4,16", help="projection: machine counts")
    p.add_argument("--workers-per-machine", default="2,16,64", help="projection: workers (one core each) per machine")
    p.add_argument("--convert-json", help="tools/bench_convert.py --json output, for the per-format projection")
    p.add_argument("--convert-workers", type=int, default=1, help="which worker count of --convert-json to use "
                   "(default 1: one process using every CPU, no spawn start-up in the figure)")
    p.add_argument("--json", metavar="OUT", help="write all results as JSON")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(json.loads(args.child))
        return 0

    me = Path(__file__).resolve()
    work = Path(args.work_dir)
    if work.exists():
        shutil.rmtree(work)
    (work / "logs").mkdir(parents=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    sizes = [float(s) for s in args.sizes.split(",")]
    if len(sizes) < 2:
        p.error("--sizes needs at least two sizes to fit a line")
    print(f"scheme {args.scheme}, {args.workers} workers, {args.layers} layer(s), experts grown to reach "
          f"{', '.join(f'{s:g}' for s in sizes)} GB; work dir {work}; {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    print(f"  {'src GB':>6} {'experts':>7} {'expert GB':>9} {'seconds':>8} {'MB/s':>7} {'cpu s':>6} "
          f"{'peak RSS MB':>11} {'tree RSS MB':>11} {'load':>5} {'(synth s)':>9}", flush=True)
    table_sizes = bc.helper(me, {"kind": "sizes", "layers": args.layers, "max_experts": 128}, work / "sizes.json",
                            env)["sizes"]
    rows = []
    for target in sizes:
        experts, total, expert = min(table_sizes, key=lambda row: abs(row[1] / 1e9 - target))
        src, out = work / "src", work / "out"
        t0 = time.perf_counter()
        bc.helper(bc.__file__, {"kind": "synth", "out": str(src), "layers": args.layers, "experts": experts},
                  work / "synth.json", env)
        synth_s = time.perf_counter() - t0
        spec = {"kind": "ours", "src": str(src), "out": str(out), "scheme": args.scheme, "weight_only": False,
                "activation_amax": args.activation_amax, "workers": args.workers,
                "max_shard_size": args.max_shard_size, "result": str(work / "res.json")}
        bc.sync_disk()
        meas = bc.run_measured([sys.executable, str(Path(bc.__file__).resolve()), "--child", json.dumps(spec)],
                               work / "logs" / f"convert-{experts}.log", env=env)
        res = json.loads((work / "res.json").read_text())
        rep = res["report"]
        row = {"src_gb": round(total / 1e9, 3), "layers": args.layers, "experts": experts,
               "expert_gb": round(expert / 1e9, 3), "seconds": round(res["work_s"], 2),
               "mb_per_s": round(total / 1e6 / res["work_s"], 1), "work_cpu_s": round(res["work_cpu_s"], 1),
               "bytes_out": rep["bytes_out"], "shards_out": rep["shards"], **meas, "synth_s": round(synth_s, 1)}
        rows.append(row)
        print(f"  {row['src_gb']:6.2f} {experts:7d} {row['expert_gb']:9.2f} {row['seconds']:8.1f} "
              f"{row['mb_per_s']:7.1f} {row['work_cpu_s']:6.1f} {row['peak_rss_mb']:11.0f} "
              f"{row['peak_tree_rss_mb']:11.0f} {row['load_before']:5.1f} {synth_s:9.0f}", flush=True)
        shutil.rmtree(out)
        shutil.rmtree(src)

    # ------------------------------------------------------------- linearity
    xs, ys = [r["src_gb"] for r in rows], [r["seconds"] for r in rows]
    a, b, r2 = fit_line(xs, ys)
    print(f"\nfit: seconds = {a:.1f} + {b:.1f} * GB (R^2 {r2:.4f}); residuals: "
          + ", ".join(f"{r['src_gb']:.2f} GB {100 * (r['seconds'] - a - b * r['src_gb']) / r['seconds']:+.1f}%"
                      for r in rows))
    rss = [r["peak_rss_mb"] for r in rows]
    tree = [r["peak_tree_rss_mb"] for r in rows]
    print(f"peak RSS, largest process: {min(rss):.0f}-{max(rss):.0f} MB; process tree: {min(tree):.0f}-{max(tree):.0f} MB "
          f"over a {xs[-1] / xs[0]:.1f}x range of source size")
    marginal = 1 / b if b > 0 else float("nan")  # GB/s for the machine at args.workers
    cores = min(args.workers, os.cpu_count() or 1) if args.workers > 1 else (os.cpu_count() or 1)
    per_worker = marginal / cores  # a worker of the projection is one core
    print(f"marginal throughput {1000 * marginal:.0f} MB/s with {args.workers} worker(s) on {cores} cores = "
          f"{1000 * per_worker:.0f} MB/s per core (= per projected worker)")

    # ------------------------------------------------------------- projection
    ref = bc.helper(me, {"kind": "reference", "scheme": args.scheme}, work / "ref.json", env)
    machines = [int(x) for x in args.machines.split(",")]
    wpm = [int(x) for x in args.workers_per_machine.split(",")]
    print(f"\nprojection, full model: {ref['total'] / 1e12:.3f} TB bf16 (NVFP4 {ref['nvfp4'] / 1e12:.3f} TB, "
          f"MXFP8 {ref['mxfp8'] / 1e12:.3f} TB, pass-through {ref['passthrough'] / 1e12:.4f} TB) "
          f"at {1000 * per_worker:.0f} MB/s per worker, assuming throughput scales with workers and the "
          f"disks/network keep up (needed read rate per machine shown); N machines = `convert --part I/N`")
    proj = []
    scale_rates = {"from": "bench_scale marginal throughput", "per_worker_mb_per_s": round(1000 * per_worker, 1)}
    t_one = ref["total"] / 1e9 / per_worker  # seconds for one worker

    def table(t_worker: float, label: str, per_worker_gbs: float):
        print(f"  {label}")
        print(f"  {'machines':>8} " + " ".join(f"{f'{w} workers':>14}" for w in wpm) + "   read MB/s per machine")
        for n in machines:
            cells = [hours(t_worker / (n * w)) for w in wpm]
            print(f"  {n:8d} " + " ".join(f"{c:>14}" for c in cells) + "   "
                  + ", ".join(f"{1000 * per_worker_gbs * w:.0f}" for w in wpm))
            for w, c in zip(wpm, cells):
                proj.append({"basis": label, "machines": n, "workers_per_machine": w,
                             "seconds": round(t_worker / (n * w)), "human": c})

    table(t_one, f"(1) bench_scale: {1000 * per_worker:.0f} MB/s per worker on the bench's format mix", per_worker)

    per_format = None
    if args.convert_json:
        cj = json.loads(Path(args.convert_json).read_text())
        w = args.convert_workers
        cores = os.cpu_count() or 1  # a "worker" of the projection is one core: divide machine rates by the CPUs

        def rate(case, scheme):
            for r in cj["results"]:
                if r["case"] == case and r["scheme"].startswith(scheme) and r["workers"] == w:
                    return r
            raise SystemExit(f"{args.convert_json}: no {case} {scheme} at {w} workers")

        r_nv, r_mx = rate("ours", "nvfp4").get("expert_mb_per_s"), rate("ours", "mxfp8").get("expert_mb_per_s")
        if not (r_nv and r_mx):
            raise SystemExit(f"{args.convert_json}: no usable expert MB/s (input too small to separate from noise)")
        r_nv, r_mx = r_nv / cores, r_mx / cores
        r_cp = rate("copy", "passthrough")["src_mb_per_s"] / cores
        t_pf = ref["nvfp4"] / 1e6 / r_nv + ref["mxfp8"] / 1e6 / r_mx + ref["passthrough"] / 1e6 / r_cp
        per_format = {"nvfp4_mb_per_s_per_worker": round(r_nv, 1), "mxfp8_mb_per_s_per_worker": round(r_mx, 1),
                      "copy_mb_per_s_per_worker": round(r_cp, 1), "one_worker_seconds": round(t_pf)}
        eff = ref["total"] / 1e6 / t_pf
        table(t_pf, f"(2) per format from {args.convert_json} ({w} worker(s), per core): NVFP4 {r_nv:.0f}, MXFP8 {r_mx:.0f}, pass-through "
                    f"{r_cp:.0f} MB/s per worker (effective {eff:.0f})", eff / 1000)

    summary = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs, {platform.platform()}",
        "command": " ".join(["python", "tools/bench_scale.py", *(argv if argv is not None else sys.argv[1:])]),
        "scheme": args.scheme, "workers": args.workers, "rows": rows,
        "fit": {"intercept_s": round(a, 2), "seconds_per_gb": round(b, 2), "r2": round(r2, 5)},
        "per_worker_mb_per_s": round(1000 * per_worker, 1), "scale_rates": scale_rates,
        "reference_bytes": ref, "per_format": per_format, "projection": proj,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    shutil.rmtree(work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
