import json

import torch
from safetensors import safe_open

from inkling_quant.model.inkling2 import Inkling2Config, checkpoint_tensors, classify
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
