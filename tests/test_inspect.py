"""`inkling-quant inspect`: a checkpoint of the published Inkling 2 layout summarized from its
safetensors headers only; a checkpoint of the retired legacy layout refused; Hugging Face MoE
checkpoints (transformers' BF16, ModelOpt's export, our convert) with their detected layout."""
import argparse
import builtins
import io
import json
import mmap
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch
from legacy_checkpoint import write_legacy_checkpoint

from inkling_quant import inspect_cmd
from inkling_quant.cli import inspect as inspect_cli

from inkling_quant.model import dspark
from inkling_quant.cli import main
from inkling_quant.errors import ConfigError
from inkling_quant.export.inkling import EXCLUDE_MODULES_ORIGINAL, config_with_quantization
from inkling_quant.export.modelopt import quantization
from inkling_quant.formats import FORMATS
from inkling_quant.export.inkling import stack_experts
from inkling_quant.model.inkling2 import Inkling2Config, experts_module
from inkling_quant.io import safetensors as st
from inkling_quant.io.checkpoint import Checkpoint
from inkling_quant.synth import make_config


@pytest.fixture(scope="module")
def source(tiny_src) -> Path:
    return tiny_src  # the session's tiny BF16 checkpoint: all 48 layers, 4 experts, a DSpark draft


@pytest.fixture(scope="module")
def converted(source, tmp_path_factory) -> Path:
    convert = pytest.importorskip("inkling_quant.convert", exc_type=ImportError)
    out = tmp_path_factory.mktemp("conv") / "tiny-default"
    convert.convert(str(source), out, convert.Options(scheme="default", default_activation_amax=4.0), quiet=True)
    return out


def run_cli(*argv) -> int:
    p = argparse.ArgumentParser()
    inspect_cli.add_arguments(p)
    return inspect_cli.run(p.parse_args([str(a) for a in argv]))


def test_source_checkpoint(source):
    s = inspect_cmd.summarize(source)
    cfg = Inkling2Config.load(source)
    t = cfg.text
    assert s.ok and s.layout == "original" and s.quant_algo is None
    assert s.tensors == len(Checkpoint.open(source).weight_map)
    assert all(set(p["formats"]) == {"passthrough"} for p in s.parts.values())
    assert s.expert_layers == [{"first": 0, "last": t.num_hidden_layers - 1, "format": "passthrough",
                                "experts": t.n_routed_experts}]
    assert sum(p["bytes"] for p in s.parts.values()) <= s.file_bytes
    # one stacked w13 [E, 2I, H] and w2 [E, H, I] a layer: 3 * H * I parameters an expert
    assert s.parts["expert"]["tensors"] == 2 * t.num_hidden_layers
    assert s.parts["expert"]["params"] == \
        t.num_hidden_layers * t.n_routed_experts * 3 * t.hidden_size * t.moe_intermediate_size
    spec = list(dspark.draft_tensors(cfg.draft))
    assert s.draft == {"present": True, "tensors": len(spec), "bytes": sum(x.nbytes for x in spec),
                       "expected_by_config": True}
    assert "DSpark draft: present" in inspect_cmd.render(s)


def test_converted_checkpoint(source, converted):
    s = inspect_cmd.summarize(converted)
    n = Inkling2Config.load(converted).text.num_hidden_layers
    assert s.ok, (s.unknown, s.unrecognized, s.mismatched)
    assert s.quant_algo == "MIXED_PRECISION"
    nv = round(n * 5 / 6)
    assert [(r["first"], r["last"], r["format"]) for r in s.expert_layers] == [(0, nv - 1, "nvfp4"),
                                                                               (nv, n - 1, "mxfp8")]
    assert set(s.parts["expert"]["formats"]) == {"nvfp4", "mxfp8"}
    assert set(s.parts["attention"]["formats"]) == {"passthrough"}
    # logical parameters are those of the source, whatever the packing; bytes shrink; the rest is untouched
    src = inspect_cmd.summarize(source)
    assert s.parts["expert"]["params"] == src.parts["expert"]["params"]
    assert s.parts["expert"]["bytes"] < src.parts["expert"]["bytes"]
    for part in set(src.parts) - {"expert"}:
        assert s.parts[part] == src.parts[part], part
    assert s.draft == src.draft and s.draft["present"]
    assert run_cli(converted, "--quiet") == 0


def _hand_quantized(root: Path, weight_only: bool = False) -> Path:
    """A one-shard checkpoint without draft: layer 0's experts NVFP4, layer 47's MXFP8, stacked
    from the formats' own per-expert tensors, with a quantization config declaring both."""
    root.mkdir(parents=True)
    cfg_dict = make_config("tiny", draft=False)
    t = Inkling2Config.from_dict(cfg_dict).text
    fmts = {0: FORMATS["nvfp4"], 47: FORMATS["mxfp8"]}
    q = quantization([(experts_module(i), f) for i, f in fmts.items()], weight_only, EXCLUDE_MODULES_ORIGINAL)
    (root / "config.json").write_text(json.dumps(config_with_quantization(cfg_dict, q)))
    tensors = {"model.llm.embed.weight": torch.zeros(t.vocab_size, t.hidden_size, dtype=torch.bfloat16)}
    g = torch.Generator().manual_seed(0)
    amax, I, H = None if weight_only else 4.0, t.moe_intermediate_size, t.hidden_size
    for layer, fmt in fmts.items():
        experts = []
        for _ in range(t.n_routed_experts):
            w = {p: torch.randn(shape, generator=g).to(torch.bfloat16)
                 for p, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I)))}
            shared = torch.maximum(w["gate_proj"].float().abs().amax(), w["up_proj"].float().abs().amax())
            kw = {"global_amax": shared} if fmt.fuses_gate_up else {}
            experts.append({p: fmt.quantize(x, input_amax=amax, **(kw if p != "down_proj" else {}))
                            for p, x in w.items()})
        tensors.update({f"{experts_module(layer)}.{k}": v.contiguous() for k, v in stack_experts(fmt, experts).items()})
    specs = [(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()]
    with st.ShardWriter(root / "model.safetensors", specs) as w:
        for k, v in tensors.items():
            w.write(k, v)
        w.commit()
    return root


def test_hand_quantized_shard_and_missing_draft(tmp_path):
    s = inspect_cmd.summarize(_hand_quantized(tmp_path / "q"))
    assert not (s.unknown or s.unrecognized or s.mismatched), (s.unknown, s.unrecognized, s.mismatched)
    # a partial checkpoint (two expert layers, the embedding): what convert and verify refuse is listed
    assert len(s.incomplete) == 46 and s.disagreeing and not s.ok
    assert [(r["first"], r["last"], r["format"], r["experts"]) for r in s.expert_layers] == [
        (0, 0, "nvfp4", 4), (47, 47, "mxfp8", 4)]
    assert s.draft == {"present": False, "tensors": 0, "bytes": 0, "expected_by_config": False}
    text = inspect_cmd.render(s)
    assert "DSpark draft: absent" in text and "layers 0" in text and "nvfp4" in text


def test_weight_only_nvfp4_is_labelled(tmp_path):
    s = inspect_cmd.summarize(_hand_quantized(tmp_path / "wo", weight_only=True))
    assert not (s.unknown or s.unrecognized or s.mismatched) and s.expert_layers[0]["format"] == "nvfp4 (weight-only)"


def test_unknown_tensors_and_unrecognized_modules(tmp_path):
    root = _hand_quantized(tmp_path / "odd")
    # rewrite the shard with one tensor outside the layout and layer 0's w13 missing its block scales
    missing = experts_module(0) + ".w13_weight_scale"
    h = st.read_header(root / "model.safetensors")
    keep = {}
    with st.ShardReader(root / "model.safetensors") as r:
        for name in h.tensors:
            if name != missing:
                keep[name] = r.get(name).clone()
    keep["model.llm.layers.0.mlp.extra_thing"] = torch.zeros(3)
    os.unlink(root / "model.safetensors")
    with st.ShardWriter(root / "model.safetensors", [(k, v.dtype, tuple(v.shape)) for k, v in keep.items()]) as w:
        for k, v in keep.items():
            w.write(k, v)
        w.commit()
    s = inspect_cmd.summarize(root)
    assert not s.ok
    assert s.unknown == ["model.llm.layers.0.mlp.extra_thing"]
    assert len(s.unrecognized) == 1 and s.unrecognized[0].startswith(experts_module(0) + ".w13 (")
    assert "unrecognized" in s.expert_layers[0]["format"] and s.mismatched == []
    assert run_cli(root) == 1


def test_legacy_layout_is_refused(tmp_path, capsys):
    """A config.json without text_config (the retired invented layout): a ConfigError naming
    config.json, exit status 2 from the command line, no traceback."""
    root = write_legacy_checkpoint(tmp_path / "legacy")
    with pytest.raises(ConfigError, match="not the published Inkling 2 layout") as e:
        inspect_cmd.summarize(root)
    assert e.value.path == str(root / "config.json")
    assert main(["inspect", str(root)]) == 2
    err = capsys.readouterr().err
    assert "config.json" in err and "no longer supported" in err and "Traceback" not in err


# --------------------------------------------------------------------------- no tensor bytes are read
def _scramble_data(root: Path) -> None:
    """Overwrite every shard's data section with random bytes of the same length."""
    for shard in sorted(root.glob("*.safetensors")):
        with open(shard, "r+b") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            size = os.fstat(f.fileno()).st_size
            f.seek(8 + n)
            f.write(os.urandom(size - 8 - n))


def test_inspect_reads_headers_only(source, tmp_path, monkeypatch):
    before = inspect_cmd.summarize(source).to_dict()

    # 1. garbage in every data byte: the summary cannot change
    copy = tmp_path / "scrambled"
    shutil.copytree(source, copy)
    _scramble_data(copy)
    after = inspect_cmd.summarize(copy).to_dict()
    assert {**after, "checkpoint": None} == {**before, "checkpoint": None}

    # 2. trace every read of a shard file, at the file-object and at the fd level: none may go
    #    past the shard's header; the readers that exist to fetch tensors must not be used at all
    header_end = {}
    for shard in copy.glob("*.safetensors"):
        with builtins.open(shard, "rb") as f:
            header_end[shard.resolve()] = 8 + struct.unpack("<Q", f.read(8))[0]
    read_upto: dict[Path, int] = {}

    def record(path: Path, end: int) -> None:
        read_upto[path] = max(read_upto.get(path, 0), end)

    def shard_of_fd(fd: int) -> Path | None:
        try:
            path = Path(os.readlink(f"/proc/self/fd/{fd}")).resolve()
        except OSError:
            return None
        return path if path in header_end else None

    def forbidden(*a, **k):
        raise AssertionError("inspect used a tensor reader")

    real_read, real_pread, real_preadv, real_mmap = os.read, os.pread, os.preadv, mmap.mmap

    def traced_read(fd, n):
        path = shard_of_fd(fd)
        pos = os.lseek(fd, 0, os.SEEK_CUR) if path else 0
        data = real_read(fd, n)
        if path:
            record(path, pos + len(data))
        return data

    def traced_pread(fd, n, offset):
        data = real_pread(fd, n, offset)
        if (path := shard_of_fd(fd)):
            record(path, offset + len(data))
        return data

    def traced_preadv(fd, buffers, offset, *rest):
        got = real_preadv(fd, buffers, offset, *rest)
        if (path := shard_of_fd(fd)):
            record(path, offset + got)
        return got

    def traced_mmap(fd, *a, **k):
        if shard_of_fd(fd):
            raise AssertionError("inspect mapped a shard")
        return real_mmap(fd, *a, **k)

    real_open = builtins.open

    class Traced:
        """A shard opened with open(): tracks how far Python code consumed it."""

        def __init__(self, f, path):
            self._f, self._path = f, path

        def read(self, n=-1):
            data = self._f.read(n)
            record(self._path, self._f.tell())
            return data

        def readinto(self, b):
            got = self._f.readinto(b)
            record(self._path, self._f.tell())
            return got

        def __getattr__(self, k):
            return getattr(self._f, k)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self._f.close()

    def traced_open(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        path = Path(file).resolve() if isinstance(file, (str, os.PathLike)) else None
        return Traced(f, path) if path in header_end else f

    import safetensors
    for mod, name, fn in ((os, "read", traced_read), (os, "pread", traced_pread), (os, "preadv", traced_preadv),
                          (mmap, "mmap", traced_mmap), (builtins, "open", traced_open), (io, "open", traced_open),
                          (st.ShardReader, "__init__", forbidden), (st.ShardReader, "read_bytes", forbidden),
                          (safetensors, "safe_open", forbidden)):
        monkeypatch.setattr(mod, name, fn)
    traced = inspect_cmd.summarize(copy).to_dict()
    monkeypatch.undo()
    assert {**traced, "checkpoint": None} == {**before, "checkpoint": None}
    assert set(read_upto) == set(header_end)                       # every header was read...
    assert all(read_upto[p] <= header_end[p] for p in header_end)  # ...and nothing past it


def test_cli_json(source, tmp_path, capsys):
    out = tmp_path / "summary.json"
    assert run_cli(source, "--json", out) == 0
    text = capsys.readouterr().out
    assert "routed experts:" in text and "DSpark draft: present" in text
    d = json.loads(out.read_text())
    assert d["draft"]["present"] and d["unknown_tensors"] == [] and d["shards"] >= 1
    assert run_cli(source, "--json", "-") == 0
    assert json.loads(capsys.readouterr().out)["tensors"] == d["tensors"]


# --------------------------------------------------------------------------- declared formats
def test_weight_only_and_declared_mismatch(source, tmp_path):
    convert = pytest.importorskip("inkling_quant.convert", exc_type=ImportError)
    n = Inkling2Config.load(source).text.num_hidden_layers
    wo = tmp_path / "wo"
    convert.convert(str(source), wo, convert.Options(scheme="mxfp8", weight_only=True), quiet=True)
    convert.convert(str(source), tmp_path / "nv", convert.Options(scheme="nvfp4", weight_only=True), quiet=True)
    s = inspect_cmd.summarize(tmp_path / "nv")
    assert s.ok and {r["format"] for r in s.expert_layers} == {"nvfp4 (weight-only)"}
    # a quantization config that says MXFP8 over NVFP4 tensors: named, exit status 1
    config = json.loads((tmp_path / "nv" / "config.json").read_text())
    config["quantization_config"] = json.loads((wo / "config.json").read_text())["quantization_config"]
    (tmp_path / "nv" / "config.json").write_text(json.dumps(config))
    s = inspect_cmd.summarize(tmp_path / "nv")
    assert not s.ok and len(s.mismatched) == 2 * n  # w13 and w2 of every layer
    assert "tensors are nvfp4, the quantization config declares mxfp8" in s.mismatched[0]
    assert run_cli(tmp_path / "nv", "--quiet") == 1


# --------------------------------------------------------------------------- Hugging Face MoE families
# transformers' own save_pretrained (the BF16 source), ModelOpt's own export of it, and our
# convert of the source (tests/hf_moe_reference.py): the layout detected, each layer's experts
# recognized as the format the quantization config declares.
HF_FAMILIES = ("qwen3_vl_moe", "deepseek_v3")  # stacked + vision tower; per expert + shared experts + a dense layer


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    from hf_moe_reference import export

    from inkling_quant.convert import Options, convert
    base = tmp_path_factory.mktemp("inspect-hf")
    out = {}
    for f in HF_FAMILIES:
        src, mo = base / f"{f}-bf16", base / f"{f}-modelopt"
        export(f, mo, src)
        convert(str(src), base / f"{f}-ours", Options(activation_scales=str(mo)), quiet=True)
        out[f] = {"src": src, "modelopt": mo, "ours": base / f"{f}-ours"}
    return out


def _declared_ranges(root: Path) -> list[tuple[int, int, str]]:
    """(first, last, format) per run of layers, from hf_quant_config.json's quantized_layers."""
    q = json.loads((root / "hf_quant_config.json").read_text())["quantization"]["quantized_layers"]
    out: list[list] = []
    for module, e in q.items():
        i, fmt = int(module.split("layers.")[1].split(".")[0]), e["quant_algo"].lower()
        if out and out[-1][2] == fmt and out[-1][1] == i - 1:
            out[-1][1] = i
        else:
            out.append([i, i, fmt])
    return [tuple(r) for r in out]


@pytest.mark.parametrize("family", HF_FAMILIES)
def test_hf_source_modelopt_export_and_ours(hf, family):
    cfg = json.loads((hf[family]["src"] / "config.json").read_text())
    t = cfg.get("text_config", cfg)
    E = next(t[k] for k in ("num_experts", "num_local_experts", "n_routed_experts") if k in t)
    H, I = t["hidden_size"], t["moe_intermediate_size"]
    want = {"qwen3_vl_moe": {"text_prefix": "model.language_model.", "vision_prefix": "model.visual.",
                             "expert_layers": [0, 1, 2], "text_config": True},
            "deepseek_v3": {"text_prefix": "model.", "vision_prefix": None, "expert_layers": [1, 2],
                            "text_config": False}}[family]
    summaries = {k: inspect_cmd.summarize(p) for k, p in hf[family].items()}
    for kind, s in summaries.items():
        assert s.ok, (kind, s.unknown, s.unrecognized, s.mismatched, s.incomplete)
        d = s.detected
        assert s.layout == family and {k: d[k] for k in want} == want
        assert d["experts_module"] == f"{want['text_prefix']}layers.N.mlp.experts" and d["lm_head"] == "lm_head.weight"
        stacked = kind == "src" and family == "qwen3_vl_moe"  # transformers stacks them; ModelOpt unstacks
        assert (d["expert_storage"], d["projections"]) == (("stacked", ["gate_up_proj", "down_proj"]) if stacked else
                                                           ("per_expert", ["gate_proj", "up_proj", "down_proj"]))
        assert d["transposed"] is (False if stacked else None)
        # the logical parameters of the routed experts, whatever the storage
        assert s.parts["expert"]["params"] == len(want["expert_layers"]) * E * 3 * H * I
        assert all(set(p["formats"]) == {"passthrough"} for part, p in s.parts.items() if part != "expert")
        ranges = [(r["first"], r["last"], r["format"]) for r in s.expert_layers]
        if kind == "src":
            assert ranges == [(want["expert_layers"][0], 2, "passthrough")] and s.quant_algo is None
        else:
            assert ranges == _declared_ranges(hf[family][kind]) and s.quant_algo == "MIXED_PRECISION"
            assert all(r["experts"] == E for r in s.expert_layers)
        assert json.loads(json.dumps(s.to_dict()))["detected"] == d
    if family == "deepseek_v3":
        assert {"shared_expert", "dense_mlp", "router"} <= set(summaries["src"].parts)
    text = inspect_cmd.render(summaries["modelopt"])
    assert f"layout: {family}" in text and f"text model      {want['text_prefix']}" in text
    experts = f"{want['text_prefix']}layers.N.mlp.experts"
    assert f"routed experts  per_expert (gate_proj/up_proj/down_proj) in {experts}" in text
    assert "DSpark draft" not in text
    assert inspect_cmd.summarize(hf[family]["ours"]).to_dict() == {**summaries["modelopt"].to_dict(), "checkpoint":
                                                                   str(hf[family]["ours"]), "shards": 1,
                                                                   "file_bytes": summaries["ours"].file_bytes}


def test_hf_weight_only_is_labelled(hf, tmp_path):
    from inkling_quant.convert import Options, convert
    out = tmp_path / "wo"
    convert(str(hf["deepseek_v3"]["src"]), out, Options(scheme="nvfp4", weight_only=True), quiet=True)
    s = inspect_cmd.summarize(out)
    assert s.ok and [(r["first"], r["last"], r["format"]) for r in s.expert_layers] == [(1, 2, "nvfp4 (weight-only)")]


def test_hf_declared_mismatch_and_missing_module(hf, tmp_path):
    root = tmp_path / "mo"
    shutil.copytree(hf["deepseek_v3"]["modelopt"], root)
    config = json.loads((root / "config.json").read_text())
    config["quantization_config"]["quantized_layers"]["model.layers.2.mlp.experts"] = {"quant_algo": "NVFP4",
                                                                                      "group_size": 16}
    (root / "config.json").write_text(json.dumps(config))
    s = inspect_cmd.summarize(root)
    assert s.mismatched == ["model.layers.2.mlp.experts: tensors are mxfp8, the quantization config declares nvfp4"]
    assert run_cli(root, "--quiet") == 1
    # an expert's down_proj gone: the layer holds fewer modules than config.json implies
    from safetensors.torch import load_file, save_file
    shutil.copyfile(hf["deepseek_v3"]["modelopt"] / "config.json", root / "config.json")
    sd = {k: v for k, v in load_file(root / "model.safetensors").items()
          if not k.startswith("model.layers.1.mlp.experts.3.down_proj.")}
    save_file(sd, root / "model.safetensors", metadata={"format": "pt"})
    s = inspect_cmd.summarize(root)
    assert s.incomplete == ["model.layers.1.mlp.experts: 11 expert module(s), config.json implies 12"]
    assert not s.mismatched
    assert "1 expert layer(s) missing modules" in inspect_cmd.render(s)


def test_hf_inspect_reads_headers_only(hf, tmp_path):
    copy = tmp_path / "scrambled"
    shutil.copytree(hf["qwen3_vl_moe"]["modelopt"], copy)
    _scramble_data(copy)
    a, b = inspect_cmd.summarize(hf["qwen3_vl_moe"]["modelopt"]).to_dict(), inspect_cmd.summarize(copy).to_dict()
    assert {**a, "checkpoint": None} == {**b, "checkpoint": None}
