"""Safety properties of every command, through the CLI, one test (or parametrized test) per
defect class:

  1. the source is never deleted or written (OUT = SRC, OUT around SRC, OUT inside SRC, a source
     named like OUT's staging (OUT.partial) or backup (OUT.old) directory, --json into SRC)
  2. writes never follow a symlink planted in OUT to a file outside it (a shard's or a JSON
     file's `.partial`, checksums.sha256.partial), and a config.json symlink leaving the source
     is refused like an escaping shard symlink
  3. no silently wrong output (an activation amax that makes input_scale 0/NaN, calibration
     entries that match no module, experts too small for their format: convert refuses exactly
     what its verify would fail)
  4. file names cannot forge lines (checksums.sha256, verify's report)
  5. no tracebacks (OUT a regular file, absurd sizes and numbers, --json at a directory, a
     hf_quant_config.json that is not an object, a huge --seed, a killed worker process)
  6. crash windows resume (index written but manifest left; --resume on a complete OUT; an FP32
     pass-through source verifies)
  7. bounded work on hostile configs (layers x experts blown up; a regex with catastrophic
     backtracking in an adapter's target_modules)
  8. two writers into one OUT: at most one succeeds, OUT is complete and consistent
  9. messages name the file and the tensor

Every "refused" case checks: exit code != 0 (2 for usage/input errors), no traceback, stderr is
one or a few lines starting with "inkling-quant ", the source byte-for-byte unchanged, nothing
outside OUT changed. Tiny checkpoints (4 experts): the whole file takes well under a minute on
two cores when the code is right (tests that guard against hangs wait up to 20 s each when it
is not). Commands run in-process where a subprocess adds nothing (an exception escaping `main`
is turned into a traceback on the captured stderr), in a subprocess where a kill, a timeout,
concurrency or the real stderr matters.
"""
from __future__ import annotations

import hashlib
import io
import json
import math
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
import traceback
from contextlib import ExitStack, redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from inkling_quant.cli import main
from inkling_quant.formats import FORMATS
from inkling_quant.formats.nvfp4 import MIN_AMAX as NVFP4_MIN_AMAX
from inkling_quant.model.inkling2 import Inkling2Config
from inkling_quant.synth import write_checkpoint

AMAX = ["--default-activation-amax", "4", "--quiet"]
MANIFEST = ".inkling-quant-convert.json"   # convert's resume manifest (inkling_quant/convert/runner.py)
INDEX = "model.safetensors.index.json"
CHECKSUMS = "checksums.sha256"
HANG_S = 20                               # "bounded work": a command must finish within this
VICTIM_BYTES = b"victim: must keep these bytes\n"


# =========================================================================== helpers
@dataclass
class Result:
    rc: int
    out: str
    err: str


def cli(*args, timeout: float = 120) -> Result:
    """`python -m inkling_quant.cli ARGS` in a subprocess (real stderr, real tracebacks)."""
    r = subprocess.run([sys.executable, "-m", "inkling_quant.cli", *map(str, args)], capture_output=True, text=True,
                       timeout=timeout)
    return Result(r.returncode, r.stdout, r.stderr)


class StillRunning(BaseException):
    """Raised by call()'s alarm (a BaseException: no `except Exception` in the code swallows it)."""


def call(*args, limit_s: float | None = None) -> Result:
    """`inkling_quant.cli.main(ARGS)` in-process; an exception escaping main becomes a traceback
    on the captured stderr, exactly what the user would see. With `limit_s`, a command still
    running after that long is stopped (and reported as a StillRunning traceback)."""
    out, err = io.StringIO(), io.StringIO()

    def alarm(*_):
        raise StillRunning(f"still running after {limit_s} s")

    old = signal.signal(signal.SIGALRM, alarm) if limit_s else None
    if limit_s:
        signal.setitimer(signal.ITIMER_REAL, limit_s)
    try:
        with redirect_stdout(out), redirect_stderr(err):
            try:
                rc = main([str(a) for a in args])
            except SystemExit as e:  # argparse
                rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except BaseException:  # noqa: BLE001 - what the user would get: a traceback
                traceback.print_exc()
                rc = 1
    finally:
        if limit_s:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
    return Result(rc, out.getvalue(), err.getvalue())


def tree_digest(path: Path) -> dict[str, tuple]:
    """relative path -> (lstat type, sha256 of a regular file / target of a symlink) for `path`
    and everything under it (symlinks not followed); {} when `path` does not exist."""
    path = Path(path)
    out: dict[str, tuple] = {}

    def one(p: Path, rel: str) -> None:
        st = os.lstat(p)
        kind = stat.S_IFMT(st.st_mode)
        if stat.S_ISREG(st.st_mode):
            out[rel] = (kind, hashlib.sha256(p.read_bytes()).hexdigest())
        elif stat.S_ISLNK(st.st_mode):
            out[rel] = (kind, os.readlink(p))
        else:
            out[rel] = (kind, None)
        if stat.S_ISDIR(st.st_mode):
            for c in sorted(os.listdir(p)):
                one(p / c, f"{rel}/{c}" if rel != "." else c)

    if os.path.lexists(path):
        one(path, ".")
    return out


def changes(before: dict[str, tuple], after: dict[str, tuple], limit: int = 6) -> list[str]:
    """What differs between two tree_digests, in words (empty when nothing changed)."""
    out = [f"removed {k}" for k in before if k not in after] + [f"added {k}" for k in after if k not in before] \
        + [f"changed {k}" for k in before if k in after and before[k] != after[k]]
    return out[:limit] + ([f"... {len(out) - limit} more"] if len(out) > limit else [])


def outside(digest: dict[str, tuple], out_rel: str) -> dict[str, tuple]:
    """The entries of a tree_digest that are not OUT (a path relative to the digest's root) or under it."""
    return {k: v for k, v in digest.items() if k != out_rel and not k.startswith(out_rel + "/")}


def stderr_is_clean(r: Result) -> None:
    """No traceback; after a failure, what stderr says is our one-line(ish) message (or argparse's
    usage + error)."""
    assert "Traceback" not in r.err, r.err
    if r.rc != 0 and r.err.strip():
        lines = r.err.strip().splitlines()
        if lines[0].startswith("usage: inkling-quant"):  # argparse: usage, then "inkling-quant CMD: error: ..."
            assert lines[-1].startswith("inkling-quant "), r.err
        else:
            assert r.err.startswith("inkling-quant "), r.err
            assert len(lines) <= 4, r.err


def assert_refused(r: Result, code: int | None = None) -> None:
    assert r.rc != 0, f"exit 0, expected a refusal\nstdout: {r.out[-2000:]}\nstderr: {r.err[-2000:]}"
    if code is not None:
        assert r.rc == code, f"exit {r.rc}, expected {code}\nstderr: {r.err[-3000:]}"
    assert r.err.strip(), f"exit {r.rc} without a message on stderr\nstdout: {r.out[-2000:]}"
    stderr_is_clean(r)


def victim(d: Path, name: str = "victim.txt") -> Path:
    d.mkdir(parents=True, exist_ok=True)
    p = d / name
    p.write_bytes(VICTIM_BYTES)
    return p


def sha256(p: Path) -> str:
    return hashlib.sha256(Path(p).read_bytes()).hexdigest()


_SUM = re.compile(r"([0-9a-f]{64})  (\S.*)")
_SUM_ESCAPED = re.compile(r"\\([0-9a-f]{64})  (\S.*)")


def _unescape(name: str) -> str:
    """sha256sum's escaping of a name with a newline or backslash: \\n and \\\\."""
    return re.sub(r"\\(.)", lambda m: {"n": "\n", "\\": "\\", "r": "\r"}.get(m.group(1), m.group(1)), name)


def assert_checksums_unforged(out: Path) -> None:
    """Every line of OUT/checksums.sha256 is `<sha256>  <name>` (or sha256sum's escaped form,
    starting with a backslash) and names a file of OUT whose bytes have that digest."""
    p = out / CHECKSUMS
    if not p.exists():
        return
    text = p.read_text()
    assert text.endswith("\n") or not text
    for line in text.split("\n")[:-1]:
        m = _SUM_ESCAPED.fullmatch(line)
        name = _unescape(m.group(2)) if m else None
        if m is None:
            m = _SUM.fullmatch(line)
            assert m, f"{p}: forged or malformed line {line!r}"
            name = m.group(2)
        f = out / name
        assert f.is_file(), f"{p}: line {line!r} names no file of {out}"
        assert sha256(f) == m.group(1), f"{p}: line {line!r} does not match {name!r}'s bytes"


def safetensors_files(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.name.endswith(".safetensors"))


# =========================================================================== fixtures
@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("safety")


@pytest.fixture(scope="module")
def src(base) -> Path:
    """The tiny BF16 source (published layout, 4 experts). Never modified: tests copy it first."""
    return write_checkpoint(base / "src", "tiny", experts=4)


@pytest.fixture(autouse=True)
def _shared_inputs_untouched(request):
    """Every test that reads the shared source (or the shared converted checkpoint) leaves it as it was."""
    shared = [request.getfixturevalue(n) for n in ("src", "converted") if n in request.fixturenames]
    before = [tree_digest(p) for p in shared]
    yield
    for p, b in zip(shared, before):
        diff = changes(b, tree_digest(p))
        assert not diff, f"the shared input {p} changed: {diff}"


@pytest.fixture(scope="module")
def converted(base, src) -> Path:
    """`convert src` with the default options (one output shard). Never modified."""
    out = base / "converted"
    r = call("convert", src, out, *AMAX)
    assert r.rc == 0, r.err
    return out


@pytest.fixture(scope="module")
def cfg(src) -> Inkling2Config:
    return Inkling2Config.load(src)


def write_adapter(d: Path, cfg: Inkling2Config, **config) -> Path:
    """A PEFT LoRA adapter (hand-written, as tests/test_lora_original.py does) on layer 0's query
    projection, as PEFT names it on transformers' Inkling2ForConditionalGeneration (`q_proj.linear`,
    the checkpoint's `attn.wq_du`)."""
    d.mkdir(parents=True, exist_ok=True)
    nh, _, hd = cfg.text.attention_dims(0)
    hidden = cfg.text.hidden_size
    gen = torch.Generator().manual_seed(0)
    r = 4
    a = torch.randn(r, hidden, generator=gen) / math.sqrt(hidden)
    b = torch.randn(nh * hd, r, generator=gen) * 0.02
    module = "base_model.model.model.language_model.layers.0.self_attn.q_proj.linear"
    save_file({f"{module}.lora_A.weight": a.contiguous(), f"{module}.lora_B.weight": b.contiguous()},
              d / "adapter_model.safetensors")
    conf = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": 8, "bias": "none",
            "use_rslora": False, "fan_in_fan_out": False, "base_model_name_or_path": "thinkingmachines/Inkling-2-Small",
            "target_modules": ["q_proj.linear"], "layers_to_transform": [0]}
    conf.update(config)
    (d / "adapter_config.json").write_text(json.dumps(conf))
    return d


@pytest.fixture(scope="module")
def adapter(base, cfg) -> Path:
    return write_adapter(base / "adapter", cfg)


def copy_src(src: Path, dst: Path) -> Path:
    dst.parent.mkdir(parents=True, exist_ok=True)
    return Path(shutil.copytree(src, dst, symlinks=True))


# =========================================================================== 1. the source is never deleted/written
def _layout_src_as_out(tmp, src, adapter):
    s = copy_src(src, tmp / "ck")
    return ["convert", s, s, *AMAX, "--overwrite"], "ck", "ck", True


def _layout_src_inside_out(tmp, src, adapter):
    copy_src(src, tmp / "P" / "src")
    return ["convert", tmp / "P" / "src", tmp / "P", *AMAX, "--overwrite"], "P/src", "P", True


def _layout_out_inside_src(tmp, src, adapter):
    s = copy_src(src, tmp / "ck")
    return ["convert", s, s / "out", *AMAX], "ck", "ck/out", True


def _layout_out_inside_src_resume(tmp, src, adapter):
    s = copy_src(src, tmp / "ck")
    return ["convert", s, s / "out", *AMAX, "--resume"], "ck", "ck/out", True


def _layout_extract_src_is_staging(tmp, src, adapter):
    s = copy_src(src, tmp / "ck.partial")
    return ["draft", "extract", s, tmp / "ck", "--quiet"], "ck.partial", "ck", False


def _layout_strip_src_is_staging(tmp, src, adapter):
    s = copy_src(src, tmp / "ck.partial")
    return ["draft", "strip", s, tmp / "ck", "--quiet"], "ck.partial", "ck", False


def _layout_strip_src_is_backup(tmp, src, adapter):
    s = copy_src(src, tmp / "ck.old")
    (tmp / "ck").mkdir()
    (tmp / "ck" / "previous.txt").write_text("an earlier output\n")
    return ["draft", "strip", s, tmp / "ck", "--quiet", "--overwrite"], "ck.old", "ck", False


def _layout_merge_src_is_backup(tmp, src, adapter):
    s = copy_src(src, tmp / "ck.old")
    (tmp / "ck").mkdir()
    (tmp / "ck" / "previous.txt").write_text("an earlier output\n")
    return ["lora", "merge", s, adapter, tmp / "ck", "--quiet", "--overwrite"], "ck.old", "ck", False


def _layout_merge_src_is_staging(tmp, src, adapter):
    s = copy_src(src, tmp / "ck.partial")
    return ["lora", "merge", s, adapter, tmp / "ck", "--quiet"], "ck.partial", "ck", False


def _layout_convert_json_into_src(tmp, src, adapter):
    s = copy_src(src, tmp / "ck")
    return ["convert", s, tmp / "out", *AMAX, "--json", s / "config.json"], "ck", "out", False


def _layout_merge_json_into_src(tmp, src, adapter):
    s = copy_src(src, tmp / "ck")
    return ["lora", "merge", s, adapter, tmp / "out", "--quiet", "--json", s / "config.json"], "ck", "out", False


@pytest.mark.parametrize("layout", [
    _layout_src_as_out, _layout_src_inside_out, _layout_out_inside_src, _layout_out_inside_src_resume,
    _layout_extract_src_is_staging, _layout_strip_src_is_staging, _layout_strip_src_is_backup,
    _layout_merge_src_is_backup, _layout_merge_src_is_staging, _layout_convert_json_into_src,
    _layout_merge_json_into_src,
], ids=lambda f: f.__name__.removeprefix("_layout_"))
def test_source_never_deleted_or_written(layout, src, adapter, tmp_path):
    """Class 1: whatever OUT (or --json) is, the source stays byte-for-byte as it was; an OUT that is,
    holds or lies inside the source is refused (exit 2); a source merely *named* like OUT's staging
    or backup directory is either left alone by a working run or refused."""
    argv, src_rel, out_rel, must_refuse = layout(tmp_path, src, adapter)
    before = tree_digest(tmp_path)
    src_before = tree_digest(tmp_path / src_rel)
    r = call(*argv)
    diff = changes(src_before, tree_digest(tmp_path / src_rel))
    assert not diff, f"the source changed (exit {r.rc}): {diff}\nstderr: {r.err[-1500:]}"
    if must_refuse:
        assert_refused(r, 2)
        diff = changes(before, tree_digest(tmp_path))
        assert not diff, f"a refused command changed files: {diff}"
    else:
        if r.rc != 0:
            assert_refused(r)
        else:
            stderr_is_clean(r)
        diff = changes(outside(before, out_rel), outside(tree_digest(tmp_path), out_rel))
        assert not diff, f"files outside OUT changed (or a staging/backup directory was left behind): {diff}"


# =========================================================================== 2. writes never follow planted symlinks
@pytest.fixture(scope="module")
def interrupted(base, src) -> Path:
    """An OUT as a conversion killed before finalizing leaves it: its resume manifest (taken from a
    `--part 1/1` run, which converts every shard and writes no index), no index, no configs; the
    shard it was writing missing (the manifest lists it, so --resume must check and redo it)."""
    out = base / "interrupted"
    r = call("convert", src, out, *AMAX, "--part", "1/1")
    assert r.rc == 0, r.err
    (part,) = out.glob(".inkling-quant-convert*.json")
    part.rename(out / MANIFEST)
    for f in safetensors_files(out):
        f.unlink()
    assert not (out / INDEX).exists() and not (out / "config.json").exists()
    return out


@pytest.mark.parametrize("planted", [
    "model-00001-of-00048.safetensors.partial",  # a shard being written
    MANIFEST + ".partial",                        # the resume manifest, written atomically
    INDEX + ".partial",
    CHECKSUMS + ".partial",
    "config.json.partial",
    "tokenizer.json.partial",                     # a carried-over file
])
def test_resume_does_not_write_through_planted_symlink(planted, src, interrupted, tmp_path):
    """Class 2: an interrupted OUT holding `<file>.partial` -> a file outside OUT: `convert --resume`
    either refuses, naming the symlink, or finishes without touching the victim."""
    out = copy_src(interrupted, tmp_path / "out")
    v = victim(tmp_path / "elsewhere")
    os.symlink(v, out / planted)
    elsewhere = tree_digest(tmp_path / "elsewhere")
    src_before = tree_digest(src)
    r = call("convert", src, out, *AMAX, "--resume")
    assert v.read_bytes() == VICTIM_BYTES, f"convert --resume wrote through {planted} -> {v} (exit {r.rc})"
    assert tree_digest(tmp_path / "elsewhere") == elsewhere
    assert tree_digest(src) == src_before
    if r.rc != 0:
        assert_refused(r)
        assert planted in r.err, f"the refusal does not name the symlink {planted}: {r.err}"
    else:
        stderr_is_clean(r)
        assert (out / INDEX).is_file()


def test_convert_of_partial_kill_does_not_write_through_planted_symlink(src, tmp_path):
    """Class 2: a real interrupted multi-shard conversion (--part 1/2 leaves half the shards, like a
    kill), every remaining shard's `.partial` planted as a symlink to one victim: `--resume` (and
    the part that finishes it) must not write through any of them."""
    out = tmp_path / "out"
    args = [*AMAX, "--max-shard-size", "400KB"]
    assert call("convert", src, out, *args, "--part", "1/2").rc == 0
    # the shards part 2 would write: every other one (names model-0000K-of-N)
    names = sorted(p.name for p in safetensors_files(out))
    n = int(re.search(r"-of-(\d+)\.safetensors$", names[0]).group(1))
    todo = [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    todo = [t for t in todo if t not in names]
    assert todo
    v = victim(tmp_path / "elsewhere")
    for t in todo:
        os.symlink(v, out / (t + ".partial"))
    r = call("convert", src, out, *args, "--part", "2/2")
    assert v.read_bytes() == VICTIM_BYTES, f"convert --part 2/2 wrote through a planted .partial (exit {r.rc})"
    if r.rc != 0:
        assert_refused(r)
        assert ".partial" in r.err, r.err


def test_verify_write_checksums_does_not_follow_planted_symlink(converted, tmp_path):
    """Class 2: `verify OUT --write-checksums` with checksums.sha256.partial -> a victim outside OUT."""
    out = copy_src(converted, tmp_path / "out")
    (out / CHECKSUMS).unlink()
    v = victim(tmp_path / "elsewhere")
    os.symlink(v, out / (CHECKSUMS + ".partial"))
    r = call("verify", out, "--write-checksums", "--quiet")
    assert v.read_bytes() == VICTIM_BYTES, f"verify --write-checksums wrote through the symlink (exit {r.rc})"
    stderr_is_clean(r)
    if r.rc != 0:
        assert CHECKSUMS + ".partial" in r.out + r.err, r.out


@pytest.mark.parametrize("command", ["convert", "draft-extract", "inspect", "lora-check"])
def test_config_json_symlink_out_of_checkpoint_refused(command, src, adapter, tmp_path):
    """Class 2: config.json a symlink to a file outside the checkpoint is refused like an escaping
    shard symlink: exit != 0, the message names config.json."""
    s = copy_src(src, tmp_path / "ck")
    outer = tmp_path / "elsewhere" / "config.json"
    outer.parent.mkdir()
    shutil.move(s / "config.json", outer)
    os.symlink(outer, s / "config.json")
    argv = {"convert": ["convert", s, tmp_path / "out", *AMAX],
            "draft-extract": ["draft", "extract", s, tmp_path / "out", "--quiet"],
            "inspect": ["inspect", s],
            "lora-check": ["lora", "check", s, adapter, "--quiet"]}[command]
    before = tree_digest(tmp_path)
    r = call(*argv)
    assert_refused(r)
    assert "config.json" in r.err, r.err
    assert outside(tree_digest(tmp_path), "out") == before


# =========================================================================== 3. silently wrong output
def _input_scales_ok(out: Path) -> list[str]:
    bad = []
    for f in safetensors_files(out):
        with safe_open(f, "pt") as st:
            for k in st.keys():
                if k.endswith("input_scale"):
                    v = st.get_tensor(k).float()
                    if not bool(torch.isfinite(v).all()) or not bool((v > 0).all()):
                        bad.append(f"{k}={v.tolist()}")
    return bad


@pytest.mark.parametrize("amax", ["1e-45", "1e-300", "nan", "0"])
def test_default_activation_amax_never_gives_zero_or_nan_input_scale(amax, src, tmp_path):
    """Class 3: --default-activation-amax X fails (exit 2) or writes only finite, positive input_scale."""
    out = tmp_path / "out"
    r = call("convert", src, out, "--default-activation-amax", amax, "--quiet")
    if r.rc != 0:
        assert_refused(r, 2)
        assert not (out / INDEX).exists()
    else:
        bad = _input_scales_ok(out)
        assert not bad, f"--default-activation-amax {amax}: {len(bad)} input_scale(s) not finite positive, e.g. {bad[:3]}"


@pytest.mark.parametrize("kind", ["json-no-such-module", "json-layer-out-of-range", "safetensors-no-such-module"])
def test_activation_scales_matching_no_module_refused(kind, src, tmp_path):
    """Class 3: a calibration file with entries for modules the checkpoint does not have (a typo, a
    file for another model) fails, naming the file, instead of being silently ignored."""
    if kind == "json-no-such-module":
        f = tmp_path / "scales.json"
        f.write_text(json.dumps({"no.such.module": 3.0}))
    elif kind == "json-layer-out-of-range":  # 48 layers: layer 48 does not exist
        f = tmp_path / "scales.json"
        f.write_text(json.dumps({"model.llm.layers.48.mlp.experts.w13_weight": 3.0}))
    else:
        f = tmp_path / "scales.safetensors"
        save_file({"no.such.module.input_amax": torch.tensor([3.0])}, f)
    out = tmp_path / "out"
    r = call("convert", src, out, "--activation-scales", f, "--default-activation-amax", "4", "--quiet")
    assert_refused(r, 2)
    assert f.name in r.err, r.err
    assert not (out / INDEX).exists()


@pytest.fixture(scope="module")
def small(base) -> Path:
    """A two-layer tiny source (4 experts): what the expert-magnitude tests rewrite."""
    return write_checkpoint(base / "small", "tiny", layers=2, experts=4)


def _with_experts(src: Path, dst: Path, fn) -> Path:
    """A copy of `src` whose routed-expert slabs (`w13_weight`, `w2_weight`, each expert apart) are
    fn(slab as float64) stored as float32."""
    s = copy_src(src, dst)
    idx = json.loads((s / INDEX).read_text())
    total = 0
    for shard in sorted(set(idx["weight_map"].values())):
        t = load_file(s / shard)
        for k in [k for k in t if k.endswith(("w13_weight", "w2_weight"))]:
            t[k] = torch.stack([fn(e.double()).float() for e in t[k]])
        total += sum(v.numel() * v.element_size() for v in t.values())
        save_file(t, s / shard, metadata={"format": "pt"})
    idx["metadata"]["total_size"] = total
    (s / INDEX).write_text(json.dumps(idx, indent=2))
    return s


def _flat(t: float):
    """Every value +-t * 2^-136 (the signs kept): at MXFP8's smallest scale, 2^-127, e4m3's
    subnormal step is 2^-136, so each value's error, and verify's (dW = c * W), is |round(t) - t| / t."""
    return lambda w: torch.sign(w) * (t * 2.0 ** -136)


def _amax_of(c: float):
    """Every slab scaled to amax exactly c (an fp32): its largest value becomes c."""
    return lambda w: w / w.abs().max() * c


def _zero_block(w):
    w = w.clone()
    w[3, :16] = 0
    return w


_F32 = np.float32
# (scheme args, the experts' rewrite, converted): what verify --against passes and only that converts
_MAGNITUDES = {
    "mxfp8-gaussian-1e-36": (["--scheme", "mxfp8"], lambda w: w * 1e-36, True),
    "mxfp8-gaussian-1e-40": (["--scheme", "mxfp8"], lambda w: w * 1e-40, False),    # the issue's: rel. error ~0.22
    "mxfp8-flat-5.56": (["--scheme", "mxfp8"], _flat(5.56), True),                  # error 0.0791 <= 0.08
    "mxfp8-flat-5.55": (["--scheme", "mxfp8"], _flat(5.55), False),                 # error 0.0811 > 0.08
    "nvfp4-amax-min": (["--scheme", "nvfp4", "--output-format", "modelopt-hf"], _amax_of(NVFP4_MIN_AMAX), True),
    # below it: the all-zero weight (formats/nvfp4.py "Below the smallest amax"), which verify expects
    "nvfp4-amax-below-min": (["--scheme", "nvfp4", "--output-format", "modelopt-hf"],
                             _amax_of(float(np.nextafter(_F32(NVFP4_MIN_AMAX), _F32(0)))), True),
    "default-all-zero": ([], torch.zeros_like, True),
    "default-zero-block": ([], _zero_block, True),
    "mxfp8-all-zero": (["--scheme", "mxfp8"], torch.zeros_like, True),
}


@pytest.mark.parametrize("case", list(_MAGNITUDES))
def test_convert_writes_only_what_its_verify_passes(case, small, tmp_path):
    """Class 3: routed experts too small for their format (MXFP8 blocks at e8m0's smallest scale
    with an error past verify's limit) are refused, exit 2 naming the file, the tensor and the
    expert; an NVFP4 amax whose global scale amax/2688 has no finite reciprocal converts as the
    all-zero weight (round 4); whatever converts, `verify OUT --against SRC` passes. On the refused side, the same conversion with the check
    switched off is what verify fails: the boundary is verify's own."""
    args, fn, converts = _MAGNITUDES[case]
    args = args + ([] if "mxfp8" in args else ["--default-activation-amax", "4"])
    s = _with_experts(small, tmp_path / "src", fn)
    out = tmp_path / "out"
    r = call("convert", s, out, *args, "--quiet")
    if converts:
        assert r.rc == 0, r.err
        v = call("verify", out, "--against", s)
        assert v.rc == 0, v.out[-3000:]
        return
    assert_refused(r, 2)
    assert re.search(r"model-\d+-of-\d+\.safetensors: tensor 'model\.llm\.layers\.\d\.mlp\.experts\.w(13|2)_weight', "
                     r"expert \d+: ", r.err), r.err
    assert "too small for MXFP8" in r.err or "below the smallest NVFP4 encodes" in r.err, r.err
    assert not (out / INDEX).exists()
    with ExitStack() as unchecked:
        for f in FORMATS.values():
            unchecked.enter_context(mock.patch.object(type(f), "magnitude_problem", lambda *a, **k: None))
        r = call("convert", s, out, *args, "--quiet", "--overwrite")
    assert r.rc == 0, r.err
    assert call("verify", out, "--against", s).rc == 1, "verify passes what convert refused"


# =========================================================================== 4. names that break line formats
@pytest.mark.parametrize("name", ["evil\nfile.txt", "evil\n" + "0" * 64 + "  tokenizer.json", "back\\slash.txt"])
def test_file_names_cannot_forge_checksum_lines(name, src, tmp_path):
    """Class 4: a source file whose name holds a newline: convert refuses, or writes a checksums.sha256
    in which every line is well formed and true (no line made up by a file name)."""
    s = copy_src(src, tmp_path / "ck")
    (s / name).write_bytes(b"some bytes\n")
    src_before = tree_digest(s)
    out = tmp_path / "out"
    r = call("convert", s, out, *AMAX)
    assert tree_digest(s) == src_before
    if r.rc != 0:
        assert_refused(r, 2)
    else:
        stderr_is_clean(r)
        assert_checksums_unforged(out)


FORGED_SHARD = "x\n  result: PASS.safetensors"


@pytest.mark.parametrize("write_checksums", [False, True], ids=["verify", "verify-write-checksums"])
def test_shard_name_cannot_forge_verify_report(write_checksums, converted, tmp_path):
    """Class 4: an index mapping tensors to a shard named "x\\n  result: PASS.safetensors": verify must
    not print a line made up by the name, and must exit != 0 (with --write-checksums: nor write one
    into checksums.sha256)."""
    out = copy_src(converted, tmp_path / "out")
    shard = sorted(safetensors_files(out))[0]  # one of the shards, renamed in the index too
    os.rename(shard, out / FORGED_SHARD)
    idx = json.loads((out / INDEX).read_text())
    idx["weight_map"] = {k: FORGED_SHARD if v == shard.name else v for k, v in idx["weight_map"].items()}
    (out / INDEX).write_text(json.dumps(idx))
    args = ["verify", out]
    if write_checksums:
        (out / CHECKSUMS).unlink()
        args.append("--write-checksums")
    sums_before = tree_digest(out / CHECKSUMS)
    r = call(*args)
    stderr_is_clean(r)
    verdict = re.compile(r"  result: (PASS|FAIL|INCOMPLETE.*) \(exit \d\)")  # verify's own last line
    forged = [ln for ln in (r.out + r.err).splitlines()
              if ln.lstrip().startswith("result: PASS") and not verdict.fullmatch(ln)]
    assert not forged, f"a line forged by the shard name: {forged}\n{r.out}"
    assert r.rc != 0, f"verify passed a shard named {FORGED_SHARD!r}\n{r.out}"
    if write_checksums:
        assert_checksums_unforged(out)
    else:
        assert tree_digest(out / CHECKSUMS) == sums_before, "plain verify changed checksums.sha256"


BAD_NAME = b"bad\xffname.txt"  # not UTF-8: os.listdir hands it over as "bad\udcffname.txt"


def plant_undecodable(d: Path) -> None:
    try:
        fd = os.open(os.path.join(os.fsencode(d), BAD_NAME), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError as e:  # a file system that takes only UTF-8 names (APFS): nothing to test
        pytest.skip(f"cannot create a file name that is not UTF-8 here: {e}")
    os.write(fd, b"some bytes\n")
    os.close(fd)


def test_file_name_not_utf8(src, converted, tmp_path):
    """Class 4: a file whose name is not UTF-8 (b"bad\\xffname.txt", there before the run): verify
    --write-checksums fails saying so, not "appeared while verifying", and writes no checksums.sha256;
    the text, JSON and JUnit reports show the byte as \\xff (no lone surrogate, which a strict JSON or
    XML reader refuses); convert refuses such a source file in the same words (exit 2)."""
    import xml.etree.ElementTree as ET

    out = copy_src(converted, tmp_path / "out")
    (out / CHECKSUMS).unlink()
    plant_undecodable(out)
    js, junit = tmp_path / "report.json", tmp_path / "report.xml"
    r = call("verify", out, "--write-checksums", "--json", js, "--junit", junit)
    stderr_is_clean(r)
    said = "file name is not valid UTF-8: bad\\xffname.txt"
    assert r.rc == 1 and said in r.out and "appeared while verifying" not in r.out, r.out
    assert not (out / CHECKSUMS).exists()
    texts = (r.out, js.read_text(encoding="utf-8"), junit.read_text(encoding="utf-8"))
    assert not [t for t in texts if "udcff" in t or "\udcff" in t], texts
    check = next(c for c in json.loads(texts[1])["checks"] if c["id"] == "write_checksums")
    assert check["status"] == "fail" and said in check["message"], check
    assert said in ET.parse(junit).getroot().find(".//testcase[@name='write_checksums']/failure").get("message")

    s = copy_src(src, tmp_path / "src")
    plant_undecodable(s)
    c = call("convert", s, tmp_path / "conv", *AMAX)
    assert_refused(c, 2)
    assert said in c.err and "udcff" not in c.err, c.err


# =========================================================================== 5. no tracebacks
@pytest.mark.parametrize("command", ["convert", "convert-overwrite", "draft-extract", "lora-merge"])
def test_out_is_a_regular_file(command, src, adapter, tmp_path):
    """Class 5: OUT an existing regular file: a clean refusal (exit 2), the file keeps its bytes
    (with --overwrite too: replacing a file by a checkpoint directory is not what was asked)."""
    f = tmp_path / "out"
    f.write_bytes(VICTIM_BYTES)
    argv = {"convert": ["convert", src, f, *AMAX],
            "convert-overwrite": ["convert", src, f, *AMAX, "--overwrite"],
            "draft-extract": ["draft", "extract", src, f, "--quiet"],
            "lora-merge": ["lora", "merge", src, adapter, f, "--quiet"]}[command]
    src_before = tree_digest(src)
    before = tree_digest(tmp_path)
    r = call(*argv)
    assert_refused(r, 2)
    assert f.read_bytes() == VICTIM_BYTES
    assert tree_digest(tmp_path) == before
    assert tree_digest(src) == src_before


@pytest.mark.parametrize("argv", [
    ["convert", "SRC", "OUT", *AMAX, "--max-shard-size", "infGB"],
    ["convert", "SRC", "OUT", *AMAX, "--max-shard-size", "nanGB"],
    ["convert", "SRC", "OUT", *AMAX, "--max-shard-size=-5GB"],  # "=": argparse would take "-5GB" for an option
    ["draft", "extract", "SRC", "OUT", "--quiet", "--max-shard-size", "infGB"],
    ["draft", "extract", "SRC", "OUT", "--quiet", "--max-shard-size", "0"],
    ["synth", "OUT", "--quiet", "--max-shard-size", "infGB"],
], ids=lambda a: f"{a[0]}{'-' + a[1] if a[0] == 'draft' else ''}-{a[-1].split('=')[-1]}")
def test_absurd_sizes_refused(argv, src, tmp_path):
    """Class 5: --max-shard-size inf/nan/negative/zero: a usage error (exit 2), no traceback, no OUT;
    refused up front (within 5 s: a negative size taken at its word means one shard per tensor)."""
    out = tmp_path / "out"
    argv = [src if a == "SRC" else out if a == "OUT" else a for a in argv]
    r = call(*argv, limit_s=5)
    assert_refused(r, 2)
    assert not out.exists() and not (tmp_path / "out.partial").exists()


@pytest.mark.parametrize("command", ["convert", "lora-check", "plan", "inspect", "verify"])
def test_json_report_to_a_directory(command, src, converted, adapter, tmp_path):
    """Class 5: --json naming an existing directory: exit != 0 without a traceback (ideally before any
    work is done); the directory is left as it was."""
    d = tmp_path / "reports"
    d.mkdir()
    (d / "keep.txt").write_text("keep\n")
    before = tree_digest(d)
    out = tmp_path / "out"
    argv = {"convert": ["convert", src, out, *AMAX, "--json", d],
            "lora-check": ["lora", "check", src, adapter, "--quiet", "--json", d],
            "plan": ["plan", "--gpu", "gb200", "--tp", "4", "--json", d],
            "inspect": ["inspect", converted, "--json", d],
            "verify": ["verify", converted, "--quiet", "--json", d]}[command]
    r = call(*argv)
    assert r.rc != 0, f"exit 0 with --json at a directory\n{r.out[-2000:]}"
    assert_refused(r)
    assert tree_digest(d) == before


DROP, KEEP = "<drop>", "<keep>"


@pytest.mark.parametrize("config_qc,hf", [
    (DROP, []), (DROP, "MIXED_PRECISION"), (DROP, 5), (DROP, None),
    (DROP, {"quantization": "MIXED_PRECISION"}), (DROP, {"quantization": [1]}),
    ([], KEEP), ({"quantization": "MIXED_PRECISION"}, KEEP), ("modelopt", []),
], ids=lambda v: "drop" if v == DROP else "keep" if v == KEEP else json.dumps(v))
def test_inspect_quant_config_not_an_object(config_qc, hf, converted, tmp_path):
    """Class 5: inspect on a converted checkpoint whose hf_quant_config.json (or config.json's
    quantization_config, or a section of either) is a list, a string, a number, null: no traceback;
    a failure is our message."""
    out = copy_src(converted, tmp_path / "out")
    cfg = json.loads((out / "config.json").read_text())
    if config_qc == DROP:
        del cfg["quantization_config"]
    else:
        cfg["quantization_config"] = config_qc
    (out / "config.json").write_text(json.dumps(cfg))
    if hf != KEEP:
        (out / "hf_quant_config.json").write_text(json.dumps(hf))
    for args in (["inspect", out], ["inspect", out, "--json", "-"]):
        r = call(*args)
        stderr_is_clean(r)
        if r.rc not in (0, 1):
            assert_refused(r, 2)


@pytest.mark.parametrize("flag,value", [
    ("--reserve-gib", "nan"), ("--reserve-gib", "inf"), ("--reserve-gib", "1e308"), ("--reserve-gib", "-inf"),
    ("--gpu-memory-utilization", "nan"), ("--gpu-memory-utilization", "inf"),
])
def test_plan_absurd_numbers(flag, value):
    """Class 5: `plan --gpu gb200 --tp 4` with a NaN/Inf/huge float: no traceback; NaN/Inf refused."""
    r = call("plan", "--gpu", "gb200", "--tp", "4", flag, value)
    stderr_is_clean(r)
    if not math.isfinite(float(value)):
        assert r.rc != 0, f"plan {flag} {value}: exit 0\n{r.out}"
        if r.rc != 1:  # 1: "does not fit"; anything else is a refusal
            assert_refused(r, 2)


@pytest.mark.parametrize("seed", [str(2 ** 80), str(-(2 ** 80))])
def test_synth_huge_seed(seed, tmp_path):
    """Class 5: synth --seed 2**80: a clean usage error (or a checkpoint), no traceback, no OUT.partial."""
    out = tmp_path / "out"
    r = call("synth", out, "--quiet", "--layers", "1", "--experts", "1", "--seed", seed)
    stderr_is_clean(r)
    assert not (tmp_path / "out.partial").exists(), "synth left OUT.partial behind"
    if r.rc != 0:
        assert_refused(r, 2)
        assert not out.exists()
    else:
        assert (out / INDEX).is_file()


def _children(pid: int) -> list[int]:
    kids = []
    for t in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            kids += [int(x) for x in t.read_text().split()]
        except OSError:
            pass
    return kids


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _shards_done(out: Path) -> int:
    """Finished output shards (their `.partial` renamed into place): the workers are converting."""
    try:
        return sum(p.name.endswith(".safetensors") for p in out.iterdir())
    except OSError:
        return 0


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs /proc to find worker processes")
def test_killed_worker_reports_resume(src, tmp_path):
    """Class 5: `convert --workers 2` whose worker process is killed (the OOM killer): exit != 0, no
    traceback, the message says --resume; and --resume then finishes."""
    out = tmp_path / "out"
    args = [*AMAX, "--max-shard-size", "100KB"]
    proc = subprocess.Popen([sys.executable, "-m", "inkling_quant.cli", "convert", str(src), str(out), *args,
                             "--workers", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    killed = None
    try:
        deadline = time.time() + 60
        while time.time() < deadline and proc.poll() is None and killed is None:
            if _shards_done(out) >= 1:
                workers = [k for k in _children(proc.pid)
                           if "multiprocessing" in _cmdline(k) and "resource_tracker" not in _cmdline(k)]
                if workers:
                    os.kill(workers[0], signal.SIGKILL)
                    killed = workers[0]
            time.sleep(0.005)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if killed is None:
        pytest.skip("the conversion ended before a worker could be killed")
    r = Result(proc.returncode, "", err)
    assert_refused(r)
    assert "--resume" in err, err
    assert not (out / INDEX).exists()
    assert call("convert", src, out, *args, "--resume").rc == 0


# =========================================================================== 6. crash windows
def _crash_after_index(src: Path, out: Path) -> None:
    """The state a kill between writing the index and removing the resume manifest leaves: every shard,
    config, checksums and the index written, `.inkling-quant-convert.json` still there. Built from a
    `--part 1/1` run (which converts every shard and keeps its manifest), `--finalize`, and that
    manifest written back under the name a one-machine run uses."""
    assert call("convert", src, out, *AMAX, "--part", "1/1").rc == 0
    manifests = sorted(out.glob(".inkling-quant-convert*.json"))
    assert manifests, "no part manifest found"
    manifest = manifests[0].read_bytes()
    assert call("convert", src, out, *AMAX, "--finalize").rc == 0
    assert (out / INDEX).is_file()
    (out / MANIFEST).write_bytes(manifest)


def _weights_and_configs(d: Path) -> dict:
    return {k: v for k, v in tree_digest(d).items() if not k.startswith(".")}


def test_resume_after_crash_between_index_and_manifest_removal(src, converted, tmp_path):
    """Class 6: index written, resume manifest still present (killed in between): `convert --resume`
    exits 0 and leaves a checkpoint `verify` passes, the same bytes as an uninterrupted run."""
    out = tmp_path / "out"
    _crash_after_index(src, out)
    r = call("convert", src, out, *AMAX, "--resume")
    assert r.rc == 0, r.err
    stderr_is_clean(r)
    v = call("verify", out, "--quiet")
    assert v.rc == 0, v.out
    assert _weights_and_configs(out) == _weights_and_configs(converted)


def test_resume_on_complete_output_is_a_no_op(src, converted, tmp_path):
    """Class 6: `convert --resume` on a complete OUT (a retried CI step) exits 0 and changes nothing."""
    out = copy_src(converted, tmp_path / "out")
    before = tree_digest(out)
    r = call("convert", src, out, *AMAX, "--resume")
    assert r.rc == 0, r.err
    stderr_is_clean(r)
    assert tree_digest(out) == before


def test_disk_full_during_finalize_keeps_shards_and_resumes(src, converted, tmp_path):
    """Class 5: ENOSPC while finalize writes checksums.sha256 (the shards are all written): exit 2
    with the --resume hint, no traceback, no index (nothing looks complete), the shards kept;
    `convert --resume` then finishes with the bytes of an uninterrupted run."""
    out = tmp_path / "out"
    real_replace = os.replace

    def full_disk(a, b, *args, **kw):
        if Path(b).name == CHECKSUMS:
            raise OSError(28, "No space left on device", str(b))
        return real_replace(a, b, *args, **kw)

    with mock.patch("os.replace", full_disk):
        r = call("convert", src, out, *AMAX)
    assert r.rc == 2, r.err
    stderr_is_clean(r)
    assert "--resume" in r.err and "No space left" in r.err
    assert not (out / INDEX).exists() and not list(out.glob("*.partial"))
    assert safetensors_files(out), "the converted shards were removed"
    r = call("convert", src, out, *AMAX, "--resume")
    assert r.rc == 0, r.err
    assert _weights_and_configs(out) == _weights_and_configs(converted)


@pytest.fixture(scope="module")
def exported(base, src) -> Path:
    """`convert src --output-format modelopt-hf`: ModelOpt's form, whose configs name ModelOpt as the
    producer (only the index names us). Never modified."""
    out = base / "exported"
    r = call("convert", src, out, "--output-format", "modelopt-hf", *AMAX)
    assert r.rc == 0, r.err
    return out


def _edit_index(out: Path, edit) -> None:
    idx = json.loads((out / INDEX).read_text())
    edit(idx)
    (out / INDEX).write_text(json.dumps(idx))


_METADATA_EDITS = {"total_size-5": lambda i: i["metadata"].update(total_size=5),
                   "total_size-missing": lambda i: i["metadata"].pop("total_size"),
                   "total_size-string": lambda i: i["metadata"].update(total_size=str(i["metadata"]["total_size"])),
                   "metadata-null": lambda i: i.update(metadata=None),
                   "metadata-list": lambda i: i.update(metadata=[1])}


@pytest.mark.parametrize("edit", list(_METADATA_EDITS))
def test_index_total_size_of_ours_is_exact(edit, converted, tmp_path):
    """Class 3: every index inkling-quant writes records the tensors' exact byte count (metadata.total_size)
    and names it as the producer: in one of ours a wrong, missing or mistyped total_size fails verify
    (exit 1) naming the index, as does a `metadata` that is not an object (transformers' from_pretrained
    fails on null or a list, whoever wrote it)."""
    out = copy_src(converted, tmp_path / "out")
    _edit_index(out, _METADATA_EDITS[edit])
    r = call("verify", out)
    stderr_is_clean(r)
    assert r.rc == 1 and f"FAIL index: 1 problem(s)\n    {out / INDEX}: " in r.out, r.out
    assert ("'metadata' must be an object" if edit.startswith("metadata") else "inkling-quant wrote this index") \
        in r.out, r.out


def test_index_total_size_of_another_writer_is_a_note(exported, tmp_path):
    """Class 3: in an index another tool wrote (ModelOpt's form, our marks taken out), a total_size that
    does not match is informational (huggingface_hub writes storage bytes, transformers does not read
    them): verify passes (exit 0) and says so in a note, the JSON figure and JUnit's system-out; a
    `metadata` that is null still fails."""
    out = copy_src(exported, tmp_path / "out")
    _edit_index(out, lambda i: i.update(metadata={"total_parameters": 1, "total_size": 5}))
    js = tmp_path / "report.json"
    r = call("verify", out, "--json", js)
    assert r.rc == 0, r.out
    assert re.search(r"note index: .*metadata.total_size 5 does not match the \d+ bytes", r.out), r.out
    index = next(c for c in json.loads(js.read_text())["checks"] if c["id"] == "index")
    assert index["figures"]["index_total_size_matches"] is False and "does not match" in index["message"]
    _edit_index(out, lambda i: i.update(metadata=None))
    r = call("verify", out)
    assert r.rc == 1 and "'metadata' must be an object, got null" in r.out, r.out


def test_fp32_passthrough_source_verifies(src, tmp_path):
    """Class 6: a source whose non-expert tensors are all FP32 (the BF16 ones too) converts (FP32
    passed through) and `verify OUT` (no --against) exits 0."""
    s = copy_src(src, tmp_path / "fp32")
    idx = json.loads((s / INDEX).read_text())
    total = 0
    for shard in sorted(set(idx["weight_map"].values())):
        tensors = load_file(s / shard)
        tensors = {k: (v if ".mlp.experts." in k else v.float()) for k, v in tensors.items()}
        total += sum(v.numel() * v.element_size() for v in tensors.values())
        save_file(tensors, s / shard, metadata={"format": "pt"})
    idx["metadata"]["total_size"] = total
    (s / INDEX).write_text(json.dumps(idx, indent=2))
    out = tmp_path / "out"
    r = call("convert", s, out, *AMAX)
    assert r.rc == 0, r.err
    with safe_open(next(iter(safetensors_files(out))), "pt") as st:
        assert st.get_slice("model.llm.layers.0.attn.wq_du.weight").get_dtype() == "F32", "BF16 made FP32 not passed through"
    v = call("verify", out)
    assert v.rc == 0, v.out


# =========================================================================== 7. bounded work
def _bounded(args, timeout=HANG_S) -> Result:
    t0 = time.monotonic()
    try:
        r = cli(*args, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"`inkling-quant {' '.join(map(str, args))}` still running after {timeout} s")
    assert time.monotonic() - t0 < timeout
    return r


def test_verify_huge_expert_count_is_bounded(converted, tmp_path):
    """Class 7: config.json claiming 16 layers x 16384 experts on a tiny checkpoint: verify finishes
    within 20 s with exit != 0 (it must not enumerate/hash millions of expected tensors first)."""
    out = copy_src(converted, tmp_path / "out")
    c = json.loads((out / "config.json").read_text())
    t = c["text_config"]
    t["num_hidden_layers"] = 16
    t["layer_types"] = t["layer_types"][:16]
    t["n_routed_experts"] = 16384
    (out / "config.json").write_text(json.dumps(c))
    r = _bounded(["verify", out, "--quiet"])
    assert r.rc != 0, r.out
    stderr_is_clean(r)


def add_empty_tensors(ck: Path, n: int, listed: bool) -> None:
    """A shard `extra.safetensors` whose header holds `n` zero-size tensors (no data: ~80 bytes each),
    all listed in the index (`listed`) or only the first."""
    names = [f"model.llm.layers.0.junk.{i}" for i in range(n)]
    blob = json.dumps(dict.fromkeys(names, {"dtype": "BF16", "shape": [0], "data_offsets": [0, 0]}),
                      separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    (ck / "extra.safetensors").write_bytes(len(blob).to_bytes(8, "little") + blob)
    _edit_index(ck, lambda i: i["weight_map"].update(dict.fromkeys(names if listed else names[:1], "extra.safetensors")))


@pytest.mark.parametrize("listed", [True, False], ids=["in-the-index", "header-only"])
def test_header_of_empty_tensors_is_bounded(listed, src, cfg, converted, tmp_path):
    """Class 7: a shard whose header holds 100k zero-size tensors (an 8 MB file; the tiny config allows
    at most ~18k tensors, model.layout.max_tensors): verify, inspect and convert refuse it at the index
    or the header, naming the file, before an entry is built per tensor (400k of them took verify 17 s
    and 1 GB, inspect minutes: its unknown names were searched in a list)."""
    out = copy_src(converted, tmp_path / "out")
    add_empty_tensors(out, 100_000, listed)
    where = out / (INDEX if listed else "extra.safetensors")
    refused = "tensors, more than the "
    v = _bounded(["verify", out, "--quiet"])
    stderr_is_clean(v)
    assert v.rc == 1 and f"{where}: " in v.out and refused in v.out, v.out
    i = _bounded(["inspect", out])
    assert_refused(i, 2)
    assert f"{where}: " in i.err and refused in i.err, i.err
    s = copy_src(src, tmp_path / "src")
    add_empty_tensors(s, 100_000, listed)
    c = _bounded(["convert", s, tmp_path / "conv", *AMAX])
    assert_refused(c, 2)
    assert refused in c.err, c.err
    for argv in (["draft", "extract", s, tmp_path / "d"], ["lora", "check", s, write_adapter(tmp_path / "a", cfg)],
                 ["verify", out, "--against", s, "--quiet"]):  # every reader of a checkpoint's headers
        r = _bounded(argv)
        assert r.rc in (1, 2) and refused in r.out + r.err, (argv, r.out, r.err)


def test_tensor_bound_admits_the_published_model():
    """Class 7: the bound is what a config can possibly hold, so no real checkpoint meets it: the published
    Inkling 2 Small config allows more than its every expert's weights stored apart as ModelOpt's NVFP4
    export stores them (48 layers x 384 experts x 3 weights x 4 tensors), with ~1,100 other tensors."""
    from inkling_quant.model.layout import max_tensors, model_config

    path = Path(__file__).resolve().parents[1] / "inkling_quant" / "configs" / "inkling-2-small.json"
    assert max_tensors(model_config(json.loads(path.read_text()), str(path))) > 48 * 384 * 3 * 4 + 1100 + 50_000


def test_lora_check_catastrophic_regex_is_bounded(src, cfg, tmp_path):
    """Class 7: an adapter whose target_modules is the regex "(.*.*)*X" (exponential backtracking on
    every module name): `lora check` finishes within 20 s, exit != 0, no traceback."""
    a = write_adapter(tmp_path / "adapter", cfg, target_modules="(.*.*)*X")
    r = _bounded(["lora", "check", src, a, "--quiet"])
    assert_refused(r)


# =========================================================================== 8. concurrent writers
# `python -c _PACED DELAY PER_UPDATE ARGS...`: the CLI with every progress-bar update (one per tensor
# or shard written) paced by PER_UPDATE seconds and the command started DELAY seconds late, so two
# runs overlap the same way on every machine: the second starts while the first is mid-shard, and
# is still writing when the first finishes.
_PACED = ("import sys, time, tqdm.std as t\n"
          "delay, per = float(sys.argv[1]), float(sys.argv[2])\n"
          "orig = t.tqdm.update\n"
          "def update(self, n=1):\n"
          "    time.sleep(per)\n"
          "    return orig(self, n)\n"
          "t.tqdm.update = update\n"
          "from inkling_quant.cli import main\n"
          "time.sleep(delay)\n"
          "sys.exit(main(sys.argv[3:]))\n")


def test_write_checksums_takes_the_output_lock(converted, tmp_path):
    """Class 8: verify --write-checksums writes into a checkpoint, so it takes the lock every writer
    takes: with a live writer holding it, nothing is written and the check says why."""
    import socket

    out = copy_src(converted, tmp_path / "out")
    (out / CHECKSUMS).unlink()
    lock = out.parent / f".{out.name}.inkling-quant.lock"
    lock.write_text(f"{socket.gethostname()} {os.getpid()}\n")  # this test process: alive
    r = call("verify", out, "--write-checksums")
    stderr_is_clean(r)
    # exit 2: the checkpoint is not at fault, verification could not finish (docs/ci.md's codes)
    assert r.rc == 2 and "another conversion" in r.out, r.out
    assert not (out / CHECKSUMS).exists()
    lock.unlink()
    assert call("verify", out, "--write-checksums", "--quiet").rc == 0
    assert (out / CHECKSUMS).is_file()


def test_two_writers_into_one_out(src, adapter, tmp_path):
    """Class 8: two `lora merge` into the same OUT at the same time (the second starting while the
    first is mid-way): at most one exits 0, neither with a traceback, and OUT, when a run reports
    success and after both ended, is a complete checkpoint identical to a single run's output."""
    out, ref = tmp_path / "out", tmp_path / "ref"
    argv = ["lora", "merge", str(src), str(adapter)]
    assert call(*argv, ref, "--quiet").rc == 0
    want = tree_digest(ref)
    procs = [subprocess.Popen([sys.executable, "-c", _PACED, delay, per, *argv, str(out), "--quiet"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for delay, per in (("0", "0.02"), ("1.0", "0.03"))]
    at_success = None
    try:
        deadline = time.time() + 120
        while time.time() < deadline and any(p.poll() is None for p in procs):
            if at_success is None and any(p.poll() == 0 for p in procs):
                at_success = tree_digest(out)  # what a consumer sees the moment a run reports success
            time.sleep(0.01)
        if at_success is None and any(p.poll() == 0 for p in procs):
            at_success = tree_digest(out)
        results = [Result(p.wait(timeout=5), *p.communicate(timeout=5)) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r in results:
        stderr_is_clean(r)
    ok = [r for r in results if r.rc == 0]
    assert len(ok) <= 1, "both writers exited 0"
    for r in results:
        if r.rc != 0:
            assert_refused(r)
    if ok:
        diff = changes(want, at_success)
        assert not diff, f"OUT when a writer reported success differs from a single run's: {diff}"
        diff = changes(want, tree_digest(out))
        assert not diff, f"OUT after both writers ended differs from a single run's: {diff}"
    else:
        assert not out.exists() or not changes(want, tree_digest(out))
    assert not (tmp_path / "out.partial").exists() and not (tmp_path / "out.old").exists()


# =========================================================================== 9. messages
def test_expert_width_error_names_file_and_tensor(tmp_path):
    """Class 9: moe_intermediate_size 40 (shapes to match; not a multiple of the NVFP4/MXFP8 blocks):
    convert exits 2 and the message names the .safetensors file and the tensor."""
    from inkling_quant import synth

    with mock.patch.dict(synth.PRESETS["tiny"]["text_config"], {"moe_intermediate_size": 40}):
        s = write_checkpoint(tmp_path / "w40", "tiny", experts=4)
    assert json.loads((s / "config.json").read_text())["text_config"]["moe_intermediate_size"] == 40
    r = call("convert", s, tmp_path / "out", *AMAX)
    assert_refused(r, 2)
    assert re.search(r"\S+\.safetensors", r.err), f"no .safetensors file named: {r.err}"
    assert re.search(r"model\.llm\.layers\.\d+\.mlp\.experts\.w(13|2)_weight", r.err), f"no tensor named: {r.err}"


_HF_TINY = {"model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 96, "num_experts": 4, "num_experts_per_tok": 2,
            "moe_intermediate_size": 32, "max_position_embeddings": 4096, "mlp_only_layers": [],
            "decoder_sparse_step": 1}
# malformed keys of a Hugging Face MoE config (a Qwen3-MoE one), and what transformers 5.25 does
_BAD_HF = {
    "layer-types-short": ({"layer_types": ["full_attention"]}, "layer_types"),             # validate_layer_type raises
    "layer-types-long": ({"layer_types": ["full_attention"] * 3}, "layer_types"),          # likewise
    "mlp-only-past-depth": ({"mlp_only_layers": [999]}, "mlp_only_layers"),                # accepted, names no layer
    "mlp-only-negative": ({"mlp_only_layers": [-1]}, "mlp_only_layers"),                   # likewise
    "moe-layers-string": ({"moe_layers": "all"}, "moe_layers"),                            # Llama 4: a TypeError
    "interleave-zero": ({"interleave_moe_layer_step": 0}, "interleave_moe_layer_step"),   # Llama 4: range() step 0
    "model-type-list": ({"model_type": ["qwen3_moe"]}, "model_type"),                      # AutoConfig: unhashable
    "text-model-type-int": ({"text_config": {"model_type": 7}}, "text_config.model_type"),  # names no family
}


@pytest.mark.parametrize("cmd", ["plan", "inspect", "convert"])
@pytest.mark.parametrize("case", list(_BAD_HF))
def test_malformed_hf_config_refused_alike(case, cmd, tmp_path):
    """Class 9: a Hugging Face config.json key of the wrong type, out of range or of the wrong
    length ends plan, inspect and convert alike (exit 2, one line naming config.json and the key):
    one reader (model.layout.MoEConfig) checks what all three read."""
    extra, key = _BAD_HF[case]
    d = {**_HF_TINY, **extra}
    if "text_config" in extra:  # the text model's settings nested, with a bad model_type of their own
        d = {"model_type": "qwen3_vl_moe", "text_config": {**_HF_TINY, **extra["text_config"]}}
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "config.json").write_text(json.dumps(d))
    save_file({"model.layers.0.mlp.experts.0.gate_proj.weight": torch.zeros(32, 64, dtype=torch.bfloat16)},
              ck / "model.safetensors")
    argv = {"plan": ["plan", "--config", ck / "config.json"], "inspect": ["inspect", ck],
            "convert": ["convert", ck, tmp_path / "out", *AMAX]}[cmd]
    r = call(*argv)
    assert_refused(r, 2)
    assert "config.json" in r.err and key in r.err, r.err
    assert not (tmp_path / "out").exists()
