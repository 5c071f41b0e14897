/*
 * The LoRA term of tk_gemm: for each row m whose slot s = row_slot[m] is >= 0,
 *
 *     C[m, :] += (A[m, :] @ La[s]^T) @ Lb[s]          (the adapter's scale folded into Lb)
 *
 * over runs of consecutive rows that share a slot (a prefill chunk is one run; the runner
 * sorts decode rows by adapter, so each adapter's are one too), so both products keep
 * several rows' sums in registers and read each adapter weight once per run:
 *
 *   La [S][K][R]        lora_A^T of every slot, R ranks a row (R: the module's ranks rounded
 *                       up to whole vectors), float32 or bfloat16 (the model's dtype: a
 *                       bfloat16 model's adapters are read at half the bytes)
 *   Lb [S][NP][R][NR]   lora_B^T x scale in the packed weight's panel order: panel p holds
 *                       the ranks' weights for the NR columns of weight panel p, so a
 *                       gate/up pair's gate and up parts add to the accumulators of the
 *                       panels they belong to, before SiLU
 *   xa [M][R]           workspace: A[m] @ La[s]^T, made once per call before any tile
 *
 * The up product runs on gemm.c's own micro-tile (K = the ranks); the down product, with
 * its few output columns, on lora_down_tile below. A slot uses ranks[s] <= R ranks, and
 * weight panel p only ranks spans[s][p] = [t0, t1): those of the part its columns belong to
 * (q, k and v each have their own ranks, and a panel of q columns adds nothing from k's).
 * A row with no slot is computed exactly as without this argument.
 *
 * The struct (tk_lora) is the API's (tandem_api.h); the code runs on gemm_tile.h's micro-tile.
 */
#ifndef TANDEM_GEMM_LORA_H
#define TANDEM_GEMM_LORA_H

#include "gemm_tile.h" /* MR, NR, the micro-tile */
#include "tandem_api.h"
#include "tandem_kernels.h"

#define LORA_MR 4 /* rows of a down tile */
#define LORA_NV 4 /* vectors of ranks of a down tile */

/* Element i of La or Lb, as a pointer of their dtype. */
static inline const void *lora_at(const tk_lora *l, const void *base, size_t i) {
    return (const char *)base + i * (l->ldtype == TK_BF16 ? 2 : 4);
}

/* xa[r][0 .. nv vectors) = a[r] @ la[0 .. K)[0 .. nv vectors) for r < mr (mr, nv literal at
 * each call: the sums stay in mr x nv registers). la: row stride R, of dtype ld. */
static inline __attribute__((always_inline)) void lora_down_tile(
    const int mr, const int nv, const float *a, int lda, const void *la, int R, int ld, int K, float *xa) {
    vf acc[LORA_MR][LORA_NV];
    for (int r = 0; r < mr; r++)
        for (int v = 0; v < nv; v++) acc[r][v] = vzero();
    for (int k = 0; k < K; k++) {
        vf b[LORA_NV];
        for (int v = 0; v < nv; v++) b[v] = vload_any(la, (size_t)k * R + v * TK_VL, ld);
        for (int r = 0; r < mr; r++) {
            const vf ar = vbcast(a[(size_t)r * lda + k]);
            for (int v = 0; v < nv; v++) acc[r][v] += ar * b[v];
        }
    }
    for (int r = 0; r < mr; r++)
        for (int v = 0; v < nv; v++) vstore(xa + (size_t)r * R + v * TK_VL, acc[r][v]);
}

#define LORA_DOWN_NV(mr, nv, ...)                       \
    switch (nv) {                                       \
    case 4: lora_down_tile(mr, 4, __VA_ARGS__); break;  \
    case 3: lora_down_tile(mr, 3, __VA_ARGS__); break;  \
    case 2: lora_down_tile(mr, 2, __VA_ARGS__); break;  \
    default: lora_down_tile(mr, 1, __VA_ARGS__); break; \
    }

/* cs [mr][NR] += A[0..mr)[0..kc) @ panel, mr <= MR (gemm_tile.h's micro-tile; an adapter's
 * panel is small and read once, so nothing is fetched ahead). */
static inline void lora_tile(int mr, const float *a, int lda, const void *panel, int pd, int kc, float *c) {
    rows_times_slice_(a, lda, mr, panel, pd, kc, c, 0, NULL, 0, NULL, NULL);
}

/* The end of the run of rows from m0 that share m0's slot, at most ``most`` rows. */
static inline int lora_run_end(const tk_lora *l, int m0, int m1, int most) {
    int e = m0 + 1;
    while (e < m1 && e - m0 < most && l->row_slot[e] == l->row_slot[m0]) e++;
    return e;
}

/* xa[m] = A[m] @ La[s]^T for the rows m0 .. m1 (A of dtype adtype, row stride lda). buf:
 * LORA_MR * K floats, where bfloat16 rows are widened. */
static void lora_down_rows(const tk_lora *l, const void *a, int lda, int adtype, int K, int m0, int m1, float *buf) {
    for (int m = m0; m < m1;) {
        const int e = lora_run_end(l, m, m1, LORA_MR), s = l->row_slot[m], n = e - m;
        if (s >= 0 && l->ranks[s] > 0) {
            const float *rows = (const float *)a + (size_t)m * lda;
            int ld = lda;
            if (adtype == TK_BF16) {
                for (int r = 0; r < n; r++)
                    for (int k = 0; k < K; k++) buf[(size_t)r * K + k] = load_any(a, (size_t)(m + r) * lda + k, adtype);
                rows = buf, ld = K;
            }
            const int used = (l->ranks[s] + TK_VL - 1) / TK_VL; /* vectors of ranks the slot uses */
            for (int v0 = 0; v0 < used; v0 += LORA_NV) {
                const int nv = used - v0 < LORA_NV ? used - v0 : LORA_NV;
                const void *la = lora_at(l, l->la, (size_t)s * K * l->r + v0 * TK_VL);
                float *xa = l->xa + (size_t)m * l->r + v0 * TK_VL;
                switch (n) {
                case 4: LORA_DOWN_NV(4, nv, rows, ld, la, l->r, l->ldtype, K, xa); break;
                case 3: LORA_DOWN_NV(3, nv, rows, ld, la, l->r, l->ldtype, K, xa); break;
                case 2: LORA_DOWN_NV(2, nv, rows, ld, la, l->r, l->ldtype, K, xa); break;
                default: LORA_DOWN_NV(1, nv, rows, ld, la, l->r, l->ldtype, K, xa); break;
                }
            }
        }
        m = e;
    }
}

/* cs [rows][NR] (rows m0 .. m1 of weight panel p) += each row's xa @ Lb[s][p]. */
static void lora_up_tile(const tk_lora *l, int m0, int m1, int p, float *cs) {
    for (int m = m0; m < m1;) {
        const int e = lora_run_end(l, m, m1, MR), s = l->row_slot[m];
        const int32_t *span = s >= 0 ? l->spans + ((size_t)s * l->np + p) * 2 : NULL;
        if (span != NULL && span[1] > span[0]) {
            const void *panel = lora_at(l, l->lb, (((size_t)s * l->np + p) * l->r + span[0]) * NR);
            lora_tile(e - m, l->xa + (size_t)m * l->r + span[0], l->r, panel, l->ldtype, span[1] - span[0],
                      cs + (size_t)(m - m0) * NR);
        }
        m = e;
    }
}

#endif
