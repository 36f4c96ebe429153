"""Synthesize a tiny Inkling-2-Small-shaped checkpoint in a temporary directory and run the
whole pipeline on it: convert (default scheme), verify against the source, inspect, extract
the DSpark draft, and plan the full-size model's serving budget from the reference config.
Prints a short summary of each step; exits non-zero if any step fails."""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from . import budget, draft
from .convert import Options, convert, print_summary
from .inspect_cmd import render as render_inspect
from .inspect_cmd import summarize
from .layout import ModelConfig
from .synth import write_checkpoint
from .verify import verify


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--keep", metavar="DIR", help="work in DIR and keep the checkpoints (default: a temp dir)")
    p.add_argument("--seed", type=int, default=0)


def run(args) -> int:
    with tempfile.TemporaryDirectory(prefix="inkling-quant-demo-") as tmp:
        work = Path(args.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        src, out, dft = work / "tiny-bf16", work / "tiny-default", work / "tiny-dspark"
        write_checkpoint(src, "tiny", seed=args.seed, overwrite=True)
        print(f"[1/6] synth: tiny Inkling-2-Small-shaped BF16 checkpoint (48 layers, 4 experts) at {src}")

        print("[2/6] convert --scheme default --default-activation-amax 4")
        print_summary(convert(src, out, Options(default_activation_amax=4.0), overwrite=True, quiet=True))

        print("[3/6] verify --against the source (structure, values, checksums, numerics)")
        report = verify(out, against=src)
        print(report.format_summary())

        print("[4/6] inspect (headers only)")
        print(render_inspect(summarize(out)))

        print("[5/6] draft extract")
        info = draft.extract(out, dft, overwrite=True)
        print(f"  {info.get('tensors', '?')} DSpark tensors -> {dft}")

        print("[6/6] plan: the full-size reference model on GB200 at TP4, --max-model-len 262144 and 1048576")
        cfg = ModelConfig.reference()
        for length in (262_144, 1_048_576):
            print("  " + budget.plan(cfg, "gb200", 4, max_model_len=length).verdict())
        if args.keep:
            print(f"checkpoints kept in {work}")
        return report.exit_code
