"""Hub sources end to end against a real Hub-compatible server (olah, tests/hub_server.py): every
command runs as a user runs it, `inkling-quant ...` in a process of its own with HF_ENDPOINT
and a fresh HF_HOME, and what it writes is compared byte for byte with the same command on the
same files held locally. A conversion killed (SIGKILL) during a shard download resumes; a rerun
with HF_HUB_OFFLINE=1 works from the cache; a missing repo, a missing revision and an unreachable
server are one line and exit 2. The prefetcher's order and bound are tested without a server."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import hub_server
from hub_server import Hub, free_port
from inkling_quant import hub as hubmod
from inkling_quant import lora
from inkling_quant.convert import Options, convert
from inkling_quant.inspect_cmd import summarize

hub = hub_server.hub  # the session fixture, by the name the tests request

SHARD = 1 << 17  # output shards of 128 KiB: several jobs, so that prefetching has a next shard
CONVERT = ["--default-activation-amax", "4", "--max-shard-size", str(SHARD), "--quiet"]


def cli(hub: Hub, home: Path, *args: str, timeout: float = 120, **env_kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "inkling_quant.cli", *args], env=hub.env(home, **env_kw),
                          capture_output=True, text=True, timeout=timeout)


def ok(r: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def assert_same_tree(got: Path, want: Path) -> None:
    """File for file the same bytes; the index the same but for the source identity it records
    (a hub revision there, local files' sizes and times here: runner.SOURCE_KEY)."""
    names = sorted(p.name for p in got.iterdir())
    assert names == sorted(p.name for p in want.iterdir())
    for n in names:
        if n == "model.safetensors.index.json":
            a, b = (json.loads((d / n).read_text()) for d in (got, want))
            for d in (a, b):
                d["metadata"].pop("inkling_quant_source")
            assert a == b, n
            continue
        assert (got / n).read_bytes() == (want / n).read_bytes(), n


def blobs(home: Path, repo: str = Hub.REPO) -> Path:
    return home / "hub" / f"models--{repo.replace('/', '--')}" / "blobs"


@pytest.fixture(scope="module")
def local_out(hub, tmp_path_factory):
    """revision -> the same files converted locally, in this process (the reference)."""
    tmp = tmp_path_factory.mktemp("local")
    out = {}
    for rev, src in hub.local.items():
        out[rev] = tmp / rev
        convert(src, out[rev], Options(default_activation_amax=4.0, max_shard_bytes=SHARD), quiet=True)
    return out


@pytest.fixture(scope="module")
def main_run(hub, tmp_path_factory):
    """`convert org/tiny` into a fresh cache: (output, --json report, HF_HOME)."""
    tmp = tmp_path_factory.mktemp("main")
    ok(cli(hub, tmp / "home", "convert", Hub.REPO, str(tmp / "out"), *CONVERT, "--json", str(tmp / "r.json")))
    return tmp / "out", json.loads((tmp / "r.json").read_text()), tmp / "home"


# --------------------------------------------------------------------------- convert
def test_convert_repo_equals_local_conversion(hub, main_run, local_out):
    out, report, _ = main_run
    assert_same_tree(out, local_out["main"])
    h = report["hub"]
    assert (h["repo"], h["commit"], h["prefetch"]) == (Hub.REPO, hub.commits["main"], True)
    assert report["shards"] > 2 and h["download_seconds"] > 0 and h["convert_seconds"] > 0
    assert 0 <= h["waiting_seconds"] <= report["seconds"]


@pytest.mark.parametrize("rev, extra, env", [
    ("v1", [], {}),                                            # a tag
    ("commit", ["--workers", "2"], {}),                        # a full commit hash; worker processes
    ("v1", [], {hubmod.PREFETCH_ENV: "0"}),                    # each shard downloaded when read
], ids=["tag", "commit-workers2", "tag-no-prefetch"])
def test_convert_revision_equals_local_conversion(hub, local_out, tmp_path, rev, extra, env):
    spec = f"{Hub.REPO}@{hub.commits['v1'] if rev == 'commit' else rev}"
    ok(cli(hub, tmp_path / "home", "convert", spec, str(tmp_path / "out"), *CONVERT, *extra,
           "--json", str(tmp_path / "r.json"), **env))
    assert_same_tree(tmp_path / "out", local_out["v1"])  # v1's weights, not main's
    h = json.loads((tmp_path / "r.json").read_text())["hub"]
    assert h["commit"] == hub.commits["v1"] and h["prefetch"] == (not env)


def test_offline_rerun_from_the_cache(hub, main_run, local_out, tmp_path):
    _, _, home = main_run
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: any request would fail
    ok(cli(hub, home, "convert", Hub.REPO, str(tmp_path / "out"), *CONVERT, endpoint=dead, offline=True))
    assert_same_tree(tmp_path / "out", local_out["main"])


def test_kill_during_shard_download_then_resume(hub, local_out, tmp_path):
    """SIGKILL while a shard is half downloaded (a throttled link) and after a shard is
    converted; `--resume` keeps that shard, finishes the download and equals the local result."""
    home, out = tmp_path / "home", tmp_path / "out"
    hub.throttle.rate = 100_000  # bytes/s: a 256 KiB source shard takes ~2.6 s
    args = [sys.executable, "-m", "inkling_quant.cli", "convert", Hub.REPO, str(out), *CONVERT]
    proc = subprocess.Popen(args, env=hub.env(home, endpoint=hub.throttle.endpoint), start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and proc.poll() is None:
            manifest = out / ".inkling-quant-convert.json"
            done = json.loads(manifest.read_text())["done"] if manifest.exists() else {}
            partial = list(blobs(home).glob("*.incomplete"))  # a download under way (written at its end)
            if done and partial:
                break
            time.sleep(0.05)
        assert proc.poll() is None, f"finished or failed before it could be killed: {proc.stdout.read()}"
        assert done and partial, "no shard converted while another downloaded within 90 s"
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        hub.throttle.rate = None
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (out / "model.safetensors.index.json").exists()
    orphans = set(blobs(home).glob("*.incomplete"))  # huggingface_hub's per-process temporary: not reused
    r = ok(cli(hub, home, "convert", Hub.REPO, str(out), *CONVERT, "--resume", "--json", "-"))
    report = json.loads(r.stdout)
    assert report["shards_resumed"] >= len(done) >= 1
    assert_same_tree(out, local_out["main"])
    assert set(blobs(home).glob("*.incomplete")) == orphans  # the resumed run left none of its own


# --------------------------------------------------------------------------- inspect, verify, lora
def test_inspect_repo_reads_headers_only(hub, tmp_path):
    home = tmp_path / "home"
    got = json.loads(ok(cli(hub, home, "inspect", Hub.REPO, "--json", "-")).stdout)
    want = summarize(hub.local["main"]).to_dict()
    assert got.pop("checkpoint") != want.pop("checkpoint")
    assert got == want
    cached = sum(p.stat().st_size for p in blobs(home).iterdir())
    assert cached < min(p.stat().st_size for p in hub.local["main"].glob("*.safetensors"))  # no shard came


def test_verify_against_repo(hub, main_run):
    out, _, home = main_run
    r = cli(hub, home, "verify", str(out), "--against", Hub.REPO, "--json", "-")
    report = json.loads(ok(r).stdout)
    status = {c["id"]: c["status"] for c in report["checks"]}
    assert status["source"] == status["passthrough"] == "pass"
    assert any(n.startswith("numerics") and s == "pass" for n, s in status.items()), status


def test_lora_merge_with_hub_adapter(hub, main_run, tmp_path):
    out, _, home = main_run
    ok(cli(hub, home, "lora", "merge", str(out), Hub.ADAPTER, str(tmp_path / "hub"), "--quiet"))
    lora.merge(out, hub.adapter, tmp_path / "local")
    shards = sorted(p.name for p in (tmp_path / "local").glob("*.safetensors"))
    assert shards == sorted(p.name for p in (tmp_path / "hub").glob("*.safetensors"))
    for n in shards:
        assert (tmp_path / "hub" / n).read_bytes() == (tmp_path / "local" / n).read_bytes(), n
    rec_hub, rec_local = (json.loads((tmp_path / d / "config.json").read_text())[lora.PROVENANCE_KEY][-1]
                          for d in ("hub", "local"))
    assert rec_hub["adapter"] == Hub.ADAPTER and rec_hub["adapter_sha256"] == rec_local["adapter_sha256"]


# --------------------------------------------------------------------------- errors
@pytest.mark.parametrize("spec, endpoint, says", [
    ("org/no-such-repo", None, "not found"),
    ("org/tiny@no-such-branch", None, "no-such-branch"),
    ("org/tiny", "dead", "cannot reach"),
], ids=["missing-repo", "missing-revision", "unreachable"])
def test_clear_error_without_traceback(hub, tmp_path, spec, endpoint, says):
    dead = f"http://127.0.0.1:{free_port()}"
    r = cli(hub, tmp_path / "home", "convert", spec, str(tmp_path / "out"), *CONVERT,
            endpoint=dead if endpoint else None)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"inkling-quant convert: error: {spec}: ") and says in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- the prefetcher alone
def test_prefetcher_downloads_in_order_one_shard_ahead(monkeypatch):
    """Shards come in the order the jobs read them, each once, and never more than one past the
    last one a reader asked for; with worker processes, one past the running jobs' last."""
    log: list[tuple[str, int]] = []  # (shard downloaded, highest position asked for then)
    asked = [-1]
    lock = threading.Lock()

    def fake_download(repo, commit, shard):
        with lock:
            log.append((shard, asked[0]))
        return Path(f"/cache/{shard}")

    monkeypatch.setattr(hubmod, "_download", fake_download)
    needs = [["a", "b"], ["b", "c"], ["d"], ["d", "e"]]
    order = ["a", "b", "c", "d", "e"]
    with hubmod.shard_source("org/x", "0" * 40, needs, pooled=0) as source:
        for job in needs:
            for s in job:
                with lock:
                    asked[0] = max(asked[0], order.index(s))
                assert hubmod.fetch_shard("org/x", "0" * 40, s) == Path(f"/cache/{s}")
            time.sleep(0.05)  # let the thread run ahead as far as it may
            source.finished(type("R", (), {"seconds": 1.0, "fetch_seconds": 0.25})())
    assert [s for s, _ in log] == order
    assert all(order.index(s) <= a + 1 for s, a in log), log
    assert source.report()["hub"]["convert_seconds"] == 3.0 and hubmod._active is None

    log.clear()
    with hubmod.shard_source("org/x", "0" * 40, needs, pooled=2) as source:
        time.sleep(0.1)
        assert [s for s, _ in log] == ["a", "b", "c", "d"]  # jobs 0 and 1 may run: c, then one more
        source.finished(type("R", (), {"seconds": 1.0, "fetch_seconds": 0.0})())
        time.sleep(0.1)
        assert [s for s, _ in log] == order


def test_snapshot_links_into_blobs_only(tmp_path):
    """A snapshot's files link to ../../blobs/<hash> (huggingface_hub's cache): read; a link
    anywhere else, even next door, is refused as it is for any checkpoint."""
    from inkling_quant.errors import UnsafePathError
    from inkling_quant.io.checkpoint import safe_child

    snap = tmp_path / "models--org--x" / "snapshots" / "c0ffee"
    snap.mkdir(parents=True)
    for d in ("blobs", "elsewhere"):
        (tmp_path / "models--org--x" / d).mkdir()
        (tmp_path / "models--org--x" / d / "h").write_text("{}")
    (snap / "config.json").symlink_to("../../blobs/h")
    (snap / "tokenizer.json").symlink_to("../../elsewhere/h")
    assert safe_child(snap, "config.json").read_text() == "{}"
    with pytest.raises(UnsafePathError, match="outside the checkpoint"):
        safe_child(snap, "tokenizer.json")
    other = tmp_path / "plain"
    other.mkdir()
    (other / "config.json").symlink_to(snap.parent.parent / "blobs" / "h")  # not a snapshot directory
    with pytest.raises(UnsafePathError, match="outside the checkpoint"):
        safe_child(other, "config.json")
