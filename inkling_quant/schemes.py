"""Conversion schemes: which tensors become which number format. A scheme is data, a list of
rules over the layout's parts and layer ranges; everything no rule names passes through
bit-exact. The built-in schemes' layer ranges are fractions of the config's layer count, so the
default scheme's "NVFP4 for layers 0-39, MXFP8 for 40-47" holds for 48 layers and scales with
other depths. A user's own scheme is a JSON or TOML file of rules over absolute layer ranges
(`load_scheme`; docs/convert.md)."""
from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

from .errors import UsageError
from .errors import short_repr as _short
from .formats import FORMATS, Format
from .model.tensors import TensorName


QUANTIZABLE_PARTS = ("expert",)  # what a rule may quantize: routed experts (everything else passes through)
ALL_LAYERS = 1 << 62              # `layers: "all"`: past any model's depth
MAX_LAYER_DIGITS = 9              # a layer index of a scheme file: up to 999,999,999


@dataclass(frozen=True)
class Rule:
    part: str
    start: Fraction | int  # first layer: a fraction of num_hidden_layers, or a layer index (absolute)
    stop: Fraction | int   # one past the last layer, likewise
    format: str
    absolute: bool = False

    def layers_text(self) -> str:
        """An absolute rule's `layers` as a scheme file spells it."""
        if self.stop >= ALL_LAYERS:
            return "all"
        return f"{self.start}" if self.stop == self.start + 1 else f"{self.start}-{self.stop - 1}"

    def layers(self, n_layers: int) -> range:
        if self.absolute:
            return range(self.start, min(self.stop, n_layers))
        return range(round(self.start * n_layers), round(self.stop * n_layers))


@dataclass(frozen=True)
class Scheme:
    name: str
    description: str
    rules: tuple[Rule, ...]

    def format_name(self, cfg, t: TensorName) -> str:
        for r in self.rules:
            if r.part == t.part and t.layer is not None and t.layer in r.layers(cfg.num_hidden_layers):
                return r.format
        return "passthrough"

    def format_for(self, cfg, t: TensorName) -> Format:
        return FORMATS[self.format_name(cfg, t)]

    @property
    def builtin(self) -> bool:
        return SCHEMES.get(self.name) is self

    def record(self) -> str | dict:
        """What an output records of the scheme that made it: a built-in's name, or a user scheme's
        name, description and rules (`from_record` reads them back), so that the output verifies
        without the file."""
        if self.builtin:
            return self.name
        return {"name": self.name, "description": self.description,
                "rules": [{"part": r.part, "layers": r.layers_text(), "format": r.format} for r in self.rules]}

    def keeping(self, fmt: str, n_layers: int) -> "Scheme":
        """This scheme as applied to a source whose routed experts are stored in `fmt` (the MXFP8
        release): the experts it leaves unquantized keep `fmt`. Absolute layers, so an output
        records (`record`) the rules its tensors follow."""
        rules = [Rule(r.part, rng.start, rng.stop, fmt if r.format == "passthrough" else r.format, absolute=True)
                 for r in self.rules if len(rng := r.layers(n_layers))]
        return Scheme(f"{self.name} (the source's {fmt} kept)", self.description,
                      (*rules, Rule("expert", 0, ALL_LAYERS, fmt, absolute=True)))

    def table(self, cfg) -> list[dict]:
        rows = [{"part": r.part, "layers": _span(r.layers(cfg.num_hidden_layers)), "format": r.format,
                 "quant_algo": FORMATS[r.format].quant_algo} for r in self.rules]
        rows.append({"part": "everything else", "layers": "all", "format": "passthrough", "quant_algo": None})
        return rows


def _span(r: range) -> str:
    return f"{r.start}-{r.stop - 1}" if len(r) else "none"


F = Fraction
SCHEMES: dict[str, Scheme] = {s.name: s for s in (
    Scheme("default", "the serving recipe: routed experts NVFP4 in the first 5/6 of layers, MXFP8 in the rest",
           (Rule("expert", F(0), F(5, 6), "nvfp4"), Rule("expert", F(5, 6), F(1), "mxfp8"))),
    Scheme("nvfp4", "every routed expert NVFP4", (Rule("expert", F(0), F(1), "nvfp4"),)),
    Scheme("mxfp8", "every routed expert MXFP8", (Rule("expert", F(0), F(1), "mxfp8"),)),
    Scheme("none", "nothing quantized: every tensor passes through (an unquantized checkpoint; the copy floor)",
           ()),
)}


def get_scheme(name: str) -> Scheme:
    """A built-in scheme by name, or a user's scheme file (`*.json` / `*.toml`, `load_scheme`)."""
    if name in SCHEMES:
        return SCHEMES[name]
    if name.endswith((".json", ".toml")):
        return load_scheme(name)
    raise UsageError(f"unknown scheme {_short(name)}; known: {', '.join(SCHEMES)}, or a scheme file (.json or .toml)")


def from_record(record, where: str) -> Scheme:
    """The scheme an output recorded (`Scheme.record`): a built-in's name, or a user scheme's
    rules, checked as a scheme file's are (a defect is a UsageError naming `where`)."""
    if isinstance(record, str) and record in SCHEMES:
        return SCHEMES[record]
    if not isinstance(record, dict):
        raise UsageError(f"the recorded scheme {_short(record)} is neither a built-in scheme "
                         f"({', '.join(SCHEMES)}) nor a scheme's rules", path=where)
    return _scheme(record, where, "recorded scheme")


def load_scheme(path: str | Path) -> Scheme:
    """A user's scheme: `{"description": "...", "rules": [{"part": "expert", "layers": "0-39",
    "format": "nvfp4"}, ...]}` in JSON, or the same as TOML (`[[rules]]` tables). `layers` is
    "all", "A-B" (inclusive) or "A"; the first rule naming a tensor decides its format, and
    tensors no rule names pass through. Every defect is a UsageError naming the file and rule."""
    from .io.checkpoint import read_json, read_text

    p = Path(path)
    if not p.is_file():
        raise UsageError("scheme file not found", path=str(p))
    if p.suffix == ".toml":
        try:
            d = tomllib.loads(read_text(p, "scheme file", UsageError))
        except (tomllib.TOMLDecodeError, RecursionError, ValueError) as e:
            why = "nested too deeply" if isinstance(e, RecursionError) else e
            raise UsageError(f"not valid TOML: {why}", path=str(p)) from None
    else:
        d = read_json(p, "scheme file", UsageError)
    if isinstance(d, dict) and not d.get("name"):
        d = {**d, "name": p.name}
    return _scheme(d, str(p), "a scheme file")


def _scheme(d, path: str, what: str) -> Scheme:
    if not isinstance(d, dict) or not isinstance(d.get("rules"), list) or not d["rules"]:
        raise UsageError(f"{what} holds a non-empty list `rules` of {{part, layers, format}}", path=path)
    unknown = sorted(set(d) - {"rules", "description", "name"})
    if unknown:
        raise UsageError(f"unknown key(s) {_short(', '.join(map(str, unknown)))} (expected rules, description, "
                         f"name)", path=path)
    for key in ("name", "description"):
        if not isinstance(d.get(key, ""), str):
            raise UsageError(f"`{key}` is a string, got {_short(d[key])}", path=path)
    rules = tuple(_rule(r, i, path) for i, r in enumerate(d["rules"]))
    name = d.get("name") or Path(path).name
    if name in SCHEMES:  # a user's rules never pass for a built-in scheme's
        name = f"{name} ({Path(path).name})"
    return Scheme(name, d.get("description") or f"rules from {Path(path).name}", rules)


def _rule(r, i: int, path: str) -> Rule:
    where = f"rules[{i}]"
    if not isinstance(r, dict) or set(r) != {"part", "layers", "format"}:
        raise UsageError(f"{where} must have exactly the keys part, layers, format; got {_short(r)}", path=path)
    if not isinstance(r["part"], str) or r["part"] not in QUANTIZABLE_PARTS:
        raise UsageError(f"{where}.part {_short(r['part'])}: schemes quantize {', '.join(QUANTIZABLE_PARTS)} "
                         f"(routed experts) only; everything else passes through", path=path)
    if not isinstance(r["format"], str) or r["format"] not in FORMATS:
        raise UsageError(f"{where}.format {_short(r['format'])} is not one of {', '.join(FORMATS)}", path=path)
    layers = r["layers"]
    if layers == "all":
        return Rule(r["part"], 0, ALL_LAYERS, r["format"], absolute=True)
    m = _LAYERS.fullmatch(layers) if isinstance(layers, str) else None
    if isinstance(layers, int) and not isinstance(layers, bool) and 0 <= layers < 10 ** MAX_LAYER_DIGITS:
        start, stop = layers, layers + 1
    elif m is not None and (m["hi"] is None or int(m["hi"]) >= int(m["lo"])):
        start = int(m["lo"])
        stop = (int(m["hi"]) if m["hi"] is not None else start) + 1
    else:
        raise UsageError(f"{where}.layers {_short(layers)}: expected \"all\", a layer \"A\" or a range \"A-B\" "
                         f"(inclusive, A <= B; layer numbers of up to {MAX_LAYER_DIGITS} ASCII digits)", path=path)
    return Rule(r["part"], start, stop, r["format"], absolute=True)


_LAYERS = re.compile(rf"(?P<lo>[0-9]{{1,{MAX_LAYER_DIGITS}}})(?:-(?P<hi>[0-9]{{1,{MAX_LAYER_DIGITS}}}))?")
