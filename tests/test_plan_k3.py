"""`inkling-quant plan` on Kimi-K3 (plan/kimi_k3.py; docs/budget.md, "Kimi-K3").

References, independent of plan: the names, shapes and bytes of the tiny release
tests/sources_reference.py writes (vLLM 0.33's loader names); vLLM 0.33's hybrid KV rules written
out by hand below, and the figures vLLM 0.33's own spec and grouping code gave for Kimi-K3's
released config when run on CPU here (vllm 0.33.0 wheel: `MambaStateShapeCalculator.kda_state_shape`,
`MambaSpec`, `MLAAttentionSpec`, `get_kv_cache_groups`, `_max_memory_usage_bytes_from_groups`; the
block-size step `_align_hybrid_block_size` restated line for line)."""
from __future__ import annotations

import json

import pytest
from safetensors import safe_open

import sources_reference as ref
from inkling_quant import cli
from inkling_quant.errors import ConfigError, UsageError
from inkling_quant.plan.hf import HFModel, text_tensors
from inkling_quant.plan.inkling2 import plan

MLA_LAYERS = [i for i in range(1, 94) if i % 4 == 0 or i == 93]
# Kimi-K3's released text config, the keys that shape it (moonshotai/Kimi-K3; docs/budget.md)
K3 = {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3", "text_config": {
    "model_type": "kimi_linear", "vocab_size": 163840, "hidden_size": 7168, "intermediate_size": 18432,
    "num_hidden_layers": 93, "num_attention_heads": 96, "num_key_value_heads": 96, "moe_intermediate_size": 3072,
    "num_experts": 896, "num_experts_per_token": 16, "num_shared_experts": 2, "first_k_dense_replace": 1,
    "moe_layer_freq": 1, "routed_expert_hidden_size": 3584, "latent_moe_use_norm": True, "q_lora_rank": 1536,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": True,
    "mla_use_output_gate": True, "attn_res_block_size": 12, "tie_word_embeddings": False,
    "max_position_embeddings": 1048576, "torch_dtype": "bfloat16",
    "linear_attn_config": {"kda_layers": [i for i in range(1, 94) if i not in MLA_LAYERS], "full_attn_layers": MLA_LAYERS,
                           "num_heads": 96, "head_dim": 128, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0,
                           "use_full_rank_gate": True}}}


def cdiv(a, b):
    return -(-a // b)


@pytest.mark.parametrize("tp, length, block, vllm_bytes", [
    (8, 131072, 768, 3822059520), (8, 1048576, 768, 29196288000), (4, 131072, 1536, 4034396160),
    (16, 131072, 384, 3726508032)])
def test_kv_is_vllm_033s(tp, length, block, vllm_bytes):
    """The figures vLLM 0.33's code gave, and the same by hand: a KDA layer's state per GPU (3
    conv rows of 3 x 96 x 128 / TP in bf16, 96 / TP heads of 128 x 128 fp32); the attention block
    the smallest multiple of 128 tokens whose MLA page (576 bf16 a token) holds it, every page
    that size; 24 MLA layers one group, 69 KDA layers three of 23; a block 24 pages; a request
    3 blocks per KDA group ("align": prefix caching on) and cdiv(L, block) MLA blocks."""
    kda = 3 * (3 * 96 * 128 // tp) * 2 + 96 // tp * 128 * 128 * 4
    assert block == 128 * cdiv(kda, 128 * 1152)
    p = plan(HFModel.from_dict(K3), "b200", tp=tp, max_model_len=length, scheme="nvfp4")
    page = block * 1152
    assert p.block_size == block and p.kv.bytes_per_block == 24 * page
    assert [(g.spec.kind, g.num_layers) for g in p.kv.groups] == [("kda state", 23)] * 3 + [("mla", 24)]
    assert p.kv_needed_bytes == 24 * page * (3 * 3 + cdiv(length, block)) == vllm_bytes


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    return ref.kimi_k3_release(tmp_path_factory.mktemp("k3plan") / "release")


def test_tensors_and_expert_bytes_are_the_releases(release):
    """The text tensors plan lists are the tiny release's under `language_model.model.` (its LM
    head under `language_model.`), routed experts apart; with --scheme none its experts are the
    release's MXFP4 bytes, sized on the latent width."""
    with safe_open(release / "model.safetensors", "pt") as f:
        stored = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    m = HFModel.from_config(json.loads((release / "config.json").read_text()), "config.json")
    listed = {("language_model." if name == "lm_head.weight" else "language_model.model.") + name: shape
              for name, _, _, shape in text_tensors(m.text)}
    assert listed == {k: s for k, s in stored.items()
                      if k.startswith("language_model.") and ".experts." not in k}
    w = plan(m, "b200", tp=1, max_model_len=256, scheme="none").weights
    experts = sum(s[0] * s[1] for k, s in stored.items() if ".experts." in k)   # uint8 codes and scales
    assert w.disk[("expert", "mxfp4_rows")] == experts
    assert m.text.expert_hidden == 192
    assert plan(m, "b200", tp=1, max_model_len=256, scheme="nvfp4").params.total == _params(stored)


def _params(stored) -> int:
    """The release's text parameters as plan counts them: every tensor's elements, an MXFP4
    expert weight's two per code byte (its scales are not parameters), the router's score bias
    not (a buffer, as DeepSeek's is in transformers)."""
    n = 0
    for k, s in stored.items():
        if not k.startswith("language_model.") or k.endswith(("e_score_correction_bias", "weight_scale")):
            continue
        elems = 1
        for d in s:
            elems *= d
        n += 2 * elems if k.endswith("weight_packed") else elems
    return n


def test_without_ep_the_expert_width_is_padded_per_rank():
    """vLLM pads an expert's width per rank up to 256 without EP (model.py:419-428): TP16's
    3072 / 16 = 192 rows are held as 256, so the experts take 256 / 192 of the unpadded share."""
    m = HFModel.from_dict(K3)
    ep, tp = (plan(m, "b200", tp=16, ep=e, scheme="mxfp8").weights.per_gpu_part("expert") for e in (True, False))
    assert tp * 3 == ep * 4


def test_flash_kda_only_where_vllm_picks_it():
    """FlashKDA's checkpoint block only for head_dim 128 with a gate_lower_bound: without one, 2
    blocks a KDA group (kda.py:363-380)."""
    k3 = json.loads(json.dumps(K3))
    del k3["text_config"]["linear_attn_config"]["gate_lower_bound"]
    p = plan(HFModel.from_dict(k3), "b200", tp=8, max_model_len=131072, scheme="nvfp4")
    assert p.kv_needed_bytes == 24 * 768 * 1152 * (3 * 2 + cdiv(131072, 768))


def test_tp_must_split_the_heads():
    with pytest.raises(UsageError, match="num_attention_heads"):
        plan(HFModel.from_dict(K3), "b200", tp=5, scheme="nvfp4")


def test_kda_layers_are_read_from_1():
    bad = json.loads(json.dumps(K3))
    bad["text_config"]["linear_attn_config"]["kda_layers"] = [0, 1]
    with pytest.raises(ConfigError, match="kda_layers"):
        HFModel.from_dict(bad)


def test_cli_prints_the_kda_state(tmp_path, capsys):
    (tmp_path / "k3").mkdir()
    (tmp_path / "k3" / "config.json").write_text(json.dumps(K3))
    assert cli.main(["plan", "--config", str(tmp_path / "k3"), "--gpu", "b200", "--tp", "16", "--scheme", "nvfp4",
                     "--max-model-len", "131072"]) == 0
    out = capsys.readouterr().out
    assert "MambaSpec(align, 3 blocks)" in out and "block 384" in out and "FITS on 16 x B200" in out
