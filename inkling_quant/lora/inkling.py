"""Where an adapter's modules are in an Inkling 2 checkpoint (inkling2.py, docs/layout.md): the
layout's side of the plan (plan.py), for the published Inkling 2 layout.

The adapter is what PEFT writes for transformers' Inkling2ForConditionalGeneration (module names
`model.language_model.layers.N...`) or Inkling2ForCausalLM (`model.layers.N...`); the checkpoint
holds the original names (`model.llm.layers.N.attn.wq_du.weight`, stacked experts). A PEFT module
is mapped to its checkpoint tensor with `inkling2.original_name`, the one home for names.

Mergeable (docs/lora.md says why): the attention projections, every nn.Linear of the attention
(ATTENTION_PROJECTIONS), from `target_modules`; the routed experts, from `target_parameters`
(`mlp.experts.gate_up_proj` / `down_proj`), when they are BF16: the checkpoint's w13 rows
interleave gate and up (row 2j gate j, 2j+1 up j) where transformers' gate_up_proj has
[gate; up], so B's rows are interleaved before the product (target.merged_expert).
"""
from __future__ import annotations

from typing import Iterable, Iterator

from ..model import dspark
from ..errors import UnknownTensorError
from ..model.inkling2 import Inkling2Config, classify, experts_module, original_name, transformers_name
from ..model.tensors import TensorName
from .target import Piece

# The attention nn.Linears of Inkling 2 (original names), all mergeable: q/k/v/r are vLLM's packed
# `qkvr` LoRA module and wo_ud its `wo_ud`; gate_attn and attn_sink_proj are Inkling 2's own
# (no vLLM LoRA module exists for them yet), merged like the others: a merge needs no LoRA kernel.
ATTENTION_PROJECTIONS = ("wq_du", "wk_dv", "wv_dv", "wr_du", "wo_ud", "gate_attn", "attn_sink_proj")
MERGEABLE_PARTS = ("attention", "expert")  # the parts (inkling2.classify) LoRA merges into
MERGEABLE = (f"the decoder's attention projections ({', '.join(ATTENTION_PROJECTIONS)}) and, when they are BF16, "
             f"the routed experts (target_parameters mlp.experts.gate_up_proj, mlp.experts.down_proj)")
EXPERT_RULE = ("(the Inkling 2 Small recipe: 'with the NVFP4/MXFP8 experts, use attention-only adapters')")
_TEXT_ONLY, _FULL = "model.layers.", "model.language_model.layers."  # Inkling2ForCausalLM vs ...ConditionalGeneration


def _original(name: str) -> str:
    """A checkpoint tensor's original name (itself where it is one already, or has none)."""
    for to_original in (lambda n: classify(n) and n, original_name):
        try:
            return to_original(name)
        except UnknownTensorError:
            continue
    return name


def hf_module(module: str) -> str:
    """`module` as Inkling2ForConditionalGeneration names it (a text-only model's `model.layers.`
    is its `model.language_model.layers.`)."""
    return _FULL + module[len(_TEXT_ONLY):] if module.startswith(_TEXT_ONLY) else module


class Inkling2Naming:
    """The Inkling 2 layout's answers to the plan's questions (the same interface as hf.HFNaming)."""

    layout = "the Inkling 2 layout"
    parts = MERGEABLE_PARTS
    mergeable_text = MERGEABLE
    expert_rule = EXPERT_RULE
    example = f"{_FULL}0.self_attn.q_proj.linear"

    def __init__(self, cfg: Inkling2Config, weight_map: dict[str, str]):
        self.num_layers, self.hidden_size = cfg.text.num_hidden_layers, cfg.text.hidden_size
        self.weight_map = weight_map
        # a checkpoint under transformers' names (the in-memory state dict, ModelOpt's form): its
        # tensors by original name, so the rules below read one naming (layout.INKLING_NAMINGS)
        self._stored = {_original(n): n for n in weight_map}
        self._original = {n: o for o, n in self._stored.items()}

    @staticmethod
    def is_experts_module(module: str) -> bool:
        return module.endswith(".mlp.experts")

    def pieces(self, module: str, param: str | None) -> list[Piece] | None:
        """The checkpoint tensor of adapter module `module` (its expert parameter `param`), as
        the checkpoint names it."""
        try:
            name = original_name(hf_module(f"{module}.{param}" if param else f"{module}.weight"))
        except UnknownTensorError:
            return None
        stored = self._stored.get(name, name)
        # only the original naming interleaves gate/up rows (transformers' gate_up_proj concatenates)
        return [Piece(stored, interleaved=param == "gate_up_proj" and stored == name)]

    def classify(self, tensor: str) -> TensorName | None:
        try:
            return classify(self._original.get(tensor, tensor))
        except UnknownTensorError:
            return None

    @staticmethod
    def mergeable(t: TensorName) -> bool:
        return t.part == "expert" or (t.part == "attention" and t.projection in ATTENTION_PROJECTIONS)

    @staticmethod
    def experts_module(layer: int) -> str:
        return experts_module(layer)

    @staticmethod
    def reads_hidden(t: TensorName, param: str | None) -> bool:
        """Whether lora_A's columns are the hidden size (every projection but the output's)."""
        return param == "gate_up_proj" or (param is None and t.projection != "wo_ud")

    @staticmethod
    def is_linear(module: str) -> bool:
        """For target_modules="all-linear": a module whose weight is a tensor of the layout."""
        try:
            original_name(hf_module(module) + ".weight")
            return True
        except UnknownTensorError:
            return False

    def selectable(self, adapter_modules: Iterable[str]) -> Iterator[tuple[str, TensorName, bool]]:
        """(PEFT key, TensorName, is an expert parameter) of every checkpoint tensor an adapter
        can name, named as this adapter names its modules (a text-only model's `model.layers.`;
        the bundled draft, no module of the model, its own)."""
        text_only = any(m.startswith(_TEXT_ONLY) for m in adapter_modules)
        for tensor in self._stored:  # by original name
            t = self.classify(tensor)
            if t is None:
                continue
            if dspark.is_draft(tensor):
                hf = tensor
            else:
                try:
                    hf = transformers_name(tensor)
                except UnknownTensorError:  # a quantized tensor's scales
                    continue
                hf = _TEXT_ONLY + hf[len(_FULL):] if text_only and hf.startswith(_FULL) else hf
            if t.part == "expert":
                if t.suffix == "weight":
                    yield hf, t, True
            elif hf.endswith(".weight"):
                yield hf[: -len(".weight")], t, False
