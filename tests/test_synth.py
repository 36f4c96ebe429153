import json

import torch
from safetensors import safe_open

from inkling_quant.model import dspark
from inkling_quant.model.inkling2 import Inkling2Config, checkpoint_tensors, classify, release_file
from inkling_quant.io.checkpoint import Checkpoint
from inkling_quant.synth import make_config, synth_tensor, write_checkpoint


def test_tiny_checkpoint_is_complete_and_readable(tiny_src):
    cfg = Inkling2Config.load(tiny_src)
    assert cfg.text.num_hidden_layers == 48 and cfg.text.n_routed_experts == 4 and cfg.draft is not None
    index = json.loads((tiny_src / "model.safetensors.index.json").read_text())
    wm = index["weight_map"]
    specs = {s.name: s for s in checkpoint_tensors(cfg)}
    assert set(wm) == set(specs)
    ck = Checkpoint.open(tiny_src)
    assert len(ck.shards) > 1
    headers = ck.headers()
    total = 0
    for shard, h in headers.items():
        with safe_open(tiny_src / shard, "pt") as f:  # the safetensors library reads our files
            for name in f.keys():
                t = f.get_tensor(name)
                assert tuple(t.shape) == specs[name].shape and t.dtype == specs[name].dtype
                classify(name)
                total += t.numel() * t.element_size()
    assert index["metadata"]["total_size"] == total
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (tiny_src / f).is_file()


def test_values_deterministic_and_realistic(tmp_path):
    cfg = Inkling2Config.load(write_checkpoint(tmp_path / "a", "tiny", seed=3, layers=1, experts=1))
    spec = next(s for s in checkpoint_tensors(cfg) if s.name.endswith("layers.0.attn.wq_du.weight"))
    a, b = synth_tensor(spec, 3), synth_tensor(spec, 3)
    assert torch.equal(a, b) and not torch.equal(a, synth_tensor(spec, 4))
    x = a.float()
    row_max = x.abs().amax(dim=1)
    assert row_max.max() > 4 * row_max.median()  # outlier rows/elements exist
    assert torch.isfinite(x).all()


def test_original_layout_stacked_expert_values(tmp_path):
    """Stacked experts [E, 2I, H] get the per-row statistics of a 2-D weight: scaled by the
    input width H (not 2I*H), with outlier rows."""
    cfg = Inkling2Config.from_dict(make_config("tiny"))
    spec = next(s for s in checkpoint_tensors(cfg) if s.name.endswith("layers.0.mlp.experts.w13_weight"))
    x = synth_tensor(spec, 0).float()
    assert x.shape == (4, 2 * 96, 64) and torch.equal(x, synth_tensor(spec, 0).float())
    assert 0.5 < x.std().item() * 64 ** 0.5 < 4  # about 1/sqrt(H) (outliers raise it a little)
    row_max = x.reshape(-1, 64).abs().amax(dim=1)
    assert row_max.max() > 4 * row_max.median()


def test_the_release_files(tiny_src):
    """One shard per decoder layer (embedding with the first, final norm, output query and
    unembedding with the last), the vision tower and the draft in files of their own, every
    file listed in the index (docs/layout.md "Files")."""
    cfg = Inkling2Config.load(tiny_src)
    ck = Checkpoint.open(tiny_src)
    layers = [f"model-{k:05d}-of-00048.safetensors" for k in range(1, 49)]
    assert ck.shards == layers + ["vision.safetensors", "mtp.safetensors"] and ck.unlisted == ()
    headers = ck.headers()
    for k, shard in enumerate(layers):
        names = list(headers[shard].tensors)
        own = {release_file(cfg.text, n) for n in names}
        assert own == {k}, shard
        assert any(f".layers.{k}." in n for n in names) and f"model.llm.attn_res.mlp_queries.{k}" in names
    assert {"model.llm.embed.weight", "model.llm.embed_norm.weight"} <= set(headers[layers[0]].tensors)
    assert {"model.llm.norm.weight", "model.llm.unembed.weight", "model.llm.attn_res.output_query",
            "model.llm.attn_res.attn_queries.46"} <= set(headers[layers[-1]].tensors)
    assert all(n.startswith("model.visual.") for n in headers["vision.safetensors"].tensors)
    assert list(headers["mtp.safetensors"].tensors) == [s.name for s in dspark.draft_tensors(cfg.draft, "mtp.")]


def test_max_shard_size_cuts_a_layers_shard(tmp_path):
    """--max-shard-size cuts a layer's shard further (numbered on, -of-N counting the pieces);
    the vision and draft files stay whole."""
    out = write_checkpoint(tmp_path / "s", "tiny", layers=2, max_shard_bytes=64 << 10)
    ck = Checkpoint.open(out)
    numbered = [s for s in ck.shards if s.startswith("model-")]
    n = len(numbered)
    assert n > 2 and numbered == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    assert ck.shards[n:] == ["vision.safetensors", "mtp.safetensors"]
    cfg = Inkling2Config.load(out)
    seen = [sorted({release_file(cfg.text, t) for t in ck.header(s).tensors}) for s in numbered]
    assert all(len(g) == 1 for g in seen) and [g[0] for g in seen] == sorted(g[0] for g in seen)
    assert all(len(ck.header(s).tensors) == 1 or (out / s).stat().st_size < (64 << 10) + 4096 for s in numbered)
    order = [t for s in numbered for t in ck.header(s).tensors]
    text = [s.name for s in checkpoint_tensors(cfg, include_draft=False) if not s.name.startswith("model.visual.")]
    assert order == text
