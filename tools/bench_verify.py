"""Throughput of `inkling-quant verify` (structure + values + checksums, one read of each byte)
against `sha256sum` of the same files, side by side, on a synthetic checkpoint.

    python tools/bench_verify.py                      # bench preset, 6 layers x 4 experts
    python tools/bench_verify.py --layers 12 --experts 8 --work /data/bench --repeat 5 --json out.json
    python tools/bench_verify.py --preset tiny --repeat 1   # toy shapes: a smoke test of this script

Builds (or reuses, with --work) a BF16 checkpoint of the published Inkling 2 layout (synth's
`bench` preset: real Inkling-2-Small expert and attention shapes, experts stacked per layer),
converts it with the default scheme, then times on the converted files:
  sha256sum       `sha256sum FILES` (coreutils, a subprocess), the files checksums.sha256 lists
  verify          inkling_quant.verify.verify(CKPT): index, headers, layout, configs, values of
                  every tensor, sha256 of every listed file; in process, no --against
  verify (CLI)    `python -m inkling_quant.cli verify CKPT --quiet` as a subprocess (adds Python
                  and torch start-up)
  hashlib         Python's sha256 alone over the same files, one thread (the floor for verify)
Files are read once beforehand so every tool sees a warm page cache; best of --repeat runs.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from inkling_quant.convert import Options, convert  # noqa: E402
from inkling_quant.synth import write_checkpoint  # noqa: E402
from inkling_quant.verify import CHECKSUMS, verify  # noqa: E402


def _files(ckpt: Path) -> list[str]:
    return [line.split("  ", 1)[1] for line in (ckpt / CHECKSUMS).read_text().splitlines() if line.strip()]


def _cpu() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _best(fn, repeat: int) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of the fastest of `repeat` runs. CPU seconds (all threads and
    child processes) compare tools fairly on a shared machine, where wall time is noisy."""
    best = (float("inf"), float("inf"))
    for _ in range(repeat):
        t, c = time.perf_counter(), _cpu()
        fn()
        best = min(best, (time.perf_counter() - t, _cpu() - c))
    return best


def _hashlib(ckpt: Path, files: list[str]) -> None:
    buf = bytearray(32 << 20)
    mv = memoryview(buf)
    for f in files:
        h = hashlib.sha256()
        with open(ckpt / f, "rb", buffering=0) as fh:
            while n := fh.readinto(buf):
                h.update(mv[:n])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="bench", choices=("bench", "tiny"),
                    help="synth preset: bench (real shapes, default) or tiny (toy shapes)")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--work", help="work directory (kept; checkpoints reused when present)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", help="write the figures as JSON here")
    args = ap.parse_args(argv)

    work = Path(args.work) if args.work else ROOT / "bench-out" / "verify"
    tag = f"{args.preset}-{args.layers}x{args.experts}"
    src, ckpt = work / f"src-{tag}", work / f"conv-{tag}"
    work.mkdir(parents=True, exist_ok=True)
    if not (src / "model.safetensors.index.json").exists():
        print(f"synth {args.preset} checkpoint ({args.layers} layers x {args.experts} experts) -> {src}", flush=True)
        write_checkpoint(src, args.preset, layers=args.layers, experts=args.experts, overwrite=True, progress=True)
    if not (ckpt / "model.safetensors.index.json").exists():
        print(f"convert (default scheme) -> {ckpt}", flush=True)
        shutil.rmtree(ckpt, ignore_errors=True)
        convert(src, ckpt, Options(default_activation_amax=4.0), quiet=False)

    files = _files(ckpt)
    nbytes = sum((ckpt / f).stat().st_size for f in files)
    _hashlib(ckpt, files)  # warm the page cache for every tool
    if not verify(ckpt).ok:
        print("verify failed on the bench checkpoint: not benchmarking", file=sys.stderr)
        return 1

    rows = []
    sha = shutil.which("sha256sum")
    if sha:
        t = _best(lambda: subprocess.run([sha, *files], cwd=ckpt, check=True, stdout=subprocess.DEVNULL), args.repeat)
        rows.append(("sha256sum FILES (coreutils)", t))
    rows.append(("hashlib sha256 only (1 thread)", _best(lambda: _hashlib(ckpt, files), args.repeat)))
    stream = []

    def run_verify():
        r = verify(ckpt)
        assert r.ok
        stream.append(r.stream_seconds)
    rows.append(("inkling-quant verify (in process)", _best(run_verify, args.repeat)))
    rows.append(("  of which the one-read pass (wall)", (min(stream), float("nan"))))
    cmd = [sys.executable, "-m", "inkling_quant.cli", "verify", str(ckpt), "--quiet"]
    rows.append(("inkling-quant verify (CLI, incl. start-up)",
                 _best(lambda: subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL), args.repeat)))

    print(f"\n{ckpt}: {len(files)} files, {nbytes / 1e9:.3f} GB (warm page cache, best of {args.repeat}, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f})")
    print(f"  {'tool':<44} {'wall s':>8} {'MB/s':>7} {'CPU s':>7} {'MB/CPU-s':>9} {'speed vs sha256sum':>19}")
    base = rows[0][1][0] if sha else None
    for name, (t, c) in rows:
        rel = f"{base / t:18.2f}x" if base else "-"
        cpu = f"{c:7.2f} {nbytes / 1e6 / c:9.0f}" if c == c else f"{'-':>7} {'-':>9}"
        print(f"  {name:<44} {t:8.3f} {nbytes / 1e6 / t:7.0f} {cpu} {rel:>19}")
    if args.json:
        Path(args.json).write_text(json.dumps({"checkpoint": str(ckpt), "files": len(files), "bytes": nbytes,
                                               "cpus": os.cpu_count(), "repeat": args.repeat,
                                               "load_average": os.getloadavg(),
                                               "results": [{"tool": n.strip(), "seconds": round(t, 4),
                                                            "mb_per_s": round(nbytes / 1e6 / t, 1),
                                                            "cpu_seconds": round(c, 4) if c == c else None}
                                                           for n, (t, c) in rows]}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
