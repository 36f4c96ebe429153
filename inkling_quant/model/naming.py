"""The names an Inkling 2 checkpoint's tensors go by, one object per naming:

- `ORIGINAL`: `model.llm.*`, `model.visual.*`, experts `mlp.experts.w13_weight` [E, 2I, H] (gate/up
  rows interleaved) and `w2_weight` [E, H, I]: what transformers' `save_pretrained` and the release
  write (transformers 5.25 conversion_mapping.py "inkling2"/"inkling2_text" renames on load and back);
- `TRANSFORMERS`: transformers' in-memory names, what `safetensors.torch.save_file(model.state_dict())`,
  FSDP or accelerate write for a fine-tune: `model.language_model.*`, `model.vision_tower.*`,
  `lm_head.weight` with only the unpadded vocabulary rows, experts stacked as `Inkling2Experts`
  holds them (`gate_up_proj` [E, 2I, H], gate then up; `down_proj` [E, H, I]);
- `MODELOPT`: transformers' names with the routed experts per expert, as ModelOpt's exporter
  writes them (`mlp.experts.E.{gate,up,down}_proj.*`).

Each translates its names to and from the original ones (the tensor table in inkling2) and says
what a name is (`classify`: transformers' names classify as their original's, ModelOpt's per-expert
modules as routed experts); `layout.detect` picks the naming from the text prefix and the expert
storage (`naming_of`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from . import inkling2
from .storage import ExpertStorage, Interleaved, PerExpert, Stacked
from .tensors import TensorName, TensorSpec


@dataclass(frozen=True)
class Naming:
    key: str                  # "original", "transformers", "modelopt"
    text_prefix: str
    storage: ExpertStorage    # how its routed experts are stored (unoriented)
    description: str
    _classify: Callable[[str], TensorName]

    @property
    def is_original(self) -> bool:
        return self is ORIGINAL

    def spec(self, cfg: inkling2.Inkling2Config, original: TensorSpec) -> TensorSpec:
        """A tensor of the original layout under this naming (transformers' drops the vocabulary
        padding rows of the unembedding: `inkling2.transformers_spec`)."""
        return original if self.is_original else inkling2.transformers_spec(cfg, original)

    def experts_module(self, layer: int) -> str:
        """The MoE module of `layer` (the key quantization configs use for its experts)."""
        return inkling2.experts_module(layer) if self.is_original else inkling2.modelopt_experts_module(layer)

    def classify(self, name: str) -> TensorName:
        """What the tensor `name` (under this naming) is; UnknownTensorError outside the layout."""
        return self._classify(name)


_HF = "model.language_model."
ORIGINAL = Naming(
    "original", inkling2.TEXT_PREFIX, Interleaved("mlp"),
    "the original names (model.llm.*, model.visual.*; experts mlp.experts.w13_weight [E, 2I, H] gate/up rows "
    "interleaved and w2_weight [E, H, I]): what save_pretrained and the release write", inkling2.classify)
TRANSFORMERS = Naming(
    "transformers", _HF, Stacked("mlp"),
    "transformers' in-memory names (model.language_model.*, model.vision_tower.*, lm_head.weight unpadded; "
    "experts mlp.experts.gate_up_proj [E, 2I, H] gate then up, and down_proj [E, H, I]): what state_dict() holds",
    inkling2.classify_modelopt)
MODELOPT = Naming(
    "modelopt", _HF, PerExpert("mlp"),
    "transformers' names with per-expert experts as ModelOpt names them "
    "(mlp.experts.E.{gate,up,down}_proj.weight [I, H], [I, H], [H, I])", inkling2.classify_modelopt)
NAMINGS = (ORIGINAL, TRANSFORMERS, MODELOPT)


def naming_of(text_prefix: str, storage: ExpertStorage) -> Naming | None:
    """The Inkling 2 naming of a checkpoint with this text prefix and expert storage (orientation
    aside), None for none."""
    plain = storage.unoriented()
    return next((n for n in NAMINGS if n.text_prefix == text_prefix and n.storage == plain), None)


def original_names(cfg, text_prefix: str | None) -> bool:
    """Whether a checkpoint of config `cfg` whose text model is under `text_prefix` is an Inkling 2
    model's under its original names (before its layout is detected)."""
    return isinstance(cfg, inkling2.Inkling2Config) and text_prefix == ORIGINAL.text_prefix


def described() -> str:
    """Every naming in words, for a message that lists what was expected."""
    return "; ".join(n.description for n in NAMINGS)
