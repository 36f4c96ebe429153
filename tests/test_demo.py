from inkling_quant.cli import main


def test_demo_runs_the_whole_pipeline(capsys, tmp_path):
    assert main(["demo", "--keep", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for step in ("[1/7] synth", "[2/7] calibrate", "experts without a token", "[3/7] convert",
                 "NVFP4 activation scales: 80 calibrated", "[4/7] verify", "result: PASS", "[5/7] inspect",
                 "calibration: routed", "[6/7] draft extract", "[7/7] plan", "FITS on 4 x GB200",
                 "recipe: KV cache for 1,048,576 tokens at TP4: 64.47 GiB; NOT reproduced"):
        assert step in out, step
    assert (tmp_path / "tiny-default" / "model.safetensors.index.json").exists()
    assert "published Inkling 2 layout" in out  # the demo runs on the real layout, stacked experts
    assert "model.llm.layers.0.mlp.experts.w13_weight" in (tmp_path / "tiny-bf16" / "model.safetensors.index.json").read_text()
