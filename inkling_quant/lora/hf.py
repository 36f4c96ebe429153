"""Where an adapter's modules are in a Hugging Face MoE checkpoint (layout.py, docs/layout.md):
the layout's side of the plan (plan.py) for the families `layout.detect` knows.

PEFT names modules as the transformers model holds them in memory (`model.layers.N.self_attn.
q_proj`, `model.language_model.layers.N...` for a multimodal model); save_pretrained writes the
same names except where the family's conversion mapping renames them (Mixtral's in-memory
`mlp.experts` / `mlp.gate` are `block_sparse_moe.experts.E.w1` / `block_sparse_moe.gate` on
disk). Names are matched below the text prefix: the adapter's `<any text prefix>layers.N.<rest>`
is the checkpoint's `<detected prefix>layers.N.<rest>`.

Mergeable (docs/lora.md says why): the attention projections (ATTENTION_PROJECTIONS, DeepSeek's
MLA ones included), the dense MLPs' and shared experts' gate/up/down_proj (nn.Linears, BF16 in
the source and in ModelOpt's export alike), and, when they are BF16, the routed experts. In
memory transformers (5.x) holds every family's routed experts stacked, [E, 2I, H] gate_up_proj
([gate; up]) and [E, H, I] down_proj, which PEFT reaches by `target_parameters`; the checkpoint
keeps them per expert (gate_proj/up_proj/down_proj or w1/w3/w2: each expert's delta split into
its gate and up halves) or stacked as in memory (Qwen3-VL-MoE as save_pretrained writes it).
Experts stacked [E, in, out] (the Hub's Qwen3-VL-MoE, Llama 4) are refused for expert adapters:
whether PEFT's delta must be transposed for them depends on the family's in-memory layout.
"""
from __future__ import annotations

import re
from dataclasses import replace
from typing import Iterable, Iterator

from ..errors import CheckpointError, ConfigError
from ..io.safetensors import Header
from ..model.layout import TEXT_PREFIXES, Layout, MoEConfig, detect
from ..model.storage import stacked_orientation
from ..model.tensors import TensorName
from .target import Piece

ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj",
                         "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")  # DeepSeek's MLA
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")  # dense MLPs and shared experts
MERGEABLE_PARTS = ("attention", "dense_mlp", "shared_expert", "expert")
_LINEAR_PARTS = {"attention": ATTENTION_PROJECTIONS, "dense_mlp": MLP_PROJECTIONS, "shared_expert": MLP_PROJECTIONS}
_READS_HIDDEN = {"q_proj", "k_proj", "v_proj", "q_a_proj", "kv_a_proj_with_mqa", "gate_proj", "up_proj"}
MERGEABLE = (f"the decoder's attention projections ({', '.join(ATTENTION_PROJECTIONS)}), the dense MLPs' and shared "
             f"experts' {'/'.join(MLP_PROJECTIONS)} and, when they are BF16, the routed experts (target_parameters "
             f"mlp.experts.gate_up_proj, mlp.experts.down_proj)")
EXPERT_RULE = ("(adding a BF16 delta to quantized weights would be a dequantize-add-requantize with new scales, "
               "not a merge)")
_IN_LAYER = re.compile(r"layers\.(?P<layer>\d+)\.(?P<rest>.+)")
_PER_EXPERT_MODULE = re.compile(r"\.experts\.\d+\.")  # transformers 4's per-expert Linears


def _split(name: str) -> tuple[str, int, str] | None:
    """(text prefix, layer, rest) of a decoder-layer name under any known text prefix."""
    for p in TEXT_PREFIXES:
        if name.startswith(p) and (m := _IN_LAYER.fullmatch(name[len(p):])):
            return p, int(m["layer"]), m["rest"]
    return None


class HFNaming:
    """A Hugging Face MoE checkpoint's answers to the plan's questions (the interface of
    inkling.Inkling2Naming), from its detected layout."""

    parts = MERGEABLE_PARTS
    mergeable_text = MERGEABLE
    expert_rule = EXPERT_RULE

    def __init__(self, cfg: MoEConfig, weight_map: dict[str, str], headers: dict[str, Header], source: str):
        self.cfg, self.weight_map, self.headers = cfg, weight_map, headers
        self.lay: Layout = detect(list(weight_map), cfg, source)
        self.num_layers, self.hidden_size = cfg.num_hidden_layers, cfg.hidden_size
        self.layout = f"this {cfg.model_type} checkpoint ({self.lay.describe()})"
        self.example = f"{self.lay.text_prefix}layers.0.self_attn.q_proj"
        # in memory every family's experts are `mlp.experts` (Llama 4: `feed_forward.experts`)
        self.memory_block = "feed_forward" if self.lay.experts.block == "feed_forward" else "mlp"
        self.source = source

    def _shape(self, name: str) -> tuple[int, ...]:
        shard = self.weight_map.get(name)
        return tuple(self.headers[shard].tensors[name].shape) if shard is not None else ()

    def is_experts_module(self, module: str) -> bool:
        return module.endswith((f".{self.memory_block}.experts", f".{self.lay.experts.block}.experts"))

    def pieces(self, module: str, param: str | None) -> list[Piece] | None:
        """The checkpoint tensor(s) of adapter module `module` (its expert parameter `param`)."""
        split, prefix = _split(module), self.lay.text_prefix
        if param is not None:
            return self._expert_pieces(split[1], param) if split and self.is_experts_module(module) else None
        if split is None:  # outside the decoder layers: under its own name, or the checkpoint's text prefix
            cands = [module] + [prefix + module[len(p):] for p in TEXT_PREFIXES if module.startswith(p)][:1]
        else:
            rest = split[2]
            cands = [f"{prefix}layers.{split[1]}.{rest}"]
            if rest.startswith(f"{self.memory_block}.") and self.lay.experts.block != self.memory_block:
                cands.append(f"{prefix}layers.{split[1]}.{self.lay.experts.block}.{rest[len(self.memory_block) + 1:]}")
        cands = [c + ".weight" for c in cands]
        return [Piece(next((c for c in cands if c in self.weight_map), cands[0]))]

    def _expert_pieces(self, layer: int, param: str) -> list[Piece]:
        s = self.lay.experts
        base = f"{self.lay.text_prefix}layers.{layer}.{s.block}.experts"
        if s.stacked:  # transformers' gate_up_proj/down_proj (detect gives Inkling's w13/w2 to Inkling 2 alone)
            self._check_orientation(base)
            return [Piece(f"{base}.{param}")]
        gate, up, down = s.names
        n = self.cfg.num_experts
        if param == "gate_up_proj":
            return [Piece(f"{base}.{e}.{name}.weight", n, e, half) for e in range(n)
                    for half, name in ((0, gate), (1, up))]
        return [Piece(f"{base}.{e}.{down}.weight", n, e) for e in range(n)]

    def _check_orientation(self, base: str) -> None:
        """Refuse expert adapters on experts stacked [E, in, out]: PEFT's delta has the layout
        transformers holds the parameter in, which the checkpoint does not tell (transformers
        transposes the Hub's Qwen3-VL-MoE to [E, out, in] on load, and keeps Llama 4's as stored)."""
        down, gate_up = self._shape(f"{base}.down_proj"), self._shape(f"{base}.gate_up_proj")
        if stacked_orientation(down, gate_up, self.cfg.hidden_size, self.cfg.expert_width) is not False:
            raise ConfigError(
                f"expert adapter: the routed experts {base}.gate_up_proj {list(gate_up)} / down_proj "
                f"{list(down)} are not stacked [E, out, in] (config.json: hidden_size {self.cfg.hidden_size}, "
                f"expert width {self.cfg.expert_width}). PEFT's delta has the layout transformers holds them in, "
                f"which for [E, in, out] storage depends on the family (transformers transposes the Hub's "
                f"Qwen3-VL-MoE on load and keeps Llama 4's). Merge into experts stacked [E, out, in] (as "
                f"save_pretrained writes them) or stored per expert, or use an attention-only adapter here",
                path=self.source)

    def classify(self, tensor: str) -> TensorName | None:
        try:
            t = self.lay.classify(tensor)
        except CheckpointError:
            return None
        if t.part in _LINEAR_PARTS and t.suffix == "weight":  # the Linear's own name, e.g. q_proj
            t = replace(t, projection=t.module.rsplit(".", 1)[-1])
        return t

    @staticmethod
    def mergeable(t: TensorName) -> bool:
        return t.part == "expert" or (t.suffix == "weight" and t.projection in _LINEAR_PARTS.get(t.part, ()))

    def experts_module(self, layer: int) -> str:
        return f"{self.lay.text_prefix}layers.{layer}.{self.lay.experts.block}.experts"

    @staticmethod
    def reads_hidden(t: TensorName, param: str | None) -> bool:
        """Whether lora_A's columns are the hidden size (the projections that read the residual)."""
        return param == "gate_up_proj" or (param is None and t.projection in _READS_HIDDEN)

    def is_linear(self, module: str) -> bool:
        """For target_modules="all-linear": a 2-D weight that is not an embedding or the LM head
        (PEFT excludes the output layer)."""
        name = self.pieces(module, None)[0].tensor
        t = self.classify(name)
        return t is not None and t.part not in ("embed", "lm_head") and len(self._shape(name)) == 2

    def selectable(self, adapter_modules: Iterable[str]) -> Iterator[tuple[str, TensorName, bool]]:
        """(PEFT key, TensorName, is an expert parameter) of every checkpoint weight an adapter
        can name, as this adapter names them: its own text prefix, the in-memory block names, and
        routed experts as transformers 5 holds them (`mlp.experts.gate_up_proj`, a parameter) or,
        for an adapter trained on transformers 4's per-expert Linears, as the checkpoint does."""
        modules = list(adapter_modules)
        found = [s[0] for s in map(_split, modules) if s]
        ours = self.lay.text_prefix
        prefix = max(set(found), key=found.count) if found else ours
        per_expert = any(_PER_EXPERT_MODULE.search(m) for m in modules)
        for tensor in self.weight_map:
            t = self.classify(tensor)
            if t is None or t.suffix != "weight":
                continue
            if t.part == "expert" and not per_expert:
                param = "down_proj" if t.projection == "down" else "gate_up_proj"
                yield f"{prefix}layers.{t.layer}.{self.memory_block}.experts.{param}", t, True
                continue
            module = t.module
            if (s := _split(module)) and s[0] == ours:
                rest = s[2]
                if t.part != "expert" and rest.startswith(f"{self.lay.experts.block}."):
                    rest = f"{self.memory_block}.{rest[len(self.lay.experts.block) + 1:]}"
                module = f"{prefix}layers.{s[1]}.{rest}"
            elif t.part in ("embed", "other") and module.startswith(ours):  # the text model's, outside layers
                module = prefix + module[len(ours):]
            yield module, t, False
