"""Plan a vLLM deployment of Inkling 2: parameters, bytes on disk, weights, KV cache and state per
GPU, MoE divisibility, verdict, and the serving recipe's figures beside ours.

The library behind `inkling-quant plan` (its CLI: plan_cmd.py), answering from config.json alone
(the published `Inkling2Config`; default: the reference config, Inkling2Config's defaults); no
tensor is read. docs/budget.md derives every
figure and states every assumption; in short:

* parameters as transformers counts them (`inkling2.param_counts`): active = the text model with
  8 of 384 routed experts, without the embedding tables;
* disk: the scheme's format for every routed-expert projection (`formats`' own byte counts), every
  other tensor as stored; the DSpark draft is not published, so its size is the recipe's 3.2 GB
  figure, labeled as such, never computed;
* per GPU at TP=N (EP=N experts unless --no-ep): experts 1/EP, attention split by heads (k/v and
  their convs by KV heads), the attention-/MLP-output short convs by hidden, the LM head
  vocab-parallel; the embedding table (as vLLM's Inkling code does), norms, routers,
  attention-residual queries, the relative-position table and the vision tower replicated; the
  draft replicated (an upper bound);
* KV cache and state: vLLM 0.33's Inkling (1) specs applied to Inkling 2's shapes (`kvcache`; vLLM
  0.33 has no Inkling 2 model);
* KV budget = memory.total x --gpu-memory-utilization - weights - --reserve-gib (activations,
  sampler, CUDA graphs, NCCL/kernel workspaces, the draft's KV cache and activations).
"""
from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .errors import UsageError
from .kvcache import CONV, DEFAULT_BLOCK_SIZE, FULL, SLIDING, KVLayout, cdiv, kv_layout, layer_specs
from .moe_checks import Check, moe_checks

if TYPE_CHECKING:
    from .inkling2 import Inkling2Config, ParamCounts

# inkling2, schemes and formats import torch (seconds): imported where they compute, so that
# `inkling-quant plan --help` answers at once.
GiB = 1 << 30
MiB = 1 << 20
GB = 10 ** 9


# --------------------------------------------------------------------------- GPUs
@dataclass(frozen=True)
class GPU:
    name: str
    vendor_gb: int        # the capacity the spec page (or the recipe) prints: a label
    total_mib: int        # nvidia-smi memory.total: what we compute with
    gpus_per_node: int    # per HGX node or per NVL72 compute tray
    node: str
    source: str           # where vendor_gb comes from

    @property
    def total_bytes(self) -> int:
        return self.total_mib * MiB


# memory.total as the driver reports it (several public nvidia-smi logs; docs/budget.md). The
# recipe itself gives only B200's figure ("NVIDIA B200 SXM 180 GB", vram_gb 1440 for 8).
GPUS: dict[str, GPU] = {g.name: g for g in (
    GPU("h100", 80, 81559, 8, "HGX node", "NVIDIA spec page"),
    GPU("h200", 141, 143771, 8, "HGX node", "NVIDIA spec page"),
    GPU("b200", 180, 183359, 8, "HGX node", "the recipe's hardware_profile"),
    GPU("gb200", 186, 189471, 4, "NVL72 compute tray", "NVIDIA spec page; not in the recipe"),
    GPU("b300", 288, 275040, 8, "HGX node", "NVIDIA spec page"),
    GPU("gb300", 288, 284208, 4, "NVL72 compute tray", "NVIDIA spec page"),
)}

DEFAULT_UTILIZATION = 0.9     # vLLM's gpu_memory_utilization default
# Per-GPU memory vLLM's profiler charges besides weights, and what we do not model: activation
# peak at max_num_batched_tokens, the sampler's and rejection sampler's fp32 logits (256 seqs x 8
# tokens x 201,024 x 4 B = 1.53 GiB per copy), CUDA graph pools, NCCL / all-reduce / FlashInfer
# workspaces, and the DSpark draft's KV cache and activations (its config is not published).
# docs/budget.md, "The reserve", sizes each; 12 GiB is our assumption, not a measurement.
DEFAULT_RESERVE_GIB = 12.0
ASYNC_BATCHES = 2             # VllmConfig.max_concurrent_batches with async scheduling (the default)
VOCAB_PADDING = 64            # DEFAULT_VOCAB_PADDING_SIZE (vocab_parallel_embedding.py)
VRAM_RULE_OF_THUMB = 1.2      # the recipe's vram_minimum_gb = ceil(1.2 x checkpoint GB): our reading


def default_batched_tokens(gpu: GPU) -> int:
    """vLLM's OpenAI-server default max_num_batched_tokens (engine/arg_utils.py:2973-2992):
    16384 on GPUs with >= 160 GiB, 8192 on H100/H200-class (>= 70 GiB), else 2048."""
    return 16384 if gpu.total_bytes >= 160 * GiB else 8192 if gpu.total_bytes >= 70 * GiB else 2048


# What the recipe states (shared/seed/Inkling-2-Small.recipe.json), for the comparison table.
RECIPE_TOTAL_PARAMS = 594e9
RECIPE_ACTIVE_PARAMS = 17e9
RECIPE_DISK_GB = 393            # "~393 GB on disk including the 3.2 GB DSpark draft"
RECIPE_DRAFT_GB = 3.2           # the draft's definition is not published: this figure is the recipe's
RECIPE_VRAM_MINIMUM_GB = 473
RECIPE_KV_1M_TP4_GIB = "64.47"  # the troubleshooting entry quotes vLLM's message
RECIPE_KV_TOKENS, RECIPE_KV_TP = 1_048_576, 4  # ... for one max-length request at TP4
M = 1_048_576


# --------------------------------------------------------------------------- how tensors split
REPLICATED, HEADS, KV_HEADS, HIDDEN, VOCAB = "replicated", "heads", "KV heads", "hidden", "vocab"

# (name after "model.llm.", part, split). vLLM 0.33's Inkling 1 code packs wq_du/wk_dv/wv_dv/wr_du
# into one column-parallel qkvr and makes wo_ud row-parallel (attention.py:95-130), replicates the
# embedding table on every rank (InklingReplicatedEmbedding, model.py:243-277) and vocab-shards
# the LM head (ParallelLMHead, model.py:439-445); the
# rows for Inkling 2's new modules (gate_attn, attn_sink_proj, the clip scales) are our assumption:
# split by heads like the projection they gate. The attention-/MLP-output convs are hidden-sharded
# (sconv_swa_attn.py:147-150).
_TEXT_RULES = tuple((re.compile(p), part, split) for p, part, split in (
    (r"embed\.weight", "embed", REPLICATED),
    (r"unembed\.weight", "lm_head", VOCAB),
    (r"(embed_norm|norm)\.weight", "norm", REPLICATED),
    (r"attn_res\..+", "attn_res", REPLICATED),
    (r"layers\.\d+\.(attn_norm|mlp_norm|[qkv]_input_norm)\.weight", "norm", REPLICATED),
    (r"layers\.\d+\.(attn|mlp)_sconv\.weight", "short_conv", HIDDEN),
    (r"layers\.\d+\.mlp\.gate\.(weight|bias)", "router", REPLICATED),
    (r"layers\.\d+\.attn\.w[kv]_dv\.weight", "attention", KV_HEADS),
    (r"layers\.\d+\.attn\.[kv]_sconv\..+", "short_conv", KV_HEADS),
    (r"layers\.\d+\.attn\.rel_logits_proj\.proj", "attention", REPLICATED),
    (r"layers\.\d+\.attn\..+", "attention", HEADS),
))


def split_of(name: str) -> tuple[str, str]:
    """(part, split) of a non-expert tensor under its original name."""
    from .inkling2 import TEXT_PREFIX, VISION_PREFIX

    if name.startswith(VISION_PREFIX):
        return "vision", REPLICATED  # vLLM ViTs may shard by heads; replicated is the upper bound
    rel = name[len(TEXT_PREFIX):] if name.startswith(TEXT_PREFIX) else name
    for pattern, part, split in _TEXT_RULES:
        if pattern.fullmatch(rel):
            return part, split
    raise UsageError(f"no split rule for tensor {name!r}")  # pragma: no cover - inkling2 names only


def rank_bytes(nbytes: int, rows: int, split: str, tp: int) -> int:
    """Bytes of one tensor on the fullest rank (TP divides heads, KV heads and hidden: checked)."""
    if split == REPLICATED:
        return nbytes
    if split == VOCAB:  # VocabParallelEmbedding / ParallelLMHead: pad to 64, ceil-divide the rows
        padded = cdiv(rows, VOCAB_PADDING) * VOCAB_PADDING
        return nbytes // rows * cdiv(padded, tp)
    return cdiv(nbytes, tp)


def check_parallel(cfg: Inkling2Config, tp: int) -> None:
    t = cfg.text
    if tp < 1:
        raise UsageError(f"--tp must be at least 1, got {tp}")
    for key, n in (("num_attention_heads", t.num_attention_heads), ("swa_num_attention_heads",
                   t.swa_num_attention_heads), ("num_key_value_heads", t.num_key_value_heads),
                   ("swa_num_key_value_heads", t.swa_num_key_value_heads), ("hidden_size", t.hidden_size)):
        if n % tp:
            raise UsageError(f"--tp {tp} does not divide text_config.{key} ({n}): vLLM splits it evenly "
                             f"across TP ranks (and Inkling's short-conv state needs TP <= KV heads)")


# --------------------------------------------------------------------------- bytes
@dataclass
class Weights:
    """Bytes on disk (whole checkpoint) and on the fullest GPU, per (part, format)."""

    disk: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    per_gpu: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    elements: dict[str, int] = field(default_factory=lambda: defaultdict(int))   # part -> tensor elements
    splits: dict[str, set] = field(default_factory=lambda: defaultdict(set))     # part -> split kinds
    fmt_layers: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))  # expert format -> layers

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

    def parts(self) -> list[str]:
        return sorted({p for p, _ in self.disk}, key=lambda p: -self.disk_part(p))


def expert_shapes(cfg: Inkling2Config, tp_split: int = 1) -> dict[str, tuple[int, int]]:
    """[out, in] of each projection of one routed expert (gate and up rows of w13, w2), with the
    intermediate dim divided by `tp_split` (pure-TP experts)."""
    t = cfg.text
    inter = t.moe_intermediate_size // tp_split
    return {"gate_proj": (inter, t.hidden_size), "up_proj": (inter, t.hidden_size),
            "down_proj": (t.hidden_size, inter)}


def weight_bytes(cfg: Inkling2Config, scheme_name: str, tp: int, ep: bool = True,
                 include_draft: bool = True) -> Weights:
    """Checkpoint bytes per (part, format), each format asked for its own size, and the fullest
    rank's bytes at TP = tp (experts: EP = tp, or TP-sharded without EP)."""
    import torch

    from .inkling2 import TEXT_PREFIX, checkpoint_tensors
    from .layout import TensorName
    from .schemes import get_scheme

    scheme, t, w = get_scheme(scheme_name), cfg.text, Weights()
    for s in checkpoint_tensors(cfg, include_experts=False, include_draft=False):
        part, split = split_of(s.name)
        layer = int(m.group(1)) if (m := re.match(r"layers\.(\d+)\.", s.name[len(TEXT_PREFIX):])) else None
        fmt = scheme.format_for(t, TensorName(s.name, part, layer))
        nbytes = fmt.nbytes(s.shape, s.dtype)
        w.disk[(part, fmt.name)] += nbytes
        w.per_gpu[(part, fmt.name)] += rank_bytes(nbytes, s.shape[0], split, tp)
        w.elements[part] += s.numel
        w.splits[part].add(split)
    full, rank = expert_shapes(cfg), expert_shapes(cfg, 1 if ep else tp)
    for i in range(t.num_hidden_layers):
        fmt = scheme.format_for(t, TensorName(f"{TEXT_PREFIX}layers.{i}.mlp.experts.w13_weight", "expert", i))
        per_expert = sum(fmt.nbytes(shape, torch.bfloat16) for shape in full.values())
        w.disk[("expert", fmt.name)] += per_expert * t.n_routed_experts
        w.elements["expert"] += sum(math.prod(s) for s in full.values()) * t.n_routed_experts
        w.fmt_layers[fmt.name].append(i)
        if ep:  # whole experts, padded to a multiple of EP (moe.py:440)
            w.per_gpu[("expert", fmt.name)] += per_expert * cdiv(t.n_routed_experts, tp)
        else:
            w.per_gpu[("expert", fmt.name)] += _tp_expert_bytes(fmt, rank, per_expert, tp) * t.n_routed_experts
    w.splits["expert"].add(f"EP{tp}" if ep else "TP intermediate")
    if include_draft:
        draft = round(RECIPE_DRAFT_GB * GB)
        w.disk[("draft", "recipe")] += draft
        w.per_gpu[("draft", "recipe")] += draft
        w.splits["draft"].add(REPLICATED)
    return w


def _tp_expert_bytes(fmt, rank_shapes: dict, per_expert: int, tp: int) -> int:
    import torch

    try:
        return sum(fmt.nbytes(shape, torch.bfloat16) for shape in rank_shapes.values())
    except Exception:  # noqa: BLE001 - a rank slice the format cannot hold: the checks say so
        return cdiv(per_expert, tp)


# --------------------------------------------------------------------------- the plan
@dataclass
class Plan:
    cfg: Inkling2Config
    gpu: GPU
    tp: int
    ep: bool
    scheme: str
    max_model_len: int
    max_num_seqs: int | None
    utilization: float
    max_num_batched_tokens: int
    concurrent_batches: int
    reserve_bytes: int
    include_draft: bool
    block_size: int
    params: ParamCounts
    weights: Weights
    kv: KVLayout
    checks: list[Check]

    @property
    def requested_bytes(self) -> int:
        # v1/worker/utils.py:724-726 request_memory: ceil(total_memory * gpu_memory_utilization)
        return math.ceil(self.gpu.total_bytes * self.utilization)

    @property
    def kv_budget_bytes(self) -> int:
        # v1/worker/gpu_worker.py:753-757: requested - non-KV memory (weights + what the reserve stands for)
        return self.requested_bytes - self.weights.per_gpu_total - self.reserve_bytes

    @property
    def kv_needed_bytes(self) -> int:
        return self.kv.bytes_needed(self.max_model_len)

    @property
    def loadable(self) -> bool:
        return not any(c.level == "error" for c in self.checks)

    @property
    def fits(self) -> bool:
        return self.loadable and 0 < self.kv_needed_bytes <= self.kv.usable(self.kv_budget_bytes)

    @property
    def largest_max_model_len(self) -> int:
        return self.kv.max_model_len(self.kv_budget_bytes, self.cfg.text.max_position_embeddings)

    @property
    def concurrency(self) -> float:
        return self.kv.max_concurrency(self.kv_budget_bytes, self.max_model_len)

    @property
    def break_even_reserve_bytes(self) -> int:
        """The largest reserve with which one request of max_model_len still fits."""
        return self.requested_bytes - self.weights.per_gpu_total - self.kv_needed_bytes - self.kv.bytes_per_block

    @property
    def nodes(self) -> int:
        return cdiv(self.tp, self.gpu.gpus_per_node)

    @property
    def max_in_flight_tokens(self) -> int:
        return self.kv.max_in_flight_tokens

    def where(self) -> str:
        return f"{self.tp} x {self.gpu.name.upper()} ({self.nodes} {self.gpu.node}{'s' if self.nodes > 1 else ''})"

    def verdict(self) -> str:
        if not self.loadable:
            return (f"DOES NOT LOAD on {self.where()}: " +
                    "; ".join(c.message for c in self.checks if c.level == "error"))
        if self.kv_budget_bytes <= 0:
            return (f"DOES NOT FIT on {self.where()}: the weights ({_gib(self.weights.per_gpu_total)} GiB per GPU) "
                    f"and the {_gib(self.reserve_bytes)} GiB reserve exceed the {_gib(self.requested_bytes)} GiB "
                    f"that --gpu-memory-utilization {self.utilization} allows; raise --tp")
        if not self.fits:
            est = self.largest_max_model_len
            hint = f"Based on the available memory, the estimated maximum model length is {est}. " if est else ""
            return (f"DOES NOT FIT on {self.where()}: To serve at least one request with the model's max seq len "
                    f"({self.max_model_len}), ({_gib(self.kv_needed_bytes)} GiB KV cache is needed, which is larger "
                    f"than the available KV cache memory ({_gib(self.kv.usable(self.kv_budget_bytes))} GiB). "
                    f"{hint}Lower --max-model-len or raise --tp.")
        msg = (f"FITS on {self.where()}: one {self.max_model_len:,}-token request needs {_gib(self.kv_needed_bytes)} "
               f"GiB of the {_gib(self.kv_budget_bytes)} GiB KV budget per GPU; {self.concurrency:.2f} such requests "
               f"fit at once; it would stop fitting only past {_gib(self.break_even_reserve_bytes)} GiB of "
               f"non-weight overhead per GPU (assumed: {_gib(self.reserve_bytes)} GiB)")
        if self.max_num_seqs is not None and self.concurrency < self.max_num_seqs:
            msg += f"; --max-num-seqs {self.max_num_seqs} full-length requests do not all fit at once"
        return msg

    def kv_kinds(self) -> dict[str, dict]:
        """Per kind of cache: layers, spec, bytes per token per layer on this GPU, and one
        max_model_len request's share of the pool."""
        needed = self.kv.bytes_by_kind(self.max_model_len)
        out = {}
        for kind in (FULL, SLIDING, CONV):
            specs = [s for s in self.kv.specs if s.kind == kind]
            if not specs:
                continue
            s = specs[0]
            out[kind] = {"layers": len(specs), "num_kv_heads_per_rank": s.num_kv_heads, "head_size": s.head_size,
                         "head_size_v": s.head_size_v, "block_size": s.block_size, "sliding_window": s.sliding_window,
                         "page_size_bytes": s.page_size_bytes, "bytes_per_token_per_layer": s.bytes_per_token,
                         "request_bytes": needed.get(kind, 0)}
        return out

    def to_dict(self) -> dict:
        w, pc = self.weights, self.params
        return {
            "model": self.cfg.raw.get("_name_or_path") or self.cfg.raw.get("model_type"),
            "gpu": {"name": self.gpu.name, "vendor_gb": self.gpu.vendor_gb, "vendor_gb_source": self.gpu.source,
                    "memory_total_bytes": self.gpu.total_bytes, "gpus_per_node": self.gpu.gpus_per_node},
            "tp": self.tp, "ep": self.tp if self.ep else 1, "nodes": self.nodes, "scheme": self.scheme,
            "max_model_len": self.max_model_len, "max_num_seqs": self.max_num_seqs,
            "gpu_memory_utilization": self.utilization, "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_in_flight_tokens": self.max_in_flight_tokens, "block_size": self.block_size,
            "params": {"total": pc.total, "active": pc.active, "routed_experts": pc.routed_experts,
                       "active_experts": pc.active_experts, "embed": pc.embed, "lm_head": pc.lm_head,
                       "text_other": pc.text_other, "vision": pc.vision,
                       "active_counts": "text model with num_experts_per_tok of n_routed_experts, "
                                        "without the embedding tables"},
            "disk": {"total_bytes": w.disk_total, "computed_bytes": w.disk_total - w.disk_part("draft"),
                     "draft_bytes_recipe_figure": w.disk_part("draft"),
                     "by_part_format": [{"part": p, "format": f, "bytes": b} for (p, f), b in sorted(w.disk.items())]},
            "per_gpu": {"weights_bytes": w.per_gpu_total,
                        "weights_by_part": {p: w.per_gpu_part(p) for p in w.parts()},
                        "splits": {p: sorted(s) for p, s in w.splits.items()},
                        "requested_bytes": self.requested_bytes, "reserve_bytes": self.reserve_bytes,
                        "kv_budget_bytes": self.kv_budget_bytes, "kv_needed_bytes": self.kv_needed_bytes,
                        "kv_bytes_per_block": self.kv.bytes_per_block, "kv_mode": self.kv.mode,
                        "kv": self.kv_kinds(),
                        "kv_groups": [{"kind": g.spec.kind, "layers": g.num_layers, "block_size": g.spec.block_size,
                                       "page_size_bytes": g.spec.page_size_bytes} for g in self.kv.groups]},
            "checks": [{"level": c.level, "message": c.message} for c in self.checks],
            "fits": self.fits, "largest_max_model_len": self.largest_max_model_len,
            "max_concurrency": self.concurrency, "break_even_reserve_bytes": self.break_even_reserve_bytes,
            "verdict": self.verdict(),
        }


def plan(cfg: Inkling2Config, gpu: str = "gb200", tp: int = 4, *, ep: bool = True, max_model_len: int | None = None,
         max_num_seqs: int | None = None, utilization: float = DEFAULT_UTILIZATION,
         max_num_batched_tokens: int | None = None, concurrent_batches: int = ASYNC_BATCHES,
         scheme: str = "default", reserve_gib: float = DEFAULT_RESERVE_GIB, block_size: int = DEFAULT_BLOCK_SIZE,
         include_draft: bool = True) -> Plan:
    from .inkling2 import param_counts

    if gpu not in GPUS:
        raise UsageError(f"unknown --gpu {gpu!r}; known: {', '.join(GPUS)}")
    g = GPUS[gpu]
    if not 0 < utilization <= 1:
        raise UsageError(f"--gpu-memory-utilization must be in (0, 1], got {utilization}")
    batched = default_batched_tokens(g) if max_num_batched_tokens is None else max_num_batched_tokens
    for name, v in (("--max-num-batched-tokens", batched), ("--block-size", block_size),
                    ("concurrent batches", concurrent_batches), ("--max-num-seqs", max_num_seqs or 1)):
        if v < 1:
            raise UsageError(f"{name} must be positive, got {v}")
    if not 0 <= reserve_gib < 1e12:
        raise UsageError(f"--reserve-gib must be between 0 and 1e12, got {reserve_gib}")
    upper = cfg.text.max_position_embeddings
    length = upper if max_model_len is None else max_model_len
    if not 1 <= length <= upper:
        raise UsageError(f"--max-model-len must be between 1 and max_position_embeddings ({upper}), got {length}")
    check_parallel(cfg, tp)
    w = weight_bytes(cfg, scheme, tp, ep, include_draft)
    kv = kv_layout(layer_specs(cfg.text, tp, block_size), concurrent_batches * batched)
    return Plan(cfg=cfg, gpu=g, tp=tp, ep=ep, scheme=scheme, max_model_len=length, max_num_seqs=max_num_seqs,
                utilization=utilization, max_num_batched_tokens=batched, concurrent_batches=concurrent_batches,
                reserve_bytes=round(reserve_gib * GiB), include_draft=include_draft, block_size=block_size,
                params=param_counts(cfg), weights=w, kv=kv, checks=moe_checks(cfg, tp, ep, set(w.fmt_layers)))


# --------------------------------------------------------------------------- the recipe's figures
def recipe_rows(cfg: Inkling2Config, p: Plan) -> list[dict]:
    """The recipe's figures beside ours. The verdicts are planned on p's GPU with p's assumptions
    (utilization, reserve, batching, block size, scheme), at the recipe's TP and lengths."""
    opts = dict(gpu=p.gpu.name, utilization=p.utilization, max_num_batched_tokens=p.max_num_batched_tokens,
                concurrent_batches=p.concurrent_batches, scheme=p.scheme, reserve_gib=p.reserve_bytes / GiB,
                block_size=p.block_size, include_draft=True)
    upper = cfg.text.max_position_embeddings
    tp4 = plan(cfg, tp=4, max_model_len=upper, **opts)
    tp8 = plan(cfg, tp=8, max_model_len=upper, **opts)
    short = plan(cfg, tp=4, max_model_len=min(262_144, upper), **opts)
    disk = tp4.weights.disk_total
    vram = math.ceil(VRAM_RULE_OF_THUMB * disk / GB)
    pc = p.params
    gpu = p.gpu.name.upper()

    def verdict(q: Plan) -> str:
        return (f"{'fits' if q.fits else 'does not fit'}: needs {_gib(q.kv_needed_bytes)} of "
                f"{_gib(q.kv.usable(q.kv_budget_bytes))} GiB, break-even reserve {_gib(q.break_even_reserve_bytes)} GiB")

    return [
        _row("total parameters", "594B", f"{pc.total / 1e9:.2f} B", abs(pc.total / RECIPE_TOTAL_PARAMS - 1) < 0.005),
        _row("active parameters", "17B", f"{pc.active / 1e9:.2f} B (text, 8/384 experts, no embedding tables)",
             abs(pc.active / RECIPE_ACTIVE_PARAMS - 1) < 0.005),
        _row("on disk, default variant, incl. draft", "~393 GB",
             f"{_gb(disk - round(RECIPE_DRAFT_GB * GB))} GB computed + {RECIPE_DRAFT_GB} GB draft (recipe's figure) "
             f"= {_gb(disk)} GB", abs(disk / GB - RECIPE_DISK_GB) < 0.5),
        _row("vram_minimum_gb", f"{RECIPE_VRAM_MINIMUM_GB}", f"ceil({VRAM_RULE_OF_THUMB} x {_gb(disk)}) = {vram} "
             f"(our reading of the rule)", vram == RECIPE_VRAM_MINIMUM_GB),
        _row(f"KV cache for {upper:,} tokens at TP4", f"{RECIPE_KV_1M_TP4_GIB} GiB",
             f"{_gib(tp4.kv_needed_bytes)} GiB", _gib(tp4.kv_needed_bytes) == RECIPE_KV_1M_TP4_GIB),
        _row(f"{upper:,} tokens at TP4 ({gpu})", "does not fit", verdict(tp4), not tp4.fits),
        _row(f"{upper:,} tokens at TP8 ({gpu})", "fits", verdict(tp8), tp8.fits),
        _row(f"{min(262_144, upper):,} tokens at TP4 ({gpu})", "fits", verdict(short), short.fits),
        # the same verdicts with the KV requirement the recipe reports instead of ours (an
        # explicit assumption: its figure taken as given, as the draft's size is)
        *(_row(f"{q.max_model_len:,} tokens at TP{q.tp} ({gpu}), recipe's KV", want, recipe_verdict(q),
               recipe_fits(q) == (want == "fits")) for q, want in ((tp4, "does not fit"), (tp8, "fits"),
                                                                   (short, "fits"))),
    ]


def recipe_kv_bytes(q: Plan) -> int:
    """The KV one request needs per GPU if the recipe's figure is right: its 64.47 GiB for
    1,048,576 tokens at TP4 (vLLM's message in its troubleshooting entry), scaled with the
    context length and inversely with TP (KV heads split over TP). Not derived from the config."""
    return round(float(RECIPE_KV_1M_TP4_GIB) * GiB * q.max_model_len / RECIPE_KV_TOKENS * RECIPE_KV_TP / q.tp)


def recipe_fits(q: Plan) -> bool:
    return q.loadable and recipe_kv_bytes(q) <= q.kv.usable(q.kv_budget_bytes)


def recipe_verdict(q: Plan) -> str:
    return (f"{'fits' if recipe_fits(q) else 'does not fit'}: needs {_gib(recipe_kv_bytes(q))} (the recipe's "
            f"figure, scaled) of {_gib(q.kv.usable(q.kv_budget_bytes))} GiB")


def _row(claim: str, recipe: str, ours: str, reproduced: bool) -> dict:
    return {"claim": claim, "recipe": recipe, "ours": ours, "reproduced": bool(reproduced)}


# --------------------------------------------------------------------------- output
def _gib(n: int) -> str:  # as vLLM's format_gib prints it
    return f"{n / GiB:.2f}"


def _gb(n: int) -> str:  # decimal, as the recipe's GB
    return f"{n / GB:.2f}"


def _split_label(splits: set, tp: int) -> str:
    return ", ".join(s if s.startswith(("EP", "TP")) or s == REPLICATED else f"{s} 1/{tp}" for s in sorted(splits))


def render_weights(p: Plan) -> list[str]:
    w = p.weights
    hdr = f"{'part':<11} {'elements':>9} {'format':<15} {'disk GB':>8}  {'split at TP' + str(p.tp):<35} {'GiB/GPU':>7}"
    out = [hdr, "-" * len(hdr)]
    for part in w.parts():
        fmts = sorted((f, b) for (q, f), b in w.disk.items() if q == part)
        for j, (f, b) in enumerate(fmts):
            layers = w.fmt_layers.get(f) if part == "expert" else None
            label = f"{f} {layers[0]}-{layers[-1]}" if layers else f
            elems = "(recipe)" if part == "draft" else f"{w.elements[part] / 1e9:.3f}B"
            out.append(f"{part if j == 0 else '':<11} {elems if j == 0 else '':>9} {label:<15} {_gb(b):>8}  "
                       f"{_split_label(w.splits[part], p.tp) if j == 0 else '':<35} {_gib(w.per_gpu[(part, f)]):>7}")
    out += ["-" * len(hdr), f"{'total':<11} {'':>9} {'':<15} {_gb(w.disk_total):>8}  {'':<35} {_gib(w.per_gpu_total):>7}"]
    return out


def render_kv(p: Plan) -> list[str]:
    kinds = p.kv_kinds()
    names = {FULL: "full attention", SLIDING: "sliding window", CONV: "short-conv state"}
    out = [f"KV cache and state per GPU (vLLM 0.33 Inkling specs on Inkling 2 shapes; BF16; block {p.block_size}; "
           f"{p.max_in_flight_tokens:,} tokens in flight = {p.concurrent_batches} x max_num_batched_tokens "
           f"{p.max_num_batched_tokens:,}):"]
    for kind, k in kinds.items():
        spec = "FullAttentionSpec" if kind == FULL else f"SlidingWindowSpec(window {k['sliding_window']})"
        unit = "B/token/layer" if kind != CONV else "B/state/layer"
        width = f"K+V {k['head_size']}" if k["head_size_v"] else f"packed {k['head_size']}"
        out.append(f"  {names[kind]:<16} {k['layers']:>2} layers  {spec:<29} {k['num_kv_heads_per_rank']} heads x "
                   f"{width:<11}  {k['bytes_per_token_per_layer']:>6,} {unit}  page "
                   f"{k['page_size_bytes']:,} (block {k['block_size']})  request {_gib(k['request_bytes'])} GiB")
    groups: dict[str, int] = defaultdict(int)
    for g in p.kv.groups:
        groups[g.spec.kind] += 1
    out.append(f"  {p.kv.mode} pool: " + " + ".join(f"{n} {k}" for k, n in groups.items()) +
               f" group(s), {p.kv.bytes_per_block:,} B per block")
    out.append(f"  one {p.max_model_len:,}-token request needs {_gib(p.kv_needed_bytes)} GiB per GPU")
    out.append(f"  {p.gpu.name.upper()} memory.total {_gib(p.gpu.total_bytes)} GiB ({p.gpu.vendor_gb} GB, "
               f"{p.gpu.source}) x {p.utilization} = {_gib(p.requested_bytes)} GiB - weights "
               f"{_gib(p.weights.per_gpu_total)} GiB - reserve {_gib(p.reserve_bytes)} GiB = KV budget "
               f"{_gib(p.kv_budget_bytes)} GiB")
    out.append(f"  largest --max-model-len that fits: {p.largest_max_model_len:,}; concurrent "
               f"{p.max_model_len:,}-token requests: {p.concurrency:.2f}")
    return out


def render(p: Plan, rows: list[dict] | None = None) -> str:
    pc = p.params
    out = [f"inkling-quant plan: scheme {p.scheme!r}, {p.where()}, TP{p.tp} attention + "
           f"{f'EP{p.tp}' if p.ep else f'TP{p.tp} (no EP)'} experts, max_model_len {p.max_model_len:,}", "",
           f"Parameters: {pc.total / 1e9:.2f} B total (vision {pc.vision / 1e9:.2f} B), {pc.active / 1e9:.2f} B active "
           f"(text model, {p.cfg.text.num_experts_per_tok} of {p.cfg.text.n_routed_experts} experts, without the "
           f"embedding tables)", ""]
    out += render_weights(p)
    w = p.weights
    draft = w.disk_part("draft")
    out.append(f"On disk: {_gb(w.disk_total - draft)} GB computed" + (
        f" + {_gb(draft)} GB DSpark draft (the recipe's figure: its definition is not published; assumed "
        f"replicated on every GPU) = {_gb(w.disk_total)} GB" if draft else " (without the draft)"))
    out.append("")
    out += render_kv(p)
    out.append(f"  reserve (--reserve-gib, default {DEFAULT_RESERVE_GIB:g}): activations at max_num_batched_tokens, "
               f"sampler logits, CUDA graphs, NCCL/kernel workspaces, the draft's KV cache and activations "
               f"(docs/budget.md)")
    if p.checks:
        out.append("")
        out += [f"{c.level.upper()}: {c.message}" for c in p.checks]
    out += ["", p.verdict()]
    if rows:
        out += ["", "The recipe's figures (Inkling-2-Small.recipe.json) beside ours:",
                f"  {'claim':<52} {'recipe':<13} {'reproduced':<11} ours"]
        out += [f"  {r['claim']:<52} {r['recipe']:<13} {'yes' if r['reproduced'] else 'NO':<11} {r['ours']}"
                for r in rows]
    return "\n".join(out)
