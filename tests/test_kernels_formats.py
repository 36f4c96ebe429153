"""Where the kernels' own package meets inkling_quant: its reference dequantizes, and its
activation fake-quantization (the sm100 path's model) encodes, bit for bit as inkling_quant.formats
does, on every byte value, NaN codes and e8m0's edges included; its format table and Inkling 2
Small's expert shapes are the formats' and the packaged config's; and verify turns its
KernelError into ours. The kernels' reference is written apart from formats/ on purpose: these
tests keep the two from drifting."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import inkling_kernels as K
from inkling_quant.errors import InklingQuantError
from inkling_quant.errors import KernelError as OurKernelError
from inkling_quant.formats import FORMATS, mxfp8, nvfp4
from inkling_kernels import formats as KF
from inkling_kernels import launch_table as LT
from inkling_kernels import reference as R

CONFIG = Path(__file__).resolve().parents[1] / "inkling_quant" / "configs" / "inkling-2-small.json"


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal fp32 bit patterns (so -0.0 != +0.0), NaN where the other is NaN."""
    assert a.dtype == b.dtype == torch.float32 and a.shape == b.shape
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32))


def _bytes(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)


def _every_byte(rows: int, cols: int, seed: int) -> torch.Tensor:
    """uint8 [rows, cols]: all 256 values first (each at least once), then random bytes."""
    b = _bytes((rows * cols,), seed)
    b[:256] = torch.arange(256, dtype=torch.uint8)
    return b[torch.randperm(b.numel(), generator=torch.Generator().manual_seed(seed))].reshape(rows, cols)


@pytest.mark.parametrize("s2", [1.0, 1e-3, 2.0 ** -130, 3.0e30])
def test_nvfp4_dequantize_is_the_formats(s2):
    t = {"weight": _every_byte(64, 64, 1), "weight_scale": _every_byte(64, 8, 2).view(torch.float8_e4m3fn),
         "weight_scale_2": torch.tensor(s2, dtype=torch.float32)}
    ours = R.dequantize_nvfp4(t["weight"], t["weight_scale"], t["weight_scale_2"])
    assert _same_bits(ours, FORMATS["nvfp4"].dequantize(t, torch.float32))
    assert _same_bits(R.dequantize("nvfp4", t), ours)


def test_nvfp4_dequantize_stacked_is_the_formats():
    """Stacked experts, one weight_scale_2 per expert; scales given as uint8 bytes too."""
    t = {"weight": _every_byte(3 * 32, 32, 3).reshape(3, 32, 32), "weight_scale": _every_byte(3 * 32, 4, 4).reshape(3, 32, 4),
         "weight_scale_2": torch.tensor([1e-3, 7.5, 2.0 ** -100])}
    ref = FORMATS["nvfp4"].dequantize(t, torch.float32)
    assert _same_bits(R.dequantize_nvfp4(t["weight"], t["weight_scale"], t["weight_scale_2"]), ref)
    for e in range(3):
        one = {k: (v[e] if k != "weight_scale_2" else v[e]) for k, v in t.items()}
        assert _same_bits(R._expert("nvfp4", t, e), FORMATS["nvfp4"].dequantize(one, torch.float32))


def test_mxfp8_dequantize_is_the_formats():
    """Every e4m3 byte (NaN codes too) under every e8m0 byte (0: 2^-127, 254, 255: inf)."""
    w = _every_byte(256, 64, 5)
    e8 = _every_byte(256, 2, 6)
    e8[:, 0] = torch.arange(256, dtype=torch.uint8)
    t = {"weight": w.view(torch.float8_e4m3fn), "weight_scale": e8}
    ours = R.dequantize_mxfp8(t["weight"], t["weight_scale"])
    assert _same_bits(ours, FORMATS["mxfp8"].dequantize(t, torch.float32))
    assert _same_bits(R.dequantize("mxfp8", {"weight": w, "weight_scale": e8}), ours)
    st = {"weight": t["weight"].reshape(4, 64, 64), "weight_scale": e8.reshape(4, 64, 2)}
    assert _same_bits(R.dequantize_mxfp8(st["weight"], st["weight_scale"]), FORMATS["mxfp8"].dequantize(st, torch.float32))


def test_passthrough_dequantize_is_the_formats():
    w = torch.randn(8, 32).to(torch.bfloat16)
    assert _same_bits(R.dequantize(R.UNQUANTIZED, {"weight": w}), FORMATS["passthrough"].dequantize({"weight": w}))
    with pytest.raises(ValueError, match="no format"):
        R.dequantize("fp8_block", {"weight": w})


def _activations(seed: int) -> torch.Tensor:
    """bf16 [24, 128]: Gaussian rows over many magnitudes, an all-zero row and block, +-0.0,
    bf16 subnormals and a row whose block lands on every e2m1 tie (exact midpoints)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(24, 128, generator=g) * torch.logspace(-30, 30, 24).unsqueeze(-1)
    x[3] = 0.0
    x[4, :16] = 0.0
    x[5, ::2] = -0.0
    x[6] = torch.randn(128, generator=g) * 2.0 ** -130                   # bf16 subnormals
    x[7] = torch.randint(-4, 4, (128,), generator=g) * 2.0 ** -133
    # amax 2.625 = 2688 * 2^-10: s2 = 2^-10; a block of bmax 6/128 gets scale 8 and y = 128 x exactly
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    x[8] = 0.0
    x[8, 0] = 2.625
    x[8, 16:32] = torch.cat([ties, -ties]) / 128
    x[8, 32:48] = torch.cat([ties, -ties]).flip(0) / 128 * 0.999
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("seed", [0, 1])
def test_nvfp4_activation_fake_quant_is_the_formats(seed):
    x = _activations(seed)
    fmt = FORMATS["nvfp4"]
    rows = [x[i:i + 1] for i in range(x.shape[0])] + [x]
    for xi in rows:
        for input_scale in (None, xi.float().abs().amax() / (6 * 448) / 4):
            amax = R.nvfp4_activation_amax(xi, input_scale)
            if fmt.flushes(float(amax)) or not amax > 0:  # the formats' all-zero tensor
                assert torch.equal(R.fake_quant_nvfp4_activations(xi, input_scale), torch.zeros(xi.shape))
                continue
            want = fmt.dequantize(fmt.quantize(xi, global_amax=amax), torch.float32)
            assert _same_bits(R.fake_quant_nvfp4_activations(xi, input_scale), want)


@pytest.mark.parametrize("seed", [0, 1])
def test_mxfp8_activation_fake_quant_is_the_formats(seed):
    x = _activations(seed)
    fmt = FORMATS["mxfp8"]
    for xi in [x[i:i + 1] for i in range(x.shape[0])] + [x]:
        assert _same_bits(R.fake_quant_mxfp8_activations(xi), fmt.dequantize(fmt.quantize(xi), torch.float32))


def test_activation_scale_is_the_formats_global_scale():
    x = _activations(2)
    for input_scale in (None, torch.tensor(0.0123)):
        amax = R.nvfp4_activation_amax(x, input_scale)
        assert torch.equal(R.nvfp4_global_scale(amax), nvfp4.nvfp4_global_scale(amax))


def test_the_kernels_format_table_is_the_formats():
    for name, kf in KF.FORMATS.items():
        assert kf.scale_block == FORMATS[name].block_size
        assert FORMATS[name].kernel in K.__all__
    assert KF.NVFP4.vmax == nvfp4.E2M1_MAX and KF.MXFP8.vmax == KF.E4M3_MAX == nvfp4.E4M3_MAX == mxfp8.E4M3_MAX
    assert KF.NVFP4_MIN_SCALE == nvfp4.MIN_BLOCK_SCALE and KF.NVFP4_GLOBAL_DIV == nvfp4.GLOBAL_DIV
    assert torch.tensor(KF.NVFP4_MIN_AMAX) == torch.tensor(nvfp4.MIN_AMAX)  # equal in fp32, where both compare
    assert list(KF.E2M1_MAGNITUDES) == nvfp4.E2M1_VALUES[:8].tolist()
    assert KF.scale_block("nvfp4") == 16 and KF.scale_block("mxfp8") == 32
    with pytest.raises(ValueError, match="no kernel for format"):
        KF.scale_block("passthrough")


def test_real_shapes_are_the_packaged_configs():
    t = json.loads(CONFIG.read_text())["text_config"]
    assert LT.real_shapes() == LT.real_shapes(CONFIG)
    assert LT.INKLING2_SMALL == {k: t[k] for k in LT.INKLING2_SMALL}


def test_verify_reports_a_kernel_error_as_ours():
    """The kernels raise their own KernelError (a ValueError); verify's numerics re-raise it as
    inkling_quant's, which its checks report and the command line prints as a message."""
    from inkling_quant.verify.numerics import kernel_errors

    with pytest.raises(OurKernelError, match="unknown path") as e:
        with kernel_errors():
            K.nvfp4_dequant_gemm(torch.zeros(1, 16), torch.zeros(1, 8, dtype=torch.uint8),
                                 torch.zeros(1, 1, dtype=torch.float8_e4m3fn), torch.ones(()), path="no-such-path")
    assert isinstance(e.value, InklingQuantError) and isinstance(e.value, ValueError)
    assert isinstance(e.value.__cause__, K.KernelError) and not isinstance(e.value.__cause__, InklingQuantError)
    assert str(e.value) == str(e.value.__cause__)
