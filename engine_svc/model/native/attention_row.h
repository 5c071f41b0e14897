/*
 * The arithmetic of one query vector's attention, shared by the decode kernel (attention.c)
 * and the prefill kernel (attention_prefill.c), so that a token's attention output has the
 * same bits whichever kernel computes it and whatever rows share its step: a draft row
 * verified in one step, a decode row, a prompt row in a chunk of any length, or an output
 * token recomputed after a preemption.
 *
 * For query vector q (float32, pre-scaled: scale * q, one float32 product per element) over
 * the context tokens 0 .. len - 1 of its request:
 *
 *   score   s_t = tree(lane sums): lane l holds q[l] k_t[l] + q[l + VL] k_t[l + VL] + ...,
 *           one float32 multiply-add chain per lane in head-dimension order, and the lanes
 *           are added as the fixed tree of hsum below (a function of k_t and q alone: which
 *           tokens are scored with it, and in what group, changes nothing)
 *   softmax p = softmax(s[0 .. len)): the max, exp(s - max) and their sum in the order of
 *           `softmax` (a function of len and the scores alone)
 *   output  o = sum_t p_t v_t, one multiply-add chain per element in token order from 0,
 *           rounded once to the rows' dtype by the caller
 *
 * Every K and V value is read in float32 (a bfloat16 cache widened, which is exact). Head
 * dimensions must be a whole number of vectors (the kernels check it), so no scalar tail
 * ever joins a sum.
 */
#ifndef TANDEM_ATTENTION_ROW_H
#define TANDEM_ATTENTION_ROW_H

#include "tandem_kernels.h"

/* Tokens scored together: their lane sums reduced at once (16 on AVX512, 8 on AVX2). */
#define SCORE_GROUP TK_VL

#if defined(__AVX512F__)
/* Lane t of the result := the lane sum of vector t of 16, as a tree: each level adds pairs of vectors'
 * halves (within 128-bit lanes, then across them), 45 operations for the 16 sums where
 * summing lane by lane costs 16 each. Sum t is, with a = acc[t] and
 * s_j = (a[4j] + a[4j + 2]) + (a[4j + 1] + a[4j + 3]): (s_0 + s_1) + (s_2 + s_3), whatever the
 * other 15 vectors hold. */
static inline __attribute__((always_inline)) vf hsum_group(const vf acc[16]) {
    __m512 l1[8], l2[4], l3[2];
    for (int i = 0; i < 8; i++) { /* tokens 2i, 2i+1: per 128-bit lane (a0+a2, b0+b2, a1+a3, b1+b3) */
        const __m512 a = (__m512)acc[2 * i], b = (__m512)acc[2 * i + 1];
        l1[i] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    }
    for (int i = 0; i < 4; i++) /* tokens 4i .. 4i+3, one partial sum per 128-bit lane */
        l2[i] = _mm512_add_ps(
            _mm512_shuffle_ps(l1[2 * i], l1[2 * i + 1], 0x44), _mm512_shuffle_ps(l1[2 * i], l1[2 * i + 1], 0xEE));
    for (int i = 0; i < 2; i++) /* tokens 8i .. 8i+7, two partial sums each */
        l3[i] = _mm512_add_ps(
            _mm512_shuffle_f32x4(l2[2 * i], l2[2 * i + 1], 0x88), _mm512_shuffle_f32x4(l2[2 * i], l2[2 * i + 1], 0xDD));
    return (vf)_mm512_add_ps(_mm512_shuffle_f32x4(l3[0], l3[1], 0x88), _mm512_shuffle_f32x4(l3[0], l3[1], 0xDD));
}
#else
/* Lane t of the result := the lane sum of vector t of 8, as a tree of horizontal adds: sum t is, with
 * a = acc[t], ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7)), whatever the others hold. */
static inline __attribute__((always_inline)) vf hsum_group(const vf acc[8]) {
    const __m256 t0 = _mm256_hadd_ps((__m256)acc[0], (__m256)acc[1]),
                 t1 = _mm256_hadd_ps((__m256)acc[2], (__m256)acc[3]);
    const __m256 t2 = _mm256_hadd_ps((__m256)acc[4], (__m256)acc[5]),
                 t3 = _mm256_hadd_ps((__m256)acc[6], (__m256)acc[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return (vf)_mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif

/* scores[0..n) = q . k_t for n <= SCORE_GROUP tokens (n a literal where it can be) whose
 * keys start at k + koff + t * stride: a lane-sum vector per token, reduced by hsum_group
 * (the unused ones zero). */
static inline __attribute__((always_inline)) void score_group(
    const int n, const float *q, const void *k, size_t koff, size_t stride, int head_dim, int dtype, float *scores) {
    vf acc[SCORE_GROUP];
    for (int t = 0; t < SCORE_GROUP; t++) acc[t] = vzero();
    for (int d = 0; d < head_dim; d += TK_VL) {
        const vf qv = vload(q + d);
        for (int t = 0; t < n; t++) acc[t] += qv * vload_any(k, koff + (size_t)t * stride + d, dtype);
    }
    const vf sums = hsum_group(acc);
    if (n == SCORE_GROUP) {
        vstore(scores, sums);
        return;
    }
    for (int t = 0; t < n; t++) scores[t] = sums[t];
}

/* scores[0..n) for n contiguous tokens (any n), keys as in score_group. */
static inline __attribute__((always_inline)) void score_tokens(
    const float *q, const void *k, size_t koff, size_t stride, int n, int head_dim, int dtype, float *scores) {
    int i = 0;
    for (; i + SCORE_GROUP <= n; i += SCORE_GROUP)
        score_group(SCORE_GROUP, q, k, koff + (size_t)i * stride, stride, head_dim, dtype, scores + i);
    const size_t at = koff + (size_t)i * stride;
    float *s = scores + i;
    switch (n - i) { /* a literal count per case: the accumulators stay in registers */
#define TAIL(m) score_group(m, q, k, at, stride, head_dim, dtype, s)
#if SCORE_GROUP > 8
    case 15: TAIL(15); break;
    case 14: TAIL(14); break;
    case 13: TAIL(13); break;
    case 12: TAIL(12); break;
    case 11: TAIL(11); break;
    case 10: TAIL(10); break;
    case 9: TAIL(9); break;
    case 8: TAIL(8); break;
#endif
    case 7: TAIL(7); break;
    case 6: TAIL(6); break;
    case 5: TAIL(5); break;
    case 4: TAIL(4); break;
    case 3: TAIL(3); break;
    case 2: TAIL(2); break;
    case 1: TAIL(1); break;
    default: break;
#undef TAIL
    }
}

/* Softmax in place over s[0 .. n). */
static inline void softmax_row(float *s, int n) {
    vf mv = vbcast(-INFINITY);
    int t = 0;
    for (; t + TK_VL <= n; t += TK_VL) mv = vmax(mv, vload(s + t));
    float m = -INFINITY;
    for (int l = 0; l < TK_VL; l++) m = m > mv[l] ? m : mv[l];
    for (; t < n; t++) m = m > s[t] ? m : s[t];
    vf sum = vzero();
    t = 0;
    for (; t + TK_VL <= n; t += TK_VL) {
        const vf e = vexp_nonpositive(vload(s + t) - m);
        vstore(s + t, e);
        sum += e;
    }
    float total = vhsum(sum);
    for (; t < n; t++) {
        s[t] = exp_nonpositive(s[t] - m);
        total += s[t];
    }
    const float c = 1.0f / total;
    for (t = 0; t + TK_VL <= n; t += TK_VL) vstore(s + t, vload(s + t) * c);
    for (; t < n; t++) s[t] *= c;
}

/* Scores of a tile of SCORE_ROWS query vectors by SCORE_GROUP / SCORE_ROWS tokens at once:
 * scores[r][t] (row r at scores + r * s_stride) for the vectors at q + r * q_stride and the
 * tokens of score_group. Each key vector loaded serves every row, each query vector every
 * token; the lane-sum vectors are score_group's, reduced by the same hsum_group, so each
 * score has score_group's bits. */
#if defined(__AVX512F__)
#define SCORE_ROWS 4
#else
#define SCORE_ROWS 2
#endif
#define SCORE_TOKENS (SCORE_GROUP / SCORE_ROWS)

static inline __attribute__((always_inline)) void score_tile(
    const float *q, size_t q_stride, const float *k, size_t stride, int head_dim, float *scores, size_t s_stride) {
    vf acc[SCORE_GROUP]; /* row r, token t: acc[r * SCORE_TOKENS + t] */
    for (int i = 0; i < SCORE_GROUP; i++) acc[i] = vzero();
    for (int d = 0; d < head_dim; d += TK_VL) {
        vf kv[SCORE_TOKENS];
        for (int t = 0; t < SCORE_TOKENS; t++) kv[t] = vload(k + (size_t)t * stride + d);
        for (int r = 0; r < SCORE_ROWS; r++) {
            const vf qv = vload(q + (size_t)r * q_stride + d);
            for (int t = 0; t < SCORE_TOKENS; t++) acc[r * SCORE_TOKENS + t] += qv * kv[t];
        }
    }
    float all[SCORE_GROUP];
    vstore(all, hsum_group(acc));
    for (int r = 0; r < SCORE_ROWS; r++)
        for (int t = 0; t < SCORE_TOKENS; t++) scores[(size_t)r * s_stride + t] = all[r * SCORE_TOKENS + t];
}

/* Query vectors that read the same values, this many at a time in the weighted sum of V
 * (HC for the decode kernel's heads of a KV group, WS_ROWS for the prefill kernel's rows),
 * and vectors of head dimensions per pass: rows * WS_NV accumulators stay in registers. */
#if defined(__AVX512F__)
#define HC 3
#define WS_ROWS 6
#else
#define HC 2
#define WS_ROWS 3
#endif
#define WS_NV 4

/* o[j][0..nv vectors) += sum_t p[j][t] * v_t for hc query vectors j (hc, nv literal at each
 * call) that read the same values, which start at v + voff + t * stride: o and p of vector
 * j at o + j * o_stride and p + j * p_stride. Each value vector is loaded once for the hc
 * vectors, and the hc * nv sums are independent chains of multiply-adds, which keep the FMA
 * units busy where one vector's few chains would wait on their own latency. Each sum adds
 * its tokens in order, whatever hc is and however a caller splits the tokens into calls. */
static inline __attribute__((always_inline)) void weighted_sum_nv(
    const int hc, const int nv, float *o, size_t o_stride, const float *p, size_t p_stride, const void *v, size_t voff,
    size_t stride, int n, int dtype) {
    vf acc[WS_ROWS][WS_NV];
    for (int j = 0; j < hc; j++)
        for (int i = 0; i < nv; i++) acc[j][i] = vload(o + (size_t)j * o_stride + i * TK_VL);
    for (int t = 0; t < n; t++) {
        vf vt[WS_NV];
        for (int i = 0; i < nv; i++) vt[i] = vload_any(v, voff + (size_t)t * stride + i * TK_VL, dtype);
        for (int j = 0; j < hc; j++) {
            const vf pt = vbcast(p[(size_t)j * p_stride + t]);
            for (int i = 0; i < nv; i++) acc[j][i] += pt * vt[i];
        }
    }
    for (int j = 0; j < hc; j++)
        for (int i = 0; i < nv; i++) vstore(o + (size_t)j * o_stride + i * TK_VL, acc[j][i]);
}

/* weighted_sum_nv over the whole head: hc (literal) vectors, head_dim in passes of WS_NV. */
static inline __attribute__((always_inline)) void weighted_sum(
    const int hc, float *o, size_t o_stride, const float *p, size_t p_stride, const void *v, size_t voff, size_t stride,
    int n, int head_dim, int dtype) {
    int d = 0;
    for (; d + WS_NV * TK_VL <= head_dim; d += WS_NV * TK_VL)
        weighted_sum_nv(hc, WS_NV, o + d, o_stride, p, p_stride, v, voff + d, stride, n, dtype);
    for (; d < head_dim; d += TK_VL)
        weighted_sum_nv(hc, 1, o + d, o_stride, p, p_stride, v, voff + d, stride, n, dtype);
}

/* weighted_sum for any count of vectors, up to `most` (HC or WS_ROWS) at a time. */
static inline __attribute__((always_inline)) void weighted_sum_any(
    int count, const int most, float *o, size_t o_stride, const float *p, size_t p_stride, const void *v, size_t voff,
    size_t stride, int n, int head_dim, int dtype) {
    for (int j = 0; j < count;) {
        const int hc = count - j < most ? count - j : most;
        float *oj = o + (size_t)j * o_stride;
        const float *pj = p + (size_t)j * p_stride;
        switch (hc) { /* a literal count per case: the accumulators stay in registers */
#define WS(m) weighted_sum(m, oj, o_stride, pj, p_stride, v, voff, stride, n, head_dim, dtype)
#if WS_ROWS > 3
        case 6: WS(6); break;
        case 5: WS(5); break;
        case 4: WS(4); break;
#endif
        case 3: WS(3); break;
        case 2: WS(2); break;
        default: WS(1); break;
#undef WS
        }
        j += hc;
    }
}

/* A row's context is read in spans of up to SPAN tokens, each within one block (the
 * decode kernel requests the next span while one is worked on; the prefill kernel scores
 * its rows span by span while the span is in L1). */
#define SPAN 16

/* Offset (in elements) of token t of a context of len tokens, and the tokens from t to the
 * end of its span (*n). */
static inline size_t span_at(const int32_t *table, int t, int len, int block_size, size_t token_stride, int *n) {
    const int in_block = block_size - t % block_size, left = len - t;
    *n = in_block < SPAN ? in_block : SPAN;
    if (left < *n) *n = left;
    return ((size_t)table[t / block_size] * block_size + t % block_size) * token_stride;
}

#endif
