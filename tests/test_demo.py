from inkling_quant.cli import main


def test_demo_runs_the_whole_pipeline(capsys, tmp_path):
    assert main(["demo", "--keep", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for step in ("[1/6] synth", "[2/6] convert", "[3/6] verify", "result: PASS", "[4/6] inspect",
                 "[5/6] draft extract", "[6/6] plan", "FITS on 4 x GB200",
                 "recipe: KV cache for 1,048,576 tokens at TP4: 64.47 GiB; NOT reproduced"):
        assert step in out, step
    assert (tmp_path / "tiny-default" / "model.safetensors.index.json").exists()
    assert "published Inkling 2 layout" in out  # the demo runs on the real layout, stacked experts
    assert "model.llm.layers.0.mlp.experts.w13_weight" in (tmp_path / "tiny-bf16" / "model.safetensors.index.json").read_text()
