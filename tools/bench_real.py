#!/usr/bin/env python
"""Issue 17's benchmark: every command on real-shape Inkling 2 inputs, side by side in one run,
against our copy floor, `cp -r` + `sha256sum` of the same bytes, NVIDIA ModelOpt's quantizers in a
per-tensor loop and llm-compressor's ``model_free_ptq``; the issue's targets printed PASS/FAIL.

Inputs (``synth --preset bench``: the reference config's real expert and attention shapes, stacked
row-interleaved experts w13 [E, 4608, 4608] and w2 [E, 4608, 2304] bf16, fewer layers and experts):
  experts      expert-heavy, default 2 layers x 32 experts (5.2 GB, 78 % routed experts; the real
               model is 98.8 %: the embedding, LM head, vision tower, draft and attention of even one
               layer are ~0.9 GB, so reaching 95 % takes ~200 expert slabs);
  release      the MXFP8 release form made from it (``convert --scheme mxfp8``, the stacked form
               Inkling-2-Small-MXFP8 stores; docs/convert.md: an accepted source), untimed;
  passthrough  pass-through-heavy, default 2 layers x 1 expert (1.2 GB, 10 % experts);
  fp8          an FP8 block-scaled source in DeepSeek-V3's layout at its real shapes (hidden 7168, expert
               width 2048, its MLA attention, one shared expert; `weight` e4m3 + `weight_scale_inv`
               fp32 per 128x128 tile, as DeepSeek's weight_quant stores Gaussian weights; config
               quant_method fp8), default 2 layers x 32 experts (3.5 GB, 80 % routed experts; vocab
               8192): its copy floor against ``default`` (FP8 experts -> NVFP4/MXFP8, the rest kept
               FP8);
  sweep        peak RSS of ``convert --scheme default`` on 1 layer with experts grown to ~1, 2, 4 and
               8 GB of input (--sweep-gb, --max-gb);
  fp8sweep     the same on the fp8 input's layout (1 layer of DeepSeek-V3 shapes, experts grown).

Cases, each its own process (tools/benchlib.py: wall, CPU and peak RSS of the largest process
(wait4) and of the process tree (sampled /proc)): our CLI in-process (``inkling_quant.cli.main``;
``work s`` is its run after imports, ~2 s of torch import left out), ``convert --scheme none``
(our copy floor: every tensor through the converter's own read, check, hash and O_DIRECT write),
``default`` (NVFP4 W4A4 + MXFP8, --default-activation-amax), ``nvfp4 --weight-only`` (W4A16, the
counterpart of llm-compressor's NVFP4A16), ``mxfp8``, ``default --output-format modelopt-hf``;
the release's own copy floor and release -> default; ``draft extract`` (its bytes: the draft
tensors) and ``lora merge --copy`` (an attention adapter, r=16, on every layer; --copy writes every
shard, so its bytes are the whole input: the default hardlinks the shards it does not change) on the
passthrough input; ``cp -r`` + ``sha256sum`` of the copy (no sync: the page cache takes its writes,
ours are O_DIRECT and fsynced); tools/bench_convert.py's ModelOpt loop and llm-compressor children
(llm-compressor reads a copy with the experts unstacked into 2-D per-expert weights, made untimed:
model_free_ptq quantizes ``<module>.weight`` matrices only and leaves a stacked tensor as it is; it
does not take the release, whose experts are e4m3 already).

MB/s = the case's bytes (source tensor bytes; the draft's for draft extract) / work s. Ratios are
MB/s over MB/s on the same input: the best of --repeat runs, and each run's against the same run of
the baseline (cases alternate within a run: a busy moment hits them all).

    python tools/bench_real.py --repeat 2 --json bench-out/real.json      # the recorded run
    python tools/bench_real.py --skip-peer --experts-input 1,2 --passthrough-input 1,1 --max-gb 1

``--baseline DIR`` (a checkout of another revision, e.g. ``git worktree add DIR REV``) adds, on the
expert-heavy input, ``convert --scheme default`` and ``verify --against`` (of a default conversion
made once, untimed) run by that checkout's inkling_quant, alternating with ours: a change's cost,
side by side in one run (targets: within 5 %); on the FP8 input, its ``default`` and ``mxfp8``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import (ROOT, args_or_child, cpu_s, ensure_lc_venv, helper, lc_env, mb, ours_env, run_measured,  # noqa: E402
                      sync_disk)

ME = Path(__file__).resolve()
BC = ME.parent / "bench_convert.py"    # its children: synth, stats, unstack, modelopt, lc
SCALE = ME.parent / "bench_scale.py"   # its child: bench input sizes by expert count
ATTN_LORA = ("q_proj.linear", "k_proj.linear", "v_proj.linear", "o_proj.linear")


# ============================================================================ children
def child(spec: dict) -> None:
    """Runs inside a measured (or helper) process; result JSON to spec['result']."""
    res = {"cli": _child_cli, "adapter": _child_adapter, "fp8_input": _child_fp8_input}[spec["kind"]](spec)
    Path(spec["result"]).write_text(json.dumps(res))


def _child_cli(spec: dict) -> dict:
    """`inkling-quant ARGV` in-process, timed after the imports (torch, the command's module)."""
    sys.path.insert(0, spec.get("root", str(ROOT)))  # a --baseline case: that checkout's inkling_quant
    import importlib

    from inkling_quant import cli      # first, as the console script: it sets the environment torch reads

    importlib.import_module("torch")  # before the clock starts (every command imports it)

    cli.build_parser(spec["argv"][0])  # imports the command's module
    c0, t0 = cpu_s(), time.perf_counter()
    rc = cli.main(spec["argv"])
    work_s, work_cpu = time.perf_counter() - t0, cpu_s() - c0
    if rc:
        raise SystemExit(f"inkling-quant {' '.join(spec['argv'])}: exit {rc}")
    return {"work_s": work_s, "work_cpu_s": work_cpu}


def _child_adapter(spec: dict) -> dict:
    """A PEFT LoRA adapter (as PeftModel.save_pretrained writes one) on the attention projections
    q, k, v, o of every layer of the checkpoint, rank spec['r'], random A and B."""
    sys.path.insert(0, str(ROOT))
    import torch
    from safetensors.torch import save_file

    from inkling_quant.model.inkling2 import original_name
    from inkling_quant.io.checkpoint import Checkpoint

    shapes = {n: e.shape for h in Checkpoint.open(spec["ckpt"]).headers().values() for n, e in h.tensors.items()}
    layers = sorted({int(n.split(".")[3]) for n in shapes if n.startswith("model.llm.layers.")})
    gen, r, tensors = torch.Generator().manual_seed(0), spec["r"], {}
    for i in layers:
        for proj in ATTN_LORA:
            module = f"model.language_model.layers.{i}.self_attn.{proj}"
            out_f, in_f = shapes[original_name(module + ".weight")]
            tensors[f"base_model.model.{module}.lora_A.weight"] = torch.randn(r, in_f, generator=gen) / in_f ** 0.5
            tensors[f"base_model.model.{module}.lora_B.weight"] = torch.randn(out_f, r, generator=gen) * 0.02
    d = Path(spec["out"])
    d.mkdir(parents=True)
    save_file(tensors, d / "adapter_model.safetensors")
    (d / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": 2 * r, "bias": "none",
        "use_rslora": False, "fan_in_fan_out": False, "target_modules": list(ATTN_LORA),
        "base_model_name_or_path": "thinkingmachines/Inkling-2-Small"}))
    return {"modules": len(tensors) // 2}


def _child_fp8_input(spec: dict) -> dict:
    """A DeepSeek-V3 FP8 block-scaled checkpoint at its real shapes (deepseek-ai/DeepSeek-V3
    inference/configs/config_671B.json: hidden 7168, expert width 2048, MLA q_lora 1536, kv_lora
    512, 128 heads), spec['layers'] MoE layers of spec['experts'] routed experts and one shared
    expert, vocab 8192: every Linear weight as DeepSeek's weight_quant stores a trained one (e4m3
    bytes, a float32 `weight_scale_inv` per 128x128 tile: inkling_quant's FP8Block.quantize) of a
    Gaussian with 1 % of rows x8 (four such weights per shape, each tensor a copy of one: their
    block maxima, which the FP8 -> NVFP4 / MXFP8 tables are keyed by, vary as a real weight's do);
    norms, router, embedding and LM head bf16. Shards of about spec['shard_size'] bytes and an
    index. Returns its stats."""
    sys.path.insert(0, str(ROOT))
    import torch
    from safetensors.torch import save_file

    from inkling_quant.cli.options import parse_size

    L, E, H, I = spec["layers"], spec["experts"], 7168, 2048
    gen = torch.Generator().manual_seed(0)

    from inkling_quant.formats import SOURCE_FORMATS
    pool: dict[tuple[int, int], list[dict]] = {}

    def fp8(name, rows, cols):
        if (rows, cols) not in pool:
            pool[(rows, cols)] = []
            for _ in range(4):
                w = torch.randn(rows, cols, generator=gen) * cols ** -0.5
                w[torch.randint(0, rows, (max(1, rows // 100),), generator=gen)] *= 8
                pool[(rows, cols)].append(SOURCE_FORMATS["fp8_block"].quantize(w))
        st = pool[(rows, cols)][int(torch.randint(0, 4, (), generator=gen))]
        return {name: st["weight"].clone(), name + "_scale_inv": st["weight_scale_inv"].clone()}

    def bf16(name, *shape):
        return {name: (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)}

    def layer(i):
        p = f"model.layers.{i}."
        t = {**fp8(p + "self_attn.q_a_proj.weight", 1536, H), **bf16(p + "self_attn.q_a_layernorm.weight", 1536),
             **fp8(p + "self_attn.q_b_proj.weight", 128 * 192, 1536), **fp8(p + "self_attn.kv_a_proj_with_mqa.weight", 576, H),
             **bf16(p + "self_attn.kv_a_layernorm.weight", 512), **fp8(p + "self_attn.kv_b_proj.weight", 128 * 256, 512),
             **fp8(p + "self_attn.o_proj.weight", H, 128 * 128), **bf16(p + "input_layernorm.weight", H),
             **bf16(p + "post_attention_layernorm.weight", H), **bf16(p + "mlp.gate.weight", E, H),
             p + "mlp.gate.e_score_correction_bias": torch.zeros(E)}
        for m in ["mlp.shared_experts"] + [f"mlp.experts.{e}" for e in range(E)]:
            for proj, (r, c) in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
                t.update(fp8(f"{p}{m}.{proj}.weight", r, c))
        return t

    out, limit = Path(spec["out"]), parse_size(spec["shard_size"])
    out.mkdir(parents=True)
    groups, cur, size = [], {}, 0
    for tensors in [{**bf16("model.embed_tokens.weight", 8192, H)}, *(layer(i) for i in range(L)),
                    {**bf16("model.norm.weight", H), **bf16("lm_head.weight", 8192, H)}]:
        for k, v in tensors.items():
            if cur and size + v.nbytes > limit:
                groups.append(cur)
                cur, size = {}, 0
            cur[k], size = v, size + v.nbytes
    groups.append(cur)
    weight_map, parts = {}, {}
    for n, g in enumerate(groups):
        f = f"model-{n + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file(g, out / f, metadata={"format": "pt"})
        for k, v in g.items():
            weight_map[k] = f
            part = "expert" if ".mlp.experts." in k else "attention" if ".self_attn." in k else "other"
            parts[part] = parts.get(part, 0) + v.nbytes
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps({
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 8192, "hidden_size": H,
        "intermediate_size": 18432, "moe_intermediate_size": I, "num_hidden_layers": L, "first_k_dense_replace": 0,
        "n_routed_experts": E, "n_shared_experts": 1, "num_experts_per_tok": min(8, E),
        "n_group": 8 if E % 8 == 0 else 1, "topk_group": 4 if E % 8 == 0 else 1,
        "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
        "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "max_position_embeddings": 4096,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                "weight_block_size": [128, 128]}}))
    return {"bytes": sum(parts.values()), "expert_bytes": parts.get("expert", 0), "parts": parts,
            "shards": len(groups)}


# ============================================================================ cases
def our_cases(scheme_args: dict) -> list[tuple[str, str, list[str]]]:
    """(id, label, `inkling-quant` argv with {src} {out}) of the converter's cases."""
    conv = ["convert", "{src}", "{out}", "--quiet", "--workers", scheme_args["workers"],
            "--max-shard-size", scheme_args["max_shard_size"]]
    amax = ["--default-activation-amax", scheme_args["amax"]]
    return [("none", "convert --scheme none (copy floor)", conv + ["--scheme", "none"]),
            ("default", "convert --scheme default", conv + ["--scheme", "default"] + amax),
            ("nvfp4", "convert --scheme nvfp4 --weight-only", conv + ["--scheme", "nvfp4", "--weight-only"]),
            ("mxfp8", "convert --scheme mxfp8", conv + ["--scheme", "mxfp8"]),
            ("default-hf", "convert default --output-format modelopt-hf",
             conv + ["--scheme", "default", "--output-format", "modelopt-hf"] + amax)]


CP = ("cp", "cp -r + sha256sum", "cp -r {src} {out} && sha256sum {out}/*.safetensors > /dev/null")
VERIFY = ["verify", "{converted}", "--against", "{src}", "--quiet"]


def beside_baseline(cases: list[dict], ids: tuple[str, ...], root: str | None) -> list[dict]:
    """`cases`, each of `ids` followed at once by the --baseline checkout's run of it, if there is one
    (adjacent: the same disk state for both)."""
    return [c2 for c in cases for c2 in [c] + ([{**c, "id": f"{c['id']}@baseline", "label": f"{c['label']} (baseline)",
                                                 "root": root}] if root and c["id"] in ids else [])]


def with_baseline(cases: list[dict], cli, root: str) -> list[dict]:
    """`cases` plus verify --against, each of convert --scheme default and verify beside the --baseline
    checkout's run of it."""
    return beside_baseline(cases + [cli("verify", "verify --against (of the default conversion)", VERIFY)],
                           ("default", "verify"), root)


def plan_cases(args, peer: bool) -> dict[str, list[dict]]:
    """input -> its cases: {id, label, kind (cli | shell | bc | lc), what to run, bytes (src | draft)}."""
    conv = {c[0]: c for c in our_cases({"workers": str(args.workers), "max_shard_size": args.max_shard_size,
                                         "amax": str(args.activation_amax)})}

    def cli(cid, label=None, argv=None, bytes_="src"):
        c = conv.get(cid)
        return {"id": cid, "label": label or c[1], "kind": "cli", "argv": argv or c[2], "bytes": bytes_}

    shell = {"id": CP[0], "label": CP[1], "kind": "shell", "cmd": CP[2], "bytes": "src"}
    mo = [{"id": f"modelopt-{f}", "label": f"ModelOpt loop {f} ({args.modelopt_threads} threads)", "kind": "bc",
           "spec": {"kind": "modelopt", "scheme": f, "threads": args.modelopt_threads}, "bytes": "src"}
          for f in ("nvfp4", "mxfp8")]
    lc = [{"id": "lc-nvfp4", "label": "llm-compressor model_free_ptq NVFP4A16", "kind": "lc",
           "spec": {"kind": "lc", "lc_scheme": "NVFP4A16", "workers": args.workers}, "bytes": "src"}] if peer else []
    ours = [cli(c) for c in ("none", "default", "nvfp4", "mxfp8")]
    return {
        "experts": (with_baseline(ours, cli, args.baseline) if args.baseline else ours) + [cli("default-hf"), shell]
        + (mo if not args.skip_modelopt else []) + lc,
        "release": [cli("none", "convert --scheme none (the release's copy floor)"),
                    cli("default", "convert --scheme default (MXFP8 release -> default)"), shell],
        "fp8": beside_baseline([cli("none", "convert --scheme none (the FP8 source's copy floor)"),
                                cli("default", "convert --scheme default (FP8 source -> default)"),
                                cli("mxfp8", "convert --scheme mxfp8 (FP8 source -> MXFP8)")], ("default", "mxfp8"),
                               args.baseline) + [shell],
        "passthrough": ours + [shell,
                               cli("draft", "draft extract", ["draft", "extract", "{src}", "{out}", "--quiet"],
                                   bytes_="draft"),
                               cli("lora", "lora merge --copy (attention adapter, r=16)",
                                   ["lora", "merge", "{src}", "{adapter}", "{out}", "--copy", "--quiet"])]
        + (mo[:1] if not args.skip_modelopt else []) + lc,
    }


def run_case(case: dict, inp: dict, work: Path, lc_py: str | None) -> dict:
    """One measured run of a case on an input; its output removed after."""
    out = work / "out"
    for d in (out, out.with_name("out.partial")):
        shutil.rmtree(d, ignore_errors=True)
    fill = {"src": str(inp["dir"]), "out": str(out), "adapter": str(inp.get("adapter", "")),
            "converted": str(inp.get("converted", ""))}
    log = work / "logs" / f"{inp['key']}-{case['id']}-{time.monotonic_ns()}.log"
    res_path = work / "res.json"
    sync_disk()
    if case["kind"] == "shell":
        meas = run_measured(["bash", "-c", case["cmd"].format(**{k: shlex.quote(v) for k, v in fill.items()})], log)
        res = {"work_s": meas["wall_s"], "work_cpu_s": meas["cpu_s"]}
    else:
        if case["kind"] == "cli":
            spec = {"kind": "cli", "result": str(res_path), "argv": [a.format(**fill) for a in case["argv"]]}
            cmd = [sys.executable, str(ME), "--child", json.dumps({**spec, **({"root": case["root"]} if "root" in case
                                                                               else {})})]
        else:
            src = inp["lc_dir"] if case["kind"] == "lc" else inp["dir"]
            spec = {**case["spec"], "src": str(src), "out": str(out), "result": str(res_path)}
            cmd = [lc_py if case["kind"] == "lc" else sys.executable, str(BC), "--child", json.dumps(spec)]
        env = lc_env() if case["kind"] == "lc" else ours_env(case.get("root"))
        meas = run_measured(cmd, log, env=env)
        res = json.loads(res_path.read_text())
        res_path.unlink()
    for d in (out, out.with_name("out.partial")):
        shutil.rmtree(d, ignore_errors=True)
    n = inp["stats"]["parts"].get("draft", 0) if case["bytes"] == "draft" else inp["stats"]["bytes"]
    return {**meas, "work_s": round(res["work_s"], 2), "work_cpu_s": round(res["work_cpu_s"], 2),
            "bytes": n, "mb_per_s": round(mb(n) / res["work_s"], 1)}


# ============================================================================ inputs
def make_input(key: str, layers: int, experts: int, work: Path, args, env: dict) -> dict:
    d = work / key
    t0 = time.perf_counter()
    helper(BC, {"kind": "synth", "out": str(d), "layers": layers, "experts": experts,
                "shard_size": args.src_shard_size}, work / "h.json", env)
    return {"key": key, "dir": d, "layers": layers, "experts": experts, "made_s": round(time.perf_counter() - t0, 1),
            "what": f"synth --preset bench --layers {layers} --experts {experts}"}


def describe(inp: dict, env: dict, work: Path) -> None:
    inp["stats"] = st = helper(BC, {"kind": "stats", "src": str(inp["dir"])}, work / "h.json", env)
    parts = ", ".join(f"{k} {100 * v / st['bytes']:.0f}%" for k, v in sorted(st["parts"].items(), key=lambda kv: -kv[1])
                      if v >= 0.005 * st["bytes"])
    print(f"\n== {inp['key']}: {inp['what']}: {mb(st['bytes']):.0f} MB in {st['shards']} shards ({parts}); "
          f"load {os.getloadavg()[0]:.1f}", flush=True)


def bench_input(inp: dict, cases: list[dict], args, work: Path, lc_py: str | None) -> list[dict]:
    """Every case on one input, --repeat times, alternating; after one unrecorded warm-up copy (the
    VM faults in memory it has not touched recently at a fraction of the usual speed)."""
    run_case(cases[0], inp, work, lc_py)
    rows = [{"input": inp["key"], "id": c["id"], "label": c["label"], "runs": []} for c in cases]
    for rep in range(args.repeat):
        for c, row in zip(cases, rows):
            if "error" in row:
                continue
            try:
                r = run_case(c, inp, work, lc_py)
            except RuntimeError as e:  # a peer refusing the input is a result; our own failing is a bug
                if c["kind"] not in ("lc", "bc"):
                    raise
                row["error"] = str(e).strip().splitlines()[-1][:300]
                print(f"  run {rep + 1}  {c['label']:<52} FAILED: {row['error']}", flush=True)
                continue
            row["runs"].append(r)
            print(f"  run {rep + 1}  {c['label']:<52} {r['work_s']:7.2f} s {r['mb_per_s']:7.0f} MB/s  "
                  f"cpu {r['work_cpu_s']:6.1f} s  wall {r['wall_s']:6.1f} s  RSS {r['peak_rss_mb']:5.0f} / "
                  f"tree {r['peak_tree_rss_mb']:5.0f} MB  load {r['load_before']:.1f}", flush=True)
    for row in (r for r in rows if r["runs"]):
        best = min(row["runs"], key=lambda r: r["work_s"])
        row.update(best_work_s=best["work_s"], mb_per_s=best["mb_per_s"],
                   work_cpu_s=min(r["work_cpu_s"] for r in row["runs"]),
                   peak_rss_mb=max(r["peak_rss_mb"] for r in row["runs"]),
                   peak_tree_rss_mb=max(r["peak_tree_rss_mb"] for r in row["runs"]))
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"\n{'input':<12} {'case':<52} {'work s: min (each)':>24} {'MB/s':>6} {'x floor':>7} {'x cp':>5} "
          f"{'cpu s':>6} {'RSS MB':>6} {'tree MB':>7}")
    for row in rows:
        if not row["runs"]:
            print(f"{row['input']:<12} {row['label']:<52} failed: {row['error']}")
            continue
        base = {r["id"]: r for r in rows if r["input"] == row["input"] and r["runs"]}
        each = " ".join(f"{r['work_s']:.1f}" for r in row["runs"])
        xf = row["mb_per_s"] / base["none"]["mb_per_s"] if "none" in base else float("nan")
        xc = row["mb_per_s"] / base["cp"]["mb_per_s"] if "cp" in base else float("nan")
        print(f"{row['input']:<12} {row['label']:<52} {row['best_work_s']:>7.2f} ({each:>14}) {row['mb_per_s']:6.0f} "
              f"{xf:7.2f} {xc:5.2f} {row['work_cpu_s']:6.1f} {row['peak_rss_mb']:6.0f} {row['peak_tree_rss_mb']:7.0f}")


# ============================================================================ targets
TARGETS = [  # (what, input, case, baseline input, baseline case, at least this many times the baseline's MB/s)
    ("default >= 0.9x our copy floor (expert-heavy)", "experts", "default", "experts", "none", 0.9),
    ("nvfp4 >= 0.9x our copy floor (expert-heavy)", "experts", "nvfp4", "experts", "none", 0.9),
    ("mxfp8 >= 0.9x our copy floor (expert-heavy)", "experts", "mxfp8", "experts", "none", 0.9),
    ("MXFP8 release -> default >= 0.8x the release's copy floor", "release", "default", "release", "none", 0.8),
    ("FP8 source -> default >= 0.8x its copy floor", "fp8", "default", "fp8", "none", 0.8),
    ("copy floor >= 0.8x cp + sha256sum (expert-heavy)", "experts", "none", "experts", "cp", 0.8),
    ("copy floor >= 0.8x cp + sha256sum (pass-through-heavy)", "passthrough", "none", "passthrough", "cp", 0.8),
    ("draft extract >= 0.8x cp + sha256sum", "passthrough", "draft", "passthrough", "cp", 0.8),
    ("lora merge --copy >= 0.8x cp + sha256sum", "passthrough", "lora", "passthrough", "cp", 0.8),
    ("nvfp4 >= 10x llm-compressor NVFP4A16 (expert-heavy)", "experts", "nvfp4", "experts", "lc-nvfp4", 10.0),
    ("nvfp4 >= 10x llm-compressor NVFP4A16 (pass-through-heavy)", "passthrough", "nvfp4", "passthrough", "lc-nvfp4",
     10.0),
    ("convert --scheme default within 5% of --baseline", "experts", "default", "experts", "default@baseline", 0.95),
    ("verify --against within 5% of --baseline", "experts", "verify", "experts", "verify@baseline", 0.95),
]


def check_targets(rows: list[dict], sweeps: dict[str, list[dict]], rss_band: float) -> list[dict]:
    by = {(r["input"], r["id"]): r for r in rows if r["runs"]}
    out = []
    for what, i, c, bi, bc, need in TARGETS:
        a, b = by.get((i, c)), by.get((bi, bc))
        if a is None or b is None:
            print(f"SKIP  {what}: not run (or failed: see above)")
            continue
        ratio = a["mb_per_s"] / b["mb_per_s"]
        each = [x["mb_per_s"] / y["mb_per_s"] for x, y in zip(a["runs"], b["runs"])]
        ok = ratio >= need
        out.append({"target": what, "ratio": round(ratio, 3), "per_run": [round(x, 3) for x in each],
                    "threshold": need, "pass": ok})
        print(f"{'PASS' if ok else 'FAIL'}  {what}: {ratio:.2f}x best of {len(each)} (each run: "
              f"{', '.join(f'{x:.2f}' for x in each)})")
    rel, floor = by.get(("release", "default")), by.get(("experts", "none"))
    if rel and floor:  # another reading of the release target: the same model's BF16 copy floor, by time
        x = floor["best_work_s"] / rel["best_work_s"]
        print(f"INFO  MXFP8 release -> default against the BF16 input's copy floor (its time / ours): {x:.2f}x")
    for what, sweep in sweeps.items():
        if len(sweep) < 2:
            print(f"SKIP  peak RSS flat over 1-8 GB ({what}): fewer than two sweep sizes")
            continue
        ref = sweep[0]["peak_tree_rss_mb"]
        dev = [s["peak_tree_rss_mb"] / ref - 1 for s in sweep]
        ok = max(abs(d) for d in dev) <= rss_band
        span = f"{sweep[0]['src_gb']:.1f}-{sweep[-1]['src_gb']:.1f} GB"
        out.append({"target": f"peak RSS flat within +-{rss_band:.0%} over {span} ({what})", "pass": ok,
                    "rss_mb": [s["peak_tree_rss_mb"] for s in sweep], "deviation": [round(d, 3) for d in dev]})
        print(f"{'PASS' if ok else 'FAIL'}  peak RSS (process tree) flat within +-{rss_band:.0%} of the smallest "
              f"input's over {span} ({what}): " + ", ".join(f"{s['src_gb']:.1f} GB {s['peak_tree_rss_mb']:.0f} MB "
                                                            f"({d:+.1%})" for s, d in zip(sweep, dev)))
    return out


# ============================================================================ the RSS sweep
def rss_sweep(args, work: Path, env: dict, fp8: bool = False) -> list[dict]:
    """Peak RSS of `convert --scheme default` on inputs of --sweep-gb (up to --max-gb), one run each,
    experts grown at a fixed layer count so only routed-expert bytes grow, as up to the real model:
    the bench preset's layout (--sweep-layers) or, with `fp8`, 1 layer of the fp8 input's."""
    gbs = [float(g) for g in args.sweep_gb.split(",") if float(g) <= args.max_gb]
    if not gbs:
        return []
    case = next(c for c in plan_cases(args, False)["fp8" if fp8 else "experts"] if c["id"] == "default")
    print(f"\n== {'fp8sweep' if fp8 else 'sweep'}: {case['label']}, {1 if fp8 else args.sweep_layers} layer(s), "
          f"experts grown to {', '.join(f'{g:g}' for g in gbs)} GB", flush=True)
    if fp8:  # an expert: 3 x 2048 x 7168 e4m3 bytes; the rest of a layer (attention, embedding, ...) ~466 MB
        sizes = [(e, None) for e in dict.fromkeys(max(1, round((g * 1e9 - 466e6) / (3 * 2048 * 7168))) for g in gbs)]
    else:
        most = int(max(gbs) * 1e9 / 63.7e6) + 16  # one expert of the bench preset: 63.7 MB
        table = helper(SCALE, {"kind": "sizes", "layers": args.sweep_layers, "max_experts": most}, work / "h.json",
                       env)["sizes"]
        picks = {min(table, key=lambda row: abs(row[1] / 1e9 - g))[0]: None for g in gbs}  # distinct, in order
        sizes = [(e, {"bytes": total, "parts": {"expert": expert}}) for e in picks for e2, total, expert in table
                 if e2 == e]
    rows = []
    for experts, stats in sizes:
        if fp8:
            inp = {"key": "fp8sweep", "dir": work / "fp8sweep", "experts": experts}
            inp["stats"] = helper(ME, {"kind": "fp8_input", "out": str(inp["dir"]), "layers": 1, "experts": experts,
                                       "shard_size": args.src_shard_size}, work / "h.json", env)
        else:
            inp = {**make_input("sweep", args.sweep_layers, experts, work, args, env), "stats": stats}
        r = run_case(case, inp, work, None)
        total, expert = inp["stats"]["bytes"], inp["stats"]["parts"].get("expert", 0)
        rows.append({"src_gb": round(total / 1e9, 3), "experts": experts, "expert_gb": round(expert / 1e9, 3), **r})
        print(f"  {total / 1e9:5.2f} GB ({experts} experts)  {r['work_s']:7.2f} s {r['mb_per_s']:6.0f} MB/s  "
              f"RSS {r['peak_rss_mb']:5.0f} / tree {r['peak_tree_rss_mb']:5.0f} MB  load {r['load_before']:.1f}",
              flush=True)
        shutil.rmtree(inp["dir"])
    return rows


# ============================================================================ driver
def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts-input", default="2,32", metavar="LAYERS,EXPERTS",
                   help="the expert-heavy input (default 2,32: 5.2 GB, 78%% routed experts)")
    p.add_argument("--passthrough-input", default="2,1", metavar="LAYERS,EXPERTS",
                   help="the pass-through-heavy input (default 2,1: 1.2 GB, 10%% routed experts)")
    p.add_argument("--inputs", default="experts,release,passthrough,fp8,sweep,fp8sweep",
                   help="which inputs to run (comma list; default all)")
    p.add_argument("--fp8-input", default="2,32", metavar="LAYERS,EXPERTS",
                   help="the FP8 block-scaled source (DeepSeek-V3 shapes; default 2,32: 3.5 GB, 80%% routed experts)")
    p.add_argument("--sweep-gb", default="1,2,4,8", help="RSS sweep input sizes, GB")
    p.add_argument("--max-gb", type=float, default=8.0, help="leave out sweep sizes above this")
    p.add_argument("--sweep-layers", type=int, default=1, help="layers of the sweep inputs (1: 0.92 GB without experts)")
    p.add_argument("--rss-band", type=float, default=0.10, help="peak RSS 'flat': within this of the smallest input's")
    p.add_argument("--repeat", type=int, default=2, help="runs of every case (each recorded; the best is compared)")
    p.add_argument("--workers", type=int, default=1, help="our --workers and llm-compressor's max_workers")
    p.add_argument("--modelopt-threads", type=int, default=2, help="torch threads of the ModelOpt loop")
    p.add_argument("--activation-amax", type=float, default=4.0, help="--default-activation-amax of W4A4 cases")
    p.add_argument("--src-shard-size", default="500MB", help="input shard size")
    p.add_argument("--max-shard-size", default="500MB", help="our output shard size")
    p.add_argument("--work-dir", default=str(ROOT / "bench-out" / "real"), help="inputs and outputs (on disk by "
                   "default; removed at the end)")
    p.add_argument("--venv", default=str(ROOT / "bench-out" / "lc-venv"), help="llm-compressor's venv")
    p.add_argument("--skip-peer", action="store_true", help="no llm-compressor (no venv)")
    p.add_argument("--skip-modelopt", action="store_true", help="no ModelOpt loop")
    p.add_argument("--baseline", metavar="DIR", help="a checkout of another revision: its convert and verify "
                   "beside ours (a change's cost)")
    p.add_argument("--json", metavar="OUT", help="write every run, the ratios and the targets as JSON")
    return args_or_child(p, argv, child)


def _pair(s: str) -> tuple[int, int]:
    layers, experts = (int(x) for x in s.split(","))
    return layers, experts


def run_inputs(args, work: Path, env: dict, lc_py: str | None) -> tuple[list[dict], dict]:
    """The experts, release and passthrough inputs, one after the other (each removed when done)."""
    which = set(args.inputs.split(","))
    cases = plan_cases(args, lc_py is not None)
    rows, inputs = [], {}

    def with_lc(inp):
        if lc_py is not None:
            inp["lc_dir"] = work / f"{inp['key']}-lc"
            helper(BC, {"kind": "unstack", "src": str(inp["dir"]), "out": str(inp["lc_dir"])}, work / "h.json", env)

    if which & {"experts", "release"}:
        inp = inputs["experts"] = make_input("experts", *_pair(args.experts_input), work, args, env)
        describe(inp, env, work)
        if args.baseline:  # what the verify cases read: one default conversion, untimed
            inp["converted"] = work / "converted"
            helper(ME, {"kind": "cli", "argv": ["convert", str(inp["dir"]), str(inp["converted"]), "--quiet",
                                                 "--default-activation-amax", str(args.activation_amax)]},
                   work / "h.json", env)
        if "experts" in which:
            with_lc(inp)
            rows += bench_input(inp, cases["experts"], args, work, lc_py)
            shutil.rmtree(inp.pop("lc_dir", work / "none"), ignore_errors=True)
        if "release" in which:
            rel = inputs["release"] = {"key": "release", "dir": work / "release",
                                       "what": "the MXFP8 release form of the experts input (convert --scheme mxfp8)"}
            helper(ME, {"kind": "cli", "argv": ["convert", str(inp["dir"]), str(rel["dir"]), "--scheme", "mxfp8",
                                                 "--quiet", "--max-shard-size", args.src_shard_size]}, work / "h.json", env)
            describe(rel, env, work)
            rows += bench_input(rel, cases["release"], args, work, None)
            shutil.rmtree(rel["dir"])
        shutil.rmtree(inp["dir"])
    if "fp8" in which:
        layers, experts = _pair(args.fp8_input)
        inp = inputs["fp8"] = {"key": "fp8", "dir": work / "fp8", "layers": layers, "experts": experts,
                               "what": f"DeepSeek-V3 FP8 block-scaled source, {layers} layers x {experts} experts"}
        inp["stats"] = st = helper(ME, {"kind": "fp8_input", "out": str(inp["dir"]), "layers": layers,
                                        "experts": experts, "shard_size": args.src_shard_size}, work / "h.json", env)
        print(f"\n== fp8: {inp['what']}: {mb(st['bytes']):.0f} MB in {st['shards']} shards ("
              + ", ".join(f"{k} {100 * v / st['bytes']:.0f}%" for k, v in sorted(st["parts"].items()))
              + f"); load {os.getloadavg()[0]:.1f}", flush=True)
        rows += bench_input(inp, cases["fp8"], args, work, None)
        shutil.rmtree(inp["dir"])
    if "passthrough" in which:
        inp = inputs["passthrough"] = make_input("passthrough", *_pair(args.passthrough_input), work, args, env)
        describe(inp, env, work)
        inp["adapter"] = work / "adapter"
        helper(ME, {"kind": "adapter", "ckpt": str(inp["dir"]), "out": str(inp["adapter"]), "r": 16}, work / "h.json", env)
        with_lc(inp)
        rows += bench_input(inp, cases["passthrough"], args, work, lc_py)
        for d in (inp["dir"], inp.pop("lc_dir", None), inp["adapter"]):
            if d is not None:
                shutil.rmtree(d)
    return rows, inputs


def main(argv=None) -> int:
    args = parse_args(argv)
    if args is None:  # ran as a measured child
        return 0
    work = Path(args.work_dir)
    if work.exists():
        shutil.rmtree(work)
    (work / "logs").mkdir(parents=True)
    env = ours_env()
    lc_py = None if args.skip_peer else str(ensure_lc_venv(Path(args.venv)))
    t0 = time.perf_counter()
    print(f"bench_real: {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}, work dir {work}, "
          f"{args.repeat} run(s) of every case, --workers {args.workers}", flush=True)
    if lc_py is None:
        print("llm-compressor skipped (--skip-peer)")
    print("llm-compressor does not take the stacked form as it is (model_free_ptq quantizes 2-D <module>.weight "
          "only): it reads a copy with the experts unstacked; nor the MXFP8 release (e4m3 experts): not run there")
    rows, inputs = run_inputs(args, work, env, lc_py)
    which = args.inputs.split(",")
    sweeps = {"bf16": rss_sweep(args, work, env) if "sweep" in which else [],
              "fp8": rss_sweep(args, work, env, fp8=True) if "fp8sweep" in which else []}
    if rows:
        print_table(rows)
    print()
    targets = check_targets(rows, sweeps, args.rss_band)
    print(f"\n{sum(t['pass'] for t in targets)} of {len(targets)} targets met; {time.perf_counter() - t0:.0f} s in all")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "machine": f"{platform.machine()} {os.cpu_count()} CPUs, {platform.platform()}",
            "cpus": os.cpu_count(), "workers": args.workers,
            "command": " ".join(["python", "tools/bench_real.py", *(argv if argv is not None else sys.argv[1:])]),
            "inputs": {k: {kk: str(v) if isinstance(v, Path) else v for kk, v in i.items()} for k, i in inputs.items()},
            "results": rows, "sweep": sweeps["bf16"], "fp8_sweep": sweeps["fp8"], "targets": targets}, indent=2) + "\n")
        print(f"wrote {args.json}")
    shutil.rmtree(work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
