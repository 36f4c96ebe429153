"""inkling-quant lora check / merge on Hugging Face MoE checkpoints, held to PEFT itself.

Tiny models of real families (tests/hf_moe_reference.py) are written by transformers' own
save_pretrained; PEFT wraps the model transformers loads from them (`get_peft_model`, random
non-zero lora_B), its adapter is saved, and PEFT's own `merge_and_unload()` + `save_pretrained`
is the reference our merge of the same adapter into the same checkpoint must equal:
- nn.Linears (attention, shared experts): bit for bit (PEFT adds the FP32 delta to the BF16
  weight in FP32 and rounds once, as we do);
- routed experts (PEFT's ParamWrapper on transformers' stacked [E, out, in] parameters, or a
  transformers-4 adapter of per-expert Linears that PEFT converts on load): PEFT rounds the
  delta to BF16 before adding, we round once: ours is exactly bf16(W + d) with d PEFT's own
  einsum laid out as the checkpoint stores the experts (per expert: gate and up halves; stacked:
  as is), PEFT's exactly W + bf16(d), the two within one BF16 ulp.
Quantized checkpoints (ModelOpt's own export): attention merged, every other tensor and the
quantization config untouched, expert adapters refused; merging into the source and converting
with ModelOpt's activation scales gives the same checkpoint as merging into the export.
"""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_moe_reference import export, save
from inkling_quant import cli, lora
from inkling_quant.convert import Options, convert
from inkling_quant.errors import CheckpointError, ConfigError

from modelopt_reference import read_tensors
from test_lora import bits_equal, one_ulp_apart, write_adapter

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

CLASSES = {"qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
           "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration", "llama4": "Llama4ForConditionalGeneration"}
ATTN = {f: ["q_proj", "k_proj", "v_proj", "o_proj"] for f in CLASSES}
ATTN["deepseek_v3"] = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]  # MLA
PREFIX = {f: "model." for f in CLASSES} | {"qwen3_vl_moe": "model.language_model.", "llama4": "language_model.model."}
EXPERTS = {"qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")), "deepseek_v3": ("mlp", ("gate_proj", "up_proj", "down_proj")),
           "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")), "qwen3_vl_moe": ("mlp", None)}  # None: stacked
EXPERT_LAYERS = {"qwen3_moe": (1, 2), "deepseek_v3": (1, 2), "mixtral": (0, 1, 2), "qwen3_vl_moe": (0, 1, 2)}
EXPERT_PARAMS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
E, H, I = 4, 64, 32  # experts, hidden size, expert width of every tiny family
# per family: PEFT's patterns and rsLoRA, so each family checks other scaling rules
CONFIGS = {
    "qwen3_moe": dict(rank_pattern={"o_proj": 2, "down_proj": 3}, alpha_pattern={"v_proj": 5, "gate_up_proj": 6}),
    "mixtral": dict(use_rslora=True, rank_pattern={"k_proj": 2}),
    "deepseek_v3": dict(rank_pattern={"kv_b_proj": 2}, alpha_pattern={"q_a_proj": 3, "down_proj": 12}),
    "qwen3_vl_moe": dict(alpha_pattern={"down_proj": 4}),
}


def peft_adapter(src: Path, family: str, out: Path, **config) -> tuple[Path, Path]:
    """(adapter, PEFT's merged save) of a LoRA on the model transformers loads from `src`."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = getattr(transformers, CLASSES[family]).from_pretrained(src, dtype=torch.bfloat16)
        torch.manual_seed(1)
        conf = dict(r=4, lora_alpha=8, target_modules=ATTN[family], init_lora_weights=False) | config
        pm = peft.get_peft_model(model, peft.LoraConfig(**conf))
        pm.save_pretrained(out / "adapter")
        pm.merge_and_unload().save_pretrained(out / "peft_merged")
    return out / "adapter", out / "peft_merged"


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    base = tmp_path_factory.mktemp("lora-hf")
    return {f: save(f, base / f"{f}-bf16") for f in CLASSES}


@pytest.fixture(scope="module")
def cases(sources, tmp_path_factory):
    """family -> (source, adapter on attention and routed experts, PEFT's merge, ours)."""
    out = {}
    for family, config in CONFIGS.items():
        tmp = tmp_path_factory.mktemp(family)
        adapter, theirs = peft_adapter(sources[family], family, tmp, target_parameters=EXPERT_PARAMS, **config)
        lora.merge(sources[family], adapter, tmp / "ours")
        out[family] = sources[family], adapter, theirs, tmp / "ours"
    return out


def expert_tensors(family: str, layer: int, param: str, delta: torch.Tensor) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of `layer`'s experts that parameter `param` ([E, out, in] in
    memory) covers, each with its part of `delta`."""
    block, names = EXPERTS[family]
    base = f"{PREFIX[family]}layers.{layer}.{block}.experts"
    if names is None:
        return {f"{base}.{param}": delta}
    if param == "down_proj":
        return {f"{base}.{e}.{names[2]}.weight": delta[e] for e in range(E)}
    return {f"{base}.{e}.{names[h]}.weight": delta[e, h * I:(h + 1) * I] for e in range(E) for h in (0, 1)}


def peft_expert_delta(ad: dict, module: str, scaling: float) -> torch.Tensor:
    """ParamWrapper.get_delta_weight's formula (peft 0.21, [E, out, in] parameters) in FP32,
    without its final cast to the parameter dtype."""
    a, b = ad[f"base_model.model.{module}.lora_A.weight"], ad[f"base_model.model.{module}.lora_B.weight"]
    return torch.einsum("o r e, e r i -> e o i", b.reshape(b.shape[0], -1, E), a.reshape(E, -1, a.shape[-1])) * scaling


def scalings(family: str) -> dict[str, float]:
    """PEFT's scaling of the two expert parameters under CONFIGS[family] (r=4, alpha=8)."""
    c = CONFIGS[family]
    out = {}
    for p in ("gate_up_proj", "down_proj"):
        r, alpha = c.get("rank_pattern", {}).get(p, 4), c.get("alpha_pattern", {}).get(p, 8)
        out[p] = alpha / (r ** 0.5 if c.get("use_rslora") else r)
    return out


# --------------------------------------------------------------------------- BF16 sources
@pytest.mark.parametrize("family", list(CONFIGS))
def test_merge_equals_peft_merge_and_unload(cases, family):
    """Every tensor of our merge: attention bit for bit PEFT's; every other tensor the source's
    (PEFT's save keeps DeepSeek's router in FP32: transformers loads it so); the routed experts
    held to PEFT's formula in the next test."""
    src, _, theirs, ours = cases[family]
    b, want, got = read_tensors(src), read_tensors(theirs), read_tensors(ours)
    assert set(got) == set(want) == set(b)
    changed = {k for k in b if not bits_equal(got[k], b[k])}
    attention = {k for k in b if any(f".self_attn.{p}.weight" in k for p in ATTN[family])}
    experts = {k for layer in EXPERT_LAYERS[family] for p in ("gate_up_proj", "down_proj")
               for k in expert_tensors(family, layer, p, torch.zeros(E, 2 * I, H))}
    assert attention and experts <= set(b)
    assert changed == attention | experts
    for k in attention:
        assert bits_equal(got[k], want[k]), k


@pytest.mark.parametrize("family", list(CONFIGS))
def test_expert_merge_is_peft_delta_rounded_once(cases, family):
    """With d = PEFT's own FP32 expert delta laid out as the checkpoint stores the experts (per
    expert: its gate and up halves, w1/w3 for Mixtral; stacked: as is), ours is bf16(W + d) and
    PEFT's bf16(W + bf16(d)), both bit for bit, and the two within one ulp."""
    src, adapter, theirs, ours = cases[family]
    b, want, got = read_tensors(src), read_tensors(theirs), read_tensors(ours)
    ad = load_file(adapter / "adapter_model.safetensors")
    s = scalings(family)
    for layer in EXPERT_LAYERS[family]:
        module = f"{PREFIX[family]}layers.{layer}.mlp.experts"
        for param, key in (("gate_up_proj", f"{module}.base_layer"), ("down_proj", module)):
            delta = peft_expert_delta(ad, key, s[param])
            for name, d in expert_tensors(family, layer, param, delta).items():
                assert bits_equal(got[name], (b[name].float() + d).to(torch.bfloat16)), name
                assert bits_equal(want[name], b[name] + d.to(torch.bfloat16)), name
                assert bool(one_ulp_apart(got[name], want[name], b[name], d).all()), name


def test_plan_names_checkpoint_tensors(cases):
    """check: each adapter module, the checkpoint tensor(s) it merges into and PEFT's scale;
    an expert parameter of a per-expert checkpoint lands in every expert's gate and up (or down)."""
    src, adapter, _, _ = cases["qwen3_moe"]
    plan = lora.check(src, adapter)
    rows = {t.tensor: t for t in plan.targets}
    q = rows["model.layers.0.self_attn.q_proj.weight"]
    assert (q.module, q.part, q.rank, q.scale) == ("model.layers.0.self_attn.q_proj", "attention", 4, 2.0)
    assert rows["model.layers.2.self_attn.o_proj.weight"].scale == 8 / 2
    assert rows["model.layers.1.self_attn.v_proj.weight"].scale == 5 / 4
    up = rows["model.layers.2.mlp.experts.3.up_proj.weight"]
    assert (up.module, up.part, up.param, up.expert, up.half, up.scale) == \
        ("model.layers.2.mlp.experts.gate_up_proj", "expert", "gate_up_proj", 3, 1, 6 / 4)
    down = rows["model.layers.1.mlp.experts.0.down_proj.weight"]
    assert (down.rank, down.scale, down.expert) == (3, 8 / 3, 0)
    s = plan.summary()
    assert s["by_part"] == {"attention": 12, "dense_mlp": 0, "shared_expert": 0, "expert": 4}
    assert (s["modules"], s["tensors"]) == (16, 12 + 2 * E * 3)
    mixtral = {t.tensor: t for t in lora.check(*cases["mixtral"][:2]).targets}  # rsLoRA: alpha / sqrt(r)
    assert mixtral["model.layers.0.self_attn.q_proj.weight"].scale == 8 / 2
    assert mixtral["model.layers.0.self_attn.k_proj.weight"].scale == pytest.approx(8 / 2 ** 0.5)
    vl = {t.tensor: t for t in lora.check(*cases["qwen3_vl_moe"][:2]).targets}
    w = vl["model.language_model.layers.1.mlp.experts.gate_up_proj"]
    assert (w.shape, w.expert, w.sliced) == ((E, 2 * I, H), None, True)


def test_check_cli_prints_plan_and_json(cases, capsys):
    src, adapter, _, _ = cases["mixtral"]
    assert cli.main(["lora", "check", str(src), str(adapter)]) == 0
    out = capsys.readouterr().out
    assert "model.layers.1.self_attn.q_proj" in out
    assert "model.layers.1.mlp.experts.gate_up_proj" in out and f"({2 * E} tensors, per expert)" in out
    assert cli.main(["lora", "check", str(src), str(adapter), "--json", "-"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["by_part"] == {"attention": 12, "dense_mlp": 0, "shared_expert": 0, "expert": 6}
    assert {t["tensor"] for t in report["targets"]} >= {"model.layers.2.block_sparse_moe.experts.3.w3.weight"}


def test_transformers4_per_expert_adapter(sources, tmp_path):
    """An adapter trained on transformers 4's per-expert Linears (`mlp.experts.E.gate_proj`,
    Mixtral's `block_sparse_moe.experts.E.w1`; with attention, or experts only) merges into the
    per-expert BF16 checkpoint as plain Linears, within one ulp of PEFT (which converts it to its
    ParamWrapper on load, rounding the delta first) and attention bit for bit."""
    g = torch.Generator().manual_seed(3)
    for family, attention in (("qwen3_moe", True), ("mixtral", False)):
        block, names = EXPERTS[family]
        modules = {}
        for layer in (1, 2):
            for e in range(E):
                for n in names:
                    shape = (H, I) if n == names[2] else (I, H)
                    modules[f"model.layers.{layer}.{block}.experts.{e}.{n}"] = \
                        (torch.randn(2, shape[1], generator=g), torch.randn(shape[0], 2, generator=g))
            if attention:
                modules[f"model.layers.{layer}.self_attn.q_proj"] = (torch.randn(2, H, generator=g),
                                                                     torch.randn(H, 2, generator=g))
        d = write_adapter(tmp_path / family / "adapter", modules, r=2, lora_alpha=4, layers_to_transform=[1, 2],
                          target_modules=list(names) + ["q_proj"] * attention, base_model_name_or_path=None)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = getattr(transformers, CLASSES[family]).from_pretrained(sources[family], dtype=torch.bfloat16)
            peft.PeftModel.from_pretrained(model, d).merge_and_unload().save_pretrained(tmp_path / family / "peft")
        report = lora.merge(sources[family], d, tmp_path / family / "ours")
        assert report["by_part"]["expert"] == 2 * E * 3 and report["by_part"]["attention"] == 2 * attention
        b, want, got = read_tensors(sources[family]), read_tensors(tmp_path / family / "peft"), read_tensors(tmp_path / family / "ours")
        for name in b:
            if name.endswith(".weight") and name[:-len(".weight")] in modules:
                a_, b_ = modules[name[:-len(".weight")]]
                delta = (b_ @ a_) * 2.0
                assert bits_equal(got[name], (b[name].float() + delta).to(torch.bfloat16)), name
                assert bool(one_ulp_apart(got[name], want[name], b[name], delta).all()), name
                if ".self_attn." in name:
                    assert bits_equal(got[name], want[name]), name
            else:
                assert bits_equal(got[name], b[name]) and bits_equal(want[name], b[name]), name


def test_llama4_prefix_and_shared_experts(sources, tmp_path):
    """Llama 4: text model under `language_model.model.`, MoE under `feed_forward`; attention and
    the shared expert's Linears (selected by a regex, as PEFT matches it) merged bit for bit as
    PEFT merges them, the rest untouched."""
    src = sources["llama4"]
    regex = r".*language_model.*\.(self_attn\.[qkvo]_proj|shared_expert\.(gate|up|down)_proj)"
    adapter, theirs = peft_adapter(src, "llama4", tmp_path, target_modules=regex)
    report = lora.merge(src, adapter, tmp_path / "ours")
    assert report["by_part"] == {"attention": 8, "dense_mlp": 0, "shared_expert": 6, "expert": 0}
    b, want, got = read_tensors(src), read_tensors(theirs), read_tensors(tmp_path / "ours")
    assert set(b) == set(want) == set(got)
    assert all(bits_equal(got[k], want[k]) for k in b)
    assert sum(not bits_equal(got[k], b[k]) for k in b) == 14


def test_stacked_in_out_experts(sources, tmp_path):
    """Qwen3-VL-MoE as the Hub stores its experts, [E, in, out]: attention adapters merge (the
    same bits as into save_pretrained's [E, out, in]); expert adapters are refused with the
    reason (whether PEFT's delta must be transposed depends on the family's in-memory layout)."""
    src, hub = sources["qwen3_vl_moe"], tmp_path / "hub"
    hub.mkdir()
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            sd = {k: (v.transpose(1, 2).contiguous() if k.endswith(("experts.gate_up_proj", "experts.down_proj")) else v)
                  for k, v in load_file(f).items()}
            save_file(sd, hub / f.name, metadata={"format": "pt"})
        else:
            (hub / f.name).write_bytes(f.read_bytes())
    adapter, theirs = peft_adapter(src, "qwen3_vl_moe", tmp_path / "attn")
    lora.merge(hub, adapter, tmp_path / "ours")
    got, want, before = read_tensors(tmp_path / "ours"), read_tensors(theirs), read_tensors(hub)
    for k, v in got.items():
        assert bits_equal(v, want[k] if ".self_attn." in k else before[k]), k
    experts, _ = peft_adapter(src, "qwen3_vl_moe", tmp_path / "experts", target_parameters=EXPERT_PARAMS)
    with pytest.raises(ConfigError, match=r"not stacked \[E, out, in\].*attention-only adapter"):
        lora.check(hub, experts)


def test_text_only_module_names(cases, tmp_path):
    """An adapter naming the text model's layers `model.layers.N` (as a text-only model would)
    merges into the multimodal checkpoint's `model.language_model.layers.N`, experts included."""
    src, adapter, _, ours = cases["qwen3_vl_moe"]
    text = tmp_path / "text-only"
    text.mkdir()
    renamed = {k.replace("model.language_model.layers.", "model.layers."): v
               for k, v in load_file(adapter / "adapter_model.safetensors").items()}
    save_file(renamed, text / "adapter_model.safetensors")
    (text / "adapter_config.json").write_bytes((adapter / "adapter_config.json").read_bytes())
    assert any(m.startswith("model.layers.") for m in lora.check(src, text).adapter.modules)
    lora.merge(src, text, tmp_path / "out")
    got, want = read_tensors(tmp_path / "out"), read_tensors(ours)
    assert all(bits_equal(got[k], want[k]) for k in want)


# --------------------------------------------------------------------------- quantized exports
@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """family -> (BF16 source, ModelOpt's export of it) for a per-expert family with MLA and
    shared experts, and a stacked multimodal one (exported per expert)."""
    base = tmp_path_factory.mktemp("lora-modelopt")
    return {f: (base / f"{f}-bf16", export(f, base / f"{f}-modelopt", base / f"{f}-bf16"))
            for f in ("deepseek_v3", "qwen3_vl_moe")}


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_vl_moe"])
def test_attention_merge_into_modelopt_export(exported, tmp_path, family):
    """Into ModelOpt's NVFP4/MXFP8 export: the attention projections as PEFT merges them into
    the source, bit for bit; every other tensor (quantized experts, scales) and the quantization
    config as exported; the merge recorded in config.json."""
    src, modelopt = exported[family]
    adapter, theirs = peft_adapter(src, family, tmp_path, **CONFIGS[family])
    report = lora.merge(modelopt, adapter, tmp_path / "ours")
    assert report["by_part"]["attention"] == 3 * len(ATTN[family]) and not report["checksums"]
    got, want, exp = read_tensors(tmp_path / "ours"), read_tensors(theirs), read_tensors(modelopt)
    assert set(got) == set(exp)
    for k, v in got.items():
        attention = any(f".self_attn.{p}.weight" in k for p in ATTN[family])
        assert bits_equal(v, want[k] if attention else exp[k]), k
    config, original = (json.loads((d / "config.json").read_text()) for d in (tmp_path / "ours", modelopt))
    assert config.pop("lora_merged")[0]["modules"] == 3 * len(ATTN[family]) and config == original
    assert (tmp_path / "ours" / "hf_quant_config.json").read_bytes() == (modelopt / "hf_quant_config.json").read_bytes()


def test_merge_then_convert_equals_merge_into_export(exported, tmp_path):
    """Merging into the BF16 source then converting with ModelOpt's activation scales gives the
    checkpoint merging into ModelOpt's export gives: every tensor bit-identical."""
    src, modelopt = exported["deepseek_v3"]
    adapter, _ = peft_adapter(src, "deepseek_v3", tmp_path)
    lora.merge(src, adapter, tmp_path / "src-merged")
    convert(str(tmp_path / "src-merged"), tmp_path / "a", Options(scheme="default", activation_scales=str(modelopt)),
            quiet=True)
    lora.merge(modelopt, adapter, tmp_path / "b")
    a, b = read_tensors(tmp_path / "a"), read_tensors(tmp_path / "b")
    assert set(a) == set(b) and all(bits_equal(a[k], b[k]) for k in a)


def test_expert_adapter_refused_on_quantized_export(exported, tmp_path, capsys):
    src, modelopt = exported["qwen3_vl_moe"]
    adapter, _ = peft_adapter(src, "qwen3_vl_moe", tmp_path, target_parameters=EXPERT_PARAMS)
    with pytest.raises(ConfigError, match=r"mlp\.experts.*routed experts of this checkpoint are NVFP4; expert "
                                          r"adapters need BF16 expert weights.*Merge into the BF16 source"):
        lora.check(modelopt, adapter)
    assert lora.check(src, adapter).summary()["by_part"]["expert"] == 6  # the BF16 source takes them
    rc = cli.main(["lora", "merge", str(modelopt), str(adapter), str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2 and "expert adapters need BF16" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()
    g = torch.Generator().manual_seed(0)  # a transformers-4 adapter of one expert's Linear: refused alike
    v4 = write_adapter(tmp_path / "v4", {"model.language_model.layers.2.mlp.experts.0.gate_proj":
                                         (torch.randn(4, H, generator=g), torch.randn(I, 4, generator=g))},
                       target_modules=["gate_proj"])
    with pytest.raises(ConfigError, match=r"experts\.0\.gate_proj.*are MXFP8; expert adapters need BF16"):
        lora.check(modelopt, v4)


# --------------------------------------------------------------------------- refusals
def test_refusals(sources, tmp_path):
    """Modules outside what merges (LM head, vision tower), another family's adapter, another
    hidden size, a transformers-4 expert module of a stacked checkpoint: each a clear error."""
    q3, vl = sources["qwen3_moe"], sources["qwen3_vl_moe"]
    g = torch.Generator().manual_seed(0)
    head = write_adapter(tmp_path / "head", {"lm_head": (torch.randn(4, H, generator=g), torch.randn(96, 4, generator=g))},
                         target_modules=["lm_head"])
    with pytest.raises(ConfigError, match=r"select only modules LoRA cannot be merged into \(e\.g\. 'lm_head', lm_head\)"):
        lora.check(q3, head)
    vision, _ = peft_adapter(vl, "qwen3_vl_moe", tmp_path / "vision", target_modules=["qkv"])
    with pytest.raises(ConfigError, match=r"'model\.visual\.blocks\.0\.attn\.qkv', vision\).*attention projections"):
        lora.check(vl, vision)
    mla, _ = peft_adapter(sources["deepseek_v3"], "deepseek_v3", tmp_path / "mla")
    with pytest.raises(CheckpointError, match="kv_a_proj_with_mqa.weight'.*not in the checkpoint.*another model"):
        lora.check(q3, mla)  # o_proj is selected in both families, the MLA projections are DeepSeek's only
    mla_only, _ = peft_adapter(sources["deepseek_v3"], "deepseek_v3", tmp_path / "mla-only",
                               target_modules=["q_a_proj", "kv_b_proj"])
    with pytest.raises(ConfigError, match="match no attention projection or routed expert.*another model"):
        lora.check(q3, mla_only)
    wide = write_adapter(tmp_path / "wide", {"model.layers.0.self_attn.q_proj": (torch.randn(4, 128, generator=g),
                                                                                torch.randn(64, 4, generator=g))},
                         target_modules=["q_proj"], layers_to_transform=[0])
    with pytest.raises(ConfigError, match=r"shape mismatch.*hidden_size 128; this checkpoint has 64.*another model"):
        lora.check(q3, wide)
    per_expert = write_adapter(tmp_path / "v4", {"model.language_model.layers.0.mlp.experts.0.gate_proj":
                                                 (torch.randn(4, H, generator=g), torch.randn(I, 4, generator=g))},
                               target_modules=["gate_proj", "q_proj"])
    with pytest.raises(ConfigError, match=r"experts\.0\.gate_proj.*LoRA merges only into"):
        lora.check(vl, per_expert)
    other = write_adapter(tmp_path / "other", {"transformer.h.0.attn.c_attn": (torch.randn(4, H, generator=g),
                                                                                torch.randn(H, 4, generator=g))},
                          target_modules=["c_attn", "q_proj"])
    with pytest.raises((ConfigError, CheckpointError), match="not a module of this qwen3_moe checkpoint"):
        lora.check(q3, other)
