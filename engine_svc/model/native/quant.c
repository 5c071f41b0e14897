/*
 * Y = X @ W^T with W kept quantized: weight-only int8 and 4-bit GEMM.
 *
 *   X  [M, K] float32 (row stride ldx); bfloat16 activations are widened by the caller
 *   W  [N, K] in groups of G consecutive weights along K, each with a float32 scale and
 *      (optionally) a float32 min:  w = q * scale + min
 *        kind 8: qs int8  [N, K]          (GGUF Q8_0, Q6_K as groups of 16, Q5_K's 5-bit
 *                                          values with their mins)
 *        kind 4: qs uint8 [N, K / 2]      (GGUF Q4_0 / Q4_1 / Q4_K): in group g of a row,
 *                byte j holds weight g*32 + j in its low nibble and g*32 + 16 + j in its high
 *      scale, min [N, K / G]
 *   Y  [M, N] float32 or bfloat16 (row stride ldy), rounded once
 *
 * Work is split by tiles of NT weight rows. A tile's rows are dequantized into a float32
 * buffer (NT * K floats: 24 KiB at K = 1536, in L1/L2), then every row of X goes past it:
 * the quantized bytes stream from memory once per call, which is what bounds a decode step.
 * Each dot product is a sum of float32 multiply-adds of exactly the dequantized weight, so the
 * result is F.linear(X, dequantized W) up to the order of the additions.
 */
#include <stdlib.h>

#include "tandem_kernels.h"

#define NT 4
#if defined(__AVX512F__)
#define MT 4
#else
#define MT 2
#endif

enum { TK_Q8 = 8, TK_Q4 = 4 };

static void dequant_row(int kind, const void *qs, const float *scale, const float *min, int group, int K, int n,
                        float *out) {
    const int ng = K / group;
    const float *s = scale + (size_t)n * ng;
    const float *mn = min ? min + (size_t)n * ng : NULL;
    if (kind == TK_Q8) {
        const int8_t *q = (const int8_t *)qs + (size_t)n * K;
        for (int g = 0; g < ng; g++) {
            const float sc = s[g], m0 = mn ? mn[g] : 0.0f;
            for (int j = 0; j < group; j++) out[g * group + j] = (float)q[g * group + j] * sc + m0;
        }
    } else {
        const uint8_t *q = (const uint8_t *)qs + (size_t)n * (K / 2);
        for (int g = 0; g < ng; g++) {
            const float sc = s[g], m0 = mn ? mn[g] : 0.0f;
            const uint8_t *b = q + g * 16;
            float *o = out + g * 32;
            for (int j = 0; j < 16; j++) {
                o[j] = (float)(b[j] & 15) * sc + m0;
                o[j + 16] = (float)(b[j] >> 4) * sc + m0;
            }
        }
    }
}

static inline float hsum(vf v) {
    float s = 0.0f;
    for (int i = 0; i < TK_VL; i++) s += v[i];
    return s;
}

/* Y[m0..m0+mt)[n0..n0+nt) from the dequantized rows w [nt][K]. */
static inline __attribute__((always_inline)) void tile(const int mt, const int nt, const float *x, long ldx,
                                                       const float *w, int K, float *sums) {
    vf acc[MT][NT];
    for (int i = 0; i < mt; i++)
        for (int j = 0; j < nt; j++) acc[i][j] = vzero();
    for (int k = 0; k < K; k += TK_VL) {
        vf wv[NT];
        for (int j = 0; j < nt; j++) wv[j] = vload(w + (size_t)j * K + k);
        for (int i = 0; i < mt; i++) {
            const vf xv = vload(x + (size_t)i * ldx + k);
            for (int j = 0; j < nt; j++) acc[i][j] += xv * wv[j];
        }
    }
    for (int i = 0; i < mt; i++)
        for (int j = 0; j < nt; j++) sums[i * NT + j] = hsum(acc[i][j]);
}

int tk_qgemm(const float *x, long ldx, int kind, const void *qs, const float *scale, const float *min, int group,
             void *y, long ldy, int ydtype, int M, int N, int K, int nthreads) {
    if (K % 32 || (kind != TK_Q8 && kind != TK_Q4) || (group != 16 && group != 32) || (kind == TK_Q4 && group != 32))
        return 1;
    const int num_tiles = (N + NT - 1) / NT;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        float *w = aligned_alloc(64, (size_t)NT * K * sizeof(float));
        if (!w) {
#pragma omp atomic write
            failed = 2;
        }
#pragma omp for schedule(dynamic, 1)
        for (int t = 0; t < num_tiles; t++) {
            if (!w) continue;
            const int n0 = t * NT, nt = N - n0 < NT ? N - n0 : NT;
            for (int j = 0; j < nt; j++) dequant_row(kind, qs, scale, min, group, K, n0 + j, w + (size_t)j * K);
            float sums[MT * NT];
            for (int m = 0; m < M; m += MT) {
                const int mt = M - m < MT ? M - m : MT;
                const float *xm = x + (size_t)m * ldx;
                if (mt == MT && nt == NT)
                    tile(MT, NT, xm, ldx, w, K, sums); /* the common case, with literal bounds */
                else
                    tile(mt, nt, xm, ldx, w, K, sums);
                for (int i = 0; i < mt; i++)
                    for (int j = 0; j < nt; j++) store_any(y, (size_t)(m + i) * ldy + n0 + j, sums[i * NT + j], ydtype);
            }
        }
        free(w);
    }
    return failed;
}
