"""Jitted building blocks shared by the GEMM and MoE kernels (gemm_kernels.py): bit-level decoders
of the checkpoint formats, the fp32 -> e4m3 / e2m1 encoders of the sm100 path, bf16 rounding for
the interpreter, and the gated activations of the fused MoE.

Everything here is integer or plain fp32 arithmetic that behaves the same in the Triton CPU
interpreter and on GPUs (no fp8 types except where ``tl.dot_scaled`` needs them), and uses no
Triton API newer than 3.6.
"""
from __future__ import annotations

try:
    import triton
    import triton.language as tl

    TRITON_IMPORT_ERROR: str | None = None
except Exception as exc:  # pragma: no cover - the package works without triton (torch reference)
    triton = None
    tl = None
    TRITON_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

# Codes of the gated activations (the MoE kernels' ACT constexpr) and their public names.
ACT_SILU = 0                # silu(gate) * up                       (Mixtral/Qwen/DeepSeek SwiGLU)
ACT_SOFTCAPPED_SWIGLU = 1   # softcap(gate, Cg) * sigmoid(gate) * softcap(up, Cu)   (Inkling 2)
ACTIVATIONS = {"silu": ACT_SILU, "softcapped-swiglu": ACT_SOFTCAPPED_SWIGLU}


if triton is not None:

    # ------------------------------------------------------------------------------------------
    # decoders (checkpoint bytes -> exact fp32)
    # ------------------------------------------------------------------------------------------
    @triton.jit
    def _e2m1_decode(code):
        """int32 e2m1 code (sign bit 3, magnitude index bits 0-2) -> exact fp32 value."""
        mag = code & 7
        e = mag >> 1
        m = mag & 1
        # e == 0: 0 or 0.5 (0x3F000000); else 2^(e-1) * (1 + m/2) = fp32 bits (e+126, m<<22)
        bits = tl.where(e == 0, m * 0x3F000000, ((e + 126) << 23) | (m << 22))
        bits = bits | ((code & 8) << 28)
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _fp16_pair_to_f32(p):
        """int32 holding two fp16 bit patterns -> (fp32 of the low half, fp32 of the high half)."""
        lo = p.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (p >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        return lo, hi

    @triton.jit
    def _e2m1_words_to_f32(q, ROWS: tl.constexpr, COLS: tl.constexpr):
        """int32 words [ROWS, COLS/8] of packed e2m1 (eight codes per word, element 2j in the low
        nibble of byte j: ModelOpt's packing read little-endian) -> fp32 [ROWS, COLS] equal to
        e2m1 * 2^-14, in K order.

        Two codes per integer op: the nibble in bits 12-15 of each 16-bit half of `t` becomes an
        fp16 in that half (sign stays at bit 15, exponent-and-mantissa bits 12-14 move to 9-11), so
        the half holds e2m1 * 2^-14 exactly, fp16 subnormals included (0.5 -> 2^-15); shifting the
        word by 4 brings the next pair of codes there. Three integer ops per two codes plus one
        cvt per code (the 2^14 is folded into the block scale: _e4m3_decode_pow2(scale, 14))."""
        e3, e7 = _fp16_pair_to_f32((q & -2147450880) | ((q >> 3) & 0x0E000E00))  # 0x80008000
        t = q << 4
        e2, e6 = _fp16_pair_to_f32((t & -2147450880) | ((t >> 3) & 0x0E000E00))
        t = q << 8
        e1, e5 = _fp16_pair_to_f32((t & -2147450880) | ((t >> 3) & 0x0E000E00))
        t = q << 12
        e0, e4 = _fp16_pair_to_f32((t & -2147450880) | ((t >> 3) & 0x0E000E00))
        # tl.join appends the fastest-varying dim: joining (e0, e4), then over the pairs, then
        # over the quads puts code i of the word at position i
        f = tl.join(tl.join(tl.join(e0, e4), tl.join(e2, e6)), tl.join(tl.join(e1, e5), tl.join(e3, e7)))
        return tl.reshape(f, (ROWS, COLS))

    @triton.jit
    def _e4m3_words_to_f32(q, ROWS: tl.constexpr, COLS: tl.constexpr):
        """int32 words [ROWS, COLS/4] of float8_e4m3fn bytes -> fp32 [ROWS, COLS] equal to the
        e4m3 values * 2^-8, in K order: the byte in bits 8-15 of each half becomes an fp16 there
        (exponent and mantissa shift right by one: fp16 bias 15 = e4m3 bias 7 + 8), subnormals
        included; two bytes per integer op. The caller multiplies the accumulator by 256 once
        (exact). NaN codes (0x7F/0xFF) decode as +-480: checkpoints hold none."""
        e1, e3 = _fp16_pair_to_f32((q & -2147450880) | ((q >> 1) & 0x3F803F80))  # 0x80008000
        t = q << 8
        e0, e2 = _fp16_pair_to_f32((t & -2147450880) | ((t >> 1) & 0x3F803F80))
        return tl.reshape(tl.join(tl.join(e0, e2), tl.join(e1, e3)), (ROWS, COLS))

    @triton.jit
    def _e4m3_decode_pow2(b, EXP: tl.constexpr):
        """uint8 float8_e4m3fn bits -> exact fp32 value * 2^EXP, with integer ops only (no fp8
        type: Triton has none before sm89, and the interpreter agrees bit for bit). NaN codes
        (0x7F/0xFF) are not special-cased (decoded as +-480): checkpoints hold none."""
        b = b.to(tl.int32)
        ex = (b >> 3) & 0xF
        m = b & 7
        normal = (((ex + (120 + EXP)) << 23) | (m << 20)).to(tl.float32, bitcast=True)
        sub = m.to(tl.float32) * (0.001953125 * (2.0 ** EXP))  # subnormal: m * 2^-9 * 2^EXP
        val = tl.where(ex == 0, sub, normal)
        return tl.where((b & 0x80) != 0, -val, val)

    @triton.jit
    def _e4m3_decode(b):
        """uint8 float8_e4m3fn bits -> exact fp32 (see _e4m3_decode_pow2)."""
        return _e4m3_decode_pow2(b, 0)

    @triton.jit
    def _e8m0_decode(s):
        """uint8 e8m0 biased exponent E -> fp32 2^(E-127) (E = 0 gives the subnormal 2^-127)."""
        sb = s.to(tl.int32) << 23
        return tl.where(sb == 0, 0x00400000, sb).to(tl.float32, bitcast=True)

    # ------------------------------------------------------------------------------------------
    # encoders (sm100 W4A4 / W8A8: activations quantized in registers)
    # ------------------------------------------------------------------------------------------
    @triton.jit
    def _e2m1_encode(v):
        """fp32 (already divided by its scale) -> int32 e2m1 code: round half to even on the
        grid [0, .5, 1, 1.5, 2, 3, 4, 6], saturating at 6 (ModelOpt's _cast_fp4 rule)."""
        a = tl.abs(v)
        idx = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
               + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
               + (a > 5.0).to(tl.int32))
        return idx | ((v < 0).to(tl.int32) << 3)

    @triton.jit
    def _round_e4m3(v):
        """fp32 -> fp32 on the float8_e4m3fn grid, round half to even (|v| <= 448 assumed).
        Done on the fp32 bits so the following .to(tl.float8e4nv) is exact: the interpreter's
        fp32->fp8 cast loses the mantissa carry (0.49 -> 0.25), and on GPUs this costs a few
        integer ops per activation element, on the sm100 path only."""
        bits = v.to(tl.int32, bitcast=True)
        mag = bits & 0x7FFFFFFF
        sign = bits ^ mag
        ex = (mag >> 23) - 127
        d = tl.where(ex >= -6, 20, 14 - ex)  # fp32 mantissa bits dropped: 3 kept, fewer if subnormal
        d = tl.minimum(tl.maximum(d, 20), 23)
        lsb = tl.where(d == 23, 1, (mag >> d) & 1)  # at 2^-9 the kept lsb is the implicit 1
        r = (mag + (1 << (d - 1)) - 1 + lsb) & (-(1 << d))
        tiny = tl.where(mag > 0x3A800000, 0x3B000000, 0)  # |v| < 2^-9: 2^-9 above 2^-10, else 0
        r = tl.where(ex < -9, tiny, r)
        return (r | sign).to(tl.float32, bitcast=True)

    # ------------------------------------------------------------------------------------------
    # output rounding and stores
    # ------------------------------------------------------------------------------------------
    @triton.jit
    def _round_bf16(v):
        """fp32 -> fp32 on the bf16 grid, round half to even (NaN kept). The interpreter's
        fp32->bf16 cast truncates; GPUs round to nearest even. Used on the interpreter so its
        bf16 outputs round like the GPU's."""
        bits = v.to(tl.int32, bitcast=True)
        r = (bits + 0x7FFF + ((bits >> 16) & 1)) & (-65536)
        return tl.where(v != v, v, r.to(tl.float32, bitcast=True))

    @triton.jit
    def _store_rounded(ptrs, val, mask, ROUND_BF16: tl.constexpr):
        """Store fp32 `val` in the pointers' dtype; ROUND_BF16 (interpreter, bf16 output) rounds
        to nearest even first, as the GPU's cvt does."""
        if ROUND_BF16:
            val = _round_bf16(val)
        tl.store(ptrs, val.to(ptrs.dtype.element_ty), mask=mask)

    # ------------------------------------------------------------------------------------------
    # gated activations of the fused MoE (fp32 in, fp32 out)
    # ------------------------------------------------------------------------------------------
    @triton.jit
    def _tanh(z):
        """tanh in fp32 from exp: (1 - e^-2|z|) / (1 + e^-2|z|), and its odd Taylor polynomial
        below |z| = 1/8 where the subtraction would cancel (truncation error < 2e-10 relative).
        No libdevice call, so the interpreter and every Triton version run the same code."""
        a = tl.abs(z)
        t = tl.exp(-2.0 * a)
        big = tl.math.div_rn(1.0 - t, 1.0 + t)
        a2 = a * a
        small = a * (1.0 + a2 * (-0.3333333333333333 + a2 * (0.13333333333333333 + a2 * -0.05396825396825397)))
        r = tl.where(a < 0.125, small, big)
        return tl.where(z < 0, -r, r)

    @triton.jit
    def _sigmoid(z):
        return tl.math.div_rn(1.0, 1.0 + tl.exp(-z))

    @triton.jit
    def _softcap(z, CAP: tl.constexpr):
        """CAP * tanh(z / CAP), as transformers' Inkling2Softcap computes it."""
        return _tanh(tl.math.div_rn(z, CAP)) * CAP

    @triton.jit
    def _gated_activation(g, u, ACT: tl.constexpr, GATE_CAP: tl.constexpr, UP_CAP: tl.constexpr):
        """h from the gate and up halves of gate_up (fp32). ACT_SILU: silu(g) * u. ACT 1:
        Inkling 2's softcapped SwiGLU, (softcap(g, 4) * sigmoid(g)) * softcap(u, 25) in that
        order (transformers 5.25 models/inkling2/modeling_inkling2.py:794-797)."""
        if ACT == 0:
            return (g * _sigmoid(g)) * u
        else:
            return (_softcap(g, GATE_CAP) * _sigmoid(g)) * _softcap(u, UP_CAP)
