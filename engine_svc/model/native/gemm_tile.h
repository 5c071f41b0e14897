/*
 * The register micro-tile of the packed GEMM, shared by gemm.c (weights packed at load) and
 * quant.c (quantized weights dequantized, a K slice at a time, into the same panel layout).
 *
 *   panel  [kc][NR] float32 or bfloat16: NR = 2 * TK_VL output columns, K down the rows
 *   A      rows of float32, row stride lda
 *   cs     [rows][NR] float32 sums: a tile's first K slice sets them, later ones add
 *
 * One micro-tile holds MR rows x NR columns in 2 * MR vector registers over a K slice;
 * each sum is a chain of float32 multiply-adds in k order, whoever calls it.
 */
#ifndef TANDEM_GEMM_TILE_H
#define TANDEM_GEMM_TILE_H

#include "tandem_kernels.h"

#if defined(__AVX512F__)
#define MR 12
#else
#define MR 6
#endif
#define NR (2 * TK_VL)
#define KC (4096 / NR) /* K slice: a panel's slice is 16 KiB of float32, it stays in L1 */

/* Rows of the next of `tiles` micro-tiles over `rows` rows: as even as they go (37 rows
 * as 9 9 9 10, not 12 12 12 1). A tile of one row keeps 2 multiply-add chains going where
 * the FMA units take 8 (2 units x 4 cycles): its k steps cost a 4-row tile's. Which tile a
 * row is in never changes its sums. */
static inline int tile_rows(int rows, int tiles) { return rows / tiles; }

/* Rows of one micro-tile: acc (=|+=) A[0..mr)[0..kc) @ panel[0..kc)[0..NR), kept in cs [mr][NR].
 * pf: the weights one slice ahead, fetched into cache while this slice computes. Only the
 * first tile of a slice reads it from memory, and the hardware prefetcher alone does not
 * run far enough ahead of a tile that is busy with multiply-adds (a 49k-wide LM head at
 * decode sizes reached ~55% of the in-cache rate without it). With prefetch 0 (a literal),
 * none: the panel is in L1 already. */
static inline __attribute__((always_inline)) void micro_tile(
    const int mr, const float *a, int lda, const void *panel, int pdtype, int kc, float *cs, int first, const char *pf,
    const int prefetch) {
    vf acc[MR][2];
    for (int r = 0; r < mr; r++) {
        acc[r][0] = first ? vzero() : vload(cs + r * NR);
        acc[r][1] = first ? vzero() : vload(cs + r * NR + TK_VL);
    }
    if (pdtype == TK_BF16) {
        const bf16 *b = (const bf16 *)panel;
        for (int k = 0; k < kc; k++) {
            if (prefetch) __builtin_prefetch(pf + (size_t)k * NR * 2, 0, 3); /* NR bfloat16: 64 bytes (AVX512) or 32 */
            const vf b0 = vload_bf16(b + (size_t)k * NR), b1 = vload_bf16(b + (size_t)k * NR + TK_VL);
            for (int r = 0; r < mr; r++) {
                const vf ar = vbcast(a[(size_t)r * lda + k]);
                acc[r][0] += ar * b0;
                acc[r][1] += ar * b1;
            }
        }
    } else {
        const float *b = (const float *)panel;
        for (int k = 0; k < kc; k++) {
            if (prefetch) {
                __builtin_prefetch(pf + (size_t)k * NR * 4, 0, 3);
                if (NR * 4 > 64) __builtin_prefetch(pf + (size_t)k * NR * 4 + 64, 0, 3); /* AVX512: 2 lines per k */
            }
            const vf b0 = vload(b + (size_t)k * NR), b1 = vload(b + (size_t)k * NR + TK_VL);
            for (int r = 0; r < mr; r++) {
                const vf ar = vbcast(a[(size_t)r * lda + k]);
                acc[r][0] += ar * b0;
                acc[r][1] += ar * b1;
            }
        }
    }
    for (int r = 0; r < mr; r++) {
        vstore(cs + r * NR, acc[r][0]);
        vstore(cs + r * NR + TK_VL, acc[r][1]);
    }
}

/* A tile's rows done: done(ctx, first row, rows, their sums in cs), called after each tile
 * of a product's last slice, so the tile's results leave while the next tiles compute. */
typedef void (*tile_done_fn)(void *ctx, int m, int mr, float *cs);

/* cs [rows][NR] (=|+=) A[0..rows)[0..kc) @ one panel slice, MR rows at a time. a: row 0's
 * element k0 (the slice's first), row stride lda; done (or NULL) after each tile. */
static inline __attribute__((always_inline)) void rows_times_slice_(
    const float *a, int lda, int rows, const void *pk, int pdtype, int kc, float *cs, int first, const char *pf,
    const int prefetch, tile_done_fn done, void *ctx) {
    const int tiles = (rows + MR - 1) / MR;
    for (int i = 0, m = 0; i < tiles; i++) {
        const int mr = tile_rows(rows - m, tiles - i);
        const float *am = a + (size_t)m * lda;
        float *c = cs + (size_t)m * NR;
        m += mr;
        switch (mr) { /* a literal row count per case: the tile stays in registers */
#if MR > 6
        case 12: micro_tile(12, am, lda, pk, pdtype, kc, c, first, pf, prefetch); break;
        case 11: micro_tile(11, am, lda, pk, pdtype, kc, c, first, pf, prefetch); break;
        case 10: micro_tile(10, am, lda, pk, pdtype, kc, c, first, pf, prefetch); break;
        case 9: micro_tile(9, am, lda, pk, pdtype, kc, c, first, pf, prefetch); break;
        case 8: micro_tile(8, am, lda, pk, pdtype, kc, c, first, pf, prefetch); break;
        case 7: micro_tile(7, am, lda, pk, pdtype, kc, c, first, pf, prefetch); break;
#endif
        case 6: micro_tile(6, am, lda, pk, pdtype, kc, c, first, pf, prefetch); break;
        case 5: micro_tile(5, am, lda, pk, pdtype, kc, c, first, pf, prefetch); break;
        case 4: micro_tile(4, am, lda, pk, pdtype, kc, c, first, pf, prefetch); break;
        case 3: micro_tile(3, am, lda, pk, pdtype, kc, c, first, pf, prefetch); break;
        case 2: micro_tile(2, am, lda, pk, pdtype, kc, c, first, pf, prefetch); break;
        default: micro_tile(1, am, lda, pk, pdtype, kc, c, first, pf, prefetch); break;
        }
        if (done) done(ctx, m - mr, mr, c);
    }
}

/* A slice streamed from memory, the next one (pf) fetched meanwhile (gemm.c's panels);
 * done (or NULL) after each tile, with rows counted from 0. */
static inline __attribute__((always_inline)) void rows_times_slice(
    const float *a, int lda, int rows, const void *pk, int pdtype, int kc, float *cs, int first, const char *pf,
    tile_done_fn done, void *ctx) {
    rows_times_slice_(a, lda, rows, pk, pdtype, kc, cs, first, pf, 1, done, ctx);
}

/* A float32 slice already in L1 (quant.c's dequantized buffer): nothing to fetch. */
static inline __attribute__((always_inline)) void rows_times_l1_slice(
    const float *a, int lda, int rows, const float *pk, int kc, float *cs, int first) {
    rows_times_slice_(a, lda, rows, pk, TK_F32, kc, cs, first, NULL, 0, NULL, NULL);
}

/* The gate/up epilogue on one row of a tile: gr [NR] := silu(gate + bg) * (up + bu), with
 * torch's roundings in bfloat16 when bf (gate, up, silu and the product each rounded).
 * bg, bu: the gate's and the up projection's bias for these columns, or NULL. In vectors:
 * the epilogue's exp costs as much as a scalar loop's whole tile of multiply-adds (vsilu
 * is silu lane by lane, same operations, same bits). */
static inline void silu_mul_row(float *gr, const float *ur, const float *bg, const float *bu, int bf) {
    for (int j = 0; j < NR; j += TK_VL) {
        vf x = vload(gr + j), u = vload(ur + j);
        if (bg) x += vload(bg + j), u += vload(bu + j);
        if (bf) x = vround_bf16(x), u = vround_bf16(u);
        x = vsilu(x);
        if (bf) x = vround_bf16(x);
        vstore(gr + j, x * u);
    }
}

#endif
