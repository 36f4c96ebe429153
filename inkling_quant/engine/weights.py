"""An Inkling 2 checkpoint's weights as transformers' modules hold them, read from its shards one
decoder layer (and one routed expert) at a time.

Every naming and storage `model/` reads works (`layout.detect`): the original names (what
`save_pretrained` and the release write), transformers' in-memory names, ModelOpt's per-expert
names; BF16/FP16/FP32 experts, or the MXFP8 release's e4m3 + e8m0 experts dequantized exactly
(the values transformers 5.25's `Inkling2LoopDequantizeExperts` loads). Names go through the one
table of transformers' names (`model.inkling2.transformers_name`, conversion_mapping.py
"inkling2"), gate/up through the storage (`ExpertStorage.split_gate_up`: the original w13's rows
interleaved, transformers' gate rows then up rows), so a layer's state dict is what
`from_pretrained` puts in `model.language_model.layers.N` (tests/test_engine.py holds it to that).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import CheckpointError
from ..formats import FORMATS
from ..io.checkpoint import Checkpoint
from ..io.shards import ShardReaders
from ..model.inkling2 import RELEASE_EXPERT_FORMAT, Inkling2Config, transformers_name
from ..model.layout import CANONICAL, Layout, detect, max_tensors, oriented

_HF_LAYER = re.compile(r"model\.language_model\.layers\.(\d+)\.(.+)")
_HF_TOP = "model.language_model."
#: model-level modules (in-memory names, after the text prefix) the forward holds outside the layers
EMBED, FINAL = ("embed_tokens.",), ("final_input.", "norm.")
LM_HEAD = "lm_head.weight"


@dataclass
class ExpertWeights:
    """One routed expert as `Inkling2Experts` holds it: gate_up_proj[e] [2I, H] (gate rows, then
    up rows) and down_proj[e] [H, I]."""
    gate_up: torch.Tensor
    down: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.gate_up.numel() * self.gate_up.element_size() + self.down.numel() * self.down.element_size()


class Weights:
    """The checkpoint at `root` (config `cfg`), its tensors read on demand. `layer(i)` is the
    decoder layer's state dict without its routed experts, keyed as the layer module names its
    parameters; `expert(i, e)` one expert; `model_level(prefixes)` the embedding, final norm and
    output query; `lm_head()` transformers' unpadded head. A context manager (it holds the shard
    readers open)."""

    def __init__(self, root: str | Path, cfg: Inkling2Config):
        self.root, self.cfg = Path(root), cfg
        self.ckpt = Checkpoint.open(self.root)
        self.headers = self.ckpt.headers(max_tensors(cfg))
        shapes = {n: tuple(e.shape) for h in self.headers.values() for n, e in h.tensors.items()}
        self.layout: Layout = oriented(detect(list(shapes), cfg, str(self.root)), shapes, cfg)
        if self.layout.naming is None:
            raise CheckpointError("not an Inkling 2 checkpoint under a naming the engine reads", path=self.root)
        self.shard_of = {n: s for s, h in self.headers.items() for n in h.tensors}
        self.readers = ShardReaders(self.root, self.headers, keep_open=True)
        self._by_layer: dict[int, dict[str, str]] = {}   # layer -> in-memory suffix -> stored name
        self._top: dict[str, str] = {}                   # in-memory name after the text prefix -> stored name
        for name in shapes:
            part = self.layout.part_of(name)
            if part is None or part.part in ("expert", "vision", "projector", "draft"):
                continue
            hf = transformers_name(name) if self.layout.original_names else name
            m = _HF_LAYER.fullmatch(hf)
            if m:
                self._by_layer.setdefault(int(m[1]), {})[m[2]] = name
            elif hf == LM_HEAD:
                self._top[LM_HEAD] = name
            elif hf.startswith(_HF_TOP):
                self._top[hf[len(_HF_TOP):]] = name
        stacked_release = self.layout.original_names and any(n.endswith("_weight_scale") for n in shapes)
        self.expert_format = RELEASE_EXPERT_FORMAT if stacked_release else None  # None: float experts

    # --- reading ------------------------------------------------------------------------------
    def _get(self, name: str) -> torch.Tensor:
        return self.readers.get(self.shard_of[name]).get(name)

    def _slice(self, name: str, e: int) -> torch.Tensor:
        return self.readers.get(self.shard_of[name]).get_slice(name, e)

    def layer(self, i: int) -> dict[str, torch.Tensor]:
        """Decoder layer i's tensors but its routed experts, under the layer module's names."""
        names = self._by_layer.get(i)
        if not names:
            raise CheckpointError(f"no tensors of decoder layer {i}", path=self.root)
        return {k: self._get(n) for k, n in names.items()}

    def layer_nbytes(self, i: int) -> int:
        return sum(self.headers[self.shard_of[n]].tensors[n].nbytes for n in self._by_layer.get(i, {}).values())

    def model_level(self, prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
        """The text model's own tensors under `prefixes` (`embed_tokens.`, `final_input.`, `norm.`),
        keyed after the prefix."""
        return {k[len(p):]: self._get(n) for k, n in self._top.items() for p in prefixes if k.startswith(p)}

    def lm_head(self) -> torch.Tensor:
        """lm_head.weight as transformers holds it: the unembedding's first unpadded_vocab_size
        rows (`Inkling2UnpadVocab`: the padding rows are dropped on load)."""
        w = self._get(self._top[LM_HEAD])
        return w[: self.cfg.text.unpadded_vocab_size].contiguous()

    def expert(self, i: int, e: int) -> ExpertWeights:
        """Routed expert e of layer i: gate_up [2I, H] (gate rows then up rows) and down [H, I],
        in the checkpoint's float dtype (the MXFP8 release's dequantized exactly, to bf16)."""
        storage, module, width = self.layout.experts, self.layout.experts_modules[i], self.cfg.text.moe_intermediate_size
        got: dict[str, torch.Tensor] = {}
        slabs: dict[str, torch.Tensor] = {}
        for proj in CANONICAL:
            name = storage.tensor(module, e, proj)
            if not storage.stacked:
                got[proj] = self._get(name)
                continue
            if name not in slabs:
                slab = self._slice(name, e)
                if self.expert_format is not None:  # the MXFP8 release: e4m3 + e8m0, exact in bf16
                    fmt = FORMATS[self.expert_format]
                    slab = fmt.dequantize({"weight": slab, "weight_scale": self._slice(name + "_scale", e)},
                                          torch.float32).to(torch.bfloat16)
                slabs[name] = slab.t() if storage.transposed else slab
            w = slabs[name]
            got[proj] = w if proj == "down" else storage.split_gate_up(w, width)[CANONICAL.index(proj)]
        return ExpertWeights(torch.cat([got["gate"], got["up"]]).contiguous(), got["down"].contiguous())

    def expert_nbytes(self, i: int) -> int:
        """Bytes layer i's routed experts occupy in the shards (what streaming them reads)."""
        prefix = self.layout.experts_modules[i] + "."
        return sum(self.headers[s].tensors[n].nbytes for n, s in self.shard_of.items() if n.startswith(prefix))

    def close(self) -> None:
        self.readers.close()

    def __enter__(self) -> "Weights":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
