/*
 * Attention straight from the paged KV cache: no K/V is gathered or copied by the caller.
 * Layouts (row-major, as engine_svc/model/attention.py documents):
 *
 *   q            [num_tokens, q_row_stride]: query head h of row i at i * q_row_stride + h * head_dim
 *                (the q part of the fused qkv projection can be passed as is)
 *   out          [num_tokens, num_heads, head_dim]
 *   k/v cache    [num_blocks, block_size, num_kv_heads, head_dim]
 *   block_table  [rows, table_stride] int32; token t lives in block table[t / block_size]
 *                at offset t % block_size
 *
 * Query head h reads KV head h / group (transformers' repeat_kv layout). q and out share
 * one dtype (float32 or bfloat16), the caches another (kv_dtype: the same, or bfloat16
 * beside float32 rows); every sum is float32, the output is rounded once.
 *
 * Decode (tk_decode_attention): one query token per row, a row's context is ctx_lens[row]
 * tokens. A row walks its blocks in spans of up to 16 tokens, each read front to back (a
 * block holds every KV head of block_size tokens contiguously), scores for the whole context go to a per-thread
 * buffer, then an exact softmax, then the weighted sum of V, the query heads of a KV
 * group together (each value vector loaded once for them). Threads take rows one at a
 * time from a counter, the next before running the one in hand, and request its first
 * span while the one in hand ends; a row's sums are all one thread's. Every cached key and
 * value of the step is read once.
 *
 * Prefill: attention_prefill.c.
 */
#include <stdlib.h>

#include "tandem_kernels.h"

#define MAX_HEADS 1024

/* Blocks sit anywhere in the pool, so the hardware prefetcher cannot guess the next one:
 * while a block is read, the next one is requested, `chunk` of its `lines` cache lines
 * at a time (part `part`), so that the requests do not pile up. */
static inline void prefetch_part(const char *p, size_t lines, size_t chunk, int part) {
    const size_t lo = chunk * part, hi = lo + chunk < lines ? lo + chunk : lines;
    for (size_t i = lo; i < hi; i++) __builtin_prefetch(p + 64 * i, 0, 3);
}

static inline float dot(const float *a, const void *b, size_t boff, int n, int dtype) {
    vf acc = vzero();
    int d = 0;
    for (; d + TK_VL <= n; d += TK_VL) acc += vload(a + d) * vload_any(b, boff + d, dtype);
    float s = vhsum(acc);
    for (; d < n; d++) s += a[d] * load_any(b, boff + d, dtype);
    return s;
}

#if defined(__AVX512F__)
/* r[j][i] := r[i][j] for an 8 x 8 block of floats. */
static inline __attribute__((always_inline)) void transpose8(__m256 r[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);     /* a0 b0 a1 b1 | a4 b4 a5 b5 */
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]); /* a2 b2 a3 b3 | a6 b6 a7 b7 */
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);     /* a0 b0 c0 d0 | a4 b4 c4 d4 */
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE); /* a1 b1 c1 d1 | a5 .. */
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int j = 0; j < 4; j++) {
        r[j] = _mm256_permute2f128_ps(u[j], u[j + 4], 0x20);
        r[j + 4] = _mm256_permute2f128_ps(u[j], u[j + 4], 0x31);
    }
}
#endif

/* The lane sums of 8 vectors, as one array of 8. AVX512: vhsum's sums, lane 0 to 15 in
 * order, taken for the 8 at once down the columns of their transpose (a lane at a time,
 * vhsum costs more than the dot products it ends). */
static inline __attribute__((always_inline)) void hsum8(const vf acc[8], float *out) {
#if !defined(__AVX512F__)
    const __m256 t0 = _mm256_hadd_ps((__m256)acc[0], (__m256)acc[1]), t1 = _mm256_hadd_ps((__m256)acc[2], (__m256)acc[3]);
    const __m256 t2 = _mm256_hadd_ps((__m256)acc[4], (__m256)acc[5]), t3 = _mm256_hadd_ps((__m256)acc[6], (__m256)acc[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31)));
#else
    __m256 lo[8], hi[8];
    for (int i = 0; i < 8; i++) {
        lo[i] = _mm512_castps512_ps256((__m512)acc[i]);
        hi[i] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd((__m512)acc[i]), 1));
    }
    transpose8(lo); /* lo[l][i]: lane l of acc[i] */
    transpose8(hi);
    __m256 sum = _mm256_setzero_ps(); /* vhsum starts from 0.0f too: -0.0 sums alike */
    for (int l = 0; l < 8; l++) sum = _mm256_add_ps(sum, lo[l]);
    for (int l = 0; l < 8; l++) sum = _mm256_add_ps(sum, hi[l]);
    _mm256_storeu_ps(out, sum);
#endif
}

#if defined(__AVX512F__)
/* out[0..16) := the lane sums of 16 vectors, as a tree: each level adds pairs of vectors'
 * halves (within 128-bit lanes, then across them), 45 operations for the 16 sums where
 * summing lane by lane costs 16 each. */
static inline __attribute__((always_inline)) void hsum16(const vf acc[16], float *out) {
    __m512 l1[8], l2[4], l3[2];
    for (int i = 0; i < 8; i++) { /* tokens 2i, 2i+1: per 128-bit lane (a0+a2, b0+b2, a1+a3, b1+b3) */
        const __m512 a = (__m512)acc[2 * i], b = (__m512)acc[2 * i + 1];
        l1[i] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    }
    for (int i = 0; i < 4; i++) /* tokens 4i .. 4i+3, one partial sum per 128-bit lane */
        l2[i] = _mm512_add_ps(_mm512_shuffle_ps(l1[2 * i], l1[2 * i + 1], 0x44),
                              _mm512_shuffle_ps(l1[2 * i], l1[2 * i + 1], 0xEE));
    for (int i = 0; i < 2; i++) /* tokens 8i .. 8i+7, two partial sums each */
        l3[i] = _mm512_add_ps(_mm512_shuffle_f32x4(l2[2 * i], l2[2 * i + 1], 0x88),
                              _mm512_shuffle_f32x4(l2[2 * i], l2[2 * i + 1], 0xDD));
    _mm512_storeu_ps(out, _mm512_add_ps(_mm512_shuffle_f32x4(l3[0], l3[1], 0x88), _mm512_shuffle_f32x4(l3[0], l3[1], 0xDD)));
}

#endif

/* scores[0..n) = q . k_t for n tokens (8, or 16 on AVX512; a literal) whose keys start at
 * k + t * stride (head_dim a multiple of TK_VL): n partial-sum vectors, reduced together. */
static inline __attribute__((always_inline)) void dots(const int n, const float *q, const void *k, size_t koff,
                                                       size_t stride, int head_dim, int dtype, float *scores) {
    vf acc[16];
    for (int t = 0; t < n; t++) acc[t] = vzero();
    for (int d = 0; d < head_dim; d += TK_VL) {
        const vf qv = vload(q + d);
        for (int t = 0; t < n; t++) acc[t] += qv * vload_any(k, koff + (size_t)t * stride + d, dtype);
    }
#if defined(__AVX512F__)
    if (n == 16) {
        hsum16(acc, scores);
        return;
    }
#endif
    hsum8(acc, scores);
}

/* Query heads that share a KV head, this many at a time in the weighted sum of V, and
 * vectors of head dimensions per pass: HC * WS_NV accumulators stay in registers. */
#if defined(__AVX512F__)
#define HC 3
#else
#define HC 2
#endif
#define WS_NV 4

/* o[j][0..nv vectors) += sum_t p[j][t] * v_t for hc heads j (hc, nv literal at each call)
 * that read the same values, which start at v + t * stride: o and p of head j at
 * o + j * head_dim and p + j * p_stride. Each value vector is loaded once for the hc heads,
 * and the hc * nv sums are independent chains of multiply-adds, which keep the FMA units
 * busy where one head's few chains would wait on their own latency. Each sum adds its
 * tokens in order, whatever hc is. */
static inline __attribute__((always_inline)) void weighted_sum_heads_nv(
    const int hc, const int nv, float *o, int head_dim, const float *p, int p_stride, const void *v, size_t voff,
    size_t stride, int n, int dtype) {
    vf acc[HC][WS_NV];
    for (int j = 0; j < hc; j++)
        for (int i = 0; i < nv; i++) acc[j][i] = vload(o + (size_t)j * head_dim + i * TK_VL);
    for (int t = 0; t < n; t++) {
        vf vt[WS_NV];
        for (int i = 0; i < nv; i++) vt[i] = vload_any(v, voff + (size_t)t * stride + i * TK_VL, dtype);
        for (int j = 0; j < hc; j++) {
            const vf pt = vbcast(p[(size_t)j * p_stride + t]);
            for (int i = 0; i < nv; i++) acc[j][i] += pt * vt[i];
        }
    }
    for (int j = 0; j < hc; j++)
        for (int i = 0; i < nv; i++) vstore(o + (size_t)j * head_dim + i * TK_VL, acc[j][i]);
}

static inline __attribute__((always_inline)) void weighted_sum_heads(const int hc, float *o, const float *p,
                                                                     int p_stride, const void *v, size_t voff,
                                                                     size_t stride, int n, int head_dim, int dtype) {
    int d = 0;
    for (; d + WS_NV * TK_VL <= head_dim; d += WS_NV * TK_VL)
        weighted_sum_heads_nv(hc, WS_NV, o + d, head_dim, p, p_stride, v, voff + d, stride, n, dtype);
    for (; d < head_dim; d += TK_VL) weighted_sum_heads_nv(hc, 1, o + d, head_dim, p, p_stride, v, voff + d, stride, n, dtype);
}

/* Softmax in place over s[0 .. n). */
static void softmax(float *s, int n) {
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

/* A decode row reads its context in spans of up to SPAN tokens, each within one block: while
 * every head reads a span (from L1 once its first head has brought it in), the next span is
 * requested. With blocks of 16 tokens a span is a block; with larger blocks, a span keeps
 * what is requested ahead to a fixed size, which L1 holds beside the span being read. */
#define SPAN 16

/* Offset (in elements) of token t of a row's context, and the tokens from t to the end of
 * its span. */
static inline size_t span_at(const int32_t *table, int t, int len, int block_size, size_t token_stride, int *n) {
    const int in_block = block_size - t % block_size, left = len - t;
    *n = in_block < SPAN ? in_block : SPAN;
    if (left < *n) *n = left;
    return ((size_t)table[t / block_size] * block_size + t % block_size) * token_stride;
}

/* One decode row. qf: the row's query heads in float32, pre-scaled; of: float32 output;
 * scores [heads][len]. Span by span, every head reads the span while it is in L1, and the
 * next span is requested while this one is worked on: the K pass's last span requests the
 * V pass's first, and the V pass's last requests `after` (the first K span of the row this
 * thread takes next, or NULL), so that neither pass nor row starts on a cold span. */
static inline __attribute__((always_inline)) void decode_row(float *of, const float *qf, const char *k_cache, const char *v_cache, const int32_t *table,
                       int len, int num_heads, int group, int head_dim, int block_size,
                       size_t token_stride, size_t elem, int dtype, float *scores, const char *after) {
    const int vec = head_dim % TK_VL == 0;
    const int num_kv_heads = num_heads / group;
    const size_t lines = ((size_t)(block_size < SPAN ? block_size : SPAN) * token_stride * elem + 63) / 64;
    const size_t k_chunk = (lines + num_heads - 1) / num_heads, v_chunk = (lines + num_kv_heads - 1) / num_kv_heads;
    int n, n_next = 0;
    const size_t first = span_at(table, 0, len, block_size, token_stride, &n);
    size_t kb = first;
    for (int t0 = 0; t0 < len; t0 += n, n = n_next) {
        const int more = t0 + n < len;
        const size_t next = more ? span_at(table, t0 + n, len, block_size, token_stride, &n_next) : kb;
        const char *k_next = more ? k_cache + next * elem : v_cache + first * elem;
        for (int h = 0; h < num_heads; h++) {
            prefetch_part(k_next, lines, k_chunk, h);
            const float *qh = qf + (size_t)h * head_dim;
            float *sh = scores + (size_t)h * len + t0;
            const size_t koff = kb + (size_t)(h / group) * head_dim;
            int i = 0;
#if defined(__AVX512F__)
            if (vec)
                for (; i + 16 <= n; i += 16) dots(16, qh, k_cache, koff + (size_t)i * token_stride, token_stride, head_dim, dtype, sh + i);
#endif
            if (vec)
                for (; i + 8 <= n; i += 8) dots(8, qh, k_cache, koff + (size_t)i * token_stride, token_stride, head_dim, dtype, sh + i);
            for (; i < n; i++) sh[i] = dot(qh, k_cache, koff + (size_t)i * token_stride, head_dim, dtype);
        }
        kb = next;
    }
    for (int h = 0; h < num_heads; h++) softmax(scores + (size_t)h * len, len);
    memset(of, 0, sizeof(float) * (size_t)num_heads * head_dim);
    size_t vb = span_at(table, 0, len, block_size, token_stride, &n), v_next_off;
    for (int t0 = 0; t0 < len; t0 += n, n = n_next, vb = v_next_off) {
        const int more = t0 + n < len;
        v_next_off = more ? span_at(table, t0 + n, len, block_size, token_stride, &n_next) : vb;
        const char *v_next = more ? v_cache + v_next_off * elem : after;
        for (int g = 0; g < num_kv_heads; g++) { /* the group of query heads that read KV head g */
            if (v_next != NULL) prefetch_part(v_next, lines, v_chunk, g);
            const size_t voff = vb + (size_t)g * head_dim;
            for (int h = g * group; h < (g + 1) * group;) {
                const float *ph = scores + (size_t)h * len + t0;
                float *oh = of + (size_t)h * head_dim;
                const int hc = (g + 1) * group - h < HC ? (g + 1) * group - h : HC;
                if (vec) {
                    switch (hc) {
#if HC > 2
                    case 3: weighted_sum_heads(3, oh, ph, len, v_cache, voff, token_stride, n, head_dim, dtype); break;
#endif
                    case 2: weighted_sum_heads(2, oh, ph, len, v_cache, voff, token_stride, n, head_dim, dtype); break;
                    default: weighted_sum_heads(1, oh, ph, len, v_cache, voff, token_stride, n, head_dim, dtype); break;
                    }
                    h += hc;
                } else {
                    for (int i = 0; i < n; i++)
                        for (int d = 0; d < head_dim; d++) oh[d] += ph[i] * load_any(v_cache, voff + (size_t)i * token_stride + d, dtype);
                    h++;
                }
            }
        }
    }
}

/* Returns 0, 1 if a scratch buffer could not be allocated, 2 on a bad shape. */
int tk_decode_attention(void *out, const void *q, long q_row_stride, const void *k_cache, const void *v_cache,
                        const int32_t *block_table, const int32_t *ctx_lens, int num_rows, int num_heads,
                        int num_kv_heads, int head_dim, int block_size, int table_stride, int max_ctx_len,
                        float scale, int dtype, int kv_dtype, int num_threads) {
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || num_heads > MAX_HEADS || head_dim <= 0 ||
        block_size <= 0)
        return 2;
    const int group = num_heads / num_kv_heads;
    const size_t token_stride = (size_t)num_kv_heads * head_dim, elem = kv_dtype == TK_BF16 ? 2 : 4;
    const size_t row_elems = (size_t)num_heads * head_dim;
    int failed = 0, next_row = 0;
    int threads = num_rows < num_threads ? num_rows : num_threads;
    if (threads < 1) threads = 1;
#pragma omp parallel num_threads(threads)
    {
        float *scores = malloc(sizeof(float) * ((size_t)num_heads * (max_ctx_len > 0 ? max_ctx_len : 1) + 2 * row_elems));
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        float *qf = scores + (size_t)num_heads * (max_ctx_len > 0 ? max_ctx_len : 1), *of = qf + row_elems;
        /* Rows from one counter, each taken before the one in hand is run, so its first
         * span can be requested while the one in hand ends. */
        int row;
#pragma omp atomic capture
        row = next_row++;
        while (scores != NULL && row < num_rows) {
            int row_after, n;
#pragma omp atomic capture
            row_after = next_row++;
            const char *after = NULL;
            if (row_after < num_rows && ctx_lens[row_after] > 0 && max_ctx_len > 0)
                after = (const char *)k_cache + span_at(block_table + (size_t)row_after * table_stride, 0, 1, block_size,
                                                        token_stride, &n) * elem;
            const int len = ctx_lens[row] > 0 ? (ctx_lens[row] < max_ctx_len ? ctx_lens[row] : max_ctx_len) : 0;
            for (size_t i = 0; i < row_elems; i++) qf[i] = scale * load_any(q, (size_t)row * q_row_stride + i, dtype);
            const int32_t *table = block_table + (size_t)row * table_stride;
            /* one copy of the row loop per cache dtype, so no load tests the dtype */
            if (len > 0 && kv_dtype == TK_BF16)
                decode_row(of, qf, (const char *)k_cache, (const char *)v_cache, table, len, num_heads, group,
                           head_dim, block_size, token_stride, elem, TK_BF16, scores, after);
            else if (len > 0)
                decode_row(of, qf, (const char *)k_cache, (const char *)v_cache, table, len, num_heads, group,
                           head_dim, block_size, token_stride, elem, TK_F32, scores, after);
            else
                memset(of, 0, sizeof(float) * row_elems);
            size_t i = 0;
            for (; i + TK_VL <= row_elems; i += TK_VL) vstore_any(out, (size_t)row * row_elems + i, vload(of + i), dtype);
            for (; i < row_elems; i++) store_any(out, (size_t)row * row_elems + i, of[i], dtype);
            row = row_after;
        }
        free(scores);
    }
    return failed;
}
