"""Reliability, round 3: each defect class through the CLI, as a user (or a requeued Slurm job, or a
hostile file) meets it.

  1. a finished output is never touched by a part run (a requeued part, another conversion's
     part, a second --finalize)
  2. one writer per OUT whatever the mode: a part and a whole run (or parts of another split)
     exclude each other; real processes, one of them paused
  3. a user's scheme file is recorded in the output and verified against
  4. a config that lies about the tensors is refused before anything is written
  5. calibration for another model (an expert past the count, a checkpoint with more experts)
  6. activation scales whose fp32 reciprocal is infinite (convert refuses, verify fails them)
  7. one-line errors, never tracebacks, for hostile scheme files, configs and adapters
  8. verify accepts another writer's lossless widening of a pass-through tensor, and only that
  9. verify's work is bounded by what the checkpoint holds, whatever the config claims
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from test_safety import Result, _children, _cmdline, assert_refused, call, changes, tree_digest

from inkling_quant.synth import write_checkpoint

AMAX = ["--default-activation-amax", "4", "--quiet"]
SMALL_SHARDS = ["--max-shard-size", "300KB"]
INDEX = "model.safetensors.index.json"
HANG_S = 20


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("reliability")


@pytest.fixture(scope="module")
def src(base) -> Path:
    return write_checkpoint(base / "src", "tiny", experts=4)


@pytest.fixture(scope="module")
def finished(base, src) -> Path:
    """A conversion split in two parts and finalized. Tests copy it before touching it."""
    out = base / "parts"
    for p in ("1/2", "2/2"):
        assert call("convert", src, out, *AMAX, *SMALL_SHARDS, "--part", p).rc == 0
    r = call("convert", src, out, *AMAX, *SMALL_SHARDS, "--finalize")
    assert r.rc == 0, r.err
    assert call("verify", out, "--quiet").rc == 0
    return out


def _copy(d: Path, to: Path) -> Path:
    import shutil

    return Path(shutil.copytree(d, to))


def _shard(out: Path) -> Path:
    return sorted(out.glob("*.safetensors"))[0]


# =========================================================================== 1. finished outputs stay finished
@pytest.mark.parametrize("part_args", [["--part", "1/2", "--resume"], ["--part", "2/2"]], ids=["requeued", "rerun"])
def test_part_rerun_on_finished_output_changes_nothing(finished, tmp_path, part_args):
    out = _copy(finished, tmp_path / "out")
    before = tree_digest(out)
    r = call("convert", finished.parent / "src", out, "--default-activation-amax", "4", *SMALL_SHARDS, *part_args)
    assert r.rc == 0, r.err
    assert "already complete" in r.out
    assert not changes(before, tree_digest(out))
    assert call("verify", out, "--quiet").rc == 0


def test_part_of_another_conversion_refused_on_finished_output(finished, tmp_path):
    out = _copy(finished, tmp_path / "out")
    before = tree_digest(out)
    r = call("convert", finished.parent / "src", out, "--default-activation-amax", "5", "--quiet", *SMALL_SHARDS,
             "--part", "1/2")  # another amax: the same names and sizes, other bytes
    assert_refused(r, 2)
    assert "finished conversion of another source, or with another" in r.err
    assert not changes(before, tree_digest(out))


def test_second_finalize_says_finalized_and_checks_it(finished, tmp_path):
    out = _copy(finished, tmp_path / "out")
    before = tree_digest(out)
    r = call("convert", finished.parent / "src", out, "--default-activation-amax", "4", *SMALL_SHARDS, "--finalize")
    assert r.rc == 0, r.err
    assert "already finalized" in r.out and "not converted yet" not in r.out + r.err
    assert not changes(before, tree_digest(out))
    shard = _shard(out)
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))  # damaged since: a second --finalize says so
    r = call("convert", finished.parent / "src", out, *AMAX, *SMALL_SHARDS, "--finalize")
    assert_refused(r, 2)
    assert shard.name in r.err and "differs" in r.err


def test_part_of_another_conversion_refused_beside_unfinished_parts(src, tmp_path):
    out = tmp_path / "out"
    assert call("convert", src, out, *AMAX, *SMALL_SHARDS, "--part", "1/2").rc == 0
    before = tree_digest(out)
    r = call("convert", src, out, "--default-activation-amax", "5", "--quiet", *SMALL_SHARDS, "--part", "2/2")
    assert_refused(r, 2)
    assert "another conversion" in r.err
    assert not changes(before, tree_digest(out))


# =========================================================================== 2. one writer per OUT
def _popen(*args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "inkling_quant.cli", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _paused_when(proc: subprocess.Popen, ready, what: str) -> None:
    """SIGSTOP `proc` once `ready()` holds (it holds its lock and is writing)."""
    deadline = time.time() + 60
    while time.time() < deadline and proc.poll() is None and not ready():
        time.sleep(0.002)
    proc.send_signal(signal.SIGSTOP)
    assert proc.poll() is None, f"{what} ended before it could be paused"


def _resume_and_finish(proc: subprocess.Popen) -> Result:
    proc.send_signal(signal.SIGCONT)
    out, err = proc.communicate(timeout=120)
    return Result(proc.returncode, out, err)


def _writing(out: Path) -> bool:
    return any(p.name.startswith(".inkling-quant-convert") for p in out.glob(".*")) if out.is_dir() else False


def test_paused_part_excludes_a_whole_run_and_finalize(src, tmp_path):
    out = tmp_path / "out"
    part = _popen("convert", src, out, *AMAX, "--max-shard-size", "60KB", "--part", "1/2")
    try:
        _paused_when(part, lambda: _writing(out), "the part")
        for args in (["--overwrite", "--default-activation-amax", "5", "--quiet"], ["--finalize", *AMAX],
                     ["--resume", *AMAX]):
            r = call("convert", src, out, *args)
            assert_refused(r, 2)
            assert "convert --part 1/2 run" in r.err and f"pid {part.pid}" in r.err, r.err
        other_split = call("convert", src, out, *AMAX, "--max-shard-size", "60KB", "--part", "1/3")
        assert_refused(other_split, 2)
        assert "convert --part 1/2 run" in other_split.err
    finally:
        r = _resume_and_finish(part)
    assert r.rc == 0, r.err
    assert call("convert", src, out, *AMAX, "--max-shard-size", "60KB", "--part", "2/2").rc == 0
    assert call("convert", src, out, *AMAX, "--max-shard-size", "60KB", "--finalize").rc == 0
    assert call("verify", out, "--against", src, "--quiet").rc == 0


def test_paused_whole_run_excludes_parts(src, tmp_path):
    out = tmp_path / "out"
    whole = _popen("convert", src, out, *AMAX, "--max-shard-size", "60KB")
    try:
        _paused_when(whole, lambda: _writing(out), "the conversion")
        r = call("convert", src, out, *AMAX, "--max-shard-size", "60KB", "--part", "2/2")
        assert_refused(r, 2)
        assert "another conversion" in r.err and f"pid {whole.pid}" in r.err, r.err
    finally:
        r = _resume_and_finish(whole)
    assert r.rc == 0, r.err
    assert call("verify", out, "--against", src, "--quiet").rc == 0


def test_killed_part_lock_is_stale_and_taken_over(src, tmp_path):
    """A part killed with -9 leaves its lock: a whole run (same host) takes over the stale lock."""
    out = tmp_path / "out"
    part = _popen("convert", src, out, *AMAX, "--max-shard-size", "60KB", "--part", "1/2")
    _paused_when(part, lambda: _writing(out), "the part")
    part.kill()
    part.communicate()
    assert list(tmp_path.glob(".out-part-1-of-2.inkling-quant.lock"))
    r = call("convert", src, out, *AMAX, "--max-shard-size", "60KB", "--overwrite")
    assert r.rc == 0, r.err
    assert not list(tmp_path.glob(".out*.lock"))


# =========================================================================== 3. user schemes verify
def _scheme(tmp_path: Path, keep: bool = True) -> Path:
    """A user's scheme: MXFP8 first, then (`keep`) one layer left unquantized, NVFP4 elsewhere."""
    p = tmp_path / "mine.toml"
    p.write_text('description = "MXFP8 first"\n'
                 '[[rules]]\npart = "expert"\nlayers = "0-9"\nformat = "mxfp8"\n'
                 + ('[[rules]]\npart = "expert"\nlayers = 12\nformat = "passthrough"\n' if keep else "")
                 + '[[rules]]\npart = "expert"\nlayers = "all"\nformat = "nvfp4"\n')
    return p


def test_user_scheme_output_verifies(src, tmp_path):
    scheme = _scheme(tmp_path)
    out = tmp_path / "out"
    assert call("convert", src, out, "--scheme", scheme, *AMAX).rc == 0
    recorded = json.loads((out / "hf_quant_config.json").read_text())["converter"]["scheme"]
    assert recorded["rules"][1] == {"part": "expert", "layers": "12", "format": "passthrough"}
    scheme.unlink()  # the output verifies without the file
    for args in ([], ["--against", src]):
        r = call("verify", out, *args, "--json", tmp_path / "v.json")
        assert r.rc == 0, r.out + r.err
        assert json.loads((tmp_path / "v.json").read_text())["scheme"] == "mine.toml"
    r = call("verify", out, "--scheme", "default", "--quiet")  # what the tensors are not
    assert r.rc == 1 and "prescribes" in r.out


def test_user_scheme_given_to_verify(src, tmp_path):
    """ModelOpt's form records nothing of ours: the file is given to verify (it writes only
    quantized experts: no layer left unquantized)."""
    scheme = _scheme(tmp_path, keep=False)
    out = tmp_path / "out"
    assert call("convert", src, out, "--scheme", scheme, *AMAX, "--output-format", "modelopt-hf").rc == 0
    assert call("verify", out, "--scheme", scheme, "--against", src, "--quiet").rc == 0


def test_recorded_scheme_that_is_not_a_scheme_fails(src, tmp_path):
    out = tmp_path / "out"
    assert call("convert", src, out, "--scheme", _scheme(tmp_path), *AMAX).rc == 0
    q = json.loads((out / "hf_quant_config.json").read_text())
    q["converter"]["scheme"]["rules"][0]["layers"] = "9-0"
    (out / "hf_quant_config.json").write_text(json.dumps(q))
    r = call("verify", out, "--quiet")
    assert r.rc == 1 and "rules[0].layers" in r.out, r.out


# =========================================================================== 4. a config that lies
def test_flat_config_of_another_family_over_inkling_tensors_refused(src, tmp_path):
    lie = _copy(src, tmp_path / "lie")
    t = json.loads((src / "config.json").read_text())["text_config"]
    (lie / "config.json").write_text(json.dumps({
        "model_type": "qwen3_moe", "hidden_size": t["hidden_size"], "num_hidden_layers": t["num_hidden_layers"],
        "num_experts": t["n_routed_experts"], "num_experts_per_tok": t["num_experts_per_tok"],
        "moe_intermediate_size": t["moe_intermediate_size"], "num_attention_heads": 4, "vocab_size": 512}))
    for cmd in (["convert", lie, tmp_path / "out", *AMAX], ["inspect", lie]):
        r = call(*cmd)
        assert_refused(r, 2)
        assert "qwen3_moe" in r.err and "must agree" in r.err
    assert not (tmp_path / "out").exists()


# =========================================================================== 5. calibration for another model
def test_calibration_naming_an_expert_past_the_count_refused(src, tmp_path):
    f = tmp_path / "scales.json"
    f.write_text(json.dumps({"model.language_model.layers.0.mlp.experts.99.gate_proj": 7.5}))
    r = call("convert", src, tmp_path / "out", "--activation-scales", f, *AMAX)
    assert_refused(r, 2)
    assert "expert 99" in r.err and f.name in r.err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("form", ["inkling", "modelopt-hf"])
def test_calibration_checkpoint_of_a_bigger_model_refused(src, tmp_path, form):
    big = write_checkpoint(tmp_path / "src8", "tiny", experts=8)
    cal = tmp_path / "cal"
    assert call("convert", big, cal, *AMAX, "--output-format", form).rc == 0
    r = call("convert", src, tmp_path / "out", "--activation-scales", cal, *AMAX)
    assert_refused(r, 2)
    assert "calibration for another model" in r.err and "has 4" in r.err
    assert not (tmp_path / "out").exists()


# =========================================================================== 6. scales engines cannot divide by
def test_activation_scale_with_infinite_reciprocal_refused(src, tmp_path):
    f = tmp_path / "scales.json"
    f.write_text(json.dumps({"model.llm.layers.0.mlp.experts.w13_weight": 1e-40}))
    r = call("convert", src, tmp_path / "out", "--activation-scales", f, *AMAX)
    assert_refused(r, 2)
    assert "model.llm.layers.0.mlp.experts.w13_weight" in r.err and "reciprocal" in r.err


def test_verify_fails_a_subnormal_input_scale(src, tmp_path):
    out = tmp_path / "out"
    assert call("convert", src, out, *AMAX, "--output-format", "modelopt-hf").rc == 0
    name = "model.language_model.layers.0.mlp.experts.0.gate_proj.input_scale"
    shard = next(p for p in out.glob("*.safetensors") if name in load_file(p))
    sd = load_file(shard)
    sd[name] = torch.tensor(3.8e-44, dtype=torch.float32)
    save_file(sd, shard, metadata={"format": "pt"})
    r = call("verify", out, "--json", tmp_path / "v.json")
    assert r.rc == 1
    problems = [p for c in json.loads((tmp_path / "v.json").read_text())["checks"] for p in c.get("problems", [])]
    assert any(p.get("tensor") == name and "reciprocal" in p["message"] for p in problems), problems


# =========================================================================== 7. one-line errors, no tracebacks
def _write(p: Path, text: str | bytes) -> Path:
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(text.encode() if isinstance(text, str) else text)
    return p


_RULE = '{{"rules": [{{"part": "expert", "layers": {}, "format": "nvfp4"}}]}}'
_HF = {"model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
       "num_key_value_heads": 2, "vocab_size": 96, "num_experts": 4, "num_experts_per_tok": 2,
       "moe_intermediate_size": 32, "max_position_embeddings": 4096}


def _scheme_case(layers: str):
    def make(tmp, src):
        return ["convert", src, tmp / "out", "--scheme", _write(tmp / "s.json", _RULE.format(layers)), *AMAX], "s.json"
    return make


def _deep_toml(tmp, src):
    return ["convert", src, tmp / "out", "--scheme", _write(tmp / "s.toml", "a = " + "[" * 3000 + "]" * 3000),
            *AMAX], "s.toml"


def _hf_config(**kw):
    def make(tmp, cmd):
        d = {k: v for k, v in {**_HF, **kw}.items() if v is not None}
        p = _write(tmp / "ck" / "config.json", json.dumps(d))
        save_file({"model.layers.0.mlp.experts.0.gate_proj.weight": torch.zeros(32, 64, dtype=torch.bfloat16)},
                  p.parent / "model.safetensors")  # a checkpoint to read: the config is what is at fault
        return {"plan": ["plan", "--config", p], "inspect": ["inspect", p.parent],
                "convert": ["convert", p.parent, tmp / "out", *AMAX]}[cmd], "config.json"
    return make


def _excludes(tmp, src, cmd):
    ck = _copy(src, tmp / "ck")
    d = json.loads((ck / "config.json").read_text())
    d["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION",
                                "exclude_modules": [1, {"a": 2}], "quantized_layers": {}}
    (ck / "config.json").write_text(json.dumps(d))
    adapter = _adapter(tmp)
    return ({"inspect": ["inspect", ck], "lora": ["lora", "check", ck, adapter]}[cmd]), "exclude_modules"


def _adapter(tmp, **config) -> Path:
    d = tmp / "adapter"
    d.mkdir(exist_ok=True)
    module = "base_model.model.model.language_model.layers.0.self_attn.q_proj.linear"
    save_file({f"{module}.lora_A.weight": torch.zeros(4, 64), f"{module}.lora_B.weight": torch.zeros(64, 4)},
              d / "adapter_model.safetensors")
    (d / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj.linear"],
        "layers_to_transform": [0], **config}))
    return d


CASES = {
    "scheme-layers-arabic-indic-digit": _scheme_case('"\u0663"'),
    "scheme-layers-superscript-digit": _scheme_case('"\u00b2"'),
    "scheme-layers-5000-digits": _scheme_case('"' + "1" * 5000 + '"'),
    "scheme-deeply-nested-toml": _deep_toml,
    "config-moe-layers-nested-list-convert": lambda tmp, src: _hf_config(
        model_type="llama4_text", moe_layers=[[1]])(tmp, "convert"),
    "config-moe-layers-nested-list-inspect": lambda tmp, src: _hf_config(
        model_type="llama4_text", moe_layers=[[1]])(tmp, "inspect"),
    "config-moe-layers-nested-list-plan": lambda tmp, src: _hf_config(
        model_type="llama4_text", moe_layers=[[1]])(tmp, "plan"),
    "config-heads-do-not-divide-hidden": lambda tmp, src: _hf_config(num_attention_heads=96,
                                                                     num_key_value_heads=96)(tmp, "plan"),
    "config-torch-dtype-list": lambda tmp, src: _hf_config(torch_dtype=["x"])(tmp, "plan"),
    "exclude-modules-not-strings-inspect": lambda tmp, src: _excludes(tmp, src, "inspect"),
    "exclude-modules-not-strings-lora-check": lambda tmp, src: _excludes(tmp, src, "lora"),
    "adapter-layers-pattern-invalid-regex": lambda tmp, src: (
        ["lora", "check", src, _adapter(tmp, layers_pattern="([")], "layers_pattern"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_hostile_inputs_end_in_one_line_errors(case, src, tmp_path):
    argv, named = CASES[case](tmp_path, src)
    r = call(*argv, limit_s=HANG_S)
    assert_refused(r, 2)
    assert named in r.err, r.err


# =========================================================================== 8. lossless widening
@pytest.fixture(scope="module")
def widened(base) -> tuple[Path, Path]:
    """ModelOpt 0.47's export of a DeepSeek-V3 loaded back by from_pretrained: its
    e_score_correction_bias is FP32 (the source's is BF16)."""
    from hf_moe_reference import export

    src, out = base / "ds-src", base / "ds-export"
    export("deepseek_v3", out, src, reload=True)
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert load_file(src / "model.safetensors")[bias].dtype == torch.bfloat16
    assert next(load_file(p)[bias] for p in out.glob("*.safetensors") if bias in load_file(p)).dtype == torch.float32
    return src, out


def test_verify_accepts_a_lossless_widening_and_reports_it(widened, tmp_path):
    src, out = widened
    r = call("verify", out, "--against", src, "--json", tmp_path / "v.json")
    assert r.rc == 0, r.out
    checks = {c["id"]: c for c in json.loads((tmp_path / "v.json").read_text())["checks"]}
    assert any("e_score_correction_bias: BF16 -> F32" in w for w in checks["passthrough"]["figures"]["widened"])


def test_verify_fails_a_widened_tensor_whose_values_changed(widened, tmp_path):
    src, export = widened
    out = _copy(export, tmp_path / "out")
    bias = "model.layers.2.mlp.gate.e_score_correction_bias"
    shard = next(p for p in out.glob("*.safetensors") if bias in load_file(p))
    sd = load_file(shard)
    sd[bias] = sd[bias].clone()
    sd[bias][3] = torch.nextafter(sd[bias][3], torch.tensor(1e9))  # one fp32 ulp: no BF16 value any more
    save_file(sd, shard, metadata={"format": "pt"})
    r = call("verify", out, "--against", src, "--quiet")
    assert r.rc == 1 and bias in r.out and "element 3" in r.out, r.out


# =========================================================================== 9. bounded by the files
@pytest.mark.parametrize("command", ["verify", "convert"])
def test_expert_count_claim_is_bounded_by_the_files(src, tmp_path, command):
    small = write_checkpoint(tmp_path / "small", "tiny", layers=6, experts=4)
    out = tmp_path / "mo"
    assert call("convert", small, out, *AMAX, "--output-format", "modelopt-hf").rc == 0
    target = out if command == "verify" else small
    d = json.loads((target / "config.json").read_text())
    d["text_config"]["n_routed_experts"] = 65536
    (target / "config.json").write_text(json.dumps(d))
    t0 = time.perf_counter()
    argv = ["verify", out, "--quiet"] if command == "verify" else ["convert", small, tmp_path / "o2", *AMAX]
    r = call(*argv, limit_s=HANG_S)
    assert time.perf_counter() - t0 < HANG_S
    assert r.rc == (1 if command == "verify" else 2), r.out + r.err
    assert "config.json" in r.out + r.err and "65536" in r.out + r.err or "they disagree" in r.out + r.err


# =========================================================================== 10. the second hostile pass
def _corrupt_last_byte(p: Path) -> None:
    b = bytearray(p.read_bytes())
    b[-3] ^= 1
    p.write_bytes(bytes(b))


@pytest.fixture(scope="module")
def converted(base, src) -> Path:
    out = base / "converted"
    assert call("convert", src, out, *AMAX).rc == 0
    return out


def test_verify_report_into_the_checkpoint_refused(converted, tmp_path):
    ck = _copy(converted, tmp_path / "ck")
    before = tree_digest(ck)
    for flag, name in (("--json", "config.json"), ("--junit", "model-00001-of-00048.safetensors")):
        r = call("verify", ck, flag, ck / name, "--quiet")
        assert_refused(r, 2)
        assert "would be written into the source" in r.err
    assert not changes(before, tree_digest(ck))


@pytest.mark.parametrize("command", ["convert", "synth", "draft-extract", "draft-strip"])
def test_report_into_the_output_refused_before_any_work(command, src, tmp_path):
    out = tmp_path / "out"
    argv = {"convert": ["convert", src, out, *AMAX], "synth": ["synth", out, "--preset", "tiny", "--quiet"],
            "draft-extract": ["draft", "extract", src, out, "--quiet"],
            "draft-strip": ["draft", "strip", src, out, "--quiet"]}[command]
    r = call(*argv, "--json", out / "config.json")
    assert_refused(r, 2)
    assert "into the output" in r.err and not out.exists()
    r = call(*argv, "--json", tmp_path / "no" / "such" / "dir" / "r.json")
    assert_refused(r, 2)
    assert "no such directory" in r.err and not out.exists()


def test_draft_extract_checks_the_source_checksums(converted, tmp_path):
    ck = _copy(converted, tmp_path / "ck")
    _corrupt_last_byte(ck / "mtp.safetensors")  # the draft's own file
    r = call("draft", "extract", ck, tmp_path / "out", "--quiet")
    assert_refused(r, 2)
    assert "mtp.safetensors" in r.err and "corrupt" in r.err and not (tmp_path / "out").exists()


def test_resume_on_a_finished_output_of_another_source_or_damaged(src, converted, tmp_path):
    other = write_checkpoint(tmp_path / "other", "tiny", experts=4, seed=2)  # the same shapes, other weights
    r = call("convert", other, _copy(converted, tmp_path / "a"), *AMAX, "--resume")
    assert_refused(r, 2)
    assert "another source" in r.err
    damaged = _copy(converted, tmp_path / "b")
    (damaged / "checksums.sha256").unlink()
    r = call("convert", src, damaged, *AMAX, "--resume")
    assert_refused(r, 2)
    assert "damaged" in r.err


def test_mxfp8_release_kept_by_scheme_none_verifies(src, tmp_path):
    release, out = tmp_path / "release", tmp_path / "none"
    assert call("convert", src, release, "--scheme", "mxfp8", "--quiet").rc == 0
    assert call("convert", release, out, "--scheme", "none", "--quiet").rc == 0
    for args in ([], ["--against", release]):
        r = call("verify", out, *args, "--quiet")
        assert r.rc == 0, r.out


def test_draft_extract_from_the_modelopt_form(src, tmp_path):
    mo = tmp_path / "mo"
    assert call("convert", src, mo, *AMAX, "--output-format", "modelopt-hf").rc == 0
    r = call("draft", "extract", mo, tmp_path / "draft", "--json", tmp_path / "d.json", "--quiet")
    assert r.rc == 0, r.err
    shared = json.loads((tmp_path / "d.json").read_text())["shared_by_reference"]
    assert shared == ["model.language_model.embed_tokens.weight", "lm_head.weight"]


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs /proc to find the worker processes")
def test_workers_exit_when_their_parent_is_killed(src, tmp_path):
    proc = _popen("convert", src, tmp_path / "out", *AMAX, "--max-shard-size", "60KB", "--workers", "2")
    workers: list[int] = []
    deadline = time.time() + 60
    while time.time() < deadline and proc.poll() is None and not workers:
        workers = [k for k in _children(proc.pid) if "resource_tracker" not in _cmdline(k)
                   and "multiprocessing" in _cmdline(k)]
        time.sleep(0.01)
    if not workers:
        proc.kill()
        pytest.skip("the conversion ended before its workers could be seen")
    proc.kill()  # SIGKILL: the parent cannot stop them
    proc.wait()
    deadline = time.time() + 15
    while time.time() < deadline and any(_alive(k) for k in workers):
        time.sleep(0.1)
    assert not any(_alive(k) for k in workers), "workers still running after their parent was killed"


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_a_fifo_among_the_source_files_is_refused(src, tmp_path):
    s = _copy(src, tmp_path / "s")
    (s / "tokenizer.json").unlink()
    os.mkfifo(s / "tokenizer.json")
    r = call("convert", s, tmp_path / "out", *AMAX, limit_s=HANG_S)
    assert_refused(r, 2)
    assert "tokenizer.json" in r.err and "not a regular file" in r.err


def test_device_checked_when_parsed(src, tmp_path):
    for dev in ("tpu", "meta", "cuda:x"):
        r = call("convert", src, tmp_path / "out", *AMAX, "--device", dev)
        assert_refused(r, 2)
        assert "expected cpu, cuda or cuda:N" in r.err and not (tmp_path / "out").exists()


def test_inspect_fails_what_convert_refuses(src, tmp_path):
    ck = _copy(src, tmp_path / "ck")
    d = json.loads((ck / "config.json").read_text())
    d["vision_config"] = None
    (ck / "config.json").write_text(json.dumps(d))
    r = call("inspect", ck, "--json", tmp_path / "i.json")
    assert r.rc == 1
    bad = json.loads((tmp_path / "i.json").read_text())["disagreeing_tensors"]
    assert bad and all("model.visual." in b for b in bad)


def test_write_checksums_that_cannot_take_the_lock_is_an_error_not_a_failure(converted, tmp_path, monkeypatch):
    from inkling_quant.errors import OutputError
    from inkling_quant.io import output

    ck = _copy(converted, tmp_path / "ck")
    (ck / "checksums.sha256").unlink()

    def read_only(self):
        raise OutputError("cannot take the output lock: Read-only file system", path=self.path)
    monkeypatch.setattr(output.OutputLock, "acquire", read_only)
    r = call("verify", ck, "--write-checksums", "--quiet")
    assert r.rc == 2 and "Read-only file system" in r.out, r.out


def test_adapter_flags_and_scales_checked(converted, tmp_path):
    from inkling_quant.model.inkling2 import Inkling2Config
    from test_safety import write_adapter

    cfg = Inkling2Config.load(converted)
    r = call("lora", "check", converted, write_adapter(tmp_path / "a", cfg, use_rslora="false"))
    assert_refused(r, 2)
    assert "'use_rslora' must be true or false" in r.err
    r = call("lora", "check", converted, write_adapter(tmp_path / "b", cfg, lora_alpha=1e308))
    assert_refused(r, 2)
    assert "past what the checkpoint's BF16 holds" in r.err


def test_messages_say_what_is_wrong(src, tmp_path):
    s = _copy(src, tmp_path / "s")
    shard = next(p for p in sorted(s.glob("*.safetensors")) if "model.llm.norm.weight" in load_file(p))
    sd = load_file(shard)
    sd["model.llm.norm.weight"] = sd["model.llm.norm.weight"].double()
    save_file(sd, shard, metadata={"format": "pt"})
    r = call("convert", s, tmp_path / "o1", *AMAX)
    assert_refused(r, 2)
    assert "not a dtype convert takes" in r.err and "already quantized" not in r.err
    f = tmp_path / "scales.json"
    f.write_text(json.dumps({"model.llm.layers.0.mlp.experts.w13_weight": 1e39}))
    r = call("convert", src, tmp_path / "o2", "--activation-scales", f, *AMAX)
    assert_refused(r, 2)
    assert "past fp32's range" in r.err
    r = call("convert", "no-such/checkpoint", tmp_path / "o3", *AMAX)
    assert_refused(r, 2)
    assert "no such local directory" in r.err
    for empty in ("{}",):
        f.write_text(empty)
        r = call("convert", src, tmp_path / "o4", "--activation-scales", f, *AMAX)
        assert_refused(r, 2)
        assert "holds no activation amax" in r.err


def test_verify_against_names_the_nested_config_key(converted, src, tmp_path):
    ck = _copy(converted, tmp_path / "ck")
    d = json.loads((ck / "config.json").read_text())
    d["text_config"]["n_layers_per_attn_res_block"] += 1
    (ck / "config.json").write_text(json.dumps(d))
    r = call("verify", ck, "--against", src)
    assert r.rc == 1 and "'text_config.n_layers_per_attn_res_block' differs" in r.out, r.out


def test_draft_mask_token_outside_the_vocabulary_refused(src, tmp_path):
    s = _copy(src, tmp_path / "s")
    d = json.loads((s / "config.json").read_text())
    d["dspark_config"]["mask_token_id"] = 10**6
    (s / "config.json").write_text(json.dumps(d))
    r = call("draft", "extract", s, tmp_path / "out", "--quiet")
    assert_refused(r, 2)
    assert "mask_token_id" in r.err
