/*
 * The LoRA term of tk_gemm: for each row m whose slot s = row_slot[m] is >= 0,
 *
 *     C[m, :] += (A[m, :] @ La[s]^T) @ Lb[s]          (the adapter's scale folded into Lb)
 *
 * Both products run on gemm.c's own micro-tile, over runs of consecutive rows that share a
 * slot (a prefill chunk is one run; decode rows of one adapter, sorted together, are too),
 * so they go at the GEMM's pace rather than a dot product's. Rank R is padded to panels:
 *
 *   La [S][RP][K][NR]   lora_A^T of every slot in panels of NR ranks (RP panels, R = RP x NR),
 *                       float32 or bfloat16 (the model's dtype: half the bytes a step reads)
 *   Lb [S][NP][R][NR]   lora_B^T x scale in the packed weight's panel order: panel p holds
 *                       the ranks' weights for the NR columns of weight panel p, so a
 *                       gate/up pair's gate and up parts add to the accumulators of the
 *                       panels they belong to, before SiLU
 *   xa [M][R]           workspace: A[m] @ La[s]^T, made once per call before any tile
 *
 * A slot uses ranks[s] <= R ranks, and weight panel p only ranks spans[s][p] = [t0, t1):
 * those of the part its columns belong to (q, k and v each have their own ranks, and a
 * panel of q columns adds nothing from k's). A row with no slot is computed exactly as
 * without this argument. The functions below use gemm.c's micro_tile,
 * MR and NR: gemm.c includes this header twice, the types first, the code after micro_tile.
 */
#ifndef TANDEM_GEMM_LORA_TYPES
#define TANDEM_GEMM_LORA_TYPES

#include <stdint.h>

typedef struct {
    const int32_t *row_slot; /* [M]: the row's slot, or -1 */
    const void *la;          /* [S][RP][K][NR], of dtype ldtype */
    const void *lb;          /* [S][NP][RP * NR][NR], of dtype ldtype */
    const int32_t *ranks;    /* [S] */
    const int32_t *spans;    /* [S][NP][2]: the ranks [t0, t1) weight panel p adds */
    int rp;                  /* panels of ranks: R = rp * NR */
    int np;                  /* panels of the packed weight */
    float *xa;               /* [M][R] */
    int ldtype;              /* TK_F32 or TK_BF16: la and lb as the model's weights are */
} tk_lora;

#elif defined(NR) && !defined(TANDEM_GEMM_LORA_CODE)
#define TANDEM_GEMM_LORA_CODE

/* The micro-tile for a literal row count (so its accumulators stay in registers). */
#define LORA_TILE(mr, a, lda, panel, pd, kc, c, first)                                      \
    switch (mr) {                                                                          \
    case 12: micro_tile(12, a, lda, panel, pd, kc, c, first, (const char *)(panel)); break; \
    case 11: micro_tile(11, a, lda, panel, pd, kc, c, first, (const char *)(panel)); break; \
    case 10: micro_tile(10, a, lda, panel, pd, kc, c, first, (const char *)(panel)); break; \
    case 9: micro_tile(9, a, lda, panel, pd, kc, c, first, (const char *)(panel)); break;   \
    case 8: micro_tile(8, a, lda, panel, pd, kc, c, first, (const char *)(panel)); break;   \
    case 7: micro_tile(7, a, lda, panel, pd, kc, c, first, (const char *)(panel)); break;   \
    case 6: micro_tile(6, a, lda, panel, pd, kc, c, first, (const char *)(panel)); break;   \
    case 5: micro_tile(5, a, lda, panel, pd, kc, c, first, (const char *)(panel)); break;   \
    case 4: micro_tile(4, a, lda, panel, pd, kc, c, first, (const char *)(panel)); break;   \
    case 3: micro_tile(3, a, lda, panel, pd, kc, c, first, (const char *)(panel)); break;   \
    case 2: micro_tile(2, a, lda, panel, pd, kc, c, first, (const char *)(panel)); break;   \
    default: micro_tile(1, a, lda, panel, pd, kc, c, first, (const char *)(panel)); break;  \
    }

/* Element (s, q, k, j) of La / (s, p, t, j) of Lb, as a pointer of their dtype. */
static inline const void *lora_at(const tk_lora *l, const void *base, size_t index) {
    return (const char *)base + index * (l->ldtype == TK_BF16 ? 2 : 4);
}

/* Rows m0 .. m0 + MR at most: the end of the run of rows that share m0's slot. */
static inline int lora_run_end(const tk_lora *l, int m0, int m1) {
    int e = m0 + 1;
    while (e < m1 && e - m0 < MR && l->row_slot[e] == l->row_slot[m0]) e++;
    return e;
}

/* xa[m] = A[m] @ La[s]^T for the rows m0 .. m1 (A of dtype adtype, row stride lda). buf:
 * MR * K floats, where bfloat16 rows are widened. */
static void lora_down_rows(const tk_lora *l, const void *a, int lda, int adtype, int K, int m0, int m1, float *buf) {
    const int R = l->rp * NR;
    float tile[MR * NR];
    for (int m = m0; m < m1;) {
        const int e = lora_run_end(l, m, m1), s = l->row_slot[m], n = e - m;
        if (s >= 0) {
            const float *rows = (const float *)a + (size_t)m * lda;
            int ld = lda;
            if (adtype == TK_BF16) {
                for (int r = 0; r < n; r++)
                    for (int k = 0; k < K; k++) buf[(size_t)r * K + k] = load_any(a, (size_t)(m + r) * lda + k, adtype);
                rows = buf, ld = K;
            }
            const int used = (l->ranks[s] + NR - 1) / NR;
            for (int q = 0; q < used; q++) {
                const void *panel = lora_at(l, l->la, ((size_t)s * l->rp + q) * K * NR);
                LORA_TILE(n, rows, ld, panel, l->ldtype, K, tile, 1);
                for (int r = 0; r < n; r++) memcpy(l->xa + (size_t)(m + r) * R + q * NR, tile + r * NR, NR * sizeof(float));
            }
        }
        m = e;
    }
}

/* cs [rows][NR] (rows m0 .. m1 of weight panel p) += each row's xa @ Lb[s][p]. */
static void lora_up_tile(const tk_lora *l, int m0, int m1, int p, float *cs) {
    const int R = l->rp * NR;
    for (int m = m0; m < m1;) {
        const int e = lora_run_end(l, m, m1), s = l->row_slot[m];
        const int32_t *span = s >= 0 ? l->spans + ((size_t)s * l->np + p) * 2 : NULL;
        if (span != NULL && span[1] > span[0]) {
            const void *panel = lora_at(l, l->lb, (((size_t)s * l->np + p) * R + span[0]) * NR);
            LORA_TILE(e - m, l->xa + (size_t)m * R + span[0], R, panel, l->ldtype, span[1] - span[0],
                      cs + (size_t)(m - m0) * NR, 0);
        }
        m = e;
    }
}

#endif
