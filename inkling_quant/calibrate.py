"""`inkling-quant calibrate SRC OUT.json --data FILE...`: the activation scales W4A4 needs, from
data, through the model's own forward streamed from the shards (docs/calibrate.md).

The engine (inkling_quant.engine) runs transformers' Inkling 2 modules one decoder layer at a
time over every sample, the routed experts expert by expert; for each routed-expert projection
whose format quantizes activations statically (NVFP4 W4A4, by the scheme), per expert, the amax
of its input is recorded: w13's (gate/up) the post-norm MoE input rows routed to it, w2's (down)
the softcapped-SwiGLU output, each `max |x|` in the activations' own dtype (bf16, exact), as
nvidia-modelopt 0.47's max calibration takes it (quantization/calib/max.py over
utils/core_utils.py `reduce_amax`, with quantization disabled during calibration:
model_calib.py `enable_stats_collection`); and each expert's token count. Policies:

- `routed` (default): the tokens the router sends (top-k). An expert no token reached takes the
  rule of Model-Optimizer's DeepSeek-V4 flow (examples/deepseek/deepseek_v4/quantize_to_nvfp4.py
  `_load_merged_amax`): the max over the calibrated experts of the same projection in its layer;
  a layer where none is calibrated is refused.
- `all`: every token through every expert for the statistics (outputs still gated by top-k), what
  ModelOpt 0.47's `moe_calib_experts_ratio=1.0` and llm-compressor's `moe_calibrate_all_experts`
  do.

The output keys each layer's activation modules as convert reads them (the source's stacked
tensors, or its per-expert modules) with the layer's maximum over its experts, the value ModelOpt
keeps (one input quantizer per fused projection of a layer, `_QuantFusedExperts`) and exports for
every expert; the per-expert figures, token counts, coverage and provenance ride beside them.
Finished layers' states and statistics are saved atomically in OUT.partial/; `--resume` goes on
from the last one and gives the same bytes as a run never stopped. OUT appears atomically at the
end and OUT.partial/ goes.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import __version__
from .errors import CheckpointError, UsageError
from .io.files import atomic_file

# torch, transformers and the formats are imported where they compute: `calibrate --help` stays light

FORMAT = "inkling-quant-calibration"
VERSION = 1
POLICIES = ("routed", "all")
PARTIAL = ".partial"


def model_fingerprint(config: dict) -> str:
    """What identifies the model a calibration is for: SHA-256 of config.json's text_config as
    canonical JSON (architecture and dimensions; not the weights: a BF16 checkpoint and the MXFP8
    release of one model share it)."""
    text = config.get("text_config", config) if isinstance(config, dict) else {}
    text = {k: v for k, v in text.items() if k not in ("quantization_config", "_name_or_path")}
    return "sha256:" + hashlib.sha256(json.dumps(text, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@dataclass
class Options:
    data: list[str]
    samples: int | None = None
    seq_len: int = 2048
    batch_size: int = 8            # rows per micro-batch
    device: str = "cpu"
    experts: str = "routed"
    scheme: str = "default"
    pack: bool = False

    def record(self) -> dict:
        return {"seq_len": self.seq_len, "batch_size": self.batch_size, "experts": self.experts,
                "scheme": self.scheme, "pack": self.pack, "samples": self.samples}


@dataclass
class Statistics:
    """Per recorded layer and expert: the w13 / w2 input amax (None: no token) and token counts
    (the engine's Observer)."""
    layers: tuple[int, ...]
    num_experts: int
    policy: str
    w13: dict[int, list[float | None]] = field(default_factory=dict)
    w2: dict[int, list[float | None]] = field(default_factory=dict)
    tokens: dict[int, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for i in self.layers:
            self.w13.setdefault(i, [None] * self.num_experts)
            self.w2.setdefault(i, [None] * self.num_experts)
            self.tokens.setdefault(i, [0] * self.num_experts)

    @staticmethod
    def _max(old: float | None, x) -> float:
        v = float(x.abs().amax()) if x.numel() else 0.0  # in x's own dtype: exact (ModelOpt's reduce_amax)
        return v if old is None else max(old, v)

    def _update(self, layer: int, e: int, x, act) -> None:
        self.w13[layer][e] = self._max(self.w13[layer][e], x)
        self.w2[layer][e] = self._max(self.w2[layer][e], act)

    def routed(self, layer, e, x, act) -> None:
        if layer in self.w13:
            self.tokens[layer][e] += x.shape[0]
            if self.policy == "routed":
                self._update(layer, e, x, act)

    def all_tokens(self, layer, e, x, act) -> None:
        if layer in self.w13 and self.policy == "all":
            self._update(layer, e, x, act)

    def to_dict(self) -> dict:
        return {"w13": {str(k): v for k, v in self.w13.items()}, "w2": {str(k): v for k, v in self.w2.items()},
                "tokens": {str(k): v for k, v in self.tokens.items()}}

    def load(self, d: dict) -> None:
        for key in ("w13", "w2", "tokens"):
            getattr(self, key).update({int(k): v for k, v in d[key].items()})


def recorded_layers(cfg, scheme_name: str) -> tuple[int, ...]:
    """The layers whose routed experts the scheme quantizes in a format with a static activation
    scale (NVFP4 W4A4): what calibrate records."""
    from .formats import FORMATS
    from .model.tensors import TensorName
    from .schemes import get_scheme

    scheme = get_scheme(scheme_name)
    return tuple(i for i in range(cfg.text.num_hidden_layers)
                 if FORMATS[scheme.format_name(cfg.text, TensorName(f"layers.{i}.mlp.experts", "expert", i))]
                 .static_activation_scale)


def _layer_result(stats: Statistics, layer: int) -> tuple[dict, dict]:
    """(per projection: the layer's amax, the per-expert amax with fallbacks filled), coverage."""
    tokens = stats.tokens[layer]
    out, fallback = {}, []
    for proj, got in (("w13", stats.w13[layer]), ("w2", stats.w2[layer])):
        known = [v for v in got if v is not None]
        if not known:
            raise UsageError(f"layer {layer}: no expert received a token, so no activation amax can be calibrated "
                             f"(more data, or --experts all)")
        top = max(known)
        fallback = [e for e, v in enumerate(got) if v is None]
        out[proj] = {"amax": top, "experts": [top if v is None else v for v in got]}
    hit = sorted(t for t in tokens if t)
    coverage = {"experts_with_tokens": len(hit), "experts": len(tokens), "tokens_min": min(tokens),
                "tokens_median": statistics.median(tokens), "tokens_max": max(tokens), "fallback_experts": fallback}
    return out, coverage


def activation_modules(layout, cfg, layer: int) -> dict[str, str]:
    """The source's activation modules of `layer` (what convert --activation-scales keys: a stacked
    source's stacked tensors, a per-expert source's expert modules) -> "w13" or "w2"."""
    from .model.layout import CANONICAL

    storage, module = layout.experts, layout.experts_modules[layer]
    out = {}
    for e in range(1 if storage.stacked else cfg.text.n_routed_experts):
        for proj in CANONICAL:
            key = layout.activation_key(layout.classify(storage.tensor(module, e, proj)))
            out[key] = "w2" if proj == "down" else "w13"
    return out


# --------------------------------------------------------------------------- the run
def _partial_fingerprint(fingerprint: str, digest: str, opts: Options, layers: tuple[int, ...]) -> str:
    rec = {"model": fingerprint, "data": digest, "options": opts.record(), "layers": list(layers), "version": VERSION}
    return hashlib.sha256(json.dumps(rec, sort_keys=True).encode()).hexdigest()


def _save_layer(partial: Path, k: int, state, stats: Statistics, key: str) -> None:
    """After layer k: the micro-batches' states and the statistics, then the progress record
    naming them (each file replaced atomically; the record last, so a kill leaves the previous
    layer's state whole)."""
    from safetensors.torch import save_file

    tensors = {}
    for b, mb in enumerate(state):
        tensors[f"{b}.hidden"] = mb.hidden.cpu().contiguous()
        tensors[f"{b}.blocks"] = mb.blocks.cpu().contiguous()
    tmp = partial / f"state-{k}.safetensors.tmp"
    save_file(tensors, str(tmp))
    os.replace(tmp, partial / f"state-{k}.safetensors")
    with atomic_file(partial / f"stats-{k}.json", "w") as f:
        json.dump(stats.to_dict(), f)
    with atomic_file(partial / "progress.json", "w") as f:
        json.dump({"fingerprint": key, "layer": k}, f)
    for old in partial.glob("*-*.*"):
        if old.name not in (f"state-{k}.safetensors", f"stats-{k}.json"):
            old.unlink()


def _resume_from(partial: Path, key: str, state, stats: Statistics) -> int:
    """The layer after the last one a killed run finished (its state loaded into `state`), or 0."""
    from safetensors.torch import load_file

    try:
        progress = json.loads((partial / "progress.json").read_text())
    except (OSError, ValueError):
        return 0
    if progress.get("fingerprint") != key:
        raise UsageError("holds another calibration's state (another source, data or options): remove it, or run "
                         "without --resume to start over", path=partial)
    k = int(progress["layer"])
    saved = load_file(str(partial / f"state-{k}.safetensors"))
    for b, mb in enumerate(state):
        mb.hidden = saved[f"{b}.hidden"].to(mb.hidden.device)
        mb.blocks = saved[f"{b}.blocks"].to(mb.blocks.device)
    stats.load(json.loads((partial / f"stats-{k}.json").read_text()))
    return k + 1


def calibrate(src: str, out: str | Path, opts: Options, *, resume: bool = False, overwrite: bool = False,
              quiet: bool = False) -> dict:
    """Calibrate SRC on `opts.data`, writing OUT (a .json file); returns the report (module doc)."""
    import torch

    from . import hub
    from .data import load_rows
    from .io.checkpoint import CONFIG_NAME, read_json, safe_child
    from .engine import Engine, Weights
    from .io.output import check_paths
    from .model.inkling2 import Inkling2Config

    out = Path(out)
    if out.suffix != ".json":
        raise UsageError("the output is a JSON file: give OUT ending in .json", path=out)
    if opts.experts not in POLICIES:
        raise UsageError(f"--experts {opts.experts!r}: one of {', '.join(POLICIES)}")
    if opts.device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available")
    root = hub.snapshot(src)
    partial = out.with_name(out.name + PARTIAL)
    check_paths(partial, [root, *opts.data], reports=[str(out)])
    if out.exists() and not overwrite:
        raise UsageError("exists: pass --overwrite to replace it", path=out)
    if partial.exists() and not resume and not overwrite:
        raise UsageError(f"a stopped run's state is in {partial.name}: pass --resume to go on from it, or --overwrite "
                         f"to start over", path=out)
    config = read_json(safe_child(root, CONFIG_NAME), CONFIG_NAME)
    cfg = Inkling2Config.from_dict(config, str(root / CONFIG_NAME))
    layers = recorded_layers(cfg, opts.scheme)
    if not layers:
        raise UsageError(f"scheme {opts.scheme!r} quantizes no routed expert with a static activation scale: "
                         f"nothing to calibrate")
    rows = load_rows(opts.data, root, opts.seq_len, cfg.text.vocab_size, opts.samples, opts.pack)
    fingerprint = model_fingerprint(config)
    key = _partial_fingerprint(fingerprint, rows.digest, opts, layers)
    if partial.exists() and not resume:
        shutil.rmtree(partial)
    partial.mkdir(exist_ok=True)
    stats = Statistics(layers, cfg.text.n_routed_experts, opts.experts)
    t0 = time.perf_counter()
    per_layer: list[dict] = []
    with Weights(root, cfg) as weights:
        engine = Engine(weights, opts.device)
        try:
            state = engine.start(rows.micro_batches(opts.batch_size))
            first = _resume_from(partial, key, state, stats) if resume else 0
            last = layers[-1]
            bar = _bar(quiet, last + 1, first)
            for i in range(first, last + 1):
                t, before = time.perf_counter(), engine.bytes_read
                engine.layer(i, state, [stats], wants_all=opts.experts == "all", prefetch=i + 1 if i < last else None)
                _save_layer(partial, i, state, stats, key)
                secs = time.perf_counter() - t
                per_layer.append({"layer": i, "seconds": round(secs, 3), "bytes_read": engine.bytes_read - before})
                if bar is not None:
                    bar.set_postfix_str(f"{rows.tokens / secs:,.0f} tok/s, "
                                        f"{(engine.bytes_read - before) / secs / 1e9:.2f} GB/s")
                    bar.update(1)
            if bar is not None:
                bar.close()
        finally:
            engine.close()
        result = _result(weights.layout, cfg, stats, layers, fingerprint, rows, opts, src)
    with atomic_file(out, "w") as f:
        json.dump(result, f, indent=1, sort_keys=False)
        f.write("\n")
    shutil.rmtree(partial)
    seconds = time.perf_counter() - t0
    return {"output": str(out), "source": str(src), "layers": len(layers), "policy": opts.experts,
            "samples": len(rows.rows), "tokens": rows.tokens, "seconds": round(seconds, 3),
            "layer_tokens_per_s": round(rows.tokens * len(per_layer) / max(seconds, 1e-9), 1),
            "per_layer": per_layer, "coverage": result["coverage"], "resumed_from": first,
            "peak_rss_mb": round(_peak_rss_mb(), 1)}


def _result(layout, cfg, stats: Statistics, layers, fingerprint: str, rows, opts: Options, src: str) -> dict:
    amax, experts, coverage = {}, {}, {}
    for i in layers:
        per, cov = _layer_result(stats, i)
        for module, proj in activation_modules(layout, cfg, i).items():
            amax[module] = per[proj]["amax"]
        experts[str(i)] = {"w13": per["w13"]["experts"], "w2": per["w2"]["experts"], "tokens": stats.tokens[i]}
        coverage[str(i)] = cov
    return {"format": FORMAT, "version": VERSION, "producer": {"name": "inkling-quant", "version": __version__},
            "provenance": {"model_fingerprint": fingerprint, "source": str(src), "data": rows.describe(),
                           "seq_len": opts.seq_len, "policy": opts.experts, "scheme": opts.scheme,
                           "amax": "max |x| in the activations' dtype (bf16), the layer's maximum over its experts "
                                   "for each module (ModelOpt's one input quantizer per fused projection)"},
            "activation_amax": amax, "experts": experts, "coverage": coverage}


def _bar(quiet: bool, total: int, first: int):
    if quiet:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=first, unit="layer", desc="calibrate")


def _peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# --------------------------------------------------------------------------- reading it back
def read_calibration(obj: dict, path) -> tuple[dict[str, float], dict]:
    """(module -> amax, provenance) of a calibration file's object (format `FORMAT`)."""
    if obj.get("version") != VERSION or not isinstance(obj.get("activation_amax"), dict):
        raise CheckpointError(f"a {FORMAT} file of version {obj.get('version')!r} without an 'activation_amax' object: "
                              f"this reader takes version {VERSION}", path=path)
    prov = obj.get("provenance") if isinstance(obj.get("provenance"), dict) else {}
    return obj["activation_amax"], prov


def check_fingerprint(prov: dict, config: dict, path) -> None:
    """A calibration made for another model (its text_config differs) is refused."""
    want, got = model_fingerprint(config), prov.get("model_fingerprint")
    if got is not None and got != want:
        raise CheckpointError(f"is a calibration of another model (its model fingerprint {str(got)[:20]}... is not "
                              f"this source's {want[:20]}...: config.json's text_config differs)", path=path)

