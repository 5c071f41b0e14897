/*
 * tk_decode_stack: every decoder layer of a decode-only step in one call.
 *
 * A decode step at small batch is short (a few milliseconds for a 135M model) and made of
 * many small calls: per layer a norm, four linear layers, RoPE, the K/V write and the
 * attention. Called one by one from Python, the calls' own cost (arguments, a tensor per
 * result, the module tree) is a large share of the step. This runs the same kernels, with
 * the same arguments and in the same order as the layers' Python path (llama.py,
 * native_layers.py, attention/paged.py), over buffers the caller hands in, so its results
 * are bit for bit those of that path.
 *
 * Per layer, on M rows (one token each), with x the previous layer's output and r the
 * residual stream (the first layer: x is the embedding, r becomes x):
 *
 *   h = rms_norm(r += x) * w_in               tk_rms_norm
 *   qkv = h @ Wqkv^T (+ b)                    tk_gemm / tk_qgemm
 *   rope(q, k heads of qkv)                    tk_rope
 *   k, v -> their slots in the paged cache    (a copy per row)
 *   a = attention(q, cache)                   tk_decode_attention
 *   o = a @ Wo^T (+ b)
 *   h = rms_norm(r += o) * w_post
 *   x = (silu(h @ Wg^T) * (h @ Wu^T)) @ Wd^T
 *
 * Float32 activations, with caches float32 or bfloat16 (attn.kv_dtype: each K and V
 * value rounded to nearest even as it is written, as torch's copy into a bfloat16 cache
 * rounds) and linear layers of packed float32 panels (gemm.c) or quantized ones (quant.c),
 * layer by layer; or bfloat16 activations (attn.dtype: a bfloat16 model), with bfloat16
 * caches and every linear layer packed in bfloat16 panels, each kernel called on bfloat16
 * rows as the layers' Python path calls it (tk_gemm widening or pairing A in a workspace).
 */
#include "tandem_api.h"

#include <stdint.h>
#include <string.h>

#include "tandem_kernels.h"

/* n values of a row (dtype sdtype) into slot `slot` of a cache of dtype kv_dtype: bfloat16
 * rows as they are (the cache is then bfloat16 too), float32 rows copied or rounded. */
static void write_kv_row(void *cache, int64_t slot, const void *row, int sdtype, int n, int kv_dtype) {
    if (sdtype == TK_BF16) {
        memcpy((bf16 *)cache + (size_t)slot * n, row, 2 * (size_t)n);
    } else if (kv_dtype == TK_BF16) {
        const float *src = row;
        bf16 *dst = (bf16 *)cache + (size_t)slot * n;
        int i = 0;
        for (; i + TK_VL <= n; i += TK_VL) vstore_bf16(dst + i, vload(src + i));
        for (; i < n; i++) dst[i] = f32_to_bf16(src[i]);
    } else {
        memcpy((float *)cache + (size_t)slot * n, row, sizeof(float) * n);
    }
}

/* The Python path's write before attention, for every row at once: row i of k (and v) goes
 * to slot slots[i], every slot checked before anything is written. A row is one thread's;
 * rows split across threads from 256 on (a prefill chunk), below that one thread copies
 * them all. */
int tk_write_kv(const tk_attn_shape *s, void *k_cache, void *v_cache, const void *k, const void *v,
                const int64_t *slots, int rows, long num_slots, int num_threads) {
    const int cdtype = s->kv_dtype, sdtype = s->dtype, width = s->num_kv_heads * s->head_dim;
    const long stride = s->row_stride;
    if (rows < 0 || width <= 0 || !(cdtype == sdtype || (cdtype == TK_BF16 && sdtype == TK_F32))) return 2;
    for (int i = 0; i < rows; i++)
        if (slots[i] < 0 || slots[i] >= num_slots) return 2;
    const size_t se = sdtype == TK_BF16 ? 2 : 4;
#pragma omp parallel for num_threads(rows >= 256 ? num_threads : 1) schedule(static)
    for (int i = 0; i < rows; i++) {
        write_kv_row(k_cache, slots[i], (const char *)k + (size_t)i * stride * se, sdtype, width, cdtype);
        write_kv_row(v_cache, slots[i], (const char *)v + (size_t)i * stride * se, sdtype, width, cdtype);
    }
    return 0;
}

/* y = x @ W^T for M rows of dtype `dtype` (x's and y's); ws: M * K floats for bfloat16 rows. */
static int linear(const tk_linear *l, const void *x, int M, void *y, int dtype, float *ws, int threads) {
    if (l->quantized) return tk_qgemm(l, x, l->k, y, l->n, TK_F32, M, threads);
    return tk_gemm(l, x, l->k, y, l->n, dtype, M, dtype == TK_BF16 ? ws : NULL, NULL, threads);
}

/* x, residual [M, hidden] of the shape's dtype (the caller norms residual + x); positions,
 * slots, block table and context lengths: the rows'. ws: float32 workspace of at least
 * M * (hidden + qkv + heads * head_dim + intermediate) floats, and for bfloat16 activations
 * M * max(hidden, heads * head_dim, intermediate) more. */
int tk_decode_stack(const tk_layer *layers, int num_layers, const tk_stack_shape *s, const tk_decode_rows *rows,
                    void *x, void *residual, float *ws, int num_threads) {
    const int M = rows->num_rows;
    const tk_attn_shape *a = &s->attn;
    if (M <= 0 || num_layers <= 0) return M < 0 ? 2 : 0;
    if (a->kv_dtype != TK_F32 && a->kv_dtype != TK_BF16) return 2;
    const int dt = a->dtype, bf = dt == TK_BF16;
    if (dt != TK_F32 && !(bf && a->kv_dtype == TK_BF16)) return 2;
    const int hd = a->head_dim, nh = a->num_heads, nkv = a->num_kv_heads;
    const int qkv_n = (nh + 2 * nkv) * hd, kv_width = nkv * hd;
    if (a->row_stride != qkv_n) return 2;
    int max_k = s->hidden > nh * hd ? s->hidden : nh * hd;
    for (int l = 0; l < num_layers; l++) {
        const tk_layer *L = &layers[l];
        if (L->qkv.n != qkv_n || L->o.k != nh * hd || L->gate_up.n != L->down.k) return 100 * (l + 1) + 2;
        if (bf && (L->qkv.quantized | L->o.quantized | L->gate_up.quantized | L->down.quantized))
            return 100 * (l + 1) + 2; /* tk_qgemm takes float32 rows */
        if (L->down.k > max_k) max_k = L->down.k;
    }
    /* bfloat16: tk_gemm's workspace first, then the activations at 2 bytes each */
    float *gemm_ws = ws;
    char *buf = (char *)(bf ? ws + (size_t)M * max_k : ws);
    const size_t e = bf ? 2 : 4;
    char *h = buf, *qkv = h + (size_t)M * s->hidden * e, *attn = qkv + (size_t)M * qkv_n * e;
    char *gu = attn + (size_t)M * nh * hd * e;
    for (int l = 0; l < num_layers; l++) {
        const tk_layer *L = &layers[l];
        int rc;
#define RUN(call)                                          \
    do {                                                   \
        if ((rc = (call)) != 0) return 100 * (l + 1) + rc; \
    } while (0)
        if (l == 0) {
            memcpy(residual, x, e * (size_t)M * s->hidden);
            RUN(tk_rms_norm(h, NULL, x, L->in_norm, M, s->hidden, s->eps, dt, num_threads));
        } else {
            RUN(tk_rms_norm(h, residual, x, L->in_norm, M, s->hidden, s->eps, dt, num_threads));
        }
        RUN(linear(&L->qkv, h, M, qkv, dt, gemm_ws, num_threads));
        RUN(tk_rope(qkv, qkv_n, rows->positions, s->cos_sin, s->max_position, M, nh + nkv, hd, dt, num_threads));
        for (int r = 0; r < M; r++) {
            const char *row = qkv + (size_t)r * qkv_n * e;
            write_kv_row(L->k_cache, rows->slots[r], row + (size_t)nh * hd * e, dt, kv_width, a->kv_dtype);
            write_kv_row(L->v_cache, rows->slots[r], row + (size_t)(nh + nkv) * hd * e, dt, kv_width, a->kv_dtype);
        }
        RUN(tk_decode_attention(a, rows, attn, qkv, L->k_cache, L->v_cache, num_threads));
        RUN(linear(&L->o, attn, M, x, dt, gemm_ws, num_threads));
        RUN(tk_rms_norm(h, residual, x, L->post_norm, M, s->hidden, s->eps, dt, num_threads));
        RUN(linear(&L->gate_up, h, M, gu, dt, gemm_ws, num_threads));
        RUN(linear(&L->down, gu, M, x, dt, gemm_ws, num_threads));
#undef RUN
    }
    return 0;
}
