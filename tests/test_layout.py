"""Layout detection on checkpoints real tools write: tiny models of five Hugging Face MoE families
saved by transformers' own save_pretrained (tests/hf_moe_reference.py), and the published Inkling 2
layout. Detection places every tensor (text prefix, routed-expert storage, shared experts, dense
MLPs, routers, vision tower, projector) or names what it could not place."""
import json

import pytest
from safetensors import safe_open

from hf_moe_reference import save
from inkling_quant.errors import CheckpointError, ConfigError
from inkling_quant.model.inkling2 import Inkling2Config
from inkling_quant.model.layout import MoEConfig, detect
from inkling_quant.model.storage import stacked_orientation

# family -> (text prefix, storage kind, block, projection names, expert layers, vision, projector)
EXPECTED = {
    "qwen3_moe": ("model.", "per_expert", "mlp", ("gate_proj", "up_proj", "down_proj"), (1, 2), None, None),
    "mixtral": ("model.", "per_expert", "block_sparse_moe", ("w1", "w3", "w2"), (0, 1, 2), None, None),
    "deepseek_v3": ("model.", "per_expert", "mlp", ("gate_proj", "up_proj", "down_proj"), (1, 2), None, None),
    "qwen3_vl_moe": ("model.language_model.", "stacked", "mlp", ("gate_proj", "up_proj", "down_proj"), (0, 1, 2),
                     "model.visual.", None),
    "llama4": ("language_model.model.", "stacked", "feed_forward", ("gate_proj", "up_proj", "down_proj"), (0, 1),
               "vision_model.", "multi_modal_projector."),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    base = tmp_path_factory.mktemp("hf")
    out = {}
    for family in EXPECTED:
        d = save(family, base / family)
        names = []
        for f in sorted(d.glob("*.safetensors")):
            with safe_open(f, "pt") as h:
                names += list(h.keys())
        out[family] = (json.loads((d / "config.json").read_text()), names)
    return out


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_detects_each_family(saved, family):
    d, names = saved[family]
    cfg = MoEConfig.from_dict(d)
    assert (cfg.num_experts, cfg.expert_width, cfg.hidden_size) == (4, 32, 64)
    assert cfg.nested == (family in ("qwen3_vl_moe", "llama4"))
    lay = detect(names, cfg)
    prefix, kind, block, projections, layers, vision, projector = EXPECTED[family]
    assert (lay.text_prefix, lay.experts.kind, lay.experts.block, lay.experts.names) == (prefix, kind, block, projections)
    assert (lay.expert_layers, lay.vision_prefix, lay.projector_prefix) == (layers, vision, projector)
    recs = [lay.classify(n) for n in names]
    experts = [r for r in recs if r.part == "expert"]
    per_layer = 3 * cfg.num_experts if kind == "per_expert" else 2
    assert len(experts) == per_layer * len(layers)
    assert {r.layer for r in experts} == set(layers)
    if kind == "per_expert":
        assert {r.expert for r in experts} == set(range(cfg.num_experts))
        assert {r.projection for r in experts} == {"gate", "up", "down"}
    else:
        assert {r.projection for r in experts} == {"gate_up", "down"}
    assert sum(r.part == "router" for r in recs) >= len(layers)
    assert sum(r.part == "lm_head" for r in recs) == 1
    assert sum(r.part == "embed" for r in recs) == 1
    if vision:
        assert any(r.part == "vision" for r in recs)


def test_shared_experts_and_dense_layers_are_not_routed_experts(saved):
    d, names = saved["deepseek_v3"]
    lay = detect(names, MoEConfig.from_dict(d))
    parts = {n: lay.classify(n).part for n in names}
    assert parts["model.layers.1.mlp.shared_experts.gate_proj.weight"] == "shared_expert"
    assert parts["model.layers.0.mlp.gate_proj.weight"] == "dense_mlp"
    assert parts["model.layers.1.mlp.gate.e_score_correction_bias"] == "router"
    assert parts["model.layers.1.mlp.experts.3.down_proj.weight"] == "expert"
    d, names = saved["llama4"]
    lay = detect(names, MoEConfig.from_dict(d))
    assert lay.classify("language_model.model.layers.0.feed_forward.shared_expert.up_proj.weight").part == "shared_expert"
    assert lay.classify("language_model.model.layers.0.feed_forward.router.weight").part == "router"
    assert lay.classify("language_model.lm_head.weight").part == "lm_head"


@pytest.mark.parametrize("key", ["num_experts", "num_local_experts", "n_routed_experts"])
def test_expert_count_aliases(key):
    cfg = MoEConfig.from_dict({"hidden_size": 8, "num_hidden_layers": 2, key: 4, "num_experts_per_tok": 2,
                               "intermediate_size": 16})
    assert (cfg.num_experts, cfg.expert_width, cfg.dense_layers, cfg.nested) == (4, 16, None, False)


@pytest.mark.parametrize("extra,dense", [
    ({"first_k_dense_replace": 2}, {0, 1}),
    ({"mlp_only_layers": [3]}, {3}),
    ({"decoder_sparse_step": 2}, {0, 2}),
    ({"interleave_moe_layer_step": 2}, {0, 2}),
    ({"moe_layers": [1, 3]}, {0, 2}),
])
def test_dense_layer_rules(extra, dense):
    d = {"text_config": {"hidden_size": 8, "num_hidden_layers": 4, "num_experts": 4, "num_experts_per_tok": 2,
                         "moe_intermediate_size": 16, **extra}}
    assert MoEConfig.from_dict(d).dense_layers == dense


@pytest.mark.parametrize("d,match", [
    ({"hidden_size": 8, "num_hidden_layers": 2, "intermediate_size": 16}, "no routed-expert count"),
    ({"hidden_size": 8, "num_hidden_layers": 2, "num_experts": 4, "num_experts_per_tok": 5,
      "intermediate_size": 16}, "num_experts_per_tok must be between 1 and 4"),
    ({"hidden_size": "8", "num_hidden_layers": 2, "num_experts": 4, "num_experts_per_tok": 2,
      "intermediate_size": 16}, "hidden_size must be an integer"),
    ({"text_config": {"num_hidden_layers": 2, "num_experts": 4}}, r"missing key text_config\.'hidden_size'"),
])
def test_config_errors_name_the_key(d, match):
    with pytest.raises(ConfigError, match=match):
        MoEConfig.from_dict(d, "x/config.json")


def test_unplaced_names_are_listed(saved):
    d, names = saved["qwen3_moe"]
    with pytest.raises(CheckpointError, match=r"1 tensor\(s\) fit no part.*'extra\.thing\.weight'") as e:
        detect(names + ["extra.thing.weight"], MoEConfig.from_dict(d), "ckpt")
    assert e.value.tensor == "extra.thing.weight" and e.value.path == "ckpt"


def test_config_and_tensors_disagreeing_on_expert_layers(saved):
    d, names = saved["qwen3_moe"]
    cfg = MoEConfig.from_dict({**d, "mlp_only_layers": [0, 1]})
    with pytest.raises(CheckpointError, match=r"routed experts in 1 layers, the tensors in 2 .*\[1\]"):
        detect(names, cfg)


def test_mixed_or_missing_expert_storage():
    per = [f"model.layers.0.mlp.experts.{e}.{p}.weight" for e in range(2) for p in ("gate_proj", "up_proj", "down_proj")]
    stacked = ["model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"]
    with pytest.raises(CheckpointError, match="expected one storage.*found per_expert under mlp, stacked under mlp"):
        detect(per + stacked)
    with pytest.raises(CheckpointError, match="found none"):
        detect(["model.layers.0.mlp.gate_proj.weight"])
    with pytest.raises(CheckpointError, match="no decoder layers found"):
        detect(["encoder.block.0.weight"])
    with pytest.raises(CheckpointError, match="mix naming schemes"):
        detect(["model.layers.0.block_sparse_moe.experts.0.w1.weight",
                "model.layers.0.block_sparse_moe.experts.0.up_proj.weight"])


def test_the_published_inkling_layout_is_detected(tiny_src):
    from inkling_quant.io.checkpoint import Checkpoint

    names = [n for h in Checkpoint.open(tiny_src).headers().values() for n in h.tensors]
    d = json.loads((tiny_src / "config.json").read_text())
    cfg = Inkling2Config.from_dict(d)
    lay = detect(names, cfg)
    assert (lay.text_prefix, lay.experts.kind, lay.vision_prefix) == ("model.llm.", "interleaved", "model.visual.")
    assert lay.expert_layers == tuple(range(cfg.num_hidden_layers))
    assert lay.experts_modules[3] == "model.llm.layers.3.mlp.experts"
    assert lay.classify("model.llm.layers.3.mlp.experts.w13_weight").projection == "gate_up"
    assert lay.classify("model.llm.unembed.weight").part == "lm_head"
    assert {lay.classify(n).part for n in names if n.startswith("mtp.")} == {"draft"}


@pytest.mark.parametrize("down,gate_up,hidden,width,want", [
    ((4, 64, 32), (4, 64, 64), 64, 32, False),   # [E, out, in]: H == 2I, down decides
    ((4, 32, 64), (4, 64, 64), 64, 32, True),    # [E, in, out]
    ((4, 64, 64), (4, 128, 64), 64, 64, False),  # H == I: gate_up decides
    ((4, 64, 64), (4, 64, 128), 64, 64, True),
    ((4, 8, 8), (4, 8, 8), 64, 32, None),        # neither fits the config
])
def test_stacked_orientation_from_the_shapes(down, gate_up, hidden, width, want):
    assert stacked_orientation(down, gate_up, hidden, width) is want


def test_layers_past_the_config_are_draft_layers(saved):
    """DeepSeek-V3 checkpoints carry their MTP module as decoder layer `num_hidden_layers`
    (layer 61 of 61): it is passed through as a draft, not taken for routed experts."""
    d, names = saved["deepseek_v3"]
    mtp = [n.replace("layers.2.", "layers.3.") for n in names if ".layers.2." in n]
    lay = detect(names + mtp, MoEConfig.from_dict(d))
    assert lay.expert_layers == (1, 2)
    assert {lay.classify(n).part for n in mtp} == {"draft"}
