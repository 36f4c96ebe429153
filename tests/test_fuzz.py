"""Fuzz every reader of untrusted bytes: safetensors headers and files, index files, config.json,
hf_quant_config.json / quantization_config, adapter configs and weights, activation-scale files,
draft configs and checksum files.

The one property: each input either parses to a valid result or raises one of our errors (an
InklingQuantError subclass) with a message. Never another exception from deep inside (TypeError,
KeyError, ValueError, OverflowError, MemoryError, RecursionError), never a hang (every call runs
under an alarm), never an allocation sized by a length in the input (every call runs under
tracemalloc with a cap far below what a lying length would ask for).

Hypothesis runs with a fixed budget (derandomize=True, no example database): the same examples
on every run, the whole file in well under a minute on two cores. Inputs that once crashed a
reader are kept in tests/fuzz_corpus/ (see its README) and replayed by `test_corpus`.

Crashers found in other modules (lora, draft, verify) are kept as regression tests at the end.

Deeper, coverage-guided runs (atheris, when installed):
    python tests/test_fuzz.py header|json|config|amax|index [-atheris_runs=N] [-max_total_time=S]
"""
from __future__ import annotations

import copy
import functools
import json
import math
import os
import shutil
import signal
import struct
import sys
import tracemalloc
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inkling_quant.convert import load_activation_amax
from inkling_quant.errors import ConfigError, InklingQuantError, UnsafePathError
from inkling_quant.io.checkpoint import INDEX_NAME, MAX_JSON_BYTES, Checkpoint, read_json, safe_child
from inkling_quant.io.safetensors import DTYPES, MAX_HEADER_BYTES, ShardReader, ShardWriter, read_header
from inkling_quant.model.inkling2 import Inkling2Config, checkpoint_tensors, classify, experts_module
from inkling_quant.synth import make_config

CORPUS = Path(__file__).parent / "fuzz_corpus"
PEAK_BYTES = 32 << 20  # every input here is < 1 MiB; a reader trusting a length would ask for far more
ALARM_S = 20           # generous for a loaded CI machine; a hang is minutes


def fuzz(n: int):
    """A fixed, reproducible example budget."""
    return settings(max_examples=n, deadline=None, derandomize=True, database=None, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])


class Hang(BaseException):
    """Raised by the alarm: a BaseException so no `except Exception` in a reader can swallow it."""


@contextmanager
def bounded(seconds: float = ALARM_S, peak: int = PEAK_BYTES):
    def alarm(*_):
        raise Hang(f"reader still running after {seconds}s")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    tracing = tracemalloc.is_tracing()
    if not tracing:
        tracemalloc.start()
    tracemalloc.reset_peak()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        _, top = tracemalloc.get_traced_memory()
        if not tracing:
            tracemalloc.stop()
    assert top < peak, f"reader allocated {top} bytes for a small input (a length trusted before checking?)"


def outcome(fn, *args, **kw):
    """fn(*args, **kw) -> ('ok', result) or ('error', our exception); anything else fails the test."""
    with bounded():
        try:
            return "ok", fn(*args, **kw)
        except InklingQuantError as e:
            msg = str(e)
            assert msg.strip(), f"{type(e).__name__} without a message"
            assert len(msg) < 4000, f"{type(e).__name__} message of {len(msg)} characters"
            return "error", e


# =========================================================================== strategies
_SPECIAL_INTS = [0, 1, -1, 2, 7, 255, 256, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64,
                 10**30, -(2**63), 10**308, 10**400]
_SPECIAL = st.sampled_from(_SPECIAL_INTS + [1.5, -0.0, 1e308, 1e-320, math.nan, math.inf, -math.inf, True, False,
                                            None, "", "1", "4096", "F32", "..", "/etc/passwd", "a\0b", "\ud800",
                                            [], {}, [1], {"": None}])
_JSON_SCALAR = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(),
                         st.text(max_size=12), _SPECIAL)
JSON = st.recursive(_JSON_SCALAR, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c,
                                                                                    max_size=4), max_leaves=10)
JSON_LITE = st.recursive(_JSON_SCALAR, lambda c: st.lists(c, max_size=2) | st.dictionaries(st.text(max_size=4), c,
                                                                                         max_size=2), max_leaves=3)


def dumps(obj) -> bytes:
    """JSON text as a careless writer would produce it (NaN/Infinity and lone surrogates included)."""
    return json.dumps(obj, allow_nan=True).encode("utf-8", "surrogatepass")


_TEXT8 = st.text(max_size=8)


@functools.lru_cache(maxsize=None)
def _key_strategy(keys: tuple):
    return st.sampled_from(keys) | _TEXT8 if keys else _TEXT8


@st.composite
def mutated(draw, base, keys=(), max_ops: int = 3, values=JSON):
    """`base` with 1..max_ops random edits below the root: a value anywhere replaced, a key or item
    deleted, a key added (from `keys` or random text)."""
    obj = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, max_ops))):
        parent, key, node = None, None, obj
        while isinstance(node, (dict, list)) and node and draw(st.integers(0, 3)) > 0:
            i = draw(st.integers(0, len(node) - 1))
            k = list(node)[i] if isinstance(node, dict) else i
            parent, key, node = node, k, node[k]
        op = ("replace", "replace", "delete", "add")[draw(st.integers(0, 3))]
        if op == "add" and isinstance(node, dict):
            node[draw(_key_strategy(tuple(keys)))] = copy.deepcopy(draw(values))
        elif op == "add" and isinstance(node, list):
            node.insert(draw(st.integers(0, len(node))), copy.deepcopy(draw(values)))
        elif op == "delete" and parent is not None:
            del parent[key]
        elif parent is not None:
            parent[key] = copy.deepcopy(draw(values))
        # the root stays an object: every reader gets it from read_json, which refuses anything else.
        # Drawn values are copied: sampled_from hands out the same [] / {} each time, and a later
        # edit inside one would change what the strategy draws (hypothesis: FlakyStrategyDefinition).
    return obj


def st_file(header: bytes, data: bytes = b"", n: int | None = None) -> bytes:
    return struct.pack("<Q", len(header) if n is None else n) + header + data


_DIMS = st.one_of(st.integers(0, 6), st.integers(0, 6), st.sampled_from(_SPECIAL_INTS + [-1, True, 1.0, "2", None]))
_H_NAMES = st.lists(st.text(max_size=6) | st.sampled_from(["a", "b", "__metadata__", "\ud800", "x" * 300]),
                    max_size=4)
_H_DTYPE = st.sampled_from(list(DTYPES))
_H_BAD_DTYPE = st.sampled_from(["F4", "f32", "", "I128"]) | JSON_LITE
_H_BAD_SHAPE = st.lists(_DIMS, max_size=4) | JSON_LITE
_H_SHAPE = st.lists(st.integers(0, 5), max_size=3)
_H_BAD_OFFS = st.lists(_DIMS, max_size=3) | JSON_LITE
_H_META = st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=2) | JSON_LITE
_H_SPLICE = st.binary(max_size=4) | st.sampled_from([b"{", b"[" * 3000, b'"\\ud800"', b" ", b"\0", b"\xff",
                                                   b"1" * 5000])
_H_ENTRY_KEYS = ("dtype", "shape", "data_offsets", "x")
_ODDS = st.integers(0, 8)


@st.composite
def headers(draw):
    """A safetensors header and data section, mostly well-formed with a few defects."""
    header, off = {}, 0
    for name in draw(_H_NAMES):
        dtype = draw(_H_DTYPE) if draw(_ODDS) else draw(_H_BAD_DTYPE)
        shape = draw(_H_SHAPE) if draw(_ODDS) > 1 else draw(_H_BAD_SHAPE)
        size = DTYPES[dtype].itemsize if isinstance(dtype, str) and dtype in DTYPES else 1
        nbytes = math.prod(shape) * size if isinstance(shape, list) and all(
            type(s) is int and 0 <= s < 2**40 for s in shape) else 0
        offs = [off, off + nbytes] if draw(_ODDS) > 1 else draw(_H_BAD_OFFS)
        off += nbytes if nbytes < 4096 else 0
        entry = {"dtype": dtype, "shape": shape, "data_offsets": offs}
        if draw(_ODDS) == 0:
            entry = draw(mutated(entry, keys=_H_ENTRY_KEYS, values=JSON_LITE))
        header[name] = entry
    if draw(_ODDS) < 4:
        header["__metadata__"] = draw(_H_META)
    blob = dumps(header)
    if draw(_ODDS) < 2:  # raw edits of the JSON text
        i = draw(st.integers(0, len(blob)))
        blob = blob[:i] + draw(_H_SPLICE)
    return blob, bytes(max(0, min(off, 1 << 16) + draw(st.integers(-2, 2))))


def _valid_file(tmp: Path) -> bytes:
    """A small, valid safetensors file with one tensor of each dtype family."""
    g = torch.Generator().manual_seed(0)
    ts = {"a": torch.randn(3, 5, generator=g).to(torch.bfloat16), "b": torch.randn(4, generator=g),
          "c": torch.randint(0, 255, (2, 3), dtype=torch.uint8, generator=g),
          "d": torch.randn(2, 8, generator=g).to(torch.float8_e4m3fn), "s": torch.tensor(0.5),
          "z": torch.empty(0, 4, dtype=torch.int32)}
    p = tmp / "valid.safetensors"
    w = ShardWriter(p, [(k, v.dtype, tuple(v.shape)) for k, v in ts.items()], {"format": "pt"})
    for k, v in ts.items():
        w.write(k, v)
    w.commit()
    return p.read_bytes()


def _read_all(path: Path) -> dict[str, torch.Tensor]:
    """read_header, then every tensor through ShardReader: the whole read path of a shard."""
    h = read_header(path)
    out = {}
    with ShardReader(path, h) as r:
        for name, e in h.tensors.items():
            t = r.get(name)
            assert t.dtype == e.dtype and tuple(t.shape) == e.shape and t.numel() * t.element_size() == e.nbytes
            out[name] = t
    # accepted => well-formed: tensors tile the data section exactly, in bounds
    pos = h.data_start
    for e in sorted(h.tensors.values(), key=lambda e: (e.begin, e.end)):
        assert e.begin == pos and e.end >= e.begin
        pos = e.end
    assert pos == h.file_size == path.stat().st_size
    return out


def _agrees_with_safetensors(data: bytes, ours: dict[str, torch.Tensor]) -> None:
    """What we accept, the safetensors library (what vLLM loads with) accepts with the same bytes."""
    from safetensors.torch import load

    if any(t.dtype == torch.float8_e8m0fnu for t in ours.values()):
        return  # safetensors 0.8's torch mapping lacks F8_E8M0
    theirs = load(data)
    assert set(theirs) == set(ours)
    for k, t in ours.items():
        u = theirs[k]
        assert u.dtype == t.dtype and u.shape == t.shape
        assert torch.equal(u.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))


def _check_safetensors_bytes(path: Path, data: bytes):
    path.write_bytes(data)
    kind, res = outcome(_read_all, path)
    if kind == "ok":
        _agrees_with_safetensors(data, res)
    return kind


# =========================================================================== safetensors
@fuzz(150)
@given(n=st.one_of(st.integers(0, 80), st.integers(0, 2**64 - 1),
                   st.sampled_from([MAX_HEADER_BYTES, MAX_HEADER_BYTES + 1, 10**15, 2**63, 2**64 - 1])),
       body=st.binary(max_size=80))
def test_header_length_prefix(tmp_path_factory, n, body):
    """Any 8-byte length: refused before reading when it exceeds the cap or the file."""
    p = tmp_path_factory.getbasetemp() / "len.safetensors"
    kind = _check_safetensors_bytes(p, st_file(body[:n] if n <= len(body) else body, body[n:], n=n))
    if n > len(body) or n > MAX_HEADER_BYTES:
        assert kind == "error"


@fuzz(100)
@given(blob=st.binary(max_size=200) | st.text(max_size=200).map(lambda s: s.encode("utf-8", "surrogatepass")),
       data=st.binary(max_size=16))
def test_random_header_bytes(tmp_path_factory, blob, data):
    _check_safetensors_bytes(tmp_path_factory.getbasetemp() / "raw.safetensors", st_file(blob, data))


@fuzz(150)
@given(hd=headers())
def test_structured_headers(tmp_path_factory, hd):
    """Entries with random dtypes, shapes (huge, negative, bool, float, overflowing products),
    offsets, extra keys, metadata of every type, duplicate keys and raw text edits."""
    blob, data = hd
    _check_safetensors_bytes(tmp_path_factory.getbasetemp() / "hdr.safetensors", st_file(blob, data))


@functools.lru_cache(maxsize=None)
def byte_edits(size: int):
    """1..4 edits of a `size`-byte file (the strategy is built once: building is costly)."""
    return st.lists(st.one_of(
        st.tuples(st.just("flip"), st.integers(0, size - 1), st.integers(0, 7)),
        st.tuples(st.just("set"), st.integers(0, size - 1), st.integers(0, 255)),
        st.tuples(st.just("truncate"), st.integers(0, size)),
        st.tuples(st.just("extend"), st.binary(min_size=1, max_size=16)),
        st.tuples(st.just("insert"), st.integers(0, size), st.binary(min_size=1, max_size=8)),
        st.tuples(st.just("delete"), st.integers(0, size), st.integers(1, 8)),
        st.tuples(st.just("length"), st.integers(0, 2**64 - 1) | st.integers(0, size + 8)),
    ), min_size=1, max_size=4)


def _apply(data: bytes, ops) -> bytes:
    b = bytearray(data)
    for op in ops:
        if op[0] == "flip" and op[1] < len(b):
            b[op[1]] ^= 1 << op[2]
        elif op[0] == "set" and op[1] < len(b):
            b[op[1]] = op[2]
        elif op[0] == "truncate":
            del b[op[1]:]
        elif op[0] == "extend":
            b += op[1]
        elif op[0] == "insert":
            b[op[1]:op[1]] = op[2]
        elif op[0] == "delete":
            del b[op[1]:op[1] + op[2]]
        elif op[0] == "length" and len(b) >= 8:
            b[:8] = struct.pack("<Q", op[1])
    return bytes(b)


@pytest.fixture(scope="module")
def valid_bytes(tmp_path_factory):
    return _valid_file(tmp_path_factory.mktemp("valid"))


def test_valid_file_reads_and_agrees(valid_bytes, tmp_path):
    assert _check_safetensors_bytes(tmp_path / "v.safetensors", valid_bytes) == "ok"


@fuzz(200)
@given(data=st.data())
def test_mutated_valid_file(valid_bytes, tmp_path_factory, data):
    """Bit flips, byte sets, truncation, extension, insertion, deletion, a rewritten length."""
    ops = data.draw(byte_edits(len(valid_bytes)))
    _check_safetensors_bytes(tmp_path_factory.getbasetemp() / "mut.safetensors", _apply(valid_bytes, ops))


def test_lying_lengths_are_refused_before_reading(tmp_path):
    """A header or tensor claiming more bytes than the file has is refused with nothing allocated
    for it (bounded() caps the process's Python allocations at 32 MiB)."""
    p = tmp_path / "x.safetensors"
    for n in (10**15, MAX_HEADER_BYTES, MAX_HEADER_BYTES + 1, 2**64 - 1):
        p.write_bytes(st_file(b"{}", n=n))
        assert outcome(read_header, p)[0] == "error"
    huge = {"a": {"dtype": "F32", "shape": [2**40, 2**20], "data_offsets": [0, 2**62]}}
    p.write_bytes(st_file(dumps(huge), b"\0" * 16))
    assert outcome(read_header, p)[0] == "error"
    for shape in ([2**62, 4, 0], [2**64, 0], [0] + [2**31] * 3, [1] * 65):
        p.write_bytes(st_file(dumps({"a": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}})))
        assert outcome(_read_all, p)[0] == "error", shape
    p.write_bytes(st_file(dumps({"a": {"dtype": "F32", "shape": [2**61, 0], "data_offsets": [0, 0]}})))
    assert outcome(_read_all, p)[0] == "ok"  # zero elements: fine, whatever the other dims
    big = tmp_path / "big.json"  # sparse: 64 MiB + 1 of nothing, refused without being read
    with open(big, "wb") as f:
        f.truncate(MAX_JSON_BYTES + 1)
    kind, e = outcome(read_json, big, "index")
    assert kind == "error" and "larger than" in str(e)


def test_special_files_never_block(tmp_path):
    """A FIFO (would block open and read forever), a directory, /dev/zero behind a symlink."""
    fifo = tmp_path / "fifo.safetensors"
    os.mkfifo(fifo)
    (tmp_path / "dir.safetensors").mkdir()
    (tmp_path / "zero.safetensors").symlink_to("/dev/zero")
    for p in (fifo, tmp_path / "dir.safetensors", tmp_path / "zero.safetensors"):
        kind, e = outcome(read_header, p)
        assert kind == "error" and "regular file" in str(e)
        kind, e = outcome(read_json, p, "config")
        assert kind == "error"
        with pytest.raises(ConfigError):
            with bounded():
                Inkling2Config.load(p)


# =========================================================================== index files
_SHARD_NAMES = ["a.safetensors", "b.safetensors", "missing.safetensors", "out.safetensors", "loop",
                "dangling", "inside_link.safetensors", "fifo", "sub", "../a.safetensors", "/etc/passwd",
                "sub/x.safetensors", "a\\b", "a\0b", "", ".", "..", "x" * 300, "\ud800", "é" * 200, " a.safetensors"]


def _two_shards(root: Path) -> None:
    """a.safetensors (t0, t1) and b.safetensors (t2): the valid shards index files point at."""
    for shard, names in (("a.safetensors", ["t0", "t1"]), ("b.safetensors", ["t2"])):
        w = ShardWriter(root / shard, [(n, torch.float32, (2,)) for n in names])
        for n in names:
            w.write(n, torch.ones(2))
        w.commit()


@pytest.fixture(scope="module")
def index_dir(tmp_path_factory):
    """Two valid shards and every kind of bad file name target."""
    base = tmp_path_factory.mktemp("index")
    root = base / "ck"
    root.mkdir()
    _two_shards(root)
    outside = base / "outside.safetensors"
    outside.write_bytes((root / "b.safetensors").read_bytes())
    (root / "out.safetensors").symlink_to(outside)
    (root / "loop").symlink_to("loop")
    (root / "dangling").symlink_to("nowhere")
    (root / "inside_link.safetensors").symlink_to("b.safetensors")
    os.mkfifo(root / "fifo")
    (root / "sub").mkdir()
    return root


def _open_checkpoint(root: Path):
    ck = Checkpoint.open(root)
    real = root.resolve()
    for s in ck.shards:
        p = (root / s).resolve()
        assert p.is_relative_to(real) and p.is_file(), s
    hs = ck.headers()
    assert set(ck.weight_map) == {n for h in hs.values() for n in h.tensors}
    return ck


_INDEX = {"metadata": {"total_size": 24}, "weight_map": {"t0": "a.safetensors", "t1": "a.safetensors",
                                                          "t2": "b.safetensors"}}


@fuzz(120)
@given(data=st.data())
def test_index_files(index_dir, data):
    """weight_map of every type; file names with `..`, absolute, NUL, backslash, too long, lone
    surrogates; symlinks outside / looping / dangling; FIFO and directory shards; metadata types."""
    if data.draw(st.integers(0, 2)) == 0:
        wm = data.draw(st.dictionaries(st.sampled_from(["t0", "t1", "t2", "t3"]) | st.text(max_size=4),
                                       st.sampled_from(_SHARD_NAMES) | JSON, max_size=4))
        obj = {"weight_map": wm}
        if data.draw(st.booleans()):
            obj["metadata"] = data.draw(JSON)
    else:
        obj = data.draw(mutated(_INDEX, keys=("weight_map", "metadata", "t0", "t3"),
                                values=st.sampled_from(_SHARD_NAMES) | JSON))
    raw = dumps(obj)
    if data.draw(st.integers(0, 6)) == 0:
        raw = raw.replace(b'"t1"', b'"t0"')  # duplicate keys
    (index_dir / INDEX_NAME).write_bytes(raw)
    outcome(_open_checkpoint, index_dir)


@fuzz(80)
@given(name=st.sampled_from(_SHARD_NAMES) | st.text(max_size=20) | JSON)
def test_safe_child(index_dir, name):
    kind, res = outcome(safe_child, index_dir, name)
    if kind == "ok":
        assert res.resolve().is_relative_to(index_dir.resolve()) and res.parent == index_dir
    else:
        assert isinstance(res, UnsafePathError)


def test_single_file_checkpoint_symlinked_outside(tmp_path, valid_bytes):
    (tmp_path / "outside.safetensors").write_bytes(valid_bytes)
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "model.safetensors").symlink_to(tmp_path / "outside.safetensors")
    kind, e = outcome(Checkpoint.open, tmp_path / "ck")
    assert kind == "error" and isinstance(e, UnsafePathError)


# =========================================================================== config.json
_TINY = make_config("tiny", layers=2, experts=2)  # the published layout's, with a DSpark draft
_CONFIG_KEYS = list(dict.fromkeys([*_TINY, *_TINY["text_config"], *_TINY["vision_config"], "dspark_config",
                                   "transformer_layer_config", "aux_hidden_state_layer_ids", "bogus"]))
_CONFIG_VALUES = st.one_of(JSON, st.integers(-5, 70), st.sampled_from(
    [["hybrid"], ["hybrid_sliding"] * 2, ["hybrid", "bogus"], "hybrid_sliding", [["x"]], ["full_attention"] * 2,
     {"a": 1}, 2**24, 2**24 + 1, 2**16, 4096, 4097, 10**12]))


def _check_config(cfg: Inkling2Config) -> None:
    """An accepted config yields sane, bounded shapes (and so bounded loops)."""
    t = cfg.text
    for k, v in vars(t).items():
        if isinstance(v, int) and not isinstance(v, bool):
            assert 1 <= v <= 2**40, (k, v)
    assert len(t.layer_types) == t.num_hidden_layers <= 4096
    assert t.num_hidden_layers * t.n_routed_experts <= 1 << 20
    assert t.num_experts_per_tok <= t.n_routed_experts
    for i, spec in enumerate(checkpoint_tensors(cfg)):
        assert all(type(s) is int and s >= 1 for s in spec.shape), spec
        classify(spec.name)
        if i > 2000:
            break


@fuzz(200)
@given(d=mutated(_TINY, keys=_CONFIG_KEYS, max_ops=4, values=_CONFIG_VALUES))
def test_config_dicts(d):
    """Missing or mistyped keys, huge/negative/float/bool/string numbers, wrong layer_types,
    text_config / vision_config / dspark_config of the wrong type, anywhere in the nesting."""
    kind, res = outcome(Inkling2Config.from_dict, d, "config.json")
    if kind == "ok":
        _check_config(res)
    else:
        assert isinstance(res, ConfigError)


@fuzz(80)
@given(raw=st.binary(max_size=120) | st.builds(dumps, mutated(_TINY, keys=_CONFIG_KEYS, values=_CONFIG_VALUES)))
def test_config_files(tmp_path_factory, raw):
    p = tmp_path_factory.getbasetemp() / "config.json"
    p.write_bytes(raw)
    kind, res = outcome(Inkling2Config.load, p)
    if kind == "ok":
        _check_config(res)
    else:
        assert isinstance(res, ConfigError)


def test_config_bool_and_float_numbers_refused():
    for section, k, v in (("text_config", "hidden_size", True), ("text_config", "hidden_size", 64.0),
                          ("text_config", "hidden_size", "64"), ("text_config", "n_routed_experts", 2**20),
                          ("text_config", "layer_types", "hybrid_sliding"), ("vision_config", "projector_bias", "false"),
                          (None, "vision_config", []), (None, "text_config", None)):
        d = copy.deepcopy(_TINY)
        (d if section is None else d[section])[k] = v
        with pytest.raises(ConfigError, match=k):
            Inkling2Config.from_dict(d)


# =========================================================================== scheme files
_RULE = {"part": "expert", "layers": "0-3", "format": "nvfp4"}
_SCHEME = {"description": "d", "rules": [_RULE, {**_RULE, "layers": "all", "format": "mxfp8"}]}
_SCHEME_VALUES = st.one_of(JSON, st.sampled_from(
    ["all", "0", "3-1", "1-", "-1", "٣", "²", "1" * 5000, "0-" + "9" * 10, " 1", "1 ", "nvfp4", "mxfp8", "passthrough",
     "expert", "attention", 10**30, -1, 2**62, 1.0, True]))


def _toml(obj) -> str:
    """A scheme (or anything) as TOML text where it can be (strings, ints, tables, arrays of tables)."""
    def value(v) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v) if not isinstance(v, float) or math.isfinite(v) else ("nan" if v != v else
                                                                                 ("inf" if v > 0 else "-inf"))
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return "{" + ", ".join(f"{json.dumps(k)} = {value(x)}" for k, x in v.items()) + "}" if isinstance(v, dict) \
            else '""'
    if not isinstance(obj, dict):
        return f"x = {value(obj)}"
    return "\n".join(f"{json.dumps(k)} = {value(v)}" for k, v in obj.items())


def _check_scheme(s) -> None:
    """An accepted scheme has rules with ranges inside the layer bound."""
    from inkling_quant.schemes import ALL_LAYERS, FORMATS

    assert s.rules and all(0 <= r.start < r.stop <= ALL_LAYERS and r.format in FORMATS for r in s.rules)
    s.table(Inkling2Config.from_dict(_TINY))


@fuzz(150)
@given(d=mutated(_SCHEME, keys=("rules", "description", "name", "part", "layers", "format", "bogus"),
                 values=_SCHEME_VALUES), toml=st.booleans())
def test_scheme_files(tmp_path_factory, d, toml):
    """Scheme files (JSON or TOML) with rules of the wrong shape, layers in every wrong spelling:
    each loads or is refused with our error, naming the file."""
    from inkling_quant.schemes import load_scheme

    p = tmp_path_factory.getbasetemp() / ("scheme.toml" if toml else "scheme.json")
    p.write_bytes(_toml(d).encode("utf-8", "surrogatepass") if toml else dumps(d))
    kind, res = outcome(load_scheme, p)
    if kind == "ok":
        _check_scheme(res)
    else:
        assert str(p) in str(res)


# =========================================================================== Hugging Face MoE configs
_HF = {"model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
       "num_key_value_heads": 2, "vocab_size": 96, "num_experts": 4, "num_experts_per_tok": 2,
       "moe_intermediate_size": 32, "intermediate_size": 96, "mlp_only_layers": [0], "decoder_sparse_step": 1,
       "max_position_embeddings": 4096, "torch_dtype": "bfloat16", "tie_word_embeddings": False}
_HF_KEYS = (*_HF, "head_dim", "moe_layers", "interleave_moe_layer_step", "first_k_dense_replace", "n_routed_experts",
            "num_local_experts", "text_config", "dtype", "kv_lora_rank", "sliding_window", "n_shared_experts")
_HF_VALUES = st.one_of(JSON, st.integers(-3, 200), st.sampled_from(
    [[[1]], [0, 99], [True], ["x"], "bfloat16", "float8", 2**24, 0, 96, 7]))


def _read_hf(d):
    """What convert/inspect (layout.model_config) and plan (budget_hf.HFModel, then the plan) read."""
    from inkling_quant.model.layout import model_config
    from inkling_quant.plan.hf import HFModel
    from inkling_quant.plan.inkling2 import plan

    model_config(d, "config.json")
    return plan(HFModel.from_dict(d, "config.json"), tp=1)


@fuzz(200)
@given(d=mutated(_HF, keys=_HF_KEYS, max_ops=4, values=_HF_VALUES))
def test_hf_config_dicts(d):
    """A Hugging Face MoE config.json with missing, mistyped or inconsistent keys: read by convert,
    inspect and plan, or refused with a ConfigError (never a TypeError or ZeroDivisionError)."""
    kind, res = outcome(_read_hf, d)
    if kind == "ok":  # an accepted config gives a plan of positive, finite sizes
        assert res.params.total > 0 and 0 < res.requested_bytes < 2**62


# =========================================================================== activation scales
@fuzz(100)
@given(obj=JSON | st.dictionaries(st.text(max_size=10), st.floats() | st.integers(-10, 10**400) | JSON,
                                  max_size=4))
def test_activation_amax_json(tmp_path_factory, obj):
    p = tmp_path_factory.getbasetemp() / "amax.json"
    p.write_bytes(dumps(obj))
    kind, res = outcome(load_activation_amax, str(p))
    if kind == "ok":
        assert all(isinstance(v, float) and 0 < v < math.inf for v in res.values())


@st.composite
def amax_files(draw):
    """safetensors of '<module>.input_amax' tensors, of random dtypes and shapes (incl. empty)."""
    header, data = {}, b""
    for _ in range(draw(st.integers(0, 3))):
        name = draw(st.sampled_from(["m.input_amax", ".input_amax", "m.weight", "x.y.input_amax"])
                    | st.text(max_size=6))
        dtype = draw(st.sampled_from(list(DTYPES)))
        shape = draw(st.lists(st.integers(0, 2), max_size=3))
        nbytes = math.prod(shape) * DTYPES[dtype].itemsize
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + nbytes]}
        data += draw(st.binary(min_size=nbytes, max_size=nbytes))
    return st_file(dumps(header), data)


@fuzz(120)
@given(raw=amax_files())
def test_activation_amax_safetensors(tmp_path_factory, raw):
    p = tmp_path_factory.getbasetemp() / "amax.safetensors"
    p.write_bytes(raw)
    kind, res = outcome(load_activation_amax, str(p))
    if kind == "ok":
        assert all(isinstance(v, float) and 0 < v < math.inf for v in res.values())


# =========================================================================== verify's config readers
def _quant_base():
    from inkling_quant.schemes import SCHEMES

    base = {k: v for k, v in _TINY.items() if k not in ("vision_config", "dspark_config")}  # fewer tensors: faster
    cfg = Inkling2Config.from_dict(base)
    want = {}
    for i in range(cfg.text.num_hidden_layers):
        e = SCHEMES["default"].format_for(cfg, classify(f"{experts_module(i)}.w13_weight")).layer_config(False)
        if e is not None:
            want[experts_module(i)] = e
    q = {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None,
         "exclude_modules": ["model.llm.unembed", "model.llm.embed", "model.llm.layers.*.attn*", "mtp*"],
         "quantized_layers": want}
    hf = {"producer": {"name": "modelopt", "version": "0.1"}, "quantization": q,
          "converter": {"name": "inkling-quant", "scheme": "default", "weight_only": False}}
    return {**base, "quantization_config": {"quant_method": "modelopt", **q}}, hf


_CONFIG_Q, _HF_QUANT = _quant_base()
_QUANT_KEYS = ["quant_algo", "kv_cache_quant_algo", "exclude_modules", "quantized_layers", "group_size",
               "quant_method", "producer", "quantization", "converter", "scheme", "weight_only"]


def _verify_config(root: Path):
    """verify's config check (config.json + hf_quant_config.json) with INKLING_QUANT_DEBUG set, so
    an exception its guard would report as an internal error propagates instead."""
    from inkling_quant.verify import check_config_files

    with mock.patch.dict(os.environ, {"INKLING_QUANT_DEBUG": "1"}):
        return check_config_files(root)


def test_verify_config_base_passes(tmp_path):
    (tmp_path / "config.json").write_bytes(dumps(_CONFIG_Q))
    (tmp_path / "hf_quant_config.json").write_bytes(dumps(_HF_QUANT))
    r = _verify_config(tmp_path)
    assert r.check("config").status == "pass", [str(p) for _, p in r.problems()]
    assert r.check("config").figures["quantized_layers"] == 2  # both layers' experts held to the scheme


@fuzz(80)
@given(which=st.sampled_from(["config", "hf", "both"]), data=st.data())
def test_verify_quant_configs(tmp_path_factory, which, data):
    """quantization_config / hf_quant_config.json mutated anywhere (model dimensions untouched:
    test_config_dicts covers those)."""
    root = tmp_path_factory.getbasetemp() / "vq"
    root.mkdir(exist_ok=True)
    config, hf = copy.deepcopy(_CONFIG_Q), _HF_QUANT
    if which != "hf":
        config["quantization_config"] = data.draw(mutated(config["quantization_config"], keys=_QUANT_KEYS))
    if which != "config":
        hf = data.draw(mutated(hf, keys=_QUANT_KEYS, max_ops=4))
    (root / "config.json").write_bytes(dumps(config))
    (root / "hf_quant_config.json").write_bytes(dumps(hf))
    with bounded():
        _verify_config(root)


# =========================================================================== adapters
_ADAPTER = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"],
            "exclude_modules": None, "layers_to_transform": None, "layers_pattern": None,
            "rank_pattern": {"q_proj": 4}, "alpha_pattern": {}, "use_rslora": False, "bias": "none",
            "init_lora_weights": True, "fan_in_fan_out": False, "base_model_name_or_path": "x/y"}
_ADAPTER_KEYS = list(_ADAPTER) + ["use_dora", "modules_to_save", "lora_dropout", "task_type", "weird"]
# Integers past float range are tested by the regression tests at the end.
_SMALL_JSON = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(),
                                     st.text(max_size=12),
                                     st.sampled_from([".*", "(", "q_proj", "all-linear", [0, 1], 0, -1, 1.5])),
                           lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
                           max_leaves=8)
# PEFT's module names for the published model (transformers' Inkling2ForConditionalGeneration)
_MODULES = ["model.language_model.layers.0.self_attn.q_proj.linear", "model.language_model.layers.1.mlp.experts",
            "lm_head"]


def _adapter_config(d):
    from inkling_quant.lora import AdapterConfig

    cfg = AdapterConfig.from_dict(d, "adapter_config.json")
    for m in _MODULES:
        cfg.targets(m, is_linear=lambda module: not module.endswith("lm_head"))
        cfg.scaling(m)
    return cfg


@fuzz(150)
@given(d=mutated(_ADAPTER, keys=_ADAPTER_KEYS, max_ops=4, values=_SMALL_JSON))
def test_adapter_configs(d):
    outcome(_adapter_config, d)


@st.composite
def adapter_weights(draw):
    header, data = {}, b""
    for _ in range(draw(st.integers(0, 4))):
        module = draw(st.sampled_from(["base_model.model.model.language_model.layers.0.self_attn.q_proj.linear",
                                       "model.language_model.layers.0.self_attn.q_proj.linear", "x"]))
        name = module + draw(st.sampled_from([".lora_A.weight", ".lora_B.weight", ".lora_magnitude_vector",
                                              ".lora_B.bias", ".lora_embedding_A", ""]))
        dtype = draw(st.sampled_from(["BF16", "F16", "F32", "I8", "F8_E4M3"]))
        shape = draw(st.lists(st.integers(0, 3), max_size=3))
        nbytes = math.prod(shape) * DTYPES[dtype].itemsize
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + nbytes]}
        data += bytes(nbytes)
    return st_file(dumps(header), data)


@fuzz(100)
@given(cfg=mutated(_ADAPTER, keys=_ADAPTER_KEYS, max_ops=1, values=_SMALL_JSON) | st.just(_ADAPTER),
       weights=adapter_weights())
def test_adapter_directories(tmp_path_factory, cfg, weights):
    from inkling_quant.lora import open_adapter

    root = tmp_path_factory.getbasetemp() / "adapter"
    root.mkdir(exist_ok=True)
    (root / "adapter_config.json").write_bytes(dumps(cfg))
    (root / "adapter_model.safetensors").write_bytes(weights)
    outcome(open_adapter, root)


# =========================================================================== draft.py readers
_DRAFT_CONFIG = _TINY["dspark_config"]  # an extracted draft's config.json: vLLM's speculators config, verbatim


@fuzz(100)
@given(dc=mutated(_DRAFT_CONFIG, keys=list(_DRAFT_CONFIG), values=st.one_of(
    st.none(), st.booleans(), st.integers(1, 8), st.text(max_size=4), st.floats(allow_infinity=False),
    st.sampled_from([[], {}, {"hidden_size": 4}, {"vocab_size": 4}]))))
def test_draft_configs(dc):
    """Extracted-draft config.json (mutated anywhere, transformer_layer_config included).
    Infinity is kept out of this property: the regression tests at the end cover it."""
    from inkling_quant.draft import draft_specs

    outcome(draft_specs, dc, "config.json")


@fuzz(60)
@given(text=st.text(max_size=200) | st.binary(max_size=200).map(lambda b: b.decode("latin-1")))
def test_checksum_files(tmp_path_factory, text):
    from inkling_quant.io.output import read_checksums

    p = tmp_path_factory.getbasetemp() / "checksums.sha256"
    p.write_bytes(text.encode("utf-8", "surrogatepass"))
    outcome(read_checksums, p)


# =========================================================================== corpus replay
def _replay_header(p: Path):
    return _read_all(p)


def _replay_index(p: Path, tmp: Path):
    root = tmp / "ck"
    root.mkdir()
    _two_shards(root)
    (root / INDEX_NAME).write_bytes(p.read_bytes())
    return _open_checkpoint(root)


def _replay_verify_config(p: Path, tmp: Path):
    root = tmp / "ck"
    root.mkdir()
    (root / "config.json").write_bytes(p.read_bytes())
    (root / "hf_quant_config.json").write_bytes(dumps(_HF_QUANT))
    return _verify_config(root)


def _replay_adapter_config(p: Path):
    return _adapter_config(json.loads(p.read_bytes()))


def _replay_draft_config(p: Path):
    from inkling_quant.draft import draft_specs

    specs = draft_specs(json.loads(p.read_bytes()), str(p))
    assert all(s >= 1 for spec in specs for s in spec.shape), "negative or zero dimension accepted"
    return specs


def _replay_hf_quant_config(p: Path, tmp: Path):
    from inkling_quant.export.modelopt import read_quantization

    shutil.copyfile(p, tmp / "hf_quant_config.json")
    return read_quantization(tmp, Inkling2Config.reference().raw)


def _replay_scheme(p: Path):
    from inkling_quant.schemes import load_scheme

    return load_scheme(p)


def _replay_hf_config(p: Path):
    return _read_hf(read_json(p, "config.json", ConfigError))


REPLAY = {
    "scheme": lambda p, tmp: _replay_scheme(p),
    "hf_config": lambda p, tmp: _replay_hf_config(p),
    "header": lambda p, tmp: _replay_header(p),
    "config": lambda p, tmp: Inkling2Config.load(p),
    "json": lambda p, tmp: read_json(p, "json file"),
    "index": _replay_index,
    "amax": lambda p, tmp: load_activation_amax(str(p)),
    "verify_config": _replay_verify_config,
    "adapter_config": lambda p, tmp: _replay_adapter_config(p),
    "draft_config": lambda p, tmp: _replay_draft_config(p),
    "hf_quant_config": _replay_hf_quant_config,
}
XFAIL: dict[str, tuple[type, str]] = {}  # all fixed; the cases stay as regressions


def _corpus():
    for p in sorted(CORPUS.glob("*/*")):
        rel = f"{p.parent.name}/{p.name}"
        marks = [pytest.mark.xfail(strict=True, raises=XFAIL[rel][0], reason=XFAIL[rel][1])] if rel in XFAIL else []
        yield pytest.param(p, id=rel, marks=marks)


@pytest.mark.parametrize("path", list(_corpus()))
def test_corpus(path, tmp_path):
    """Every input that once crashed a reader: now it parses or raises our error."""
    kind, _ = outcome(REPLAY[path.parent.name], path, tmp_path)
    assert kind in ("ok", "error")


def test_corpus_covers_every_reader():
    assert {p.parent.name for p in CORPUS.glob("*/*")} <= set(REPLAY)
    assert set(XFAIL) <= {f"{p.parent.name}/{p.name}" for p in CORPUS.glob("*/*")}


# =========================================================================== once-crashers in other modules (fixed)
@pytest.mark.parametrize("text", [b"[" * 100_000, b'{"hidden_size": ' + b"1" * 5000 + b"}"], ids=["deep", "bigint"])
def test_verify_malformed_config_json_is_not_an_internal_error(tmp_path, text):
    """Same inputs as corpus verify_config/*, run as a user would (no debug flag): a finding
    naming the file, not 'internal error while checking (RecursionError...)'."""
    from inkling_quant.verify import check_config_files

    (tmp_path / "config.json").write_bytes(text)
    report = check_config_files(tmp_path)
    msgs = [p.message for _, p in report.problems()]
    assert msgs and not any("internal error" in m for m in msgs), msgs


def test_verify_fifo_config_does_not_hang(tmp_path):
    from inkling_quant.verify import check_config_files

    os.mkfifo(tmp_path / "config.json")
    with bounded(seconds=5):
        report = check_config_files(tmp_path)
    assert report.check("config").status != "pass"


def test_draft_read_checksums_fifo_does_not_hang(tmp_path):
    from inkling_quant.io.output import read_checksums

    os.mkfifo(tmp_path / "checksums.sha256")
    with pytest.raises(InklingQuantError):
        with bounded(seconds=1):
            read_checksums(tmp_path / "checksums.sha256")


def test_lora_huge_integer_rank():
    from inkling_quant.lora import AdapterConfig

    with pytest.raises(InklingQuantError):
        AdapterConfig.from_dict({**_ADAPTER, "r": 10**400}, "adapter_config.json")


def test_lora_deeply_nested_pattern():
    from inkling_quant.lora import AdapterConfig

    with pytest.raises(InklingQuantError):
        with bounded():
            AdapterConfig.from_dict({**_ADAPTER, "target_modules": "(" * 5000 + ")" * 5000}, "adapter_config.json")


def _draft_with(**layer):
    return {**_DRAFT_CONFIG, "transformer_layer_config": {**_DRAFT_CONFIG["transformer_layer_config"], **layer}}


def test_draft_specs_infinity():
    from inkling_quant.draft import draft_specs

    assert draft_specs(_draft_with())  # the base is valid
    with pytest.raises(InklingQuantError, match="hidden_size"):
        draft_specs(_draft_with(hidden_size=math.inf))


def test_draft_specs_negative_dims():
    from inkling_quant.draft import draft_specs

    with pytest.raises(ConfigError, match="hidden_size"):
        draft_specs(_draft_with(hidden_size=-64))


# =========================================================================== atheris (optional, manual)
def _atheris_main() -> None:  # pragma: no cover - run by hand, not by pytest
    """libFuzzer over one reader, seeded with valid inputs and this file's corpus; crashes (any
    exception but ours) are written by libFuzzer as crash-<sha1> in the working directory."""
    import tempfile

    import atheris

    target = sys.argv.pop(1)
    tmp = Path(tempfile.mkdtemp())
    p = tmp / ("x.safetensors" if target in ("header", "amax") else "x.json")
    seeds = tmp / "seeds"
    seeds.mkdir()
    index_root = tmp / "ck"
    index_root.mkdir()
    for shard, names in (("a.safetensors", ["t0", "t1"]), ("b.safetensors", ["t2"])):
        w = ShardWriter(index_root / shard, [(n, torch.float32, (2,)) for n in names])
        for n in names:
            w.write(n, torch.ones(2))
        w.commit()
    valid = {"header": [_valid_file(tmp)], "json": [dumps(_ADAPTER), dumps(_INDEX)], "config": [dumps(_TINY)],
             "amax": [dumps({"m": 1.5})], "index": [dumps(_INDEX)]}[target]
    corpus_dir = {"header": ["header"], "json": ["json"], "config": ["config"], "amax": ["amax"],
                  "index": ["index"]}[target]
    for i, b in enumerate(valid + [q.read_bytes() for d in corpus_dir for q in sorted((CORPUS / d).glob("*"))]):
        (seeds / f"seed{i}").write_bytes(b)
    run = {"header": lambda: _read_all(p), "json": lambda: read_json(p, "json"),
           "config": lambda: Inkling2Config.load(p), "amax": lambda: load_activation_amax(str(p)),
           "index": lambda: _open_checkpoint(index_root)}[target]

    def one(data: bytes) -> None:
        if target in ("header", "amax") and len(data) > 8 and data[0] & 1:
            data = struct.pack("<Q", len(data) - 8) + data[8:]  # a random length rarely fits: fix it half the time
        (index_root / INDEX_NAME if target == "index" else p).write_bytes(data)
        try:
            with bounded():
                run()
        except InklingQuantError:
            pass

    import inspect

    for name, mod in list(sys.modules.items()):  # coverage of our readers only (instrument_all takes minutes)
        if name.startswith("inkling_quant") or name == __name__:
            for obj in list(vars(mod).values()):
                if getattr(obj, "__module__", None) != name:
                    continue
                funcs = [obj] if inspect.isfunction(obj) else [
                    getattr(v, "__func__", v) for v in vars(obj).values()] if inspect.isclass(obj) else []
                for f in funcs:
                    if inspect.isfunction(f):
                        atheris.instrument_func(f)
    atheris.Setup(sys.argv + [str(seeds)], one)
    atheris.Fuzz()


if __name__ == "__main__":  # pragma: no cover
    _atheris_main()
