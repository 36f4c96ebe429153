"""inkling-quant draft extract / strip on tiny synthetic checkpoints (the draft bundled as
inkling_quant.model.dspark spells it; tests/test_draft_original.py holds the spec to vLLM)."""
from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from inkling_quant import cli, draft
from inkling_quant.cli import draft as draft_cli

from inkling_quant.model import dspark
from inkling_quant.errors import CheckpointError, ConfigError, InklingQuantError, UsageError
from inkling_quant.model.inkling2 import Inkling2Config, checkpoint_tensors
from inkling_quant.io.checkpoint import INDEX_NAME, Checkpoint, shard_name
from inkling_quant.io.output import read_checksums
from inkling_quant.io.safetensors import ShardReader, ShardWriter, sha256_file
from inkling_quant.io.shards import plan_shards
from inkling_quant.synth import write_checkpoint
from inkling_quant.verify import verify

from legacy_checkpoint import write_legacy_checkpoint


P = dspark.PREFIX  # "mtp.": the bundled draft's tensors


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    """The tiny preset in the release's files: 48 layer shards, vision.safetensors, and the draft
    alone in mtp.safetensors."""
    return write_checkpoint(tmp_path_factory.mktemp("draft") / "src", "tiny")


@pytest.fixture(scope="module")
def extracted(src, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("draft") / "extracted"
    draft.extract(src, out)
    return out


@pytest.fixture(scope="module")
def stripped(src, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("draft") / "stripped"
    draft.strip(src, out)
    return out


def tensor_bytes(root: Path) -> dict[str, tuple[str, tuple, bytes]]:
    """{name: (dtype, shape, raw bytes)} of a whole checkpoint, read through its (validated) index."""
    ckpt = Checkpoint.open(root)
    out = {}
    for shard, h in ckpt.headers().items():
        with ShardReader(root / shard, h) as r:
            for name, e in h.tensors.items():
                out[name] = (str(e.dtype), e.shape, bytes(r.read_bytes(e)))
    return out


def copy_ckpt(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)  # real copies: the tests below damage them
    return dst


def repack(src: Path, dst: Path, max_bytes: int | None = None, index: bool = True) -> Path:
    """SRC's tensors, in SRC's order, in size-packed shards (`max_bytes`; None: one file) as
    save_pretrained or ModelOpt's export packs them: the draft inside the model's shards, no
    mtp.safetensors. Without `index`, one model.safetensors and no index."""
    dst.mkdir()
    ckpt = Checkpoint.open(src)
    headers = ckpt.headers()
    entries = [(s, e) for s in ckpt.shards for e in headers[s].tensors.values()]
    shards = plan_shards(entries, max_bytes or 1 << 62, size=lambda x: x[1].nbytes)
    wm = {}
    for i, group in enumerate(shards):
        name = shard_name(i, len(shards)) if index else "model.safetensors"
        with ShardWriter(dst / name, [(e.name, e.dtype, e.shape) for _, e in group], {"format": "pt"}) as w:
            for s, e in group:
                with ShardReader(src / s, headers[s]) as r:
                    w.write(e.name, r.get(e.name))
                wm[e.name] = name
            w.commit()
    if index:
        (dst / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    for p in ckpt.other_files() + [src / "config.json"]:
        shutil.copy(p, dst / p.name)
    return dst


def edit_config(root: Path, fn) -> None:
    p = root / "config.json"
    d = json.loads(p.read_text())
    fn(d)
    p.write_text(json.dumps(d))


# --------------------------------------------------------------------------- extract
def test_extract_is_byte_identical(src, extracted):
    source, out = tensor_bytes(src), tensor_bytes(extracted)
    draft_names = {n for n in source if n.startswith(P)}
    assert P == "mtp." and draft_names and set(out) == {n[len(P):] for n in draft_names}  # the drafter's own names
    for name, v in out.items():
        assert v == source[P + name], name
    sums = read_checksums(extracted / "checksums.sha256")
    assert sums == {s: sha256_file(extracted / s) for s in Checkpoint.open(extracted).shards}
    index = json.loads((extracted / INDEX_NAME).read_text())
    assert index["metadata"]["total_size"] == sum(len(v[2]) for v in out.values())


def test_extract_config_describes_the_draft(src, extracted, tmp_path):
    dc = json.loads((extracted / "config.json").read_text())
    target = Inkling2Config.load(src)
    assert dc == json.loads((src / "config.json").read_text())["dspark_config"]  # verbatim
    assert dc["speculators_model_type"] == "dspark" and dc["architectures"] == ["Qwen3DSparkModel"]
    assert dc["block_size"] == 7 == dc["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    assert dc["transformer_layer_config"]["hidden_size"] == dc["target_hidden_size"] == target.text.hidden_size
    assert "quantization_config" not in dc
    # the config alone regenerates the tensor list (names, shapes, dtypes) of the extracted shards
    headers = Checkpoint.open(extracted).headers()
    got = {n: (e.shape, e.dtype) for h in headers.values() for n, e in h.tensors.items()}
    assert got == {s.name: (s.shape, s.dtype) for s in draft.draft_specs(dc)}
    assert got == {s.name: (s.shape, s.dtype) for s in dspark.draft_tensors(target.draft)}
    # shared tensors by reference: named, not copied, and present in the target
    shared = draft.extract(src, tmp_path / "d")["shared_by_reference"]
    assert shared == ["model.llm.embed.weight", "model.llm.unembed.weight"]
    assert not set(got) & set(shared)
    src_headers = Checkpoint.open(src).headers()
    src_shapes = {n: e.shape for h in src_headers.values() for n, e in h.tensors.items()}
    assert all(src_shapes[n] == (target.draft.vocab_size, target.draft.hidden_size) for n in shared)


def test_extract_splits_shards(src, tmp_path):
    out = tmp_path / "d"
    r = draft.extract(src, out, max_shard_bytes=100_000)
    ckpt = Checkpoint.open(out)
    assert r["shards"] == len(ckpt.shards) > 1
    assert all(os.path.getsize(out / s) < 100_000 + 8192 or len(ckpt.header(s).tensors) == 1 for s in ckpt.shards)
    assert tensor_bytes(out) == {k[len(P):]: v for k, v in tensor_bytes(src).items() if k.startswith(P)}


# --------------------------------------------------------------------------- strip
def test_strip_and_extract_partition_the_source(src, stripped, extracted):
    source, s = tensor_bytes(src), tensor_bytes(stripped)
    d = {P + n: v for n, v in tensor_bytes(extracted).items()}
    assert not set(s) & set(d)                     # each tensor exactly once
    assert set(s) | set(d) == set(source)
    assert {**s, **d} == source                    # byte-identical
    # the shared tensors stay in the target, once; the draft only names them
    assert set(draft.shared_tensor_names().values()) <= set(s)


def test_strip_layout(src, stripped):
    src_ckpt, out = Checkpoint.open(src), Checkpoint.open(stripped)
    # the draft is mtp.safetensors alone: dropped; every other file keeps its name and is the
    # source's file (hardlinked)
    assert src_ckpt.shards == [f"model-{i:05d}-of-00048.safetensors" for i in range(1, 49)] + \
        ["vision.safetensors", "mtp.safetensors"]
    assert all(n.startswith(P) for n in src_ckpt.header("mtp.safetensors").tensors)
    assert out.shards == src_ckpt.shards[:-1]
    for s in out.shards:
        assert os.stat(src / s).st_ino == os.stat(stripped / s).st_ino, s
    index = json.loads((stripped / INDEX_NAME).read_text())
    assert index["metadata"]["total_size"] == sum(len(v[2]) for v in tensor_bytes(stripped).values())
    for p in src_ckpt.other_files():
        assert (stripped / p.name).read_bytes() == p.read_bytes()
    assert not (stripped / "checksums.sha256").exists()  # the source had none
    assert not list(stripped.parent.glob("*.partial"))


def test_strip_then_synth_config_loads(src, stripped):
    cfg = Inkling2Config.load(stripped)
    assert cfg.draft is None
    raw = json.loads((stripped / "config.json").read_text())
    assert "dspark_config" not in raw
    note = raw[draft.STRIPPED_KEY]
    assert note["dspark_config"] == json.loads((src / "config.json").read_text())["dspark_config"]
    # the stripped checkpoint is exactly what the layout expects of a model without a draft
    headers = Checkpoint.open(stripped).headers()
    got = {n: (e.shape, e.dtype) for h in headers.values() for n, e in h.tensors.items()}
    assert got == {s.name: (s.shape, s.dtype) for s in checkpoint_tensors(cfg)}


def test_draft_in_the_model_shards(src, extracted, tmp_path):
    """A checkpoint packed by size (save_pretrained's, ModelOpt's export: the draft inside the
    model's shards): a mixed shard is rewritten, a draft-only numbered shard dropped and the
    numbered shards left renumbered so "-of-N" stays true."""
    packed = repack(src, tmp_path / "packed", 1 << 20)
    shards = Checkpoint.open(packed).shards
    only_draft = [s for s in shards if all(n.startswith(P) for n in Checkpoint.open(packed).header(s).tensors)]
    assert only_draft == [shards[-1]] and len(shards) > 3
    r = draft.strip(packed, tmp_path / "s")
    assert (r["dropped"], r["rewritten"], r["linked"]) == (1, 1, len(shards) - 2)
    n = len(shards) - 1
    assert Checkpoint.open(tmp_path / "s").shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    draft.extract(packed, tmp_path / "d")
    assert tensor_bytes(tmp_path / "d") == tensor_bytes(extracted)
    assert {**tensor_bytes(tmp_path / "s"), **{P + k: v for k, v in tensor_bytes(tmp_path / "d").items()}} == \
        tensor_bytes(src)


def test_strip_keeps_names_when_no_shard_is_dropped(tmp_path):
    one = repack(write_checkpoint(tmp_path / "synth", "tiny", layers=1), tmp_path / "one")
    assert Checkpoint.open(one).shards == ["model-00001-of-00001.safetensors"]
    r = draft.strip(one, tmp_path / "s", copy=True)
    assert (r["rewritten"], r["dropped"], r["linked"]) == (1, 0, 0)
    assert Checkpoint.open(tmp_path / "s").shards == ["model-00001-of-00001.safetensors"]
    assert Inkling2Config.load(tmp_path / "s").draft is None


def test_strip_drops_the_sources_parameter_count(src, tmp_path):
    """transformers' save_pretrained records `total_parameters` in the index; after the draft is
    gone it would be stale, so the stripped index carries no such count (and its exact size)."""
    shutil.copytree(src, tmp_path / "src")
    index = tmp_path / "src" / INDEX_NAME
    obj = json.loads(index.read_text())
    obj["metadata"]["total_parameters"] = 123456789
    index.write_text(json.dumps(obj))
    draft.strip(tmp_path / "src", tmp_path / "s")
    meta = json.loads((tmp_path / "s" / INDEX_NAME).read_text())["metadata"]
    assert "total_parameters" not in meta
    assert meta["total_size"] == sum(e.nbytes for h in Checkpoint.open(tmp_path / "s").headers().values()
                                     for e in h.tensors.values())


def test_single_file_checkpoint(tmp_path):
    one = repack(write_checkpoint(tmp_path / "synth", "tiny", layers=1), tmp_path / "one", index=False)
    draft.strip(one, tmp_path / "s")
    draft.extract(one, tmp_path / "d")
    assert sorted(p.name for p in (tmp_path / "s").glob("*.safetensors")) == ["model.safetensors"]
    extracted = {P + n: v for n, v in tensor_bytes(tmp_path / "d").items()}
    assert {**tensor_bytes(tmp_path / "s"), **extracted} == tensor_bytes(one)


def _without_draft_file(src: Path, dst: Path) -> Path:
    """SRC's tensors but the draft's in model.safetensors (no index), the draft in mtp.safetensors
    beside it: Inkling 2 Mini's files (the tiny-random/inkling2-loop card)."""
    ckpt = Checkpoint.open(src)
    headers = ckpt.headers()
    dst.mkdir()
    model = [(s, e) for s in ckpt.shards if s != "mtp.safetensors" for e in headers[s].tensors.values()]
    with ShardWriter(dst / "model.safetensors", [(e.name, e.dtype, e.shape) for _, e in model], {"format": "pt"}) as w:
        for s, e in model:
            with ShardReader(src / s, headers[s]) as r:
                w.write(e.name, r.get(e.name))
        w.commit()
    shutil.copy(src / "mtp.safetensors", dst / "mtp.safetensors")
    for p in ckpt.other_files() + [src / "config.json"]:
        shutil.copy(p, dst / p.name)
    return dst


@pytest.mark.parametrize("form", ["index omits it", "model.safetensors beside it"])
def test_mtp_file_the_index_does_not_list(src, extracted, tmp_path, form):
    """mtp.safetensors is found whether or not the index lists it (an index that omits it, as
    SGLang tolerates for GLM-4 MoE; Mini's model.safetensors + mtp.safetensors without one)."""
    if form == "index omits it":
        ck = copy_ckpt(src, tmp_path / "ck")
        index = json.loads((ck / INDEX_NAME).read_text())
        index["weight_map"] = {n: f for n, f in index["weight_map"].items() if f != "mtp.safetensors"}
        (ck / INDEX_NAME).write_text(json.dumps(index))
    else:
        ck = _without_draft_file(src, tmp_path / "ck")
    opened = Checkpoint.open(ck)
    assert opened.unlisted == ("mtp.safetensors",) and opened.shards[-1] == "mtp.safetensors"
    assert tensor_bytes(ck) == tensor_bytes(src)
    draft.extract(ck, tmp_path / "d")
    assert tensor_bytes(tmp_path / "d") == tensor_bytes(extracted)
    r = draft.strip(ck, tmp_path / "s")
    assert r["dropped"] == 1 and not (tmp_path / "s" / "mtp.safetensors").exists()
    assert Checkpoint.open(tmp_path / "s").unlisted == ()
    r = verify(ck, write_checksums=True)  # verify reads it too, and says so
    assert r.ok and r.check("index").figures["unlisted_weight_files"] == ["mtp.safetensors"], r.format_summary()
    # a tensor both in the index's files and in the unlisted mtp.safetensors: named, refused
    dup = copy_ckpt(ck, tmp_path / "dup")
    H = Inkling2Config.load(src).text.hidden_size
    with ShardWriter(dup / "mtp.safetensors", [("model.llm.norm.weight", torch.bfloat16, (H,))], {"format": "pt"}) as w:
        w.write("model.llm.norm.weight", torch.ones(H, dtype=torch.bfloat16))
        w.commit()
    with pytest.raises(CheckpointError, match=r"model\.llm\.norm\.weight.*mtp\.safetensors.*exactly once"):
        Checkpoint.open(dup)


def test_converted_checkpoint(src, tmp_path):
    """A converted checkpoint: quantization configs and checksums.sha256 (as convert writes them)."""
    conv = copy_ckpt(src, tmp_path / "conv")
    qc = {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION", "exclude_modules": ["lm_head", "mtp*"]}
    edit_config(conv, lambda d: d.update(quantization_config=qc))
    (conv / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"}, "quantization": qc}))
    listed = sorted([p.name for p in conv.iterdir() if p.name != INDEX_NAME])
    (conv / "checksums.sha256").write_text("".join(f"{sha256_file(conv / f)}  {f}\n" for f in listed))

    r = draft.strip(conv, tmp_path / "s", copy=True)
    s = tmp_path / "s"
    assert r["copied"] == 49 and r["dropped"] == 1 and r["checksums"]
    assert (s / "hf_quant_config.json").read_bytes() == (conv / "hf_quant_config.json").read_bytes()
    assert json.loads((s / "config.json").read_text())["quantization_config"] == qc
    sums = read_checksums(s / "checksums.sha256")
    out_files = {p.name for p in s.iterdir() if p.name not in (INDEX_NAME, "checksums.sha256")}
    assert set(sums) == out_files
    assert all(sha256_file(s / f) == h for f, h in sums.items())

    draft.extract(conv, tmp_path / "d")
    dc = json.loads((tmp_path / "d" / "config.json").read_text())
    assert "quantization_config" not in dc and not (tmp_path / "d" / "hf_quant_config.json").exists()
    assert {**tensor_bytes(s), **{P + n: v for n, v in tensor_bytes(tmp_path / "d").items()}} == \
        tensor_bytes(conv)

    # a source file that does not match the checksums it ships is refused, by name: a copied
    # shard by strip, the draft's file by extract
    for bad, fn in (("model-00010-of-00048.safetensors", lambda o: draft.strip(conv, o, copy=True)),
                    ("mtp.safetensors", lambda o: draft.extract(conv, o))):
        good = (conv / "checksums.sha256").read_text()
        (conv / "checksums.sha256").write_text(good.replace(sha256_file(conv / bad), "0" * 64))
        with pytest.raises(CheckpointError, match=f"{bad}.*(corrupt|does not match)"):
            fn(tmp_path / "s2")
        assert not (tmp_path / "s2").exists() and not (tmp_path / "s2.partial").exists()
        (conv / "checksums.sha256").write_text(good)


# --------------------------------------------------------------------------- errors
def test_no_draft(stripped, tmp_path):
    for fn in (draft.extract, draft.strip):
        with pytest.raises(CheckpointError, match="no DSpark draft"):
            fn(stripped, tmp_path / fn.__name__)
    assert not list(tmp_path.iterdir())


def test_config_and_tensors_disagree(src, tmp_path):
    no_cfg = copy_ckpt(src, tmp_path / "no_cfg")
    edit_config(no_cfg, lambda d: d.pop("dspark_config"))
    with pytest.raises(ConfigError, match="dspark_config"):
        draft.extract(no_cfg, tmp_path / "o1")
    missing_key = copy_ckpt(src, tmp_path / "missing_key")
    edit_config(missing_key, lambda d: d["dspark_config"]["speculators_config"]["proposal_methods"][0].pop(
        "speculative_tokens"))
    with pytest.raises(ConfigError, match="speculative_tokens"):
        draft.strip(missing_key, tmp_path / "o2")
    deeper = copy_ckpt(src, tmp_path / "deeper")
    edit_config(deeper, lambda d: d["dspark_config"]["transformer_layer_config"].update(num_hidden_layers=6))
    with pytest.raises(CheckpointError, match=r"draft incomplete.*mtp\.layers\.5"):
        draft.extract(deeper, tmp_path / "o3")


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    """Two layers of the tiny preset, with its draft: what the dspark_config tests edit."""
    return write_checkpoint(tmp_path_factory.mktemp("draft") / "small", "tiny", layers=2)


def _set(path: str, value):
    """An edit of config.json setting dspark_config's key `path` (dots; a digit indexes a list)."""
    def fn(d):
        node, keys = d["dspark_config"], path.split(".")
        for k in keys[:-1]:
            node = node[int(k)] if k.isdigit() else node[k]
        node[keys[-1]] = value
    return fn


_METHOD = "speculators_config.proposal_methods.0."
# (edit, the key path the message names): values the public sources refuse (docs/draft.md "Errors")
_BAD_DSPARK = {
    "mask-past-vocab": (_set("mask_token_id", 100000), "dspark_config.mask_token_id"),
    "mask-negative": (_set("mask_token_id", -1), "dspark_config.mask_token_id"),
    "markov-foo": (_set("markov_head_type", "foo"), "dspark_config.markov_head_type"),
    "markov-not-a-string": (_set("markov_head_type", ["vanilla"]), "dspark_config.markov_head_type"),
    "markov-missing": (lambda d: d["dspark_config"].pop("markov_head_type"), "dspark_config.'markov_head_type'"),
    "tokens-past-block": (_set(_METHOD + "speculative_tokens", 9),
                          "dspark_config.speculators_config.proposal_methods[0].speculative_tokens"),
    "tokens-below-block": (_set(_METHOD + "speculative_tokens", 3),
                           "dspark_config.speculators_config.proposal_methods[0].speculative_tokens"),
    "tokens-short-from-anchor": (lambda d: (_set(_METHOD + "speculative_tokens", 6)(d),
                                            _set("sample_from_anchor", True)(d)),
                                 "dspark_config.speculators_config.proposal_methods[0].speculative_tokens"),
    "anchor-not-bool": (_set("sample_from_anchor", "yes"), "dspark_config.sample_from_anchor"),
}


@pytest.mark.parametrize("case", list(_BAD_DSPARK))
def test_dspark_config_values_refused(case, small, tmp_path, capsys):
    """draft extract, draft strip and convert refuse a dspark_config the public DSpark sources
    refuse (exit 2, naming config.json and the key), writing nothing."""
    edit, key = _BAD_DSPARK[case]
    ck = copy_ckpt(small, tmp_path / "ck")
    edit_config(ck, edit)
    for cmd in (["draft", "extract"], ["draft", "strip"], ["convert"]):
        out = tmp_path / "_".join(cmd)
        assert cli.main([*cmd, str(ck), str(out), "--quiet"]) == 2, cmd
        err = capsys.readouterr().err
        assert "Traceback" not in err and f"{ck / 'config.json'}: " in err and key in err, (cmd, err)
        assert not out.exists() and not (tmp_path / (out.name + ".partial")).exists()


# values no public source constrains (or several allow): accepted and passed on unchanged
_FREE_DSPARK = {
    "algorithm-eagle3": _set("speculators_config.algorithm", "eagle3"),
    "proposal-type-greedy": _set(_METHOD + "proposal_type", "greedy"),
    "tokens-block-minus-one": _set(_METHOD + "speculative_tokens", 6),  # vLLM's algos.py: the bonus-anchor layout
    "markov-upper-case": _set("markov_head_type", "Vanilla"),            # SGLang and NeMo lower-case it
}


@pytest.mark.parametrize("case", list(_FREE_DSPARK))
def test_dspark_config_values_accepted(case, small, tmp_path):
    ck = copy_ckpt(small, tmp_path / "ck")
    edit_config(ck, _FREE_DSPARK[case])
    want = json.loads((ck / "config.json").read_text())["dspark_config"]
    assert cli.main(["draft", "extract", str(ck), str(tmp_path / "ex"), "--quiet"]) == 0
    assert json.loads((tmp_path / "ex" / "config.json").read_text()) == want
    assert cli.main(["draft", "strip", str(ck), str(tmp_path / "st"), "--quiet"]) == 0


@pytest.mark.parametrize("head,name,shapes", [("gated", "gate_proj", ((16, 64 + 16), (16,))),
                                              ("rnn", "joint_proj", ((48, 2 * 16 + 64), (48,)))])
def test_markov_head_types_carry_their_tensors(head, name, shapes, small, tmp_path, capsys):
    """A gated or RNN Markov head (SGLang 0.5.23, NeMo AutoModel 0.7.0) has its own Linear: the
    spec lists it, and a config naming one over a vanilla draft is refused naming the tensor."""
    dc = json.loads((small / "config.json").read_text())["dspark_config"]
    dc["markov_head_type"] = head
    specs = {s.name: s.shape for s in draft.draft_specs(dc)}
    assert (specs[f"markov_head.{name}.weight"], specs[f"markov_head.{name}.bias"]) == shapes
    ck = copy_ckpt(small, tmp_path / "ck")
    edit_config(ck, _set("markov_head_type", head))
    assert cli.main(["draft", "extract", str(ck), str(tmp_path / "ex"), "--quiet"]) == 2
    assert f"'mtp.markov_head.{name}." in capsys.readouterr().err


def test_legacy_layout_refused(tmp_path, capsys):
    """A checkpoint of the layout this project invented before Inkling 2 was published (draft
    tensors named its way, flat config.json): refused, naming config.json, writing nothing."""
    legacy = write_legacy_checkpoint(tmp_path / "legacy")
    for fn in (draft.extract, draft.strip):
        with pytest.raises(ConfigError, match=r"config\.json: no 'text_config'.*no longer supported"):
            fn(legacy, tmp_path / fn.__name__)
    assert cli.main(["draft", "extract", str(legacy), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "config.json" in err and "no longer supported" in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["legacy"]


def test_draft_config_without_draft_tensors(stripped, tmp_path):
    ck = copy_ckpt(stripped, tmp_path / "ck")
    edit_config(ck, lambda d: d.update(dspark_config=d[draft.STRIPPED_KEY]["dspark_config"]))
    with pytest.raises(CheckpointError, match="no DSpark draft tensors"):
        draft.strip(ck, tmp_path / "o")


def test_out_exists(src, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(UsageError, match="already exists"):
        draft.extract(src, out)
    assert (out / "keep.txt").exists()
    draft.extract(src, out, overwrite=True)
    assert not (out / "keep.txt").exists() and (out / "config.json").exists()
    assert not (tmp_path / "out.old").exists() and not (tmp_path / "out.partial").exists()
    with pytest.raises(UsageError, match="outside the source"):
        draft.strip(src, src / "inside", overwrite=True)


def test_corrupt_shard_is_named(src, tmp_path):
    bad = copy_ckpt(src, tmp_path / "bad")
    shard = bad / "model-00003-of-00048.safetensors"
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) - 100)
    for fn in (draft.extract, draft.strip):
        with pytest.raises(CheckpointError, match="model-00003-of-00048.safetensors.*truncated"):
            fn(bad, tmp_path / fn.__name__)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad"]


def test_cli(src, tmp_path, capsys):
    assert cli.COMMANDS["draft"][0] == "inkling_quant.cli.draft"
    p = argparse.ArgumentParser()
    draft_cli.add_arguments(p)  # cli.main builds the same parser for `inkling-quant draft`
    args = p.parse_args(["extract", str(src), str(tmp_path / "d"), "--quiet", "--max-shard-size", "1MB"])
    assert draft_cli.run(args) == 0
    assert capsys.readouterr().out == ""
    args = p.parse_args(["strip", str(src), str(tmp_path / "d"), "--quiet"])
    with pytest.raises(InklingQuantError, match="already exists"):
        draft_cli.run(args)
