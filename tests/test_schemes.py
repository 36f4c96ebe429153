"""The scheme table: which routed experts get which format, per layer, at any depth; `none`
quantizes nothing; the CLI prints and writes the same table."""
import json

import pytest

from inkling_quant.cli import main
from inkling_quant.errors import UsageError
from inkling_quant.layout import ModelConfig, classify, expected_tensors
from inkling_quant.schemes import SCHEMES, get_scheme
from inkling_quant.synth import make_config


def _formats_by_layer(scheme: str, cfg: ModelConfig) -> dict[int, str]:
    s = get_scheme(scheme)
    return {i: s.format_name(cfg, classify(f"model.layers.{i}.mlp.experts.0.up_proj.weight"))
            for i in range(cfg.num_hidden_layers)}


def test_default_is_the_recipe_at_48_layers():
    cfg = ModelConfig.reference()
    assert cfg.num_hidden_layers == 48
    by_layer = _formats_by_layer("default", cfg)
    assert [i for i, f in by_layer.items() if f == "nvfp4"] == list(range(40))
    assert [i for i, f in by_layer.items() if f == "mxfp8"] == list(range(40, 48))


@pytest.mark.parametrize("layers,nvfp4_layers", [(6, 5), (12, 10), (24, 20), (7, 6)])
def test_default_scales_with_depth(layers, nvfp4_layers):
    cfg = ModelConfig.from_dict(make_config("tiny", layers, 4))
    by_layer = _formats_by_layer("default", cfg)
    assert sum(f == "nvfp4" for f in by_layer.values()) == nvfp4_layers
    assert sum(f == "mxfp8" for f in by_layer.values()) == layers - nvfp4_layers
    assert all(by_layer[i] == "nvfp4" for i in range(nvfp4_layers))  # NVFP4 first, MXFP8 last


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_only_routed_experts_are_quantized(name):
    cfg = ModelConfig.from_dict(make_config("tiny", None, 4))
    s = get_scheme(name)
    formats = {spec.name: s.format_name(cfg, classify(spec.name)) for spec in expected_tensors(cfg)}
    quantized = {n for n, f in formats.items() if f != "passthrough"}
    assert all(classify(n).part == "expert" for n in quantized)
    if name == "none":
        assert not quantized
    else:
        experts = {n for n in formats if classify(n).part == "expert"}
        assert quantized == experts


def test_unknown_scheme_is_a_usage_error():
    with pytest.raises(UsageError, match="unknown scheme 'nvfp8'.*default"):
        get_scheme("nvfp8")


def test_cli_table_and_json_agree(tmp_path, capsys):
    assert main(["schemes", "--json", str(tmp_path / "s.json")]) == 0
    table = capsys.readouterr().out
    written = json.loads((tmp_path / "s.json").read_text())
    assert set(written) == set(SCHEMES)
    assert written["default"][:2] == [
        {"part": "expert", "layers": "0-39", "format": "nvfp4", "quant_algo": "NVFP4"},
        {"part": "expert", "layers": "40-47", "format": "mxfp8", "quant_algo": "MXFP8"}]
    assert written["none"] == [{"part": "everything else", "layers": "all", "format": "passthrough",
                                "quant_algo": None}]
    for name, rows in written.items():
        for r in rows:
            assert any(line.split()[0] == name and r["format"] in line for line in table.splitlines())
    assert main(["schemes", "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out) == written
