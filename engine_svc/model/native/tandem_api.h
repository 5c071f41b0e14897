/*
 * The kernels' C API: every function the shared object exports and every struct they take,
 * declared here once. Each .c file includes this header, so the compiler checks every
 * definition against its declaration (and the tests' build, with -Wmissing-prototypes,
 * refuses an exported function that is not declared here). The ctypes side reads the
 * prototypes from this file (api.py) and mirrors each struct once, field for field (checked
 * by tests/engine/model/native/test_native_api.py).
 *
 * Conventions. Tensors are pointers with a dtype code; sizes are int, strides and offsets
 * that can pass 2^31 long; num_threads comes last. A list of arguments that would run long
 * is split: what is fixed for a layer or a model (a weight, the attention's shape) in one
 * struct, what a step's rows are (a decode batch, prefill chunks) in another, and the call's
 * tensors beside them. Every kernel returns 0 on success and a small code otherwise (named
 * at each declaration); the C side trusts what the wrappers check (kernels.py).
 *
 * TK_API_VERSION changes with any signature or struct here: a build of other sources (an
 * older commit's, say) is refused by its version instead of being called wrongly.
 */
#ifndef TANDEM_API_H
#define TANDEM_API_H

#include <stdint.h>

#define TK_API_VERSION 2

enum { TK_F32 = 0, TK_BF16 = 1, TK_F16 = 2 };  /* dtype codes; TK_F16: a quantized weight's scales only */
enum { TK_Q8 = 8, TK_Q4 = 4 };                 /* a quantized weight's bits (quant.c) */
enum { TK_EPI_NONE = 0, TK_EPI_SILU_MUL = 1 }; /* what a GEMM does to its sums (gemm.c) */

/* -- structs --------------------------------------------------------------------------- */

/* One linear layer's weight as its kernel takes it, fixed at load. quantized 0: tk_gemm on
 * panels (gemm.c) of dtype `kind` (TK_F32 / TK_BF16); 1: tk_qgemm of bits `kind` (TK_Q8 /
 * TK_Q4) on quantized panels (quant.c). With TK_EPI_SILU_MUL the panels alternate gate and up,
 * and n is the width of the product silu(gate) * up. */
typedef struct {
    int quantized;
    int kind;
    const void *w;     /* the panels; quantized: qs */
    const void *scale; /* quantized only: [P][K/group][NR], dtype sdtype */
    const void *min;   /* quantized only: as scale, or NULL */
    int sdtype;        /* TK_F32 or TK_F16 */
    int group;
    const float *bias; /* [P * NR] float32 in panel order, or NULL */
    int n;             /* output columns */
    int k;
    int epilogue;
    int xquant; /* quantized only: 1 for int8 activations (builds with tk_qgemm_int8()) */
} tk_linear;

/* A LoRA term per row, added inside tk_gemm (gemm_lora.h has the layouts). */
typedef struct tk_lora {
    const int32_t *row_slot; /* [M]: the row's slot, or -1 */
    const void *la;          /* [S][K][R], of dtype ldtype */
    const void *lb;          /* [S][NP][R][NR], of dtype ldtype */
    const int32_t *ranks;    /* [S] */
    const int32_t *spans;    /* [S][NP][2]: the ranks [t0, t1) weight panel p adds */
    int r;                   /* R: a whole number of vectors */
    int np;                  /* panels of the packed weight */
    float *xa;               /* [M][R] */
    int ldtype;              /* TK_F32 or TK_BF16: la and lb as the model's weights are */
} tk_lora;

/* The attention's heads and paged cache (attention.c has the layouts): query head h reads KV
 * head h / (num_heads / num_kv_heads). */
typedef struct {
    int num_heads, num_kv_heads, head_dim;
    int block_size;  /* tokens per cache block */
    long row_stride; /* elements from one row of q (and of k and v, tk_write_kv) to the next */
    float scale;     /* of the scores q . k */
    int dtype;       /* q's and out's: TK_F32 or TK_BF16 */
    int kv_dtype;    /* the caches': dtype, or TK_BF16 beside float32 rows */
} tk_attn_shape;

/* A decode step's rows, one query token each: row i at position positions[i], its K and V
 * written to slot slots[i], its context the first ctx_lens[i] tokens of its blocks. */
typedef struct {
    int num_rows;
    const int64_t *positions;   /* [num_rows]; read by tk_decode_stack only */
    const int64_t *slots;       /* [num_rows]; read by tk_decode_stack only */
    const int32_t *block_table; /* [num_rows][table_stride] */
    int table_stride;
    const int32_t *ctx_lens; /* [num_rows] */
    int max_ctx_len;
} tk_decode_rows;

/* A prefill step's chunks: chunk c is rows rows[c] .. + lens[c] of q and out, at positions
 * starts[c] .., its blocks in row c of block_table. */
typedef struct {
    int num_chunks;
    const int32_t *rows, *starts, *lens; /* [num_chunks] each */
    const int32_t *block_table;          /* [num_chunks][table_stride] */
    int table_stride;
} tk_prefill_chunks;

/* One decoder layer of tk_decode_stack (stack.c). */
typedef struct {
    const float *in_norm;   /* [hidden] */
    const float *post_norm; /* [hidden] */
    tk_linear qkv, o, gate_up, down;
    void *k_cache; /* [blocks, block_size, kv_heads, head_dim], attn.kv_dtype */
    void *v_cache;
} tk_layer;

/* What every layer of tk_decode_stack shares. */
typedef struct {
    tk_attn_shape attn; /* attn.row_stride: the fused qkv's width; attn.dtype: the activations' */
    int hidden;
    float eps; /* of both norms */
    int max_position;
    const float *cos_sin; /* [max_position, head_dim] float32: RoPE's cos | sin */
} tk_stack_shape;

/* -- what a build is ------------------------------------------------------------------- */

int tk_api_version(void);  /* TK_API_VERSION of the sources it was built from */
int tk_gemm_nr(void);      /* NR: output columns of a panel (two vectors) */
int tk_gemm_bf16_dp(void); /* 1 where bfloat16 products run as bfloat16 dot products (gemm_bf16.h) */
int tk_qgemm_int8(void);   /* 1 where tk_qgemm takes int8 activations (VNNI) */

/* -- linear layers: gemm.c, quant.c ---------------------------------------------------- */

/* Rows of K a panel holds: K, or K rounded up to pairs (bfloat16 with tk_gemm_bf16_dp()). */
int tk_gemm_panel_k(int K, int pdtype);

/* W [N, K] (dtype wdtype) -> panels (dtype pdtype). With pairs, the first N/2 rows of W
 * (gate) and the last N/2 (up) are packed as alternating panels. */
void tk_gemm_pack(const void *w, int wdtype, int N, int K, int pairs, void *out, int pdtype);

/* C [M, w->n] (row stride ldc) = A [M, w->k] (row stride lda) @ W^T (+ bias), A and C of
 * dtype `dtype`. ws: M * K floats when dtype is bfloat16, else NULL; lora: a LoRA term per
 * row, or NULL. Bfloat16 panels of a tk_gemm_bf16_dp() build take bfloat16 A only. Returns 0,
 * 1 if scratch memory could not be allocated, 2 on a bad argument. */
int tk_gemm(const tk_linear *w, const void *a, int lda, void *c, int ldc, int dtype, int M, float *ws,
            const tk_lora *lora, int num_threads);

/* Y [M, w->n] (row stride ldy, dtype ydtype) = X [M, w->k] (float32, row stride ldx) @
 * dequantized(W)^T (+ bias); with w->xquant, X quantized to int8 per row and group first.
 * Returns 0, 1 on a bad argument, 2 if scratch memory could not be allocated. */
int tk_qgemm(const tk_linear *w, const float *x, long ldx, void *y, long ldy, int ydtype, int M, int num_threads);

/* -- per-row ops: elementwise.c -------------------------------------------------------- */

/* out, x, residual: [rows, dim] contiguous, weight [dim], all of one dtype. With residual
 * (not NULL): residual = x + residual (rounded to dtype), then out = norm(residual) * w;
 * else out = norm(x) * w. Returns 0, 2 on a bad size. */
int tk_rms_norm(void *out, void *residual, const void *x, const void *weight, int rows, int dim, float eps, int dtype,
                int num_threads);

/* out [rows, inter] = silu(gu[:, :inter]) * gu[:, inter:]; gu [rows, 2 * inter]. Returns 0, 2 on a bad size. */
int tk_silu_mul(void *out, const void *gu, int rows, int inter, int dtype, int num_threads);

/* Rotate-half RoPE in place on the first num_heads heads of each of `rows` rows of qkv (row
 * stride row_stride); cos_sin [max_position, head_dim] float32, cos | sin. Returns 0, 2 on a
 * bad size, 3 on a position outside the table. */
int tk_rope(void *qkv, long row_stride, const int64_t *positions, const float *cos_sin, int max_position, int rows,
            int num_heads, int head_dim, int dtype, int num_threads);

/* out[r] := the index of the first maximum of row r of x [rows, cols] float32 (rows ld floats
 * apart), a NaN counting as the maximum. Returns 0, 2 on a bad size. */
int tk_argmax_rows(int64_t *out, const float *x, long ld, int rows, int cols, int num_threads);

/* -- attention: attention.c, attention_prefill.c, stack.c ------------------------------ */

/* The rows of k and v ([rows][num_kv_heads * head_dim] of dtype s->dtype, s->row_stride
 * apart) into slots slots[i] of the caches (kv_dtype, num_slots slots). Returns 0, or 2,
 * nothing written, if a slot is outside the caches or the dtypes do not pair. */
int tk_write_kv(const tk_attn_shape *s, void *k_cache, void *v_cache, const void *k, const void *v,
                const int64_t *slots, int rows, long num_slots, int num_threads);

/* out [num_rows, num_heads, head_dim] = attention of each row's query (q, [num_rows] rows)
 * over its context in the caches. Returns 0, 1 if a scratch buffer could not be allocated,
 * 2 on a bad shape. */
int tk_decode_attention(const tk_attn_shape *s, const tk_decode_rows *rows, void *out, const void *q,
                        const void *k_cache, const void *v_cache, int num_threads);

/* Causal attention of each chunk's query rows over the caches, the chunk's own K/V included.
 * Returns 0, 1 if a scratch buffer could not be allocated, 2 on a bad shape. */
int tk_prefill_attention(const tk_attn_shape *s, const tk_prefill_chunks *chunks, void *out, const void *q,
                         const void *k_cache, const void *v_cache, int num_threads);

/* Every decoder layer of a decode-only step (stack.c). x [rows, hidden]: the embedding in, the
 * last layer's MLP output out; residual [rows, hidden]: the stream out; ws: float32 workspace
 * (stack.c says how much). Returns 0, or 100 * (layer + 1) + the failing kernel's code. */
int tk_decode_stack(const tk_layer *layers, int num_layers, const tk_stack_shape *s, const tk_decode_rows *rows,
                    void *x, void *residual, float *ws, int num_threads);

#endif
