"""`convert --output-format modelopt-hf` against NVIDIA ModelOpt's own export of the same model:
a tiny Inkling 2 built by transformers is saved (BF16, original layout) and quantized + exported
by ModelOpt (NVFP4 experts, MXFP8 in the last layer, calibrated activation scales); our
converter, given the saved model and ModelOpt's export as `--activation-scales`, writes the same
tensors (names, dtypes, shapes, bytes) and the same two config files. The Inkling form of the
same conversion carries the same quantized values."""
from __future__ import annotations

import json

import pytest
import torch

from inkling_quant.convert import Options, convert
from inkling_quant.export.inkling import unstack_expert
from inkling_quant.formats import FORMATS

mo = pytest.importorskip("modelopt_reference")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("modelopt")
    mo.export_tiny(tmp / "modelopt", source=tmp / "src")
    return tmp / "src", tmp / "modelopt"


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def test_modelopt_hf_output_equals_modelopt_export(exported, tmp_path):
    src, ref = exported
    convert(src, tmp_path / "ours", Options(output_format="modelopt-hf", activation_scales=str(ref)), quiet=True)
    theirs, ours = mo.read_tensors(ref), mo.read_tensors(tmp_path / "ours")
    assert sorted(set(theirs) ^ set(ours)) == []
    differ = [n for n in theirs if theirs[n].dtype != ours[n].dtype or theirs[n].shape != ours[n].shape
              or not torch.equal(bits(theirs[n]), bits(ours[n]))]
    assert differ == []
    for f in ("hf_quant_config.json",):
        assert json.loads((tmp_path / "ours" / f).read_text()) == json.loads((ref / f).read_text())
    q_ours = json.loads((tmp_path / "ours" / "config.json").read_text())["quantization_config"]
    q_theirs = json.loads((ref / "config.json").read_text())["quantization_config"]
    assert q_ours == q_theirs


def test_one_format_equals_modelopt_export(tmp_path):
    """Every layer's experts NVFP4: ModelOpt's one-format export of the tiny Inkling 2 (its
    exclusions summarized from the modules it put a quantizer on: not the text embedding,
    model.inkling2.MODELOPT_UNWRAPPED) and ours, tensor for tensor and both config files; ours
    passes verify --against its source."""
    ref = mo.export_tiny(tmp_path / "modelopt", source=tmp_path / "src", mxfp8_last=False)
    convert(tmp_path / "src", tmp_path / "ours", Options(scheme="nvfp4", output_format="modelopt-hf",
                                                         activation_scales=str(ref)), quiet=True)
    theirs, ours = mo.read_tensors(ref), mo.read_tensors(tmp_path / "ours")
    assert set(theirs) == set(ours) and all(torch.equal(bits(theirs[n]), bits(ours[n])) for n in theirs)
    for f in ("hf_quant_config.json", "config.json"):
        assert json.loads((tmp_path / "ours" / f).read_text()).get("quantization_config") == \
            json.loads((ref / f).read_text()).get("quantization_config"), f
    hq = json.loads((tmp_path / "ours" / "hf_quant_config.json").read_text())
    assert hq == json.loads((ref / "hf_quant_config.json").read_text())
    assert hq["quantization"]["quant_algo"] == "NVFP4" and "model.vision_tower*" in hq["quantization"]["exclude_modules"]
    # the embedding it leaves out is no Linear: verify's one-format rule does not ask for it
    from inkling_quant.verify import verify
    r = verify(tmp_path / "ours", against=tmp_path / "src", sample=1)
    assert r.ok, r.format_summary()


def test_inkling_output_carries_the_same_quantized_experts(exported, tmp_path):
    """The Inkling (stacked) output of the same conversion with ModelOpt's encoder, unstacked, is
    ModelOpt's per-expert tensors bit for bit (the form changes the layout, not the bits)."""
    src, ref = exported
    convert(src, tmp_path / "ink", Options(activation_scales=str(ref), encoder="modelopt"), quiet=True)
    theirs, ours = mo.read_tensors(ref), mo.read_tensors(tmp_path / "ink")
    layers = 1 + max(int(n.split(".")[3]) for n in ours if n.startswith("model.llm.layers."))
    for layer in range(layers):
        p = f"model.llm.layers.{layer}.mlp.experts."
        stacked = {k[len(p):]: v for k, v in ours.items() if k.startswith(p)}
        fmt = FORMATS["nvfp4" if stacked["w13_weight"].dtype == torch.uint8 else "mxfp8"]
        for e, want in enumerate(mo.layer_experts(theirs, layer)):
            got = unstack_expert(fmt, stacked, e)
            for mod, tensors in want.items():
                assert set(got[mod]) == set(tensors), (layer, e, mod)
                for k, t in tensors.items():
                    assert torch.equal(bits(got[mod][k]), bits(t)), (layer, e, mod, k)
