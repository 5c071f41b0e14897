/*
 * Y = X @ W^T with W kept quantized: weight-only int8 and 4-bit GEMM.
 *
 *   X  [M, K] float32 (row stride ldx); bfloat16 activations are widened by the caller
 *   W  [N, K] in groups of G consecutive weights along K, each with a float32 scale and
 *      (optionally) a float32 min:  w = q * scale + min
 *        kind 8: qs int8  [N, K]          (GGUF Q8_0, Q6_K as groups of 16, Q5_K's 5-bit
 *                                          values with their mins)
 *        kind 4: qs uint8 [N, K / 2]      (GGUF Q4_0 / Q4_1 / Q4_K): in group g of a row,
 *                byte j holds weight g*32 + j in its low nibble and g*32 + 16 + j in its high
 *      scale, min [N, K / G]
 *   Y  [M, N] float32 or bfloat16 (row stride ldy), rounded once
 *
 * Up to FUSED_MAX_ROWS rows of X (decode), each weight row is dequantized a group at a time
 * in registers and used at once. Past that, work is split by tiles of NT weight rows: a
 * tile's rows are dequantized into a float32
 * buffer (NT * K floats: 24 KiB at K = 1536, in L1/L2), then every row of X goes past it:
 * the quantized bytes stream from memory once per call, which is what bounds a decode step.
 * Each dot product is a sum of float32 multiply-adds of exactly the dequantized weight, so the
 * result is F.linear(X, dequantized W) up to the order of the additions.
 */
#include <stdlib.h>

#include "tandem_kernels.h"

#define NT 4
#if defined(__AVX512F__)
#define MT 4
#else
#define MT 2
#endif

enum { TK_Q8 = 8, TK_Q4 = 4 };

static inline vf widen_i8(const int8_t *p);
static inline vf widen_nibbles(const uint8_t *p, int hi);

static void dequant_row(int kind, const void *qs, const float *scale, const float *min, int group, int K, int n,
                        float *out) {
    const int ng = K / group;
    const float *s = scale + (size_t)n * ng;
    const float *mn = min ? min + (size_t)n * ng : NULL;
    for (int g = 0; g < ng; g++) {
        const vf sc = vbcast(s[g]), m0 = vbcast(mn ? mn[g] : 0.0f);
        if (kind == TK_Q8) {
            const int8_t *q = (const int8_t *)qs + (size_t)n * K + g * group;
            for (int j = 0; j < group; j += TK_VL) vstore(out + g * group + j, widen_i8(q + j) * sc + m0);
        } else {
            const uint8_t *b = (const uint8_t *)qs + (size_t)n * (K / 2) + g * 16;
            for (int j = 0; j < 16; j += TK_VL) {
                vstore(out + g * 32 + j, widen_nibbles(b + j, 0) * sc + m0);
                vstore(out + g * 32 + 16 + j, widen_nibbles(b + j, 1) * sc + m0);
            }
        }
    }
}

static inline float hsum(vf v) {
#if defined(__AVX512F__)
    return _mm512_reduce_add_ps((__m512)v);
#else
    const __m128 lo = _mm256_castps256_ps128((__m256)v), hi = _mm256_extractf128_ps((__m256)v, 1);
    __m128 s = _mm_add_ps(lo, hi);
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
#endif
}

/* Few rows (a decode step's): each group of 32 weights is dequantized in registers and
 * used at once, so the quantized bytes are the only weight traffic. */
/* Rows that take the fused path: on AVX512 (32 registers) up to 5, a speculative step's
 * 1 + 4 rows included (measured: at 8 rows the dequantized tile is faster); on AVX2 (16) up to 4. */
#if defined(__AVX512F__)
#define FUSED_MAX_ROWS 5
#else
#define FUSED_MAX_ROWS 4
#endif

/* TK_VL int8 / uint8 values -> float32 (sign- or zero-extended, then converted). */
static inline vf widen_i8(const int8_t *p) {
#if defined(__AVX512F__)
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#else
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#endif
}

/* The low (hi = 0) or high (hi = 1) nibbles of TK_VL bytes at p -> float32. */
static inline vf widen_nibbles(const uint8_t *p, int hi) {
#if defined(__AVX512F__)
    __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    w = hi ? _mm512_srli_epi32(w, 4) : _mm512_and_si512(w, _mm512_set1_epi32(15));
    return (vf)_mm512_cvtepi32_ps(w);
#else
    __m256i w = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    w = hi ? _mm256_srli_epi32(w, 4) : _mm256_and_si256(w, _mm256_set1_epi32(15));
    return (vf)_mm256_cvtepi32_ps(w);
#endif
}

/* Weight rows per fused tile: independent accumulator chains, so the multiply-adds are
 * not bound by one chain's latency (2 x FR x rows accumulators in registers). */
#if defined(__AVX512F__)
#define FR 4
#else
#define FR 2
#endif

/* The j-th of the group's vectors of weights (two per group of 32 in either width's
 * pairing: low and high halves on AVX512, halves of each on AVX2). */
static inline vf group_vector(int kind, const void *row, int g, int group, int j, vf sc, vf m0) {
    if (kind == TK_Q8) return widen_i8((const int8_t *)row + g * group + j) * sc + m0;
    /* 4-bit: j < 16 are the low nibbles of bytes j.., j >= 16 the high nibbles of bytes j-16.. */
    const uint8_t *b = (const uint8_t *)row + g * 16;
    return (j < 16 ? widen_nibbles(b + j, 0) : widen_nibbles(b + j - 16, 1)) * sc + m0;
}

static inline __attribute__((always_inline)) void fused_tile(const int mt, const int nr, const float *x, long ldx,
                                                             int kind, const void *qs, const float *scale,
                                                             const float *min, int group, int K, int n0,
                                                             float *sums) {
    const int ng = K / group;
    const size_t row_bytes = kind == TK_Q8 ? (size_t)K : (size_t)K / 2;
    vf acc[FUSED_MAX_ROWS][FR][2];
    for (int i = 0; i < mt; i++)
        for (int r = 0; r < nr; r++) acc[i][r][0] = acc[i][r][1] = vzero();
    for (int g = 0; g < ng; g++) {
        const int k0 = g * group;
        /* Two vectors at a time into the two accumulator halves: constant indices keep
         * every accumulator in a register. */
        for (int j = 0; j < group; j += 2 * TK_VL) {
            const int two = j + TK_VL < group;
            for (int r = 0; r < nr; r++) {
                const size_t at = (size_t)(n0 + r) * ng + g;
                const char *row = (const char *)qs + (size_t)(n0 + r) * row_bytes;
                const vf sc = vbcast(scale[at]), m0 = vbcast(min ? min[at] : 0.0f);
                const vf w0 = group_vector(kind, row, g, group, j, sc, m0);
                for (int i = 0; i < mt; i++) acc[i][r][0] += vload(x + (size_t)i * ldx + k0 + j) * w0;
                if (two) {
                    const vf w1 = group_vector(kind, row, g, group, j + TK_VL, sc, m0);
                    for (int i = 0; i < mt; i++) acc[i][r][1] += vload(x + (size_t)i * ldx + k0 + j + TK_VL) * w1;
                }
            }
        }
    }
    for (int i = 0; i < mt; i++)
        for (int r = 0; r < nr; r++) sums[i * FR + r] = hsum(acc[i][r][0] + acc[i][r][1]);
}

/* Y[m0..m0+mt)[n0..n0+nt) from the dequantized rows w [nt][K]. */
static inline __attribute__((always_inline)) void tile(const int mt, const int nt, const float *x, long ldx,
                                                       const float *w, int K, float *sums) {
    vf acc[MT][NT];
    for (int i = 0; i < mt; i++)
        for (int j = 0; j < nt; j++) acc[i][j] = vzero();
    for (int k = 0; k < K; k += TK_VL) {
        vf wv[NT];
        for (int j = 0; j < nt; j++) wv[j] = vload(w + (size_t)j * K + k);
        for (int i = 0; i < mt; i++) {
            const vf xv = vload(x + (size_t)i * ldx + k);
            for (int j = 0; j < nt; j++) acc[i][j] += xv * wv[j];
        }
    }
    for (int i = 0; i < mt; i++)
        for (int j = 0; j < nt; j++) sums[i * NT + j] = hsum(acc[i][j]);
}

int tk_qgemm(const float *x, long ldx, int kind, const void *qs, const float *scale, const float *min, int group,
             void *y, long ldy, int ydtype, int M, int N, int K, int nthreads) {
    if (K % 32 || (kind != TK_Q8 && kind != TK_Q4) || (group != 16 && group != 32) || (kind == TK_Q4 && group != 32))
        return 1;
    const int num_tiles = (N + NT - 1) / NT;
    int failed = 0;
    if (M <= FUSED_MAX_ROWS) {
        const int fr = M <= 2 ? FR : M <= 4 ? FR / 2 : 1; /* weight rows per tile: 2 x fr x M accumulators */
        const int num_fused = (N + fr - 1) / fr;
#pragma omp parallel for schedule(dynamic, 8) num_threads(nthreads)
        for (int t = 0; t < num_fused; t++) {
            const int n0 = t * fr, nr = N - n0 < fr ? N - n0 : fr;
            float sums[FUSED_MAX_ROWS * FR];
            if (nr == fr && M == 1)
                fused_tile(1, FR, x, ldx, kind, qs, scale, min, group, K, n0, sums);
            else if (nr == fr && M == 2)
                fused_tile(2, FR, x, ldx, kind, qs, scale, min, group, K, n0, sums);
            else if (nr == fr && M == 3)
                fused_tile(3, FR / 2, x, ldx, kind, qs, scale, min, group, K, n0, sums);
            else if (nr == fr && M == 4)
                fused_tile(4, FR / 2, x, ldx, kind, qs, scale, min, group, K, n0, sums);
#if FUSED_MAX_ROWS > 4
            else if (M == 5)
                fused_tile(5, 1, x, ldx, kind, qs, scale, min, group, K, n0, sums);
#endif
            else
                fused_tile(M, nr, x, ldx, kind, qs, scale, min, group, K, n0, sums);
            for (int i = 0; i < M; i++)
                for (int r = 0; r < nr; r++) store_any(y, (size_t)i * ldy + n0 + r, sums[i * FR + r], ydtype);
        }
        return 0;
    }
#pragma omp parallel num_threads(nthreads)
    {
        float *w = aligned_alloc(64, (size_t)NT * K * sizeof(float));
        if (!w) {
#pragma omp atomic write
            failed = 2;
        }
#pragma omp for schedule(dynamic, 1)
        for (int t = 0; t < num_tiles; t++) {
            if (!w) continue;
            const int n0 = t * NT, nt = N - n0 < NT ? N - n0 : NT;
            for (int j = 0; j < nt; j++) dequant_row(kind, qs, scale, min, group, K, n0 + j, w + (size_t)j * K);
            float sums[MT * NT];
            for (int m = 0; m < M; m += MT) {
                const int mt = M - m < MT ? M - m : MT;
                const float *xm = x + (size_t)m * ldx;
                if (mt == MT && nt == NT)
                    tile(MT, NT, xm, ldx, w, K, sums); /* the common case, with literal bounds */
                else
                    tile(mt, nt, xm, ldx, w, K, sums);
                for (int i = 0; i < mt; i++)
                    for (int j = 0; j < nt; j++) store_any(y, (size_t)(m + i) * ldy + n0 + j, sums[i * NT + j], ydtype);
            }
        }
        free(w);
    }
    return failed;
}
