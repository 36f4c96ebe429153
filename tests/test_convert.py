"""inkling-quant convert on the session's tiny published-layout checkpoint (all 48 layers, 4
experts; the default scheme: NVFP4 experts in layers 0-39, MXFP8 in 40-47), through the CLI: the
output against ModelOpt's own quantizers on each expert's gate, up and down taken out of the
stacked source, the configs, schemes, activation scales, parallel and buffered runs, bad input
and memory. (tests/test_convert_original.py: the MXFP8 release as source, transformers' reader;
tests/test_hardening.py: kills, signals, full disks, --part.)"""
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import inkling_quant
from inkling_quant.cli import main
from inkling_quant.export.inkling import projection_specs
from inkling_quant.model.inkling2 import Inkling2Config, checkpoint_tensors, classify
from inkling_quant.io.checkpoint import Checkpoint
from inkling_quant.io.safetensors import sha256_file
from inkling_quant.schemes import get_scheme
from inkling_quant.synth import write_checkpoint

import release_reference

AMAX = 4.0
LAYERS, EXPERTS, NVFP4_LAYERS = 48, 4, 40  # the tiny preset; the default scheme's first 5/6
SCALE_DIV = 6 * 448  # NVFP4: e2m1 max x e4m3 max (weight_scale_2 = amax / 2688, input_scale likewise)


def _load_all(root: Path) -> dict[str, torch.Tensor]:
    wm = json.loads((root / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for shard in sorted(set(wm.values())):
        with safe_open(root / shard, "pt") as f:
            for k in f.keys():
                out[k] = f.get_tensor(k)
    assert set(out) == set(wm)
    return out


def _files(root: Path) -> dict[str, str]:
    return {p.name: sha256_file(p) for p in sorted(root.iterdir()) if p.is_file()}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _experts(layer: int) -> str:
    return f"model.llm.layers.{layer}.mlp.experts."


def _convert(tiny_src, tmp_path_factory, *extra: str) -> Path:
    out = tmp_path_factory.mktemp("conv") / "tiny-default"
    before = _files(tiny_src)
    rc = main(["convert", str(tiny_src), str(out), "--scheme", "default", "--default-activation-amax", str(AMAX),
               "--quiet", "--json", str(out.parent / "report.json"), *extra])
    assert rc == 0
    assert _files(tiny_src) == before  # the source is never modified
    return out


@pytest.fixture(scope="module")
def converted(tiny_src, tmp_path_factory):
    """The default: the inkling form, written by the release's encoders."""
    return _convert(tiny_src, tmp_path_factory)


@pytest.fixture(scope="module")
def converted_modelopt(tiny_src, tmp_path_factory):
    """The inkling form written by ModelOpt's encoders (--encoder modelopt)."""
    return _convert(tiny_src, tmp_path_factory, "--encoder", "modelopt")


def test_every_tensor_has_the_prescribed_dtype_and_shape(tiny_src, converted):
    cfg = Inkling2Config.load(tiny_src)
    scheme = get_scheme("default")
    got = _load_all(converted)
    want = {}
    for s in checkpoint_tensors(cfg):
        rec = classify(s.name)
        if rec.part != "expert":
            want[s.name] = (s.shape, s.dtype)
            continue
        prefix = s.name[: -len(f"{rec.projection}_weight")]
        for k, o in projection_specs(scheme.format_for(cfg, rec), rec.projection, s.shape, dtype=s.dtype).items():
            want[prefix + k] = (tuple(o.shape), o.dtype)
    assert set(got) == set(want)
    for name, t in got.items():
        assert (tuple(t.shape), t.dtype) == want[name], name
    # the stacked form spelled out (export/inkling.py): E=4, 2I=192, H=64
    nv, mx = _experts(0), _experts(47)
    assert {k: (tuple(got[nv + k].shape), got[nv + k].dtype) for k in (
        "w13_weight", "w13_weight_scale", "w13_weight_amax", "w13_weight_outer_scale_denominator",
        "w13_weight.input_amax")} == {
        "w13_weight": ((4, 192, 32), torch.uint8), "w13_weight_scale": ((4, 192, 4), torch.float8_e4m3fn),
        "w13_weight_amax": ((4,), torch.float32), "w13_weight_outer_scale_denominator": ((), torch.float32),
        "w13_weight.input_amax": ((4,), torch.float32)}
    assert {k: (tuple(got[mx + k].shape), got[mx + k].dtype) for k in ("w2_weight", "w2_weight_scale")} == {
        "w2_weight": ((4, 64, 96), torch.float8_e4m3fn), "w2_weight_scale": ((4, 64, 3), torch.uint8)}


def test_passthrough_byte_identical_and_quantized_bit_identical_to_modelopt(tiny_src, converted_modelopt):
    """--encoder modelopt: every non-expert tensor bit-exact; every expert's gate (w13 rows 0, 2,
    ...), up (rows 1, 3, ...) and down (w2) what ModelOpt's NVFP4QTensor / MXFP8QTensor make of
    them, read straight from the stacked output: rows interleaved as in the source, NVFP4's global
    scale (gate and up share max(amax(gate), amax(up)) / 2688, ModelOpt's sync_moe_gate_up_amax) as
    amax / outer_scale_denominator, the activation scale as input_amax."""
    from modelopt.torch.quantization.qtensor import MXFP8QTensor, NVFP4QTensor

    src, out = _load_all(tiny_src), _load_all(converted_modelopt)
    for name, w in src.items():
        if ".mlp.experts." not in name:
            assert out[name].dtype == w.dtype and torch.equal(_bits(out[name]), _bits(w)), name
    n_nvfp4 = n_mxfp8 = 0
    for layer in range(LAYERS):
        p = _experts(layer)
        w13, w2 = src[p + "w13_weight"], src[p + "w2_weight"]
        for e in range(EXPERTS):
            gate, up, down = w13[e, 0::2].contiguous(), w13[e, 1::2].contiguous(), w2[e].contiguous()
            mods = (("w13", 0, gate), ("w13", 1, up), ("w2", None, down))
            if layer < NVFP4_LAYERS:
                gate_up_s2 = torch.maximum(gate.float().abs().amax(), up.float().abs().amax()) / SCALE_DIV
                for proj, row, w in mods:
                    s2 = gate_up_s2 if proj == "w13" else w.float().abs().amax() / SCALE_DIV
                    qt, s, _ = NVFP4QTensor.quantize(w, 16, weights_scaling_factor_2=s2)
                    rows = slice(row, None, 2) if row is not None else slice(None)
                    where = (layer, e, proj, row)
                    assert torch.equal(out[p + f"{proj}_weight"][e, rows], qt._quantized_data), where
                    assert torch.equal(_bits(out[p + f"{proj}_weight_scale"][e, rows]), _bits(s)), where
                    got_s2 = out[p + f"{proj}_weight_amax"][e] / out[p + f"{proj}_weight_outer_scale_denominator"]
                    assert torch.equal(got_s2, s2.float()), where
                    got_in = out[p + f"{proj}_weight.input_amax"][e] / SCALE_DIV
                    assert torch.equal(got_in, torch.tensor(AMAX / SCALE_DIV, dtype=torch.float32)), where
                    n_nvfp4 += 1
            else:
                for proj, row, w in mods:
                    qt, s = MXFP8QTensor.quantize(w)
                    rows = slice(row, None, 2) if row is not None else slice(None)
                    got_w, got_s = out[p + f"{proj}_weight"][e, rows], out[p + f"{proj}_weight_scale"][e, rows]
                    assert torch.equal(_bits(got_w), _bits(qt._quantized_data)), (layer, e, proj, row)
                    assert torch.equal(got_s, s.reshape(got_s.shape)), (layer, e, proj, row)
                    n_mxfp8 += 1
                assert not any(k.startswith(p) and ("amax" in k or "denominator" in k) for k in out)
    assert n_nvfp4 == NVFP4_LAYERS * EXPERTS * 3 and n_mxfp8 == (LAYERS - NVFP4_LAYERS) * EXPERTS * 3


def test_quantized_bits_are_the_release_encoders(tiny_src, converted):
    """The default (inkling form): every expert slab, as stored (gate/up rows interleaved, one
    amax per expert over both), is what the release's encoders write, held to the reference
    written apart from formats/ (tests/release_reference.py); every other tensor bit-exact."""
    src, out = _load_all(tiny_src), _load_all(converted)
    for name, w in src.items():
        if ".mlp.experts." not in name:
            assert out[name].dtype == w.dtype and torch.equal(_bits(out[name]), _bits(w)), name
    for layer in range(LAYERS):
        p = _experts(layer)
        for proj in ("w13", "w2"):
            for e in range(EXPERTS):
                slab, where = src[p + f"{proj}_weight"][e], (layer, proj, e)
                got_w, got_s = out[p + f"{proj}_weight"][e], out[p + f"{proj}_weight_scale"][e]
                if layer < NVFP4_LAYERS:
                    packed, scale, amax = release_reference.nvfp4_nearest(slab)
                    assert torch.equal(out[p + f"{proj}_weight_amax"][e], torch.as_tensor(amax).float()), where
                    assert float(out[p + f"{proj}_weight_outer_scale_denominator"]) == 2688.0
                else:
                    packed, scale = release_reference.mxfp8_nearest(slab)
                assert torch.equal(_bits(got_w), _bits(packed)), where
                assert torch.equal(_bits(got_s), _bits(scale)), where


def test_gate_and_up_share_the_global_scale(tiny_src, converted):
    """One NVFP4 global scale per expert for gate and up together: w13's amax is the BF16 amax
    over both (so gate's and up's weight_scale_2 are one value), over the 2688 divisor."""
    src, out = _load_all(tiny_src), _load_all(converted)
    for layer in range(NVFP4_LAYERS):
        p = _experts(layer)
        for proj in ("w13", "w2"):
            want = src[p + f"{proj}_weight"].float().abs().amax(dim=(1, 2))
            assert torch.equal(out[p + f"{proj}_weight_amax"], want), (layer, proj)
            assert torch.equal(out[p + f"{proj}_weight_outer_scale_denominator"], torch.tensor(2688.0))


def test_configs_are_modelopt_mixed_precision(tiny_src, converted):
    cfg = json.loads((converted / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "modelopt" and qc["quant_algo"] == "MIXED_PRECISION"
    assert qc["quantized_layers"] == {
        f"model.llm.layers.{i}.mlp.experts":
        {"quant_algo": "NVFP4", "group_size": 16, "encoder": "nvfp4_nearest", "scales": "amax_denominator"}
        if i < NVFP4_LAYERS else
        {"quant_algo": "MXFP8", "group_size": 32, "encoder": "mxfp8_nearest", "scales": "ue8m0"} for i in range(LAYERS)}
    hf = json.loads((converted / "hf_quant_config.json").read_text())
    assert hf["producer"] == {"name": "inkling-quant", "version": inkling_quant.__version__}
    assert hf["converter"]["encoder"] == "release"
    assert hf["quantization"] == {k: v for k, v in qc.items() if k != "quant_method"}
    src_cfg = json.loads((tiny_src / "config.json").read_text())
    assert {k: v for k, v in cfg.items() if k != "quantization_config"} == src_cfg
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
              "preprocessor_config.json"):
        assert sha256_file(converted / f) == sha256_file(tiny_src / f)
    sums = dict(reversed(line.split("  ")) for line in (converted / "checksums.sha256").read_text().splitlines())
    assert set(sums) == {p.name for p in converted.iterdir()} - {"checksums.sha256", "model.safetensors.index.json"}
    for f, h in sums.items():
        assert sha256_file(converted / f) == h
    assert not (converted / ".inkling-quant-convert.json").exists()
    report = json.loads((converted.parent / "report.json").read_text())
    # stacked tensors: w13 and w2 of each layer
    assert report["tensors_by_format"] == {"nvfp4": 2 * NVFP4_LAYERS, "mxfp8": 2 * (LAYERS - NVFP4_LAYERS),
                                           "passthrough": len(_load_all(tiny_src)) - 2 * LAYERS}
    assert report["activation_scales"] == {"calibrated": 0, "default": 2 * NVFP4_LAYERS}
    assert report["bytes_out"] < report["bytes_in"]


def test_other_schemes_are_data(tiny_src, tmp_path):
    for scheme, algo in (("nvfp4", "W4A16_NVFP4"), ("mxfp8", "MXFP8")):
        out = tmp_path / scheme
        assert main(["convert", str(tiny_src), str(out), "--scheme", scheme, "--weight-only", "--quiet"]) == 0
        layers = json.loads((out / "config.json").read_text())["quantization_config"]["quantized_layers"]
        assert len(layers) == LAYERS and {v["quant_algo"] for v in layers.values()} == {algo}
        assert main(["verify", str(out), "--quiet"]) == 0
        names = _load_all(out)
        assert not any(n.endswith(("input_scale", "input_amax")) for n in names)
        assert (names[_experts(0) + "w2_weight"].dtype == torch.uint8) == (scheme == "nvfp4")


def test_activation_scales_file_and_missing_scales(tiny_src, tmp_path, capsys):
    """--activation-scales keys an amax by the stacked tensor (gate and up are one module, w13);
    a module the file does not name takes --default-activation-amax; with neither, the run stops
    before writing and names the three flags."""
    assert main(["convert", str(tiny_src), str(tmp_path / "x"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "--activation-scales" in err and "--weight-only" in err and "--default-activation-amax" in err
    assert not (tmp_path / "x" / "model.safetensors.index.json").exists()
    amax = {_experts(i) + f"{p}_weight": 1.0 + i + (0.5 if p == "w2" else 0.0)
            for i in range(NVFP4_LAYERS) for p in ("w13", "w2")}
    del amax[_experts(39) + "w2_weight"]
    (tmp_path / "amax.json").write_text(json.dumps(amax))
    out = tmp_path / "cal"
    assert main(["convert", str(tiny_src), str(out), "--activation-scales", str(tmp_path / "amax.json"),
                 "--default-activation-amax", "7", "--quiet", "--json", str(tmp_path / "r.json")]) == 0
    t = _load_all(out)
    assert torch.equal(t[_experts(3) + "w2_weight.input_amax"], torch.full((EXPERTS,), 4.5))
    assert torch.equal(t[_experts(0) + "w13_weight.input_amax"], torch.full((EXPERTS,), 1.0))
    assert torch.equal(t[_experts(39) + "w2_weight.input_amax"], torch.full((EXPERTS,), 7.0))
    assert json.loads((tmp_path / "r.json").read_text())["activation_scales"] == {
        "calibrated": 2 * NVFP4_LAYERS - 1, "default": 1}


def test_existing_output_refused_then_overwrite(tiny_src, tmp_path, capsys):
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    assert main(["convert", str(tiny_src), str(out), "--weight-only", "--quiet"]) == 2
    assert "--resume" in capsys.readouterr().err and (out / "keep.txt").exists()
    assert main(["convert", str(tiny_src), str(out), "--weight-only", "--quiet", "--overwrite"]) == 0
    assert not (out / "keep.txt").exists()


def test_a_units_tensors_in_different_source_shards(tmp_path):
    """A stacked expert tensor of the MXFP8 release is one unit with its block scale: converted
    (to NVFP4) or copied (kept MXFP8) alike when the source put weight and scale in different
    shards."""
    src = write_checkpoint(tmp_path / "src", "tiny", layers=6, experts=2)
    release = tmp_path / "release"
    assert main(["convert", str(src), str(release), "--scheme", "mxfp8", "--quiet"]) == 0
    split = tmp_path / "split"
    shutil.copytree(release, split)
    idx = json.loads((split / "model.safetensors.index.json").read_text())
    tensors = _load_all(split)
    for f in set(idx["weight_map"].values()):
        (split / f).unlink()
    scales = {k: v for k, v in tensors.items() if k.endswith("_weight_scale")}
    rest = {k: v for k, v in tensors.items() if k not in scales}
    save_file(rest, split / "rest.safetensors", metadata={"format": "pt"})
    save_file(scales, split / "scales.safetensors", metadata={"format": "pt"})
    idx["weight_map"] = {k: "scales.safetensors" if k in scales else "rest.safetensors" for k in tensors}
    (split / "model.safetensors.index.json").write_text(json.dumps(idx))
    ck = Checkpoint.open(split)
    p = _experts(0)
    assert ck.weight_map[p + "w13_weight"] != ck.weight_map[p + "w13_weight_scale"]
    for d in (release, split):
        assert main(["convert", str(d), str(tmp_path / f"{d.name}-out"), "--default-activation-amax", "2", "--quiet"]) == 0
    whole, got = _load_all(tmp_path / "release-out"), _load_all(tmp_path / "split-out")
    assert set(got) == set(whole) and all(torch.equal(_bits(got[k]), _bits(whole[k])) for k in whole)
    assert got[p + "w13_weight"].dtype == torch.uint8  # layers 0-4 NVFP4 from the release
    for k in ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale"):  # layer 5 kept MXFP8
        assert torch.equal(_bits(got[_experts(5) + k]), _bits(tensors[_experts(5) + k])), k


def test_two_workers_same_bytes(tiny_src, converted, tmp_path):
    out = tmp_path / "w2"
    assert main(["convert", str(tiny_src), str(out), "--default-activation-amax", str(AMAX), "--quiet",
                 "--workers", "2"]) == 0
    assert _files(out) == _files(converted)


def test_buffered_io_same_bytes(tiny_src, converted, tmp_path):
    """--buffered-io changes how shards are written (page cache instead of O_DIRECT), not what."""
    out = tmp_path / "buffered"
    assert main(["convert", str(tiny_src), str(out), "--default-activation-amax", str(AMAX), "--quiet",
                 "--buffered-io"]) == 0
    assert _files(out) == _files(converted)


def test_read_buffers_serve_shard_after_shard(tiny_src, converted, tmp_path, monkeypatch):
    """In one process the read buffers of a finished shard are the next shard's (fresh ones are
    faulted in and zeroed again), handed on only once its writes are done: the same bytes out,
    fewer buffers made than with each shard its own, and none kept once the run ends."""
    from inkling_quant.convert import worker

    made = []

    class Counted(worker.TensorBuffer):
        def __init__(self):
            super().__init__()
            made.append(self)

    def run(name: str) -> int:
        made.clear()
        out = tmp_path / name
        assert main(["convert", str(tiny_src), str(out), "--default-activation-amax", str(AMAX), "--quiet",
                     "--workers", "1"]) == 0
        assert _files(out) == _files(converted)
        assert len(set(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"].values())) > 1
        return len(made)

    monkeypatch.setattr(worker, "TensorBuffer", Counted)
    monkeypatch.setattr(worker, "_SPARE_SETS", [])
    monkeypatch.setattr(worker._ReadAhead, "recycle", lambda self: None)
    each_shard_its_own = run("unshared")
    monkeypatch.undo()
    monkeypatch.setattr(worker, "TensorBuffer", Counted)
    monkeypatch.setattr(worker, "_SPARE_SETS", [])
    kept = []
    monkeypatch.setattr(worker._ReadAhead, "recycle", lambda self, real=worker._ReadAhead.recycle: (
        real(self), kept.append(len(worker._SPARE_SETS))))
    assert 0 < run("shared") < each_shard_its_own
    assert max(kept) == 1 and worker._SPARE_SETS == []   # one shard's set at a time; freed at the end


# ----------------------------------------------------------------------------- bad input
def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _first_expert_shard(root: Path) -> tuple[str, str]:
    wm = json.loads((root / "model.safetensors.index.json").read_text())["weight_map"]
    name = _experts(1) + "w13_weight"
    return wm[name], name


def _convert_fails(src, tmp_path, capsys, *expect):
    out = tmp_path / "out"
    rc = main(["convert", str(src), str(out), "--default-activation-amax", "4", "--quiet"])
    err = capsys.readouterr().err
    assert rc != 0, err
    for e in expect:
        assert e in err, err
    assert "Traceback" not in err
    assert not (out / "model.safetensors.index.json").exists()  # nothing looks complete
    assert not list(out.glob("*.partial")) if out.exists() else True
    return err


def test_truncated_shard(tiny_src, tmp_path, capsys):
    src = _copy(tiny_src, tmp_path / "s")
    shard, _ = _first_expert_shard(src)
    data = (src / shard).read_bytes()
    (src / shard).write_bytes(data[:-100])
    _convert_fails(src, tmp_path, capsys, shard, "truncated")


def test_header_lies_about_offsets(tiny_src, tmp_path, capsys):
    src = _copy(tiny_src, tmp_path / "s")
    shard, name = _first_expert_shard(src)
    raw = (src / shard).read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    b, e = header[name]["data_offsets"]
    header[name]["data_offsets"] = [b + 2, e + 2]
    blob = json.dumps(header).encode()
    blob += b" " * (n - len(blob)) if len(blob) <= n else b""
    (src / shard).write_bytes(struct.pack("<Q", len(blob)) + blob + raw[8 + n:])
    _convert_fails(src, tmp_path, capsys, shard)


@pytest.mark.parametrize("target, expect", [("missing-00001.safetensors", "does not exist"),
                                            ("../../etc/passwd", "refusing")])
def test_index_missing_file_or_outside(tiny_src, tmp_path, capsys, target, expect):
    src = _copy(tiny_src, tmp_path / "s")
    idx = json.loads((src / "model.safetensors.index.json").read_text())
    idx["weight_map"][_experts(0) + "w13_weight"] = target
    (src / "model.safetensors.index.json").write_text(json.dumps(idx))
    _convert_fails(src, tmp_path, capsys, expect)


def test_shape_disagrees_with_config(tiny_src, tmp_path, capsys):
    src = _copy(tiny_src, tmp_path / "s")
    cfg = json.loads((src / "config.json").read_text())
    cfg["text_config"]["moe_intermediate_size"] = 128
    (src / "config.json").write_text(json.dumps(cfg))
    _convert_fails(src, tmp_path, capsys, "disagrees with config.json", "mlp.experts.w13_weight")


def _rewrite_tensor(src: Path, name: str, fn):
    from inkling_quant.io.safetensors import read_header

    wm = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    path = src / wm[name]
    e = read_header(path).tensors[name]
    raw = bytearray(path.read_bytes())
    t = torch.frombuffer(raw[e.begin:e.end], dtype=e.dtype).clone().reshape(e.shape)
    fn(t)
    raw[e.begin:e.end] = t.reshape(-1).view(torch.uint8).numpy().tobytes()
    path.write_bytes(bytes(raw))
    return wm[name]


@pytest.mark.parametrize("name", ["model.llm.layers.2.mlp.experts.w2_weight", "model.llm.layers.45.mlp.experts.w13_weight",
                                  "model.llm.layers.2.attn.wq_du.weight"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_inf_weight(tiny_src, tmp_path, capsys, name, bad):
    src = _copy(tiny_src, tmp_path / "s")

    def poison(t):
        t.view(-1)[5] = bad

    shard = _rewrite_tensor(src, name, poison)
    _convert_fails(src, tmp_path, capsys, shard, name, "NaN or Inf")


def test_unknown_tensor_name(tiny_src, tmp_path, capsys):
    src = _copy(tiny_src, tmp_path / "s")
    shard, name = _first_expert_shard(src)
    bad = name.replace("w13_weight", "w13_weighx")
    raw = (src / shard).read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = raw[8:8 + n].replace(name.encode(), bad.encode())
    (src / shard).write_bytes(raw[:8] + header + raw[8 + n:])
    idx = json.loads((src / "model.safetensors.index.json").read_text())
    idx["weight_map"][bad] = idx["weight_map"].pop(name)
    (src / "model.safetensors.index.json").write_text(json.dumps(idx))
    _convert_fails(src, tmp_path, capsys, shard, bad, "not a tensor of the Inkling 2 layout")


def test_already_quantized_source_refused(converted, tmp_path, capsys):
    _convert_fails(converted, tmp_path, capsys, "already quantized", ".mlp.experts.w13_weight")


@pytest.mark.parametrize("output_format", ["inkling", "modelopt-hf"])
def test_legacy_layout_refused(tiny_src, tmp_path, capsys, output_format):
    """A config.json without text_config (the layout this project invented before the model was
    published) is refused up front, naming config.json and saying the layout is not supported."""
    src = _copy(tiny_src, tmp_path / "s")
    (src / "config.json").write_text(json.dumps({"model_type": "inkling2", "num_hidden_layers": 48, "hidden_size": 64,
                                                 "num_experts": 4, "moe_intermediate_size": 96}))
    rc = main(["convert", str(src), str(tmp_path / "out"), "--default-activation-amax", "4", "--quiet",
               "--output-format", output_format])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err, err
    assert f"{src}/config.json" in err and "text_config" in err and "no longer supported" in err, err
    assert not (tmp_path / "out").exists()


# kill -9 / SIGTERM / disk-full / lock / --part: tests/test_hardening.py


# ----------------------------------------------------------------------------- memory
def _cli(*args) -> list[str]:
    return [sys.executable, "-m", "inkling_quant.cli", *args]


# the peak resident memory of the process's own address space (VmHWM): a child's ru_maxrss starts
# from its parent's RSS at exec, and this test's parent holds the synthetic checkpoint it wrote
_HWM = ("import re, sys\n{}\n"
        "print(int(re.search(r'VmHWM:\\s+(\\d+) kB', open('/proc/self/status').read()).group(1)))")


def _peak_rss_mb(code: str, *args) -> float:
    r = subprocess.run([sys.executable, "-c", _HWM.format(code), *map(str, args)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return int(r.stdout.split()[-1]) / 1024


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmHWM from /proc")
def test_peak_rss_bounded_by_tensors_not_shard(tmp_path):
    # one 1.1 GB layer shard of real-size tensors (and the vision and draft files beside it):
    # stacked experts w13 [10, 4608, 4608] (425 MB) and w2 [10, 4608, 2304] bf16, read one expert
    # at a time; the embedding and the unembedding (151 MB each) are the largest tensors read whole
    src = write_checkpoint(tmp_path / "big", "bench", layers=1, experts=10)
    shard, *rest = Checkpoint.open(src).shards
    assert rest == ["vision.safetensors", "mtp.safetensors"]
    shard_mb = (src / shard).stat().st_size / 1e6
    assert shard_mb > 1000
    largest_mb = 16384 * 4608 * 2 / 1e6
    base = _peak_rss_mb("import inkling_quant.convert, torch; torch.zeros(1)")
    peak = _peak_rss_mb("from inkling_quant.cli import main\nif main(sys.argv[1:]):\n    sys.exit(1)",
                        "convert", src, tmp_path / "o", "--default-activation-amax", "4", "--quiet")
    print(f"shard {shard_mb:.0f} MB, baseline {base:.0f} MB, peak {peak:.0f} MB")
    assert peak - base < 4 * largest_mb + 64
    assert peak - base < shard_mb / 3
