"""The Inkling stacked expert form (inkling_quant/export/inkling.py) against independent readers:
plain torch (round trip, interleave), transformers' own `inkling2_loop` dequantization (its ops
called directly, and a tiny Inkling2Loop checkpoint loaded end to end), vLLM's input-amax
expression, and experts quantized and exported by NVIDIA ModelOpt itself.

One thing is not bit-exact, by the readers' design: transformers dequantizes NVFP4 as
`(e2m1 * scale) * (amax / den)`, ModelOpt (and our `dequantize`) as `e2m1 * (scale * s2)`.
e2m1 x e4m3 is exact in fp32, so transformers' value is the correctly rounded exact product
(`exact_nvfp4` below, computed in fp64); ModelOpt's rounds twice and is off by one ulp for some
codes +-1.5/3/6 (never for 0, 0.5, 1, 2, 4). The tests hold each reader to its own order bit for
bit and bound the difference between them.
"""
from __future__ import annotations

import types

import pytest
import torch

from inkling_quant.errors import FormatError
from inkling_quant.export.inkling import (OUTER_SCALE_DENOMINATOR, expert_slices, stack_experts, stacked_specs,
                                          unstack_experts, write_expert)
from inkling_quant.formats import FORMATS, detect

BF = torch.bfloat16
MODS = ("gate_proj", "up_proj", "down_proj")
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def per_expert(fmt, E, I, H, seed=0, input_amax=True):
    """Per-expert tensors as our formats write them (gate/up share the global scale)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for e in range(E):
        gate, up = (torch.randn(I, H, generator=g) * (1 + e)).to(BF), (torch.randn(I, H, generator=g) * 3).to(BF)
        down = torch.randn(H, I, generator=g).to(BF)
        ga = fmt.fused_global_amax([gate, up])
        ia = (2.5 + e, 0.75 * (e + 1)) if input_amax else (None, None)
        out.append({"gate_proj": fmt.quantize(gate, global_amax=ga, input_amax=ia[0]),
                    "up_proj": fmt.quantize(up, global_amax=ga, input_amax=ia[0]),
                    "down_proj": fmt.quantize(down, input_amax=ia[1])})
    return out


def exact_nvfp4(t) -> torch.Tensor:
    """e2m1 x weight_scale x weight_scale_2 computed exactly (fp64), rounded once to fp32."""
    w = t["weight"]
    codes = torch.stack((w & 0xF, w >> 4), dim=-1).reshape(*w.shape[:-1], -1).long()
    vals = torch.tensor(E2M1, dtype=torch.float64)[codes]
    sc = t["weight_scale"].to(torch.float64).repeat_interleave(16, dim=-1)
    return (vals * sc * torch.as_tensor(t["weight_scale_2"]).double()).float()


def exact_mxfp8(t) -> torch.Tensor:
    e = t["weight_scale"].to(torch.float64).repeat_interleave(32, dim=-1)
    return (t["weight"].double() * torch.exp2(e - 127)).float()


def exact(t) -> torch.Tensor:
    return exact_nvfp4(t) if t["weight"].dtype == torch.uint8 else exact_mxfp8(t)


def assert_one_ulp_on_odd_codes(ref_order: torch.Tensor, tf: torch.Tensor, packed: torch.Tensor):
    """ModelOpt-order vs transformers-order NVFP4 values: equal on power-of-two codes, <= 1 ulp
    apart on 1.5 x 2^k codes. (+ 0.0 makes -0.0 +0.0: ModelOpt's table maps code 8 to +0.)"""
    ref_order, tf = ref_order + 0.0, tf + 0.0
    codes = torch.stack((packed & 7, (packed >> 4) & 7), dim=-1).reshape(tf.shape)
    diff = (ref_order.view(torch.int32).long() - tf.view(torch.int32).long()).abs()
    odd = (codes == 3) | (codes == 5) | (codes == 7)
    assert int(diff[~odd].max()) == 0
    assert int(diff.max()) <= 1


# ------------------------------------------------------------------------------ round trip
CASES = [("nvfp4", 3, 48, 80, True), ("nvfp4", 5, 112, 48, False), ("mxfp8", 3, 96, 160, True),
         ("passthrough", 2, 24, 40, True)]


@pytest.mark.parametrize("name,E,I,H,act", CASES)
def test_round_trip_is_bit_identical(name, E, I, H, act):
    fmt = FORMATS[name]
    experts = per_expert(fmt, E, I, H, input_amax=act)
    stacked = stack_experts(fmt, experts)
    specs = stacked_specs(fmt, E, I, H, activation_scale=act)
    assert {k: (tuple(v.shape), v.dtype) for k, v in stacked.items()} == \
        {k: (s.shape, s.dtype) for k, s in specs.items()}
    # streaming: one expert at a time into preallocated tensors gives the same bytes
    streamed = {k: torch.zeros(s.shape, dtype=s.dtype) for k, s in specs.items()}
    for e in reversed(range(E)):
        write_expert(streamed, e, expert_slices(fmt, experts[e]))
    assert all(torch.equal(bits(streamed[k]), bits(stacked[k])) for k in specs)
    # the interleave, by plain indexing
    for suffix in ("weight", "weight_scale") if name != "passthrough" else ("weight",):
        w13 = stacked[f"w13_{suffix}"]
        for e in range(E):
            assert torch.equal(bits(w13[e, 0::2]), bits(experts[e]["gate_proj"][suffix]))
            assert torch.equal(bits(w13[e, 1::2]), bits(experts[e]["up_proj"][suffix]))
            assert torch.equal(bits(stacked[f"w2_{suffix}"][e]), bits(experts[e]["down_proj"][suffix]))
    back = unstack_experts(fmt, stacked)
    for e in range(E):
        assert back[e].keys() == experts[e].keys()
        for m in MODS:
            assert back[e][m].keys() == experts[e][m].keys()
            for s, v in experts[e][m].items():
                assert back[e][m][s].shape == v.shape and back[e][m][s].dtype == v.dtype, (m, s)
                assert torch.equal(bits(back[e][m][s]), bits(v)), (e, m, s)


def _scalar_experts(s2: torch.Tensor, input_scale: torch.Tensor | None = None):
    """Minimal NVFP4 experts carrying the given global (and input) scales."""
    out = []
    for i in range(s2.numel()):
        t = {"weight": torch.zeros(2, 8, dtype=torch.uint8), "weight_scale": torch.ones(2, 1).to(torch.float8_e4m3fn),
             "weight_scale_2": s2[i].clone()}
        if input_scale is not None:
            t["input_scale"] = input_scale[i].clone()
        out.append({"gate_proj": t, "up_proj": dict(t), "down_proj": {**t, "weight": torch.zeros(2, 1, dtype=torch.uint8)}})
    return out


def test_global_scale_is_amax_over_denominator_bit_for_bit():
    """transformers' factor `amax.float() / denominator.float()` equals weight_scale_2 exactly,
    with the one per-tensor denominator 2688, for every scale an fp32 amax / 2688 gives (what
    ModelOpt writes); a scale no fp32 amax gives (a random fp32 has none ~10% of the time) is
    refused by name, never stored approximately."""
    g = torch.Generator().manual_seed(3)
    amaxes = torch.exp2(torch.rand(600, generator=g) * 60 - 30) * (1 + torch.rand(600, generator=g))
    from_amax = amaxes.float() / torch.tensor(2688.0)                      # ModelOpt's weight_scale_2
    st = stack_experts(FORMATS["nvfp4"], _scalar_experts(from_amax, input_scale=from_amax))
    for p in ("w13", "w2"):
        amax, den = st[f"{p}_weight_amax"], st[f"{p}_weight_outer_scale_denominator"]
        assert den.shape == () and float(den) == OUTER_SCALE_DENOMINATOR
        assert torch.equal((amax.float() / den.float()).view(torch.int32), from_amax.view(torch.int32))
        # vLLM's reading: input_scale.fill_(float(amax.max()) / (finfo(e4m3).max * 6.0)), per expert
        ia = st[f"{p}_weight.input_amax"]
        vllm = torch.tensor([float(a) / (torch.finfo(torch.float8_e4m3fn).max * 6.0) for a in ia], dtype=torch.float32)
        assert torch.equal(vllm.view(torch.int32), from_amax.view(torch.int32))
    arbitrary = (torch.exp2(torch.rand(200, generator=g) * 60 - 40) * (1 + torch.rand(200, generator=g))).float()
    refused = 0
    for s2 in arbitrary:
        try:
            one = stack_experts(FORMATS["nvfp4"], _scalar_experts(s2.reshape(1)))
        except FormatError as e:
            assert "weight_scale_2" in str(e) and "denominator" in str(e)
            refused += 1
            continue
        assert torch.equal((one["w13_weight_amax"] / one["w13_weight_outer_scale_denominator"]).view(torch.int32),
                           s2.reshape(1).view(torch.int32))
    assert 0 < refused < len(arbitrary)


def test_stored_amaxes_are_the_true_amaxes():
    """Where several fp32 amaxes give the scale, the stored one is the shortest: for BF16 weights
    and BF16-exact activation amaxes that is the amax itself (not only an equivalent one)."""
    fmt, E, I, H = FORMATS["nvfp4"], 4, 32, 64
    g = torch.Generator().manual_seed(5)
    ws = [[(torch.randn(*shape, generator=g) * 10 ** (e - 2)).to(BF) for shape in ((I, H), (I, H), (H, I))]
          for e in range(E)]
    in_amax = [(0.125 * 3 ** e, 7.0 * 2.0 ** -e) for e in range(E)]  # BF16-exact
    experts = []
    for (gate, up, down), (a13, a2) in zip(ws, in_amax):
        ga = fmt.fused_global_amax([gate, up])
        experts.append({"gate_proj": fmt.quantize(gate, global_amax=ga, input_amax=a13),
                        "up_proj": fmt.quantize(up, global_amax=ga, input_amax=a13),
                        "down_proj": fmt.quantize(down, input_amax=a2)})
    st = stack_experts(fmt, experts)
    want13 = torch.stack([torch.maximum(gate.abs().max(), up.abs().max()).float() for gate, up, _ in ws])
    assert torch.equal(st["w13_weight_amax"], want13)
    assert torch.equal(st["w2_weight_amax"], torch.stack([d.abs().max().float() for _, _, d in ws]))
    assert torch.equal(st["w13_weight.input_amax"], torch.tensor([a for a, _ in in_amax], dtype=torch.float32))
    assert torch.equal(st["w2_weight.input_amax"], torch.tensor([a for _, a in in_amax], dtype=torch.float32))


def test_refuses_what_the_stacked_form_cannot_hold():
    s2 = torch.tensor([1e-4])
    experts = _scalar_experts(s2)
    experts[0]["up_proj"]["weight_scale_2"] = torch.tensor(2e-4)
    with pytest.raises(FormatError, match="different weight_scale_2"):
        expert_slices(FORMATS["nvfp4"], experts[0])
    # an input scale no fp32 amax / 2688 gives: vLLM would read another value
    bad = next(s for s in (torch.rand(200, generator=torch.Generator().manual_seed(1)) * 1e-3)
               if torch.tensor(float(s) * 2688.0).float() / 2688.0 != s and
               all(torch.nextafter(torch.tensor(float(s) * 2688.0), torch.tensor(d)) / 2688.0 != s
                   for d in (0.0, 1e9)))
    with pytest.raises(FormatError, match="input_amax cannot hold it"):
        expert_slices(FORMATS["nvfp4"], _scalar_experts(s2, input_scale=bad.reshape(1))[0])
    specs = stacked_specs(FORMATS["mxfp8"], 2, 32, 64)
    with pytest.raises(FormatError, match="does not fit"):
        write_expert({k: torch.zeros(s.shape, dtype=torch.float32) for k, s in specs.items()}, 0,
                     expert_slices(FORMATS["mxfp8"], per_expert(FORMATS["mxfp8"], 1, 32, 64)[0]))


# ------------------------------------------------------------------------------ transformers as the reader
W13_SOURCES = [r"mlp\.experts\.w13_weight", r"mlp\.experts\.w13_weight_scale", r"mlp\.experts\.w13_weight_amax",
               r"mlp\.experts\.w13_weight_outer_scale_denominator"]


def transformers_dequant(stacked: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up_proj, down_proj) in fp32 as transformers' inkling2_loop conversion computes them:
    `Inkling2LoopDequantizeExperts` then `Interleave(dim=1)` for w13 (conversion_mapping.py:2748-2768)."""
    from transformers.core_model_loading import Inkling2LoopDequantizeExperts, Interleave

    fp32_model = types.SimpleNamespace(get_parameter=lambda name: torch.empty(0))  # the param dtype it casts to
    out = []
    for p in ("w13", "w2"):
        src = [s.replace("w13", p) for s in W13_SOURCES]
        names = [f"{p}_weight", f"{p}_weight_scale", f"{p}_weight_amax", f"{p}_weight_outer_scale_denominator"]
        inputs = {s: [stacked[n]] for s, n in zip(src, names) if n in stacked}
        target = "gate_up_proj" if p == "w13" else "down_proj"
        t = Inkling2LoopDequantizeExperts().convert(inputs, src, [target], model=fp32_model,
                                                    full_layer_name=target)[target]
        if p == "w13":
            t = Interleave(dim=1).convert({src[0]: t}, src, [target])[target]
        out.append(t)
    return out[0], out[1]


def expected_from_experts(experts, value) -> tuple[torch.Tensor, torch.Tensor]:
    gate_up = torch.stack([torch.cat([value(x["gate_proj"]), value(x["up_proj"])]) for x in experts])
    return gate_up, torch.stack([value(x["down_proj"]) for x in experts])


@pytest.mark.parametrize("name,E,I,H", [("nvfp4", 3, 48, 80), ("mxfp8", 3, 96, 160)])
def test_transformers_ops_read_our_stacked_layer(name, E, I, H):
    fmt = FORMATS[name]
    experts = per_expert(fmt, E, I, H)
    got = transformers_dequant(stack_experts(fmt, experts))
    want_exact = expected_from_experts(experts, exact)
    ours = expected_from_experts(experts, lambda t: fmt.dequantize(t, torch.float32))
    for g, w, o, mods in zip(got, want_exact, ours, (("gate_proj", "up_proj"), ("down_proj",))):
        assert g.dtype == torch.float32 and g.shape == w.shape
        assert torch.equal(bits(g), bits(w))
        if name == "mxfp8":
            assert torch.equal(bits(g), bits(o))   # one multiplication by 2^k: the same in any order
        else:
            packed = torch.stack([torch.cat([x[m]["weight"] for m in mods]) for x in experts])
            assert_one_ulp_on_odd_codes(o, g, packed)


def _loop_checkpoint(tmp, layers_fmt):
    """A tiny Inkling2Loop saved by transformers in BF16, its experts replaced by our stacked
    tensors (layer -> format name). Returns (dir, {layer: per-expert tensors})."""
    from safetensors.torch import load_file, save_file
    from transformers.models.inkling2_loop import Inkling2LoopConfig, Inkling2LoopForConditionalGeneration

    from inkling2_reference import tiny_config

    base = tiny_config(moe_intermediate_size=64)
    text = {k: v for k, v in base.text_config.to_dict().items() if k not in ("model_type", "architectures")}
    text.update(loop_layer_index_start=2, loop_layer_index_end=4, loop_num_passes=2, loop_gate_rank=8)
    vision = {k: v for k, v in base.vision_config.to_dict().items() if k != "architectures"}
    cfg = Inkling2LoopConfig(text_config=text, vision_config=vision, image_token_id=base.image_token_id)
    torch.manual_seed(0)
    Inkling2LoopForConditionalGeneration._from_config(cfg, dtype=BF).save_pretrained(tmp)
    sd = load_file(tmp / "model.safetensors")
    E, I, H = text["n_routed_experts"], text["moe_intermediate_size"], text["hidden_size"]
    per = {}
    for layer, name in layers_fmt.items():
        prefix = f"model.llm.layers.{layer}.mlp.experts."
        assert sd.pop(prefix + "w13_weight").shape == (E, 2 * I, H) and prefix + "w2_weight" in sd
        del sd[prefix + "w2_weight"]
        per[layer] = per_expert(FORMATS[name], E, I, H, seed=layer)
        sd.update({prefix + k: v for k, v in stack_experts(FORMATS[name], per[layer]).items()})
    save_file(sd, tmp / "model.safetensors", metadata={"format": "pt"})
    return tmp, cfg, per


def test_transformers_loads_a_stacked_inkling2_loop_checkpoint(tmp_path):
    """End to end: our names are the ones transformers' inkling2_loop mapping reads. The
    `.input_amax` tensors are the only unexpected keys (transformers renames them on the way,
    `w13_weight.input_amax` -> `gate_up_proj.input_amax`, then drops them); nothing is missing."""
    from transformers.models.inkling2_loop import Inkling2LoopForConditionalGeneration

    layers = {0: "nvfp4", 1: "nvfp4", 2: "nvfp4", 3: "mxfp8"}
    path, cfg, per = _loop_checkpoint(tmp_path / "loop", layers)
    model, info = Inkling2LoopForConditionalGeneration.from_pretrained(path, dtype=torch.float32,
                                                                       output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    assert sorted(info["unexpected_keys"]) == sorted(
        f"model.language_model.layers.{i}.mlp.experts.{p}.input_amax" for i in range(3) for p in ("gate_up_proj", "down_proj"))
    for layer, experts in per.items():
        ex = model.model.language_model.layers[layer].mlp.experts
        gate_up, down = expected_from_experts(experts, exact)
        assert torch.equal(bits(ex.gate_up_proj.data), bits(gate_up)), layer
        assert torch.equal(bits(ex.down_proj.data), bits(down)), layer


# ------------------------------------------------------------------------------ ModelOpt as the reference
@pytest.fixture(scope="module")
def modelopt_export(tmp_path_factory):
    pytest.importorskip("modelopt.torch.quantization")
    from modelopt_reference import export_tiny, read_tensors, tiny_modelopt_config

    out = export_tiny(tmp_path_factory.mktemp("modelopt") / "tiny")
    return tiny_modelopt_config().text_config, read_tensors(out)


def test_modelopt_experts_stacked_read_back_by_transformers(modelopt_export):
    """ModelOpt's exported per-expert tensors, stacked by us and dequantized by transformers'
    ops, are ModelOpt's own values; our formats' dequantize of ModelOpt's bytes is ModelOpt's
    dequantize bit for bit; and the stacked form round-trips ModelOpt's bytes."""
    from modelopt_reference import layer_experts, modelopt_dequantize

    text, sd = modelopt_export
    E, I, H = text.n_routed_experts, text.moe_intermediate_size, text.hidden_size
    seen = set()
    for layer in range(text.num_hidden_layers):
        experts = layer_experts(sd, layer)
        assert len(experts) == E
        shapes = {"gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)}
        fmts = {detect({s: (v.shape, v.dtype) for s, v in x[m].items()}, shapes[m], BF) for x in experts for m in MODS}
        assert len(fmts) == 1 and None not in fmts, (layer, fmts)
        fmt = fmts.pop()
        seen.add(fmt.name)
        for x in experts:  # value rules: positive finite scales, e8m0 bytes not NaN (0xFF)
            for m in MODS:
                for s, v in x[m].items():
                    rule = fmt.value_rule(s)
                    if rule == "positive":
                        assert torch.isfinite(v.float()).all() and (v.float() > 0).all(), (layer, m, s)
                    elif rule == "e8m0":
                        assert (v != 255).all()
                mo = modelopt_dequantize(x[m])
                # equal values; not bits: ModelOpt's e2m1 table has +0.0 for code 8 (-0), ours -0.0
                assert torch.equal(fmt.dequantize(x[m], torch.float32), mo), (layer, m)
        stacked = stack_experts(fmt, experts)
        assert {k: (tuple(v.shape), v.dtype) for k, v in stacked.items()} == \
            {k: (s.shape, s.dtype) for k, s in stacked_specs(fmt, E, I, H).items()}
        got = transformers_dequant(stacked)
        mo_vals = expected_from_experts(experts, modelopt_dequantize)
        for g, w, mo, mods in zip(got, expected_from_experts(experts, exact), mo_vals,
                                  (("gate_proj", "up_proj"), ("down_proj",))):
            assert torch.equal(bits(g), bits(w)), layer
            if fmt.name == "mxfp8":
                assert torch.equal(g, mo), layer
            else:
                packed = torch.stack([torch.cat([x[m]["weight"] for m in mods]) for x in experts])
                assert_one_ulp_on_odd_codes(mo, g, packed)
                p = "w13" if "gate_proj" in mods else "w2"
                # ModelOpt's weight_scale_2 is an fp32 amax / 2688: a true amax is stored, never the fallback
                assert (stacked[f"{p}_weight_outer_scale_denominator"] == OUTER_SCALE_DENOMINATOR).all()
                vllm = float(stacked[f"{p}_weight.input_amax"].max()) / (torch.finfo(torch.float8_e4m3fn).max * 6.0)
                assert torch.equal(torch.tensor(vllm, dtype=torch.float32), experts[0][mods[0]]["input_scale"])
        back = unstack_experts(fmt, stacked)
        assert all(torch.equal(bits(back[e][m][s]), bits(v)) for e, x in enumerate(experts)
                   for m in MODS for s, v in x[m].items())
    assert seen == {"nvfp4", "mxfp8"}


@pytest.mark.parametrize("fmt_name, input_amax", [("nvfp4", 3.5), ("nvfp4", None), ("mxfp8", None),
                                                  ("passthrough", None)])
def test_quantizing_the_interleaved_slab_equals_quantizing_gate_and_up_apart(fmt_name, input_amax):
    """What the converter does (quantize expert e's w13 slab as stored, rows interleaved, under
    the slab's amax) gives bit for bit the slices of quantizing gate and up apart under their
    fused amax and interleaving the results (expert_slices); likewise w2."""
    from inkling_quant.export.inkling import slab_slices

    fmt = FORMATS[fmt_name]
    g = torch.Generator().manual_seed(7)
    I, H = 64, 96  # both multiples of 32: MXFP8's block along each input dimension
    gate, up, down = (torch.randn(I, H, generator=g) * 2).to(BF), torch.randn(I, H, generator=g).to(BF), \
        torch.randn(H, I, generator=g).to(BF)
    ga = fmt.fused_global_amax([gate, up])
    apart = expert_slices(fmt, {"gate_proj": fmt.quantize(gate, global_amax=ga, input_amax=input_amax),
                                "up_proj": fmt.quantize(up, global_amax=ga, input_amax=input_amax),
                                "down_proj": fmt.quantize(down, input_amax=input_amax)})
    slab = torch.empty(2 * I, H, dtype=BF)
    slab[0::2], slab[1::2] = gate, up
    together = {**slab_slices(fmt, "w13", fmt.quantize(slab, global_amax=fmt.fused_global_amax([slab]),
                                                       input_amax=input_amax)),
                **slab_slices(fmt, "w2", fmt.quantize(down, input_amax=input_amax))}
    assert set(together) == set(apart)
    for k in apart:
        assert apart[k].dtype == together[k].dtype and torch.equal(bits(apart[k]), bits(together[k])), k
