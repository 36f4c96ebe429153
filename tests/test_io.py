import json
import os
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from inkling_quant.errors import CheckpointError, UnsafePathError
from inkling_quant.io.checkpoint import Checkpoint
import errno

from inkling_quant.io import safetensors as st
from inkling_quant.io.safetensors import ShardReader, ShardWriter, TensorBuffer, read_header, sha256_file


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "a": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "b": torch.randn(7, generator=g),
        "c": torch.randint(0, 255, (4, 2), dtype=torch.uint8, generator=g),
        "d": torch.randn(4, 32, generator=g).to(torch.float8_e4m3fn),
        "s": torch.tensor(0.25),
    }


def test_writer_output_is_read_by_safetensors(tmp_path):
    ts = _tensors()
    # 6 MB, between small ones: hashed on the writer's second thread, the digest still in order
    ts = {"big": torch.randn(1536, 1024, generator=torch.Generator().manual_seed(1)), **ts, "z": torch.ones(3)}
    p = tmp_path / "x.safetensors"
    w = ShardWriter(p, [(k, v.dtype, tuple(v.shape)) for k, v in ts.items()], {"format": "pt"})
    for k, v in ts.items():
        w.write(k, v)
    assert not p.exists()  # only the .partial until commit
    sha = w.commit()
    assert sha == sha256_file(p) and not (tmp_path / "x.safetensors.partial").exists()
    with safe_open(p, "pt") as f:
        for k, v in ts.items():
            got = f.get_tensor(k)
            assert got.dtype == v.dtype and torch.equal(got.reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8))
    buf = TensorBuffer()
    with ShardReader(p) as r:
        for k, v in ts.items():
            got = r.get(k, buf).clone()
            assert torch.equal(got.reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8))


def _write(path, ts, direct):
    w = ShardWriter(path, [(k, v.dtype, tuple(v.shape)) for k, v in ts.items()], {"format": "pt"}, direct=direct)
    for k, v in ts.items():
        w.write(k, v)
    return w, w.commit()


def _direct_io_works(d) -> bool:
    try:
        os.close(os.open(d / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT))
        return True
    except OSError:
        return False


def _exactly(total: int) -> dict:
    """One u8 tensor sized so that the whole file is `total` bytes (header included)."""
    head, _, _ = st._header_bytes([("t", torch.uint8, (1,))], {"format": "pt"})
    return {"t": torch.arange(total - len(head) + 1, dtype=torch.int64).to(torch.uint8)}


CHUNK = st._DIRECT_CHUNK


@pytest.mark.parametrize("case", ["empty", "small", "one_chunk", "two_chunks", "chunk_plus_one", "mixed"])
def test_direct_io_writes_the_same_bytes_as_buffered(tmp_path, case):
    g = torch.Generator().manual_seed(2)
    ts = {"empty": {}, "small": _tensors(), "one_chunk": _exactly(CHUNK), "two_chunks": _exactly(2 * CHUNK),
          "chunk_plus_one": _exactly(CHUNK + 1),
          "mixed": {**_tensors(), "big": torch.randn(1200, 2048, generator=g).to(torch.bfloat16),
                    "z": torch.zeros(0, 4), "tail": torch.randint(0, 255, (4099,), dtype=torch.uint8, generator=g)},
          }[case]
    wd, sha_d = _write(tmp_path / "d.safetensors", ts, direct=True)
    wb, sha_b = _write(tmp_path / "b.safetensors", ts, direct=False)
    assert not wb.direct
    assert wd.direct == _direct_io_works(tmp_path)  # used wherever the file system takes it
    assert (tmp_path / "d.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()
    assert sha_d == sha_b == sha256_file(tmp_path / "d.safetensors")
    with safe_open(tmp_path / "d.safetensors", "pt") as f:
        assert sorted(f.keys()) == sorted(ts)
        for k, v in ts.items():
            assert torch.equal(f.get_tensor(k).reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("refused_at", ["open", "write"])
def test_direct_io_falls_back_to_buffered_where_refused(tmp_path, monkeypatch, refused_at):
    """Some file systems refuse O_DIRECT with EINVAL, at open or only at the first write."""
    real_open, real_write = os.open, os.write

    def fake_open(path, flags, *a):
        if refused_at == "open" and flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)

    def fake_write(fd, b):
        if refused_at == "write" and st.fcntl.fcntl(fd, st.fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, b)

    monkeypatch.setattr(st.os, "open", fake_open)
    monkeypatch.setattr(st.os, "write", fake_write)
    ts = {**_tensors(), "big": torch.randn(3 * CHUNK // 4 + 5, generator=torch.Generator().manual_seed(3))}
    w, sha = _write(tmp_path / "f.safetensors", ts, direct=True)
    assert not w.direct
    assert sha == sha256_file(tmp_path / "f.safetensors")
    with safe_open(tmp_path / "f.safetensors", "pt") as f:
        assert all(torch.equal(f.get_tensor(k).reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8))
                   for k, v in ts.items())


def test_direct_io_error_other_than_einval_is_raised_and_nothing_left(tmp_path, monkeypatch):
    def no_space(fd, b):
        raise OSError(errno.ENOSPC, "No space left on device")

    ts = {"big": torch.zeros(2 * CHUNK, dtype=torch.uint8)}
    p = tmp_path / "g.safetensors"
    with pytest.raises(OSError, match="No space"):
        with ShardWriter(p, [("big", torch.uint8, (2 * CHUNK,))], direct=True) as w:
            monkeypatch.setattr(st.os, "write", no_space)
            w.write("big", ts["big"])
    assert list(tmp_path.iterdir()) == []


def test_reader_reads_library_files(tmp_path):
    ts = {k: v for k, v in _tensors().items()}
    p = tmp_path / "lib.safetensors"
    save_file(ts, p)
    with ShardReader(p) as r:
        assert torch.equal(r.get("a"), ts["a"])


def test_writer_enforces_declared_order_and_aborts(tmp_path):
    p = tmp_path / "y.safetensors"
    with pytest.raises(CheckpointError, match="declared"):
        with ShardWriter(p, [("a", torch.float32, (2,))]) as w:
            w.write("b", torch.zeros(2))
    assert list(tmp_path.iterdir()) == []


def _raw(tmp_path, header: dict, data: bytes = b"", n=None):
    blob = json.dumps(header).encode()
    p = tmp_path / "bad.safetensors"
    p.write_bytes(struct.pack("<Q", len(blob) if n is None else n) + blob + data)
    return p


@pytest.mark.parametrize("header, data, match", [
    ({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4, "truncated"),
    ({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 12, "trailing"),
    ({"t": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, "expected 12"),
    ({"t": {"dtype": "Q9", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, "unknown dtype"),
    ({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "u": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12, "overlaps"),
    ({"t": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}, b"\0" * 16, "gap"),
    ({"t": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8, "non-negative"),
    ({"t": [1, 2]}, b"", "exactly dtype"),
])
def test_bad_headers_name_file_and_tensor(tmp_path, header, data, match):
    p = _raw(tmp_path, header, data)
    with pytest.raises(CheckpointError, match=match) as e:
        read_header(p)
    assert str(p) in str(e.value)


def test_bad_header_error_carries_file_and_tensor_as_fields(tmp_path):
    """The file and tensor are data on the error, not only words in its message."""
    p = _raw(tmp_path, {"w": {"dtype": "Q9", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8)
    with pytest.raises(CheckpointError) as e:
        read_header(p)
    assert (e.value.path, e.value.tensor) == (str(p), "w")
    assert e.value.message == "tensor 'w': unknown dtype 'Q9'"
    assert str(e.value) == f"{p}: tensor 'w': unknown dtype 'Q9'"
    with pytest.raises(CheckpointError) as e:  # a defect of the file, not of one tensor
        read_header(_raw(tmp_path, {}, n=10**12))
    assert (e.value.path, e.value.tensor) == (str(p), None)


def test_header_length_lies(tmp_path):
    with pytest.raises(CheckpointError, match="truncated"):
        read_header(_raw(tmp_path, {}, n=10**6))
    with pytest.raises(CheckpointError, match="cap"):
        read_header(_raw(tmp_path, {}, n=10**12))
    (tmp_path / "short.safetensors").write_bytes(b"abc")
    with pytest.raises(CheckpointError, match="no safetensors header"):
        read_header(tmp_path / "short.safetensors")


def _index(tmp_path, wm):
    save_file({"t": torch.zeros(2)}, tmp_path / "ok.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))


@pytest.mark.parametrize("fname", ["../evil.safetensors", "/etc/passwd", "sub/x.safetensors", ".."])
def test_index_paths_cannot_escape(tmp_path, fname):
    _index(tmp_path, {"t": fname})
    with pytest.raises(UnsafePathError, match="refusing"):
        Checkpoint.open(tmp_path)


def test_index_symlink_outside_refused(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    save_file({"t": torch.zeros(2)}, outside / "o.safetensors")
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "link.safetensors").symlink_to(outside / "o.safetensors")
    (ck / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"t": "link.safetensors"}}))
    with pytest.raises(UnsafePathError, match="outside"):
        Checkpoint.open(ck)


def test_index_missing_shard_and_mismatch(tmp_path):
    _index(tmp_path, {"t": "missing.safetensors"})
    with pytest.raises(CheckpointError, match="does not exist"):
        Checkpoint.open(tmp_path)
    _index(tmp_path, {"t": "ok.safetensors", "u": "ok.safetensors"})
    with pytest.raises(CheckpointError, match="lacks it"):
        Checkpoint.open(tmp_path).headers()
    _index(tmp_path, {"x": "ok.safetensors"})
    with pytest.raises(CheckpointError, match="not in the index"):
        Checkpoint.open(tmp_path).headers()
    (tmp_path / "model.safetensors.index.json").write_text("[]")
    with pytest.raises(CheckpointError, match="JSON object"):
        Checkpoint.open(tmp_path)


def test_tensor_buffer_grows_geometrically():
    """Reads of ever larger tensors reallocate O(log n) times, not once per tensor."""
    b, prev, grown = TensorBuffer(), None, 0
    for n in range(1, 10_001):
        mv = b.view(n)
        assert len(mv) == n
        grown += mv.obj is not prev
        prev = mv.obj
    assert grown <= 25  # log_1.5(10000) ~ 23


@pytest.mark.parametrize("exc", [KeyboardInterrupt, OSError])
def test_atomic_small_files_leave_nothing_behind_when_interrupted(tmp_path, monkeypatch, exc):
    """A SIGTERM (raised as KeyboardInterrupt) or an I/O error while a manifest, config or
    checksum file is written: the old file stays as it was and no `.partial` is left."""
    from inkling_quant.io.checkpoint import copy_file_atomic, write_json_atomic
    from inkling_quant.io.output import write_checksums

    target = tmp_path / "m.json"
    target.write_text("old")
    (tmp_path / "src.txt").write_text("new")

    def fail(fd):
        raise exc("interrupted")

    monkeypatch.setattr(os, "fsync", fail)
    for write in (lambda: write_json_atomic(target, {"a": 1}), lambda: copy_file_atomic(tmp_path / "src.txt", target),
                  lambda: write_checksums(target, {"f": "0" * 64})):
        with pytest.raises(exc):
            write()
        assert target.read_text() == "old" and not list(tmp_path.glob("*.partial"))


def test_stacked_tensor_written_in_pieces_and_read_by_slice(tmp_path):
    """A stacked [E, R, C] tensor written expert by expert (write_part) is the same file as one
    write(); get_slice(name, e) reads exactly tensor[e] (and only its bytes)."""
    from safetensors.torch import load_file

    w = torch.randn(5, 6, 8).to(torch.bfloat16)
    s = torch.arange(5 * 6, dtype=torch.uint8).reshape(5, 6, 1)
    specs = [("w", torch.bfloat16, (5, 6, 8)), ("s", torch.uint8, (5, 6, 1))]
    with st.ShardWriter(tmp_path / "whole.safetensors", specs) as wr:
        wr.write("w", w)
        wr.write("s", s)
        whole = wr.commit()
    with st.ShardWriter(tmp_path / "parts.safetensors", specs) as wr:
        for e in range(5):
            wr.write_part("w", w[e])
        wr.write_part("s", s[:2])
        wr.write_part("s", s[2:])
        parts = wr.commit()
    assert parts == whole and (tmp_path / "parts.safetensors").read_bytes() == (tmp_path / "whole.safetensors").read_bytes()
    assert torch.equal(load_file(tmp_path / "parts.safetensors")["w"], w)
    with st.ShardReader(tmp_path / "parts.safetensors") as r:
        buf = st.TensorBuffer()
        for e in range(5):
            assert torch.equal(r.get_slice("w", e, buf), w[e]) and torch.equal(r.get_slice("s", e), s[e])
        with pytest.raises(CheckpointError, match=r"has no slice 5"):
            r.get_slice("w", 5)
        assert torch.equal(r.get_rows("w", 3, buf), w[:3]) and r.get_rows("w", 0).shape == (0, 6, 8)
        assert torch.equal(r.get_rows("w", 5, buf, start=2), w[2:5]) and r.get_rows("w", 4, start=4).shape == (0, 6, 8)
        with pytest.raises(CheckpointError, match=r"has no rows 0:6"):
            r.get_rows("w", 6)
        with pytest.raises(CheckpointError, match=r"has no rows 4:3"):
            r.get_rows("w", 3, start=4)


def test_write_part_refuses_what_was_not_declared(tmp_path):
    specs = [("w", torch.bfloat16, (2, 4))]
    with st.ShardWriter(tmp_path / "a.safetensors", specs) as wr:
        with pytest.raises(CheckpointError, match="piece of 'x'"):
            wr.write_part("x", torch.zeros(4, dtype=torch.bfloat16))
        with pytest.raises(CheckpointError, match="bytes left"):
            wr.write_part("w", torch.zeros(3, 4, dtype=torch.bfloat16))  # more than declared
        wr.write_part("w", torch.zeros(4, dtype=torch.bfloat16))
        with pytest.raises(CheckpointError, match="got 'w'"):
            wr.write("w", torch.zeros(2, 4, dtype=torch.bfloat16))  # half written: no whole write
    with pytest.raises(CheckpointError, match="closed before tensor 'w'"):
        with st.ShardWriter(tmp_path / "b.safetensors", specs) as wr:
            wr.write_part("w", torch.zeros(4, dtype=torch.bfloat16))
            wr.commit()  # pieces stopped short: refused, and the temporary removed
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("b.")] == []
