"""vLLM v1's KV-cache allocation for an Inkling 2 Small deployment, per GPU: the attention
spec of every layer (full and sliding-window), how the hybrid allocator groups them into pages,
and what one request of a given length holds. `budget.plan` asks it; docs/budget.md derives it
from vllm/v1/kv_cache_interface.py and vllm/v1/core/kv_cache_utils.py. Light: no torch."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from .errors import UsageError

if TYPE_CHECKING:
    from .budget import Parallel
    from .layout import ModelConfig

DEFAULT_BLOCK_SIZE = 16
DEFAULT_BATCHED_TOKENS = 8192


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVSpec:
    """One attention layer's KV cache on one GPU, as vllm/v1/kv_cache_interface.py states it."""

    kind: str                # "full" or "sliding"
    num_kv_heads: int        # per rank
    head_size: int
    dtype_bytes: int = 2     # BF16
    block_size: int = DEFAULT_BLOCK_SIZE
    sliding_window: int | None = None

    @property
    def page_size_bytes(self) -> int:
        # AttentionSpec.real_page_size_bytes: 2 (K and V) * block_size * num_kv_heads * head_size * dtype
        return 2 * self.block_size * self.num_kv_heads * self.head_size * self.dtype_bytes

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        if self.kind == "full":
            # FullAttentionSpec: cdiv(max_model_len, block_size) * page_size_bytes
            return cdiv(max_model_len, self.block_size) * self.page_size_bytes
        # SlidingWindowSpec: the last sliding_window - 1 tokens plus one scheduled chunk, capped by
        # max_model_len, +1 block because the window may not start at a block boundary
        num_tokens = min(self.sliding_window - 1 + max_num_batched_tokens, max_model_len)
        return (cdiv(num_tokens, self.block_size) + 1) * self.page_size_bytes

    def with_block_size(self, block_size: int) -> "KVSpec":
        return replace(self, block_size=block_size)


@dataclass(frozen=True)
class KVGroup:
    spec: KVSpec
    num_layers: int


@dataclass(frozen=True)
class KVLayout:
    """How vLLM's KV cache manager pools the layers of one GPU (vllm/v1/core/kv_cache_utils.py:
    get_kv_cache_groups, _max_memory_usage_bytes_from_groups, get_max_concurrency_for_kv_cache_config).

    Memory is handed out in units of `unit_bytes` (one block of every layer of a group slot);
    a request of length L needs `blocks(L)` units."""

    mode: str                     # "uniform", "uniform_type" or "hybrid"
    groups: tuple[KVGroup, ...]
    unit_bytes: int
    layer_specs: tuple[KVSpec, ...]
    max_num_batched_tokens: int

    def blocks(self, max_model_len: int) -> int:
        mnbt = self.max_num_batched_tokens
        if self.mode == "uniform_type":
            # one group of UniformTypeKVCacheSpecs: the per-layer sum, in units of all pages
            total = sum(s.max_memory_usage_bytes(max_model_len, mnbt) for s in self.layer_specs)
            return cdiv(total, self.unit_bytes)
        page = self.groups[0].spec.page_size_bytes
        return sum(cdiv(g.spec.max_memory_usage_bytes(max_model_len, mnbt), page) for g in self.groups)

    def bytes_needed(self, max_model_len: int) -> int:
        """KV bytes per GPU to serve one request of max_model_len (what vLLM checks at start-up)."""
        if self.mode == "uniform_type":
            return sum(s.max_memory_usage_bytes(max_model_len, self.max_num_batched_tokens)
                       for s in self.layer_specs)
        return self.unit_bytes * self.blocks(max_model_len)

    def max_model_len(self, available: int, upper: int) -> int:
        """Largest length <= upper whose single request fits (vLLM's estimate_max_model_len)."""
        if available <= 0 or self.bytes_needed(1) > available:
            return 0
        lo, hi = 1, upper
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.bytes_needed(mid) <= available:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def max_concurrency(self, available: int, max_model_len: int) -> float:
        """vLLM's "Maximum concurrency for N tokens per request: X.XXx"."""
        if available <= 0:
            return 0.0
        return (available // self.unit_bytes) / self.blocks(max_model_len)


def kv_layer_specs(cfg: ModelConfig, par: Parallel, block_size: int = DEFAULT_BLOCK_SIZE) -> list[KVSpec]:
    specs = []
    for i in range(cfg.num_hidden_layers):
        _, nkv, hd = cfg.attention_dims(i)
        if cfg.is_full_attention(i):
            specs.append(KVSpec("full", par.kv_per_rank(nkv), hd, block_size=block_size))
        else:
            specs.append(KVSpec("sliding", par.kv_per_rank(nkv), hd, block_size=block_size,
                                sliding_window=cfg.sliding_window))
    return specs


def kv_layout(specs: list[KVSpec], max_num_batched_tokens: int = DEFAULT_BATCHED_TOKENS) -> KVLayout:
    """Group layers the way vLLM's hybrid KV cache manager does (get_kv_cache_groups)."""
    if not specs:
        raise UsageError("the model has no attention layers: nothing to plan a KV cache for")
    if len(set(specs)) == 1:  # is_kv_cache_spec_uniform
        return KVLayout("uniform", (KVGroup(specs[0], len(specs)),), specs[0].page_size_bytes * len(specs),
                        tuple(specs), max_num_batched_tokens)
    kinds = {(s.kind, s.sliding_window) for s in specs}
    if len(kinds) == 1:  # UniformTypeKVCacheSpecs: same token slots, different hidden sizes
        return KVLayout("uniform_type", (), sum(s.page_size_bytes for s in specs), tuple(specs),
                        max_num_batched_tokens)
    # unify_kv_cache_spec_page_size: grow the block size of layers with smaller pages
    page = max(s.page_size_bytes for s in specs)
    unified = []
    for s in specs:
        if page % s.page_size_bytes:
            raise UsageError(f"KV page sizes {sorted({x.page_size_bytes for x in specs})} cannot be unified "
                             f"by vLLM (the largest is not a multiple of each): hybrid KV cache unsupported")
        unified.append(s.with_block_size(s.block_size * (page // s.page_size_bytes)))
    same: dict[KVSpec, int] = {}
    for s in unified:
        same[s] = same.get(s, 0) + 1
    # _get_kv_cache_groups_uniform_page_size: groups of equal size (padding the last one)
    group_size = min(same.values())
    if max(same.values()) < group_size * 1.5:
        group_size = max(same.values())
    groups = []
    for s, n in same.items():
        groups += [KVGroup(s, group_size)] * cdiv(n, group_size)
    return KVLayout("hybrid", tuple(groups), page * group_size, tuple(unified), max_num_batched_tokens)
