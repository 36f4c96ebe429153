"""`inkling-quant plan` on standard Hugging Face MoE configs (budget_hf; docs/budget.md, "Standard
Hugging Face MoE configs").

References, independent of budget_hf: the parameter count of the model transformers builds
(`sum(p.numel())`, tiny models from tests/hf_moe_reference.py and full-size configs on the meta
device), the tensor bytes safetensors itself reports for the checkpoint save_pretrained writes,
and vLLM's KV formulas written out by hand."""
import json
import math
import warnings

import pytest
import torch

from hf_moe_reference import build
from inkling_quant import cli
from inkling_quant.errors import ConfigError, UsageError
from inkling_quant.model.inkling2 import Inkling2Config
from inkling_quant.plan.hf import HFModel, is_hf_moe
from inkling_quant.plan.inkling2 import GiB, load_config, plan
from inkling_quant.plan.kvcache import FULL, MLA, SLIDING

FAMILIES = ("qwen3_moe", "mixtral", "deepseek_v3", "qwen3_vl_moe", "llama4")
VISION = ("model.visual.", "vision_model.", "multi_modal_projector.")
IN_FLIGHT = 2 * 8192          # async scheduling x vLLM's max_num_batched_tokens on H100

# Qwen3-30B-A3B's published config.json (Qwen/Qwen3-30B-A3B)
QWEN3_30B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "decoder_sparse_step": 1, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 6144, "max_position_embeddings": 40960,
    "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
    "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 48, "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_sliding_window": False, "vocab_size": 151936}
# DeepSeek-V3's published config.json (deepseek-ai/DeepSeek-V3), the keys that shape it
DEEPSEEK_V3 = {
    "model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 128,
    "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 256, "n_shared_experts": 1,
    "moe_intermediate_size": 2048, "intermediate_size": 18432, "first_k_dense_replace": 3, "moe_layer_freq": 1,
    "vocab_size": 129280, "num_experts_per_tok": 8, "max_position_embeddings": 163840, "n_group": 8,
    "topk_group": 4, "topk_method": "noaux_tc", "num_nextn_predict_layers": 1, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16"}


def cdiv(a, b):
    return -(-a // b)


def numel(model, keep=lambda n: True) -> int:
    return sum(p.numel() for n, p in model.named_parameters() if keep(n))


@pytest.fixture(scope="module", params=FAMILIES)
def saved(request, tmp_path_factory):
    """(family, the transformers model, its save_pretrained directory)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build(request.param)
        out = tmp_path_factory.mktemp(request.param)
        model.save_pretrained(out)
    return request.param, model, out


def safetensors_bytes(root) -> int:
    from safetensors import safe_open

    total = 0
    for f in root.glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            for k in st.keys():
                t = st.get_slice(k)
                total += math.prod(t.get_shape()) * getattr(torch, {"BF16": "bfloat16", "F32": "float32"}[
                    t.get_dtype()]).itemsize
    return total


# --------------------------------------------------------------------------- parameters and bytes
def test_params_are_transformers(saved):
    family, model, root = saved
    p = plan(load_config(str(root)), "h100", 1, scheme="none")
    assert p.hf and p.params.total == numel(model)
    text = numel(model, lambda n: not n.startswith(VISION))
    assert p.params.total - p.params.vision == text
    # config only: the vision tower is not counted, and said so
    only = plan(load_config(str(root / "config.json")), "h100", 1)
    assert only.params.total == text
    assert any("vision tower not counted" in n for n in only.notes) == (text != numel(model))


def test_active_params(saved):
    family, model, root = saved
    t = model.config.get_text_config()
    p = plan(load_config(str(root)), "h100", 1)
    routed = numel(model, lambda n: ".experts." in n and "shared" not in n)
    tables = numel(model, lambda n: "embed_tokens" in n or "lm_head" in n)
    other = numel(model, lambda n: not n.startswith(VISION)) - routed - tables
    k, e = t.num_experts_per_tok, p.cfg.text.n_routed_experts
    assert p.params.active == other + routed * k // e
    assert p.params.routed_experts == routed


def test_disk_bytes_are_the_checkpoints(saved):
    family, model, root = saved
    p = plan(load_config(str(root)), "h100", 1, scheme="none")
    assert p.weights.disk_total == safetensors_bytes(root)      # every tensor save_pretrained wrote, shapes exact


def test_scheme_quantizes_routed_experts_only(saved):
    from inkling_quant.formats import FORMATS

    family, model, root = saved
    cfg = load_config(str(root))
    t = cfg.text
    none, default = plan(cfg, "h100", 1, scheme="none"), plan(cfg, "h100", 1)
    per = {f: sum(FORMATS[f].nbytes(s) for s in ((t.moe_intermediate_size, t.hidden_size),) * 2
                  + ((t.hidden_size, t.moe_intermediate_size),)) for f in ("nvfp4", "mxfp8")}
    layers = default.weights.fmt_layers
    n = t.num_hidden_layers
    assert layers["nvfp4"] == [i for i in t.moe_layers if i < round(5 * n / 6)]
    assert default.weights.disk_part("expert") == sum(len(layers[f]) * t.n_routed_experts * per[f] for f in per)
    for part in none.weights.parts():
        if part != "expert":
            assert default.weights.disk_part(part) == none.weights.disk_part(part)


def test_kv_is_the_formula(saved):
    family, model, root = saved
    t = model.config.get_text_config()
    p = plan(load_config(str(root)), "h100", 1, max_model_len=1000)
    L = t.num_hidden_layers
    if family == "deepseek_v3":  # MLA: one latent of kv_lora_rank + qk_rope_head_dim, no V
        per_token = (t.kv_lora_rank + t.qk_rope_head_dim) * 2
        assert {s.kind for s in p.kv.specs} == {MLA}
    else:                        # 2 (K and V) x KV heads x head_dim x bf16
        per_token = 2 * t.num_key_value_heads * t.head_dim * 2
        assert {s.kind for s in p.kv.specs} == {FULL}       # Llama 4's chunked layers: full (hybrid manager off)
    assert {s.bytes_per_token for s in p.kv.specs} == {per_token}
    assert p.kv.mode == "uniform" and p.kv.bytes_per_block == 16 * per_token * L
    assert p.kv_needed_bytes == cdiv(1000, 16) * 16 * per_token * L


# --------------------------------------------------------------------------- more configs
def _tiny(cls_name: str, **cfg):
    import transformers as T

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = getattr(T, cls_name.replace("ForCausalLM", "Config"))(**cfg)
        return getattr(T, cls_name)(config), config.to_dict()


@pytest.mark.parametrize("cls_name,cfg", [
    # Qwen2-MoE: q/k/v biases, a shared expert of its own width with a [1, H] gate
    ("Qwen2MoeForCausalLM", dict(vocab_size=96, hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
                                 intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                 num_hidden_layers=2, num_experts=4, num_experts_per_tok=2)),
    # DeepSeek without q_lora_rank (V2-Lite's q_proj), tied embeddings
    ("DeepseekV3ForCausalLM", dict(vocab_size=96, hidden_size=64, num_attention_heads=2, num_key_value_heads=2,
                                   intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                                   n_routed_experts=4, n_shared_experts=2, first_k_dense_replace=2,
                                   num_experts_per_tok=2, q_lora_rank=None, kv_lora_rank=32, qk_rope_head_dim=16,
                                   qk_nope_head_dim=16, v_head_dim=16, n_group=2, topk_group=1,
                                   tie_word_embeddings=True)),
    # Qwen3-MoE with attention biases and tied embeddings
    ("Qwen3MoeForCausalLM", dict(vocab_size=96, hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
                                 head_dim=32, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
                                 num_experts=4, num_experts_per_tok=2, attention_bias=True, tie_word_embeddings=True)),
])
def test_more_variants_count_like_transformers(cls_name, cfg):
    model, d = _tiny(cls_name, **cfg)
    assert plan(HFModel.from_dict(d), "h100", 1).params.total == numel(model)


@pytest.mark.parametrize("d,cls_name,total", [
    (QWEN3_30B, "Qwen3MoeForCausalLM", 30_532_122_624),      # "30.5B total"
    (DEEPSEEK_V3, "DeepseekV3ForCausalLM", 671_026_404_352),  # "671B total"
])
def test_full_size_configs_on_meta(d, cls_name, total):
    import transformers as T

    keep = {k: v for k, v in d.items() if k not in ("model_type", "torch_dtype", "topk_method", "moe_layer_freq",
                                                     "architectures")}
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        model = getattr(T, cls_name)(getattr(T, cls_name.replace("ForCausalLM", "Config"))(**keep))
    p = plan(HFModel.from_dict(d), "h200", 8)
    assert p.params.total == numel(model) == total


def test_qwen3_30b_at_tp1_and_tp2_on_h100():
    cfg = HFModel.from_dict(QWEN3_30B)
    t1, t2 = plan(cfg, "h100", 1), plan(cfg, "h100", 2)
    assert t1.params.active + t1.params.embed + t1.params.lm_head == pytest.approx(3.35e9, rel=1e-3)  # "3.3B activated"
    # KV per token: 2 x 48 layers x 4 KV heads x 128 x 2 B at TP1, half at TP2
    assert t1.kv.bytes_needed(16) == 16 * 2 * 48 * 4 * 128 * 2
    assert t2.kv.bytes_needed(16) * 2 == t1.kv.bytes_needed(16)
    assert t1.kv_needed_bytes == 40960 * 98304 and t1.fits and t2.fits
    assert t1.weights.per_gpu_part("expert") == 2 * t2.weights.per_gpu_part("expert")   # EP2: 64 of 128 experts
    # a reserve that leaves ~2 GiB of KV budget: the largest length is whole blocks of what is left
    reserve = (t1.requested_bytes - t1.weights.per_gpu_total - 2 * GiB) / GiB
    q = plan(cfg, "h100", 1, reserve_gib=reserve)
    usable = q.kv_budget_bytes - q.kv.bytes_per_block            # less vLLM's null block
    longest = usable // (16 * 98304) * 16
    assert q.largest_max_model_len == longest < 40960
    assert plan(cfg, "h100", 1, reserve_gib=reserve, max_model_len=longest).fits
    no = plan(cfg, "h100", 1, reserve_gib=reserve, max_model_len=longest + 1)
    assert not no.fits and no.verdict().startswith("DOES NOT FIT") and f"is {longest}" in no.verdict()


def test_kv_heads_below_tp_are_replicated():
    cfg = HFModel.from_dict(QWEN3_30B)                           # 4 KV heads
    p8 = plan(cfg, "h100", 8)
    assert {s.num_kv_heads for s in p8.kv.specs} == {1}          # max(1, 4 // 8)
    per_rank_kv = 48 * 2 * 128 * 2048 * 2                        # one KV head of k_proj and v_proj per layer
    q_o = 48 * 2 * 4096 * 2048 * 2 // 8
    assert p8.weights.per_gpu_part("attention") == q_o + per_rank_kv
    with pytest.raises(UsageError, match="num_attention_heads"):
        plan(cfg, "h100", 3)
    with pytest.raises(UsageError, match="num_key_value_heads"):      # 4 ranks, 6 KV heads: neither divides
        plan(HFModel.from_dict({**QWEN3_30B, "num_attention_heads": 24, "num_key_value_heads": 6}), "h100", 4)


def test_mla_cache_is_not_split_by_tp():
    cfg = HFModel.from_dict(DEEPSEEK_V3)
    p1, p8 = plan(cfg, "h200", 8, max_model_len=4096), plan(cfg, "h200", 8)
    assert p8.kv.specs[0].bytes_per_token == (512 + 64) * 2 == 1152
    assert p8.kv_needed_bytes == 163840 * 61 * 1152 and p1.kv_needed_bytes == 4096 * 61 * 1152
    assert any("MLA" in n for n in cfg.notes) and any("num_nextn_predict_layers" in n for n in cfg.notes)


def test_sliding_window_in_every_layer():
    d = {**QWEN3_30B, "use_sliding_window": True, "sliding_window": 4096}
    p = plan(HFModel.from_dict(d), "h100", 2, max_model_len=32768)
    assert {(s.kind, s.sliding_window) for s in p.kv.specs} == {(SLIDING, 4096)}
    page = 16 * 2 * 2 * 128 * 2
    assert p.kv_needed_bytes == 48 * (cdiv(min(4095 + IN_FLIGHT, 32768), 16) + 1) * page
    off = plan(HFModel.from_dict({**d, "use_sliding_window": False}), "h100", 2)   # Qwen's switch
    assert {s.kind for s in off.kv.specs} == {FULL}


# --------------------------------------------------------------------------- what is not modelled
@pytest.mark.parametrize("extra,key", [
    ({"linear_num_value_heads": 32, "layer_types": ["linear_attention", "full_attention"] * 24},
     "linear_num_value_heads"),
    ({"layer_types": ["linear_attention", "full_attention"] * 24}, r"layer_types\[0\] is 'linear_attention'"),
    ({"layer_types": ["sliding_attention", "full_attention"] * 24, "sliding_window": 4096,
      "use_sliding_window": True}, "layer_types mixes sliding_attention"),
    ({"index_topk": 2048}, "index_topk"),
    ({"moe_layer_freq": 2}, "moe_layer_freq"),
])
def test_unmodelled_attention_is_a_clear_error(tmp_path, capsys, extra, key):
    (tmp_path / "config.json").write_text(json.dumps({**QWEN3_30B, **extra}))
    with pytest.raises(ConfigError, match=key):
        HFModel.from_dict({**QWEN3_30B, **extra})
    assert cli.main(["plan", "--config", str(tmp_path), "--gpu", "h100"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("inkling-quant plan: error: ") and "Traceback" not in err and "config.json" in err


def test_not_moe_and_bad_values_are_config_errors():
    dense = {k: v for k, v in QWEN3_30B.items() if k != "num_experts"}
    with pytest.raises(ConfigError, match="no routed-expert count"):
        HFModel.from_dict(dense)
    with pytest.raises(ConfigError, match="torch_dtype"):
        HFModel.from_dict({**QWEN3_30B, "torch_dtype": "int8"})
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        HFModel.from_dict({k: v for k, v in QWEN3_30B.items() if k != "max_position_embeddings"})


# --------------------------------------------------------------------------- the CLI
def test_inkling_configs_keep_their_path():
    ref = Inkling2Config.reference()
    assert not is_hf_moe(ref.raw) and not is_hf_moe({"text_config": {"model_type": "inkling2_text"}})
    assert is_hf_moe({"text_config": {}})  # no model_type anywhere: not Inkling 2 (Inkling2Config.describes)
    assert is_hf_moe(QWEN3_30B) and is_hf_moe({"text_config": {"model_type": "qwen3_vl_moe_text"}})
    assert isinstance(load_config(None), Inkling2Config)


def test_cli_prints_and_writes_json(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B))
    assert cli.main(["plan", "--config", str(tmp_path), "--gpu", "h100", "--tp", "2"]) == 0
    text = capsys.readouterr().out
    for s in ("30.53 B total, 2.73 B active", "3.35 B with them", "EP2 experts",
              "FullAttentionSpec", "1,024 B/token/layer", "FITS on 2 x H100"):
        assert s in text, s
    assert "recipe" not in text and "DSpark" not in text
    assert cli.main(["plan", "--config", str(tmp_path), "--gpu", "h100", "--tp", "1", "--json", "-",
                     "--reserve-gib", "65"]) == 1
    d = json.loads(capsys.readouterr().out)
    assert d["fits"] is False and d["recipe"] == [] and d["params"]["total"] == 30_532_122_624
    assert d["per_gpu"]["kv"]["full"]["bytes_per_token_per_layer"] == 2 * 4 * 128 * 2
    assert d["params"]["active_with_embedding_tables"] == d["params"]["active"] + 2 * 151936 * 2048


def test_cli_on_a_saved_multimodal_checkpoint(tmp_path, capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build("qwen3_vl_moe")
        model.save_pretrained(tmp_path)
    assert cli.main(["plan", str(tmp_path), "--gpu", "h100", "--tp", "1"]) == 0
    text = capsys.readouterr().out
    vision = numel(model, lambda n: n.startswith(VISION))
    assert f"B total (vision {vision / 1e9:.2f} B)" in text and "not counted" not in text
    assert cli.main(["plan", "--config", str(tmp_path / "config.json"), "--gpu", "h100", "--tp", "1"]) == 0
    text = capsys.readouterr().out
    assert "B total (vision tower not counted)" in text and "NOTE: vision tower not counted" in text
