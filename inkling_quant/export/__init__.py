"""What convert writes: the output forms. Each form is the one home of how its checkpoint names and
lays out quantized experts, which config files it carries, and what verify expects when it
reads one back (`form.OutputForm`):

- `modelopt.py`: exactly what NVIDIA ModelOpt's `export_hf_checkpoint` writes (per-expert modules,
  MIXED_PRECISION `quantization_config` and `hf_quant_config.json`): `--output-format modelopt-hf`;
- `inkling.py`: Inkling 2's original names with its routed experts stacked, as the release stores
  them: `--output-format inkling`.
"""
from __future__ import annotations

from ..errors import UsageError
from ..formats import FORMATS
from ..model.layout import Layout
from .form import Copy, OutputForm, Writing
from .inkling import INKLING
from .inkling import value_rule as _stacked_value_rule
from .modelopt import MODELOPT

FORMS: dict[str, OutputForm] = {f.name: f for f in (INKLING, MODELOPT)}

__all__ = ["FORMS", "INKLING", "MODELOPT", "Copy", "OutputForm", "Writing", "form_for", "form_of", "value_rules"]


def form_of(layout: Layout) -> OutputForm:
    """The form a checkpoint of `layout` is written in (and convert's default for such a source):
    Inkling's stacked form under Inkling 2's original names, ModelOpt's export otherwise."""
    return INKLING if layout.original_names else MODELOPT


def form_for(cfg, layout: Layout, requested: str | None = None) -> OutputForm:
    """The output form: the one asked for, else the source's own (Inkling's stacked form for
    Inkling 2 under its original names; ModelOpt's export, under the source's names, otherwise);
    UsageError when the source cannot be written in it."""
    if requested is not None and requested not in FORMS:
        raise UsageError(f"--output-format {requested!r}: known {', '.join(FORMS)}")
    form = FORMS[requested] if requested is not None else form_of(layout)
    form.check_source(cfg, layout)
    return form


def value_rules(suffix: str, encoder: str = "modelopt") -> set[str]:
    """The value rules (formats.VALUE_RULES' keys) some format puts on tensors named `*.{suffix}`
    (per module, as ModelOpt names them) or `*_{suffix}` (the Inkling stacked form), written by
    `encoder` ("modelopt", "release")."""
    return {r for f in FORMATS.values()
            for r in (f.value_rule(suffix, encoder), _stacked_value_rule(f, suffix, encoder)) if r is not None}
