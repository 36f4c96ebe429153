"""inkling-quant lora check / merge on the published Inkling 2 layout, held to PEFT itself.

A tiny transformers Inkling2ForConditionalGeneration (tests/inkling2_reference.py) is wrapped
with `peft.get_peft_model` (attention modules by `target_modules`, the stacked routed experts by
`target_parameters`), its adapter saved, the base saved with `save_pretrained` (original layout);
our merge of the two is compared with PEFT's own `merge_and_unload()` + `save_pretrained`:
- attention (nn.Linear, FP32 adapter weights): PEFT computes (B @ A) * scaling in FP32 and adds
  it to the BF16 weight in FP32, rounding once; so do we: identical bits.
- routed experts (PEFT's ParamWrapper): PEFT rounds the FP32 delta to BF16 *before* adding
  (`get_delta_weight` casts to the parameter's dtype), two roundings; we round once. The two
  differ by at most one BF16 ulp at the magnitude of the larger of W, the delta and the result
  (where W and the delta nearly cancel, PEFT's early rounding shows) and are otherwise identical.
  Against PEFT's delta formula rounded once (the einsum of ParamWrapper.get_delta_weight, FP32,
  no early cast) the merge is identical up to FP32 summation order (within one ulp, nearly all
  bit-identical).
Converted checkpoints: attention merges, quantized experts stay bit-exact, expert adapters are
refused with the recipe's reason.
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from inkling_quant import lora
from inkling_quant.convert import Options, convert
from inkling_quant.errors import ConfigError
from inkling_quant.model.inkling2 import Inkling2Config, checkpoint_tensors, transformers_name
from inkling_quant.synth import write_checkpoint

from modelopt_reference import read_tensors
from test_lora import ATTN, bits_equal, one_ulp_apart, write_adapter

ref = pytest.importorskip("inkling2_reference")  # transformers >= 5.24 (models/inkling2)
peft = pytest.importorskip("peft")
inkling2, save_tiny = ref.inkling2, ref.save_tiny

ATTN_MODULES = list(ATTN)
EXPERT_PARAMS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
PREFIX = "base_model.model."


def peft_model(base: Path, **config):
    model = inkling2.Inkling2ForConditionalGeneration.from_pretrained(base, dtype=torch.bfloat16)
    torch.manual_seed(1)
    conf = dict(r=4, lora_alpha=8, target_modules=ATTN_MODULES, init_lora_weights=False)
    conf.update(config)
    return peft.get_peft_model(model, peft.LoraConfig(**conf))


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """(base, adapter, PEFT's merged save, our merged output) for an attention + expert adapter
    with a rank_pattern and an alpha_pattern."""
    tmp = tmp_path_factory.mktemp("peft")
    base = save_tiny(tmp / "base")
    pm = peft_model(base, target_parameters=EXPERT_PARAMS, rank_pattern={"o_proj.linear": 2, "down_proj": 3},
                    alpha_pattern={"sink_proj": 5, "gate_up_proj": 6})
    pm.save_pretrained(tmp / "adapter")
    pm.merge_and_unload().save_pretrained(tmp / "peft_merged")
    lora.merge(base, tmp / "adapter", tmp / "ours")
    return base, tmp / "adapter", tmp / "peft_merged", tmp / "ours"


def test_peft_writes_stacked_expert_factors(case):
    """What PEFT 0.21 saves for target_parameters on Inkling2Experts: one ParamWrapper per
    parameter, nested (gate_up_proj innermost, under base_layer), lora_A [r*E, in], lora_B [out, r*E]."""
    _, adapter, _, _ = case
    t = load_file(adapter / "adapter_model.safetensors")
    p = f"{PREFIX}model.language_model.layers.1.mlp.experts."
    E, H, inter = 4, 96, 48
    assert t[p + "base_layer.lora_A.weight"].shape == (4 * E, H)          # gate_up_proj: r=4
    assert t[p + "base_layer.lora_B.weight"].shape == (2 * inter, 4 * E)
    assert t[p + "lora_A.weight"].shape == (3 * E, inter)                 # down_proj: rank_pattern 3
    assert t[p + "lora_B.weight"].shape == (H, 3 * E)


def test_plan_names_checkpoint_tensors(case):
    base, adapter, _, _ = case
    plan = lora.check(base, adapter)
    rows = {t.tensor: t for t in plan.targets}
    assert len(rows) == 4 * (7 + 2)
    q = rows["model.llm.layers.1.attn.wq_du.weight"]
    assert (q.module, q.part, q.rank, q.scale) == ("model.language_model.layers.1.self_attn.q_proj.linear",
                                                   "attention", 4, 2.0)
    assert rows["model.llm.layers.2.attn.wo_ud.weight"].rank == 2
    assert rows["model.llm.layers.0.attn.attn_sink_proj.weight"].scale == 5 / 4
    w13 = rows["model.llm.layers.3.mlp.experts.w13_weight"]
    assert (w13.part, w13.param, w13.rank, w13.scale) == ("expert", "gate_up_proj", 4, 6 / 4)
    w2 = rows["model.llm.layers.3.mlp.experts.w2_weight"]
    assert (w2.param, w2.rank, w2.scale) == ("down_proj", 3, 8 / 3)
    assert plan.summary()["by_part"] == {"attention": 28, "expert": 8}


def test_merge_equals_peft_merge_and_unload(case):
    """Every tensor of our merge equals PEFT's merged save: attention and all the rest bit for
    bit; the stacked experts are held to PEFT in the next test (PEFT rounds them twice)."""
    base, _, peft_dir, ours_dir = case
    b, want, got = read_tensors(base), read_tensors(peft_dir), read_tensors(ours_dir)
    assert set(got) == set(want) == set(b)
    changed = 0
    for name, w in want.items():
        g = got[name]
        if ".mlp.experts." in name:
            assert g.dtype == w.dtype and g.shape == w.shape
        else:
            assert bits_equal(g, w), name
        changed += not bits_equal(g, b[name])
    assert changed == 4 * 9  # every targeted tensor changed, nothing else


def _peft_expert_delta(a: torch.Tensor, b: torch.Tensor, n_exp: int, scaling: float) -> torch.Tensor:
    """ParamWrapper.get_delta_weight's formula (peft 0.21, (experts, out, in) parameters), in FP32,
    without its final cast to the parameter dtype."""
    return torch.einsum("o r e, e r i -> e o i", b.reshape(b.shape[0], -1, n_exp),
                        a.reshape(n_exp, -1, a.shape[-1])) * scaling


def test_expert_merge_is_peft_delta_rounded_once_with_w13_interleaved(case):
    """The expert difference, exactly: with d = PEFT's own FP32 expert delta re-laid as the
    checkpoint stores w13 (rows interleaved gate/up: transformers' gate_up_proj is [gate; up]),
    ours is bf16(W + d) (one rounding) and PEFT's merge_and_unload is bf16(W + bf16(d)) (two),
    both bit for bit. (With this test's large random factors, |d| ~ 2|W|, about 30% of the
    elements differ by that one ulp; for a trained adapter's small delta, far fewer.)"""
    base, adapter, peft_dir, ours_dir = case
    b, got, ad = read_tensors(base), read_tensors(ours_dir), load_file(adapter / "adapter_model.safetensors")
    theirs = read_tensors(peft_dir)
    for layer in range(4):
        p = f"{PREFIX}model.language_model.layers.{layer}.mlp.experts."
        for proj, key, scaling in (("w13", "base_layer.", 6 / 4), ("w2", "", 8 / 3)):
            name = f"model.llm.layers.{layer}.mlp.experts.{proj}_weight"
            delta = _peft_expert_delta(ad[p + key + "lora_A.weight"], ad[p + key + "lora_B.weight"], 4, scaling)
            if proj == "w13":  # [gate; up] -> interleaved rows
                delta = torch.stack(delta.chunk(2, dim=1), dim=2).reshape(delta.shape)
            assert bits_equal(got[name], (b[name].float() + delta).to(torch.bfloat16)), name
            assert bits_equal(theirs[name], b[name] + delta.to(torch.bfloat16)), name
            ok = one_ulp_apart(got[name], theirs[name], b[name], delta)
            assert bool(ok.all()), f"{name}: {int((~ok).sum())} element(s) more than one ulp from PEFT's"


def test_text_only_adapter_names(case, tmp_path):
    """An adapter of Inkling2ForCausalLM (`model.layers.N...`) merges the same as the
    multimodal model's (`model.language_model.layers.N...`)."""
    base, adapter, _, ours_dir = case
    t = load_file(adapter / "adapter_model.safetensors")
    d = tmp_path / "text"
    d.mkdir()
    save_file({k.replace("model.model.language_model.", "model.model."): v for k, v in t.items()},
              d / "adapter_model.safetensors")
    (d / "adapter_config.json").write_text((adapter / "adapter_config.json").read_text())
    lora.merge(base, d, tmp_path / "out")
    got, want = read_tensors(tmp_path / "out"), read_tensors(ours_dir)
    assert all(bits_equal(got[k], want[k]) for k in want)


def test_attention_only_merge_is_bit_identical_to_peft(tmp_path):
    base = save_tiny(tmp_path / "base", seed=3)
    pm = peft_model(base, r=8, lora_alpha=4, use_rslora=True, target_modules=["q_proj.linear", "o_proj.linear"])
    pm.save_pretrained(tmp_path / "adapter")
    pm.merge_and_unload().save_pretrained(tmp_path / "peft")
    report = lora.merge(base, tmp_path / "adapter", tmp_path / "ours")
    assert report["by_part"] == {"attention": 8, "expert": 0}
    want, got = read_tensors(tmp_path / "peft"), read_tensors(tmp_path / "ours")
    assert set(got) == set(want) and all(bits_equal(got[k], want[k]) for k in want)


# --------------------------------------------------------------------------- converted checkpoints
@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("conv")
    src = write_checkpoint(tmp / "src", "tiny", layers=6)
    convert(src, tmp / "out", Options(default_activation_amax=4.0, max_shard_bytes=1 << 17), quiet=True)
    return src, tmp / "out"


def _factors(shape, r, gen, stacked=0):
    if stacked:  # PEFT ParamWrapper: lora_A [r*E, in], lora_B [out, r*E]
        _, out_f, in_f = shape
        return (torch.randn(r * stacked, in_f, generator=gen) / math.sqrt(in_f),
                torch.randn(out_f, r * stacked, generator=gen) * 0.02)
    out_f, in_f = shape
    return torch.randn(r, in_f, generator=gen) / math.sqrt(in_f), torch.randn(out_f, r, generator=gen) * 0.02


def adapter_for(src: Path, d: Path, *, attention=True, experts=False, extra=None, **config) -> Path:
    """Factors for every attention projection (and the stacked experts) of `src`'s config."""
    cfg = Inkling2Config.load(src)
    gen = torch.Generator().manual_seed(0)
    mods = {}
    for s in checkpoint_tensors(cfg, include_experts=True):
        hf = transformers_name(s.name) if s.name.startswith("model.llm.layers.") else ""
        if attention and ".attn." in s.name and s.name.endswith(".weight") and ".self_attn." in hf \
                and "sconv" not in hf:
            mods[hf[: -len(".weight")]] = _factors(s.shape, 4, gen)
        if experts and s.name.endswith("w13_weight"):
            mods[hf.rsplit(".", 1)[0] + ".base_layer"] = _factors(s.shape, 4, gen, s.shape[0])
        if experts and s.name.endswith("w2_weight"):
            mods[hf.rsplit(".", 1)[0]] = _factors(s.shape, 4, gen, s.shape[0])
    mods.update(extra or {})
    if experts:
        config.setdefault("target_parameters", EXPERT_PARAMS)
    return write_adapter(d, mods, **config)


def test_merge_into_converted_keeps_quantized_experts(converted, tmp_path):
    src, conv = converted
    d = adapter_for(src, tmp_path / "a")
    report = lora.merge(conv, d, tmp_path / "out")
    assert report["by_part"] == {"attention": 6 * 7, "expert": 0}
    assert 0 < report["rewritten"] < report["rewritten"] + report["linked"]
    before, after, ad = read_tensors(conv), read_tensors(tmp_path / "out"), load_file(d / "adapter_model.safetensors")
    assert set(before) == set(after)
    for name, t in before.items():
        if ".attn." in name and name.endswith(".weight") and "sconv" not in name:
            m = PREFIX + transformers_name(name)[: -len(".weight")]
            a, b = ad[m + ".lora_A.weight"], ad[m + ".lora_B.weight"]
            want = (t.float() + (b @ a) * 2.0).to(torch.bfloat16)
            assert bits_equal(after[name], want) and not bits_equal(after[name], t), name
        else:  # quantized experts, their scales, norms, convs, router, embeddings: untouched
            assert bits_equal(after[name], t), name
    sums = lora.read_checksums(tmp_path / "out" / "checksums.sha256")
    assert set(sums) == set(lora.read_checksums(conv / "checksums.sha256"))


def test_merge_into_source_then_convert_equals_convert_then_merge(converted, tmp_path):
    src, conv = converted
    d = adapter_for(src, tmp_path / "a")
    lora.merge(src, d, tmp_path / "src-merged")
    convert(tmp_path / "src-merged", tmp_path / "a-then-c", Options(default_activation_amax=4.0,
                                                                    max_shard_bytes=1 << 17), quiet=True)
    lora.merge(conv, d, tmp_path / "c-then-a")
    x, y = read_tensors(tmp_path / "a-then-c"), read_tensors(tmp_path / "c-then-a")
    assert set(x) == set(y) and all(bits_equal(x[k], y[k]) for k in x)


def test_expert_adapter_refused_on_converted_merged_on_source(converted, tmp_path):
    src, conv = converted
    d = adapter_for(src, tmp_path / "a", experts=True)
    with pytest.raises(ConfigError, match=r"mlp\.experts.*(NVFP4|MXFP8).*expert adapters need BF16 expert weights"):
        lora.check(conv, d)
    plan = lora.check(src, d)  # the BF16 source takes them
    assert plan.summary()["by_part"] == {"attention": 6 * 7, "expert": 12}


@pytest.mark.parametrize("module, match", [
    ("model.language_model.layers.0.self_attn.k_proj.sconv.weight_proj", r"k_sconv\.weight_proj.*short_conv"),
    ("model.vision_tower.layers.0.self_attn.q_proj", r"vision_tower.*vision"),
    ("lm_head", r"'lm_head'.*lm_head"),
    ("model.language_model.layers.0.mlp.gate", r"mlp\.gate.*router"),
    ("transformer.h.0.attn.c_attn", r"transformer\.h\.0\.attn\.c_attn.*not a module of the Inkling 2 layout"),
])
def test_module_outside_mergeable_set_refused_naming_it(converted, tmp_path, module, match):
    src, _ = converted
    extra = {module: (torch.zeros(4, 8), torch.zeros(8, 4))}
    d = adapter_for(src, tmp_path / "a", extra=extra, target_modules=ATTN_MODULES + [module.rsplit(".", 1)[-1]])
    with pytest.raises(ConfigError, match=match):
        lora.check(src, d)


def test_adapter_for_another_model_refused(converted, tmp_path):
    src, _ = converted
    deep = {"model.language_model.layers.9.self_attn.q_proj.linear": (torch.zeros(4, 8), torch.zeros(8, 4))}
    with pytest.raises(ConfigError, match="layer 9, but config.json has 6 layers"):
        lora.check(src, adapter_for(src, tmp_path / "deep", extra=deep))
    d = adapter_for(src, tmp_path / "part", layers_to_transform=[0, 1, 2, 3, 4, 5])
    t = load_file(d / "adapter_model.safetensors")
    save_file({k: v for k, v in t.items() if ".layers.2." not in k}, d / "adapter_model.safetensors")
    with pytest.raises(ConfigError, match="no weights for"):
        lora.check(src, d)
    other = write_adapter(tmp_path / "none", {"transformer.h.0.attn.c_attn": (torch.zeros(4, 8), torch.zeros(8, 4))},
                          target_modules=["c_attn"])
    with pytest.raises(ConfigError, match="match no attention projection"):
        lora.check(src, other)



def test_attention_merge_into_transformers_names_and_modelopt_form(tmp_path):
    """The same adapter merged into the checkpoint under transformers' names (the in-memory state
    dict) and into convert's ModelOpt form (also transformers' names): the merged attention
    projections are bit-identical to the merge into the original names."""
    base = save_tiny(tmp_path / "base", seed=3)
    pm = peft_model(base, r=8, lora_alpha=4, target_modules=["q_proj.linear", "o_proj.linear"])
    pm.save_pretrained(tmp_path / "adapter")
    model = inkling2.Inkling2ForConditionalGeneration.from_pretrained(base, dtype=torch.bfloat16)
    names = tmp_path / "names"
    names.mkdir()
    for f in base.glob("*.json"):
        (names / f.name).write_bytes(f.read_bytes())
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, names / "model.safetensors")
    convert(str(base), tmp_path / "hf", Options(output_format="modelopt-hf", scheme="nvfp4", default_activation_amax=4.0),
            quiet=True)
    lora.merge(base, tmp_path / "adapter", tmp_path / "ours")
    want = read_tensors(tmp_path / "ours")
    merged = {k for k in want if ".attn.wq_du." in k or ".attn.wo_ud." in k}
    assert merged
    for other in ("names", "hf"):
        report = lora.merge(tmp_path / other, tmp_path / "adapter", tmp_path / f"{other}-merged")
        assert report["by_part"] == {"attention": 8, "expert": 0}
        got = read_tensors(tmp_path / f"{other}-merged")
        assert all(bits_equal(got[transformers_name(k)], want[k]) for k in merged), other
