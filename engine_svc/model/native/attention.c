/*
 * Attention straight from the paged KV cache: no K/V is gathered or copied by the caller.
 * Layouts (row-major, as engine_svc/model/attention.py documents):
 *
 *   q            [num_tokens, row_stride]: query head h of row i at i * row_stride + h * head_dim
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
 * value of the step is read once. The arithmetic of a row is attention_row.h's, which the
 * prefill kernel (attention_prefill.c) shares: a token's output has the same bits from
 * either kernel.
 */
#include "tandem_api.h"

#include <stdlib.h>

#include "attention_row.h"
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

/* One decode row. qf: the row's query heads in float32, pre-scaled; of: float32 output;
 * scores [heads][len]. Span by span, every head reads the span while it is in L1, and the
 * next span is requested while this one is worked on: the K pass's last span requests the
 * V pass's first, and the V pass's last requests `after` (the first K span of the row this
 * thread takes next, or NULL), so that neither pass nor row starts on a cold span. */
static inline __attribute__((always_inline)) void decode_row(
    float *of, const float *qf, const char *k_cache, const char *v_cache, const int32_t *table, int len, int num_heads,
    int group, int head_dim, int block_size, size_t token_stride, size_t elem, int dtype, float *scores,
    const char *after) {
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
            if (vec)
                score_tokens(qh, k_cache, koff, token_stride, n, head_dim, dtype, sh);
            else /* not a prefill kernel's head size: the scalar tail joins each sum */
                for (int i = 0; i < n; i++) sh[i] = dot(qh, k_cache, koff + (size_t)i * token_stride, head_dim, dtype);
        }
        kb = next;
    }
    for (int h = 0; h < num_heads; h++) softmax_row(scores + (size_t)h * len, len);
    memset(of, 0, sizeof(float) * (size_t)num_heads * head_dim);
    size_t vb = span_at(table, 0, len, block_size, token_stride, &n), v_next_off;
    for (int t0 = 0; t0 < len; t0 += n, n = n_next, vb = v_next_off) {
        const int more = t0 + n < len;
        v_next_off = more ? span_at(table, t0 + n, len, block_size, token_stride, &n_next) : vb;
        const char *v_next = more ? v_cache + v_next_off * elem : after;
        for (int g = 0; g < num_kv_heads; g++) { /* the group of query heads that read KV head g */
            if (v_next != NULL) prefetch_part(v_next, lines, v_chunk, g);
            const size_t voff = vb + (size_t)g * head_dim;
            float *og = of + (size_t)g * group * head_dim;
            const float *pg = scores + (size_t)g * group * len + t0;
            if (vec) {
                weighted_sum_any(group, HC, og, head_dim, pg, len, v_cache, voff, token_stride, n, head_dim, dtype);
                continue;
            }
            for (int j = 0; j < group; j++)
                for (int i = 0; i < n; i++)
                    for (int d = 0; d < head_dim; d++)
                        og[(size_t)j * head_dim + d] +=
                            pg[(size_t)j * len + i] * load_any(v_cache, voff + (size_t)i * token_stride + d, dtype);
        }
    }
}

int tk_decode_attention(const tk_attn_shape *s, const tk_decode_rows *rows, void *out, const void *q,
                        const void *k_cache, const void *v_cache, int num_threads) {
    const int num_heads = s->num_heads, num_kv_heads = s->num_kv_heads, head_dim = s->head_dim;
    const int block_size = s->block_size, dtype = s->dtype, kv_dtype = s->kv_dtype;
    const long q_row_stride = s->row_stride;
    const float scale = s->scale;
    const int32_t *block_table = rows->block_table, *ctx_lens = rows->ctx_lens;
    const int num_rows = rows->num_rows, table_stride = rows->table_stride, max_ctx_len = rows->max_ctx_len;
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || num_heads > MAX_HEADS || head_dim <= 0 || block_size <= 0)
        return 2;
    const int group = num_heads / num_kv_heads;
    const size_t token_stride = (size_t)num_kv_heads * head_dim, elem = kv_dtype == TK_BF16 ? 2 : 4;
    const size_t row_elems = (size_t)num_heads * head_dim;
    int failed = 0, next_row = 0;
    int threads = num_rows < num_threads ? num_rows : num_threads;
    if (threads < 1) threads = 1;
#pragma omp parallel num_threads(threads)
    {
        float *scores =
            malloc(sizeof(float) * ((size_t)num_heads * (max_ctx_len > 0 ? max_ctx_len : 1) + 2 * row_elems));
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
                after =
                    (const char *)k_cache +
                    span_at(block_table + (size_t)row_after * table_stride, 0, 1, block_size, token_stride, &n) * elem;
            const int len = ctx_lens[row] > 0 ? (ctx_lens[row] < max_ctx_len ? ctx_lens[row] : max_ctx_len) : 0;
            for (size_t i = 0; i < row_elems; i++) qf[i] = scale * load_any(q, (size_t)row * q_row_stride + i, dtype);
            const int32_t *table = block_table + (size_t)row * table_stride;
            /* one copy of the row loop per cache dtype, so no load tests the dtype */
            if (len > 0 && kv_dtype == TK_BF16)
                decode_row(of, qf, (const char *)k_cache, (const char *)v_cache, table, len, num_heads, group, head_dim,
                           block_size, token_stride, elem, TK_BF16, scores, after);
            else if (len > 0)
                decode_row(of, qf, (const char *)k_cache, (const char *)v_cache, table, len, num_heads, group, head_dim,
                           block_size, token_stride, elem, TK_F32, scores, after);
            else
                memset(of, 0, sizeof(float) * row_elems);
            size_t i = 0;
            for (; i + TK_VL <= row_elems; i += TK_VL)
                vstore_any(out, (size_t)row * row_elems + i, vload(of + i), dtype);
            for (; i < row_elems; i++) store_any(out, (size_t)row * row_elems + i, of[i], dtype);
            row = row_after;
        }
        free(scores);
    }
    return failed;
}
