"""`inkling-quant plan` on the published Inkling 2 config (docs/budget.md derives each figure).

The expected values are computed here independently of budget/kvcache: transformers' parameter
counts (research notes, count_params.out), vLLM's spec formulas written out by hand."""
import argparse
import copy
import json
import math

import pytest

from inkling_quant.cli import plan as plan_cmd
from inkling_quant.errors import ConfigError, UsageError
from inkling_quant.formats import FORMATS
from inkling_quant.model.inkling2 import Inkling2Config, checkpoint_tensors, param_counts
from inkling_quant.plan.inkling2 import GB, GiB, plan, recipe_rows
from inkling_quant.plan.kvcache import CONV, FULL, SLIDING, KVSpec, kv_layout, layer_specs
from inkling_quant.plan.moe_checks import FAIL, PASS, WARN, moe_checks

M = 1_048_576
IN_FLIGHT = 2 * 16384      # async scheduling x vLLM's max_num_batched_tokens on >= 160 GiB GPUs


def cdiv(a, b):
    return -(-a // b)


@pytest.fixture(scope="module")
def ref():
    return Inkling2Config.reference()


@pytest.fixture(scope="module")
def tp4(ref):
    return plan(ref, "gb200", 4)


@pytest.fixture(scope="module")
def rows(ref, tp4):
    return {r["claim"]: r for r in recipe_rows(ref, tp4)}


def small_config(**text) -> Inkling2Config:
    d = copy.deepcopy(Inkling2Config.reference().raw)
    d["text_config"].update(text)
    return Inkling2Config.from_dict(d, "test")


# --------------------------------------------------------------------------- parameters
def test_param_counts_are_transformers(ref, tp4):
    # transformers' Inkling2ForConditionalGeneration on meta, defaults (research: count_params.out)
    assert tp4.params.total == 594_046_172_160
    assert tp4.params.active == 17_032_541_184
    assert tp4.params == param_counts(ref)
    assert tp4.params.routed_experts == 48 * 384 * 3 * 4608 * 2304
    assert tp4.params.active_experts == 48 * 8 * 3 * 4608 * 2304


# --------------------------------------------------------------------------- disk
def test_disk_bytes_ask_the_formats(ref, tp4):
    # --scheme default: what convert writes in ModelOpt's per-module form (the official checkpoints'
    # stacked form: tests/test_plan_variants.py)
    w = plan(ref, "gb200", 4, scheme="default").weights
    per = {f: sum(FORMATS[f].nbytes(s) for s in ((2304, 4608), (2304, 4608), (4608, 2304))) for f in ("nvfp4", "mxfp8")}
    assert w.disk[("expert", "nvfp4")] == 40 * 384 * per["nvfp4"]
    assert w.disk[("expert", "mxfp8")] == 8 * 384 * per["mxfp8"]
    rest = sum(s.nbytes for s in checkpoint_tensors(ref, include_experts=False))
    assert sum(b for (p, _), b in w.disk.items() if p not in ("expert", "draft")) == rest
    assert w.disk_part("draft") == 3_200_000_000                         # the recipe's figure, not computed
    computed = w.disk_total - w.disk_part("draft")
    assert computed / GB == pytest.approx(390.2, abs=0.1)
    assert w.disk_total / GB == pytest.approx(393.4, abs=0.1)            # recipe: ~393 GB incl. the draft
    assert plan(ref, "gb200", 4, scheme="default", include_draft=False).weights.disk_total == computed


def test_weights_per_gpu_split_by_tp_and_ep(ref, tp4):
    p8 = plan(ref, "gb200", 8)
    w4, w8 = tp4.weights, p8.weights
    assert w4.per_gpu_part("expert") * 4 == w4.disk_part("expert")      # EP4: 96 of 384 whole experts
    assert w4.per_gpu_part("expert") == 2 * w8.per_gpu_part("expert")
    for part in ("embed", "router", "norm", "attn_res", "vision", "draft"):  # replicated (draft: upper bound)
        assert w4.per_gpu_part(part) == w8.per_gpu_part(part) == w4.disk_part(part)
    assert w4.per_gpu_part("lm_head") == w4.disk_part("lm_head") // 4   # 201,024 rows = 64 x 3141: exact
    # attention splits by heads / KV heads, only the small relative-position table is replicated
    table = 48 * 16 * 1024 * 2
    assert w4.per_gpu_part("attention") - table == pytest.approx((w4.disk_part("attention") - table) / 4, rel=1e-6)
    assert 90 * GiB < w4.per_gpu_total < 100 * GiB


def test_pure_tp_experts_shard_the_intermediate_dim(ref, tp4):
    p = plan(ref, "gb200", 4, ep=False, scheme="default")
    nv = FORMATS["nvfp4"].nbytes
    assert p.weights.per_gpu[("expert", "nvfp4")] == 40 * 384 * (2 * nv((576, 4608)) + nv((4608, 576)))
    assert p.weights.per_gpu_part("expert") == pytest.approx(tp4.weights.per_gpu_part("expert"), rel=1e-3)


# --------------------------------------------------------------------------- KV cache and state
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_kv_bytes_per_token_per_layer_per_rank(ref, tp):
    specs = layer_specs(ref.text, tp)
    kv_r = 8 // tp
    for s in specs:
        if s.kind in (FULL, SLIDING):
            assert s.bytes_per_token == 2 * kv_r * 128 * 2
            assert s.page_size_bytes == 16 * 2 * kv_r * 128 * 2
    assert [s.kind for s in specs].count(FULL) == 8 and [s.kind for s in specs].count(SLIDING) == 40
    assert [i for i, s in enumerate(x for x in specs if x.kind != CONV) if s.kind == FULL] == list(range(5, 48, 6))
    assert {s.sliding_window for s in specs if s.kind == SLIDING} == {1024}


@pytest.mark.parametrize("tp", [1, 4, 8])
def test_conv_state_page(ref, tp):
    conv = [s for s in layer_specs(ref.text, tp) if s.kind == CONV]
    assert len(conv) == 48                                          # one per decoder layer
    raw = 2 * 128 + 2 * 4608 // 8                                   # K + V + attn-out + mlp-out per head
    head = 2 ** math.ceil(math.log2(raw))
    assert (raw, head) == (1408, 2048)
    for s in conv:
        assert (s.block_size, s.sliding_window, s.head_size_v) == (4, 4, 0)
        assert s.page_size_bytes == (8 // tp) * 4 * head * 2      # num_heads x K states x head_size x bf16


def test_pages_unify_and_group_like_vllm(ref):
    lay = kv_layout(layer_specs(ref.text, 4), IN_FLIGHT)
    assert lay.mode == "hybrid"
    kinds = [g.spec.kind for g in lay.groups]
    assert (kinds.count(FULL), kinds.count(SLIDING), kinds.count(CONV)) == (1, 5, 6)
    assert {g.num_layers for g in lay.groups} == {8}
    assert {g.spec.page_size_bytes for g in lay.groups} == {32768}
    assert {g.spec.block_size for g in lay.groups if g.spec.kind != CONV} == {32}   # 16 grown to 32
    assert lay.bytes_per_block == 8 * 32768


def test_1m_request_at_tp4(tp4):
    assert tp4.max_in_flight_tokens == IN_FLIGHT
    page = 32768
    full = cdiv(M, 32) * 8 * page
    sliding = 5 * (cdiv(min(1023 + IN_FLIGHT, M), 32) + 1) * 8 * page
    conv = 6 * (cdiv(min(3 + IN_FLIGHT, M), 4) + 1) * 8 * page
    assert tp4.kv_needed_bytes == full + sliding + conv
    assert tp4.kv.bytes_by_kind(M) == {CONV: conv, FULL: full, SLIDING: sliding}
    assert full == 8 * GiB                                           # 8 layers x 1,024 B x 1M tokens
    assert f"{tp4.kv_needed_bytes / GiB:.2f}" != "64.47"             # the recipe's figure does not follow


def test_sliding_spec_admission_cap():
    swa = KVSpec(SLIDING, 2, 128, 128, 16, sliding_window=1024)
    assert swa.max_memory_usage_bytes(M, 8192) == (cdiv(1023 + 8192, 16) + 1) * swa.page_size_bytes
    assert swa.max_memory_usage_bytes(100, 8192) == (cdiv(100, 16) + 1) * swa.page_size_bytes


def test_async_scheduling_and_batched_tokens(ref):
    assert plan(ref, "h200", 4).max_in_flight_tokens == 2 * 8192
    assert plan(ref, "gb200", 4, concurrent_batches=1).max_in_flight_tokens == 16384
    assert plan(ref, "gb200", 4, max_num_batched_tokens=2048).max_in_flight_tokens == 4096


# --------------------------------------------------------------------------- the recipe's claims
def test_recipe_rows(rows):
    yes = {"total parameters", "active parameters", "on disk, default variant, incl. draft", "vram_minimum_gb",
           "1,048,576 tokens at TP8 (GB200)", "262,144 tokens at TP4 (GB200)"}
    no = {"KV cache for 1,048,576 tokens at TP4", "1,048,576 tokens at TP4 (GB200)"}
    # the recipe's three verdicts under its own KV figure (an explicit assumption): all reproduced
    recipe_kv = {"1,048,576 tokens at TP4 (GB200), recipe's KV", "1,048,576 tokens at TP8 (GB200), recipe's KV",
                 "262,144 tokens at TP4 (GB200), recipe's KV"}
    yes |= recipe_kv
    assert set(rows) == yes | no
    assert rows["1,048,576 tokens at TP4 (GB200), recipe's KV"]["ours"].startswith("does not fit: needs 64.47 ")
    assert rows["1,048,576 tokens at TP8 (GB200), recipe's KV"]["ours"].startswith("fits: needs 32.24 ")
    assert rows["262,144 tokens at TP4 (GB200), recipe's KV"]["ours"].startswith("fits: needs 16.12 ")
    assert all(rows[c]["reproduced"] for c in yes)
    assert not any(rows[c]["reproduced"] for c in no)
    assert rows["KV cache for 1,048,576 tokens at TP4"]["recipe"] == "64.47 GiB"
    assert "recipe's figure" in rows["on disk, default variant, incl. draft"]["ours"]


def test_three_verdicts(ref, tp4):
    # recipe: 1M does not fit at TP4 -- with the published config it fits unless vLLM's
    # non-weight overhead were over 40 GiB per GPU: not reproduced, and not tuned to be
    assert tp4.fits and tp4.break_even_reserve_bytes > 40 * GiB
    assert not plan(ref, "gb200", 4, reserve_gib=tp4.break_even_reserve_bytes / GiB + 0.01).fits
    assert plan(ref, "gb200", 4, reserve_gib=tp4.break_even_reserve_bytes / GiB - 0.01).fits
    p8 = plan(ref, "gb200", 8)
    assert p8.fits and p8.nodes == 2 and p8.largest_max_model_len == M
    short = plan(ref, "gb200", 4, max_model_len=262_144, max_num_seqs=256)
    assert short.fits and short.nodes == 1 and short.verdict().startswith("FITS")


def test_does_not_fit_message_is_vllms(ref):
    p = plan(ref, "gb200", 4, reserve_gib=55)
    assert not p.fits and 0 < p.largest_max_model_len < M
    assert ("DOES NOT FIT on 4 x GB200 (1 NVL72 compute tray): To serve at least one request with the model's "
            "max seq len (1048576), (21.29 GiB KV cache is needed, which is larger than the available KV cache "
            "memory") in p.verdict()
    assert "raise --tp" in plan(ref, "h100", 4).verdict()                # the weights alone do not fit


# --------------------------------------------------------------------------- MoE divisibility
def test_ep_needs_nothing(ref):
    for tp in (4, 8):
        checks = moe_checks(ref, tp, True, {"nvfp4", "mxfp8"})
        assert checks and all(c.level == PASS for c in checks)


def test_pure_tp8_warns_and_recommends_ep(ref):
    p = plan(ref, "gb200", 8, ep=False)
    text = [c.message for c in p.checks if c.level == WARN]
    assert {c.level for c in p.checks} == {PASS, WARN} and p.loadable
    assert any("576" in m and "multiple of 128" in m and "288 to 320" in m for m in text)  # #46879, padded in 0.33
    assert any("recommend EP" in m for m in text)
    assert all(c.level == PASS for c in moe_checks(ref, 4, False, {"mxfp8"}))


def test_pure_tp_misaligned_block_scales_is_an_error():
    cfg = small_config(moe_intermediate_size=2336)                  # 2336 / 8 = 292: not whole 16/32 blocks
    p = plan(cfg, "gb200", 8, ep=False)
    assert not p.loadable and not p.fits and p.verdict().startswith("DOES NOT LOAD")
    assert any(c.level == FAIL and "scale group" in c.message for c in p.checks)
    assert plan(cfg, "gb200", 8).loadable                           # EP keeps whole experts


# --------------------------------------------------------------------------- bad input
def test_bad_parallelism_and_arguments(ref):
    with pytest.raises(UsageError, match="num_attention_heads"):
        plan(ref, "gb200", 5)
    with pytest.raises(UsageError, match="num_key_value_heads"):
        plan(ref, "gb200", 16)
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
    plan_cmd.add_arguments(p)
    return plan_cmd.run(p.parse_args(list(argv)))


def test_bad_config_is_a_config_error_naming_the_key(tmp_path):
    d = copy.deepcopy(Inkling2Config.reference().raw)
    del d["text_config"]["num_key_value_heads"]
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        run_cli("--config", str(tmp_path / "config.json"))
    d["text_config"]["num_key_value_heads"] = "8"
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ConfigError, match="text_config.num_key_value_heads must be an integer"):
        run_cli("--config", str(tmp_path))                          # a directory holding config.json
    with pytest.raises(ConfigError, match="not found"):
        run_cli(str(tmp_path / "nowhere"))


def test_cli_table_and_json(tmp_path, capsys, ref):
    (tmp_path / "config.json").write_text(json.dumps(ref.raw))
    assert run_cli("--config", str(tmp_path)) == 0                  # 1M at TP4 fits by our arithmetic
    text = capsys.readouterr().out
    for s in ("594.05 B total", "17.03 B active", "390.23 GB computed", "3.20 GB DSpark draft (the recipe's figure",
              "64.47 GiB", "NO", "short-conv state", "reserve"):
        assert s in text, s
    assert run_cli("--tp", "8", "--max-model-len", "262144", "--json", "-") == 0
    d = json.loads(capsys.readouterr().out)
    assert d["fits"] is True and d["tp"] == d["ep"] == 8
    assert d["params"]["total"] == 594_046_172_160
    assert d["per_gpu"]["kv"]["full"]["bytes_per_token_per_layer"] == 2 * 1 * 128 * 2
    assert {r["claim"] for r in d["recipe"] if not r["reproduced"] and "recipe" in r["source"]} == {
        "KV cache for 1,048,576 tokens at TP4", "1,048,576 tokens at TP4 (GB200)"}
    out = tmp_path / "plan.json"
    assert run_cli("--tp", "8", "--no-ep", "--quiet", "--json", str(out)) == 0
    assert capsys.readouterr().out == ""
    assert any("recommend EP" in c["message"] for c in json.loads(out.read_text())["checks"])
