"""`inkling-quant verify` of an Inkling 2 checkpoint under transformers' in-memory names (experts
stacked `gate_up_proj` [E, 2I, H], gate rows then up rows) and under ModelOpt's per-expert names,
and of convert's output of each (ModelOpt's form, the default for such sources): the BF16 source
alone, the output alone and the output `--against` the source pass every check; a flipped
pass-through byte or a wrong expert weight fails, naming the tensor. The sources are the ones
tests/test_convert_inkling_names.py builds with transformers."""
from __future__ import annotations

import shutil

import pytest
from test_convert_inkling_names import write_sources
from test_verify_original import _failed, _patch, _problem, _rewrite

from inkling_quant.convert import Options, convert
from inkling_quant.verify import SKIP, verify

NAMINGS = ["transformers", "per_expert"]
E = "model.language_model.layers.{}.mlp.experts."


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    return write_sources(tmp_path_factory.mktemp("inkling-names"))


@pytest.fixture(scope="module")
def outputs(sources, tmp_path_factory):
    """naming -> convert's output of that source (the default scheme and output form)."""
    base = tmp_path_factory.mktemp("verify-inkling-names")
    for naming in NAMINGS:
        convert(str(sources[naming]), base / naming, Options(default_activation_amax=3.0, max_shard_bytes=1 << 18),
                quiet=True)
    return {n: base / n for n in NAMINGS}


@pytest.fixture
def broken(outputs, tmp_path, request):
    dst = tmp_path / "ckpt"
    shutil.copytree(outputs[request.param], dst)
    return request.param, dst


@pytest.mark.parametrize("naming", NAMINGS)
def test_the_output_passes_against_its_source(sources, outputs, naming):
    r = verify(outputs[naming], against=sources[naming], sample=0)
    assert r.ok and r.exit_code == 0, r.format_summary()
    layers = [i for i in (c.id for c in r.checks) if i.startswith("numerics[")]
    assert layers == [f"numerics[layer {i}]" for i in range(4)]
    assert len(r.numerics) == 4 * 4 * 3  # every expert's gate, up and down
    for n in r.numerics:
        assert n["tensor"] == f"{E.format(n['layer'])}{n['expert']}.{n['module']}.weight"
    assert r.check("passthrough").figures["tensors_compared"] > 50  # lm_head and the vision tower included
    assert r.check("source").figures["layout"].startswith("text model under 'model.language_model.'")
    assert verify(outputs[naming]).ok  # without --against


@pytest.mark.parametrize("naming, storage", [("transformers", "stacked"), ("per_expert", "per_expert")])
def test_the_bf16_source_alone_passes(sources, naming, storage):
    r = verify(sources[naming])
    assert r.ok and r.scheme == "none", r.format_summary()
    assert f"routed experts {storage} " in r.check("layout").figures["detected"]
    assert r.check("layout").figures["quantized_experts"] == {}
    assert r.check("checksums").status == SKIP  # transformers and ModelOpt write none
    strict = verify(sources[naming], require_checksums=True)
    assert _failed(strict) == {"checksums"}


@pytest.mark.parametrize("broken", NAMINGS, indirect=True)
def test_a_flipped_pass_through_byte_is_named(sources, broken):
    naming, out = broken
    name = "model.language_model.layers.1.self_attn.q_proj.linear.weight"
    shard = _patch(out, name, 0, b"\x12\x34")
    r = verify(out, against=sources[naming])
    assert "passthrough" in _failed(r)
    assert "byte 0" in _problem(r, "passthrough", shard, name).message


@pytest.mark.parametrize("broken", NAMINGS, indirect=True)
def test_a_wrong_expert_weight_is_named(sources, broken):
    """Expert 2's up_proj of layer 1 swapped for its gate_proj (well-formed, wrong values): only
    the numerics against the source can tell, and they name the module's weight."""
    naming, out = broken
    up = E.format(1) + "2.up_proj."
    gate = up.replace("up_proj", "gate_proj")
    shard = _rewrite(out, up + "weight", lambda t: t.update(
        {up + s: t[gate + s].clone() for s in ("weight", "weight_scale")}))
    assert verify(out).ok  # structurally sound
    r = verify(out, against=sources[naming], sample=0)
    assert r.exit_code == 1 and _failed(r) == {"numerics[layer 1]"}, r.format_summary()
    assert "expert 2 up_proj" in _problem(r, "numerics[layer 1]", shard, up + "weight").message


def test_the_output_of_one_naming_against_the_other_source(sources, outputs):
    """The same weights under the other storage: the source's layout decides how its experts are read."""
    r = verify(outputs["per_expert"], against=sources["transformers"], sample=0)
    assert r.ok, r.format_summary()
    r = verify(outputs["transformers"], against=sources["original"], sample=0)
    assert r.ok, r.format_summary()
