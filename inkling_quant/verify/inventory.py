"""What is in the checkpoint and what should be: the data the checks share.

The first steps of `verify()` read the checkpoint once each and record what they found (and
their check): `Files` (index + headers), `Conf` (config.json, hf_quant_config.json, the scheme),
`Source` (--against). The layout step (experts.check_layout) then computes `Expected` from
them. The four together are the `Inventory`, which no step changes afterwards; every later
check reads it.
Nothing here records a problem except `load_json`, which reads the checkpoint's JSON files
through io.checkpoint.read_json.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import CheckpointError, FormatError, InklingQuantError
from ..formats import Format
from ..model.inkling2 import Inkling2Config, classify, classify_modelopt
from ..model.layout import Layout, MoEConfig
from ..io.checkpoint import INDEX_NAME, SINGLE_NAME, read_json, safe_child
from ..io.safetensors import Header, TensorEntry
from ..schemes import Scheme
from ..model.tensors import TensorName
from .report import Check

UNQUANTIZED = "none"       # the scheme of a checkpoint with no quantization config (a BF16 source)


# ============================================================================ what is there
@dataclass(frozen=True)
class Located:
    """Where a tensor is: its shard and its header entry."""

    shard: str
    entry: TensorEntry


@dataclass(frozen=True)
class Files:
    """The index and the shards' headers (the well-formed ones)."""

    weight_map: dict[str, str]          # tensor -> shard, as the index says (safe names only)
    headers: dict[str, Header]          # shard -> header
    tensors: dict[str, Located]         # tensor -> where, from the headers
    index_ok: bool                      # the index check passed
    index_metadata: dict | None = None  # the index's `metadata` ({} when it has none); None: no usable index
    indexed_bytes: int = 0              # the bytes of the tensors the index lists (an unlisted draft file's not)

    @functools.cached_property
    def shards(self) -> list[str]:
        """Shards named by the index, in index order."""
        return list(dict.fromkeys(self.weight_map.values()))

    @functools.cached_property
    def readable_shards(self) -> list[str]:
        """Shards whose header is well formed, in index order."""
        return [s for s in self.shards if s in self.headers]


def converter_of(hf_quant):
    """hf_quant_config.json's `converter` entry (what inkling-quant convert recorded), or None."""
    return hf_quant.get("converter") if isinstance(hf_quant, dict) else None


@dataclass(frozen=True)
class Conf:
    """config.json, hf_quant_config.json and the scheme. `cfg`/`scheme` None: not usable. `cfg`
    is the published Inkling 2 model's (its strict spec applies) or another Hugging Face MoE
    family's (not `strict`). Either way the layout is detected from the tensor names (experts.py)."""

    root: Path
    config: dict | None = None
    cfg: Inkling2Config | MoEConfig | None = None
    hf_quant: dict | None = None
    scheme: Scheme | None = None
    scheme_given: bool = False          # --scheme or the converter's record, not a default
    _formats: dict = field(default_factory=dict, repr=False, compare=False)  # memo of format_for
    _names: dict = field(default_factory=dict, repr=False, compare=False)    # memo of classify

    @property
    def usable(self) -> bool:
        return self.cfg is not None and self.scheme is not None

    @property
    def converter(self):
        return converter_of(self.hf_quant)

    @property
    def strict(self) -> bool:
        """config.json lists every tensor (the family's record says so: Inkling 2's published
        spec), not only the routed experts (model/families.py)."""
        return self.cfg is None or self.cfg.family.strict  # no usable config: read as Inkling 2's

    @functools.cached_property
    def modelopt_hf(self) -> bool:
        """ModelOpt's export form: always for other families (the only form convert writes for
        them); for Inkling 2, convert --output-format modelopt-hf (transformers' names, per-expert
        modules), whose quantization config keys the experts modules by transformers' names
        (`model.language_model.layers.N.mlp.experts`)."""
        if self.cfg is None:
            return False
        if not self.strict:
            return True
        hq = self.hf_quant.get("quantization") if isinstance(self.hf_quant, dict) else None
        for q in (self.config.get("quantization_config"), hq):
            layers = q.get("quantized_layers") if isinstance(q, dict) else None
            if isinstance(layers, dict) and any(str(k).startswith("model.language_model.") for k in layers):
                return True
        return False

    def classify(self, name: str) -> TensorName:
        """The Inkling 2 layout's classify, memoized for this run: what the checks read a name
        as when no layout was detected (`Inventory.classify`)."""
        if not self.strict:
            raise CheckpointError(f"tensor {name!r}: the layout of this {self.cfg.model_type} checkpoint was not "
                                  f"detected (see the layout check)", tensor=name)
        t = self._names.get(name)
        if t is None:
            t = self._names[name] = (classify_modelopt if self.modelopt_hf else classify)(name)
        return t

    def format_for(self, t: TensorName) -> Format:
        """scheme.format_for, memoized per (part, layer): the scheme's rules are layer ranges."""
        key = (t.part, t.layer)
        f = self._formats.get(key)
        if f is None:
            f = self._formats[key] = self.scheme.format_for(self.cfg, t)
        return f


@dataclass(frozen=True)
class Source:
    """The --against checkpoint: its headers, and whether the source check passed."""

    root: Path
    headers: dict[str, Header]
    tensors: dict[str, Located]
    ok: bool
    layout: Layout | None = None        # the source's detected layout


# ============================================================================ what should be there
Shape = tuple[tuple[int, ...], torch.dtype]
SKIPPED, DISAGREES, FAILED, CHECKED = "skipped", "disagrees", "failed", "checked"


@dataclass(frozen=True)
class Expected:
    """What the layout and the quantization config prescribe, and how far the layout check got
    (`status`): CHECKED tensor by tensor; SKIPPED (no usable config, or no index); DISAGREES
    (config.json implies far more tensors than the files hold: the config check does not compare
    the tensors either); FAILED (a format cannot hold the config's shapes). Only CHECKED expects
    any tensor: otherwise later checks know no tensor's format."""

    status: str = SKIPPED
    weight_only: bool = False           # NVFP4 without an activation scale (W4A16), as the tensors say
    tensors: dict[str, Shape] = field(default_factory=dict)      # every expected output tensor
    fmt_of: dict[str, str] = field(default_factory=dict)         # output tensor -> its format
    module_tensors: dict[str, list[str]] = field(default_factory=dict)  # quantized module -> tensors
    source_of: dict[str, str] = field(default_factory=dict)      # output tensor -> its source tensor, where renamed
    layout: Layout | None = None        # the checkpoint's detected layout (CHECKED)
    # a quantized source's modules outside the routed experts: kept in their format (module -> format
    # name; ModelOpt's FP8_PB_WO), or dequantized (output weight -> the source format it was stored in)
    kept_modules: dict[str, str] = field(default_factory=dict)
    dequantized: dict[str, str] = field(default_factory=dict)
    # the checkpoint is itself stored in a source's format (a `--scheme none` copy of an FP8 or MXFP4
    # source): that format's name (formats.SOURCE_FORMATS); `layout.source` says how it names its tensors
    stored_as: str | None = None


@dataclass(frozen=True)
class Inventory:
    """Everything the checks after the layout read; built once, changed by none of them."""

    root: Path
    files: Files
    conf: Conf
    source: Source | None
    expected: Expected

    def classify(self, name: str) -> TensorName:
        """What tensor `name` is: by the detected layout, else (none detected) the Inkling 2 layout's."""
        lay = self.expected.layout
        return lay.classify(name) if lay is not None else self.conf.classify(name)


@contextlib.contextmanager
def config_shape(conf: "Conf | None", name: str, shape, fmt: Format):
    """Around asking `fmt` for the tensors of weight `name` of the config's `shape`: a shape the
    format cannot hold is the config's fault (a FormatError naming config.json and the weight);
    without `conf`, the format's own error passes as it is."""
    try:
        yield
    except FormatError as e:
        if conf is None:
            raise
        raise FormatError(f"{name} {list(shape)} cannot be {fmt.name}: {e.message}",
                          path=conf.root / "config.json", tensor=name) from None


def weight_only_vote(conf: "Conf", holds_scale: list[bool]) -> bool:
    """W4A16 or W4A4: decided by the layers whose format has a static activation scale
    (`holds_scale`: one per such layer, whether it holds the scale; most hold it or most do not);
    without such layers, what the converter recorded."""
    if holds_scale:
        return holds_scale.count(False) > holds_scale.count(True)
    conv = conf.converter
    return bool(conv.get("weight_only", False)) if isinstance(conv, dict) else False


def listing(root: Path) -> Path:
    """The file that lists a checkpoint's tensors, named by a problem about a missing one: its
    index, or its single shard where it has no index (as save_pretrained and ModelOpt write a
    small model)."""
    return root / (SINGLE_NAME if not (root / INDEX_NAME).exists() and (root / SINGLE_NAME).exists() else INDEX_NAME)


# ============================================================================ JSON files
def load_json(path: Path, what: str, check: Check) -> dict | None:
    """A JSON object from one of the checkpoint's files (io.checkpoint.read_json: size cap, FIFO,
    duplicate keys, depth), or None with the defect recorded in `check`: a failure, or an error
    (exit 2) when the file could not be read at all."""
    try:
        safe_child(path.parent, path.name, what)  # a symlink leaving the checkpoint: refused, as for shards
        return read_json(path, what)
    except InklingQuantError as e:
        if isinstance(e.__cause__, OSError):
            check.error(e.path or path, e.message)
        else:
            check.fail(e.path or path, e.tensor, e.message)
        return None
