/*
 * What the quantized GEMM's strategies share (quant.c has the layouts): the call's arguments
 * (qargs), reading a panel's scales and quantized weights into vectors, and the entry point of
 * each strategy and of the work-item loop they run on.
 *
 *   quant.c         tk_qgemm: the checks and the choice of strategy
 *   quant_tiles.c   the tile runner they share: work items between threads, a tile's result
 *   quant_fused.c   few rows: each k's weights dequantized in registers (or the groups' algebra)
 *   quant_wide.c    wide batches: a dequantized K slice in L1 under gemm.c's micro-tile
 *   quant_int8.c    int8 activations: integer dot products (VNNI builds)
 *
 * The entry points are internal to the shared object (hidden): the API is tandem_api.h's.
 */
#ifndef TANDEM_QUANT_H
#define TANDEM_QUANT_H

#include <stddef.h>
#include <stdint.h>

#include "gemm_tile.h" /* MR, NR, KC, the micro-tile, silu_mul_row */
#include "tandem_api.h"
#include "tandem_kernels.h"

#define TK_INTERNAL __attribute__((visibility("hidden")))

/* Rows that take the register path; past them the dequantized buffer is faster (measured
 * on Zen 5 over SmolLM2's layers: at 8 rows 9.2 ms in registers, 11.8 through the buffer;
 * at 9 to 16 rows two register passes were no faster than the buffer). AVX2 has 16
 * registers, not 32: at 5 and 6 rows the two paths are even there. */
#ifndef FUSED_MAX_ROWS
#if defined(__AVX512F__)
#define FUSED_MAX_ROWS 8
#else
#define FUSED_MAX_ROWS 4
#endif
#endif

/* How far ahead of the dequantization the quantized bytes are fetched: the hardware
 * prefetcher alone left a 16-row product ~25% slower from memory than from cache. */
#ifndef PF_BYTES
#define PF_BYTES 2048
#endif

typedef struct {
    const float *x;
    int ldx;
    int kind;
    const uint8_t *qs;
    size_t panel_qbytes; /* bytes of qs per panel */
    const void *scale, *min;
    int sdtype, group, ng; /* ng: groups per column, K / group */
    const float *bias;
    void *y;
    long ldy;
    int ydtype;
    int M, N, K, epilogue;
    const float *xsum; /* [M][ng]: each row's sum over each group of K (alg_panel, with mins) */
} qargs;

static inline vf vload_f16(const uint16_t *p) {
#if defined(__AVX512F__)
    return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#else
    return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#endif
}

/* The NR scales (or mins) at index at, as two vectors; zeros where base is NULL. */
static inline void group_vectors(const void *base, int sdtype, size_t at, vf out[2]) {
    if (base == NULL) {
        out[0] = out[1] = vzero();
    } else if (sdtype == TK_F16) {
        out[0] = vload_f16((const uint16_t *)base + at);
        out[1] = vload_f16((const uint16_t *)base + at + TK_VL);
    } else {
        out[0] = vload((const float *)base + at);
        out[1] = vload((const float *)base + at + TK_VL);
    }
}

/* TK_VL int8 / uint8 values -> int32 lanes. */
static inline vi widen_i8(const int8_t *p) {
#if defined(__AVX512F__)
    return (vi)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
#else
    return (vi)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
#endif
}
static inline vi widen_u8(const uint8_t *p) {
#if defined(__AVX512F__)
    return (vi)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
#else
    return (vi)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
#endif
}

/* One k of int8 weights: NR bytes -> w[2]. */
static inline void q8_k(const int8_t *b, const vf s[2], const vf m[2], vf w[2]) {
    w[0] = __builtin_convertvector(widen_i8(b), vf) * s[0] + m[0];
    w[1] = __builtin_convertvector(widen_i8(b + TK_VL), vf) * s[1] + m[1];
}

/* Two k (even, odd) of 4-bit weights: NR bytes -> w0[2] (k), w1[2] (k + 1). */
static inline void q4_pair(const uint8_t *b, const vf s[2], const vf m[2], vf w0[2], vf w1[2]) {
    for (int h = 0; h < 2; h++) {
        const vi u = widen_u8(b + h * TK_VL);
        w0[h] = __builtin_convertvector(u & 15, vf) * s[h] + m[h];
        w1[h] = __builtin_convertvector(u >> 4, vf) * s[h] + m[h];
    }
}

#if (defined(__AVX512F__) && defined(__AVX512VNNI__)) || (!defined(__AVX512F__) && defined(__AVXVNNI__))
#define TK_INT8_DOT 1
#else
#define TK_INT8_DOT 0
#endif

/* X's rows quantized, per row and group of K (the weight's groups): q = round(x * 127 / a),
 * a = max |x| over the group, to nearest even; the group's scale is a / 127 (0 where a is 0,
 * NaN where the group holds a NaN or an infinity).
 *   q    int8 [M][K], the 8 k of each aligned run in the order the weights' quads take them:
 *        natural for 8-bit weights, k + 0, 2, 4, 6, 1, 3, 5, 7 for 4-bit ones
 *   sx   [M][ng] the scales
 *   xs   [M][ng] sx * sum(q): the group's sum of the dequantized row (for the mins)
 *   xc   [M][ng] 128 * sum(q) (8-bit weights, held biased by 128: see i8_convert) */
typedef struct {
    int8_t *q;
    float *sx, *xs;
    int32_t *xc;
} xquant;

/* cs [rows][NR] = X[m0..m0+rows) @ panel p for a wide product, through a scratch buffer. */
typedef void (*block_fn)(const qargs *a, const xquant *xq, int m0, int rows, int p, void *buf, float *cs);

/* quant_tiles.c: the result of output tile q, and a wide product's work items (row block, tile). */
TK_INTERNAL void tkq_store_tile(const qargs *a, int m0, int rows, int q, float *cs, const float *up);
TK_INTERNAL int tkq_run_items(const qargs *a, const xquant *xq, block_fn block, int mc, size_t buf_bytes, int nthreads);

/* The strategies, each the whole product: 0, or 2 if scratch memory could not be allocated. */
TK_INTERNAL int tkq_fused(qargs *a, int nthreads); /* M <= FUSED_MAX_ROWS */
TK_INTERNAL int tkq_wide(const qargs *a, int nthreads);
#if TK_INT8_DOT
TK_INTERNAL int tkq_int8(const qargs *a, int nthreads);
TK_INTERNAL void tkq_quantize_row(const float *x, int K, int group, int kind, int8_t *q, float *sx, float *xs,
                                  int32_t *xc);
#endif

#endif
