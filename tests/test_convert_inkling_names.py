"""convert and inspect of an Inkling 2 checkpoint saved under transformers' in-memory names
(`safetensors.torch.save_file(model.state_dict())`: `model.language_model.*`, `lm_head.weight`
unpadded, experts stacked `gate_up_proj` [E, 2I, H] gate then up and `down_proj` [E, H, I]) and
under ModelOpt's per-expert names (`...mlp.experts.E.{gate,up,down}_proj.weight`), against the
same model saved by `save_pretrained` (the original names): the strict spec holds under each
naming, and `--output-format modelopt-hf` writes the same tensors, bit for bit, and the same
config files from all three (the original-names output is ModelOpt's export: tests/test_modelopt_hf.py)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from inkling2_reference import inkling2, per_expert, save_like, tiny_config
from modelopt_reference import read_tensors
from inkling_quant import inspect_cmd
from inkling_quant.convert import Options, convert
from inkling_quant.errors import CheckpointError, UsageError
from inkling_quant.model.inkling2 import Inkling2Config
from inkling_quant.model.layout import detect, expected_tensors

I = 64  # the expert width: MXFP8's 32-blocks divide it (the default scheme's last layer)


def _model():
    """The tiny model with its experts' rows scaled over two decades (scales that differ across
    rows, so a rule that mixes up gate/up rows or experts changes the bytes)."""
    torch.manual_seed(0)
    model = inkling2.Inkling2ForConditionalGeneration._from_config(tiny_config(moe_intermediate_size=I),
                                                                    dtype=torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("static_weight", ".query")) or "conv1d" in name:
                p.normal_(0.0, 0.02)
            elif name.endswith(("gate_up_proj", "down_proj")):
                p.mul_(torch.logspace(-1, 1, p.shape[1]).reshape(1, -1, 1).to(p.dtype))
    return model


def _per_expert(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return per_expert(sd, I)


def _save(sd: dict[str, torch.Tensor], like: Path, out: Path) -> Path:
    return save_like(sd, like, out)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    return write_sources(tmp_path_factory.mktemp("inkling-names"))


def write_sources(base: Path) -> dict[str, Path]:
    """naming -> a directory under `base` holding the same weights: "original" (save_pretrained),
    "transformers" (the in-memory state dict), "per_expert" (ModelOpt's per-expert names)."""
    model = _model()
    model.save_pretrained(base / "original")
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    return {"original": base / "original", "transformers": _save(sd, base / "original", base / "transformers"),
            "per_expert": _save(_per_expert(sd), base / "original", base / "per_expert")}


def _scales() -> dict[str, float]:
    """Calibration amax per ModelOpt module: one per layer and projection, gate and up alike
    (ModelOpt's one input quantizer per fused expert projection)."""
    return {f"model.language_model.layers.{n}.mlp.experts.{e}.{m}": 1.5 + n + (m == "down_proj")
            for n in range(4) for e in range(4) for m in ("gate_proj", "up_proj", "down_proj")}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def test_in_memory_names_are_what_the_model_holds(sources):
    """The fixture's in-memory source is transformers' own naming: it loads back into the model
    with nothing missing or unexpected (so the names convert accepts are transformers')."""
    model = _model()
    result = model.load_state_dict(load_file(sources["transformers"] / "model.safetensors"), strict=True)
    assert not result.missing_keys and not result.unexpected_keys


@pytest.mark.parametrize("naming", ["original", "transformers", "per_expert"])
def test_the_spec_under_each_naming_is_the_checkpoint(sources, naming):
    """layout.expected_tensors under the detected layout: exactly the saved names and shapes."""
    held = {k: tuple(v.shape) for k, v in read_tensors(sources[naming]).items()}
    cfg = Inkling2Config.load(sources[naming])
    lay = detect(list(held), cfg)
    assert {n: s.shape for n, s in expected_tensors(cfg, lay).items()} == held


@pytest.mark.parametrize("naming", ["transformers", "per_expert"])
def test_modelopt_hf_output_is_the_same_from_every_naming(sources, tmp_path, naming):
    scales = tmp_path / "scales.json"
    scales.write_text(json.dumps(_scales()))
    opts = Options(output_format="modelopt-hf", activation_scales=str(scales))
    convert(str(sources["original"]), tmp_path / "ref", opts, quiet=True)
    report = convert(str(sources[naming]), tmp_path / "out", opts, quiet=True)
    ref, out = read_tensors(tmp_path / "ref"), read_tensors(tmp_path / "out")
    assert sorted(set(ref) ^ set(out)) == []
    differ = [k for k in ref if ref[k].dtype != out[k].dtype or ref[k].shape != out[k].shape
              or not torch.equal(_bits(ref[k]), _bits(out[k]))]
    assert differ == []
    assert any(k.endswith("experts.0.gate_proj.weight_scale_2") for k in out)  # NVFP4 experts were written
    assert out["lm_head.weight"].shape[0] == 150  # the unpadded vocabulary
    for f in ("config.json", "hf_quant_config.json"):
        assert json.loads((tmp_path / "out" / f).read_text()) == json.loads((tmp_path / "ref" / f).read_text()), f
    assert report["activation_scales"] == {"calibrated": report["activation_scales"]["calibrated"], "default": 0}


def test_transformers_names_default_to_modelopt_hf_and_refuse_the_inkling_form(sources, tmp_path):
    convert(str(sources["transformers"]), tmp_path / "a", Options(default_activation_amax=3.0), quiet=True)
    convert(str(sources["transformers"]), tmp_path / "b", Options(default_activation_amax=3.0,
                                                                  output_format="modelopt-hf"), quiet=True)
    a, b = read_tensors(tmp_path / "a"), read_tensors(tmp_path / "b")
    assert set(a) == set(b) and all(torch.equal(_bits(a[k]), _bits(b[k])) for k in a)
    with pytest.raises(UsageError, match="--output-format inkling writes the original names.*modelopt-hf"):
        convert(str(sources["transformers"]), tmp_path / "c", Options(default_activation_amax=3.0,
                                                                      output_format="inkling"), quiet=True)


def _broken(sources, tmp_path: Path, naming: str, edit) -> Path:
    sd = load_file(sources[naming] / "model.safetensors")
    edit(sd)
    return _save(sd, sources[naming], tmp_path / "bad")


@pytest.mark.parametrize("naming, name", [
    ("transformers", "model.language_model.layers.1.self_attn.q_proj.linear.weight"),
    ("transformers", "model.vision_tower.merger.linear_2.bias"),
    ("transformers", "lm_head.weight"),
    ("per_expert", "model.language_model.layers.2.mlp.experts.3.up_proj.weight"),
])
def test_a_missing_tensor_is_named(sources, tmp_path, naming, name):
    src = _broken(sources, tmp_path, naming, lambda sd: sd.pop(name))
    with pytest.raises(CheckpointError, match="is missing") as e:
        convert(str(src), tmp_path / "out", Options(default_activation_amax=3.0), quiet=True)
    assert e.value.tensor == name and name in str(e.value)


def test_an_unexpected_tensor_is_listed_with_what_was_expected(sources, tmp_path):
    def rename(sd):  # a typo, and a tensor the model does not have
        sd["model.language_model.layers.1.self_attn.q_proj.linaer.weight"] = sd.pop(
            "model.language_model.layers.1.self_attn.q_proj.linear.weight")
        sd["model.language_model.layers.0.extra.weight"] = torch.zeros(3)

    src = _broken(sources, tmp_path, "transformers", rename)
    with pytest.raises(CheckpointError, match=r"2 tensor\(s\) not a tensor of the Inkling 2 layout") as e:
        convert(str(src), tmp_path / "out", Options(default_activation_amax=3.0), quiet=True)
    msg = str(e.value)
    assert "q_proj.linaer.weight" in msg and "layers.0.extra.weight" in msg and "model.safetensors" in msg
    assert "transformers' in-memory names" in msg  # what was expected
    assert "missing from the checkpoint: 'model.language_model.layers.1.self_attn.q_proj.linear.weight'" in msg


@pytest.mark.parametrize("name, shape", [("lm_head.weight", (160, 96)),  # padded, as the original unembed
                                         ("model.language_model.layers.0.mlp.experts.down_proj", (4, 96, 32))])
def test_a_tensor_of_the_wrong_shape_is_named(sources, tmp_path, name, shape):
    src = _broken(sources, tmp_path, "transformers", lambda sd: sd.update({name: torch.zeros(shape, dtype=torch.bfloat16)}))
    with pytest.raises(CheckpointError, match="disagrees with config.json") as e:
        convert(str(src), tmp_path / "out", Options(default_activation_amax=3.0), quiet=True)
    assert e.value.tensor == name


def test_an_inkling_config_over_another_layout_is_refused(sources, tmp_path):
    """Inkling 2's names under another family's prefix fit no Inkling 2 naming: the error says
    which namings are accepted."""
    src = _broken(sources, tmp_path, "transformers", lambda sd: sd.update(
        {k.replace("model.language_model.", "model."): sd.pop(k) for k in list(sd)
         if k.startswith("model.language_model.")}))
    with pytest.raises(CheckpointError, match="laid out as no Inkling 2 checkpoint is.*expected one of"):
        convert(str(src), tmp_path / "out", Options(default_activation_amax=3.0), quiet=True)


@pytest.mark.parametrize("naming, storage", [("transformers", "stacked"), ("per_expert", "per_expert")])
def test_inspect_shows_the_detected_layout(sources, naming, storage):
    s = inspect_cmd.summarize(sources[naming])
    assert s.ok and s.layout == "inkling2"
    d = s.detected
    assert (d["text_prefix"], d["expert_storage"], d["lm_head"], d["vision_prefix"]) == (
        "model.language_model.", storage, "lm_head.weight", "model.vision_tower.")
    assert d["expert_layers"] == [0, 1, 2, 3] and d["experts"] == 4
    assert s.expert_layers == [{"first": 0, "last": 3, "format": "passthrough", "experts": 4}]
    assert "text model      model.language_model." in inspect_cmd.render(s)
