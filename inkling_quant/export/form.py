"""The output-form contract: what a form decides for each unit convert writes (its `Writing`:
the names, shapes and order of the tensors, and how one expert's quantized slab becomes them),
the source layouts it can be written from, its config files, and what verify expects of it.

A `Writing` travels with its unit to a worker process (frozen dataclasses: picklable); the
worker reads the source and quantizes, and asks the writing what to write."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator

import torch

from ..errors import UsageError
from ..io.checkpoint import CONFIG_NAME, HF_QUANT_CONFIG
from ..io.safetensors import DTYPE_NAMES, DTYPES

if TYPE_CHECKING:
    from ..model.layout import Layout

Spec = tuple[str, str, tuple[int, ...]]            # (name, safetensors dtype name, shape) of a written tensor
Outputs = list[tuple[str, torch.Tensor, bool]]      # (name, tensor, whole): False for the next piece of a tensor


class ExpertWriter:
    """One stacked unit being written, expert by expert: `expert(e, q)` gives what to write for
    expert e's quantized slab (`Format.quantize`'s tensors, by suffix), `after()` what follows the
    last expert (callables, each run on the converting thread)."""

    def expert(self, e: int, q: dict[str, torch.Tensor], path) -> Outputs:
        raise NotImplementedError

    def after(self) -> Iterator[Callable[[], Outputs]]:
        return iter(())


class Writing:
    """How a unit's tensors are named and laid out in the output (the form's decision)."""

    def specs(self, u) -> list[Spec]:
        """Every tensor written for unit `u`, in write order."""
        raise NotImplementedError

    def quantized_module(self, u, layout: "Layout") -> str | None:
        """The module the quantization config lists for a quantized unit (None: pass-through)."""
        return None

    def open(self, u, out_dir) -> ExpertWriter:
        """The writer of a stacked unit (converted expert by expert)."""
        raise NotImplementedError(f"{type(self).__name__} writes no stacked unit")

    def write_kept(self, u, stored: dict[str, torch.Tensor], path) -> Outputs:
        """What to write for a kept unit (`OutputForm.kept`) from its weight's stored tensors
        (by the source format's suffixes), checked by the worker first."""
        raise NotImplementedError(f"{type(self).__name__} writes no kept module")


@dataclass(frozen=True)
class Copy(Writing):
    """A pass-through tensor, bit-exact: under its own name or `name`, and (`rows`) only its
    leading rows (transformers' lm_head drops the unembedding's vocabulary padding)."""

    name: str | None = None
    rows: int | None = None

    def specs(self, u) -> list[Spec]:
        src = u.sources[0]
        shape = (self.rows, *src.shape[1:]) if self.rows is not None else src.shape
        return [(self.name or src.name, src.dtype, shape)]


def row_suffixes(fmt) -> tuple[str, ...]:
    """The suffixes a format writes per output row (weight, block scales), not the scalars: the
    tensors an expert's gate/up rows are split or interleaved along."""
    return tuple(k for k, o in fmt.out_specs((16 * fmt.block_size, 32 * fmt.block_size), torch.bfloat16).items()
                 if o.shape)


def out_specs(fmt, name: str, shape, dtype: str, activation_scale: bool) -> list[Spec]:
    """A format's tensors for one source weight, as (name, dtype name, shape) under its module."""
    out = fmt.out_tensors(name, shape, DTYPES[dtype], activation_scale=activation_scale)
    return [(n, DTYPE_NAMES[o.dtype], tuple(o.shape)) for n, o in out.items()]


class OutputForm:
    """One output form (`FORMS`): what convert writes and how the other commands read it back."""

    name: str
    files: tuple[str, ...] = (CONFIG_NAME, HF_QUANT_CONFIG)  # the config files it may write
    encoder: str = "modelopt"  # whose rule writes its quantized bits unless --encoder says otherwise

    def check_source(self, cfg, layout: "Layout") -> None:
        """UsageError when this form cannot be written from a source of `layout`."""

    def check_units(self, layout: "Layout", units: list) -> None:
        """UsageError, before anything is written, when the planned units (convert.planner.Unit)
        make a checkpoint this form's readers would load wrongly."""

    def copy(self, cfg, layout: "Layout", name: str) -> Copy:
        """A pass-through tensor's writing (renamed where the form names tensors otherwise)."""
        return Copy()

    def per_expert(self, layout: "Layout") -> Writing:
        """The writing of a per-expert source's unit (an expert's gate and up, or one projection)."""
        raise NotImplementedError

    def kept(self, layout: "Layout", weight: str, source_format: str, dequantize: bool) -> Writing:
        """The writing of a quantized source's module that is not requantized (an FP8 source's
        attention, shared experts, ...): in the form's entry for that source format, or
        (`dequantize`) as a BF16 weight. UsageError where the form has none."""
        raise UsageError(f"--output-format {self.name} cannot hold {weight!r}, stored {source_format}: use "
                         f"--output-format modelopt-hf")

    def stacked(self, cfg, layout: "Layout", name: str, projection: str, fmt: str) -> Writing:
        """The writing of a stacked expert tensor `name` (canonical `projection` gate_up/down) in `fmt`."""
        raise NotImplementedError

    def file_of(self, cfg, layout: "Layout") -> Callable[[str], str | int] | None:
        """The form's file layout: output tensor name -> the weight file it goes to (a file name,
        or a numbered shard's group: `io.shards.plan_files`); None: shards packed by size alone
        (--max-shard-size), as ModelOpt's exporter packs them."""
        return None

    def config_files(self, cfg, layers: dict, weight_only: bool, converter: dict,
                     unquantized: list[str]) -> dict[str, dict]:
        """file name -> JSON object of the quantization configs for the quantized `layers` (experts
        module -> Format) and the modules written unquantized (`unquantized`: every one whose
        weight of two dims or more passes through, as the output names it); {} when nothing is
        quantized (config.json is then the source's)."""
        raise NotImplementedError

    def expert_specs(self, layout: "Layout", weight: str, shape, dtype, fmt, activation_scale: bool) -> dict:
        """name -> OutSpec of what this form writes for one routed-expert weight of the layout (a
        per-expert weight, or a stacked tensor [E, ...]) in `fmt` (verify's expectation)."""
        raise NotImplementedError
