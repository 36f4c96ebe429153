"""`inkling-quant verify`: a good checkpoint passes every check; a corpus of broken ones (one
defect each, generated here from one converted tiny checkpoint of the published Inkling 2
layout, stacked experts) is each caught with the file and tensor named and the documented exit
code, never a traceback. A checkpoint of the retired legacy layout is refused."""
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree as ET

import pytest
import torch

from legacy_checkpoint import write_legacy_checkpoint
from inkling_quant.cli import main
from inkling_quant.convert import Options, convert
from inkling_quant.errors import CheckpointError, prefixed
from inkling_quant.formats import FORMATS
from inkling_quant.export.inkling import stack_experts
from inkling_quant.io.checkpoint import INDEX_NAME
from inkling_quant.io.safetensors import ShardReader, ShardWriter, read_header, sha256_file
from inkling_quant.verify import CHECKSUMS, check_config_files, sample_experts, verify

AMAX = 4.0
P = "model.llm.layers.{}.mlp.experts."  # a layer's stacked experts module, with the dot


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def converted(tiny_src, tmp_path_factory):
    out = tmp_path_factory.mktemp("verify") / "tiny-default"
    convert(tiny_src, out, Options(default_activation_amax=AMAX, max_shard_bytes=1 << 20), quiet=True)
    return out


@pytest.fixture(scope="module")
def good_report(converted, tiny_src):
    return verify(converted, tiny_src, sample=0)


@pytest.fixture(scope="module")
def hf_converted(tiny_src, tmp_path_factory):
    """ModelOpt's form of the same model (transformers' names, per-expert modules)."""
    out = tmp_path_factory.mktemp("verify-hf") / "tiny-hf"
    convert(tiny_src, out, Options(output_format="modelopt-hf", default_activation_amax=AMAX,
                                   max_shard_bytes=1 << 20), quiet=True)
    return out


@pytest.fixture
def broken(converted, tmp_path):
    """A fresh copy of the good checkpoint to break."""
    dst = tmp_path / "ckpt"
    shutil.copytree(converted, dst)
    return dst


def _index(root: Path) -> dict:
    return json.loads((root / INDEX_NAME).read_text())


def _shard_of(root: Path, name: str) -> str:
    return _index(root)["weight_map"][name]


def _reseal(root: Path) -> None:
    """Rewrite checksums.sha256 for the current files: the defect is then a 'clean lie' that only
    the structural/value/numeric checks can catch."""
    lines = []
    for line in (root / CHECKSUMS).read_text().splitlines():
        _, name = line.split("  ", 1)
        lines.append(f"{sha256_file(root / name)}  {name}\n")
    (root / CHECKSUMS).write_text("".join(lines))


def _rewrite_shard(root: Path, shard: str, edit) -> None:
    """Load a shard's tensors (tiny), let `edit(dict)` change them, write it back, fix the index."""
    with ShardReader(root / shard) as r:
        tensors = {n: r.get(n).clone() for n in r.header.tensors}
    edit(tensors)
    (root / shard).unlink()
    w = ShardWriter(root / shard, [(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()], {"format": "pt"})
    for n, t in tensors.items():
        w.write(n, t)
    w.commit()
    idx = _index(root)
    wm = {n: s for n, s in idx["weight_map"].items() if s != shard or n in tensors}
    wm.update({n: shard for n in tensors})
    idx["weight_map"] = wm
    idx["metadata"]["total_size"] = sum(e.nbytes for s in set(wm.values()) for e in read_header(root / s).tensors.values())
    (root / INDEX_NAME).write_text(json.dumps(idx))


def _patch_bytes(root: Path, name: str, at: int, data: bytes) -> str:
    """Overwrite bytes of tensor `name` in place, `at` bytes into its data."""
    shard = _shard_of(root, name)
    e = read_header(root / shard).tensors[name]
    with open(root / shard, "r+b") as f:
        f.seek(e.begin + at)
        f.write(data)
    return shard


def _run(capsys, *argv) -> tuple[int, str, dict]:
    """`inkling-quant verify ARGV --json R`: exit code, printed output, the JSON report (R beside
    the checkpoint unless ARGV names one)."""
    args = [str(a) for a in argv]
    if "--json" in args:
        rep = Path(args[args.index("--json") + 1])
    else:
        rep = Path(args[0]).parent / "report.json"
        args += ["--json", str(rep)]
    rep.unlink(missing_ok=True)
    rc = main(["verify", *args])
    cap = capsys.readouterr()
    out = cap.out + cap.err
    assert "Traceback" not in out
    report = json.loads(rep.read_text()) if rep.exists() else {}
    assert not report or report["exit_code"] == rc
    return rc, out, report


def _failed(report: dict, prefix: str) -> list[dict]:
    bad = [c for c in report["checks"] if c["id"].startswith(prefix) and c["status"] in ("fail", "error")]
    assert bad, f"no failing check {prefix!r}: " + "; ".join(f"{c['id']}={c['status']}" for c in report["checks"]
                                                             if c["status"] != "pass")
    return bad


def _failed_ids(report: dict) -> set[str]:
    return {c["id"] for c in report["checks"] if c["status"] in ("fail", "error")}


def _problem(report: dict, prefix: str, file: str, tensor: str | None) -> dict:
    """The problem of a failing check naming `file` (a path fragment) and `tensor`."""
    for c in _failed(report, prefix):
        for p in c["problems"]:
            if file in p["file"] and (tensor is None or p["tensor"] == tensor or repr(tensor) in p["message"]):
                return p
    raise AssertionError(f"no {prefix} problem naming {file!r} / {tensor!r}: "
                         + "; ".join(str(p) for c in _failed(report, prefix) for p in c["problems"][:5]))


# --------------------------------------------------------------------------- the good checkpoint
def test_good_checkpoint_passes_every_check(good_report, converted, tiny_src):
    r = good_report
    assert r.ok and r.exit_code == 0, r.format_summary()
    ids = [c.id for c in r.checks]
    shards = sorted(set(_index(converted)["weight_map"].values()))
    for must in ["input", "index", "config", "layout", "checksums", "source", "passthrough"]:
        assert must in ids
    assert "gate_up" not in ids  # the stacked form: one global scale per expert's w13, nothing to compare
    for s in shards:
        assert f"header[{s}]" in ids and f"values[{s}]" in ids
    assert [i for i in ids if i.startswith("numerics[")] == [f"numerics[layer {i}]" for i in range(48)]
    assert all(c.status == "pass" for c in r.checks)
    # numerics: every expert (--sample 0), its gate, up and down, both formats, within the thresholds
    assert len(r.numerics) == 48 * 4 * 3
    assert {(n["layer"], n["expert"], n["module"]) for n in r.numerics} == {
        (i, e, m) for i in range(48) for e in range(4) for m in ("gate_proj", "up_proj", "down_proj")}
    for fmt in ("nvfp4", "mxfp8"):
        rows = [n for n in r.numerics if n["format"] == fmt]
        f = FORMATS[fmt]
        assert rows and all(n["rel_error"] <= f.max_rel_error and n["cosine"] >= f.min_cosine for n in rows)
    assert {n["format"] for n in r.numerics if n["layer"] < 40} == {"nvfp4"}
    assert {n["format"] for n in r.numerics if n["layer"] >= 40} == {"mxfp8"}
    assert r.check("passthrough").figures["tensors_compared"] > 0
    # summary table: one row per layer range and format, plus the pass-through
    rows = {(row.layers, row.format) for row in r.rows}
    assert {("0-39", "nvfp4"), ("40-47", "mxfp8"), ("all", "passthrough")} <= rows
    assert r.bytes_read == sum(p.stat().st_size for p in converted.iterdir()
                               if p.name not in (CHECKSUMS, INDEX_NAME))
    text = r.format_summary()
    assert "0-39" in text and "40-47" in text and "result: PASS" in text


def test_cli_reports_json_and_junit(converted, tiny_src, tmp_path, capsys):
    rc, out, rep = _run(capsys, converted, "--against", tiny_src, "--json", tmp_path / "r.json",
                        "--junit", tmp_path / "r.xml")
    assert rc == 0 and "result: PASS (exit 0)" in out and "nvfp4" in out and "mxfp8" in out
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["ok"] and rep["exit_code"] == 0 and rep["counts"]["fail"] == 0
    assert rep["scheme"] == "default" and rep["kernel_path"] == "torch-reference"
    assert all({"id", "status", "problems", "figures"} <= set(c) for c in rep["checks"])
    assert rep["numerics"] and {"rel_error", "cosine", "max_rel_error", "min_cosine"} <= set(rep["numerics"][0])
    # the default sample: 2 experts per layer, the same on every run (seeded by the layer)
    assert len(rep["numerics"]) == 48 * 2 * 3
    picked = {(n["layer"], n["expert"]) for n in rep["numerics"]}
    assert picked == {(i, e) for i in range(48) for e in sample_experts(i, 4, 2)}
    assert sample_experts(7, 384, 2) == sample_experts(7, 384, 2) != sample_experts(8, 384, 2)
    suite = ET.parse(tmp_path / "r.xml").getroot()
    cases = suite.findall(".//testcase")
    assert len(cases) == len(rep["checks"]) and suite.get("failures") == "0"
    assert not suite.findall(".//failure") and not suite.findall(".//error")


def test_help_documents_exit_codes(capsys):
    with pytest.raises(SystemExit):
        main(["verify", "--help"])
    out = capsys.readouterr().out
    assert "exit codes" in out and "relative error" in out
    for code in ("0  every check passed", "1  a check failed", "2  the input could not be read"):
        assert code in out


def test_legacy_layout_is_refused(tmp_path, capsys):
    """A config.json without text_config (the retired invented layout): the config check says
    so, naming config.json; nothing is checked against a layout; exit 1, no traceback."""
    root = write_legacy_checkpoint(tmp_path / "legacy")
    rc, out, r = _run(capsys, root)
    assert rc == 1 and "not the published Inkling 2 layout" in out
    assert "no longer supported" in _problem(r, "config", "config.json", None)["message"]
    layout = next(c for c in r["checks"] if c["id"] == "layout")
    assert layout["status"] == "skip" and not layout["problems"]


# --------------------------------------------------------------------------- the broken corpus
def test_flipped_byte(broken, tiny_src, capsys):
    name = "model.llm.layers.0.attn.wq_du.weight"
    shard = _shard_of(broken, name)
    first = (broken / shard).read_bytes()[read_header(broken / shard).tensors[name].begin]
    _patch_bytes(broken, name, 0, bytes([first ^ 0x01]))  # mantissa bit: still a finite bf16
    rc, out, r = _run(capsys, broken, "--against", tiny_src, "--sample", "1")
    assert rc == 1 and _failed_ids(r) == {"checksums", "passthrough"}
    _problem(r, "checksums", shard, None)
    assert "byte 0" in _problem(r, "passthrough", shard, name)["message"]


def test_truncated_shard(broken, capsys):
    shard = sorted(set(_index(broken)["weight_map"].values()))[-1]
    last = list(read_header(broken / shard).tensors)[-1]
    os.truncate(broken / shard, (broken / shard).stat().st_size - 100)
    rc, out, r = _run(capsys, broken)
    assert rc == 1 and shard in out and "truncated" in out
    assert "truncated" in _problem(r, f"header[{shard}]", shard, last)["message"]


def test_missing_tensor(broken, capsys):
    name = P.format(5) + "w2_weight_scale"
    _rewrite_shard(broken, _shard_of(broken, name), lambda t: t.pop(name))
    _reseal(broken)
    rc, out, r = _run(capsys, broken)
    assert rc == 1 and name in out
    assert "missing" in _problem(r, "layout", INDEX_NAME, name)["message"]


@pytest.mark.parametrize("name,beside,shape", [
    ("model.llm.layers.2.attn.wq_du.weight_scale", "model.llm.layers.2.attn.wq_du.weight", (1,)),  # a pass-through's
    (P.format(40) + "w13_weight.input_amax", P.format(40) + "w13_weight", (4,)),  # MXFP8 has no activation scale
], ids=["scale-of-a-passthrough", "activation-scale-of-mxfp8"])
def test_extra_tensor(broken, capsys, name, beside, shape):
    shard = _shard_of(broken, beside)
    _rewrite_shard(broken, shard, lambda t: t.__setitem__(name, torch.ones(shape, dtype=torch.float32)))
    _reseal(broken)
    rc, out, r = _run(capsys, broken)
    assert rc == 1 and name in out and _failed_ids(r) == {"layout"}
    assert "unexpected" in _problem(r, "layout", shard, name)["message"]


def test_wrong_dtype(broken, capsys):
    name = P.format(1) + "w13_weight_scale"
    shard = _shard_of(broken, name)
    _rewrite_shard(broken, shard, lambda t: t.__setitem__(name, t[name].view(torch.uint8)))
    _reseal(broken)
    rc, out, r = _run(capsys, broken)
    assert rc == 1 and name in out
    p = _problem(r, "layout", shard, name)
    assert "U8" in p["message"] and "F8_E4M3" in p["message"]


def _swap_experts(root: Path, name: str, a: int, b: int) -> None:
    """Swap experts a and b's slabs of the stacked tensor `name` in place."""
    shard = _shard_of(root, name)
    e = read_header(root / shard).tensors[name]
    slab = e.nbytes // e.shape[0]
    data = (root / shard).read_bytes()[e.begin:e.end]
    _patch_bytes(root, name, a * slab, data[b * slab:(b + 1) * slab])
    _patch_bytes(root, name, b * slab, data[a * slab:(a + 1) * slab])


def test_swapped_scales_caught_by_checksum_and_numerics(broken, tiny_src, capsys):
    name = P.format(3) + "w13_weight_scale"
    _swap_experts(broken, name, 0, 1)  # experts 0 and 1 exchange their gate/up block scales
    rc, out, r = _run(capsys, broken)  # structure and values are fine: the checksum catches it
    assert rc == 1 and _failed_ids(r) == {"checksums"} and _shard_of(broken, name) in out
    _reseal(broken)  # a forger who also rewrites the checksums: the numerics catch it
    rc, out, r = _run(capsys, broken, "--against", tiny_src, "--sample", "0")
    assert rc == 1 and _failed_ids(r) == {"numerics[layer 3]"}
    _problem(r, "numerics[layer 3]", _shard_of(broken, name), name)
    messages = [p["message"] for p in _failed(r, "numerics[layer 3]")[0]["problems"]]
    for e in (0, 1):
        assert any(m.startswith(f"expert {e} gate_proj") for m in messages), messages
        assert any(m.startswith(f"expert {e} up_proj") for m in messages), messages
    assert not any(m.startswith(("expert 2", "expert 3")) or "down_proj" in m.split(" (")[0] for m in messages)


def _nvfp4_layer(src: Path, layer: int) -> dict[str, torch.Tensor]:
    """Layer `layer`'s experts of the BF16 source quantized to NVFP4 (W4A4) in the stacked form,
    from the formats directly: gate and up (w13 rows 0::2, 1::2) share one global amax."""
    nv, wm = FORMATS["nvfp4"], _index(src)["weight_map"]
    stacked = {}
    for proj in ("w13", "w2"):
        n = f"{P.format(layer)}{proj}_weight"
        with ShardReader(src / wm[n]) as r:
            stacked[proj] = r.get(n).clone()
    experts = []
    for e in range(stacked["w13"].shape[0]):
        gate, up, down = stacked["w13"][e, 0::2], stacked["w13"][e, 1::2], stacked["w2"][e]
        g = torch.maximum(gate.float().abs().amax(), up.float().abs().amax())
        experts.append({"gate_proj": nv.quantize(gate.contiguous(), global_amax=g, input_amax=AMAX),
                        "up_proj": nv.quantize(up.contiguous(), global_amax=g, input_amax=AMAX),
                        "down_proj": nv.quantize(down.contiguous(), input_amax=AMAX)})
    return {P.format(layer) + k: v for k, v in stack_experts(nv, experts).items()}


def test_layer_in_wrong_format(broken, tiny_src, capsys):
    """Layer 40's experts written as NVFP4 (the default scheme says MXFP8), configs made to agree."""
    layer, nv = 40, FORMATS["nvfp4"]
    module, new = P.format(layer)[:-1], _nvfp4_layer(tiny_src, layer)
    shard = _shard_of(broken, module + ".w13_weight")
    assert shard == _shard_of(broken, module + ".w2_weight")

    def edit(t):
        for k in [k for k in t if k.startswith(module + ".")]:
            t.pop(k)
        t.update(new)
    _rewrite_shard(broken, shard, edit)
    for f, key in (("config.json", "quantization_config"), ("hf_quant_config.json", "quantization")):
        cfg = json.loads((broken / f).read_text())
        cfg[key]["quantized_layers"][module] = nv.layer_config(False)
        recipe = cfg[key]["modelopt_quant_config"]["quant_cfg"]
        for k in [k for k in recipe if k.startswith(module + ".")]:  # its MXFP8 override: NVFP4's global quantizers
            del recipe[k]
        (broken / f).write_text(json.dumps(cfg))
    _reseal(broken)
    rc, out, r = _run(capsys, broken)
    assert rc == 1 and _failed_ids(r) == {"layout"}
    msg = _problem(r, "layout", shard, module + ".w13_weight")["message"]
    assert f"layer {layer} are stored as nvfp4" in msg and "scheme 'default' prescribes mxfp8" in msg


@pytest.mark.parametrize("name,data,what", [
    (P.format(7) + "w2_weight_amax", struct.pack("<f", float("nan")), "finite and positive"),   # global scale
    (P.format(7) + "w13_weight_outer_scale_denominator", struct.pack("<f", 0.0), "finite and positive"),
    (P.format(7) + "w2_weight_scale", b"\x7f", "finite and >= 0"),                              # e4m3 NaN
    (P.format(8) + "w13_weight_scale", b"\x88", "finite and >= 0"),                             # negative block scale
    (P.format(44) + "w13_weight_scale", b"\xff", "e8m0"),                                       # e8m0 NaN
    (P.format(44) + "w13_weight", b"\x7f", "e4m3 NaN"),
    (P.format(9) + "w2_weight.input_amax", struct.pack("<f", -1.0), "finite and positive"),
    ("model.llm.layers.0.attn.wo_ud.weight", b"\x80\x7f", "NaN/Inf"),                           # bf16 +Inf
    ("model.llm.unembed.weight", b"\xc0\x7f", "NaN/Inf"),                                       # bf16 NaN
    ("model.llm.layers.3.mlp_norm.weight", b"\x80\xff", "NaN/Inf"),                             # bf16 -Inf
], ids=["nan-global-amax", "zero-outer-denominator", "nan-block-scale", "negative-block-scale", "e8m0-ff",
        "e4m3-nan-weight", "negative-input-amax", "bf16-inf", "unembed-nan", "norm-minus-inf"])
def test_bad_values(broken, capsys, name, data, what):
    at = 2 if len(data) == 2 else 0  # a bf16: its second element
    shard = _patch_bytes(broken, name, at, data)
    _reseal(broken)
    rc, out, r = _run(capsys, broken)
    assert rc == 1 and name in out and _failed_ids(r) == {f"values[{shard}]"}
    msg = _problem(r, f"values[{shard}]", shard, name)["message"]
    assert what in msg and f"element {at // len(data)} is" in msg
    if ".mlp.experts." in name and not name.endswith("_outer_scale_denominator"):  # that one: per tensor
        assert "(expert 0)" in msg  # a stacked tensor's problem names the expert


def test_gate_and_up_must_share_weight_scale_2(hf_converted, tmp_path, capsys):
    """ModelOpt's per-expert form stores gate's and up's global scale apart: vLLM fuses them
    under the gate's, so they must agree (the stacked form cannot disagree: one per w13)."""
    broken = tmp_path / "hf"
    shutil.copytree(hf_converted, broken)
    assert _run(capsys, broken)[0] == 0
    name = "model.language_model.layers.6.mlp.experts.3.up_proj.weight_scale_2"
    shard = _patch_bytes(broken, name, 0, struct.pack("<f", 0.5))
    _reseal(broken)
    rc, out, r = _run(capsys, broken)
    assert rc == 1 and _failed_ids(r) == {"gate_up"}
    assert "gate_proj" in _problem(r, "gate_up", shard, name)["message"]


def test_lying_header_offset(broken, capsys):
    shard = sorted(set(_index(broken)["weight_map"].values()))[0]
    raw = (broken / shard).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    head = json.loads(raw[8:8 + n])
    last = max((k for k in head if k != "__metadata__"), key=lambda k: head[k]["data_offsets"][0])
    head[last]["data_offsets"] = [o + 16 for o in head[last]["data_offsets"]]
    blob = json.dumps(head).encode()
    blob += b" " * (-len(blob) % 8)
    (broken / shard).write_bytes(struct.pack("<Q", len(blob)) + blob + raw[8 + n:])
    _reseal(broken)
    rc, out, r = _run(capsys, broken)
    assert rc == 1 and shard in out and last in out
    _problem(r, f"header[{shard}]", shard, last)


def test_index_pointing_outside_the_directory(broken, tiny_src, capsys):
    idx = _index(broken)
    name = "model.llm.norm.weight"
    idx["weight_map"][name] = f"../{tiny_src.name}/{idx['weight_map'][name]}"
    (broken / INDEX_NAME).write_text(json.dumps(idx))
    rc, out, r = _run(capsys, broken)
    assert rc == 1 and "refusing" in out and name in out
    assert "inside the checkpoint" in _problem(r, "index", INDEX_NAME, name)["message"]


def test_config_disagrees_with_tensors(broken, capsys):
    module = P.format(10)[:-1]
    cfg = json.loads((broken / "config.json").read_text())
    cfg["quantization_config"]["quantized_layers"][module] = {"quant_algo": "MXFP8", "group_size": 32}
    (broken / "config.json").write_text(json.dumps(cfg))
    _reseal(broken)
    rc, out, r = _run(capsys, broken)
    assert rc == 1 and module in out and _failed_ids(r) == {"config"}
    p = _problem(r, "config", "config.json", module + ".w13_weight")
    assert "MXFP8" in p["message"] and "NVFP4" in p["message"]
    _problem(r, "config", "hf_quant_config.json", None)  # the two config files disagree too


def test_weight_only_config_on_w4a4_tensors(broken, capsys):
    """W4A16_NVFP4 in both configs, but the NVFP4 tensors carry an activation scale (input_amax)."""
    for f, key in (("config.json", "quantization_config"), ("hf_quant_config.json", "quantization")):
        cfg = json.loads((broken / f).read_text())
        for e in cfg[key]["quantized_layers"].values():
            if e["quant_algo"] == "NVFP4":
                e["quant_algo"] = "W4A16_NVFP4"
        (broken / f).write_text(json.dumps(cfg))
    _reseal(broken)
    rc, out, r = _run(capsys, broken)
    assert rc == 1 and _failed_ids(r) == {"config"} and "W4A16_NVFP4" in out and "input_scale" in out


def test_config_dimension_disagrees_with_tensors(broken, capsys):
    cfg = json.loads((broken / "config.json").read_text())
    cfg["text_config"]["moe_intermediate_size"] = 128
    (broken / "config.json").write_text(json.dumps(cfg))
    _reseal(broken)
    rc, out, r = _run(capsys, broken)
    name = P.format(0) + "w2_weight"
    assert rc == 1 and "prescribes U8 [4, 64, 64]" in _problem(r, "layout", "", name)["message"]


def test_excluded_quantized_module(broken, capsys):
    for f, key in (("config.json", "quantization_config"), ("hf_quant_config.json", "quantization")):
        cfg = json.loads((broken / f).read_text())
        cfg[key]["exclude_modules"].append("model.llm.layers.4*")
        (broken / f).write_text(json.dumps(cfg))
    _reseal(broken)
    rc, out, r = _run(capsys, broken)
    assert rc == 1 and _failed_ids(r) == {"config"} and "'model.llm.layers.4*' excludes" in out


def test_quantization_config_on_unquantized_tensors(tiny_src, converted, tmp_path, capsys):
    """A BF16 checkpoint whose config.json claims a quantization: the tensors decide the layout
    (all pass-through), the config check names the claim."""
    src = tmp_path / "src"
    shutil.copytree(tiny_src, src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = json.loads((converted / "config.json").read_text())["quantization_config"]
    (src / "config.json").write_text(json.dumps(cfg))
    rc, out, r = _run(capsys, src)
    assert rc == 1 and _failed_ids(r) == {"config", "checksums"}  # synth writes no checksums.sha256
    assert "no module is quantized" in _problem(r, "config", "config.json", None)["message"]
    layout = next(c for c in r["checks"] if c["id"] == "layout")
    assert layout["status"] == "pass" and layout["figures"]["quantized_experts"] == {}


def test_stray_shard_and_unfinished_conversion(broken, capsys):
    shutil.copyfile(broken / sorted(set(_index(broken)["weight_map"].values()))[0], broken / "extra.safetensors")
    (broken / ".inkling-quant-convert.json").write_text("{}")
    rc, out, r = _run(capsys, broken)
    assert rc == 1 and "extra.safetensors" in out and "unfinished" in out
    _problem(r, "index", "extra.safetensors", None)


# --------------------------------------------------------------------------- the config files alone
def _config_problems(root: Path, **kw) -> list:
    r = check_config_files(root, **kw)
    assert [c.id for c in r.checks] == ["config"]
    return r.check("config").problems


def test_config_files_alone_hold_quantized_layers_to_the_scheme(converted, tiny_src, tmp_path):
    """check_config_files reads no tensor: the experts modules the scheme quantizes stand in for
    them, so a quantized_layers entry that names the wrong format, or lacks a layer, is found."""
    root = tmp_path / "cfg"
    root.mkdir()
    for f in ("config.json", "hf_quant_config.json"):
        shutil.copyfile(converted / f, root / f)
    assert _config_problems(root) == []
    assert check_config_files(root).check("config").figures["quantized_layers"] == 48
    weight_only = _config_problems(root, weight_only=True)  # the configs say NVFP4 (W4A4), not W4A16
    assert weight_only and all("W4A16_NVFP4" in p.message for p in weight_only if p.tensor)
    src = tmp_path / "src"
    src.mkdir()
    shutil.copyfile(tiny_src / "config.json", src / "config.json")
    assert _config_problems(src) == []  # no quantization config: scheme none, nothing quantized

    def edit(change):
        for f, key in (("config.json", "quantization_config"), ("hf_quant_config.json", "quantization")):
            cfg = json.loads((converted / f).read_text())
            change(cfg[key]["quantized_layers"])
            (root / f).write_text(json.dumps(cfg))
    edit(lambda layers: layers.update({P.format(10)[:-1]: {"quant_algo": "MXFP8", "group_size": 32}}))
    problems = _config_problems(root)
    assert {p.tensor for p in problems} == {P.format(10) + "w13_weight"} and len(problems) == 2
    assert all("'MXFP8'" in p.message and "'NVFP4'" in p.message for p in problems)
    edit(lambda layers: layers.pop(P.format(47)[:-1]))
    problems = _config_problems(root)
    assert {p.tensor for p in problems} == {P.format(47) + "w13_weight"} and len(problems) == 2
    edit(lambda layers: layers.update({"model.layers.0.mlp.experts.0.gate_proj": {"quant_algo": "NVFP4",
                                                                                 "group_size": 16}}))
    assert len(_config_problems(root)) == 2  # a legacy module name: no such module


# --------------------------------------------------------------------------- exit code 2
def test_unreadable_inputs_exit_2(converted, tmp_path, capsys):
    rc, out, r = _run(capsys, tmp_path / "nope", "--json", tmp_path / "r.json", "--junit", tmp_path / "r.xml")
    assert rc == 2 and "does not exist" in out
    assert json.loads((tmp_path / "r.json").read_text())["exit_code"] == 2
    assert ET.parse(tmp_path / "r.xml").getroot().get("errors") == "1"
    rc, out, r = _run(capsys, converted, "--against", tmp_path / "nope")
    assert rc == 2 and "source directory does not exist" in out
    rc, out, _ = _run(capsys, converted, "--scheme", "bogus", "--json", tmp_path / "u.json")
    assert rc == 2 and "unknown scheme" in out and json.loads((tmp_path / "u.json").read_text())["exit_code"] == 2
    rc, out, _ = _run(capsys, converted, "--sample", "-1")
    assert rc == 2 and "--sample" in out
    if not torch.cuda.is_available():
        rc, out, _ = _run(capsys, converted, "--device", "cuda")
        assert rc == 2 and "CUDA" in out


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root reads unreadable files")
def test_unreadable_shard_exit_2(broken, capsys):
    shard = sorted(set(_index(broken)["weight_map"].values()))[0]
    os.chmod(broken / shard, 0)
    try:
        rc, out, _ = _run(capsys, broken)
    finally:
        os.chmod(broken / shard, 0o644)
    assert rc == 2 and shard in out


def test_subprocess_never_tracebacks(broken):
    os.truncate(broken / sorted(set(_index(broken)["weight_map"].values()))[0], 10)
    (broken / "config.json").write_text("{not json")
    p = subprocess.run([sys.executable, "-m", "inkling_quant.cli", "verify", str(broken)], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 1 and "Traceback" not in p.stdout + p.stderr
    assert "config.json" in p.stdout and "not valid JSON" in p.stdout and "truncated" in p.stdout


# --------------------------------------------------------------------------- checksums
def test_write_checksums(broken, tiny_src, tmp_path, capsys):
    (broken / CHECKSUMS).unlink()
    rc, out, _ = _run(capsys, broken)
    assert rc == 1 and "--write-checksums" in out
    rc, out, r = _run(capsys, broken, "--write-checksums")
    assert rc == 0 and (broken / CHECKSUMS).is_file() and r["checksums_written"]
    listed = {line.split("  ", 1)[1] for line in (broken / CHECKSUMS).read_text().splitlines()}
    assert INDEX_NAME in listed and "config.json" in listed
    assert _run(capsys, broken)[0] == 0
    if shutil.which("sha256sum"):
        p = subprocess.run(["sha256sum", "-c", "--quiet", CHECKSUMS], cwd=broken, capture_output=True, text=True)
        assert p.returncode == 0, p.stdout + p.stderr
    # never for a broken checkpoint
    (broken / CHECKSUMS).unlink()
    _patch_bytes(broken, P.format(7) + "w2_weight_scale", 0, b"\x7f")
    rc, out, _ = _run(capsys, broken, "--write-checksums")
    assert rc == 1 and not (broken / CHECKSUMS).exists() and "not written" in out


def test_bad_checksum_lines_each_reported(broken, capsys):
    """verify lists every malformed or repeated line (draft/lora, which only read the file,
    stop at the first: one parser, io/output.read_checksums, serves both)."""
    p = broken / CHECKSUMS
    lines = p.read_text().splitlines()
    p.write_text("\n".join([lines[0], "not a checksum line", *lines[1:], lines[-1]]) + "\n")
    rc, out, r = _run(capsys, broken)
    assert rc == 1 and _failed_ids(r) == {"checksums"}
    assert _problem(r, "checksums", f"{CHECKSUMS}:2", None)["message"].startswith("not a '<sha256>  <file>' line")
    assert "listed twice" in _problem(r, "checksums", f"{CHECKSUMS}:{len(lines) + 2}", None)["message"]
    from inkling_quant.io.output import read_checksums
    with pytest.raises(CheckpointError, match=f"{CHECKSUMS}:2: not a"):
        read_checksums(p)


def test_write_checksums_for_a_bf16_source(tiny_src, tmp_path):
    """Any checkpoint: a BF16 one has no quantization config (scheme 'none')."""
    src = tmp_path / "src"
    shutil.copytree(tiny_src, src)
    r = verify(src, write_checksums=True)
    assert r.ok and r.scheme == "none" and (src / CHECKSUMS).is_file()
    r = verify(src)
    assert r.ok and r.check("checksums").figures["matched"] == len(list(src.iterdir())) - 1


# --------------------------------------------------------------------------- errors' fields
def test_error_fields_name_the_file_and_tensor(tmp_path):
    """An error's `path`/`tensor` fields are the problem's file and tensor (the message is not
    parsed); one raised without a path is reported against the checkpoint."""
    from inkling_quant.verify import Check, VerifyReport
    from inkling_quant.verify.report import Recorder

    def problem(e: Exception):
        run = Recorder(VerifyReport(str(tmp_path), None, "default", "cpu"), tmp_path)
        c = run.new("x", "structure", "")

        def body():
            raise e
        run.guard(c, body)
        assert isinstance(c, Check) and c.status == "fail" and c.problem_count == 1
        p = c.problems[0]
        return p.file, p.tensor, p.message

    shard = str(tmp_path / "a.safetensors")
    assert problem(CheckpointError("bad offsets", path=shard, tensor="w")) == (shard, "w", "bad offsets")
    assert problem(CheckpointError("values out of range", path=shard)) == (shard, None, "values out of range")
    short = CheckpointError("tensor 'v' is short", path=shard, tensor="v")
    assert problem(short) == (shard, "v", "tensor 'v' is short")
    wrapped = prefixed("corrupt: ", CheckpointError("tensor 'v' is short", path=shard, tensor="v"))
    assert problem(wrapped) == (shard, "v", f"corrupt: {shard}: tensor 'v' is short")
    assert problem(CheckpointError("no file named", tensor="w")) == (str(tmp_path), "w", "no file named")
