"""What shared machines do to a long conversion: kill -9 at many points, SIGTERM/SIGINT, a full
disk (RLIMIT_FSIZE), a second writer, and a conversion split across machines (--part/--finalize).
Real processes, real files."""
import json
import random
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from inkling_quant.cli import main
from inkling_quant.io.safetensors import sha256_file
from inkling_quant.synth import write_checkpoint

ARGS = ["--default-activation-amax", "4", "--quiet", "--max-shard-size", "100KB"]


def _cli(*args) -> list[str]:
    return [sys.executable, "-m", "inkling_quant.cli", *args]


def _files(root: Path) -> dict[str, str]:
    return {p.name: sha256_file(p) for p in sorted(root.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def src_and_ref(tmp_path_factory):
    d = tmp_path_factory.mktemp("hard")
    src = write_checkpoint(d / "src", "tiny", experts=8)
    ref = d / "ref"
    assert main(["convert", str(src), str(ref), *ARGS]) == 0
    return src, ref


def _done(out: Path) -> int:
    try:
        return len(json.loads((out / ".inkling-quant-convert.json").read_text())["done"])
    except (OSError, ValueError, KeyError):
        return 0


def _start_and_wait(src, out, shards_done: int, *extra):
    proc = subprocess.Popen(_cli("convert", str(src), str(out), *ARGS, *extra), stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None and _done(out) < shards_done:
        time.sleep(0.002)
    return proc


def test_sigkill_at_many_points_always_resumes_byte_identical(src_and_ref, tmp_path):
    src, ref = src_and_ref
    shards = len([p for p in ref.iterdir() if p.suffix == ".safetensors"])
    rng = random.Random(0)
    # (shards done, then a random delay of up to about one shard's time (~10 ms here), so the kill
    # lands mid-read, mid-write, mid-rename or mid-manifest-update)
    points = [(0, 0.0), (5, 0.0)] + [(rng.randrange(1, shards - 10), rng.uniform(0, 0.02)) for _ in range(3)]
    for k, (at, delay) in enumerate(points):
        out = tmp_path / f"k{k}"
        proc = _start_and_wait(src, out, at)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert proc.returncode == -signal.SIGKILL, f"kill point {at}+{delay:.3f}s: the run ended first"
        assert not (out / "model.safetensors.index.json").exists()
        assert main(["convert", str(src), str(out), *ARGS, "--resume"]) == 0
        assert _files(out) == _files(ref), f"kill point {at} shards + {delay:.3f}s"


def test_resume_removes_the_temporaries_a_kill_left(src_and_ref, tmp_path):
    """A kill -9 while the manifest, the index or a shard was being written leaves a temporary
    under a random name (`<name>.<hex>.partial`), which no rerun overwrites: --resume removes
    this conversion's own, so the result is file for file the uninterrupted one."""
    src, ref = src_and_ref
    out = tmp_path / "o"
    proc = _start_and_wait(src, out, 2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    left = [".inkling-quant-convert.json", "model.safetensors.index.json", "config.json", "checksums.sha256",
            sorted(p.name for p in ref.iterdir() if p.suffix == ".safetensors")[-1]]
    for name in left:
        (out / f"{name}.0123456789abcdef.partial").write_bytes(b"half-written")
    assert main(["convert", str(src), str(out), *ARGS, "--resume"]) == 0
    assert _files(out) == _files(ref)


@pytest.mark.parametrize("sig,workers", [(signal.SIGTERM, 1), (signal.SIGINT, 1), (signal.SIGTERM, 2), (signal.SIGINT, 2)])
def test_sigterm_sigint_stop_cleanly_and_resume(src_and_ref, tmp_path, sig, workers):
    src, ref = src_and_ref
    out = tmp_path / "o"
    proc = _start_and_wait(src, out, 2, "--workers", str(workers))  # 2 workers: terminated mid-shard
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "--resume" in err and "Traceback" not in err
    assert not list(out.glob("*.partial")) and not (out / "model.safetensors.index.json").exists()
    assert not list(out.parent.glob(".o*.inkling-quant.lock"))  # the lock (beside OUT) is released
    assert main(["convert", str(src), str(out), *ARGS, "--resume"]) == 0
    assert _files(out) == _files(ref)


def test_second_writer_refused_and_stale_lock_taken_over(src_and_ref, tmp_path, capsys):
    src, ref = src_and_ref
    out = tmp_path / "o"
    first = _start_and_wait(src, out, 1)
    second = main(["convert", str(src), str(out), *ARGS, "--resume"])  # in-process: no start-up delay
    err = capsys.readouterr().err
    alive = first.poll() is None
    first.send_signal(signal.SIGKILL)
    first.wait()
    assert alive, "first conversion ended before the second started"
    assert second == 2 and "another conversion" in err and f"pid {first.pid}" in err
    assert (out.parent / ".o.inkling-quant.lock").exists()  # left behind by kill -9: stale now
    assert main(["convert", str(src), str(out), *ARGS, "--resume"]) == 0
    assert _files(out) == _files(ref)


def test_disk_full_stops_clearly_then_resume_finishes(src_and_ref, tmp_path):
    src, ref = src_and_ref
    out = tmp_path / "o"
    args = ["--default-activation-amax", "4", "--quiet", "--max-shard-size", "400KB"]

    def small_disk():
        resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, 300_000))

    r = subprocess.run(_cli("convert", str(src), str(out), *args), capture_output=True, text=True, preexec_fn=small_disk)
    assert r.returncode == 2, r.stderr
    assert "cannot write" in r.stderr and "--resume" in r.stderr and "Traceback" not in r.stderr
    assert not (out / "model.safetensors.index.json").exists() and not list(out.glob("*.partial"))
    subprocess.run(_cli("convert", str(src), str(out), *args, "--resume"), check=True)
    ref400 = tmp_path / "ref400"
    assert main(["convert", str(src), str(ref400), *args]) == 0
    assert _files(out) == _files(ref400)


def test_parts_then_finalize_equal_one_machine(src_and_ref, tmp_path, capsys):
    src, ref = src_and_ref
    out = tmp_path / "shared-fs"
    assert main(["convert", str(src), str(out), *ARGS, "--part", "2/3"]) == 0
    assert not (out / "model.safetensors.index.json").exists()
    assert main(["convert", str(src), str(out), *ARGS, "--finalize"]) == 2
    assert "not converted yet" in capsys.readouterr().err
    for p in ("1/3", "3/3"):
        assert main(["convert", str(src), str(out), *ARGS, "--part", p]) == 0
    assert main(["convert", str(src), str(out), *ARGS, "--finalize"]) == 0
    assert _files(out) == _files(ref)
    assert not list(out.glob(".inkling-quant*"))


def test_part_argument_validated(src_and_ref, tmp_path, capsys):
    src, _ = src_and_ref
    with pytest.raises(SystemExit):
        main(["convert", str(src), str(tmp_path / "o"), "--part", "4/3"])
    assert "1 <= I <= N" in capsys.readouterr().err
