"""Verify a converted checkpoint: structure, values, integrity and (with --against) numerics.

The check a CI job runs after `inkling-quant convert`. Checks (docs/ci.md has the full list):
  index        index.json covers every shard and every tensor exactly once; no stray shard
  header[F]    shard F's safetensors header is well formed (offsets, dtypes, sizes)
  config       config.json parses (the published Inkling 2 layout, or another MoE family's:
               layout.model_config); quantization_config
               / hf_quant_config.json agree with the tensors (algorithm per experts module,
               exclude_modules, group sizes, activation scale presence)
  layout       every tensor the layout and the quantization config require, with its dtype and
               shape; no other (Inkling 2: its strict spec; other families: the layout detected
               from the names, routed experts in the format their tensors or config declare; a
               checkpoint whose config.json is an FP8/MXFP4 source's, a --scheme none copy: as
               convert accepts such a source, and with --against exactly its tensors)
  values[F]    no NaN/Inf in shard F; scales finite and positive; e8m0 exponents not 0xFF
  gate_up      (ModelOpt's per-expert form) gate and up of each NVFP4 expert share weight_scale_2
  checksums    checksums.sha256 matches the bytes (hashed in the same single read as `values`);
               required for Inkling 2 checkpoints under the original names; otherwise (transformers
               and ModelOpt write none) skipped without the file unless --require-checksums
  source       (--against) the source opens and has the same config
  passthrough  (--against) BF16/FP32 pass-through tensors are byte-identical to the source
  encoder      (Inkling's stacked form) sampled quantized experts decode and encode again to the
               same bytes under the release's encoders (nvfp4_nearest, mxfp8_nearest), the only
               documented ones that are fixed points; skipped for layers whose config names ModelOpt's
  numerics[L]  (--against) sampled experts of layer L through the dequant-GEMM kernels against
               the BF16 weights: relative error and cosine within the format's thresholds

Exit codes: 0 every check passed; 1 a check failed (the checkpoint is wrong); 2 the input could
not be read (bad usage, no such directory, an I/O error) so verification is incomplete.
`--json REPORT` writes every check and figure, `--junit FILE` a JUnit XML (one testcase per check).
Python: `verify(ckpt, against=...) -> VerifyReport` (`.ok`, `.exit_code`, `.checks`, `.to_dict()`).
"""
# The package (docs/ci.md lists the checks):
#   __init__   verify(): the steps in report order (_run_checks), the CLI
#   report     Check, Problem, Row, VerifyReport; text, JSON and JUnit; Recorder (add + guard a check)
#   inventory  what is there (Files, Conf, Source) and what should be (Expected); read-only
#   structure  input, index, header[F], source
#   config     config (load_config: the scheme; check_config: the quantization configs vs the tensors)
#   experts    layout, what config expects, numerics[layer L], for every layout (layout.detect:
#              Inkling's interleaved experts, per-expert modules, transformers' stacked experts;
#              an Inkling 2 config's strict spec for the rest)
#   stream     the single read of every file: sha256 + per-tensor visitors
#   values     values[F], gate_up (visitors)
#   encoding   encoder (the release encoders' fixed point on Inkling's stacked experts)
#   numerics   passthrough (a visitor); the sample, activations and GEMM numerics[layer L] uses
#   integrity  checksums, --write-checksums
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import hub
from ..errors import UsageError
from ..io.output import CHECKSUMS
from ..schemes import get_scheme
from . import config, encoding, experts, integrity, numerics, stream, structure, values
from .config import QUANT_CONFIG, check_config_files
from .inventory import UNQUANTIZED, Inventory
from .numerics import ACT_ROWS, activations, sample_experts
from .report import (DEFAULT_SAMPLE, ERROR, FAIL, MAX_PROBLEMS, PASS, SKIP, Check, Problem, Recorder, Row,
                     Tally, VerifyReport, summary_rows)
from .stream import CHUNK
from .structure import CONVERT_MANIFEST
from .values import SLICE

__all__ = ["verify", "check_config_files", "sample_experts", "activations", "add_arguments", "run",
           "VerifyReport", "Check", "Problem", "Row", "PASS", "FAIL", "SKIP", "ERROR", "CHECKSUMS",
           "QUANT_CONFIG", "CONVERT_MANIFEST", "UNQUANTIZED", "DEFAULT_SAMPLE", "MAX_PROBLEMS", "ACT_ROWS",
           "CHUNK", "SLICE"]


# ============================================================================ API
def verify(ckpt: str | Path, against: str | Path | None = None, *, scheme: str | None = None,
           sample: int = DEFAULT_SAMPLE, device: str = "cpu", write_checksums: bool = False,
           progress: bool = False, require_checksums: bool = False) -> VerifyReport:
    """Verify checkpoint `ckpt` (and, with `against`, its numerics against the BF16 source).
    `require_checksums`: a missing checksums.sha256 fails for every checkpoint (by default only
    for Inkling 2 under its original names, whose writers always record one).
    Never raises for a defect of the checkpoint: the report says what failed (`report.ok`,
    `report.exit_code`, `report.failures()`; `report.raise_for_failure()` to turn it into an
    exception). Raises UsageError for bad arguments (unknown scheme, no CUDA, negative sample)."""
    if scheme is not None:
        get_scheme(scheme)
    if sample < 0:
        raise UsageError(f"--sample must be >= 0 (0 = every expert), got {sample}")
    if not (device == "cpu" or device.startswith("cuda")):
        raise UsageError(f"--device must be cpu or cuda, got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available")
    # a hub repo id: its snapshot, every file downloaded to the cache (after `convert` of it, nothing)
    opts = _Options(Path(ckpt), hub.snapshot(str(against)) if against is not None else None, scheme, sample, device,
                    write_checksums, progress, require_checksums)
    report = VerifyReport(str(ckpt), str(against) if against is not None else None, scheme or "?", device,
                          sample=sample)
    t0 = time.perf_counter()
    _run_checks(Recorder(report, opts.root), opts)
    report.seconds = time.perf_counter() - t0
    return report


@dataclass(frozen=True)
class _Options:
    root: Path
    src_root: Path | None
    scheme: str | None
    sample: int
    device: str
    write_checksums: bool
    progress: bool
    require_checksums: bool = False


def _run_checks(run: Recorder, o: _Options) -> None:
    """Every check, in report order. The first steps read the checkpoint (each records the check
    of what it read) into the inventory; the rest only read the inventory."""
    readable, src_root = structure.check_input(run, o.root, o.src_root)          # input
    if not readable:
        return
    files = structure.check_index(run, o.root, structure.tensor_bound(o.root))    # index, header[F]
    conf = config.load_config(run, o.root, o.scheme)                              # config (1/2)
    structure.check_total_size(run, files, conf)                                  # index (total_size)
    source = structure.check_source(run, src_root, conf) if src_root else None    # source
    expected = experts.check_layout(run, files, conf, source)                     # layout
    inv = Inventory(o.root, files, conf, source, expected)
    if expected.stored_as is not None:  # stored as a quantized source (a --scheme none copy)
        config.check_source_config(run, conf)                                     # config (2/2)
    else:
        config.check_config(run, conf, expected.weight_only, experts.quantized_layers(expected),
                            experts.tensor_namer(expected), experts.unquantized(expected))  # config (2/2)
    # the single read of every file: sha256 + each tensor's bytes through the visitors
    tally, scales = Tally(), values.GateUpScales()
    passthrough = numerics.Passthrough.start(run, inv)                            # passthrough
    rules = values.ValueRules(encoding.encoder_of(inv), values.source_rules(inv))
    visitors = [tally, rules, scales] + ([passthrough] if passthrough else [])
    digests = stream.read_all(run, inv, integrity.files_to_hash(inv, o.write_checksums), visitors,
                              o.progress)                                         # values[F], read
    values.check_gate_up(run, inv, scales)                                        # gate_up
    integrity.check_checksums(run, o.root, digests, o.write_checksums,
                              o.require_checksums or integrity.required(inv))     # checksums
    encoding.check_encoder(run, inv, o.sample)                                   # encoder
    experts.check_numerics(run, inv, o.sample, o.device)                          # numerics[layer L]
    run.report.rows = summary_rows(tally, run.report.numerics, passthrough.check if passthrough else None)
    if o.write_checksums:
        integrity.write_checksums_file(run, o.root, digests)                      # write_checksums


# ============================================================================ CLI
