/*
 * The tile runner the quantized GEMM's strategies share (quant.c says what they compute): the
 * output tiles split between threads, each tile summed whole by one thread into its own
 * buffer, and a tile's sums stored with the bias and the epilogue, rounded once to Y's dtype.
 * It calls no strategy: each strategy hands it its block function (quant.h).
 */
#include "tandem_api.h"

#include <stdlib.h>

#include "quant.h"

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
