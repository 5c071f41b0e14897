/*
 * Y = X @ W^T (+ bias) with W kept quantized: weight-only int8 and 4-bit GEMM.
 *
 * W is packed at load (quant_pack.py) in the panels of the packed GEMM (gemm.c): panel p
 * holds output columns p*NR .. p*NR+NR-1 (zero past N) with K down the rows, so that the NR
 * weights of one k are one pair of vectors, dequantized without a transpose:
 *
 *   kind 8: qs int8  [P][K][NR]          w[k][j] = q * scale + min
 *   kind 4: qs uint8 [P][K/2][NR]        byte (k/2, j): k even in the low nibble, k + 1 in the high
 *   scale, min [P][K/G][NR]               float32 or float16 (sdtype); min NULL: 0
 *   bias [P * NR] float32 in panel order, or NULL
 *
 *   X  [M, K] float32, row stride ldx (bfloat16 activations are widened by the caller)
 *   Y  [M, N] float32 or bfloat16, row stride ldy, rounded once
 *
 * With the SILU_MUL epilogue (gate/up projection) the panels alternate gate q / up q, as
 * gemm.c packs pairs, and Y [M, N] = silu(X @ Wg^T) * (X @ Wu^T).
 *
 * Four strategies, in three files beside this one (quant.h lists them): up to FUSED_MAX_ROWS
 * rows (decode), each k's weights dequantized in registers, or for one and two rows (one on
 * AVX2) the groups' algebra, s * sum(x q) + m * sum(x) (quant_fused.c); wider, each K slice of
 * a panel dequantized into an L1 buffer under gemm.c's micro-tile (quant_wide.c); with int8
 * activations, integer dot products (quant_int8.c). Every output tile is summed whole by one
 * thread, so results do not depend on the thread count; each float sum is float32
 * multiply-adds of exactly the dequantized weights, F.linear(X, dequantized W) up to the
 * order of the additions (for one and two rows, their order and grouping).
 */
#include "tandem_api.h"

#include <stdlib.h>

#include "quant.h"

int tk_qgemm_int8(void) { return TK_INT8_DOT; }

/* Rows m0 .. m0+rows of output tile q (columns q*NR ..) from its sums cs (and, for the gate/up
 * epilogue, the up projection's in up), bias added, rounded once to Y's dtype. */
void tkq_store_tile(const qargs *a, int m0, int rows, int q, float *cs, const float *up) {
    const int col0 = q * NR, ncols = a->N - col0 < NR ? a->N - col0 : NR, bf = a->ydtype == TK_BF16;
    for (int r = 0; r < rows; r++) {
        float *cr = cs + (size_t)r * NR;
        if (a->epilogue == TK_EPI_SILU_MUL) {
            const float *bg = a->bias ? a->bias + (size_t)(2 * q) * NR : NULL;
            silu_mul_row(cr, up + (size_t)r * NR, bg, bg ? bg + NR : NULL, bf);
        } else if (a->bias) {
            for (int j = 0; j < NR; j += TK_VL) vstore(cr + j, vload(cr + j) + vload(a->bias + (size_t)q * NR + j));
        }
        const size_t at = (size_t)(m0 + r) * a->ldy + col0;
        if (ncols == NR) {
            vstore_any(a->y, at, vload(cr), a->ydtype);
            vstore_any(a->y, at + TK_VL, vload(cr + TK_VL), a->ydtype);
        } else {
            for (int j = 0; j < ncols; j++) store_any(a->y, at + j, cr[j], a->ydtype);
        }
    }
}

/* A wide product's (row block of mc rows, output tile) items, handed out by one counter to
 * the threads, each with its own scratch (buf_bytes, and the sums); with xq, X's rows are
 * quantized first by the same threads. Returns 0, or 2 if scratch could not be allocated. */
int tkq_run_items(const qargs *a, const xquant *xq, block_fn block, int mc, size_t buf_bytes, int nthreads) {
    const int M = a->M, silu = a->epilogue == TK_EPI_SILU_MUL, num_tiles = (a->N + NR - 1) / NR;
    const int num_items = (M + mc - 1) / mc * num_tiles;
    int threads = 2.0 * M * a->N * a->K * (silu ? 2 : 1) < 2e5 ? 1 : nthreads;
    if (threads > num_items) threads = num_items;
    int next = 0, failed = 0;
#pragma omp parallel num_threads(threads)
    {
#if TK_INT8_DOT
        if (xq != NULL) { /* every thread takes this branch or none; the loop ends in a barrier */
#pragma omp for schedule(static)
            for (int r = 0; r < M; r++)
                tkq_quantize_row(a->x + (size_t)r * a->ldx, a->K, a->group, a->kind, xq->q + (size_t)r * a->K,
                                 xq->sx + (size_t)r * a->ng, xq->xs + (size_t)r * a->ng, xq->xc + (size_t)r * a->ng);
        }
#endif
        void *buf = aligned_alloc(64, buf_bytes);
        float *cs = malloc(sizeof(float) * 2 * (size_t)mc * NR);
        if (buf == NULL || cs == NULL) {
#pragma omp atomic write
            failed = 2;
        }
        for (;;) {
            int item;
#pragma omp atomic capture
            item = next++;
            if (item >= num_items || buf == NULL || cs == NULL) break;
            const int mb = item / num_tiles, q = item % num_tiles;
            const int m0 = mb * mc, rows = M - m0 < mc ? M - m0 : mc;
            block(a, xq, m0, rows, silu ? 2 * q : q, buf, cs);
            if (silu) block(a, xq, m0, rows, 2 * q + 1, buf, cs + (size_t)rows * NR);
            tkq_store_tile(a, m0, rows, q, cs, cs + (size_t)rows * NR);
        }
        free(buf);
        free(cs);
    }
    return failed;
}

int tk_qgemm(const tk_linear *w, const float *x, long ldx, void *y, long ldy, int ydtype, int M, int num_threads) {
    const int kind = w->kind, sdtype = w->sdtype, group = w->group, N = w->n, K = w->k, epilogue = w->epilogue;
    const int xquant = w->xquant;
    if (!w->quantized || M < 0 || N <= 0 || K <= 0 || K % 32 || (kind != TK_Q8 && kind != TK_Q4) || group < 16 ||
        group % 16 || K % group || (sdtype != TK_F32 && sdtype != TK_F16) ||
        (epilogue != TK_EPI_NONE && epilogue != TK_EPI_SILU_MUL) || ldx > 0x7fffffff ||
        (xquant != 0 && (xquant != 1 || !TK_INT8_DOT || group > 512)))
        return 1;
    if (M == 0) return 0;
    qargs a = {
        .x = x,
        .ldx = (int)ldx,
        .kind = kind,
        .qs = (const uint8_t *)w->w,
        .panel_qbytes = (size_t)K * NR / (kind == TK_Q4 ? 2 : 1),
        .scale = w->scale,
        .min = w->min,
        .sdtype = sdtype,
        .group = group,
        .ng = K / group,
        .bias = w->bias,
        .y = y,
        .ldy = ldy,
        .ydtype = ydtype,
        .M = M,
        .N = N,
        .K = K,
        .epilogue = epilogue,
    };
#if TK_INT8_DOT
    if (xquant) return tkq_int8(&a, num_threads);
#endif
    if (M <= FUSED_MAX_ROWS) return tkq_fused(&a, num_threads);
    return tkq_wide(&a, num_threads);
}
