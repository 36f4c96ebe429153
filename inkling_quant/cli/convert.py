"""`inkling-quant convert`: the command line of inkling_quant.convert."""
from __future__ import annotations

import argparse
import json
import sys

from ..convert import Options, __doc__ as DESCRIPTION, convert, finalize
from ..errors import UsageError
from ..export import FORMS
from ..io.output import write_report
from .options import add_output_options, device, int_range, parse_size, positive_float

__all__ = ["DESCRIPTION", "add_arguments", "run"]  # DESCRIPTION: the command's --help (cli.build_parser)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="source checkpoint: a local HF directory or a hub repo id org/name[@revision]")
    p.add_argument("out", help="output directory (must not exist, unless --resume or --overwrite)")
    p.add_argument("--scheme", default="default", help="conversion scheme (see `inkling-quant schemes`)")
    p.add_argument("--workers", type=int_range(1, 1024), default=1, help="shards converted in parallel processes")
    p.add_argument("--device", type=device, default="cpu", help="cpu, cuda or cuda:N (bit-identical results)")
    p.add_argument("--max-shard-size", type=parse_size,
                   help="largest output shard (default: 5GB for modelopt-hf; --output-format inkling writes one shard "
                        "per decoder layer and cuts one further only when this is given: docs/convert.md)")
    p.add_argument("--buffered-io", action="store_true",
                   help="write shards through the page cache instead of O_DIRECT (docs/convert.md)")
    p.add_argument("--output-format", choices=tuple(FORMS), default=None,
                   help="Inkling 2 sources under the original names: 'inkling' (default: original names, stacked "
                        "experts, the release's form) or 'modelopt-hf' (exactly what ModelOpt's exporter writes: "
                        "transformers' names, per-expert tensors, its config); every other source (Inkling 2 under "
                        "transformers' names too): 'modelopt-hf' only (its own names)")
    p.add_argument("--encoder", choices=("release", "modelopt"), default=None,
                   help="whose rules write the quantized bits: 'release' (the Inkling 2 release's nvfp4_nearest / "
                        "mxfp8_nearest; the default of --output-format inkling) or 'modelopt' (NVIDIA ModelOpt 0.47's; "
                        "the default of modelopt-hf, bit-identical to its export); recorded in the output's config")
    p.add_argument("--dequantize-fp8", action="store_true",
                   help="an FP8 block-scaled source's modules outside the routed experts (attention, shared experts, "
                        "dense MLPs) written as BF16 (exact fp32 dequantization rounded once) instead of kept FP8 as "
                        "ModelOpt's FP8_PB_WO (docs/convert.md)")
    a = p.add_argument_group("NVFP4 activation scales (W4A4 needs one input_scale per expert projection)")
    a.add_argument("--activation-scales", metavar="FILE|DIR",
                   help="calibration amax per module: `inkling-quant calibrate`'s OUT.json, a JSON {module: amax}, "
                        "safetensors {module.input_amax}, or a quantized checkpoint (ModelOpt's export, ours) whose "
                        "scales are taken verbatim")
    a.add_argument("--default-activation-amax", type=positive_float, metavar="X",
                   help="a placeholder, not a calibration: amax X for every module without a calibrated value "
                        "(`inkling-quant calibrate` measures them)")
    a.add_argument("--weight-only", action="store_true", help="W4A16 NVFP4 (no input_scale; vLLM's W4A16_NVFP4)")
    p.add_argument("--resume", action="store_true", help="continue an interrupted conversion in OUT")
    m = p.add_argument_group("several machines sharing one OUT (docs/scale.md)")
    m.add_argument("--part", type=_part, metavar="I/N", help="convert only part I of N (a deterministic shard subset); "
                   "no index is written until --finalize")
    m.add_argument("--finalize", action="store_true", help="check all parts are there and write configs, checksums, index")
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    add_output_options(p)


def run(args) -> int:
    quiet = args.quiet or args.json == "-"
    if args.weight_only and (args.activation_scales or args.default_activation_amax is not None):
        raise UsageError("--weight-only writes no activation scales; drop --activation-scales/--default-activation-amax")
    opts = Options(scheme=args.scheme, weight_only=args.weight_only,
                   default_activation_amax=args.default_activation_amax,
                   activation_scales=args.activation_scales, max_shard_bytes=args.max_shard_size,
                   workers=args.workers, device=args.device, buffered_io=args.buffered_io,
                   output_format=args.output_format, encoder=args.encoder, dequantize_fp8=args.dequantize_fp8)
    if args.finalize:
        if args.part:
            raise UsageError("--finalize runs once, after all --part runs: drop --part")
        report = finalize(args.src, args.out, opts, reports=(args.json,))
        write_report(args.json, json.dumps(report, indent=2) + "\n")
        if quiet:
            pass
        elif report.get("already_finalized"):
            print(f"{report['output']}: already finalized ({report['shards']} shards of this conversion; "
                  f"{report['files_checked']} files match checksums.sha256); nothing to do")
        else:
            print(f"finalized {report['output']}: {report['shards']} shards")
        return 0
    if args.part and args.overwrite:
        raise UsageError("--overwrite with --part would delete the other parts' shards")
    report = convert(args.src, args.out, opts, resume=args.resume, overwrite=args.overwrite, quiet=quiet,
                     part=args.part, reports=(args.json,))
    write_report(args.json, json.dumps(report, indent=2) + "\n")
    if not quiet:
        print_summary(report)
    return 0


def _part(text: str) -> tuple[int, int]:
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--part takes I/N, e.g. 3/8, got {text!r}") from None
    if not 1 <= i <= n:
        raise argparse.ArgumentTypeError(f"--part {text}: need 1 <= I <= N")
    return i, n


def print_summary(r: dict, file=None) -> None:
    file = file or sys.stdout  # looked up now, not at import: a redirected stdout is honoured
    if r.get("already_complete"):
        print(f"{r['output']}: already complete ({r['shards']} shards of this conversion); nothing to do", file=file)
        return
    fmts = ", ".join(f"{k} {v}" for k, v in sorted(r["tensors_by_format"].items()))
    print(f"converted {r['source']} -> {r['output']} (scheme {r['scheme']}{', weight-only' if r['weight_only'] else ''})",
          file=file)
    print(f"  tensors: {fmts}", file=file)
    act = r.get("activation_scales") or {}
    if any(act.values()):
        print("  NVFP4 activation scales: " + ", ".join(f"{v} {k}" for k, v in act.items() if v), file=file)
    print(f"  bytes: {r['bytes_in'] / 1e9:.3f} GB in, {r['bytes_out'] / 1e9:.3f} GB out in {r['shards']} shards"
          f" ({r['shards_resumed']} resumed)", file=file)
    for layer, b in (r.get("mxfp4_to_nvfp4_blocks") or {}).items():
        print(f"  MXFP4 -> NVFP4 layer {layer}: {b['lossless']} blocks cast losslessly, {b['rerounded']} re-rounded",
              file=file)
    if r.get("flushed_to_zero"):
        z = r["flushed_to_zero"]
        print(f"  written as zero: {len(z)} weight(s) below their format's smallest amax, zero at any precision that serves "
              f"(docs/formats.md), {z[0]}{' and more (--json)' if len(z) > 1 else ''}", file=file)
    print(f"  time: {r['seconds']:.2f} s, {r['source_mb_per_s']:.0f} MB/s of source, peak RSS {r['peak_rss_mb']:.0f} MB,"
          f" {r['workers']} worker(s)", file=file)


