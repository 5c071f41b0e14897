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
 * Four strategies, in three files beside this one (quant.h lists them), over the tile
 * runner they share (quant_tiles.c): up to FUSED_MAX_ROWS
 * rows (decode), each k's weights dequantized in registers, or for one and two rows (one on
 * AVX2) the groups' algebra, s * sum(x q) + m * sum(x) (quant_fused.c); wider, each K slice of
 * a panel dequantized into an L1 buffer under gemm.c's micro-tile (quant_wide.c); with int8
 * activations, integer dot products (quant_int8.c). Every output tile is summed whole by one
 * thread, so results do not depend on the thread count; each float sum is float32
 * multiply-adds of exactly the dequantized weights, F.linear(X, dequantized W) up to the
 * order of the additions (for one and two rows, their order and grouping).
 */
#include "tandem_api.h"

#include "quant.h"

int tk_qgemm_int8(void) { return TK_INT8_DOT; }

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
