"""Convert an Inkling 2 Small checkpoint in the published layout (BF16/FP16/FP32, or the MXFP8
release) or a Hugging Face MoE checkpoint (inkling_quant.model.layout detects its layout): routed
experts to NVFP4/MXFP8 per the scheme, everything else passed through bit-exact, as the Inkling
stacked form or ModelOpt's MIXED_PRECISION Hugging Face export.

A pipeline read top to bottom: validate the source against the layout -> plan output shards
(a stacked expert tensor is one unit: gate and up of an expert, interleaved in w13, share one
NVFP4 global scale) -> convert shards in parallel, one tensor (one expert of a stacked tensor) in
memory at a time, each shard written under a temporary name and recorded in a resume manifest
-> finalize (configs, non-weight files, checksums, index last).
A killed run leaves no index, so nothing looks complete; `--resume` redoes only unfinished shards.
"""
# The package: planner.py (source, calibration, units, shards) -> worker.py (one shard: read,
# check, quantize, write) -> runner.py (output directory, manifest, signals, process pool) ->
# here: prepare(), convert(), finalize() (the configs through inkling_quant.export), the CLI.
from __future__ import annotations

import dataclasses
import resource
import time
from pathlib import Path

import torch

from .. import __version__, hub
from ..errors import CheckpointError, OutputError, UsageError
from ..export import form_for
from ..formats import get_format
from ..io.checkpoint import CONFIG_NAME, INDEX_NAME, copy_file_atomic, write_index, write_json_atomic
from ..io.output import CHECKSUMS, OutputLock, check_paths, write_checksums
from ..io.safetensors import fsync_files, sha256_file
from ..calibrate import check_fingerprint
from ..model.layout import max_tensors
from ..schemes import get_scheme
from .calibration import load_activation_amax, load_calibration
from .planner import (FLOAT_SOURCES, Options, Prepared, ShardJob, SrcTensor, Unit, kept_encoders, list_source, load_config,
                      plan)
from .validation import validate_source
from .runner import (CONVERSION_KEY, MANIFEST, MANIFEST_GLOB, SOURCE_KEY, confirm_complete, confirm_finalized,
                     fingerprint, finished, manifest_path, manifests, part_jobs, previous_output, recorded_checksums,
                     refuse_symlinks, remove_temps, run_jobs, source_id, start_output, writing)
from .worker import SHARD_METADATA, ShardResult, convert_shard

__all__ = ["FLOAT_SOURCES", "MANIFEST", "MANIFEST_GLOB", "SHARD_METADATA", "Options", "Prepared", "ShardJob",
           "ShardResult", "SrcTensor", "Unit", "add_arguments", "convert", "convert_shard", "finalize",
           "load_activation_amax", "plan", "prepare", "print_summary", "quantized_layers", "run", "unquantized_modules",
           "validate_source"]


# --------------------------------------------------------------------------- the pipeline
def prepare(src: str, opts: Options) -> Prepared:
    """Resolve and check the source, settle every activation amax, plan the shards: everything
    decided before any byte is written (the same for every part and every resume)."""
    root, repo, revision = hub.resolve(str(src))
    cfg = load_config(root)
    scheme = get_scheme(opts.scheme)
    listing, other_files, stat = list_source(root, repo, revision, max_tensors(cfg))
    tensors, layout = validate_source(cfg, listing, str(src))
    form = form_for(cfg, layout, opts.output_format)
    opts = dataclasses.replace(opts, output_format=form.name, encoder=opts.encoder or form.encoder)
    provenance: dict = {}  # a calibrate file's: the model it was made for, its data, its policy
    calibrated = {} if opts.weight_only else load_calibration(opts.activation_scales, tensors, layout, src, provenance)
    if provenance:
        check_fingerprint(provenance, cfg.raw, opts.activation_scales)
    jobs = plan(cfg, layout, tensors, scheme, form, opts, calibrated, str(src))
    return Prepared(root, repo, revision, cfg, layout, jobs, other_files, fingerprint(jobs, opts, scheme, stat),
                    fingerprint(jobs, opts, scheme, {}), source_id(stat), form, scheme,
                    kept_encoders(root, cfg, layout, jobs), provenance)


def convert(src: str, out: str | Path, opts: Options, *, resume: bool = False, overwrite: bool = False,
            quiet: bool = False, part: tuple[int, int] | None = None, reports: tuple[str | None, ...] = ()) -> dict:
    """Convert SRC into OUT. With `part=(i, n)` only every n-th shard (from the i-th) is
    converted and nothing is finalized: `finalize(src, out, opts)` does that once all parts ran.
    `reports`: the report files the caller will write (checked with the output paths)."""
    t0 = time.perf_counter()
    out = Path(out)
    if opts.device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available")
    prep = prepare(src, opts)
    jobs = part_jobs(prep.jobs, part)
    check_paths(out, [prep.root, opts.activation_scales], reports=reports)
    manifest = manifest_path(out, part)
    with writing(out, part):  # the output lock, and signals that stop the run cleanly
        if previous_output(out, part, resume, overwrite):  # a finished OUT: confirmed, never reopened
            confirm_complete(out, prep)
            return {**_report(src, out, opts, prep.jobs, [], t0), "already_complete": True}
        done = start_output(out, prep, jobs, manifest, resume)
        todo = [j for j in jobs if j.file not in done]
        timings = run_jobs(prep, todo, jobs, done, manifest, out, opts, quiet)
        blocks = _blocks_by_layer(prep, timings.pop("source_blocks", {}))
        report = _report(src, out, opts, jobs if part else prep.jobs, todo, t0) | timings | blocks
        if part is None:
            _finalize_io(out, prep, opts)
        else:
            report["part"] = f"{part[0]}/{part[1]}"
        return report


def finalize(src: str, out: str | Path, opts: Options, *, prep: Prepared | None = None, quiet: bool = False,
             reports: tuple[str | None, ...] = ()) -> dict:
    """Write configs, non-weight files, checksums and, last, the index; then drop the resume
    manifests. Checks that every planned shard is present (and matches its recorded checksum)
    first. Called by `convert` (which holds the output lock) or alone after --part runs."""
    out = Path(out)
    if prep is not None:
        return _finalize_io(out, prep, opts)
    prep = prepare(src, opts)
    check_paths(out, [prep.root, opts.activation_scales], reports=reports)
    if not out.is_dir():
        raise UsageError("no such output directory: run the --part conversions first", path=out)
    with OutputLock(out):
        refuse_symlinks(out)
        if finished(out):  # finalized before: say so, and check it is still what was finalized
            return {"output": str(out), "shards": len(prep.jobs), "already_finalized": True,
                    "files_checked": confirm_finalized(out, prep)}
        return _finalize_io(out, prep, opts)


def _finalize_io(out: Path, prep: Prepared, opts: Options) -> dict:
    try:
        return _finalize(out, prep, opts)
    except OSError as e:  # a full disk, a lost mount: the shards are kept, the manifest says so
        raise OutputError(f"finalizing failed: {e.strerror or e}"
                          f"{f' ({e.filename})' if e.filename else ''}; the converted shards are kept: "
                          f"free space and rerun with --resume (or --finalize after --part runs)", path=out) from None


def _finalize(out: Path, prep: Prepared, opts: Options) -> dict:
    remove_temps(out, [*prep.form.files, CHECKSUMS, INDEX_NAME] + [p.name for p in prep.other_files])
    sums = recorded_checksums(out, prep)
    fsync_files(out / j.file for j in prep.jobs)
    if len(manifests(out)) > 1:  # shards from other machines: check what they recorded
        for f, h in sums.items():
            if sha256_file(out / f) != h:
                raise CheckpointError("checksum differs from the one its part recorded", path=out / f)
    written = _write_configs(out, prep, opts)
    for p in prep.other_files:
        copy_file_atomic(p, out / p.name)
    _write_checksums(out, sums, written + [p.name for p in prep.other_files])
    weight_map = {name: j.file for j in prep.jobs for name, _, _ in j.specs}
    write_index(out / INDEX_NAME, weight_map, sum(j.out_bytes for j in prep.jobs),
                {CONVERSION_KEY: prep.conversion, SOURCE_KEY: prep.source_id})
    for m in manifests(out):
        m.unlink()
    return {"output": str(out), "shards": len(prep.jobs), "finalized": True}


def quantized_layers(prep: Prepared) -> dict:
    """experts module -> Format of every quantized unit of the planned conversion (the module the
    output form lists it under: a layer's experts module, or Inkling's stacked tensor's module);
    gate/up and down share the layer's format."""
    return {m: get_format(u.format, source=True) for j in prep.jobs for u in j.units
            if u.format != "passthrough" and (m := u.writing.quantized_module(u, prep.layout)) is not None}


def unquantized_modules(prep: Prepared) -> list[str]:
    """Every module the planned conversion writes unquantized, as the output names it: each
    pass-through `<module>.weight` of two dims or more (a Linear, an embedding, a conv: what
    ModelOpt puts a quantizer on), and the experts module of a layer whose routed experts pass
    through. What a one-format config must exclude."""
    out = []
    for u in (u for j in prep.jobs for u in j.units if u.format == "passthrough"):
        if u.storage is not None:  # routed experts left as they are
            out.append(prep.layout.experts_modules[prep.layout.classify(u.sources[0].name).layer])
            continue
        out += [name[: -len(".weight")] for name, _, shape in u.writing.specs(u)
                if name.endswith(".weight") and len(shape) >= 2]
    return list(dict.fromkeys(out))


def _write_configs(out: Path, prep: Prepared, opts: Options) -> list[str]:
    """The output form's quantization config files (with who converted it where the form records
    it); a conversion that quantizes nothing (scheme `none`) writes config.json as the source has
    it, as ModelOpt leaves an unquantized model. Returns the names written."""
    encoder = opts.encoder or prep.form.encoder
    converter = {"name": "inkling-quant", "version": __version__, "scheme": _applied_scheme(prep).record(),
                 "weight_only": opts.weight_only, "encoder": encoder}
    kept = {m: e for m, e in prep.kept_encoders.items() if e != encoder}  # copied layers another encoder wrote
    if kept:
        converter["layers"] = kept
    if prep.calibration:
        converter["calibration"] = prep.calibration
    files = prep.form.config_files(prep.cfg, quantized_layers(prep), opts.weight_only, converter,
                                   unquantized_modules(prep)) or {CONFIG_NAME: prep.cfg.raw}
    for name, obj in files.items():
        write_json_atomic(out / name, obj)
    return list(files)


def _applied_scheme(prep: Prepared):
    """The scheme as the output holds it: where a quantized source's experts (the MXFP8 release)
    were left alone by the scheme they keep their stored format, and the record says so."""
    kept = {u.source_format for j in prep.jobs for u in j.units if u.source_format and u.storage is not None
            and prep.scheme.format_name(prep.cfg, prep.layout.classify(u.sources[0].name)) == "passthrough"}
    return prep.scheme.keeping(kept.pop(), prep.cfg.num_hidden_layers) if kept else prep.scheme


def _write_checksums(out: Path, shard_sums: dict[str, str], others: list[str]) -> None:
    """checksums.sha256 over every file: the shards' as recorded while writing, the rest hashed."""
    sums = dict(shard_sums)
    files = sorted(list(sums) + others)
    for f in files:
        if f not in sums:
            sums[f] = sha256_file(out / f)
    write_checksums(out / CHECKSUMS, {f: sums[f] for f in files})


def _report(src, out: Path, opts: Options, jobs: list[ShardJob], todo: list[ShardJob], t0: float) -> dict:
    seconds = time.perf_counter() - t0
    counts: dict[str, int] = {}
    act = {"calibrated": 0, "default": 0}  # where each module's activation amax came from
    for j in jobs:
        for u in j.units:
            counts[u.format] = counts.get(u.format, 0) + (1 if u.stacked else len(u.weights))
            for o in u.amax_origin:
                if o is not None:
                    act[o] += 1
    return {
        "source": str(src), "output": str(out), "scheme": opts.scheme, "weight_only": opts.weight_only,
        "shards": len(jobs), "shards_resumed": len(jobs) - len(todo), "tensors_by_format": counts,
        "activation_scales": act,
        "bytes_in": sum(j.src_bytes for j in jobs), "bytes_out": sum(j.out_bytes for j in jobs),
        "seconds": round(seconds, 3),
        "source_mb_per_s": round(sum(j.src_bytes for j in todo) / 1e6 / max(seconds, 1e-9), 1),
        "workers": min(opts.workers, max(1, len(todo))), "peak_rss_mb": round(_peak_rss_mb(), 1),
    }


def _blocks_by_layer(prep: Prepared, blocks: dict[str, list[int]]) -> dict:
    """The MXFP4 -> NVFP4 cast's block counts (the converted shards') per layer: blocks cast
    losslessly (ModelOpt's count) and re-rounded (the rest); {} when nothing was cast."""
    out: dict[int, dict[str, int]] = {}
    for name, (n, ok) in blocks.items():
        got = out.setdefault(prep.layout.classify(name).layer, {"lossless": 0, "rerounded": 0})
        got["lossless"] += ok
        got["rerounded"] += n - ok
    return {"mxfp4_to_nvfp4_blocks": {str(k): out[k] for k in sorted(out)}} if out else {}


def _peak_rss_mb() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(own, kids) / 1024


# --------------------------------------------------------------------------- CLI
