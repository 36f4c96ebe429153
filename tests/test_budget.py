"""`inkling-quant plan` against the serving recipe's figures (docs/budget.md derives each)."""
import argparse
import json
import math

import pytest

from inkling_quant import budget
from inkling_quant.budget import GiB, Parallel, param_counts, plan
from inkling_quant.kvcache import KVSpec, kv_layer_specs, kv_layout
from inkling_quant.errors import ConfigError, UsageError
from inkling_quant.formats import FORMATS
from inkling_quant.layout import PROJECTIONS, ModelConfig, expert_shape
from inkling_quant.synth import make_config

M = 1_048_576


@pytest.fixture(scope="module")
def ref():
    return ModelConfig.reference()


@pytest.fixture(scope="module")
def tp4(ref):
    return plan(ref, "gb200", 4)


def gib2(n: int) -> str:
    """As vLLM prints GiB: two decimals."""
    return f"{n / GiB:.2f}"


# --------------------------------------------------------------------------- parameters
def test_param_counts_match_recipe(ref):
    pc = param_counts(ref)
    assert pc.total == pytest.approx(594e9, rel=0.01)      # recipe: 594B total
    assert pc.active == pytest.approx(17e9, rel=0.01)      # recipe: 17B active
    assert pc.draft * 2 == pytest.approx(3.2e9, rel=0.01)  # BF16 draft: 3.2 GB
    assert pc.total == sum(v for k, v in pc.parts.items() if k != "draft")
    per_expert = sum(math.prod(expert_shape(ref, p)) for p in PROJECTIONS)
    assert pc.parts["expert"] == per_expert * 384 * 48
    # active = the text path + 8 of 384 experts (vision and draft are not active per text token)
    text = sum(pc.parts[p] for p in budget.TEXT_PARTS)
    assert pc.active == text + per_expert * 8 * 48
    assert pc.parts["vision"] > 0 and pc.active < pc.total - pc.parts["vision"]


# --------------------------------------------------------------------------- disk
def test_disk_size_default_scheme(ref, tp4):
    w = tp4.weights
    assert w.disk_total == pytest.approx(393e9, rel=0.005)             # ~393 GB including the draft
    assert w.disk_part("draft") == pytest.approx(3.2e9, rel=0.01)      # the 3.2 GB DSpark draft
    assert {f for (p, f) in w.disk if p == "expert"} == {"nvfp4", "mxfp8"}
    assert {f for (p, f) in w.disk if p != "expert"} == {"passthrough"}
    # every byte comes from formats: experts = layers x experts x the format's own nbytes
    for fmt, layers in (("nvfp4", 40), ("mxfp8", 8)):
        per = sum(FORMATS[fmt].nbytes(expert_shape(ref, p)) for p in PROJECTIONS)
        assert w.disk[("expert", fmt)] == layers * 384 * per
    no_draft = plan(ref, "gb200", 4, include_draft=False)
    assert w.disk_total - no_draft.weights.disk_total == w.disk_part("draft")


def test_vram_minimum_is_1_2_times_checkpoint(tp4):
    assert tp4.vram_minimum_gb == 473                                   # recipe: vram_minimum_gb 473
    assert tp4.vram_minimum_gb == math.ceil(1.2 * tp4.weights.disk_total / 1e9)


# --------------------------------------------------------------------------- KV cache formulas
def test_kv_spec_formulas_follow_vllm():
    full = KVSpec("full", num_kv_heads=4, head_size=512)
    swa = KVSpec("sliding", num_kv_heads=2, head_size=128, sliding_window=4096)
    assert full.page_size_bytes == 2 * 16 * 4 * 512 * 2
    assert full.max_memory_usage_bytes(M, 8192) == math.ceil(M / 16) * full.page_size_bytes
    assert swa.max_memory_usage_bytes(M, 8192) == (math.ceil((4096 - 1 + 8192) / 16) + 1) * swa.page_size_bytes
    # min(..., max_model_len): a short request never holds more than itself (+1 block)
    assert swa.max_memory_usage_bytes(100, 8192) == (math.ceil(100 / 16) + 1) * swa.page_size_bytes


def test_hybrid_grouping_like_vllm(ref):
    lay = kv_layout(kv_layer_specs(ref, Parallel(4, ref)))
    assert lay.mode == "hybrid"
    # 40 sliding + 8 full: group size 8 -> 5 sliding groups + 1 full group, pages unified
    kinds = [g.spec.kind for g in lay.groups]
    assert kinds.count("sliding") == 5 and kinds.count("full") == 1
    assert {g.num_layers for g in lay.groups} == {8}
    assert {g.spec.page_size_bytes for g in lay.groups} == {2 * 16 * 4 * 512 * 2}
    assert {g.spec.block_size for g in lay.groups if g.spec.kind == "sliding"} == {128}


def test_kv_per_token_and_head_replication(ref, tp4):
    assert tp4.kv_bytes_per_token() == {"full": 8 * 2 * 4 * 512 * 2, "sliding": 40 * 2 * 2 * 128 * 2}
    par = Parallel(16, ref)  # 16 > 8 sliding KV heads: replicated, one per rank
    specs = kv_layer_specs(ref, par)
    assert {s.num_kv_heads for s in specs if s.kind == "sliding"} == {1}
    assert {s.num_kv_heads for s in specs if s.kind == "full"} == {1}


# --------------------------------------------------------------------------- the recipe's serving claims
def test_1m_at_tp4_needs_64_47_gib_and_does_not_fit_on_a_gb200_tray(tp4):
    assert tp4.max_model_len == M
    assert gib2(tp4.kv_needed_bytes) == "64.47"      # vLLM's own message quotes 64.47 GiB
    assert tp4.nodes == 1 and tp4.gpu.gpus_per_node == 4
    assert not tp4.fits
    v = tp4.verdict()
    assert "DOES NOT FIT" in v
    assert "To serve at least one request with the model's max seq len (1048576), (64.47 GiB KV cache is needed" in v
    assert 0 < tp4.largest_max_model_len < M


def test_262144_fits_at_tp4(ref):
    for gpu in ("gb200", "b200"):  # verified on GB200; the recommended command targets B200
        p = plan(ref, gpu, 4, max_model_len=262_144, max_num_seqs=256)
        assert p.fits and p.nodes == 1
        assert gib2(p.kv_needed_bytes) == "16.47"
        assert p.concurrency > 1
        assert p.largest_max_model_len >= 262_144
        assert p.verdict().startswith("FITS")


def test_full_1m_fits_at_tp8_on_two_trays(ref):
    p = plan(ref, "gb200", 8)
    assert p.fits and p.nodes == 2
    assert p.largest_max_model_len == M
    assert gib2(p.kv_needed_bytes) == "32.24"


def test_weights_per_gpu_split_by_tp_and_ep(ref, tp4):
    p8 = plan(ref, "gb200", 8)
    w4, w8 = tp4.weights.per_gpu_by_part(), p8.weights.per_gpu_by_part()
    assert w4["expert"] == 2 * w8["expert"]                       # EP: 96 vs 48 experts per rank
    assert w4["expert"] * 4 == tp4.weights.disk_part("expert")
    for part in ("router", "norm", "attn_res"):                     # replicated on every rank
        assert w4[part] == w8[part] == tp4.weights.disk_part(part)
    assert w4["attention"] == pytest.approx(2 * w8["attention"], rel=1e-6)
    assert w4["embed"] == tp4.weights.disk_part("embed") // 4       # vocab-parallel
    assert 85 * GiB < tp4.weights.per_gpu_total < 100 * GiB


def test_reserve_and_break_even(tp4, ref):
    # the recipe's 1M failure holds while vLLM's non-weight overhead exceeds the break-even
    assert 0 < tp4.break_even_reserve_bytes < tp4.reserve_bytes
    lean = plan(ref, "gb200", 4, reserve_gib=tp4.break_even_reserve_bytes / GiB - 0.01)
    assert lean.fits


def test_small_synthetic_config_plans():
    cfg = ModelConfig.from_dict(make_config("tiny"))
    p = plan(cfg, "h100", 2, max_model_len=4096, reserve_gib=0)
    assert p.fits and p.weights.per_gpu_total < p.weights.disk_total
    assert json.loads(json.dumps(p.to_dict()))["fits"] is True


# --------------------------------------------------------------------------- bad input
def test_tp_not_dividing_heads_or_experts(ref):
    with pytest.raises(UsageError, match="num_attention_heads"):
        plan(ref, "gb200", 3)
    cfg = ModelConfig.from_dict({**make_config("tiny"), "num_experts": 6}, "test")
    with pytest.raises(UsageError, match="num_experts"):
        plan(cfg, "gb200", 4)
    with pytest.raises(UsageError, match="num_attention_heads"):
        plan(ref, "gb200", 64)


def test_bad_arguments(ref):
    with pytest.raises(UsageError, match="--gpu"):
        plan(ref, "a100", 4)
    with pytest.raises(UsageError, match="max_position_embeddings"):
        plan(ref, "gb200", 4, max_model_len=2 * M)
    with pytest.raises(UsageError, match="utilization"):
        plan(ref, "gb200", 4, utilization=1.5)
    with pytest.raises(UsageError, match="scheme"):
        plan(ref, "gb200", 4, scheme="nope")


def run_cli(*argv) -> int:
    p = argparse.ArgumentParser()
    budget.add_arguments(p)
    return budget.run(p.parse_args(list(argv)))


def test_missing_config_key_is_a_config_error(tmp_path):
    cfg = dict(ModelConfig.reference().raw)
    del cfg["num_key_value_heads"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        run_cli("--config", str(tmp_path / "config.json"), "--gpu", "gb200", "--tp", "4")
    with pytest.raises(ConfigError, match="not found"):
        run_cli(str(tmp_path / "nowhere"), "--gpu", "gb200", "--tp", "4")


def test_cli_table_and_json(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert run_cli("--gpu", "gb200", "--tp", "4", "--json", str(out)) == 1   # does not fit: exit 1
    text = capsys.readouterr().out
    assert "64.47 GiB KV cache is needed" in text and "473 GB" in text and "393.53 GB" in text
    d = json.loads(out.read_text())
    assert d["fits"] is False and d["tp"] == d["ep"] == 4
    assert d["disk"]["vram_minimum_gb"] == 473
    assert run_cli("--gpu", "gb200", "--tp", "4", "--max-model-len", "262144", "--json", "-") == 0
    assert json.loads(capsys.readouterr().out)["fits"] is True
