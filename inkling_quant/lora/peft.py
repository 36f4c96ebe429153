"""The PEFT side of `inkling-quant lora`: what an adapter is and what of it is refused.

- The adapter config (`AdapterConfig`): the LoraConfig fields that decide which modules an
  adapter touches and how much, PEFT's own targeting and scaling rules, and the adapter's own
  patterns matched in bounded time (`_user_match`).
- The refusal tables: the settings whose value changes what the saved A/B mean (`_UNSUPPORTED`,
  `_BASE_MODIFYING_INIT`, `_KNOWN_KEYS`) and the tensors that are not LoRA deltas
  (`_REFUSED_TENSORS`). Which parts of the model LoRA merges into is the layout's business
  (plan.py and the layout's naming: inkling.py, hf.py).
- The adapter files (`open_adapter`): adapter_config.json + adapter_model.safetensors, local or
  from the hub, validated before any tensor data is read.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import regex
import torch

from .. import hub
from ..errors import CheckpointError, ConfigError, UsageError, prefixed
from ..io.checkpoint import read_json, safe_child
from ..io.safetensors import DTYPE_NAMES, Header, ShardReader, TensorEntry, read_header, sha256_file

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # what LoRA factors may be stored as

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
    "target_parameters",  # LoRA on nn.Parameters: the stacked routed experts (lora/plan.py)
} | set(_UNSUPPORTED)

# Tensors of adapter_model.safetensors that are not plain LoRA deltas: (key fragments, why).
_REFUSED_TENSORS: tuple[tuple[tuple[str, ...], str], ...] = (
    ((".lora_magnitude_vector",), "a DoRA magnitude vector: DoRA adapters are not supported"),
    ((".lora_embedding_",), "an embedding LoRA: only the attention projections (and BF16 routed experts) can "
                            "be merged"),
    ((".lora_B.bias", ".lora_A.bias"), "a LoRA bias (lora_bias): the attention projections have no bias"),
)


def _number(d: dict, key: str, path: str, default=None, positive: bool = True, section: str = "") -> float:
    v = d.get(key, default)
    try:
        finite = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    except OverflowError:  # an integer too large for a float
        finite = False
    if not finite or (positive and v <= 0):
        raise ConfigError(f"{section}{key!r} must be a {'positive ' if positive else ''}finite number, got {v!r}",
                          path=path)
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


def _refuse_settings(d: dict, path: str) -> None:
    """Raise ConfigError for an adapter config that is not a plain LoRA delta W + s*B@A."""
    peft_type = d.get("peft_type")
    if peft_type is None:
        raise ConfigError("missing key 'peft_type' (not a PEFT adapter config?)", path=path)
    if str(peft_type).upper() != "LORA":
        raise ConfigError(f"peft_type is {peft_type!r}; only plain LoRA adapters (peft_type 'LORA') "
                          f"can be merged", path=path)
    for key, why in _UNSUPPORTED.items():
        if d.get(key):
            raise ConfigError(f"{key}={json.dumps(d[key])} is not supported: {why}", path=path)
    init = d.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_BASE_MODIFYING_INIT):
        raise ConfigError(
            f"init_lora_weights={init!r} trains against modified base weights, so A/B are not a delta "
            f"on this checkpoint; convert it to a plain LoRA adapter first (PEFT: save_pretrained(..., "
            f"path_initial_model_for_weight_conversion=...))", path=path)
    bias = d.get("bias", "none")
    if bias not in (None, "none"):
        raise ConfigError(f"bias={bias!r} trains base-layer biases; the attention projections have "
                          f"none (only bias='none' adapters can be merged)", path=path)
    unknown = sorted(k for k in d if k not in _KNOWN_KEYS and d[k] not in (None, False, "", [], {}, 0))
    if unknown:
        raise ConfigError(f"unknown setting(s) {', '.join(f'{k}={json.dumps(d[k])}' for k in unknown)}: "
                          f"possibly a LoRA variant this tool does not know; refusing rather than merging "
                          f"something other than W + s*B@A", path=path)


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
    target_parameters: list[str]      # PEFT's `target_parameters`: parameters (not modules) it wraps
    fan_in_fan_out: bool
    base_model: str | None
    raw: dict = field(compare=False, repr=False)

    @classmethod
    def from_dict(cls, d: dict, path: str) -> "AdapterConfig":
        """Validate adapter_config.json (`d`, read from `path`): refuse what is not plain LoRA."""
        _refuse_settings(d, path)
        r = _number(d, "r", path, 8)
        if int(r) != r:
            raise ConfigError(f"'r' must be a positive integer, got {r!r}", path=path)
        alpha = _number(d, "lora_alpha", path, 8)
        rank_pattern = d.get("rank_pattern") or {}
        alpha_pattern = d.get("alpha_pattern") or {}
        for name, pat in (("rank_pattern", rank_pattern), ("alpha_pattern", alpha_pattern)):
            if not isinstance(pat, dict):
                raise ConfigError(f"{name!r} must be an object, got {pat!r}", path=path)
            for k in pat:
                _number(pat, k, path, section=f"{name}: ")
                try:
                    re.compile(k)
                except (re.error, RecursionError, OverflowError) as e:
                    raise ConfigError(f"{name} key {k!r} is not a valid pattern: {e}", path=path) from None
        for k, v in rank_pattern.items():
            if int(v) != v:
                raise ConfigError(f"rank_pattern[{k!r}] must be a positive integer, got {v!r}", path=path)
        targets = d.get("target_modules")
        excludes = d.get("exclude_modules")
        for name, v in (("target_modules", targets), ("exclude_modules", excludes)):
            if v is not None and not isinstance(v, str) and not (
                    isinstance(v, list) and all(isinstance(x, str) for x in v)):
                raise ConfigError(f"{name!r} must be a string (regex) or a list of names, got {v!r}", path=path)
            if isinstance(v, str):
                try:
                    re.compile(v)
                except (re.error, RecursionError, OverflowError) as e:
                    raise ConfigError(f"{name} {v!r} is not a valid pattern: {e}", path=path) from None
        params = d.get("target_parameters") or []
        if not (isinstance(params, list) and all(isinstance(x, str) for x in params)):
            raise ConfigError(f"'target_parameters' must be a list of parameter names, got {params!r}", path=path)
        if not targets and not params:
            raise ConfigError("'target_modules' is empty: the adapter targets no module", path=path)
        layers = d.get("layers_to_transform")
        if layers is not None and not (type(layers) is int or (isinstance(layers, list)
                                                               and all(type(x) is int for x in layers))):
            raise ConfigError("'layers_to_transform' must be an integer or a list of integers", path=path)
        pattern = d.get("layers_pattern")
        if pattern is not None and not (isinstance(pattern, str) or (isinstance(pattern, list)
                                                                     and all(isinstance(x, str) for x in pattern))):
            raise ConfigError("'layers_pattern' must be a string or a list of strings", path=path)
        for p in [pattern] if isinstance(pattern, str) else pattern or []:
            try:
                re.compile(_layer_pattern(p))
            except (re.error, RecursionError, OverflowError) as e:
                raise ConfigError(f"layers_pattern {p!r} is not a valid pattern: {e}", path=path) from None
        return cls(r=int(r), lora_alpha=alpha, use_rslora=_flag(d, "use_rslora", path),
                   target_modules=list(targets) if isinstance(targets, list) else targets,
                   exclude_modules=list(excludes) if isinstance(excludes, list) else excludes,
                   layers_to_transform=layers, layers_pattern=pattern,
                   rank_pattern={k: int(v) for k, v in rank_pattern.items()},
                   alpha_pattern=dict(alpha_pattern), target_parameters=list(params),
                   fan_in_fan_out=_flag(d, "fan_in_fan_out", path),
                   base_model=d.get("base_model_name_or_path"), raw=dict(d))

    # PEFT's own rules (peft.tuners.tuners_utils.check_target_module_exists, peft.utils.other.get_pattern_key)
    def targets(self, module: str, is_linear) -> bool:
        """Whether PEFT would put a LoRA layer on `module` (its name in the base model).
        `is_linear(module)` decides "all-linear" (the layout knows which modules are Linears)."""
        tm = self.target_modules
        if not tm:  # target_parameters only
            return False
        ex = self.exclude_modules
        if ex:
            if isinstance(ex, str):
                if _user_match(ex, module, full=True):
                    return False
            elif module in ex or any(module.endswith("." + k) for k in ex):
                return False
        if isinstance(tm, str):
            if tm.lower() == "all-linear":  # every Linear but the output layer
                return is_linear(module)
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
                m = _user_match(_layer_pattern(p), module)
                if m:
                    break
        if not m:
            return False
        layer = int(m.group("idx"))
        return layer == idx if isinstance(idx, int) else layer in idx

    def targets_parameter(self, key: str) -> bool:
        """Whether PEFT would wrap the parameter `key` (module + "." + parameter name) for
        `target_parameters` (peft.tuners.tuners_utils._inject_parameters: the key equals an
        entry or ends with "." + it; exclude_modules and layers_to_transform do not apply)."""
        return any(key == k or key.endswith("." + k) for k in self.target_parameters)

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
            raise UsageError("no such adapter directory (and not a hub repo id org/name[@revision])", path=spec)
        if not p.is_dir():
            raise UsageError(f"an adapter is a directory holding {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}", path=spec)
        return p
    return hub.snapshot(spec, allow_patterns=[ADAPTER_CONFIG, ADAPTER_WEIGHTS])


def open_adapter(spec: str | Path) -> Adapter:
    """Read and validate an adapter's config and safetensors header (no tensor data yet)."""
    root = resolve_adapter(str(spec))
    cfg_path = safe_child(root, ADAPTER_CONFIG, "adapter config")
    cfg = AdapterConfig.from_dict(read_json(cfg_path, "adapter config"), str(cfg_path))
    weights = root / ADAPTER_WEIGHTS
    if not weights.is_file():
        if (root / "adapter_model.bin").exists():
            raise CheckpointError(f"only {ADAPTER_WEIGHTS} is read; adapter_model.bin is a pickle (which "
                                  f"can run code when loaded). Re-save the adapter with safetensors "
                                  f"(PEFT: save_pretrained(..., safe_serialization=True))", path=root)
        raise CheckpointError("not found", path=weights)
    try:
        header = read_header(safe_child(root, ADAPTER_WEIGHTS, "adapter weights"))
    except CheckpointError as e:
        raise prefixed("corrupt adapter: ", e, CheckpointError) from None
    found: dict[str, dict[str, TensorEntry]] = {}
    for name, e in header.tensors.items():
        where = f"tensor {name!r}"
        key = name[len(PEFT_PREFIX):] if name.startswith(PEFT_PREFIX) else name
        for fragments, why in _REFUSED_TENSORS:
            if any(f in key for f in fragments):
                raise ConfigError(f"{where}: {why}", path=weights, tensor=name)
        m = _KEY.fullmatch(key)
        if m and m.group("what") in found.get(m.group("module"), {}):
            raise CheckpointError(f"{where}: {m.group('module')!r} {m.group('what')} appears twice (with and "
                                  f"without the {PEFT_PREFIX!r} prefix)", path=weights, tensor=name)
        if not m:
            raise ConfigError(f"{where}: not a LoRA weight ('<module>.lora_A.weight' / '<module>.lora_B.weight'); "
                              f"only plain LoRA adapters can be merged", path=weights, tensor=name)
        if e.dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"{where}: dtype {DTYPE_NAMES[e.dtype]} (LoRA weights are BF16/FP16/FP32)",
                                  path=weights, tensor=name)
        if len(e.shape) != 2 or 0 in e.shape:
            raise CheckpointError(f"{where}: shape {list(e.shape)} (LoRA weights are 2-D)", path=weights, tensor=name)
        found.setdefault(m.group("module"), {})[m.group("what")] = e
    if not found:
        raise CheckpointError("holds no LoRA weights", path=weights)
    modules = {}
    for module, ab in found.items():
        for what in ("lora_A", "lora_B"):
            if what not in ab:
                raise CheckpointError(f"module {module!r} has no {what}.weight (incomplete adapter)", path=weights)
        a, b = ab["lora_A"], ab["lora_B"]
        if a.shape[0] != b.shape[1]:
            raise CheckpointError(f"module {module!r}: lora_A is {list(a.shape)}, lora_B is {list(b.shape)}: "
                                  f"their ranks differ", path=weights)
        modules[module] = (a, b)
    return Adapter(str(spec), root, cfg, header, modules, sha256_file(header.path))


def read_lora(reader: ShardReader, e: TensorEntry) -> torch.Tensor:
    """A LoRA factor of the adapter file, as FP32; NaN or Inf is a corrupt adapter."""
    t = reader.get(e.name).float()
    if not bool(torch.isfinite(t).all()):
        raise prefixed("corrupt adapter: ", CheckpointError(f"tensor {e.name!r} contains NaN or Inf", path=reader.path,
                                                            tensor=e.name))
    return t


def quantized_refusal(where: str, part: str, fmt: str, path, rule: str) -> ConfigError:
    """Why an adapter module cannot merge into a quantized checkpoint tensor (for routed experts,
    the layout's `rule`: the recipe's words for Inkling 2)."""
    if part == "expert":
        return ConfigError(
            f"{where}: the routed experts of this checkpoint are {fmt}; expert adapters need BF16 expert "
            f"weights {rule}. Merge into the BF16 source before converting, or train an attention-only adapter",
            path=path)
    return ConfigError(f"{where}: the checkpoint holds this projection quantized ({fmt}); LoRA merges into "
                       f"unquantized weights only", path=path)


def _layer_pattern(p: str) -> str:
    """PEFT's regex around a `layers_pattern` entry (tuners_utils.check_target_module_exists)."""
    return rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\."


def _flag(d: dict, key: str, path: str) -> bool:
    """A true/false setting (absent: false); a string such as "false" would be truthy and, for
    use_rslora, double the scale silently."""
    v = d.get(key, False)
    if not isinstance(v, bool):
        raise ConfigError(f"{key!r} must be true or false, got {v!r}", path=path)
    return v
