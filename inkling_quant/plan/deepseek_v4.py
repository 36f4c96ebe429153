"""DeepSeek-V4 in `plan`: its tensors under the release's names and how vLLM 0.33 places them at
TP / EP, and the KV caches vLLM 0.33 allocates for it (`vllm/models/deepseek_v4/`, read; its spec
and grouping code was also run on CPU once, docs/budget.md "DeepSeek-V4").

Attention per layer (transformers 5.25 models/deepseek_v4, conversion_mapping.py "deepseek_v4" for
the names): a sliding window of `sliding_window` tokens in every layer, one shared K=V head of
head_dim; a CSA layer (compress rate 4) adds a compressed KV (one state per 4 tokens), a Lightning
Indexer with its own compressed keys (index_head_dim) and both compressors' running states; an
HCA layer (rate 128) a compressed KV and its compressor's state. vLLM 0.33 (FlashMLA, SM90/SM100)
stores the KV as `fp8_ds_mla`, 584 bytes a token or state (attention.py:880-882: 448 fp8 NoPE,
128 bf16 RoPE, 8 scale), the indexer keys fp8 with an fp32 scale per 128, the compressor states
fp32; every page padded to 576 bytes; one KV head, so every TP rank holds all of it
(`max_tp_shards=1`). Block sizes: 256 for the full-history caches (the backends' one size,
platforms/interface.py:700-780), 64 for the window, 4 and 8 for the C4 and C128 states
(sparse_swa.py, compressor.py). The MTP block (`mtp.*`) is not loaded without speculative
decoding (nvidia/model.py:1265-1268): neither counted nor cached.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

from ..errors import ConfigError, UsageError
from ..errors import short_repr as _short
from ..model.fields import ConfigFields
from ..units import cdiv
from .kvcache import CSA, CSA_STATE, HCA, HCA_STATE, INDEXER, INDEXER_STATE, SLIDING, KVSpec
from .placement import HEADS, REPLICATED, TP_SPLIT, VOCAB

# configuration_deepseek_v4.py: a layer type and its compress rate (0: sliding window only)
LAYER_TYPES = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
_LEGACY = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
DS_MLA_BYTES, DS_MLA_ALIGN = 584, 576   # fp8_ds_mla: a token's bytes, a page's alignment
BLOCK, SWA_BLOCK = 256, 64
# the Linears the release stores FP8 with a UE8M0 scale per 128x128 tile (vLLM 0.33 builds these
# with the FP8 config; the compressors and the indexer's weights_proj with none: bf16)
FP8_SUFFIXES = (".attn.wq_a.weight", ".attn.wkv.weight", ".attn.wq_b.weight", ".attn.wo_a.weight",
                ".attn.wo_b.weight", ".attn.indexer.wq_b.weight", ".shared_experts.w1.weight",
                ".shared_experts.w3.weight", ".shared_experts.w2.weight")
# held in fp32 (vLLM's parameters and transformers' alike; the release's on-disk dtype of these
# small tensors was not read): hyper-connections, compressors' position bias, sinks, router bias
FP32_SUFFIXES = ("_fn", "_base", "_scale", ".ape", ".attn_sink", ".gate.bias")


@dataclass(frozen=True)
class V4Dims:
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    index_n_heads: int
    index_head_dim: int
    hc_mult: int
    ratios: tuple[int, ...]     # per decoder layer: 0 sliding window only, 4 CSA, 128 HCA
    hash_layers: frozenset[int]  # the layers that route by token (`ffn.gate.tid2eid`, no bias)
    sliding_window: int


def dims(t: ConfigFields, n: int) -> V4Dims:
    """The V4 keys as transformers 5.25's DeepseekV4Config reads them (`__post_init__`): layer_types,
    else the legacy per-layer `compress_ratios` (its entries past num_hidden_layers are the MTP
    block's), else 2 HCA layers then CSA/HCA alternating; compress_rates (legacy compress_rate_csa /
    compress_rate_hca folded in), whose rates this plan takes as vLLM's kernels have them (4, 128);
    mlp_layer_types, else num_hash_layers (3) hash layers first."""
    o = t.obj
    types = o.get("layer_types")
    if types is None and o.get("compress_ratios") is not None:
        ratios = o["compress_ratios"]
        if not isinstance(ratios, list) or len(ratios) < n or any(type(r) is not int or r not in _LEGACY
                                                                   for r in ratios[:n]):
            raise ConfigError(f"{t.where}compress_ratios must list one of 0, 4, 128 per layer, got {_short(ratios)}",
                              path=t.source)
        types = [_LEGACY[r] for r in ratios[:n]]
    if types is None:
        types = ["heavily_compressed_attention"] * min(n, 2) + [
            "compressed_sparse_attention" if i % 2 else "heavily_compressed_attention" for i in range(max(n - 2, 0))]
    if not isinstance(types, list) or len(types) != n or any(not isinstance(x, str) or x not in LAYER_TYPES
                                                              for x in types):
        raise ConfigError(f"{t.where}layer_types must give one of {', '.join(LAYER_TYPES)} per layer, got "
                          f"{_short(types)}", path=t.source)
    if not isinstance(o.get("compress_rates") or {}, dict):
        raise ConfigError(f"{t.where}compress_rates must map a layer type to its rate, got "
                          f"{_short(o['compress_rates'])}", path=t.source)
    rates = {**{k: v for k, v in LAYER_TYPES.items() if v}, **(o.get("compress_rates") or {})}
    rates.update({k: o[key] for k, key in (("compressed_sparse_attention", "compress_rate_csa"),
                                           ("heavily_compressed_attention", "compress_rate_hca")) if key in o})
    if {k: rates[k] for k in ("compressed_sparse_attention", "heavily_compressed_attention")} != \
            {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}:
        raise ConfigError(f"{t.where}compress_rates {_short(rates)}: vLLM 0.33's compressors take 4 (CSA) and 128 "
                          f"(HCA) only (compressor.py CompressorStateCache)", path=t.source)
    mlp = o.get("mlp_layer_types")
    if mlp is None:
        mlp = ["hash_moe"] * t.int("num_hash_layers", 3, lo=0, hi=n) + ["moe"] * n
    if not isinstance(mlp, list) or len(mlp) < n or any(x not in ("hash_moe", "moe") for x in mlp[:n]):
        raise ConfigError(f"{t.where}mlp_layer_types must give 'hash_moe' or 'moe' per layer, got {_short(mlp)}",
                          path=t.source)
    hashed = frozenset(i for i, x in enumerate(mlp[:n]) if x == "hash_moe")
    return V4Dims(t.int("q_lora_rank"), t.int("o_groups", 8), t.int("o_lora_rank", 1024), t.int("index_n_heads", 64),
                  t.int("index_head_dim", 128), t.int("hc_mult", 4), tuple(LAYER_TYPES[x] for x in types), hashed,
                  t.int("sliding_window", 128))


def is_fp8(name: str) -> bool:
    """Whether the release stores the weight `name` FP8 (and a convert of it keeps it so)."""
    return name.endswith(FP8_SUFFIXES)


def fp8_bytes(fmt, shape: tuple[int, ...]) -> int:
    """An FP8 weight as the release stores it (and ModelOpt's DeepSeek-V4 form keeps it): a byte
    per weight and a UE8M0 byte per 128x128 tile (`fp8_block`'s scale grid)."""
    return math.prod(shape) + math.prod(fmt.scale_shape(shape))


def held_dtype(name: str, dtype):
    """The dtype the tensor `name` (not quantized) is held in: the hash table's int64, the small
    fp32 tensors' (FP32_SUFFIXES), else the config's `dtype`."""
    import torch

    if name.endswith("tid2eid"):
        return torch.int64
    return torch.float32 if name.endswith(FP32_SUFFIXES) and not name.endswith(".weight") else dtype


def tensors(t) -> Iterator[tuple[str, str, str, tuple[int, ...]]]:
    """(name, part, split, shape) of every text tensor but the routed experts, under the release's
    names, split as vLLM 0.33 shards them (attention.py, compressor.py, nvidia/model.py): wq_a, wkv,
    the compressors, the indexer, the router and the hyper-connections replicated; wq_b and wo_a by
    output rows, wo_b by input columns, the sinks by heads, shared experts by their width."""
    v, H, hd, nh = t.v4, t.hidden_size, t.head_dim, t.num_attention_heads
    q, mix = v.q_lora_rank, (2 + v.hc_mult) * v.hc_mult
    yield "embed.weight", "embed", VOCAB, (t.vocab_size, H)
    for i, r in enumerate(v.ratios):
        p, a = f"layers.{i}.", f"layers.{i}.attn."
        yield p + "attn_norm.weight", "norm", REPLICATED, (H,)
        yield p + "ffn_norm.weight", "norm", REPLICATED, (H,)
        for s in ("attn", "ffn"):
            yield from ((p + f"hc_{s}_{k}", "other", REPLICATED, shape)
                        for k, shape in (("fn", (mix, v.hc_mult * H)), ("base", (mix,)), ("scale", (3,))))
        yield a + "wq_a.weight", "attention", REPLICATED, (q, H)
        yield a + "q_norm.weight", "norm", REPLICATED, (q,)
        yield a + "wkv.weight", "attention", REPLICATED, (hd, H)
        yield a + "kv_norm.weight", "norm", REPLICATED, (hd,)
        yield a + "wq_b.weight", "attention", TP_SPLIT, (nh * hd, q)
        yield a + "wo_a.weight", "attention", TP_SPLIT, (v.o_groups * v.o_lora_rank, nh * hd // v.o_groups)
        yield a + "wo_b.weight", "attention", TP_SPLIT, (H, v.o_groups * v.o_lora_rank)
        yield a + "attn_sink", "attention", HEADS, (nh,)
        if r:
            yield from _compressor(a + "compressor.", r, hd, H)
        if r == 4:
            ih = v.index_head_dim
            yield a + "indexer.wq_b.weight", "attention", REPLICATED, (v.index_n_heads * ih, q)
            yield a + "indexer.weights_proj.weight", "attention", REPLICATED, (v.index_n_heads, H)
            yield from _compressor(a + "indexer.compressor.", r, ih, H)
        f = p + "ffn."
        yield f + "gate.weight", "router", REPLICATED, (t.n_routed_experts, H)
        if i in v.hash_layers:  # token -> experts (int64): the hash-routed layers have no bias
            yield f + "gate.tid2eid", "router", REPLICATED, (t.vocab_size, t.num_experts_per_tok)
        else:                  # the e_score_correction_bias (a buffer in transformers)
            yield f + "gate.bias", "router", REPLICATED, (t.n_routed_experts,)
        if t.shared_width:     # vLLM pads the width to 128 x TP per rank: no divisibility asked
            for w, shape in (("w1", (t.shared_width, H)), ("w3", (t.shared_width, H)), ("w2", (H, t.shared_width))):
                yield f"{f}shared_experts.{w}.weight", "shared_expert", TP_SPLIT, shape
    yield "norm.weight", "norm", REPLICATED, (H,)
    yield from (("hc_head_" + k, "other", REPLICATED, shape)
                for k, shape in (("fn", (t.v4.hc_mult, t.v4.hc_mult * H)), ("base", (t.v4.hc_mult,)), ("scale", (1,))))
    yield "head.weight", "lm_head", VOCAB, (t.vocab_size, H)


def _compressor(c: str, ratio: int, hd: int, H: int):
    """A compressor (compressor.py DeepseekCompressor): a CSA one projects to two series (2 x hd)."""
    width = (2 if ratio == 4 else 1) * hd
    yield c + "wkv.weight", "attention", REPLICATED, (width, H)
    yield c + "wgate.weight", "attention", REPLICATED, (width, H)
    yield c + "ape", "attention", REPLICATED, (ratio, width)
    yield c + "norm.weight", "norm", REPLICATED, (hd,)


def is_buffer(name: str) -> bool:
    """What transformers holds as a buffer, not a parameter: the router bias, the hash table."""
    return name.endswith((".gate.bias", ".gate.tid2eid"))


def check_parallel(t, tp: int) -> None:
    """What vLLM 0.33's V4 attention asks of TP (attention.py:218-226): the heads split evenly,
    and whole output groups per rank (its wo_a divides o_groups by TP; 0.34 asserts it)."""
    for key, n in (("num_attention_heads", t.num_attention_heads), ("o_groups", t.v4.o_groups)):
        if n % tp:
            raise UsageError(f"--tp {tp} does not divide {key} ({n}): vLLM's DeepSeek-V4 attention splits it evenly "
                             f"across TP ranks")


def _page(block: int, per_state: int, state_bytes: int) -> int:
    return cdiv(block // per_state * state_bytes, DS_MLA_ALIGN) * DS_MLA_ALIGN


def kv_specs(t, block_size: int) -> list[KVSpec]:
    """Every cache spec of one GPU (the same on every rank), per layer in vLLM's order: the sliding
    window (sparse_swa.py:76-147); a CSA or HCA layer's compressed KV (attention.py:865-883) and
    compressor state (compressor.py:139-192, a row of 2 x coff x head_dim fp32 per token over a
    window of coff x rate); a CSA layer's indexer keys (attention.py:1020-1036) and its
    compressor's state."""
    if block_size % BLOCK:
        raise UsageError(f"--block-size {block_size}: DeepSeek-V4's FlashMLA and indexer backends take multiples of "
                         f"{BLOCK} (sparse_mla.py, indexer.py)")
    v, hd, ih = t.v4, t.head_dim, t.v4.index_head_dim
    out = []
    for r in v.ratios:
        out.append(KVSpec(SLIDING, 1, hd, 0, SWA_BLOCK, v.sliding_window, _page(SWA_BLOCK, 1, DS_MLA_BYTES),
                          1, state_bytes=DS_MLA_BYTES))
        if not r:
            continue
        coff = 2 if r == 4 else 1
        state_block = 4 if r == 4 else 8
        out.append(KVSpec(CSA if r == 4 else HCA, 1, hd, 0, block_size, None, _page(block_size, r, DS_MLA_BYTES),
                          1, r, DS_MLA_BYTES))
        out.append(KVSpec(CSA_STATE if r == 4 else HCA_STATE, 1, 2 * coff * hd, 0, state_block, coff * r,
                          _page(state_block, 1, 2 * coff * hd * 4), 4))
        if r == 4:
            key = ih + ih // 128 * 4   # fp8 keys and an fp32 scale per 128
            out.append(KVSpec(INDEXER, 1, ih, 0, block_size, None, _page(block_size, r, key), 1, r, key))
            out.append(KVSpec(INDEXER_STATE, 1, 2 * coff * ih, 0, state_block, coff * r,
                              _page(state_block, 1, 2 * coff * ih * 4), 4))
    return out
