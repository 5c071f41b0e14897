/*
 * The small per-layer ops, each one pass over its rows:
 *
 *   tk_rms_norm   residual += x (when given), out = rmsnorm(residual or x) * weight
 *   tk_silu_mul   out = silu(gate) * up, from one [rows, 2 * inter] gate/up tensor
 *   tk_rope       rotate-half RoPE in place on the q and k heads of a fused qkv tensor
 *   tk_argmax_rows  each row's first maximum (greedy sampling over the logits)
 *
 * They round where torch's ops on the model dtype round (in bfloat16: each op's result),
 * so they agree with the plain-PyTorch path to float32 rounding. The few operations that
 * torch does not fuse (rope's products and differences) are computed without fused
 * multiply-add for that reason. Rows are split over threads only when a call is big
 * enough to pay for a parallel region (a decode step's rows are not).
 */
#include "tandem_api.h"

#include "tandem_kernels.h"

#define PARALLEL_MIN_ELEMENTS (1 << 16)

/* rmsnorm of one row r (float32 values in buf) into out: r * rsqrt(mean(r^2) + eps) * w. */
static inline void norm_row(void *out, size_t off, const float *buf, const void *weight, int dim, float eps,
                            int dtype) {
    vf acc = vzero();
    int i = 0;
    for (; i + TK_VL <= dim; i += TK_VL) {
        const vf v = vload(buf + i);
        acc += v * v;
    }
    float sum = 0.0f;
    for (int l = 0; l < TK_VL; l++) sum += acc[l];
    for (; i < dim; i++) sum += buf[i] * buf[i];
    const float inv = 1.0f / sqrtf(sum / (float)dim + eps);
    const int bf = dtype == TK_BF16;
    i = 0;
    for (; i + TK_VL <= dim; i += TK_VL) {
        vf n = vload(buf + i) * inv;
        if (bf) n = vround_bf16(n);
        vstore_any(out, off + i, n * vload_any(weight, i, dtype), dtype);
    }
    for (; i < dim; i++) {
        float n = buf[i] * inv;
        if (bf) n = round_bf16(n);
        store_any(out, off + i, n * load_any(weight, i, dtype), dtype);
    }
}

int tk_rms_norm(void *out, void *residual, const void *x, const void *weight, int rows, int dim, float eps, int dtype,
                int num_threads) {
    if (rows < 0 || dim <= 0 || dim > (1 << 20)) return 2;
    const int threads = (size_t)rows * dim >= PARALLEL_MIN_ELEMENTS ? num_threads : 1;
#pragma omp parallel num_threads(threads)
    {
        float buf[dim]; /* one row in float32 */
#pragma omp for schedule(static)
        for (int r = 0; r < rows; r++) {
            const size_t off = (size_t)r * dim;
            int i = 0;
            if (residual != NULL) {
                for (; i + TK_VL <= dim; i += TK_VL) {
                    const vf s = vload_any(x, off + i, dtype) + vload_any(residual, off + i, dtype);
                    vstore_any(residual, off + i, s, dtype);
                    vstore(buf + i, dtype == TK_BF16 ? vround_bf16(s) : s);
                }
                for (; i < dim; i++) {
                    const float s = load_any(x, off + i, dtype) + load_any(residual, off + i, dtype);
                    store_any(residual, off + i, s, dtype);
                    buf[i] = dtype == TK_BF16 ? round_bf16(s) : s;
                }
            } else {
                for (; i + TK_VL <= dim; i += TK_VL) vstore(buf + i, vload_any(x, off + i, dtype));
                for (; i < dim; i++) buf[i] = load_any(x, off + i, dtype);
            }
            norm_row(out, off, buf, weight, dim, eps, dtype);
        }
    }
    return 0;
}

int tk_silu_mul(void *out, const void *gu, int rows, int inter, int dtype, int num_threads) {
    if (rows < 0 || inter <= 0) return 2;
    const int threads = (size_t)rows * inter >= PARALLEL_MIN_ELEMENTS ? num_threads : 1;
    const int bf = dtype == TK_BF16;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int r = 0; r < rows; r++) {
        const size_t g0 = (size_t)r * 2 * inter, u0 = g0 + inter, o0 = (size_t)r * inter;
        for (int i = 0; i < inter; i++) {
            float s = silu(load_any(gu, g0 + i, dtype));
            if (bf) s = round_bf16(s);
            store_any(out, o0 + i, s * load_any(gu, u0 + i, dtype), dtype);
        }
    }
    return 0;
}

/* cos_sin holds cos and sin already rounded to the model dtype. */
__attribute__((optimize("fp-contract=off"))) int tk_rope(
    void *qkv, long row_stride, const int64_t *positions, const float *cos_sin, int max_position, int rows,
    int num_heads, int head_dim, int dtype, int num_threads) {
    if (rows < 0 || head_dim <= 0 || head_dim % 2 != 0) return 2;
    for (int r = 0; r < rows; r++)
        if (positions[r] < 0 || positions[r] >= max_position) return 3;
    const int half = head_dim / 2;
    const int bf = dtype == TK_BF16;
    const int threads = (size_t)rows * num_heads * head_dim >= PARALLEL_MIN_ELEMENTS ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int r = 0; r < rows; r++) {
        const float *cs = cos_sin + (size_t)positions[r] * head_dim;
        for (int h = 0; h < num_heads; h++) {
            const size_t base = (size_t)r * row_stride + (size_t)h * head_dim;
            int i = 0;
            for (; i + TK_VL <= half; i += TK_VL) {
                const vf c = vload(cs + i), s = vload(cs + half + i);
                const vf x1 = vload_any(qkv, base + i, dtype), x2 = vload_any(qkv, base + half + i, dtype);
                vf a = x1 * c, b = x2 * s, d = x2 * c, e = x1 * s;
                if (bf) { /* each product rounded, as the scalar tail below and torch's ops */
                    a = vround_bf16(a), b = vround_bf16(b), d = vround_bf16(d), e = vround_bf16(e);
                }
                vstore_any(qkv, base + i, a - b, dtype);
                vstore_any(qkv, base + half + i, d + e, dtype);
            }
            for (; i < half; i++) {
                const float c = cs[i], s = cs[half + i];
                const float x1 = load_any(qkv, base + i, dtype), x2 = load_any(qkv, base + half + i, dtype);
                float a = x1 * c, b = x2 * s, d = x2 * c, e = x1 * s;
                if (bf) {
                    a = round_bf16(a), b = round_bf16(b), d = round_bf16(d), e = round_bf16(e);
                }
                store_any(qkv, base + i, a - b, dtype);
                store_any(qkv, base + half + i, d + e, dtype);
            }
        }
    }
    return 0;
}

/* The index of the first maximum of x[0 .. n), a NaN counting as the maximum (the first
 * NaN, then): torch's max(dim=-1).indices. Per lane, the first of its largest values (a
 * strict >), then the largest of the lanes' values at the smallest index. */
static int64_t argmax_row(const float *x, int n) {
    float m = x[0];
    int64_t at = 0;
    int i = 1, nan = x[0] != x[0];
    if (n >= 2 * TK_VL) {
        vf best = vload(x);
        vi lane, idx, seen_nan = (vi)(best != best);
        for (int l = 0; l < TK_VL; l++) lane[l] = l;
        idx = lane;
        for (i = TK_VL; i + TK_VL <= n; i += TK_VL) {
            const vf v = vload(x + i);
            const vi gt = (vi)(v > best);
            best = vselect(gt, v, best);
            idx = ((lane + i) & gt) | (idx & ~gt);
            seen_nan |= (vi)(v != v);
        }
        m = best[0], at = idx[0];
        for (int l = 1; l < TK_VL; l++) {
            if (best[l] > m || (best[l] == m && idx[l] < at)) m = best[l], at = idx[l];
            nan |= seen_nan[l] != 0;
        }
        nan |= seen_nan[0] != 0;
    }
    for (; i < n && !nan; i++) {
        nan = x[i] != x[i];
        if (x[i] > m) m = x[i], at = i;
    }
    if (nan)
        for (i = 0; i < n; i++)
            if (x[i] != x[i]) return i;
    return at;
}

int tk_argmax_rows(int64_t *out, const float *x, long ld, int rows, int cols, int num_threads) {
    if (rows < 0 || cols <= 0 || ld < cols) return 2;
    const int threads = (size_t)rows * cols >= PARALLEL_MIN_ELEMENTS ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int r = 0; r < rows; r++) out[r] = argmax_row(x + (size_t)r * ld, cols);
    return 0;
}
