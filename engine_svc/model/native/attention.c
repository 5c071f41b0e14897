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
 * tokens. A row walks its blocks and reads each front to back (a block holds every KV head
 * of block_size tokens contiguously), scores for the whole context go to a per-thread
 * buffer, then an exact softmax, then the weighted sum of V, the query heads of a KV
 * group together (each value vector loaded once for them). Rows are split across threads,
 * one at a time; a row's sums are all one thread's. Every cached key and value of the
 * step is read once.
 *
 * Prefill (tk_prefill_attention): chunks of consecutive query tokens, chunk c at rows
 * chunk_rows[c] .. + chunk_lens[c] and positions chunk_starts[c] ..; the chunk's own K/V
 * are in the cache already, and token p attends to positions 0 .. p (causal with an
 * offset, so chunked prefill and prefix-cache hits need nothing special). Work items are
 * (chunk, tile of QT query tokens, KV head), heaviest first, handed out by one counter.
 * An item keeps its group's QT * group query vectors, their output and running softmax
 * in the core's cache, and walks the blocks up to its last position, flash-attention
 * style: per block, K is transposed (and V widened) into a float32 buffer, then
 * S = Q K^T and O += P V run as small register-tiled products.
 */
#include <stdlib.h>

#include "gemm_bf16.h"
#include "tandem_kernels.h"

#define MAX_HEADS 1024
#define QT 16 /* query tokens per prefill item */
#define MR 12 /* rows per register tile */

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
 * next span is requested while this one is worked on. */
static inline __attribute__((always_inline)) void decode_row(float *of, const float *qf, const char *k_cache, const char *v_cache, const int32_t *table,
                       int len, int num_heads, int group, int head_dim, int block_size,
                       size_t token_stride, size_t elem, int dtype, float *scores) {
    const int vec = head_dim % TK_VL == 0;
    const int num_kv_heads = num_heads / group;
    const size_t lines = ((size_t)(block_size < SPAN ? block_size : SPAN) * token_stride * elem + 63) / 64;
    const size_t k_chunk = (lines + num_heads - 1) / num_heads, v_chunk = (lines + num_kv_heads - 1) / num_kv_heads;
    int n, n_next = 0;
    size_t kb = span_at(table, 0, len, block_size, token_stride, &n);
    for (int t0 = 0; t0 < len; t0 += n, n = n_next) {
        const size_t next = t0 + n < len ? span_at(table, t0 + n, len, block_size, token_stride, &n_next) : kb;
        const char *k_next = k_cache + next * elem;
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
        v_next_off = t0 + n < len ? span_at(table, t0 + n, len, block_size, token_stride, &n_next) : vb;
        const char *v_next = v_cache + v_next_off * elem;
        for (int g = 0; g < num_kv_heads; g++) { /* the group of query heads that read KV head g */
            prefetch_part(v_next, lines, v_chunk, g);
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
    int failed = 0;
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
#pragma omp for schedule(dynamic, 1)
        for (int row = 0; row < num_rows; row++) {
            if (scores == NULL) continue;
            const int len = ctx_lens[row] > 0 ? (ctx_lens[row] < max_ctx_len ? ctx_lens[row] : max_ctx_len) : 0;
            for (size_t i = 0; i < row_elems; i++) qf[i] = scale * load_any(q, (size_t)row * q_row_stride + i, dtype);
            const int32_t *table = block_table + (size_t)row * table_stride;
            /* one copy of the row loop per cache dtype, so no load tests the dtype */
            if (len > 0 && kv_dtype == TK_BF16)
                decode_row(of, qf, (const char *)k_cache, (const char *)v_cache, table, len, num_heads, group,
                           head_dim, block_size, token_stride, elem, TK_BF16, scores);
            else if (len > 0)
                decode_row(of, qf, (const char *)k_cache, (const char *)v_cache, table, len, num_heads, group,
                           head_dim, block_size, token_stride, elem, TK_F32, scores);
            else
                memset(of, 0, sizeof(float) * row_elems);
            size_t i = 0;
            for (; i + TK_VL <= row_elems; i += TK_VL) vstore_any(out, (size_t)row * row_elems + i, vload(of + i), dtype);
            for (; i < row_elems; i++) store_any(out, (size_t)row * row_elems + i, of[i], dtype);
        }
        free(scores);
    }
    return failed;
}

/* Accumulators one register tile of small_gemm holds: 24 of AVX512's 32 vector registers,
 * 12 of AVX2's 16 (the rest hold B's vectors and A's broadcast). */
#if defined(__AVX512F__)
#define TILE_ACC 24
#else
#define TILE_ACC 12
#endif

/* C[0..mr)[0..nv vectors) (= or +=) A[0..mr)[0..kdim) B[0..kdim)[0..nv vectors), one
 * register tile (mr, nv literal at each call). A is read with any row and k strides (rows
 * of K, or columns of P^T). Each sum is a chain of multiply-adds in k order, whatever the
 * tile's shape. */
static inline __attribute__((always_inline)) void tile(const int mr, const int nv, float *c, size_t ldc, const float *a,
                                                       size_t ars, size_t aks, const float *b, size_t ldb, int kdim,
                                                       int accumulate) {
    vf acc[MR][4];
    for (int r = 0; r < mr; r++)
        for (int i = 0; i < nv; i++) acc[r][i] = accumulate ? vload(c + (size_t)r * ldc + i * TK_VL) : vzero();
    for (int k = 0; k < kdim; k++) {
        vf bk[4];
        for (int i = 0; i < nv; i++) bk[i] = vload(b + (size_t)k * ldb + i * TK_VL);
        for (int r = 0; r < mr; r++) {
            const vf ar = vbcast(a[(size_t)r * ars + (size_t)k * aks]);
            for (int i = 0; i < nv; i++) acc[r][i] += ar * bk[i];
        }
    }
    for (int r = 0; r < mr; r++)
        for (int i = 0; i < nv; i++) vstore(c + (size_t)r * ldc + i * TK_VL, acc[r][i]);
}

/* Rows r0 .. rows of small_gemm's product at columns [j, j + nv vectors), one vector at a
 * time in tiles of up to MR rows. */
static void narrow_rows(float *c, size_t ldc, const float *a, size_t ars, size_t aks, const float *b, size_t ldb,
                        int r0, int rows, int j, int nv, int kdim, int accumulate) {
    for (int jj = j; jj < j + nv * TK_VL; jj += TK_VL)
        for (int r = r0; r < rows; r += MR) {
            float *cr = c + (size_t)r * ldc + jj;
            const float *ar = a + (size_t)r * ars, *bj = b + jj;
            switch (rows - r < MR ? rows - r : MR) { /* a literal row count per case: the tile stays in registers */
#define NARROW(m) tile(m, 1, cr, ldc, ar, ars, aks, bj, ldb, kdim, accumulate)
            case 12: NARROW(12); break;
            case 11: NARROW(11); break;
            case 10: NARROW(10); break;
            case 9: NARROW(9); break;
            case 8: NARROW(8); break;
            case 7: NARROW(7); break;
            case 6: NARROW(6); break;
            case 5: NARROW(5); break;
            case 4: NARROW(4); break;
            case 3: NARROW(3); break;
            case 2: NARROW(2); break;
            default: NARROW(1); break;
#undef NARROW
            }
        }
}

/* C[rows][cols] (= or +=) A[rows][kdim] B[kdim][cols]; cols a multiple of TK_VL. Columns in
 * groups of up to 4 vectors, rows in tiles of TILE_ACC / nv: each B vector loaded serves
 * every row of the tile, each broadcast of A every vector (one vector wide, a tile of 12
 * rows needed 13 loads for its 12 multiply-adds); the rows past the last whole tile go
 * one vector at a time. */
static void small_gemm(float *c, size_t ldc, const float *a, size_t ars, size_t aks, const float *b, size_t ldb,
                       int rows, int cols, int kdim, int accumulate) {
    for (int j = 0; j < cols;) {
        const int left = (cols - j) / TK_VL, nv = left < 4 ? left : 4;
        int r = 0;
        switch (nv) { /* literal tile shapes */
#define WIDE(n)                                                                                                       \
    for (; r + TILE_ACC / (n) <= rows; r += TILE_ACC / (n))                                                          \
        tile(TILE_ACC / (n), n, c + (size_t)r * ldc + j, ldc, a + (size_t)r * ars, ars, aks, b + j, ldb, kdim, accumulate)
        case 4: WIDE(4); break;
        case 3: WIDE(3); break;
        case 2: WIDE(2); break;
        default: break;
#undef WIDE
        }
        narrow_rows(c, ldc, a, ars, aks, b, ldb, r, rows, j, nv, kdim, accumulate);
        j += nv * TK_VL;
    }
}

#if TK_BF16_DP
/* S^T [0..mt)[0..nv vectors) := K [mt tokens][hd] Q^T, as bfloat16 dot products (AVX512-BF16
 * builds, bfloat16 rows over a bfloat16 cache): each step takes a pair of dimensions, a
 * key's pair broadcast against Q^T's pairs (qt2 [hd/2][rows][2]), with float32 sums; the
 * scale is the caller's to apply. k: the first token's key, ks: elements between tokens. */
static inline __attribute__((always_inline)) void scores_dp_tile(const int mt, const int nv, float *st, int rows,
                                                                 const bf16 *k, size_t ks, const bf16 *qt2, int hd) {
    __m512 acc[8][3];
    for (int t = 0; t < mt; t++)
        for (int i = 0; i < nv; i++) acc[t][i] = _mm512_setzero_ps();
    for (int p = 0; p < hd / 2; p++) {
        __m512bh b[3];
        for (int i = 0; i < nv; i++) b[i] = (__m512bh)_mm512_loadu_si512(qt2 + ((size_t)p * rows + i * 16) * 2);
        for (int t = 0; t < mt; t++) {
            int32_t pair;
            memcpy(&pair, k + (size_t)t * ks + 2 * p, 4);
            const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
            for (int i = 0; i < nv; i++) acc[t][i] = _mm512_dpbf16_ps(acc[t][i], a, b[i]);
        }
    }
    for (int t = 0; t < mt; t++)
        for (int i = 0; i < nv; i++) _mm512_storeu_ps(st + (size_t)t * rows + i * 16, acc[t][i]);
}

/* S^T [ntok][rows] = K Q^T over bfloat16 pairs: tokens 8 at a time, columns 3 vectors at a time. */
static void scores_dp(float *st, int rows, const bf16 *k, size_t ks, const bf16 *qt2, int ntok, int hd) {
    for (int j = 0; j < rows; j += 48) {
        const int nv = (rows - j) / 16 < 3 ? (rows - j) / 16 : 3;
        const bf16 *qj = qt2 + (size_t)j * 2;
        for (int t = 0; t < ntok;) {
            const int mt = ntok - t >= 8 ? 8 : 1;
            float *sj = st + (size_t)t * rows + j;
            const bf16 *kt = k + (size_t)t * ks;
#define SCORES(m)                                                      \
    switch (nv) {                                                      \
    case 3: scores_dp_tile(m, 3, sj, rows, kt, ks, qj, hd); break;     \
    case 2: scores_dp_tile(m, 2, sj, rows, kt, ks, qj, hd); break;     \
    default: scores_dp_tile(m, 1, sj, rows, kt, ks, qj, hd); break;    \
    }
            if (mt == 8)
                SCORES(8)
            else
                SCORES(1)
#undef SCORES
            t += mt;
        }
    }
}

/* The interleave of pair_layouts below: 32-bit lane i of the result is (x[i], x[16 + i]). */
static inline __m512i interleave_halves(__m512i x) {
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(idx, x);
}

/* O += P V with P rounded to bfloat16, as bfloat16 dot products over pairs of tokens (torch's
 * CPU flash attention rounds P to the rows' dtype before its P V product too). pb: P in pairs,
 * [(ntok + 1) / 2][rows], lane (P[j][t], P[j][t + 1]); vp: V in pairs, [(ntok + 1) / 2][hd],
 * lane (V[t][d], V[t + 1][d]); a missing t + 1 is 0 in both. */
static void p_pairs(bf16 *pb, const float *st, int rows, int ntok) {
    for (int t = 0; t < ntok; t += 2)
        for (int j = 0; j < rows; j += 16) {
            const __m512 a = _mm512_loadu_ps(st + (size_t)t * rows + j);
            const __m512 b = t + 1 < ntok ? _mm512_loadu_ps(st + (size_t)(t + 1) * rows + j) : _mm512_setzero_ps();
            _mm512_storeu_si512(pb + ((size_t)(t / 2) * rows + j) * 2, interleave_halves((__m512i)_mm512_cvtne2ps_pbh(b, a)));
        }
}

static void v_pairs(bf16 *vp, const bf16 *v, size_t ks, int ntok, int hd) {
    for (int t = 0; t < ntok; t += 2)
        for (int d = 0; d < hd; d += 16) {
            const __m256i a = _mm256_loadu_si256((const __m256i *)(v + (size_t)t * ks + d));
            const __m256i b = t + 1 < ntok ? _mm256_loadu_si256((const __m256i *)(v + (size_t)(t + 1) * ks + d))
                                           : _mm256_setzero_si256();
            _mm512_storeu_si512(vp + ((size_t)(t / 2) * hd + d) * 2,
                                interleave_halves(_mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1)));
        }
}

/* O [4 rows][nv vectors] += P V over np token pairs (nv literal). */
static inline __attribute__((always_inline)) void pv_dp_tile(const int nv, float *o, int hd, const bf16 *pb, int rows,
                                                             const bf16 *vp, int np) {
    __m512 acc[4][4];
    for (int r = 0; r < 4; r++)
        for (int i = 0; i < nv; i++) acc[r][i] = _mm512_loadu_ps(o + (size_t)r * hd + i * 16);
    for (int p = 0; p < np; p++) {
        __m512bh b[4];
        for (int i = 0; i < nv; i++) b[i] = (__m512bh)_mm512_loadu_si512(vp + ((size_t)p * hd + i * 16) * 2);
        for (int r = 0; r < 4; r++) {
            int32_t pair;
            memcpy(&pair, pb + ((size_t)p * rows + r) * 2, 4);
            const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
            for (int i = 0; i < nv; i++) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], a, b[i]);
        }
    }
    for (int r = 0; r < 4; r++)
        for (int i = 0; i < nv; i++) _mm512_storeu_ps(o + (size_t)r * hd + i * 16, acc[r][i]);
}

/* O [rows][hd] += P V: rows a multiple of 16, hd of 16. */
static void pv_dp(float *o, int hd, const bf16 *pb, int rows, const bf16 *vp, int np) {
    for (int d = 0; d < hd; d += 64) {
        const int nv = (hd - d) / 16 < 4 ? (hd - d) / 16 : 4;
        for (int r = 0; r < rows; r += 4) {
            float *od = o + (size_t)r * hd + d;
            const bf16 *pr = pb + (size_t)r * 2, *vd = vp + (size_t)d * 2;
            switch (nv) {
            case 4: pv_dp_tile(4, od, hd, pr, rows, vd, np); break;
            case 3: pv_dp_tile(3, od, hd, pr, rows, vd, np); break;
            case 2: pv_dp_tile(2, od, hd, pr, rows, vd, np); break;
            default: pv_dp_tile(1, od, hd, pr, rows, vd, np); break;
            }
        }
    }
}
#endif

typedef struct {
    int chunk, tile, kv_head, first_pos;
} prefill_item;

static int by_context_desc(const void *a, const void *b) {
    const prefill_item *x = a, *y = b;
    if (x->first_pos != y->first_pos) return x->first_pos > y->first_pos ? -1 : 1;
    if (x->chunk != y->chunk) return x->chunk - y->chunk;
    return x->kv_head - y->kv_head;
}

/* One prefill item: rows = QT * group query vectors (query token j / group, head
 * kv_head * group + j % group; rows past the chunk's end are zero and never stored).
 * Buffers: qt [hd][rows] (Q^T, pre-scaled), o [rows][hd], st [bs][rows] (S^T, then P^T),
 * kb, vb [bs][hd] (the block's K and V in float32, for a bfloat16 cache), m, l [rows]. */
typedef struct {
    float *qt, *o, *st, *kb, *vb, *m, *l, *pb;
} prefill_scratch;

static void prefill_item_run(const prefill_item *it, void *out, const void *q, long q_row_stride, const char *k_cache,
                             const char *v_cache, const int32_t *table, int chunk_row, int chunk_start, int chunk_len,
                             int num_heads, int num_kv_heads, int head_dim, int block_size, float scale, int dtype,
                             int kv_dtype, const prefill_scratch *w) {
    const int group = num_heads / num_kv_heads, rows = QT * group, kvh = it->kv_head;
    const size_t token_stride = (size_t)num_kv_heads * head_dim, block_elems = (size_t)block_size * token_stride;
    const int q0 = it->tile * QT, nqt = chunk_len - q0 < QT ? chunk_len - q0 : QT;
    const int pos0 = chunk_start + q0, nrows = nqt * group;
    /* bfloat16 rows over a bfloat16 cache: S from bfloat16 dot products (Q^T in pairs, as
     * it is, and the scale applied to S) where the build has them */
    const int dp = TK_BF16_DP && dtype == TK_BF16 && kv_dtype == TK_BF16;
    for (int j = 0; j < rows; j++) {
        const size_t src = (size_t)(chunk_row + q0 + j / group) * q_row_stride + (size_t)(kvh * group + j % group) * head_dim;
        if (dp)
            for (int d = 0; d < head_dim; d++)
                ((bf16 *)w->qt)[((size_t)(d / 2) * rows + j) * 2 + d % 2] = j < nrows ? ((const bf16 *)q)[src + d] : 0;
        else
            for (int d = 0; d < head_dim; d++) w->qt[(size_t)d * rows + j] = j < nrows ? scale * load_any(q, src + d, dtype) : 0.0f;
        w->m[j] = -INFINITY;
        w->l[j] = 0.0f;
    }
    memset(w->o, 0, sizeof(float) * (size_t)rows * head_dim);
    const int last_pos = pos0 + nqt - 1, num_blocks = last_pos / block_size + 1;
    for (int b = 0; b < num_blocks; b++) {
        const size_t base = (size_t)table[b] * block_elems + (size_t)kvh * head_dim;
        const int t0 = b * block_size, ntok = last_pos + 1 - t0 < block_size ? last_pos + 1 - t0 : block_size;
        const float *kr = (const float *)k_cache + base, *vr = (const float *)v_cache + base;
        size_t kv_stride = token_stride;
        /* A bfloat16 cache: the block's K and V widened once, every query vector reads them
         * (with bfloat16 dot products K is read as it is and V laid out in pairs below). */
        if (kv_dtype == TK_BF16 && !dp) {
            for (int t = 0; t < ntok; t++)
                for (int d = 0; d < head_dim; d += TK_VL) {
                    vstore(w->kb + (size_t)t * head_dim + d, vload_bf16((const bf16 *)k_cache + base + t * token_stride + d));
                    vstore(w->vb + (size_t)t * head_dim + d, vload_bf16((const bf16 *)v_cache + base + t * token_stride + d));
                }
            kr = w->kb, vr = w->vb, kv_stride = head_dim;
        }
        /* S^T [ntok][rows] = K [ntok][hd] Q^T [hd][rows] */
#if TK_BF16_DP
        if (dp)
            scores_dp(w->st, rows, (const bf16 *)k_cache + base, token_stride, (const bf16 *)w->qt, ntok, head_dim);
        else
#endif
            small_gemm(w->st, rows, kr, kv_stride, 1, w->qt, rows, ntok, rows, head_dim, 0);
        /* Online softmax, TK_VL query vectors at a time; token t0 + t is visible to query
         * vector j when it is not past the query's position. */
        const int diagonal = t0 + ntok - 1 > pos0;
        for (int j = 0; j < rows; j += TK_VL) {
            vf qpos;
            for (int l = 0; l < TK_VL; l++) qpos[l] = (float)(pos0 + (j + l) / group);
            vf mb = vload(w->m + j);
            for (int t = 0; t < ntok; t++) {
                vf st = vload(w->st + (size_t)t * rows + j);
                if (dp) st *= scale;
                if (diagonal) st = vselect((vi)(vbcast((float)(t0 + t)) <= qpos), st, vbcast(-INFINITY));
                vstore(w->st + (size_t)t * rows + j, st);
                mb = vmax(mb, st);
            }
            const vf m_old = vload(w->m + j);
            /* rows that see no token yet keep m = -inf; they get p = 0 and corr = 1 */
            const vi seen = (vi)(mb > vbcast(-INFINITY));
            const vf mref = vselect(seen, mb, vzero());
            const vf corr = vselect((vi)(m_old > vbcast(-INFINITY)), vexp_nonpositive(m_old - mref), vbcast(1.0f));
            vf sum = vzero();
            for (int t = 0; t < ntok; t++) {
                const vf st = vload(w->st + (size_t)t * rows + j);
                const vf p = vselect((vi)(st > vbcast(-INFINITY)), vexp_nonpositive(st - mref), vzero());
                vstore(w->st + (size_t)t * rows + j, p);
                sum += p;
            }
            vstore(w->m + j, mb);
            vstore(w->l + j, vload(w->l + j) * corr + sum);
            for (int l = 0; l < TK_VL; l++)
                if (corr[l] != 1.0f) {
                    float *oj = w->o + (size_t)(j + l) * head_dim;
                    const vf c = vbcast(corr[l]);
                    for (int d = 0; d < head_dim; d += TK_VL) vstore(oj + d, vload(oj + d) * c);
                }
        }
        /* O [rows][hd] += P [rows][ntok] V [ntok][hd], P read from P^T */
#if TK_BF16_DP
        if (dp) {
            p_pairs((bf16 *)w->pb, w->st, rows, ntok);
            v_pairs((bf16 *)w->vb, (const bf16 *)v_cache + base, token_stride, ntok, head_dim);
            pv_dp(w->o, head_dim, (const bf16 *)w->pb, rows, (const bf16 *)w->vb, (ntok + 1) / 2);
        } else
#endif
            small_gemm(w->o, head_dim, w->st, 1, rows, vr, kv_stride, rows, head_dim, ntok, 1);
    }
    for (int j = 0; j < nrows; j++) {
        const size_t dst = ((size_t)(chunk_row + q0 + j / group) * num_heads + kvh * group + j % group) * head_dim;
        const float inv = w->l[j] > 0.0f ? 1.0f / w->l[j] : 0.0f;
        for (int d = 0; d < head_dim; d += TK_VL) vstore_any(out, dst + d, vload(w->o + (size_t)j * head_dim + d) * inv, dtype);
    }
}

/* Returns 0, 1 if a scratch buffer could not be allocated, 2 on a bad shape. */
int tk_prefill_attention(void *out, const void *q, long q_row_stride, const void *k_cache, const void *v_cache,
                         const int32_t *block_table, const int32_t *chunk_rows, const int32_t *chunk_starts,
                         const int32_t *chunk_lens, int num_chunks, int num_heads, int num_kv_heads, int head_dim,
                         int block_size, int table_stride, float scale, int dtype, int kv_dtype, int num_threads) {
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || head_dim <= 0 || head_dim % TK_VL != 0 ||
        block_size <= 0 || (QT * (num_heads / num_kv_heads)) % TK_VL != 0)
        return 2;
    const int rows = QT * (num_heads / num_kv_heads);
    int num_items = 0;
    for (int c = 0; c < num_chunks; c++) num_items += (chunk_lens[c] + QT - 1) / QT * num_kv_heads;
    if (num_items == 0) return 0;
    prefill_item *items = malloc(sizeof(prefill_item) * (size_t)num_items);
    if (items == NULL) return 1;
    int n = 0;
    for (int c = 0; c < num_chunks; c++)
        for (int t = 0; t < (chunk_lens[c] + QT - 1) / QT; t++)
            for (int h = 0; h < num_kv_heads; h++) items[n++] = (prefill_item){c, t, h, chunk_starts[c] + t * QT};
    /* Heaviest first (the tiles that see the longest contexts), so the last items are short. */
    qsort(items, (size_t)n, sizeof(prefill_item), by_context_desc);
    int failed = 0, next = 0;
    const int threads = num_items < num_threads ? num_items : num_threads;
#pragma omp parallel num_threads(threads)
    {
        const size_t nq = (size_t)rows * head_dim, nkv = (size_t)block_size * head_dim;
        const size_t npb = (size_t)(block_size + 1) / 2 * rows; /* P in bfloat16 pairs (dot-product builds) */
        float *buf = malloc(sizeof(float) * (2 * nq + (size_t)block_size * rows + 2 * nkv + 2 * (size_t)rows + npb));
        if (buf == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        prefill_scratch w = {buf, buf + nq, buf + 2 * nq, NULL, NULL, NULL, NULL, NULL};
        if (buf != NULL) {
            w.kb = w.st + (size_t)block_size * rows;
            w.vb = w.kb + nkv;
            w.m = w.vb + nkv;
            w.l = w.m + rows;
            w.pb = w.l + rows;
        }
        for (;;) {
            int i;
#pragma omp atomic capture
            i = next++;
            if (i >= num_items || buf == NULL) break;
            const prefill_item *it = &items[i];
            const int c = it->chunk;
            prefill_item_run(it, out, q, q_row_stride, (const char *)k_cache, (const char *)v_cache,
                             block_table + (size_t)c * table_stride, chunk_rows[c], chunk_starts[c], chunk_lens[c],
                             num_heads, num_kv_heads, head_dim, block_size, scale, dtype, kv_dtype, &w);
        }
        free(buf);
    }
    free(items);
    return failed;
}
