"""`inkling-quant plan`: the CLI over inkling_quant.budget (the plan, its rendering and the
recipe's figures beside ours); docs/budget.md."""
from __future__ import annotations

import argparse
import json

from .budget import (ASYNC_BATCHES, DEFAULT_BLOCK_SIZE, DEFAULT_RESERVE_GIB, DEFAULT_UTILIZATION, GPUS, plan,
                     recipe_rows, render)
from .cli_common import float_range, int_range
from .errors import UsageError

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", nargs="?", help="checkpoint directory whose config.json to plan for")
    parser.add_argument("--config", metavar="FILE|DIR", help="a config.json, or a directory holding one "
                        "(default, with neither: the reference config, Inkling2Config's defaults)")
    parser.add_argument("--gpu", default="gb200", choices=sorted(GPUS), help="default: gb200 (the recipe's verified GPU)")
    parser.add_argument("--tp", type=int_range(1, 4096), default=4,
                        help="tensor parallel size; experts are expert-parallel over the same GPUs (default 4)")
    parser.add_argument("--no-ep", action="store_true", help="shard experts by TP instead (vLLM without "
                        "--enable-expert-parallel); the divisibility checks then apply to moe_intermediate_size / TP")
    parser.add_argument("--max-model-len", type=int_range(1, 2**40), help="default: max_position_embeddings")
    parser.add_argument("--max-num-seqs", type=int_range(1, 2**20))
    parser.add_argument("--gpu-memory-utilization", type=float_range(0.0, 1.0, lo_open=True), default=DEFAULT_UTILIZATION)
    parser.add_argument("--max-num-batched-tokens", type=int_range(1, 2**30),
                        help="default: vLLM's for the GPU (16384 at >= 160 GiB, 8192 on H100/H200)")
    parser.add_argument("--no-async-scheduling", action="store_true",
                        help="one batch in flight instead of two (sliding-window and conv admission caps)")
    parser.add_argument("--scheme", default="default")
    parser.add_argument("--reserve-gib", type=float_range(0.0, 1e6), default=DEFAULT_RESERVE_GIB,
                        help="per-GPU memory besides weights and KV: activations, sampler, CUDA graphs, NCCL and "
                             f"kernel workspaces, the draft's KV cache (default {DEFAULT_RESERVE_GIB:g})")
    parser.add_argument("--block-size", type=int_range(1, 1 << 20), default=DEFAULT_BLOCK_SIZE)
    parser.add_argument("--no-draft", action="store_true", help="leave out the DSpark draft (the recipe's 3.2 GB)")
    parser.add_argument("--json", metavar="FILE", help="also write the plan as JSON ('-' for standard output only)")
    parser.add_argument("--quiet", action="store_true", help="print nothing (the exit code says whether it fits)")


def load_config(checkpoint: str | None, config: str | None):
    if checkpoint and config:
        raise UsageError("give a checkpoint or --config, not both")
    from .inkling2 import Inkling2Config

    if checkpoint or config:
        return Inkling2Config.load(checkpoint or config)
    return Inkling2Config.reference()


def run(args) -> int:
    from .io.output import check_paths, write_report

    check_paths(None, [args.checkpoint, args.config], reports=[args.json])
    cfg = load_config(args.checkpoint, args.config)
    p = plan(cfg, args.gpu, args.tp, ep=not args.no_ep, max_model_len=args.max_model_len,
             max_num_seqs=args.max_num_seqs, utilization=args.gpu_memory_utilization,
             max_num_batched_tokens=args.max_num_batched_tokens,
             concurrent_batches=1 if args.no_async_scheduling else ASYNC_BATCHES, scheme=args.scheme,
             reserve_gib=args.reserve_gib, block_size=args.block_size, include_draft=not args.no_draft)
    try:  # the recipe's TP4/TP8 comparisons need a config both TPs can serve
        rows = recipe_rows(cfg, p)
    except UsageError:
        rows = []
    write_report(args.json, json.dumps({**p.to_dict(), "recipe": rows}, indent=2) + "\n")
    if not (args.quiet or args.json == "-"):
        print(render(p, rows))
    return 0 if p.fits else 1

