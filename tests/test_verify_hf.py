"""`inkling-quant verify` on Hugging Face MoE checkpoints (tests/hf_moe_reference.py: Qwen3-MoE,
Mixtral, DeepSeek-V3 and Qwen3-VL-MoE saved by transformers' own save_pretrained): NVIDIA
ModelOpt's own export of each and our convert of the same BF16 source pass every check, alone and
--against the source (stacked source experts compared with the unstacked output); verify's
numerics agree with an independent computation (ModelOpt's dequantization, transformers' expert
products); copies broken one defect each fail the right check, naming the file and the tensor."""
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hf_moe_reference import FAMILIES, export
from modelopt_reference import modelopt_dequantize
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from inkling_quant.cli import main
from inkling_quant.convert import Options, convert
from inkling_quant.formats import FORMATS, format_for_quant_algo
from inkling_quant.io.checkpoint import INDEX_NAME, SINGLE_NAME
from inkling_quant.io.safetensors import read_header, sha256_file
from inkling_quant.verify import ACT_ROWS, CHECKSUMS, PASS, SKIP, activations, verify

KINDS = ("modelopt", "ours")
EXPERTS = 4  # hf_moe_reference's tiny models


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """family -> {"src": BF16 by save_pretrained, "modelopt": ModelOpt's export, "ours": our convert}."""
    base = tmp_path_factory.mktemp("verify-hf")
    out = {}
    for f in FAMILIES:
        src, mo, ours = base / f"{f}-bf16", base / f"{f}-modelopt", base / f"{f}-ours"
        export(f, mo, src)
        convert(str(src), ours, Options(scheme="default", activation_scales=str(mo)), quiet=True)
        out[f] = {"src": src, "modelopt": mo, "ours": ours}
    return out


@pytest.fixture
def copy(exported, tmp_path):
    """A writable copy of one checkpoint: copy(family, kind) -> (its path, the BF16 source)."""
    def make(family: str, kind: str) -> tuple[Path, Path]:
        dst = tmp_path / f"{family}-{kind}"
        shutil.copytree(exported[family][kind], dst)
        return dst, exported[family]["src"]
    return make


# --------------------------------------------------------------------------- helpers
def _shards(root: Path) -> list[str]:
    if (root / INDEX_NAME).exists():
        return sorted(set(json.loads((root / INDEX_NAME).read_text())["weight_map"].values()))
    return [SINGLE_NAME]


def _shard_of(root: Path, name: str) -> str:
    return next(s for s in _shards(root) if name in read_header(root / s).tensors)


def _patch(root: Path, name: str, at: int, edit) -> str:
    """Byte `at` of tensor `name`, in place: new = edit(old)."""
    shard = _shard_of(root, name)
    begin = read_header(root / shard).tensors[name].begin
    with open(root / shard, "r+b") as f:
        f.seek(begin + at)
        old = f.read(1)[0]
        f.seek(begin + at)
        f.write(bytes([edit(old)]))
    return shard


def _rewrite(root: Path, name: str, edit) -> str:
    """The shard holding `name` rewritten with edit(tensors) applied; index and checksums follow
    (a 'clean lie': only the defect itself can show)."""
    shard = _shard_of(root, name)
    tensors = load_file(root / shard)
    edit(tensors)
    save_file(tensors, root / shard, metadata={"format": "pt"})
    if (root / INDEX_NAME).exists():
        idx = json.loads((root / INDEX_NAME).read_text())
        kept = {n: s for n, s in idx["weight_map"].items() if s != shard}
        idx["weight_map"] = {**kept, **dict.fromkeys(tensors, shard)}
        idx["metadata"]["total_size"] = sum(e.nbytes for s in set(idx["weight_map"].values())
                                            for e in read_header(root / s).tensors.values())
        (root / INDEX_NAME).write_text(json.dumps(idx))
    _reseal(root)
    return shard


def _reseal(root: Path) -> None:
    if (root / CHECKSUMS).exists():
        names = [line.split("  ", 1)[1] for line in (root / CHECKSUMS).read_text().splitlines()]
        (root / CHECKSUMS).write_text("".join(f"{sha256_file(root / n)}  {n}\n" for n in names))


def _failed(r) -> set[str]:
    return {c.id for c in r.failures()}


def _problem(r, check: str, file: str, tensor: str | None):
    for p in r.check(check).problems:
        if p.file.endswith(file) and p.tensor == tensor:
            return p
    seen = [str(p) for p in r.check(check).problems[:5]]
    raise AssertionError(f"{check}: no problem naming {file} / {tensor}: {seen}")


def _quantized_layers(root: Path) -> dict[str, dict]:
    return json.loads((root / "hf_quant_config.json").read_text())["quantization"]["quantized_layers"]


def _experts(family: str) -> str:
    return {"qwen3_vl_moe": "model.language_model.layers.{}.mlp.experts",
            "mixtral": "model.layers.{}.block_sparse_moe.experts"}.get(family, "model.layers.{}.mlp.experts")


# --------------------------------------------------------------------------- good
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_export_passes_every_check(exported, family, kind):
    src, out = exported[family]["src"], exported[family][kind]
    r = verify(out, against=src, sample=0)
    assert r.ok and r.exit_code == 0, r.format_summary()
    q = _quantized_layers(out)
    layers = {int(m.split("layers.")[1].split(".")[0]): m for m in q}
    ids = [c.id for c in r.checks]
    for must in ("config", "source", "layout", "passthrough", "gate_up", "checksums"):
        assert must in ids
    assert [i for i in ids if i.startswith("numerics[")] == [f"numerics[layer {i}]" for i in sorted(layers)]
    assert len(r.numerics) == len(layers) * EXPERTS * 3  # every expert's gate, up and down
    for n in r.numerics:
        f = format_for_quant_algo(q[layers[n["layer"]]]["quant_algo"])
        assert n["format"] == f.name and n["rel_error"] <= f.max_rel_error and n["cosine"] >= f.min_cosine
        assert n["tensor"].startswith(layers[n["layer"]] + f".{n['expert']}.")
    assert r.check("layout").figures["quantized_experts"] == {m: format_for_quant_algo(e["quant_algo"]).name
                                                              for m, e in q.items()}
    with safe_open(src / SINGLE_NAME, "pt") as h:
        others = [k for k in h.keys() if ".experts." not in k]  # shared_experts, dense MLPs, routers included
    assert r.check("passthrough").figures["tensors_compared"] == len(others)
    nvfp4 = sum(e["quant_algo"] == "NVFP4" for e in q.values())
    assert r.check("gate_up").figures["experts"] == nvfp4 * EXPERTS
    sums = r.check("checksums")
    want = (SKIP, True) if kind == "modelopt" else (PASS, False)  # ModelOpt writes none; convert does
    assert (sums.status, "--require-checksums" in sums.message) == want
    alone = verify(out)
    assert alone.ok, alone.format_summary()


def test_sharded_index_total_size_is_exact(tmp_path):
    """The index's metadata.total_size as transformers' save_pretrained (huggingface_hub's storage
    bytes) and ModelOpt's sharded export write it equals the tensors' bytes: verify passes both
    without a note. Only another writer's mismatch would be one (tests/test_safety.py)."""
    src, mo = tmp_path / "bf16", tmp_path / "modelopt"
    export("qwen3_moe", mo, src, batches=1, seq=8, max_shard_size="100KB")
    for ck in (src, mo):
        assert len(list(ck.glob("*.safetensors"))) > 1 and (ck / INDEX_NAME).is_file()
        r = verify(ck)
        index = r.check("index")
        assert r.ok and index.figures["index_total_size_matches"] and not index.message, r.format_summary()


@pytest.mark.parametrize("family", ["mixtral", "qwen3_vl_moe"])  # per-expert w1/w3/w2; stacked gate_up_proj
def test_numerics_agree_with_an_independent_computation(exported, family):
    """Each figure verify reports equals the same error computed apart: ModelOpt's own
    dequantization of the exported module, the source expert's product as transformers computes
    it (a stacked gate_up_proj: linear(x, gate_up_proj[e]).chunk(2, -1), modeling_qwen3_vl_moe)."""
    src, mo = exported[family]["src"], exported[family]["modelopt"]
    r = verify(mo, against=src, sample=0)
    assert r.ok, r.format_summary()
    s, q = load_file(src / SINGLE_NAME), load_file(mo / SINGLE_NAME)
    for n in r.numerics:
        module = n["tensor"][: -len(".weight")]
        x = activations(module, ACT_ROWS, q[n["tensor"]].shape[1] * (2 if n["format"] == "nvfp4" else 1)).float()
        if family == "mixtral":
            ref = F.linear(x, s[n["tensor"]].float())
        else:
            stack = module.rsplit(".", 2)[0]
            if n["module"] == "down_proj":
                ref = F.linear(x, s[f"{stack}.down_proj"][n["expert"]].float())
            else:
                gate, up = F.linear(x, s[f"{stack}.gate_up_proj"][n["expert"]].float()).chunk(2, dim=-1)
                ref = gate if n["module"] == "gate_proj" else up
        w = modelopt_dequantize({k.rsplit(".", 1)[1]: v for k, v in q.items() if k.rsplit(".", 1)[0] == module})
        y = F.linear(x, w).double()
        rel = float(torch.linalg.vector_norm(y - ref.double()) / torch.linalg.vector_norm(ref.double()))
        assert n["rel_error"] == pytest.approx(rel, rel=1e-4, abs=1e-6), n
        assert rel > 0.005  # a real quantization error, not a self-comparison


def test_stacked_source_as_the_hub_stores_it(exported, tmp_path):
    """Qwen3-VL-MoE on the Hub stores gate_up_proj [E, H, 2I], down_proj [E, I, H]: verify
    --against it gives exactly the figures of the [E, 2I, H] source it was transposed from."""
    src, mo = exported["qwen3_vl_moe"]["src"], exported["qwen3_vl_moe"]["modelopt"]
    hub = tmp_path / "hub"
    shutil.copytree(src, hub)
    sd = {k: (v.transpose(1, 2).contiguous() if k.endswith(("experts.gate_up_proj", "experts.down_proj")) else v)
          for k, v in load_file(src / SINGLE_NAME).items()}
    save_file(sd, hub / SINGLE_NAME, metadata={"format": "pt"})
    a, b = verify(mo, against=src, sample=0), verify(mo, against=hub, sample=0)
    assert b.ok, b.format_summary()
    assert [(n["tensor"], n["rel_error"]) for n in a.numerics] == [(n["tensor"], n["rel_error"]) for n in b.numerics]
    assert verify(hub).ok  # the source alone: stacked experts, transposed, pass through


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_source_alone(exported, family):
    src = exported[family]["src"]
    r = verify(src)
    assert r.ok and r.scheme == "none", r.format_summary()
    assert r.check("layout").figures["quantized_experts"] == {}
    assert r.check("checksums").status == SKIP
    strict = verify(src, require_checksums=True)
    assert strict.exit_code == 1 and _failed(strict) == {"checksums"}
    assert "checksums.sha256 not found" in _problem(strict, "checksums", CHECKSUMS, None).message


def test_require_checksums_on_the_command_line(exported, capsys):
    mo, ours = exported["qwen3_vl_moe"]["modelopt"], exported["qwen3_vl_moe"]["ours"]
    assert main(["verify", str(mo)]) == 0
    out = capsys.readouterr().out
    assert "skip checksums: no checksums.sha256" in out and "result: PASS (exit 0)" in out
    assert main(["verify", str(mo), "--require-checksums"]) == 1
    out = capsys.readouterr().out
    assert "FAIL checksums" in out and f"{mo}/{CHECKSUMS}: checksums.sha256 not found" in out
    assert "Traceback" not in out
    assert main(["verify", str(ours), "--require-checksums"]) == 0


# --------------------------------------------------------------------------- broken, one defect each
def _largest(src: Path, family: str, layer: int, e: int) -> tuple[int, int]:
    """(row, column) of expert e's largest gate weight in the source: a byte that matters."""
    s = load_file(src / SINGLE_NAME)
    if family == "qwen3_vl_moe":
        w = s[_experts(family).format(layer) + ".gate_up_proj"][e].chunk(2, dim=0)[0]
    else:
        w = s[f"{_experts(family).format(layer)}.{e}.gate_proj.weight"]
    i = int(w.float().abs().argmax())
    return divmod(i, w.shape[1])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layer", [0, 2])  # NVFP4, MXFP8
def test_flipped_byte_in_an_expert_weight(copy, kind, layer):
    """The sign bits of the byte holding expert 1's largest gate weight: every value stays valid,
    so only the numerics (and our checksums) can see it; they name the file and the tensor."""
    out, src = copy("qwen3_vl_moe", kind)
    name = _experts("qwen3_vl_moe").format(layer) + ".1.gate_proj.weight"
    row, col = _largest(src, "qwen3_vl_moe", layer, 1)
    nvfp4 = layer == 0
    cols = read_header(out / _shard_of(out, name)).tensors[name].shape[1]
    shard = _patch(out, name, row * cols + (col // 2 if nvfp4 else col), lambda b: b ^ (0x88 if nvfp4 else 0x80))
    r = verify(out, against=src, sample=0)
    assert r.exit_code == 1
    assert _failed(r) == {f"numerics[layer {layer}]"} | ({"checksums"} if kind == "ours" else set())
    msg = _problem(r, f"numerics[layer {layer}]", shard, name).message
    assert "expert 1 gate_proj" in msg and "do not reproduce the source" in msg
    assert [n["tensor"] for n in r.numerics if not n["pass"]] == [name]


@pytest.mark.parametrize("kind", KINDS)
def test_missing_weight_scale_2(copy, kind):
    out, src = copy("qwen3_vl_moe", kind)
    name = _experts("qwen3_vl_moe").format(1) + ".2.up_proj.weight_scale_2"
    _rewrite(out, name, lambda t: t.pop(name))
    r = verify(out, against=src)
    assert r.exit_code == 1 and _failed(r) == {"layout", "numerics[layer 1]"}
    listing = INDEX_NAME if kind == "ours" else SINGLE_NAME
    assert "missing: nvfp4 requires it (F32 [])" in _problem(r, "layout", listing, name).message
    assert "tensor missing" in _problem(r, "numerics[layer 1]", listing, name).message


@pytest.mark.parametrize("kind", KINDS)
def test_wrong_quantized_layers_entry(copy, kind):
    """hf_quant_config.json calls layer 2's MXFP8 experts NVFP4 (config.json left right)."""
    out, _ = copy("mixtral", kind)
    module = _experts("mixtral").format(2)
    hq = json.loads((out / "hf_quant_config.json").read_text())
    hq["quantization"]["quantized_layers"][module] = {"quant_algo": "NVFP4", "group_size": 16}
    (out / "hf_quant_config.json").write_text(json.dumps(hq))
    _reseal(out)
    r = verify(out)
    assert r.exit_code == 1 and _failed(r) == {"config"}
    msg = _problem(r, "config", "hf_quant_config.json", f"{module}.0.w1.weight").message
    assert "quantized_layers" in msg and "'NVFP4', the tensors are 'MXFP8'" in msg
    assert "disagrees with config.json" in _problem(r, "config", "hf_quant_config.json", None).message


@pytest.mark.parametrize("kind", KINDS)
def test_nan_scale(copy, kind):
    out, src = copy("deepseek_v3", kind)
    weight = _experts("deepseek_v3").format(1) + ".3.down_proj.weight"
    name = weight + "_scale"
    shard = _patch(out, name, 5, lambda b: 0x7F)  # e4m3 NaN
    r = verify(out, against=src, sample=0)
    assert r.exit_code == 1
    assert _failed(r) == {f"values[{shard}]", "numerics[layer 1]"} | ({"checksums"} if kind == "ours" else set())
    msg = _problem(r, f"values[{shard}]", shard, name).message
    assert f"must be finite and positive (e4m3 scale) (weight_scale of {weight[:-7]}): element 5 is 0x7F (nan)" == msg
    assert "expert 3 down_proj" in _problem(r, "numerics[layer 1]", shard, weight).message


@pytest.mark.parametrize("kind", KINDS)
def test_zero_block_scale_of_modelopt_encoder(copy, kind):
    """ModelOpt's rule floors NVFP4 block scales at 2^-9: a zero one is refused in its form (the
    release's rule writes zeros for blocks near 0: tests/test_safety.py's zero experts)."""
    out, _ = copy("deepseek_v3", kind)
    weight = _experts("deepseek_v3").format(1) + ".3.down_proj.weight"
    name = weight + "_scale"
    shard = _patch(out, name, 5, lambda b: 0x00)
    r = verify(out)
    assert r.exit_code == 1 and f"values[{shard}]" in _failed(r)
    msg = _problem(r, f"values[{shard}]", shard, name).message
    assert "must be finite and positive (e4m3 scale)" in msg and "element 5 is 0x00" in msg


def test_e8m0_scale_of_255(copy):
    out, _ = copy("qwen3_moe", "modelopt")
    name = _experts("qwen3_moe").format(2) + ".0.up_proj.weight_scale"
    shard = _patch(out, name, 1, lambda b: 0xFF)
    r = verify(out)
    assert _failed(r) == {f"values[{shard}]"}
    assert "e8m0 exponent in range (not 0xFF)" in _problem(r, f"values[{shard}]", shard, name).message


@pytest.mark.parametrize("kind", KINDS)
def test_changed_pass_through_tensor(copy, kind):
    out, src = copy("deepseek_v3", kind)
    name = "model.layers.1.mlp.shared_experts.up_proj.weight"  # shared experts pass through
    shard = _patch(out, name, 6, lambda b: b ^ 0x01)  # a mantissa bit: still a finite bf16
    r = verify(out, against=src)
    assert _failed(r) == {"passthrough"} | ({"checksums"} if kind == "ours" else set())
    assert "at byte 6 of the tensor: pass-through must be bit-exact" in _problem(r, "passthrough", shard, name).message


@pytest.mark.parametrize("kind", KINDS)
def test_gate_and_up_with_different_global_scales(copy, kind):
    """vLLM fuses w1/w3 under one weight_scale_2: Mixtral's w3 with its own is named."""
    out, _ = copy("mixtral", kind)
    name = _experts("mixtral").format(0) + ".2.w3.weight_scale_2"
    _rewrite(out, name, lambda t: t.update({name: t[name] * 2}))
    r = verify(out)
    assert r.exit_code == 1 and _failed(r) == {"gate_up"}
    assert "vLLM fuses gate and up" in _problem(r, "gate_up", _shard_of(out, name), name).message


def test_a_scale_outside_the_routed_experts(copy):
    """Only routed experts are quantized: a scale beside a shared expert is unexpected."""
    out, src = copy("deepseek_v3", "modelopt")
    name = "model.layers.1.mlp.shared_experts.up_proj.weight_scale_2"
    shard = _rewrite(out, "model.layers.1.mlp.shared_experts.up_proj.weight",
                     lambda t: t.update({name: torch.tensor(0.5)}))
    r = verify(out)
    assert _failed(r) == {"layout"}
    assert "shared_expert tensor stored as F32 named as a scale" in _problem(r, "layout", shard, name).message
    r = verify(out, against=src)
    assert "the source has no such tensor" in _problem(r, "layout", shard, name).message


def test_a_missing_expert_module(copy):
    """Mixtral's config says nothing of dense layers: every layer's experts, every module, are required."""
    out, src = copy("mixtral", "ours")
    prefix = _experts("mixtral").format(1) + ".3.w2."
    _rewrite(out, prefix + "weight", lambda t: [t.pop(k) for k in list(t) if k.startswith(prefix)])
    r = verify(out)
    assert r.exit_code == 1 and _failed(r) == {"layout"}
    assert r.check("layout").problem_count == len(FORMATS["nvfp4"].out_specs((64, 32), torch.bfloat16))
    assert "missing: nvfp4 requires it (U8 [64, 16])" in _problem(r, "layout", INDEX_NAME, prefix + "weight").message


def test_another_familys_source_is_refused(exported, capsys):
    """--against a source of another family: the source check names what differs; exit 1."""
    r = verify(exported["mixtral"]["modelopt"], against=exported["qwen3_moe"]["src"])
    assert r.exit_code == 1 and "source" in _failed(r)
    assert "differs from the source's config.json" in _problem(r, "source", "config.json", None).message
    assert main(["verify", str(exported["mixtral"]["modelopt"]), "--against", str(exported["qwen3_moe"]["src"])]) == 1
    assert "Traceback" not in capsys.readouterr().out
