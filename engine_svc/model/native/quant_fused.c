/*
 * The quantized GEMM for few rows (decode): up to FUSED_MAX_ROWS rows, each k's weights are
 * dequantized in registers and used at once by every row, so the quantized bytes are the only
 * weight traffic. One and two rows (one on AVX2) skip the dequantization: each group's sum is
 * s * sum(x q) + m * sum(x) (alg_panel). Output tiles are dealt to the threads whole.
 */
#include "quant.h"

#include <stdlib.h>

/* Rows of the register path's accumulator array. Measured with GCC 12 on AVX2: sized for
 * exactly 4 rows, 4 rows ran 1.5x slower than with the array sized for 6. */
#define FUSED_ACC_ROWS (FUSED_MAX_ROWS < 6 ? 6 : FUSED_MAX_ROWS)

/* Rows that take the groups' algebra (alg_panel): its partial and total sums take 3 ch
 * registers a row and half, with ch chains: 4 for one row on AVX512, 2 otherwise. */
#if defined(__AVX512F__)
#define ALG_MAX_ROWS 2
#define ALG_CHAINS_1 4
#else
#define ALG_MAX_ROWS 1
#define ALG_CHAINS_1 2
#endif

/* cs [mr][NR] = X[0..mr) @ panel p, each k's weights dequantized and used at once. Even and
 * odd k add into separate accumulators (summed at the end), so that a row's chains are not
 * bound by the multiply-add latency; on AVX2 (16 registers) only up to 2 rows. */
static inline __attribute__((always_inline)) void fused_panel(
    const int mr, const qargs *a, const float *x, int p, float *cs) {
    const int par = mr <= (TK_VL == 16 ? 4 : 2); /* odd k in their own accumulators */
    vf acc[FUSED_ACC_ROWS][2][2];
    for (int r = 0; r < mr; r++)
        for (int h = 0; h < 2; h++) acc[r][h][0] = acc[r][h][1] = vzero();
    const size_t sb = (size_t)p * a->ng * NR;
    const uint8_t *q = a->qs + (size_t)p * a->panel_qbytes;
    for (int g = 0; g < a->ng; g++) {
        vf s[2], m[2];
        group_vectors(a->scale, a->sdtype, sb + (size_t)g * NR, s);
        group_vectors(a->min, a->sdtype, sb + (size_t)g * NR, m);
        const int kend = (g + 1) * a->group;
        for (int k = g * a->group; k < kend; k += 2) {
            vf w0[2], w1[2];
            if (a->kind == TK_Q4) {
                __builtin_prefetch(q + (size_t)(k / 2) * NR + PF_BYTES, 0, 3);
                q4_pair(q + (size_t)(k / 2) * NR, s, m, w0, w1);
            } else {
                __builtin_prefetch(q + (size_t)k * NR + PF_BYTES, 0, 3);
                __builtin_prefetch(q + (size_t)k * NR + PF_BYTES + NR, 0, 3);
                q8_k((const int8_t *)q + (size_t)k * NR, s, m, w0);
                q8_k((const int8_t *)q + (size_t)(k + 1) * NR, s, m, w1);
            }
            for (int r = 0; r < mr; r++) {
                const vf x0 = vbcast(x[(size_t)r * a->ldx + k]), x1 = vbcast(x[(size_t)r * a->ldx + k + 1]);
                acc[r][0][0] += x0 * w0[0];
                acc[r][1][0] += x0 * w0[1];
                acc[r][0][par] += x1 * w1[0];
                acc[r][1][par] += x1 * w1[1];
            }
        }
    }
    for (int r = 0; r < mr; r++)
        for (int h = 0; h < 2; h++) vstore(cs + r * NR + h * TK_VL, par ? acc[r][h][0] + acc[r][h][1] : acc[r][h][0]);
}

/* The same product for the fewest rows, by the groups' algebra: within a group g a weight is
 * s * q + m, so a row's sum over the group is s * (sum_k x_k q_k) + m * xs[g], xs[g] = sum_k x_k
 * over the group (a->xsum, computed once per call). Each weight then costs one conversion
 * and one multiply-add instead of a conversion and two, and the group sums run in ch
 * independent chains a row and half (k mod ch ... mod 2 ch), so that one row's adds are not
 * bound by the multiply-add latency. The result is F.linear's up to the order and grouping
 * of the additions (within 1e-5: tests/engine/model/native/test_quant_kernels.py). */
static inline __attribute__((always_inline)) void alg_panel(
    const int mr, const int ch, const qargs *a, const float *x, int p, float *cs) {
    vf tot[ALG_MAX_ROWS][2];
    for (int r = 0; r < mr; r++) tot[r][0] = tot[r][1] = vzero();
    const size_t sb = (size_t)p * a->ng * NR;
    const uint8_t *q = a->qs + (size_t)p * a->panel_qbytes;
    for (int g = 0; g < a->ng; g++) {
        vf part[ALG_MAX_ROWS][2][4];
        for (int r = 0; r < mr; r++)
            for (int h = 0; h < 2; h++)
                for (int c = 0; c < ch; c++) part[r][h][c] = vzero();
        const int kend = (g + 1) * a->group;
        for (int k = g * a->group; k < kend; k += 2 * ch) {
            /* ch pairs (k + 2c, k + 2c + 1): chain c takes both k of pair c */
            for (int c = 0; c < ch; c++) {
                const int kk = k + 2 * c;
                vf q0[2], q1[2];
                if (a->kind == TK_Q4) {
                    const uint8_t *b = q + (size_t)(kk / 2) * NR;
                    __builtin_prefetch(b + PF_BYTES, 0, 3);
                    for (int h = 0; h < 2; h++) {
                        const vi u = widen_u8(b + h * TK_VL);
                        q0[h] = __builtin_convertvector(u & 15, vf);
                        q1[h] = __builtin_convertvector(u >> 4, vf);
                    }
                } else {
                    const int8_t *b = (const int8_t *)q + (size_t)kk * NR;
                    __builtin_prefetch(b + PF_BYTES, 0, 3);
                    __builtin_prefetch(b + PF_BYTES + NR, 0, 3);
                    for (int h = 0; h < 2; h++) {
                        q0[h] = __builtin_convertvector(widen_i8(b + h * TK_VL), vf);
                        q1[h] = __builtin_convertvector(widen_i8(b + NR + h * TK_VL), vf);
                    }
                }
                for (int r = 0; r < mr; r++) {
                    const vf x0 = vbcast(x[(size_t)r * a->ldx + kk]), x1 = vbcast(x[(size_t)r * a->ldx + kk + 1]);
                    for (int h = 0; h < 2; h++) part[r][h][c] += x0 * q0[h] + x1 * q1[h];
                }
            }
        }
        vf s[2], m[2];
        group_vectors(a->scale, a->sdtype, sb + (size_t)g * NR, s);
        if (a->min != NULL) group_vectors(a->min, a->sdtype, sb + (size_t)g * NR, m);
        for (int r = 0; r < mr; r++)
            for (int h = 0; h < 2; h++) {
                vf sum = part[r][h][0];
                for (int c = 1; c < ch; c++) sum += part[r][h][c];
                tot[r][h] += sum * s[h];
                if (a->min != NULL) tot[r][h] += vbcast(a->xsum[(size_t)r * a->ng + g]) * m[h];
            }
    }
    for (int r = 0; r < mr; r++)
        for (int h = 0; h < 2; h++) vstore(cs + r * NR + h * TK_VL, tot[r][h]);
}

static void fused_rows(const qargs *a, const float *x, int rows, int p, float *cs) {
    switch (rows) { /* a literal row count per case: the accumulators stay in registers */
#if FUSED_MAX_ROWS >= 8
    case 8: fused_panel(8, a, x, p, cs); break;
#endif
#if FUSED_MAX_ROWS >= 7
    case 7: fused_panel(7, a, x, p, cs); break;
#endif
#if FUSED_MAX_ROWS >= 6
    case 6: fused_panel(6, a, x, p, cs); break;
#endif
#if FUSED_MAX_ROWS >= 5
    case 5: fused_panel(5, a, x, p, cs); break;
#endif
#if FUSED_MAX_ROWS >= 4
    case 4: fused_panel(4, a, x, p, cs); break;
#endif
#if FUSED_MAX_ROWS >= 3
    case 3: fused_panel(3, a, x, p, cs); break;
#endif
#if ALG_MAX_ROWS >= 2
    case 2: alg_panel(2, 2, a, x, p, cs); break;
#else
    case 2: fused_panel(2, a, x, p, cs); break;
#endif
    default: alg_panel(1, ALG_CHAINS_1, a, x, p, cs); break;
    }
}

int tkq_fused(qargs *a, int nthreads) {
    const int M = a->M, silu = a->epilogue == TK_EPI_SILU_MUL, num_tiles = (a->N + NR - 1) / NR;
    const double flops = 2.0 * M * a->N * a->K * (silu ? 2 : 1);
    const int threads = flops < 2e5 ? 1 : nthreads;
    float *xsum = NULL;
    if (M <= ALG_MAX_ROWS && a->min != NULL) { /* alg_panel's group sums of X */
        xsum = malloc(sizeof(float) * (size_t)M * a->ng);
        if (xsum == NULL) return 2;
        for (int r = 0; r < M; r++)
            for (int g = 0; g < a->ng; g++) {
                float sum = 0;
                for (int k = g * a->group; k < (g + 1) * a->group; k++) sum += a->x[(size_t)r * a->ldx + k];
                xsum[(size_t)r * a->ng + g] = sum;
            }
        a->xsum = xsum;
    }
#pragma omp parallel for schedule(dynamic, 2) num_threads(threads)
    for (int q = 0; q < num_tiles; q++) {
        float cs[2][FUSED_MAX_ROWS * NR];
        fused_rows(a, a->x, M, silu ? 2 * q : q, cs[0]);
        if (silu) fused_rows(a, a->x, M, 2 * q + 1, cs[1]);
        tkq_store_tile(a, 0, M, q, cs[0], cs[1]);
    }
    free(xsum);
    return 0;
}
