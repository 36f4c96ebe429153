"""`inkling-quant verify` on ModelOpt's form of the published Inkling 2 model (`convert
--output-format modelopt-hf`: transformers' names, per-expert modules, lm_head cut to the
unpadded vocabulary): the clean output passes every check against its source; copies broken one
defect each fail the right check, naming the file and the tensor."""
import json
import shutil

import pytest
import torch
from test_verify_original import _failed, _patch, _problem, _rewrite

from inkling_quant.convert import Options, convert
from inkling_quant.formats import FORMATS
from inkling_quant.io.checkpoint import INDEX_NAME
from inkling_quant.synth import write_checkpoint
from inkling_quant.verify import verify

LAYERS, EXPERTS, AMAX = 6, 4, 4.0  # the default scheme: NVFP4 experts in layers 0-4, MXFP8 in layer 5
E = "model.language_model.layers.{}.mlp.experts."


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("verify-hf")
    src = write_checkpoint(tmp / "src", "tiny", layers=LAYERS)
    convert(src, tmp / "out", Options(output_format="modelopt-hf", default_activation_amax=AMAX,
                                      max_shard_bytes=1 << 18), quiet=True)
    return src, tmp / "out"


@pytest.fixture
def hf_broken(hf_pair, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(hf_pair[1], dst)
    return dst


def test_modelopt_hf_output_passes_every_check(hf_pair):
    src, out = hf_pair
    r = verify(out, against=src, sample=0)
    assert r.ok and r.exit_code == 0, r.format_summary()
    ids = [c.id for c in r.checks]
    for must in ["config", "source", "layout", "passthrough", "gate_up", "checksums"]:
        assert must in ids
    assert [i for i in ids if i.startswith("numerics[")] == [f"numerics[layer {i}]" for i in range(LAYERS)]
    assert len(r.numerics) == LAYERS * EXPERTS * 3  # every expert's gate, up and down
    for n in r.numerics:
        assert n["format"] == ("nvfp4" if n["layer"] < 5 else "mxfp8")
        assert n["tensor"] == f"{E.format(n['layer'])}{n['expert']}.{n['module']}.weight"
        f = FORMATS[n["format"]]
        assert n["rel_error"] <= f.max_rel_error and n["cosine"] >= f.min_cosine
    assert r.check("layout").figures["quantized_experts"][E.format(5)[:-1]] == "mxfp8"
    assert r.check("passthrough").figures["tensors_compared"] > 200  # lm_head and the draft included
    assert r.check("gate_up").figures["experts"] == 5 * EXPERTS
    assert verify(out).ok  # without --against


def test_flipped_byte_in_an_expert_weight_scale(hf_broken, hf_pair):
    name = E.format(0) + "0.up_proj.weight_scale"
    shard = _patch(hf_broken, name, 0, b"\xff")  # e4m3 0xFF: NaN
    r = verify(hf_broken, against=hf_pair[0], sample=0)
    assert r.exit_code == 1
    assert _failed(r) == {f"values[{shard}]", "numerics[layer 0]", "checksums"}
    assert "finite and positive" in _problem(r, f"values[{shard}]", shard, name).message
    # numerics names the module by its weight (one rule for every per-expert form: tests/test_verify_hf.py)
    assert "expert 0 up_proj" in _problem(r, "numerics[layer 0]", shard, E.format(0) + "0.up_proj.weight").message
    _problem(r, "checksums", shard, None)


def test_missing_weight_scale_2(hf_broken, hf_pair):
    name = E.format(0) + "0.up_proj.weight_scale_2"
    _rewrite(hf_broken, name, lambda t: t.pop(name))
    r = verify(hf_broken, against=hf_pair[0])
    assert r.exit_code == 1 and "layout" in _failed(r)
    assert "missing: nvfp4 requires it" in _problem(r, "layout", INDEX_NAME, name).message


def test_lm_head_with_the_padded_rows(hf_broken, hf_pair):
    src, name = hf_pair[0], "lm_head.weight"
    cfg = json.loads((src / "config.json").read_text())["text_config"]
    shard = _rewrite(hf_broken, name, lambda t: t.update({name: torch.zeros(cfg["vocab_size"], cfg["hidden_size"],
                                                                            dtype=torch.bfloat16)}))
    r = verify(hf_broken, against=src)
    assert r.exit_code == 1 and "layout" in _failed(r)
    msg = _problem(r, "layout", shard, name).message
    assert f"[{cfg['vocab_size']}, {cfg['hidden_size']}]" in msg and f"[{cfg['unpadded_vocab_size']}, " in msg


def test_a_renamed_pass_through_tensor_is_compared_with_its_source(hf_broken, hf_pair):
    name = "model.language_model.norm.weight"
    shard = _patch(hf_broken, name, 0, b"\x12\x34")
    r = verify(hf_broken, against=hf_pair[0])
    assert "byte 0" in _problem(r, "passthrough", shard, name).message
