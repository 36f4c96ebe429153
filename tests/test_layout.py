import json

import pytest
import torch

from inkling_quant.errors import ConfigError, UnknownTensorError
from inkling_quant.layout import ModelConfig, classify, expected_tensors, source_spec
from inkling_quant.synth import make_config


def test_reference_config_shape():
    cfg = ModelConfig.reference()
    assert cfg.num_hidden_layers == 48
    assert cfg.full_attention_layers == tuple(range(5, 48, 6))  # every 6th layer, 8 of them
    assert len(cfg.full_attention_layers) == 8
    assert cfg.draft.num_hidden_layers == 5 and cfg.draft.num_speculative_tokens == 7
    assert cfg.vision.depth == 23


def test_every_expected_name_classifies_and_roundtrips():
    cfg = ModelConfig.from_dict(make_config("tiny"))
    parts = set()
    for s in expected_tensors(cfg):
        t = classify(s.name)
        parts.add(t.part)
        if t.part != "expert":
            assert source_spec(cfg, s.name) == s
    assert parts == {"embed", "attention", "attn_sink", "rel_bias", "short_conv", "attn_res", "norm",
                     "router", "expert", "vision", "draft", "lm_head"}


@pytest.mark.parametrize("name, part, layer, expert, proj, suffix", [
    ("model.layers.7.mlp.experts.383.down_proj.weight", "expert", 7, 383, "down_proj", "weight"),
    ("model.layers.0.mlp.experts.1.gate_proj.weight_scale_2", "expert", 0, 1, "gate_proj", "weight_scale_2"),
    ("model.layers.41.mlp.experts.2.up_proj.input_scale", "expert", 41, 2, "up_proj", "input_scale"),
    ("model.layers.3.mlp.gate.weight", "router", 3, None, None, "weight"),
    ("model.layers.3.self_attn.g_proj.weight", "attention", 3, None, "g_proj", "weight"),
    ("model.layers.3.self_attn.sinks", "attn_sink", 3, None, None, "sinks"),
    ("model.layers.3.attn_res.mlp_query", "attn_res", 3, None, None, "mlp_query"),
    ("model.layers.3.mlp.input_conv.weight", "short_conv", 3, None, "input_conv", "weight"),
    ("model.visual.blocks.22.mlp.fc2.bias", "vision", 22, None, "mlp.fc2", "bias"),
    ("dspark.layers.4.mlp.down_proj.weight", "draft", 4, None, "mlp.down_proj", "weight"),
    ("dspark.markov_head.rnn.weight_hh", "draft", None, None, "markov_head.rnn", "weight_hh"),
    ("lm_head.weight", "lm_head", None, None, None, "weight"),
])
def test_classify(name, part, layer, expert, proj, suffix):
    t = classify(name)
    assert (t.part, t.layer, t.expert, t.projection, t.suffix) == (part, layer, expert, proj, suffix)


@pytest.mark.parametrize("name", ["model.layers.1.mlp.experts.1.gate_proj.bias", "model.layers.x.self_attn.q_proj.weight",
                                  "transformer.h.0.attn.weight", "", "lm_head.weight.extra"])
def test_unknown_names_raise(name):
    with pytest.raises(UnknownTensorError, match="not part of the Inkling 2 Small layout"):
        classify(name)


def test_layer_past_config_is_unknown():
    cfg = ModelConfig.from_dict(make_config("tiny"))
    with pytest.raises(UnknownTensorError):
        source_spec(cfg, "model.layers.48.self_attn.q_proj.weight")


def test_full_attention_layers_have_their_own_geometry():
    cfg = ModelConfig.reference()
    assert source_spec(cfg, "model.layers.5.self_attn.k_proj.weight").shape == (16 * 512, 3072)
    assert source_spec(cfg, "model.layers.4.self_attn.k_proj.weight").shape == (8 * 128, 3072)
    assert source_spec(cfg, "model.layers.4.self_attn.sinks").dtype == torch.float32


def test_config_errors(tmp_path):
    d = make_config("tiny")
    del d["hidden_size"]
    with pytest.raises(ConfigError, match="missing key 'hidden_size'"):
        ModelConfig.from_dict(d)
    d = make_config("tiny")
    d["layer_types"] = d["layer_types"][:-1]
    with pytest.raises(ConfigError, match="layer_types has 47"):
        ModelConfig.from_dict(d)
    p = tmp_path / "config.json"
    p.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.load(tmp_path)
    p.write_text(json.dumps([1]))
    with pytest.raises(ConfigError, match="JSON object"):
        ModelConfig.load(p)
