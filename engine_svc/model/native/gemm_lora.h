/*
 * The LoRA term of tk_gemm: for each row m whose slot s = row_slot[m] is >= 0,
 *
 *     C[m, :] += (A[m, :] @ La[s]^T) @ Lb[s]          (the adapter's scale folded into Lb)
 *
 *   La [S][R][K] float32     the down-projections (lora_A) of every slot, ranks[s] rows used
 *   Lb [S][R][ldb] float32   the up-projections (lora_B, transposed), columns in the packed
 *                            weight's panel order: Lb[s][t][p * NR + j] adds to the column j
 *                            of panel p, so a gate/up pair's gate and up parts land in the
 *                            accumulators of the panels they belong to, before SiLU
 *   xa [M][R] float32        workspace: A[m] @ La[s]^T, computed once per row and call
 *
 * Rows of different adapters (and rows with none) mix freely in one call: the base product
 * is one pass over the weights for all rows, and each row adds its own adapter's rank-r
 * term to its output tile while the tile is still in registers or L1. A row with no slot
 * is computed exactly as without this argument.
 */
#ifndef TANDEM_GEMM_LORA_H
#define TANDEM_GEMM_LORA_H

#include "tandem_kernels.h"

typedef struct {
    const int32_t *row_slot; /* [M]: the row's slot, or -1 */
    const float *la;         /* [S][R][K] */
    const float *lb;         /* [S][R][ldb] */
    const int32_t *ranks;    /* [S] */
    int max_rank;            /* R */
    int ldb;                 /* columns of Lb: the weight's panels x NR */
    float *xa;               /* [M][R] */
} tk_lora;

/* xa[m] = A[m] @ La[s]^T for row m (A of dtype adtype, row stride lda, K columns). */
static inline void lora_down_row(const tk_lora *l, const void *a, int lda, int adtype, int K, int m) {
    const int s = l->row_slot[m];
    if (s < 0) return;
    const float *la = l->la + (size_t)s * l->max_rank * K;
    float *xa = l->xa + (size_t)m * l->max_rank;
    const size_t row = (size_t)m * lda;
    for (int t = 0; t < l->ranks[s]; t++) {
        const float *w = la + (size_t)t * K;
        vf acc = vzero();
        int k = 0;
        for (; k + TK_VL <= K; k += TK_VL) acc += vload_any(a, row + k, adtype) * vload(w + k);
        float sum = 0.0f;
        for (int i = 0; i < TK_VL; i++) sum += acc[i];
        for (; k < K; k++) sum += load_any(a, row + k, adtype) * w[k];
        xa[t] = sum;
    }
}

/* cs [rows][nr] (rows m0 .. m1 of panel p's columns) += each row's xa @ Lb[s][:, panel p]. */
static inline void lora_up_tile(const tk_lora *l, int m0, int m1, int p, int nr, float *cs) {
    for (int m = m0; m < m1; m++) {
        const int s = l->row_slot[m];
        if (s < 0) continue;
        const float *xa = l->xa + (size_t)m * l->max_rank;
        const float *lb = l->lb + (size_t)s * l->max_rank * l->ldb + (size_t)p * nr;
        float *c = cs + (size_t)(m - m0) * nr;
        for (int j = 0; j < nr; j += TK_VL) {
            vf acc = vload(c + j);
            for (int t = 0; t < l->ranks[s]; t++) acc += vbcast(xa[t]) * vload(lb + (size_t)t * l->ldb + j);
            vstore(c + j, acc);
        }
    }
}

#endif
