"""inkling_quant.model.inkling2 against transformers' own Inkling 2 (config, save_pretrained, parameters)."""
from __future__ import annotations

import json

import pytest
import torch

from inkling_quant.errors import ConfigError, UnknownTensorError
from inkling_quant.model import dspark
from inkling_quant.model.inkling2 import Inkling2Config, checkpoint_tensors, param_counts
from inkling_quant.io.checkpoint import Checkpoint
from modelopt_reference import read_tensors

ref = pytest.importorskip("inkling2_reference")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return ref.save_tiny(tmp_path_factory.mktemp("inkling2") / "ckpt")


def on_disk(root) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {n: (tuple(e.shape), e.dtype) for h in Checkpoint.open(root).headers().values()
            for n, e in h.tensors.items()}


def test_layout_equals_what_save_pretrained_writes(saved):
    cfg = Inkling2Config.load(saved)
    ours = {s.name: (s.shape, s.dtype) for s in checkpoint_tensors(cfg)}
    theirs = on_disk(saved)
    assert sorted(set(ours) - set(theirs)) == [] and sorted(set(theirs) - set(ours)) == []
    assert {n: v for n, v in ours.items() if theirs[n] != v} == {}
    assert any(n.endswith("mlp.experts.w13_weight") for n in ours)  # stacked experts, original names


def test_w13_rows_interleave_gate_and_up(saved):
    """Row 2j of w13_weight is expert gate row j, row 2j+1 up row j: transformers' Interleave op
    loads it into gate_up_proj with gate as the first half."""
    from transformers.models.inkling2 import Inkling2ForConditionalGeneration

    model = Inkling2ForConditionalGeneration.from_pretrained(saved, dtype=torch.bfloat16)
    w13 = read_tensors(saved)["model.llm.layers.1.mlp.experts.w13_weight"]
    gate_up = model.model.language_model.layers[1].mlp.experts.gate_up_proj.detach()
    inter = gate_up.shape[1] // 2
    assert torch.equal(w13[:, 0::2], gate_up[:, :inter]) and torch.equal(w13[:, 1::2], gate_up[:, inter:])


def test_reference_config_is_transformers_default():
    """configs/inkling-2-small.json holds Inkling2Config()'s defaults: the published model."""
    from transformers.models.inkling2 import Inkling2Config as HF

    ours = Inkling2Config.reference().raw
    theirs = HF().to_dict()
    for key in ("text_config", "vision_config"):
        for k, v in ours[key].items():
            if k not in ("dtype", "transformers_version"):
                assert theirs[key][k] == v, (key, k)


def test_parameter_counts_match_the_modeling_code():
    """594.05 B total and 17.03 B active (text, 8 of 384 experts, no embedding tables), as
    transformers' model counts them at the published defaults (on the meta device)."""
    from transformers.models.inkling2 import Inkling2Config as HF, Inkling2ForConditionalGeneration

    with torch.device("meta"):
        model = Inkling2ForConditionalGeneration(HF())
    total = sum(p.numel() for p in model.parameters())
    p = param_counts(Inkling2Config.reference())
    assert p.total == total == 594_046_172_160
    text = model.model.language_model
    experts = sum(layer.mlp.experts.gate_up_proj.numel() + layer.mlp.experts.down_proj.numel()
                  for layer in text.layers)
    no_tables = sum(q.numel() for q in text.parameters()) - text.embed_tokens.weight.numel()
    assert p.active == no_tables - experts + experts * 8 // 384 == 17_032_541_184


def test_tiny_parameter_counts(saved):
    from transformers.models.inkling2 import Inkling2ForConditionalGeneration

    model = Inkling2ForConditionalGeneration.from_pretrained(saved)
    assert param_counts(Inkling2Config.load(saved)).total == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("edit, match", [
    (lambda d: d.pop("text_config"), "no 'text_config': not the published Inkling 2 layout"),
    (lambda d: d.update(model_type="qwen3_moe"), "model_type 'qwen3_moe': not an Inkling 2 checkpoint"),
    (lambda d: d["text_config"].update(layer_types=["hybrid"]), "layer_types has 1 entries"),
    (lambda d: d["text_config"].update(layer_types=["full_attention"] * 48), "unknown"),
    (lambda d: d["text_config"].update(hidden_size=4608.0), "hidden_size must be an integer"),
    (lambda d: d["text_config"].update(n_routed_experts=1 << 17), "n_routed_experts must be between"),
    (lambda d: d["text_config"].update(unpadded_vocab_size=10**6), "exceeds vocab_size"),
    (lambda d: d["vision_config"].update(text_hidden_size=64), "must match text_config.hidden_size"),
    (lambda d: d["vision_config"].update(projector_bias="no"), "projector_bias must be true or false"),
])
def test_bad_configs_name_the_key(tmp_path, edit, match):
    d = json.loads(json.dumps(Inkling2Config.reference().raw))
    edit(d)
    p = tmp_path / "config.json"
    p.write_text(json.dumps(d))
    with pytest.raises(ConfigError, match=match):
        Inkling2Config.load(p)


def _transformers_layout(cfg_dict: dict) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """What save_pretrained writes for `cfg_dict`, without data: the model built on the meta
    device in bf16 (its fp32 modules stay fp32), names mapped back by transformers' own
    revert_weight_conversion (the step save_pretrained runs)."""
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.models.inkling2 import Inkling2Config as HF, Inkling2ForConditionalGeneration

    with torch.device("meta"):
        model = Inkling2ForConditionalGeneration._from_config(HF.from_dict(cfg_dict), dtype=torch.bfloat16)
    state = revert_weight_conversion(model, dict(model.state_dict()))
    return {n: (tuple(t.shape), t.dtype) for n, t in state.items()}


@pytest.mark.parametrize("preset", ["tiny", "bench"])
def test_synth_original_layout_equals_transformers(tmp_path, preset):
    """synth: the names, shapes and dtypes transformers writes for the same
    config (tiny: the files themselves; bench, too big to write here: the specs)."""
    from inkling_quant.synth import make_config, write_checkpoint

    cfg_dict = make_config(preset)
    theirs = _transformers_layout(cfg_dict)
    if preset == "tiny":
        ours = on_disk(write_checkpoint(tmp_path / "s", preset))
    else:
        ours = {s.name: (s.shape, s.dtype) for s in checkpoint_tensors(Inkling2Config.from_dict(cfg_dict))}
        t = Inkling2Config.from_dict(cfg_dict).text
        assert (t.hidden_size, t.moe_intermediate_size) == (4608, 2304)  # the real expert shapes
    # the bundled DSpark draft is ours, beside transformers' model (docs/draft.md): exactly its spec
    draft = {s.name: (s.shape, s.dtype) for s in dspark.draft_tensors(Inkling2Config.from_dict(cfg_dict).draft,
                                                                      dspark.PREFIX)}
    assert draft and {n: v for n, v in ours.items() if dspark.is_draft(n)} == draft
    assert {n: v for n, v in ours.items() if not dspark.is_draft(n)} == theirs


def test_meta_layout_helper_agrees_with_save_pretrained(saved):
    """The meta-device route above gives exactly what save_pretrained wrote."""
    cfg = json.loads((saved / "config.json").read_text())
    assert _transformers_layout(cfg) == on_disk(saved)


def test_names_map_both_ways_as_transformers_does():
    """transformers_name/original_name agree with transformers' own revert_weight_conversion
    (the renames save_pretrained applies), tensor by tensor: pairs found by storage identity, the
    two value-changing entries (w13 interleave, unembed padding) by name."""
    from transformers.core_model_loading import revert_weight_conversion

    from inkling_quant.model.inkling2 import original_name, transformers_name

    model = ref.inkling2.Inkling2ForConditionalGeneration._from_config(ref.tiny_config(), dtype=torch.bfloat16)
    state = dict(model.state_dict())
    by_storage = {(t.data_ptr(), tuple(t.shape)): n for n, t in state.items()}
    reverted = revert_weight_conversion(model, dict(state))
    pairs = {o: by_storage.get((t.data_ptr(), tuple(t.shape))) for o, t in reverted.items()}
    changed = {o for o, hf in pairs.items() if hf is None}
    assert {o.rsplit(".", 1)[-1] if "unembed" not in o else "unembed" for o in changed} == {"w13_weight", "unembed"}
    for o, hf in pairs.items():
        if hf is None:
            hf = "lm_head.weight" if "unembed" in o else o.replace("model.llm.", "model.language_model.").replace(
                "w13_weight", "gate_up_proj")
            assert hf in state
        assert transformers_name(o) == hf and original_name(hf) == o
    assert set(map(transformers_name, reverted)) == set(state)
    for bad in ("model.llm.layers.0.attn.wz.weight", "model.language_model.layers.0.attention_input.query"):
        with pytest.raises(UnknownTensorError, match="not a"):
            (transformers_name if bad.startswith("model.llm") else original_name)(bad)


def test_classify_every_tensor_of_the_layout():
    from inkling_quant.model.inkling2 import classify

    cfg = Inkling2Config.reference()
    parts = {}
    for s in checkpoint_tensors(cfg):
        t = classify(s.name)
        parts[t.part] = parts.get(t.part, 0) + 1
        if t.part == "expert":
            assert t.projection in ("w13", "w2") and t.suffix == "weight" and t.layer is not None
    assert parts["expert"] == 2 * 48 and parts["router"] == 2 * 48 and parts["attention"] == 7 * 48
    assert classify("model.llm.layers.3.mlp.experts.w13_weight_outer_scale_denominator").suffix == \
        "weight_outer_scale_denominator"
    assert classify("model.llm.layers.3.mlp.experts.w2_weight.input_amax").suffix == "weight.input_amax"
    with pytest.raises(UnknownTensorError):
        classify("model.layers.0.self_attn.q_proj.weight")
