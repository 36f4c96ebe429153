"""How a checkpoint stores one MoE layer's routed experts: one class per storage, the only place
its tensor names, shapes, orientation and gate/up rows are spelled.

- `PerExpert`: one 2-D tensor per expert and projection, `<experts>.<e>.<name>.weight` ([I, H] for
  gate/up, [H, I] for down); `names` are the family's projection names (gate_proj/up_proj/down_proj,
  Mixtral's w1/w3/w2).
- `Stacked`: transformers' fused form, `<experts>.gate_up_proj` [E, 2I, H] with the gate rows then
  the up rows (transformers 5.25 models/*/modeling_*.py `gate_up.chunk(2, dim=-1)`) and
  `<experts>.down_proj` [E, H, I]; `transposed`: stored [E, in, out], as the Hub's Qwen3-VL-MoE and
  Llama 4 checkpoints hold them (settled from the shapes: `oriented`).
- `Interleaved`: Inkling 2's original form, `mlp.experts.w13_weight` [E, 2I, H] with gate and up
  rows alternating (row 2i gate_i, 2i+1 up_i: transformers 5.25 core_model_loading.py `Interleave`)
  and `mlp.experts.w2_weight` [E, H, I].

Every storage answers in the canonical projections `CANONICAL` (gate, up, down) and, for a stacked
tensor, `gate_up` / `down`. No torch at import: slices are cut from tensors the caller reads.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import ClassVar, Iterator

CANONICAL = ("gate", "up", "down")  # an expert's projections, whatever a family calls them
PER_EXPERT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))  # gate, up, down per family

Shape = tuple[int, ...]


@dataclass(frozen=True)
class ExpertStorage:
    """The storage of a layer's routed experts under the MoE block `block` (the module holding
    `experts`: "mlp", "block_sparse_moe", "feed_forward" or DeepSeek-V4's "ffn")."""

    block: str = "mlp"

    kind: ClassVar[str]                 # a name for messages and reports
    stacked: ClassVar[bool]             # all experts of a projection in one [E, ...] tensor
    pattern: ClassVar[re.Pattern]       # a layer tensor's name after `layers.N.`: groups block, proj, suffix
    transposed: ClassVar[bool] = False  # stored [E, in, out] (a field of Stacked)
    interleaved: ClassVar[bool] = False  # a stacked gate/up tensor's rows alternate (a field of Stacked)
    # an expert's modules' names (gate, up, down): a per-expert family's own, else ModelOpt's (unstacked)
    names: ClassVar[tuple[str, str, str]] = PER_EXPERT_NAMES[0]

    # --- names ---------------------------------------------------------------------------
    def match(self, rest: str) -> tuple[int | None, str, str] | None:
        """(expert or None for a stacked tensor, canonical projection, suffix) of a layer's tensor
        named `rest` after `layers.N.`, or None when it is not one of this storage's."""
        m = self.pattern.fullmatch(rest)
        if m is None or m["block"] != self.block:
            return None
        g = m.groupdict()
        expert = int(g["expert"]) if g.get("expert") is not None else None
        return expert, self._canonical(m["proj"]), m["suffix"] or "weight"

    def _canonical(self, proj: str) -> str:
        raise NotImplementedError

    def tensor(self, module: str, e: int, proj: str) -> str:
        """The tensor holding expert `e`'s projection `proj` (gate, up, down) under the experts
        module `module`: per expert its own weight; stacked the tensor holding all experts."""
        raise NotImplementedError

    def named(self, module: str) -> str:
        """The tensor a problem about the experts module `module` names: its first expert's gate
        weight, or the stacked tensor holding it."""
        return self.tensor(module, 0, "gate")

    def activation_key(self, module: str, name: str) -> str:
        """What a routed expert weight's activation amax is keyed by: per expert its module, stacked
        the tensor (vLLM reads one input scale per layer and projection there)."""
        return name if self.stacked else module

    # --- shapes --------------------------------------------------------------------------
    def weight_shapes(self, module: str, experts: int, hidden: int, width: int) -> dict[str, Shape]:
        """name -> shape of every routed-expert weight of one layer, as stored (oriented)."""
        raise NotImplementedError

    def weights_per_layer(self, experts: int) -> int:
        """How many weights `weight_shapes` lists, counted without listing them."""
        raise NotImplementedError

    def oriented(self, shapes: dict[str, Shape], module: str, hidden: int, width: int) -> "ExpertStorage":
        """This storage with its orientation settled from the stored shapes of one layer."""
        return self

    def unoriented(self) -> "ExpertStorage":
        """This storage as its naming knows it, orientation aside."""
        return self

    def projections(self, e: int) -> Iterator[tuple[str, str]]:
        """(canonical projection, module name) of an expert's modules, gate, up, down."""
        return iter(zip(CANONICAL, self.names))

    def split_gate_up(self, slab, width: int):
        """(gate, up) rows of one expert's stacked gate/up slab [2I, H] (a tensor sliced, not copied)."""
        raise NotImplementedError

    @property
    def stored_names(self) -> tuple[str, ...]:
        """The names its weights are stored under, below the experts module (per expert: below `<e>.`)."""
        raise NotImplementedError

    def describe(self) -> str:
        return f"{self.kind} under 'layers.N.{self.block}.experts'"


@dataclass(frozen=True)
class PerExpert(ExpertStorage):
    names: tuple[str, str, str] = PER_EXPERT_NAMES[0]

    kind: ClassVar[str] = "per_expert"
    stacked: ClassVar[bool] = False
    pattern: ClassVar[re.Pattern] = re.compile(
        r"(?P<block>mlp|block_sparse_moe|feed_forward|ffn)\.experts\.(?P<expert>\d+)\."
        r"(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)\.(?P<suffix>.+)")

    @property
    def stored_names(self) -> tuple[str, ...]:
        return self.names

    def _canonical(self, proj: str) -> str:
        return CANONICAL[self.names.index(proj)] if proj in self.names else ""

    def match(self, rest: str) -> tuple[int | None, str, str] | None:
        got = super().match(rest)
        return got if got is not None and got[1] else None  # another family's projection names: not ours

    def tensor(self, module: str, e: int, proj: str) -> str:
        return f"{module}.{e}.{self.names[CANONICAL.index(proj)]}.weight"

    def weight_shapes(self, module: str, experts: int, hidden: int, width: int) -> dict[str, Shape]:
        return {self.tensor(module, e, proj): ((hidden, width) if proj == "down" else (width, hidden))
                for e in range(experts) for proj in CANONICAL}

    def weights_per_layer(self, experts: int) -> int:
        return len(CANONICAL) * experts


class _Fused(ExpertStorage):
    """A stacked storage: per layer one gate/up tensor [E, 2I, H] and one down tensor [E, H, I]."""

    stacked: ClassVar[bool] = True
    fused_names: ClassVar[tuple[str, str]]  # (gate/up, down) tensor names under the experts module

    @property
    def stored_names(self) -> tuple[str, ...]:
        return self.fused_names

    def _canonical(self, proj: str) -> str:
        return "down" if proj in ("down_proj", "w2") else "gate_up"

    def tensor(self, module: str, e: int, proj: str) -> str:
        return f"{module}.{self.fused_names[1] if proj == 'down' else self.fused_names[0]}"

    def weight_shapes(self, module: str, experts: int, hidden: int, width: int) -> dict[str, Shape]:
        out = {}
        for name, (rows, cols) in zip(self.fused_names, ((2 * width, hidden), (hidden, width))):
            out[f"{module}.{name}"] = (experts, cols, rows) if self.transposed else (experts, rows, cols)
        return out

    def weights_per_layer(self, experts: int) -> int:
        return 2


@dataclass(frozen=True)
class Stacked(_Fused):
    transposed: bool = False
    interleaved: bool = False  # gate/up rows alternate (gpt-oss: a family fact, families.Family.gate_up_interleaved)

    kind: ClassVar[str] = "stacked"
    fused_names: ClassVar[tuple[str, str]] = ("gate_up_proj", "down_proj")
    # `_blocks` / `_scales`: an MXFP4 source's stored tensors of the stacked weight (model/sources.py)
    pattern: ClassVar[re.Pattern] = re.compile(
        r"(?P<block>mlp|feed_forward)\.experts\.(?P<proj>gate_up_proj|down_proj)(?:_(?P<suffix>blocks|scales))?")

    def split_gate_up(self, slab, width: int):
        if self.interleaved:  # row 2j gate_j, 2j+1 up_j (transformers 5.25 modeling_gpt_oss.py: gate_up[..., ::2])
            return slab[0::2], slab[1::2]
        return slab[:width], slab[width:2 * width]

    def describe(self) -> str:
        return super().describe() + (", gate/up rows interleaved" if self.interleaved else "")

    def oriented(self, shapes: dict[str, Shape], module: str, hidden: int, width: int) -> "Stacked":
        t = stacked_orientation(shapes.get(f"{module}.down_proj", ()), shapes.get(f"{module}.gate_up_proj", ()),
                                hidden, width)
        return replace(self, transposed=bool(t))

    def unoriented(self) -> "Stacked":
        return replace(self, transposed=False)


@dataclass(frozen=True)
class Interleaved(_Fused):
    kind: ClassVar[str] = "interleaved"
    fused_names: ClassVar[tuple[str, str]] = ("w13_weight", "w2_weight")
    pattern: ClassVar[re.Pattern] = re.compile(r"(?P<block>mlp)\.experts\.(?P<proj>w13|w2)_(?P<suffix>weight.*)")

    def split_gate_up(self, slab, width: int):
        return slab[0::2], slab[1::2]


STORAGES: tuple[type[ExpertStorage], ...] = (PerExpert, Stacked, Interleaved)


def stacked_orientation(down_shape: Shape, gate_up_shape: Shape, hidden: int, width: int) -> bool | None:
    """Whether transformers-stacked experts are stored [E, in, out] (True) or [E, out, in]
    (False), from the shapes: down_proj tells unless H == I, gate_up_proj unless H == 2I (never
    both). None: neither shape fits the config."""
    for shape, out_in in ((tuple(down_shape), (hidden, width)), (tuple(gate_up_shape), (2 * width, hidden))):
        if out_in[0] != out_in[1] and len(shape) == 3:
            if shape[1:] == out_in:
                return False
            if shape[1:] == out_in[::-1]:
                return True
    return None
