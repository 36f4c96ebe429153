"""What the benchmark scripts share: a measured process run (wall seconds, CPU seconds, peak RSS of
the largest process and of the whole process tree), unmeasured helper children, the environments
our code and llm-compressor run in, and llm-compressor's own venv.

The measuring process never imports torch: a child's ru_maxrss (wait4) starts from its parent's
RSS at exec, so a lean parent is what makes the per-process peaks true.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LC_VERSION = "0.14.0.1"
TORCH_VERSION = "2.13.0"


def mb(n: float) -> float:
    return n / 1e6


# ============================================================================ process measurement
def _children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rfind(b")") + 2:].split()[1])
        kids.setdefault(ppid, []).append(int(d))
    return kids


def _tree_rss_kb(pid: int) -> int:
    kids = _children_map()
    todo, total = [pid], 0
    while todo:
        p = todo.pop()
        todo.extend(kids.get(p, ()))
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
                        break
        except OSError:
            pass
    return total


def run_measured(cmd: list[str], log: Path, env: dict | None = None) -> dict:
    """Run cmd; return wall seconds, rusage (max single-process RSS, CPU of the whole tree) and the
    peak RSS summed over the process tree, sampled every 50 ms."""
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    with open(log, "wb") as lf:
        p = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        peak = [0]
        done = threading.Event()

        def sample():
            while not done.wait(0.05):
                peak[0] = max(peak[0], _tree_rss_kb(p.pid))

        th = threading.Thread(target=sample, daemon=True)
        th.start()
        try:
            _, status, ru = os.wait4(p.pid, 0)
        except BaseException:
            p.kill()
            raise
        finally:
            done.set()
            th.join()
        p.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{' '.join(map(str, cmd))} exited {p.returncode}; log {log}:\n{tail}")
    return {"wall_s": round(wall, 2), "cpu_s": round(ru.ru_utime + ru.ru_stime, 2),
            "peak_rss_mb": round(ru.ru_maxrss / 1024, 1), "peak_tree_rss_mb": round(peak[0] / 1024, 1),
            "load_before": round(load0, 2), "load_after": round(os.getloadavg()[0], 2)}


def sync_disk() -> None:
    os.sync()  # flush the previous case's dirty pages so they are not written during the next one


def cpu_s() -> float:
    """Inside a measured child: CPU seconds of this process and of its reaped children (our
    spawned workers)."""
    import resource

    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime


def helper(script: str | Path, spec: dict, result: Path, env: dict | None = None) -> dict:
    """Run `script --child spec` unmeasured and return the JSON it writes to `result`."""
    subprocess.run([sys.executable, str(script), "--child", json.dumps({**spec, "result": str(result)})],
                   check=True, cwd=ROOT, env=env)
    res = json.loads(result.read_text())
    result.unlink()
    return res


# ============================================================================ environments
def ours_env(root: str | Path | None = None) -> dict:
    """This checkout's inkling_quant (or ROOT's, another revision's) first on the path: a worktree wins over an
    editable install."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(root or ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def lc_env() -> dict:
    """llm-compressor's venv: nothing of ours on the path, no GPU."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def ensure_lc_venv(venv: Path) -> Path:
    """llm-compressor's python, its venv created on first use (a few minutes), reused after."""
    py = venv / "bin" / "python"
    probe = [str(py), "-c", f"import llmcompressor, torch; assert llmcompressor.__version__ == '{LC_VERSION}'"]
    if py.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return py
    print(f"creating {venv} (torch=={TORCH_VERSION}, then llmcompressor=={LC_VERSION}; a few minutes)", flush=True)
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(py), "-m", "pip", "install", "-q"]
    # torch first: llmcompressor's torch requirement would otherwise pull a CUDA build (~3 GB).
    subprocess.run(pip + [f"torch=={TORCH_VERSION}"], check=True)
    subprocess.run(pip + [f"llmcompressor=={LC_VERSION}"], check=True)
    subprocess.run(probe, check=True)
    return py


def args_or_child(p: argparse.ArgumentParser, argv, child) -> argparse.Namespace | None:
    """`p`'s arguments; or, when this script was started as a measured child of itself
    (`--child SPEC`, see `helper`), run `child(spec)` and return None."""
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(json.loads(args.child))
        return None
    return args
