"""Summarize a checkpoint from its safetensors headers alone: parts, number formats per layer
range, bytes, whether the DSpark draft is there. No tensor byte is read: the index, the
config files and each shard's JSON header are all this command opens, so it takes seconds on
a multi-hundred-GB checkpoint. Nothing about a format is re-derived here: each layer's stacked
w13 / w2 is recognized by asking every format in `formats` which stacked tensors (names,
shapes, dtypes: `formats.stacked.projection_specs`) it would write for the source shape (from
config.json), and checked against the format the quantization config declares for
`model.llm.layers.N.mlp.experts`; everything else passes through.

The published Inkling 2 layout only (inkling_quant.inkling2; the bundled DSpark draft of
inkling_quant.dspark): a config.json without text_config is refused with a ConfigError.

Exit status 0, or 1 when a tensor is outside the layout, matches no format or not the format
the quantization config declares (listed)."""
from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import hub
from .cli_common import human_bytes
from .errors import ConfigError, InklingQuantError, printable
from .export import format_of, read_quantization
from .formats import FORMATS
from .formats.stacked import projection_specs
from .inkling2 import Inkling2Config, classify, experts_module
from .io.checkpoint import CONFIG_NAME, Checkpoint, read_json, safe_child
from .io.output import check_paths, write_report
from .io.safetensors import TensorEntry

UNRECOGNIZED = "unrecognized"
SOURCE_DTYPES = FORMATS["passthrough"].source_dtypes


@dataclass
class Summary:
    root: str
    shards: int
    file_bytes: int
    tensors: int
    quant_algo: str | None
    parts: dict[str, dict] = field(default_factory=dict)        # part -> tensors, params, bytes, formats
    expert_layers: list[dict] = field(default_factory=list)     # ranges of layers with one expert format
    draft: dict = field(default_factory=dict)
    unknown: list[str] = field(default_factory=list)            # names outside the layout
    unrecognized: list[str] = field(default_factory=list)       # modules no format would write
    mismatched: list[str] = field(default_factory=list)         # format found != format declared
    layout: str = "original"                                     # the published Inkling 2 layout

    @property
    def ok(self) -> bool:
        return not self.unknown and not self.unrecognized and not self.mismatched

    def to_dict(self) -> dict:
        return {"checkpoint": self.root, "shards": self.shards, "file_bytes": self.file_bytes,
                "tensors": self.tensors, "quant_algo": self.quant_algo, "parts": self.parts,
                "expert_layers": self.expert_layers, "draft": self.draft,
                "unknown_tensors": self.unknown, "unrecognized_modules": self.unrecognized,
                "format_mismatches": self.mismatched, "layout": self.layout}


def summarize(root: str | Path) -> Summary:
    """Read the index, config.json and every shard header (never tensor data) and summarize."""
    root, ckpt = hub.open_checkpoint(str(root))  # a hub repo id: its headers, no shard downloaded
    path = safe_child(root, CONFIG_NAME)
    raw = read_json(path, CONFIG_NAME, ConfigError)
    return _summarize(root, ckpt, Inkling2Config.from_dict(raw, str(path)))


def _stacked_format(proj: str, shape: tuple[int, ...], observed: dict[str, TensorEntry]) -> tuple[str, bool | None]:
    """(format, carries an activation scale) whose stacked tensors for a source `<proj>_weight`
    of `shape` are exactly `observed` (name under the experts module -> entry)."""
    w = observed.get(f"{proj}_weight")
    dtype = w.dtype if w is not None and w.dtype in SOURCE_DTYPES else torch.bfloat16
    got = {k: (tuple(e.shape), e.dtype) for k, e in observed.items()}
    for fmt in FORMATS.values():
        for act in (True, False):
            try:
                want = projection_specs(fmt, proj, shape, dtype=dtype, activation_scale=act)
            except InklingQuantError:
                continue
            if {k: (tuple(o.shape), o.dtype) for k, o in want.items()} == got:
                return fmt.name, (act if fmt.quant_algo else None)
    return UNRECOGNIZED, None


def _label(fmt: str, act: bool | None) -> str:
    return fmt if act is None else f"{fmt}{'' if act else ' (weight-only)'}"


def _summarize(root: Path, ckpt: Checkpoint, cfg: Inkling2Config) -> Summary:
    """Each layer's stacked w13 / w2 recognized as a unit, everything else float and passed through."""
    headers = ckpt.headers()
    entries = [e for h in headers.values() for e in h.tensors.values()]
    q = read_quantization(root, cfg.raw)
    s = Summary(str(root), len(headers), sum(h.file_size for h in headers.values()), len(entries),
                q["quant_algo"] if q else None)
    t = cfg.text
    shapes = {"w13": (t.n_routed_experts, 2 * t.moe_intermediate_size, t.hidden_size),
              "w2": (t.n_routed_experts, t.hidden_size, t.moe_intermediate_size)}
    stacked: dict[tuple[int, str], dict[str, TensorEntry]] = defaultdict(dict)
    parts: dict[str, dict] = defaultdict(lambda: {"tensors": 0, "params": 0, "bytes": 0, "formats": defaultdict(int)})
    for e in entries:
        try:
            n = classify(e.name)
        except InklingQuantError:
            s.unknown.append(e.name)
            continue
        if n.part == "expert":
            stacked[(n.layer, n.projection)][f"{n.projection}_{n.suffix}"] = e
            continue
        label = "passthrough" if e.dtype in SOURCE_DTYPES else UNRECOGNIZED
        if label == UNRECOGNIZED:
            s.unrecognized.append(f"{e.name} ({e.dtype} {list(e.shape)})")
        p = parts[n.part]
        p["tensors"], p["bytes"], p["params"] = p["tensors"] + 1, p["bytes"] + e.nbytes, p["params"] + math.prod(e.shape)
        p["formats"][label] += e.nbytes
    per_layer: dict[int, set[str]] = defaultdict(set)
    for (layer, proj), observed in sorted(stacked.items()):
        fmt, act = _stacked_format(proj, shapes[proj], observed)
        label, module = _label(fmt, act), experts_module(layer)
        if fmt == UNRECOGNIZED:
            found = ", ".join(f"{k} {e.dtype} {list(e.shape)}" for k, e in sorted(observed.items()))
            s.unrecognized.append(f"{module}.{proj} ({found})")
        else:
            declared = format_of(q, module)
            if (declared.name if declared is not None else "passthrough") != fmt:
                s.mismatched.append(f"{module}.{proj}: tensors are {fmt}, the quantization config declares "
                                    f"{declared.name if declared is not None else 'none (unquantized)'}")
        nbytes = sum(e.nbytes for e in observed.values())
        p = parts["expert"]
        p["tensors"], p["bytes"], p["params"] = p["tensors"] + len(observed), p["bytes"] + nbytes, \
            p["params"] + math.prod(shapes[proj])
        p["formats"][label] += nbytes
        per_layer[layer].add(label)
    _finish(s, parts, {i: (" + ".join(sorted(f)), t.n_routed_experts) for i, f in per_layer.items()},
            cfg.draft is not None)
    return s


def _finish(s: Summary, parts: dict, per_layer: dict[int, tuple[str, int]], draft_expected: bool) -> None:
    s.parts = {k: {**v, "formats": dict(v["formats"])} for k, v in
               sorted(parts.items(), key=lambda kv: -kv[1]["bytes"])}
    s.expert_layers = _ranges(per_layer)
    d = s.parts.get("draft")
    s.draft = {"present": d is not None, "tensors": d["tensors"] if d else 0, "bytes": d["bytes"] if d else 0,
               "expected_by_config": draft_expected}


def _ranges(per_layer: dict[int, tuple[str, int]]) -> list[dict]:
    """Consecutive layers with the same (format, expert count) merged into one range."""
    out: list[dict] = []
    for i in sorted(per_layer):
        fmt, n = per_layer[i]
        if out and out[-1]["format"] == fmt and out[-1]["experts"] == n and out[-1]["last"] == i - 1:
            out[-1]["last"] = i
        else:
            out.append({"first": i, "last": i, "format": fmt, "experts": n})
    return out


def render(s: Summary) -> str:
    out = [f"{s.root}: {s.tensors:,} tensors in {s.shards} shard(s), {human_bytes(s.file_bytes, 2)}"
           + (f", quant_algo {s.quant_algo}" if s.quant_algo else ", no quantization_config")]
    out.append("")
    hdr = f"{'part':<12} {'tensors':>8} {'params':>15} {'bytes':>10}  formats"
    out += [hdr, "-" * len(hdr)]
    for part, p in s.parts.items():
        fm = ", ".join(f"{f} {human_bytes(b, 2)}" for f, b in sorted(p["formats"].items()))
        out.append(f"{part:<12} {p['tensors']:>8,} {p['params']:>15,} {human_bytes(p['bytes'], 2):>10}  {fm}")
    out.append("")
    if s.expert_layers:
        out.append("routed experts:")
        for r in s.expert_layers:
            span = f"{r['first']}" if r["first"] == r["last"] else f"{r['first']}-{r['last']}"
            out.append(f"  layers {span:<7} {r['format']} ({r['experts']} experts per layer)")
    else:
        out.append("routed experts: none")
    d = s.draft
    out.append("DSpark draft: " + (f"present, {d['tensors']} tensors, {human_bytes(d['bytes'], 2)}" if d["present"]
                                  else "absent" + (" (config.json has a dspark_config)" if d["expected_by_config"]
                                                   else "")))
    for what, items in (("tensor(s) outside the layout", s.unknown),
                        ("module(s) no format would write", s.unrecognized),
                        ("module(s) not in the format the quantization config declares", s.mismatched)):
        if items:
            out.append(f"{len(items)} {what}: " + "; ".join(items[:5]) + (" ..." if len(items) > 5 else ""))
    return "\n".join(printable(line) for line in out)  # a name read from a file cannot forge a line


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="a local checkpoint directory or a hub repo id org/name[@revision] (its "
                   "headers read over HTTP: no shard is downloaded)")
    p.add_argument("--json", metavar="FILE", help="also write the summary as JSON ('-' for standard output only)")
    p.add_argument("--quiet", action="store_true", help="print nothing (the exit code says whether it is clean)")


def run(args) -> int:
    check_paths(None, [args.checkpoint], reports=[args.json])
    s = summarize(args.checkpoint)
    write_report(args.json, json.dumps(s.to_dict(), indent=2) + "\n")
    if not (args.quiet or args.json == "-"):
        print(render(s))
    return 0 if s.ok else 1
