"""convert on the published Inkling 2 layout (synth: transformers' names,
stacked row-interleaved experts) into the Inkling stacked form (export/inkling.py), checked
against independent paths: the per-module quantization of each expert's gate, up and down
taken apart from the source, and transformers' own inkling2_loop dequantization ops."""
from __future__ import annotations

import json

import pytest
import torch

from modelopt_reference import read_tensors
from inkling_quant.convert import Options, convert
from inkling_quant.errors import CheckpointError, FormatError
from inkling_quant.export.inkling import unstack_expert
from inkling_quant.formats import FORMATS
from inkling_quant.export.inkling import projection_specs
from inkling_quant.model.inkling2 import Inkling2Config
from inkling_quant.synth import write_checkpoint

LAYERS, AMAX = 6, 4.0  # the default scheme: NVFP4 experts in layers 0-4, MXFP8 in layer 5


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("orig")
    src = write_checkpoint(tmp / "src", "tiny", layers=LAYERS)
    report = convert(src, tmp / "out", Options(default_activation_amax=AMAX, max_shard_bytes=1 << 17), quiet=True)
    return src, tmp / "out", report


def expert_format(layer: int) -> str:
    return "nvfp4" if layer < 5 else "mxfp8"


def test_everything_but_the_experts_is_bit_exact_and_experts_are_stacked(pair):
    src, out, report = pair
    s, o = read_tensors(src), read_tensors(out)
    assert report["shards"] > 1
    experts = {n for n in s if ".mlp.experts." in n}
    for name in set(s) - experts:
        assert o[name].dtype == s[name].dtype and torch.equal(bits(o[name]), bits(s[name])), name
    want = set(s) - experts
    for layer in range(LAYERS):
        fmt = FORMATS[expert_format(layer)]
        for proj in ("w13", "w2"):
            name = f"model.llm.layers.{layer}.mlp.experts.{proj}_weight"
            for k, spec in projection_specs(fmt, proj, tuple(s[name].shape)).items():
                got = o[f"model.llm.layers.{layer}.mlp.experts.{k}"]
                assert (tuple(got.shape), got.dtype) == (tuple(spec.shape), spec.dtype), k
                want.add(f"model.llm.layers.{layer}.mlp.experts.{k}")
    assert set(o) == want


def test_expert_values_equal_quantizing_gate_up_down_apart(pair):
    """Unstacked, every expert's tensors are bit for bit what the format's release encoder (the
    inkling form's) writes for its gate, up (under their fused amax) and down taken out of the
    source on their own, with the activation amax given: quantizing the interleaved slab as stored
    is quantizing gate and up apart."""
    src, out, _ = pair
    s, o = read_tensors(src), read_tensors(out)
    for layer in range(LAYERS):
        fmt = FORMATS[expert_format(layer)]
        p = f"model.llm.layers.{layer}.mlp.experts."
        stacked = {k[len(p):]: v for k, v in o.items() if k.startswith(p)}
        w13, w2 = s[p + "w13_weight"], s[p + "w2_weight"]
        ia = AMAX if fmt.static_activation_scale else None
        for e in range(w13.shape[0]):
            gate, up = w13[e, 0::2].contiguous(), w13[e, 1::2].contiguous()
            ga = fmt.fused_global_amax([gate, up])
            want = {"gate_proj": fmt.quantize(gate, global_amax=ga, input_amax=ia, encoder="release"),
                    "up_proj": fmt.quantize(up, global_amax=ga, input_amax=ia, encoder="release"),
                    "down_proj": fmt.quantize(w2[e].contiguous(), input_amax=ia, encoder="release")}
            got = unstack_expert(fmt, stacked, e)
            for mod in want:
                assert set(got[mod]) == set(want[mod]) - {"weight_amax"}  # stored as the stacked amax
                if "weight_amax" in want[mod]:
                    proj = "w2" if mod == "down_proj" else "w13"
                    assert torch.equal(stacked[f"{proj}_weight_amax"][e], want[mod]["weight_amax"])
                for k in got[mod]:
                    assert torch.equal(bits(got[mod][k]), bits(want[mod][k])), (layer, e, mod, k)


def test_transformers_reads_the_experts(pair):
    """transformers' inkling2_loop ops (Inkling2LoopDequantizeExperts + Interleave) on our
    output give our formats' dequantization of the same experts (MXFP8 bit for bit; NVFP4 within
    the one-ulp rounding-order difference test_stacked documents)."""
    test_stacked = pytest.importorskip("test_stacked")
    src, out, _ = pair
    o = read_tensors(out)
    for layer in (0, 5):
        fmt = FORMATS[expert_format(layer)]
        p = f"model.llm.layers.{layer}.mlp.experts."
        stacked = {k[len(p):]: v for k, v in o.items() if k.startswith(p)}
        gate_up, down = test_stacked.transformers_dequant(stacked)
        experts = [unstack_expert(fmt, stacked, e) for e in range(gate_up.shape[0])]
        ours_gu, ours_d = test_stacked.expected_from_experts(experts, lambda t: fmt.dequantize(t, torch.float32))
        if fmt.name == "mxfp8":
            assert torch.equal(bits(gate_up), bits(ours_gu)) and torch.equal(bits(down), bits(ours_d))
        else:
            for got, ours, mods in ((gate_up, ours_gu, ("gate_proj", "up_proj")), (down, ours_d, ("down_proj",))):
                packed = torch.stack([torch.cat([x[m]["weight"] for m in mods]) for x in experts])
                test_stacked.assert_one_ulp_on_odd_codes(ours, got, packed)


def test_quantization_config_names_each_layers_experts(pair):
    src, out, _ = pair
    q = json.loads((out / "config.json").read_text())["quantization_config"]
    assert q["quant_algo"] == "MIXED_PRECISION"
    nv = {"quant_algo": "NVFP4", "group_size": 16, "encoder": "nvfp4_nearest", "scales": "amax_denominator"}
    mx = {"quant_algo": "MXFP8", "group_size": 32, "encoder": "mxfp8_nearest", "scales": "ue8m0"}
    assert q["quantized_layers"] == {f"model.llm.layers.{i}.mlp.experts": nv for i in range(5)} | \
        {"model.llm.layers.5.mlp.experts": mx}
    assert "model.llm.layers.*.attn*" in q["exclude_modules"]
    hq = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    assert hq["quantized_layers"] == q["quantized_layers"]
    assert hq["modelopt_quant_config"] == q["modelopt_quant_config"]
    cfg = Inkling2Config.load(out)  # the rest of config.json is the source's
    assert cfg == Inkling2Config.load(src)


def _modelopt_preset(name: str) -> dict[str, dict]:
    """nvidia-modelopt's own preset recipe `name`: its weight and input quantizers' attributes
    (num_bits, block_sizes; None where the preset disables the quantizer)."""
    from modelopt.torch.quantization import config as mtq_config
    out = {}
    for entry in getattr(mtq_config, name)["quant_cfg"]:
        kind = {"*weight_quantizer": "weight", "*input_quantizer": "input"}.get(entry["quantizer_name"])
        if kind is not None:
            cfg = entry.get("cfg")
            out[kind] = None if entry.get("enable") is False or cfg is None else \
                {"num_bits": list(cfg["num_bits"]), "block_sizes": {str(k): list(v) if isinstance(v, tuple) else v
                                                                  for k, v in cfg["block_sizes"].items()}}
    return out


def _resolved(quant_cfg: dict, module: str, kind: str) -> dict | None:
    """ModelOpt's dict-form quant_cfg applied to one quantizer: the last wildcard matching its
    name wins; only what a preset also holds (num_bits, block_sizes; None: disabled)."""
    import fnmatch
    got = None
    for pattern, attrs in quant_cfg.items():
        if fnmatch.fnmatchcase(f"{module}.{kind}_quantizer", pattern):
            got = attrs
    if got is None or got.get("enable") is False:
        return None
    return {"num_bits": got["num_bits"], "block_sizes": got["block_sizes"]}


def test_the_recipe_gives_each_layer_modelopts_own_quantizers(pair):
    """The inkling form's `modelopt_quant_config.quant_cfg` (the first Inkling generation's
    schema, which SGLang 0.5.23's Inkling parser reads at `quant_cfg["*weight_quantizer"]`): each
    layer's experts resolve to the quantizers of nvidia-modelopt's own NVFP4 / MXFP8 presets, and
    the global weight quantizer is NVFP4 (e2m1 with e4m3 block scales: what that parser checks)."""
    _, out, _ = pair
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]["modelopt_quant_config"]["quant_cfg"]
    presets = {"nvfp4": _modelopt_preset("NVFP4_DEFAULT_CFG"), "mxfp8": _modelopt_preset("MXFP8_DEFAULT_CFG")}
    for layer in range(LAYERS):
        module = f"model.llm.layers.{layer}.mlp.experts"
        for kind in ("weight", "input"):
            assert _resolved(cfg, module, kind) == presets[expert_format(layer)][kind], (layer, kind)
    top = cfg["*weight_quantizer"]
    assert tuple(top["num_bits"]) == (2, 1) and tuple(top["block_sizes"]["scale_bits"]) == (4, 3)
    assert "-2" not in top["block_sizes"]  # one scale per 16 along a row, not 2-D


def test_one_format_stays_per_layer_with_the_presets_recipe(release, tmp_path):
    """Every module MXFP8 (the MXFP8 release's form), or every module weight-only NVFP4: still
    MIXED_PRECISION, every layer listed with its encoder (docs/formats.md says why the inkling
    form does not take ModelOpt's one-format form), the two files alike, and the recipe resolving
    every layer to nvidia-modelopt's own MXFP8_DEFAULT_CFG / W4A16_NVFP4_CFG (whose input
    quantizer is off). verify reads the encoder from the entries with no converter record."""
    import shutil

    from inkling_quant.verify import verify
    convert(release, tmp_path / "wo", Options(scheme="nvfp4", weight_only=True), quiet=True)
    for out, preset, algo in ((release, "MXFP8_DEFAULT_CFG", "MXFP8"), (tmp_path / "wo", "W4A16_NVFP4_CFG", "W4A16_NVFP4")):
        q = json.loads((out / "config.json").read_text())["quantization_config"]
        assert q["quant_algo"] == "MIXED_PRECISION" and len(q["quantized_layers"]) == LAYERS
        assert {e["quant_algo"] for e in q["quantized_layers"].values()} == {algo}
        want = _modelopt_preset(preset)
        cfg = q["modelopt_quant_config"]["quant_cfg"]
        for layer in range(LAYERS):
            module = f"model.llm.layers.{layer}.mlp.experts"
            assert {k: _resolved(cfg, module, k) for k in ("weight", "input")} == \
                {"weight": want["weight"], "input": want.get("input")}, (preset, layer)
        hq = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
        assert {k: v for k, v in q.items() if k != "quant_method"} == hq
    bare = tmp_path / "bare"
    shutil.copytree(release, bare)
    _rewrite_json(bare / "hf_quant_config.json", lambda h: h.pop("converter"))
    enc = next(c for c in verify(bare, sample=1).checks if c.id == "encoder")
    assert enc.status == "pass" and set(enc.figures["encoder"].values()) == {"mxfp8_nearest"}


def test_a_one_format_config_must_exclude_the_experts_it_leaves_in_bf16(pair, tmp_path):
    """Layers 0-4's experts MXFP8 and layer 5's left BF16 (a scheme file), the configs then
    rewritten into ModelOpt's one-format form (as another writer might): unless the exclusions
    name layer 5's experts module, verify fails naming its stacked tensor (an engine would load
    those BF16 experts as MXFP8); with it named, the config check passes."""
    from inkling_quant.verify import verify
    src, _, _ = pair
    scheme = tmp_path / "mine.toml"
    scheme.write_text('[[rules]]\npart = "expert"\nlayers = "0-4"\nformat = "mxfp8"\n')
    out = tmp_path / "out"
    convert(src, out, Options(scheme=str(scheme)), quiet=True)
    (out / "checksums.sha256").unlink()
    for extra, ok in (([], False), (["model.llm.layers.5.mlp.experts"], True)):
        for f, key in (("config.json", "quantization_config"), ("hf_quant_config.json", "quantization")):
            _rewrite_json(out / f, lambda c: c.update({key: {
                **({"quant_method": "modelopt"} if key == "quantization_config" else {}),
                "quant_algo": "MXFP8", "kv_cache_quant_algo": None, "group_size": 32,
                "exclude_modules": ["model.llm.unembed", "model.llm.embed", "model.llm.layers.*.attn*",
                                    "model.llm.layers.*.mlp.gate", "model.visual*", "mtp*", *extra]}}))
        check = verify(out, sample=0).check("config")
        assert (check.status == "pass") == ok, check.problems
        if not ok:
            assert check.problems[0].tensor == "model.llm.layers.5.mlp.experts.w13_weight"
            assert "does not exclude 'model.llm.layers.5.mlp.experts'" in check.problems[0].message


def test_verify_fails_a_recipe_that_disagrees_with_the_tensors(pair, tmp_path):
    """A recipe whose wildcards give layer 5's MXFP8 experts NVFP4 quantizers (its override
    dropped, in both files alike) fails verify's config check, naming a layer-5 tensor; a recipe
    that is not an object of quantizer attributes fails too."""
    import shutil

    from inkling_quant.verify import verify
    _, out, _ = pair
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    (bad / "checksums.sha256").unlink()

    def drop(q):
        cfg = q["modelopt_quant_config"]["quant_cfg"]
        for k in [k for k in cfg if k.startswith("model.llm.layers.5.")]:
            del cfg[k]
    _rewrite_json(bad / "config.json", lambda c: drop(c["quantization_config"]))
    _rewrite_json(bad / "hf_quant_config.json", lambda h: drop(h["quantization"]))
    r = verify(bad, sample=0)
    problems = next(c for c in r.checks if c.id == "config").problems
    assert r.exit_code == 1 and len(problems) == 4  # weight and input quantizers, in both files
    assert all("modelopt_quant_config.quant_cfg gives 'model.llm.layers.5.mlp.experts'" in p.message for p in problems)
    assert problems[0].tensor.startswith("model.llm.layers.5.mlp.experts.w") and "MXFP8" in problems[0].message
    # the same recipe spelled as nvidia-modelopt's presets spell it (effective_bits, tuples, no
    # axis / enable; no input quantizer for weight-only) means the same quantizers: it passes
    from modelopt.torch.quantization import config as mtq_config
    spelled = {"*weight_quantizer": None, "*input_quantizer": None}
    for name, prefix in (("NVFP4_DEFAULT_CFG", "*"), ("MXFP8_DEFAULT_CFG", "model.llm.layers.5.mlp.experts.*")):
        for e in getattr(mtq_config, name)["quant_cfg"]:
            if e["quantizer_name"] in ("*weight_quantizer", "*input_quantizer"):
                spelled[prefix + e["quantizer_name"].lstrip("*")] = dict(e["cfg"])
    spelled = json.loads(json.dumps({k: v for k, v in spelled.items() if v is not None}, default=list))
    for f, key in (("config.json", "quantization_config"), ("hf_quant_config.json", "quantization")):
        _rewrite_json(bad / f, lambda c: c[key].update(modelopt_quant_config={"quant_cfg": spelled}))
    assert next(c for c in verify(bad, sample=0).checks if c.id == "config").status == "pass"
    for f, key in (("config.json", "quantization_config"), ("hf_quant_config.json", "quantization")):
        _rewrite_json(bad / f, lambda c: c[key].update(modelopt_quant_config={"quant_cfg": ["*weight_quantizer"]}))
    r = verify(bad, sample=0)
    assert r.exit_code == 1 and len([p for p in next(c for c in r.checks if c.id == "config").problems
                                     if "quant_cfg must be an object of quantizer attributes" in p.message]) == 2


def test_parallel_and_resumed_runs_are_byte_identical(pair, tmp_path):
    src, out, _ = pair
    convert(src, tmp_path / "w2", Options(default_activation_amax=AMAX, max_shard_bytes=1 << 17, workers=2),
            quiet=True)
    assert (tmp_path / "w2" / "checksums.sha256").read_text() == (out / "checksums.sha256").read_text()


def test_a_wrong_source_is_refused_naming_the_tensor(pair, tmp_path):
    import shutil

    src, _, _ = pair
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["text_config"]["moe_intermediate_size"] = 64
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"w13_weight.*disagrees with config.json"):
        convert(bad, tmp_path / "o", Options(default_activation_amax=AMAX), quiet=True)
    assert not (tmp_path / "o").exists()


# ------------------------------------------------------------------------------ the MXFP8 release as source
@pytest.fixture(scope="module")
def release(pair, tmp_path_factory):
    """An MXFP8 'release': every routed expert MXFP8 in the Inkling stacked form (our convert
    with --scheme mxfp8 of the BF16 source), as Inkling-2-Small-MXFP8 stores them."""
    src, _, _ = pair
    out = tmp_path_factory.mktemp("release") / "mxfp8"
    convert(src, out, Options(scheme="mxfp8", max_shard_bytes=1 << 17), quiet=True)
    return out


def test_default_from_the_mxfp8_release(pair, release, tmp_path):
    """MXFP8 experts of the MXFP8 layers are copied bit-exact; the others are dequantized exactly
    and quantized to NVFP4: bit for bit what NVFP4's release encoder makes of the dequantized
    gate, up and down."""
    src, from_bf16, _ = pair
    convert(release, tmp_path / "out", Options(default_activation_amax=AMAX, max_shard_bytes=1 << 17), quiet=True)
    r, o, b = read_tensors(release), read_tensors(tmp_path / "out"), read_tensors(from_bf16)
    assert set(o) == set(b)  # the same tensors as converting the BF16 source
    mx, nv = FORMATS["mxfp8"], FORMATS["nvfp4"]
    for layer in range(LAYERS):
        p = f"model.llm.layers.{layer}.mlp.experts."
        if expert_format(layer) == "mxfp8":
            for k in ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale"):
                assert torch.equal(bits(o[p + k]), bits(r[p + k])), k
            continue
        stacked = {k[len(p):]: v for k, v in o.items() if k.startswith(p)}
        rel = {k[len(p):]: v for k, v in r.items() if k.startswith(p)}
        for e in range(2):
            stored = unstack_expert(mx, rel, e)
            deq = {m: mx.dequantize(stored[m], torch.float32) for m in stored}
            ga = nv.fused_global_amax([deq["gate_proj"], deq["up_proj"]])
            want = {"gate_proj": nv.quantize(deq["gate_proj"], global_amax=ga, input_amax=AMAX, encoder="release"),
                    "up_proj": nv.quantize(deq["up_proj"], global_amax=ga, input_amax=AMAX, encoder="release"),
                    "down_proj": nv.quantize(deq["down_proj"], input_amax=AMAX, encoder="release")}
            got = unstack_expert(nv, stacked, e)
            for m in want:
                assert set(got[m]) == set(want[m]) - {"weight_amax"}
                for k in got[m]:
                    assert torch.equal(bits(got[m][k]), bits(want[m][k])), (layer, e, m, k)
            assert torch.equal(stacked["w13_weight_amax"][e], want["gate_proj"]["weight_amax"])


def test_nvfp4_from_the_release_costs_little_against_nvfp4_from_bf16(pair, release, tmp_path):
    """The price of starting from the release instead of the BF16 weights: the NVFP4 experts'
    relative error against the BF16 weights grows by a few percent at most (MXFP8's own error,
    ~2-3%, is mostly absorbed by NVFP4's ~10% grid); measured figures are in docs/convert.md."""
    src, from_bf16, _ = pair
    convert(release, tmp_path / "out", Options(default_activation_amax=AMAX), quiet=True)
    s, o, b = read_tensors(src), read_tensors(tmp_path / "out"), read_tensors(from_bf16)
    nv = FORMATS["nvfp4"]
    errs = {"bf16": [], "release": []}
    for layer in range(5):
        p = f"model.llm.layers.{layer}.mlp.experts."
        w = s[p + "w13_weight"].float()
        for name, out in (("bf16", b), ("release", o)):
            stacked = {k[len(p):]: v for k, v in out.items() if k.startswith(p)}
            deq = torch.stack([torch.stack((lambda x: (x["gate_proj"], x["up_proj"]))(
                {m: nv.dequantize(t, torch.float32) for m, t in unstack_expert(nv, stacked, e).items()}), 1)
                .reshape(w.shape[1], -1) for e in range(w.shape[0])])
            errs[name].append(((deq - w).norm() / w.norm()).item())
    bf16, rel = sum(errs["bf16"]) / 5, sum(errs["release"]) / 5
    assert 0.05 < bf16 < 0.2 and bf16 <= rel < bf16 * 1.1, errs


def test_release_round_trips_and_feeds_modelopt_hf(pair, release, tmp_path):
    """--scheme none keeps the release's experts as they are; modelopt-hf output from it works."""
    convert(release, tmp_path / "none", Options(scheme="none"), quiet=True)
    r, n = read_tensors(release), read_tensors(tmp_path / "none")
    assert set(r) == set(n) and all(torch.equal(bits(r[k]), bits(n[k])) for k in r)
    assert json.loads((tmp_path / "none" / "config.json").read_text())["quantization_config"] == \
        json.loads((release / "config.json").read_text())["quantization_config"]
    convert(release, tmp_path / "hf", Options(output_format="modelopt-hf", default_activation_amax=AMAX), quiet=True)
    hf = read_tensors(tmp_path / "hf")
    assert "lm_head.weight" in hf and "model.language_model.layers.5.mlp.experts.0.gate_proj.weight_scale" in hf


def test_verify_against_the_release_and_a_corrupt_release_is_refused(release, tmp_path):
    """verify --against the MXFP8 release compares with its exact dequantization; a release
    whose kept MXFP8 expert holds an e8m0 255 scale is refused, naming the tensor."""
    import shutil

    from inkling_quant.io.safetensors import read_header
    from inkling_quant.verify import verify

    convert(release, tmp_path / "out", Options(default_activation_amax=AMAX), quiet=True)
    assert verify(tmp_path / "out", against=release).exit_code == 0
    bad = tmp_path / "bad"
    shutil.copytree(release, bad)
    name = "model.llm.layers.5.mlp.experts.w2_weight_scale"
    shard = json.loads((bad / "model.safetensors.index.json").read_text())["weight_map"][name]
    entry = read_header(bad / shard).tensors[name]
    with open(bad / shard, "r+b") as f:
        f.seek(entry.begin)
        f.write(b"\xff")
    with pytest.raises(FormatError, match=r"w2_weight.*NaN or Inf"):
        convert(bad, tmp_path / "o", Options(default_activation_amax=AMAX), quiet=True)
    assert not (tmp_path / "o" / "model.safetensors.index.json").exists()  # nothing that looks complete


def test_a_failure_in_a_fresh_process_reports_itself(pair, tmp_path):
    """Regression: with one worker, an error raised while converting (here a NaN in a pass-through
    tensor) was masked by "module 'concurrent.futures' has no attribute 'process'" in a process
    that had never started a pool (the except clause named cf.process.BrokenProcessPool)."""
    import shutil
    import subprocess
    import sys

    from inkling_quant.io.safetensors import read_header

    src, _, _ = pair
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    name = "model.llm.layers.1.attn.wq_du.weight"
    shard = json.loads((bad / "model.safetensors.index.json").read_text())["weight_map"][name]
    with open(bad / shard, "r+b") as f:
        f.seek(read_header(bad / shard).tensors[name].begin)
        f.write(b"\xc0\x7f")  # bf16 NaN
    r = subprocess.run([sys.executable, "-m", "inkling_quant.cli", "convert", str(bad), str(tmp_path / "o"),
                        "--default-activation-amax", "4", "--quiet"], capture_output=True, text=True)
    assert r.returncode == 2 and f"tensor '{name}': contains NaN or Inf" in r.stderr, r.stderr


# --------------------------------------------------------------------------- encoders
def _rewrite_json(path, edit) -> None:
    obj = json.loads(path.read_text())
    edit(obj)
    path.write_text(json.dumps(obj))


def test_verify_holds_the_inkling_form_to_the_release_encoders_fixed_point(pair, tmp_path):
    """verify's `encoder` check: our default output is a fixed point of the release's rules and
    the check names them per layer; written by ModelOpt's encoder and declared so, the check is
    skipped (not a fixed point); the same bytes with a config that names no encoder (another
    writer's) fail, naming an MXFP8 tensor (ModelOpt's MXFP8 scales differ on ~5 % of blocks)."""
    from inkling_quant.verify import verify

    src, out, _ = pair
    r = verify(out, sample=2)
    enc = next(c for c in r.checks if c.id == "encoder")
    assert r.exit_code == 0 and enc.status == "pass"
    assert enc.figures["encoder"] == {str(i): "nvfp4_nearest" for i in range(5)} | {"5": "mxfp8_nearest"}
    mo = tmp_path / "mo"
    convert(src, mo, Options(default_activation_amax=AMAX, encoder="modelopt"), quiet=True)
    hq = json.loads((mo / "hf_quant_config.json").read_text())
    assert hq["converter"]["encoder"] == "modelopt"
    assert "encoder" not in hq["quantization"]["quantized_layers"]["model.llm.layers.0.mlp.experts"]
    r = verify(mo, sample=2)
    assert r.exit_code == 0 and next(c for c in r.checks if c.id == "encoder").status == "skip"
    _rewrite_json(mo / "hf_quant_config.json", lambda h: h.pop("converter"))
    (mo / "checksums.sha256").unlink()
    r = verify(mo, sample=0)
    enc = next(c for c in r.checks if c.id == "encoder")
    assert r.exit_code == 1 and enc.status == "fail"
    p = enc.problems[0]
    assert p.tensor.startswith("model.llm.layers.5.mlp.experts.w") and "mxfp8_nearest" in p.message
    assert "no documented encoder reproduces these bytes" in p.message


def test_encoder_flag_records_itself_and_modelopt_hf_with_the_release_encoder(pair, tmp_path):
    """--encoder release on the ModelOpt form: its tensors are the release's bits under ModelOpt's
    names (weight_scale_2 = amax / 2688) and hf_quant_config.json says so in a `converter` entry;
    the ModelOpt form's own default adds nothing of ours."""
    src, out, _ = pair
    convert(src, tmp_path / "rel", Options(output_format="modelopt-hf", default_activation_amax=AMAX,
                                           encoder="release"), quiet=True)
    convert(src, tmp_path / "mo", Options(output_format="modelopt-hf", default_activation_amax=AMAX), quiet=True)
    rel, mo = (json.loads((tmp_path / d / "hf_quant_config.json").read_text()) for d in ("rel", "mo"))
    assert rel["converter"]["encoder"] == "release" and "converter" not in mo
    ink, hf = read_tensors(out), read_tensors(tmp_path / "rel")
    stacked = {k[len("model.llm.layers.0.mlp.experts."):]: v for k, v in ink.items()
               if k.startswith("model.llm.layers.0.mlp.experts.")}
    got = unstack_expert(FORMATS["nvfp4"], stacked, 1)  # the inkling output's expert 1, per module
    p = "model.language_model.layers.0.mlp.experts.1."
    for mod in ("gate_proj", "up_proj", "down_proj"):
        for k in ("weight", "weight_scale", "weight_scale_2", "input_scale"):
            assert torch.equal(bits(hf[p + f"{mod}.{k}"]), bits(got[mod][k])), (mod, k)


def test_the_release_files_and_a_bit_identical_draft_file(pair, tmp_path):
    """--output-format inkling writes the release's files (docs/layout.md "Files"): one shard per
    decoder layer (cut further only by an explicit --max-shard-size), vision.safetensors and
    mtp.safetensors, every file in the index. The draft is BF16 passed through, never quantized:
    a quantized conversion's mtp.safetensors is the source's file byte for byte."""
    from inkling_quant.io.checkpoint import Checkpoint
    from inkling_quant.io.safetensors import sha256_file
    from inkling_quant.model.inkling2 import release_file

    src, cut, _ = pair
    out = tmp_path / "o"
    convert(src, out, Options(default_activation_amax=AMAX), quiet=True)
    layers = [f"model-{k:05d}-of-{LAYERS:05d}.safetensors" for k in range(1, LAYERS + 1)]
    ck = Checkpoint.open(out)
    assert ck.shards == layers + ["vision.safetensors", "mtp.safetensors"] and ck.unlisted == ()
    cfg = Inkling2Config.load(src)
    for k, shard in enumerate(layers):
        assert {release_file(cfg.text, n) for n in ck.header(shard).tensors} == {k}, shard
    assert ck.header(layers[0]).tensors["model.llm.layers.0.mlp.experts.w13_weight"].dtype == torch.uint8  # NVFP4
    for f in ("mtp.safetensors", "vision.safetensors"):
        assert sha256_file(out / f) == sha256_file(src / f), f
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(ck.shards)
    assert "mtp.safetensors" in (out / "checksums.sha256").read_text()
    # --max-shard-size given (the pair's 128 KiB): the layers' shards cut further, the draft whole
    numbered = [s for s in Checkpoint.open(cut).shards if s.startswith("model-")]
    assert len(numbered) > LAYERS and Checkpoint.open(cut).shards[len(numbered):] == ["vision.safetensors",
                                                                                       "mtp.safetensors"]
    assert sha256_file(cut / "mtp.safetensors") == sha256_file(src / "mtp.safetensors")
    # ModelOpt's form keeps ModelOpt's packing: numbered shards by size, the draft among them
    convert(src, tmp_path / "hf", Options(output_format="modelopt-hf", default_activation_amax=AMAX), quiet=True)
    hf = Checkpoint.open(tmp_path / "hf")
    assert all(s.startswith("model-") for s in hf.shards) and not (tmp_path / "hf" / "mtp.safetensors").exists()
    s, h = read_tensors(src), read_tensors(tmp_path / "hf")
    assert all(torch.equal(bits(h[n]), bits(s[n])) for n in s if n.startswith("mtp."))


def test_verify_against_the_release_requires_its_mxfp8_layers_byte_identical(release, tmp_path):
    """verify --against the MXFP8 release: the MXFP8 layers the default scheme keeps are the
    release's bytes, compared byte for byte (a re-encoding, even a valid one, is a failure);
    one changed e4m3 byte is named, though its values would pass the numerics thresholds."""
    from inkling_quant.io.safetensors import read_header
    from inkling_quant.verify import verify

    out = tmp_path / "out"
    convert(release, out, Options(default_activation_amax=AMAX), quiet=True)
    r = verify(out, against=release)
    pt = next(c for c in r.checks if c.id == "passthrough")
    assert r.exit_code == 0 and pt.figures["kept_quantized"] == 4  # layer 5: w13/w2 weight and scale
    name = "model.llm.layers.5.mlp.experts.w13_weight"
    shard = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"][name]
    entry = read_header(out / shard).tensors[name]
    with open(out / shard, "r+b") as f:
        f.seek(entry.begin + 7)
        b = f.read(1)[0]
        f.seek(entry.begin + 7)
        f.write(bytes([b ^ 0x01]))  # one e4m3 mantissa step
    r = verify(out, against=release)
    pt = next(c for c in r.checks if c.id == "passthrough")
    assert pt.status == "fail" and pt.problems[0].tensor == name
    assert "mxfp8 tensor kept from the source must be bit-exact" in pt.problems[0].message
