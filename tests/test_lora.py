"""inkling-quant lora check / merge on the session's tiny synthetic Inkling 2 checkpoint.

Adapters are named as PEFT names them on transformers' Inkling2ForConditionalGeneration
(`model.language_model.layers.N.self_attn.q_proj.linear`, the stacked experts through
`target_parameters`); the checkpoint holds the original names (`model.llm.layers.N.attn.wq_du`).
Numerics are held to PEFT itself where peft and transformers' inkling2 are installed: the
checkpoint loaded by transformers, the adapter applied by PEFT, `merge_and_unload()`.
- FP32 adapter weights (PEFT's default, `autocast_adapter_dtype=True`): PEFT computes
  (B @ A) * scaling in FP32 and adds it to the BF16 weight in FP32, rounding once: our merge is
  the same computation, so the bits must be identical.
- BF16 adapter weights: PEFT rounds the delta to BF16 before adding (two roundings), we round
  once, so the two may differ by one BF16 ulp (at the magnitude of the larger of W, the delta
  and the result: where W and the delta cancel, PEFT's early rounding shows), never more.
Without them, the same properties are checked against an explicit FP64 reference of PEFT's
formula (scaling = alpha / r, or alpha / sqrt(r) with rsLoRA; rank_pattern / alpha_pattern).
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from inkling_quant import cli, lora
from inkling_quant.convert import Options, convert
from inkling_quant.errors import CheckpointError, ConfigError, UsageError
from inkling_quant.io.checkpoint import INDEX_NAME, Checkpoint
from inkling_quant.io.safetensors import ShardReader, sha256_file

from legacy_checkpoint import write_legacy_checkpoint
from modelopt_reference import read_tensors

# PEFT module under self_attn (transformers' name) -> the checkpoint's projection under attn
# (docs/lora.md's table): the seven attention nn.Linears of Inkling 2
ATTN = {"q_proj.linear": "wq_du", "k_proj.linear": "wk_dv", "v_proj.linear": "wv_dv", "o_proj.linear": "wo_ud",
        "o_proj.gate_proj": "gate_attn", "relative_position_bias.linear": "wr_du", "sink_proj": "attn_sink_proj"}
HF = "model.language_model.layers."
PEFT_LAYERS = (0, 4, 5, 11, 47)  # sliding and full-attention layers (5, 11, 47: every 6th), first and last
RS_RANKS = {"q_proj.linear": 8, f"{HF}5.self_attn.o_proj.linear": 2}
RS_ALPHAS = {"v_proj.linear": 3}
OPTS = dict(default_activation_amax=4.0, max_shard_bytes=1 << 20)  # several shards: linking is visible


# --------------------------------------------------------------------------- helpers
def module(layer: int, proj: str) -> str:
    return f"{HF}{layer}.self_attn.{proj}"


def tensor_of(mod: str) -> str:
    """The checkpoint tensor an attention module of the adapter merges into."""
    layer, _, proj = mod[len(HF):].partition(".self_attn.")
    return f"model.llm.layers.{layer}.attn.{ATTN[proj]}.weight"


def load_all(root: Path) -> dict[str, torch.Tensor]:
    ckpt = Checkpoint.open(root)
    out = {}
    for shard, h in ckpt.headers().items():
        with ShardReader(root / shard, h) as r:
            for name in h.tensors:
                out[name] = r.get(name).clone()
    return out


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and \
        bytes(a.reshape(-1).view(torch.uint8).numpy()) == bytes(b.reshape(-1).view(torch.uint8).numpy())


def one_ulp_apart(got: torch.Tensor, want: torch.Tensor, *terms: torch.Tensor) -> torch.Tensor:
    """Elementwise: |got - want| <= one BF16 ulp at the magnitude of the largest of got, want and
    `terms` (W and the delta). Rounding the delta before the sum (PEFT with BF16 adapter weights)
    or an FP32 rather than FP64 sum errs by that much at most; where W and the delta cancel, the
    result is small and the error is measured against the inputs that produced it."""
    mag = torch.stack([t.double().abs().reshape(-1) for t in (got, want, *terms)]).amax(0)
    _, e = torch.frexp(mag)  # mag = m * 2**e with m in [0.5, 1): ulp_bf16 = 2**(e - 1 - 7)
    ulp = torch.ldexp(torch.ones_like(mag), e - 8)
    return (got.double().reshape(-1) - want.double().reshape(-1)).abs() <= ulp


def assert_one_ulp(got, want, w, a, b, scale, name, min_identical):
    """`got` within one BF16 ulp of `want` everywhere and bit-identical in `min_identical` of it."""
    delta = scale * (b.double() @ a.double())
    ok = one_ulp_apart(got, want, w, delta)
    assert bool(ok.all()), f"{name}: {int((~ok).sum())} element(s) more than one ulp apart"
    identical = float((got.reshape(-1) == want.reshape(-1)).double().mean())
    assert identical >= min_identical, f"{name}: only {identical:.3%} bit-identical"


def write_adapter(d: Path, modules: dict[str, tuple[torch.Tensor, torch.Tensor]], *, prefix: str = "base_model.model.",
                  **config) -> Path:
    """A PEFT-format adapter directory, written by hand (target_modules: every attention projection
    unless given)."""
    d.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for m, (a, b) in modules.items():
        tensors[f"{prefix}{m}.lora_A.weight"] = a.contiguous()
        tensors[f"{prefix}{m}.lora_B.weight"] = b.contiguous()
    save_file(tensors, d / "adapter_model.safetensors")
    conf = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 4, "lora_alpha": 8, "bias": "none",
            "use_rslora": False, "fan_in_fan_out": False, "base_model_name_or_path": "thinkingmachines/Inkling-2-Small",
            "target_modules": list(ATTN)}
    conf.update(config)
    (d / "adapter_config.json").write_text(json.dumps(conf))
    return d


def random_lora(shape: tuple[int, int], r: int, gen: torch.Generator, dtype=torch.float32):
    out_f, in_f = shape
    a = torch.randn(r, in_f, generator=gen) / math.sqrt(in_f)
    b = torch.randn(out_f, r, generator=gen) * 0.02
    return a.to(dtype), b.to(dtype)


def n_layers(shapes: dict) -> int:
    return 1 + max(int(n.split(".")[3]) for n in shapes if n.startswith("model.llm.layers."))


def attention_adapter(d: Path, shapes: dict, *, layers=None, projections=tuple(ATTN), r=4, rank_pattern=None,
                      seed=0, dtype=torch.float32, **config) -> Path:
    """LoRA on the attention projections of `layers` (all by default), ranks as PEFT assigns them."""
    gen = torch.Generator().manual_seed(seed)
    every = range(n_layers(shapes))
    layers = every if layers is None else layers
    rank_pattern = rank_pattern or {}
    probe = lora.AdapterConfig.from_dict({"peft_type": "LORA", "r": r, "lora_alpha": 1, "target_modules": ["x"],
                                          "rank_pattern": rank_pattern}, "probe")
    mods = {}
    for i in layers:
        for p in ATTN:
            if p in projections:
                m = module(i, p)
                mods[m] = random_lora(shapes[tensor_of(m)], probe.rank_alpha(m)[0], gen, dtype)
    extra = {} if "layers_to_transform" in config or layers == every else {"layers_to_transform": list(layers)}
    return write_adapter(d, mods, r=r, rank_pattern=rank_pattern, target_modules=list(projections), **extra, **config)


def reference_merge(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """PEFT's formula in FP64, rounded once to the weight's dtype."""
    return (w.double() + scale * (b.double() @ a.double())).to(w.dtype)


def load_all_adapter(d: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    t = load_file(d / "adapter_model.safetensors")
    out = {}
    for k in t:
        if k.endswith(".lora_A.weight"):
            m = k[len("base_model.model."): -len(".lora_A.weight")]
            out[m] = (t[k].float(), t[k.replace("lora_A", "lora_B")].float())
    return out


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def src(tiny_src, tmp_path_factory) -> Path:
    """A private copy of the session's BF16 source (merges hardlink its shards)."""
    return Path(shutil.copytree(tiny_src, tmp_path_factory.mktemp("lora") / "src"))


@pytest.fixture(scope="module")
def shapes(src) -> dict[str, tuple[int, ...]]:
    return {n: tuple(e.shape) for h in Checkpoint.open(src).headers().values() for n, e in h.tensors.items()}


@pytest.fixture(scope="module")
def converted(src, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("lora") / "converted"
    convert(src, out, Options(**OPTS), quiet=True)
    return out


@pytest.fixture(scope="module")
def rs_adapter(shapes, tmp_path_factory) -> Path:
    """Hand-written: rsLoRA, r=4 with q_proj at rank 8 and one o_proj at rank 2, alpha 8 with v_proj at 3."""
    return attention_adapter(tmp_path_factory.mktemp("lora") / "rs", shapes, r=4, lora_alpha=8, use_rslora=True,
                             rank_pattern=RS_RANKS, alpha_pattern=RS_ALPHAS)


@pytest.fixture(scope="module")
def merged_converted(converted, rs_adapter, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("lora") / "merged"
    lora.merge(converted, rs_adapter, out)
    return out


@pytest.fixture(scope="module")
def peft_case(src, tmp_path_factory):
    """(adapter dir, PEFT-merged tensors under the original names): an adapter made and merged by PEFT."""
    return _peft_adapter(src, tmp_path_factory.mktemp("lora") / "peft", autocast=True)


def _peft_adapter(src: Path, d: Path, *, autocast: bool):
    """The checkpoint loaded by transformers' Inkling2ForConditionalGeneration, LoRA on the
    attention projections of PEFT_LAYERS by PEFT, saved; PEFT's merge_and_unload() saved by
    transformers (which writes the original names back)."""
    peft = pytest.importorskip("peft")
    ref = pytest.importorskip("inkling2_reference")  # transformers >= 5.24 (models/inkling2)
    base = ref.inkling2.Inkling2ForConditionalGeneration.from_pretrained(src, dtype=torch.bfloat16)
    torch.manual_seed(1)
    conf = peft.LoraConfig(r=4, lora_alpha=8, use_rslora=True, target_modules=list(ATTN), init_lora_weights=False,
                           layers_to_transform=list(PEFT_LAYERS), rank_pattern=RS_RANKS, alpha_pattern=RS_ALPHAS)
    model = peft.get_peft_model(base, conf, autocast_adapter_dtype=autocast)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:  # PEFT's random init is large; make the delta the size of a fine-tune's
                p.mul_(0.05)
    model.save_pretrained(d)
    model.merge_and_unload().save_pretrained(d.parent / f"{d.name}-merged")
    return d, read_tensors(d.parent / f"{d.name}-merged")


# --------------------------------------------------------------------------- check
def test_check_reports_modules_shards_ranks_scales(converted, rs_adapter, shapes):
    before = sorted(p.name for p in converted.iterdir())
    plan = lora.check(converted, rs_adapter, scale=0.5)
    assert len(plan.targets) == n_layers(shapes) * len(ATTN)
    by = {t.module: t for t in plan.targets}
    wm = Checkpoint.open(converted).weight_map
    for t in plan.targets:
        assert t.tensor == tensor_of(t.module) and t.shard == wm[t.tensor] and t.part == "attention"
    q, v, o5, o6 = (by[module(i, p)] for i, p in ((0, "q_proj.linear"), (0, "v_proj.linear"), (5, "o_proj.linear"),
                                                  (6, "o_proj.linear")))
    assert (q.rank, q.alpha, q.scaling) == (8, 8, 8 / math.sqrt(8))  # rsLoRA: alpha / sqrt(r)
    assert (v.rank, v.alpha, v.scaling) == (4, 3, 3 / 2)
    assert (o5.rank, o5.scaling) == (2, 8 / math.sqrt(2))
    assert (o6.rank, o6.scaling) == (4, 8 / 2)
    assert all(t.scale == t.scaling * 0.5 for t in plan.targets)      # --scale multiplies
    assert sorted(p.name for p in converted.iterdir()) == before       # nothing written
    assert not list(converted.parent.glob("*.partial"))


def test_check_cli_prints_plan_and_json(converted, rs_adapter, capsys):
    assert cli.main(["lora", "check", str(converted), str(rs_adapter)]) == 0
    out = capsys.readouterr().out
    assert "336 module(s) (336 attention)" in out and "rsLoRA" in out
    assert module(47, "o_proj.gate_proj") in out
    assert cli.main(["lora", "check", str(converted), str(rs_adapter), "--json", "-"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["modules"] == 336 and report["by_part"] == {"attention": 336, "expert": 0}
    row = next(t for t in report["targets"] if t["module"] == module(0, "q_proj.linear"))
    assert row["rank"] == 8 and row["shard"].startswith("model-") and math.isclose(row["scale"], 8 / math.sqrt(8))
    assert row["tensor"] == "model.llm.layers.0.attn.wq_du.weight"


# --------------------------------------------------------------------------- merge: numerics
def test_merge_into_converted_matches_reference_formula(converted, merged_converted, rs_adapter):
    """No peft needed: every merged projection within one ulp of PEFT's formula computed in FP64
    (FP32 arithmetic may round a near-tie the other way), nearly all identical; the rest untouched."""
    before, after = load_all(converted), load_all(merged_converted)
    assert set(before) == set(after)
    adapter = {tensor_of(m): (m, ab) for m, ab in load_all_adapter(rs_adapter).items()}
    conf = lora.AdapterConfig.from_dict(json.loads((rs_adapter / "adapter_config.json").read_text()), "x")
    for name, w in before.items():
        if name in adapter:
            m, (a, b) = adapter[name]
            r, alpha = conf.rank_alpha(m)
            scale = alpha / math.sqrt(r)
            assert_one_ulp(after[name], reference_merge(w, a, b, scale), w, a, b, scale, name, 0.99)
            assert not bits_equal(after[name], w), name  # the delta is visible
        else:
            assert bits_equal(after[name], w), name  # experts (NVFP4/MXFP8), norms, draft...: byte-identical
    assert len(adapter) == 336


def test_merge_is_bit_identical_to_peft(src, converted, peft_case, tmp_path):
    """FP32 adapter weights: PEFT's merge_and_unload() and ours are the same FP32 computation
    with one rounding: identical bits, on the converted checkpoint's BF16 attention."""
    adapter, peft_merged = peft_case
    source = load_all(src)
    # transformers' lm_head drops the unembedding's padding rows, which save_pretrained then writes as its own
    unembed, rows = "model.llm.unembed.weight", json.loads((src / "config.json").read_text())["text_config"][
        "unpadded_vocab_size"]
    assert bits_equal(peft_merged.pop(unembed)[:rows], source[unembed][:rows])
    peft_changed = {n for n, w in peft_merged.items() if not bits_equal(w, source[n])}
    assert peft_changed == {tensor_of(module(i, p)) for i in PEFT_LAYERS for p in ATTN}
    out = tmp_path / "m"
    lora.merge(converted, adapter, out)
    got = load_all(out)
    assert {n for n, w in load_all(converted).items() if not bits_equal(got[n], w)} == peft_changed
    for name in peft_changed:
        assert bits_equal(got[name], peft_merged[name]), name


def test_bf16_adapter_within_one_ulp_of_peft(src, converted, tmp_path):
    """BF16 adapter weights: PEFT rounds the delta to BF16, then the sum (two roundings); we round
    once. At most one BF16 ulp apart, and mostly identical."""
    adapter, peft_merged = _peft_adapter(src, tmp_path / "a", autocast=False)
    assert json.loads((adapter / "adapter_config.json").read_text())["use_rslora"] is True
    out = tmp_path / "m"
    lora.merge(converted, adapter, out)
    got, base, ad = load_all(out), load_all(src), load_all_adapter(adapter)
    assert len(ad) == len(PEFT_LAYERS) * len(ATTN)
    conf = lora.AdapterConfig.from_dict(json.loads((adapter / "adapter_config.json").read_text()), "x")
    for m, (a, b) in ad.items():
        name = tensor_of(m)
        r, alpha = conf.rank_alpha(m)
        assert_one_ulp(got[name], peft_merged[name], base[name], a, b, alpha / math.sqrt(r), name, 0.9)


def test_scale_multiplies_and_fan_in_fan_out_is_ignored_like_peft(src, shapes, tmp_path):
    """--scale multiplies PEFT's scaling; fan_in_fan_out=true is ignored for Linear weights (PEFT
    resets it with a warning), so the merge is the same with it; plain (non-rs) LoRA is alpha/r."""
    a1 = attention_adapter(tmp_path / "a1", shapes, layers=[3], r=16, lora_alpha=32, projections=("q_proj.linear",))
    a2 = attention_adapter(tmp_path / "a2", shapes, layers=[3], r=16, lora_alpha=32, projections=("q_proj.linear",),
                           fan_in_fan_out=True)
    plan = lora.check(src, a2)
    assert any("fan_in_fan_out" in w for w in plan.warnings)
    lora.merge(src, a1, tmp_path / "o1", scale=0.25)
    lora.merge(src, a2, tmp_path / "o2", scale=0.25)
    name = "model.llm.layers.3.attn.wq_du.weight"
    w = load_all(src)[name]
    a, b = load_all_adapter(a1)[module(3, "q_proj.linear")]
    got1, got2 = load_all(tmp_path / "o1")[name], load_all(tmp_path / "o2")[name]
    assert bits_equal(got1, got2)
    assert_one_ulp(got1, reference_merge(w, a, b, 32 / 16 * 0.25), w, a, b, 32 / 16 * 0.25, name, 0.99)
    wrong = reference_merge(w, a, b, 32 / 4 * 0.25)  # alpha/sqrt(r) would be 4x as large
    assert not bool(one_ulp_apart(got1, wrong, w, wrong).all())


# --------------------------------------------------------------------------- merge: output
def test_merged_output_is_a_valid_converted_checkpoint(converted, merged_converted, rs_adapter):
    src_ckpt, out_ckpt = Checkpoint.open(converted), Checkpoint.open(merged_converted)
    assert out_ckpt.shards == src_ckpt.shards and out_ckpt.weight_map == src_ckpt.weight_map
    assert (merged_converted / INDEX_NAME).read_bytes() == (converted / INDEX_NAME).read_bytes()
    assert (merged_converted / "hf_quant_config.json").read_bytes() == (converted / "hf_quant_config.json").read_bytes()
    for p in src_ckpt.other_files():
        assert (merged_converted / p.name).read_bytes() == p.read_bytes()
    # config: unchanged but for the provenance record
    c_in = json.loads((converted / "config.json").read_text())
    c_out = json.loads((merged_converted / "config.json").read_text())
    rec = c_out.pop(lora.PROVENANCE_KEY)
    assert c_out == c_in
    assert len(rec) == 1 and rec[0]["modules"] == 336 and rec[0]["use_rslora"] is True
    assert rec[0]["adapter_sha256"] == sha256_file(rs_adapter / "adapter_model.safetensors")
    # shards with a targeted tensor rewritten, the others the very same files (hardlinks)
    targeted = {tensor_of(m) for m in load_all_adapter(rs_adapter)}
    headers = src_ckpt.headers()
    for s in src_ckpt.shards:
        has_attn = any(n in targeted for n in headers[s].tensors)
        same_inode = os.stat(converted / s).st_ino == os.stat(merged_converted / s).st_ino
        assert same_inode != has_attn, s
    # checksums: the same file list as the source's, every digest true
    sums_in = lora.read_checksums(converted / "checksums.sha256")
    sums = lora.read_checksums(merged_converted / "checksums.sha256")
    assert set(sums) == set(sums_in)
    assert sums == {f: sha256_file(merged_converted / f) for f in sums}
    assert not list(merged_converted.parent.glob("*.partial"))


def test_only_shards_with_targets_are_rewritten(converted, shapes, tmp_path):
    d = attention_adapter(tmp_path / "a", shapes, layers=[2], projections=("v_proj.linear",))
    out = tmp_path / "out"
    r = lora.merge(converted, d, out)
    ckpt = Checkpoint.open(converted)
    name = "model.llm.layers.2.attn.wv_dv.weight"
    holder = ckpt.weight_map[name]
    assert (r["rewritten"], r["linked"], r["copied"]) == (1, len(ckpt.shards) - 1, 0)
    for s in ckpt.shards:
        assert (os.stat(converted / s).st_ino == os.stat(out / s).st_ino) == (s != holder), s
    before, after = load_all(converted), load_all(out)
    assert [n for n in before if not bits_equal(before[n], after[n])] == [name]
    sums = lora.read_checksums(out / "checksums.sha256")
    assert sums == {f: sha256_file(out / f) for f in sums}


def test_merged_checkpoint_verifies(merged_converted):
    verify = pytest.importorskip("inkling_quant.verify")
    report = verify.verify(merged_converted)
    assert report.ok, report.format_summary()


def test_merge_into_source_then_convert_equals_convert_then_merge(src, converted, merged_converted, rs_adapter,
                                                                  tmp_path):
    """An attention-only adapter commutes with conversion: attention passes through the converter
    bit-exactly, and the experts are not touched. Every tensor is bit-identical either way."""
    merged_src = tmp_path / "merged-src"
    r = lora.merge(src, rs_adapter, merged_src)
    assert r["checksums"] is False  # the synthetic source has no checksums.sha256: none invented
    out = tmp_path / "merged-then-converted"
    convert(merged_src, out, Options(**OPTS), quiet=True)
    a, b = load_all(out), load_all(merged_converted)
    assert set(a) == set(b)
    for name in a:
        assert bits_equal(a[name], b[name]), name
    prov = json.loads((out / "config.json").read_text())[lora.PROVENANCE_KEY]  # survives convert
    assert prov == json.loads((merged_converted / "config.json").read_text())[lora.PROVENANCE_KEY]


# --------------------------------------------------------------------------- experts
def stacked_lora(shape: tuple[int, int, int], r: int, gen: torch.Generator):
    """PEFT's ParamWrapper factors for a stacked [E, out, in] parameter: lora_A [r*E, in], lora_B [out, r*E]."""
    n_exp, out_f, in_f = shape
    return torch.randn(r * n_exp, in_f, generator=gen) / math.sqrt(in_f), \
        torch.randn(out_f, r * n_exp, generator=gen) * 0.02


def expert_adapter(d: Path, shapes: dict, layers=(0, 47)) -> Path:
    """LoRA on q_proj and on both stacked expert parameters of `layers` (target_parameters named
    per layer: PEFT applies neither layers_to_transform nor exclude_modules to parameters)."""
    gen = torch.Generator().manual_seed(7)
    mods, params = {}, []
    for i in layers:
        experts = f"{HF}{i}.mlp.experts"
        # both parameters targeted: gate_up_proj's ParamWrapper is the inner one, saved under base_layer
        mods[experts + ".base_layer"] = stacked_lora(shapes[f"model.llm.layers.{i}.mlp.experts.w13_weight"], 4, gen)
        mods[experts] = stacked_lora(shapes[f"model.llm.layers.{i}.mlp.experts.w2_weight"], 4, gen)
        params += [experts + ".gate_up_proj", experts + ".down_proj"]
        mods[module(i, "q_proj.linear")] = random_lora(shapes[tensor_of(module(i, "q_proj.linear"))], 4, gen)
    return write_adapter(d, mods, target_modules=["q_proj.linear"], target_parameters=params,
                         layers_to_transform=list(layers))


def expert_references(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, gate_up: bool):
    """Per expert e: (reference, W_e, A_e, B_e) with PEFT's ParamWrapper factors A[e*r:(e+1)*r],
    B[:, e::E], B's rows for gate_up_proj ([gate; up]) interleaved as the checkpoint's w13 stores
    them (row 2j gate j, 2j+1 up j); the reference is PEFT's formula in FP64, rounded once."""
    n_exp = w.shape[0]
    r = a.shape[0] // n_exp
    for e in range(n_exp):
        a_e, b_e = a[e * r:(e + 1) * r], b[:, e::n_exp]
        if gate_up:
            gate, up = b_e.chunk(2)
            b_e = torch.stack((gate, up), dim=1).reshape(b_e.shape)
        yield reference_merge(w[e], a_e, b_e, scale), w[e], a_e, b_e


def test_expert_adapter_refused_on_quantized_experts(converted, shapes, tmp_path):
    ad = expert_adapter(tmp_path / "ex", shapes)
    with pytest.raises(ConfigError, match=r"mlp\.experts.*NVFP4.*expert adapters need BF16 expert weights"):
        lora.check(converted, ad)
    with pytest.raises(ConfigError, match="expert adapters need BF16"):
        lora.merge(converted, ad, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()
    ad47 = expert_adapter(tmp_path / "ex47", shapes, layers=(47,))
    with pytest.raises(ConfigError, match="MXFP8"):
        lora.check(converted, ad47)


def test_expert_adapter_merged_on_bf16_source(src, shapes, tmp_path):
    ad = expert_adapter(tmp_path / "ex", shapes)
    plan = lora.check(src, ad)
    assert plan.summary()["by_part"] == {"attention": 2, "expert": 2 * 2}
    out = tmp_path / "out"
    lora.merge(src, ad, out)
    before, after, adapter = load_all(src), load_all(out), load_all_adapter(ad)
    merged = set()
    for m, (a, b) in adapter.items():
        if ".mlp.experts" not in m:
            name = tensor_of(m)
            assert_one_ulp(after[name], reference_merge(before[name], a, b, 8 / 4), before[name], a, b, 8 / 4, name,
                           0.99)
        else:
            layer = m[len(HF):].split(".")[0]
            name = f"model.llm.layers.{layer}.mlp.experts.{'w13' if m.endswith('base_layer') else 'w2'}_weight"
            refs = expert_references(before[name], a, b, 8 / 4, gate_up=name.endswith("w13_weight"))
            for e, (want, w_e, a_e, b_e) in enumerate(refs):
                assert_one_ulp(after[name][e], want, w_e, a_e, b_e, 8 / 4, f"{name}[{e}]", 0.99)
        merged.add(name)
    assert len(merged) == 6
    for name, w in before.items():
        if name not in merged:
            assert bits_equal(after[name], w), name


# --------------------------------------------------------------------------- refusals
def test_legacy_layout_refused(shapes, tmp_path, capsys):
    """A checkpoint of the layout this project invented before Inkling 2 was published: refused,
    naming config.json, writing nothing."""
    legacy = write_legacy_checkpoint(tmp_path / "legacy")
    d = attention_adapter(tmp_path / "a", shapes, layers=[0], projections=("q_proj.linear",))
    with pytest.raises(ConfigError, match=r"config\.json: no 'text_config'.*no longer supported"):
        lora.check(legacy, d)
    rc = cli.main(["lora", "merge", str(legacy), str(d), str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2 and "config.json" in err and "no longer supported" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_corrupt_adapter_files(src, shapes, tmp_path):
    good = attention_adapter(tmp_path / "good", shapes, layers=[0], projections=("q_proj.linear",))
    q0 = module(0, "q_proj.linear")

    def variant(name: str) -> Path:
        return Path(shutil.copytree(good, tmp_path / name))

    d = variant("truncated")
    p = d / "adapter_model.safetensors"
    p.write_bytes(p.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="corrupt adapter.*truncated"):
        lora.check(src, d)
    d = variant("header")
    (d / "adapter_model.safetensors").write_bytes(struct.pack("<Q", 20) + b"{not json at all!!!}")
    with pytest.raises(CheckpointError, match="corrupt adapter.*not valid JSON"):
        lora.check(src, d)
    d = variant("config")
    (d / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4,')
    with pytest.raises(CheckpointError, match=r"adapter_config.json.*not valid JSON"):
        lora.check(src, d)
    d = variant("nan")
    a, b = load_all_adapter(good)[q0]
    b[3, 1] = float("nan")
    write_adapter(d, {q0: (a, b)}, target_modules=["q_proj.linear"], layers_to_transform=[0])
    with pytest.raises(CheckpointError, match="NaN or Inf"):
        lora.check(src, d)
    d = variant("half")
    save_file({f"base_model.model.{q0}.lora_A.weight": a}, d / "adapter_model.safetensors")
    with pytest.raises(CheckpointError, match="no lora_B"):
        lora.check(src, d)
    d = variant("pickle")
    (d / "adapter_model.safetensors").unlink()
    (d / "adapter_model.bin").write_bytes(b"\x80\x04N.")
    with pytest.raises(CheckpointError, match="pickle"):
        lora.check(src, d)
    d = variant("rank")
    cfg_d = json.loads((d / "adapter_config.json").read_text())
    (d / "adapter_config.json").write_text(json.dumps({**cfg_d, "r": 8}))
    with pytest.raises(ConfigError, match="lora_A has rank 4 but the adapter config gives r=8"):
        lora.check(src, d)
    with pytest.raises(UsageError, match="no such adapter directory"):
        lora.check(src, tmp_path / "nowhere")


def test_adapter_for_another_model(src, shapes, tmp_path):
    gen = torch.Generator().manual_seed(3)
    q0 = module(0, "q_proj.linear")
    q_out = shapes[tensor_of(q0)][0]
    # hidden size: an adapter made for a model with hidden 128 (this one has 64)
    d = write_adapter(tmp_path / "hidden", {q0: random_lora((q_out, 128), 4, gen)},
                      target_modules=["q_proj.linear"], layers_to_transform=[0])
    with pytest.raises(ConfigError, match=r"shape mismatch.*hidden_size 128; this checkpoint has 64.*another model"):
        lora.check(src, d)
    # a layer past the config's depth
    d = write_adapter(tmp_path / "deep", {module(60, "q_proj.linear"): random_lora((q_out, 64), 4, gen)},
                      target_modules=["q_proj.linear"])
    with pytest.raises(ConfigError, match="layer 60, but config.json has 48 layers"):
        lora.check(src, d)
    # a shallower model: LoRA on every q_proj of its 24 layers, which target_modules extends to 48 here
    d = attention_adapter(tmp_path / "shallow", shapes, layers=range(24), projections=("q_proj.linear",),
                          layers_to_transform=None)
    with pytest.raises(ConfigError, match="layers 0-23 only.*48-layer checkpoint.*fewer layers"):
        lora.check(src, d)
    # another model with more experts: PEFT stacks one rank-r factor per expert
    experts = f"{HF}0.mlp.experts"
    _, out_f, in_f = shapes["model.llm.layers.0.mlp.experts.w2_weight"]
    d = write_adapter(tmp_path / "experts", {experts: stacked_lora((8, out_f, in_f), 4, gen)},
                      target_modules=None, target_parameters=[experts + ".down_proj"])
    with pytest.raises(ConfigError, match=r"lora_A has rank 32 but .* r \* experts = 4 \* 4"):
        lora.check(src, d)
    # another architecture's module names
    d = write_adapter(tmp_path / "gpt2", {"transformer.h.0.attn.c_attn": random_lora((192, 64), 4, gen)},
                      target_modules=["c_attn"])
    with pytest.raises(ConfigError, match="match no attention projection or routed expert"):
        lora.check(src, d)
    d = write_adapter(tmp_path / "gpt2b", {"transformer.h.0.attn.c_attn": random_lora((192, 64), 4, gen)},
                      target_modules=["c_attn", "q_proj.linear"])
    with pytest.raises(ConfigError, match="not a module of the Inkling 2 layout"):
        lora.check(src, d)
    # weights for modules the config does not target: files that do not belong together
    d = attention_adapter(tmp_path / "mismatch", shapes, layers=[0], projections=("q_proj.linear",))
    conf = json.loads((d / "adapter_config.json").read_text())
    (d / "adapter_config.json").write_text(json.dumps({**conf, "target_modules": ["k_proj.linear"]}))
    with pytest.raises(ConfigError, match="does not select it"):
        lora.check(src, d)
    # modules outside attention/experts (the router, the draft)
    router = f"{HF}0.mlp.gate"
    for m, shape in ((router, (4, 64)), ("mtp.layers.0.self_attn.q_proj", (64, 64))):
        d = write_adapter(tmp_path / m.replace(".", "_"), {m: random_lora(shape, 4, gen)}, target_modules=[m])
        with pytest.raises(ConfigError, match=rf"cannot be merged into \(e\.g\. '{re.escape(m)}'"):
            lora.check(src, d)
    for m, match in ((router, r"mlp\.gate' \(.*router\): LoRA merges only into"),
                     ("mtp.layers.0.self_attn.q_proj", r"self_attn\.q_proj' is the DSpark draft: LoRA merges only")):
        d = write_adapter(tmp_path / f"both-{m}", {q0: random_lora((q_out, 64), 4, gen), m: random_lora((4, 64), 4, gen)},
                          target_modules=["q_proj.linear", m], layers_to_transform=[0])
        with pytest.raises(ConfigError, match=match):
            lora.check(src, d)


@pytest.mark.parametrize("setting, match", [
    ({"use_dora": True}, "DoRA"),
    ({"lora_bias": True}, "lora_bias"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"init_lora_weights": "pissa_niter_4"}, "modified base weights"),
    ({"init_lora_weights": "olora"}, "modified base weights"),
    ({"peft_type": "LOHA"}, "only plain LoRA"),
    ({"bias": "all"}, "bias='none'"),
    ({"use_some_future_variant": True}, "unknown setting"),
    ({"r": 0}, "'r' must be a positive"),
    ({"target_modules": []}, "targets no module"),
])
def test_unsupported_variants_refused(src, shapes, tmp_path, setting, match):
    d = attention_adapter(tmp_path / "a", shapes, layers=[0], projections=("q_proj.linear",))
    conf = json.loads((d / "adapter_config.json").read_text())
    (d / "adapter_config.json").write_text(json.dumps({**conf, **setting}))
    with pytest.raises(ConfigError, match=match):
        lora.check(src, d)


def test_dora_and_embedding_tensors_refused(src, shapes, tmp_path):
    d = attention_adapter(tmp_path / "a", shapes, layers=[0], projections=("q_proj.linear",))
    q0 = module(0, "q_proj.linear")
    for extra, match in ((f"{q0}.lora_magnitude_vector", "DoRA"),
                         ("model.language_model.embed_tokens.lora_embedding_A", "embedding LoRA"),
                         (f"{q0}.lora_B.bias", "lora_bias")):
        t = {f"base_model.model.{k}": v for k, v in
             {f"{m}.lora_{w}.weight": x for m, (a, b) in load_all_adapter(d).items() for w, x in (("A", a), ("B", b))}.items()}
        t[f"base_model.model.{extra}"] = torch.zeros(4)
        save_file(t, tmp_path / "w.safetensors")
        e = Path(shutil.copytree(d, tmp_path / extra.replace(".", "_")))
        shutil.copyfile(tmp_path / "w.safetensors", e / "adapter_model.safetensors")
        with pytest.raises(ConfigError, match=match):
            lora.check(src, e)


def test_dtype_guard(src, shapes, tmp_path):
    d = attention_adapter(tmp_path / "a", shapes, layers=[0], projections=("q_proj.linear",))
    with pytest.raises(UsageError, match="wq_du.weight' is BF16, not fp16.*never changes it.*--dtype bf16"):
        lora.check(src, d, dtype="fp16")


# --------------------------------------------------------------------------- output safety
def test_existing_out_refused_and_failures_leave_nothing(src, shapes, tmp_path):
    d = attention_adapter(tmp_path / "a", shapes, layers=[0], projections=("q_proj.linear",))
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(UsageError, match="already exists"):
        lora.merge(src, d, out)
    assert (out / "keep.txt").read_text() == "mine"
    lora.merge(src, d, out, overwrite=True)
    assert not (out / "keep.txt").exists() and (out / INDEX_NAME).exists()
    with pytest.raises(UsageError, match="outside the source"):
        lora.merge(src, d, src / "inside")
    # an adapter so large the merged BF16 weight would overflow: refused before merging (its delta's
    # bound past BF16's range), nothing left behind
    q0 = module(0, "q_proj.linear")
    a, b = load_all_adapter(d)[q0]
    big = write_adapter(tmp_path / "big", {q0: (a * 1e30, b * 1e30)}, target_modules=["q_proj.linear"],
                        layers_to_transform=[0])
    with pytest.raises(UsageError, match="past what the checkpoint's BF16 holds"):
        lora.merge(src, big, tmp_path / "out2")
    assert not (tmp_path / "out2").exists() and not (tmp_path / "out2.partial").exists()


def test_merge_cli_and_errors(src, shapes, converted, tmp_path, capsys):
    d = attention_adapter(tmp_path / "a", shapes, layers=[0, 5], projections=("q_proj.linear", "o_proj.gate_proj"))
    out = tmp_path / "out"
    assert cli.main(["lora", "merge", str(src), str(d), str(out), "--scale", "2", "--copy"]) == 0
    text = capsys.readouterr().out
    ckpt = Checkpoint.open(src)
    holders = {ckpt.weight_map[tensor_of(m)] for m in load_all_adapter(d)}
    assert "4 module(s)" in text and f"{len(holders)} shard(s) rewritten" in text and "copied" in text
    assert len(holders) < len(ckpt.shards)
    assert all(os.stat(out / s).st_ino != os.stat(src / s).st_ino for s in ckpt.shards)  # --copy: no links
    rc = cli.main(["lora", "merge", str(converted), str(expert_adapter(tmp_path / "ex", shapes)), str(tmp_path / "o2")])
    err = capsys.readouterr().err
    assert rc == 2 and "expert adapters need BF16 expert weights" in err and "Traceback" not in err
    rc = cli.main(["lora", "check", str(src), str(d), "--scale", "nan"])
    assert rc == 2 and "--scale must be a finite number" in capsys.readouterr().err


def test_merges_stack_and_record_provenance(src, shapes, tmp_path):
    d1 = attention_adapter(tmp_path / "a1", shapes, layers=[1], projections=("k_proj.linear",), seed=1)
    d2 = attention_adapter(tmp_path / "a2", shapes, layers=[1], projections=("k_proj.linear",), seed=2)
    lora.merge(src, d1, tmp_path / "o1")
    lora.merge(tmp_path / "o1", d2, tmp_path / "o2", scale=-1.0)
    rec = json.loads((tmp_path / "o2" / "config.json").read_text())[lora.PROVENANCE_KEY]
    assert [r["scale"] for r in rec] == [1.0, -1.0] and rec[0]["adapter_sha256"] != rec[1]["adapter_sha256"]
    name = "model.llm.layers.1.attn.wk_dv.weight"
    w, ad1, ad2 = load_all(src)[name], load_all_adapter(d1), load_all_adapter(d2)
    m = module(1, "k_proj.linear")
    w1, w2 = load_all(tmp_path / "o1")[name], load_all(tmp_path / "o2")[name]
    assert_one_ulp(w1, reference_merge(w, *ad1[m], 2.0), w, *ad1[m], 2.0, name, 0.99)
    assert_one_ulp(w2, reference_merge(w1, *ad2[m], -2.0), w1, *ad2[m], -2.0, name, 0.99)
