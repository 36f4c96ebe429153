"""Where a tensor's bytes land on the GPUs of a TP / EP deployment, for both plans (`plan.inkling2`
for Inkling 2, `plan.hf` for a standard HF MoE config): the kinds of split, the fullest rank's
bytes of one tensor, the routed experts' bytes per format, and the `Weights` tally they fill.
docs/budget.md, "Weights per GPU", cites vLLM for each split."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

from ..units import cdiv

REPLICATED, HEADS, KV_HEADS, HIDDEN, VOCAB = "replicated", "heads", "KV heads", "hidden", "vocab"
TP_SPLIT = "intermediate"     # a dense or shared-expert MLP: gate/up by columns, down by rows
VOCAB_PADDING = 64            # DEFAULT_VOCAB_PADDING_SIZE (vocab_parallel_embedding.py)


def rank_bytes(nbytes: int, rows: int, split: str, tp: int, kv_heads: int | None = None) -> int:
    """Bytes of one tensor on the fullest rank (TP divides heads, KV heads and hidden: checked;
    with fewer `kv_heads` than ranks, each rank holds one KV head)."""
    if split == REPLICATED:
        return nbytes
    if split == KV_HEADS and kv_heads is not None and kv_heads < tp:
        return nbytes // kv_heads
    if split == VOCAB:  # VocabParallelEmbedding / ParallelLMHead: pad to 64, ceil-divide the rows
        padded = cdiv(rows, VOCAB_PADDING) * VOCAB_PADDING
        return nbytes // rows * cdiv(padded, tp)
    return cdiv(nbytes, tp)


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
        return sorted({p for p, _ in self.disk}, key=lambda p: (-self.disk_part(p), p))  # ties by name: stable

    def add(self, part: str, fmt: str, nbytes: int, rank: int, elements: int, split: str) -> None:
        self.disk[(part, fmt)] += nbytes
        self.per_gpu[(part, fmt)] += rank
        self.elements[part] += elements
        self.splits[part].add(split)


def module_expert_bytes(fmt, inter: int, hidden: int, dtype) -> int:
    """One expert's bytes in ModelOpt's per-module form (what `convert --output-format modelopt-hf`
    writes): each projection as the format writes it, its per-tensor scales included."""
    shapes = ((inter, hidden), (inter, hidden), (hidden, inter))
    return sum(fmt.nbytes(shape, dtype) for shape in shapes)


def add_experts(w: Weights, text, scheme, layers, tp: int, ep: bool, dtype,
                expert_bytes: Callable = module_expert_bytes, kept=None, min_rank_width: int = 0) -> None:
    """The routed experts of `layers` into `w`, each layer in the format the scheme names for it
    (where it leaves them alone and a quantized source stores them in `kept`, that format),
    `expert_bytes(fmt, width, hidden, dtype)` bytes per expert (the format asked for its own size,
    in the checkpoint's layout; `dtype`: what passthrough stores). Per rank: whole experts with
    EP (the fullest rank cdiv(E, EP): vLLM's expert map, Inkling's moe.py:440,
    fused_moe/expert_map_manager.py:67-69), else every expert's intermediate dim / TP, padded up
    to `min_rank_width` where the model pads it so (Kimi-K3)."""
    from ..model.tensors import TensorName

    H, inter, n = text.expert_hidden, text.moe_intermediate_size, text.n_routed_experts
    for i in layers:
        fmt = scheme.format_for(text, TensorName(f"layers.{i}.mlp.experts", "expert", i))
        fmt = kept if kept is not None and fmt.name == "passthrough" else fmt
        per_expert = expert_bytes(fmt, inter, H, dtype)
        padded = min_rank_width * tp if inter // tp < min_rank_width else inter
        on_rank = per_expert * cdiv(n, tp) if ep else _tp_expert_bytes(
            fmt, expert_bytes, padded, H, expert_bytes(fmt, padded, H, dtype), tp, dtype) * n
        w.add("expert", fmt.name, per_expert * n, on_rank, 3 * H * inter * n, f"EP{tp}" if ep else "TP intermediate")
        w.fmt_layers[fmt.name].append(i)


def _tp_expert_bytes(fmt, expert_bytes: Callable, inter: int, H: int, per_expert: int, tp: int, dtype) -> int:
    if inter % tp == 0:
        try:
            return expert_bytes(fmt, inter // tp, H, dtype)
        except Exception:  # noqa: BLE001 - a rank slice the format cannot hold: the checks say so
            pass
    return cdiv(per_expert, tp)
