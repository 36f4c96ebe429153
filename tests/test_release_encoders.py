"""The release encoders (`encoder="release"`: NVFP4 `nvfp4_nearest` with `amax_denominator`
scales, MXFP8 `mxfp8_nearest` with `ue8m0` scales) held bit for bit to the independent reference
in tests/release_reference.py, which is written only from the documented text (NeMo AutoModel /
Megatron-Bridge; transformers 5.25's `Inkling2LoopDequantizeExperts` decodes the same bytes).

Three kinds of test: the reference checked against definitions and torch's own E4M3 cast (so a
shared misreading would have to get past those too); our encoders against the reference on random
and adversarial inputs (ties at every E2M1 and E4M3 midpoint, saturation, signed zeros, zero and
subnormal block scales, extreme magnitudes, several chunks on 1 and 2 threads, refusals); and the
documented fixed point on "released" tensors, decoded by transformers' own decoder.
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import release_reference as R
from inkling_quant.errors import FormatError
from inkling_quant.formats import FORMATS
from inkling_quant.formats.nvfp4 import RELEASE_DENOMINATOR

BF, F16, F32 = torch.bfloat16, torch.float16, torch.float32
DTYPES = (BF, F16, F32)
DEN = R.DENOMINATOR
E2M1_MIDS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
E4M3_MIDS = (R.E4M3_MAGNITUDES[:-1] + R.E4M3_MAGNITUDES[1:]) / 2  # 126 midpoints, 2**-10 .. 440


@pytest.fixture(autouse=True)
def _two_threads():
    """2 torch threads (the chunked CPU encoder then runs 2 workers) unless a test says otherwise;
    the caller's setting is restored."""
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(n)


# ------------------------------------------------------------------------------ helpers
def ours_nvfp4(w, amax=None, **kw):
    if amax is not None and not isinstance(amax, torch.Tensor):
        amax = torch.tensor(amax, dtype=F32)
    return FORMATS["nvfp4"].quantize(w, global_amax=amax, encoder="release", **kw)


def ours_mxfp8(w):
    return FORMATS["mxfp8"].quantize(w, encoder="release")


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def assert_same_bytes(got: torch.Tensor, want: torch.Tensor, what: str, w: torch.Tensor | None = None, per: int = 1):
    """Equal dtype, shape and bytes; otherwise say how many differ and show the first (with the
    input block it came from, `per` input columns per output column block)."""
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    g, x = _u8(got.cpu()), _u8(want)
    bad = (g != x).nonzero()
    if len(bad):
        i = tuple(bad[0].tolist())
        msg = f"{what}: {len(bad)} of {x.numel()} bytes differ; first at {i}: ours {g[i].item():#04x}, reference {x[i].item():#04x}"
        if w is not None:
            c = i[-1] * per
            block = w[i[:-1]].float()[c - c % 16 if per <= 16 else c: c + max(per, 16)]
            msg += f"; input near it: {block.tolist()}"
        raise AssertionError(msg)


def check_nvfp4(w: torch.Tensor, amax=None):
    """Ours against the reference on `w` (amax: the caller's, fp32, or None): codes, block
    scales, the amax used and weight_scale_2 = fp32(amax / 2688); returns (ours, reference)."""
    ref_w, ref_s, ref_a = R.nvfp4_nearest(w, amax)
    q = ours_nvfp4(w, amax)
    assert_same_bytes(q["weight"], ref_w, "NVFP4 codes", w, per=2)
    assert_same_bytes(q["weight_scale"], ref_s, "NVFP4 block scales", w, per=16)
    # for amax 0 (the all-zero tensor) the project's zero-tensor convention of docs/formats.md:
    # amax 1 and weight_scale_2 1/2688, "as if the amax were 1" (a global scale with a finite
    # reciprocal; the decoded values are 0 either way, the block scales being 0)
    want_a = ref_a if ref_a != 0 else torch.tensor(1.0)
    got_a = q["weight_amax"]
    assert got_a.dtype == F32 and got_a.dim() == 0, (got_a.dtype, got_a.shape)
    assert torch.equal(got_a.cpu().view(torch.int32), want_a.view(torch.int32)), (got_a, ref_a)
    s2 = q["weight_scale_2"]
    assert s2.dtype == F32 and s2.dim() == 0
    want_s2 = want_a / torch.tensor(DEN, dtype=F32)
    assert torch.equal(s2.cpu(), want_s2), (s2, ref_a)
    return q, (ref_w, ref_s, ref_a)


def check_mxfp8(w: torch.Tensor):
    ref_v, ref_s = R.mxfp8_nearest(w)
    q = ours_mxfp8(w)
    assert_same_bytes(q["weight_scale"], ref_s, "MXFP8 scales", w, per=32)
    assert_same_bytes(q["weight"], ref_v, "MXFP8 values", w)
    return q, (ref_v, ref_s)


def same_outcome(fn_ours, fn_ref):
    """Both refuse with FormatError, or both return; returns (ours, reference) or None."""
    try:
        ref = fn_ref()
    except FormatError:
        with pytest.raises(FormatError):
            fn_ours()
        return None
    return fn_ours(), ref


def gaussian_outliers(shape, dtype=BF, seed=0, std=0.02):
    """Gaussian weights with outliers: a few elements x60, one row x300 and a few big singles."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g) * std
    flat = w.view(-1)
    flat[torch.randint(0, flat.numel(), (max(1, flat.numel() // 200),), generator=g)] *= 60.0
    w.view(-1, shape[-1])[1] *= 300.0
    flat[7] = 2.5
    flat[-3] = -4.0
    return w.to(dtype)


def exact(values, dtype) -> torch.Tensor:
    """float64 values as a `dtype` tensor, asserting that none was rounded."""
    t64 = torch.tensor(np.asarray(values, dtype=np.float64))
    t = t64.to(dtype)
    assert torch.equal(t.double(), t64), "constructed value not exact in " + str(dtype)
    return t


def step(t: torch.Tensor, up: bool) -> torch.Tensor:
    """The next representable value of t's dtype above (or below)."""
    return torch.nextafter(t, torch.full_like(t, float("inf") if up else float("-inf")))


# ------------------------------------------------------------------------------ adversarial inputs
def nvfp4_e2m1_ties(dtype, mult: int = 1) -> torch.Tensor:
    """amax = 2688 * mult (1 or 3) sits in the tensor; each row j has blocks whose bmax is
    6 * 2**j * mult, so the block scale is exactly 2**j (e4m3 subnormal for j < -6), d = 2**j *
    mult and w / d lands exactly on every E2M1 midpoint (+ and -), one step of the dtype either
    side of it, on -0.0, and (a negative below 0.25 d) on a negative rounding to zero."""
    amax = DEN * mult
    rows = []
    for j in range(-9, 9):
        d = 2.0**j * mult
        mids = exact(E2M1_MIDS * d, dtype)
        up, down = step(mids, True).double().tolist(), step(mids, False).double().tolist()
        m = mids.double().tolist()
        neg = lambda v: [-x for x in v]
        b1 = [6 * d, *m, *neg(m), -0.0]
        b2 = [-6 * d, *up, *down, 0.0]
        b3 = [6 * d, *neg(up), *neg(down), -0.125 * d]
        b4 = [amax] + [0.0] * 15
        rows.append(torch.tensor([b1 + b2 + b3 + b4], dtype=torch.float64).to(dtype))
    w = torch.cat(rows)
    assert w.float().abs().max().item() == amax
    return w


def nvfp4_scale_ties(dtype, min_t: float = 0.0) -> torch.Tensor:
    """amax = 2688 (first block; fp32(den / amax) = 1): one block per E4M3 midpoint t >= min_t
    (2**-10 .. 440), bmax = 6 t, so the block scale is exactly halfway between two E4M3 values;
    then blocks whose bmax is one dtype step either side of 6 t; zero-filled to whole rows."""
    fill = np.array([0.31, -0.26, 0.74, -1.26, 1.74, -2.51, 3.49, -4.99, 5.01, -0.0, 0.0, -5.9, 2.2, -0.05, 1e-3])
    bmax = exact(6 * E4M3_MIDS[E4M3_MIDS >= min_t], dtype)
    blocks = [torch.tensor([DEN] + [0.0] * 15, dtype=torch.float64)]
    for b in (bmax, step(bmax, True), step(bmax, False)):
        for i, t in enumerate(b.double().tolist()):
            sign = -1.0 if i % 3 == 0 else 1.0
            blocks.append(torch.tensor([sign * t, *(fill * t / 6)], dtype=torch.float64))
    blocks += [torch.zeros(16, dtype=torch.float64)] * ((-len(blocks)) % 8)
    return torch.stack(blocks).reshape(-1, 64).to(dtype)


def rows_to(t: torch.Tensor, n: int) -> torch.Tensor:
    """The first n rows of a 2-D tensor, zero rows added if it has fewer."""
    if t.shape[0] < n:
        t = torch.cat([t, torch.zeros(n - t.shape[0], t.shape[1], dtype=t.dtype)])
    return t[:n]


def nvfp4_subnormal_sweep(dtype, seed=5) -> torch.Tensor:
    """amax 1; blocks whose bmax falls from 1 to 1e-8 in steps of 10**(1/8): their scales
    (448 * bmax) run through the normal, the subnormal (2**-9 .. 2**-6) and the zero E4M3 range."""
    g = torch.Generator().manual_seed(seed)
    k = torch.arange(65, dtype=torch.float64)
    bmax = 10.0 ** (-k / 8)
    x = torch.rand(65, 16, generator=g, dtype=torch.float64) * 2 - 1
    x[:, 3] = 1.0
    x = x / x.abs().amax(-1, keepdim=True) * bmax[:, None]
    x[::2] *= -1
    w = torch.cat([x.reshape(-1), torch.zeros(16 * 3)]).reshape(-1, 64)
    w[0, 0] = 1.0
    return w.to(dtype)


def mxfp8_ties(dtype, ks=(-120, -20, 0, 7, 20, 100)) -> torch.Tensor:
    """Blocks with bmax 448 * 2**k (so s = k): the rest of each block are every E4M3 midpoint
    (times 2**k, both signs), a dtype step either side of them, -0.0 and a negative rounding to
    zero (-2**-11 * 2**k)."""
    rows = []
    for k in ks:
        sc = 2.0**k
        mids = torch.tensor(E4M3_MIDS * sc).to(dtype)
        up, down = step(mids, True), step(mids, False)
        vals = torch.cat([mids, -mids, up, -down, down, -up]).double()
        vals = torch.cat([vals, torch.tensor([-0.0, -(2.0**-11) * sc, 0.0, 2.0**-10 * sc])])
        n = len(vals)
        per = 31
        nblk = -(-n // per)
        vals = torch.cat([vals, torch.zeros(nblk * per - n, dtype=torch.float64)]).reshape(nblk, per)
        head = torch.full((nblk, 1), 448.0 * sc, dtype=torch.float64)
        head[1::2] *= -1
        rows.append(torch.cat([head, vals], 1).reshape(-1))
    flat = torch.cat(rows)
    pad = (-flat.numel()) % 128
    return torch.cat([flat, torch.zeros(pad, dtype=torch.float64)]).reshape(-1, 128).to(dtype)


def _ulps(x: np.ndarray, k) -> np.ndarray:
    """Positive fp32 values moved k units in the last place."""
    return (np.asarray(x, dtype=np.float32).view(np.int32) + np.asarray(k, dtype=np.int32)).view(np.float32)


def nvfp4_near_ties(seed: int):
    """(w fp32 [16, 128], amax) for an amax drawn log-uniformly from 1e-20..1e20 (so fp32(den /
    amax) and d are not powers of two): 24 blocks whose w / d lands within 2 fp32 ulps of every
    E2M1 midpoint for a random normal block scale, and 8 whose bmax / 6 * den / amax lands within
    2 ulps of a random E4M3 midpoint. Here the order of the fp32 operations decides the bytes."""
    rng = np.random.default_rng(seed)
    f = np.float32
    amax = f(10.0 ** rng.uniform(-20, 20))
    blocks = []
    for _ in range(24):
        bs = f(R.E4M3_MAGNITUDES[rng.integers(8, 127)])
        d = (bs * amax) / f(DEN)
        near = _ulps(E2M1_MIDS.astype(f) * d, rng.integers(-2, 3, 14).reshape(2, 7)).reshape(-1)
        near *= rng.choice(np.array([-1, 1], dtype=f), 14)
        blocks.append(np.concatenate([[f(6) * d], near, [f(rng.uniform(-5, 5)) * d]]).astype(f))
    for _ in range(8):
        b = rng.integers(8, 126)
        mid = (R.E4M3_MAGNITUDES[b] + R.E4M3_MAGNITUDES[b + 1]) / 2
        bmax = _ulps(f(6 * mid * float(amax) / DEN), rng.integers(-2, 3))
        blocks.append(np.concatenate([[bmax], rng.uniform(-1, 1, 15).astype(f) * bmax]).astype(f))
    w = np.stack(blocks).reshape(-1, 128)
    return torch.from_numpy(np.concatenate([w, w[::-1] * f(0.75)])), torch.tensor(amax)


MXFP8_RATIOS = (447.0, 448.0, 448.5, 449.0, 452.0, 456.0, 460.0, 463.0, 464.0, 465.0, 232.0, 240.0, 300.0, 100.0)


def mxfp8_edges(dtype, ks=(-100, -9, 0, 3, 40)) -> torch.Tensor:
    """Blocks whose bmax / 2**k is each of MXFP8_RATIOS (the (448, 464] band, 464 itself, and
    around it), bmax one fp32 step above 448 * 2**k and 464 * 2**k and below, all-zero blocks
    and blocks of -0.0; fill: a Gaussian times bmax / 3."""
    g = torch.Generator().manual_seed(11)
    bm = []
    for k in ks:
        r = torch.tensor(MXFP8_RATIOS, dtype=F32) * 2.0**k
        extra = torch.tensor([448.0, 464.0], dtype=F32) * 2.0**k
        bm += [r, step(extra, True), step(extra, False)]
    bmax = torch.cat(bm).to(dtype).double()
    x = torch.randn(len(bmax), 32, generator=g, dtype=torch.float64).clamp(-2.9, 2.9) * bmax[:, None] / 3
    x[:, 5] = bmax
    x[1::3, 5] *= -1
    zeros = torch.zeros(4, 32, dtype=torch.float64)
    zeros[1] = -0.0
    zeros[2, ::3] = -0.0
    x = torch.cat([x, zeros])
    pad = (-x.shape[0]) % 4
    x = torch.cat([x, torch.zeros(pad, 32, dtype=torch.float64)])
    return x.reshape(-1, 128).to(dtype)


# ============================================================================== the reference itself
def test_reference_e4m3_rounding_is_torchs_cast():
    """The reference's E4M3 rounding (written from the definition) equals torch's fp32 ->
    float8_e4m3fn cast on every grid value, every midpoint, an fp32 step either side, 2**-10
    and random values up to 448; and its byte table equals torch's decoding of the bytes."""
    mids = torch.tensor(E4M3_MIDS, dtype=F32)
    g = torch.Generator().manual_seed(0)
    xs = torch.cat([torch.tensor(R.E4M3_MAGNITUDES, dtype=F32), mids, step(mids, True), step(mids, False),
                    torch.rand(20000, generator=g) * 448, torch.rand(5000, generator=g) * 0.03,
                    torch.tensor([0.0, 2.0**-10, 2.0**-11, 3 * 2.0**-11, 1e-30, 1e-45])])
    xs = xs[xs <= 448]
    ours = torch.from_numpy(R.e4m3_byte(xs.numpy()).astype(np.uint8))
    torchs = xs.to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(ours, torchs), xs[ours != torchs][:5]
    table = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).float().double().numpy()
    assert np.array_equal(R.E4M3_MAGNITUDES, table)
    # beyond 448 (MXFP8 only): up to 464 rounds to 448, ties to even
    assert R.e4m3_byte(np.array([448.0, 456.0, 463.99997, 464.0], dtype=np.float32)).tolist() == [126] * 4


def test_reference_e2m1_rounding_ties_to_even_and_saturates():
    """The documented E2M1 table: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4 (ties
    to the even mantissa), an fp32 step off a midpoint goes to the near side, and large values
    (inf too) saturate at 6."""
    mids = E2M1_MIDS.astype(np.float32)
    vals = lambda c: R.E2M1_MAGNITUDES[R.e2m1_code(c)].tolist()
    assert vals(mids) == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert vals(np.nextafter(mids, np.float32(np.inf))) == [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert vals(np.nextafter(mids, np.float32(0))) == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0]
    assert vals(np.array([0.0, 6.0, 6.5, 7.0, 1e30, np.inf], dtype=np.float32)) == [0.0] + [6.0] * 5


def test_reference_mxfp8_exponent_is_the_smallest_exact_one():
    """The frexp form of "the smallest s with bmax / 2**s <= 464" equals counting up from -127
    in exact binary64 arithmetic, at the edges (448, 464, an fp32 step around them, powers of
    two) and on random magnitudes, and is clamped to -127 for tiny blocks."""
    g = torch.Generator().manual_seed(1)
    edges = torch.tensor([448.0, 464.0, 232.0, 240.0, 1.0, 0.5, 2.0, 3.0], dtype=F32)
    base = torch.cat([edges * 2.0**k for k in (-130, -60, -9, -1, 0, 1, 9, 60, 119)])
    base = base[torch.isfinite(base) & (base > 0)]
    cand = torch.cat([base, step(base, True), step(base, False), torch.exp(torch.randn(300, generator=g) * 30),
                      torch.tensor([torch.finfo(F32).max, torch.finfo(F32).tiny, 1e-45])]).float()
    cand = cand[torch.isfinite(cand) & (cand > 0)]
    fast = R.mxfp8_exponent(cand.numpy())
    slow = [R.mxfp8_exponent_by_search(v) for v in cand.double().tolist()]
    assert fast.tolist() == slow
    assert R.mxfp8_exponent(np.array([464.0, np.nextafter(np.float32(464), np.float32(1e9)), 0.0, 1e-40],
                                     dtype=np.float32)).tolist() == [0, 1, -127, -127]


def test_reference_nvfp4_adversarial_inputs_hit_their_targets():
    """The adversarial NVFP4 inputs really are adversarial: the tie tensor's blocks decode to the
    documented E2M1 tie results (with -0.0 and the small negative as code 8), and the scale-tie
    tensor's pre-rounding block scales land exactly on all 126 E4M3 midpoints."""
    for dtype in DTYPES:
        w = nvfp4_e2m1_ties(dtype)
        codes = R.unpack_e2m1(R.nvfp4_nearest(w)[0])
        expect_b1 = [7, 0, 2, 2, 4, 4, 6, 6, 8, 10, 10, 12, 12, 14, 14, 8]
        for row in codes:
            assert row[:16].tolist() == expect_b1
            assert row[47] == 8  # -0.125 d rounds to -0
        sw = nvfp4_scale_ties(dtype)
        pre = R.nvfp4_block_scale_prescale(R.widen(sw), np.float32(DEN)).reshape(-1).astype(np.float64)
        assert np.isin(E4M3_MIDS, pre).all(), dtype


def test_reference_mxfp8_adversarial_inputs_hit_their_targets():
    """The MXFP8 tie tensor puts w / 2**s exactly on every E4M3 midpoint, and the edge tensor has
    blocks with bmax / 2**s in (448, 464] and exactly 464."""
    x = R.widen(mxfp8_ties(F32)).reshape(-1, 32)
    s = R.mxfp8_exponent(np.abs(x).max(-1))
    y = np.abs(x / np.ldexp(np.float32(1), s)[:, None]).astype(np.float64)
    assert np.isin(E4M3_MIDS, y).all()
    e = R.widen(mxfp8_edges(F32)).reshape(-1, 32)
    bmax = np.abs(e).max(-1).astype(np.float64)
    ratio = bmax / np.ldexp(1.0, R.mxfp8_exponent(bmax))
    assert ((ratio > 448) & (ratio < 464)).sum() >= 20 and (ratio == 464).sum() >= 5


def test_transformers_decoder_agrees_with_the_reference_decoders():
    """transformers 5.25's Inkling2LoopDequantizeExperts (fp32 target) gives bit for bit the
    reference decoders' values, `(e2m1 * bs) * (amax / den)` and `e4m3 * 2**(scale - 127)`, on
    stacked released experts (signed zeros included)."""
    experts = [gaussian_outliers((32, 128), BF, seed=s) for s in range(3)] + [rows_to(nvfp4_e2m1_ties(F32).repeat(1, 2), 32)]
    enc = [R.nvfp4_nearest(w) for w in experts]
    packed, scale, amax = (torch.stack([e[i] for e in enc]) for i in range(3))
    hf = R.hf_decode_nvfp4(packed, scale, amax, torch.full((len(enc),), DEN))
    ours = torch.stack([R.decode_nvfp4(*e) for e in enc])
    assert hf.dtype == F32 and torch.equal(hf.view(torch.int32), ours.view(torch.int32))
    assert (torch.signbit(hf) & (hf == 0)).any()  # -0.0 survives decoding
    mx = torch.stack([gaussian_outliers((32, 128), BF, seed=s) for s in range(2)] + [rows_to(mxfp8_edges(BF), 32)])
    v, s = R.mxfp8_nearest(mx)
    hf = R.hf_decode_mxfp8(v, s)
    assert torch.equal(hf.view(torch.int32), R.decode_mxfp8(v, s).view(torch.int32))


def test_reference_fixed_point_on_released_tensors():
    """The documented fixed point holds for the reference itself: encode (the 'release'),
    decode with transformers, re-encode with the released amax, same bytes (both formats)."""
    ws = [gaussian_outliers((64, 256), BF, seed=3), nvfp4_e2m1_ties(F16).repeat(1, 4)[:, :256].repeat(4, 1)[:64]]
    for w in ws:
        p, s, a = R.nvfp4_nearest(w)
        dec = R.hf_decode_nvfp4(p[None], s[None], a[None], torch.tensor([DEN]))[0]
        p2, s2, a2 = R.nvfp4_nearest(dec, a)
        assert torch.equal(p2, p) and torch.equal(s2.view(torch.uint8), s.view(torch.uint8)) and a2 == a
    v, s = R.mxfp8_nearest(mxfp8_ties(BF)[None])
    v2, s2 = R.mxfp8_nearest(R.hf_decode_mxfp8(v, s))
    assert torch.equal(v2.view(torch.uint8), v.view(torch.uint8)) and torch.equal(s2, s)


# ============================================================================== our encoders: NVFP4
def test_release_denominator_is_6_times_448():
    """The released per-tensor denominator we write is 2688 = 6 * 448 (the amax block gets 448)."""
    assert RELEASE_DENOMINATOR == DEN == 6 * 448


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(64, 256), (3, 40, 160), (2, 2, 8, 64)])
def test_nvfp4_random_weights_match_reference(dtype, shape):
    """Gaussian weights with outliers, any leading dims, each input dtype: bytes, scales, amax
    and weight_scale_2 equal the reference's."""
    check_nvfp4(gaussian_outliers(shape, dtype, seed=len(shape)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mult", [1, 3])
def test_nvfp4_e2m1_midpoints_round_to_even(dtype, mult):
    """Every E2M1 midpoint (and a dtype step either side), for block scales from 2**-9
    (subnormal) to 2**8, with d a power of two or 3 times one: ties go to the even code, and
    -0.0 and small negatives are code 8, as in the reference."""
    check_nvfp4(nvfp4_e2m1_ties(dtype, mult))


@pytest.mark.parametrize("dtype", DTYPES)
def test_nvfp4_block_scale_e4m3_midpoints_round_to_even(dtype):
    """Block scales exactly on every E4M3 midpoint (2**-10 included: it rounds to 0) and a dtype
    step either side of each."""
    check_nvfp4(nvfp4_scale_ties(dtype))


def test_nvfp4_near_ties_follow_the_documented_operation_order():
    """Within 2 fp32 ulps of E2M1 and E4M3 midpoints, for 40 amaxes that make fp32(den / amax)
    and d inexact, ours equals the reference evaluated left to right (bmax / 6 first, then
    * fp32(den / amax); d = fp32(bs * amax) / den): any other order shows here."""
    for seed in range(40):
        w, amax = nvfp4_near_ties(seed)
        check_nvfp4(w, amax)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nvfp4_subnormal_and_zero_block_scales(dtype):
    """Blocks 1 to 1e-8 times the amax: normal, subnormal and zero E4M3 block scales (a zero
    scale gives codes 0 / 8 by sign, OUR choice) match the reference."""
    w = nvfp4_subnormal_sweep(dtype)
    _, (_, s, _) = check_nvfp4(w)
    sb = s.view(torch.uint8)
    assert ((sb > 0) & (sb < 8)).any() and (sb == 0).any()  # the sweep reaches both


@pytest.mark.parametrize("factor", [0.25, 0.999, 1.0, 4.0])
def test_nvfp4_caller_amax_saturates_or_shrinks(factor):
    """A caller amax below the tensor max saturates block scales at 448 and codes at 6; equal to
    it or above it scales down; weight_amax reports the caller's value."""
    w = gaussian_outliers((32, 256), BF, seed=9)
    amax = torch.tensor(w.float().abs().max().item() * factor, dtype=F32)
    q, (_, s, _) = check_nvfp4(w, amax)
    assert torch.equal(q["weight_amax"], amax)
    if factor == 0.25:
        assert (s.view(torch.uint8) == 126).sum() > 1 and (R.unpack_e2m1(q["weight"]) % 8 == 7).sum() > 1


def test_nvfp4_amax_exactly_at_a_block_max():
    """The amax block gets scale 448 exactly (bmax / 6 * 2688 / amax); a caller amax equal to a
    smaller block's max saturates every block above that one."""
    w = gaussian_outliers((16, 128), F32, seed=4)
    q, (_, s, _) = check_nvfp4(w)
    bmax = w.abs().reshape(16, 8, 16).amax(-1)
    top = (bmax == bmax.max()).nonzero()[0].tolist()
    assert s.view(torch.uint8)[top[0], top[1]] == 126
    mid = torch.tensor(bmax.flatten().sort().values[64].item(), dtype=F32)
    check_nvfp4(w, mid)


def test_nvfp4_zeros_and_negative_zeros():
    """All-zero tensor (amax 0, OUR choice: scale bytes 0, codes 0 / 8 by sign, amax stored as 1),
    and all-zero or -0.0 blocks inside a normal tensor."""
    z = torch.zeros(8, 64, dtype=BF)
    z[1] = -0.0
    z[2, ::3] = -0.0
    q, (p, s, a) = check_nvfp4(z)
    assert a == 0 and (s.view(torch.uint8) == 0).all()
    assert (R.unpack_e2m1(p)[1] == 8).all() and (R.unpack_e2m1(p)[0] == 0).all()
    w = gaussian_outliers((8, 64), BF, seed=2)
    w[0, :16] = 0
    w[1, 16:32] = -0.0
    w[2, :] = -0.0
    w[3, 5] = -0.0
    check_nvfp4(w)


@pytest.mark.parametrize("case", ["fp32_tiny", "fp32_huge", "bf16_tiny", "bf16_subnormals", "fp16_extremes"])
def test_nvfp4_extreme_magnitudes(case):
    """Tiny (amax near the refusal limit, where amax / den is an fp32 subnormal) and huge (near
    448 * amax overflowing) tensors; bf16 subnormals inside a normal tensor; fp16 max and its
    subnormals: the same bytes, or the same refusal, as the reference."""
    g = torch.Generator().manual_seed(7)
    base = torch.randn(16, 64, generator=g).clamp(-3.9, 3.9)
    base[0, 0] = 4.0
    w = {"fp32_tiny": base * 3e-36, "fp32_huge": base * 1e35, "bf16_tiny": (base * 1e-30).to(BF),
         "bf16_subnormals": torch.where(base.abs() < 1, base * 1e-39, base).to(BF),
         "fp16_extremes": torch.where(base.abs() < 1, base * 1e-7, base * 20000).clamp(-65504, 65504).to(F16)}[case]
    if case == "fp16_extremes":
        w[0, 0] = 65504.0
    out = same_outcome(lambda: ours_nvfp4(w), lambda: R.nvfp4_nearest(w))
    assert out is not None  # none of these is out of range
    check_nvfp4(w)


def test_nvfp4_amax_range_limits_refuse_exactly_where_the_reference_does():
    """Around the smallest amax whose fp32(2688 / amax) is finite and the largest whose
    fp32(448 * amax) is: a few fp32 steps either side, ours refuses (FormatError) exactly where
    the reference does and otherwise matches it (below the smallest amax both write the all-zero
    weight); too-large tensors are refused."""
    fmax = torch.finfo(F32).max
    lo = torch.tensor(DEN / fmax, dtype=F32)
    hi = torch.tensor(fmax / 448, dtype=F32)
    w = (torch.randn(4, 32, generator=torch.Generator().manual_seed(8)) * 1e-37).float()
    outcomes = []
    for centre in (lo, hi):
        a = centre.clone()
        near = [a]
        for _ in range(3):
            near = [step(near[0], False)] + near + [step(near[-1], True)]
        for amax in near:
            r = same_outcome(lambda: ours_nvfp4(w, amax), lambda: R.nvfp4_nearest(w, amax))
            outcomes.append(r is None)
            if r is not None:
                check_nvfp4(w, amax)
    assert any(outcomes) and not all(outcomes)  # the limits were straddled
    # 2688 / amax overflows: below NVFP4's smallest amax, so the all-zero weight (formats/nvfp4.py
    # "Below the smallest amax"), as the reference writes it too
    q, _ = check_nvfp4(torch.full((2, 16), 1e-37))
    assert not bool(q["weight"].any()) and not bool(q["weight_scale"].view(torch.uint8).any())
    with pytest.raises(FormatError):
        ours_nvfp4(torch.full((2, 16), 3.0e38, dtype=BF))  # bf16 near its max: 448 * amax overflows
    with pytest.raises(FormatError):
        ours_nvfp4(gaussian_outliers((2, 32), F32), torch.tensor(1e37))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_and_inf_are_refused_by_both_formats(bad, dtype):
    """NaN or +-Inf anywhere in the weight: FormatError from both release encoders."""
    w = gaussian_outliers((4, 64), dtype)
    w[2, 37] = bad
    with pytest.raises(FormatError):
        ours_nvfp4(w)
    with pytest.raises(FormatError):
        ours_nvfp4(w, torch.tensor(1.0))
    with pytest.raises(FormatError):
        ours_mxfp8(w)


def test_nvfp4_input_amax_adds_input_scale_without_touching_the_weight():
    """With input_amax, the result also holds input_scale; the weight tensors are unchanged."""
    w = gaussian_outliers((16, 64), BF, seed=12)
    q = ours_nvfp4(w, input_amax=torch.tensor(3.5))
    plain, _ = check_nvfp4(w)
    assert "input_scale" in q and "input_scale" not in plain
    for k in ("weight", "weight_scale", "weight_amax", "weight_scale_2"):
        assert torch.equal(_u8(q[k]), _u8(plain[k])), k


# ============================================================================== our encoders: MXFP8
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(64, 256), (3, 40, 160), (2, 2, 8, 64)])
def test_mxfp8_random_weights_match_reference(dtype, shape):
    """Gaussian weights with outliers, any leading dims, each input dtype: values and ue8m0
    scales equal the reference's."""
    check_mxfp8(gaussian_outliers(shape, dtype, seed=len(shape) + 20))


@pytest.mark.parametrize("dtype", DTYPES)
def test_mxfp8_e4m3_midpoints_round_to_even_keeping_signs(dtype):
    """w / 2**s on every E4M3 midpoint (subnormal ones and 2**-10 included), a step either
    side, both signs, -0.0 and negatives rounding to zero (byte 0x80), for several s."""
    ks = (-10, 0, 7) if dtype == F16 else (-120, -20, 0, 7, 20, 100)
    q, (v, _) = check_mxfp8(mxfp8_ties(dtype, ks))
    assert (v.view(torch.uint8) == 0x80).any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_mxfp8_blocks_between_448_and_464_keep_the_smaller_scale(dtype):
    """bmax / 2**s in (448, 464] and exactly 464 (it rounds to 448), an fp32 step around 448 and
    464, all-zero and -0.0 blocks (scale byte 0, OUR choice)."""
    ks = (-9, 0, 3) if dtype == F16 else (-100, -9, 0, 3, 40)
    q, (v, s) = check_mxfp8(mxfp8_edges(dtype, ks))
    assert (s == 0).any()


def test_mxfp8_extreme_magnitudes():
    """Near the max and the smallest subnormal of bf16, fp16 and fp32 (s = 120 at the top; tiny
    blocks clamp to s = -127 and lose their low values), and an all-zero tensor."""
    for dtype in DTYPES:
        fi = torch.finfo(dtype)
        vals = torch.tensor([fi.max, -fi.max, fi.max / 3, fi.tiny, fi.smallest_normal, fi.tiny * 2 ** -5], dtype=F32)
        vals = torch.cat([vals, vals * 0.77]).to(dtype)
        w = torch.zeros(4, 64, dtype=dtype)
        w[0, :12] = vals
        w[1, 32:44] = fi.tiny  # a block of the smallest normal
        sub = torch.tensor(2.0 ** -133 if dtype == BF else (2.0 ** -24 if dtype == F16 else 2.0 ** -149))
        w[2, :8] = sub.to(dtype)
        w[2, 8] = -sub.to(dtype)
        w[3, 40:] = step(torch.full((24,), float(fi.max), dtype=dtype), False)
        check_mxfp8(w)
    z = torch.zeros(3, 64, dtype=BF)
    z[1, 1::2] = -0.0
    _, (v, s) = check_mxfp8(z)
    assert (s == 0).all() and (v.view(torch.uint8)[1, 1::2] == 0x80).all()


# ============================================================================== chunks and threads
@pytest.mark.parametrize("threads", [1, 2])
def test_several_chunks_with_a_partial_last_one(threads):
    """Tensors spanning several encoder chunks (4096 NVFP4 / 2048 MXFP8 blocks) with a partial
    last chunk, and a row split across a chunk boundary, on 1 and 2 threads."""
    torch.set_num_threads(threads)  # the autouse fixture restores it
    w = gaussian_outliers((3, 100, 784), BF, seed=30)  # 14700 NVFP4 blocks: 3 chunks + 2412
    w[1, 50:60] = 0
    w[2, 3, :16] = -0.0
    check_nvfp4(w)
    check_nvfp4(w, torch.tensor(0.5))
    m = gaussian_outliers((3, 100, 736), F16, seed=31)  # 6900 MXFP8 blocks: 3 chunks + 756
    m[0, 99, 32:64] = 0
    m[2, 7, 64:96] = torch.tensor(456.0 * 2**-8, dtype=F16)
    check_mxfp8(m)


# ============================================================================== fixed point
def _released_nvfp4_experts():
    """Stacked experts 'released' by the reference, each with its own amax (Gaussian bf16 with
    outliers, the E2M1-tie and E4M3-scale-tie tensors, zero blocks, a saturating caller amax)."""
    gw = gaussian_outliers((4, 32, 128), BF, seed=40)
    ex = [gw[0], gw[1], rows_to(nvfp4_e2m1_ties(BF).repeat(1, 2), 32),
          rows_to(nvfp4_scale_ties(F32, min_t=3 * 2.0**-9).reshape(-1, 128), 32), gw[2].clone(), gw[3]]
    ex[4][3:9] = 0
    ex[4][10, ::5] = -0.0
    amaxes = [None, None, None, None, None, gw[3].float().abs().max() / 3]
    enc = [R.nvfp4_nearest(w.float(), a) for w, a in zip(ex, amaxes)]
    return tuple(torch.stack([e[i] for e in enc]) for i in range(3))


def test_nvfp4_fixed_point_through_transformers_decoder():
    """Released NVFP4 experts, decoded by transformers' own decoder (fp32) and re-encoded by ours
    with the released amax, give back the released codes and scales bit for bit (the documented
    fixed point; code 8 for -0.0 is what makes it hold)."""
    packed, scale, amax = _released_nvfp4_experts()
    decoded = R.hf_decode_nvfp4(packed, scale, amax, torch.full((len(amax),), DEN))
    for e in range(len(amax)):
        q = ours_nvfp4(decoded[e], amax[e])
        assert_same_bytes(q["weight"], packed[e], f"expert {e} codes", decoded[e], per=2)
        assert_same_bytes(q["weight_scale"], scale[e], f"expert {e} scales", decoded[e], per=16)
        assert torch.equal(q["weight_amax"], amax[e])


def test_mxfp8_fixed_point_through_transformers_decoder():
    """Released MXFP8 experts (Gaussian, every E4M3 midpoint, the (448, 464] band, zero blocks,
    extreme scales), decoded by transformers' decoder and re-encoded by ours: same bytes."""
    parts = [gaussian_outliers((2, 32, 128), BF, seed=41).float(), rows_to(mxfp8_ties(F32), 64).reshape(2, 32, 128),
             rows_to(mxfp8_edges(F32), 32)[None]]
    w = torch.cat(parts)
    v, s = R.mxfp8_nearest(w)
    decoded = R.hf_decode_mxfp8(v, s)
    q = ours_mxfp8(decoded)
    assert_same_bytes(q["weight"], v, "MXFP8 values", decoded)
    assert_same_bytes(q["weight_scale"], s, "MXFP8 scales", decoded, per=32)


def test_nvfp4_fixed_point_gap_on_two_smallest_block_scales():
    """Not a fixed point, by the documented rule itself: a block whose E4M3 scale is 1 or 2
    times 2**-9 can have its largest code below 6 (here 2**-9 * 1.5 rounds up to 2 * 2**-9, so
    the largest code is 4, i.e. 4.5 rounded to even). Re-encoding its decode picks a smaller
    scale. Ours must still equal the reference on the re-encode."""
    w = torch.zeros(2, 32)
    w[0, 0] = DEN                          # amax: fp32(den / amax) = 1
    w[1, 0] = 9 * 2.0**-9                  # bmax / 6 = 1.5 * 2**-9, a tie: scale 2 * 2**-9
    w[1, 1] = -3 * 2.0**-9
    p, s, a = R.nvfp4_nearest(w)
    assert s.view(torch.uint8)[1, 0] == 2 and R.unpack_e2m1(p)[1, 0] == 6  # code 6 = value 4
    dec = R.decode_nvfp4(p, s, a)
    hf = R.hf_decode_nvfp4(p[None], s[None], a[None], torch.tensor([DEN]))[0]
    assert torch.equal(dec, hf)
    p2, s2, _ = R.nvfp4_nearest(dec, a)
    assert s2.view(torch.uint8)[1, 0] == 1 and not torch.equal(p2, p)  # the gap
    check_nvfp4(dec, a)
    # the same over a sweep of block sizes: ours re-encodes as the reference does, and the only
    # blocks that move are ones released with scale byte 1 or 2
    w = nvfp4_subnormal_sweep(F32)
    p, s, a = R.nvfp4_nearest(w)
    dec = R.decode_nvfp4(p, s, a)
    _, (p2, s2, _) = check_nvfp4(dec, a)
    moved = (s2.view(torch.uint8) != s.view(torch.uint8)) | (
        torch.from_numpy(R.unpack_e2m1(p2) != R.unpack_e2m1(p)).reshape(*s.shape, 16).any(-1))
    assert torch.isin(s.view(torch.uint8)[moved], torch.tensor([1, 2], dtype=torch.uint8)).all()


# ============================================================================== release vs modelopt
def test_release_and_modelopt_mxfp8_scales_differ_exactly_on_the_448_464_band():
    """ModelOpt picks 2**ceil(log2(bmax / 448)): one more than the release rule exactly where
    bmax / 2**s is in (448, 464], the same elsewhere (Gaussian blocks, 448, an fp32 step above
    464, zero blocks); where the scales agree, so do the values. (bmax only an fp32 step above
    448 * 2**k is left out: ModelOpt's fp32 log2 can round that one down.)"""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from modelopt.torch.quantization.qtensor import MXFP8QTensor
    g = torch.Generator().manual_seed(50)
    w = torch.randn(16, 128, generator=g) * 0.02
    blocks = w.view(16, 4, 32)
    ratios = [449.0, 456.0, 463.5, 464.0, 448.0, 464.25, 447.0, 300.0]
    for i, r in enumerate(ratios):
        for j, k in enumerate((-30, -3, 0, 5, 12)):
            b = blocks[i * 2 + j // 3, j % 3 + (1 if j > 2 else 0)]
            b.mul_(0.5 / b.abs().max()).mul_(r * 2.0**k)
            b[3] = -r * 2.0**k
    blocks[15, 3] = 0
    w = w.to(BF)
    ours = ours_mxfp8(w)
    mo_v, mo_s = MXFP8QTensor.quantize(w)
    mo_s = mo_s.reshape(ours["weight_scale"].shape)
    bmax = w.float().abs().view(16, 4, 32).amax(-1).double()
    s_rel = torch.from_numpy(R.mxfp8_exponent(bmax.numpy()))
    ratio = bmax / torch.exp2(s_rel.double())
    band = (ratio > 448) & (ratio <= 464)
    assert band.sum() >= 15 and (~band).sum() >= 15
    diff = mo_s.long() - ours["weight_scale"].long()
    assert torch.equal(diff != 0, band) and (diff[band] == 1).all()
    same = (~band).repeat_interleave(32, -1).reshape(w.shape)
    assert torch.equal(_u8(ours["weight"])[same], _u8(mo_v._quantized_data)[same])
    check_mxfp8(w)


def test_encoder_argument_selects_the_rule():
    """The default is ModelOpt's rule (unchanged), and release differs from it: on a Gaussian
    weight NVFP4 bytes are not all identical, and MXFP8 scales differ on a (448, 464] block."""
    w = gaussian_outliers((64, 256), BF, seed=60)
    nv = FORMATS["nvfp4"]
    default, modelopt, release = nv.quantize(w), nv.quantize(w, encoder="modelopt"), ours_nvfp4(w)
    for k in ("weight", "weight_scale"):
        assert torch.equal(_u8(default[k]), _u8(modelopt[k])), k
    assert not (torch.equal(release["weight"], modelopt["weight"])
                and torch.equal(_u8(release["weight_scale"]), _u8(modelopt["weight_scale"])))
    m = torch.zeros(2, 32, dtype=BF)
    m[0, 0], m[1, 0] = 456.0, 1.0
    mx = FORMATS["mxfp8"]
    d, mo, rel = mx.quantize(m), mx.quantize(m, encoder="modelopt"), ours_mxfp8(m)
    assert torch.equal(d["weight_scale"], mo["weight_scale"])
    assert mo["weight_scale"][0, 0] == 128 and rel["weight_scale"][0, 0] == 127
