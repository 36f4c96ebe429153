"""`draft extract` / `draft strip` on the published Inkling 2 layout (synth with
its bundled DSpark draft, named as vLLM's DSpark drafter names it: inkling_quant/dspark.py), the
extracted config checked with vLLM 0.33's own speculators config code (vendored: tests/vendor)."""
from __future__ import annotations

import importlib.util
import json
import re
import sys
import types
from pathlib import Path

import pytest
import torch

from modelopt_reference import read_tensors
from inkling_quant import draft

from inkling_quant.model import dspark
from inkling_quant.convert import Options, convert
from inkling_quant.errors import CheckpointError, UnknownTensorError
from inkling_quant.model.inkling2 import Inkling2Config, checkpoint_tensors
from inkling_quant.synth import write_checkpoint

LAYERS = 6
# vLLM 0.33.0's speculators config code, vendored unmodified (tests/vendor/README.md)
VLLM_SPECULATORS = Path(__file__).parent / "vendor" / "vllm_speculators"


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("draft-orig")


@pytest.fixture(scope="module")
def src(tmp) -> Path:
    return write_checkpoint(tmp / "src", "tiny", layers=LAYERS)


@pytest.fixture(scope="module")
def extracted(src, tmp) -> Path:
    draft.extract(src, tmp / "extracted")
    return tmp / "extracted"


@pytest.fixture(scope="module")
def stripped(src, tmp) -> Path:
    draft.strip(src, tmp / "stripped")
    return tmp / "stripped"


@pytest.fixture(scope="module")
def converted(src, tmp) -> Path:
    convert(src, tmp / "converted", Options(default_activation_amax=4.0, max_shard_bytes=1 << 17), quiet=True)
    return tmp / "converted"


# --------------------------------------------------------------------------- the spec
def test_synth_bundles_the_spec(src):
    cfg = Inkling2Config.load(src)
    assert cfg.draft is not None
    names = {s.name for s in checkpoint_tensors(cfg)}
    spec = [s for s in dspark.draft_tensors(cfg.draft, dspark.PREFIX)]
    assert {s.name for s in spec} <= names and {n for n in read_tensors(src) if dspark.is_draft(n)} == {s.name for s in spec}
    d = cfg.draft  # target-derived dimensions
    t = cfg.text
    assert (d.hidden_size, d.num_attention_heads, d.num_key_value_heads, d.head_dim, d.vocab_size) == \
        (t.hidden_size, t.num_attention_heads, t.num_key_value_heads, t.head_dim, t.vocab_size)
    assert d.intermediate_size == t.num_experts_per_tok * t.moe_intermediate_size
    assert d.aux_hidden_state_layer_ids == (2, 3, 4, 5, 6)  # 6 layers: the last 5 (target ids 1..5)


def test_full_size_draft():
    """At the published dims: 1,813,475,329 parameters, 3.63 GB (the recipe says 3.2 GB; see docs/draft.md)."""
    ref = Inkling2Config.reference()
    full = dspark.DSparkConfig.from_dict(dspark.make_draft_config(ref.text, ref.raw["text_config"]))
    full.check_target(ref.text, "reference")
    assert dspark.param_count(full) == 1_813_475_329
    assert sum(s.nbytes for s in dspark.draft_tensors(full)) == 3_626_960_388


def test_classify_and_default_layer_ids():
    assert dspark.default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # DeepSpec's Qwen3-4B config
    assert dspark.default_target_layer_ids(48, 5) == [1, 12, 23, 34, 45]
    t = dspark.classify("mtp.layers.3.self_attn.q_proj.weight")
    assert (t.part, t.layer, t.projection, t.suffix) == ("draft", 3, "q_proj", "weight")
    assert dspark.classify("mtp.markov_head.markov_w1.weight").layer is None
    with pytest.raises(UnknownTensorError):
        dspark.classify("dspark.layers.3.self_attn.q_proj.weight")  # the prefix before the release's files


# --------------------------------------------------------------------------- extract
def test_extract_is_the_spec_with_the_source_bytes(src, extracted):
    s, o = read_tensors(src), read_tensors(extracted)
    cfg = Inkling2Config.load(src)
    spec = {x.name: x for x in dspark.draft_tensors(cfg.draft)}
    assert set(o) == set(spec)
    for name, t in o.items():
        assert (tuple(t.shape), t.dtype) == (spec[name].shape, spec[name].dtype), name
        assert same(t, s[dspark.PREFIX + name]), name
    config = json.loads((extracted / "config.json").read_text())
    assert config == json.loads((src / "config.json").read_text())[dspark.CONFIG_KEY]
    assert [(x.name, x.shape) for x in draft.draft_specs(config)] == [(x.name, x.shape) for x in spec.values()]


def _vllm_keys_read(fn: str) -> set[str]:
    """The config_dict keys one `@register_speculator` updater of vLLM's algos.py reads."""
    src = (VLLM_SPECULATORS / "algos.py").read_text()
    body = src.split(f"def {fn}(", 1)[1].split("\n@register_speculator", 1)[0]
    keys = set(re.findall(r'config_dict(?:\.get\(|\[)"(\w+)"', body))
    for tup in re.findall(r"for key in \((.*?)\):", body, re.S):
        keys |= set(re.findall(r'"(\w+)"', tup))
    return keys


def _load_vllm_speculators(monkeypatch):
    """vLLM 0.33's SpeculatorsConfig (base.py) and its updaters (algos.py), executed from the
    source with the one vLLM helper base.py imports stubbed (vLLM itself is not installed)."""
    pkg = "vllm.transformers_utils.configs.speculators"
    for name in ("vllm", "vllm.transformers_utils", "vllm.transformers_utils.configs", pkg):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    utils = types.ModuleType("vllm.transformers_utils.utils")
    utils.without_trust_remote_code = lambda kw: {k: v for k, v in kw.items() if k != "trust_remote_code"}
    monkeypatch.setitem(sys.modules, utils.__name__, utils)
    mods = {}
    for mod in ("algos", "base"):
        spec = importlib.util.spec_from_file_location(f"{pkg}.{mod}", VLLM_SPECULATORS / f"{mod}.py")
        mods[mod] = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, spec.name, mods[mod])
        spec.loader.exec_module(mods[mod])
    return mods["base"].SpeculatorsConfig


def test_extracted_config_is_what_vllms_speculators_config_accepts(extracted, monkeypatch):
    config = json.loads((extracted / "config.json").read_text())
    assert _vllm_keys_read("update_dspark") - {"architectures"} <= set(config)  # every key vLLM's updater reads
    SpeculatorsConfig = _load_vllm_speculators(monkeypatch)
    assert SpeculatorsConfig.extract_vllm_speculative_config(config) == \
        {"method": "dspark", "num_speculative_tokens": config["block_size"]}
    hf = SpeculatorsConfig.from_pretrained(str(extracted))
    assert hf.architectures == ["Qwen3DSparkModel"] and hf.dspark_bonus_anchor is True
    assert hf.eagle_aux_hidden_state_layer_ids == config["aux_hidden_state_layer_ids"]
    assert hf.target_layer_ids == [i - 1 for i in config["aux_hidden_state_layer_ids"]]
    # the shapes vLLM's Qwen3DSparkForCausalLM allocates from that config (qwen3_dflash.py:84-93,
    # 205-220, 265-266, 352-362, 476-495; qwen3_dspark.py:61-80, 164-230), derived apart from dspark.py
    H, hd, nh, nkv, inter = hf.hidden_size, hf.head_dim, hf.num_attention_heads, hf.num_key_value_heads, \
        hf.intermediate_size
    want = {"fc.weight": (H, hf.target_hidden_size * len(hf.eagle_aux_hidden_state_layer_ids)),
            "hidden_norm.weight": (H,), "norm.weight": (H,),
            "markov_head.markov_w1.weight": (hf.vocab_size, hf.markov_rank),
            "markov_head.markov_w2.weight": (hf.draft_vocab_size or hf.vocab_size, hf.markov_rank),
            "confidence_head.proj.weight": (1, H + hf.markov_rank), "confidence_head.proj.bias": (1,)}
    for k in range(hf.num_hidden_layers):
        p = f"layers.{k}."
        want |= {p + "self_attn.q_proj.weight": (nh * hd, H), p + "self_attn.k_proj.weight": (nkv * hd, H),
                 p + "self_attn.v_proj.weight": (nkv * hd, H), p + "self_attn.o_proj.weight": (H, nh * hd),
                 p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                 p + "mlp.gate_proj.weight": (inter, H), p + "mlp.up_proj.weight": (inter, H),
                 p + "mlp.down_proj.weight": (H, inter), p + "input_layernorm.weight": (H,),
                 p + "post_attention_layernorm.weight": (H,)}
    assert {n: tuple(t.shape) for n, t in read_tensors(extracted).items()} == want


# --------------------------------------------------------------------------- strip
def test_strip_is_the_target_bit_exact(src, stripped):
    s, o = read_tensors(src), read_tensors(stripped)
    assert set(o) == {n for n in s if not dspark.is_draft(n)}
    assert all(same(o[n], s[n]) for n in o)
    config = json.loads((stripped / "config.json").read_text())
    assert dspark.CONFIG_KEY not in config and draft.STRIPPED_KEY in config
    cfg = Inkling2Config.load(stripped)
    assert cfg.draft is None and {x.name for x in checkpoint_tensors(cfg)} == set(o)
    with pytest.raises(CheckpointError, match="no DSpark draft"):
        draft.extract(stripped, stripped.parent / "nothing")


def test_convert_of_stripped_and_full(stripped, converted, src, tmp):
    convert(stripped, tmp / "stripped-converted", Options(default_activation_amax=4.0), quiet=True)
    a, b = read_tensors(tmp / "stripped-converted"), read_tensors(converted)
    assert set(b) - set(a) == {n for n in read_tensors(src) if dspark.is_draft(n)}
    assert all(same(a[n], b[n]) for n in a)  # the same target, with or without the draft beside it
    q = json.loads((converted / "config.json").read_text())["quantization_config"]
    assert "mtp*" in q["exclude_modules"] and not any(k.startswith("mtp") for k in q["quantized_layers"])


def test_converted_draft_is_the_source_draft(src, converted, extracted, tmp):
    s, c = read_tensors(src), read_tensors(converted)
    assert all(same(c[n], s[n]) for n in s if dspark.is_draft(n))
    draft.extract(converted, tmp / "extracted-converted")
    e1, e2 = read_tensors(extracted), read_tensors(tmp / "extracted-converted")
    assert set(e1) == set(e2) and all(same(e1[n], e2[n]) for n in e1)
    assert json.loads((tmp / "extracted-converted" / "config.json").read_text()) == \
        json.loads((extracted / "config.json").read_text())  # no quantization_config travels
    draft.strip(converted, tmp / "converted-stripped")
    assert Inkling2Config.load(tmp / "converted-stripped").draft is None


def test_mismatched_draft_config_is_refused(src, tmp):
    bad = json.loads((src / "config.json").read_text())
    bad[dspark.CONFIG_KEY]["transformer_layer_config"]["hidden_size"] += 1
    from inkling_quant.errors import ConfigError
    with pytest.raises(ConfigError, match="hidden_size"):
        Inkling2Config.from_dict(bad)
