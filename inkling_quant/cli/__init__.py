"""`inkling-quant` command line. Each subcommand's parsing lives in its own module of this
package, which defines `add_arguments(parser)`, `run(args) -> int` and `DESCRIPTION` (its --help
text, the library module's docstring); the library modules know nothing of argparse. This file
only dispatches and turns our errors into a message and an exit code (never a traceback)."""
from __future__ import annotations

import argparse
import importlib
import os
import sys

# Before torch loads libgomp: its OpenMP threads otherwise spin after every parallel torch op
# (e.g. a check over an MXFP8 scale tensor), taking cores from the converter's own reader, kernel
# and writer threads; sleeping instead cost 1.3 CPU-s less of 6.4 on an FP8 -> MXFP8 conversion
# (docs/benchmarks.md). A caller's own setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from .. import __version__
from ..errors import InklingQuantError, printable

# subcommand -> (its module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "synth": ("inkling_quant.cli.synth", "write a synthetic Inkling-2-Small-shaped BF16 checkpoint"),
    "schemes": ("inkling_quant.cli.schemes", "print the conversion scheme table"),
    "calibrate": ("inkling_quant.cli.calibrate", "activation scales for W4A4 from data, the model's own forward "
                  "streamed from the shards"),
    "convert": ("inkling_quant.cli.convert", "convert a BF16 checkpoint to NVFP4/MXFP8 (streaming, resumable)"),
    "verify": ("inkling_quant.cli.verify", "check a converted checkpoint: structure, values, checksums, numerics (exit 0/1/2)"),
    "draft": ("inkling_quant.cli.draft", "extract the bundled DSpark draft as its own checkpoint, or strip it off"),
    "lora": ("inkling_quant.cli.lora", "merge a PEFT LoRA adapter into the BF16 attention projections, or check one"),
    "demo": ("inkling_quant.cli.demo", "synthesize a tiny checkpoint and run the whole pipeline on it"),
    "plan": ("inkling_quant.cli.plan", "plan a vLLM deployment: disk, weights and KV cache per GPU, fits or not"),
    "inspect": ("inkling_quant.cli.inspect", "summarize a checkpoint from its safetensors headers (no tensor data read)"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only `command`'s module is imported (the others, and torch, cost seconds)."""
    parser = argparse.ArgumentParser(
        prog="inkling-quant", description="Convert Inkling 2 Small checkpoints to NVFP4/MXFP8, verify them, "
        "and plan their serving budget. `inkling-quant COMMAND --help` for each command.")
    parser.add_argument("--version", action="version", version=f"inkling-quant {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_) in COMMANDS.items():
        if name != command:
            sub.add_parser(name, help=help_)
            continue
        mod = importlib.import_module(module)
        described = getattr(mod, "DESCRIPTION", None) or mod.__doc__ or help_
        p = sub.add_parser(name, help=help_, description=described.strip(),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(command if command in COMMANDS else None).parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except InklingQuantError as e:
        print(f"inkling-quant {args.command}: error: {printable(str(e))}", file=sys.stderr)
        return e.exit_code
    except OSError as e:  # an I/O failure no command step anticipated: still a message, not a traceback
        where = f"{printable(str(e.filename))}: " if e.filename else ""
        print(f"inkling-quant {args.command}: error: {where}{e.strerror or e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"inkling-quant {args.command}: interrupted", file=sys.stderr)
        return 130
