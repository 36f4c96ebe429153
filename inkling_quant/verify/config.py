"""The `config` check: config.json and hf_quant_config.json, read (`load_config`: they decide the
scheme) and then held against the tensors (`check_config`: algorithm per layer, exclude_modules,
group sizes, activation scale presence). `check_config_files` runs both on their own, holding
the quantization configs to what the scheme prescribes."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Mapping

from ..errors import ConfigError, InklingQuantError, UsageError
from ..export.modelopt import MIXED_PRECISION, modelopt_quantization_config, quantization_problems
from ..export import fp8_release, kimi_k3
from ..io.checkpoint import HF_QUANT_CONFIG as QUANT_CONFIG
from ..model.inkling2 import experts_module, modelopt_experts_module
from ..model.layout import model_config
from ..model.sources import source_quant
from ..schemes import SCHEMES, from_record, get_scheme
from ..model.tensors import TensorName
from .inventory import UNQUANTIZED, Conf, converter_of, load_json
from .report import ERROR, Check, Recorder, VerifyReport


# ============================================================================ load


def load_config(run: Recorder, root: Path, scheme_arg: str | None) -> Conf:
    """The first half of the `config` check: config.json parses as the published Inkling 2
    model's (text_config nested) or another MoE family's (layout.model_config), and the scheme
    is known (--scheme, else the converter's record, else default; none if unquantized)."""
    c = run.new("config", "config", "config.json / hf_quant_config.json agree with the tensors")
    config = run.guard(c, load_json, root / "config.json", "config.json", c)
    conf = run.guard(c, _parse, c, root, config, scheme_arg) if config is not None else None
    conf = conf or Conf(root, config)
    if conf.scheme is not None:
        run.report.scheme = conf.scheme.name
    return conf


def _parse(c: Check, root: Path, config: dict, scheme_arg: str | None) -> Conf:
    path = root / "config.json"
    try:
        cfg = model_config(config, str(path))
    except InklingQuantError as e:
        c.fail(path, None, e.message)
        return Conf(root, config)
    qpath = root / QUANT_CONFIG
    hf_quant = load_json(qpath, QUANT_CONFIG, c) if qpath.exists() else None
    converter = converter_of(hf_quant)
    recorded = converter.get("scheme") if isinstance(converter, dict) else None
    given = scheme_arg is not None or recorded is not None
    scheme = None
    try:
        if scheme_arg is not None:  # --scheme: a built-in or a scheme file
            scheme = get_scheme(scheme_arg)
        elif recorded is not None:  # what the converter recorded: a built-in's name or a user scheme's rules
            scheme = from_record(recorded, str(qpath))
        else:  # a quantization config of a source's format: stored as the source is (a --scheme none copy)
            quantized = ("quantization_config" in config and not _source_format(c, config, path)) or hf_quant is not None
            scheme = SCHEMES["default" if quantized else UNQUANTIZED]
    except UsageError as e:
        c.fail(qpath if scheme_arg is None else scheme_arg, None, f"{e.message}; pass --scheme")
    if scheme is not None:
        c.figures["scheme"] = scheme.name
        if scheme_arg is not None and recorded is not None and recorded != scheme.record():
            c.figures["converter_scheme"] = recorded if isinstance(recorded, str) else recorded.get("name")
    return Conf(root, config, cfg, hf_quant, scheme, given)


def _source_format(c: Check, config: dict, path: Path) -> bool:
    """Whether config.json's quantization_config is a source's (FP8 block-scaled, MXFP4); an FP8
    one convert does not read counts as one, its problem recorded in `c`."""
    try:
        return source_quant(config, str(path)) is not None
    except ConfigError as e:
        c.fail(e.path or path, None, e.message)
        return True


# ============================================================================ against the tensors
def check_config(run: Recorder, conf: Conf, weight_only: bool, want: dict[str, dict] | None,
                 tensor_of: Callable[[str], str] | None = None, unquantized: Mapping[str, str] | None = None) -> None:
    """The second half of the `config` check, once the tensors decided `weight_only`: both
    quantization configs list exactly the modules in `want` (experts module -> its
    quantized_layers entry; None: the layout check could not list them), with their algorithm.
    A problem about an experts module names the tensor `tensor_of(module)` (default: the
    Inkling 2 layout's, `named_tensor`). A config of one format (no quantized_layers) must exclude
    every module in `unquantized` (module -> its tensor: what the tensors leave unquantized that
    an engine would quantize; experts.unquantized)."""
    c = run.report.check("config")
    if not conf.usable or c.status == ERROR:
        return
    if want is None:
        c.figures["tensors"] = "not compared (the layout check could not list them)"
        return
    run.guard(c, _check, c, conf, weight_only, (want, dict(unquantized or {})), tensor_of or named_tensor)


def check_source_config(run: Recorder, conf: Conf) -> None:
    """The second half of the `config` check for a checkpoint stored in a source's format (a
    `--scheme none` copy of an FP8 or MXFP4 source, as the layout check found): its
    quantization_config is one convert reads as a source (model.sources.source_quant), there is
    no hf_quant_config.json (that describes ModelOpt's formats), and the scheme, given, is none."""
    c = run.report.check("config")
    if not conf.usable or c.status == ERROR:
        return
    path = conf.root / "config.json"
    try:
        q = source_quant(conf.config, str(path))
    except ConfigError as e:
        c.fail(e.path or path, None, e.message)
        return
    c.figures["stored_as"] = q.describe()
    if conf.hf_quant is not None:
        c.fail(conf.root / QUANT_CONFIG, None, f"present, but the tensors are stored as a quantized source stores them "
               f"({q.describe()}), not in ModelOpt's formats")
    if conf.scheme.name != UNQUANTIZED:
        c.fail(path, None, f"the tensors are stored as a quantized source stores them ({q.describe()}): a copy "
               f"(scheme {UNQUANTIZED!r}); scheme {conf.scheme.name!r} prescribes converted experts")


def _check(c: Check, conf: Conf, weight_only: bool, tensors: tuple[dict[str, dict], list[str]],
           tensor_of: Callable[[str], str]) -> None:
    want = tensors[0]
    path, qpath = conf.root / "config.json", conf.root / QUANT_CONFIG
    qc = conf.config.get("quantization_config")
    if not want:
        if qc is not None:
            c.fail(path, None, "has a quantization_config but no module is quantized")
        return
    if not isinstance(qc, dict):
        c.fail(path, None, "missing 'quantization_config' (vLLM would load the checkpoint unquantized)")
        return
    if conf.cfg.family.moe_quant_algo:
        _check_fp8_release(c, conf, qc, tensors, tensor_of)
        return
    if conf.cfg.family.modelopt_aliases:  # Kimi-K3's form: each module under every spelling its loaders probe
        canonical = {a: m for m in want for a in kimi_k3.aliases(m)}
        want, tensor_of = {a: want[m] for a, m in canonical.items()}, lambda a, f=tensor_of: f(canonical.get(a, a))
        tensors = (want, tensors[1])
    if not str(qc.get("quant_method", "")).startswith("modelopt"):
        c.fail(path, None, f"quantization_config.quant_method is {qc.get('quant_method')!r}, expected 'modelopt'")
    _check_quant_dict(c, path, "quantization_config", qc, tensors, tensor_of)
    hq = conf.hf_quant
    if hq is None:
        c.fail(qpath, None, f"{QUANT_CONFIG} missing")
    elif not isinstance(hq.get("quantization"), dict):
        c.fail(qpath, None, "missing the 'quantization' object")
    else:
        q = hq["quantization"]
        _check_quant_dict(c, qpath, "quantization", q, tensors, tensor_of)
        for k, kc in _disagreements(q, qc, conf.modelopt_hf, conf.cfg.family.modelopt_aliases):
            c.fail(qpath, None, f"quantization.{k} disagrees with config.json quantization_config.{kc}" +
                   (" (ModelOpt's form of quantization)" if conf.modelopt_hf else ""))
        if not isinstance(hq.get("producer"), dict):
            c.fail(qpath, None, "missing the 'producer' object")
        conv = hq.get("converter")
        if isinstance(conv, dict) and "weight_only" in conv and bool(conv["weight_only"]) != weight_only:
            c.fail(qpath, None, f"converter.weight_only is {conv['weight_only']} but the NVFP4 tensors "
                   f"{'lack' if weight_only else 'have'} an activation scale (input_scale / input_amax)")
    c.figures.update(quantized_layers=len(want), weight_only=weight_only)


def _check_fp8_release(c: Check, conf: Conf, qc: dict, tensors: tuple[dict[str, dict], list[str]],
                       tensor_of: Callable[[str], str]) -> None:
    """ModelOpt's FP8-release form (export/fp8_release.py, DeepSeek-V4's): config.json's
    quantization_config the source's FP8 one with `moe_quant_algo` the experts' quant_algo,
    NVFP4 (the only one its loader reads: fp8_release.check_units); it and hf_quant_config.json's
    `quantization` each a MIXED_PRECISION manifest listing exactly the quantized experts
    modules, none excluded (config.json's exclusions spelled `ignore`)."""
    want = tensors[0]
    path, qpath = conf.root / "config.json", conf.root / QUANT_CONFIG
    algos = sorted({str(e.get("quant_algo")) for e in want.values()})
    if algos != ["NVFP4"]:
        c.fail(path, None, f"the routed experts' tensors are {', '.join(algos)}: this form's loader reads NVFP4 "
               f"(W4A4) experts only (vLLM's DeepseekV4FP8Config, by moe_quant_algo)")
    if qc.get("quant_method") != "fp8":
        c.fail(path, None, f"quantization_config.quant_method is {qc.get('quant_method')!r}, expected 'fp8' (the "
               f"source's FP8 config kept, ModelOpt's form for this family)")
    if algos and qc.get("moe_quant_algo") != algos[0]:
        c.fail(path, None, f"quantization_config.moe_quant_algo is {qc.get('moe_quant_algo')!r}, the routed "
               f"experts' tensors are {algos[0]!r}")
    for problem in fp8_release.config_problems(conf.config):
        c.fail(path, None, problem)
    q = conf.hf_quant.get("quantization") if isinstance(conf.hf_quant, dict) else None
    if not isinstance(q, dict):
        c.fail(qpath, None, f"{QUANT_CONFIG} missing or without its 'quantization' object (the experts' manifest)")
    for file, key, d in ((path, "quantization_config", qc), (qpath, "quantization", q)):
        if not isinstance(d, dict):
            continue
        if d.get("quant_algo") != MIXED_PRECISION:
            c.fail(file, None, f"{key}.quant_algo is {d.get('quant_algo')!r}, expected '{MIXED_PRECISION}'")
        else:
            _check_quant_dict(c, file, key, d, (want, {}), tensor_of)
    c.figures.update(quantized_layers=len(want), moe_quant_algo=algos[0] if len(algos) == 1 else algos)


def _disagreements(q: dict, qc: dict, modelopt_hf: bool, kimi: bool = False) -> list[tuple[str, str]]:
    """(key of `q`, key of `qc`) where hf_quant_config.json's `quantization` and config.json's
    quantization_config say different things. ModelOpt derives config.json's from it
    (export/convert_hf_config.py:130-285): for one format, quant_algo and the exclusions (as
    `ignore`) are what vLLM reads of it; for MIXED_PRECISION, export.modelopt_quantization_config
    (Kimi-K3's form, `kimi`: with its quant_method, export/kimi_k3.py)."""
    if q.get("quant_algo") != MIXED_PRECISION and "quantized_layers" not in q:
        pairs = (("quant_algo", "quant_algo"), ("exclude_modules", "ignore"))
        return [(k, kc) for k, kc in pairs if q.get(k) != qc.get(kc, qc.get(k))]
    ref, skip = (_modelopt_form(q), set()) if modelopt_hf else (q, {"quant_method"})
    if kimi and ref:
        ref["quant_method"] = kimi_k3.QUANT_METHOD
    return [(k, k) for k in sorted(set(ref) | set(qc) - skip) if k not in skip and ref.get(k) != qc.get(k)]


def _modelopt_form(q: dict) -> dict:
    """config.json's quantization_config as ModelOpt's exporter derives it from hf_quant_config.json's
    `quantization` (export.modelopt_quantization_config); {} when `q` is too malformed for that
    (the problems with `q` are reported on their own)."""
    try:
        return modelopt_quantization_config(q)
    except (KeyError, TypeError, AttributeError, ValueError):
        return {}


def _check_quant_dict(c: Check, path: Path, key: str, q: dict, tensors: tuple[dict[str, dict], list[str]],
                      tensor_of: Callable[[str], str]) -> None:
    """One quantization config (config.json's or hf_quant_config.json's) against the tensors."""
    want, unquantized = tensors
    for tensor, message in quantization_problems(q, want, key, tensor_of=tensor_of, unquantized=unquantized):
        c.fail(path, tensor, message)


# ============================================================================ on their own
def check_config_files(ckpt: str | Path, *, scheme: str | None = None, weight_only: bool = False) -> VerifyReport:
    """The `config` check alone, on config.json and hf_quant_config.json without any tensor:
    what `verify` checks once the tensors have decided `weight_only` (given here), with the
    experts modules the scheme quantizes standing in for the tensors (the Inkling 2 layout; another
    family's experts modules are named by its tensors, so they are not compared). Returns a report
    holding that one check."""
    root = Path(ckpt)
    report = VerifyReport(str(ckpt), None, scheme or "?", "cpu")
    run = Recorder(report, root)
    conf = load_config(run, root, scheme)
    usable = conf.usable and conf.strict
    check_config(run, conf, weight_only, scheme_layers(conf, weight_only) if usable else None)
    return report


def scheme_layers(conf: Conf, weight_only: bool) -> dict[str, dict]:
    """experts module -> the `quantized_layers` entry the scheme prescribes for it (the Inkling 2
    layout, whose experts modules the config alone names): what check_config_files holds the
    quantization configs to without any tensor."""
    out = {}
    for i in range(conf.cfg.num_hidden_layers):
        entry = conf.format_for(TensorName(f"{experts_module(i)}.0", "expert", i)).layer_config(weight_only)
        if entry is not None:
            out[modelopt_experts_module(i) if conf.modelopt_hf else experts_module(i)] = entry
    return out


def named_tensor(module: str) -> str:
    """The tensor a config problem about an Inkling 2 experts module names without a detected
    layout: its stacked w13 (ModelOpt's form: its first expert's gate_proj weight)."""
    if module.startswith("model.language_model."):
        return f"{module}.0.gate_proj.weight"
    return f"{module}.w13_weight"
