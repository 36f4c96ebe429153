"""FP8 block-scaled and MXFP4 sources (docs/convert.md, "Sources we accept"): tiny DeepSeek-V3,
Qwen3-MoE (bf16 scales) and gpt-oss checkpoints in the released layouts (tests/sources_reference.py:
transformers' save_pretrained, then the published quantizers), converted and held bit for bit to
ModelOpt's quantizers on the exactly dequantized experts; the FP8 modules outside the experts kept
byte for byte (ModelOpt's FP8_PB_WO form) or dequantized; verify --against them; inspect, plan and
lora on them; bad scales refused by name; sources never modified."""
from __future__ import annotations

import hashlib
import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import sources_reference as ref
from modelopt_reference import read_tensors
from inkling_quant.convert import Options, convert
from inkling_quant.errors import CheckpointError, ConfigError, FormatError, UsageError
from inkling_quant.verify import verify

AMAX = 2.0            # --default-activation-amax
GLOBAL_DIV = 6.0 * 448.0


def _hashes(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("sources")
    ds = ref.deepseek_v3(root / "ds-bf16")
    qw = ref.qwen3_moe(root / "qw-bf16")
    go = ref.gpt_oss(root / "go-bf16")
    out = {"ds": ref.to_fp8(ds, root / "ds-fp8"), "qw": ref.to_fp8(qw, root / "qw-fp8", torch.bfloat16),
           "go": ref.to_mxfp4(go, root / "go-mxfp4"), "root": root}
    out["hashes"] = {k: _hashes(v) for k, v in out.items() if k in ("ds", "qw", "go")}
    return out


def _convert(src: Path, out: Path, **kw) -> dict:
    opts = Options(**{"default_activation_amax": AMAX, **kw})
    return convert(str(src), out, opts, quiet=True)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.element_size() == 1 else t


def _modelopt():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from modelopt.torch.quantization.qtensor import MXFP8QTensor, NVFP4QTensor
    return NVFP4QTensor, MXFP8QTensor


def _check_nvfp4(out: dict, prefix: str, ws: dict[str, torch.Tensor], fused: tuple[str, str]) -> None:
    """ModelOpt's NVFP4QTensor on the fp32 weights, gate and up under their shared amax."""
    NVFP4QTensor, _ = _modelopt()
    shared = torch.maximum(*[ws[p].abs().max() for p in fused])
    for proj, w in ws.items():
        amax = shared if proj in fused else w.abs().max()
        q, sc, s2 = NVFP4QTensor.quantize(w, 16, None, amax.float() / GLOBAL_DIV)
        assert torch.equal(out[f"{prefix}{proj}.weight"], q._quantized_data), proj
        assert torch.equal(_bits(out[f"{prefix}{proj}.weight_scale"]), _bits(sc)), proj
        assert torch.equal(out[f"{prefix}{proj}.weight_scale_2"], s2.reshape(())), proj
        assert float(out[f"{prefix}{proj}.input_scale"]) == float(torch.tensor(AMAX) / GLOBAL_DIV)


def _check_mxfp8(out: dict, prefix: str, ws: dict[str, torch.Tensor]) -> None:
    _, MXFP8QTensor = _modelopt()
    for proj, w in ws.items():
        q, e8 = MXFP8QTensor.quantize(w)
        assert torch.equal(_bits(out[f"{prefix}{proj}.weight"]), _bits(q._quantized_data)), proj
        assert torch.equal(out[f"{prefix}{proj}.weight_scale"].reshape(-1), e8.reshape(-1)), proj


# ------------------------------------------------------------------------------ FP8 block-scaled
def test_deepseek_fp8_experts_bit_exact_to_modelopt_and_the_rest_kept(sources, tmp_path):
    """Experts: NVFP4 (layer 1) / MXFP8 (layer 2) of the exact fp32 dequantization, bit for bit
    what ModelOpt's quantizers make of it; every FP8 module outside the experts its bytes kept
    (scale viewed [gm, 1, gn, 1]: ModelOpt's FP8_PB_WO) and declared; everything else as it is."""
    src = load_file(sources["ds"] / "model.safetensors")
    report = _convert(sources["ds"], tmp_path / "o")
    out = read_tensors(tmp_path / "o")
    for e in range(4):
        p = f"model.layers.1.mlp.experts.{e}."
        _check_nvfp4(out, p, {k: ref.fp8_dequantize(src[f"{p}{k}.weight"], src[f"{p}{k}.weight_scale_inv"])
                              for k in ("gate_proj", "up_proj", "down_proj")}, ("gate_proj", "up_proj"))
        p = f"model.layers.2.mlp.experts.{e}."
        _check_mxfp8(out, p, {k: ref.fp8_dequantize(src[f"{p}{k}.weight"], src[f"{p}{k}.weight_scale_inv"])
                              for k in ("gate_proj", "up_proj", "down_proj")})
    kept = []
    for k, v in src.items():
        routed = ".mlp.experts." in k
        if k.endswith(".weight_scale_inv") and not routed:
            w, module = k[: -len("_scale_inv")], k[: -len(".weight_scale_inv")]
            assert torch.equal(_bits(out[w]), _bits(src[w])), w
            s = out[f"{module}.weight_scale"]
            assert s.dtype == torch.float32 and s.shape == (v.shape[0], 1, v.shape[1], 1)
            assert torch.equal(s.reshape(v.shape), v)
            kept.append(module)
        elif not routed and v.dtype != torch.float8_e4m3fn:
            assert torch.equal(out[k], v), k
    assert any("kv_a_proj_with_mqa" in m for m in kept) and any("shared_experts" in m for m in kept)
    assert not [k for k in out if k.endswith("_scale_inv")]
    q = json.loads((tmp_path / "o" / "config.json").read_text())["quantization_config"]
    assert {m: q["quantized_layers"][m] for m in kept} == {m: {"quant_algo": "fp8_pb_wo"} for m in kept}
    assert q["quantized_layers"]["model.layers.1.mlp.experts"] == {"quant_algo": "NVFP4", "group_size": 16}
    assert {"quant_algo": "fp8_pb_wo", "targets": sorted(kept)} in q["config_groups"].values()
    assert report["tensors_by_format"]["fp8_block"] == len(kept)
    assert verify(tmp_path / "o", against=sources["ds"]).exit_code == 0
    assert verify(tmp_path / "o").exit_code == 0


def test_deepseek_fp8_dequantized_modules_equal_transformers_reading(sources, tmp_path):
    """--dequantize-fp8: the modules outside the experts are bf16(exact fp32 dequantization), what
    transformers 5.25's own FP8 loader (CPU: dequantize) gives for the 128-aligned ones."""
    import transformers as T

    src = load_file(sources["ds"] / "model.safetensors")
    _convert(sources["ds"], tmp_path / "o", dequantize_fp8=True, scheme="nvfp4")
    out = read_tensors(tmp_path / "o")
    for k, v in src.items():
        if k.endswith(".weight_scale_inv") and ".mlp.experts." not in k:
            w = k[: -len("_scale_inv")]
            assert out[w].dtype == torch.bfloat16 and torch.equal(out[w], ref.fp8_dequantize(src[w], v).bfloat16()), w
            assert w[: -len("weight")] + "weight_scale" not in out
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = T.AutoModelForCausalLM.from_pretrained(sources["ds"], dtype=torch.bfloat16)
    sd = model.state_dict()
    for w in ("model.layers.1.self_attn.o_proj.weight", "model.layers.1.self_attn.kv_b_proj.weight",
              "model.layers.0.mlp.down_proj.weight"):   # aligned: transformers' grid-derived blocks are right
        assert torch.equal(sd[w], out[w]), w
    q = json.loads((tmp_path / "o" / "config.json").read_text())["quantization_config"]
    assert q["quant_algo"] == "NVFP4" and "quantized_layers" not in q  # one format: ModelOpt's one-format form
    assert "model.layers.1.self_attn*" in q["ignore"]  # the dequantized modules are among the exclusions
    assert verify(tmp_path / "o", against=sources["ds"]).exit_code == 0


def test_qwen3_fp8_bf16_scales(sources, tmp_path):
    """Qwen3's FP8 releases store weight_scale_inv in bf16: it widens exactly; the kept scale is
    written fp32 (ModelOpt's and vLLM's dtype)."""
    src = load_file(sources["qw"] / "model.safetensors")
    assert src["model.layers.0.mlp.experts.0.gate_proj.weight_scale_inv"].dtype == torch.bfloat16
    _convert(sources["qw"], tmp_path / "o", scheme="nvfp4")
    out = read_tensors(tmp_path / "o")
    p = "model.layers.1.mlp.experts.3."
    _check_nvfp4(out, p, {k: ref.fp8_dequantize(src[f"{p}{k}.weight"], src[f"{p}{k}.weight_scale_inv"])
                          for k in ("gate_proj", "up_proj", "down_proj")}, ("gate_proj", "up_proj"))
    s = src["model.layers.0.self_attn.q_proj.weight_scale_inv"]
    assert torch.equal(out["model.layers.0.self_attn.q_proj.weight_scale"].reshape(s.shape), s.float())
    assert verify(tmp_path / "o", against=sources["qw"]).exit_code == 0


def test_scheme_none_copies_a_quantized_source(sources, tmp_path):
    _convert(sources["qw"], tmp_path / "o", scheme="none")
    src, out = load_file(sources["qw"] / "model.safetensors"), read_tensors(tmp_path / "o")
    assert src.keys() == out.keys() and all(torch.equal(_bits(src[k]), _bits(out[k])) for k in src)
    cfg = json.loads((tmp_path / "o" / "config.json").read_text())
    assert cfg["quantization_config"] == json.loads((sources["qw"] / "config.json").read_text())["quantization_config"]


# ------------------------------------------------------------------------------ verify of a --scheme none copy
def _patch(ckpt: Path, tensor: str, at: int, value: bytes) -> None:
    """Overwrite bytes `at` of `tensor` in its shard in place (header untouched), and drop
    checksums.sha256 so only the value and passthrough checks can see it."""
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    path = ckpt / index["weight_map"][tensor]
    raw = bytearray(path.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    begin = 8 + n + json.loads(raw[8:8 + n])[tensor]["data_offsets"][0]
    raw[begin + at:begin + at + len(value)] = value
    path.write_bytes(bytes(raw))
    (ckpt / "checksums.sha256").unlink(missing_ok=True)


def _failed(report, tensor: str) -> set[str]:
    """The checks whose problems name `tensor`."""
    return {c.id for c in report.checks for p in c.problems if p.tensor == tensor}


@pytest.fixture(scope="module")
def copies(sources, tmp_path_factory):
    root = tmp_path_factory.mktemp("copies")
    for k in ("ds", "qw", "go"):
        _convert(sources[k], root / k, scheme="none")
    return root


@pytest.mark.parametrize("src", ["ds", "qw", "go"])
def test_verify_passes_a_scheme_none_copy(sources, copies, src):
    """A --scheme none copy of an FP8 or MXFP4 source is checked as that source: its tensors as
    convert accepts them, the source format's value rules, every byte the source's (--against);
    no numerics (nothing quantized by convert)."""
    for kw in ({}, {"scheme": "none"}, {"against": sources[src]}, {"against": sources[src], "scheme": "none"}):
        r = verify(copies / src, **kw)
        assert r.exit_code == 0, (kw, [(c.id, c.problems[:2]) for c in r.failures()])
        assert r.check("layout").figures["stored_as"] and r.check("config").figures["stored_as"]
    assert r.check("numerics").status == "skip" and "stored as the source" in r.check("numerics").message
    pt = r.check("passthrough").figures
    assert pt["tensors_compared"] == len(load_file(sources[src] / "model.safetensors"))
    assert verify(copies / src, scheme="nvfp4").exit_code == 1


@pytest.mark.parametrize("src, tensor, at, value", [
    ("ds", "model.layers.1.mlp.experts.0.gate_proj.weight", 5, b"\x7f"),          # NaN e4m3 byte
    ("ds", "model.layers.1.self_attn.o_proj.weight", 0, b"\xff"),                # -NaN
    ("ds", "model.layers.1.mlp.experts.0.down_proj.weight_scale_inv", 0, bytes(4)),        # scale 0 (fp32)
    ("ds", "model.layers.0.self_attn.q_a_proj.weight_scale_inv", 0, b"\x00\x00\xc0\x7f"),  # NaN scale
    ("qw", "model.layers.1.self_attn.q_proj.weight_scale_inv", 0, bytes(2)),      # scale 0 (bf16)
    ("go", "model.layers.1.mlp.experts.gate_up_proj_scales", 3, b"\xff")])       # e8m0 NaN
def test_verify_fails_a_damaged_copy_naming_the_tensor(sources, copies, tmp_path, src, tensor, at, value):
    ckpt = tmp_path / "c"
    shutil.copytree(copies / src, ckpt)
    _patch(ckpt, tensor, at, value)
    for kw in ({}, {"against": sources[src]}):
        r = verify(ckpt, **kw)
        assert r.exit_code == 1 and any(i.startswith("values[") for i in _failed(r, tensor)), kw


@pytest.mark.parametrize("src, tensor", [("ds", "model.layers.1.mlp.experts.0.gate_proj.weight"),
                                         ("ds", "model.layers.0.mlp.down_proj.weight_scale_inv"),
                                         ("qw", "model.layers.1.mlp.experts.0.up_proj.weight_scale_inv"),
                                         ("go", "model.layers.0.mlp.experts.down_proj_blocks"),
                                         ("go", "model.layers.0.self_attn.q_proj.weight")])
def test_verify_against_fails_a_changed_byte_of_a_copy(sources, copies, tmp_path, src, tensor):
    """A byte changed to another valid value (no value rule sees it): passthrough names the tensor."""
    ckpt = tmp_path / "c"
    shutil.copytree(copies / src, ckpt)
    first = int(load_file(copies / src / "model-00001-of-00001.safetensors")[tensor].contiguous().view(torch.uint8)
                .reshape(-1)[0])  # the lowest mantissa bit of a float, no e4m3 NaN
    _patch(ckpt, tensor, 0, bytes([first ^ (1 if (first ^ 1) & 0x7F != 0x7F else 2)]))
    assert verify(ckpt).exit_code == 0
    r = verify(ckpt, against=sources[src])
    assert r.exit_code == 1 and _failed(r, tensor) == {"passthrough"}


@pytest.mark.parametrize("src, scheme, why", [("ds", "none", "copied as it is"),
                                              ("go", "default", "holds no FP8 block-scaled weights"),
                                              ("ds-bf16", "default", "float weights")])
def test_dequantize_fp8_where_it_does_not_apply_is_refused(sources, tmp_path, src, scheme, why):
    """--dequantize-fp8 never passes silently: not on a copy (scheme none), an MXFP4 or a BF16 source."""
    root = sources["root"] / src if src.endswith("bf16") else sources[src]
    with pytest.raises(UsageError, match=why):
        _convert(root, tmp_path / "o", scheme=scheme, dequantize_fp8=True)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("qc, says", [({"quant_method": "FP8", "weight_block_size": [128, 128]}, "quant_method is 'FP8'"),
                                      (None, "no quantization_config")])
def test_quantized_tensors_under_a_config_convert_does_not_read(sources, tmp_path, qc, says):
    """FP8 tensors whose config.json does not say fp8 (another spelling, or none): refused, the
    message saying what the config declares rather than only that scales are unexpected."""
    def edit(cfg):
        cfg.pop("quantization_config")
        if qc is not None:
            cfg["quantization_config"] = qc

    src = _with_config(sources["ds"], tmp_path / "src", edit)
    with pytest.raises(CheckpointError, match=says):
        _convert(src, tmp_path / "o")


def test_bf16_experts_under_an_mxfp4_config_say_so(sources, tmp_path):
    """gpt-oss BF16 experts (`gate_up_proj`) under the MXFP4 release's config: refused, saying
    the config describes them stored quantized (not an expert count that reads 'expert None')."""
    mxfp4 = json.loads((sources["go"] / "config.json").read_text())["quantization_config"]
    src = _with_config(sources["root"] / "go-bf16", tmp_path / "src",
                       lambda cfg: cfg.__setitem__("quantization_config", mxfp4))
    with pytest.raises(CheckpointError, match="quant_method 'mxfp4'") as err:
        _convert(src, tmp_path / "o")
    assert "None" not in str(err.value)


# ------------------------------------------------------------------------------ MXFP4 (gpt-oss)
def test_gpt_oss_mxfp4_to_nvfp4_is_modelopts_lossless_cast(sources, tmp_path):
    """Each expert's gate/up (interleaved rows) and down: ModelOpt 0.47's
    quantize_mxfp4_to_nvfp4_lossless per projection, gate and up under their shared k_max
    (build_w13_kmax_overrides), bit for bit; the report's block counts per layer are ModelOpt's."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from modelopt.torch.export.shard_cast_utils import mxfp4_kmax, quantize_mxfp4_to_nvfp4_lossless
    src = load_file(sources["go"] / "model.safetensors")
    report = _convert(sources["go"], tmp_path / "o")
    out = read_tensors(tmp_path / "o")
    counts = {}
    for layer in (0, 1):
        m = f"model.layers.{layer}.mlp.experts."
        n = ok = 0
        for e in range(4):
            b, s = src[m + "gate_up_proj_blocks"][e], src[m + "gate_up_proj_scales"][e]
            parts = {"gate_proj": (b[0::2], s[0::2]), "up_proj": (b[1::2], s[1::2]),
                     "down_proj": (src[m + "down_proj_blocks"][e], src[m + "down_proj_scales"][e])}
            kmax = {p: mxfp4_kmax(sc) for p, (_, sc) in parts.items()}
            kmax["gate_proj"] = kmax["up_proj"] = max(kmax["gate_proj"], kmax["up_proj"])
            for p, (blocks, scales) in parts.items():
                q, sc, s2, nb, nl = quantize_mxfp4_to_nvfp4_lossless(blocks.reshape(blocks.shape[0], -1), scales,
                                                                     kmax[p], "cpu")
                assert torch.equal(out[f"{m}{e}.{p}.weight"], q) and torch.equal(_bits(out[f"{m}{e}.{p}.weight_scale"]),
                                                                             _bits(sc)), (layer, e, p)
                assert torch.equal(out[f"{m}{e}.{p}.weight_scale_2"], s2), (layer, e, p)
                n, ok = n + nb, ok + nl
        counts[str(layer)] = {"lossless": ok, "rerounded": n - ok}
    assert report["mxfp4_to_nvfp4_blocks"] == counts and counts["0"]["rerounded"] > 0
    for k in ("model.layers.0.mlp.experts.gate_up_proj_bias", "model.layers.1.self_attn.sinks"):
        assert torch.equal(out[k], src[k])
    assert not [k for k in out if k.endswith(("_blocks", "_scales"))]
    assert verify(tmp_path / "o", against=sources["go"]).exit_code == 0
    assert verify(tmp_path / "o").exit_code == 0


def test_gpt_oss_mxfp4_to_mxfp8_exact(sources, tmp_path):
    """MXFP8 of the exactly dequantized experts (transformers' LUT decode, transposed to [out, in]),
    gate rows 0::2 and up rows 1::2 (modeling_gpt_oss.py: gate_up[..., ::2])."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    src = load_file(sources["go"] / "model.safetensors")
    _convert(sources["go"], tmp_path / "o", scheme="mxfp8")
    out = read_tensors(tmp_path / "o")
    m = "model.layers.1.mlp.experts."
    gu = convert_moe_packed_tensors(src[m + "gate_up_proj_blocks"], src[m + "gate_up_proj_scales"],
                                    dtype=torch.float32).transpose(1, 2)       # [E, 2I, H]
    dn = convert_moe_packed_tensors(src[m + "down_proj_blocks"], src[m + "down_proj_scales"],
                                    dtype=torch.float32).transpose(1, 2)
    for e in (0, 3):
        _check_mxfp8(out, f"{m}{e}.", {"gate_proj": gu[e, 0::2], "up_proj": gu[e, 1::2], "down_proj": dn[e]})
    assert verify(tmp_path / "o", against=sources["go"]).exit_code == 0


def test_gpt_oss_layout_bf16_and_mxfp4(sources, tmp_path):
    """gpt-oss's stacked experts are detected with gate/up interleaved (the family's record), the
    BF16 checkpoint transposed ([E, in, out]), the MXFP4 one not; a BF16 gpt-oss converts as the
    MXFP4 one does, rows 0::2 gate and 1::2 up of the [out, in] weight."""
    from inkling_quant.convert.planner import list_source, load_config
    from inkling_quant.convert.validation import validate_source

    for key, transposed, fmt in (("go-bf16", True, None), ("go", False, "mxfp4")):
        d = sources["root"] / key if key == "go-bf16" else sources[key]
        listing, _, _ = list_source(d, None, None)
        _, lay = validate_source(load_config(d), listing, str(d))
        assert lay.experts.stacked and lay.experts.interleaved and lay.experts.transposed == transposed
        assert (lay.source.format if lay.source else None) == fmt
        assert lay.classify("model.layers.0.mlp.experts.gate_up_proj_bias").part == "other"
        assert lay.classify("model.layers.0.mlp.router.weight").part == "router"
    d = sources["root"] / "go-bf16"
    _convert(d, tmp_path / "o", scheme="mxfp8")
    src, out = load_file(d / "model.safetensors"), read_tensors(tmp_path / "o")
    gu = src["model.layers.0.mlp.experts.gate_up_proj"][2].T.float()                # [2I, H]
    dn = src["model.layers.0.mlp.experts.down_proj"][2].T.float()
    _check_mxfp8(out, "model.layers.0.mlp.experts.2.", {"gate_proj": gu[0::2], "up_proj": gu[1::2], "down_proj": dn})


# ------------------------------------------------------------------------------ refusals
def _tamper(src: Path, dst: Path, fn) -> Path:
    """A copy of checkpoint `src` at `dst` whose state dict `fn` edited in place."""
    shutil.copytree(src, dst)
    sd = load_file(dst / "model.safetensors")
    fn(sd)
    save_file(sd, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _with_config(src: Path, dst: Path, fn) -> Path:
    """A copy of checkpoint `src` at `dst` whose config.json `fn` edited in place."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    fn(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("bad", [float("nan"), 0.0, -0.5, float("inf"), 1e-40])   # 1e-40: no finite 1/s
def test_bad_fp8_scales_are_refused_by_name(sources, tmp_path, bad):
    for name in ("model.layers.1.mlp.experts.2.up_proj.weight_scale_inv", "model.layers.2.self_attn.o_proj.weight_scale_inv"):
        d = _tamper(sources["ds"], tmp_path / f"s{name[13:15]}", lambda sd: sd[name].view(-1).__setitem__(1, bad))
        with pytest.raises(FormatError, match="not finite and > 0") as e:
            _convert(d, tmp_path / f"o{name[13:15]}")
        assert e.value.tensor == name and str(e.value.path).endswith("model.safetensors")
        assert not (tmp_path / f"o{name[13:15]}" / "model.safetensors.index.json").exists()


def test_wrong_scale_grid_and_missing_scale_refused_before_writing(sources, tmp_path):
    grid = "model.layers.1.self_attn.kv_a_proj_with_mqa.weight_scale_inv"   # [160, 256]: needs [2, 2]
    d = _tamper(sources["ds"], tmp_path / "grid", lambda sd: sd.__setitem__(grid, sd[grid][:1].contiguous()))
    with pytest.raises(CheckpointError, match=r"needs F32/BF16/F16/F8_E8M0 \[2, 2\]") as e:
        _convert(d, tmp_path / "o1")
    assert e.value.tensor == grid and not (tmp_path / "o1").exists()
    expert = "model.layers.1.mlp.experts.0.down_proj.weight_scale_inv"
    d = _tamper(sources["ds"], tmp_path / "grid2", lambda sd: sd.__setitem__(expert, sd[expert][:, :1].contiguous()))
    with pytest.raises(CheckpointError, match="disagrees with config.json") as e:
        _convert(d, tmp_path / "o2")
    assert e.value.tensor == expert
    d = _tamper(sources["ds"], tmp_path / "gone", lambda sd: sd.pop("model.layers.0.self_attn.o_proj.weight_scale_inv"))
    with pytest.raises(CheckpointError, match="weight_scale_inv' is missing") as e:
        _convert(d, tmp_path / "o3")
    assert e.value.tensor == "model.layers.0.self_attn.o_proj.weight"


def test_nan_e4m3_byte_and_nan_e8m0_scale_refused(sources, tmp_path):
    w = "model.layers.2.mlp.experts.1.gate_proj.weight"
    d = _tamper(sources["ds"], tmp_path / "nanbyte", lambda sd: sd[w].view(torch.uint8).view(-1).__setitem__(7, 0x7F))
    with pytest.raises(FormatError, match="NaN e4m3 byte") as e:
        _convert(d, tmp_path / "o1")
    assert e.value.tensor == w
    s = "model.layers.1.mlp.experts.down_proj_scales"
    d = _tamper(sources["go"], tmp_path / "nan8", lambda sd: sd[s].view(-1).__setitem__(5, 255))
    with pytest.raises(FormatError, match="255") as e:
        _convert(d, tmp_path / "o2")
    assert e.value.tensor == s


def test_expert_tensors_of_the_wrong_dtype_named_in_the_sources_terms(sources, tmp_path):
    """A routed expert's stored tensor in a dtype its source format does not store, or an FP8
    weight without its scale, or MXFP4 outside the experts: named, in the source format's terms
    (not "convert takes BF16/FP16/FP32", which a BF16 weight beside its scale would contradict)."""
    e = "model.layers.1.mlp.experts.2.up_proj.weight"
    s = "model.layers.0.mlp.experts.gate_up_proj_scales"

    def attn_mxfp4(sd):
        sd.pop("model.layers.0.self_attn.q_proj.weight")
        sd["model.layers.0.self_attn.q_proj.weight_blocks"] = torch.zeros(128, 8, 16, dtype=torch.uint8)
        sd["model.layers.0.self_attn.q_proj.weight_scales"] = torch.full((128, 8), 127, dtype=torch.uint8)
    for i, (src, fn, name, match) in enumerate((
            ("ds", lambda sd: sd.__setitem__(e, sd[e].float().bfloat16()), e, r"BF16 \[160, 256\]; the fp8_block weight .* is stored F8_E4M3"),
            ("ds", lambda sd: sd.__setitem__(e + "_scale_inv", sd[e + "_scale_inv"].double()), e + "_scale_inv",
             "F64 .* is stored F32/BF16/F16"),
            ("ds", lambda sd: sd.pop(e + "_scale_inv"), e, "companion .*weight_scale_inv' is missing"),
            ("go", lambda sd: sd.__setitem__(s, sd[s].float()), s, r"F32 \[4, 384, 8\]; the mxfp4 weight_scale .* is stored U8"),
            ("go", attn_mxfp4, "model.layers.0.self_attn.q_proj.weight_blocks", "outside the routed experts"))):
        d = _tamper(sources[src], tmp_path / f"s{i}", fn)
        with pytest.raises(CheckpointError, match=match) as err:
            _convert(d, tmp_path / f"o{i}")
        assert err.value.tensor == name and str(err.value.path).endswith("model.safetensors"), i
    d = _tamper(sources["go"], tmp_path / "e254", lambda sd: sd[s].fill_(254))   # 6 x 2^127: past fp32
    with pytest.raises(FormatError, match="past the fp32 range") as err:
        _convert(d, tmp_path / "o254")
    assert str(err.value).count(repr(s)) == 1 and err.value.tensor == s  # the scale, named once


def test_fp8_configs_this_reader_does_not_take(sources, tmp_path):
    for key, value, match in (("weight_block_size", [1, 128], "128x128 blocks only"),
                              ("activation_scheme", "static", "static")):
        d = _with_config(sources["qw"], tmp_path / key, lambda cfg: cfg["quantization_config"].__setitem__(key, value))
        with pytest.raises(ConfigError, match=match) as e:
            _convert(d, tmp_path / f"o-{key}")
        assert str(e.value.path).endswith("config.json")


def test_a_scheme_must_quantize_every_quantized_expert_layer(sources, tmp_path):
    rules = tmp_path / "s.json"
    rules.write_text(json.dumps({"rules": [{"part": "expert", "layers": "0", "format": "nvfp4"}]}))
    for src in ("qw", "go"):
        with pytest.raises(UsageError, match="unquantized|no entry"):
            _convert(sources[src], tmp_path / f"o{src}", scheme=str(rules))


# ------------------------------------------------------------------------------ inspect, plan, lora
def test_inspect_and_plan_read_quantized_sources(sources):
    from inkling_quant.inspect_cmd import summarize
    from inkling_quant.plan.hf import HFModel, weight_bytes

    for key, fmt in (("ds", "fp8_block"), ("go", "mxfp4")):
        s = summarize(sources[key])
        assert s.ok and s.expert_layers and all(r["format"] == fmt for r in s.expert_layers), (key, s.expert_layers)
        assert sum(p["bytes"] for p in s.parts.values()) == sum(e for e in _entry_bytes(sources[key]))
    s = summarize(sources["ds"])
    assert s.parts["attention"]["formats"]["fp8_block"] > 0 and s.detected["source_format"] == "fp8_block"
    _convert(sources["ds"], sources["root"] / "ds-out")
    o = summarize(sources["root"] / "ds-out")   # the output: its kept FP8_PB_WO modules recognised
    assert o.ok and o.parts["attention"]["formats"]["fp8_block"] == s.parts["attention"]["formats"]["fp8_block"]
    cfg = json.loads((sources["ds"] / "config.json").read_text())
    w = weight_bytes(HFModel.from_dict(cfg), "none", 1)
    fp8 = sum(b for (part, f), b in w.disk.items() if f == "fp8_block" and part != "expert")
    assert fp8 == sum(b for p, v in s.parts.items() if p != "expert" for f, b in v["formats"].items() if f == "fp8_block")
    # --scheme none leaves the experts as the source stores them, and labels them so
    assert w.disk[("expert", "fp8_block")] == s.parts["expert"]["formats"]["fp8_block"]


def _entry_bytes(d: Path):
    from inkling_quant.io.checkpoint import Checkpoint
    return [e.nbytes for h in Checkpoint.open(d).headers().values() for e in h.tensors.values()]


def test_lora_merge_refuses_a_quantized_base(sources, tmp_path):
    from inkling_quant.lora.merge import check

    with pytest.raises(UsageError, match="quantized source") as e:
        check(sources["ds"], tmp_path / "no-adapter")
    assert str(e.value.path).endswith("config.json")


def test_sources_never_modified(sources):
    assert {k: _hashes(sources[k]) for k in ("ds", "qw", "go")} == sources["hashes"]
