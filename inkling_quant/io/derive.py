"""Deriving a checkpoint from another (`draft strip`, `lora merge`): shards that change are
rewritten tensor by tensor (`rewrite_shard`), the others hardlinked or copied
(`output.link_or_copy`), small files copied (`copy_other_files`), and the source's
`checksums.sha256` carried over to what OUT holds (`source_checksums`, `carry_checksums`)."""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Callable, Iterable

import torch

from ..errors import CheckpointError
from .checkpoint import Checkpoint, copy_file_atomic, safe_child
from .output import CHECKSUMS, read_checksums, write_checksums
from .safetensors import ShardReader, ShardWriter, TensorBuffer, TensorEntry, sha256_file

SliceTransform = Callable[[int, torch.Tensor], torch.Tensor]  # (index along dim 0, slice) -> new slice


def source_checksums(root: Path) -> dict[str, str] | None:
    """The source's checksums.sha256 ({file: sha256}), None when it has none."""
    return read_checksums(safe_child(root, CHECKSUMS)) if (root / CHECKSUMS).exists() else None


def _as_tensor(mv: memoryview, e: TensorEntry) -> torch.Tensor:
    if e.nbytes == 0:
        return torch.empty(e.shape, dtype=e.dtype)
    return torch.frombuffer(mv, dtype=e.dtype).reshape(e.shape)


def rewrite_shard(reader: ShardReader, dst: Path, *, drop: Callable[[str], bool] | None = None,
                  transform: Callable[[TensorEntry, torch.Tensor], torch.Tensor] | None = None,
                  sliced: Callable[[TensorEntry], SliceTransform | None] | None = None,
                  expected: str | None = None, buf: TensorBuffer | None = None, bar=None) -> str:
    """dst = the shard `reader` reads, streamed one tensor at a time in file order, its header
    metadata kept: tensors whose name `drop` selects are left out, `transform(entry, tensor)`
    gives each kept tensor's value (same dtype and shape; default: the bytes as they are). Where
    `sliced(entry)` gives a function f, the tensor is instead read and written one slice along
    its first dimension at a time, f(index, slice) giving each slice's value: memory one expert
    of a stacked [E, ...] tensor, not the stack. With
    `expected`, the whole source file is hashed on the way (dropped tensors included) and checked
    against it. `buf` is reused for every tensor; `bar` counts the bytes written. Returns dst's
    sha256."""
    header = reader.header
    buf = buf if buf is not None else TensorBuffer()
    h = hashlib.sha256() if expected is not None else None
    if h is not None:
        with open(header.path, "rb") as f:
            h.update(f.read(header.data_start))
    keep = [e for e in header.tensors.values() if drop is None or not drop(e.name)]
    with ShardWriter(dst, [(e.name, e.dtype, e.shape) for e in keep], header.metadata or None, direct=True) as w:
        for e in header.tensors.values():
            dropped = drop is not None and drop(e.name)
            if dropped and h is None:
                continue
            per_slice = sliced(e) if sliced is not None and not dropped else None
            if per_slice is not None and e.shape and e.nbytes:
                _rewrite_sliced(reader, w, e, per_slice, buf, h)
                if bar is not None:
                    bar.update(e.nbytes)
                continue
            mv = reader.read_bytes(e, buf.view(e.nbytes)) if e.nbytes else memoryview(b"")
            if h is not None:
                h.update(mv)
            if dropped:
                continue
            t = _as_tensor(mv, e)
            w.write(e.name, t if transform is None else transform(e, t))
            if bar is not None:
                bar.update(e.nbytes)
        if h is not None and h.hexdigest() != expected:
            raise CheckpointError(f"sha256 {h.hexdigest()} does not match {CHECKSUMS} "
                                  f"({expected}): the shard is corrupt", path=header.path)
        return w.commit()


def _rewrite_sliced(reader: ShardReader, w: ShardWriter, e: TensorEntry, f: SliceTransform, buf: TensorBuffer,
                    h) -> None:
    """Tensor `e` through `f`, one first-dimension slice at a time (hashed on the way when `h`)."""
    step = e.nbytes // e.shape[0]
    for i in range(e.shape[0]):
        mv = reader.read_bytes(e, buf.view(step), start=i * step, nbytes=step)
        if h is not None:
            h.update(mv)
        piece = f(i, torch.frombuffer(mv, dtype=e.dtype).reshape(e.shape[1:]))
        if piece.dtype != e.dtype or tuple(piece.shape) != tuple(e.shape[1:]):
            raise CheckpointError(f"slice {i} of {e.name!r} came back {piece.dtype} {list(piece.shape)}",
                                  path=reader.path, tensor=e.name)
        w.write_part(e.name, piece)


def copy_other_files(ckpt: Checkpoint, dst: Path, also: Iterable[str] = ()) -> None:
    """Copy the source's non-weight files (`Checkpoint.other_files`) and those of `also` it has
    into dst, unchanged."""
    root = ckpt.root
    for p in ckpt.other_files() + [safe_child(root, n) for n in also if (root / n).exists()]:
        copy_file_atomic(p, dst / p.name)  # a non-regular file is refused (open_regular), not dropped


def carry_checksums(sums_in: dict[str, str], out_dir: Path, digests: dict[str, str],
                    also: Iterable[str] = ()) -> None:
    """Write out_dir's checksums.sha256 from the source's (`sums_in`): every file the source
    lists that out_dir has (plain names only), with its digest from `digests` where the writer
    knows it (a rewritten shard: the writer's; a linked one: the source's, same inode), else
    re-hashed (config.json, copied small files); plus the files of `also`, listed or not (shards
    the source's list cannot name: `draft strip` renumbers them)."""
    sums = {}
    for f in sums_in:
        plain = "/" not in f and "\\" not in f and f not in (".", "..", CHECKSUMS)
        if plain and (out_dir / f).is_file():
            sums[f] = digests.get(f) or sha256_file(out_dir / f)
    for f in also:
        sums[f] = digests[f]
    write_checksums(out_dir / CHECKSUMS, sums)
