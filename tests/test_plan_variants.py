"""`inkling-quant plan --variant`: the two official Inkling 2 Small checkpoints and the engine
checks for the GPU that serves them (docs/budget.md, "The official checkpoints" and "Engine
checks").

Every figure is checked against a calculation written out here from the published dimensions
(hidden 4608, expert width 2304, 384 experts, 48 layers) and the formats' definitions (NVFP4: two
e2m1 codes per byte, one e4m3 scale per 16, a per-expert fp32 amax and denominator; MXFP8: one
e4m3 byte per value, one e8m0 byte per 32), not against the plan's own output."""
import argparse
import copy
import json

import pytest
import torch
from safetensors.torch import save_file

from inkling_quant.cli import plan as plan_cmd
from inkling_quant.errors import UsageError
from inkling_quant.export.modelopt import quantization
from inkling_quant.formats import FORMATS
from inkling_quant.model.inkling2 import Inkling2Config, checkpoint_tensors, default_layer_types, experts_module
from inkling_quant.plan.inkling2 import GB, VARIANTS, plan
from inkling_quant.plan.moe_checks import FAIL, PASS, WARN, moe_checks
from inkling_quant.plan.variants import choose_variant, cookbook_rows, stored_variant

H, I, E, LAYERS = 4608, 2304, 384, 48
DRAFT = 3_200_000_000                       # the recipe's figure for the bundled DSpark draft
NVFP4_EXPERT = 3 * H * I // 2 + 3 * H * I // 16 + 2 * (4 + 4)   # codes + e4m3 scales + (amax, denominator) x w13, w2
MXFP8_EXPERT = 3 * H * I + 3 * H * I // 32                      # e4m3 values + e8m0 scales
EXPERTS = {"default": E * (40 * NVFP4_EXPERT + 8 * MXFP8_EXPERT), "mxfp8": E * LAYERS * MXFP8_EXPERT}


@pytest.fixture(scope="module")
def ref():
    return Inkling2Config.reference()


@pytest.fixture(scope="module")
def rest(ref):
    """Every tensor but the routed experts, as the published layout stores it (the model's table)."""
    return sum(s.nbytes for s in checkpoint_tensors(ref, include_experts=False))


def run_cli(*argv) -> int:
    p = argparse.ArgumentParser()
    plan_cmd.add_arguments(p)
    return plan_cmd.run(p.parse_args(list(argv)))


# --------------------------------------------------------------------------- bytes
@pytest.mark.parametrize("variant", ["default", "mxfp8"])
def test_disk_and_per_gpu_follow_from_the_formats(ref, rest, variant):
    p4, p8 = plan(ref, "gb200", 4, variant=variant), plan(ref, "gb200", 8, variant=variant)
    assert p4.variant == variant and p4.scheme == VARIANTS[variant].scheme
    w = p4.weights
    assert w.disk_part("expert") == EXPERTS[variant]
    assert w.disk_total == EXPERTS[variant] + rest + DRAFT
    # EP4 / EP8: 96 / 48 whole experts per rank; the rest as vLLM places it, the same for both variants
    assert w.per_gpu_part("expert") == EXPERTS[variant] // 4
    assert p8.weights.per_gpu_part("expert") == EXPERTS[variant] // 8
    other = plan(ref, "gb200", 4, variant="mxfp8" if variant == "default" else "default").weights
    assert w.per_gpu_total - w.per_gpu_part("expert") == other.per_gpu_total - other.per_gpu_part("expert")
    assert w.per_gpu_part("draft") == DRAFT                          # replicated: an upper bound


def test_the_published_figures(ref, rest):
    # the recipe: "~393 GB on disk including the 3.2 GB DSpark draft"; the cookbook: ~394 / ~623 GB
    default, mxfp8 = (EXPERTS[v] + rest + DRAFT for v in ("default", "mxfp8"))
    assert round(default / GB) == 393 and round(mxfp8 / GB) == 623
    assert round((EXPERTS["default"] + rest) / GB) == 390                  # without the draft neither follows
    # the cookbook's ~94 / ~151 GB per GPU at TP4 are one EP4 rank's routed experts alone (96 of 384)
    assert (round(EXPERTS["default"] / 4 / GB), round(EXPERTS["mxfp8"] / 4 / GB)) == (94, 151)
    assert round((EXPERTS["default"] + rest + DRAFT) / 4 / GB) == 98          # not the checkpoint split evenly
    rows = {v: {r["claim"]: r for r in cookbook_rows(ref, plan(ref, "gb200", 4, variant=v))} for v in VARIANTS}
    for v, r in rows.items():
        assert {x["reproduced"] for c, x in r.items() if "routed experts only" in c} == {True}
        assert {x["reproduced"] for c, x in r.items() if "split evenly" in c or c.startswith("weights per")} == {False}
        assert all(x["source"].startswith("SGLang") for x in r.values())
    assert rows["mxfp8"]["on disk, thinkingmachines/Inkling-2-Small-MXFP8"]["reproduced"]
    assert not rows["default"]["on disk, thinkingmachines/Inkling-2-Small"]["reproduced"]  # 393.43 rounds to 393


def test_a_scheme_plans_the_converted_checkpoint(ref):
    p = plan(ref, "gb200", 4, scheme="mxfp8")
    assert p.variant is None and p.weights.disk_part("expert") == E * LAYERS * sum(
        FORMATS["mxfp8"].nbytes(s) for s in ((I, H), (I, H), (H, I)))
    with pytest.raises(UsageError, match="not both"):
        plan(ref, "gb200", 4, scheme="default", variant="default")
    with pytest.raises(UsageError, match="--variant"):
        plan(ref, "gb200", 4, variant="nvfp4")


# --------------------------------------------------------------------------- engine checks
def by_rule(checks, fmt):
    return {c.rule: c for c in checks if c.message.startswith(fmt)}


@pytest.mark.parametrize("tp", [4, 8, 32])
@pytest.mark.parametrize("arch", ["sm90", "sm100"])
def test_ep_keeps_whole_experts(ref, tp, arch):
    checks = moe_checks(ref, tp, True, {"nvfp4", "mxfp8"}, arch=arch)
    assert all(c.source for c in checks)
    assert not any(c.level == FAIL for c in checks)
    for fmt in ("nvfp4", "mxfp8"):
        assert "do not apply" in by_rule(checks, fmt)["scale groups"].message


def test_pure_tp_on_blackwell(ref):
    assert all(c.level == PASS for c in moe_checks(ref, 4, False, {"nvfp4", "mxfp8"}, arch="sm100"))  # 576 per rank
    tp8 = moe_checks(ref, 8, False, {"nvfp4", "mxfp8"}, arch="sm100")                               # 288 per rank
    tiles = by_rule(tp8, "nvfp4")["kernel tiles"]
    assert tiles.level == WARN and "576" in tiles.message and "#46879" in tiles.source and "#46880" in tiles.source
    assert not any(c.level == FAIL for c in tp8) and any("recommend EP" in c.message for c in tp8)
    tp32 = moe_checks(ref, 32, False, {"nvfp4", "mxfp8"}, arch="sm100")                             # 72 per rank
    nv, mx = by_rule(tp32, "nvfp4")["scale groups"], by_rule(tp32, "mxfp8")["scale groups"]
    assert nv.level == mx.level == FAIL and "72" in nv.message
    assert "#49949" in nv.source and "modelopt.py" in mx.source


def test_hopper_is_weight_only(ref):
    checks = moe_checks(ref, 8, False, {"nvfp4", "mxfp8"}, arch="sm90")
    nv, mx = by_rule(checks, "nvfp4"), by_rule(checks, "mxfp8")
    assert nv["datapath"].level == mx["datapath"].level == WARN
    assert "W4A16" in nv["datapath"].message and "MARLIN" in nv["datapath"].message
    assert "W8A16" in mx["datapath"].message and "#34664" in mx["datapath"].source
    assert nv["kernel tiles"].level == WARN and "288 to 320" in nv["kernel tiles"].message   # Marlin's padding
    blackwell = moe_checks(ref, 4, True, {"nvfp4", "mxfp8"}, arch="sm100")
    assert {c.level for c in blackwell if c.rule == "datapath"} == {PASS}


# --------------------------------------------------------------------------- the command
def test_exit_status_follows_the_checks(tmp_path, capsys):
    d = copy.deepcopy(Inkling2Config.reference().raw)
    d["text_config"]["moe_intermediate_size"] = 2336                  # 2336 / 8 = 292: cuts 16- and 32-groups
    (tmp_path / "config.json").write_text(json.dumps(d))
    assert run_cli("--config", str(tmp_path / "config.json"), "--tp", "8", "--no-ep", "--json", "-") == 1
    out = json.loads(capsys.readouterr().out)
    fails = [c for c in out["checks"] if c["level"] == FAIL]
    assert fails and all(c["source"] and c["rule"] == "scale groups" for c in fails)
    assert out["verdict"].startswith("DOES NOT LOAD") and out["engine"] == "vLLM 0.33.0"
    assert run_cli("--config", str(tmp_path / "config.json"), "--tp", "8", "--quiet") == 0   # EP: whole experts
    assert run_cli("--gpu", "h200", "--tp", "8", "--no-ep", "--max-model-len", "262144", "--quiet") == 0  # WARN only
    assert capsys.readouterr().out == ""


def test_json_and_text(capsys):
    assert run_cli("--variant", "mxfp8", "--gpu", "h200", "--tp", "8", "--max-model-len", "262144", "--json", "-") == 0
    d = json.loads(capsys.readouterr().out)
    assert d["variant"]["repo"] == "thinkingmachines/Inkling-2-Small-MXFP8" and d["scheme"] == "mxfp8"
    assert d["gpu"]["arch"] == "sm90" and d["gpu"]["generation"] == "Hopper"
    assert {c["level"] for c in d["checks"]} == {PASS, WARN}
    assert all(set(c) == {"level", "rule", "message", "source"} for c in d["checks"])
    assert any(r["source"].startswith("SGLang") and "~151 GB" == r["recipe"] for r in d["recipe"])
    assert run_cli("--gpu", "h200", "--tp", "8", "--max-model-len", "262144") == 0
    text = capsys.readouterr().out
    for s in ("variant 'default' (thinkingmachines/Inkling-2-Small)", "Engine checks (vLLM 0.33.0 on H200, Hopper",
              "WARN  datapath: nvfp4", "source: vllm 0.33.0", "cookbook", "routed experts only (96 per EP4 rank)"):
        assert s in text, s
    with pytest.raises(SystemExit) as e:
        run_cli("--variant", "default", "--scheme", "mxfp8")
    assert e.value.code == 2


# --------------------------------------------------------------------------- the variant a checkpoint holds
def test_variant_from_the_declared_quantization(tmp_path, ref, capsys):
    for variant in VARIANTS:
        scheme = VARIANTS[variant].scheme
        layers = [(experts_module(i), FORMATS["mxfp8" if scheme == "mxfp8" or i >= 40 else "nvfp4"])
                  for i in range(LAYERS)]
        (tmp_path / "config.json").write_text(json.dumps({**ref.raw, "quantization_config": quantization(
            layers, weight_only=False)}))
        assert stored_variant(tmp_path, ref)[0] == variant
        assert run_cli(str(tmp_path), "--tp", "8", "--max-model-len", "262144", "--json", "-") == 0
        assert json.loads(capsys.readouterr().out)["variant"]["name"] == variant
    # an index downloaded before its shards: the headers cannot be read, the config still says
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {f"{experts_module(i)}.w13_weight": "model-00001.safetensors"
                                        for i in range(LAYERS)}}))
    assert stored_variant(tmp_path, ref) == ("mxfp8", "routed experts stored as variant 'mxfp8' "
                                                      "(thinkingmachines/Inkling-2-Small-MXFP8) stores them, read "
                                                      "from the quantization config")
    with pytest.raises(UsageError, match="disagrees"):
        choose_variant(ref, str(tmp_path), "default", None)           # the directory holds the mxfp8 variant
    assert choose_variant(ref, str(tmp_path), None, "default")[:2] == (None, "default")  # --scheme: as asked
    (tmp_path / "config.json").write_text(json.dumps(ref.raw))
    assert stored_variant(tmp_path, ref)[0] is None                 # nothing declared: --variant or the default


def test_variant_from_the_shard_headers(tmp_path):
    d = copy.deepcopy(Inkling2Config.reference().raw)
    d["text_config"].update(num_hidden_layers=6, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                            hidden_size=64, layer_types=default_layer_types(6))
    d["vision_config"]["text_hidden_size"] = 64
    cfg = Inkling2Config.from_dict(d, "tiny")                        # 6 layers: NVFP4 0-4, MXFP8 5 by default
    stored = {"nvfp4": ((8, 64, 32), torch.uint8), "mxfp8": ((8, 64, 64), torch.float8_e4m3fn),
              "bf16": ((8, 64, 64), torch.bfloat16)}
    for kinds, want in ((["nvfp4"] * 5 + ["mxfp8"], "default"), (["mxfp8"] * 6, "mxfp8"), (["bf16"] * 6, None)):
        save_file({f"{experts_module(i)}.w13_weight": torch.zeros(*stored[k][0], dtype=stored[k][1])
                   for i, k in enumerate(kinds)}, str(tmp_path / "model.safetensors"))
        variant, how = stored_variant(tmp_path, cfg)
        assert variant == want and "shard headers" in how
    assert "passthrough in 6 layer(s)" in how
    assert choose_variant(cfg, str(tmp_path), None, None)[:2] == (None, "default")  # a BF16 source: a conversion
