"""Value checks, run as stream visitors in the single read: `values[F]` (no NaN/Inf, scales
finite and positive, or >= 0 for NVFP4 block scales of the release's rule, e8m0 exponents not
0xFF) and `gate_up` (the gate and up modules of each NVFP4 expert share weight_scale_2: ModelOpt's
per-expert form, for every family; the stacked form stores one global scale per expert's w13, so
it has nothing to compare)."""
from __future__ import annotations

import math
import threading
from typing import Callable, NamedTuple

import numpy as np
import torch

from ..export import value_rules
from ..formats import FORMATS, VALUE_RULES, invertible, value_violation
from ..io.checkpoint import INDEX_NAME
from ..io.safetensors import TensorEntry
from ..model.layout import CANONICAL
from ..model.tensors import TensorName
from .inventory import Inventory
from .report import Recorder
from .sources import copy_value_rules
from .stream import Seen

SLICE = 2 << 20            # value checks run on cache-sized slices of a chunk


# ============================================================================ values[F]
class ValueRules:
    """The `values[F]` checks: each tensor's bytes against the rule its dtype and name give, and
    the encoder that wrote it (`encoder_of(t)`: "modelopt" or "release")."""

    def __init__(self, encoder_of: Callable[[TensorName | None], str] = lambda t: "modelopt",
                 rules_of: Callable[[Seen], set[str] | None] | None = None):
        self.encoder_of, self.rules_of = encoder_of, rules_of

    def visit(self, seen: Seen):
        rules = self.rules_of(seen) if self.rules_of is not None else None
        rule = _value_rule(seen.t, seen.entry, self.encoder_of(seen.t), rules)
        return None if rule is None else _RuleSink(seen, rule)


def source_rules(inv: Inventory) -> Callable[[Seen], set[str] | None] | None:
    """seen -> the value rules of a tensor stored in a source's format, for a checkpoint stored so
    (a `--scheme none` copy: the source format's rules, sources.copy_value_rules); None for the
    rest (their names decide). None for any other checkpoint."""
    if inv.expected.stored_as is None:
        return None
    lay = inv.expected.layout
    formats = {lay.source.format, lay.source.expert_format}
    return lambda seen: copy_value_rules(lay, seen.name) if seen.fmt in formats else None


class _RuleSink:
    """Reports the first offending element of one tensor, then stops looking."""

    def __init__(self, seen: Seen, rule: Rule):
        self.seen, self.rule, self.bad = seen, rule, False
        self.scalars = seen.entry.dtype == torch.float32

    def feed(self, piece: memoryview, offset: int) -> None:
        if self.bad:
            return
        item = self.seen.entry.dtype.itemsize
        if self.scalars and len(piece) <= 64:
            vals = piece.cast("f")  # scalars (global and input scales): no torch op per value
            positive = self.rule.key == "positive"
            for i, v in enumerate(vals):
                if not math.isfinite(v) or (positive and not invertible(v)):
                    self._fail(offset // item + i, f"{v}")
                    return
            return
        for lo in range(0, len(piece), SLICE):
            if self.rule.bad(piece[lo:lo + SLICE]):
                idx, val = _first_bad(torch.frombuffer(piece[lo:lo + SLICE], dtype=self.seen.entry.dtype),
                                      self.rule.key)
                self._fail((offset + lo) // item + idx, val)
                return

    def _fail(self, index: int, value: str) -> None:
        s, t, shape = self.seen, self.seen.t, self.seen.entry.shape
        where = f" ({t.suffix} of {t.module})" if t is not None and t.suffix != "weight" and t.module != s.name else ""
        if t is not None and t.is_expert and t.expert is None and shape and shape[0]:  # stacked [E, ...]
            where += f" (expert {index // max(1, math.prod(shape[1:]))})"
        s.check.fail(s.path, s.name, f"must be {self.rule.what}{where}: element {index} is {value}")
        self.bad = True

    def done(self) -> None:
        pass


class Rule(NamedTuple):
    key: str                                # "positive", "e8m0" (formats.VALUE_RULES) or "finite"
    what: str                               # what is checked, in words
    bad: Callable[[memoryview], bool]       # bad(bytes of whole elements)


def _value_rule(t: TensorName | None, entry: TensorEntry, encoder: str = "modelopt",
                rules: set[str] | None = None) -> Rule | None:
    """The rule one tensor's bytes are held to: what the formats say of its name suffix (scales
    finite and positive, e8m0 exponents not 0xFF; `rules`, where given, instead), and for every
    float tensor no NaN/Inf, read on the dtype's bits. Each test is one or two passes over the bytes with no per-element
    Python (min/max propagate NaN and show Inf), ~1.5-3 GB/s on one core."""
    if rules is None:
        rules = value_rules(t.suffix, encoder) if t is not None else set()
    dt = entry.dtype
    if dt in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        if "nonnegative" in rules:
            def bad_sign(b, dt=dt):
                mn, mx = torch.aminmax(torch.frombuffer(b, dtype=dt))
                return not (float(mn) >= 0 and math.isfinite(float(mx)))
            return Rule("nonnegative", VALUE_RULES["nonnegative"], bad_sign)
        if "positive" in rules:
            def bad_scale(b, dt=dt):
                mn, mx = torch.aminmax(torch.frombuffer(b, dtype=dt))
                return not (invertible(float(mn)) and math.isfinite(float(mx)))
            return Rule("positive", VALUE_RULES["positive"], bad_scale)

        def bad_float(b, dt=dt):
            mn, mx = torch.aminmax(torch.frombuffer(b, dtype=dt))
            return not (math.isfinite(float(mn)) and math.isfinite(float(mx)))
        return Rule("finite", "finite (no NaN/Inf)", bad_float)
    if dt == torch.float8_e4m3fn:
        if "positive" in rules:  # positive finite e4m3 <=> byte in [0x01, 0x7E]; (b - 1) wraps 0 to 255
            return Rule("positive", "finite and positive (e4m3 scale)",
                        lambda b: int(_u8_op(b, np.subtract, 1).max()) > 0x7D)
        if "nonnegative" in rules:  # +0 or positive finite e4m3 <=> byte in [0x00, 0x7E]
            return Rule("nonnegative", "finite and >= 0 (e4m3 scale)",
                        lambda b: int(np.frombuffer(b, np.uint8).max()) > 0x7E)
        return Rule("finite", "finite (no e4m3 NaN)", lambda b: int(_u8_op(b, np.bitwise_and, 0x7F).max()) == 0x7F)
    if dt == torch.float8_e5m2:
        return Rule("finite", "finite (no NaN/Inf)", lambda b: int(_u8_op(b, np.bitwise_and, 0x7C).max()) == 0x7C)
    # an e8m0 byte is a power of two, positive and invertible, but 0xFF (NaN): a float8_e8m0fnu
    # tensor (DeepSeek-V4's UE8M0 scales, whatever its name) is held to that, a uint8 one by its rule
    if dt == torch.float8_e8m0fnu or (dt == torch.uint8 and "e8m0" in rules):
        return Rule("e8m0", VALUE_RULES["e8m0"], lambda b: int(np.frombuffer(b, np.uint8).max()) == 0xFF)
    return None


_U8_TMP = threading.local()


def _u8_op(b: memoryview, op, value: int) -> np.ndarray:
    """op(bytes, value) into a reused scratch buffer (uint8 arithmetic wraps)."""
    a = np.frombuffer(b, np.uint8)
    tmp = getattr(_U8_TMP, "buf", None)
    if tmp is None or tmp.size < a.size:
        tmp = _U8_TMP.buf = np.empty(max(a.size, SLICE), np.uint8)
    return op(a, np.uint8(value), out=tmp[:a.size])


def _first_bad(x: torch.Tensor, rule: str) -> tuple[int, str]:
    """Index and value of the first offending element of a Rule `rule` (only on the failure path)."""
    return value_violation(x, None if rule == "finite" else rule) or (0, "?")


# ============================================================================ gate_up
# the per-tensor scales that formats fusing gate and up (NVFP4's weight_scale_2) share
_SHARED_SCALES = {f.global_scale for f in FORMATS.values() if f.fuses_gate_up}


class GateUpScales:
    """Collects each expert's shared global scales (fp32 scalars) of gate and up in the read:
    the projections vLLM fuses into one w13, as the detected layout's classify names them."""

    def __init__(self) -> None:
        self.fused = CANONICAL[:2]
        self.scale2: dict[tuple[int, int], dict[str, float]] = {}
        self.seen: dict[tuple[int, int, str], str] = {}  # (layer, expert, projection) -> tensor name

    def visit(self, seen: Seen):
        t, e = seen.t, seen.entry
        if t is not None and t.is_expert and t.suffix in _SHARED_SCALES and e.dtype == torch.float32 \
                and e.nbytes == 4 and t.projection in self.fused:
            self.seen[t.layer, t.expert, t.projection] = seen.name
            return _ScaleSink(self.scale2.setdefault((t.layer, t.expert), {}), t.projection)
        return None


class _ScaleSink:
    def __init__(self, into: dict[str, float], projection: str):
        self.into, self.projection = into, projection

    def feed(self, piece: memoryview, offset: int) -> None:
        self.into[self.projection] = float(torch.frombuffer(piece, dtype=torch.float32)[0])

    def done(self) -> None:
        pass


def check_gate_up(run: Recorder, inv: Inventory, scales: GateUpScales) -> None:
    """The `gate_up` check (when the layout expects NVFP4 per-expert modules): vLLM fuses gate
    and up (w13) under one weight_scale_2, the gate's."""
    if not any(n.rsplit(".", 1)[-1] in _SHARED_SCALES for n in inv.expected.fmt_of):
        return
    c = run.new("gate_up", "values", "gate and up of each NVFP4 expert share weight_scale_2")
    n = 0
    first, second = scales.fused
    for (layer, expert), d in sorted(scales.scale2.items()):
        if first in d and second in d:
            n += 1
            g, u = d[first], d[second]
            if not (g == u or (math.isnan(g) and math.isnan(u))):
                name, gate = scales.seen[layer, expert, second], scales.seen[layer, expert, first]
                where = inv.files.tensors.get(name)
                c.fail(inv.root / (where.shard if where else INDEX_NAME), name,
                       f"{u!r} differs from {gate}'s {g!r}: vLLM fuses gate and up (w13) under one "
                       f"global scale and would use the gate's for both")
    c.figures["experts"] = n
