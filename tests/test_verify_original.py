"""`inkling-quant verify` on the published Inkling 2 layout (synth): a BF16
source and its conversion into the Inkling stacked form pass every check; copies broken one
defect each fail the right check, naming the file and the tensor, never with a traceback."""
import json
import shutil
from pathlib import Path

import pytest
import torch
from test_verify import _rewrite_shard

from inkling_quant.cli import main
from inkling_quant.convert import Options, convert
from inkling_quant.formats import FORMATS
from inkling_quant.io.checkpoint import INDEX_NAME
from inkling_quant.io.safetensors import read_header, sha256_file
from inkling_quant.synth import write_checkpoint
from inkling_quant.verify import CHECKSUMS, verify

LAYERS, EXPERTS, AMAX = 6, 4, 4.0  # the default scheme: NVFP4 experts in layers 0-4, MXFP8 in layer 5
P = "model.llm.layers.{}.mlp.experts."


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("verify-orig")
    src = write_checkpoint(tmp / "src", "tiny", layers=LAYERS)
    convert(src, tmp / "out", Options(default_activation_amax=AMAX, max_shard_bytes=1 << 18), quiet=True)
    return src, tmp / "out"


@pytest.fixture
def broken(pair, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(pair[1], dst)
    return dst


def _shard_of(root: Path, name: str) -> str:
    return json.loads((root / INDEX_NAME).read_text())["weight_map"][name]


def _patch(root: Path, name: str, at: int, data: bytes) -> str:
    shard = _shard_of(root, name)
    with open(root / shard, "r+b") as f:
        f.seek(read_header(root / shard).tensors[name].begin + at)
        f.write(data)
    return shard


def _rewrite(root: Path, name: str, edit) -> str:
    """Rewrite the shard holding `name` with `edit(tensors)` applied (test_verify's rewriter);
    index and checksums follow."""
    shard = _shard_of(root, name)
    _rewrite_shard(root, shard, edit)
    _reseal(root)
    return shard


def _reseal(root: Path) -> None:
    """checksums.sha256 for the files as they are now: the defect is a 'clean lie'."""
    names = [line.split("  ", 1)[1] for line in (root / CHECKSUMS).read_text().splitlines()]
    (root / CHECKSUMS).write_text("".join(f"{sha256_file(root / n)}  {n}\n" for n in names))


def _edit_json(root: Path, name: str, edit) -> None:
    obj = json.loads((root / name).read_text())
    edit(obj)
    (root / name).write_text(json.dumps(obj, indent=2))


def _failed(r) -> set[str]:
    return {c.id for c in r.failures()}


def _problem(r, check: str, file: str, tensor: str | None):
    c = r.check(check)
    for p in c.problems:
        if p.file.endswith(file) and p.tensor == tensor:
            return p
    raise AssertionError(f"{check}: no problem naming {file} / {tensor}: {[str(p) for p in c.problems[:5]]}")


# --------------------------------------------------------------------------- good
def test_converted_checkpoint_passes_every_check(pair):
    src, out = pair
    r = verify(out, against=src, sample=0)
    assert r.ok and r.exit_code == 0, r.format_summary()
    ids = [c.id for c in r.checks]
    shards = sorted(set(json.loads((out / INDEX_NAME).read_text())["weight_map"].values()))
    assert len(shards) > 1
    for must in ["input", "index", "config", "source", "layout", "passthrough", "checksums"]:
        assert must in ids
    assert "gate_up" not in ids  # one global scale per expert's w13: nothing to compare
    assert all(f"header[{s}]" in ids and f"values[{s}]" in ids for s in shards)
    assert [i for i in ids if i.startswith("numerics[")] == [f"numerics[layer {i}]" for i in range(LAYERS)]
    assert all(c.status == "pass" for c in r.checks) and r.scheme == "default"
    assert len(r.numerics) == LAYERS * EXPERTS * 3  # every expert's gate, up and down
    for n in r.numerics:
        f = FORMATS[n["format"]]
        assert n["format"] == ("nvfp4" if n["layer"] < 5 else "mxfp8")
        assert n["rel_error"] <= f.max_rel_error and n["cosine"] >= f.min_cosine
    assert r.check("layout").figures["quantized_experts"][P.format(5)[:-1]] == "mxfp8"
    assert r.check("passthrough").figures["tensors_compared"] > 100
    assert {(row.layers, row.format) for row in r.rows} >= {("0-4", "nvfp4"), ("5", "mxfp8"), ("all", "passthrough")}
    assert verify(out).ok  # without --against: no numerics, no passthrough


def test_the_bf16_source_passes(pair, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(pair[0], src)
    r = verify(src, write_checksums=True)
    assert r.ok and r.scheme == "none", r.format_summary()
    r = verify(src)
    assert r.ok and r.check("layout").figures["quantized_experts"] == {}


def test_cli_json_to_stdout(pair, capsys):
    src, out = pair
    rc = main(["verify", str(out), "--against", str(src), "--json", "-"])
    rep = json.loads(capsys.readouterr().out)
    assert rc == 0 and rep["ok"] and rep["exit_code"] == 0 and rep["counts"]["fail"] == 0
    assert len(rep["numerics"]) == LAYERS * 2 * 3  # the default sample: 2 experts a layer
    assert {"expert", "module", "rel_error", "cosine"} <= set(rep["numerics"][0])


def test_an_index_that_omits_mtp_safetensors(broken, pair):
    """The draft's mtp.safetensors is read whether or not the index lists it (io.checkpoint.
    DRAFT_FILE): an index without it passes, saying so; a stray other file still fails."""
    _edit_json(broken, INDEX_NAME, lambda o: o.update(weight_map={
        n: f for n, f in o["weight_map"].items() if f != "mtp.safetensors"}))
    r = verify(broken, against=pair[0], sample=0)
    assert r.ok, r.format_summary()
    assert r.check("index").figures["unlisted_weight_files"] == ["mtp.safetensors"]
    assert "header[mtp.safetensors]" in [c.id for c in r.checks]
    shutil.copy(broken / "mtp.safetensors", broken / "extra.safetensors")
    r = verify(broken)
    assert _problem(r, "index", "extra.safetensors", None) and not r.ok


# --------------------------------------------------------------------------- broken
def test_flipped_byte_in_a_block_scale(broken, pair):
    name = P.format(0) + "w13_weight_scale"
    shard = _patch(broken, name, 0, b"\x7f")  # expert 0's first e4m3 block scale -> NaN
    r = verify(broken, against=pair[0], sample=0)
    assert r.exit_code == 1
    assert _failed(r) == {f"values[{shard}]", "numerics[layer 0]", "checksums"}  # encoder: left to values
    p = _problem(r, f"values[{shard}]", shard, name)
    # the release's rule writes zero block scales (near-zero blocks): its e4m3 scales must be >= 0
    assert "finite and >= 0" in p.message and "(expert 0)" in p.message
    assert "expert 0 gate_proj" in _problem(r, "numerics[layer 0]", shard, name).message
    _problem(r, "checksums", shard, None)


def test_e8m0_byte_255_in_an_mxfp8_scale(broken, pair):
    name = P.format(5) + "w2_weight_scale"
    shard = _patch(broken, name, 3, b"\xff")
    _reseal(broken)
    r = verify(broken, against=pair[0], sample=0)
    assert f"values[{shard}]" in _failed(r) and "checksums" not in _failed(r)
    assert "e8m0" in _problem(r, f"values[{shard}]", shard, name).message


def test_missing_w2_weight_amax(broken, pair):
    name = P.format(1) + "w2_weight_amax"
    _rewrite(broken, name, lambda t: t.pop(name))
    r = verify(broken, against=pair[0])
    assert r.exit_code == 1 and "layout" in _failed(r)
    assert "missing: nvfp4 requires it" in _problem(r, "layout", INDEX_NAME, name).message
    assert "tensor missing" in _problem(r, "numerics[layer 1]", INDEX_NAME, name).message


def test_wrong_dtype(broken, pair):
    name = P.format(2) + "w13_weight_amax"
    shard = _rewrite(broken, name, lambda t: t.update({name: t[name].to(torch.bfloat16)}))
    r = verify(broken, against=pair[0])
    assert r.exit_code == 1 and "layout" in _failed(r)
    msg = _problem(r, "layout", shard, name).message
    assert "BF16" in msg and "nvfp4 prescribes F32" in msg


def test_config_json_edited(broken, pair):
    _edit_json(broken, "config.json", lambda c: c["text_config"].update(rms_norm_eps=1e-3))
    _reseal(broken)
    r = verify(broken, against=pair[0])
    assert _failed(r) == {"source"}
    assert "'text_config.rms_norm_eps' differs" in _problem(r, "source", "config.json", None).message


def test_quantized_layers_name_the_wrong_format(broken, pair):
    module = P.format(3)[:-1]
    for f, key in (("config.json", "quantization_config"), ("hf_quant_config.json", "quantization")):
        _edit_json(broken, f, lambda c: c[key]["quantized_layers"].update({module: {"quant_algo": "MXFP8",
                                                                                    "group_size": 32}}))
    _reseal(broken)
    r = verify(broken, against=pair[0])
    assert _failed(r) == {"config"}, r.format_summary()
    for f in ("config.json", "hf_quant_config.json"):
        p = _problem(r, "config", f, module + ".w13_weight")
        assert "'MXFP8', the tensors are 'NVFP4'" in p.message


def test_a_scheme_the_tensors_do_not_follow(pair):
    r = verify(pair[1], scheme="none")
    name = P.format(0) + "w13_weight"
    p = _problem(r, "layout", _shard_of(pair[1], name), name)
    assert "stored as nvfp4; scheme 'none' prescribes passthrough" in p.message


def test_a_config_implying_far_more_tensors_is_bounded(broken):
    def more_layers(c):
        n = 2000
        c["text_config"].update(num_hidden_layers=n, layer_types=["hybrid_sliding"] * n)
    _edit_json(broken, "config.json", more_layers)
    r = verify(broken)
    assert "implies more than" in _problem(r, "layout", "config.json", None).message
    assert r.check("config").status == "pass" and r.exit_code == 1


def test_a_malformed_text_config_fails_config(broken, capsys):
    _edit_json(broken, "config.json", lambda c: c.update(text_config=5))
    rc = main(["verify", str(broken)])
    out = capsys.readouterr().out
    assert rc == 1 and "Traceback" not in out and "FAIL config" in out and "text_config" in out


def test_weight_only_and_unquantized_conversions_pass(pair, tmp_path):
    src = pair[0]
    convert(src, tmp_path / "w4a16", Options(weight_only=True), quiet=True)
    r = verify(tmp_path / "w4a16", against=src)
    assert r.ok and r.check("config").figures["weight_only"] is True, r.format_summary()
    convert(src, tmp_path / "none", Options(scheme="none"), quiet=True)
    r = verify(tmp_path / "none", against=src)
    assert r.ok and not r.numerics and r.check("passthrough").figures["tensors_compared"] > 100


# --------------------------------------------------------------------------- the fused MoE
def test_numerics_runs_the_sampled_experts_as_one_moe_layer(pair):
    """numerics[layer L] also runs the layer's sampled experts as one MoE layer through the
    fused MoE entry point (verify --device cuda: the Triton kernels; here the torch reference),
    against the BF16 experts' layer: its error is a figure, within twice the per-GEMM bound. The
    same figure through the Triton kernels (the interpreter on CPU) agrees with the reference's."""
    pytest.importorskip("triton")
    from types import SimpleNamespace

    import inkling_kernels as kernels
    from inkling_quant.verify.numerics import moe_figures
    from inkling_quant.verify.report import Check

    src, out = pair
    r = verify(out, against=src, sample=2)
    for layer, fmt in ((0, "nvfp4"), (LAYERS - 1, "mxfp8")):
        f = next(c for c in r.checks if c.id == f"numerics[layer {layer}]").figures
        assert f["moe_path"] == "torch-reference" and f["moe_experts"] == 2 and f["moe_top_k"] == 2
        assert 0 < f["moe_rel_error"] <= 2 * FORMATS[fmt].max_rel_error
    # moe_figures itself on tiny experts, reference path against the Triton kernel's
    g = torch.Generator().manual_seed(0)
    nv = FORMATS["nvfp4"]
    source, quantized = [], []
    for _ in range(3):
        w = {p: (torch.randn(*s, generator=g) * 0.05).to(torch.bfloat16)
             for p, s in (("gate", (32, 64)), ("up", (32, 64)), ("down", (64, 32)))}
        a = nv.fused_global_amax([w["gate"], w["up"]])
        source.append(w)
        quantized.append({"gate": nv.quantize(w["gate"], global_amax=a), "up": nv.quantize(w["up"], global_amax=a),
                          "down": nv.quantize(w["down"])})
    figures = {}
    for path in (kernels.PATH_REFERENCE, kernels.PATH_SPLITK):
        c = Check("numerics[layer 0]", "numerics", "")
        moe_figures(c, SimpleNamespace(dev=torch.device("cpu"), path=path, inv=SimpleNamespace(root=out)), nv,
                    "m", source, quantized, "softcapped-swiglu")
        assert c.status != "fail" and c.figures["moe_top_k"] == 3
        figures[path] = c.figures["moe_rel_error"]
    assert abs(figures[kernels.PATH_SPLITK] - figures[kernels.PATH_REFERENCE]) < 1e-2, figures
