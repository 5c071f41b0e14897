/*
 * The quantized GEMM with int8 activations (W8A8, W4A8), in builds with integer dot products
 * (AVX512-VNNI, AVX-VNNI; tk_qgemm_int8()): each row of X quantized per group of the weight's
 * K (xquant in quant.h), the weights turned into VPDPBUSD's unsigned bytes, and each group's
 * sums exact in int32 until they are scaled, once a group, into float32. Every row count
 * takes the work items of quant.c; a row block of one micro-tile reads the panels directly,
 * a wider one converts each K slice once into a buffer for all of its tiles.
 */
#include "quant.h"

#include <stdlib.h>
#include <string.h>

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
void tkq_quantize_row(const float *x, int K, int group, int kind, int8_t *q, float *sx, float *xs, int32_t *xc) {
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
            const __m128i w =
                _mm_packs_epi32(_mm256_castsi256_si128((__m256i)qi), _mm256_extracti128_si256((__m256i)qi, 1));
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
static inline __attribute__((always_inline)) void i8_fold(
    const int mr, const int q8, const int has_min, const qargs *a, const xquant *xq, int r, int p, int g, vi isum[][2],
    float *cs) {
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
static inline __attribute__((always_inline)) void i8_tile(
    const int mr, const int q8, const int has_min, const qargs *a, const xquant *xq, int r, int p, int k0, int kc,
    const uint8_t *buf, float *cs, int first) {
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
static inline __attribute__((always_inline)) void i8_tile_direct(
    const int mr, const int q8, const int has_min, const qargs *a, const xquant *xq, int r, int p, float *cs) {
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
#define I8_SWITCH(rows, TILE) \
    switch (rows) {           \
    case 6: TILE(6); break;   \
    case 5: TILE(5); break;   \
    case 4: TILE(4); break;   \
    case 3: TILE(3); break;   \
    case 2: TILE(2); break;   \
    default: TILE(1); break;  \
    }
#elif I8_MR == 3
#define I8_SWITCH(rows, TILE) \
    switch (rows) {           \
    case 3: TILE(3); break;   \
    case 2: TILE(2); break;   \
    default: TILE(1); break;  \
    }
#else
#error "I8_MR is 6 or 3"
#endif
#define I8_TILE(n) i8_tile(n, Q8, HAS_MIN, a, xq, r, p, k0, kc, buf, cs, first)
#define I8_TILE_DIRECT(n) i8_tile_direct(n, Q8, HAS_MIN, a, xq, r, p, cs)
#define I8_LAYOUT(q8, has_min)                                                                                  \
    static void i8_rows_##q8##has_min(const qargs *a, const xquant *xq, int r, int rows, int p, int k0, int kc, \
                                      const uint8_t *buf, float *cs, int first) {                               \
        enum { Q8 = q8, HAS_MIN = has_min };                                                                    \
        I8_SWITCH(rows, I8_TILE)                                                                                \
    }                                                                                                           \
    static void i8_direct_##q8##has_min(const qargs *a, const xquant *xq, int r, int rows, int p, float *cs) {  \
        enum { Q8 = q8, HAS_MIN = has_min };                                                                    \
        I8_SWITCH(rows, I8_TILE_DIRECT)                                                                         \
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

/* The product with X quantized to int8 (xquant), every row count alike. */
int tkq_int8(const qargs *a, int nthreads) {
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
    const int failed = tkq_run_items(a, &xq, i8_block, mc, (size_t)i8_slice(K, a->group) * NR, nthreads);
    free(xq.q), free(xq.sx), free(xq.xs), free(xq.xc);
    return failed;
}

#endif /* TK_INT8_DOT */
