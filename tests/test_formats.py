"""NVFP4 / MXFP8 formats: bit-exact against NVIDIA ModelOpt's own quantizers (packed bits, block
scales, global scale), dequantization, the conventions docs/formats.md pins, and the errors.

ModelOpt is imported lazily (a module fixture): `import inkling_quant.formats` must not load it."""
from __future__ import annotations

import subprocess
import sys

import numba
import numpy as np
import pytest
import warnings

import torch

from inkling_quant.errors import FormatError
from inkling_quant.formats import FORMATS, MXFP8, NVFP4, get_format
from inkling_quant.formats import _jit
from inkling_quant.formats import MIN_INVERTIBLE_SCALE, SOURCE_FORMATS, TRANSCODERS, Format, FP8Block, invertible, transcode
from inkling_quant.formats.mxfp8 import _mxfp8_torch, e8m0_exponent
from inkling_quant.formats.nvfp4 import (_MODELOPT, E2M1_BOUNDS, E2M1_VALUES, _e2m1_codes_torch, _nvfp4_torch, amax, pack_e2m1,
                                         unpack_e2m1)

BF = torch.bfloat16
U8 = torch.uint8


# ------------------------------------------------------------------------------ fixtures / helpers
@pytest.fixture(scope="module")
def mo():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from modelopt.torch.quantization.qtensor import MXFP8QTensor, NVFP4QTensor
    return NVFP4QTensor, MXFP8QTensor


@pytest.fixture(autouse=True)
def _two_threads():
    """Run with 2 torch threads (the chunked kernel then uses 2 worker threads) unless a test
    says otherwise; restore the caller's setting."""
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(n)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(U8) if t.dtype in (torch.float8_e4m3fn, U8) else t


def gaussian(rows=64, cols=256, seed=0, std=0.02, dtype=BF):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, cols, generator=g) * std).to(dtype)


def outliers(rows=64, cols=256, seed=1):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.02
    w[3] *= 1000.0                                    # a whole row x1000
    w[10, 17] = 250.0                                 # single huge elements
    w[20, 5] = -3000.0
    w.view(-1)[torch.randint(0, w.numel(), (40,), generator=g)] *= 60.0
    return w.to(BF)


def zero_blocks(rows=64, cols=256, seed=2):
    w = gaussian(rows, cols, seed)
    w[0, :16] = 0                                     # one NVFP4 block
    w[1, 32:64] = 0                                   # one MXFP8 block
    w[2, :] = 0                                       # a whole row
    w[5, 16:32] = -0.0                                # a block of negative zeros
    w[6, 3] = -0.0                                    # lone negative zeros
    w[7, 100] = -0.0
    return w


def subnormal(rows=64, cols=256, seed=3):
    """bf16 subnormals (|x| < 2^-126): a whole tensor of them would be all-subnormal; here half
    the rows are subnormal-only and half mix 1e-40-ish values into normal blocks."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 1e-39
    w[rows // 2:] = torch.randn(rows - rows // 2, cols, generator=g) * 0.02
    w[rows // 2:, ::7] = torch.randn(rows - rows // 2, (cols + 6) // 7, generator=g) * 1e-40
    return w.to(BF)


def underflow(rows=8, cols=64):
    """A block with a huge element and tiny negatives: x / d underflows to -0.0, which ModelOpt
    does not count as negative (code 0, not 8)."""
    w = torch.zeros(rows, cols)
    w[:, 0] = 3.0e38
    w[:, 1:16] = -9.2e-41
    w[:, 16:32] = torch.linspace(-1e-30, 1e-30, 16)
    w[:, 32:] = 1.0
    return w.to(BF)


def ties(seed=4):
    """Weights landing exactly on the e2m1 rounding bounds (and one bf16 ulp either side), with
    power-of-two scales so that y = x / d is exact: global amax 2.625 -> weight_scale_2 = 2^-10,
    block amax 0.375 -> block scale 64 -> d = 2^-4."""
    d = 2.0 ** -4
    vals = []
    for b in E2M1_BOUNDS.tolist() + [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 0.0]:
        x = torch.tensor(b * d).to(BF)
        up = (x.view(torch.int16) + 1).view(BF)
        down = (x.view(torch.int16) - 1).view(BF) if b > 0 else x
        vals += [x, up, down, -x, -up, -down]
    body = torch.stack(vals).float()
    rows = []
    for r in range(0, len(body), 15):
        blk = body[r:r + 15]
        blk = torch.cat([blk, torch.zeros(15 - len(blk))])
        rows.append(torch.cat([torch.tensor([6 * d]), blk]))      # each block's amax = 6d
    w = torch.cat(rows).reshape(-1, 32)
    w = torch.cat([w, torch.full((1, 32), 2.625)])                # global amax
    return w.to(BF)


CASES = {
    "gaussian": gaussian,
    "outliers": outliers,
    "zero_blocks": zero_blocks,
    "subnormal": subnormal,
    "underflow": underflow,
    "ties": ties,
    "fp16": lambda: gaussian(dtype=torch.float16),
    "fp32": lambda: outliers().float() * 1.0001,
    "partial_chunk": lambda: gaussian(333, 3072, seed=5),          # blocks not a multiple of a chunk
}


def mo_nvfp4(mo, w, s2=None):
    qt, s, s2_ = mo[0].quantize(w, 16, weights_scaling_factor_2=s2)
    return qt, s, s2_


def assert_nvfp4_equal(ours, qt, s, s2):
    assert ours["weight"].dtype == U8 and ours["weight_scale"].dtype == torch.float8_e4m3fn
    assert torch.equal(ours["weight"], qt._quantized_data), "packed e2m1 bits differ"
    assert torch.equal(_bits(ours["weight_scale"]), _bits(s)), "block scales differ"
    assert ours["weight_scale_2"].shape == () and ours["weight_scale_2"].dtype == torch.float32
    assert torch.equal(ours["weight_scale_2"], s2.reshape(())), "global scale differs"


# ------------------------------------------------------------------------------ NVFP4 vs ModelOpt
@pytest.mark.parametrize("case", sorted(CASES))
def test_nvfp4_bit_exact(mo, case):
    w = CASES[case]()
    qt, s, s2 = mo_nvfp4(mo, w)
    ours = NVFP4().quantize(w)
    assert_nvfp4_equal(ours, qt, s, s2)
    # the plain-torch path (used on GPUs) gives the same bits
    p, sc = _nvfp4_torch(w.contiguous(), ours["weight_scale_2"], _MODELOPT, "")
    assert torch.equal(p.reshape(qt._quantized_data.shape), qt._quantized_data)
    assert torch.equal(sc.reshape(s.shape), _bits(s))


def test_nvfp4_medium_tensor_and_threads(mo):
    w = outliers(512, 3072, seed=7)
    qt, s, s2 = mo_nvfp4(mo, w)
    torch.set_num_threads(1)
    one = NVFP4().quantize(w)
    torch.set_num_threads(2)
    two = NVFP4().quantize(w)
    assert_nvfp4_equal(one, qt, s, s2)
    assert_nvfp4_equal(two, qt, s, s2)


def test_nvfp4_shared_global_scale(mo):
    """Fused gate/up: both quantized with weights_scaling_factor_2 = max(amax)/(6*448)."""
    gate, up = gaussian(64, 256, seed=11), gaussian(64, 256, seed=12, std=0.2)
    g = torch.maximum(amax(gate), amax(up))
    s2 = g / (6 * 448)
    for w in (gate, up):
        qt, s, s2_mo = mo_nvfp4(mo, w, s2)
        ours = NVFP4().quantize(w, global_amax=g)
        assert_nvfp4_equal(ours, qt, s, s2_mo)
    assert torch.equal(NVFP4().quantize(gate, global_amax=g)["weight_scale_2"],
                       NVFP4().quantize(up, global_amax=g)["weight_scale_2"])


@pytest.mark.parametrize("factor", [1e-6, 1e-3, 0.5, 10.0, 1e6])
def test_nvfp4_foreign_global_amax(mo, factor):
    """A global amax far above the tensor's (block scales clamp at 2^-9) or below it (block
    scales clamp at 448, values saturate at 6): same as ModelOpt given the same scale."""
    w = outliers(32, 128, seed=13)
    g = amax(w) / factor
    qt, s, s2 = mo_nvfp4(mo, w, g / (6 * 448))
    assert_nvfp4_equal(NVFP4().quantize(w, global_amax=g), qt, s, s2)


def test_nvfp4_stacked_experts(mo):
    w = torch.stack([gaussian(32, 128, seed=s) for s in range(3)])  # [E, out, in]
    qt, s, s2 = mo_nvfp4(mo, w)
    ours = NVFP4().quantize(w)
    assert ours["weight"].shape == (3, 32, 64) and ours["weight_scale"].shape == (3, 32, 8)
    assert_nvfp4_equal(ours, qt, s, s2)


def test_nvfp4_dequantize_matches_modelopt(mo):
    for w in (outliers(), zero_blocks(), subnormal()):
        qt, s, s2 = mo_nvfp4(mo, w)
        ref = qt.dequantize(dtype=torch.float32, scale=s, double_scale=s2, block_sizes={-1: 16})
        ours = NVFP4().dequantize(NVFP4().quantize(w), torch.float32)
        assert torch.equal(ours, ref)
        # and the explicit formula: e2m1(code) * fp32(scale) * s2 per block
        t = NVFP4().quantize(w)
        vals = E2M1_VALUES[unpack_e2m1(t["weight"]).long()].view(w.shape[0], -1, 16)
        formula = vals * (t["weight_scale"].float() * t["weight_scale_2"]).unsqueeze(-1)
        assert torch.equal(ours, formula.reshape(w.shape))
        assert NVFP4().dequantize(t, BF).dtype == BF


def test_nvfp4_all_zero_is_finite_where_modelopt_is_nan(mo):
    """ModelOpt divides 0/0 for an all-zero tensor (NaN scales, codes 6.0); we write a valid
    all-zero encoding: codes 0, block scales 1.0, weight_scale_2 = 1/2688."""
    w = torch.zeros(16, 64, dtype=BF)
    _, s, s2 = mo_nvfp4(mo, w)
    assert torch.isnan(s.float()).all() and float(s2) == 0.0
    t = NVFP4().quantize(w)
    assert int(t["weight"].max()) == 0
    assert (t["weight_scale"].float() == 1.0).all()
    assert float(t["weight_scale_2"]) == pytest.approx(1 / 2688)
    assert not NVFP4().dequantize(t).any()
    t2 = NVFP4().quantize(w, global_amax=torch.tensor(0.0))  # gate and up both zero
    assert torch.equal(t2["weight_scale_2"], t["weight_scale_2"])
    with pytest.raises(FormatError, match="not all zero"):
        NVFP4().quantize(gaussian(), global_amax=0.0, name="x.weight")


def test_nvfp4_input_scale():
    w = gaussian()
    t = NVFP4().quantize(w, input_amax=3.5)
    assert set(t) == {"weight", "weight_scale", "weight_scale_2", "input_scale"}
    assert t["input_scale"].shape == () and t["input_scale"].dtype == torch.float32
    assert torch.equal(t["input_scale"], torch.tensor(3.5, dtype=torch.float32) / 2688.0)
    assert "input_scale" not in NVFP4().quantize(w)
    with pytest.raises(FormatError, match="input_amax"):
        NVFP4().quantize(w, input_amax=0.0)
    with pytest.raises(FormatError, match="input_amax"):
        NVFP4().quantize(w, input_amax=float("nan"))


# ------------------------------------------------------------------------------ e2m1 rounding
def test_e2m1_rounding_formula_matches_modelopt_cast(mo):
    """The kernel's e2m1 rounding (_jit.e2m1_code) vs ModelOpt's own _cast_fp4 (searchsorted +
    odd-bound tie fix) on: every bf16 value, every fp32 within 4096 ulps of each bound and grid point, and
    random fp32 in [0, 8] and up to 1e38. (All fp32 in [0, 8.5] were checked once, offline.)"""
    allbf = torch.arange(0, 0x7F80, dtype=torch.int32).to(torch.int16).view(BF).float()
    pts = torch.cat([E2M1_BOUNDS, E2M1_VALUES[:8], torch.tensor([8.0])])
    near = (pts.view(torch.int32)[:, None] + torch.arange(-4096, 4097, dtype=torch.int32)).reshape(-1)
    near = near[near >= 0].view(torch.float32)
    g = torch.Generator().manual_seed(0)
    rnd = torch.cat([torch.rand(1 << 18, generator=g) * 8, torch.rand(1 << 14, generator=g) * 1e38])
    y = torch.cat([allbf, near, rnd]).contiguous()
    ref = mo[0]._cast_fp4(y.clone())
    assert torch.equal(_e2m1_codes_jit(y), ref)
    assert torch.equal(_e2m1_codes_jit(-y[y > 0]), ref[y > 0] + 8)
    assert torch.equal(_e2m1_codes_torch(y), ref)
    assert torch.equal(_e2m1_codes_torch(-y[y > 0]), ref[y > 0] + 8)


def _e2m1_codes_jit(y: torch.Tensor) -> torch.Tensor:
    codes = np.empty(y.numel(), np.uint8)
    _e2m1_each(y.contiguous().numpy(), codes)
    return torch.from_numpy(codes)


@numba.njit(cache=False)
def _e2m1_each(y, out):
    for i in range(y.size):
        out[i] = _jit.e2m1_code(y[i])


def test_e4m3_rounding_matches_torch_cast():
    """The kernels' e4m3 rounding on fp32 bit patterns (_jit.e4m3_bytes: block scales, MXFP8
    values) vs torch's cast, on every e4m3 value (subnormals and zero included), the midpoints
    between them and their fp32 neighbours, and random values over the whole range."""
    grid = torch.arange(256, dtype=torch.int32).to(U8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid) & (grid >= 0)].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    pts = torch.cat([grid, mids])
    near = (pts.view(torch.int32)[:, None] + torch.arange(-3, 4, dtype=torch.int32)).reshape(-1).view(torch.float32)
    g = torch.Generator().manual_seed(0)
    rnd = torch.exp2(torch.rand(1 << 16, generator=g) * 24 - 15)
    v = torch.cat([near[near >= 0], rnd]).clamp(0, 448).contiguous()
    ours = np.empty(v.numel(), np.uint8)
    _jit.e4m3_bytes(v.view(torch.int32).numpy().view(np.uint32), ours)
    assert torch.equal(torch.from_numpy(ours), v.to(torch.float8_e4m3fn).view(U8))


def test_e2m1_ties_round_half_to_even():
    y = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.01, 7.0, 100.0])
    assert _e2m1_codes_torch(y).tolist() == [0, 2, 2, 4, 4, 6, 6, 7, 7, 7]
    assert E2M1_VALUES[_e2m1_codes_torch(y).long()].tolist() == [0, 1, 1, 2, 2, 4, 4, 6, 6, 6]


def test_pack_unpack_nibble_order():
    codes = torch.tensor([[1, 2, 3, 15, 0, 8]], dtype=U8)
    packed = pack_e2m1(codes)
    assert packed.tolist() == [[0x21, 0xF3, 0x80]]           # element 2j in the low nibble
    assert torch.equal(unpack_e2m1(packed), codes)
    g = torch.Generator().manual_seed(0)
    c = torch.randint(0, 16, (7, 64), generator=g, dtype=torch.int32).to(U8)
    assert torch.equal(unpack_e2m1(pack_e2m1(c)), c)


def test_e2m1_values_table():
    assert E2M1_VALUES[:8].tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert torch.equal(E2M1_VALUES[8:], -E2M1_VALUES[:8])
    assert torch.signbit(E2M1_VALUES[8])                      # code 8 is -0.0


# ------------------------------------------------------------------------------ amax
def test_amax_exact():
    w = gaussian()
    w[3, 4] = -7.5                                            # the max is negative
    for t in (w, w.half(), w.float()):
        a = amax(t)
        assert a.dtype == torch.float32 and a.shape == ()
        assert float(a) == 7.5
    assert float(amax(torch.full((4, 16), -0.0, dtype=BF))) == 0.0
    assert float(amax(subnormal()[:32])) == float(subnormal()[:32].float().abs().max())
    big = outliers(300, 1024)                                 # several chunks
    assert float(amax(big)) == float(big.float().abs().max())
    for bad in (float("nan"), float("inf"), float("-inf")):
        w2 = gaussian()
        w2[1, 2] = bad
        with pytest.raises(FormatError, match="NaN or Inf") as e:
            amax(w2, "model.layers.0.mlp.experts.0.up_proj.weight")
        assert "up_proj" in str(e.value)


# ------------------------------------------------------------------------------ MXFP8 vs ModelOpt
@pytest.mark.parametrize("case", sorted(CASES))
def test_mxfp8_bit_exact(mo, case):
    w = CASES[case]()
    mq, ms = mo[1].quantize(w)
    ours = MXFP8().quantize(w)
    assert set(ours) == {"weight", "weight_scale"}
    assert ours["weight"].dtype == torch.float8_e4m3fn and ours["weight_scale"].dtype == U8
    assert torch.equal(_bits(ours["weight"]), _bits(mq._quantized_data))
    assert torch.equal(ours["weight_scale"], ms)
    q, e = _mxfp8_torch(w.contiguous(), "")
    assert torch.equal(_bits(q).reshape(w.shape), _bits(mq._quantized_data))
    assert torch.equal(e.reshape(ms.shape), ms)


def every_bf16_under_many_block_scales() -> torch.Tensor:
    """Every finite bf16 pattern, both signs, in blocks whose amax (column 0) sweeps the bf16
    exponent range, so each pattern is scaled by many e8m0 exponents (E from 0 to 247), zero,
    e4m3-subnormal and bf16-subnormal results included."""
    mags = torch.arange(0, 0x7F80, dtype=torch.int32)
    rows = []
    for le in list(range(1, 255, 6)) + [254]:
        for lm in (0, 0x3F, 0x7F):
            lead = (le << 7) | lm
            body = mags[mags <= lead]
            body = body | ((torch.arange(body.numel()) % 2) << 15)              # alternate signs
            body = torch.cat([body, torch.zeros(-body.numel() % 31, dtype=torch.int32)]).reshape(-1, 31)
            lead_sign = (torch.arange(body.shape[0]) % 3 == 0).int() << 15
            rows.append(torch.cat([(lead | lead_sign)[:, None], body], dim=1))
    return torch.cat(rows).to(torch.int16).view(BF)                          # [blocks, 32]


def test_mxfp8_every_bf16_pattern_under_many_scales(mo):
    w = every_bf16_under_many_block_scales()
    ours = MXFP8().quantize(w)
    q, e = _mxfp8_torch(w, "")
    assert torch.equal(_bits(ours["weight"]).reshape(-1), _bits(q))
    assert torch.equal(ours["weight_scale"].reshape(-1), e)
    assert int(e.min()) == 0 and int(e.max()) == 247           # the whole e8m0 range bf16 reaches
    mq, ms = mo[1].quantize(w)
    assert torch.equal(_bits(ours["weight"]), _bits(mq._quantized_data))
    assert torch.equal(ours["weight_scale"], ms)


def test_mxfp8_medium_tensor_and_threads(mo):
    w = outliers(512, 3072, seed=8)
    mq, ms = mo[1].quantize(w)
    for nt in (1, 2):
        torch.set_num_threads(nt)
        ours = MXFP8().quantize(w)
        assert torch.equal(_bits(ours["weight"]), _bits(mq._quantized_data))
        assert torch.equal(ours["weight_scale"], ms)


def test_mxfp8_dequantize_matches_modelopt(mo):
    for w in (outliers(), zero_blocks(), subnormal()):
        mq, ms = mo[1].quantize(w)
        ref = mq.dequantize(dtype=torch.float32, scale=ms)
        t = MXFP8().quantize(w)
        ours = MXFP8().dequantize(t, torch.float32)
        assert torch.equal(ours, ref)
        formula = (t["weight"].float().view(w.shape[0], -1, 32)
                   * torch.exp2(t["weight_scale"].float() - 127).unsqueeze(-1)).reshape(w.shape)
        assert torch.equal(ours, formula)


def random_mxfp8(rows=96, cols=4096 + 32 * 37, seed=9, e8_range=(0, 200)):
    """Stored MXFP8 tensors of every e4m3 byte but NaN under random e8m0 scales, 0 (a subnormal
    factor, 2^-127) included: what another producer's release may hold."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 255, (rows, cols), generator=g, dtype=torch.int32)
    q = torch.where((q & 0x7F) == 0x7F, q - 1, q).to(U8)
    e8 = torch.randint(*e8_range, (rows, cols // 32), generator=g, dtype=torch.int32).to(U8)
    e8[0, :4] = 0
    return {"weight": q.view(torch.float8_e4m3fn), "weight_scale": e8}


def release_cases():
    """MXFP8 stored tensors: ModelOpt-style quantized weights (multi-chunk and partial-chunk
    shapes among them) and random bytes and scales."""
    ws = [outliers(), zero_blocks(), subnormal(), underflow(), ties(), gaussian(333, 3072, seed=5),
          outliers(512, 3072, seed=7)]
    return [MXFP8().quantize(w) for w in ws] + [random_mxfp8()]


@pytest.mark.parametrize("threads", [1, 2])
def test_nvfp4_requantize_from_mxfp8_matches_modelopt(mo, threads):
    """NVFP4 of an MXFP8 release's weight, read from its bytes (the fused kernel), equals ModelOpt's
    NVFP4 of the dequantized weight, and our own quantize of it, bit for bit."""
    torch.set_num_threads(threads)
    for stored in release_cases():
        deq = MXFP8().dequantize(stored, torch.float32)
        ours = NVFP4().requantize(stored, MXFP8(), input_amax=3.5)
        assert_nvfp4_equal(ours, *mo_nvfp4(mo, deq))
        plain = NVFP4().quantize(deq, input_amax=3.5)
        assert all(torch.equal(_bits(ours[k]), _bits(plain[k])) for k in plain) and set(ours) == set(plain)


def test_requantize_on_other_devices_and_zeros_takes_the_plain_path():
    """The base path (dequantize, then quantize) gives the same bits, zeros included (where
    ModelOpt writes NaN scales, both write the finite all-zero encoding)."""
    from inkling_quant.formats.base import Format
    for stored in (random_mxfp8(rows=4, cols=256), MXFP8().quantize(torch.zeros(8, 64, dtype=BF))):
        fused = NVFP4().requantize(stored, MXFP8())
        plain = Format.requantize(NVFP4(), stored, MXFP8())
        assert all(torch.equal(_bits(fused[k]), _bits(plain[k])) for k in plain) and set(fused) == set(plain)


def test_mxfp8_amax_before_reading_finds_the_maximum_wherever_it_is():
    """The global amax NVFP4.requantize starts from reads only the blocks of the largest
    exponents; it must still be the exact maximum when a block of a smaller exponent holds it,
    and give up to a full read when no few blocks do (all zeros)."""
    from inkling_quant.formats.mxfp8 import amax_before_reading, stored_bytes
    lower_wins = random_mxfp8(rows=4, cols=256, e8_range=(100, 120))
    lower_wins["weight_scale"][0, 0] = 130                        # the largest exponent...
    lower_wins["weight"].view(U8)[0, :32] = 0x08                  # ...holds 2^-6 x 2^3 only
    lower_wins["weight_scale"][1, 2] = 129                        # the next one holds 448 x 2^2
    lower_wins["weight"].view(U8)[1, 64 + 5] = 0x7E
    many_levels = {"weight": torch.full((4, 256), 0x08, dtype=U8).view(torch.float8_e4m3fn),
                   "weight_scale": torch.full((4, 8), 100, dtype=U8)}  # past 4 exponents: read all
    many_levels["weight_scale"][0, :5] = torch.tensor([140, 139, 138, 137, 136], dtype=U8)
    many_levels["weight"].view(U8)[3, 7] = 0x7E
    many_levels["weight_scale"][3, 0] = 135
    for stored in release_cases() + [lower_wins, many_levels, MXFP8().quantize(torch.zeros(8, 64, dtype=BF)),
                                     random_mxfp8(seed=11)]:
        want = MXFP8().dequantize(stored, torch.float32).abs().amax()
        assert torch.equal(torch.tensor(amax_before_reading(*stored_bytes(stored)[:2])), want)
    assert float(MXFP8().amax(lower_wins)) == 448.0 * 4 and float(MXFP8().amax(many_levels)) == 448.0 * 2 ** 8
    hidden_nan = MXFP8().quantize(outliers())                     # a NaN byte in a block not read
    hidden_nan["weight"].view(U8)[40, 200] = 0x7F
    assert np.isfinite(amax_before_reading(*stored_bytes(hidden_nan)[:2]))
    with pytest.raises(FormatError, match="contains NaN or Inf"):  # the kernel reads every block
        NVFP4().requantize(hidden_nan, MXFP8())


def test_mxfp8_amax_and_all_finite_from_the_bytes():
    for stored in release_cases():
        deq = MXFP8().dequantize(stored, torch.float32)
        assert torch.equal(MXFP8().amax(stored), deq.abs().amax())
        assert MXFP8().all_finite(stored)
    nan_byte = random_mxfp8(rows=4, cols=256)
    nan_byte["weight"].view(U8)[2, 77] = 0xFF                     # -NaN
    inf_scale = random_mxfp8(rows=4, cols=256)
    inf_scale["weight_scale"][3, 1] = 255                         # a factor of 2^128: Inf
    overflow = random_mxfp8(rows=4, cols=256, e8_range=(250, 254))  # 448 * 2^127 is Inf in fp32
    for bad in (nan_byte, inf_scale, overflow):
        assert not MXFP8().all_finite(bad)
        assert not torch.isfinite(MXFP8().dequantize(bad)).all()
        with pytest.raises(FormatError, match="'experts.w13': contains NaN or Inf"):
            NVFP4().requantize(bad, MXFP8(), name="experts.w13")


def test_e8m0_integer_rule_on_every_bf16_and_fp16_amax(mo):
    """The kernel's integer ceil(log2(amax/448)) (mxfp8._e8m0_doc) equals ModelOpt's torch.log2
    form for every finite bf16 and fp16 block amax (all 32640 / 31744 patterns): one block per
    pattern, its amax that pattern."""
    for dt, top in ((BF, 0x7F80), (torch.float16, 0x7C00)):
        a = torch.arange(0, top, dtype=torch.int32).to(torch.int16).view(dt)
        ref = (mo[1]._compute_e8m0_exponent(a) + 127).to(U8)
        blocks = torch.zeros(a.numel(), 32, dtype=dt)
        blocks[:, 7] = a
        assert torch.equal(MXFP8().quantize(blocks)["weight_scale"].reshape(-1), ref)
        assert torch.equal(e8m0_exponent(a), ref)


def test_e8m0_follows_modelopt_not_ocp_floor(mo):
    """ModelOpt: E = ceil(log2(amax/448)) (nothing clips). OCP MX v1.0: floor(log2(amax)) - 8,
    which for these blocks is one lower and clips the block maximum at 448."""
    w = torch.zeros(2, 64)
    w[0, :32] = torch.linspace(-500.0, 500.0, 32)            # amax 500
    w[1, 32:] = torch.linspace(-1.9, 1.9, 32)                 # amax 1.9
    w[0, 32:] = torch.linspace(-1.0, 1.0, 32)                 # amax 1 (a power of two: both agree)
    w = w.to(BF)
    t = MXFP8().quantize(w)
    e = t["weight_scale"].int() - 127
    amaxes = torch.tensor([[500.0, 1.0], [0.0, 1.9]]).to(BF).float()
    ocp = torch.floor(torch.log2(amaxes)) - 8
    modelopt = torch.ceil(torch.log2(amaxes / 448))
    assert e[0].tolist() == [1, -8] and e[1, 1] == -7
    assert e[0, 0] == modelopt[0, 0] == ocp[0, 0] + 1
    assert e[1, 1] == modelopt[1, 1] == ocp[1, 1] + 1
    assert e[0, 1] == modelopt[0, 1] == ocp[0, 1]
    assert int(e[1, 0]) == -127                               # an all-zero block
    _, ms = mo[1].quantize(w)
    assert torch.equal(t["weight_scale"], ms)
    deq = MXFP8().dequantize(t)
    assert float(deq[0, :32].abs().max()) > 448               # OCP's scale would clip to 448


# ------------------------------------------------------------------------------ errors, specs
@pytest.mark.parametrize("fmt, shape", [(NVFP4(), (64, 250)), (NVFP4(), (64, 8)), (MXFP8(), (64, 48)),
                                        (MXFP8(), (64, 16))])
def test_bad_shape_raises(fmt, shape):
    w = torch.zeros(shape, dtype=BF)
    with pytest.raises(FormatError, match="divisible by") as e:
        fmt.quantize(w, name="model.layers.3.mlp.experts.1.down_proj.weight")
    assert "down_proj" in str(e.value) and str(shape[-1]) in str(e.value)
    with pytest.raises(FormatError):
        fmt.out_specs(shape, BF)


@pytest.mark.parametrize("fmt", [NVFP4(), MXFP8()])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [BF, torch.float32])
def test_nonfinite_raises(fmt, bad, dtype):
    w = gaussian(64, 256).to(dtype)
    w[40, 200] = bad
    with pytest.raises(FormatError, match="NaN or Inf") as e:
        fmt.quantize(w, name="model.layers.2.mlp.experts.5.gate_proj.weight")
    assert "gate_proj" in str(e.value)
    if fmt.name == "nvfp4":  # also when the global amax comes from elsewhere
        with pytest.raises(FormatError, match="NaN or Inf"):
            fmt.quantize(w, global_amax=torch.tensor(1.0))


def test_bad_global_amax_and_dtype():
    w = gaussian()
    with pytest.raises(FormatError, match="global_amax"):
        NVFP4().quantize(w, global_amax=float("inf"))
    with pytest.raises(FormatError, match="global_amax"):
        NVFP4().quantize(w, global_amax=torch.tensor(-1.0))
    with pytest.raises(FormatError, match="too small"):
        NVFP4().quantize(w, global_amax=1e-45)
    for fmt in (NVFP4(), MXFP8()):
        with pytest.raises(FormatError, match="bf16/fp16/fp32"):
            fmt.quantize(w.to(torch.float64))


def test_out_specs_match_quantize():
    w = gaussian(96, 64)
    for fmt, kw in ((NVFP4(), {"input_amax": 2.0}), (NVFP4(), {}), (MXFP8(), {}), (get_format("passthrough"), {})):
        t = fmt.quantize(w, **kw)
        specs = fmt.out_specs(tuple(w.shape), BF, activation_scale="input_amax" in kw)
        assert set(t) == set(specs)
        for k, spec in specs.items():
            assert tuple(t[k].shape) == spec.shape and t[k].dtype == spec.dtype, k
        nbytes = sum(x.numel() * x.element_size() for x in t.values())
        assert fmt.nbytes(tuple(w.shape), BF, "input_amax" in kw) == nbytes
    assert NVFP4().nbytes((3488, 3072)) == 3488 * 1536 + 3488 * 192 + 4 + 4


def test_layer_config_and_registry():
    assert NVFP4().layer_config() == {"quant_algo": "NVFP4", "group_size": 16}
    assert NVFP4().layer_config(weight_only=True) == {"quant_algo": "W4A16_NVFP4", "group_size": 16}
    assert MXFP8().layer_config() == {"quant_algo": "MXFP8", "group_size": 32}
    assert (FORMATS["nvfp4"].quant_algo, FORMATS["nvfp4"].block_size) == ("NVFP4", 16)
    assert (FORMATS["mxfp8"].quant_algo, FORMATS["mxfp8"].block_size) == ("MXFP8", 32)
    for f in (NVFP4(), MXFP8()):
        assert 0 < f.max_rel_error < 0.5 and 0.9 < f.min_cosine < 1


def test_thresholds_hold_on_synthetic_weights():
    """verify's thresholds pass realistic weights with room to spare, and fail a broken one."""
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(96, 64, generator=g) * 64 ** -0.5)
    w[7] *= 8
    w = w.to(BF)
    x = torch.randn(32, 64, generator=g).to(BF).double()
    ref = x @ w.double().T
    for fmt in (NVFP4(), MXFP8()):
        t = fmt.quantize(w)
        y = x @ fmt.dequantize(t).double().T
        rel = float((y - ref).norm() / ref.norm())
        cos = float((y * ref).sum() / (y.norm() * ref.norm()))
        assert rel < fmt.max_rel_error / 1.3 and cos > 1 - (1 - fmt.min_cosine) / 1.3
        if fmt.name == "nvfp4":   # swap the nibbles: the check must fail
            t["weight"] = (t["weight"] >> 4) | (t["weight"] << 4)
        else:                     # scales off by one power of two
            t["weight_scale"] = t["weight_scale"] + 1
        y = x @ fmt.dequantize(t).double().T
        assert float((y - ref).norm() / ref.norm()) > fmt.max_rel_error


def test_input_not_modified_and_noncontiguous():
    w = outliers()
    before = w.clone()
    a = NVFP4().quantize(w.t().contiguous().t().contiguous())
    b = NVFP4().quantize(w)
    assert torch.equal(w, before)
    assert torch.equal(a["weight"], b["weight"])
    wt = outliers(256, 64).t()                                 # non-contiguous view
    assert torch.equal(NVFP4().quantize(wt)["weight"], NVFP4().quantize(wt.contiguous())["weight"])
    assert torch.equal(_bits(MXFP8().quantize(wt)["weight"]), _bits(MXFP8().quantize(wt.contiguous())["weight"]))


def test_import_does_not_load_modelopt():
    code = ("import sys, inkling_quant.formats as f; f.FORMATS['nvfp4'].quantize(__import__('torch').zeros(2, 16)); "
            "assert not [m for m in sys.modules if m.startswith('modelopt')], 'modelopt imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


# ------------------------------------------------------------------------------ 2-D blocks, fp8_block
FP8B = FP8Block()


def random_fp8_block(shape, seed=0, scale_range=(1e-4, 1e-2)):
    """Stored fp8_block tensors: every e4m3 byte but NaN, positive fp32 scales on the ceil grid."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 255, shape, generator=g, dtype=torch.int32)
    q = torch.where((q & 0x7F) == 0x7F, q - 1, q).to(U8)
    grid = (*shape[:-2], -(-shape[-2] // 128), -(-shape[-1] // 128))
    lo, hi = scale_range
    s = (torch.rand(grid, generator=g, dtype=torch.float64) * (hi - lo) + lo).float()
    return {"weight": q.view(torch.float8_e4m3fn), "weight_scale_inv": s}


def fp8_block_reference(t, dtype=torch.float32):
    """Independent plain-torch dequantization: each scale repeated over its 128x128 tile, the grid
    cropped to the weight, one fp32 multiply (DeepSeek-V3 inference/kernel.py weight_dequant)."""
    w, s = t["weight"], t["weight_scale_inv"]
    m, n = w.shape[-2:]
    full = s.repeat_interleave(128, dim=-2).repeat_interleave(128, dim=-1)[..., :m, :n]
    return (w.to(torch.float32) * full).to(dtype)


def test_block_shape_contract():
    """Every format says which elements one scale covers; block_size stays its cols."""
    want = {"nvfp4": (1, 16), "mxfp8": (1, 32), "passthrough": (1, 1)}
    assert {n: f.block_shape for n, f in FORMATS.items()} == want
    assert FP8B.block_shape == (128, 128) and FP8B.partial_tiles and FP8B.source_only
    for f in (*FORMATS.values(), FP8B):
        assert f.block_size == f.block_shape[1]
        assert f.row_blocked == (f.block_shape[0] == 1)
    assert all(f.row_blocked and not f.partial_tiles and not f.source_only for f in FORMATS.values())
    assert not FP8B.row_blocked
    assert NVFP4().scale_shape((3, 64, 96)) == (3, 64, 6) and MXFP8().scale_shape((64, 96)) == (64, 3)
    for shape, grid in (((300, 200), (3, 2)), ((256, 384), (2, 3)), ((1, 1), (1, 1)), ((129, 257), (2, 3)),
                        ((2, 130, 140), (2, 2, 2)), ((0, 128), (0, 1))):
        assert FP8B.scale_shape(shape) == grid
        assert FP8B.out_specs(shape)["weight_scale_inv"].shape == grid
        assert FP8B.out_specs(shape)["weight"].shape == shape


def test_two_d_blocks_without_partial_tiles_check_both_dims():
    """A 2-D format that does not take partial tiles refuses a shape either dim of which its block
    does not divide, naming the tensor; block_size alone (an older subclass) still means (1, n)."""
    class Tiles(Format):
        name, quant_algo, block_shape = "tiles", None, (4, 8)

    class Old(Format):
        name, quant_algo, block_size = "old", None, 64

    t = Tiles()
    assert t.block_size == 8 and not t.row_blocked and t.scale_shape((8, 16)) == (2, 2)
    for shape in ((6, 16), (8, 12), (16,)):
        with pytest.raises(FormatError, match="4x8") as e:
            t.check_shape(shape, "model.layers.0.mlp.experts.3.gate_proj.weight")
        assert "experts.3.gate_proj" in str(e.value) and e.value.tensor.endswith("gate_proj.weight")
    assert Old().block_shape == (1, 64) and Old().row_blocked
    with pytest.raises(TypeError, match="block_size"):
        type("Bad", (Format,), {"name": "bad", "block_shape": (1, 16), "block_size": 32})


def test_fp8_block_shape_errors_name_the_tensor():
    name = "model.layers.5.mlp.experts.7.down_proj.weight"
    with pytest.raises(FormatError, match="two dimensions") as e:
        FP8B.quantize(torch.zeros(256, dtype=BF), name=name)
    assert e.value.tensor == name
    stored = random_fp8_block((300, 200))
    for bad in (torch.zeros(2, 2), torch.zeros(3, 3), torch.zeros(3, 2, dtype=torch.float64),
                torch.zeros(3, 2, dtype=U8)):
        with pytest.raises(FormatError, match=r"needs float32 \(3, 2\)") as e:
            FP8B.check_stored({**stored, "weight_scale_inv": bad}, name)
        assert e.value.tensor == "model.layers.5.mlp.experts.7.down_proj.weight_scale_inv"
        with pytest.raises(FormatError, match="needs float32"):
            FP8B.dequantize({**stored, "weight_scale_inv": bad})
    with pytest.raises(FormatError, match="float8_e4m3fn"):
        FP8B.dequantize({**stored, "weight": stored["weight"].float()})
    with pytest.raises(FormatError, match="weight_scale_inv"):
        FP8B.dequantize({"weight": stored["weight"]})


@pytest.mark.parametrize("shape", [(300, 200), (256, 384), (128, 128), (1, 1), (129, 257), (2, 130, 140)])
def test_fp8_block_dequantize_matches_plain_torch_reference(shape):
    t = random_fp8_block(shape, seed=sum(shape))
    assert torch.equal(FP8B.dequantize(t), fp8_block_reference(t))
    assert FP8B.dequantize(t).dtype == torch.float32
    assert torch.equal(FP8B.dequantize(t, BF), fp8_block_reference(t, BF))
    as_bytes = {**t, "weight": t["weight"].view(U8)}                     # a uint8 view reads the same
    assert torch.equal(FP8B.dequantize(as_bytes), fp8_block_reference(t))


def test_fp8_block_quantize_rule():
    """Per tile s = fp32(amax) / 448, values e4m3(w / s); an all-zero tile takes 1.0, a
    deep-subnormal one the smallest invertible scale; partial edge tiles count only their elements."""
    w = outliers(300, 200).float()
    w[128:256, 128:] = 0                                                  # a zero (partial) tile
    w[256:, :128] = 1e-40                                                 # a subnormal-only tile
    t = FP8B.quantize(w.to(BF), name="x.weight")
    s, q = t["weight_scale_inv"], t["weight"]
    wb = w.to(BF).float()
    for i in range(3):
        for j in range(2):
            tile = wb[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            a = tile.abs().max()
            want = torch.tensor(1.0) if a == 0 else torch.maximum(a / 448.0, torch.tensor(MIN_INVERTIBLE_SCALE))
            assert torch.equal(s[i, j], want), (i, j)
            assert torch.equal(_bits(q[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]),
                               _bits((tile / want).to(torch.float8_e4m3fn)))
    assert float(s[1, 1]) == 1.0 and float(s[2, 0]) == MIN_INVERTIBLE_SCALE and invertible(float(s.min()))
    FP8B.check_stored(t, "x.weight")
    g = gaussian(384, 256).float()
    rel = float((FP8B.dequantize(FP8B.quantize(g)) - g).norm() / g.norm())
    assert rel < 0.05
    with pytest.raises(FormatError, match="NaN or Inf"):
        FP8B.quantize(torch.full((4, 4), float("inf")), name="x.weight")


def test_fp8_block_amax_and_all_finite_exact_on_stored_bytes():
    for shape in ((300, 200), (129, 257), (2, 130, 140)):
        t = random_fp8_block(shape, seed=3)
        t["weight_scale_inv"].view(-1)[0] = -t["weight_scale_inv"].view(-1)[0]   # |scale| counts
        assert torch.equal(FP8B.amax(t), FP8B.dequantize(t).abs().amax()) and FP8B.all_finite(t)
    assert float(FP8B.amax({"weight": torch.zeros(0, 5, dtype=torch.float8_e4m3fn),
                            "weight_scale_inv": torch.zeros(0, 1)})) == 0.0
    base = random_fp8_block((300, 200), seed=4)
    nan_byte, neg_nan = ({**base, "weight": base["weight"].clone()} for _ in range(2))
    nan_byte["weight"].view(U8)[299, 199] = 0x7F                         # in a partial edge tile
    neg_nan["weight"].view(U8)[0, 0] = 0xFF
    inf_scale = {**base, "weight_scale_inv": base["weight_scale_inv"].clone()}
    inf_scale["weight_scale_inv"][1, 0] = float("inf")                  # 0 x Inf: NaN
    inf_no_zero = {"weight": torch.full((130, 5), 0x38, dtype=U8).view(torch.float8_e4m3fn),
                   "weight_scale_inv": torch.tensor([[1.0], [float("-inf")]])}  # Inf, no NaN
    overflow = {**base, "weight_scale_inv": torch.full((3, 2), 1e37)}
    for bad in (nan_byte, neg_nan, inf_scale, inf_no_zero, overflow):
        assert not FP8B.all_finite(bad) and not torch.isfinite(FP8B.dequantize(bad)).all()
        got, want = FP8B.amax(bad), FP8B.dequantize(bad).abs().amax()
        assert bool(got.isnan() & want.isnan()) or torch.equal(got, want)
    assert float(FP8B.amax(inf_no_zero)) == float("inf")


def test_fp8_block_check_stored_refuses_bad_bytes_and_scales():
    name, sname = "model.layers.1.mlp.experts.2.up_proj.weight", "model.layers.1.mlp.experts.2.up_proj.weight_scale_inv"
    FP8B.check_stored(random_fp8_block((300, 200)), name)
    for byte in (0x7F, 0xFF):
        t = random_fp8_block((300, 200))
        t["weight"].view(U8)[200, 150] = byte
        with pytest.raises(FormatError, match=r"NaN e4m3 byte.*\(200, 150\)") as e:
            FP8B.check_stored(t, name)
        assert e.value.tensor == name
    for v in (float("nan"), float("inf"), float("-inf"), 0.0, -0.0, -1e-3):
        t = random_fp8_block((300, 200))
        t["weight_scale_inv"][2, 1] = v
        with pytest.raises(FormatError, match=r"not finite and > 0.*tile \(2, 1\)") as e:
            FP8B.check_stored(t, name)
        assert e.value.tensor == sname and "up_proj.weight_scale_inv" in str(e.value)
    with pytest.raises(FormatError, match="fp32 range") as e:
        FP8B.check_stored({**random_fp8_block((300, 200)), "weight_scale_inv": torch.full((3, 2), 1e37)}, name)
    assert e.value.tensor == name


def test_fp8_block_is_a_source_format_only():
    """Registered apart: nothing that iterates FORMATS (schemes, detect, value rules, suffixes,
    quant_algo lookups) sees it."""
    from inkling_quant.export import value_rules
    from inkling_quant.formats import SCALE_SUFFIXES, detect, format_for_quant_algo
    assert set(FORMATS) == {"nvfp4", "mxfp8", "passthrough"} and set(SOURCE_FORMATS) == {"fp8_block", "mxfp4", "mxfp4_rows"}
    assert isinstance(SOURCE_FORMATS["fp8_block"], FP8Block)
    assert get_format("fp8_block", source=True) is SOURCE_FORMATS["fp8_block"]
    assert get_format("nvfp4", source=True) is FORMATS["nvfp4"]
    with pytest.raises(KeyError, match="unknown format 'fp8_block'"):
        get_format("fp8_block")
    assert "weight_scale_inv" not in SCALE_SUFFIXES and value_rules("weight_scale_inv") == set()
    assert format_for_quant_algo("FP8_PB_WO") is None and format_for_quant_algo("fp8_pb_wo") is None
    # written only as it is stored, in ModelOpt's FP8_PB_WO form (its exporter's spelling, no config_groups bits)
    assert isinstance(format_for_quant_algo("FP8_PB_WO", source=True), FP8Block)
    assert FP8B.quant_algo == "fp8_pb_wo" and FP8B.layer_config() == {"quant_algo": "fp8_pb_wo"}
    t = random_fp8_block((256, 128))
    observed = {k: (tuple(v.shape), v.dtype) for k, v in t.items()}
    assert detect(observed, (256, 128), BF) is None and FP8B.matches(observed, (256, 128), BF)
    assert FP8B.value_rule("weight_scale_inv") == "positive"
    assert FP8B.config_group_bits() is None


def test_config_group_bits_are_exports_table():
    """(weight bits, activation bits) per quant_algo, ModelOpt's config_groups (ModelOpt 0.47
    export/convert_hf_config.py:23-118): the formats answer it, export.modelopt asks them."""
    table = {a: f.config_group_bits(a) for f in FORMATS.values() for a in f.quant_algos}
    assert table == {"NVFP4": (4, 4), "W4A16_NVFP4": (4, None), "MXFP8": (8, 8)}
    assert NVFP4().config_group_bits() == (4, 4) and MXFP8().config_group_bits() == (8, 8)
    with pytest.raises(KeyError, match="nvfp4 has no config_groups entry for quant_algo 'MXFP8'"):
        NVFP4().config_group_bits("MXFP8")
    with pytest.raises(KeyError):
        FORMATS["passthrough"].config_group_bits()


def test_transcode_registry_lookup():
    """One home for format-to-format fast paths, keyed by (source, target) names; nvfp4.py no
    longer knows mxfp8.py."""
    import ast
    from pathlib import Path

    import inkling_quant.formats.nvfp4 as nv_module
    assert transcode.TRANSCODERS is TRANSCODERS
    assert TRANSCODERS[("mxfp8", "nvfp4")] is transcode.nvfp4_from_mxfp8
    assert transcode.find(MXFP8(), NVFP4()) is transcode.find("mxfp8", "nvfp4") is transcode.nvfp4_from_mxfp8
    assert transcode.find("mxfp4", "mxfp8") is None and transcode.find("nvfp4", "mxfp8") is None
    # DeepSeek-V4's per-expert MXFP4 holds gpt-oss's bits: one cast for both
    assert transcode.find("mxfp4_rows", "nvfp4") is transcode.find("mxfp4", "nvfp4") is transcode.nvfp4_from_mxfp4
    tree = ast.parse(Path(nv_module.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "mxfp8" not in imported and "requantize" not in NVFP4.__dict__
    with pytest.raises(ValueError, match="registered already"):
        transcode.transcoder("mxfp8", "nvfp4")(lambda *a, **k: None)


def test_requantize_takes_a_registered_fast_path_and_falls_back(monkeypatch):
    """Format.requantize asks TRANSCODERS first; a path that declines (None), or no path, gives
    quantize(source.dequantize(...)) bit for bit; the registered MXFP8 -> NVFP4 path equals it."""
    calls = []

    def spy(tensors, source, target, *, global_amax=None, input_amax=None, name="", encoder="modelopt", parts=None):
        calls.append((source.name, target.name, input_amax, name))
        return {"weight": torch.zeros(1)}

    monkeypatch.setitem(TRANSCODERS, ("fp8_block", "mxfp8"), spy)
    stored = FP8B.quantize(outliers(300, 256))
    assert MXFP8().requantize(stored, FP8B, input_amax=2.0, name="m.weight")["weight"].shape == (1,)
    assert calls == [("fp8_block", "mxfp8", 2.0, "m.weight")]
    monkeypatch.setitem(TRANSCODERS, ("fp8_block", "mxfp8"), lambda *a, **k: None)   # declines
    for target in (MXFP8(), NVFP4()):                                  # declined, and none registered
        got = target.requantize(stored, FP8B, input_amax=3.5)
        want = target.quantize(FP8B.dequantize(stored), input_amax=3.5)
        assert set(got) == set(want) and all(torch.equal(_bits(got[k]), _bits(want[k])) for k in want)
    for stored in (random_mxfp8(rows=8, cols=512), MXFP8().quantize(outliers())):
        fast = NVFP4().requantize(stored, MXFP8(), input_amax=3.5)
        plain = NVFP4().quantize(MXFP8().dequantize(stored), input_amax=3.5)
        assert set(fast) == set(plain) and all(torch.equal(_bits(fast[k]), _bits(plain[k])) for k in plain)


# ------------------------------------------------------------------------------ source formats: bf16 scales, mxfp4
def test_fp8_block_reads_bf16_scales_and_writes_modelopt_fp8_pb_wo():
    """Qwen3's FP8 releases store weight_scale_inv in bf16: it widens exactly. ModelOpt's FP8_PB_WO
    form (its 0.47 exporter: `weight` + fp32 `weight_scale` [gm, 1, gn, 1]) keeps the bytes."""
    t = random_fp8_block((300, 200), seed=5)
    half = {**t, "weight_scale_inv": t["weight_scale_inv"].to(BF)}
    assert torch.equal(FP8B.dequantize(half), fp8_block_reference({**t, "weight_scale_inv": half["weight_scale_inv"].float()}))
    FP8B.check_stored(half, "m.weight")
    mo = FP8B.modelopt_tensors(half)
    assert torch.equal(_bits(mo["weight"]), _bits(t["weight"])) and mo["weight_scale"].dtype == torch.float32
    assert mo["weight_scale"].shape == (3, 1, 2, 1) and torch.equal(mo["weight_scale"].reshape(3, 2),
                                                                    half["weight_scale_inv"].float())
    assert {k: (tuple(o.shape), o.dtype) for k, o in FP8B.modelopt_specs((300, 200)).items()} == \
        {"weight": ((300, 200), torch.float8_e4m3fn), "weight_scale": ((3, 1, 2, 1), torch.float32)}
    observed = {k: (tuple(v.shape), v.dtype) for k, v in half.items()}
    assert FP8B.matches(observed, (300, 200), BF)


def _modelopt_mxfp4():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from modelopt.torch.export.shard_cast_utils import (dequantize_mxfp4_to_bf16, mxfp4_kmax,
                                                            quantize_mxfp4_to_nvfp4_lossless)
        from modelopt.torch.quantization.qtensor import MXFP4QTensor
    return MXFP4QTensor, dequantize_mxfp4_to_bf16, mxfp4_kmax, quantize_mxfp4_to_nvfp4_lossless


def test_mxfp4_quantize_and_dequantize_are_modelopts():
    """MXFP4.quantize is ModelOpt 0.47's MXFP4QTensor.quantize bit for bit (zeros as code 8, ties
    down); dequantize is exact, equal to ModelOpt's and transformers' decoders."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    MXFP4QTensor, deq, _, _ = _modelopt_mxfp4()
    fmt = get_format("mxfp4", source=True)
    w = outliers(64, 256)
    w[3, :32] = 0
    w[5, 32:64] *= 2.0 ** -60
    q, e8 = MXFP4QTensor.quantize(w, 32)
    st = fmt.quantize(w)
    assert st["weight"].shape == (64, 8, 16) and st["weight_scale"].shape == (64, 8)
    assert torch.equal(st["weight"].reshape(-1), q._quantized_data.reshape(-1))
    assert torch.equal(st["weight_scale"].reshape(-1), e8.reshape(-1))
    x = fmt.dequantize(st)
    assert torch.equal(x.to(BF), deq(st["weight"].reshape(64, 128), st["weight_scale"], "cpu"))
    tf = convert_moe_packed_tensors(st["weight"][None], st["weight_scale"][None], dtype=torch.float32)[0]
    assert torch.equal(x, tf.T) and torch.equal(fmt.amax(st), x.abs().amax())
    assert fmt.weight_shape({"weight": (4, 64, 8, 16), "weight_scale": (4, 64, 8)}) == (4, 64, 256)


def test_mxfp4_check_stored_names_the_scale():
    fmt = get_format("mxfp4", source=True)
    st = fmt.quantize(outliers(64, 256))
    bad = {**st, "weight_scale": st["weight_scale"].clone()}
    bad["weight_scale"][2, 3] = 255
    with pytest.raises(FormatError, match=r"255 \(NaN\).*\(2, 3\)") as e:
        fmt.check_stored(bad, "x_blocks", {"weight_scale": "x_scales"})
    assert e.value.tensor == "x_scales"
    big = {**st, "weight_scale": torch.full_like(st["weight_scale"], 254)}
    with pytest.raises(FormatError, match="fp32 range"):
        fmt.check_stored(big, "x_blocks")
    with pytest.raises(FormatError, match="do not match"):
        fmt.dequantize({**st, "weight_scale": st["weight_scale"][:, :3]})


@pytest.mark.parametrize("case", ["gaussian", "out_of_window", "zero_e8m0", "scale_one"])
def test_nvfp4_from_mxfp4_is_modelopts_lossless_cast(case):
    """The MXFP4 -> NVFP4 transcoder is ModelOpt 0.47's quantize_mxfp4_to_nvfp4_lossless bit for
    bit (k_max of the slab; in-window blocks' codes verbatim, -0 to +0; the rest re-rounded),
    and reports its block counts; the release's encoder takes the plain path."""
    MXFP4QTensor, _, kmax, lossless = _modelopt_mxfp4()
    fmt = get_format("mxfp4", source=True)
    w = outliers(96, 512).float()
    if case == "out_of_window":
        w[3, :32] *= 2.0 ** -30
        w[7, 64:96] *= 2.0 ** -19
    st = fmt.quantize(w.to(BF))
    if case == "zero_e8m0":
        st["weight_scale"][0, 0] = 0
    if case == "scale_one":
        st["weight_scale"][1, 1] = 1
    got = NVFP4().requantize(st, fmt, input_amax=3.5)
    q, sc, s2, nb, nl = lossless(st["weight"].reshape(96, 256), st["weight_scale"], kmax(st["weight_scale"]), "cpu")
    assert torch.equal(got["weight"], q) and torch.equal(_bits(got["weight_scale"]), _bits(sc))
    assert torch.equal(got["weight_scale_2"], s2) and (int(got["mxfp4_blocks"]), int(got["mxfp4_lossless_blocks"])) == (nb, nl)
    assert torch.equal(got["input_scale"], NVFP4().quantize(w[:1, :16], input_amax=3.5)["input_scale"])
    assert (nl < nb) == (case in ("out_of_window", "scale_one"))
    plain = NVFP4().quantize(fmt.dequantize(st), encoder="release")
    rel = NVFP4().requantize(st, fmt, encoder="release")
    assert all(torch.equal(_bits(rel[k]), _bits(plain[k])) for k in plain)


@pytest.mark.parametrize("shape", [(300, 256), (130, 160), (256, 384)])
def test_fp8_block_transcoders_equal_dequantize_then_quantize(shape):
    """The FP8 block -> NVFP4 / MXFP8 fast paths (by table from the bytes, never an fp32 copy)
    are bit for bit quantize(dequantize(...)), with the weight's own or a shared global amax,
    for both encoders, on every e4m3 byte under scales spanning 60 binades (subnormal values)."""
    assert transcode.find("fp8_block", "nvfp4") is transcode.nvfp4_from_fp8_block
    assert transcode.find("fp8_block", "mxfp8") is transcode.mxfp8_from_fp8_block
    st = random_fp8_block(shape, seed=sum(shape), scale_range=(0.0, 1.0))
    st["weight_scale_inv"] = torch.exp2(st["weight_scale_inv"] * 60 - 45)
    x = FP8B.dequantize(st)
    g = x.abs().amax() * 1.5
    cases = [(NVFP4(), dict(input_amax=3.5)), (NVFP4(), dict(global_amax=g)), (NVFP4(), dict(encoder="release")),
             (NVFP4(), dict(global_amax=g, encoder="release")), (MXFP8(), {}), (MXFP8(), dict(encoder="release"))]
    for target, kw in cases:
        fast, plain = target.requantize(st, FP8B, **kw), target.quantize(x, **kw)
        assert set(fast) == set(plain) and all(torch.equal(_bits(fast[k]), _bits(plain[k])) for k in plain), (target.name, kw)
    bad = {**st, "weight": st["weight"].clone()}
    bad["weight"].view(U8)[5, 7] = 0x7F
    for target in (NVFP4(), MXFP8()):
        with pytest.raises(FormatError, match="NaN or Inf") as e:
            target.requantize(bad, FP8B, name="m.weight")
        assert e.value.tensor == "m.weight"


def fp8_weight_of_many_block_maxima(rows, cols, seed=0):
    """An FP8 block-scaled weight as DeepSeek's weight_quant makes one (FP8B.quantize) of a
    Gaussian whose 16-blocks are scaled by 2^U(-10, 0), with outlier rows, all-zero 16-blocks and
    an all-zero row: each 128x128 tile then holds dozens of distinct block maxima."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g)
    w *= torch.exp2(-10 * torch.rand(rows, cols // 16, 1, generator=g)).expand(-1, -1, 16).reshape(rows, cols)
    w[torch.randint(0, rows, (3,), generator=g)] *= 30
    w.view(rows, cols // 16, 16)[torch.rand(rows, cols // 16, generator=g) < 0.02] = 0
    w[rows // 2] = 0
    return FP8B.quantize(w)


@pytest.mark.parametrize("threads", [1, 2])
def test_fp8_block_transcoder_tables_match_modelopt(mo, threads):
    """The FP8 -> NVFP4 / MXFP8 paths code each element by a table per (tile, block maximum byte);
    on weights with many block maxima per tile (more tables in one band than one encoder batch
    holds: 32 tile columns), zero blocks, -0 bytes and edge tiles of 2 rows and 16 (NVFP4) or 32
    columns, they equal ModelOpt's NVFP4 and MXFP8 of the exactly dequantized weight and the plain
    path, both NVFP4 encoders, the weight's own or a shared global amax."""
    torch.set_num_threads(threads)
    for shape in ((258, 4096), (130, 400), (130, 416)):
        st = fp8_weight_of_many_block_maxima(*shape, seed=shape[1])
        st["weight"].view(U8)[1, :64] = 0x80   # -0 bytes: code 0 under ModelOpt's sign rule, 8 under the release's
        x = FP8B.dequantize(st)
        shared = x.abs().amax() * 1.25
        ours = NVFP4().requantize(st, FP8B, input_amax=3.5)
        assert_nvfp4_equal(ours, *mo_nvfp4(mo, x))
        assert_nvfp4_equal(NVFP4().requantize(st, FP8B, global_amax=shared),
                           *mo_nvfp4(mo, x, (shared / (6.0 * 448.0)).float()))
        for kw in (dict(encoder="release"), dict(global_amax=shared, encoder="release")):
            fast, plain = NVFP4().requantize(st, FP8B, **kw), NVFP4().quantize(x, **kw)
            assert set(fast) == set(plain) and all(torch.equal(_bits(fast[k]), _bits(plain[k])) for k in plain), kw
        if shape[1] % 32:
            continue   # MXFP8 takes whole 32-blocks
        mq, ms = mo[1].quantize(x)
        mx = MXFP8().requantize(st, FP8B)
        assert torch.equal(_bits(mx["weight"]), _bits(mq._quantized_data)) and torch.equal(mx["weight_scale"], ms)
        per_tile = (st["weight"].view(U8)[:128, :128] & 0x7F).reshape(128, 8, 16).amax(-1)
        assert len(torch.unique(per_tile)) > 40   # many tables in one tile


def test_fp8_block_transcoders_refuse_overflow_and_keep_release_amax_of_zeros():
    """A tile whose values overflow fp32 once scaled (448 x 1e36) is refused as NaN/Inf with a
    caller-given global amax too (the plain path refuses it); an all-zero weight's release
    weight_amax is 1, as the plain path writes it; an empty weight gives the plain path's."""
    st = {"weight": torch.zeros(128, 128, dtype=U8), "weight_scale_inv": torch.full((1, 1), 1e36)}
    st["weight"][3, 5] = 0x7E
    st["weight"] = st["weight"].view(torch.float8_e4m3fn)
    for kw in (dict(global_amax=3.0), dict(global_amax=3.0, encoder="release"), {}):
        with pytest.raises(FormatError, match="NaN or Inf") as e:
            NVFP4().requantize(st, FP8B, name="m.weight", **kw)
        assert e.value.tensor == "m.weight"
        with pytest.raises(FormatError, match="NaN or Inf"):
            NVFP4().quantize(FP8B.dequantize(st), **kw)
    zeros = {"weight": torch.zeros(130, 160, dtype=U8).view(torch.float8_e4m3fn),
             "weight_scale_inv": torch.full((2, 2), 0.5)}
    stored_zeros = [(FP8B, zeros), (MXFP8(), MXFP8().quantize(torch.zeros(4, 64, dtype=BF)))]
    for shape in ((0, 128), (128, 0)):
        empty = {"weight": torch.zeros(shape, dtype=U8).view(torch.float8_e4m3fn),
                 "weight_scale_inv": torch.ones(FP8B.scale_shape(shape))}
        for target in (NVFP4(), MXFP8()):
            fast, plain = target.requantize(empty, FP8B), target.quantize(FP8B.dequantize(empty))
            assert {k: (v.shape, v.dtype) for k, v in fast.items()} == {k: (v.shape, v.dtype) for k, v in plain.items()}
    for src, stored in stored_zeros:
        fast = NVFP4().requantize(stored, src, encoder="release")
        plain = NVFP4().quantize(src.dequantize(stored), encoder="release")
        assert float(plain["weight_amax"]) == 1.0
        assert set(fast) == set(plain) and all(torch.equal(_bits(fast[k]), _bits(plain[k])) for k in plain), src.name
