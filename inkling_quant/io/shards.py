"""Shards of a checkpoint being written or read in order: the shard packers (consecutive
tensors, in order, into shards of at most N bytes; tensors into the files a layout names them,
`plan_files`) and the shard-reader cache. Used by `convert`, `synth`, `draft` and `lora`."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence, TypeVar

from .checkpoint import safe_child, shard_name
from .safetensors import Header, ShardReader

T = TypeVar("T")


def _nbytes(item) -> int:
    return item.nbytes


def plan_shards(items: Sequence[T], max_bytes: int, size: Callable[[T], int] = _nbytes) -> list[list[T]]:
    """`items` in order, cut into consecutive shards of at most `max_bytes` (by `size(item)`,
    default `item.nbytes`). An item larger than `max_bytes` is a shard of its own; never an
    empty shard, except the one shard of no items."""
    shards: list[list[T]] = [[]]
    total = 0
    for item in items:
        n = size(item)
        if shards[-1] and total + n > max_bytes:
            shards.append([])
            total = 0
        shards[-1].append(item)
        total += n
    return shards


def plan_files(items: Sequence[T], file_of: Callable[[T], str | int], max_bytes: int | None = None,
               size: Callable[[T], int] = _nbytes) -> list[tuple[str, list[T]]]:
    """`items` into the files a layout gives them (docs/layout.md "Files"): `file_of(item)` is a
    file name (a file of its own, never split: `mtp.safetensors`) or a group number (one
    numbered shard per group, `model-0000k-of-0000N.safetensors`, in group order; a group over
    `max_bytes`, when given, cut further as `plan_shards` cuts, N counting the pieces). Items keep
    their order within a file. Returns (file name, items): the numbered shards, then the named
    files in order of first appearance."""
    groups: dict[int, list[T]] = {}
    named: dict[str, list[T]] = {}
    for item in items:
        f = file_of(item)
        (named if isinstance(f, str) else groups).setdefault(f, []).append(item)
    pieces = [p for g in sorted(groups) for p in (plan_shards(groups[g], max_bytes, size) if max_bytes
                                                  else [groups[g]])]
    return [(shard_name(i, len(pieces)), p) for i, p in enumerate(pieces)] + list(named.items())


class ShardReaders:
    """Readers for the shards of the checkpoint at `root`, opened on demand. By default one at a
    time: asking for another shard closes the previous one (draft, lora and synth read shards in
    order). `keep_open=True` keeps every reader open until `close()` (a conversion job's units
    may alternate between shards). `fetch(shard) -> Path` locates a shard elsewhere (a hub
    download); `headers`, when given, saves re-reading them. A context manager."""

    def __init__(self, root: Path, headers: dict[str, Header] | None = None, *,
                 fetch: Callable[[str], Path] | None = None, keep_open: bool = False):
        self.root, self.headers, self.fetch, self.keep_open = Path(root), headers or {}, fetch, keep_open
        self.readers: dict[str, ShardReader] = {}

    def get(self, shard: str) -> ShardReader:
        r = self.readers.get(shard)
        if r is None:
            if not self.keep_open:
                self.close()
            path = self.fetch(shard) if self.fetch is not None else safe_child(self.root, shard, "shard")
            r = self.readers[shard] = ShardReader(path, self.headers.get(shard))
        return r

    def close(self) -> None:
        readers, self.readers = self.readers, {}
        for r in readers.values():
            r.close()

    def __enter__(self) -> "ShardReaders":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
