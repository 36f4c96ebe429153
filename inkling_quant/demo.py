"""Synthesize a tiny Inkling-2-Small-shaped checkpoint in a temporary directory and run the
whole pipeline on it: convert (default scheme), verify against the source, inspect, plan the
full-size model's serving budget, extract the draft. Prints a short summary of each step."""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from .convert import Options, convert, print_summary
from .synth import write_checkpoint


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--keep", metavar="DIR", help="work in DIR and keep the checkpoints (default: a temp dir)")
    p.add_argument("--seed", type=int, default=0)


def run(args) -> int:
    with tempfile.TemporaryDirectory(prefix="inkling-quant-demo-") as tmp:
        work = Path(args.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        src, out = work / "tiny-bf16", work / "tiny-default"
        write_checkpoint(src, "tiny", seed=args.seed, overwrite=True)
        print(f"[1/5] synth: tiny Inkling-2-Small-shaped BF16 checkpoint at {src}")
        report = convert(src, out, Options(default_activation_amax=4.0), overwrite=True, quiet=True)
        print("[2/5] convert --scheme default --default-activation-amax 4")
        print_summary(report)
        for step in STEPS:
            step(src, out)
    return 0


STEPS: list = []  # later steps register here: (src, converted) -> None
