"""convert on Hugging Face MoE checkpoints written by transformers' own save_pretrained, against
NVIDIA ModelOpt's own quantize + export of the same model (tests/hf_moe_reference.py): with
ModelOpt's activation scales, our output holds exactly ModelOpt's tensor names, every tensor
bit-identical, and the same config.json and hf_quant_config.json. Families: per-expert experts
(Qwen3-MoE with a dense first layer, Mixtral's w1/w3/w2, DeepSeek-V3 with shared experts) and
stacked ones (Qwen3-VL-MoE: nested text_config, a vision tower), the latter also as the Hub stores
them ([E, in, out])."""
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from hf_moe_reference import FAMILIES, export
from modelopt_reference import read_tensors
from inkling_quant.cli import main
from inkling_quant.convert import Options, convert
from inkling_quant.errors import CheckpointError, UsageError


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """family -> (BF16 source by save_pretrained, ModelOpt's export of it)."""
    base = tmp_path_factory.mktemp("hf")
    return {f: (base / f"{f}-bf16", export(f, base / f"{f}-modelopt", base / f"{f}-bf16")) for f in FAMILIES}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                     b.reshape(-1).view(torch.uint8))


def _assert_equals_modelopt(ours: Path, modelopt: Path) -> None:
    a, b = read_tensors(modelopt), read_tensors(ours)
    assert set(a) == set(b), (sorted(set(a) - set(b))[:5], sorted(set(b) - set(a))[:5])
    differ = sorted(k for k in a if not _same_bits(a[k], b[k]))
    assert not differ, differ[:5]
    for name in ("config.json", "hf_quant_config.json"):  # key order included: dumped as parsed
        assert json.dumps(json.loads((ours / name).read_text())) == \
            json.dumps(json.loads((modelopt / name).read_text())), name


@pytest.mark.parametrize("family", FAMILIES)
def test_default_scheme_equals_modelopt_export(exported, tmp_path, family):
    src, modelopt = exported[family]
    out = tmp_path / "out"
    report = convert(str(src), out, Options(scheme="default", activation_scales=str(modelopt)), quiet=True)
    _assert_equals_modelopt(out, modelopt)
    q = json.loads((out / "hf_quant_config.json").read_text())["quantization"]["quantized_layers"]
    assert [e["quant_algo"] for e in q.values()][-1] == "MXFP8" and "NVFP4" in {e["quant_algo"] for e in q.values()}
    assert report["activation_scales"]["calibrated"] > 0 and report["activation_scales"]["default"] == 0


@pytest.mark.parametrize("family,scheme", [(f, "nvfp4") for f in FAMILIES] + [
    ("deepseek_v3", "mxfp8"), ("mixtral", "w4a16_nvfp4"), ("qwen3_moe_tied", "nvfp4")])
def test_one_format_equals_modelopt_export(tmp_path, family, scheme):
    """Every routed expert one format: ModelOpt writes its one-format configs (no quantized_layers;
    the unquantized modules summarized as prefix wildcards, `ignore` in config.json; config_groups
    targeting Linear for NVFP4 and W4A16_NVFP4, none for MXFP8; a tied lm_head listed all the
    same) and ours equals them, tensors and both files."""
    src = tmp_path / "src"
    weight_only = scheme == "w4a16_nvfp4"
    modelopt = export(family, tmp_path / "modelopt", src, mxfp8="all" if scheme == "mxfp8" else "none",
                      weight_only=weight_only)
    hq = json.loads((modelopt / "hf_quant_config.json").read_text())["quantization"]
    assert hq["quant_algo"] == scheme.upper() and "quantized_layers" not in hq and "lm_head" in hq["exclude_modules"]
    out = tmp_path / "out"
    scales = {"activation_scales": str(modelopt)} if scheme == "nvfp4" else {}  # W4A16 and MXFP8 have none
    convert(str(src), out, Options(scheme="mxfp8" if scheme == "mxfp8" else "nvfp4", weight_only=weight_only,
                                   **scales), quiet=True)
    _assert_equals_modelopt(out, modelopt)
    assert main(["verify", str(out), "--against", str(src), "--quiet"]) == 0
    if family.endswith("_tied"):  # a tied head left out of the exclusions: vLLM builds it quantized
        problems = _config_problems_without(out, "lm_head")
        assert [p.tensor for p in problems] == ["lm_head.weight"] * 2 and "'lm_head'" in problems[0].message


def _config_problems_without(out: Path, module: str) -> list:
    """verify's `config` problems once both one-format configs of `out` stop excluding `module`."""
    from inkling_quant.verify import verify
    for name, key, excl in (("hf_quant_config.json", "quantization", "exclude_modules"),
                            ("config.json", "quantization_config", "ignore")):
        cfg = json.loads((out / name).read_text())
        cfg[key][excl].remove(module)
        (out / name).write_text(json.dumps(cfg))
    (out / "checksums.sha256").unlink()
    return verify(out, sample=0).check("config").problems


def test_one_format_lm_head_under_its_own_name(tmp_path):
    """Llama 4's head is `language_model.lm_head` (no ModelOpt export of it runs here): the
    one-format exclusions name it and no bare `lm_head` (which would be a tied head's), verify
    passes, and a copy whose exclusions drop it fails naming its tensor."""
    from hf_moe_reference import save

    from inkling_quant.verify import verify
    src, out = save("llama4", tmp_path / "src"), tmp_path / "out"
    convert(str(src), out, Options(scheme="nvfp4", default_activation_amax=4.0), quiet=True)
    hq = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    assert "language_model.lm_head" in hq["exclude_modules"] and "lm_head" not in hq["exclude_modules"]
    assert verify(out, against=src, sample=0).ok
    problems = _config_problems_without(out, "language_model.lm_head")
    assert [p.tensor for p in problems] == ["language_model.lm_head.weight"] * 2


def test_exclusions_are_summarized_as_modelopt_does():
    """export.modelopt.summarize_exclusions against nvidia-modelopt 0.47's own
    `_prefix_wildcard_summarize_exclude_modules` on module lists of every shape it distinguishes:
    a whole dense layer, a sibling prefix (layers.1 / layers.10), a module whose every prefix is
    taken, nested experts, in shuffled orders."""
    import random

    from modelopt.torch.export.quant_utils import _prefix_wildcard_summarize_exclude_modules as theirs

    from inkling_quant.export.modelopt import summarize_exclusions
    rng = random.Random(0)
    for trial in range(200):
        n = rng.randint(1, 12)
        quantized = {f"model.layers.{i}.mlp.experts" for i in range(n) if rng.random() < 0.6}
        names = ["lm_head", "model.embed_tokens", "model.norm"]
        for i in range(n):
            names += [f"model.layers.{i}.self_attn.{p}" for p in ("q_proj", "k_proj", "o_proj")]
            names += [f"model.layers.{i}.mlp.gate"] + ([] if f"model.layers.{i}.mlp.experts" in quantized else
                                                      [f"model.layers.{i}.mlp.{p}" for p in ("up_proj", "down_proj")])
            if rng.random() < 0.3:
                names.append(f"model.layers.{i}.mlp.experts.shared")
        rng.shuffle(names)
        assert summarize_exclusions(names, quantized) == sorted(theirs(names, quantized)), (trial, names, quantized)


def test_shared_experts_and_dense_layers_pass_through(exported, tmp_path):
    src, _ = exported["deepseek_v3"]
    out = tmp_path / "out"
    convert(str(src), out, Options(scheme="nvfp4", default_activation_amax=4.0), quiet=True)
    a, b = read_tensors(src), read_tensors(out)
    for name in ("model.layers.0.mlp.gate_proj.weight", "model.layers.1.mlp.shared_experts.up_proj.weight",
                 "model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.e_score_correction_bias",
                 "model.embed_tokens.weight", "lm_head.weight"):
        assert _same_bits(a[name], b[name]), name
    assert b["model.layers.2.mlp.experts.3.down_proj.weight"].dtype == torch.uint8
    assert "model.layers.1.mlp.shared_experts.up_proj.weight_scale" not in b


def test_stacked_experts_stored_as_the_hub_stores_them(exported, tmp_path):
    """Qwen3-VL-MoE's Hub checkpoints store gate_up_proj [E, H, 2I] and down_proj [E, I, H]
    (transformers transposes them on load); converted, they give ModelOpt's export exactly."""
    src, modelopt = exported["qwen3_vl_moe"]
    hub = tmp_path / "hub-form"
    hub.mkdir()
    for p in src.iterdir():
        if p.suffix == ".safetensors":
            sd = {k: (v.transpose(1, 2).contiguous() if k.endswith(("experts.gate_up_proj", "experts.down_proj"))
                      else v) for k, v in load_file(p).items()}
            save_file(sd, hub / p.name, metadata={"format": "pt"})
        else:
            (hub / p.name).write_bytes(p.read_bytes())
    with safe_open(hub / "model.safetensors", "pt") as h:
        assert h.get_slice("model.language_model.layers.0.mlp.experts.down_proj").get_shape() == [4, 32, 64]
    out = tmp_path / "out"
    convert(str(hub), out, Options(activation_scales=str(modelopt)), quiet=True)
    _assert_equals_modelopt(out, modelopt)


def test_scheme_none_copies_every_tensor(exported, tmp_path):
    src, _ = exported["qwen3_vl_moe"]
    out = tmp_path / "out"
    convert(str(src), out, Options(scheme="none"), quiet=True)
    a, b = read_tensors(src), read_tensors(out)
    assert set(a) == set(b) and all(_same_bits(a[k], b[k]) for k in a)
    assert "quantization_config" not in json.loads((out / "config.json").read_text())


def test_a_users_scheme_file(exported, tmp_path):
    """A scheme file quantizing layer 1's experts alone (MXFP8): one format, so ModelOpt's
    one-format configs, with layers 0 and 2 (their experts too) among the exclusions; equal to
    ModelOpt's own export of the same recipe, tensors and both files."""
    import copy

    from hf_moe_reference import build
    from modelopt_reference import MXFP8_CFG, quantize_and_export
    src, _ = exported["mixtral"]
    g = torch.Generator().manual_seed(2)
    recipe = {"quant_cfg": [{"quantizer_name": "*", "enable": False}] + [
        {"quantizer_name": f"*layers.1.*.experts.*{q}*", "cfg": MXFP8_CFG} for q in ("weight_quantizer", "input_quantizer")],
        "algorithm": "max"}
    modelopt = quantize_and_export(build("mixtral"), copy.deepcopy(recipe),
                                   [torch.randint(0, 90, (1, 24), generator=g) for _ in range(3)], tmp_path / "modelopt")
    scheme = tmp_path / "mine.toml"
    scheme.write_text('[[rules]]\npart = "expert"\nlayers = "1"\nformat = "mxfp8"\n')
    out = tmp_path / "out"
    convert(str(src), out, Options(scheme=str(scheme)), quiet=True)
    _assert_equals_modelopt(out, modelopt)
    q = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    assert q["quant_algo"] == "MXFP8" and {"model.layers.0*", "model.layers.2*"} <= set(q["exclude_modules"])
    assert main(["verify", str(out), "--quiet"]) == 0
    b = read_tensors(out)
    assert b["model.layers.1.block_sparse_moe.experts.0.w1.weight"].dtype == torch.float8_e4m3fn
    assert b["model.layers.0.block_sparse_moe.experts.0.w1.weight"].dtype == torch.bfloat16


def test_inkling_output_format_is_refused_for_other_families(exported, tmp_path, capsys):
    src, _ = exported["qwen3_moe"]
    assert main(["convert", str(src), str(tmp_path / "out"), "--output-format", "inkling",
                 "--default-activation-amax", "4", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "--output-format inkling" in err and "qwen3_moe" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_calibration_for_another_model_is_refused(exported, tmp_path):
    src, _ = exported["qwen3_moe"]
    _, other = exported["mixtral"]
    with pytest.raises(CheckpointError, match=r"module name\(s\) match no module of .*block_sparse_moe"):
        convert(str(src), tmp_path / "out", Options(activation_scales=str(other)), quiet=True)
    with pytest.raises(UsageError, match="needs an activation scale.*model.layers.1.mlp.experts.0.down_proj"):
        convert(str(src), tmp_path / "out", Options(), quiet=True)


def test_a_missing_expert_or_a_wrong_shape_names_the_tensor(exported, tmp_path):
    src, _ = exported["qwen3_moe"]
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_bytes((src / "config.json").read_bytes())
    sd = load_file(src / "model.safetensors")
    del sd["model.layers.2.mlp.experts.3.up_proj.weight"]
    save_file(sd, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="layer 2 expert 3: the routed expert's up weight is missing"):
        convert(str(bad), tmp_path / "out", Options(default_activation_amax=4.0), quiet=True)
    sd = load_file(src / "model.safetensors")
    sd["model.layers.1.mlp.experts.0.down_proj.weight"] = sd["model.layers.1.mlp.experts.0.down_proj.weight"][:, :16].contiguous()
    save_file(sd, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"experts\.0\.down_proj\.weight': shape \[64, 16\] disagrees") as e:
        convert(str(bad), tmp_path / "out", Options(default_activation_amax=4.0), quiet=True)
    assert e.value.tensor == "model.layers.1.mlp.experts.0.down_proj.weight"
