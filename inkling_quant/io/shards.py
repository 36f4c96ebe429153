"""Shards of a checkpoint being written or read in order: the shard packer (consecutive
tensors, in order, into shards of at most N bytes) and the shard-reader cache. Used by
`convert`, `synth`, `draft` and `lora`."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence, TypeVar

from .checkpoint import safe_child
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
