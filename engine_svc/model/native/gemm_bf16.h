/*
 * bfloat16 dot products for gemm.c, in builds for CPUs with AVX512-BF16 (TK_BF16_DP).
 *
 * bfloat16 panels of such a build hold K in pairs, so that one VDPBF16PS takes two k
 * steps of 16 columns: for the pair (k, k+1) of column j, the 32-bit lane j holds
 *
 *      bits 31..16: W[j][k]      bits 15..0: W[j][k+1]      (k even; K padded to even with 0)
 *
 * and A's rows are copied, before the product, into the same pairs (ws, bfloat16 [M][Kp]).
 *
 * The rounding rule of tandem_kernels.h holds bit for bit: a product of two bfloat16 is
 * exact in float32, and VDPBF16PS adds a lane's odd element (bits 31..16, here k) to the
 * accumulator first, then its even one (k+1), each sum rounded to nearest even: the
 * float32 multiply-adds of the other builds, in the same k order. Where it differs: it
 * flushes denormal inputs and results to zero (float32 results below 2^-126; bfloat16
 * weights and activations of a trained model are never near that), and the zero that
 * pads an odd K adds +0 to a sum of -0.
 */
#ifndef TANDEM_GEMM_BF16_H
#define TANDEM_GEMM_BF16_H

#include "tandem_kernels.h"

#if defined(__AVX512BF16__)
#define TK_BF16_DP 1
#else
#define TK_BF16_DP 0
#endif

/* Rows per panel of K: bfloat16 panels of a TK_BF16_DP build hold whole pairs. */
static inline int panel_k(int K, int pdtype) { return TK_BF16_DP && pdtype == TK_BF16 ? (K + 1) / 2 * 2 : K; }

/* Index of W[col][k] in a panel of the pair layout (nr columns). */
static inline size_t pair_index(int k, int j, int nr) { return ((size_t)(k / 2) * nr + j) * 2 + (k % 2 ? 0 : 1); }

/* A row (bfloat16, K elements) -> the pair layout (Kp elements, zero-padded). */
static inline void pair_row(bf16 *dst, const bf16 *src, int K) {
    for (int k = 0; k + 1 < K; k += 2) dst[k] = src[k + 1], dst[k + 1] = src[k];
    if (K % 2) dst[K - 1] = 0, dst[K] = src[K - 1];
}

#if TK_BF16_DP
/* acc (=|+=) A[0..mr)[0..kc) @ panel slice, kc even, 32 columns (two vectors of 16). a: rows
 * in the pair layout with stride lda; pf: the next slice, prefetched as in micro_tile. */
static inline __attribute__((always_inline)) void micro_tile_dp(
    const int mr, const bf16 *a, int lda, const bf16 *panel, int kc, float *cs, int first, const char *pf) {
    __m512 acc[12][2];
    for (int r = 0; r < mr; r++) {
        acc[r][0] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(cs + r * 32);
        acc[r][1] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(cs + r * 32 + 16);
    }
    for (int k = 0; k < kc; k += 2) {
        __builtin_prefetch(pf + (size_t)k * 64, 0, 3); /* a pair of 32 bfloat16 columns: 128 bytes */
        __builtin_prefetch(pf + (size_t)k * 64 + 64, 0, 3);
        const __m512bh b0 = (__m512bh)_mm512_loadu_si512(panel + (size_t)k * 32);
        const __m512bh b1 = (__m512bh)_mm512_loadu_si512(panel + (size_t)k * 32 + 32);
        for (int r = 0; r < mr; r++) {
            int32_t pair;
            memcpy(&pair, a + (size_t)r * lda + k, 4);
            const __m512bh ar = (__m512bh)_mm512_set1_epi32(pair);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], ar, b0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], ar, b1);
        }
    }
    for (int r = 0; r < mr; r++) {
        _mm512_storeu_ps(cs + r * 32, acc[r][0]);
        _mm512_storeu_ps(cs + r * 32 + 16, acc[r][1]);
    }
}
#endif

#endif
