"""`inkling-quant plan` on DeepSeek-V4 (plan/deepseek_v4.py; docs/budget.md, "DeepSeek-V4").

References, independent of plan: the parameters of the model transformers 5.25 builds
(`DeepseekV4ForCausalLM`, `sum(p.numel())`); the names, shapes and bytes of the tiny release
tests/sources_reference.py writes from it (FP8 Linears with UE8M0 scales, MXFP4 experts); vLLM
0.33's KV formulas written out by hand below, and the figures vLLM 0.33's own spec and grouping
code gave for DeepSeek-V4-Flash's config when run on CPU here (vllm 0.33.0 wheel:
`DeepseekV4Attention.get_kv_cache_spec`, `kv_cache_planning.get_kv_cache_groups`,
`_max_memory_usage_bytes_from_groups`)."""
from __future__ import annotations

import json
import warnings

import pytest
import torch
from safetensors import safe_open

import sources_reference as ref
from inkling_quant import cli
from inkling_quant.errors import ConfigError, UsageError
from inkling_quant.plan.hf import HFModel, param_counts, text_tensors
from inkling_quant.plan.inkling2 import plan

# DeepSeek-V4-Flash's config.json, the keys that shape it (deepseek-ai/DeepSeek-V4-Flash; legacy
# `compress_ratios`, its last entry the MTP block's)
FLASH = {"model_type": "deepseek_v4", "vocab_size": 129280, "hidden_size": 4096, "moe_intermediate_size": 2048,
         "num_hidden_layers": 43, "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512,
         "q_lora_rank": 1024, "num_experts_per_tok": 6, "n_routed_experts": 256, "n_shared_experts": 1,
         "o_groups": 8, "o_lora_rank": 1024, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
         "hc_mult": 4, "sliding_window": 128, "num_hash_layers": 3, "num_nextn_predict_layers": 1,
         "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0], "max_position_embeddings": 1048576,
         "torch_dtype": "bfloat16", "expert_dtype": "fp4",
         "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                 "weight_block_size": [128, 128], "scale_fmt": "ue8m0"}}
TINY = dict(vocab_size=96, hidden_size=256, moe_intermediate_size=160, num_hidden_layers=4, num_attention_heads=4,
            head_dim=64, q_lora_rank=64, o_groups=2, o_lora_rank=32, index_n_heads=4, index_head_dim=32,
            n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, sliding_window=8, hc_mult=3)


def cdiv(a, b):
    return -(-a // b)


@pytest.mark.parametrize("extra", [
    {"layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                     "compressed_sparse_attention"], "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"]},
    {"compress_ratios": [0, 4, 128, 128, 0]},   # legacy, its MTP entry past the layers
    {}])                                       # transformers' default schedule, 3 hash layers
def test_params_are_transformers(extra):
    """Every parameter transformers' DeepseekV4ForCausalLM builds, counted from the config alone
    (the router bias and hash table are buffers there: not parameters)."""
    import transformers as T
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = T.DeepseekV4Config(**TINY, **extra)
        model = T.DeepseekV4ForCausalLM(cfg)
    got = param_counts(HFModel.from_dict({**TINY, **extra, "model_type": "deepseek_v4", "max_position_embeddings": 4096}))
    assert got.total == sum(p.numel() for p in model.parameters())
    assert got.routed_experts == sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    root = tmp_path_factory.mktemp("v4plan")
    return ref.to_v4_release(ref.deepseek_v4(root / "bf16"), root / "release")


def test_tensors_and_bytes_are_the_releases(release):
    """The tensors plan lists are the tiny release's (names and shapes, MTP block aside, routed
    experts apart); its FP8 and MXFP4 bytes, scales included, are the release's own."""
    with safe_open(release / "model.safetensors", "pt") as f:
        stored = {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}
    decoder = {k: v for k, v in stored.items() if not k.startswith("mtp.")}
    m = HFModel.from_config(json.loads((release / "config.json").read_text()), "config.json")
    listed = {name: shape for name, _, _, shape in text_tensors(m.text)}
    assert listed == {k: s for k, (s, _) in decoder.items() if ".experts." not in k and not k.endswith(".scale")}
    w = plan(m, "h200", tp=1, max_model_len=256, scheme="none").weights
    nbytes = {k: torch.tensor([], dtype=getattr(torch, {"F8_E4M3": "float8_e4m3fn", "F8_E8M0": "float8_e8m0fnu",
                                                        "I8": "int8"}.get(d, "float32"))).element_size()
              * int(torch.tensor(s).prod()) for k, (s, d) in decoder.items()}
    fp8 = [k for k, (_, d) in decoder.items() if d == "F8_E4M3"]
    assert any(".attn.wq_b." in k for k in fp8) and not any("compressor" in k for k in fp8)
    assert sum(b for (_, f), b in w.disk.items() if f == "fp8_block") == \
        sum(nbytes[k] + nbytes[k[: -len("weight")] + "scale"] for k in fp8)
    assert w.disk[("expert", "mxfp4_rows")] == sum(b for k, b in nbytes.items() if ".experts." in k)


def test_flash_kv_is_vllm_033s():
    """DeepSeek-V4-Flash at vLLM 0.33's defaults (FlashMLA, fp8_ds_mla, block 256, 2 x 8192 tokens
    in flight): the groups, block bytes and per-request bytes its own code gave, and the same by
    hand: 43 SWA pages of 64 x 584 (padded to 576), one 256-token block of the 21 CSA layers'
    compressed KV and indexer keys and the 20 HCA layers' compressed KV, the C4 states in blocks
    of 4 tokens over a window of 8, the C128 states in blocks of 8 over 128; a window's pages
    bound by the tokens in flight, the full-history pages by the length."""
    m = HFModel.from_dict(FLASH)
    pad = lambda x: cdiv(x, 576) * 576  # noqa: E731
    swa, c4, idx, c128 = pad(64 * 584), pad(64 * 584), pad(64 * 132), pad(2 * 584)
    s4, s4i, s8 = pad(4 * 8192), pad(4 * 2048), pad(8 * 4096)
    assert (swa, c4, idx, c128, s4, s4i, s8) == (37440, 37440, 8640, 1728, 32832, 8640, 32832)
    for batched, length, vllm_bytes in ((8192, 65536, 6953541120), (8192, 1048576, 10802142720),
                                        (2048, 65536, 1950359040), (2048, 1048576, 5798960640)):
        p = plan(m, "h200", tp=8, max_model_len=length, scheme="nvfp4", max_num_batched_tokens=batched)
        assert [(g.num_layers, g.page_bytes) for g in p.kv.groups] == \
            [(22, 22 * swa), (21, 21 * swa), (62, 21 * (c4 + idx) + 20 * c128), (42, 21 * (s4 + s4i)), (20, 20 * s8)]
        block = 21 * (c4 + idx) + 20 * c128
        assert p.kv.bytes_per_block == block == 1002240
        flight = 2 * batched
        pages = 2 * (cdiv(min(127 + flight, length), 64) + 1) + cdiv(length, 256) \
            + cdiv(min(7 + flight, length), 4) + 1 + cdiv(min(127 + flight, length), 8) + 1
        assert p.kv_needed_bytes == block * pages == vllm_bytes
        assert p.block_size == 256


def test_kv_is_the_same_on_every_tp_rank():
    m = HFModel.from_dict(FLASH)
    one, eight = (plan(m, "h200", tp=tp, max_model_len=65536, scheme="none") for tp in (1, 8))
    assert one.kv_needed_bytes == eight.kv_needed_bytes and one.kv.bytes_per_block == eight.kv.bytes_per_block
    assert one.weights.per_gpu_total > 7 * eight.weights.per_gpu_total


@pytest.mark.parametrize("tp, says", [(16, "o_groups"), (3, "num_attention_heads")])
def test_tp_must_split_heads_and_output_groups(tp, says):
    with pytest.raises(UsageError, match=says):
        plan(HFModel.from_dict(FLASH), "h200", tp=tp, scheme="none")


def test_block_size_must_be_the_backends():
    with pytest.raises(UsageError, match="multiples of 256"):
        plan(HFModel.from_dict(FLASH), "h200", tp=8, block_size=128, scheme="none")
    assert plan(HFModel.from_dict(FLASH), "h200", tp=8, block_size=512, scheme="none").kv.bytes_per_block > 1002240


def test_without_csa_layers_the_window_buckets_are_capped():
    """No CSA layer, so no bucket mixes page sizes: vLLM 0.33 keeps the 43 HCA caches one group
    (43 x 1,728 B a block) and splits each sliding-window bucket into groups of as many layers as
    that block holds (kv_cache_planning.py:992-1024): 43 SWA groups of one, 22 HCA-state groups."""
    p = plan(HFModel.from_dict({**FLASH, "compress_ratios": [128] * 44}), "h200", tp=8, max_model_len=65536,
             scheme="none")
    assert p.kv.bytes_per_block == 43 * 1728
    assert sorted((g.spec.kind, g.num_layers) for g in p.kv.groups) == \
        sorted([("sliding", 1)] * 43 + [("hca", 43)] + [("hca state", 2)] * 21 + [("hca state", 1)])


def test_hash_layers_are_read_per_layer():
    """mlp_layer_types names the hash-routed layers wherever they are: theirs hold tid2eid, the
    others the router bias."""
    m = HFModel.from_dict({**FLASH, "mlp_layer_types": ["moe", "hash_moe"] + ["moe"] * 41})
    names = {n for n, *_ in text_tensors(m.text)}
    assert "layers.1.ffn.gate.tid2eid" in names and "layers.0.ffn.gate.bias" in names
    assert "layers.0.ffn.gate.tid2eid" not in names


@pytest.mark.parametrize("edit, key", [({"compress_ratios": [0, 4, 64]}, "compress_ratios"),
                                      ({"compress_ratios": [[4]] * 44}, "compress_ratios"),
                                      ({"compress_rates": {"compressed_sparse_attention": 8}}, "compress_rates"),
                                      ({"compress_rates": [4, 128]}, "compress_rates"),
                                      ({"mlp_layer_types": ["moe"]}, "mlp_layer_types"),
                                      ({"layer_types": ["full_attention"] * 43}, "layer_types")])
def test_bad_v4_keys_are_config_errors(edit, key):
    with pytest.raises(ConfigError, match=key):
        HFModel.from_dict({**{k: v for k, v in FLASH.items() if k != "compress_ratios"}, **edit})


def test_cli_prints_and_writes_json(tmp_path, capsys):
    (tmp_path / "flash").mkdir()
    (tmp_path / "flash" / "config.json").write_text(json.dumps(FLASH))
    assert cli.main(["plan", "--config", str(tmp_path / "flash"), "--gpu", "h200", "--tp", "8", "--scheme", "nvfp4",
                     "--max-model-len", "65536", "--json", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    assert "fp8_ds_mla" in out and "CSA compressed" in out and "packed pool" in out and "6.48 GiB" in out
    d = json.loads((tmp_path / "p.json").read_text())
    assert d["fits"] and d["block_size"] == 256 and d["params"]["total"] == pytest.approx(284.33e9, rel=1e-4)
