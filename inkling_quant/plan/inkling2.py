"""Plan a vLLM deployment of Inkling 2: parameters, bytes on disk, weights, KV cache and state per
GPU, the engine checks (`moe_checks`), verdict, and the serving recipe's figures beside ours; the
two official checkpoints (`VARIANTS`: `--variant default|mxfp8`) or what a `--scheme` converts.

The library behind `inkling-quant plan` (its CLI and rendering: `cli.plan`), answering from
config.json alone (the published `Inkling2Config`; default: the reference config, Inkling2Config's
defaults); no tensor is read. A standard Hugging Face MoE config (Qwen3-MoE, Mixtral, DeepSeek-V3,
...) is planned the same way from `plan.hf` (its tensors, parameters and bytes) and
`kvcache.hf_layer_specs`; `load_config` decides which. `placement` holds what both share: how a
tensor splits over TP/EP and the `Weights` tally. docs/budget.md derives every figure and
states every assumption; for Inkling 2, in short:

* parameters as transformers counts them (the model's `inkling2.param_counts`): active = the text model with
  8 of 384 routed experts, without the embedding tables;
* disk: the scheme's format for every routed-expert projection (`formats`' own byte counts; an
  official checkpoint's stacked as it stores them, `release_expert_bytes`), every other tensor as
  stored; the DSpark draft is not published, so its size is the recipe's 3.2 GB figure, labeled as
  such, never computed;
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
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import UsageError
from .hf import HFModel, is_hf_moe
from .hf import check_parallel as hf_check_parallel
from .hf import param_counts as hf_param_counts
from .hf import weight_bytes as hf_weight_bytes
from . import deepseek_v4, kimi_k3
from .kvcache import DEFAULT_BLOCK_SIZE, KINDS, KVLayout, hf_layer_specs, kv_layout, layer_specs, packed_layout
from .moe_checks import ARCHS, ENGINE, FAIL, Check, moe_checks
from .placement import (HEADS, HIDDEN, KV_HEADS, REPLICATED, VOCAB, Weights, add_experts,  # noqa: F401
                        module_expert_bytes, rank_bytes)
from ..units import GB, GiB, MiB, cdiv
from .units import in_units

if TYPE_CHECKING:
    from ..model.inkling2 import Inkling2Config, ParamCounts

# inkling2, schemes and formats import torch (seconds): imported where they compute, so that
# `inkling-quant plan --help` answers at once.


# --------------------------------------------------------------------------- GPUs
@dataclass(frozen=True)
class GPU:
    name: str
    vendor_gb: int        # the capacity the spec page (or the recipe) prints: a label
    total_mib: int        # nvidia-smi memory.total: what we compute with
    gpus_per_node: int    # per HGX node or per NVL72 compute tray
    node: str
    source: str           # where vendor_gb comes from
    arch: str             # moe_checks.ARCHS: the compute capability vLLM's MoE kernels ask for

    @property
    def total_bytes(self) -> int:
        return self.total_mib * MiB


# memory.total as the driver reports it (several public nvidia-smi logs; docs/budget.md). The
# recipe itself gives only B200's figure ("NVIDIA B200 SXM 180 GB", vram_gb 1440 for 8).
GPUS: dict[str, GPU] = {g.name: g for g in (
    GPU("h100", 80, 81559, 8, "HGX node", "NVIDIA spec page", "sm90"),
    GPU("h200", 141, 143771, 8, "HGX node", "NVIDIA spec page", "sm90"),
    GPU("b200", 180, 183359, 8, "HGX node", "the recipe's hardware_profile", "sm100"),
    GPU("gb200", 186, 189471, 4, "NVL72 compute tray", "NVIDIA spec page; not in the recipe", "sm100"),
    GPU("b300", 288, 275040, 8, "HGX node", "NVIDIA spec page", "sm103"),
    GPU("gb300", 288, 284208, 4, "NVL72 compute tray", "NVIDIA spec page", "sm103"),
)}

DEFAULT_UTILIZATION = 0.9     # vLLM's gpu_memory_utilization default
# Per-GPU memory vLLM's profiler charges besides weights, and what we do not model: activation
# peak at max_num_batched_tokens, the sampler's and rejection sampler's fp32 logits (256 seqs x 8
# tokens x 201,024 x 4 B = 1.53 GiB per copy), CUDA graph pools, NCCL / all-reduce / FlashInfer
# workspaces, and the DSpark draft's KV cache and activations (its config is not published).
# docs/budget.md, "The reserve", sizes each; 12 GiB is our assumption, not a measurement.
DEFAULT_RESERVE_GIB = 12.0
ASYNC_BATCHES = 2             # VllmConfig.max_concurrent_batches with async scheduling (the default)
VRAM_RULE_OF_THUMB = 1.2      # the recipe's vram_minimum_gb = ceil(1.2 x checkpoint GB): our reading


def default_batched_tokens(gpu: GPU) -> int:
    """vLLM's OpenAI-server default max_num_batched_tokens (engine/arg_utils.py:2973-2992):
    16384 on GPUs with >= 160 GiB, 8192 on H100/H200-class (>= 70 GiB), else 2048."""
    return 16384 if gpu.total_bytes >= 160 * GiB else 8192 if gpu.total_bytes >= 70 * GiB else 2048


# What the recipe states (its Inkling-2-Small.recipe.json), for the comparison table.
RECIPE_TOTAL_PARAMS = 594e9
RECIPE_ACTIVE_PARAMS = 17e9
RECIPE_DISK_GB = 393            # "~393 GB on disk including the 3.2 GB DSpark draft"
RECIPE_DRAFT_GB = 3.2           # the draft's definition is not published: this figure is the recipe's
RECIPE_VRAM_MINIMUM_GB = 473
RECIPE_KV_1M_TP4_GIB = "64.47"  # the troubleshooting entry quotes vLLM's message
RECIPE_KV_TOKENS, RECIPE_KV_TP = 1_048_576, 4  # ... for one max-length request at TP4
M = 1_048_576
COOKBOOK = "SGLang's Inkling 2 Small cookbook"  # docs.sglang.io/cookbook/autoregressive/ThinkingMachines/Inkling-2-Small


# --------------------------------------------------------------------------- the official checkpoints
@dataclass(frozen=True)
class Variant:
    """An official Inkling 2 Small checkpoint: which format each layer's routed experts are stored
    in (a scheme of `schemes.SCHEMES`), in the stacked form of the original names, beside the
    published figures for it (SGLang's cookbook; the recipe gives the default's disk size too)."""

    name: str
    repo: str
    scheme: str
    cookbook_disk_gb: int         # "about 394 GB" / "about 623 GB"
    cookbook_tp4_gb: int          # "at TP4 its weights take about 151 GB per GPU, against 94 GB"
    experts: str


VARIANTS: dict[str, Variant] = {v.name: v for v in (
    Variant("default", "thinkingmachines/Inkling-2-Small", "default", 394, 94,
            "routed experts NVFP4 in layers 0-39 (packed e2m1, e4m3 scale per 16, per-expert fp32 amax and "
            "denominator), MXFP8 in layers 40-47 (e4m3, e8m0 scale per 32)"),
    Variant("mxfp8", "thinkingmachines/Inkling-2-Small-MXFP8", "mxfp8", 623, 151,
            "every routed expert MXFP8 (e4m3, e8m0 scale per 32)"),
)}


def release_expert_bytes(fmt, inter: int, hidden: int, dtype) -> int:
    """One routed expert's bytes as the official checkpoints store them: the stacked form of the
    original names (`export.inkling.stacked_specs` of one expert: w13 and w2 as the format writes
    them, NVFP4's global scale as a per-expert fp32 amax and denominator). No activation amax:
    whether the release stores one is not published (it would add 8 B per expert)."""
    from ..export.inkling import stacked_specs

    specs = stacked_specs(fmt, 1, inter, hidden, dtype=dtype, activation_scale=False)
    return sum(o.nbytes for o in specs.values())


# --------------------------------------------------------------------------- how tensors split
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
    from ..model.inkling2 import TEXT_PREFIX, VISION_PREFIX

    if name.startswith(VISION_PREFIX):
        return "vision", REPLICATED  # vLLM ViTs may shard by heads; replicated is the upper bound
    rel = name[len(TEXT_PREFIX):] if name.startswith(TEXT_PREFIX) else name
    for pattern, part, split in _TEXT_RULES:
        if pattern.fullmatch(rel):
            return part, split
    raise UsageError(f"no split rule for tensor {name!r}")  # pragma: no cover - inkling2 names only


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
def weight_bytes(cfg: Inkling2Config, scheme_name: str, tp: int, ep: bool = True,
                 include_draft: bool = True, expert_bytes=module_expert_bytes, draft_bytes: int | None = None) -> Weights:
    """Checkpoint bytes per (part, format), each format asked for its own size (routed experts:
    `expert_bytes`, the layout they are stored in), and the fullest rank's bytes at TP = tp
    (experts: EP = tp, or TP-sharded without EP). The draft: `draft_bytes` where a checkpoint's
    own draft tensors were counted, else the recipe's figure."""
    import torch

    from ..model.inkling2 import TEXT_PREFIX, checkpoint_tensors
    from ..model.tensors import TensorName
    from ..schemes import get_scheme

    scheme, t, w = get_scheme(scheme_name), cfg.text, Weights()
    for s in checkpoint_tensors(cfg, include_experts=False, include_draft=False):
        part, split = split_of(s.name)
        layer = int(m.group(1)) if (m := re.match(r"layers\.(\d+)\.", s.name[len(TEXT_PREFIX):])) else None
        fmt = scheme.format_for(t, TensorName(s.name, part, layer))
        nbytes = fmt.nbytes(s.shape, s.dtype)
        w.add(part, fmt.name, nbytes, rank_bytes(nbytes, s.shape[0], split, tp), s.numel, split)
    add_experts(w, t, scheme, range(t.num_hidden_layers), tp, ep, torch.bfloat16, expert_bytes)
    if include_draft:
        draft, where = (round(RECIPE_DRAFT_GB * GB), "recipe") if draft_bytes is None else (draft_bytes, "stored")
        w.disk[("draft", where)] += draft
        w.per_gpu[("draft", where)] += draft
        w.splits["draft"].add(REPLICATED)
    return w


# --------------------------------------------------------------------------- the plan
@dataclass
class ServingPlan:
    """One deployment's figures (a model, a GPU kind, TP/EP, lengths, memory): what `plan` returns,
    `plan.cli` renders and `--json` writes; named apart from lora's merge `Plan`."""

    cfg: Inkling2Config | HFModel
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
    hf: bool = False              # a standard HF MoE config (plan.hf), not Inkling 2's
    notes: tuple[str, ...] = ()   # what the plan assumes or leaves out, for this config
    variant: str | None = None    # the official checkpoint planned (VARIANTS), or None: `scheme` converted
    checkpoint: str | None = None  # the directory planned, whose experts are stored as `variant` stores them

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
        return not any(c.level == FAIL for c in self.checks)

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
            return (f"DOES NOT LOAD on {self.where()} with {ENGINE}: " +
                    "; ".join(c.message for c in self.checks if c.level == FAIL))
        reserve, needed = in_units(self.reserve_bytes, "GiB"), in_units(self.kv_needed_bytes, "GiB")
        if self.kv_budget_bytes <= 0:
            return (f"DOES NOT FIT on {self.where()}: the weights ({in_units(self.weights.per_gpu_total, 'GiB')} GiB "
                    f"per GPU) and the {reserve} GiB reserve exceed the {in_units(self.requested_bytes, 'GiB')} GiB "
                    f"that --gpu-memory-utilization {self.utilization} allows; raise --tp")
        if not self.fits:
            est = self.largest_max_model_len
            hint = f"Based on the available memory, the estimated maximum model length is {est}. " if est else ""
            return (f"DOES NOT FIT on {self.where()}: To serve at least one request with the model's max seq len "
                    f"({self.max_model_len}), ({needed} GiB KV cache is needed, which is larger than the available "
                    f"KV cache memory ({in_units(self.kv.usable(self.kv_budget_bytes), 'GiB')} GiB). "
                    f"{hint}Lower --max-model-len or raise --tp.")
        msg = (f"FITS on {self.where()}: one {self.max_model_len:,}-token request needs {needed} GiB of the "
               f"{in_units(self.kv_budget_bytes, 'GiB')} GiB KV budget per GPU; {self.concurrency:.2f} such requests "
               f"fit at once; it would stop fitting only past {in_units(self.break_even_reserve_bytes, 'GiB')} GiB of "
               f"non-weight overhead per GPU (assumed: {reserve} GiB)")
        if self.max_num_seqs is not None and self.concurrency < self.max_num_seqs:
            msg += f"; --max-num-seqs {self.max_num_seqs} full-length requests do not all fit at once"
        return msg

    def kv_kinds(self) -> dict[str, dict]:
        """Per kind of cache: layers, spec, bytes per token per layer on this GPU, and one
        max_model_len request's share of the pool."""
        needed = self.kv.bytes_by_kind(self.max_model_len)
        out = {}
        for kind in KINDS:
            specs = [s for s in self.kv.specs if s.kind == kind]
            if not specs:
                continue
            s = specs[0]
            out[kind] = {"layers": len(specs), "num_kv_heads_per_rank": s.num_kv_heads, "head_size": s.head_size,
                         "head_size_v": s.head_size_v, "block_size": s.block_size, "sliding_window": s.sliding_window,
                         "page_size_bytes": s.page_size_bytes, "bytes_per_token_per_layer": s.bytes_per_token,
                         "tokens_per_state": s.tokens_per_state, "state_bytes": s.state_size_bytes,
                         "state_blocks": s.state_blocks,
                         "request_bytes": needed.get(kind, 0)}
        return out

    def to_dict(self) -> dict:
        d = self._dict()
        if self.hf:
            d["params"]["active_counts"] = ("text model with num_experts_per_tok of the routed experts, without "
                                            "the embedding tables (embed, lm_head)")
            d["params"]["active_with_embedding_tables"] = self.params.active + self.params.embed + self.params.lm_head
        d["notes"] = list(self.notes)
        v = VARIANTS.get(self.variant) if self.variant else None
        d["variant"] = None if v is None else {"name": v.name, "repo": v.repo, "scheme": v.scheme,
                                               "experts": v.experts, "expert_layout": "stacked (original names)"}
        d["checkpoint"] = self.checkpoint
        return d

    def _dict(self) -> dict:
        w, pc = self.weights, self.params
        return {
            "model": self.cfg.raw.get("_name_or_path") or self.cfg.raw.get("model_type"),
            "gpu": {"name": self.gpu.name, "vendor_gb": self.gpu.vendor_gb, "vendor_gb_source": self.gpu.source,
                    "memory_total_bytes": self.gpu.total_bytes, "gpus_per_node": self.gpu.gpus_per_node,
                    "arch": self.gpu.arch, "generation": ARCHS[self.gpu.arch].generation},
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
                     "draft_bytes_recipe_figure": w.disk.get(("draft", "recipe"), 0),
                     "draft_bytes_in_checkpoint": w.disk.get(("draft", "stored"), 0),
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
            "engine": ENGINE, "checks": [c.to_dict() for c in self.checks],
            "fits": self.fits, "largest_max_model_len": self.largest_max_model_len,
            "max_concurrency": self.concurrency, "break_even_reserve_bytes": self.break_even_reserve_bytes,
            "verdict": self.verdict(),
        }


def load_config(path: str | None) -> Inkling2Config | HFModel:
    """The config `plan` plans for: a config.json or a directory holding one; Inkling 2's
    (`Inkling2Config`) or a standard HF MoE config (`plan.hf.HFModel`, which also reads a
    checkpoint directory's shard headers for the vision tower); default: the reference config."""
    from pathlib import Path

    from ..errors import ConfigError
    from ..model.inkling2 import Inkling2Config
    from ..io.checkpoint import CONFIG_NAME, read_json, safe_child

    if path is None:
        return Inkling2Config.reference()
    p = Path(path)
    cfg_path = safe_child(p, CONFIG_NAME) if p.is_dir() else p
    d = read_json(cfg_path, CONFIG_NAME, ConfigError)
    if is_hf_moe(d):
        return HFModel.from_config(d, str(cfg_path), p if p.is_dir() else None)
    return Inkling2Config.from_dict(d, str(cfg_path))


def plan(cfg: Inkling2Config | HFModel, gpu: str = "gb200", tp: int = 4, *, ep: bool = True,
         max_model_len: int | None = None, max_num_seqs: int | None = None, utilization: float = DEFAULT_UTILIZATION,
         max_num_batched_tokens: int | None = None, concurrent_batches: int = ASYNC_BATCHES,
         scheme: str | None = None, variant: str | None = None, reserve_gib: float = DEFAULT_RESERVE_GIB,
         block_size: int = DEFAULT_BLOCK_SIZE, include_draft: bool = True, notes: tuple[str, ...] = (),
         draft_bytes: int | None = None, checkpoint: str | None = None) -> ServingPlan:
    """The plan at TP = tp on `gpu`: of the official checkpoint `variant` (VARIANTS; Inkling 2
    only), or of the checkpoint `scheme` would convert; with neither, Inkling 2's default variant
    (a standard HF config: the default scheme). A standard HF config has no DSpark draft
    (include_draft is ignored for it). `notes` are added to the plan's own. `checkpoint`: the
    directory planned (its experts stored as `variant` stores them); `draft_bytes` its draft's
    bytes as its headers count them (None: the recipe's figure)."""
    from ..model.inkling2 import param_counts

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
    hf = not cfg.family.strict  # planned from the family's rules (plan.hf), not from a published spec
    variant, scheme = _variant_and_scheme(cfg, hf, variant, scheme)
    layout = kv_layout
    if hf:
        hf_check_parallel(cfg.text, tp)
        include_draft = False
        w, params = hf_weight_bytes(cfg, scheme, tp, ep), hf_param_counts(cfg)
        if cfg.text.v4 is not None:  # vLLM resolves its backends' block size (256) where none is given
            block_size = deepseek_v4.BLOCK if block_size == DEFAULT_BLOCK_SIZE else block_size
            specs, layout = deepseek_v4.kv_specs(cfg.text, block_size), packed_layout
        elif cfg.text.k3 is not None:  # the attention block vLLM aligns to the KDA state
            specs, block_size = kimi_k3.kv_specs(cfg.text, tp, block_size)
        else:
            specs = hf_layer_specs(cfg.text, tp, block_size)
    else:
        check_parallel(cfg, tp)
        form = release_expert_bytes if variant else module_expert_bytes
        w, params = weight_bytes(cfg, scheme, tp, ep, include_draft, form, draft_bytes), param_counts(cfg)
        specs = layer_specs(cfg.text, tp, block_size)
    kv = layout(specs, concurrent_batches * batched)
    return ServingPlan(cfg=cfg, gpu=g, tp=tp, ep=ep, scheme=scheme, max_model_len=length, max_num_seqs=max_num_seqs,
                utilization=utilization, max_num_batched_tokens=batched, concurrent_batches=concurrent_batches,
                reserve_bytes=round(reserve_gib * GiB), include_draft=include_draft, block_size=block_size,
                params=params, weights=w, kv=kv, hf=hf, variant=variant, checkpoint=checkpoint,
                checks=moe_checks(cfg, tp, ep, set(w.fmt_layers), recipe=not hf, arch=g.arch),
                notes=(cfg.notes if hf else ()) + tuple(notes))


def _variant_and_scheme(cfg, hf: bool, variant: str | None, scheme: str | None) -> tuple[str | None, str]:
    if variant is not None and scheme is not None:
        raise UsageError("give --variant (an official checkpoint) or --scheme (a conversion), not both")
    if variant is not None and hf:
        raise UsageError(f"--variant names an official Inkling 2 Small checkpoint; this is a {cfg.text.model_type!r} "
                         f"config: plan it with --scheme")
    if hf or scheme is not None:
        return None, scheme or "default"
    variant = variant or "default"
    if variant not in VARIANTS:
        raise UsageError(f"unknown --variant {variant!r}; known: {', '.join(VARIANTS)}")
    return variant, VARIANTS[variant].scheme


# --------------------------------------------------------------------------- the recipe's figures
def recipe_rows(cfg: Inkling2Config, p: ServingPlan) -> list[dict]:
    """The recipe's figures beside ours. Its checkpoint is the default variant; the verdicts are
    planned on p's GPU with p's assumptions (utilization, reserve, batching, block size), at the
    recipe's TP and lengths. SGLang's cookbook's figures: `plan.variants.cookbook_rows`."""
    opts = dict(gpu=p.gpu.name, utilization=p.utilization, max_num_batched_tokens=p.max_num_batched_tokens,
                concurrent_batches=p.concurrent_batches, variant="default", reserve_gib=p.reserve_bytes / GiB,
                block_size=p.block_size, include_draft=True)
    upper = cfg.text.max_position_embeddings
    tp4 = plan(cfg, tp=4, max_model_len=upper, **opts)
    tp8 = plan(cfg, tp=8, max_model_len=upper, **opts)
    short = plan(cfg, tp=4, max_model_len=min(262_144, upper), **opts)
    disk = tp4.weights.disk_total
    vram = math.ceil(VRAM_RULE_OF_THUMB * disk / GB)
    kv_tp4 = in_units(tp4.kv_needed_bytes, "GiB")
    pc = p.params
    gpu = p.gpu.name.upper()

    def verdict(q: ServingPlan) -> str:
        return (f"{'fits' if q.fits else 'does not fit'}: needs {in_units(q.kv_needed_bytes, 'GiB')} of "
                f"{in_units(q.kv.usable(q.kv_budget_bytes), 'GiB')} GiB, break-even reserve "
                f"{in_units(q.break_even_reserve_bytes, 'GiB')} GiB")

    return [
        _row("total parameters", "594B", f"{pc.total / 1e9:.2f} B", abs(pc.total / RECIPE_TOTAL_PARAMS - 1) < 0.005),
        _row("active parameters", "17B", f"{pc.active / 1e9:.2f} B (text, 8/384 experts, no embedding tables)",
             abs(pc.active / RECIPE_ACTIVE_PARAMS - 1) < 0.005),
        _row("on disk, default variant, incl. draft", "~393 GB",
             f"{in_units(disk - round(RECIPE_DRAFT_GB * GB), 'GB')} GB computed + {RECIPE_DRAFT_GB} GB draft "
             f"(recipe's figure) = {in_units(disk, 'GB')} GB", abs(disk / GB - RECIPE_DISK_GB) < 0.5),
        _row("vram_minimum_gb", f"{RECIPE_VRAM_MINIMUM_GB}",
             f"ceil({VRAM_RULE_OF_THUMB} x {in_units(disk, 'GB')}) = {vram} (our reading of the rule)",
             vram == RECIPE_VRAM_MINIMUM_GB),
        _row(f"KV cache for {upper:,} tokens at TP4", f"{RECIPE_KV_1M_TP4_GIB} GiB", f"{kv_tp4} GiB",
             kv_tp4 == RECIPE_KV_1M_TP4_GIB),
        _row(f"{upper:,} tokens at TP4 ({gpu})", "does not fit", verdict(tp4), not tp4.fits),
        _row(f"{upper:,} tokens at TP8 ({gpu})", "fits", verdict(tp8), tp8.fits),
        _row(f"{min(262_144, upper):,} tokens at TP4 ({gpu})", "fits", verdict(short), short.fits),
        # the same verdicts with the KV requirement the recipe reports instead of ours (an
        # explicit assumption: its figure taken as given, as the draft's size is)
        *(_row(f"{q.max_model_len:,} tokens at TP{q.tp} ({gpu}), recipe's KV", want, recipe_verdict(q),
               recipe_fits(q) == (want == "fits")) for q, want in ((tp4, "does not fit"), (tp8, "fits"),
                                                                   (short, "fits"))),
    ]


def recipe_kv_bytes(q: ServingPlan) -> int:
    """The KV one request needs per GPU if the recipe's figure is right: its 64.47 GiB for
    1,048,576 tokens at TP4 (vLLM's message in its troubleshooting entry), scaled with the
    context length and inversely with TP (KV heads split over TP). Not derived from the config."""
    return round(float(RECIPE_KV_1M_TP4_GIB) * GiB * q.max_model_len / RECIPE_KV_TOKENS * RECIPE_KV_TP / q.tp)


def recipe_fits(q: ServingPlan) -> bool:
    return q.loadable and recipe_kv_bytes(q) <= q.kv.usable(q.kv_budget_bytes)


def recipe_verdict(q: ServingPlan) -> str:
    return (f"{'fits' if recipe_fits(q) else 'does not fit'}: needs {in_units(recipe_kv_bytes(q), 'GiB')} (the "
            f"recipe's figure, scaled) of {in_units(q.kv.usable(q.kv_budget_bytes), 'GiB')} GiB")


def _row(claim: str, recipe: str, ours: str, reproduced: bool) -> dict:
    return {"claim": claim, "recipe": recipe, "ours": ours, "reproduced": bool(reproduced),
            "source": "the recipe (Inkling-2-Small.recipe.json)"}

