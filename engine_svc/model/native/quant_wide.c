/*
 * The quantized GEMM for wide batches: each K slice of a panel is dequantized into a float32
 * [kc][NR] buffer that stays in L1, and gemm.c's micro-tile (gemm_tile.h) runs the row block
 * past it, so the multiply-adds run at the float GEMM's rate while the weights stream at a
 * fifth of its bytes.
 */
#include "quant.h"

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

static void float_block(const qargs *a, const xquant *xq, int m0, int rows, int p, void *buf, float *cs) {
    (void)xq;
    block_times_qpanel(a, m0, rows, p, buf, cs);
}

int tkq_wide(const qargs *a, int nthreads) {
    /* Row blocks as gemm.c sizes them: a block's X stays within ~384 KiB of L2. */
    int mc = (384 * 1024 / (4 * a->K)) / MR * MR;
    if (mc < MR) mc = MR;
    return tkq_run_items(a, NULL, float_block, mc, sizeof(float) * KC * NR, nthreads);
}
