"""Shards of a checkpoint being written or read in order: the shard packer (consecutive
tensors, in order, into shards of at most N bytes) and the shard-reader cache (one open
`ShardReader` at a time). Used by `synth`, `draft` and `lora`."""
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
    """Readers for the shards of the checkpoint at `root`, opened on demand, one at a time:
    asking for another shard closes the previous one (the commands read shards in order). A
    context manager; `close()` closes the open one."""

    def __init__(self, root: Path, headers: dict[str, Header]):
        self.root, self.headers = Path(root), headers
        self.name: str | None = None
        self.reader: ShardReader | None = None

    def get(self, shard: str) -> ShardReader:
        if shard != self.name:
            self.close()
            self.reader = ShardReader(safe_child(self.root, shard, "shard"), self.headers[shard])
            self.name = shard
        return self.reader

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
        self.name, self.reader = None, None

    def __enter__(self) -> "ShardReaders":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
