"""`inkling-quant calibrate` (issue 37; docs/calibrate.md): the engine against transformers'
whole-model forward (every layer's output and the logits, bit for bit, in every naming and from
the MXFP8 release), calibrate's statistics against nvidia-modelopt's own max calibration of the
whole model on the same token batches (each input quantizer's amax, bit for bit; both policies;
ModelOpt's token counts) and a per-expert oracle written here with hooks on transformers' forward,
convert of ours against ModelOpt's own export bit for bit, input_scale included; the data
files' refusals; kill -9 and --resume byte-identical."""
from __future__ import annotations

import copy
import json
import math
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from inkling2_reference import inkling2, per_expert, save_like
from modelopt_reference import quant_config, read_tensors, tiny_modelopt_config
from inkling_quant.calibrate import Options, calibrate
from inkling_quant.cli import main
from inkling_quant.convert import Options as ConvertOptions, convert
from inkling_quant.engine import Engine, Weights
from inkling_quant.errors import CheckpointError, UsageError
from inkling_quant.model.inkling2 import Inkling2Config
from inkling_quant.synth import write_checkpoint
from inkling_quant.verify import verify

SEQ, BATCHES = 16, 3
LAYERS = 4  # the tiny model: the default scheme gives NVFP4 W4A4 in layers 0-2, MXFP8 in layer 3


def _ids(vocab: int, n: int = BATCHES, rows: int = 1, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (rows, SEQ), generator=g) for _ in range(n)]


def _jsonl(path: Path, batches: list[torch.Tensor]) -> Path:
    path.write_text("".join(json.dumps({"input_ids": r.tolist()}) + "\n" for b in batches for r in b))
    return path


def _model_of(src: Path):
    return inkling2.Inkling2ForConditionalGeneration.from_pretrained(
        src, dtype=torch.bfloat16, experts_implementation="eager").eval()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Inkling 2 written by transformers' save_pretrained, with sharper routing than its
    initialisation (so experts see different token counts) and random correction biases."""
    root = tmp_path_factory.mktemp("cal")
    torch.manual_seed(0)
    model = inkling2.Inkling2ForConditionalGeneration._from_config(tiny_modelopt_config(), dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(("static_weight", ".query")) or "conv1d" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            elif n.endswith("mlp.gate.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            elif "experts" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    model.config.architectures = [type(model).__name__]
    copy.deepcopy(model).save_pretrained(root / "src")
    vocab = model.config.text_config.unpadded_vocab_size
    return {"src": root / "src", "root": root, "ids": _ids(vocab), "vocab": vocab}


# ------------------------------------------------------------------------------ the engine
def _streamed(src: Path, batches: list[torch.Tensor]):
    cfg = Inkling2Config.load(src)
    outs = {}
    with Weights(src, cfg) as w:
        eng = Engine(w)
        st = eng.start(batches)
        for i in range(cfg.text.num_hidden_layers):
            eng.layer(i, st, prefetch=i + 1)
            outs[i] = [mb.hidden.clone() for mb in st]
        logits = list(eng.logits(st))
        eng.close()
    return outs, logits


def _whole(model, batches):
    outs, hooks = {}, []
    for i, layer in enumerate(model.model.language_model.layers):
        hooks.append(layer.register_forward_hook(lambda m, a, o, i=i: outs.setdefault(i, []).append(o)))
    with torch.no_grad():
        logits = [model(input_ids=b).logits for b in batches]
    for h in hooks:
        h.remove()
    return outs, logits


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_the_engine_is_transformers_forward_bit_for_bit(tiny):
    """Every decoder layer's output and the logits of the layer-streaming engine equal
    transformers' whole-model forward (eager experts), for micro-batches of one and two rows."""
    model = _model_of(tiny["src"])
    for batches in (tiny["ids"], _ids(tiny["vocab"], 2, rows=2, seed=5)):
        want_layers, want_logits = _whole(model, batches)
        got_layers, got_logits = _streamed(tiny["src"], batches)
        for i in range(LAYERS):
            assert _same(got_layers[i], want_layers[i]), i
        assert _same(got_logits, want_logits)


def test_the_engine_reads_every_naming_and_the_mxfp8_release(tiny, tmp_path):
    """The same model under transformers' in-memory names and ModelOpt's per-expert names gives the
    same logits; the MXFP8 release's experts are read dequantized exactly: the logits of a BF16
    checkpoint holding that dequantization (e4m3 x 2^(e8m0 - 127), computed here) under
    transformers' forward."""
    model = _model_of(tiny["src"])
    _, want = _whole(model, tiny["ids"])
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    inter = model.config.text_config.moe_intermediate_size
    for d in (save_like(sd, tiny["src"], tmp_path / "hf"), save_like(per_expert(sd, inter), tiny["src"], tmp_path / "pe")):
        assert _same(_streamed(d, tiny["ids"])[1], want), d.name
    release = tmp_path / "mx"
    convert(str(tiny["src"]), release, ConvertOptions(scheme="mxfp8"), quiet=True)
    deq = tmp_path / "deq"
    shutil.copytree(tiny["src"], deq)
    base = load_file(deq / "model.safetensors")
    rel = read_tensors(release)
    for k in [k for k in base if k.endswith(("w13_weight", "w2_weight"))]:
        q, s = rel[k].float(), rel[k + "_scale"].view(torch.uint8).to(torch.int32)
        base[k] = (q.reshape(*s.shape, 32) * torch.exp2((s - 127).float()).unsqueeze(-1)).reshape(q.shape).to(torch.bfloat16)
    save_file(base, deq / "model.safetensors", metadata={"format": "pt"})
    _, want_mx = _whole(_model_of(deq), tiny["ids"])
    assert _same(_streamed(release, tiny["ids"])[1], want_mx)


# ------------------------------------------------------------------------------ calibrate vs ModelOpt
def _oracle(model, batches) -> dict:
    """Per layer and expert, with hooks on transformers' own forward: the amax of its routed
    inputs (w13) and gated activations (w2), its routed token count, and the all-experts figures
    (every token through the expert, the eager loop's ops)."""
    rec = {}
    hooks = []
    for li, layer in enumerate(model.model.language_model.layers):
        ex = layer.mlp.experts
        E = ex.num_experts
        st = rec[li] = {"w13": [None] * E, "w2": [None] * E, "w13_all": [None] * E, "w2_all": [None] * E,
                        "tokens": [0] * E, "queue": []}

        def mx(old, x):
            v = float(x.abs().max())
            return v if old is None else max(old, v)

        def pre(mod, args, st=st, E=E):
            hidden, idx, _ = args
            st["queue"] = None
            for e in range(E):
                tok = (idx == e).any(-1).nonzero().squeeze(-1)
                st["tokens"][e] += tok.numel()
                if tok.numel():
                    st["w13"][e] = mx(st["w13"][e], hidden[tok])
                act = mod._apply_gate(F.linear(hidden, mod.gate_up_proj[e]))
                st["w13_all"][e], st["w2_all"][e] = mx(st["w13_all"][e], hidden), mx(st["w2_all"][e], act)
            st["queue"] = sorted(int(e) for e in idx.unique())

        def post(mod, args, out, st=st):
            if st["queue"]:
                e = st["queue"].pop(0)
                st["w2"][e] = mx(st["w2"][e], out)

        hooks += [ex.register_forward_pre_hook(pre), ex.act_fn.register_forward_hook(post)]
    with torch.no_grad():
        for b in batches:
            model(input_ids=b)
    for h in hooks:
        h.remove()
    return rec


def _modelopt(src: Path, batches, ratio=None, register=False, export: Path | None = None):
    """ModelOpt 0.47's max calibration of the whole model (NVFP4 W4A4 experts in layers 0-2,
    MXFP8 weights in layer 3) on `batches`: per layer (w13 amax, w2 amax, expert_token_count).
    `register`: Inkling2SparseMoeBlock registered as ModelOpt's `_QuantSparseSequentialMoe`, which
    `moe_calib_experts_ratio` needs (0.47 registers only blocks whose experts are iterable,
    plugins/huggingface.py `_is_sparse_sequaential_moe_block`)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import modelopt.torch.quantization as mtq
        from modelopt.torch.export import export_hf_checkpoint
        from modelopt.torch.quantization.nn import QuantModuleRegistry
        from modelopt.torch.quantization.plugins.huggingface import _QuantSparseSequentialMoe
    block = inkling2.modeling_inkling2.Inkling2SparseMoeBlock
    if register:
        QuantModuleRegistry.register({block: "hf.Inkling2SparseMoeBlock"})(_QuantSparseSequentialMoe)
    try:
        model = inkling2.Inkling2ForConditionalGeneration.from_pretrained(src, dtype=torch.bfloat16).eval()
        model.config.architectures = [type(model).__name__]
        cfg = quant_config([LAYERS - 1], experts="*language_model.layers.{i}.mlp.experts*")
        cfg["quant_cfg"].append({"quantizer_name": f"*language_model.layers.{LAYERS - 1}.mlp.experts*input_quantizer*",
                                 "enable": False})  # MXFP8 activations are dynamic: nothing to calibrate
        if ratio is not None:
            cfg["algorithm"] = {"method": "max", "moe_calib_experts_ratio": ratio}

        def loop(m):
            with torch.no_grad():
                for b in batches:
                    m(input_ids=b)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mtq.quantize(model, cfg, loop)
            out = {}
            for i, layer in enumerate(model.model.language_model.layers[:LAYERS - 1]):
                ex = layer.mlp.experts
                count = getattr(layer.mlp, "expert_token_count", None)
                out[i] = (float(ex.gate_up_proj_input_quantizer._amax), float(ex.down_proj_input_quantizer._amax),
                          None if count is None else count.tolist())
            if export is not None:
                export_hf_checkpoint(model, export_dir=str(export))
        return out
    finally:
        if register:
            QuantModuleRegistry.unregister(block)


def _calibrate(tiny, tmp_path, name: str, batches, **kw) -> dict:
    data = _jsonl(tmp_path / f"{name}.jsonl", batches)
    out = tmp_path / f"{name}.json"
    calibrate(str(tiny["src"]), out, Options(data=[str(data)], seq_len=SEQ, batch_size=batches[0].shape[0], **kw),
              quiet=True)
    return json.loads(out.read_text())


def _key(layer: int, proj: str) -> str:
    return f"model.llm.layers.{layer}.mlp.experts.{'w13' if proj == 'w13' else 'w2'}_weight"


@pytest.fixture(scope="module")
def routed(tiny, tmp_path_factory):
    d = tmp_path_factory.mktemp("routed")
    return d, _calibrate(tiny, d, "routed", tiny["ids"])


def test_routed_amax_equals_modelopts_calibration_and_the_oracle(tiny, routed, tmp_path):
    """ModelOpt keeps one input amax per fused projection of a layer: ours is the max over the
    layer's experts, bit for bit; our per-expert values and token counts equal the hooks'. Stock
    ModelOpt with moe_calib_experts_ratio 1.0 calibrates Inkling 2 as routed (the setting does not
    reach its MoE block)."""
    _, ours = routed
    mo = _modelopt(tiny["src"], tiny["ids"])
    for i, (w13, w2, _) in mo.items():
        assert ours["activation_amax"][_key(i, "w13")] == w13 and ours["activation_amax"][_key(i, "w2")] == w2, i
    assert _modelopt(tiny["src"], tiny["ids"], ratio=1.0) == mo
    rec = _oracle(_model_of(tiny["src"]), tiny["ids"])
    for i in range(LAYERS - 1):
        got = ours["experts"][str(i)]
        assert got["tokens"] == rec[i]["tokens"], i
        for proj in ("w13", "w2"):
            want = [v if v is not None else max(x for x in rec[i][proj] if x is not None) for v in rec[i][proj]]
            assert got[proj] == want, (i, proj)
    assert ours["provenance"]["policy"] == "routed" and str(LAYERS - 1) not in ours["experts"]
    assert sum(ours["experts"]["0"]["tokens"]) == BATCHES * SEQ * 2  # top-2 of every token


def test_all_experts_equals_modelopts_all_experts_calibration(tiny, tmp_path):
    """--experts all: ModelOpt's moe_calib_experts_ratio=1.0 (its MoE block registered so it takes
    effect) gives the same amax as ours, bit for bit, and the oracle's every-token figures ours per
    expert; token counts stay the routed ones."""
    ours = _calibrate(tiny, tmp_path, "all", tiny["ids"], experts="all")
    mo = _modelopt(tiny["src"], tiny["ids"], ratio=1.0, register=True)
    for i, (w13, w2, _) in mo.items():
        assert ours["activation_amax"][_key(i, "w13")] == w13 and ours["activation_amax"][_key(i, "w2")] == w2, i
    rec = _oracle(_model_of(tiny["src"]), tiny["ids"])
    for i in range(LAYERS - 1):
        got = ours["experts"][str(i)]
        assert got["w13"] == rec[i]["w13_all"] and got["w2"] == rec[i]["w2_all"] and got["tokens"] == rec[i]["tokens"]
        assert ours["coverage"][str(i)]["fallback_experts"] == []


def test_token_counts_equal_modelopts(tiny, routed):
    """ModelOpt counts tokens per expert only with moe_calib_experts_ratio < 1 (its block
    registered), of the routing it widens to max(top_k, E * ratio) experts and from the second
    calibration batch on (huggingface.py `_QuantSparseSequentialMoe`): at ratio top_k / E its
    counts are the routed ones of batches 2..N, ours on those batches."""
    cfg = tiny_modelopt_config().text_config
    mo = _modelopt(tiny["src"], tiny["ids"], ratio=cfg.num_experts_per_tok / cfg.n_routed_experts, register=True)
    d, _ = routed
    later = _calibrate(tiny, d, "later", tiny["ids"][1:])
    for i, (_, _, count) in mo.items():
        assert count == later["experts"][str(i)]["tokens"], i


def test_convert_with_ours_is_modelopts_export(tiny, routed, tmp_path):
    """convert --output-format modelopt-hf --activation-scales <ours> equals ModelOpt's own export
    of the model it calibrated on the same batches: every tensor bit for bit, input_scale included;
    the output records the calibration's provenance, inspect shows it, and verify passes it."""
    d, _ = routed
    export = tmp_path / "mo"
    _modelopt(tiny["src"], tiny["ids"], export=export)
    out = tmp_path / "ours"
    convert(str(tiny["src"]), out, ConvertOptions(output_format="modelopt-hf", activation_scales=str(d / "routed.json")),
            quiet=True)
    got, want = read_tensors(out), read_tensors(export)
    assert set(got) == set(want)
    for k in want:
        a, b = got[k], want[k]
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                                                  b.view(torch.uint8) if b.element_size() == 1 else b), k
    assert any(k.endswith("input_scale") for k in want)
    conv = json.loads((out / "hf_quant_config.json").read_text())["converter"]["calibration"]
    assert conv["policy"] == "routed" and conv["data"]["tokens"] == BATCHES * SEQ
    assert verify(out, against=tiny["src"], sample=0).exit_code == 0


def test_calibrate_convert_verify_on_the_inkling_form(tiny, routed, tmp_path, capsys):
    d, ours = routed
    out = tmp_path / "ink"
    assert main(["convert", str(tiny["src"]), str(out), "--activation-scales", str(d / "routed.json"), "--quiet"]) == 0
    t = read_tensors(out)
    assert float(t["model.llm.layers.0.mlp.experts.w13_weight.input_amax"].max()) == \
        ours["activation_amax"]["model.llm.layers.0.mlp.experts.w13_weight"]
    assert main(["verify", str(out), "--against", str(tiny["src"]), "--quiet"]) == 0
    assert main(["inspect", str(out)]) == 0
    assert "calibration: routed" in capsys.readouterr().out


def test_transformers_module_names_are_accepted_and_unknown_ones_list_the_forms(tiny, routed, tmp_path):
    """A hand-written file in transformers' names maps onto the source's stacked tensors; a name of
    another model is refused listing the forms accepted."""
    _, ours = routed
    hand = {f"model.language_model.layers.{i}.mlp.experts.{p}": 2.0 + i for i in range(3)
            for p in ("gate_up_proj", "down_proj_input_quantizer")}
    (tmp_path / "hand.json").write_text(json.dumps(hand))
    convert(str(tiny["src"]), tmp_path / "o", ConvertOptions(activation_scales=str(tmp_path / "hand.json")), quiet=True)
    assert float(read_tensors(tmp_path / "o")["model.llm.layers.2.mlp.experts.w2_weight.input_amax"].max()) == 4.0
    (tmp_path / "bad.json").write_text(json.dumps({"model.layers.0.mlp.experts.0.gate_proj": 1.0}))
    with pytest.raises(CheckpointError, match="Accepted: the source's own .* ModelOpt's per-expert modules .* "
                                              "transformers' stacked parameters"):
        convert(str(tiny["src"]), tmp_path / "o2", ConvertOptions(activation_scales=str(tmp_path / "bad.json")),
                quiet=True)


def test_a_calibration_of_another_model_is_refused(tiny, routed, tmp_path):
    d, ours = routed
    other = copy.deepcopy(ours)
    other["provenance"]["model_fingerprint"] = "sha256:" + "0" * 64
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(CheckpointError, match="calibration of another model"):
        convert(str(tiny["src"]), tmp_path / "o", ConvertOptions(activation_scales=str(tmp_path / "other.json")),
                quiet=True)


def test_the_synth_in_original_names_equals_modelopts_calibration(tmp_path):
    """Our synth (original names, 6 layers) as transformers loads it: the same bits."""
    src = write_checkpoint(tmp_path / "synth", "tiny", layers=6, experts=4)
    cfg = Inkling2Config.load(src)
    batches = _ids(cfg.text.unpadded_vocab_size, rows=2)
    data = _jsonl(tmp_path / "d.jsonl", batches)
    out = tmp_path / "c.json"
    calibrate(str(src), out, Options(data=[str(data)], seq_len=SEQ, batch_size=2), quiet=True)
    ours = json.loads(out.read_text())["activation_amax"]
    model = _model_of(src)
    rec = _oracle(model, batches)
    for i in range(5):  # layers 0-4 NVFP4, layer 5 MXFP8
        assert ours[_key(i, "w13")] == max(v for v in rec[i]["w13"] if v is not None)
        assert ours[_key(i, "w2")] == max(v for v in rec[i]["w2"] if v is not None)
    assert set(ours) == {_key(i, p) for i in range(5) for p in ("w13", "w2")}


# ------------------------------------------------------------------------------ data, refusals, resume
def test_text_chat_and_plain_files_through_the_synths_tokenizer(tmp_path):
    """Text is tokenized with the checkpoint's own tokenizer (the synth's byte-level one), chat
    messages rendered with its chat template; rows truncated, or packed with --pack."""
    src = write_checkpoint(tmp_path / "s", "tiny", layers=2, experts=2)
    (tmp_path / "t.jsonl").write_text(json.dumps({"text": "a" * 40}) + "\n" +
                                      json.dumps({"messages": [{"role": "user", "content": "hi there"}]}) + "\n")
    (tmp_path / "p.txt").write_text("plain text " * 5)
    files = [str(tmp_path / "t.jsonl"), str(tmp_path / "p.txt")]
    r = calibrate(str(src), tmp_path / "a.json", Options(data=files, seq_len=32, scheme="nvfp4"), quiet=True)
    prov = json.loads((tmp_path / "a.json").read_text())["provenance"]["data"]
    assert r["samples"] == 3 and prov["packing"] == "truncated" and prov["truncated_samples"] == 2
    chat = "<|user|>hi there<|end|>"  # the synth's chat template, byte for byte
    assert prov["tokens"] == 32 + (len(chat.encode()) - len("<|end|>") + 1) + 32
    calibrate(str(src), tmp_path / "b.json", Options(data=files, seq_len=32, pack=True, scheme="nvfp4"), quiet=True)
    packed = json.loads((tmp_path / "b.json").read_text())["provenance"]["data"]
    total = 40 + (len(chat.encode()) - len("<|end|>") + 1) + len("plain text " * 5) + 2  # two EOS between
    assert packed["packing"] == "packed" and packed["samples"] == total // 32 and packed["dropped_tokens"] == total % 32


@pytest.mark.parametrize("content, says", [
    (b"", "holds no samples"),
    (b'{"input_ids": [1, 2]}\n\xff\xfe\n', "line 2 is not UTF-8"),
    (b'{"input_ids": [1, 2]}\n{"input_ids": [' + b"1, " * 40 + b"1]}\n", "line 2: 41 input_ids, over --seq-len 16"),
    (b'{"input_ids": [1, 99999]}\n', "outside the vocabulary"),
    (b'{"text": ""}\n', "empty text"),
    (b'{"tokens": [1]}\n', "exactly one of"),
    (b"not json\n", "line 1 is not JSON")])
def test_bad_data_files_are_refused_naming_the_file_and_line(tiny, tmp_path, content, says):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(content)
    with pytest.raises(UsageError, match=says) as e:
        calibrate(str(tiny["src"]), tmp_path / "o.json", Options(data=[str(bad)], seq_len=SEQ), quiet=True)
    assert str(e.value.path) == str(bad) and not (tmp_path / "o.json").exists()


def test_too_little_data_and_text_without_a_tokenizer(tiny, tmp_path):
    data = _jsonl(tmp_path / "d.jsonl", tiny["ids"])
    with pytest.raises(UsageError, match="too short: --samples 10 wants 10 rows, the data gives 3"):
        calibrate(str(tiny["src"]), tmp_path / "o.json", Options(data=[str(data)], seq_len=SEQ, samples=10), quiet=True)
    (tmp_path / "t.jsonl").write_text(json.dumps({"text": "hello"}) + "\n")
    with pytest.raises(UsageError, match="needs the checkpoint's tokenizer"):  # save_pretrained wrote none
        calibrate(str(tiny["src"]), tmp_path / "o.json", Options(data=[str(tmp_path / "t.jsonl")], seq_len=SEQ),
                  quiet=True)


def test_an_existing_output_or_a_stopped_run_is_not_overwritten_silently(tiny, routed, tmp_path):
    d, _ = routed
    data = _jsonl(tmp_path / "d.jsonl", tiny["ids"])
    out = tmp_path / "o.json"
    out.write_text("{}")
    with pytest.raises(UsageError, match="--overwrite"):
        calibrate(str(tiny["src"]), out, Options(data=[str(data)], seq_len=SEQ), quiet=True)
    with pytest.raises(UsageError, match="ending in .json"):
        calibrate(str(tiny["src"]), tmp_path / "o.txt", Options(data=[str(data)], seq_len=SEQ), quiet=True)


def _cli(*args) -> list[str]:
    return [sys.executable, "-m", "inkling_quant.cli", *args]


def test_kill_9_then_resume_is_byte_identical(tmp_path):
    src = write_checkpoint(tmp_path / "s", "tiny", experts=4)  # 48 layers: NVFP4 in 0-39
    cfg = Inkling2Config.load(src)
    data = _jsonl(tmp_path / "d.jsonl", _ids(cfg.text.unpadded_vocab_size, 4, rows=2))
    args = ["--data", str(data), "--seq-len", str(SEQ), "--batch-size", "2", "--quiet"]
    ref = tmp_path / "ref.json"
    assert main(["calibrate", str(src), str(ref), *args]) == 0
    for at in (3, 20):
        out = tmp_path / f"k{at}.json"
        progress = tmp_path / f"k{at}.json.partial" / "progress.json"
        proc = subprocess.Popen(_cli("calibrate", str(src), str(out), *args), stderr=subprocess.PIPE)
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None:
            try:
                if json.loads(progress.read_text())["layer"] >= at:
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert proc.returncode == -signal.SIGKILL, "the run ended first"
        assert not out.exists()
        with pytest.raises(UsageError, match="--resume"):
            calibrate(str(src), out, Options(data=[str(data)], seq_len=SEQ, batch_size=2), quiet=True)
        assert main(["calibrate", str(src), str(out), *args, "--resume", "--json", str(tmp_path / "r.json")]) == 0
        assert json.loads((tmp_path / "r.json").read_text())["resumed_from"] > 0
        assert out.read_bytes() == ref.read_bytes()
        assert not (tmp_path / f"k{at}.json.partial").exists()
    assert math.isfinite(json.loads(ref.read_text())["activation_amax"]["model.llm.layers.39.mlp.experts.w2_weight"])
