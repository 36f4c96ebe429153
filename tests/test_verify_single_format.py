"""`inkling-quant verify` on quantization configs of one format and on a family without a
dense-layer rule.

- ModelOpt's own export of a tiny Qwen3-MoE with NVFP4 routed experts only (`mtq.quantize` with
  `NVFP4_EXPERTS_ONLY_CFG` + `export_hf_checkpoint`, CPU): its configs name one quant_algo
  ("NVFP4"), a group_size and the exclusions, and no quantized_layers (ModelOpt 0.47
  export/quant_utils.py:780-790; config.json's form lists the exclusions as `ignore`,
  export/convert_hf_config.py:262-264). It passes verify alone and --against its BF16 source;
  copies whose configs disagree with the tensors fail the config check naming the module.
- Mixtral's config has no dense-layer rule: which layers hold routed experts is what the tensors
  say, for layout.detect, convert and verify alike (docs/layout.md, "How detection decides", 4).
"""
import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from hf_moe_reference import build, save
from modelopt_reference import quantize_and_export
from safetensors.torch import load_file, save_file

from inkling_quant.convert import Options, convert
from inkling_quant.export.modelopt import format_of, read_quantization
from inkling_quant.formats import FORMATS
from inkling_quant.io.checkpoint import SINGLE_NAME
from inkling_quant.model.layout import detect, model_config
from inkling_quant.verify import verify

CONFIGS = (("config.json", "quantization_config", "ignore"), ("hf_quant_config.json", "quantization", "exclude_modules"))


@pytest.fixture(scope="module")
def nvfp4_only(tmp_path_factory):
    """(ModelOpt's NVFP4-experts-only export of the tiny Qwen3-MoE, its BF16 source)."""
    import modelopt.torch.quantization as mtq

    base = tmp_path_factory.mktemp("single-format")
    model = build("qwen3_moe")
    copy.deepcopy(model).save_pretrained(base / "src")
    g = torch.Generator().manual_seed(2)
    ids = [torch.randint(0, 90, (1, 24), generator=g) for _ in range(3)]
    quantize_and_export(model, copy.deepcopy(mtq.NVFP4_EXPERTS_ONLY_CFG), ids, base / "out")
    return base / "out", base / "src"


@pytest.fixture
def edited(nvfp4_only, tmp_path):
    """A copy of the export whose two quantization configs `change(q, exclusions_key)` edits."""
    def make(change) -> Path:
        dst = tmp_path / "out"
        shutil.copytree(nvfp4_only[0], dst)
        for name, key, excl in CONFIGS:
            cfg = json.loads((dst / name).read_text())
            change(cfg[key], excl)
            (dst / name).write_text(json.dumps(cfg))
        return dst
    return make


def _problems(r, check: str) -> list[tuple[str, str | None, str]]:
    return [(Path(p.file).name, p.tensor, p.message) for p in r.check(check).problems]


def test_modelopt_export_of_one_format_passes(nvfp4_only):
    out, src = nvfp4_only
    hq = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert hq["quant_algo"] == qc["quant_algo"] == "NVFP4" and "quantized_layers" not in hq
    assert hq["group_size"] == 16 and qc["ignore"] == hq["exclude_modules"] and "exclude_modules" not in qc
    alone = verify(out)
    assert alone.ok, alone.format_summary()
    r = verify(out, against=src, sample=0)
    assert r.ok, r.format_summary()
    assert r.check("layout").figures["quantized_experts"] == {f"model.layers.{i}.mlp.experts": "nvfp4" for i in (1, 2)}
    assert {(n["layer"], n["format"]) for n in r.numerics} == {(1, "nvfp4"), (2, "nvfp4")}
    assert len(r.numerics) == 2 * 4 * 3 and r.check("passthrough").figures["tensors_compared"] > 0


def test_format_of_reads_the_exclusions_of_either_form(nvfp4_only):
    """export.format_of on ModelOpt's two configs of one format: the exclusions are
    `exclude_modules` in hf_quant_config.json, `ignore` in config.json; either excludes the same
    modules, and every other module is the one quant_algo."""
    out = nvfp4_only[0]
    config = json.loads((out / "config.json").read_text())
    forms = {"config.json": read_quantization(out, config),
             "hf_quant_config.json": read_quantization(out, {k: v for k, v in config.items() if k != "quantization_config"})}
    assert "ignore" in forms["config.json"] and "exclude_modules" in forms["hf_quant_config.json"]
    modules = {"model.layers.1.mlp.experts": FORMATS["nvfp4"], "model.layers.2.mlp.experts.3.down_proj": FORMATS["nvfp4"],
               "model.layers.0.mlp.experts": None,  # the dense first layer: model.layers.0*
               "model.layers.1.self_attn.q_proj": None, "model.layers.2.mlp.gate": None, "lm_head": None}
    for name, q in forms.items():
        assert {m: format_of(q, m) for m in modules} == modules, name


def test_quant_algo_of_another_format(edited):
    out = edited(lambda q, _: q.update(quant_algo="MXFP8"))
    r = verify(out)
    assert not r.ok and {c.id for c in r.checks if c.status == "fail"} == {"config"}
    for i in (1, 2):
        tensor = f"model.layers.{i}.mlp.experts.0.gate_proj.weight"
        msgs = [m for f, t, m in _problems(r, "config") if t == tensor]
        assert len(msgs) == 2 and all("'MXFP8' for every module not excluded" in m and
                                      f"'model.layers.{i}.mlp.experts' are 'NVFP4'" in m for m in msgs)


def test_exclusions_that_exclude_a_quantized_experts_module(edited):
    out = edited(lambda q, excl: q[excl].append("model.layers.2.mlp.experts*"))
    r = verify(out)
    assert {c.id for c in r.checks if c.status == "fail"} == {"config"}
    found = {(f, t) for f, t, m in _problems(r, "config")
             if "'model.layers.2.mlp.experts*' excludes the quantized module 'model.layers.2.mlp.experts'" in m}
    assert found == {("config.json", "model.layers.2.mlp.experts.0.gate_proj.weight"),
                     ("hf_quant_config.json", "model.layers.2.mlp.experts.0.gate_proj.weight")}


def test_an_unquantized_module_left_out_of_the_exclusions(edited):
    """The dense first layer's MLP is BF16: without `model.layers.0*` vLLM would load it as NVFP4."""
    out = edited(lambda q, excl: q[excl].remove("model.layers.0*"))
    r = verify(out)
    assert {c.id for c in r.checks if c.status == "fail"} == {"config"}
    problems = _problems(r, "config")
    for f, excl in (("config.json", "ignore"), ("hf_quant_config.json", "exclude_modules")):
        for module in ("model.layers.0.mlp.gate_proj", "model.layers.0.mlp.down_proj", "model.layers.0.self_attn.q_proj"):
            assert (f, module + ".weight", f"{'quantization_config' if f == 'config.json' else 'quantization'}.{excl} "
                    f"does not exclude {module!r}, which the tensors leave unquantized (vLLM would load it as "
                    f"NVFP4)") in problems


def test_config_json_and_hf_quant_config_disagree(nvfp4_only, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(nvfp4_only[0], out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"]["ignore"].append("model.layers.1.self_attn.extra")  # still excludes every BF16 module
    (out / "config.json").write_text(json.dumps(cfg))
    r = verify(out)
    assert _problems(r, "config") == [("hf_quant_config.json", None, "quantization.exclude_modules disagrees with "
                                       "config.json quantization_config.ignore (ModelOpt's form of quantization)")]


def test_mixtral_expert_layers_are_what_the_tensors_say(tmp_path):
    """Mixtral's config has no dense-layer rule: a source whose layer 2 holds no routed experts is
    detected with experts in layers 0-1, converted so, and its conversion verifies alone (the
    tensors decide, as for detect and convert) and against the source."""
    src = save("mixtral", tmp_path / "src")
    sd = load_file(src / SINGLE_NAME)
    save_file({k: v for k, v in sd.items() if not k.startswith("model.layers.2.block_sparse_moe.experts.")},
              src / SINGLE_NAME, metadata={"format": "pt"})
    cfg = model_config(json.loads((src / "config.json").read_text()), "config.json")
    assert cfg.dense_layers is None and detect(list(load_file(src / SINGLE_NAME)), cfg).expert_layers == (0, 1)
    convert(str(src), tmp_path / "out", Options(weight_only=True), quiet=True)
    alone = verify(tmp_path / "out")
    assert alone.ok, alone.format_summary()
    assert set(alone.check("layout").figures["quantized_experts"]) == {
        f"model.layers.{i}.block_sparse_moe.experts" for i in (0, 1)}
    r = verify(tmp_path / "out", against=src, sample=1)
    assert r.ok and {n["layer"] for n in r.numerics} == {0, 1}, r.format_summary()
