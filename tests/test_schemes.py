"""The scheme table: which routed experts get which format, per layer, at any depth; `none`
quantizes nothing; the CLI prints and writes the same table."""
import json

import pytest

from inkling_quant.cli import main
from inkling_quant.errors import UsageError
from inkling_quant.model.inkling2 import Inkling2Config, checkpoint_tensors, classify
from inkling_quant.schemes import SCHEMES, get_scheme
from inkling_quant.synth import make_config


def _formats_by_layer(scheme, cfg: Inkling2Config) -> dict[int, str]:
    s = get_scheme(scheme) if isinstance(scheme, str) else scheme
    return {i: s.format_name(cfg, classify(f"model.llm.layers.{i}.mlp.experts.w13_weight"))
            for i in range(cfg.num_hidden_layers)}


def _config(layers=None, experts=4) -> Inkling2Config:
    return Inkling2Config.from_dict(make_config("tiny", layers, experts, draft=False))


def test_default_is_the_recipe_at_48_layers():
    cfg = Inkling2Config.reference()
    assert cfg.num_hidden_layers == 48
    by_layer = _formats_by_layer("default", cfg)
    assert [i for i, f in by_layer.items() if f == "nvfp4"] == list(range(40))
    assert [i for i, f in by_layer.items() if f == "mxfp8"] == list(range(40, 48))


@pytest.mark.parametrize("layers,nvfp4_layers", [(6, 5), (12, 10), (24, 20), (7, 6)])
def test_default_scales_with_depth(layers, nvfp4_layers):
    cfg = _config(layers)
    by_layer = _formats_by_layer("default", cfg)
    assert sum(f == "nvfp4" for f in by_layer.values()) == nvfp4_layers
    assert sum(f == "mxfp8" for f in by_layer.values()) == layers - nvfp4_layers
    assert all(by_layer[i] == "nvfp4" for i in range(nvfp4_layers))  # NVFP4 first, MXFP8 last


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_only_routed_experts_are_quantized(name):
    cfg = _config()
    s = get_scheme(name)
    formats = {spec.name: s.format_name(cfg, classify(spec.name)) for spec in checkpoint_tensors(cfg)}
    quantized = {n for n, f in formats.items() if f != "passthrough"}
    assert all(classify(n).part == "expert" for n in quantized)
    if name == "none":
        assert not quantized
    else:
        experts = {n for n in formats if classify(n).part == "expert"}
        assert quantized == experts


def test_unknown_scheme_is_a_usage_error():
    with pytest.raises(UsageError, match="unknown scheme 'nvfp8'.*default.*scheme file"):
        get_scheme("nvfp8")


def test_a_user_scheme_file_in_toml_and_json(tmp_path):
    """A user's rules over absolute layer ranges, the first rule naming a layer deciding it; the
    same rules in TOML and JSON give the same formats."""
    rules = [{"part": "expert", "layers": "0-2", "format": "mxfp8"}, {"part": "expert", "layers": "4", "format": "nvfp4"},
             {"part": "expert", "layers": "all", "format": "passthrough"}]
    (tmp_path / "s.json").write_text(json.dumps({"description": "mine", "rules": rules}))
    (tmp_path / "s.toml").write_text('description = "mine"\n' + "".join(
        f'[[rules]]\npart = "{r["part"]}"\nlayers = "{r["layers"]}"\nformat = "{r["format"]}"\n' for r in rules))
    cfg = _config(6)
    want = {0: "mxfp8", 1: "mxfp8", 2: "mxfp8", 3: "passthrough", 4: "nvfp4", 5: "passthrough"}
    for f in ("s.json", "s.toml"):
        s = get_scheme(str(tmp_path / f))
        assert s.description == "mine"
        assert _formats_by_layer(s, cfg) == want
    # a range past the model's layers is cut at its depth, not an error
    (tmp_path / "deep.json").write_text(json.dumps({"rules": [{"part": "expert", "layers": "3-99", "format": "nvfp4"}]}))
    assert _formats_by_layer(get_scheme(str(tmp_path / "deep.json")), cfg) == {
        0: "passthrough", 1: "passthrough", 2: "passthrough", 3: "nvfp4", 4: "nvfp4", 5: "nvfp4"}


@pytest.mark.parametrize("content,match", [
    ({"rules": []}, "non-empty list `rules`"),
    ({"rules": [{"part": "expert", "layers": "0-3"}]}, r"rules\[0\] must have exactly the keys"),
    ({"rules": [{"part": "attention", "layers": "0-3", "format": "nvfp4"}]}, r"rules\[0\]\.part 'attention'.*routed experts"),
    ({"rules": [{"part": "expert", "layers": "3-1", "format": "nvfp4"}]}, r"rules\[0\]\.layers '3-1'"),
    ({"rules": [{"part": "expert", "layers": "x", "format": "nvfp4"}]}, r"rules\[0\]\.layers 'x'"),
    ({"rules": [{"part": "expert", "layers": True, "format": "nvfp4"}]}, r"rules\[0\]\.layers True"),
    ({"rules": [{"part": "expert", "layers": "all", "format": "int4"}]}, r"rules\[0\]\.format 'int4' is not one of"),
    ({"rules": [{"part": "expert", "layers": "all", "format": "nvfp4"}], "extra": 1}, "unknown key.*extra"),
])
def test_a_bad_scheme_file_is_a_usage_error_naming_the_file_and_rule(tmp_path, content, match):
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(content))
    with pytest.raises(UsageError, match=match) as e:
        get_scheme(str(p))
    assert e.value.path == str(p)


def test_a_scheme_file_that_is_not_toml_or_missing(tmp_path):
    (tmp_path / "s.toml").write_text("rules = [")
    with pytest.raises(UsageError, match="not valid TOML"):
        get_scheme(str(tmp_path / "s.toml"))
    with pytest.raises(UsageError, match="scheme file not found"):
        get_scheme(str(tmp_path / "nope.json"))


def test_cli_shows_a_user_scheme(tmp_path, capsys):
    p = tmp_path / "s.json"
    p.write_text(json.dumps({"rules": [{"part": "expert", "layers": "0-9", "format": "mxfp8"}]}))
    assert main(["schemes", "--scheme", str(p), "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out) == {str(p): [
        {"part": "expert", "layers": "0-9", "format": "mxfp8", "quant_algo": "MXFP8"},
        {"part": "everything else", "layers": "all", "format": "passthrough", "quant_algo": None}]}


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
