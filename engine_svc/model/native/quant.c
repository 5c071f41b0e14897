/*
 * Y = X @ W^T (+ bias) with W kept quantized: weight-only int8 and 4-bit GEMM.
 *
 * W is packed at load (quant_pack.py) in the panels of the packed GEMM (gemm.c): panel p
 * holds output columns p*NR .. p*NR+NR-1 (zero past N) with K down the rows, so that the NR
 * weights of one k are one pair of vectors, dequantized without a transpose:
 *
 *   kind 8: qs int8  [P][K][NR]          w[k][j] = q * scale + min
 *   kind 4: qs uint8 [P][K/2][NR]        byte (k/2, j): k even in the low nibble, k + 1 in the high
 *   scale, min [P][K/G][NR]               float32 or float16 (sdtype); min NULL: 0
 *   bias [P * NR] float32 in panel order, or NULL
 *
 *   X  [M, K] float32, row stride ldx (bfloat16 activations are widened by the caller)
 *   Y  [M, N] float32 or bfloat16, row stride ldy, rounded once
 *
 * With the SILU_MUL epilogue (gate/up projection) the panels alternate gate q / up q, as
 * gemm.c packs pairs, and Y [M, N] = silu(X @ Wg^T) * (X @ Wu^T).
 *
 * Up to FUSED_MAX_ROWS rows (decode), each k's weights are dequantized in registers and used
 * at once by every row: the quantized bytes are the only weight traffic. One and two rows
 * (one on AVX2) skip the dequantization: each group's sum is s * sum(x q) + m * sum(x)
 * (alg_panel). Wider, each K slice
 * of a panel is dequantized into a float32 [kc][NR] buffer that stays in L1, and gemm.c's
 * micro-tile (gemm_tile.h) runs the row block past it, so the multiply-adds run at the float
 * GEMM's rate while the weights stream at a fifth of its bytes. Either way every output tile
 * is summed whole by one thread, so results do not depend on the thread count; each sum is
 * float32 multiply-adds of exactly the dequantized weights, F.linear(X, dequantized W) up to
 * the order of the additions (for one and two rows, their order and grouping).
 */
#include <stdlib.h>

#include "gemm_tile.h" /* MR, NR, KC, the micro-tile, silu_mul_row */
#include "tandem_kernels.h"

enum { TK_Q8 = 8, TK_Q4 = 4 };
enum { TK_F16 = 2 }; /* scale dtype beside TK_F32 */
enum { EPI_NONE = 0, EPI_SILU_MUL = 1 };

/* Rows that take the register path; past them the dequantized buffer is faster (measured
 * on Zen 5 over SmolLM2's layers: at 8 rows 9.2 ms in registers, 11.8 through the buffer;
 * at 9 to 16 rows two register passes were no faster than the buffer). AVX2 has 16
 * registers, not 32: at 5 and 6 rows the two paths are even there. */
#ifndef FUSED_MAX_ROWS
#if defined(__AVX512F__)
#define FUSED_MAX_ROWS 8
#else
#define FUSED_MAX_ROWS 4
#endif
#endif
/* Rows of the register path's accumulator array. Measured with GCC 12 on AVX2: sized for
 * exactly 4 rows, 4 rows ran 1.5x slower than with the array sized for 6. */
#define FUSED_ACC_ROWS (FUSED_MAX_ROWS < 6 ? 6 : FUSED_MAX_ROWS)

/* Rows that take the groups' algebra (alg_panel): its partial and total sums take 3 ch
 * registers a row and half, with ch chains: 4 for one row on AVX512, 2 otherwise. */
#if defined(__AVX512F__)
#define ALG_MAX_ROWS 2
#define ALG_CHAINS_1 4
#else
#define ALG_MAX_ROWS 1
#define ALG_CHAINS_1 2
#endif

/* How far ahead of the dequantization the quantized bytes are fetched: the hardware
 * prefetcher alone left a 16-row product ~25% slower from memory than from cache. */
#ifndef PF_BYTES
#define PF_BYTES 2048
#endif

typedef struct {
    const float *x;
    int ldx;
    int kind;
    const uint8_t *qs;
    size_t panel_qbytes; /* bytes of qs per panel */
    const void *scale, *min;
    int sdtype, group, ng; /* ng: groups per column, K / group */
    const float *bias;
    void *y;
    long ldy;
    int ydtype;
    int M, N, K, epilogue;
    const float *xsum; /* [M][ng]: each row's sum over each group of K (alg_panel, with mins) */
} qargs;

static inline vf vload_f16(const uint16_t *p) {
#if defined(__AVX512F__)
    return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#else
    return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#endif
}

/* The NR scales (or mins) at index at, as two vectors; zeros where base is NULL. */
static inline void group_vectors(const void *base, int sdtype, size_t at, vf out[2]) {
    if (base == NULL) {
        out[0] = out[1] = vzero();
    } else if (sdtype == TK_F16) {
        out[0] = vload_f16((const uint16_t *)base + at);
        out[1] = vload_f16((const uint16_t *)base + at + TK_VL);
    } else {
        out[0] = vload((const float *)base + at);
        out[1] = vload((const float *)base + at + TK_VL);
    }
}

/* TK_VL int8 / uint8 values -> int32 lanes. */
static inline vi widen_i8(const int8_t *p) {
#if defined(__AVX512F__)
    return (vi)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
#else
    return (vi)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
#endif
}
static inline vi widen_u8(const uint8_t *p) {
#if defined(__AVX512F__)
    return (vi)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
#else
    return (vi)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
#endif
}

/* One k of int8 weights: NR bytes -> w[2]. */
static inline void q8_k(const int8_t *b, const vf s[2], const vf m[2], vf w[2]) {
    w[0] = __builtin_convertvector(widen_i8(b), vf) * s[0] + m[0];
    w[1] = __builtin_convertvector(widen_i8(b + TK_VL), vf) * s[1] + m[1];
}

/* Two k (even, odd) of 4-bit weights: NR bytes -> w0[2] (k), w1[2] (k + 1). */
static inline void q4_pair(const uint8_t *b, const vf s[2], const vf m[2], vf w0[2], vf w1[2]) {
    for (int h = 0; h < 2; h++) {
        const vi u = widen_u8(b + h * TK_VL);
        w0[h] = __builtin_convertvector(u & 15, vf) * s[h] + m[h];
        w1[h] = __builtin_convertvector(u >> 4, vf) * s[h] + m[h];
    }
}

/* -- few rows: dequantized in registers ----------------------------------------------- */

/* cs [mr][NR] = X[0..mr) @ panel p, each k's weights dequantized and used at once. Even and
 * odd k add into separate accumulators (summed at the end), so that a row's chains are not
 * bound by the multiply-add latency; on AVX2 (16 registers) only up to 2 rows. */
static inline __attribute__((always_inline)) void fused_panel(const int mr, const qargs *a, const float *x, int p,
                                                              float *cs) {
    const int par = mr <= (TK_VL == 16 ? 4 : 2); /* odd k in their own accumulators */
    vf acc[FUSED_ACC_ROWS][2][2];
    for (int r = 0; r < mr; r++)
        for (int h = 0; h < 2; h++) acc[r][h][0] = acc[r][h][1] = vzero();
    const size_t sb = (size_t)p * a->ng * NR;
    const uint8_t *q = a->qs + (size_t)p * a->panel_qbytes;
    for (int g = 0; g < a->ng; g++) {
        vf s[2], m[2];
        group_vectors(a->scale, a->sdtype, sb + (size_t)g * NR, s);
        group_vectors(a->min, a->sdtype, sb + (size_t)g * NR, m);
        const int kend = (g + 1) * a->group;
        for (int k = g * a->group; k < kend; k += 2) {
            vf w0[2], w1[2];
            if (a->kind == TK_Q4) {
                __builtin_prefetch(q + (size_t)(k / 2) * NR + PF_BYTES, 0, 3);
                q4_pair(q + (size_t)(k / 2) * NR, s, m, w0, w1);
            } else {
                __builtin_prefetch(q + (size_t)k * NR + PF_BYTES, 0, 3);
                __builtin_prefetch(q + (size_t)k * NR + PF_BYTES + NR, 0, 3);
                q8_k((const int8_t *)q + (size_t)k * NR, s, m, w0);
                q8_k((const int8_t *)q + (size_t)(k + 1) * NR, s, m, w1);
            }
            for (int r = 0; r < mr; r++) {
                const vf x0 = vbcast(x[(size_t)r * a->ldx + k]), x1 = vbcast(x[(size_t)r * a->ldx + k + 1]);
                acc[r][0][0] += x0 * w0[0];
                acc[r][1][0] += x0 * w0[1];
                acc[r][0][par] += x1 * w1[0];
                acc[r][1][par] += x1 * w1[1];
            }
        }
    }
    for (int r = 0; r < mr; r++)
        for (int h = 0; h < 2; h++) vstore(cs + r * NR + h * TK_VL, par ? acc[r][h][0] + acc[r][h][1] : acc[r][h][0]);
}

/* The same product for the fewest rows, by the groups' algebra: within a group g a weight is
 * s * q + m, so a row's sum over the group is s * (sum_k x_k q_k) + m * xs[g], xs[g] = sum_k x_k
 * over the group (a->xsum, computed once per call). Each weight then costs one conversion
 * and one multiply-add instead of a conversion and two, and the group sums run in ch
 * independent chains a row and half (k mod ch ... mod 2 ch), so that one row's adds are not
 * bound by the multiply-add latency. The result is F.linear's up to the order and grouping
 * of the additions (within 1e-5: tests/engine/test_quant_kernels.py). */
static inline __attribute__((always_inline)) void alg_panel(const int mr, const int ch, const qargs *a, const float *x,
                                                            int p, float *cs) {
    vf tot[ALG_MAX_ROWS][2];
    for (int r = 0; r < mr; r++) tot[r][0] = tot[r][1] = vzero();
    const size_t sb = (size_t)p * a->ng * NR;
    const uint8_t *q = a->qs + (size_t)p * a->panel_qbytes;
    for (int g = 0; g < a->ng; g++) {
        vf part[ALG_MAX_ROWS][2][4];
        for (int r = 0; r < mr; r++)
            for (int h = 0; h < 2; h++)
                for (int c = 0; c < ch; c++) part[r][h][c] = vzero();
        const int kend = (g + 1) * a->group;
        for (int k = g * a->group; k < kend; k += 2 * ch) {
            /* ch pairs (k + 2c, k + 2c + 1): chain c takes both k of pair c */
            for (int c = 0; c < ch; c++) {
                const int kk = k + 2 * c;
                vf q0[2], q1[2];
                if (a->kind == TK_Q4) {
                    const uint8_t *b = q + (size_t)(kk / 2) * NR;
                    __builtin_prefetch(b + PF_BYTES, 0, 3);
                    for (int h = 0; h < 2; h++) {
                        const vi u = widen_u8(b + h * TK_VL);
                        q0[h] = __builtin_convertvector(u & 15, vf);
                        q1[h] = __builtin_convertvector(u >> 4, vf);
                    }
                } else {
                    const int8_t *b = (const int8_t *)q + (size_t)kk * NR;
                    __builtin_prefetch(b + PF_BYTES, 0, 3);
                    __builtin_prefetch(b + PF_BYTES + NR, 0, 3);
                    for (int h = 0; h < 2; h++) {
                        q0[h] = __builtin_convertvector(widen_i8(b + h * TK_VL), vf);
                        q1[h] = __builtin_convertvector(widen_i8(b + NR + h * TK_VL), vf);
                    }
                }
                for (int r = 0; r < mr; r++) {
                    const vf x0 = vbcast(x[(size_t)r * a->ldx + kk]), x1 = vbcast(x[(size_t)r * a->ldx + kk + 1]);
                    for (int h = 0; h < 2; h++) part[r][h][c] += x0 * q0[h] + x1 * q1[h];
                }
            }
        }
        vf s[2], m[2];
        group_vectors(a->scale, a->sdtype, sb + (size_t)g * NR, s);
        if (a->min != NULL) group_vectors(a->min, a->sdtype, sb + (size_t)g * NR, m);
        for (int r = 0; r < mr; r++)
            for (int h = 0; h < 2; h++) {
                vf sum = part[r][h][0];
                for (int c = 1; c < ch; c++) sum += part[r][h][c];
                tot[r][h] += sum * s[h];
                if (a->min != NULL) tot[r][h] += vbcast(a->xsum[(size_t)r * a->ng + g]) * m[h];
            }
    }
    for (int r = 0; r < mr; r++)
        for (int h = 0; h < 2; h++) vstore(cs + r * NR + h * TK_VL, tot[r][h]);
}

static void fused_rows(const qargs *a, const float *x, int rows, int p, float *cs) {
    switch (rows) { /* a literal row count per case: the accumulators stay in registers */
#if FUSED_MAX_ROWS >= 8
    case 8: fused_panel(8, a, x, p, cs); break;
#endif
#if FUSED_MAX_ROWS >= 7
    case 7: fused_panel(7, a, x, p, cs); break;
#endif
#if FUSED_MAX_ROWS >= 6
    case 6: fused_panel(6, a, x, p, cs); break;
#endif
#if FUSED_MAX_ROWS >= 5
    case 5: fused_panel(5, a, x, p, cs); break;
#endif
#if FUSED_MAX_ROWS >= 4
    case 4: fused_panel(4, a, x, p, cs); break;
#endif
#if FUSED_MAX_ROWS >= 3
    case 3: fused_panel(3, a, x, p, cs); break;
#endif
#if ALG_MAX_ROWS >= 2
    case 2: alg_panel(2, 2, a, x, p, cs); break;
#else
    case 2: fused_panel(2, a, x, p, cs); break;
#endif
    default: alg_panel(1, ALG_CHAINS_1, a, x, p, cs); break;
    }
}

/* -- wide batches: dequantized into the panel layout, gemm.c's micro-tile ------------- */

/* buf [kc][NR] = the dequantized K slice k0 .. k0 + kc of panel p (k0, kc even). */
static void dequant_slice(const qargs *a, int p, int k0, int kc, float *buf) {
    const size_t sb = (size_t)p * a->ng * NR;
    const uint8_t *q = a->qs + (size_t)p * a->panel_qbytes;
    for (int k = k0; k < k0 + kc;) {
        const int g = k / a->group, kend = (g + 1) * a->group < k0 + kc ? (g + 1) * a->group : k0 + kc;
        vf s[2], m[2];
        group_vectors(a->scale, a->sdtype, sb + (size_t)g * NR, s);
        group_vectors(a->min, a->sdtype, sb + (size_t)g * NR, m);
        if (a->kind == TK_Q4) {
            for (; k < kend; k += 2) {
                vf w0[2], w1[2];
                __builtin_prefetch(q + (size_t)(k / 2) * NR + PF_BYTES, 0, 3);
                q4_pair(q + (size_t)(k / 2) * NR, s, m, w0, w1);
                float *out = buf + (size_t)(k - k0) * NR;
                vstore(out, w0[0]), vstore(out + TK_VL, w0[1]);
                vstore(out + NR, w1[0]), vstore(out + NR + TK_VL, w1[1]);
            }
        } else {
            for (; k < kend; k++) {
                vf w[2];
                __builtin_prefetch(q + (size_t)k * NR + PF_BYTES, 0, 3);
                q8_k((const int8_t *)q + (size_t)k * NR, s, m, w);
                vstore(buf + (size_t)(k - k0) * NR, w[0]), vstore(buf + (size_t)(k - k0) * NR + TK_VL, w[1]);
            }
        }
    }
}

/* cs [rows][NR] = X[m0..m0+rows) @ panel p, a K slice at a time through buf [KC][NR]. */
static void block_times_qpanel(const qargs *a, int m0, int rows, int p, float *buf, float *cs) {
    for (int k0 = 0; k0 < a->K; k0 += KC) {
        const int kc = a->K - k0 < KC ? a->K - k0 : KC;
        dequant_slice(a, p, k0, kc, buf);
        rows_times_l1_slice(a->x + (size_t)m0 * a->ldx + k0, a->ldx, rows, buf, kc, cs, k0 == 0);
    }
}

/* -- int8 activations (W8A8): integer dot products ------------------------------------ */

#if (defined(__AVX512F__) && defined(__AVX512VNNI__)) || (!defined(__AVX512F__) && defined(__AVXVNNI__))
#define TK_INT8_DOT 1
#else
#define TK_INT8_DOT 0
#endif

/* X's rows quantized, per row and group of K (the weight's groups): q = round(x * 127 / a),
 * a = max |x| over the group, to nearest even; the group's scale is a / 127 (0 where a is 0,
 * NaN where the group holds a NaN or an infinity).
 *   q    int8 [M][K], the 8 k of each aligned run in the order the weights' quads take them:
 *        natural for 8-bit weights, k + 0, 2, 4, 6, 1, 3, 5, 7 for 4-bit ones
 *   sx   [M][ng] the scales
 *   xs   [M][ng] sx * sum(q): the group's sum of the dequantized row (for the mins)
 *   xc   [M][ng] 128 * sum(q) (8-bit weights, held biased by 128: see i8_convert) */
typedef struct {
    int8_t *q;
    float *sx, *xs;
    int32_t *xc;
} xquant;

#if TK_INT8_DOT

static inline vi vdot_u8s8(vi acc, vi u, vi s) {
#if defined(__AVX512F__)
    return (vi)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)u, (__m512i)s);
#else
    return (vi)_mm256_dpbusd_avx_epi32((__m256i)acc, (__m256i)u, (__m256i)s);
#endif
}

static inline vi vbcast_i32(int32_t x) {
#if defined(__AVX512F__)
    return (vi)_mm512_set1_epi32(x);
#else
    return (vi)_mm256_set1_epi32(x);
#endif
}

/* One row's groups quantized (xquant's rules). */
static void quantize_row(const float *x, int K, int group, int kind, int8_t *q, float *sx, float *xs, int32_t *xc) {
#if defined(__AVX512F__)
    const __m512i evens_odds = _mm512_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
#else
    const __m256i evens_odds = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
#endif
    for (int g = 0; g < K / group; g++) {
        const float *xg = x + (size_t)g * group;
        vf amax = vzero(), bad = vzero(); /* bad: NaN where some x is NaN or infinite */
        for (int k = 0; k < group; k += TK_VL) {
            const vf v = vload(xg + k);
            amax = vmax(amax, (vf)((vi)v & 0x7fffffff));
            bad += v - v;
        }
#if defined(__AVX512F__)
        float a = _mm512_reduce_max_ps((__m512)amax);
#else
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128((__m256)amax), _mm256_extractf128_ps((__m256)amax, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        float a = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
#endif
        if (vhsum(bad) != 0.0f) a = NAN; /* the group's scale NaN: so are the row's results, as in F.linear */
        const float inv = a > 0.0f ? 127.0f / a : 0.0f;
        vi sum = (vi){0};
        for (int k = 0; k < group; k += TK_VL) {
            vf v = vload(xg + k);
#if defined(__AVX512F__)
            if (kind == TK_Q4) v = (vf)_mm512_permutexvar_ps(evens_odds, (__m512)v);
            const vi qi = (vi)_mm512_cvtps_epi32((__m512)(v * inv));
            _mm_storeu_si128((__m128i *)(q + (size_t)g * group + k), _mm512_cvtepi32_epi8((__m512i)qi));
#else
            if (kind == TK_Q4) v = (vf)_mm256_permutevar8x32_ps((__m256)v, evens_odds);
            const vi qi = (vi)_mm256_cvtps_epi32((__m256)(v * inv));
            const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128((__m256i)qi), _mm256_extracti128_si256((__m256i)qi, 1));
            _mm_storel_epi64((__m128i *)(q + (size_t)g * group + k), _mm_packs_epi16(w, w));
#endif
            sum += qi;
        }
#if defined(__AVX512F__)
        const int32_t total = _mm512_reduce_add_epi32((__m512i)sum);
#else
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128((__m256i)sum), _mm256_extracti128_si256((__m256i)sum, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
        const int32_t total = _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(2, 3, 0, 1))));
#endif
        sx[g] = a / 127.0f;
        xs[g] = sx[g] * (float)total;
        xc[g] = 128 * total;
    }
}

/* 4 rows of NR bytes (row i at r + i * stride) -> two vectors whose 32-bit lane j holds the
 * four bytes of column j (then j + TK_VL), rows in order: the quads of VPDPBUSD. */
static inline void bytes_transpose(const uint8_t *r, size_t stride, vi out[2]) {
#if defined(__AVX512F__)
    const __m256i a0 = _mm256_loadu_si256((const __m256i *)r), a1 = _mm256_loadu_si256((const __m256i *)(r + stride));
    const __m256i a2 = _mm256_loadu_si256((const __m256i *)(r + 2 * stride));
    const __m256i a3 = _mm256_loadu_si256((const __m256i *)(r + 3 * stride));
    const __m256i lo01 = _mm256_unpacklo_epi8(a0, a1), hi01 = _mm256_unpackhi_epi8(a0, a1);
    const __m256i lo23 = _mm256_unpacklo_epi8(a2, a3), hi23 = _mm256_unpackhi_epi8(a2, a3);
    /* per 128-bit lane: c0 columns 0-3 (lane 1: 16-19), c1 4-7, c2 8-11, c3 12-15 */
    const __m256i c0 = _mm256_unpacklo_epi16(lo01, lo23), c1 = _mm256_unpackhi_epi16(lo01, lo23);
    const __m256i c2 = _mm256_unpacklo_epi16(hi01, hi23), c3 = _mm256_unpackhi_epi16(hi01, hi23);
    const __m512i u0 = _mm512_inserti64x4(_mm512_castsi256_si512(c0), c1, 1);
    const __m512i u1 = _mm512_inserti64x4(_mm512_castsi256_si512(c2), c3, 1);
    out[0] = (vi)_mm512_shuffle_i64x2(u0, u1, _MM_SHUFFLE(2, 0, 2, 0));
    out[1] = (vi)_mm512_shuffle_i64x2(u0, u1, _MM_SHUFFLE(3, 1, 3, 1));
#else
    const __m128i a0 = _mm_loadu_si128((const __m128i *)r), a1 = _mm_loadu_si128((const __m128i *)(r + stride));
    const __m128i a2 = _mm_loadu_si128((const __m128i *)(r + 2 * stride));
    const __m128i a3 = _mm_loadu_si128((const __m128i *)(r + 3 * stride));
    const __m128i lo01 = _mm_unpacklo_epi8(a0, a1), hi01 = _mm_unpackhi_epi8(a0, a1);
    const __m128i lo23 = _mm_unpacklo_epi8(a2, a3), hi23 = _mm_unpackhi_epi8(a2, a3);
    out[0] = (vi)_mm256_set_m128i(_mm_unpackhi_epi16(lo01, lo23), _mm_unpacklo_epi16(lo01, lo23));
    out[1] = (vi)_mm256_set_m128i(_mm_unpackhi_epi16(hi01, hi23), _mm_unpacklo_epi16(hi01, hi23));
#endif
}

/* buf [kc/4][NR][4] uint8 = the quantized K slice k0 .. k0 + kc of panel p as VPDPBUSD's
 * unsigned operand: 4-bit weights as they are (8 k at a time: the low nibbles make the quad
 * of k + 0, 2, 4, 6, the high ones k + 1, 3, 5, 7, as the rows were ordered); 8-bit weights
 * plus 128 (q ^ 0x80), which the row's 128 * sum(q) takes back out of each group's sum. */
static void i8_convert(const qargs *a, int p, int k0, int kc, uint8_t *buf) {
    const uint8_t *q = a->qs + (size_t)p * a->panel_qbytes;
    if (a->kind == TK_Q4) {
        for (int k = k0; k < k0 + kc; k += 8) {
            const uint8_t *b = q + (size_t)(k / 2) * NR;
            __builtin_prefetch(b + PF_BYTES, 0, 3);
            __builtin_prefetch(b + PF_BYTES + 2 * NR, 0, 3);
            vi t[2];
            bytes_transpose(b, NR, t);
            vi *out = (vi *)(buf + (size_t)(k - k0) * NR);
            out[0] = t[0] & 0x0f0f0f0f, out[1] = t[1] & 0x0f0f0f0f;
            out[2] = (t[0] >> 4) & 0x0f0f0f0f, out[3] = (t[1] >> 4) & 0x0f0f0f0f;
        }
    } else {
        for (int k = k0; k < k0 + kc; k += 4) {
            const uint8_t *b = q + (size_t)k * NR;
            __builtin_prefetch(b + PF_BYTES, 0, 3);
            __builtin_prefetch(b + PF_BYTES + 2 * NR, 0, 3);
            vi t[2];
            bytes_transpose(b, NR, t);
            vi *out = (vi *)(buf + (size_t)(k - k0) * NR);
            out[0] = t[0] ^ (int32_t)0x80808080, out[1] = t[1] ^ (int32_t)0x80808080;
        }
    }
}

/* Rows of the integer micro-tile: two int32 sums a row for the group in hand; the float32
 * totals stay in cs (L1), added to once a group. Measured on Zen 5 over SmolLM2's layers
 * (int4, 64 and 256 rows): 6 rows ran 1.2-1.3x faster than 4, 8 or 12 (fewer rows reload
 * the weights more often; more run out of registers for the fold). AVX2: 16 registers. */
#if defined(__AVX512F__)
#define I8_MR 6
#else
#define I8_MR 3
#endif

/* cs [mr][NR] += group g's integer sums of rows r .. r + mr, exact until here, scaled:
 * s * sx * sum (minus the bias of 8-bit weights first), plus m * xs for the group's min. */
static inline __attribute__((always_inline)) void i8_fold(const int mr, const int q8, const int has_min,
                                                          const qargs *a, const xquant *xq, int r, int p, int g,
                                                          vi isum[][2], float *cs) {
    const size_t at0 = ((size_t)p * a->ng + g) * NR;
    vf s[2], m[2];
    group_vectors(a->scale, a->sdtype, at0, s);
    if (has_min) group_vectors(a->min, a->sdtype, at0, m);
    for (int i = 0; i < mr; i++) {
        const size_t at = (size_t)(r + i) * a->ng + g;
        const vf sx = vbcast(xq->sx[at]);
        for (int h = 0; h < 2; h++) {
            const vi sum = q8 ? isum[i][h] - vbcast_i32(xq->xc[at]) : isum[i][h];
            vf t = vload(cs + i * NR + h * TK_VL) + __builtin_convertvector(sum, vf) * (s[h] * sx);
            if (has_min) t += m[h] * vbcast(xq->xs[at]);
            vstore(cs + i * NR + h * TK_VL, t);
        }
    }
}

static inline void zero_rows(int mr, float *cs) {
    for (int i = 0; i < mr; i++) vstore(cs + i * NR, vzero()), vstore(cs + i * NR + TK_VL, vzero());
}

/* cs [mr][NR] (=|+=) rows r .. r + mr times the slice k0 .. k0 + kc held in buf. */
static inline __attribute__((always_inline)) void i8_tile(const int mr, const int q8, const int has_min,
                                                          const qargs *a, const xquant *xq, int r, int p, int k0,
                                                          int kc, const uint8_t *buf, float *cs, int first) {
    if (first) zero_rows(mr, cs);
    const int8_t *xr = xq->q + (size_t)r * a->K + k0;
    int g = k0 / a->group;
    for (int k = 0; k < kc; k += a->group, g++) {
        vi isum[I8_MR][2];
        for (int i = 0; i < mr; i++) isum[i][0] = isum[i][1] = (vi){0};
        for (int kk = k; kk < k + a->group; kk += 4) {
            const vi *b = (const vi *)(buf + (size_t)kk * NR);
            const vi b0 = b[0], b1 = b[1];
            for (int i = 0; i < mr; i++) {
                int32_t quad;
                memcpy(&quad, xr + (size_t)i * a->K + kk, 4);
                const vi x4 = vbcast_i32(quad);
                isum[i][0] = vdot_u8s8(isum[i][0], b0, x4);
                isum[i][1] = vdot_u8s8(isum[i][1], b1, x4);
            }
        }
        i8_fold(mr, q8, has_min, a, xq, r, p, g, isum, cs);
    }
}

/* Few rows (one micro-tile): cs [mr][NR] = rows r .. r + mr times panel p, the weights taken
 * from the panel to VPDPBUSD in registers, with no buffer between. */
static inline __attribute__((always_inline)) void i8_tile_direct(const int mr, const int q8, const int has_min,
                                                                 const qargs *a, const xquant *xq, int r, int p,
                                                                 float *cs) {
    zero_rows(mr, cs);
    const uint8_t *qp = a->qs + (size_t)p * a->panel_qbytes;
    const int8_t *xr = xq->q + (size_t)r * a->K;
    for (int g = 0; g < a->ng; g++) {
        vi isum[I8_MR][2];
        for (int i = 0; i < mr; i++) isum[i][0] = isum[i][1] = (vi){0};
        for (int k = g * a->group; k < (g + 1) * a->group; k += 8) {
            vi w[4]; /* quads k .. k + 3 and k + 4 .. k + 7 of the slice's order */
            if (q8) {
                const uint8_t *b = qp + (size_t)k * NR;
                __builtin_prefetch(b + PF_BYTES, 0, 3);
                __builtin_prefetch(b + PF_BYTES + 2 * NR, 0, 3);
                __builtin_prefetch(b + PF_BYTES + 4 * NR, 0, 3);
                __builtin_prefetch(b + PF_BYTES + 6 * NR, 0, 3);
                bytes_transpose(b, NR, w);
                bytes_transpose(b + 4 * NR, NR, w + 2);
                for (int h = 0; h < 4; h++) w[h] ^= (int32_t)0x80808080;
            } else {
                const uint8_t *b = qp + (size_t)(k / 2) * NR;
                __builtin_prefetch(b + PF_BYTES, 0, 3);
                __builtin_prefetch(b + PF_BYTES + 2 * NR, 0, 3);
                vi t[2];
                bytes_transpose(b, NR, t);
                w[0] = t[0] & 0x0f0f0f0f, w[1] = t[1] & 0x0f0f0f0f;
                w[2] = (t[0] >> 4) & 0x0f0f0f0f, w[3] = (t[1] >> 4) & 0x0f0f0f0f;
            }
            for (int i = 0; i < mr; i++) {
                int32_t quad[2];
                memcpy(quad, xr + (size_t)i * a->K + k, 8);
                const vi x0 = vbcast_i32(quad[0]), x1 = vbcast_i32(quad[1]);
                isum[i][0] = vdot_u8s8(isum[i][0], w[0], x0);
                isum[i][1] = vdot_u8s8(isum[i][1], w[1], x0);
                isum[i][0] = vdot_u8s8(isum[i][0], w[2], x1);
                isum[i][1] = vdot_u8s8(isum[i][1], w[3], x1);
            }
        }
        i8_fold(mr, q8, has_min, a, xq, r, p, g, isum, cs);
    }
}

/* A literal row count and layout per call (Q8, HAS_MIN: enum constants of the caller): the
 * sums stay in registers, the fold does only what the weight's layout needs. */
#if I8_MR == 6
#define I8_SWITCH(rows, TILE)                                                                   \
    switch (rows) {                                                                             \
    case 6: TILE(6); break;                                                                     \
    case 5: TILE(5); break;                                                                     \
    case 4: TILE(4); break;                                                                     \
    case 3: TILE(3); break;                                                                     \
    case 2: TILE(2); break;                                                                     \
    default: TILE(1); break;                                                                    \
    }
#elif I8_MR == 3
#define I8_SWITCH(rows, TILE)                                                                   \
    switch (rows) {                                                                             \
    case 3: TILE(3); break;                                                                     \
    case 2: TILE(2); break;                                                                     \
    default: TILE(1); break;                                                                    \
    }
#else
#error "I8_MR is 6 or 3"
#endif
#define I8_TILE(n) i8_tile(n, Q8, HAS_MIN, a, xq, r, p, k0, kc, buf, cs, first)
#define I8_TILE_DIRECT(n) i8_tile_direct(n, Q8, HAS_MIN, a, xq, r, p, cs)
#define I8_LAYOUT(q8, has_min)                                                                  \
    static void i8_rows_##q8##has_min(const qargs *a, const xquant *xq, int r, int rows, int p, int k0, int kc, \
                                      const uint8_t *buf, float *cs, int first) {               \
        enum { Q8 = q8, HAS_MIN = has_min };                                                    \
        I8_SWITCH(rows, I8_TILE)                                                                \
    }                                                                                           \
    static void i8_direct_##q8##has_min(const qargs *a, const xquant *xq, int r, int rows, int p, float *cs) { \
        enum { Q8 = q8, HAS_MIN = has_min };                                                    \
        I8_SWITCH(rows, I8_TILE_DIRECT)                                                         \
    }
I8_LAYOUT(0, 0)
I8_LAYOUT(0, 1)
I8_LAYOUT(1, 0)
I8_LAYOUT(1, 1)

static void i8_rows(const qargs *a, const xquant *xq, int r, int rows, int p, int k0, int kc, const uint8_t *buf,
                    float *cs, int first) {
    if (a->kind == TK_Q8) {
        (a->min ? i8_rows_11 : i8_rows_10)(a, xq, r, rows, p, k0, kc, buf, cs, first);
    } else {
        (a->min ? i8_rows_01 : i8_rows_00)(a, xq, r, rows, p, k0, kc, buf, cs, first);
    }
}

/* cs [rows][NR] = quantized X[r..r+rows) @ panel p, rows <= I8_MR, the whole of K. */
static void i8_direct(const qargs *a, const xquant *xq, int r, int rows, int p, float *cs) {
    if (a->kind == TK_Q8) {
        (a->min ? i8_direct_11 : i8_direct_10)(a, xq, r, rows, p, cs);
    } else {
        (a->min ? i8_direct_01 : i8_direct_00)(a, xq, r, rows, p, cs);
    }
}

/* K per slice of the integer path: whole groups, about 512 k (16 KiB of buf on AVX512). */
static inline int i8_slice(int K, int group) {
    const int kc = group >= 512 ? group : 512 / group * group;
    return kc < K ? kc : K;
}

/* cs [rows][NR] = quantized X[m0..m0+rows) @ panel p, a K slice at a time through buf. */
static void i8_block(const qargs *a, const xquant *xq, int m0, int rows, int p, void *buf, float *cs) {
    if (rows <= I8_MR) { /* one micro-tile: no buffer, each weight converted once anyway */
        i8_direct(a, xq, m0, rows, p, cs);
        return;
    }
    const int kcs = i8_slice(a->K, a->group);
    for (int k0 = 0; k0 < a->K; k0 += kcs) {
        const int kc = a->K - k0 < kcs ? a->K - k0 : kcs;
        i8_convert(a, p, k0, kc, buf);
        for (int r = 0; r < rows; r += I8_MR) {
            const int mr = rows - r < I8_MR ? rows - r : I8_MR;
            i8_rows(a, xq, m0 + r, mr, p, k0, kc, buf, cs + (size_t)r * NR, k0 == 0);
        }
    }
}

#endif /* TK_INT8_DOT */

/* -- the result ----------------------------------------------------------------------- */

/* Rows m0 .. m0+rows of output tile q (columns q*NR ..) from its sums cs (and, for the gate/up
 * epilogue, the up projection's in up), bias added, rounded once to Y's dtype. */
static void store_tile(const qargs *a, int m0, int rows, int q, float *cs, const float *up) {
    const int col0 = q * NR, ncols = a->N - col0 < NR ? a->N - col0 : NR, bf = a->ydtype == TK_BF16;
    for (int r = 0; r < rows; r++) {
        float *cr = cs + (size_t)r * NR;
        if (a->epilogue == EPI_SILU_MUL) {
            const float *bg = a->bias ? a->bias + (size_t)(2 * q) * NR : NULL;
            silu_mul_row(cr, up + (size_t)r * NR, bg, bg ? bg + NR : NULL, bf);
        } else if (a->bias) {
            for (int j = 0; j < NR; j += TK_VL) vstore(cr + j, vload(cr + j) + vload(a->bias + (size_t)q * NR + j));
        }
        const size_t at = (size_t)(m0 + r) * a->ldy + col0;
        if (ncols == NR) {
            vstore_any(a->y, at, vload(cr), a->ydtype);
            vstore_any(a->y, at + TK_VL, vload(cr + TK_VL), a->ydtype);
        } else {
            for (int j = 0; j < ncols; j++) store_any(a->y, at + j, cr[j], a->ydtype);
        }
    }
}

/* cs [rows][NR] = X[m0..m0+rows) @ panel p for a wide product, through a scratch buffer. */
typedef void (*block_fn)(const qargs *a, const xquant *xq, int m0, int rows, int p, void *buf, float *cs);

static void float_block(const qargs *a, const xquant *xq, int m0, int rows, int p, void *buf, float *cs) {
    (void)xq;
    block_times_qpanel(a, m0, rows, p, buf, cs);
}

/* A wide product's (row block of mc rows, output tile) items, handed out by one counter to
 * the threads, each with its own scratch (buf_bytes, and the sums); with xq, X's rows are
 * quantized first by the same threads. Returns 0, or 2 if scratch could not be allocated. */
static int run_items(const qargs *a, const xquant *xq, block_fn block, int mc, size_t buf_bytes, int nthreads) {
    const int M = a->M, silu = a->epilogue == EPI_SILU_MUL, num_tiles = (a->N + NR - 1) / NR;
    const int num_items = (M + mc - 1) / mc * num_tiles;
    int threads = 2.0 * M * a->N * a->K * (silu ? 2 : 1) < 2e5 ? 1 : nthreads;
    if (threads > num_items) threads = num_items;
    int next = 0, failed = 0;
#pragma omp parallel num_threads(threads)
    {
#if TK_INT8_DOT
        if (xq != NULL) { /* every thread takes this branch or none; the loop ends in a barrier */
#pragma omp for schedule(static)
            for (int r = 0; r < M; r++)
                quantize_row(a->x + (size_t)r * a->ldx, a->K, a->group, a->kind, xq->q + (size_t)r * a->K,
                             xq->sx + (size_t)r * a->ng, xq->xs + (size_t)r * a->ng, xq->xc + (size_t)r * a->ng);
        }
#endif
        void *buf = aligned_alloc(64, buf_bytes);
        float *cs = malloc(sizeof(float) * 2 * (size_t)mc * NR);
        if (buf == NULL || cs == NULL) {
#pragma omp atomic write
            failed = 2;
        }
        for (;;) {
            int item;
#pragma omp atomic capture
            item = next++;
            if (item >= num_items || buf == NULL || cs == NULL) break;
            const int mb = item / num_tiles, q = item % num_tiles;
            const int m0 = mb * mc, rows = M - m0 < mc ? M - m0 : mc;
            block(a, xq, m0, rows, silu ? 2 * q : q, buf, cs);
            if (silu) block(a, xq, m0, rows, 2 * q + 1, buf, cs + (size_t)rows * NR);
            store_tile(a, m0, rows, q, cs, cs + (size_t)rows * NR);
        }
        free(buf);
        free(cs);
    }
    return failed;
}

/* Whether this build has the integer dot products of tk_qgemm's int8 activations. */
int tk_qgemm_int8(void) { return TK_INT8_DOT; }

#if TK_INT8_DOT
/* The product with X quantized to int8 (xquant), every row count alike. */
static int qgemm_int8(const qargs *a, int nthreads) {
    const int M = a->M, K = a->K, ng = a->ng;
    xquant xq = {
        .q = malloc((size_t)M * K),
        .sx = malloc(sizeof(float) * (size_t)M * ng),
        .xs = malloc(sizeof(float) * (size_t)M * ng),
        .xc = malloc(sizeof(int32_t) * (size_t)M * ng),
    };
    if (xq.q == NULL || xq.sx == NULL || xq.xs == NULL || xq.xc == NULL) {
        free(xq.q), free(xq.sx), free(xq.xs), free(xq.xc);
        return 2;
    }
    /* Row blocks: a block's quantized X within ~128 KiB of L2. */
    int mc = (128 * 1024 / K) / I8_MR * I8_MR;
    if (mc < I8_MR) mc = I8_MR;
    const int failed = run_items(a, &xq, i8_block, mc, (size_t)i8_slice(K, a->group) * NR, nthreads);
    free(xq.q), free(xq.sx), free(xq.xs), free(xq.xc);
    return failed;
}
#endif

/* xquant 1: X quantized to int8 per row and group (W8A8), in builds with tk_qgemm_int8().
 * Returns 0, 1 on a bad argument, 2 if scratch memory could not be allocated. */
int tk_qgemm(const float *x, long ldx, int kind, const void *qs, const void *scale, const void *min, int sdtype,
             int group, const float *bias, void *y, long ldy, int ydtype, int M, int N, int K, int epilogue,
             int xquant, int nthreads) {
    if (M < 0 || N <= 0 || K <= 0 || K % 32 || (kind != TK_Q8 && kind != TK_Q4) || group < 16 || group % 16 ||
        K % group || (sdtype != TK_F32 && sdtype != TK_F16) || (epilogue != EPI_NONE && epilogue != EPI_SILU_MUL) ||
        ldx > 0x7fffffff || (xquant != 0 && (xquant != 1 || !TK_INT8_DOT || group > 512)))
        return 1;
    if (M == 0) return 0;
    const int silu = epilogue == EPI_SILU_MUL, num_tiles = (N + NR - 1) / NR;
    qargs a = {
        .x = x,
        .ldx = (int)ldx,
        .kind = kind,
        .qs = (const uint8_t *)qs,
        .panel_qbytes = (size_t)K * NR / (kind == TK_Q4 ? 2 : 1),
        .scale = scale,
        .min = min,
        .sdtype = sdtype,
        .group = group,
        .ng = K / group,
        .bias = bias,
        .y = y,
        .ldy = ldy,
        .ydtype = ydtype,
        .M = M,
        .N = N,
        .K = K,
        .epilogue = epilogue,
    };
#if TK_INT8_DOT
    if (xquant) return qgemm_int8(&a, nthreads);
#endif
    const double flops = 2.0 * M * N * K * (silu ? 2 : 1);
    if (M <= FUSED_MAX_ROWS) {
        const int threads = flops < 2e5 ? 1 : nthreads;
        float *xsum = NULL;
        if (M <= ALG_MAX_ROWS && min != NULL) { /* alg_panel's group sums of X */
            xsum = malloc(sizeof(float) * (size_t)M * a.ng);
            if (xsum == NULL) return 2;
            for (int r = 0; r < M; r++)
                for (int g = 0; g < a.ng; g++) {
                    float sum = 0;
                    for (int k = g * group; k < (g + 1) * group; k++) sum += x[(size_t)r * ldx + k];
                    xsum[(size_t)r * a.ng + g] = sum;
                }
            a.xsum = xsum;
        }
#pragma omp parallel for schedule(dynamic, 2) num_threads(threads)
        for (int q = 0; q < num_tiles; q++) {
            float cs[2][FUSED_MAX_ROWS * NR];
            fused_rows(&a, x, M, silu ? 2 * q : q, cs[0]);
            if (silu) fused_rows(&a, x, M, 2 * q + 1, cs[1]);
            store_tile(&a, 0, M, q, cs[0], cs[1]);
        }
        free(xsum);
        return 0;
    }
    /* Row blocks as gemm.c sizes them: a block's X stays within ~384 KiB of L2. */
    int mc = (384 * 1024 / (4 * K)) / MR * MR;
    if (mc < MR) mc = MR;
    return run_items(&a, NULL, float_block, mc, sizeof(float) * KC * NR, nthreads);
}
