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

from inkling_quant.cli import main
from inkling_quant.io.checkpoint import Checkpoint
from inkling_quant.io.safetensors import sha256_file
from inkling_quant.layout import ModelConfig, classify, expected_tensors
from inkling_quant.schemes import get_scheme
from inkling_quant.synth import write_checkpoint

AMAX = 4.0


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


@pytest.fixture(scope="module")
def converted(tiny_src, tmp_path_factory):
    out = tmp_path_factory.mktemp("conv") / "tiny-default"
    before = _files(tiny_src)
    rc = main(["convert", str(tiny_src), str(out), "--scheme", "default", "--default-activation-amax", str(AMAX),
               "--quiet", "--json", str(out.parent / "report.json")])
    assert rc == 0
    assert _files(tiny_src) == before  # the source is never modified
    return out


def test_every_tensor_has_the_prescribed_dtype_and_shape(tiny_src, converted):
    cfg = ModelConfig.load(tiny_src)
    scheme = get_scheme("default")
    got = _load_all(converted)
    want = {}
    for s in expected_tensors(cfg):
        fmt = scheme.format_for(cfg, classify(s.name))
        for suffix, o in fmt.out_specs(s.shape, s.dtype).items():
            name = s.name if fmt.name == "passthrough" else s.name[: -len("weight")] + suffix
            want[name] = (o.shape, o.dtype)
    assert set(got) == set(want)
    for name, t in got.items():
        assert (tuple(t.shape), t.dtype) == want[name], name


def test_passthrough_byte_identical_and_quantized_bit_identical_to_modelopt(tiny_src, converted):
    from modelopt.torch.quantization.qtensor import MXFP8QTensor, NVFP4QTensor

    cfg = ModelConfig.load(tiny_src)
    src, out = _load_all(tiny_src), _load_all(converted)
    scheme = get_scheme("default")
    n_nvfp4 = n_mxfp8 = 0
    for name, w in src.items():
        t = classify(name)
        fmt = scheme.format_name(cfg, t)
        if fmt == "passthrough":
            assert out[name].dtype == w.dtype and torch.equal(out[name].view(-1).view(torch.uint8) if w.dim() else out[name],
                                                              w.view(-1).view(torch.uint8) if w.dim() else w), name
            continue
        m = name[: -len(".weight")]
        if fmt == "nvfp4":
            if t.projection in ("gate_proj", "up_proj"):
                other = src[m.rsplit(".", 1)[0] + (".up_proj.weight" if t.projection == "gate_proj" else ".gate_proj.weight")]
                s2 = torch.maximum(w.float().abs().amax(), other.float().abs().amax()) / (6 * 448)
            else:
                s2 = w.float().abs().amax() / (6 * 448)
            qt, s, s2_ref = NVFP4QTensor.quantize(w, 16, weights_scaling_factor_2=s2)
            assert torch.equal(out[m + ".weight"], qt._quantized_data), name
            assert torch.equal(out[m + ".weight_scale"].view(torch.uint8), s.view(torch.uint8)), name
            assert torch.equal(out[m + ".weight_scale_2"], s2.reshape(()).float()), name
            assert out[m + ".input_scale"].item() == pytest.approx(AMAX / (6 * 448), rel=1e-7)
            n_nvfp4 += 1
        else:
            qt, s = MXFP8QTensor.quantize(w)
            assert torch.equal(out[m + ".weight"].view(torch.uint8), qt._quantized_data.view(torch.uint8)), name
            assert torch.equal(out[m + ".weight_scale"], s.reshape(out[m + ".weight_scale"].shape)), name
            assert m + ".input_scale" not in out and m + ".weight_scale_2" not in out
            n_mxfp8 += 1
    assert n_nvfp4 == 40 * 4 * 3 and n_mxfp8 == 8 * 4 * 3


def test_gate_and_up_share_the_global_scale(converted):
    out = _load_all(converted)
    for layer in range(40):
        for e in range(4):
            p = f"model.layers.{layer}.mlp.experts.{e}."
            assert torch.equal(out[p + "gate_proj.weight_scale_2"], out[p + "up_proj.weight_scale_2"])
            assert torch.equal(out[p + "gate_proj.input_scale"], out[p + "up_proj.input_scale"])


def test_configs_are_modelopt_mixed_precision(tiny_src, converted):
    cfg = json.loads((converted / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "modelopt" and qc["quant_algo"] == "MIXED_PRECISION"
    layers = qc["quantized_layers"]
    assert layers["model.layers.0.mlp.experts.0.gate_proj"] == {"quant_algo": "NVFP4", "group_size": 16}
    assert layers["model.layers.47.mlp.experts.3.down_proj"]["quant_algo"] == "MXFP8"
    assert len(layers) == 48 * 4 * 3
    hf = json.loads((converted / "hf_quant_config.json").read_text())
    assert hf["producer"]["name"] == "modelopt" and hf["quantization"] == {k: v for k, v in qc.items() if k != "quant_method"}
    src_cfg = json.loads((tiny_src / "config.json").read_text())
    assert {k: v for k, v in cfg.items() if k != "quantization_config"} == src_cfg
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
              "preprocessor_config.json"):
        assert sha256_file(converted / f) == sha256_file(tiny_src / f)
    sums = dict(reversed(line.split("  ")) for line in (converted / "checksums.sha256").read_text().splitlines())
    for f, h in sums.items():
        assert sha256_file(converted / f) == h
    assert not (converted / ".inkling-quant-convert.json").exists()
    report = json.loads((converted.parent / "report.json").read_text())
    assert report["tensors_by_format"]["nvfp4"] == 480 and report["bytes_out"] < report["bytes_in"]


def test_other_schemes_are_data(tiny_src, tmp_path):
    for scheme, fmt in (("nvfp4", "NVFP4"), ("mxfp8", "MXFP8")):
        out = tmp_path / scheme
        assert main(["convert", str(tiny_src), str(out), "--scheme", scheme, "--weight-only", "--quiet"]) == 0
        algos = {v["quant_algo"] for v in json.loads((out / "config.json").read_text())["quantization_config"]["quantized_layers"].values()}
        assert algos == ({"W4A16_NVFP4"} if fmt == "NVFP4" else {"MXFP8"})
        names = _load_all(out)
        assert not any(n.endswith("input_scale") for n in names)


def test_activation_scales_file_and_missing_scales(tiny_src, tmp_path, capsys):
    assert main(["convert", str(tiny_src), str(tmp_path / "x"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "--activation-scales" in err and "--weight-only" in err and "--default-activation-amax" in err
    assert not (tmp_path / "x" / "model.safetensors.index.json").exists()
    amax = {f"model.layers.{i}.mlp.experts.{e}.{p}": 1.0 + i + e / 10
            for i in range(40) for e in range(4) for p in ("gate_proj", "up_proj", "down_proj")}
    amax["model.layers.0.mlp.experts.0.up_proj"] = 9.0  # gate/up read the same input: max wins
    (tmp_path / "amax.json").write_text(json.dumps(amax))
    out = tmp_path / "cal"
    assert main(["convert", str(tiny_src), str(out), "--activation-scales", str(tmp_path / "amax.json"), "--quiet"]) == 0
    t = _load_all(out)
    assert t["model.layers.3.mlp.experts.2.down_proj.input_scale"].item() == pytest.approx(4.2 / 2688, rel=1e-6)
    assert t["model.layers.0.mlp.experts.0.gate_proj.input_scale"].item() == pytest.approx(9.0 / 2688, rel=1e-6)


def test_existing_output_refused_then_overwrite(tiny_src, tmp_path, capsys):
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    assert main(["convert", str(tiny_src), str(out), "--weight-only", "--quiet"]) == 2
    assert "--resume" in capsys.readouterr().err and (out / "keep.txt").exists()
    assert main(["convert", str(tiny_src), str(out), "--weight-only", "--quiet", "--overwrite"]) == 0
    assert not (out / "keep.txt").exists()


def test_gate_up_in_different_source_shards(tmp_path):
    src = write_checkpoint(tmp_path / "split", "tiny", layers=2, experts=2, max_shard_bytes=13_000, layout="legacy")
    ck = Checkpoint.open(src)
    p = "model.layers.0.mlp.experts.1."
    assert ck.weight_map[p + "gate_proj.weight"] != ck.weight_map[p + "up_proj.weight"]
    out = tmp_path / "o"
    assert main(["convert", str(src), str(out), "--default-activation-amax", "2", "--quiet", "--max-shard-size", "20KB"]) == 0
    t = _load_all(out)
    assert torch.equal(t[p + "gate_proj.weight_scale_2"], t[p + "up_proj.weight_scale_2"])
    both = torch.cat([_load_all(src)[p + "gate_proj.weight"].float().abs().reshape(-1),
                      _load_all(src)[p + "up_proj.weight"].float().abs().reshape(-1)])
    assert t[p + "gate_proj.weight_scale_2"].item() == pytest.approx(both.max().item() / 2688, rel=1e-6)


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


# ----------------------------------------------------------------------------- bad input
def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _first_expert_shard(root: Path) -> tuple[str, str]:
    wm = json.loads((root / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.layers.1.mlp.experts.0.gate_proj.weight"
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
    idx["weight_map"]["model.layers.0.mlp.experts.0.gate_proj.weight"] = target
    (src / "model.safetensors.index.json").write_text(json.dumps(idx))
    _convert_fails(src, tmp_path, capsys, expect)


def test_shape_disagrees_with_config(tiny_src, tmp_path, capsys):
    src = _copy(tiny_src, tmp_path / "s")
    cfg = json.loads((src / "config.json").read_text())
    cfg["moe_intermediate_size"] = 128
    (src / "config.json").write_text(json.dumps(cfg))
    _convert_fails(src, tmp_path, capsys, "disagrees with config.json", "mlp.experts")


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


@pytest.mark.parametrize("name", ["model.layers.2.mlp.experts.1.down_proj.weight", "model.layers.2.self_attn.q_proj.weight"])
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
    raw = (src / shard).read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = raw[8:8 + n].replace(name.encode(), b"model.layers.1.mlp.experts.0.gate_prox.weight")
    (src / shard).write_bytes(raw[:8] + header + raw[8 + n:])
    idx = json.loads((src / "model.safetensors.index.json").read_text())
    idx["weight_map"]["model.layers.1.mlp.experts.0.gate_prox.weight"] = idx["weight_map"].pop(name)
    (src / "model.safetensors.index.json").write_text(json.dumps(idx))
    _convert_fails(src, tmp_path, capsys, shard, "gate_prox", "not part of the Inkling 2 Small layout")


def test_already_quantized_source_refused(converted, tmp_path, capsys):
    _convert_fails(converted, tmp_path, capsys, "already quantized")


# kill -9 / SIGTERM / disk-full / lock / --part: tests/test_hardening.py


# ----------------------------------------------------------------------------- memory
def _cli(*args) -> list[str]:
    return [sys.executable, "-m", "inkling_quant.cli", *args]


def _peak_rss_mb(cmd: list[str]) -> float:
    proc = subprocess.Popen(cmd)
    _, status, usage = os.wait4(proc.pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    return usage.ru_maxrss / 1024


def test_peak_rss_bounded_by_tensors_not_shard(tmp_path):
    # one ~800 MB shard of real-size expert tensors (3488 x 3072 bf16 = 21 MB each)
    src = write_checkpoint(tmp_path / "big", "bench", layers=1, experts=6, max_shard_bytes=10**10, layout="legacy")
    (shard,) = Checkpoint.open(src).shards
    shard_mb = (src / shard).stat().st_size / 1e6
    assert shard_mb > 500
    largest_mb = 16384 * 3072 * 2 / 1e6  # the embedding / LM head
    base = _peak_rss_mb([sys.executable, "-c", "import inkling_quant.convert, torch; torch.zeros(1)"])
    peak = _peak_rss_mb(_cli("convert", str(src), str(tmp_path / "o"), "--default-activation-amax", "4", "--quiet"))
    print(f"shard {shard_mb:.0f} MB, baseline {base:.0f} MB, peak {peak:.0f} MB")
    assert peak - base < 4 * largest_mb + 64
    assert peak - base < shard_mb / 3
