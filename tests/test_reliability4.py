"""Reliability, round 4 (issue 36): quantized sources copied or cast silently wrong, encoders
mislabelled, and what a new user hit. Each case was an exit 0 whose output our own verify then
failed, or a refusal the rest of the tool does not make; each is now refused by name (exit 2) or
written so that verify passes it. The inputs are tiny (tests/sources_reference.py, the synth,
transformers' own save_pretrained)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import sources_reference as ref
from modelopt_reference import read_tensors
from inkling_quant.cli import main
from inkling_quant.convert import Options, convert
from inkling_quant.errors import CheckpointError, ConfigError, FormatError
from inkling_quant.formats import FORMATS
from inkling_quant.formats.nvfp4 import MIN_AMAX
from inkling_quant.synth import write_checkpoint
from inkling_quant.verify import verify

AMAX = 4.0
LAYERS = 6  # the default scheme: NVFP4 in layers 0-4, MXFP8 in layer 5


def _convert(src: Path, out: Path, **kw) -> dict:
    return convert(str(src), out, Options(**{"default_activation_amax": AMAX, **kw}), quiet=True)


def _passes(out: Path, src: Path) -> None:
    """Our own verify passes the output, alone and against its source, every expert sampled."""
    for kw in ({}, {"against": src, "sample": 0}):
        r = verify(out, **kw)
        assert r.exit_code == 0, (kw, [(c.id, [p.message for p in c.problems[:2]]) for c in r.failures()])


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    root = tmp_path_factory.mktemp("q")
    go = ref.to_mxfp4(ref.gpt_oss(root / "go-bf16"), root / "go")
    ds = ref.to_fp8(ref.deepseek_v3(root / "ds-bf16"), root / "ds")
    qw = ref.to_fp8(ref.qwen3_moe(root / "qw-bf16"), root / "qw", torch.bfloat16)
    return {"go": go, "k3": ref.kimi_k3_release(root / "k3"), "ds": ds, "qw": qw,
            "v4": ref.to_v4_release(ref.deepseek_v4(root / "v4-bf16"), root / "v4")}


# ------------------------------------------------------------------------------ a copied layer's encoder
@pytest.fixture(scope="module")
def inkling(tmp_path_factory):
    root = tmp_path_factory.mktemp("ink")
    src = write_checkpoint(root / "bf16", "tiny", layers=LAYERS, experts=2)
    by_modelopt, by_release = root / "mx-modelopt", root / "mx-release"
    _convert(src, by_modelopt, scheme="mxfp8", encoder="modelopt")
    _convert(src, by_release, scheme="mxfp8")
    return src, by_modelopt, by_release


def _layers(out: Path) -> dict:
    return json.loads((out / "hf_quant_config.json").read_text())


def test_a_copied_layer_carries_the_encoder_that_wrote_it(inkling, tmp_path):
    """An MXFP8 source written by ModelOpt's encoder, converted to the Inkling form (the release's
    encoder): layer 5 is copied byte for byte and its entry names ModelOpt's encoder, the NVFP4
    layers the release's; the converter record lists the copied layer. verify passes it (the
    `encoder` check holds only the release's layers to the fixed point) and --against it."""
    _, by_modelopt, _ = inkling
    out = tmp_path / "o"
    _convert(by_modelopt, out)
    hq = _layers(out)
    entries = hq["quantization"]["quantized_layers"]
    assert entries["model.llm.layers.5.mlp.experts"] == {"quant_algo": "MXFP8", "group_size": 32, "encoder": "modelopt"}
    assert entries["model.llm.layers.0.mlp.experts"]["encoder"] == "nvfp4_nearest"
    assert hq["converter"]["encoder"] == "release"
    assert hq["converter"]["layers"] == {"model.llm.layers.5.mlp.experts": "modelopt"}
    cfg_entries = json.loads((out / "config.json").read_text())["quantization_config"]["quantized_layers"]
    assert cfg_entries == entries
    got, src = read_tensors(out), read_tensors(by_modelopt)
    for k in ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale"):
        name = f"model.llm.layers.5.mlp.experts.{k}"
        assert torch.equal(got[name].view(torch.uint8), src[name].view(torch.uint8)), k
    _passes(out, by_modelopt)
    enc = verify(out).check("encoder")
    assert enc.figures["modelopt_layers"] == [5] and set(enc.figures["encoder"]) == {str(i) for i in range(5)}


def test_a_release_layer_copied_under_modelopts_encoder_says_so(inkling, tmp_path):
    """The other way round: the release's MXFP8 bytes copied into a run of ModelOpt's encoder
    (the ModelOpt form's default, and --encoder modelopt on the Inkling form) are named the
    release's: in the Inkling form's entry, and in hf_quant_config.json's converter record of the
    ModelOpt form (whose entries are ModelOpt's own)."""
    _, _, by_release = inkling
    _convert(by_release, tmp_path / "ink", encoder="modelopt")
    entry = _layers(tmp_path / "ink")["quantization"]["quantized_layers"]["model.llm.layers.5.mlp.experts"]
    assert entry["encoder"] == "mxfp8_nearest" and entry["scales"] == "ue8m0"
    _passes(tmp_path / "ink", by_release)
    _convert(by_release, tmp_path / "hf", output_format="modelopt-hf")
    conv = _layers(tmp_path / "hf")["converter"]
    assert conv["encoder"] == "modelopt" and conv["layers"] == {"model.language_model.layers.5.mlp.experts": "release"}
    _passes(tmp_path / "hf", by_release)
    _convert(by_release, tmp_path / "same")  # the release's own encoder: nothing to record
    assert "layers" not in _layers(tmp_path / "same")["converter"]


def test_an_unknown_encoder_of_a_copied_layer_is_refused_naming_the_file(inkling, tmp_path):
    _, by_modelopt, _ = inkling
    src = tmp_path / "src"
    shutil.copytree(by_modelopt, src)
    hq = _layers(src)
    hq["quantization"]["quantized_layers"]["model.llm.layers.5.mlp.experts"]["encoder"] = "mxfp8_magic"
    (src / "hf_quant_config.json").write_text(json.dumps(hq))
    with pytest.raises(ConfigError, match="mxfp8_magic") as e:
        _convert(src, tmp_path / "o")
    assert str(e.value.path).endswith("hf_quant_config.json") and not (tmp_path / "o").exists()


# ------------------------------------------------------------------------------ weights below NVFP4's smallest amax
def _zero_e8m0(name: str, expert=None):
    def edit(sd):
        s = sd[name]
        (s[expert] if expert is not None else s).view(torch.uint8)[...] = 0
    return edit


MXFP4_ZERO = {  # one expert projection whose e8m0 bytes are all 0: values <= 6 * 2^-127 ~ 3.5e-38
    "go": ("model.layers.0.mlp.experts.down_proj_scales", 1, {}),
    "k3": ("language_model.model.layers.1.block_sparse_moe.experts.2.w2.weight_scale", None, {}),
    "v4": ("layers.1.ffn.experts.2.w2.scale", None, {"scheme": "nvfp4"}),
}


@pytest.mark.parametrize("encoder", ["modelopt", "release"])
@pytest.mark.parametrize("src", sorted(MXFP4_ZERO))
def test_mxfp4_expert_of_zero_scales_is_written_as_zero(quantized, tmp_path, src, encoder):
    """Both encoders write NVFP4's all-zero weight for it (ModelOpt's cast would give a global
    scale of 2^-8 over codes that decode to +-0, the release's refused it) and name it in the
    report; verify expects exactly that encoding of such a weight, and passes the output."""
    name, expert, kw = MXFP4_ZERO[src]
    s = ref.tampered_copy(quantized[src], tmp_path / "s", _zero_e8m0(name, expert))
    report = _convert(s, tmp_path / "o", encoder=encoder, **{"scheme": "nvfp4", **kw})
    assert len(report["flushed_to_zero"]) == 1, report.get("flushed_to_zero")
    _passes(tmp_path / "o", s)
    zero = [n for n in verify(tmp_path / "o", against=s, sample=0).numerics if n.get("written_as_zero")]
    assert zero and all(n["pass"] for n in zero)


def test_a_weight_decoding_nonzero_where_zero_is_due_fails_verify(quantized, tmp_path):
    """verify holds a weight below NVFP4's smallest amax to the all-zero encoding: nonzero codes
    there are a failure naming the tensor (a ModelOpt cast's output, say, whose scale no engine
    can divide by, is refused already by the values check)."""
    name, expert, _ = MXFP4_ZERO["go"]
    s = ref.tampered_copy(quantized["go"], tmp_path / "s", _zero_e8m0(name, expert))
    out = tmp_path / "o"
    _convert(s, out, scheme="nvfp4")
    t = "model.layers.0.mlp.experts.1.down_proj.weight"
    sd = load_file(out / "model-00001-of-00001.safetensors")
    sd[t][0, 0] = 0x22  # two codes of 1.0
    save_file(sd, out / "model-00001-of-00001.safetensors", metadata={"format": "pt"})
    r = verify(out, against=s, sample=0)
    bad = [p for c in r.failures() for p in c.problems if p.tensor == t]
    assert r.exit_code == 1 and any("written as" not in p.message and "all-zero weight" in p.message for p in bad)


def test_a_finite_mxfp4_block_near_fp32s_top(quantized, tmp_path):
    """A block of e8m0 253 x code 3 (2.55e38): ModelOpt's cast encodes it, and verify judges it on
    activations scaled down by a power of two (no fp32 overflow, its relative error as for any
    weight); the release's rule cannot (448 * amax overflows fp32) and refuses it by name."""
    def edit(sd):
        s, b = sd["model.layers.0.mlp.experts.down_proj_scales"], sd["model.layers.0.mlp.experts.down_proj_blocks"]
        s[1, 0, 0], b[1, 0, 0, :] = 253, 0x55
    s = ref.tampered_copy(quantized["go"], tmp_path / "s", edit)
    _convert(s, tmp_path / "mo", scheme="nvfp4")
    _passes(tmp_path / "mo", s)
    worst = max(n["rel_error"] for n in verify(tmp_path / "mo", against=s, sample=0).numerics)
    assert 0 < worst <= FORMATS["nvfp4"].max_rel_error
    with pytest.raises(FormatError, match="release encoder's fp32 range") as e:
        _convert(s, tmp_path / "rel", scheme="nvfp4", encoder="release")
    assert e.value.tensor == "model.layers.0.mlp.experts.down_proj_blocks"
    assert not (tmp_path / "rel" / "model.safetensors.index.json").exists()


@pytest.fixture(scope="module")
def subnormal(tmp_path_factory):
    """The synth with layer 0's expert 1 of fp32 subnormals only (|w| < 1.2e-38, in gate/up and in
    down) and layer 1's expert 0 down all zero."""
    root = tmp_path_factory.mktemp("sub")
    src = write_checkpoint(root / "src", "tiny", layers=LAYERS, experts=2)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    g = torch.Generator().manual_seed(3)
    for name, e, scale in (("model.llm.layers.0.mlp.experts.w13_weight", 1, 1e-39),
                           ("model.llm.layers.0.mlp.experts.w2_weight", 1, 1e-39),
                           ("model.llm.layers.1.mlp.experts.w2_weight", 0, 0.0)):
        f = src / index["weight_map"][name]
        sd = load_file(f)
        t = sd[name]
        t[e] = (torch.randn(t[e].shape, generator=g) * scale).to(t.dtype)
        save_file(sd, f, metadata={"format": "pt"})
    (src / "checksums.sha256").unlink(missing_ok=True)
    assert 0 < float(load_file(src / index["weight_map"]["model.llm.layers.0.mlp.experts.w2_weight"])[
        "model.llm.layers.0.mlp.experts.w2_weight"][1].float().abs().max()) < MIN_AMAX
    return src


@pytest.mark.parametrize("form, encoder", [("inkling", None), ("inkling", "modelopt"), ("modelopt-hf", None),
                                           ("modelopt-hf", "release")])
def test_a_subnormal_bf16_expert_converts_as_zero(subnormal, tmp_path, form, encoder):
    """The default conversion stopped at such an expert ("out of the release encoder's fp32
    range"; ModelOpt's encoder at its global scale); now every form and encoder writes the
    encoder's all-zero weight for it, says so, and verify passes the output. An all-zero expert
    converts as before, not listed."""
    out = tmp_path / "o"
    r = _convert(subnormal, out, output_format=form, encoder=encoder)
    assert len(r["flushed_to_zero"]) == 2 and all("layers.0." in n for n in r["flushed_to_zero"])
    _passes(out, subnormal)


def test_the_report_names_what_was_written_as_zero(subnormal, tmp_path, capsys):
    assert main(["convert", str(subnormal), str(tmp_path / "o"), "--default-activation-amax", "4"]) == 0
    assert "written as zero: 2 weight(s)" in capsys.readouterr().out


# ------------------------------------------------------------------------------ --scheme none copies
@pytest.mark.parametrize("src, tensor, value", [
    ("go", "model.layers.0.mlp.experts.down_proj_scales", 255),
    ("k3", "language_model.model.layers.1.block_sparse_moe.experts.1.w2.weight_scale", 255),
    ("ds", "model.layers.1.self_attn.o_proj.weight_scale_inv", 0.0),
    ("ds", "model.layers.1.self_attn.o_proj.weight_scale_inv", -0.0),
    ("ds", "model.layers.1.self_attn.o_proj.weight_scale_inv", -0.5),
    ("ds", "model.layers.1.self_attn.o_proj.weight_scale_inv", 1e-40),   # no finite fp32 reciprocal
    ("qw", "model.layers.1.self_attn.o_proj.weight_scale_inv", 0.0),     # bf16 scales
    ("qw", "model.layers.1.self_attn.o_proj.weight_scale_inv", -0.0),
    ("qw", "model.layers.1.self_attn.o_proj.weight_scale_inv", -0.5),
    ("qw", "model.layers.1.self_attn.o_proj.weight_scale_inv", 1e-40)])
def test_a_copy_is_held_to_its_source_formats_value_rules(quantized, tmp_path, src, tensor, value):
    """--scheme none copied these with exit 0 and an index, and verify then failed the copy; now
    convert refuses, naming the tensor and its element, and leaves nothing that looks complete."""
    s = ref.tampered_copy(quantized[src], tmp_path / "s", lambda sd: sd[tensor].view(-1).__setitem__(1, value))
    with pytest.raises(FormatError, match="element 1 is") as e:
        _convert(s, tmp_path / "o", scheme="none")
    assert e.value.tensor == tensor and str(e.value.path).endswith("model.safetensors")
    assert not (tmp_path / "o" / "model.safetensors.index.json").exists()


# ------------------------------------------------------------------------------ configs verify and convert read
@pytest.fixture(scope="module")
def v4_form(quantized, tmp_path_factory):
    out = tmp_path_factory.mktemp("v4o") / "o"
    _convert(quantized["v4"], out, scheme="nvfp4")
    return out


@pytest.mark.parametrize("edit, says", [
    (lambda c: c.pop("expert_dtype"), "expert_dtype is None"),
    (lambda c: c.__setitem__("expert_dtype", "fp8"), "expert_dtype is 'fp8'"),
    (lambda c: c["quantization_config"].__setitem__("weight_block_size", [64, 64]), "weight_block_size is [64, 64]"),
    (lambda c: c["quantization_config"].__setitem__("fmt", "e5m2"), "fmt is 'e5m2'"),
    (lambda c: c["quantization_config"].pop("scale_fmt"), "scale_fmt is None")])
def test_verify_fails_a_deepseek_v4_form_its_loader_would_misread(v4_form, tmp_path, edit, says):
    """The fields vLLM's DeepseekV4FP8Config reads: each named by the config check."""
    d = tmp_path / "o"
    shutil.copytree(v4_form, d)
    cfg = json.loads((d / "config.json").read_text())
    edit(cfg)
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "checksums.sha256").unlink(missing_ok=True)
    r = verify(d)
    c = r.check("config")
    assert r.exit_code == 1 and any(says in p.message for p in c.problems), [p.message for p in c.problems]
    assert verify(v4_form).exit_code == 0


@pytest.mark.parametrize("groups, says", [([], "config_groups is []"), ({"g": 5}, "config_groups.g is 5"),
                                          ({"g": {"weights": []}}, "config_groups.g is")])
def test_kimi_k3_config_groups_are_type_checked(quantized, tmp_path, groups, says):
    s = ref.edited_copy(quantized["k3"], tmp_path / "s", "config.json",
                        lambda c: c["text_config"]["quantization_config"].__setitem__("config_groups", groups))
    with pytest.raises(ConfigError, match=says.replace("[", r"\[").replace("]", r"\]")) as e:
        _convert(s, tmp_path / "o", scheme="nvfp4")
    assert str(e.value.path).endswith("config.json") and not (tmp_path / "o").exists()


def test_plan_reads_a_null_moe_layer_freq_as_convert_does(quantized, tmp_path, capsys):
    s = ref.edited_copy(quantized["k3"], tmp_path / "s", "config.json",
                        lambda c: c["text_config"].__setitem__("moe_layer_freq", None))
    assert main(["plan", str(s), "--gpu", "b200", "--tp", "2", "--quiet"]) == 0
    ref_json, null_json = tmp_path / "a.json", tmp_path / "b.json"
    main(["plan", str(quantized["k3"]), "--gpu", "b200", "--tp", "2", "--json", str(ref_json)])
    main(["plan", str(s), "--gpu", "b200", "--tp", "2", "--json", str(null_json)])
    a, b = (json.loads(p.read_text()) for p in (ref_json, null_json))
    assert a["disk"] == b["disk"] and a["per_gpu"]["weights_bytes"] == b["per_gpu"]["weights_bytes"]


# ------------------------------------------------------------------------------ what a new user hit
@pytest.fixture(scope="module")
def transformers_written(tmp_path_factory):
    import inkling2_reference as iref

    root = tmp_path_factory.mktemp("tf")
    src = iref.save_tiny(root / "src", iref.tiny_config(moe_intermediate_size=64))
    out = root / "out"
    _convert(src, out)
    return src, out


def test_plan_describes_the_checkpoint_it_was_given(transformers_written, capsys):
    """A user's own conversion is planned as it is: named as a checkpoint whose experts are stored
    as the default variant stores them, not as the release, and without the recipe's 3.2 GB draft
    it does not hold (inspect: absent)."""
    _, out = transformers_written
    assert main(["plan", str(out), "--gpu", "b200", "--tp", "1"]) == 0
    text = capsys.readouterr().out
    assert f"plan: checkpoint {out} (routed experts as variant 'default' stores them)" in text
    assert "(without the draft)" in text and "holds no DSpark draft" in text and "3.20" not in text
    assert main(["plan", str(out), "--gpu", "b200", "--tp", "1", "--json", "-"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["checkpoint"] == str(out) and d["disk"]["draft_bytes_recipe_figure"] == 0
    assert main(["inspect", str(out)]) == 0 and "DSpark draft: absent" in capsys.readouterr().out


def test_plan_counts_a_checkpoints_own_draft(tmp_path, capsys):
    src = write_checkpoint(tmp_path / "s", "tiny", layers=LAYERS, experts=2)
    assert main(["plan", str(src), "--gpu", "b200", "--tp", "1", "--json", "-"]) == 0
    d = json.loads(capsys.readouterr().out)
    draft = sum(e["bytes"] for e in json.loads(json.dumps(d["disk"]["by_part_format"])) if e["part"] == "draft")
    assert d["disk"]["draft_bytes_in_checkpoint"] == draft > 0 and d["disk"]["draft_bytes_recipe_figure"] == 0
    held = sum(t.numel() * t.element_size() for k, t in read_tensors(src).items() if k.startswith("mtp."))
    assert draft == held


def test_verify_against_peft_s_merge_ignores_the_merge_record(transformers_written, tmp_path):
    """`lora merge` records the adapters it merged under config.json's `lora_merged`; against a
    checkpoint PEFT merged (which has no such key) that is no difference a CI gate should fail."""
    src, _ = transformers_written
    ours = tmp_path / "ours"
    shutil.copytree(src, ours)
    cfg = json.loads((ours / "config.json").read_text())
    cfg["lora_merged"] = [{"adapter": "a", "modules": 3}]
    (ours / "config.json").write_text(json.dumps(cfg))
    r = verify(ours, against=src, write_checksums=True)  # transformers writes no checksums.sha256
    assert r.exit_code == 0 and r.check("source").status == "pass"
    cfg["rms_norm_eps_was_here"] = 1
    (ours / "config.json").write_text(json.dumps(cfg))
    assert verify(ours, against=src, write_checksums=True).check("source").status == "fail"  # another key still does


def test_inspect_groups_the_same_tensors_alike_in_both_output_forms(transformers_written, tmp_path):
    from inkling_quant.inspect_cmd import summarize

    src, out = transformers_written
    hf = tmp_path / "hf"
    _convert(src, hf, output_format="modelopt-hf")
    a, b = summarize(out).to_dict()["parts"], summarize(hf).to_dict()["parts"]
    assert set(a) == set(b)
    for part in a.keys() - {"expert", "lm_head"}:  # lm_head: the release's rows padded, ModelOpt's cut
        assert (a[part]["tensors"], a[part]["params"]) == (b[part]["tensors"], b[part]["params"]), part


def test_draft_commands_say_why_there_is_no_draft(transformers_written, tmp_path):
    src, _ = transformers_written
    for cmd in ("extract", "strip"):
        assert main(["draft", cmd, str(src), str(tmp_path / cmd)]) == 2
    from inkling_quant import draft

    with pytest.raises(CheckpointError, match="never held one") as e:
        draft.extract(src, tmp_path / "x")
    assert "already stripped" not in str(e.value)


def test_the_demo_ends_on_its_verdict(capsys):
    assert main(["demo"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1].startswith("demo: PASS")
    assert any("a finding about the recipe, not a failure" in line for line in lines)
