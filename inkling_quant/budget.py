"""Plan a vLLM deployment: parameters, bytes on disk, weights and KV cache per GPU, verdict.

`inkling-quant plan` answers, from config.json alone (no tensor is read): how large the
converted checkpoint is (bytes per part and number format, as `formats` reports them), how many
weight bytes each GPU holds at TP=EP=N, how much KV cache a request of a given length needs on
each GPU (vLLM v1's own formulas, hybrid sliding-window/full allocator included), what is left
for it, the longest --max-model-len that fits, how many such requests fit at once, and a verdict.
docs/budget.md derives every figure and states our assumptions; in short:

* parameter counts are logical elements of the BF16 source (a packed FP4 byte is 2 params);
  "total" is the served model (text + vision), the draft is counted apart; "active" is what one
  text token touches: embeddings, attention, routers, norms, short convs, attn-res queries,
  LM head, and top-k of the routed experts (vision only runs on images, the draft is a separate
  model);
* per GPU, TP splits attention heads, EP (= TP) splits routed experts, embeddings and LM heads
  are vocab-parallel, KV heads are split while TP <= KV heads and replicated beyond;
  norms, routers, attn-res queries, MLP short convs, the draft's `fc` and RNN are replicated;
  the draft runs at the target's TP (vLLM's default `draft_tensor_parallel_size`);
* KV cache: BF16, block size 16, no KV for the draft (the recipe's 64.47 GiB is reproduced
  exactly without it);
* KV budget = memory.total x --gpu-memory-utilization - weights - --reserve-gib, the reserve
  standing for what vLLM's profiler finds besides weights (activation peak, NCCL/cuBLAS/
  FlashInfer workspaces, CUDA graph pools).
"""
from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from dataclasses import dataclass, field

from typing import TYPE_CHECKING

from .cli_common import float_range, int_range
from .errors import UsageError
from .kvcache import DEFAULT_BATCHED_TOKENS, DEFAULT_BLOCK_SIZE, KVLayout, cdiv, kv_layer_specs, kv_layout

if TYPE_CHECKING:
    from .layout import ModelConfig, TensorName

# layout, schemes and io import torch (seconds): this module imports them where it computes,
# so that `inkling-quant plan --help` answers at once.
GiB = 1 << 30
MiB = 1 << 20
GB = 10 ** 9


# --------------------------------------------------------------------------- GPUs
@dataclass(frozen=True)
class GPU:
    name: str
    vendor_gb: int        # the capacity NVIDIA's spec page prints (a label: GB there is not one unit)
    total_mib: int        # nvidia-smi memory.total: the capacity CUDA exposes, what we compute with
    gpus_per_node: int    # GPUs per node (HGX/DGX board) or per compute tray (NVL72 racks)
    node: str             # what a node is called for this GPU

    @property
    def total_bytes(self) -> int:
        return self.total_mib * MiB


# Vendor figures: NVIDIA's data-center spec pages, quoted from our notes, not re-fetched here
# (the build machine has no web access): H100 SXM 80 GB (nvidia.com/en-us/data-center/h100),
# H200 SXM 141 GB (.../h200), DGX B200 1,440 GB for 8 GPUs = 180 GB (.../dgx-b200; the recipe's
# hardware profile says "B200 SXM 180 GB"), GB200 NVL72 13.4 TB HBM3e for 72 GPUs = 186 GB
# (.../gb200-nvl72, 372 GB per 2-GPU superchip), Blackwell Ultra B300 / GB300 288 GB HBM3e
# (.../dgx-b300, .../gb300-nvl72).
# These labels mix units (B300's 288 GB is decimal, 268.6 GiB; GB200's 186 GB is ~185 GiB), so
# we compute with what the driver reports instead: `nvidia-smi --query-gpu=memory.total`, the
# same values in several independent public logs (searched 2026-12): H100 80GB HBM3 81559 MiB,
# H200 143771 MiB, B200 183359 MiB, B300 SXM6 AC 275040 MiB, GB200 189471 MiB, GB300 284208 MiB.
# CUDA's own total (torch.cuda.mem_get_info, what vLLM multiplies by the utilization) is a few
# hundred MiB lower still (an H100 logs 79.14 GiB); the reserve absorbs that.
GPUS: dict[str, GPU] = {g.name: g for g in (
    GPU("h100", 80, 81559, 8, "HGX node"),
    GPU("h200", 141, 143771, 8, "HGX node"),
    GPU("b200", 180, 183359, 8, "HGX node"),
    GPU("gb200", 186, 189471, 4, "NVL72 compute tray"),
    GPU("b300", 288, 275040, 8, "HGX node"),
    GPU("gb300", 288, 284208, 4, "NVL72 compute tray"),
)}

# vLLM's defaults we follow (vllm/v1 at commit 001cabc1be16a59a70d720ed61a13b678c060a18):
# CacheConfig.block_size 16 on CUDA, gpu_memory_utilization 0.9, and the OpenAI server's
# max_num_batched_tokens 8192 (with which the recipe's 64.47 GiB comes out; 2048 gives 64.23).
DEFAULT_UTILIZATION = 0.9
# What vLLM's memory profiler charges besides weights, per GPU (docs/budget.md, "reserve").
DEFAULT_RESERVE_GIB = 12.0
VOCAB_PADDING = 64            # vLLM's DEFAULT_VOCAB_PADDING_SIZE (vocab_parallel_embedding.py)
VRAM_RULE_OF_THUMB = 1.2      # the recipe's vram_minimum_gb = ceil(1.2 x checkpoint GB): our reading


# --------------------------------------------------------------------------- parameters
TEXT_PARTS = ("embed", "attention", "attn_sink", "rel_bias", "short_conv", "attn_res", "norm", "router",
              "lm_head")


@dataclass
class ParamCounts:
    parts: dict[str, int]      # part -> parameters (logical elements), every part incl. draft
    total: int                 # served model: text + vision, draft excluded
    active: int                # one text token: TEXT_PARTS + top_k/num_experts of the experts
    draft: int
    top_k: int
    num_experts: int

    @property
    def total_with_draft(self) -> int:
        return self.total + self.draft

    def to_dict(self) -> dict:
        return {"total": self.total, "active": self.active, "draft": self.draft,
                "total_with_draft": self.total_with_draft, "parts": dict(self.parts),
                "active_counts": f"{', '.join(TEXT_PARTS)} + {self.top_k}/{self.num_experts} of expert"}


def param_counts(cfg: ModelConfig) -> ParamCounts:
    """Parameter counts per part, total and active (see the module docstring for what counts)."""
    parts: dict[str, int] = defaultdict(int)
    from .layout import PROJECTIONS, classify, expected_tensors, expert_shape

    for s in expected_tensors(cfg, include_experts=False):
        parts[classify(s.name).part] += s.numel
    per_expert = sum(math.prod(expert_shape(cfg, p)) for p in PROJECTIONS)
    parts["expert"] = per_expert * cfg.num_experts * cfg.num_hidden_layers
    draft = parts.get("draft", 0)
    total = sum(parts.values()) - draft
    active = sum(parts.get(p, 0) for p in TEXT_PARTS) + \
        per_expert * cfg.num_experts_per_tok * cfg.num_hidden_layers
    return ParamCounts(dict(parts), total, active, draft, cfg.num_experts_per_tok, cfg.num_experts)


# --------------------------------------------------------------------------- parallelism
@dataclass(frozen=True)
class Parallel:
    """Tensor parallel size (= expert parallel size) and the per-rank head counts it implies."""

    tp: int
    cfg: ModelConfig
    draft: bool = True   # the draft is served too (its heads must split as well)

    def __post_init__(self):
        cfg, tp = self.cfg, self.tp
        if tp < 1:
            raise UsageError(f"--tp must be at least 1, got {tp}")
        if cfg.num_attention_heads % tp:
            raise UsageError(f"--tp {tp} does not divide num_attention_heads ({cfg.num_attention_heads}): "
                             f"vLLM splits attention heads evenly across TP ranks")
        if cfg.num_experts % tp:
            raise UsageError(f"--tp {tp} does not divide num_experts ({cfg.num_experts}): with EP = TP "
                             f"every rank must hold the same number of routed experts")
        kv_heads = {("num_key_value_heads", cfg.num_key_value_heads),
                    ("full_attention_num_key_value_heads", cfg.full_attention_num_key_value_heads)}
        if self.draft and cfg.draft is not None:
            kv_heads.add(("dspark_config.num_key_value_heads", cfg.draft.num_key_value_heads))
            if cfg.draft.num_attention_heads % tp:
                raise UsageError(f"--tp {tp} does not divide dspark_config.num_attention_heads "
                                 f"({cfg.draft.num_attention_heads}); the draft runs at the target's TP")
        for key, n in sorted(kv_heads):
            if (tp % n if tp >= n else n % tp):
                raise UsageError(f"--tp {tp} and {key} ({n}): vLLM needs one to divide the other "
                                 f"(KV heads are split, or replicated when TP exceeds them)")

    def kv_per_rank(self, kv_heads: int) -> int:
        """vLLM: max(1, total_num_kv_heads // tp_size); replicated when TP > KV heads."""
        return max(1, kv_heads // self.tp)

    def vocab_share(self, vocab: int) -> float:
        padded = -(-vocab // VOCAB_PADDING) * VOCAB_PADDING
        return -(-padded // self.tp) / vocab


# Per-rank share of a non-expert tensor, by (part, projection). Column-parallel and row-parallel
# weights split by TP; the biases of row-parallel layers are replicated; K/V projections split
# by KV heads (replicated past them); vocab-parallel embeddings and LM heads pad the vocabulary.
_BY_HEADS = {("attention", "q_proj"), ("attention", "g_proj"), ("attention", "o_proj"),
             ("short_conv", "q_conv"), ("draft", "self_attn.q_proj"), ("draft", "self_attn.o_proj"),
             ("draft", "mlp.gate_proj"), ("draft", "mlp.up_proj"), ("draft", "mlp.down_proj")}
_BY_KV = {("attention", "k_proj"), ("attention", "v_proj"), ("short_conv", "k_conv"), ("short_conv", "v_conv")}
_DRAFT_KV = {("draft", "self_attn.k_proj"), ("draft", "self_attn.v_proj")}
_VISION_COLUMN = {"attn.qkv", "mlp.fc1", "merger.mlp.0"}
_VISION_ROW = {"attn.proj", "mlp.fc2", "merger.mlp.2"}


def rank_share(t: TensorName, cfg: ModelConfig, par: Parallel) -> float:
    """Fraction of a non-expert tensor held by the fullest rank."""
    key = (t.part, t.projection)
    if t.part in ("rel_bias", "attn_sink") or key in _BY_HEADS:
        return 1 / par.tp
    if key in _BY_KV:
        nkv = cfg.attention_dims(t.layer)[1]
        return par.kv_per_rank(nkv) / nkv
    if key in _DRAFT_KV:
        nkv = cfg.draft.num_key_value_heads
        return par.kv_per_rank(nkv) / nkv
    if t.part in ("embed", "lm_head") or key == ("draft", "markov_head.lm_head"):
        return par.vocab_share(cfg.vocab_size)
    if t.part == "vision" and (t.projection in _VISION_COLUMN or
                               (t.projection in _VISION_ROW and t.suffix == "weight")):
        return 1 / par.tp
    return 1.0  # norms, routers, attn-res queries, MLP short conv, patch embed, draft fc / RNN


# --------------------------------------------------------------------------- bytes
@dataclass
class Weights:
    """Bytes on disk (whole checkpoint) and on the fullest GPU, per part and per format."""

    disk: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))  # (part, fmt)
    source: dict[str, int] = field(default_factory=lambda: defaultdict(int))           # part -> BF16 bytes
    per_gpu: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))  # (part, fmt)

    @property
    def disk_total(self) -> int:
        return sum(self.disk.values())

    @property
    def per_gpu_total(self) -> int:
        return sum(self.per_gpu.values())

    def disk_part(self, part: str) -> int:
        return sum(b for (p, _), b in self.disk.items() if p == part)

    def per_gpu_part(self, part: str) -> int:
        return sum(b for (p, _), b in self.per_gpu.items() if p == part)

    def per_gpu_by_part(self) -> dict[str, int]:
        return {p: self.per_gpu_part(p) for p in sorted({p for p, _ in self.per_gpu})}


def weight_bytes(cfg: ModelConfig, scheme_name: str, par: Parallel, include_draft: bool = True) -> Weights:
    """Checkpoint bytes per (part, format), asking `formats` for every tensor's size, and the
    bytes of the fullest rank at TP = EP = par.tp."""
    import torch

    from .layout import PROJECTIONS, classify, expected_tensors, expert_shape
    from .schemes import get_scheme

    scheme = get_scheme(scheme_name)
    w = Weights()
    for s in expected_tensors(cfg, include_draft=include_draft, include_experts=False):
        t = classify(s.name)
        fmt = scheme.format_for(cfg, t)
        nbytes = fmt.nbytes(s.shape, s.dtype)
        w.disk[(t.part, fmt.name)] += nbytes
        w.source[t.part] += s.nbytes
        w.per_gpu[(t.part, fmt.name)] += math.ceil(nbytes * rank_share(t, cfg, par))
    experts_per_rank = cfg.num_experts // par.tp
    for i in range(cfg.num_hidden_layers):
        for proj in PROJECTIONS:
            t = classify(f"model.layers.{i}.mlp.experts.0.{proj}.weight")
            fmt = scheme.format_for(cfg, t)
            shape = expert_shape(cfg, proj)
            nbytes = fmt.nbytes(shape, torch.bfloat16)
            w.disk[("expert", fmt.name)] += nbytes * cfg.num_experts
            w.source["expert"] += math.prod(shape) * torch.bfloat16.itemsize * cfg.num_experts
            w.per_gpu[("expert", fmt.name)] += nbytes * experts_per_rank
    return w


# --------------------------------------------------------------------------- the plan
@dataclass
class Plan:
    cfg: ModelConfig
    gpu: GPU
    tp: int
    scheme: str
    max_model_len: int
    max_num_seqs: int | None
    utilization: float
    max_num_batched_tokens: int
    reserve_bytes: int
    include_draft: bool
    params: ParamCounts
    weights: Weights
    kv: KVLayout
    block_size: int

    # derived -------------------------------------------------------------
    @property
    def requested_bytes(self) -> int:
        # vllm/v1/worker/utils.py request_memory: ceil(total_memory * gpu_memory_utilization)
        return math.ceil(self.gpu.total_bytes * self.utilization)

    @property
    def kv_budget_bytes(self) -> int:
        return self.requested_bytes - self.weights.per_gpu_total - self.reserve_bytes

    @property
    def kv_needed_bytes(self) -> int:
        return self.kv.bytes_needed(self.max_model_len)

    @property
    def fits(self) -> bool:
        return 0 < self.kv_needed_bytes <= self.kv_budget_bytes

    @property
    def largest_max_model_len(self) -> int:
        return self.kv.max_model_len(self.kv_budget_bytes, self.cfg.max_position_embeddings)

    @property
    def concurrency(self) -> float:
        return self.kv.max_concurrency(self.kv_budget_bytes, self.max_model_len)

    @property
    def break_even_reserve_bytes(self) -> int:
        """The largest reserve with which one request of max_model_len still fits."""
        return self.requested_bytes - self.weights.per_gpu_total - self.kv_needed_bytes

    @property
    def vram_minimum_gb(self) -> int:
        return math.ceil(VRAM_RULE_OF_THUMB * self.weights.disk_total / GB)

    @property
    def nodes(self) -> int:
        return cdiv(self.tp, self.gpu.gpus_per_node)

    def kv_bytes_per_token(self) -> dict[str, int]:
        """Per GPU, per token, summed over the layers of each kind (before block rounding)."""
        out: dict[str, int] = defaultdict(int)
        for s in kv_layer_specs(self.cfg, Parallel(self.tp, self.cfg, self.include_draft), self.block_size):
            out[s.kind] += s.page_size_bytes // s.block_size
        return dict(out)

    def verdict(self) -> str:
        where = f"{self.tp} x {self.gpu.name.upper()} ({self.nodes} {self.gpu.node}{'s' if self.nodes > 1 else ''})"
        if self.kv_budget_bytes <= 0:
            return (f"DOES NOT FIT on {where}: the weights ({_gib(self.weights.per_gpu_total)} GiB per GPU) and "
                    f"the {_gib(self.reserve_bytes)} GiB reserve exceed the {_gib(self.requested_bytes)} GiB that "
                    f"--gpu-memory-utilization {self.utilization} allows; raise --tp")
        if not self.fits:
            est = self.largest_max_model_len
            hint = f"Based on the available memory, the estimated maximum model length is {est}. " if est else ""
            even = self.break_even_reserve_bytes
            margin = (f"It would fit only if vLLM's non-weight overhead stayed under {_gib(even)} GiB per GPU "
                      f"(assumed: {_gib(self.reserve_bytes)} GiB). " if even > 0 else
                      "The weights alone leave too little for this length. ")
            return (f"DOES NOT FIT on {where}: To serve at least one request with the model's max seq len "
                    f"({self.max_model_len}), ({_gib(self.kv_needed_bytes)} GiB KV cache is needed, which is larger "
                    f"than the available KV cache memory ({_gib(self.kv_budget_bytes)} GiB). {hint}{margin}"
                    f"Lower --max-model-len or raise --tp.")
        msg = (f"FITS on {where}: one {self.max_model_len:,}-token request needs {_gib(self.kv_needed_bytes)} GiB "
               f"of the {_gib(self.kv_budget_bytes)} GiB KV budget per GPU; {self.concurrency:.2f} such requests "
               f"fit at once (margin: fits while vLLM's non-weight overhead stays under "
               f"{_gib(self.break_even_reserve_bytes)} GiB per GPU)")
        if self.max_num_seqs is not None and self.concurrency < self.max_num_seqs:
            msg += (f"; --max-num-seqs {self.max_num_seqs} full-length requests do not all fit at once "
                    f"(shorter ones share the pool)")
        return msg

    def to_dict(self) -> dict:
        w = self.weights
        return {
            "model": self.cfg.raw.get("_name_or_path") or self.cfg.raw.get("model_type"),
            "gpu": {"name": self.gpu.name, "vendor_gb": self.gpu.vendor_gb, "memory_total_bytes": self.gpu.total_bytes,
                    "gpus_per_node": self.gpu.gpus_per_node, "node": self.gpu.node},
            "tp": self.tp, "ep": self.tp, "nodes": self.nodes, "scheme": self.scheme,
            "max_model_len": self.max_model_len, "max_num_seqs": self.max_num_seqs,
            "gpu_memory_utilization": self.utilization, "max_num_batched_tokens": self.max_num_batched_tokens,
            "block_size": self.block_size, "draft_included": self.include_draft,
            "params": self.params.to_dict(),
            "disk": {"total_bytes": w.disk_total,
                     "by_part_format": [{"part": p, "format": f, "bytes": b} for (p, f), b in sorted(w.disk.items())],
                     "source_bf16_bytes": dict(w.source),
                     "vram_minimum_gb": self.vram_minimum_gb},
            "per_gpu": {"weights_bytes": w.per_gpu_total, "weights_by_part": w.per_gpu_by_part(),
                        "requested_bytes": self.requested_bytes, "reserve_bytes": self.reserve_bytes,
                        "kv_budget_bytes": self.kv_budget_bytes,
                        "kv_bytes_per_token": self.kv_bytes_per_token(),
                        "kv_needed_bytes": self.kv_needed_bytes,
                        "kv_groups": [{"kind": g.spec.kind, "layers": g.num_layers, "block_size": g.spec.block_size,
                                       "page_size_bytes": g.spec.page_size_bytes} for g in self.kv.groups],
                        "kv_mode": self.kv.mode},
            "fits": self.fits, "largest_max_model_len": self.largest_max_model_len,
            "max_concurrency": self.concurrency, "break_even_reserve_bytes": self.break_even_reserve_bytes,
            "verdict": self.verdict(),
        }


def plan(cfg: ModelConfig, gpu: str, tp: int, *, max_model_len: int | None = None, max_num_seqs: int | None = None,
         utilization: float = DEFAULT_UTILIZATION, max_num_batched_tokens: int = DEFAULT_BATCHED_TOKENS,
         scheme: str = "default", reserve_gib: float = DEFAULT_RESERVE_GIB, block_size: int = DEFAULT_BLOCK_SIZE,
         include_draft: bool = True) -> Plan:
    if gpu not in GPUS:
        raise UsageError(f"unknown --gpu {gpu!r}; known: {', '.join(GPUS)}")
    if not 0 < utilization <= 1:
        raise UsageError(f"--gpu-memory-utilization must be in (0, 1], got {utilization}")
    for name, v in (("--max-num-batched-tokens", max_num_batched_tokens), ("--block-size", block_size)):
        if v < 1:
            raise UsageError(f"{name} must be positive, got {v}")
    if reserve_gib < 0:
        raise UsageError(f"--reserve-gib must not be negative, got {reserve_gib}")
    if max_num_seqs is not None and max_num_seqs < 1:
        raise UsageError(f"--max-num-seqs must be positive, got {max_num_seqs}")
    length = cfg.max_position_embeddings if max_model_len is None else max_model_len
    if length < 1:
        raise UsageError(f"--max-model-len must be positive, got {length}")
    if length > cfg.max_position_embeddings:
        raise UsageError(f"--max-model-len {length} exceeds max_position_embeddings "
                         f"({cfg.max_position_embeddings}); vLLM refuses that without an override")
    include_draft = include_draft and cfg.draft is not None
    par = Parallel(tp, cfg, include_draft)
    return Plan(cfg=cfg, gpu=GPUS[gpu], tp=tp, scheme=scheme, max_model_len=length, max_num_seqs=max_num_seqs,
                utilization=utilization, max_num_batched_tokens=max_num_batched_tokens,
                reserve_bytes=round(reserve_gib * GiB), include_draft=include_draft, params=param_counts(cfg),
                weights=weight_bytes(cfg, scheme, par, include_draft),
                kv=kv_layout(kv_layer_specs(cfg, par, block_size), max_num_batched_tokens), block_size=block_size)


# --------------------------------------------------------------------------- output
def _gib(n: int) -> str:
    return f"{n / GiB:.2f}"


def _gb(n: int) -> str:
    return f"{n / GB:.2f}"


def _b(n: int) -> str:
    for unit, scale in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= scale:
            return f"{n / scale:.3f}{unit}" if unit == "B" else f"{n / scale:.1f}{unit}"
    return str(n)


def render(p: Plan) -> str:
    w, pc = p.weights, p.params
    out = [f"inkling-quant plan: scheme {p.scheme!r}, {p.tp} x {p.gpu.name.upper()} (TP{p.tp} attention, EP{p.tp} "
           f"experts), max_model_len {p.max_model_len:,}, gpu_memory_utilization {p.utilization}, "
           f"max_num_batched_tokens {p.max_num_batched_tokens}, block_size {p.block_size}", ""]
    out.append(f"Parameters: total {_b(pc.total)} (text + vision), active {_b(pc.active)} per text token "
               f"({pc.top_k}/{pc.num_experts} experts), draft {_b(pc.draft)}")
    out.append("")
    hdr = f"{'part':<12} {'params':>10} {'format':<12} {'BF16 GB':>9} {'disk GB':>9} {'per GPU GiB':>12}"
    out += [hdr, "-" * len(hdr)]
    for part in sorted({p_ for p_, _ in w.disk}, key=lambda x: -w.disk_part(x)):
        fmts = sorted((f, b) for (p_, f), b in w.disk.items() if p_ == part)
        for j, (f, b) in enumerate(fmts):
            first = j == 0
            out.append(f"{part if first else '':<12} {_b(pc.parts.get(part, 0)) if first else '':>10} {f:<12} "
                       f"{_gb(w.source[part]) if first else '':>9} {_gb(b):>9} {_gib(w.per_gpu[(part, f)]):>12}")
    out.append("-" * len(hdr))
    out.append(f"{'total':<12} {_b(pc.total_with_draft if p.include_draft else pc.total):>10} {'':<12} "
               f"{_gb(sum(w.source.values())):>9} {_gb(w.disk_total):>9} {_gib(w.per_gpu_total):>12}")
    out.append("")
    by_fmt: dict[str, int] = defaultdict(int)
    for (_, f), b in w.disk.items():
        by_fmt[f] += b
    out.append(f"On disk: {_gb(w.disk_total)} GB ({', '.join(f'{f} {_gb(b)} GB' for f, b in sorted(by_fmt.items()))})"
               + (f", draft {_gb(w.disk_part('draft'))} GB included" if p.include_draft else ", without the draft"))
    out.append(f"VRAM minimum (recipe rule of thumb, our reading: ceil({VRAM_RULE_OF_THUMB} x checkpoint GB)): "
               f"{p.vram_minimum_gb} GB")
    out.append("")
    kinds = p.kv_bytes_per_token()
    out.append("KV cache per GPU (BF16): " + ", ".join(
        f"{k} layers {v:,} B/token" for k, v in sorted(kinds.items())) + f"; vLLM pools them as {len(p.kv.groups)} "
        f"group(s) ({p.kv.mode})")
    out.append(f"  {p.gpu.name.upper()} memory.total {_gib(p.gpu.total_bytes)} GiB (vendor: {p.gpu.vendor_gb} GB) x "
               f"{p.utilization} = {_gib(p.requested_bytes)} GiB")
    out.append(f"  - weights {_gib(w.per_gpu_total)} GiB - reserve {_gib(p.reserve_bytes)} GiB "
               f"= KV budget {_gib(p.kv_budget_bytes)} GiB")
    out.append(f"  one {p.max_model_len:,}-token request needs {_gib(p.kv_needed_bytes)} GiB; "
               f"largest --max-model-len that fits: {p.largest_max_model_len:,}")
    out.append(f"  concurrent {p.max_model_len:,}-token requests: {p.concurrency:.2f}")
    out.append("")
    out.append(p.verdict())
    return "\n".join(out)


# --------------------------------------------------------------------------- CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", nargs="?", help="checkpoint directory whose config.json to plan for")
    parser.add_argument("--config", help="a config.json (default, with neither: the reference config)")
    parser.add_argument("--gpu", required=True, choices=sorted(GPUS))
    parser.add_argument("--tp", type=int_range(1, 4096), required=True,
                        help="tensor parallel size (= expert parallel size)")
    parser.add_argument("--max-model-len", type=int_range(1, 2**40), help="default: max_position_embeddings")
    parser.add_argument("--max-num-seqs", type=int_range(1, 2**20))
    parser.add_argument("--gpu-memory-utilization", type=float_range(0.0, 1.0, lo_open=True), default=DEFAULT_UTILIZATION)
    parser.add_argument("--max-num-batched-tokens", type=int_range(1, 2**40), default=DEFAULT_BATCHED_TOKENS)
    parser.add_argument("--scheme", default="default")
    parser.add_argument("--reserve-gib", type=float_range(0.0, 1e6), default=DEFAULT_RESERVE_GIB,
                        help="per-GPU memory vLLM's profiler charges besides weights (activations, NCCL and "
                             f"kernel workspaces, CUDA graphs); default {DEFAULT_RESERVE_GIB}")
    parser.add_argument("--block-size", type=int_range(1, 1 << 20), default=DEFAULT_BLOCK_SIZE)
    parser.add_argument("--no-draft", action="store_true", help="serve without the DSpark draft")
    parser.add_argument("--json", metavar="FILE", help="also write the plan as JSON ('-' for standard output only)")
    parser.add_argument("--quiet", action="store_true", help="print nothing (the exit code says whether it fits)")


def load_config(checkpoint: str | None, config: str | None) -> ModelConfig:
    if checkpoint and config:
        raise UsageError("give a checkpoint or --config, not both")
    from .layout import ModelConfig

    if checkpoint or config:
        return ModelConfig.load(checkpoint or config)
    return ModelConfig.reference()


def run(args) -> int:
    from .io.output import check_paths, write_report

    check_paths(None, [args.checkpoint, args.config], reports=[args.json])
    cfg = load_config(args.checkpoint, args.config)
    p = plan(cfg, args.gpu, args.tp, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
             utilization=args.gpu_memory_utilization, max_num_batched_tokens=args.max_num_batched_tokens,
             scheme=args.scheme, reserve_gib=args.reserve_gib, block_size=args.block_size,
             include_draft=not args.no_draft)
    write_report(args.json, json.dumps(p.to_dict(), indent=2) + "\n")
    if not (args.quiet or args.json == "-"):
        print(render(p))
    return 0 if p.fits else 1
