#!/usr/bin/env python
"""A hub conversion against a real Hub-compatible server (olah, as the hub tests run it), with the
shard prefetch on and off: how much of the download the conversion hides.

One ``synth --preset tiny`` checkpoint with many experts (8 layers x 256 experts, 74 MB in 8 MB
shards: olah reads each file whole out of git for every request, which real expert shapes make
minutes long) is committed as a git repository,
served by olah on 127.0.0.1 behind a forwarder that caps the bytes per second it sends back
(``--rate-mb``: a network link; 0 = no cap, loopback speed), and converted by
``inkling-quant convert bench/inkling OUT --scheme default`` into a fresh HF_HOME each run:

  download   ``snapshot_download`` of the repo alone (the link's time for these bytes)
  local      ``inkling-quant convert`` of the same files from a local directory (the converter's time)
  off        the hub conversion with INKLING_QUANT_HUB_PREFETCH=0: each shard downloaded when read
  on         the hub conversion as shipped: shard k+1 downloads while shard k converts

Each run is a process of its own (wall time includes its ~3 s of imports); ``--repeat N`` keeps
the fastest. The ``download/waiting/convert s`` columns are the ``hub`` entry of ``--json``. With
the overlap, ``on`` approaches max(download, local) + one shard's download; without it, the sum.

    python tools/bench_hub.py                      # 8 layers x 256 experts, 8 MB shards, 10 MB/s link
    python tools/bench_hub.py --rate-mb 0          # loopback: downloads cost little, little to hide
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
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from hub_server import Olah, Throttle, commit_files, olah_venv  # noqa: E402

from inkling_quant.synth import write_checkpoint  # noqa: E402

REPO = "bench/inkling"
CONVERT = ["--scheme", "default", "--default-activation-amax", "4", "--quiet"]


def run(cmd: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)}: exit {r.returncode}\n{r.stderr[-3000:]}")
    return time.perf_counter() - t0


def env_for(endpoint: str, home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    # olah reads a whole file (out of git) before its first byte: more than the client's 10 s on a busy machine
    env.update(HF_ENDPOINT=endpoint, HF_HOME=str(home), HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DOWNLOAD_TIMEOUT="120",
               HF_HUB_ETAG_TIMEOUT="120",
               PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""), **extra)
    return env


def case(name: str, work: Path, endpoint: str) -> dict:
    """One run in a fresh HF_HOME and output: wall seconds and the report's hub timings."""
    home, out, report = work / "home", work / "out", work / "report.json"
    for p in (home, out):
        shutil.rmtree(p, ignore_errors=True)
    py = [sys.executable, "-m", "inkling_quant.cli"]
    if name == "download":
        code = f"from huggingface_hub import snapshot_download as s; s({REPO!r})"
        return {"wall_s": run([sys.executable, "-c", code], env_for(endpoint, home))}
    if name == "local":
        return {"wall_s": run(py + ["convert", str(work / "src"), str(out), *CONVERT], env_for(endpoint, home))}
    prefetch = {"on": "1", "off": "0"}[name]
    wall = run(py + ["convert", REPO, str(out), *CONVERT, "--json", str(report)],
               env_for(endpoint, home, INKLING_QUANT_HUB_PREFETCH=prefetch))
    r = json.loads(report.read_text())
    return {"wall_s": wall, "seconds": r["seconds"], **{k: r["hub"][k] for k in
                                                         ("download_seconds", "waiting_seconds", "convert_seconds")}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--shard-mb", type=int, default=8, help="source shard size (olah reads whole files into memory)")
    ap.add_argument("--rate-mb", type=float, default=10.0, help="link speed in MB/s (0: no cap)")
    ap.add_argument("--repeat", type=int, default=1, help="keep the fastest of N runs per case")
    ap.add_argument("--work-dir", type=Path, default=Path("bench-out/hub"))
    ap.add_argument("--json", type=Path, help="write the figures as JSON")
    a = ap.parse_args()

    work = a.work_dir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    src = work / "src"
    if not src.exists():
        write_checkpoint(src, "tiny", layers=a.layers, experts=a.experts, max_shard_bytes=a.shard_mb << 20)
    shards = sorted(src.glob("*.safetensors"))
    total = sum(p.stat().st_size for p in shards)
    mirrors = work / "mirrors"
    shutil.rmtree(mirrors, ignore_errors=True)
    commit_files(mirrors / "models" / REPO, src, "bench checkpoint")
    (work / "olah").mkdir(exist_ok=True)
    server = Olah(olah_venv(), mirrors, work / "olah")
    try:
        server.wait_ready(REPO)
        link = Throttle(server.port, a.rate_mb * 1e6 or None)
        results = {}
        for name in ("download", "local", "off", "on"):
            runs = [case(name, work, link.endpoint) for _ in range(a.repeat)]
            results[name] = min(runs, key=lambda r: r["wall_s"])
            print(f"{name:>9}: {json.dumps({k: round(v, 2) for k, v in results[name].items()})}", flush=True)
        link.close()
    finally:
        server.stop()

    print(f"\n{len(shards)} source shards, {total / 1e6:.0f} MB; link {a.rate_mb or 'uncapped'} MB/s; "
          f"{os.cpu_count()} CPUs")
    print(f"{'case':<9} {'wall s':>7} {'download s':>11} {'waiting s':>10} {'convert s':>10}")
    for name, r in results.items():
        print(f"{name:<9} {r['wall_s']:>7.1f} {r.get('download_seconds', float('nan')):>11.1f} "
              f"{r.get('waiting_seconds', float('nan')):>10.1f} {r.get('convert_seconds', float('nan')):>10.1f}")
    if a.json:
        a.json.write_text(json.dumps({"shards": len(shards), "bytes": total, "rate_mb_s": a.rate_mb,
                                      "cpus": os.cpu_count(), "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
