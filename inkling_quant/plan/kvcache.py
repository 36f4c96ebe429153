"""vLLM 0.33's KV-cache and state allocation for an Inkling 2 deployment, per GPU.

vLLM 0.33.0 has no Inkling 2 model. Its `vllm/models/inkling/` serves the previous generation;
we apply the specs that code emits to Inkling 2's shapes (`inkling2.TextConfig`), on the
assumption that an Inkling 2 port keeps them (Inkling 2 has the same full/sliding layer kinds and
the same four short-conv streams per layer):

* a "hybrid" (full-attention) layer: `FullAttentionSpec(block_size, num_kv_heads=max(1, KV // TP),
  head_size=head_dim)` (models/inkling/nvidia/attention.py:183-199);
* a "hybrid_sliding" layer: the same page, `SlidingWindowSpec(sliding_window=sliding_window_size)`;
* every decoder layer also owns one short-conv state (`InklingConvState`,
  models/inkling/nvidia/sconv_swa_attn.py:121-193): `SlidingWindowSpec(block_size=K,
  sliding_window=K, num_kv_heads=KV // TP, head_size=next_pow2(2 * head_dim + 2 * H // KV),
  head_size_v=0)` holding K, V, attention-output and MLP-output streams packed per head; it
  asserts TP <= KV heads and BF16.

A standard Hugging Face MoE config (its `AttentionDims`, which `plan.hf.HFText` has) gets the
specs vLLM 0.33's generic attention layers emit (`hf_layer_specs`): `FullAttentionSpec` in every
layer, `SlidingWindowSpec` in every layer where the config's one window applies to all of them,
or DeepSeek's `MLAAttentionSpec` (one latent "head" of kv_lora_rank + qk_rope_head_dim, not split
by TP).

Pages are unified and layers grouped as vllm/v1/core/kv_cache_planning.py does (docs/budget.md
cites the lines); DeepSeek-V4's caches (`plan.deepseek_v4.kv_specs`) are packed block-outermost
instead (`packed_layout`). `plan.inkling2.plan` asks it. Light: no torch.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

from ..errors import UsageError
from ..units import cdiv

if TYPE_CHECKING:
    from ..model.inkling2 import TextConfig

DEFAULT_BLOCK_SIZE = 16   # CacheConfig.block_size on CUDA
DTYPE_BYTES = 2           # BF16: --kv-cache-dtype auto = the model dtype; the conv state asserts bf16
FULL, SLIDING, CONV, MLA = "full", "sliding", "conv", "mla"
# DeepSeek-V4's (plan.deepseek_v4): the CSA and HCA layers' compressed KV and the indexer's keys
# are full-history MLA specs, the compressors' running states sliding-window ones
CSA, HCA, INDEXER = "csa", "hca", "indexer"
CSA_STATE, HCA_STATE, INDEXER_STATE = "csa state", "hca state", "indexer state"
KDA = "kda state"  # Kimi-K3's KDA layers' recurrent state (plan.kimi_k3): a MambaSpec
KINDS = (FULL, MLA, CSA, HCA, INDEXER, SLIDING, CSA_STATE, INDEXER_STATE, HCA_STATE, KDA, CONV)
FULL_HISTORY = (FULL, MLA, CSA, HCA, INDEXER)  # FullAttentionSpec's admission rule; the rest a window's


class LatentDims(Protocol):
    """What the MLA cache spec reads of DeepSeek's latent attention (`plan.hf.MLADims` has it)."""

    @property
    def kv_lora_rank(self) -> int: ...
    @property
    def qk_rope_head_dim(self) -> int: ...


class AttentionDims(Protocol):
    """What `hf_layer_specs` reads of a standard HF config's text model (`plan.hf.HFText` has
    it): a Protocol, so that this module does not import the plan that imports it."""

    @property
    def num_hidden_layers(self) -> int: ...
    @property
    def num_key_value_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def sliding_window(self) -> int | None: ...
    @property
    def mla(self) -> LatentDims | None: ...
    @property
    def dtype_bytes(self) -> int: ...


def conv_head_size(head_dim: int, hidden_size: int, num_kv_heads: int) -> int:
    """InklingConvState's packed per-head width, padded to a power of two
    (sconv_swa_attn.py:152-157): K + V + the attention- and MLP-output chunks of one head."""
    raw = 2 * head_dim + 2 * (hidden_size // num_kv_heads)
    return 1 << (raw - 1).bit_length()


@dataclass(frozen=True)
class KVSpec:
    """One layer's cache on one GPU, as vllm/v1/kv_cache_interface.py states it."""

    kind: str                       # FULL, MLA (a full-attention spec), SLIDING or CONV
    num_kv_heads: int               # per rank
    head_size: int
    head_size_v: int
    block_size: int
    sliding_window: int | None = None
    page_size_padded: int | None = None
    dtype_bytes: int = DTYPE_BYTES
    tokens_per_state: int = 1      # a compressed cache's tokens per stored state (DeepSeek-V4's 4, 128)
    state_bytes: int = 0           # one state's bytes where a layout fixes them (fp8_ds_mla's 584); 0: heads x dtype
    state_blocks: int = 0          # a recurrent state's blocks per request, whatever its length (KDA)

    @property
    def state_size_bytes(self) -> int:
        """One stored state (a token's, or a compressed cache's tokens_per_state tokens') on this
        GPU: (head_size + head_size_v) * dtype per head unless the spec sets it (kv_cache_interface.py:586-590)."""
        return self.num_kv_heads * (self.state_bytes or (self.head_size + self.head_size_v) * self.dtype_bytes)

    @property
    def real_page_size_bytes(self) -> int:
        # AttentionSpec: num_states (block_size / tokens_per_state) * a state (kv_cache_interface.py:593-601)
        return self.block_size // self.tokens_per_state * self.state_size_bytes

    @property
    def page_size_bytes(self) -> int:
        return self.page_size_padded or self.real_page_size_bytes

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token (one stored state for CONV) takes in this layer on this GPU."""
        return self.real_page_size_bytes // self.block_size

    def max_memory_usage_bytes(self, max_model_len: int, max_in_flight_tokens: int) -> int:
        """One request's admission cap (kv_cache_interface.py:643-648 full, 917-955 sliding)."""
        if self.kind == KDA:  # MambaSpec: blocks per request fixed by its cache mode (kv_cache_interface.py:1135-1141)
            return self.state_blocks * self.page_size_bytes
        if self.kind in FULL_HISTORY:  # MLAAttentionSpec is a FullAttentionSpec (kv_cache_interface.py:729)
            return cdiv(max_model_len, self.block_size) * self.page_size_bytes
        # the last sliding_window - 1 tokens plus every scheduled-but-unsettled token, capped by
        # max_model_len, +1 block because the window need not start at a block boundary
        tokens = min(self.sliding_window - 1 + max_in_flight_tokens, max_model_len)
        return (cdiv(tokens, self.block_size) + 1) * self.page_size_bytes


def layer_specs(text: TextConfig, tp: int, block_size: int = DEFAULT_BLOCK_SIZE) -> list[KVSpec]:
    """Every cache spec of the model on one GPU: per decoder layer its attention spec, then its
    short-conv state spec."""
    specs = []
    for i in range(text.num_hidden_layers):
        _, nkv, hd = text.attention_dims(i)
        if tp > nkv:
            raise UsageError(f"--tp {tp} exceeds the {nkv} KV heads of layer {i}: vLLM's Inkling short-conv "
                             f"state asserts tp_size <= num_kv_heads (sconv_swa_attn.py:142-145)")
        kv_r = max(1, nkv // tp)
        if text.is_full(i):
            specs.append(KVSpec(FULL, kv_r, hd, hd, block_size))
        else:
            specs.append(KVSpec(SLIDING, kv_r, hd, hd, block_size, sliding_window=text.sliding_window_size))
        k = text.conv_kernel_size
        specs.append(KVSpec(CONV, nkv // tp, conv_head_size(hd, text.hidden_size, nkv), 0, k, sliding_window=k))
    return specs


def hf_layer_specs(text: AttentionDims, tp: int, block_size: int = DEFAULT_BLOCK_SIZE) -> list[KVSpec]:
    """Every layer's cache spec on one GPU for a standard HF config, as vLLM 0.33's `Attention`
    and `MLAAttention` emit them (model_executor/layers/attention/attention.py:624-682,
    mla_attention.py:1371-1399). KV heads per rank `max(1, KV // TP)`: fewer KV heads than TP
    ranks are replicated (qwen3_moe.py:266-275)."""
    dtype = text.dtype_bytes  # --kv-cache-dtype auto: the model's dtype
    if text.mla is not None:  # num_kv_heads=1, max_tp_shards=1: every rank holds the whole latent
        head = text.mla.kv_lora_rank + text.mla.qk_rope_head_dim  # mla_attention.py:480
        return [KVSpec(MLA, 1, head, 0, block_size, dtype_bytes=dtype)] * text.num_hidden_layers
    kv_r, hd = max(1, text.num_key_value_heads // tp), text.head_dim
    if text.sliding_window is not None:
        spec = KVSpec(SLIDING, kv_r, hd, hd, block_size, sliding_window=text.sliding_window, dtype_bytes=dtype)
    else:
        spec = KVSpec(FULL, kv_r, hd, hd, block_size, dtype_bytes=dtype)
    return [spec] * text.num_hidden_layers


@dataclass(frozen=True)
class KVGroup:
    spec: KVSpec      # after page unification (a packed group: its first layer's)
    num_layers: int
    layers: tuple[KVSpec, ...] = ()  # a packed group's layers, pages of several sizes side by side

    @property
    def page_bytes(self) -> int:
        """One block of the group: a page of each of its layers."""
        return sum(s.page_size_bytes for s in self.layers) if self.layers else self.spec.page_size_bytes * self.num_layers


@dataclass(frozen=True)
class KVLayout:
    """How vLLM's KV cache manager pools one GPU's layers (kv_cache_planning.py:1113-1200
    get_kv_cache_groups; 1253-1285 _max_memory_usage_bytes_from_groups). Memory is handed out in
    blocks of `bytes_per_block` (one page of every layer of the widest group); a request of
    length L takes `blocks(L)` of them, summed over groups."""

    mode: str                     # "uniform", "uniform_type", "hybrid" or "packed"
    groups: tuple[KVGroup, ...]
    bytes_per_block: int
    specs: tuple[KVSpec, ...]     # per layer, unified
    max_in_flight_tokens: int

    def group_blocks(self, g: KVGroup, max_model_len: int) -> int:
        return cdiv(g.spec.max_memory_usage_bytes(max_model_len, self.max_in_flight_tokens), g.spec.page_size_bytes)

    def blocks(self, max_model_len: int) -> int:
        if self.mode == "uniform_type":  # UniformTypeKVCacheSpecs: the per-layer sum, in whole blocks
            return cdiv(self.per_layer_sum(max_model_len), self.bytes_per_block)
        return sum(self.group_blocks(g, max_model_len) for g in self.groups)

    def per_layer_sum(self, max_model_len: int) -> int:
        return sum(s.max_memory_usage_bytes(max_model_len, self.max_in_flight_tokens) for s in self.specs)

    def bytes_needed(self, max_model_len: int) -> int:
        """KV bytes per GPU to admit one request of max_model_len (what vLLM checks at start-up)."""
        return self.bytes_per_block * self.blocks(max_model_len)

    def bytes_by_kind(self, max_model_len: int) -> dict[str, int]:
        out = dict.fromkeys(sorted({s.kind for s in self.specs}), 0)
        if self.mode == "uniform_type":
            for s in self.specs:
                out[s.kind] += s.max_memory_usage_bytes(max_model_len, self.max_in_flight_tokens)
            return out
        for g in self.groups:
            blocks = self.bytes_per_block * self.group_blocks(g, max_model_len)
            if not g.layers:
                out[g.spec.kind] += blocks
            for s in g.layers:  # a packed group's blocks shared out by its layers' page bytes
                out[s.kind] += blocks * s.page_size_bytes // g.page_bytes
        return out

    def usable(self, available: int) -> int:
        """What the admission check compares against: one block is the null block the pool
        keeps back (kv_cache_planning.py:1533-1543)."""
        return available - self.bytes_per_block

    def max_model_len(self, available: int, upper: int) -> int:
        """Largest length <= upper whose single request fits (_estimate_max_model_len_from_groups)."""
        usable = self.usable(available)
        if usable <= 0 or self.bytes_needed(1) > usable:
            return 0
        lo, hi = 1, upper
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.bytes_needed(mid) <= usable:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def max_concurrency(self, available: int, max_model_len: int) -> float:
        """vLLM's "Maximum concurrency for N tokens per request: X.XXx"
        (kv_cache_utils.py:1061-1092): num_blocks / blocks per request."""
        if available <= 0:
            return 0.0
        return (available // self.bytes_per_block) / self.blocks(max_model_len)


def unify_page_size(specs: list[KVSpec]) -> list[KVSpec]:
    """unify_kv_cache_spec_page_size (kv_cache_planning.py:346-408): grow the block size of the
    layers with smaller pages until every page equals the largest; pad a page that does not
    divide it."""
    page = max(s.page_size_bytes for s in specs)
    out = []
    for s in specs:
        if s.page_size_bytes == page:
            out.append(s)
        elif page % s.page_size_bytes == 0:
            out.append(replace(s, block_size=s.block_size * (page // s.page_size_bytes)))
        else:
            out.append(replace(s, page_size_padded=page))
    return out


def kv_layout(specs: list[KVSpec], max_in_flight_tokens: int) -> KVLayout:
    """Group layers the way vLLM's hybrid KV cache manager does. The packed (block-outermost)
    grouping does not apply: neither FlashAttention nor Inkling's conv backend declares layouts,
    so the default LBNHC (not block-outermost) is chosen (v1/attention/backends/utils.py:229-235,
    332-340; kv_cache_planning.py:931)."""
    if not specs:
        raise UsageError("the model has no attention layers: nothing to plan a KV cache for")
    if len(set(specs)) == 1:  # is_kv_cache_spec_uniform: one group of every layer
        return KVLayout("uniform", (KVGroup(specs[0], len(specs)),), specs[0].page_size_bytes * len(specs),
                        tuple(specs), max_in_flight_tokens)
    if len({(s.kind, s.sliding_window) for s in specs}) == 1:  # UniformTypeKVCacheSpecs
        return KVLayout("uniform_type", (), sum(s.page_size_bytes for s in specs), tuple(specs),
                        max_in_flight_tokens)
    unified = unify_page_size(specs)
    same: dict[KVSpec, int] = {}
    for s in unified:
        same[s] = same.get(s, 0) + 1
    # _get_kv_cache_groups_uniform_page_size (kv_cache_planning.py:416-556): groups of the smallest
    # type's layer count (the largest if that is under 1.5x the smallest), the last one short
    group_size = min(same.values())
    if max(same.values()) < group_size * 1.5:
        group_size = max(same.values())
    groups: list[KVGroup] = []
    for s, n in same.items():
        num_groups = cdiv(n, group_size)  # layers[i::num_groups] for group i
        groups += [KVGroup(s, len(range(i, n, num_groups))) for i in range(num_groups)]
    # _get_kv_cache_bytes_per_block (kv_cache_planning.py:574-583): the widest group's pages
    page = unified[0].page_size_bytes
    return KVLayout("hybrid", tuple(groups), page * max(g.num_layers for g in groups), tuple(unified),
                    max_in_flight_tokens)


def _approximate_gcd(values: list[int], lower_bound: int) -> int:
    """The chunk d >= lower_bound that pads `values` up to multiples of d least, ties to the larger
    (kv_cache_planning.py:876-911)."""
    if lower_bound > max(values):
        return lower_bound
    pads = {d: sum(-x % d for x in values) for d in range(max(1, lower_bound), max(values) + 1)}
    return min(pads, key=lambda d: (pads[d], -d))


def packed_layout(specs: list[KVSpec], max_in_flight_tokens: int) -> KVLayout:
    """vLLM 0.33's grouping for a block-outermost layout (kv_cache_planning.py:914-1041
    `_get_packed_kv_cache_groups`; DeepSeek-V4's indexer backend allows no other, indexer.py:348-352):
    no page unification; layers bucketed by block size and kind of window; a bucket with as many
    layers of each page size (one pattern of them per repeat) split into groups of the same number
    of repeats, `_approximate_gcd` of the balanced buckets' counts at least the largest mixed one's;
    any other bucket one group; where no bucket mixes page sizes (no CSA layer), each sliding-window
    bucket is split into groups of as many layers as the widest bucket's page bytes hold (l.992-1024).
    A block holds one page of each layer of a group, side by side: its bytes are the largest
    group's (`_get_kv_cache_bytes_per_block`, l.574-605)."""
    if len({s.page_size_bytes for s in specs}) <= 1:  # nothing to pack (l.930-932): the usual grouping
        return kv_layout(specs, max_in_flight_tokens)
    buckets: dict[tuple, dict[int, list[KVSpec]]] = {}
    for s in specs:  # UniformTypeKVCacheSpecs.is_uniform_type: one block size, one kind of window
        by_page = buckets.setdefault((s.block_size, s.kind in FULL_HISTORY, s.sliding_window), {})
        by_page.setdefault(s.page_size_bytes, []).append(s)
    info = [(b, len({len(v) for v in b.values()}) == 1, max(len(v) for v in b.values())) for b in buckets.values()]
    floor = max((n for b, balanced, n in info if balanced and len(b) > 1), default=0)
    repeats = _approximate_gcd([n for _, balanced, n in info if balanced], floor) if floor else None

    def state(b) -> bool:  # a bucket split down to one layer a group where no pattern repeats
        return repeats is None and next(iter(b.values()))[0].kind not in FULL_HISTORY

    def count_of(b, balanced, n) -> int:
        return cdiv(n, repeats) if balanced and repeats is not None else 1
    anchor = max(sum(cdiv(len(v), sum(map(len, b.values())) if state(b) else count_of(b, bal, n)) * page
                     for page, v in b.items()) for b, bal, n in info)
    groups = []
    for b, balanced, n in info:
        count = count_of(b, balanced, n)
        if state(b):
            count = max(count, cdiv(sum(map(len, b.values())), max(anchor // next(iter(b)), 1)))
        pattern = list(zip(*b.values())) if balanced else [tuple(s for v in b.values() for s in v)]
        for i in range(count):
            layers = tuple(s for rep in pattern[i::count] for s in rep)
            groups.append(KVGroup(layers[0], len(layers), layers))
    return KVLayout("packed", tuple(groups), max(g.page_bytes for g in groups), tuple(specs), max_in_flight_tokens)
