/*
 * C = A @ W^T (+ bias) for the model's linear layers, with W packed once at load time.
 *
 *   A  [M, K] float32 or bfloat16, row stride lda (activations, row-major)
 *   W  [N, K] -> panels of NR = 2 * TK_VL output columns: panel p holds columns
 *      p*NR .. p*NR+NR-1 as [K][NR] (zero-padded past N), float32 or bfloat16
 *   C  [M, N] float32 or bfloat16, row stride ldc
 *
 *      panel 0          panel 1               one micro-tile: MR rows x NR columns,
 *   k ┌──────────┐   ┌──────────┐           accumulated in 2 * MR vector registers over
 *   0 │ n0 .. n15│   │n16 .. n31│           the whole of K, then written once
 *   1 │ n0 .. n15│   │n16 .. n31│
 *   : │          │   │          │
 *
 * Every product is a float32 multiply-add (bfloat16 inputs are widened, which is exact),
 * the result is rounded to C's dtype once: the arithmetic of torch's bfloat16 matmul on a
 * CPU without bfloat16 dot products, and of any float32 matmul. Builds for AVX512-BF16 take
 * bfloat16 products two k steps at a time as dot products, with the same bits
 * (gemm_bf16.h: their bfloat16 panels hold K in pairs).
 *
 * Work items are (row block, panel) pairs. A row block is sized so its A rows stay in the
 * core's L2 cache while the panels stream past. Thread t of n owns the panels
 * [tiles * t / n, tiles * (t + 1) / n) of every row block and takes its items row block by
 * row block, panels in order (work_split.h): the threads share each block's A, each
 * streams its own contiguous part of the weights, and a thread that the OS delays has its
 * remaining items taken over by the others instead of holding up the region's end. With
 * fewer panels than threads, the runs are contiguous runs of whole items instead.
 *
 * SILU_MUL epilogue (gate/up projection): the weight was packed as pairs (gate panel p,
 * up panel p), and C [M, N/2] = silu(A @ Wg^T) * (A @ Wu^T), with torch's roundings in
 * bfloat16 (gate, up, silu and the product each rounded).
 */
#include "tandem_api.h"

#include <omp.h>
#include <stdlib.h>

#include "gemm_bf16.h"
#include "gemm_lora.h" /* the LoRA term, on the micro-tile */
#include "gemm_tile.h" /* MR, NR, KC and the micro-tile, shared with quant.c */
#include "tandem_kernels.h"
#include "work_split.h"

int tk_api_version(void) { return TK_API_VERSION; }

int tk_gemm_nr(void) { return NR; }

int tk_gemm_bf16_dp(void) { return TK_BF16_DP; }

int tk_gemm_panel_k(int K, int pdtype) { return panel_k(K, pdtype); }

void tk_gemm_pack(const void *w, int wdtype, int N, int K, int pairs, void *out, int pdtype) {
    const int half = pairs ? N / 2 : N;
    const int np_half = (half + NR - 1) / NR;
    const int num_panels = pairs ? 2 * np_half : np_half;
    const int kp = panel_k(K, pdtype), dp = kp != K || (TK_BF16_DP && pdtype == TK_BF16);
    for (int p = 0; p < num_panels; p++) {
        const int part = pairs ? p % 2 : 0, q = pairs ? p / 2 : p; /* part 1 = up */
        for (int k = 0; k < kp; k++)
            for (int j = 0; j < NR; j++) {
                const int col = q * NR + j;
                const float x = col < half && k < K ? load_any(w, (size_t)(part * half + col) * K + k, wdtype) : 0.0f;
                store_any(out, (size_t)p * kp * NR + (dp ? pair_index(k, j, NR) : (size_t)k * NR + j), x, pdtype);
            }
    }
}

typedef struct {
    const void *a; /* float32 A (converted when the caller's A is bfloat16), or bfloat16 pairs (dp) */
    int lda;
    int dp; /* bfloat16 dot products: A and the panels in the pair layout of gemm_bf16.h */
    const char *panels;
    int pdtype;
    size_t panel_bytes, elem;
    const float *bias; /* [num_panels * NR] float32, panel order, or NULL */
    void *c;
    int ldc, cdtype;
    int N, K; /* N: columns of C; K: of A, rounded up to pairs where dp */
    int epilogue;
    const tk_lora *lora; /* a LoRA term per row (gemm_lora.h), or NULL */
} gemm_args;

/* cs [rows][NR] = A[m0..m1) @ panel p, K in slices of KC so that the panel's slice stays
 * in L1 while every MR-row tile of the block goes past it. done (or NULL): after each tile
 * of the last slice, rows counted from 0. */
static void block_times_panel(const gemm_args *g, int m0, int m1, int p, float *cs, tile_done_fn done, void *ctx) {
    const char *panel = g->panels + (size_t)p * g->panel_bytes;
    for (int k0 = 0; k0 < g->K; k0 += KC) {
        const int kc = g->K - k0 < KC ? g->K - k0 : KC;
        const void *pk = panel + (size_t)k0 * NR * g->elem;
        /* The next slice, or the next panel's first: prefetching past the end is harmless. */
        const char *pf = (const char *)pk + (size_t)KC * NR * g->elem;
        const float *a = (const float *)g->a + (size_t)m0 * g->lda + k0;
        const int last = k0 + KC >= g->K;
        rows_times_slice(a, g->lda, m1 - m0, pk, g->pdtype, kc, cs, k0 == 0, pf, last ? done : NULL, ctx);
    }
}

#if TK_BF16_DP
/* block_times_panel with bfloat16 dot products: K in pairs, kc even. */
static void block_times_panel_dp(const gemm_args *g, int m0, int m1, int p, float *cs, tile_done_fn done, void *ctx) {
    const bf16 *panel = (const bf16 *)(g->panels + (size_t)p * g->panel_bytes);
    for (int k0 = 0; k0 < g->K; k0 += KC) {
        const int kc = g->K - k0 < KC ? g->K - k0 : KC;
        const bf16 *pk = panel + (size_t)k0 * NR;
        const char *pf = (const char *)(pk + (size_t)KC * NR);
        const int tiles = (m1 - m0 + MR - 1) / MR;
        for (int i = 0, m = m0; i < tiles; i++) {
            const int mr = tile_rows(m1 - m, tiles - i);
            const bf16 *a = (const bf16 *)g->a + (size_t)m * g->lda + k0;
            float *c = cs + (size_t)(m - m0) * NR;
            m += mr;
            switch (mr) {
            case 12: micro_tile_dp(12, a, g->lda, pk, kc, c, k0 == 0, pf); break;
            case 11: micro_tile_dp(11, a, g->lda, pk, kc, c, k0 == 0, pf); break;
            case 10: micro_tile_dp(10, a, g->lda, pk, kc, c, k0 == 0, pf); break;
            case 9: micro_tile_dp(9, a, g->lda, pk, kc, c, k0 == 0, pf); break;
            case 8: micro_tile_dp(8, a, g->lda, pk, kc, c, k0 == 0, pf); break;
            case 7: micro_tile_dp(7, a, g->lda, pk, kc, c, k0 == 0, pf); break;
            case 6: micro_tile_dp(6, a, g->lda, pk, kc, c, k0 == 0, pf); break;
            case 5: micro_tile_dp(5, a, g->lda, pk, kc, c, k0 == 0, pf); break;
            case 4: micro_tile_dp(4, a, g->lda, pk, kc, c, k0 == 0, pf); break;
            case 3: micro_tile_dp(3, a, g->lda, pk, kc, c, k0 == 0, pf); break;
            case 2: micro_tile_dp(2, a, g->lda, pk, kc, c, k0 == 0, pf); break;
            default: micro_tile_dp(1, a, g->lda, pk, kc, c, k0 == 0, pf); break;
            }
            if (done && k0 + KC >= g->K) done(ctx, m - mr - m0, mr, c);
        }
    }
}
#define BLOCK_TIMES_PANEL(g, m0, m1, p, cs, done, ctx) \
    ((g)->dp ? block_times_panel_dp(g, m0, m1, p, cs, done, ctx) : block_times_panel(g, m0, m1, p, cs, done, ctx))
#else
#define BLOCK_TIMES_PANEL block_times_panel
#endif

static inline void store_row(const gemm_args *g, size_t row, int col0, int ncols, const float *t) {
    if (ncols == NR) {
        vstore_any(g->c, row * g->ldc + col0, vload(t), g->cdtype);
        vstore_any(g->c, row * g->ldc + col0 + TK_VL, vload(t + TK_VL), g->cdtype);
        return;
    }
    for (int j = 0; j < ncols; j++) store_any(g->c, row * g->ldc + col0 + j, t[j], g->cdtype);
}

/* Where a tile's finished rows go: output tile q of the row block from m0; gate: the gate
 * panel's sums of the block (SILU_MUL, the up panel being the one computed), or NULL. */
typedef struct {
    const gemm_args *g;
    int m0, q;
    const float *gate;
} tile_out;

/* Rows m0 + m .. + mr of output tile q from their sums cs [mr][NR]: the LoRA term, then the
 * bias or the SiLU-and-multiply with the gate's sums, rounded to C's dtype and stored. */
static void finish_rows(void *ctx, int m, int mr, float *cs) {
    const tile_out *o = ctx;
    const gemm_args *g = o->g;
    const int bf = g->cdtype == TK_BF16, col0 = o->q * NR, ncols = g->N - col0 < NR ? g->N - col0 : NR;
    const int silu = o->gate != NULL, p = silu ? 2 * o->q + 1 : o->q; /* the panel cs holds */
    if (g->lora) lora_up_tile(g->lora, o->m0 + m, o->m0 + m + mr, p, cs);
    const float *bg = silu && g->bias ? g->bias + (size_t)(2 * o->q) * NR : NULL, *bu = bg ? bg + NR : NULL;
    for (int r = 0; r < mr; r++) {
        float *cr = cs + (size_t)r * NR;
        if (silu) {
            float *gr = (float *)o->gate + (size_t)(m + r) * NR;
            silu_mul_row(gr, cr, bg, bu, bf);
            cr = gr;
        } else if (g->bias) {
            for (int j = 0; j < NR; j++) cr[j] += g->bias[(size_t)o->q * NR + j];
        }
        store_row(g, (size_t)(o->m0 + m + r), col0, ncols, cr);
    }
}

/* Output tile q (columns q*NR ..) of rows m0 .. m1; cs: scratch of 2 * rows * NR floats.
 * Each tile's rows are finished and stored as soon as their last slice is done, not after
 * the whole block: stores that wait on memory overlap the next tiles' multiply-adds (prefill
 * shapes of 1,024 rows, float32: 1-3% faster). */
static void output_tile(const gemm_args *g, int m0, int m1, int q, float *cs) {
    const int rows = m1 - m0;
    if (g->epilogue == TK_EPI_SILU_MUL) {
        float *gate = cs, *up = cs + (size_t)rows * NR;
        BLOCK_TIMES_PANEL(g, m0, m1, 2 * q, gate, NULL, NULL);
        if (g->lora) lora_up_tile(g->lora, m0, m1, 2 * q, gate); /* before SiLU: the adapter changes gate and up */
        tile_out o = {g, m0, q, gate};
        BLOCK_TIMES_PANEL(g, m0, m1, 2 * q + 1, up, finish_rows, &o);
        return;
    }
    tile_out o = {g, m0, q, NULL};
    BLOCK_TIMES_PANEL(g, m0, m1, q, cs, finish_rows, &o);
}

/* With TK_BF16_DP, ws holds A's rows in the pair layout of gemm_bf16.h (the products are of
 * bfloat16 pairs), else A widened to float32. */
int tk_gemm(const tk_linear *w, const void *a, int lda, void *c, int ldc, int dtype, int M, float *ws,
            const tk_lora *lora, int num_threads) {
    const int N = w->n, K = w->k, epilogue = w->epilogue, pdtype = w->kind, adtype = dtype;
    if (w->quantized || M < 0 || N <= 0 || K <= 0 || (epilogue != TK_EPI_NONE && epilogue != TK_EPI_SILU_MUL)) return 2;
    if (M == 0) return 0;
    if (adtype == TK_BF16 && ws == NULL) return 2;
    const int dp = TK_BF16_DP && pdtype == TK_BF16, kp = panel_k(K, pdtype);
    if (dp && adtype != TK_BF16) return 2;
    gemm_args g = {
        .a = adtype == TK_BF16 ? (const void *)ws : a,
        .lda = dp                  ? kp
               : adtype == TK_BF16 ? K
                                   : lda,
        .dp = dp,
        .panels = (const char *)w->w,
        .pdtype = pdtype,
        .panel_bytes = (size_t)kp * NR * (pdtype == TK_BF16 ? 2 : 4),
        .elem = pdtype == TK_BF16 ? 2 : 4,
        .bias = w->bias,
        .c = c,
        .ldc = ldc,
        .cdtype = dtype,
        .N = N,
        .K = dp ? kp : K,
        .epilogue = epilogue,
        .lora = lora,
    };
    const int num_tiles = (N + NR - 1) / NR;
    /* Rows per block: A's block stays within ~384 KiB of L2. */
    int mc = (384 * 1024 / (4 * K)) / MR * MR;
    if (mc < MR) mc = MR;
    const int num_row_blocks = (M + mc - 1) / mc;
    const int num_items = num_row_blocks * num_tiles;
    /* Small products run on one thread: a parallel region costs more than they do. */
    const double flops = 2.0 * M * N * K * (epilogue == TK_EPI_SILU_MUL ? 2 : 1);
    int threads = flops < 2e5 ? 1 : num_threads;
    if (threads > num_items) threads = num_items;
    /* Run t: its panels [q0, q0 + span) of every row block, index i -> (i / span, q0 + i % span);
     * or, by_panels 0, the items [lo, hi) in row-block order. */
    const int by_panels = num_tiles >= threads;
    tk_run *runs = tk_runs_new(threads);
    if (runs == NULL) return 1;
    for (int t = 0; t < threads; t++) {
        const int lo = (by_panels ? num_tiles : num_items) * t / threads;
        const int hi = (by_panels ? num_tiles : num_items) * (t + 1) / threads;
        tk_run_set(&runs[t], by_panels ? num_row_blocks * (hi - lo) : hi - lo);
    }
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *cs = malloc(sizeof(float) * 2 * (size_t)mc * NR);
        if (cs == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        if (adtype == TK_BF16) {
#pragma omp for schedule(static)
            for (int m = 0; m < M; m++) {
                const bf16 *src = (const bf16 *)a + (size_t)m * lda;
                if (dp) { /* kp bfloat16 per row fit in the K floats the caller gave */
                    pair_row((bf16 *)ws + (size_t)m * kp, src, K);
                    continue;
                }
                float *dst = ws + (size_t)m * K;
                for (int k = 0; k < K; k++) dst[k] = bf16_to_f32(src[k]);
            }
        }
        if (lora) { /* every row's down-projection, before any tile adds it */
            float *buf = adtype == TK_BF16 ? malloc(sizeof(float) * LORA_MR * (size_t)K) : NULL;
            if (adtype == TK_BF16 && buf == NULL) {
#pragma omp atomic write
                failed = 1;
            }
#pragma omp for schedule(static)
            for (int m = 0; m < M; m += MR)
                if (adtype != TK_BF16 || buf != NULL)
                    lora_down_rows(lora, a, lda, adtype, K, m, m + MR < M ? m + MR : M, buf);
            free(buf);
        }
        int t, i;
        while (cs != NULL && tk_runs_next(runs, threads, omp_get_thread_num(), &t, &i)) {
            const int lo = (by_panels ? num_tiles : num_items) * t / threads;
            const int span = by_panels ? num_tiles * (t + 1) / threads - lo : 0;
            const int item = by_panels ? 0 : lo + i;
            const int mb = by_panels ? i / span : item / num_tiles, q = by_panels ? lo + i % span : item % num_tiles;
            const int m0 = mb * mc, m1 = m0 + mc < M ? m0 + mc : M;
            output_tile(&g, m0, m1, q, cs);
        }
        free(cs);
    }
    free(runs);
    return failed;
}
