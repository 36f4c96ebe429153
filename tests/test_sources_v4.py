"""DeepSeek-V4's release layout as a source (docs/convert.md, "Sources we accept"): a tiny
checkpoint under the release's original names (tests/sources_reference.py `to_v4_release`: FP8
Linears with UE8M0 scales, MXFP4 routed experts `<module>.weight` int8 + `<module>.scale` e8m0,
an MTP block), converted into ModelOpt's DeepSeek-V4 form (Model-Optimizer examples/deepseek/
deepseek_v4/quantize_to_nvfp4.py): experts bit for bit ModelOpt's MXFP4 -> NVFP4 cast (and the
format's MXFP8 ModelOpt's of transformers' own dequantization); every FP8 module and its UE8M0
scale kept byte for byte; the config files as that script writes them; other expert formats,
bad scales and a converted checkpoint as source refused by name; verify and inspect read it."""
from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import sources_reference as ref
from modelopt_reference import read_tensors
from inkling_quant import inspect_cmd
from inkling_quant.convert import Options, convert
from inkling_quant.errors import CheckpointError, ConfigError, FormatError, UsageError
from inkling_quant.formats import FORMATS, SOURCE_FORMATS, FP8Block
from inkling_quant.model.layout import detect, model_config
from inkling_quant.verify import verify

AMAX = 2.0
BLOCKS = ("layers.0", "layers.1", "layers.2")  # the MTP block's experts stay as the source stores them


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    root = tmp_path_factory.mktemp("v4")
    return ref.to_v4_release(ref.deepseek_v4(root / "bf16"), root / "release")


def _convert(src: Path, out: Path, **kw) -> dict:
    return convert(str(src), out, Options(**{"default_activation_amax": AMAX, **kw}), quiet=True)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.element_size() == 1 else t


def _experts(src: dict):
    for block in BLOCKS:
        for e in range(4):
            yield block, e, f"{block}.ffn.experts.{e}."


def test_layout_of_the_release_names(v4):
    """No `model.` prefix, `ffn` experts w1/w3/w2, `head.weight`, hash layers' tid2eid a router
    tensor; the MTP block a draft whose experts are stored as the decoder's (MXFP4)."""
    names = list(load_file(v4 / "model.safetensors"))
    cfg = model_config(json.loads((v4 / "config.json").read_text()), "config.json")
    lay = detect(names, cfg)
    assert lay.text_prefix == "" and lay.lm_head == "head.weight" and lay.experts.names == ("w1", "w3", "w2")
    assert lay.expert_layers == (0, 1, 2) and lay.classify("layers.0.ffn.gate.tid2eid").part == "router"
    assert lay.classify("mtp.0.ffn.experts.2.w3.weight").part == "draft" == lay.classify("mtp.0.e_proj.weight").part
    assert lay.source_format("mtp.0.ffn.experts.2.w3.weight") == "mxfp4_rows"
    assert lay.source_format("mtp.0.e_proj.weight") == "fp8_block" == lay.source_format("layers.0.attn.wq_a.weight")
    assert (lay.source.format, lay.source.expert_format, lay.source.scale) == ("fp8_block", "mxfp4_rows", "scale")


def test_bare_layer_names_only_where_the_family_has_them():
    """`layers.N.` with no prefix is DeepSeek-V4's (Family.bare_names); a Qwen3-MoE checkpoint so
    named is refused as before, not converted under names its loader would not map."""
    cfg = model_config({"model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 1, "num_experts": 1,
                        "num_experts_per_tok": 1, "moe_intermediate_size": 32}, "config.json")
    with pytest.raises(CheckpointError, match="no decoder layers found"):
        detect([f"layers.0.mlp.experts.0.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")], cfg)


def test_v4_experts_are_modelopts_cast_and_the_fp8_release_kept(v4, tmp_path):
    """--scheme nvfp4: each expert's w1/w3 (shared k_max) and w2 bit for bit ModelOpt 0.47's
    quantize_mxfp4_to_nvfp4_lossless, block counts per layer as it counts them; every FP8 weight
    and UE8M0 scale, and the whole MTP block, byte for byte under its own name; the config files
    as Model-Optimizer's quantize_to_nvfp4.py (main at a2fbac7) writes them."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from modelopt.torch.export.shard_cast_utils import mxfp4_kmax, quantize_mxfp4_to_nvfp4_lossless
    src = load_file(v4 / "model.safetensors")
    report = _convert(v4, tmp_path / "o", scheme="nvfp4")
    out = read_tensors(tmp_path / "o")
    counts: dict[str, dict[str, int]] = {}
    for block, e, p in _experts(src):
        parts = {w: (src[f"{p}{w}.weight"].view(torch.uint8), src[f"{p}{w}.scale"].view(torch.uint8))
                 for w in ("w1", "w3", "w2")}
        kmax = {w: mxfp4_kmax(s) for w, (_, s) in parts.items()}
        kmax["w1"] = kmax["w3"] = max(kmax["w1"], kmax["w3"])   # cast_mxfp4_to_nvfp4.py `prepass`: w1/w3 share m
        layer = str(BLOCKS.index(block))
        got = counts.setdefault(layer, {"lossless": 0, "rerounded": 0})
        for w, (packed, scales) in parts.items():
            q, sc, s2, nb, nl = quantize_mxfp4_to_nvfp4_lossless(packed, scales, kmax[w], "cpu")
            assert torch.equal(out[f"{p}{w}.weight"], q), (p, w)
            assert torch.equal(_bits(out[f"{p}{w}.weight_scale"]), _bits(sc)), (p, w)
            assert torch.equal(out[f"{p}{w}.weight_scale_2"], s2), (p, w)
            assert float(out[f"{p}{w}.input_scale"]) == float(torch.tensor(AMAX) / (6.0 * 448.0))
            got["lossless"] += nl
            got["rerounded"] += nb - nl
            assert f"{p}{w}.scale" not in out
    assert report["mxfp4_to_nvfp4_blocks"] == counts and counts["0"]["rerounded"] > 0
    for k, v in src.items():
        if not k.startswith("layers.") or ".ffn.experts." not in k:
            assert out[k].dtype == v.dtype and torch.equal(_bits(out[k]), _bits(v)), k
    kept = [k for k, v in src.items() if v.dtype == torch.float8_e4m3fn]
    assert any("attn.wq_a" in k for k in kept) and any("shared_experts" in k for k in kept)
    assert "mtp.0.ffn.experts.3.w2.scale" in out
    layers = {f"{b}.ffn.experts": {"quant_algo": "NVFP4", "group_size": 16} for b in BLOCKS}
    excludes = ["*.attn.*", "*.ffn.shared_experts.*", "head", "mtp.*"]
    hq = json.loads((tmp_path / "o" / "hf_quant_config.json").read_text())
    assert hq == {"producer": {"name": "modelopt", "version": "dsv4-nvfp4-experts"},
                  "quantization": {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None, "group_size": 16,
                                   "quantized_layers": layers, "exclude_modules": excludes}}
    cfg_src = json.loads((v4 / "config.json").read_text())
    cfg_out = json.loads((tmp_path / "o" / "config.json").read_text())
    nvfp4 = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}
    assert cfg_out == {**cfg_src, "quantization_config": {
        **cfg_src["quantization_config"], "moe_quant_algo": "NVFP4", "producer": hq["producer"],
        "quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None, "group_size": 16,
        "config_groups": {"group_0": {"input_activations": nvfp4, "weights": nvfp4, "targets": ["Linear"]}},
        "quantized_layers": layers, "ignore": excludes}}


@pytest.mark.parametrize("kw, says, part", [
    ({}, "would be MXFP8", ".ffn.experts."), ({"scheme": "nvfp4", "weight_only": True}, "W4A16", ".ffn.experts."),
    ({"scheme": "nvfp4", "dequantize_fp8": True}, "keeps its FP8 Linears", ".attn.")])
def test_v4_form_refuses_what_its_loader_would_misread(v4, tmp_path, kw, says, part):
    """vLLM's DeepseekV4FP8Config reads every routed expert by moe_quant_algo ("NVFP4", else
    MXFP4) and every Linear as FP8: the default scheme's MXFP8 layers, weight-only NVFP4 and BF16
    Linears are refused before writing, naming a tensor."""
    with pytest.raises(UsageError, match=says) as e:
        _convert(v4, tmp_path / "o", **kw)
    assert part in e.value.tensor and not (tmp_path / "o").exists()


def test_v4_expert_to_mxfp8_is_modelopts_of_transformers_dequantization(v4):
    """The stored form's MXFP8 (the format's own requantize, as the gpt-oss source converts):
    bit for bit ModelOpt's MXFP8QTensor of transformers' dequantization (Fp8Dequantize)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from modelopt.torch.quantization.qtensor import MXFP8QTensor
    src = load_file(v4 / "model.safetensors")
    for p in ("layers.2.ffn.experts.1.w1", "mtp.0.ffn.experts.3.w2", "layers.0.ffn.experts.1.w1"):
        q, e8 = MXFP8QTensor.quantize(ref.mxfp4_dequantize(src[f"{p}.weight"], src[f"{p}.scale"]))
        got = FORMATS["mxfp8"].requantize({"weight": src[f"{p}.weight"], "weight_scale": src[f"{p}.scale"]},
                                          SOURCE_FORMATS["mxfp4_rows"])
        assert torch.equal(_bits(got["weight"]), _bits(q._quantized_data)), p
        assert torch.equal(got["weight_scale"].reshape(-1), e8.reshape(-1)), p


def test_ue8m0_fp8_dequantizes_as_deepseek_and_transformers_read_it(v4):
    """FP8 weights with UE8M0 tile scales: our dequantization is DeepSeek's weight_dequant (fp32
    value x its tile's scale, partial edge tiles included) and, where the tiles are whole,
    transformers' Fp8Dequantize."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize
    src = load_file(v4 / "model.safetensors")
    whole = 0
    for k in [k for k, v in src.items() if v.dtype == torch.float8_e4m3fn]:
        scale = src[k[: -len("weight")] + "scale"]
        want = ref.fp8_dequantize(src[k], scale)
        assert torch.equal(FP8Block().dequantize({"weight": src[k], "weight_scale_inv": scale}), want), k
        if all(d % ref.TILE == 0 for d in src[k].shape):
            assert torch.equal(Fp8Dequantize(None)._dequantize_one(src[k], scale, torch.float32), want), k
            whole += 1
    assert whole > 0


def _tamper(src: Path, dst: Path, name: str, byte: int) -> Path:
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    sd = load_file(src / "model.safetensors")
    t = sd[name].contiguous().view(torch.uint8).clone()
    t.view(-1)[0] = byte
    sd[name] = t.view(sd[name].dtype)
    save_file(sd, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("tensor, byte, says", [
    ("layers.1.attn.wq_a.scale", 0xFF, "not finite and > 0"),      # NaN
    ("mtp.0.attn.wo_b.scale", 0xFF, "not finite and > 0"),         # in the MTP block (e8m0 has no zero)
    ("layers.0.ffn.experts.2.w2.scale", 0xFF, "255")])
def test_bad_ue8m0_scales_refused_naming_them(v4, tmp_path, tensor, byte, says):
    """An e8m0 byte 255 (NaN) in an FP8 module's scale or an expert's: refused naming that tensor,
    nothing that looks complete written (e8m0 has no zero: its byte 0 is 2^-127, a usable scale)."""
    bad = _tamper(v4, tmp_path / "bad", tensor, byte)
    with pytest.raises(FormatError, match=says) as e:
        _convert(bad, tmp_path / "o", scheme="nvfp4")
    assert e.value.tensor == tensor and not (tmp_path / "o" / "model.safetensors.index.json").exists()


def test_wrong_ue8m0_scale_grid_refused_before_writing(v4, tmp_path):
    name = "layers.2.attn.wo_a.scale"   # [320, 192]: needs [3, 2]
    dst = tmp_path / "grid"
    dst.mkdir()
    (dst / "config.json").write_text((v4 / "config.json").read_text())
    sd = load_file(v4 / "model.safetensors")
    sd[name] = sd[name][:2].contiguous()
    save_file(sd, dst / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"needs F32/BF16/F16/F8_E8M0 \[3, 2\]") as e:
        _convert(dst, tmp_path / "o", scheme="nvfp4")
    assert e.value.tensor == name and not (tmp_path / "o").exists()


def test_a_converted_v4_checkpoint_is_not_read_as_a_source(v4, tmp_path):
    """moe_quant_algo says the experts are converted already: refused as a source, by its key."""
    _convert(v4, tmp_path / "o", scheme="nvfp4")
    with pytest.raises(ConfigError, match="moe_quant_algo"):
        _convert(tmp_path / "o", tmp_path / "again", scheme="nvfp4")


@pytest.fixture(scope="module")
def converted(v4, tmp_path_factory):
    root = tmp_path_factory.mktemp("v4out")
    out = {"nvfp4": root / "nvfp4"}
    _convert(v4, out["nvfp4"], scheme="nvfp4")
    return out


def test_verify_passes_the_v4_form(v4, converted):
    """verify reads ModelOpt's DeepSeek-V4 form: the FP8 modules as stored, each expert projection
    listed; --against the MXFP4/FP8 source its numerics pass, the kept tensors byte-identical."""
    alone, against = verify(converted["nvfp4"]), verify(converted["nvfp4"], against=v4)
    assert alone.exit_code == 0, alone.failures()
    assert against.exit_code == 0, against.failures()
    numerics = [c for c in against.checks if c.id.startswith("numerics")]
    assert numerics and all(c.status == "pass" for c in numerics)


@pytest.mark.parametrize("file, edit, says", [
    ("config.json", lambda d: d["quantization_config"].__setitem__("moe_quant_algo", "MXFP8"), "moe_quant_algo"),
    ("hf_quant_config.json", lambda d: d["quantization"]["quantized_layers"].pop("layers.1.ffn.experts"),
     "layers.1.ffn.experts"),
    ("config.json", lambda d: d["quantization_config"]["ignore"].append("*.ffn.experts*"), "excludes"),
    ("hf_quant_config.json", lambda d: d["quantization"]["exclude_modules"].append("*.ffn.experts*"), "excludes")])
def test_verify_fails_a_wrong_v4_config_naming_it(converted, tmp_path, file, edit, says):
    bad = ref.edited_copy(converted["nvfp4"], tmp_path / "bad", file, edit)
    report = verify(bad)
    assert report.exit_code == 1
    assert any(says in p.message for c in report.checks if c.id == "config" for p in c.problems)


def test_inspect_reads_the_v4_source_and_its_conversion(v4, converted):
    """inspect labels the source's experts mxfp4_rows and its Linears fp8_block, the converted
    experts in the format hf_quant_config.json declares, the index table as passed through."""
    src = inspect_cmd.summarize(v4)
    assert [r["format"] for r in src.expert_layers] == ["mxfp4_rows"]
    assert set(src.parts["attention"]["formats"]) == {"fp8_block", "passthrough"} and not src.unrecognized
    out = inspect_cmd.summarize(converted["nvfp4"])
    assert [r["format"] for r in out.expert_layers] == ["nvfp4"]
    assert not out.unrecognized and not out.mismatched


def test_scheme_none_copies_the_v4_release_and_verify_holds_it_to_the_source(v4, tmp_path):
    """--scheme none: every tensor and the config as they are (UE8M0 scales checked for an e8m0
    255 on the way, not refused for their dtype); verify reads the copy as the source format it
    is stored in."""
    _convert(v4, tmp_path / "o", scheme="none")
    src, out = load_file(v4 / "model.safetensors"), read_tensors(tmp_path / "o")
    assert set(out) == set(src) and all(torch.equal(_bits(out[k]), _bits(v)) for k, v in src.items())
    assert json.loads((tmp_path / "o" / "config.json").read_text()) == json.loads((v4 / "config.json").read_text())
    assert verify(tmp_path / "o", against=v4).exit_code == 0 and verify(tmp_path / "o").exit_code == 0


def test_an_all_zero_w1_shares_modelopts_k_max(v4, tmp_path):
    """ModelOpt takes k_max per projection, 0 for one without a non-zero e8m0 byte, then shares
    the larger (build_w13_kmax_overrides): an expert whose w1 is all zero beside a w3 of small
    values (k_max < 0) gets weight_scale_2 2^-8 for both, as it does, not w3's own."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from modelopt.torch.export.shard_cast_utils import mxfp4_kmax, quantize_mxfp4_to_nvfp4_lossless
    sd = load_file(v4 / "model.safetensors")
    p = "layers.1.ffn.experts.0."
    sd[p + "w1.weight"] = torch.zeros_like(sd[p + "w1.weight"])
    sd[p + "w1.scale"] = torch.zeros_like(sd[p + "w1.scale"].view(torch.uint8)).view(torch.float8_e8m0fnu)
    dst = tmp_path / "zero-w1"
    dst.mkdir()
    (dst / "config.json").write_text((v4 / "config.json").read_text())
    save_file(sd, dst / "model.safetensors", metadata={"format": "pt"})
    _convert(dst, tmp_path / "o", scheme="nvfp4")
    out = read_tensors(tmp_path / "o")
    scales = {w: sd[f"{p}{w}.scale"].view(torch.uint8) for w in ("w1", "w3")}
    assert mxfp4_kmax(scales["w1"]) == 0 > mxfp4_kmax(scales["w3"])   # the case that differs from the slab's own
    shared = max(mxfp4_kmax(s) for s in scales.values())
    for w, s in scales.items():
        q, sc, s2, _, _ = quantize_mxfp4_to_nvfp4_lossless(sd[f"{p}{w}.weight"].view(torch.uint8), s, shared, "cpu")
        assert torch.equal(out[f"{p}{w}.weight"], q) and torch.equal(_bits(out[f"{p}{w}.weight_scale"]), _bits(sc)), w
        assert torch.equal(out[f"{p}{w}.weight_scale_2"], s2) and float(s2) == 2.0 ** -8, w


def _variant(src: Path, dst: Path, edit_tensors=None, edit_config=None) -> Path:
    dst.mkdir()
    sd, cfg = load_file(src / "model.safetensors"), json.loads((src / "config.json").read_text())
    if edit_tensors:
        edit_tensors(sd)
    if edit_config:
        edit_config(cfg)
    save_file(sd, dst / "model.safetensors", metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_the_v4_form_only_from_the_mxfp4_release(v4, tmp_path):
    """vLLM reads moe_quant_algo (and UE8M0 Linear scales) only with expert_dtype "fp4": a V4
    checkpoint of FP8 experts (Flash-Base's storage) converts to nothing that loader reads right,
    so it is refused before writing; --scheme none still copies it."""
    def fp8_experts(sd):
        for k in [k for k in sd if ".ffn.experts." in k and k.endswith(".weight")]:
            w = ref.mxfp4_dequantize(sd[k], sd.pop(k[: -len("weight")] + "scale"))
            sd[k], sd[k[: -len("weight")] + "scale"] = ref.per_block_cast_to_fp8(w)
    base = _variant(v4, tmp_path / "base", fp8_experts, lambda c: c.__setitem__("expert_dtype", "fp8"))
    with pytest.raises(UsageError, match="stores its routed experts fp8_block") as e:
        _convert(base, tmp_path / "o", scheme="nvfp4")
    assert "expert_dtype 'fp4'" in str(e.value) and not (tmp_path / "o").exists()
    _convert(base, tmp_path / "copy", scheme="none")


def test_integer_tensors_pass_through_in_routers_only(v4, tmp_path):
    """A router's lookup table (tid2eid) passes through; an integer tensor anywhere else is a
    quantized weight's (GPTQ's g_idx) and is refused, naming it."""
    bad = _variant(v4, tmp_path / "gidx", lambda sd: sd.__setitem__("layers.0.attn.wq_b.g_idx",
                                                                    torch.zeros(192, dtype=torch.int32)))
    with pytest.raises(CheckpointError) as e:
        _convert(bad, tmp_path / "o", scheme="nvfp4")
    assert e.value.tensor == "layers.0.attn.wq_b.g_idx"


def test_verify_finds_a_nan_ue8m0_scale_in_the_output(converted, tmp_path):
    """An e8m0 255 in a kept FP8 Linear's `scale`: values[F] fails naming it (checksums removed,
    so only the values can tell)."""
    bad = tmp_path / "bad"
    shutil.copytree(converted["nvfp4"], bad)
    (bad / "checksums.sha256").unlink()
    shard = next(bad.glob("model-*.safetensors"))
    sd = load_file(shard)
    sd["layers.1.attn.wq_a.scale"] = _tamper_first(sd["layers.1.attn.wq_a.scale"])
    save_file(sd, shard, metadata={"format": "pt"})
    report = verify(bad)
    assert report.exit_code == 1
    assert any(p.tensor == "layers.1.attn.wq_a.scale" for c in report.checks if c.id.startswith("values")
               for p in c.problems)


def _tamper_first(t: torch.Tensor) -> torch.Tensor:
    b = t.contiguous().view(torch.uint8).clone()
    b.view(-1)[0] = 0xFF
    return b.view(t.dtype)


def test_activation_scales_naming_the_kept_mtp_experts_are_skipped(v4, tmp_path):
    """A calibration file (ModelOpt's dumps hold them) naming the MTP block's experts, which the
    form keeps as stored: those entries are skipped, the decoder's taken; a name of no module at
    all is still refused."""
    amax = {f"{b}.ffn.experts.{e}.{w}": 3.0 for b in (*BLOCKS, "mtp.0") for e in range(4) for w in ("w1", "w2", "w3")}
    (tmp_path / "amax.json").write_text(json.dumps(amax))
    _convert(v4, tmp_path / "o", scheme="nvfp4", activation_scales=str(tmp_path / "amax.json"),
             default_activation_amax=None)
    out = read_tensors(tmp_path / "o")
    assert float(out["layers.2.ffn.experts.3.w2.input_scale"]) == float(torch.tensor(3.0) / (6.0 * 448.0))
    (tmp_path / "bad.json").write_text(json.dumps({**amax, "layers.9.ffn.experts.0.w1": 3.0}))
    with pytest.raises(CheckpointError, match="match no module"):
        _convert(v4, tmp_path / "o2", scheme="nvfp4", activation_scales=str(tmp_path / "bad.json"),
                 default_activation_amax=None)
