"""LoRA: merge a PEFT adapter into the BF16 attention projections of a checkpoint.

  inkling-quant lora check CKPT ADAPTER          what would be merged where (module, shard,
                                                 rank, alpha, scale); writes nothing
  inkling-quant lora merge CKPT ADAPTER OUT      OUT = CKPT with W' = W + scale * B @ A merged
                                                 into every module the adapter targets

CKPT is a converted checkpoint (NVFP4/MXFP8 routed experts, BF16 attention) or a BF16 source.
ADAPTER is a PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors) or
a hub repo id org/name[@revision]. The merge is computed in FP32 and rounded once to the stored
dtype. Routed-expert adapters are merged only where the experts are BF16 (a source, before
conversion): the recipe's rule, "expert adapters need BF16 expert weights". Only shards holding
a merged tensor are rewritten; the others are hardlinked (or copied). OUT is built in
OUT.partial and renamed into place when complete. docs/lora.md has the workflow and the
reasons for every refusal.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import regex
import torch
from tqdm import tqdm

from . import __version__, hub
from .io.output import CHECKSUMS, check_paths, link_or_copy, read_checksums, staged_output, write_checksums, write_report
from .errors import CheckpointError, ConfigError, InklingQuantError, UnknownTensorError, UsageError
from .io.checkpoint import INDEX_NAME, Checkpoint, copy_file_atomic, read_json, safe_child, write_json_atomic
from .io.safetensors import (DTYPE_NAMES, Header, ShardReader, ShardWriter, TensorBuffer, TensorEntry, read_header,
                             sha256_file)
from .layout import ATTENTION_PROJECTIONS, ModelConfig, TensorName, classify

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
QUANT_CONFIG = "hf_quant_config.json"
PROVENANCE_KEY = "lora_merged"          # config.json: the adapters merged into this checkpoint
MERGEABLE_PARTS = ("attention", "expert")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_FLOAT = (torch.bfloat16, torch.float16, torch.float32)

# adapter_config.json keys whose value changes what the saved A/B mean (or adds tensors we would
# drop). A truthy value is refused with the reason; PEFT's defaults (false/null/"none") pass.
_UNSUPPORTED: dict[str, str] = {
    "use_dora": "DoRA (use_dora) rescales each output row by a learned magnitude; the merge is not W + s*B@A",
    "lora_bias": "lora_bias adds a bias to the base layer; the attention projections have none",
    "velora_config": "VeLoRA is a LoRA variant this tool does not implement",
    "alora_invocation_tokens": "activated LoRA (aLoRA) applies only after invocation tokens; it cannot be merged",
    "monteclora_config": "MonteCLoRA is a LoRA variant this tool does not implement",
    "use_bdlora": "block-diagonal LoRA (BD-LoRA) is a LoRA variant this tool does not implement",
    "arrow_config": "Arrow routes between several adapters per token; it cannot be merged",
    "kasa_config": "KaSA is a LoRA variant this tool does not implement",
    "use_qalora": "QA-LoRA adapters belong to a quantized (group-pooled) base; merge them with their own tools",
    "layer_replication": "layer_replication changes the base model's layer stack",
    "target_parameters": "target_parameters (LoRA on fused nn.Parameter experts) is not supported; "
                         "this layout has one Linear per expert projection",
    "trainable_token_indices": "trainable_token_indices edits embedding rows; only LoRA deltas are merged",
    "modules_to_save": "modules_to_save stores full replacement modules, not LoRA deltas; only LoRA deltas "
                       "are merged (dropping them silently would change the model)",
}
# init_lora_weights values that train against *modified* base weights: the saved A/B are not a
# delta on the original checkpoint until PEFT converts them (save_pretrained with
# path_initial_model_for_weight_conversion, which resets init_lora_weights to true).
_BASE_MODIFYING_INIT = ("pissa", "corda", "olora", "loftq", "lora_ga", "mica")
# Every other LoraConfig field of PEFT 0.21: harmless for a merge (training, init or runtime only).
_KNOWN_KEYS = {
    "task_type", "peft_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision",
    "inference_mode", "r", "target_modules", "exclude_modules", "lora_alpha", "lora_dropout", "fan_in_fan_out",
    "bias", "use_rslora", "init_lora_weights", "layers_to_transform", "layers_pattern", "rank_pattern",
    "alpha_pattern", "megatron_config", "megatron_core", "loftq_config", "eva_config", "corda_config",
    "lora_ga_config", "qalora_group_size", "runtime_config", "ensure_weight_tying",
} | set(_UNSUPPORTED)


# --------------------------------------------------------------------------- adapter config
def _number(d: dict, key: str, where: str, default=None, positive: bool = True) -> float:
    v = d.get(key, default)
    try:
        finite = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    except OverflowError:  # an integer too large for a float
        finite = False
    if not finite or (positive and v <= 0):
        raise ConfigError(f"{where}: {key!r} must be a {'positive ' if positive else ''}finite number, got {v!r}")
    return v


PATTERN_TIMEOUT_S = 1.0


def _user_match(pattern: str, text: str, *, full: bool = False):
    """re.match/re.fullmatch of an adapter's own pattern, bounded in time: a pattern such as
    `(.*.*)*X` backtracks for hours on a module name. `regex` takes re's syntax and a timeout."""
    try:
        return (regex.fullmatch if full else regex.match)(pattern, text, timeout=PATTERN_TIMEOUT_S)
    except TimeoutError:
        raise ConfigError(f"adapter config: pattern {pattern[:200]!r} took over {PATTERN_TIMEOUT_S:g} s to match "
                          f"{text!r} (catastrophic backtracking): simplify it, e.g. list the module names") from None


@dataclass(frozen=True)
class AdapterConfig:
    """The parts of a PEFT LoraConfig that decide which modules an adapter touches and how much."""

    r: int
    lora_alpha: float
    use_rslora: bool
    target_modules: list[str] | str | None
    exclude_modules: list[str] | str | None
    layers_to_transform: list[int] | int | None
    layers_pattern: list[str] | str | None
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]
    fan_in_fan_out: bool
    base_model: str | None
    raw: dict = field(compare=False, repr=False)

    @classmethod
    def from_dict(cls, d: dict, where: str) -> "AdapterConfig":
        peft_type = d.get("peft_type")
        if peft_type is None:
            raise ConfigError(f"{where}: missing key 'peft_type' (not a PEFT adapter config?)")
        if str(peft_type).upper() != "LORA":
            raise ConfigError(f"{where}: peft_type is {peft_type!r}; only plain LoRA adapters (peft_type 'LORA') "
                              f"can be merged")
        for key, why in _UNSUPPORTED.items():
            if d.get(key):
                raise ConfigError(f"{where}: {key}={json.dumps(d[key])} is not supported: {why}")
        init = d.get("init_lora_weights", True)
        if isinstance(init, str) and init.lower().startswith(_BASE_MODIFYING_INIT):
            raise ConfigError(
                f"{where}: init_lora_weights={init!r} trains against modified base weights, so A/B are not a delta "
                f"on this checkpoint; convert it to a plain LoRA adapter first (PEFT: save_pretrained(..., "
                f"path_initial_model_for_weight_conversion=...))")
        bias = d.get("bias", "none")
        if bias not in (None, "none"):
            raise ConfigError(f"{where}: bias={bias!r} trains base-layer biases; the attention projections have "
                              f"none (only bias='none' adapters can be merged)")
        unknown = sorted(k for k in d if k not in _KNOWN_KEYS and d[k] not in (None, False, "", [], {}, 0))
        if unknown:
            raise ConfigError(f"{where}: unknown setting(s) {', '.join(f'{k}={json.dumps(d[k])}' for k in unknown)}: "
                              f"possibly a LoRA variant this tool does not know; refusing rather than merging "
                              f"something other than W + s*B@A")
        r = _number(d, "r", where, 8)
        if int(r) != r:
            raise ConfigError(f"{where}: 'r' must be a positive integer, got {r!r}")
        alpha = _number(d, "lora_alpha", where, 8)
        rank_pattern = d.get("rank_pattern") or {}
        alpha_pattern = d.get("alpha_pattern") or {}
        for name, pat in (("rank_pattern", rank_pattern), ("alpha_pattern", alpha_pattern)):
            if not isinstance(pat, dict):
                raise ConfigError(f"{where}: {name!r} must be an object, got {pat!r}")
            for k in pat:
                _number(pat, k, f"{where}: {name}")
                try:
                    re.compile(k)
                except (re.error, RecursionError, OverflowError) as e:
                    raise ConfigError(f"{where}: {name} key {k!r} is not a valid pattern: {e}") from None
        for k, v in rank_pattern.items():
            if int(v) != v:
                raise ConfigError(f"{where}: rank_pattern[{k!r}] must be a positive integer, got {v!r}")
        targets = d.get("target_modules")
        excludes = d.get("exclude_modules")
        for name, v in (("target_modules", targets), ("exclude_modules", excludes)):
            if v is not None and not isinstance(v, str) and not (
                    isinstance(v, list) and all(isinstance(x, str) for x in v)):
                raise ConfigError(f"{where}: {name!r} must be a string (regex) or a list of names, got {v!r}")
            if isinstance(v, str):
                try:
                    re.compile(v)
                except (re.error, RecursionError, OverflowError) as e:
                    raise ConfigError(f"{where}: {name} {v!r} is not a valid pattern: {e}") from None
        if not targets:
            raise ConfigError(f"{where}: 'target_modules' is empty: the adapter targets no module")
        layers = d.get("layers_to_transform")
        if layers is not None and not (type(layers) is int or (isinstance(layers, list)
                                                               and all(type(x) is int for x in layers))):
            raise ConfigError(f"{where}: 'layers_to_transform' must be an integer or a list of integers")
        pattern = d.get("layers_pattern")
        if pattern is not None and not (isinstance(pattern, str) or (isinstance(pattern, list)
                                                                     and all(isinstance(x, str) for x in pattern))):
            raise ConfigError(f"{where}: 'layers_pattern' must be a string or a list of strings")
        return cls(r=int(r), lora_alpha=alpha, use_rslora=bool(d.get("use_rslora", False)),
                   target_modules=list(targets) if isinstance(targets, list) else targets,
                   exclude_modules=list(excludes) if isinstance(excludes, list) else excludes,
                   layers_to_transform=layers, layers_pattern=pattern,
                   rank_pattern={k: int(v) for k, v in rank_pattern.items()},
                   alpha_pattern=dict(alpha_pattern), fan_in_fan_out=bool(d.get("fan_in_fan_out", False)),
                   base_model=d.get("base_model_name_or_path"), raw=dict(d))

    # PEFT's own rules (peft.tuners.tuners_utils.check_target_module_exists, peft.utils.other.get_pattern_key)
    def targets(self, module: str) -> bool:
        """Whether PEFT would put a LoRA layer on `module` (its name in the base model)."""
        ex = self.exclude_modules
        if ex:
            if isinstance(ex, str):
                if _user_match(ex, module, full=True):
                    return False
            elif module in ex or any(module.endswith("." + k) for k in ex):
                return False
        tm = self.target_modules
        if isinstance(tm, str):
            if tm.lower() == "all-linear":  # every Linear but the output layer
                return classify_module(module) is not None
            return _user_match(tm, module, full=True) is not None
        if module in tm:
            return True
        if not any(module.endswith("." + k) for k in tm):
            return False
        idx = self.layers_to_transform
        if idx is None or (isinstance(idx, list) and not idx):
            return True
        pats = self.layers_pattern
        if not pats:
            m = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", module)
        else:
            for p in [pats] if isinstance(pats, str) else pats:
                m = _user_match(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", module)
                if m:
                    break
        if not m:
            return False
        layer = int(m.group("idx"))
        return layer == idx if isinstance(idx, int) else layer in idx

    def rank_alpha(self, module: str) -> tuple[int, float]:
        def key(patterns):
            for k in patterns:
                if _user_match(rf"(.*\.)?({k})$", module):
                    return k
            return module
        return (self.rank_pattern.get(key(self.rank_pattern), self.r),
                self.alpha_pattern.get(key(self.alpha_pattern), self.lora_alpha))

    def scaling(self, module: str) -> tuple[int, float, float]:
        """(r, alpha, scaling) as PEFT computes them: alpha / r, or alpha / sqrt(r) with rsLoRA."""
        r, alpha = self.rank_alpha(module)
        return r, alpha, (alpha / math.sqrt(r) if self.use_rslora else alpha / r)


def classify_module(module: str) -> TensorName | None:
    """The layout record of `module`'s weight, None when it is not a tensor of the layout."""
    try:
        return classify(module + ".weight")
    except UnknownTensorError:
        return None


# --------------------------------------------------------------------------- adapter
_KEY = re.compile(r"(?P<module>.+)\.(?P<what>lora_A|lora_B)\.weight")


@dataclass
class Adapter:
    source: str                       # what the user named
    root: Path                        # local directory
    config: AdapterConfig
    header: Header                    # of adapter_model.safetensors
    modules: dict[str, tuple[TensorEntry, TensorEntry]]  # module -> (lora_A, lora_B), file order
    sha256: str

    @property
    def path(self) -> Path:
        return self.header.path


def resolve_adapter(spec: str) -> Path:
    """A local adapter directory, or a hub repo id downloaded (config and safetensors only)."""
    if not hub.is_repo_id(spec):
        p = Path(spec)
        if not p.exists():
            raise UsageError(f"{spec}: no such adapter directory (and not a hub repo id org/name[@revision])")
        if not p.is_dir():
            raise UsageError(f"{spec}: an adapter is a directory holding {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}")
        return p
    repo, _, rev = spec.partition("@")
    from huggingface_hub import snapshot_download  # lazy: only hub adapters need it

    try:
        local = snapshot_download(repo, revision=rev or None, allow_patterns=[ADAPTER_CONFIG, ADAPTER_WEIGHTS])
    except Exception as e:  # network, auth, missing repo: one clear line
        raise UsageError(f"{spec}: cannot fetch the adapter from the hub: {type(e).__name__}: {e}") from None
    return Path(local)


def open_adapter(spec: str | Path) -> Adapter:
    """Read and validate an adapter's config and safetensors header (no tensor data yet)."""
    root = resolve_adapter(str(spec))
    cfg_path = safe_child(root, ADAPTER_CONFIG, "adapter config")
    cfg = AdapterConfig.from_dict(read_json(cfg_path, "adapter config"), str(cfg_path))
    weights = root / ADAPTER_WEIGHTS
    if not weights.is_file():
        if (root / "adapter_model.bin").exists():
            raise CheckpointError(f"{root}: only {ADAPTER_WEIGHTS} is read; adapter_model.bin is a pickle (which "
                                  f"can run code when loaded). Re-save the adapter with safetensors "
                                  f"(PEFT: save_pretrained(..., safe_serialization=True))")
        raise CheckpointError(f"{weights}: not found")
    try:
        header = read_header(safe_child(root, ADAPTER_WEIGHTS, "adapter weights"))
    except CheckpointError as e:
        raise CheckpointError(f"corrupt adapter: {e}") from None
    found: dict[str, dict[str, TensorEntry]] = {}
    for name, e in header.tensors.items():
        where = f"{weights}: tensor {name!r}"
        key = name[len(PEFT_PREFIX):] if name.startswith(PEFT_PREFIX) else name
        if ".lora_magnitude_vector" in key:
            raise ConfigError(f"{where}: a DoRA magnitude vector: DoRA adapters are not supported")
        if ".lora_embedding_" in key:
            raise ConfigError(f"{where}: an embedding LoRA: only the attention projections (and BF16 routed "
                              f"experts) can be merged")
        if ".lora_B.bias" in key or ".lora_A.bias" in key:
            raise ConfigError(f"{where}: a LoRA bias (lora_bias): the attention projections have no bias")
        m = _KEY.fullmatch(key)
        if m and m.group("what") in found.get(m.group("module"), {}):
            raise CheckpointError(f"{where}: {m.group('module')!r} {m.group('what')} appears twice (with and "
                                  f"without the {PEFT_PREFIX!r} prefix)")
        if not m:
            raise ConfigError(f"{where}: not a LoRA weight ('<module>.lora_A.weight' / '<module>.lora_B.weight'); "
                              f"only plain LoRA adapters can be merged")
        if e.dtype not in _FLOAT:
            raise CheckpointError(f"{where}: dtype {DTYPE_NAMES[e.dtype]} (LoRA weights are BF16/FP16/FP32)")
        if len(e.shape) != 2 or 0 in e.shape:
            raise CheckpointError(f"{where}: shape {list(e.shape)} (LoRA weights are 2-D)")
        found.setdefault(m.group("module"), {})[m.group("what")] = e
    if not found:
        raise CheckpointError(f"{weights}: holds no LoRA weights")
    modules = {}
    for module, ab in found.items():
        for what in ("lora_A", "lora_B"):
            if what not in ab:
                raise CheckpointError(f"{weights}: module {module!r} has no {what}.weight (incomplete adapter)")
        a, b = ab["lora_A"], ab["lora_B"]
        if a.shape[0] != b.shape[1]:
            raise CheckpointError(f"{weights}: module {module!r}: lora_A is {list(a.shape)}, lora_B is {list(b.shape)}: "
                                  f"their ranks differ")
        modules[module] = (a, b)
    return Adapter(str(spec), root, cfg, header, modules, sha256_file(header.path))


def _read_lora(reader: ShardReader, e: TensorEntry) -> torch.Tensor:
    t = reader.get(e.name).float()
    if not bool(torch.isfinite(t).all()):
        raise CheckpointError(f"corrupt adapter: {reader.path}: tensor {e.name!r} contains NaN or Inf")
    return t


# --------------------------------------------------------------------------- plan
@dataclass(frozen=True)
class Target:
    module: str
    part: str           # "attention" or "expert"
    layer: int
    tensor: str         # the checkpoint tensor merged into (module + ".weight")
    shard: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    rank: int
    alpha: float
    scaling: float      # PEFT's scaling (alpha/r or alpha/sqrt(r))
    scale: float        # scaling * --scale: what multiplies B @ A

    def row(self) -> dict:
        return {"module": self.module, "part": self.part, "shard": self.shard, "shape": list(self.shape),
                "dtype": DTYPE_NAMES[self.dtype], "rank": self.rank, "alpha": self.alpha,
                "scaling": self.scaling, "scale": self.scale}


@dataclass
class Plan:
    ckpt: Checkpoint
    headers: dict[str, Header]
    config: dict
    cfg: ModelConfig
    adapter: Adapter
    targets: list[Target]
    user_scale: float
    warnings: list[str]

    @property
    def rewrite(self) -> list[str]:
        shards = {t.shard for t in self.targets}
        return [s for s in self.ckpt.shards if s in shards]

    def summary(self) -> dict:
        a = self.adapter.config
        return {
            "checkpoint": str(self.ckpt.root), "adapter": self.adapter.source,
            "adapter_sha256": self.adapter.sha256, "base_model_name_or_path": a.base_model,
            "r": a.r, "lora_alpha": a.lora_alpha, "use_rslora": a.use_rslora, "user_scale": self.user_scale,
            "modules": len(self.targets),
            "by_part": {p: sum(t.part == p for t in self.targets) for p in MERGEABLE_PARTS},
            "shards_rewritten": len(self.rewrite), "shards_unchanged": len(self.ckpt.shards) - len(self.rewrite),
            "warnings": self.warnings, "targets": [t.row() for t in self.targets],
        }


def _quantized_format(plan_cfg: dict, ckpt: Checkpoint, headers: dict[str, Header], module: str) -> str | None:
    """The number format of `module` when the checkpoint holds it quantized, else None."""
    layers = ((plan_cfg.get("quantization_config") or {}).get("quantized_layers") or {})
    entry = layers.get(module)
    if isinstance(entry, dict) and entry.get("quant_algo"):
        return str(entry["quant_algo"])
    for suffix in ("weight_scale", "weight_scale_2", "input_scale"):
        if f"{module}.{suffix}" in ckpt.weight_map:
            return "quantized"
    shard = ckpt.weight_map.get(module + ".weight")
    if shard is not None:
        e = headers[shard].tensors.get(module + ".weight")
        if e is not None and e.dtype not in _FLOAT:
            return DTYPE_NAMES[e.dtype]
    return None


def _span(layers: list[int]) -> str:
    return f"{min(layers)}-{max(layers)}" if layers else "none"


def check(ckpt_dir: str | Path, adapter_spec: str | Path, *, scale: float = 1.0, dtype: str = "bf16") -> Plan:
    """Validate the adapter against the checkpoint and plan the merge; raise on anything we refuse."""
    if not (isinstance(scale, (int, float)) and math.isfinite(scale)):
        raise UsageError(f"--scale must be a finite number, got {scale!r}")
    if dtype not in DTYPES:
        raise UsageError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    want_dtype = DTYPES[dtype]
    ckpt = Checkpoint.open(ckpt_dir)
    headers = ckpt.headers()
    config_path = safe_child(ckpt.root, "config.json")
    config = read_json(config_path, "config.json")
    cfg = ModelConfig.from_dict(config, str(config_path))
    adapter = open_adapter(adapter_spec)
    acfg, aw = adapter.config, adapter.path
    warnings: list[str] = []
    if acfg.fan_in_fan_out:
        warnings.append("fan_in_fan_out=true ignored, as PEFT does for nn.Linear layers: the projections are "
                        "stored [out, in], so the delta is B @ A")

    # 1. target_modules must select some mergeable module of this checkpoint
    selected, elsewhere = [], []
    for tensor in ckpt.weight_map:
        if not tensor.endswith(".weight"):
            continue
        module = tensor[: -len(".weight")]
        t = classify_module(module)
        if t is not None and acfg.targets(module):
            (selected if t.part in MERGEABLE_PARTS else elsewhere).append((module, t))
    if not selected and elsewhere:
        m, t = elsewhere[0]
        raise ConfigError(f"{adapter.root / ADAPTER_CONFIG}: target_modules={json.dumps(acfg.target_modules)} selects "
                          f"only modules LoRA cannot be merged into (e.g. {m!r}, {t.part}): LoRA merges only into "
                          f"the decoder's attention projections ({', '.join(ATTENTION_PROJECTIONS)}) and, when they "
                          f"are BF16, the routed experts")
    if not selected:
        raise ConfigError(f"{adapter.root / ADAPTER_CONFIG}: target_modules={json.dumps(acfg.target_modules)} matches "
                          f"no attention projection or routed expert of {ckpt.root}: adapter for another model")

    # 2. every adapter module is a mergeable module of this model, which target_modules selects
    targets: list[Target] = []
    for module, (a, b) in adapter.modules.items():
        where = f"{aw}: module {module!r}"
        t = classify_module(module)
        if t is None:
            raise ConfigError(f"{where} is not a module of the Inkling 2 Small layout (expected e.g. "
                              f"'{PEFT_PREFIX}model.layers.0.self_attn.q_proj.lora_A.weight'): adapter for "
                              f"another model?")
        if t.part not in MERGEABLE_PARTS:
            raise ConfigError(f"{where} ({t.part}): LoRA merges only into the decoder's attention projections "
                              f"({', '.join(ATTENTION_PROJECTIONS)}) and, when they are BF16, the routed experts")
        if t.layer >= cfg.num_hidden_layers:
            raise ConfigError(f"{where} is in layer {t.layer}, but config.json has {cfg.num_hidden_layers} layers: "
                              f"adapter for another model")
        if t.part == "expert" and t.expert >= cfg.num_experts:
            raise ConfigError(f"{where} is expert {t.expert}, but config.json has {cfg.num_experts} routed experts: "
                              f"adapter for another model")
        if not acfg.targets(module):
            raise ConfigError(f"{where} has LoRA weights, but the adapter config's target_modules="
                              f"{json.dumps(acfg.target_modules)} does not select it: adapter files do not match")
        fmt = _quantized_format(config, ckpt, headers, module)
        if fmt is not None:
            if t.part == "expert":
                raise ConfigError(
                    f"{where}: the routed experts of this checkpoint are {fmt}; expert adapters need BF16 expert "
                    f"weights (the Inkling 2 Small recipe: 'with the NVFP4/MXFP8 experts, use attention-only "
                    f"adapters'). Merge into the BF16 source before converting, or train an attention-only adapter")
            raise ConfigError(f"{where}: the checkpoint holds this projection quantized ({fmt}); LoRA merges into "
                              f"unquantized weights only")
        tensor = module + ".weight"
        shard = ckpt.weight_map.get(tensor)
        if shard is None:
            raise CheckpointError(f"{ckpt.root}: tensor {tensor!r} (targeted by the adapter) is not in the checkpoint")
        e = headers[shard].tensors[tensor]
        if e.dtype != want_dtype:
            stored = next((k for k, v in DTYPES.items() if v == e.dtype), None)
            hint = f"; pass --dtype {stored} to merge into {stored} weights" if stored else ""
            raise UsageError(f"{ckpt.root / shard}: tensor {tensor!r} is {DTYPE_NAMES[e.dtype]}, not {dtype}: the "
                             f"merge rounds to the stored dtype and never changes it{hint}")
        out_f, in_f = e.shape
        if a.shape[1] != in_f or b.shape[0] != out_f:
            hint = ""
            if t.part == "attention" and t.projection != "o_proj" and a.shape[1] != in_f:
                hint = f" (trained on hidden_size {a.shape[1]}; this checkpoint has {cfg.hidden_size})"
            raise ConfigError(f"{where}: shape mismatch: B @ A is [{b.shape[0]}, {a.shape[1]}] but the checkpoint's "
                              f"weight is {list(e.shape)}{hint}: adapter for another model")
        r, alpha, scaling = acfg.scaling(module)
        if a.shape[0] != r:
            raise ConfigError(f"{where}: lora_A has rank {a.shape[0]} but the adapter config gives r={r} for this "
                              f"module (r / rank_pattern): the scale alpha/r would be wrong")
        targets.append(Target(module, t.part, t.layer, tensor, shard, tuple(e.shape), e.dtype, r, alpha, scaling,
                              scaling * scale))

    # 3. modules target_modules selects here but the adapter lacks: another (smaller) model
    missing = [(m, t) for m, t in selected if m not in adapter.modules]
    if missing:
        have = sorted({t.layer for t in targets})
        miss_layers = sorted({t.layer for _, t in missing})
        if have and min(miss_layers) > max(have):
            raise ConfigError(f"{aw}: LoRA weights for layers {_span(have)} only, but target_modules selects layers up "
                              f"to {max(miss_layers)} of this {cfg.num_hidden_layers}-layer checkpoint: adapter for "
                              f"another model (fewer layers)")
        raise ConfigError(f"{aw}: target_modules selects {len(missing)} module(s) the adapter has no weights for, e.g. "
                          f"{missing[0][0]!r}: incomplete adapter or another model")

    # 4. adapter values: finite (one tensor at a time; adapters are small beside the model)
    with ShardReader(aw, adapter.header) as reader:
        for a, b in adapter.modules.values():
            _read_lora(reader, a)
            _read_lora(reader, b)

    if acfg.base_model:
        warnings.append(f"adapter trained on {acfg.base_model!r} (base_model_name_or_path; shapes and layer "
                        f"count were checked against this checkpoint, the name is not)")
    order = {n: i for i, n in enumerate(ckpt.weight_map)}
    shard_pos = {s: i for i, s in enumerate(ckpt.shards)}
    targets.sort(key=lambda t: (shard_pos[t.shard], order[t.tensor]))
    return Plan(ckpt, headers, config, cfg, adapter, targets, float(scale), warnings)


# --------------------------------------------------------------------------- merge
def merged_weight(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """W + scale * (B @ A), computed in FP32 and rounded once (to nearest even) to W's dtype.

    The same operations, in the same order, as PEFT's merge with FP32 adapter weights
    (`get_delta_weight`: (B @ A) * scaling in FP32; then `weight.data += delta`, which adds in FP32
    and rounds once), so the bits match PEFT's `merge_and_unload()` exactly."""
    delta = b.float() @ a.float()
    delta.mul_(scale)
    delta.add_(w)  # FP32 += BF16: the weight is widened exactly, the sum is FP32
    return delta.to(w.dtype)


def _rewrite_shard(plan: Plan, shard: str, dst: Path, factors: ShardReader, expected: str | None, bar) -> str:
    """dst = the source shard with its targeted tensors merged, every other tensor byte for byte,
    file order and metadata kept. The source file is hashed on the way and checked when its
    digest is known. Returns dst's sha256."""
    header = plan.headers[shard]
    targets = {t.tensor: t for t in plan.targets if t.shard == shard}
    buf = TensorBuffer()
    h = hashlib.sha256() if expected is not None else None
    if h is not None:
        with open(header.path, "rb") as f:
            h.update(f.read(header.data_start))
    specs = [(e.name, e.dtype, e.shape) for e in header.tensors.values()]
    with ShardReader(header.path, header) as reader, \
            ShardWriter(dst, specs, header.metadata or None, direct=True) as w:
        for e in header.tensors.values():
            mv = reader.read_bytes(e, buf.view(e.nbytes)) if e.nbytes else memoryview(b"")
            if h is not None:
                h.update(mv)
            t = torch.frombuffer(mv, dtype=e.dtype).reshape(e.shape) if e.nbytes else torch.empty(e.shape, dtype=e.dtype)
            tgt = targets.get(e.name)
            if tgt is not None:
                a_e, b_e = plan.adapter.modules[tgt.module]
                merged = merged_weight(t, _read_lora(factors, a_e), _read_lora(factors, b_e), tgt.scale)
                if not bool(torch.isfinite(merged).all()):
                    raise CheckpointError(f"{header.path}: tensor {e.name!r}: the merged weight has Inf/NaN "
                                          f"(overflow of {DTYPE_NAMES[e.dtype]}; is --scale too large?)")
                t = merged
            w.write(e.name, t)
            bar.update(e.nbytes)
        if h is not None and h.hexdigest() != expected:
            raise CheckpointError(f"{header.path}: sha256 {h.hexdigest()} does not match {CHECKSUMS} ({expected}): "
                                  f"the shard is corrupt")
        return w.commit()


def merged_config(plan: Plan) -> dict:
    """config.json with the merge recorded under PROVENANCE_KEY (appended: merges stack)."""
    config = dict(plan.config)
    record = {
        "adapter": plan.adapter.source, "adapter_sha256": plan.adapter.sha256,
        "base_model_name_or_path": plan.adapter.config.base_model,
        "r": plan.adapter.config.r, "lora_alpha": plan.adapter.config.lora_alpha,
        "use_rslora": plan.adapter.config.use_rslora, "scale": plan.user_scale,
        "modules": len(plan.targets), "tool": f"inkling-quant {__version__}",
    }
    prior = config.get(PROVENANCE_KEY)
    config[PROVENANCE_KEY] = (list(prior) if isinstance(prior, list) else []) + [record]
    return config


def merge(ckpt_dir: str | Path, adapter_spec: str | Path, out: str | Path, *, scale: float = 1.0,
          dtype: str = "bf16", overwrite: bool = False, copy: bool = False, progress: bool = False) -> dict:
    """Write CKPT with the adapter merged to OUT; return a report."""
    plan = check(ckpt_dir, adapter_spec, scale=scale, dtype=dtype)
    ckpt, headers = plan.ckpt, plan.headers
    root = ckpt.root
    sums_in = read_checksums(safe_child(root, CHECKSUMS)) if (root / CHECKSUMS).exists() else None
    rewrite = set(plan.rewrite)
    sums: dict[str, str] = {}
    counts = {"rewritten": 0, "linked": 0, "copied": 0}
    bar_total = sum(h.file_size for h in headers.values())
    with staged_output(out, [root, plan.adapter.root], overwrite) as tmp, \
            ShardReader(plan.adapter.path, plan.adapter.header) as factors, \
            tqdm(total=bar_total, unit="B", unit_scale=True, desc="lora merge", disable=not progress) as bar:
        for s in ckpt.shards:
            expected = sums_in.get(s) if sums_in is not None else None
            if s in rewrite:
                digest = _rewrite_shard(plan, s, tmp / s, factors, expected, bar)
                counts["rewritten"] += 1
            else:
                digest, how = link_or_copy(safe_child(root, s, "shard"), tmp / s, copy, expected, False, bar)
                counts[how] += 1
            if digest is not None:
                sums[s] = digest
        write_json_atomic(tmp / "config.json", merged_config(plan))
        others = ckpt.other_files() + [safe_child(root, n) for n in (INDEX_NAME, QUANT_CONFIG) if (root / n).is_file()]
        for p in others:
            copy_file_atomic(p, tmp / p.name)
        if sums_in is not None:
            # the files the source lists, as OUT has them: merged shards and config.json re-hashed,
            # linked shards with the source's digest (same inode), copied small files re-hashed
            out_sums = {}
            for f in sums_in:
                plain = "/" not in f and "\\" not in f and f not in (".", "..", CHECKSUMS)
                if plain and (tmp / f).is_file():
                    out_sums[f] = sums.get(f) or sha256_file(tmp / f)
            write_checksums(tmp / CHECKSUMS, out_sums)
    return {"action": "merge", "output": str(out), **counts, "checksums": sums_in is not None,
            **plan.summary()}


# --------------------------------------------------------------------------- CLI
def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    c = sub.add_parser("check", help="report what would be merged where, without writing",
                       description="Validate ADAPTER against CKPT and list every module it would merge: "
                                   "module, shard, rank, alpha, scale. Exit 0 when the merge would succeed.")
    m = sub.add_parser("merge", help="merge a PEFT LoRA adapter into the checkpoint's BF16 attention projections",
                       description="Write CKPT with ADAPTER merged (W' = W + scale * B @ A, FP32, rounded once) to OUT; "
                                   "shards without a merged tensor are hardlinked (or copied with --copy).")
    for q in (c, m):
        q.add_argument("ckpt", help="checkpoint directory: converted (NVFP4/MXFP8 experts) or a BF16 source")
        q.add_argument("adapter", help="PEFT adapter directory (adapter_config.json + adapter_model.safetensors) "
                                       "or hub repo id org/name[@revision]")
    m.add_argument("out", help="output directory (built in OUT.partial, renamed when complete)")
    for q in (c, m):
        q.add_argument("--scale", type=float, default=1.0,
                       help="multiplies the adapter's own scale (lora_alpha/r, or /sqrt(r) with rsLoRA); default 1")
        q.add_argument("--dtype", default="bf16", choices=sorted(DTYPES),
                       help="dtype of the merged projections: must be the stored dtype, which the merge keeps "
                            "(default bf16)")
        q.add_argument("--json", metavar="REPORT", help="write the plan/report as JSON to REPORT ('-' for stdout)")
        q.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    m.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    m.add_argument("--copy", action="store_true", help="copy unchanged shards instead of hardlinking them")


def print_plan(s: dict) -> None:
    rs = " (rsLoRA: alpha/sqrt(r))" if s["use_rslora"] else ""
    print(f"adapter {s['adapter']}: LoRA r={s['r']} alpha={s['lora_alpha']}{rs}, --scale {s['user_scale']:g}")
    for w in s["warnings"]:
        print(f"  note: {w}")
    parts = ", ".join(f"{n} {p}" for p, n in s["by_part"].items() if n)
    print(f"{s['modules']} module(s) ({parts}) into {s['checkpoint']}: {s['shards_rewritten']} shard(s) rewritten, "
          f"{s['shards_unchanged']} unchanged")
    width = max(len(t["module"]) for t in s["targets"])
    swidth = max(len(t["shard"]) for t in s["targets"])
    print(f"  {'module':<{width}}  {'shard':<{swidth}}  {'rank':>4}  {'alpha':>7}  {'scale':>10}")
    for t in s["targets"]:
        print(f"  {t['module']:<{width}}  {t['shard']:<{swidth}}  {t['rank']:>4}  {t['alpha']:>7g}  {t['scale']:>10.6g}")


def run(args) -> int:
    quiet = args.quiet or args.json == "-"
    check_paths(getattr(args, "out", None), [args.ckpt, args.adapter if Path(args.adapter).exists() else None],
                reports=[args.json])
    if args.action == "check":
        plan = check(args.ckpt, args.adapter, scale=args.scale, dtype=args.dtype)
        report = {"action": "check", **plan.summary()}
        if not quiet:
            print_plan(report)
    elif args.action == "merge":
        report = merge(args.ckpt, args.adapter, args.out, scale=args.scale, dtype=args.dtype,
                       overwrite=args.overwrite, copy=args.copy, progress=not quiet)
        if not quiet:
            print_plan(report)
            print(f"merged into {report['output']}: {report['rewritten']} shard(s) rewritten, {report['linked']} "
                  f"linked, {report['copied']} copied" + ("" if report["checksums"] else
                                                           " (source had no checksums.sha256: none written)"))
    else:  # pragma: no cover - argparse refuses other actions
        raise InklingQuantError(f"unknown action {args.action!r}")
    write_report(args.json, json.dumps(report, indent=2) + "\n")
    return 0
