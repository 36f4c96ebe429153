#!/usr/bin/env python
"""Does conversion time grow linearly with the checkpoint and peak memory stay flat? And what does
that project for the full Inkling 2 Small on one node and on N nodes?

The measurement converts ``synth --preset bench`` checkpoints of growing size (default ~1, 2, 4 GB)
with ``inkling_quant.convert`` (scheme default: NVFP4 W4A4 with a constant activation amax, MXFP8 in
the last sixth of the layers). The bench preset has the real expert shapes (stacked w13 [E, 2I, H] =
[E, 4608, 4608], w2 [E, H, I] = [E, 4608, 2304], bf16); the layer count is fixed (default 3: two
NVFP4 layers, one MXFP8) and the routed-expert count grows, so only expert bytes grow, as they do up
to the real model. Each run is its own process (tools/benchlib.py: os.wait4 peak RSS of the largest
process, /proc-sampled sum over the process tree, CPU seconds). Prints a table, a least-squares line
seconds = a + b * GB with its residuals, and the projection.

The projection is for the real model (``Inkling2Config.reference()``, configs/inkling-2-small.json:
48 layers x 384 experts at those shapes, 1.174 TB of routed experts, its own pass-through bytes; the
bytes out are what the formats declare). Its assumptions, printed with it: one worker per core, each
core converting at the measured rate of this machine divided by its CPUs (the converter's read,
quantize and hash/write threads of one worker keep two cores busy here); nodes split the shards
(`convert --part I/N`, docs/scale.md); storage delivers the read and write rates each cell prints,
unless --read-gbs / --write-gbs cap them (then the cell is the slower of compute and storage).

    python tools/bench_scale.py                       # sizes 1,2,4 GB on ./bench-out (disk)
    python tools/bench_scale.py --sizes 1,2,3,4 --work-dir /dev/shm/ib
    python tools/bench_scale.py --from-json bench-out/real.json --skip-measure --read-gbs 5 --write-gbs 3

--from-json takes tools/bench_real.py's --json (its expert-heavy input's per-format rates; its RSS
sweep as the linear fit with --skip-measure) or tools/bench_convert.py's: a second projection then
charges each part of the real model at its own measured rate: NVFP4 experts at ours' nvfp4 net expert
rate, MXFP8 experts at the mxfp8 one, pass-through at the copy floor.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import ROOT, args_or_child, helper, ours_env, run_measured, sync_disk  # noqa: E402

BC = Path(__file__).resolve().parent / "bench_convert.py"  # its children: synth, ours
TARGET_S = 15 * 60  # issue 17: 594 B on one 16-core node under 15 minutes


def bench_sizes(layers: int, experts: int) -> tuple[int, int]:
    """(total bf16 bytes, routed-expert bytes) of the bench preset at layers x experts."""
    sys.path.insert(0, str(ROOT))
    from inkling_quant.model.inkling2 import Inkling2Config, checkpoint_tensors, classify
    from inkling_quant.synth import make_config

    specs = list(checkpoint_tensors(Inkling2Config.from_dict(make_config("bench", layers, experts))))
    return sum(s.nbytes for s in specs), sum(s.nbytes for s in specs if classify(s.name).part == "expert")


def child(spec: dict) -> None:
    """Helpers that import torch run in a child, so that the measuring process stays lean."""
    if spec["kind"] == "sizes":
        res = {"sizes": [[e, *bench_sizes(spec["layers"], e)] for e in range(1, spec["max_experts"] + 1)]}
    elif spec["kind"] == "reference":
        res = reference_model(spec["scheme"])
    else:
        raise SystemExit(f"unknown child kind {spec['kind']!r}")
    Path(spec["result"]).write_text(json.dumps(res))


def reference_model(scheme_name: str = "default") -> dict:
    """The real model by what the scheme makes of it: bytes in and out per format, and the
    routed-expert tensors (projection, shape, how many)."""
    sys.path.insert(0, str(ROOT))
    from inkling_quant.formats import FORMATS
    from inkling_quant.export.inkling import projection_specs
    from inkling_quant.model.inkling2 import Inkling2Config, checkpoint_tensors, classify
    from inkling_quant.schemes import get_scheme

    cfg = Inkling2Config.reference()
    scheme = get_scheme(scheme_name)
    bytes_in = {"passthrough": 0, "nvfp4": 0, "mxfp8": 0}
    bytes_out = dict(bytes_in)
    experts: dict[str, list] = {}
    for s in checkpoint_tensors(cfg):
        rec = classify(s.name)
        fmt = scheme.format_name(cfg, rec)
        bytes_in[fmt] += s.nbytes
        bytes_out[fmt] += s.nbytes if fmt == "passthrough" else sum(
            o.nbytes for o in projection_specs(FORMATS[fmt], rec.projection, s.shape, dtype=s.dtype).values())
        if rec.part == "expert":
            experts.setdefault(f"{rec.projection} {list(s.shape)} {str(s.dtype).removeprefix('torch.')}", [0])[0] += 1
    return {"in": {**bytes_in, "total": sum(bytes_in.values())}, "out": {**bytes_out, "total": sum(bytes_out.values())},
            "layers": cfg.num_hidden_layers, "experts": cfg.text.n_routed_experts,
            "expert_tensors": {k: v[0] for k, v in experts.items()}}


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
    return f"{s / 3600:.1f} h" if s >= 3600 else f"{s / 60:.1f} min"


# ============================================================================ measurement
def measure(args, work: Path, env: dict) -> list[dict]:
    """convert --scheme args.scheme on bench inputs of --sizes GB, one process each."""
    me = Path(__file__).resolve()
    sizes = [float(s) for s in args.sizes.split(",")]
    print(f"scheme {args.scheme}, {args.workers} workers, {args.layers} layer(s), experts grown to reach "
          f"{', '.join(f'{s:g}' for s in sizes)} GB; work dir {work}; {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    print(f"  {'src GB':>6} {'experts':>7} {'expert GB':>9} {'seconds':>8} {'MB/s':>7} {'cpu s':>6} "
          f"{'peak RSS MB':>11} {'tree RSS MB':>11} {'load':>5} {'(synth s)':>9}", flush=True)
    most = int(max(sizes) * 1e9 / 63.7e6) + 16  # one expert of the bench preset: 63.7 MB
    table = helper(me, {"kind": "sizes", "layers": args.layers, "max_experts": most}, work / "sizes.json", env)["sizes"]
    rows = []
    for target in sizes:
        experts, total, expert = min(table, key=lambda row: abs(row[1] / 1e9 - target))
        src, out = work / "src", work / "out"
        t0 = time.perf_counter()
        helper(BC, {"kind": "synth", "out": str(src), "layers": args.layers, "experts": experts}, work / "synth.json", env)
        synth_s = time.perf_counter() - t0
        spec = {"kind": "ours", "src": str(src), "out": str(out), "scheme": args.scheme, "weight_only": False,
                "activation_amax": args.activation_amax, "workers": args.workers,
                "max_shard_size": args.max_shard_size, "result": str(work / "res.json")}
        # the first size twice, the first run unrecorded: the VM faults in memory it has not
        # touched recently at a fraction of the usual speed (docs/benchmarks.md)
        for _ in range(2 if not rows else 1):
            shutil.rmtree(out, ignore_errors=True)
            sync_disk()
            meas = run_measured([sys.executable, str(BC), "--child", json.dumps(spec)],
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
    return rows


def report_fit(rows: list[dict], workers: int, cpus: int) -> dict | None:
    """The line seconds = a + b * GB; its slope's throughput per core (the machine's / its CPUs)."""
    xs, ys = [r["src_gb"] for r in rows], [r["seconds"] for r in rows]
    a, b, r2 = fit_line(xs, ys)
    print(f"\nfit: seconds = {a:.1f} + {b:.2f} * GB (R^2 {r2:.4f}); residuals: "
          + ", ".join(f"{r['src_gb']:.2f} GB {100 * (r['seconds'] - a - b * r['src_gb']) / r['seconds']:+.1f}%"
                      for r in rows))
    tree = [r["peak_tree_rss_mb"] for r in rows]
    print(f"peak RSS (process tree): {min(tree):.0f}-{max(tree):.0f} MB over a {xs[-1] / xs[0]:.1f}x range of "
          f"source size")
    if b <= 0:
        print("no usable slope (sizes too close, or noise): no projection from the fit")
        return None
    per_core = 1000 / b / cpus
    print(f"marginal throughput {1000 / b:.0f} MB/s with {workers} worker(s) on {cpus} CPUs = {per_core:.0f} MB/s "
          f"per core")
    return {"intercept_s": round(a, 2), "seconds_per_gb": round(b, 3), "r2": round(r2, 5),
            "per_core_mb_per_s": round(per_core, 1)}


# ============================================================================ rates from another run
def _cpus(cj: dict) -> int:
    """CPUs of the machine a --json was taken on (its 'machine' line: 'x86_64 N CPUs, ...')."""
    return cj.get("cpus") or int(cj["machine"].split()[1])


def per_format_rates(cj: dict, workers: int) -> dict:
    """Per-core MB/s of NVFP4 and MXFP8 experts (net of pass-through, charged at the copy floor) and of
    pass-through, from bench_real's expert-heavy input or bench_convert's results."""
    cpus = _cpus(cj)
    if "targets" in cj:  # bench_real: best work s of each case on the expert-heavy input
        st = cj["inputs"]["experts"]["stats"]
        best = {r["id"]: r for r in cj["results"] if r["input"] == "experts"}
        floor_s, pass_frac = best["none"]["best_work_s"], 1 - st["expert_bytes"] / st["bytes"]

        def net(cid):
            s = best[cid]["best_work_s"] - floor_s * pass_frac
            if s < 0.1 * best[cid]["best_work_s"]:  # the experts' share lost in the noise of a small input
                raise SystemExit(f"--from-json: no usable {cid} expert rate (too few expert bytes)")
            return st["expert_bytes"] / 1e6 / s

        nv, mx, cp = net("nvfp4"), net("mxfp8"), best["none"]["mb_per_s"]
        src = f"bench_real, expert-heavy input, --workers {cj.get('workers', '?')}"
    else:  # bench_convert
        def rate(case, scheme):
            for r in cj["results"]:
                if r["case"] == case and r["scheme"].startswith(scheme) and r["workers"] == workers:
                    return r
            raise SystemExit(f"--from-json: no {case} {scheme} at {workers} workers")

        nv, mx = rate("ours", "nvfp4").get("expert_mb_per_s"), rate("ours", "mxfp8").get("expert_mb_per_s")
        if not (nv and mx):
            raise SystemExit("--from-json: no usable expert MB/s (input too small to separate from noise)")
        cp, src = rate("copy", "passthrough")["src_mb_per_s"], f"bench_convert, {workers} worker(s)"
    return {"from": src, "cpus": cpus, "nvfp4": nv / cpus, "mxfp8": mx / cpus, "passthrough": cp / cpus}


def sweep_rows(cj: dict) -> list[dict]:
    """bench_real's RSS sweep as rows of the linear fit."""
    return [{"src_gb": s["src_gb"], "seconds": s["work_s"], "peak_tree_rss_mb": s["peak_tree_rss_mb"]}
            for s in cj.get("sweep", [])]


# ============================================================================ projection
def describe_model(ref: dict) -> None:
    i, o = ref["in"], ref["out"]
    shapes = "; ".join(f"{k} x{n}" for k, n in ref["expert_tensors"].items())
    print(f"\nthe real model: {ref['layers']} layers x {ref['experts']} routed experts ({shapes}); "
          f"in {i['total'] / 1e12:.3f} TB (NVFP4-bound experts {i['nvfp4'] / 1e12:.3f} TB, MXFP8-bound "
          f"{i['mxfp8'] / 1e12:.3f} TB, pass-through {i['passthrough'] / 1e9:.1f} GB); out {o['total'] / 1e12:.3f} TB")


def project(ref: dict, one_core_s: float, label: str, machines: list[int], wpm: list[int],
            read_gbs: float | None, write_gbs: float | None) -> list[dict]:
    """Wall time of the full conversion on n nodes x w workers (one core each): the compute time
    one_core_s / (n w), or the storage's if --read-gbs / --write-gbs make that longer; with the
    read and write rates per node that it takes."""
    caps = ", ".join(f"{k} capped at {v:g} GB/s per node" for k, v in (("reads", read_gbs), ("writes", write_gbs)) if v)
    print(f"\n{label}\n  assumes: one worker per core at that rate, nodes splitting the shards (--part I/N); "
          f"{caps or 'storage keeping up (the read and write GB/s per node it takes are shown)'}")
    print(f"  {'nodes':>5} {'workers':>7} {'wall':>10} {'read GB/s':>10} {'write GB/s':>10}  bound")
    rows = []
    for n in machines:
        for w in wpm:
            t_cpu = one_core_s / (n * w)
            t_read = ref["in"]["total"] / n / 1e9 / read_gbs if read_gbs else 0.0
            t_write = ref["out"]["total"] / n / 1e9 / write_gbs if write_gbs else 0.0
            t = max(t_cpu, t_read, t_write)
            bound = "compute" if t == t_cpu else "reads" if t == t_read else "writes"
            row = {"nodes": n, "workers_per_node": w, "seconds": round(t), "human": hours(t), "bound": bound,
                   "read_gbs_per_node": round(ref["in"]["total"] / n / 1e9 / t, 2),
                   "write_gbs_per_node": round(ref["out"]["total"] / n / 1e9 / t, 2)}
            rows.append(row)
            print(f"  {n:5d} {w:7d} {row['human']:>10} {row['read_gbs_per_node']:10.2f} "
                  f"{row['write_gbs_per_node']:10.2f}  {bound}")
    one = next((r for r in rows if r["nodes"] == 1 and r["workers_per_node"] == 16), None)
    if one is not None:
        print(f"  {'PASS' if one['seconds'] < TARGET_S else 'FAIL'}  one 16-core node under 15 min: {one['human']}")
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1,2,4", help="target source sizes in GB (comma list)")
    p.add_argument("--layers", type=int, default=3, help="decoder layers, fixed across sizes (default 3)")
    p.add_argument("--scheme", default="default", help="conversion scheme (default: default)")
    p.add_argument("--activation-amax", type=float, default=8.0, help="constant activation amax (NVFP4 W4A4)")
    p.add_argument("--workers", type=int, default=1, help="converter workers (default 1: one process keeps the "
                   "two cores here busy)")
    p.add_argument("--max-shard-size", default="500MB", help="output shard size")
    p.add_argument("--work-dir", default=str(ROOT / "bench-out" / "scale"))
    p.add_argument("--machines", default="1,2,4,8", help="projection: node counts")
    p.add_argument("--workers-per-machine", default="16", help="projection: workers (one core each) per node")
    p.add_argument("--read-gbs", type=float, help="projection: storage read GB/s per node (default: keeps up)")
    p.add_argument("--write-gbs", type=float, help="projection: storage write GB/s per node (default: keeps up)")
    p.add_argument("--from-json", "--convert-json", dest="from_json",
                   help="tools/bench_real.py or tools/bench_convert.py --json output, for the per-format projection")
    p.add_argument("--convert-workers", type=int, default=1, help="which worker count of a bench_convert --json")
    p.add_argument("--skip-measure", action="store_true", help="no conversions here: project from --from-json "
                   "(bench_real's sweep for the linear fit)")
    p.add_argument("--json", metavar="OUT", help="write all results as JSON")
    args = args_or_child(p, argv, child)
    if args is None:
        return 0
    if args.skip_measure and not args.from_json:
        p.error("--skip-measure needs --from-json")

    work = Path(args.work_dir)
    if work.exists():
        shutil.rmtree(work)
    (work / "logs").mkdir(parents=True)
    env = ours_env()
    cj = json.loads(Path(args.from_json).read_text()) if args.from_json else None
    rows, workers, cpus = [], args.workers, os.cpu_count() or 1
    if not args.skip_measure:
        rows = measure(args, work, env)
    elif sweep_rows(cj):
        rows, workers, cpus = sweep_rows(cj), cj.get("workers", 1), _cpus(cj)
        print(f"linear fit from {args.from_json}'s RSS sweep ({len(rows)} sizes)")
    fit = report_fit(rows, workers, cpus) if len(rows) >= 2 else None

    ref = helper(Path(__file__).resolve(), {"kind": "reference", "scheme": args.scheme}, work / "ref.json", env)
    describe_model(ref)
    machines = [int(x) for x in args.machines.split(",")]
    wpm = [int(x) for x in args.workers_per_machine.split(",")]
    proj, rates = {}, None
    if fit:
        proj["fit"] = project(ref, ref["in"]["total"] / 1e6 / fit["per_core_mb_per_s"],
                              f"(1) the linear fit's {fit['per_core_mb_per_s']:.0f} MB/s per core on the bench "
                              f"input's mix", machines, wpm, args.read_gbs, args.write_gbs)
    if cj:
        rates = per_format_rates(cj, args.convert_workers)
        one = sum(ref["in"][f] / 1e6 / rates[f] for f in ("nvfp4", "mxfp8", "passthrough"))
        proj["per_format"] = project(
            ref, one, f"(2) per format from {args.from_json} ({rates['from']}; per core of {rates['cpus']}): NVFP4 "
            f"experts {rates['nvfp4']:.0f}, MXFP8 experts {rates['mxfp8']:.0f}, pass-through "
            f"{rates['passthrough']:.0f} MB/s (effective {ref['in']['total'] / 1e6 / one:.0f})",
            machines, wpm, args.read_gbs, args.write_gbs)

    if args.json:
        Path(args.json).write_text(json.dumps({
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "machine": f"{platform.machine()} {os.cpu_count()} CPUs, {platform.platform()}",
            "command": " ".join(["python", "tools/bench_scale.py", *(argv if argv is not None else sys.argv[1:])]),
            "scheme": args.scheme, "workers": workers, "rows": rows, "fit": fit, "reference": ref,
            "per_format_rates": rates, "read_gbs": args.read_gbs, "write_gbs": args.write_gbs,
            "projection": proj}, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    shutil.rmtree(work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
