"""A real Hub-compatible server for the hub tests: olah (a self-hosted Hugging Face mirror) in
offline mode, serving git repositories from a mirrors directory, on a free port of 127.0.0.1.

- olah gets a venv of its own (it needs huggingface_hub>=1.27, whatever ours holds), installed
  from tools/olah-requirements.txt (pinned, --no-deps) once per machine under
  ~/.cache/inkling-quant-olah/<hash of that file>. Where it cannot be installed (no package
  index, no git) the tests skip, saying why; with INKLING_QUANT_REQUIRE_HUB_TESTS=1 (CI) they fail.
- olah ignores Range, reads whole files into memory and answers 401 for a missing file or
  branch: keep the checkpoints tiny and assert no exception class of the Hub's.
- `Throttle`: a TCP forwarder in front of olah whose server-to-client bytes per second a test
  sets (a slow network: a shard download that lasts long enough to be killed mid-way).

The session fixture `hub` is imported by tests/test_hub.py (conftest.py is not touched)."""
from __future__ import annotations

import hashlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REQUIREMENTS = ROOT / "tools" / "olah-requirements.txt"
REQUIRE_ENV = "INKLING_QUANT_REQUIRE_HUB_TESTS"
STARTUP_S = 90  # olah took 2-18 s to answer here; a loaded CI machine gets more


def _unavailable(why: str):
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"hub tests: {why} ({REQUIRE_ENV}=1)")
    pytest.skip(f"hub tests need olah, a Hub-compatible server: {why}")


# --------------------------------------------------------------------------- olah's venv
def olah_venv() -> Path:
    """olah's venv, built once per requirements file (into a temporary name, renamed when complete)."""
    digest = hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "inkling-quant-olah"
    venv = cache / digest
    if (venv / "bin" / "python").exists():
        return venv
    cache.mkdir(parents=True, exist_ok=True)
    tmp = cache / f"{digest}.building-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    steps = [[sys.executable, "-m", "venv", str(tmp)],
             [str(tmp / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
              "-r", str(REQUIREMENTS)]]
    for cmd in steps:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            _unavailable(f"cannot install it ({' '.join(cmd[-4:])}: exit {r.returncode}): "
                         f"{(r.stderr or r.stdout).strip()[-400:]}")
    try:
        tmp.rename(venv)
    except OSError:  # another session built it meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
    return venv


# --------------------------------------------------------------------------- repositories
def git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1",
           "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.com"}
    r = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)}: {r.stderr.strip()}")
    return r.stdout.strip()


def commit_files(repo: Path, files_from: Path, message: str, tag: str | None = None) -> str:
    """Replace the repository's files with those of `files_from` and commit them; the commit hash."""
    if not (repo / ".git").exists():
        repo.mkdir(parents=True, exist_ok=True)
        git(repo, "init", "-q", "-b", "main")
    for p in repo.iterdir():
        if p.name != ".git":
            p.unlink()
    for p in files_from.iterdir():
        shutil.copyfile(p, repo / p.name)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", message)
    if tag:
        git(repo, "tag", tag)
    return git(repo, "rev-parse", "HEAD")


# --------------------------------------------------------------------------- the server
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Olah:
    """olah serving `mirrors` (models/<org>/<name> git repositories) on 127.0.0.1, offline."""

    def __init__(self, venv: Path, mirrors: Path, work: Path):
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        config = work / "olah.toml"
        config.write_text(f'[basic]\nhost = "127.0.0.1"\nport = {self.port}\nrepos-path = "{work / "repos"}"\n'
                          f'mirrors-path = ["{mirrors}"]\n[accessibility]\noffline = true\n')
        self.log = work / "olah.log"
        with open(self.log, "wb") as log:  # cwd: olah writes ./logs
            # `python -m olah.server`, not bin/olah-cli: the venv was built under another name, which
            # the scripts' #! lines keep
            self.proc = subprocess.Popen([str(venv / "bin" / "python"), "-m", "olah.server", "-c", str(config)], cwd=work,
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, repo: str) -> float:
        """Seconds until the repo's revision API answers (not `/`: it answers before the mirrors do)."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < STARTUP_S:
            if self.proc.poll() is not None:
                raise RuntimeError(f"olah exited ({self.proc.returncode}): {self.log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.endpoint}/api/models/{repo}/revision/main", timeout=2) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        raise RuntimeError(f"olah did not serve {repo} within {STARTUP_S} s: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # its own session: uvicorn and nothing else of ours
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


class Throttle:
    """127.0.0.1:port forwarding to `target_port`; `rate` (bytes/s, None: unlimited) caps what
    flows back to the clients, all connections together (one link), read on every chunk so a
    test can change it between runs."""

    def __init__(self, target_port: int, rate: float | None = None):
        self.target, self.rate = target_port, rate
        self.lock, self.free_at = threading.Lock(), 0.0  # when the link is free to send again
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, throttled: bool) -> None:
        try:
            while chunk := src.recv(8192):
                if throttled and self.rate:
                    with self.lock:  # this chunk's turn on the link
                        self.free_at = end = max(time.monotonic(), self.free_at) + len(chunk) / self.rate
                    time.sleep(max(0.0, end - time.monotonic()))
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def close(self) -> None:
        self.sock.close()


# --------------------------------------------------------------------------- the fixture
@dataclass
class Hub:
    endpoint: str
    throttle: Throttle
    local: dict[str, Path]          # revision -> the files committed there (a local source to compare with)
    commits: dict[str, str]         # "v1", "main" -> commit hash
    adapter: Path                   # the adapter's files, as committed to org/tiny-lora
    startup_s: float
    venv_s: float
    homes: list[Path] = field(default_factory=list)

    REPO = "org/tiny"
    ADAPTER = "org/tiny-lora"

    def env(self, home: Path, *, endpoint: str | None = None, offline: bool = False, **extra: str) -> dict[str, str]:
        """The environment of a CLI run against the server: its own HF_HOME (the cache), no token."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
        env.update(HF_ENDPOINT=endpoint or self.endpoint, HF_HOME=str(home), HF_HUB_DISABLE_TELEMETRY="1",
                   PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""), **extra)
        if offline:
            env["HF_HUB_OFFLINE"] = "1"
        return env


def build_repos(tmp: Path, mirrors: Path) -> tuple[dict[str, Path], dict[str, str], Path]:
    """org/tiny: tag v1 = a tiny checkpoint (seed 0), main = another one (seed 1), so that a
    revision really selects the weights; org/tiny-lora: an attention adapter for them."""
    from inkling_quant.synth import write_checkpoint
    from test_lora_original import adapter_for

    local, commits = {}, {}
    repo = mirrors / "models" / "org" / "tiny"
    for rev, seed in (("v1", 0), ("main", 1)):
        local[rev] = write_checkpoint(tmp / f"src-{rev}", "tiny", seed=seed, layers=2, experts=4,
                                      max_shard_bytes=1 << 18)
        commits[rev] = commit_files(repo, local[rev], f"tiny checkpoint, seed {seed}", tag=rev if rev != "main" else None)
    adapter = adapter_for(local["main"], tmp / "adapter")
    commit_files(mirrors / "models" / "org" / "tiny-lora", adapter, "attention adapter")
    return local, commits, adapter


@pytest.fixture(scope="session")
def hub(tmp_path_factory):
    """olah on a free local port serving org/tiny and org/tiny-lora; stopped after the session."""
    if shutil.which("git") is None:
        _unavailable("git is not installed (olah serves git repositories)")
    t0 = time.monotonic()
    venv = olah_venv()
    venv_s = time.monotonic() - t0
    tmp = tmp_path_factory.mktemp("hub")
    mirrors = tmp / "mirrors"
    local, commits, adapter = build_repos(tmp, mirrors)
    (tmp / "olah").mkdir()
    server = Olah(venv, mirrors, tmp / "olah")
    throttle = None
    try:
        startup = server.wait_ready(Hub.REPO)
        throttle = Throttle(server.port)
        yield Hub(server.endpoint, throttle, local, commits, adapter, startup, venv_s)
    finally:
        if throttle is not None:
            throttle.close()
        server.stop()
