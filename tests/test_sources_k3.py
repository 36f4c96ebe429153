"""Kimi-K3's release layout as a source (docs/convert.md, "Sources we accept"): a tiny checkpoint
under the names and storage vLLM 0.33's Kimi-K3 loader reads (tests/sources_reference.py
`kimi_k3_release`: compressed-tensors MXFP4 experts `<module>.weight_packed` + `<module>.weight_scale`
uint8, a latent MoE whose experts act on routed_expert_hidden_size, everything else BF16),
converted into the form NVIDIA Model-Optimizer's Kimi-K3 script writes (export/kimi_k3.py):
experts bit for bit ModelOpt 0.47's MXFP4 -> NVFP4 cast (w1/w3 sharing k_max), MXFP8 bit for bit
ModelOpt's MXFP8 of ModelOpt's own MXFP4 dequantization; every other tensor byte for byte; the
manifest under every module spelling; bad scales refused by name; verify, inspect and plan read it."""
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
from inkling_quant.errors import CheckpointError, ConfigError, FormatError
from inkling_quant.model.layout import MoEConfig, detect, model_config
from inkling_quant.plan.hf import HFModel
from inkling_quant.verify import verify

AMAX = 2688.0   # the K3 recipe's constant expert amax: input_scale 2688 / (6 * 448) = 1.0
LM = "language_model.model.layers."


@pytest.fixture(scope="module")
def k3(tmp_path_factory):
    return ref.kimi_k3_release(tmp_path_factory.mktemp("k3") / "release")


@pytest.fixture(scope="module")
def converted(k3, tmp_path_factory):
    out = tmp_path_factory.mktemp("k3out") / "nvfp4"
    report = _convert(k3, out, scheme="nvfp4")
    return out, report


def _convert(src: Path, out: Path, **kw) -> dict:
    return convert(str(src), out, Options(**{"default_activation_amax": AMAX, **kw}), quiet=True)


def _modelopt():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from modelopt.torch.export import shard_cast_utils
        from modelopt.torch.export.convert_hf_config import convert_hf_quant_config_format
        from modelopt.torch.quantization.qtensor import MXFP4QTensor, MXFP8QTensor
    return shard_cast_utils, convert_hf_quant_config_format, MXFP4QTensor, MXFP8QTensor


def _experts(layers=(1, 2), n=4):
    for layer in layers:
        for e in range(n):
            yield layer, f"{LM}{layer}.block_sparse_moe.experts.{e}."


def test_layout_and_config_of_the_release(k3):
    """The text model under `language_model.model.`, experts per expert w1/w3/w2 under
    block_sparse_moe in the layers past first_k_dense_replace, acting on the latent width; the
    compressed-tensors config read from text_config; the latent projections pass through."""
    cfg = model_config(json.loads((k3 / "config.json").read_text()), "config.json")
    assert isinstance(cfg, MoEConfig) and cfg.family.name == "kimi_k3"
    assert (cfg.num_experts_per_tok, cfg.hidden_size, cfg.expert_hidden_size, cfg.dense_layers) == (2, 256, 192, {0})
    lay = detect(list(load_file(k3 / "model.safetensors")), cfg)
    assert lay.text_prefix == "language_model.model." and lay.experts.names == ("w1", "w3", "w2")
    assert lay.expert_layers == (1, 2) and lay.projector_prefix == "mm_projector."
    assert (lay.source.method, lay.source.expert_format, lay.source.packed, lay.source.scale) == \
        ("compressed-tensors", "mxfp4_rows", "weight_packed", "weight_scale")
    w = f"{LM}1.block_sparse_moe.experts.2.w3.weight"
    assert lay.stored(w) == {"weight": w + "_packed", "weight_scale": w[: -len("weight")] + "weight_scale"}
    assert lay.owner(w + "_packed") == (w, "weight")
    assert lay.classify(f"{LM}1.block_sparse_moe.shared_experts.up_proj.weight").part == "shared_expert"
    assert lay.classify(f"{LM}2.block_sparse_moe.gate.e_score_correction_bias").part == "router"


def test_moe_layer_freq_skips_layers_as_vllm_does():
    """MoE where i >= first_k_dense_replace (default 0) and i % moe_layer_freq == 0 (vLLM 0.33
    models/kimi_k3/nvidia/model.py; DeepSeek-V2's rule); a null freq is 1."""
    cfg = MoEConfig.from_dict({**ref.K3_TEXT, "num_hidden_layers": 6, "moe_layer_freq": 2})
    assert cfg.dense_layers == {0, 1, 3, 5}
    no_first = {k: v for k, v in ref.K3_TEXT.items() if k != "first_k_dense_replace"}
    assert MoEConfig.from_dict({**no_first, "num_hidden_layers": 4, "moe_layer_freq": 2}).dense_layers == {1, 3}
    assert MoEConfig.from_dict({**ref.K3_TEXT, "moe_layer_freq": None}).dense_layers == {0}


def test_only_a_compressed_tensors_config_is_read_from_text_config():
    """Kimi-K3 keeps its compressed-tensors config in text_config; another model's FP8 config
    there is not read as a source (its converted output would keep it, describing tensors gone)."""
    from inkling_quant.model.sources import source_quant
    assert source_quant({"text_config": {"quantization_config": ref.K3_CONFIG}}, "c").method == "compressed-tensors"
    fp8 = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    assert source_quant({"text_config": {"quantization_config": fp8}}, "c") is None


def test_k3_experts_are_modelopts_cast_in_its_k3_form(k3, converted):
    """--scheme nvfp4: each expert's w1/w3 (one k_max) and w2 bit for bit ModelOpt 0.47's
    quantize_mxfp4_to_nvfp4_lossless, the blocks counted per layer; `weight_packed` gone; every
    other tensor byte for byte; hf_quant_config.json as Model-Optimizer's quantize_to_nvfp4.py
    `_build_hf_quant_config` writes it (each bank and pattern under every spelling), config.json's
    quantization_config ModelOpt's convert_hf_quant_config_format of it with quant_method
    "modelopt_mixed", text_config's compressed-tensors config removed."""
    cast, to_config_json, _, _ = _modelopt()
    out_dir, report = converted
    src, out = load_file(k3 / "model.safetensors"), read_tensors(out_dir)
    counts: dict[str, dict[str, int]] = {}
    for layer, p in _experts():
        parts = {w: (src[f"{p}{w}.weight_packed"], src[f"{p}{w}.weight_scale"]) for w in ("w1", "w3", "w2")}
        kmax = {w: cast.mxfp4_kmax(s) for w, (_, s) in parts.items()}
        kmax["w1"] = kmax["w3"] = max(kmax["w1"], kmax["w3"])
        got = counts.setdefault(str(layer), {"lossless": 0, "rerounded": 0})
        for w, (packed, scales) in parts.items():
            q, sc, s2, nb, nl = cast.quantize_mxfp4_to_nvfp4_lossless(packed, scales, kmax[w], "cpu")
            assert torch.equal(out[f"{p}{w}.weight"], q), (p, w)
            assert torch.equal(out[f"{p}{w}.weight_scale"].view(torch.uint8), sc.view(torch.uint8)), (p, w)
            assert torch.equal(out[f"{p}{w}.weight_scale_2"], s2), (p, w)
            assert float(out[f"{p}{w}.input_scale"]) == 1.0
            assert f"{p}{w}.weight_packed" not in out
            got["lossless"] += nl
            got["rerounded"] += nb - nl
    assert report["mxfp4_to_nvfp4_blocks"] == counts and counts["1"]["rerounded"] > 0
    for k, v in src.items():
        if ".experts." not in k:
            assert out[k].dtype == v.dtype and torch.equal(out[k], v), k

    def spellings(name):  # quantize_to_nvfp4.py `_module_name_aliases`, spelled out
        names = {name, name.replace("block_sparse_moe", "mlp")}
        for n in list(names):
            if n.startswith("language_model.model."):
                names |= {"model." + n[21:], n[21:]}
            elif n.startswith("language_model."):
                names.add(n[15:])
        return sorted(names)
    nvfp4 = {"quant_algo": "NVFP4", "group_size": 16}
    layers = {a: nvfp4 for i in (1, 2) for a in spellings(f"{LM}{i}.block_sparse_moe.experts")}
    patterns = ["*block_sparse_moe.gate*", "*block_sparse_moe.routed_expert_up_proj*",
                "*block_sparse_moe.routed_expert_down_proj*", "*block_sparse_moe.routed_expert_norm*",
                "*block_sparse_moe.shared_experts*", "*self_attn.q_conv1d*", "*self_attn.k_conv1d*",
                "*self_attn.v_conv1d*", "*self_attn.f_b_proj*", "*self_attn.o_norm*", "*self_attn.q_a_layernorm*",
                "*self_attn.kv_a_layernorm*", "*_res_proj*", "*_res_norm*", "*layernorm*",
                "language_model.model.layers.0.mlp.*", "language_model.lm_head", "vision_tower*", "mm_projector*"]
    excludes = list(dict.fromkeys(a for p in patterns for a in spellings(p)))
    hq = json.loads((out_dir / "hf_quant_config.json").read_text())
    assert hq == {"producer": {"name": "modelopt", "version": "0.47.0"},
                  "quantization": {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None, "group_size": 16,
                                   "quantized_layers": layers, "exclude_modules": excludes}}
    assert list(hq["quantization"]["quantized_layers"]) == list(layers)
    cfg_src = json.loads((k3 / "config.json").read_text())
    cfg_out = json.loads((out_dir / "config.json").read_text())
    want = {**to_config_json(hq), "quant_method": "modelopt_mixed"}
    text = {k: v for k, v in cfg_src["text_config"].items() if k != "quantization_config"}
    assert cfg_out == {**cfg_src, "text_config": text, "quantization_config": want}


def test_k3_expert_to_mxfp8_is_modelopts_of_modelopts_dequantization(k3, tmp_path):
    """--scheme mxfp8: each expert bit for bit ModelOpt's MXFP8QTensor of ModelOpt's own
    MXFP4QTensor dequantization (exact in fp32), listed as MXFP8 under every spelling."""
    _, _, MXFP4QTensor, MXFP8QTensor = _modelopt()
    _convert(k3, tmp_path / "o", scheme="mxfp8")
    src, out = load_file(k3 / "model.safetensors"), read_tensors(tmp_path / "o")
    for _, p in _experts(n=2):
        for w in ("w1", "w3", "w2"):
            packed, e8 = src[f"{p}{w}.weight_packed"], src[f"{p}{w}.weight_scale"]
            shape = (packed.shape[0], packed.shape[1] * 2)
            exact = MXFP4QTensor(torch.Size(shape), torch.float32, packed).dequantize(
                dtype=torch.float32, scale=e8, block_sizes={-1: 32})
            q, s = MXFP8QTensor.quantize(exact)
            assert torch.equal(out[f"{p}{w}.weight"].view(torch.uint8), q._quantized_data.view(torch.uint8)), (p, w)
            assert torch.equal(out[f"{p}{w}.weight_scale"].reshape(-1), s.reshape(-1)), (p, w)
    hq = json.loads((tmp_path / "o" / "hf_quant_config.json").read_text())
    assert hq["quantization"]["quantized_layers"]["layers.2.mlp.experts"]["quant_algo"] == "MXFP8"
    assert verify(tmp_path / "o", against=k3).exit_code == 0


def test_verify_passes_the_k3_form_against_its_source(k3, converted):
    alone, against = verify(converted[0]), verify(converted[0], against=k3)
    assert alone.exit_code == 0, alone.failures()
    assert against.exit_code == 0, against.failures()
    numerics = [c for c in against.checks if c.id.startswith("numerics")]
    assert numerics and all(c.status == "pass" for c in numerics)


@pytest.mark.parametrize("file, edit, says", [
    ("hf_quant_config.json", lambda d: d["quantization"]["quantized_layers"].pop("layers.2.mlp.experts"),
     "layers.2.mlp.experts"),
    ("config.json", lambda d: d["quantization_config"]["quantized_layers"].__setitem__(
        "model.layers.0.mlp", {"quant_algo": "NVFP4", "group_size": 16}), "model.layers.0.mlp"),
    ("config.json", lambda d: d["quantization_config"]["ignore"].append("*mlp.experts*"), "excludes")])
def test_verify_fails_a_wrong_k3_manifest_naming_it(converted, tmp_path, file, edit, says):
    """A spelling of a quantized bank missing, a module listed that nothing quantizes, the
    experts excluded: each a config problem naming the module."""
    report = verify(ref.edited_copy(converted[0], tmp_path / "bad", file, edit))
    assert report.exit_code == 1
    assert any(says in p.message for c in report.checks if c.id == "config" for p in c.problems)


def _tamper(src: Path, dst: Path, edit) -> Path:
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    sd = load_file(src / "model.safetensors")
    edit(sd)
    save_file(sd, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_a_nan_e8m0_scale_is_refused_naming_it(k3, tmp_path):
    """An E8M0 byte 255 (NaN) in an expert's weight_scale: refused naming that tensor, nothing
    that looks complete written."""
    name = f"{LM}2.block_sparse_moe.experts.3.w2.weight_scale"
    bad = _tamper(k3, tmp_path / "bad", lambda sd: sd[name].view(-1).__setitem__(0, 255))
    with pytest.raises(FormatError, match="255") as e:
        _convert(bad, tmp_path / "o", scheme="nvfp4")
    assert e.value.tensor == name and not (tmp_path / "o" / "model.safetensors.index.json").exists()


def test_a_wrong_scale_grid_is_refused_before_writing(k3, tmp_path):
    name = f"{LM}1.block_sparse_moe.experts.0.w1.weight_scale"   # [160, 6]
    bad = _tamper(k3, tmp_path / "grid", lambda sd: sd.__setitem__(name, sd[name][:, :5].contiguous()))
    with pytest.raises(CheckpointError, match=r"\[160, 6\]") as e:
        _convert(bad, tmp_path / "o", scheme="nvfp4")
    assert e.value.tensor == name and not (tmp_path / "o").exists()


def test_an_mxfp4_group_vllm_would_not_read_is_refused_by_key(k3, tmp_path):
    dst = tmp_path / "g16"
    shutil.copytree(k3, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["text_config"]["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 16
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="config_groups.group_0.weights"):
        _convert(dst, tmp_path / "o", scheme="nvfp4")


def test_inspect_and_plan_read_the_k3_config(k3, converted):
    """inspect labels the source's experts mxfp4_rows and the output's NVFP4 (MIXED_PRECISION);
    plan reads the config (tests/test_plan_k3.py holds its figures), the experts as stored."""
    src = inspect_cmd.summarize(k3)
    assert [r["format"] for r in src.expert_layers] == ["mxfp4_rows"] and not src.unrecognized
    assert inspect_cmd.render(src).splitlines()[0].endswith("a source's quantization_config (mxfp4_rows)")
    out = inspect_cmd.summarize(converted[0])
    assert [r["format"] for r in out.expert_layers] == ["nvfp4"] and out.quant_algo == "MIXED_PRECISION"
    m = HFModel.from_dict(json.loads((k3 / "config.json").read_text()))
    assert m.text.k3 is not None and m.text.source_expert_format == "mxfp4_rows"


def test_lora_merge_refuses_the_k3_release_pointing_at_convert(k3, tmp_path):
    """Its experts are MXFP4 under a compressed-tensors config lora merge does not read: refused,
    naming config.json and saying convert writes them NVFP4/MXFP8 first."""
    from inkling_quant.errors import UsageError
    from inkling_quant.lora.merge import check

    with pytest.raises(UsageError, match="'compressed-tensors'.*routed experts NVFP4/MXFP8") as e:
        check(k3, tmp_path / "no-adapter")
    assert str(e.value.path).endswith("config.json")


def test_an_mtp_layers_mxfp4_experts_are_refused_naming_the_layer(k3, tmp_path):
    """A layer past num_hidden_layers (vLLM 0.33's Kimi-K3 MTP layers are numbered so) whose
    experts are MXFP4: refused before writing, naming the tensor and saying it is past the decoder
    (the release's MTP layers, if it ships them, are not converted here: docs/convert.md)."""
    def add_layer(sd):
        for k in [k for k in sd if k.startswith(LM + "2.")]:
            sd[LM + "3." + k[len(LM + "2."):]] = sd[k].clone()
    bad = _tamper(k3, tmp_path / "mtp", add_layer)
    with pytest.raises(CheckpointError, match="past the config's 3 decoder layers") as e:
        _convert(bad, tmp_path / "o", scheme="nvfp4")
    assert e.value.tensor.startswith(LM + "3.") and not (tmp_path / "o").exists()
