/*
 * Prefill attention straight from the paged KV cache, in the layouts of attention.c.
 *
 * Prefill (tk_prefill_attention): chunks of consecutive query tokens, chunk c at rows
 * chunk_rows[c] .. + chunk_lens[c] and positions chunk_starts[c] ..; the chunk's own K/V
 * are in the cache already, and token p attends to positions 0 .. p (causal with an
 * offset, so chunked prefill and prefix-cache hits need nothing special).
 *
 * Each query vector is computed with the decode kernel's arithmetic (attention_row.h): its
 * scores over its own context, an exact softmax, the weighted sum of V in token order. So
 * a token's output is the same bits whether it is a prompt row, in a chunk of any length
 * at any offset, or a decode row (a draft verified with a request's last token, an output
 * token recomputed after a preemption): greedy and seeded outputs do not depend on how
 * the scheduler cut the work into steps. (A flash-attention order, an online softmax per
 * block, and bfloat16 dot products over bfloat16 pairs ran about 1.3x faster in float32
 * and 2x in bfloat16, and gave each token other bits than its decode row: in bfloat16
 * enough, on a real model, to turn near ties after a preemption. benchmarks/figures/speculative.md,
 * "Exact in bfloat16", has the figures and a dot-product variant of both kernels.)
 *
 * Work items are (chunk, tile of QT query tokens, KV head), heaviest first, handed out by
 * one counter. An item holds its group's QT * group query vectors, and walks its context
 * span by span (attention_row.h's spans) twice: scoring every vector that sees the span
 * while the span's keys are in L1, then, after each vector's softmax, adding the span's
 * values to every vector that sees it, each value vector loaded once for WS_ROWS of them.
 */
#include "tandem_api.h"

#include <stdlib.h>
#include <string.h>

#include "attention_row.h"
#include "tandem_kernels.h"

#define QT 16 /* query tokens per prefill item */

typedef struct {
    int chunk, tile, kv_head, first_pos;
} prefill_item;

static int by_context_desc(const void *a, const void *b) {
    const prefill_item *x = a, *y = b;
    if (x->first_pos != y->first_pos) return x->first_pos > y->first_pos ? -1 : 1;
    if (x->chunk != y->chunk) return x->chunk - y->chunk;
    return x->kv_head - y->kv_head;
}

/* Per-thread buffers of an item: qf [rows][hd] (the query vectors in float32, pre-scaled),
 * o [rows][hd] (their sums), s [rows][s_stride] (each vector's scores, then its softmax),
 * len [rows] (each vector's context), span [SPAN][hd] (a span's keys or values of the
 * item's KV head, widened to float32 once for every vector that reads them: the values
 * the decode kernel widens at each read). */
typedef struct {
    float *qf, *o, *s, *span;
    size_t s_stride;
    int *len; /* [rows]: each vector's context length */
} prefill_scratch;

/* The n tokens' head_dim values at cache + off + t * stride, as float32 [n][head_dim] in
 * buf (a float32 cache is read in place: its address is returned, with *stride kept). */
static const float *span_f32(const char *cache, size_t off, size_t *stride, int n, int head_dim, int kv_dtype,
                             float *buf) {
    if (kv_dtype != TK_BF16) return (const float *)cache + off;
    for (int t = 0; t < n; t++)
        for (int d = 0; d < head_dim; d += TK_VL)
            vstore(buf + (size_t)t * head_dim + d, vload_bf16((const bf16 *)cache + off + (size_t)t * *stride + d));
    *stride = (size_t)head_dim;
    return buf;
}

/* One prefill item: vector j (of nqt * group) is query token j / group of the tile, head
 * kv_head * group + j % group; its context is positions 0 .. its own. */
static void prefill_item_run(
    const prefill_item *it, void *out, const void *q, long q_row_stride, const char *k_cache, const char *v_cache,
    const int32_t *table, int chunk_row, int chunk_start, int chunk_len, int num_heads, int num_kv_heads, int head_dim,
    int block_size, float scale, int dtype, int kv_dtype, const prefill_scratch *w) {
    const int group = num_heads / num_kv_heads, kvh = it->kv_head;
    const size_t token_stride = (size_t)num_kv_heads * head_dim, ss = w->s_stride, hd = (size_t)head_dim;
    const int q0 = it->tile * QT, nqt = chunk_len - q0 < QT ? chunk_len - q0 : QT;
    const int pos0 = chunk_start + q0, nrows = nqt * group, len_max = pos0 + nqt;
    for (int j = 0; j < nrows; j++) {
        const size_t src = (size_t)(chunk_row + q0 + j / group) * q_row_stride + (size_t)(kvh * group + j % group) * hd;
        for (size_t d = 0; d < hd; d++) w->qf[j * hd + d] = scale * load_any(q, src + d, dtype);
    }
    /* Vector j sees len(j) = pos0 + j / group + 1 tokens; of a span [t0, t0 + n), the vectors
     * from first(t0 + n) on see all of it, those from first(t0 + 1) on part of it. */
    for (int j = 0; j < nrows; j++) w->len[j] = pos0 + j / group + 1;
#define LEN(j) (w->len[j])
#define FIRST(t) ((t) - pos0 - 1 <= 0 ? 0 : ((t) - pos0 - 1) * group) /* first j with LEN(j) >= t */
    int n;
    for (int t0 = 0; t0 < len_max; t0 += n) {
        size_t stride = token_stride;
        const size_t off = span_at(table, t0, len_max, block_size, token_stride, &n) + (size_t)kvh * hd;
        const float *k = span_f32(k_cache, off, &stride, n, head_dim, kv_dtype, w->span);
        /* Tiles of SCORE_ROWS vectors over the tokens all of them see, SCORE_TOKENS at a
         * time; what is left of each vector's tokens, one vector at a time. */
        int j = FIRST(t0 + 1);
        for (; j + SCORE_ROWS <= nrows; j += SCORE_ROWS) {
            const int common = LEN(j) - t0 < n ? LEN(j) - t0 : n; /* the tile's first vector sees least */
            int t = 0;
            for (; t + SCORE_TOKENS <= common; t += SCORE_TOKENS)
                score_tile(w->qf + j * hd, hd, k + (size_t)t * stride, stride, head_dim, w->s + j * ss + t0 + t, ss);
            for (int r = j; r < j + SCORE_ROWS; r++) {
                const int nr = LEN(r) - t0 < n ? LEN(r) - t0 : n;
                if (nr > t)
                    score_tokens(w->qf + r * hd, k + (size_t)t * stride, 0, stride, nr - t, head_dim, TK_F32,
                                 w->s + r * ss + t0 + t);
            }
        }
        for (; j < nrows; j++) {
            const int nj = LEN(j) - t0 < n ? LEN(j) - t0 : n;
            score_tokens(w->qf + j * hd, k, 0, stride, nj, head_dim, TK_F32, w->s + j * ss + t0);
        }
    }
    for (int j = 0; j < nrows; j++) softmax_row(w->s + j * ss, LEN(j));
    memset(w->o, 0, sizeof(float) * (size_t)nrows * hd);
    for (int t0 = 0; t0 < len_max; t0 += n) {
        size_t stride = token_stride;
        const size_t off = span_at(table, t0, len_max, block_size, token_stride, &n) + (size_t)kvh * hd;
        const float *v = span_f32(v_cache, off, &stride, n, head_dim, kv_dtype, w->span);
        const int full = FIRST(t0 + n) < nrows ? FIRST(t0 + n) : nrows;
        for (int j = FIRST(t0 + 1); j < full; j += group) { /* the diagonal: a token's vectors see part */
            const int count = full - j < group ? full - j : group;
            weighted_sum_any(
                count, WS_ROWS, w->o + j * hd, hd, w->s + j * ss + t0, ss, v, 0, stride, LEN(j) - t0, head_dim, TK_F32);
        }
        weighted_sum_any(
            nrows - full, WS_ROWS, w->o + full * hd, hd, w->s + full * ss + t0, ss, v, 0, stride, n, head_dim, TK_F32);
    }
#undef LEN
#undef FIRST
    for (int j = 0; j < nrows; j++) {
        const size_t dst = ((size_t)(chunk_row + q0 + j / group) * num_heads + kvh * group + j % group) * hd;
        for (size_t d = 0; d < hd; d += TK_VL) vstore_any(out, dst + d, vload(w->o + j * hd + d), dtype);
    }
}

int tk_prefill_attention(const tk_attn_shape *s, const tk_prefill_chunks *chunks, void *out, const void *q,
                         const void *k_cache, const void *v_cache, int num_threads) {
    const int num_heads = s->num_heads, num_kv_heads = s->num_kv_heads, head_dim = s->head_dim;
    const int block_size = s->block_size, dtype = s->dtype, kv_dtype = s->kv_dtype;
    const long q_row_stride = s->row_stride;
    const float scale = s->scale;
    const int32_t *block_table = chunks->block_table, *chunk_rows = chunks->rows;
    const int32_t *chunk_starts = chunks->starts, *chunk_lens = chunks->lens;
    const int num_chunks = chunks->num_chunks, table_stride = chunks->table_stride;
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || head_dim <= 0 || head_dim % TK_VL != 0 || block_size <= 0)
        return 2;
    const int rows = QT * (num_heads / num_kv_heads);
    int num_items = 0, len_cap = 1;
    for (int c = 0; c < num_chunks; c++) {
        if (chunk_starts[c] < 0 || chunk_lens[c] < 0) return 2;
        num_items += (chunk_lens[c] + QT - 1) / QT * num_kv_heads;
        if (chunk_starts[c] + chunk_lens[c] > len_cap) len_cap = chunk_starts[c] + chunk_lens[c];
    }
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
        /* a score row's stride: whole vectors, so that rows start aligned alike */
        const size_t nq = (size_t)rows * head_dim, ss = ((size_t)len_cap + TK_VL - 1) / TK_VL * TK_VL;
        float *buf = malloc(sizeof(float) * (2 * nq + (size_t)rows * ss + (size_t)SPAN * head_dim));
        int *lens = malloc(sizeof(int) * (size_t)rows);
        if (buf == NULL || lens == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        const prefill_scratch w = {buf, buf + nq, buf + 2 * nq, buf + 2 * nq + (size_t)rows * ss, ss, lens};
        int i;
#pragma omp atomic capture
        i = next++;
        while (i < num_items && buf != NULL && lens != NULL) {
            const prefill_item *it = &items[i];
            const int c = it->chunk;
            prefill_item_run(it, out, q, q_row_stride, (const char *)k_cache, (const char *)v_cache,
                             block_table + (size_t)c * table_stride, chunk_rows[c], chunk_starts[c], chunk_lens[c],
                             num_heads, num_kv_heads, head_dim, block_size, scale, dtype, kv_dtype, &w);
#pragma omp atomic capture
            i = next++;
        }
        free(buf);
        free(lens);
    }
    free(items);
    return failed;
}
