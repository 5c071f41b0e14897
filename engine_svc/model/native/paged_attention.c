/*
 * Decode attention straight from the paged KV cache (float32, CPU).
 *
 * One query token per request; each request reads its context through its block table,
 * so no K/V is copied: every cached key and value of the step is read from memory once.
 * Layouts (row-major, as engine_svc/attention.py documents):
 *
 *   q, out       [num_rows, num_heads, head_dim]
 *   k/v cache    [num_blocks, block_size, num_kv_heads, head_dim]
 *   block_table  [num_rows, table_stride] int32; token t of row i lives in block
 *                block_table[i][t / block_size] at offset t % block_size
 *   ctx_lens     [num_rows] int32; row i attends to tokens 0 .. ctx_lens[i] - 1
 *
 * Work items are rows. A row walks its blocks in table order and reads each block front
 * to back (a block holds every KV head of block_size tokens contiguously), so memory is
 * streamed in runs of block_size * num_kv_heads * head_dim floats. Query head h uses KV
 * head h / group (transformers' repeat_kv layout). Softmax is exact: scores for the whole
 * context go to a per-thread buffer, then max, exp and sum, then the weighted sum of V.
 *
 * Threads come from the OpenMP runtime that torch has already loaded (same soname), so
 * this kernel and torch's own ops share one thread pool.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_HEADS 1024

/* exp(x) for x <= 0 as a polynomial the compiler can vectorise (Cephes expf: range
 * reduction by ln 2, degree-5 minimax; relative error ~1e-7 on [-87, 0]). */
static inline float exp_nonpositive(float x) {
    x = fmaxf(x, -87.0f);
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union {
        int32_t i;
        float f;
    } two_n;
    two_n.i = ((int32_t)n + 127) << 23;
    return p * two_n.f;
}

/* q . k with eight independent partial sums (one AVX register); head_dim % 8 == 0. */
static inline float dot8(const float *a, const float *b, const int head_dim) {
    float acc[8] = {0};
    for (int d = 0; d < head_dim; d += 8)
        for (int l = 0; l < 8; l++) acc[l] += a[d + l] * b[d + l];
    return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

static inline float dot_any(const float *a, const float *b, const int head_dim) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int d = 0; d < head_dim; d++) acc += a[d] * b[d];
    return acc;
}

static inline void axpy(float *o, const float p, const float *v, const int head_dim) {
#pragma omp simd
    for (int d = 0; d < head_dim; d++) o[d] += p * v[d];
}

/* Blocks sit anywhere in the pool, so the hardware prefetcher cannot guess the next one:
 * while token i of a block is read, token i of the next block is requested. */
static inline void prefetch_row(const float *p, size_t num_floats) {
    for (size_t i = 0; i < num_floats; i += 16) __builtin_prefetch(p + i, 0, 3);
}

/* One row: scores for every query head over the whole context, exact softmax, then the
 * weighted sum of V. Always inlined, so the calls below with a literal head_dim (64, 128)
 * get inner loops that unroll completely. */
static inline __attribute__((always_inline)) void row_attention(
    float *orow, const float *qr, const float *k_cache, const float *v_cache, const int32_t *table,
    int len, int num_heads, const int *kv_head_of, const int head_dim, int block_size, size_t token_stride,
    float scale, float *scores) {
    const size_t block_stride = (size_t)block_size * token_stride;
    const int num_blocks = (len + block_size - 1) / block_size;
    /* Pass 1, block by block: a block holds the keys of all KV heads of block_size tokens
     * in one contiguous run, read front to back. scores[h][t] = scale * q_h . k_{t, h / group} */
    for (int b = 0; b < num_blocks; b++) {
        const float *kb = k_cache + (size_t)table[b] * block_stride;
        const float *k_next = k_cache + (size_t)table[b + 1 < num_blocks ? b + 1 : b] * block_stride;
        const int t0 = b * block_size;
        const int n = len - t0 < block_size ? len - t0 : block_size;
        for (int i = 0; i < n; i++) {
            const float *krow = kb + (size_t)i * token_stride;
            prefetch_row(k_next + (size_t)i * token_stride, token_stride);
            for (int h = 0; h < num_heads; h++) {
                const float *qh = qr + (size_t)h * head_dim, *k = krow + (size_t)kv_head_of[h] * head_dim;
                const float dot = head_dim % 8 == 0 ? dot8(qh, k, head_dim) : dot_any(qh, k, head_dim);
                scores[(size_t)h * len + t0 + i] = scale * dot;
            }
        }
    }
    /* Softmax over t for each query head. */
    for (int h = 0; h < num_heads; h++) {
        float *s = scores + (size_t)h * len;
        float m = -INFINITY;
#pragma omp simd reduction(max : m)
        for (int t = 0; t < len; t++) m = fmaxf(m, s[t]);
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int t = 0; t < len; t++) {
            s[t] = exp_nonpositive(s[t] - m);
            sum += s[t];
        }
        const float c = 1.0f / sum;
#pragma omp simd
        for (int t = 0; t < len; t++) s[t] *= c;
    }
    /* Pass 2, block by block: out_h = sum_t p[h][t] * v_{t, h / group} */
    memset(orow, 0, sizeof(float) * (size_t)num_heads * head_dim);
    for (int b = 0; b < num_blocks; b++) {
        const float *vb = v_cache + (size_t)table[b] * block_stride;
        const float *v_next = v_cache + (size_t)table[b + 1 < num_blocks ? b + 1 : b] * block_stride;
        const int t0 = b * block_size;
        const int n = len - t0 < block_size ? len - t0 : block_size;
        for (int i = 0; i < n; i++) {
            const float *vrow = vb + (size_t)i * token_stride;
            prefetch_row(v_next + (size_t)i * token_stride, token_stride);
            for (int h = 0; h < num_heads; h++)
                axpy(orow + (size_t)h * head_dim, scores[(size_t)h * len + t0 + i],
                     vrow + (size_t)kv_head_of[h] * head_dim, head_dim);
        }
    }
}

/* Returns 0 on success, 1 if a scratch buffer could not be allocated, 2 on a bad shape. */
int tandem_paged_decode_attention_f32(
    float *out, const float *q, const float *k_cache, const float *v_cache,
    const int32_t *block_table, const int32_t *ctx_lens,
    int num_rows, int num_heads, int num_kv_heads, int head_dim, int block_size,
    int table_stride, int max_ctx_len, float scale, int num_threads) {
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || head_dim <= 0 || block_size <= 0) return 2;
    const int group = num_heads / num_kv_heads;
    int kv_head_of[MAX_HEADS]; /* query head -> its KV head, precomputed (no division per token) */
    if (num_heads > MAX_HEADS) return 2;
    for (int h = 0; h < num_heads; h++) kv_head_of[h] = h / group;
    const size_t token_stride = (size_t)num_kv_heads * head_dim; /* floats from one token to the next */
    int failed = 0;

#pragma omp parallel num_threads(num_threads)
    {
        /* scores[h][t] for every query head of one row */
        float *scores = malloc(sizeof(float) * (size_t)num_heads * (max_ctx_len > 0 ? max_ctx_len : 1));
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int row = 0; row < num_rows; row++) {
            if (scores == NULL) continue;
            const int len = ctx_lens[row] > 0 ? ctx_lens[row] : 0;
            const int32_t *table = block_table + (size_t)row * table_stride;
            const float *qr = q + (size_t)row * num_heads * head_dim;
            float *orow = out + (size_t)row * num_heads * head_dim; /* all zeros when len <= 0 */
            if (head_dim == 64)
                row_attention(orow, qr, k_cache, v_cache, table, len, num_heads, kv_head_of, 64, block_size, token_stride, scale, scores);
            else if (head_dim == 128)
                row_attention(orow, qr, k_cache, v_cache, table, len, num_heads, kv_head_of, 128, block_size, token_stride, scale, scores);
            else
                row_attention(orow, qr, k_cache, v_cache, table, len, num_heads, kv_head_of, head_dim, block_size, token_stride, scale, scores);
        }
        free(scores);
    }
    return failed;
}
