"""The Triton kernels: one dequant-GEMM kernel for both formats and every launch shape, and the
small epilogue kernels of split-K and the fused MoE. Launchers live in dequant_gemm.py and
fused_moe.py; docs/kernels.md explains the algorithms and the error bounds.

``_dequant_gemm_kernel`` computes ``out[pid_k] = x @ dequant(W_e)^T`` over one K slice. Its
constexpr switches:

* ``FMT``: FMT_NVFP4 (uint8 [N, K/2] e2m1 pairs + e4m3 [N, K/16] + fp32 per-expert scale) or
  FMT_MXFP8 (e4m3 [N, K] + e8m0 [N, K/32]).
* ``INNER``: how a dequantized tile meets the activations. INNER_FMA: fp32 multiply-add and a
  ``tl.sum`` over K (GEMV style: no MMA rows wasted when M is 1-2); INNER_DOT_F32: ``tl.dot`` on
  fp32 operands (the interpreter: its bf16 ``tl.dot`` is wrong, triton-lang/triton#11584);
  INNER_DOT_BF16: bf16 tensor-core MMA; INNER_DOT_SCALED: sm100 ``tl.dot_scaled`` with the
  activations quantized on the fly (W4A4 / W8A8).
* ``ROWS``: which rows an M-block owns. ROWS_DENSE: ``pid_m * BLOCK_M + i``; ROWS_RANGES: a
  row range of one expert (tokens already sorted, ``moe_tile_map``); ROWS_SORTED_IDS: vLLM's
  ``moe_align_block_size`` form, ``sorted_token_ids`` padded per expert to BLOCK_M with an
  expert id per block; the activation row is ``id // X_ROW_DIV`` (top_k for gate_up), the
  output row is ``id``.
* Split-K: program axis 2 takes K slice ``pid_k``; with more than one slice the launcher
  passes an fp32 partial buffer [SPLIT, rows, N] and sums it in a fixed order afterwards
  (``_splitk_sum_kernel`` / the MoE epilogues): deterministic, no atomics.
"""
from __future__ import annotations

from .triton_ops import tl, triton

FMT_NVFP4, FMT_MXFP8 = 0, 1
INNER_FMA, INNER_DOT_F32, INNER_DOT_BF16, INNER_DOT_SCALED = 0, 1, 2, 3
ROWS_DENSE, ROWS_RANGES, ROWS_SORTED_IDS = 0, 1, 2

if triton is not None:
    from .triton_ops import (_e2m1_encode, _e2m1_words_to_f32, _e4m3_decode_pow2, _e4m3_words_to_f32,
                             _e8m0_decode, _gated_activation, _round_e4m3, _store_rounded)

    @triton.jit
    def _block_rows(blk_expert_ptr, blk_rows_ptr, blk_end_ptr, M, pid_m,
                    BLOCK_M: tl.constexpr, ROWS: tl.constexpr, X_ROW_DIV: tl.constexpr):
        """(expert, activation rows, output rows, row mask) of M-block pid_m; expert -1 marks a
        spare block of an upper-bound grid (no host sync to size it), which does nothing."""
        offs = tl.arange(0, BLOCK_M)
        if ROWS == 0:
            e = pid_m * 0
            rows = pid_m * BLOCK_M + offs
            mask = rows < M
            x_rows = rows
        elif ROWS == 1:
            e = tl.load(blk_expert_ptr + pid_m)
            rows = tl.load(blk_rows_ptr + pid_m) + offs
            mask = rows < tl.load(blk_end_ptr + pid_m)
            x_rows = rows
        else:
            e = tl.load(blk_expert_ptr + pid_m)
            rows = tl.load(blk_rows_ptr + pid_m * BLOCK_M + offs)
            mask = rows < M  # padding ids equal M = number of (token, k) pairs
            x_rows = rows // X_ROW_DIV
        return e, x_rows, rows, mask

    @triton.jit
    def _step_inside(k0, k_hi, W: tl.constexpr):
        """[1, W] all equal to k0 < k_hi (a mask constant along K keeps loads vectorized)."""
        return (tl.zeros((1, W), dtype=tl.int32) + k0) < k_hi

    @triton.jit
    def _load_weight(w_base, s_base, k0, k_hi, n_mask, BLOCK_K: tl.constexpr, EPU: tl.constexpr,
                     SB: tl.constexpr, EVEN_K: tl.constexpr):
        """One K step of weight units [BN, BK/EPU] (EPU elements per unit: int32 words of 8 e2m1 /
        4 e4m3 codes, or single bytes for tl.dot_scaled) and scale bytes [BN, BK/SB], each
        loaded once per program and step: rows are contiguous and the launcher's strides are
        multiples of 16 bytes, so these become 16-byte vector loads. EVEN_K: no K masks."""
        # k0 is a multiple of BLOCK_K (slices are whole steps): say so, or the division by
        # EPU / SB hides the 16-byte alignment the vectorizer needs
        offs_b = tl.multiple_of(k0 // EPU, BLOCK_K // EPU) + tl.arange(0, BLOCK_K // EPU)
        offs_s = tl.multiple_of(k0 // SB, BLOCK_K // SB) + tl.arange(0, BLOCK_K // SB)
        if EVEN_K:  # whole steps: only "is this step inside the slice", uniform along K
            wb = tl.load(w_base + offs_b[None, :], mask=n_mask[:, None] & _step_inside(k0, k_hi, BLOCK_K // EPU),
                         other=0)
            sb = tl.load(s_base + offs_s[None, :], mask=n_mask[:, None] & _step_inside(k0, k_hi, BLOCK_K // SB),
                         other=0)
        else:
            wb = tl.load(w_base + offs_b[None, :], mask=n_mask[:, None] & (offs_b < k_hi // EPU)[None, :], other=0)
            sb = tl.load(s_base + offs_s[None, :], mask=n_mask[:, None] & (offs_s < k_hi // SB)[None, :], other=0)
        return wb, sb

    @triton.jit
    def _offs_k(k0, k_hi, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
        """(K offsets of step k0, their mask)."""
        offs_k = tl.multiple_of(k0, BLOCK_K) + tl.arange(0, BLOCK_K)
        if EVEN_K:
            k_mask = tl.reshape(_step_inside(k0, k_hi, BLOCK_K), (BLOCK_K,))
        else:
            k_mask = offs_k < k_hi
        return offs_k, k_mask

    @triton.jit
    def _weight_values(wb, sb, FMT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SB: tl.constexpr):
        """(values [BN, BK/SB, SB], block scales [BN, BK/SB]) of one step, unscaled: the FMA
        path multiplies each block's partial sum by its scale, not each weight."""
        if FMT == 0:
            v = tl.reshape(_e2m1_words_to_f32(wb, BLOCK_N, BLOCK_K), (BLOCK_N, BLOCK_K // SB, SB))
            s = _e4m3_decode_pow2(sb, 14)
        else:
            v = tl.reshape(_e4m3_words_to_f32(wb, BLOCK_N, BLOCK_K), (BLOCK_N, BLOCK_K // SB, SB))
            s = _e8m0_decode(sb)
        return v, s

    @triton.jit
    def _weight_tile(wb, sb, FMT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SB: tl.constexpr):
        """Exact fp32 [BN, BK] weights from one step's units (NVFP4: e2m1 * e4m3; MXFP8: e4m3 *
        2^-8 * 2^(E-127), the 2^8 applied to the accumulator by the caller)."""
        v, s = _weight_values(wb, sb, FMT, BLOCK_N, BLOCK_K, SB)
        return tl.reshape(v * s[:, :, None], (BLOCK_N, BLOCK_K))

    @triton.jit
    def _scaled_dot_step(acc, x, wb, sb, a_s2, FMT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                         SB: tl.constexpr, VMAX: tl.constexpr, SMAX: tl.constexpr, SMIN: tl.constexpr):
        """sm100: quantize the activation tile to the weight's format, one block-scaled MMA."""
        xb = tl.reshape(x.to(tl.float32), (BLOCK_M, BLOCK_K // SB, SB))
        amax = tl.max(tl.abs(xb), axis=2)
        if FMT == 0:
            # W4A4: per-16 e4m3 scales under the per-tensor activation scale a_s2
            bs = tl.math.div_rn(amax, VMAX * a_s2)
            bs = tl.where(bs == 0.0, 1.0, bs)
            bs = tl.minimum(tl.maximum(bs, SMIN), SMAX)
            bs8 = _round_e4m3(bs).to(tl.float8e4nv)
            denom = bs8.to(tl.float32) * a_s2
            xq = tl.math.div_rn(xb, denom[:, :, None])
            codes = tl.reshape(_e2m1_encode(xq), (BLOCK_M, BLOCK_K // 2, 2))
            lo, hi = tl.split(codes)
            xp = (lo | (hi << 4)).to(tl.uint8)
            acc = tl.dot_scaled(xp, bs8, "e2m1", tl.trans(wb), sb.to(tl.float8e4nv, bitcast=True), "e2m1", acc)
        else:
            # W8A8: ModelOpt's scale rule E = ceil(log2(amax/VMAX)), exactly from the fp32 bits;
            # e4m3 x e4m3 with e8m0 scales
            bits = tl.math.div_rn(amax, VMAX).to(tl.int32, bitcast=True)
            ef = (bits >> 23) & 0xFF
            mant = bits & 0x7FFFFF
            ex = ef - 127 + (mant != 0).to(tl.int32)
            ex = tl.where(ef == 0, tl.where(mant > 0x400000, -126, -127), ex)  # subnormal amax/VMAX
            ex = tl.where(amax == 0.0, -127, ex)
            ex = tl.minimum(tl.maximum(ex, -127), 127)
            inv = ((127 - ex) << 23).to(tl.float32, bitcast=True)  # 2^-ex, ex <= 120 for finite x
            xs = tl.minimum(tl.maximum(xb * inv[:, :, None], -VMAX), VMAX)
            x8 = tl.reshape(_round_e4m3(xs), (BLOCK_M, BLOCK_K)).to(tl.float8e4nv)
            xe = (ex + 127).to(tl.uint8)
            acc = tl.dot_scaled(x8, xe, "e4m3", tl.trans(wb.to(tl.float8e4nv, bitcast=True)), sb, "e4m3", acc)
        return acc

    @triton.jit
    def _tile_loop(x_ptr, x_rows, m_mask, stride_xm, w_base, s_base, n_mask, k_lo, k_hi, steps, a_s2,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FMT: tl.constexpr,
                   INNER: tl.constexpr, EPU: tl.constexpr, EVEN_K: tl.constexpr, SB: tl.constexpr, VMAX: tl.constexpr,
                   SMAX: tl.constexpr, SMIN: tl.constexpr):
        """MMA tiles: acc[BM, BN] over K in [k_lo, k_hi) with tl.dot (fp32 operands in the
        interpreter, bf16 on GPUs) or tl.dot_scaled (sm100)."""
        x_base = x_ptr + x_rows[:, None].to(tl.int64) * stride_xm
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for step in range(0, steps):  # trip count from an argument: any Triton, interpreter included
            k0 = k_lo + step * BLOCK_K
            offs_k, k_mask = _offs_k(k0, k_hi, BLOCK_K, EVEN_K)
            x = tl.load(x_base + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            wb, sb = _load_weight(w_base, s_base, k0, k_hi, n_mask, BLOCK_K, EPU, SB, EVEN_K)
            if INNER == 3:
                acc = _scaled_dot_step(acc, x, wb, sb, a_s2, FMT, BLOCK_M, BLOCK_K, SB, VMAX, SMAX, SMIN)
            else:
                w = _weight_tile(wb, sb, FMT, BLOCK_N, BLOCK_K, SB)
                if INNER == 1:
                    acc = tl.dot(x.to(tl.float32), tl.trans(w), acc, input_precision="ieee")
                else:
                    acc = tl.dot(x.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)), acc)
        return acc

    @triton.jit
    def _fma_loop(x_ptr, x_rows, m_mask, stride_xm, w_base, s_base, n_mask, k_lo, k_hi, steps,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FMT: tl.constexpr,
                  EPU: tl.constexpr, EVEN_K: tl.constexpr, SB: tl.constexpr):
        """GEMV style for 1 or 2 rows, in the weight tile's own layout: per scale block an exact
        fp32 partial sum of x * value (an FMA per weight; NVFP4's values carry 2^-14, MXFP8's
        2^-8, so every product is a normal fp32 for |x| >= 2^-100), times the block's scale into
        per-lane accumulators acc_r[BN, BK/SB], summed over K once after the loop (no cross-lane
        traffic in it). Returns acc[BM, BN]."""
        tl.static_assert(BLOCK_M <= 2, "the FMA path takes 1 or 2 rows per block")
        x_base = x_ptr + x_rows[None, :].to(tl.int64) * stride_xm  # [1, BM]: x loaded as [BK, BM]
        acc0 = tl.zeros((BLOCK_N, BLOCK_K // SB), dtype=tl.float32)
        acc1 = tl.zeros((BLOCK_N, BLOCK_K // SB), dtype=tl.float32)
        for step in range(0, steps):  # trip count from an argument: any Triton, interpreter included
            k0 = k_lo + step * BLOCK_K
            offs_k, k_mask = _offs_k(k0, k_hi, BLOCK_K, EVEN_K)
            xt = tl.load(x_base + offs_k[:, None], mask=k_mask[:, None] & m_mask[None, :], other=0.0).to(tl.float32)
            wb, sb = _load_weight(w_base, s_base, k0, k_hi, n_mask, BLOCK_K, EPU, SB, EVEN_K)
            v, s = _weight_values(wb, sb, FMT, BLOCK_N, BLOCK_K, SB)
            if BLOCK_M == 1:
                x0 = tl.reshape(xt, (BLOCK_K // SB, SB))
                acc0 += tl.sum(x0[None, :, :] * v, axis=2) * s
            else:
                x0, x1 = tl.split(xt)
                acc0 += tl.sum(tl.reshape(x0, (BLOCK_K // SB, SB))[None, :, :] * v, axis=2) * s
                acc1 += tl.sum(tl.reshape(x1, (BLOCK_K // SB, SB))[None, :, :] * v, axis=2) * s
        if BLOCK_M == 1:
            acc = tl.sum(acc0, axis=1)[None, :]
        else:
            acc = tl.trans(tl.join(tl.sum(acc0, axis=1), tl.sum(acc1, axis=1)))
        return acc

    @triton.jit
    def _dequant_gemm_kernel(
        x_ptr, w_ptr, ws_ptr, ws2_ptr, as2_ptr, out_ptr,
        blk_expert_ptr, blk_rows_ptr, blk_end_ptr,
        M, N, K, steps_per_split,
        stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_os, stride_om,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        FMT: tl.constexpr, INNER: tl.constexpr, ROWS: tl.constexpr, X_ROW_DIV: tl.constexpr,
        EPU: tl.constexpr, EVEN_K: tl.constexpr, ROUND_BF16: tl.constexpr,
        SB: tl.constexpr, VMAX: tl.constexpr, SMAX: tl.constexpr, SMIN: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        e, x_rows, out_rows, m_mask = _block_rows(blk_expert_ptr, blk_rows_ptr, blk_end_ptr, M, pid_m,
                                                  BLOCK_M, ROWS, X_ROW_DIV)
        if e >= 0:
            e64 = e.to(tl.int64)
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            n_mask = offs_n < N
            w_base = w_ptr + e64 * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
            s_base = ws_ptr + e64 * stride_se + offs_n[:, None].to(tl.int64) * stride_sn
            a_s2 = tl.load(as2_ptr)  # per-tensor activation scale (sm100 NVFP4 only)
            k_lo = pid_k * steps_per_split * BLOCK_K
            k_hi = tl.minimum(K, k_lo + steps_per_split * BLOCK_K)
            if INNER == 0:
                acc = _fma_loop(x_ptr, x_rows, m_mask, stride_xm, w_base, s_base, n_mask, k_lo, k_hi, steps_per_split,
                                BLOCK_M, BLOCK_N, BLOCK_K, FMT, EPU, EVEN_K, SB)
            else:
                acc = _tile_loop(x_ptr, x_rows, m_mask, stride_xm, w_base, s_base, n_mask, k_lo, k_hi, steps_per_split,
                                 a_s2,
                                 BLOCK_M, BLOCK_N, BLOCK_K, FMT, INNER, EPU, EVEN_K, SB, VMAX, SMAX, SMIN)
            # per-tensor factors, once per output: NVFP4's weight_scale_2 (and the activation
            # scale of W4A4); MXFP8's 2^8 taken out of the weights by _e4m3_words_to_f32
            if FMT == 0:
                acc = acc * tl.load(ws2_ptr + e64)
                if INNER == 3:
                    acc = acc * a_s2
            else:
                if INNER != 3:
                    acc = acc * 256.0
            out_ptrs = (out_ptr + pid_k.to(tl.int64) * stride_os + out_rows[:, None].to(tl.int64) * stride_om
                        + offs_n[None, :])
            _store_rounded(out_ptrs, acc, m_mask[:, None] & n_mask[None, :], ROUND_BF16)

    @triton.jit
    def _sum_splits(p_ptr, rows, cols, mask, SPLIT, stride_ps, stride_pm):
        """sum over s = 0, 1, ..., SPLIT-1 of the fp32 partials p[s, rows, cols], in that order."""
        ptrs = p_ptr + rows[:, None].to(tl.int64) * stride_pm + cols[None, :]
        acc = tl.load(ptrs, mask=mask, other=0.0)
        for s in range(1, SPLIT):
            acc += tl.load(ptrs + s * stride_ps, mask=mask, other=0.0)
        return acc

    @triton.jit
    def _splitk_sum_kernel(p_ptr, y_ptr, R, N, SPLIT, stride_ps, stride_pm, stride_ym,
                           BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, ROUND_BF16: tl.constexpr):
        """y[r, n] = sum_s p[s, r, n] (fixed order: deterministic split-K)."""
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (rows < R)[:, None] & (cols < N)[None, :]
        acc = _sum_splits(p_ptr, rows, cols, mask, SPLIT, stride_ps, stride_pm)
        _store_rounded(y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :], acc, mask, ROUND_BF16)

    @triton.jit
    def _moe_activation_kernel(p_ptr, h_ptr, R, I, SPLIT, stride_ps, stride_pm, stride_hm,
                               ACT: tl.constexpr, GATE_CAP: tl.constexpr, UP_CAP: tl.constexpr,
                               BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, ROUND_BF16: tl.constexpr):
        """h[r, c] = act(gate, up) with gate = sum_s p[s, r, c] and up = sum_s p[s, r, I + c]
        (gate rows first in gate_up, as transformers' chunk(2, dim=-1)); h is stored in h's
        dtype (bf16: the down GEMM's activation)."""
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (rows < R)[:, None] & (cols < I)[None, :]
        g = _sum_splits(p_ptr, rows, cols, mask, SPLIT, stride_ps, stride_pm)
        u = _sum_splits(p_ptr, rows, cols + I, mask, SPLIT, stride_ps, stride_pm)
        h = _gated_activation(g, u, ACT, GATE_CAP, UP_CAP)
        _store_rounded(h_ptr + rows[:, None].to(tl.int64) * stride_hm + cols[None, :], h, mask, ROUND_BF16)

    @triton.jit
    def _moe_combine_kernel(p_ptr, tw_ptr, y_ptr, T, N, SPLIT, stride_ps, stride_pm, stride_ym,
                            TOP_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                            ROUND_BF16: tl.constexpr):
        """y[t, n] = sum_k w[t, k] * (sum_s p[s, t*TOP_K + k, n]), k = 0, 1, ... in order (the
        reference's order; fp32), stored in y's dtype."""
        tok = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        t_mask = tok < T
        mask = t_mask[:, None] & (cols < N)[None, :]
        acc = tl.zeros((BLOCK_R, BLOCK_N), dtype=tl.float32)
        for kk in tl.static_range(TOP_K):
            flat = tok * TOP_K + kk
            yk = _sum_splits(p_ptr, flat, cols, mask, SPLIT, stride_ps, stride_pm)
            wk = tl.load(tw_ptr + flat, mask=t_mask, other=0.0)
            acc += wk[:, None] * yk
        _store_rounded(y_ptr + tok[:, None].to(tl.int64) * stride_ym + cols[None, :], acc, mask, ROUND_BF16)
