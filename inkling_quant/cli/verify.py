"""`inkling-quant verify`: the command line of inkling_quant.verify."""
from __future__ import annotations

import argparse
import sys

from ..errors import HubError, UsageError
from ..formats import FORMATS
from ..io.output import CHECKSUMS, check_paths, write_report
from ..verify import DEFAULT_SAMPLE, UNQUANTIZED, __doc__ as DESCRIPTION, verify
from ..verify.report import Check, VerifyReport
from .options import device

__all__ = ["DESCRIPTION", "add_arguments", "run"]  # DESCRIPTION: the command's --help (cli.build_parser)


EPILOG = """exit codes:
  0  every check passed
  1  a check failed: the checkpoint is wrong (the report names file and tensor)
  2  the input could not be read (usage error, missing directory, I/O error): verification
     is incomplete; 2 wins over 1 when both happen

thresholds (numerics, per format, from inkling_quant.formats):
""" + "".join(f"  {f.name:<6} relative error <= {f.max_rel_error:g}, cosine >= {f.min_cosine:g}\n"
              for f in FORMATS.values() if f.quant_algo) + """
docs/ci.md has every check, the report formats and a GitHub Actions workflow."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = EPILOG
    p.add_argument("ckpt", metavar="CKPT", help="the converted checkpoint directory")
    p.add_argument("--against", metavar="SRC", help="the BF16 source (a directory or a hub repo id org/name[@revision]): "
                   "run the numerics and byte-identity checks")
    p.add_argument("--scheme", help="the conversion scheme (default: hf_quant_config.json's converter entry, else "
                   f"'default'; '{UNQUANTIZED}' for an unquantized checkpoint)")
    p.add_argument("--sample", type=int, default=DEFAULT_SAMPLE, metavar="N",
                   help=f"experts per layer checked numerically, chosen deterministically (0 = all; default {DEFAULT_SAMPLE})")
    p.add_argument("--device", type=device, default="cpu",
                   help="cpu (torch reference GEMM), cuda or cuda:N (the Triton kernels)")
    p.add_argument("--json", metavar="REPORT", help="write the full report (every check and figure) as JSON ('-': standard output)")
    p.add_argument("--junit", metavar="FILE", help="write a JUnit XML report (one testcase per check) for CI ('-': standard output)")
    p.add_argument("--quiet", action="store_true", help="print only failures and the result line")
    p.add_argument("--write-checksums", action="store_true",
                   help=f"write {CHECKSUMS} for the checkpoint if every other check passes")
    p.add_argument("--require-checksums", action="store_true",
                   help=f"fail when {CHECKSUMS} is missing (always so for Inkling 2 under its original names; "
                   "checkpoints as transformers and ModelOpt write them have none and skip the check)")


def run(args) -> int:
    # the checkpoint is read (a source of the reports' guard) or, with --write-checksums, written
    check_paths(args.ckpt if args.write_checksums else None,
                [args.against] + ([] if args.write_checksums else [args.ckpt]), reports=[args.json, args.junit])
    if args.json == "-" and args.junit == "-":
        raise UsageError("--json - and --junit - would both write to standard output: give one a file")
    try:
        report = verify(args.ckpt, args.against, scheme=args.scheme, sample=args.sample, device=args.device,
                        write_checksums=args.write_checksums, progress=not args.quiet and sys.stderr.isatty(),
                        require_checksums=args.require_checksums)
    except (UsageError, HubError) as e:  # still write the reports: CI looks for them
        report = VerifyReport(args.ckpt, args.against, args.scheme or "?", args.device, sample=args.sample)
        usage = Check("usage", "input", "the command line is valid")
        usage.error("inkling-quant verify", str(e))
        report.checks.append(usage)
    for dest, text in ((args.json, report.to_json), (args.junit, report.to_junit)):
        if dest:
            write_report(dest, text())  # an OutputError: exit 2, the message names the file
    if "-" in (args.json, args.junit):
        return report.exit_code  # standard output holds the report: no summary mixed into it
    out = report.format_summary()
    if args.quiet:
        out = "\n".join(line for line in out.splitlines()
                        if line.lstrip().startswith(("FAIL", "ERROR", "result")) or line.startswith("    "))
    print(out)
    return report.exit_code


