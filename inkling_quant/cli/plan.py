"""`inkling-quant plan`: the CLI over inkling_quant.plan.inkling2 (the plan, its rendering, the
engine checks, and the published figures beside ours: the recipe's and, for an official
checkpoint, SGLang's cookbook's through plan.variants; a standard HF MoE config through plan.hf);
docs/budget.md."""
from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from ..errors import UsageError
from ..plan.inkling2 import (ASYNC_BATCHES, DEFAULT_BLOCK_SIZE, DEFAULT_RESERVE_GIB, DEFAULT_UTILIZATION, GPUS,
                             VARIANTS, ServingPlan, load_config, plan, recipe_rows)
from ..plan.kvcache import CONV, CSA, FULL, HCA, INDEXER, KDA, MLA
from ..plan.moe_checks import ARCHS, ENGINE, FAIL, PASS
from ..plan.placement import KV_HEADS, REPLICATED
from ..plan.units import in_units
from .options import add_output_options, float_range, int_range


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", nargs="?", help="checkpoint directory whose config.json to plan for")
    parser.add_argument("--config", metavar="FILE|DIR", help="a config.json, or a directory holding one: Inkling 2's "
                        "or a standard Hugging Face MoE config (default, with neither: the reference config, "
                        "Inkling2Config's defaults)")
    parser.add_argument("--gpu", default="gb200", choices=sorted(GPUS),
                        help="default: gb200 (the recipe's verified GPU); h100/h200 are Hopper (sm90), b200/gb200 "
                             "Blackwell (sm100), b300/gb300 Blackwell Ultra (sm103): the engine checks follow it")
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
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--variant", choices=sorted(VARIANTS),
                       help="the official checkpoint to plan: default = thinkingmachines/Inkling-2-Small (experts "
                            "NVFP4 in layers 0-39, MXFP8 in 40-47), mxfp8 = Inkling-2-Small-MXFP8 (every expert "
                            "MXFP8). Default: what the checkpoint directory holds, else default")
    which.add_argument("--scheme", help="plan the checkpoint `convert --scheme SCHEME` would write instead of an "
                                        "official one (Hugging Face MoE configs: default 'default')")
    parser.add_argument("--reserve-gib", type=float_range(0.0, 1e6), default=DEFAULT_RESERVE_GIB,
                        help="per-GPU memory besides weights and KV: activations, sampler, CUDA graphs, NCCL and "
                             f"kernel workspaces, the draft's KV cache (default {DEFAULT_RESERVE_GIB:g})")
    parser.add_argument("--block-size", type=int_range(1, 1 << 20), default=DEFAULT_BLOCK_SIZE)
    parser.add_argument("--no-draft", action="store_true", help="leave out the DSpark draft (the recipe's 3.2 GB)")
    add_output_options(parser, report="the plan",
                       quiet="print nothing (the exit code says whether it loads and fits)")


def run(args) -> int:
    from ..io.output import check_paths, write_report
    from ..plan.variants import choose_variant, cookbook_rows, held_draft_bytes

    check_paths(None, [args.checkpoint, args.config], reports=[args.json])
    if args.checkpoint and args.config:
        raise UsageError("give a checkpoint or --config, not both")
    source = args.checkpoint or args.config
    cfg = load_config(source)
    variant, scheme, notes = choose_variant(cfg, source, args.variant, args.scheme)
    # a checkpoint directory is planned as it is: its own draft (or none), not the recipe's
    held = held_draft_bytes(args.checkpoint) if args.checkpoint and Path(args.checkpoint).is_dir() else None
    if held == 0 and not args.no_draft and cfg.family.strict:
        notes += ("the checkpoint holds no DSpark draft (no mtp.* tensors, as inspect says): none is counted",)
    p = plan(cfg, args.gpu, args.tp, ep=not args.no_ep, max_model_len=args.max_model_len,
             max_num_seqs=args.max_num_seqs, utilization=args.gpu_memory_utilization,
             max_num_batched_tokens=args.max_num_batched_tokens,
             concurrent_batches=1 if args.no_async_scheduling else ASYNC_BATCHES, scheme=scheme,
             variant=variant, reserve_gib=args.reserve_gib, block_size=args.block_size,
             include_draft=not args.no_draft and held != 0, notes=notes, draft_bytes=held,
             checkpoint=args.checkpoint if variant is not None and args.checkpoint else None)
    rows = []
    if not p.hf:
        try:  # the recipe's TP4/TP8 comparisons need a config both TPs can serve
            rows = recipe_rows(cfg, p) + (cookbook_rows(cfg, p) if p.variant else [])
        except UsageError:
            rows = []
    write_report(args.json, json.dumps({**p.to_dict(), "recipe": rows}, indent=2) + "\n")
    if not (args.quiet or args.json == "-"):
        print(render(p, rows))
    return 0 if p.fits else 1


# --------------------------------------------------------------------------- output
def _split_label(p: ServingPlan, splits: set) -> str:
    kv = p.cfg.text.num_key_value_heads if p.hf else None

    def one(s: str) -> str:
        if s.startswith(("EP", "TP")) or s == REPLICATED:
            return s
        if s == KV_HEADS and kv is not None and kv < p.tp:
            return f"{s} 1/{kv} (replicated over TP)"
        return f"{s} 1/{p.tp}"

    return ", ".join(one(s) for s in sorted(splits))


def render_weights(p: ServingPlan) -> list[str]:
    w = p.weights
    pw = max([11] + [len(part) for part in w.parts()])
    split = "split at TP" + str(p.tp)
    hdr = f"{'part':<{pw}} {'elements':>9} {'format':<15} {'disk GB':>8}  {split:<35} {'GiB/GPU':>7}"
    out = [hdr, "-" * len(hdr)]
    for part in w.parts():
        fmts = sorted((f, b) for (q, f), b in w.disk.items() if q == part)
        for j, (f, b) in enumerate(fmts):
            layers = w.fmt_layers.get(f) if part == "expert" else None
            label = f"{f} {layers[0]}-{layers[-1]}" if layers else f
            elems = f"({f})" if part == "draft" else f"{w.elements[part] / 1e9:.3f}B"
            split = _split_label(p, w.splits[part]) if j == 0 else ""
            out.append(f"{part if j == 0 else '':<{pw}} {elems if j == 0 else '':>9} {label:<15} "
                       f"{in_units(b, 'GB'):>8}  {split:<35} {in_units(w.per_gpu[(part, f)], 'GiB'):>7}")
    out += ["-" * len(hdr), f"{'total':<{pw}} {'':>9} {'':<15} {in_units(w.disk_total, 'GB'):>8}  {'':<35} "
                            f"{in_units(w.per_gpu_total, 'GiB'):>7}"]
    return out


def _kv_header(p: ServingPlan) -> str:
    flight = (f"block {p.block_size}; {p.max_in_flight_tokens:,} tokens in flight = {p.concurrent_batches} x "
              f"max_num_batched_tokens {p.max_num_batched_tokens:,}")
    if not p.hf:
        return f"KV cache and state per GPU (vLLM 0.33 Inkling specs on Inkling 2 shapes; BF16; {flight}):"
    if p.cfg.text.v4 is not None:
        return (f"KV cache and state per GPU, every rank (vLLM 0.33's DeepSeek-V4 specs: fp8_ds_mla on FlashMLA, "
                f"fp8 indexer keys, fp32 compressor states; {flight}):")
    return (f"KV cache per GPU (vLLM 0.33's attention specs on the config's shapes; {p.cfg.text.dtype}, "
            f"--kv-cache-dtype auto; {flight}):")


def render_kv(p: ServingPlan) -> list[str]:
    kinds = p.kv_kinds()
    names = {FULL: "full attention", MLA: "MLA latent", "sliding": "sliding window", CONV: "short-conv state",
             CSA: "CSA compressed", HCA: "HCA compressed", INDEXER: "indexer keys"}
    out = [_kv_header(p)]
    for kind, k in kinds.items():
        spec = {FULL: "FullAttentionSpec", MLA: "MLAAttentionSpec"}.get(
            kind, f"SlidingWindowSpec(window {k['sliding_window']})")
        unit = "B/token/layer" if kind not in (CONV, KDA) else "B/state/layer"
        packed = "latent" if kind == MLA else "packed"
        width = f"K+V {k['head_size']}" if k["head_size_v"] else f"{packed} {k['head_size']}"
        per = f"{k['bytes_per_token_per_layer']:,}"
        if kind == KDA:  # Kimi-K3: one conv + recurrent state a request, its page padded to the MLA page
            spec, width, per = f"MambaSpec(align, {k['state_blocks']} blocks)", "conv+ssm", f"{k['state_bytes']:,}"
        elif k["tokens_per_state"] > 1:  # DeepSeek-V4's compressed caches: one state per tokens_per_state
            spec, per = f"MLAAttentionSpec(1 per {k['tokens_per_state']})", f"{k['state_bytes']}/{k['tokens_per_state']}"
        out.append(f"  {names.get(kind, kind):<16} {k['layers']:>2} layers  {spec:<29} {k['num_kv_heads_per_rank']} "
                   f"heads x {width:<11}  {per:>6} {unit}  page "
                   f"{k['page_size_bytes']:,} (block {k['block_size']})  request "
                   f"{in_units(k['request_bytes'], 'GiB')} GiB")
    groups: dict[str, int] = defaultdict(int)
    for g in p.kv.groups:
        groups[g.spec.kind] += 1
    out.append(f"  {p.kv.mode} pool: " + " + ".join(f"{n} {k}" for k, n in groups.items()) +
               f" group(s), {p.kv.bytes_per_block:,} B per block")
    out.append(f"  one {p.max_model_len:,}-token request needs {in_units(p.kv_needed_bytes, 'GiB')} GiB per GPU")
    out.append(f"  {p.gpu.name.upper()} memory.total {in_units(p.gpu.total_bytes, 'GiB')} GiB ({p.gpu.vendor_gb} GB, "
               f"{p.gpu.source}) x {p.utilization} = {in_units(p.requested_bytes, 'GiB')} GiB - weights "
               f"{in_units(p.weights.per_gpu_total, 'GiB')} GiB - reserve {in_units(p.reserve_bytes, 'GiB')} GiB = "
               f"KV budget {in_units(p.kv_budget_bytes, 'GiB')} GiB")
    out.append(f"  largest --max-model-len that fits: {p.largest_max_model_len:,}; concurrent "
               f"{p.max_model_len:,}-token requests: {p.concurrency:.2f}")
    return out


def _params_line(p: ServingPlan) -> str:
    pc, t = p.params, p.cfg.text
    experts = f"{t.num_experts_per_tok} of {t.n_routed_experts} experts"
    if not p.hf:
        return (f"Parameters: {pc.total / 1e9:.2f} B total (vision {pc.vision / 1e9:.2f} B), {pc.active / 1e9:.2f} B "
                f"active (text model, {experts}, without the embedding tables)")
    multimodal = isinstance(p.cfg.raw.get("vision_config"), dict)
    vision = f" (vision {pc.vision / 1e9:.2f} B)" if pc.vision else " (vision tower not counted)"
    vision = vision if multimodal else ""
    tables = pc.active + pc.embed + pc.lm_head
    return (f"Parameters: {pc.total / 1e9:.2f} B total{vision}, {pc.active / 1e9:.2f} B active (text model, "
            f"{experts}, without the embedding tables; {tables / 1e9:.2f} B with them, as model cards count)")


def _disk_line(p: ServingPlan) -> str:
    w = p.weights
    if p.hf:
        return (f"On disk: {in_units(w.disk_total, 'GB')} GB computed (routed experts in the scheme's formats, "
                f"every other tensor as stored, {p.cfg.text.dtype})")
    draft = w.disk_part("draft")
    own = ("the checkpoint's own mtp.* tensors" if ("draft", "stored") in w.disk else
           "the recipe's figure: its definition is not published")
    form = (f" ({p.checkpoint}: routed experts stacked as {VARIANTS[p.variant].repo} stores them)" if p.checkpoint
            and p.variant else f" ({VARIANTS[p.variant].repo}: routed experts stacked as the official checkpoint "
            f"stores them)" if p.variant else f" (as `convert --scheme {p.scheme}` writes it, ModelOpt's per-module form)")
    return f"On disk: {in_units(w.disk_total - draft, 'GB')} GB computed{form}" + (
        f" + {in_units(draft, 'GB')} GB DSpark draft ({own}; assumed replicated on every GPU) = "
        f"{in_units(w.disk_total, 'GB')} GB" if draft else " (without the draft)")


def render_checks(p: ServingPlan) -> list[str]:
    a = ARCHS[p.gpu.arch]
    out = [f"Engine checks ({ENGINE} on {p.gpu.name.upper()}, {a.generation} {a.name}; FAIL: it does not load as "
           f"requested, WARN: it loads, not as the checkpoint was made to run or only padded):"]
    for c in p.checks:
        label = {PASS: "PASS", FAIL: "FAIL"}.get(c.level, "WARN")
        out += [f"  {label}  {c.rule}: {c.message}", f"        source: {c.source}"]
    return out


def _title(p: ServingPlan) -> str:
    what = (f"checkpoint {p.checkpoint} (routed experts as variant {p.variant!r} stores them)" if p.checkpoint and
            p.variant else f"variant {p.variant!r} ({VARIANTS[p.variant].repo})" if p.variant else f"scheme {p.scheme!r}")
    return (f"inkling-quant plan: {what}, {p.where()}, TP{p.tp} attention + "
            f"{f'EP{p.tp}' if p.ep else f'TP{p.tp} (no EP)'} experts, max_model_len {p.max_model_len:,}")


def render(p: ServingPlan, rows: list[dict] | None = None) -> str:
    out = [_title(p), "", _params_line(p), ""]
    out += render_weights(p)
    out += [_disk_line(p), ""]
    out += render_kv(p)
    draft = "" if p.hf else ", the draft's KV cache and activations"
    out.append(f"  reserve (--reserve-gib, default {DEFAULT_RESERVE_GIB:g}): activations at max_num_batched_tokens, "
               f"sampler logits, CUDA graphs, NCCL/kernel workspaces{draft} (docs/budget.md)")
    if p.notes:
        out += [""] + [f"NOTE: {n}" for n in p.notes]
    if p.checks:
        out += [""] + render_checks(p)
    out += ["", p.verdict()]
    if rows:
        out += ["", "Published figures beside ours (the recipe: Inkling-2-Small.recipe.json; SGLang's cookbook):",
                f"  {'claim':<52} {'from':<9} {'published':<13} {'reproduced':<11} ours"]
        out += [f"  {r['claim']:<52} {'cookbook' if 'cookbook' in r['source'] else 'recipe':<9} {r['recipe']:<13} "
                f"{'yes' if r['reproduced'] else 'NO':<11} {r['ours']}" for r in rows]
    return "\n".join(out)
