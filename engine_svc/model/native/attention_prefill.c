/*
 * Prefill attention straight from the paged KV cache, in the layouts of attention.c.
 *
 * Prefill (tk_prefill_attention): chunks of consecutive query tokens, chunk c at rows
 * chunk_rows[c] .. + chunk_lens[c] and positions chunk_starts[c] ..; the chunk's own K/V
 * are in the cache already, and token p attends to positions 0 .. p (causal with an
 * offset, so chunked prefill and prefix-cache hits need nothing special). Work items are
 * (chunk, tile of QT query tokens, KV head), heaviest first, handed out by one counter.
 * An item keeps its group's QT * group query vectors, their output and running softmax
 * in the core's cache, and walks the blocks up to its last position, flash-attention
 * style: per block, S = Q K^T and O += P V run as small register-tiled products (a
 * bfloat16 cache's K and V widened to float32 first), or, with bfloat16 rows over a
 * bfloat16 cache on AVX512-BF16 builds, as bfloat16 dot products.
 */
#include <stdlib.h>
#include <string.h>

#include "gemm_bf16.h"
#include "tandem_kernels.h"

#define QT 16 /* query tokens per prefill item */
#define MR 12 /* rows per register tile */

/* Accumulators one register tile of small_gemm holds: 24 of AVX512's 32 vector registers,
 * 12 of AVX2's 16 (the rest hold B's vectors and A's broadcast). */
#if defined(__AVX512F__)
#define TILE_ACC 24
#else
#define TILE_ACC 12
#endif

/* C[0..mr)[0..nv vectors) (= or +=) A[0..mr)[0..kdim) B[0..kdim)[0..nv vectors), one
 * register tile (mr, nv literal at each call). A is read with any row and k strides (rows
 * of K, or columns of P^T). Each sum is a chain of multiply-adds in k order, whatever the
 * tile's shape. */
static inline __attribute__((always_inline)) void tile(const int mr, const int nv, float *c, size_t ldc, const float *a,
                                                       size_t ars, size_t aks, const float *b, size_t ldb, int kdim,
                                                       int accumulate) {
    vf acc[MR][4];
    for (int r = 0; r < mr; r++)
        for (int i = 0; i < nv; i++) acc[r][i] = accumulate ? vload(c + (size_t)r * ldc + i * TK_VL) : vzero();
    for (int k = 0; k < kdim; k++) {
        vf bk[4];
        for (int i = 0; i < nv; i++) bk[i] = vload(b + (size_t)k * ldb + i * TK_VL);
        for (int r = 0; r < mr; r++) {
            const vf ar = vbcast(a[(size_t)r * ars + (size_t)k * aks]);
            for (int i = 0; i < nv; i++) acc[r][i] += ar * bk[i];
        }
    }
    for (int r = 0; r < mr; r++)
        for (int i = 0; i < nv; i++) vstore(c + (size_t)r * ldc + i * TK_VL, acc[r][i]);
}

/* Rows r0 .. rows of small_gemm's product at columns [j, j + nv vectors), one vector at a
 * time in tiles of up to MR rows. */
static void narrow_rows(float *c, size_t ldc, const float *a, size_t ars, size_t aks, const float *b, size_t ldb,
                        int r0, int rows, int j, int nv, int kdim, int accumulate) {
    for (int jj = j; jj < j + nv * TK_VL; jj += TK_VL)
        for (int r = r0; r < rows; r += MR) {
            float *cr = c + (size_t)r * ldc + jj;
            const float *ar = a + (size_t)r * ars, *bj = b + jj;
            switch (rows - r < MR ? rows - r : MR) { /* a literal row count per case: the tile stays in registers */
#define NARROW(m) tile(m, 1, cr, ldc, ar, ars, aks, bj, ldb, kdim, accumulate)
            case 12: NARROW(12); break;
            case 11: NARROW(11); break;
            case 10: NARROW(10); break;
            case 9: NARROW(9); break;
            case 8: NARROW(8); break;
            case 7: NARROW(7); break;
            case 6: NARROW(6); break;
            case 5: NARROW(5); break;
            case 4: NARROW(4); break;
            case 3: NARROW(3); break;
            case 2: NARROW(2); break;
            default: NARROW(1); break;
#undef NARROW
            }
        }
}

/* C[rows][cols] (= or +=) A[rows][kdim] B[kdim][cols]; cols a multiple of TK_VL. Columns in
 * groups of up to 4 vectors, rows in tiles of TILE_ACC / nv: each B vector loaded serves
 * every row of the tile, each broadcast of A every vector (one vector wide, a tile of 12
 * rows needed 13 loads for its 12 multiply-adds); the rows past the last whole tile go
 * one vector at a time. */
static void small_gemm(float *c, size_t ldc, const float *a, size_t ars, size_t aks, const float *b, size_t ldb,
                       int rows, int cols, int kdim, int accumulate) {
    for (int j = 0; j < cols;) {
        const int left = (cols - j) / TK_VL, nv = left < 4 ? left : 4;
        int r = 0;
        switch (nv) { /* literal tile shapes */
#define WIDE(n)                                                                                                       \
    for (; r + TILE_ACC / (n) <= rows; r += TILE_ACC / (n))                                                          \
        tile(TILE_ACC / (n), n, c + (size_t)r * ldc + j, ldc, a + (size_t)r * ars, ars, aks, b + j, ldb, kdim, accumulate)
        case 4: WIDE(4); break;
        case 3: WIDE(3); break;
        case 2: WIDE(2); break;
        default: break;
#undef WIDE
        }
        narrow_rows(c, ldc, a, ars, aks, b, ldb, r, rows, j, nv, kdim, accumulate);
        j += nv * TK_VL;
    }
}

#if TK_BF16_DP
/* S^T [0..mt)[0..nv vectors) := K [mt tokens][hd] Q^T, as bfloat16 dot products (AVX512-BF16
 * builds, bfloat16 rows over a bfloat16 cache): each step takes a pair of dimensions, a
 * key's pair broadcast against Q^T's pairs (qt2 [hd/2][rows][2]), with float32 sums; the
 * scale is the caller's to apply. k: the first token's key, ks: elements between tokens. */
static inline __attribute__((always_inline)) void scores_dp_tile(const int mt, const int nv, float *st, int rows,
                                                                 const bf16 *k, size_t ks, const bf16 *qt2, int hd) {
    __m512 acc[8][3];
    for (int t = 0; t < mt; t++)
        for (int i = 0; i < nv; i++) acc[t][i] = _mm512_setzero_ps();
    for (int p = 0; p < hd / 2; p++) {
        __m512bh b[3];
        for (int i = 0; i < nv; i++) b[i] = (__m512bh)_mm512_loadu_si512(qt2 + ((size_t)p * rows + i * 16) * 2);
        for (int t = 0; t < mt; t++) {
            int32_t pair;
            memcpy(&pair, k + (size_t)t * ks + 2 * p, 4);
            const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
            for (int i = 0; i < nv; i++) acc[t][i] = _mm512_dpbf16_ps(acc[t][i], a, b[i]);
        }
    }
    for (int t = 0; t < mt; t++)
        for (int i = 0; i < nv; i++) _mm512_storeu_ps(st + (size_t)t * rows + i * 16, acc[t][i]);
}

/* S^T [ntok][rows] = K Q^T over bfloat16 pairs: tokens 8 at a time, columns 3 vectors at a time. */
static void scores_dp(float *st, int rows, const bf16 *k, size_t ks, const bf16 *qt2, int ntok, int hd) {
    for (int j = 0; j < rows; j += 48) {
        const int nv = (rows - j) / 16 < 3 ? (rows - j) / 16 : 3;
        const bf16 *qj = qt2 + (size_t)j * 2;
        for (int t = 0; t < ntok;) {
            const int mt = ntok - t >= 8 ? 8 : 1;
            float *sj = st + (size_t)t * rows + j;
            const bf16 *kt = k + (size_t)t * ks;
#define SCORES(m)                                                      \
    switch (nv) {                                                      \
    case 3: scores_dp_tile(m, 3, sj, rows, kt, ks, qj, hd); break;     \
    case 2: scores_dp_tile(m, 2, sj, rows, kt, ks, qj, hd); break;     \
    default: scores_dp_tile(m, 1, sj, rows, kt, ks, qj, hd); break;    \
    }
            if (mt == 8)
                SCORES(8)
            else
                SCORES(1)
#undef SCORES
            t += mt;
        }
    }
}

/* The interleave of pair_layouts below: 32-bit lane i of the result is (x[i], x[16 + i]). */
static inline __m512i interleave_halves(__m512i x) {
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(idx, x);
}

/* O += P V with P rounded to bfloat16, as bfloat16 dot products over pairs of tokens (torch's
 * CPU flash attention rounds P to the rows' dtype before its P V product too). pb: P in pairs,
 * [(ntok + 1) / 2][rows], lane (P[j][t], P[j][t + 1]); vp: V in pairs, [(ntok + 1) / 2][hd],
 * lane (V[t][d], V[t + 1][d]); a missing t + 1 is 0 in both. */
static void p_pairs(bf16 *pb, const float *st, int rows, int ntok) {
    for (int t = 0; t < ntok; t += 2)
        for (int j = 0; j < rows; j += 16) {
            const __m512 a = _mm512_loadu_ps(st + (size_t)t * rows + j);
            const __m512 b = t + 1 < ntok ? _mm512_loadu_ps(st + (size_t)(t + 1) * rows + j) : _mm512_setzero_ps();
            _mm512_storeu_si512(pb + ((size_t)(t / 2) * rows + j) * 2, interleave_halves((__m512i)_mm512_cvtne2ps_pbh(b, a)));
        }
}

static void v_pairs(bf16 *vp, const bf16 *v, size_t ks, int ntok, int hd) {
    for (int t = 0; t < ntok; t += 2)
        for (int d = 0; d < hd; d += 16) {
            const __m256i a = _mm256_loadu_si256((const __m256i *)(v + (size_t)t * ks + d));
            const __m256i b = t + 1 < ntok ? _mm256_loadu_si256((const __m256i *)(v + (size_t)(t + 1) * ks + d))
                                           : _mm256_setzero_si256();
            _mm512_storeu_si512(vp + ((size_t)(t / 2) * hd + d) * 2,
                                interleave_halves(_mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1)));
        }
}

/* O [4 rows][nv vectors] += P V over np token pairs (nv literal). */
static inline __attribute__((always_inline)) void pv_dp_tile(const int nv, float *o, int hd, const bf16 *pb, int rows,
                                                             const bf16 *vp, int np) {
    __m512 acc[4][4];
    for (int r = 0; r < 4; r++)
        for (int i = 0; i < nv; i++) acc[r][i] = _mm512_loadu_ps(o + (size_t)r * hd + i * 16);
    for (int p = 0; p < np; p++) {
        __m512bh b[4];
        for (int i = 0; i < nv; i++) b[i] = (__m512bh)_mm512_loadu_si512(vp + ((size_t)p * hd + i * 16) * 2);
        for (int r = 0; r < 4; r++) {
            int32_t pair;
            memcpy(&pair, pb + ((size_t)p * rows + r) * 2, 4);
            const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
            for (int i = 0; i < nv; i++) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], a, b[i]);
        }
    }
    for (int r = 0; r < 4; r++)
        for (int i = 0; i < nv; i++) _mm512_storeu_ps(o + (size_t)r * hd + i * 16, acc[r][i]);
}

/* O [rows][hd] += P V: rows a multiple of 16, hd of 16. */
static void pv_dp(float *o, int hd, const bf16 *pb, int rows, const bf16 *vp, int np) {
    for (int d = 0; d < hd; d += 64) {
        const int nv = (hd - d) / 16 < 4 ? (hd - d) / 16 : 4;
        for (int r = 0; r < rows; r += 4) {
            float *od = o + (size_t)r * hd + d;
            const bf16 *pr = pb + (size_t)r * 2, *vd = vp + (size_t)d * 2;
            switch (nv) {
            case 4: pv_dp_tile(4, od, hd, pr, rows, vd, np); break;
            case 3: pv_dp_tile(3, od, hd, pr, rows, vd, np); break;
            case 2: pv_dp_tile(2, od, hd, pr, rows, vd, np); break;
            default: pv_dp_tile(1, od, hd, pr, rows, vd, np); break;
            }
        }
    }
}
#endif

typedef struct {
    int chunk, tile, kv_head, first_pos;
} prefill_item;

static int by_context_desc(const void *a, const void *b) {
    const prefill_item *x = a, *y = b;
    if (x->first_pos != y->first_pos) return x->first_pos > y->first_pos ? -1 : 1;
    if (x->chunk != y->chunk) return x->chunk - y->chunk;
    return x->kv_head - y->kv_head;
}

/* One prefill item: rows = QT * group query vectors (query token j / group, head
 * kv_head * group + j % group; rows past the chunk's end are zero and never stored).
 * Buffers: qt [hd][rows] (Q^T, pre-scaled), o [rows][hd], st [bs][rows] (S^T, then P^T),
 * kb, vb [bs][hd] (the block's K and V in float32, for a bfloat16 cache), m, l [rows]. */
typedef struct {
    float *qt, *o, *st, *kb, *vb, *m, *l, *pb;
} prefill_scratch;

static void prefill_item_run(const prefill_item *it, void *out, const void *q, long q_row_stride, const char *k_cache,
                             const char *v_cache, const int32_t *table, int chunk_row, int chunk_start, int chunk_len,
                             int num_heads, int num_kv_heads, int head_dim, int block_size, float scale, int dtype,
                             int kv_dtype, const prefill_scratch *w, const char *q_next, size_t q_next_row_bytes) {
    const int group = num_heads / num_kv_heads, rows = QT * group, kvh = it->kv_head;
    const size_t token_stride = (size_t)num_kv_heads * head_dim, block_elems = (size_t)block_size * token_stride;
    const int q0 = it->tile * QT, nqt = chunk_len - q0 < QT ? chunk_len - q0 : QT;
    const int pos0 = chunk_start + q0, nrows = nqt * group;
    /* bfloat16 rows over a bfloat16 cache: S from bfloat16 dot products (Q^T in pairs, as
     * it is, and the scale applied to S) where the build has them */
    const int dp = TK_BF16_DP && dtype == TK_BF16 && kv_dtype == TK_BF16;
    for (int j = 0; j < rows; j++) {
        const size_t src = (size_t)(chunk_row + q0 + j / group) * q_row_stride + (size_t)(kvh * group + j % group) * head_dim;
        if (dp)
            for (int d = 0; d < head_dim; d++)
                ((bf16 *)w->qt)[((size_t)(d / 2) * rows + j) * 2 + d % 2] = j < nrows ? ((const bf16 *)q)[src + d] : 0;
        else
            for (int d = 0; d < head_dim; d++) w->qt[(size_t)d * rows + j] = j < nrows ? scale * load_any(q, src + d, dtype) : 0.0f;
        w->m[j] = -INFINITY;
        w->l[j] = 0.0f;
    }
    memset(w->o, 0, sizeof(float) * (size_t)rows * head_dim);
    const int last_pos = pos0 + nqt - 1, num_blocks = last_pos / block_size + 1;
    /* The next item's query rows (QT tokens, its group's heads) into the cache while this
     * item computes, a share each block: they are read first thing there, from a buffer
     * far larger than the cache. */
    const size_t q_lines = q_next == NULL ? 0 : ((size_t)group * head_dim * (dtype == TK_BF16 ? 2 : 4) + 63) / 64;
    for (int b = 0; b < num_blocks; b++) {
        for (size_t i = (size_t)b * QT / num_blocks; q_next != NULL && i < (size_t)(b + 1) * QT / num_blocks; i++)
            for (size_t l = 0; l < q_lines; l++) __builtin_prefetch(q_next + i * q_next_row_bytes + 64 * l, 0, 3);
        const size_t base = (size_t)table[b] * block_elems + (size_t)kvh * head_dim;
        const int t0 = b * block_size, ntok = last_pos + 1 - t0 < block_size ? last_pos + 1 - t0 : block_size;
        const float *kr = (const float *)k_cache + base, *vr = (const float *)v_cache + base;
        size_t kv_stride = token_stride;
        /* A bfloat16 cache: the block's K and V widened once, every query vector reads them
         * (with bfloat16 dot products K is read as it is and V laid out in pairs below). */
        if (kv_dtype == TK_BF16 && !dp) {
            for (int t = 0; t < ntok; t++)
                for (int d = 0; d < head_dim; d += TK_VL) {
                    vstore(w->kb + (size_t)t * head_dim + d, vload_bf16((const bf16 *)k_cache + base + t * token_stride + d));
                    vstore(w->vb + (size_t)t * head_dim + d, vload_bf16((const bf16 *)v_cache + base + t * token_stride + d));
                }
            kr = w->kb, vr = w->vb, kv_stride = head_dim;
        }
        /* S^T [ntok][rows] = K [ntok][hd] Q^T [hd][rows] */
#if TK_BF16_DP
        if (dp)
            scores_dp(w->st, rows, (const bf16 *)k_cache + base, token_stride, (const bf16 *)w->qt, ntok, head_dim);
        else
#endif
            small_gemm(w->st, rows, kr, kv_stride, 1, w->qt, rows, ntok, rows, head_dim, 0);
        /* Online softmax, TK_VL query vectors at a time; token t0 + t is visible to query
         * vector j when it is not past the query's position. */
        const int diagonal = t0 + ntok - 1 > pos0;
        for (int j = 0; j < rows; j += TK_VL) {
            vf qpos;
            for (int l = 0; l < TK_VL; l++) qpos[l] = (float)(pos0 + (j + l) / group);
            vf mb = vload(w->m + j);
            for (int t = 0; t < ntok; t++) {
                vf st = vload(w->st + (size_t)t * rows + j);
                if (dp) st *= scale;
                if (diagonal) st = vselect((vi)(vbcast((float)(t0 + t)) <= qpos), st, vbcast(-INFINITY));
                vstore(w->st + (size_t)t * rows + j, st);
                mb = vmax(mb, st);
            }
            const vf m_old = vload(w->m + j);
            /* rows that see no token yet keep m = -inf; they get p = 0 and corr = 1 */
            const vi seen = (vi)(mb > vbcast(-INFINITY));
            const vf mref = vselect(seen, mb, vzero());
            const vf corr = vselect((vi)(m_old > vbcast(-INFINITY)), vexp_nonpositive(m_old - mref), vbcast(1.0f));
            vf sum = vzero();
            for (int t = 0; t < ntok; t++) {
                const vf st = vload(w->st + (size_t)t * rows + j);
                const vf p = vselect((vi)(st > vbcast(-INFINITY)), vexp_nonpositive(st - mref), vzero());
                vstore(w->st + (size_t)t * rows + j, p);
                sum += p;
            }
            vstore(w->m + j, mb);
            vstore(w->l + j, vload(w->l + j) * corr + sum);
            for (int l = 0; l < TK_VL; l++)
                if (corr[l] != 1.0f) {
                    float *oj = w->o + (size_t)(j + l) * head_dim;
                    const vf c = vbcast(corr[l]);
                    for (int d = 0; d < head_dim; d += TK_VL) vstore(oj + d, vload(oj + d) * c);
                }
        }
        /* O [rows][hd] += P [rows][ntok] V [ntok][hd], P read from P^T */
#if TK_BF16_DP
        if (dp) {
            p_pairs((bf16 *)w->pb, w->st, rows, ntok);
            v_pairs((bf16 *)w->vb, (const bf16 *)v_cache + base, token_stride, ntok, head_dim);
            pv_dp(w->o, head_dim, (const bf16 *)w->pb, rows, (const bf16 *)w->vb, (ntok + 1) / 2);
        } else
#endif
            small_gemm(w->o, head_dim, w->st, 1, rows, vr, kv_stride, rows, head_dim, ntok, 1);
    }
    for (int j = 0; j < nrows; j++) {
        const size_t dst = ((size_t)(chunk_row + q0 + j / group) * num_heads + kvh * group + j % group) * head_dim;
        const float inv = w->l[j] > 0.0f ? 1.0f / w->l[j] : 0.0f;
        for (int d = 0; d < head_dim; d += TK_VL) vstore_any(out, dst + d, vload(w->o + (size_t)j * head_dim + d) * inv, dtype);
    }
}

/* Returns 0, 1 if a scratch buffer could not be allocated, 2 on a bad shape. */
int tk_prefill_attention(void *out, const void *q, long q_row_stride, const void *k_cache, const void *v_cache,
                         const int32_t *block_table, const int32_t *chunk_rows, const int32_t *chunk_starts,
                         const int32_t *chunk_lens, int num_chunks, int num_heads, int num_kv_heads, int head_dim,
                         int block_size, int table_stride, float scale, int dtype, int kv_dtype, int num_threads) {
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || head_dim <= 0 || head_dim % TK_VL != 0 ||
        block_size <= 0 || (QT * (num_heads / num_kv_heads)) % TK_VL != 0)
        return 2;
    const int rows = QT * (num_heads / num_kv_heads);
    int num_items = 0;
    for (int c = 0; c < num_chunks; c++) num_items += (chunk_lens[c] + QT - 1) / QT * num_kv_heads;
    if (num_items == 0) return 0;
    prefill_item *items = malloc(sizeof(prefill_item) * (size_t)num_items);
    if (items == NULL) return 1;
    int n = 0;
    for (int c = 0; c < num_chunks; c++)
        for (int t = 0; t < (chunk_lens[c] + QT - 1) / QT; t++)
            for (int h = 0; h < num_kv_heads; h++) items[n++] = (prefill_item){c, t, h, chunk_starts[c] + t * QT};
    /* Heaviest first (the tiles that see the longest contexts), so the last items are short. */
    qsort(items, (size_t)n, sizeof(prefill_item), by_context_desc);
    int failed = 0, next = 0;
    const int threads = num_items < num_threads ? num_items : num_threads;
#pragma omp parallel num_threads(threads)
    {
        const size_t nq = (size_t)rows * head_dim, nkv = (size_t)block_size * head_dim;
        const size_t npb = (size_t)(block_size + 1) / 2 * rows; /* P in bfloat16 pairs (dot-product builds) */
        float *buf = malloc(sizeof(float) * (2 * nq + (size_t)block_size * rows + 2 * nkv + 2 * (size_t)rows + npb));
        if (buf == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        prefill_scratch w = {buf, buf + nq, buf + 2 * nq, NULL, NULL, NULL, NULL, NULL};
        if (buf != NULL) {
            w.kb = w.st + (size_t)block_size * rows;
            w.vb = w.kb + nkv;
            w.m = w.vb + nkv;
            w.l = w.m + rows;
            w.pb = w.l + rows;
        }
        /* Each thread takes its next item before running the current one, so it can fetch
         * that item's query rows ahead. */
        const size_t elem = dtype == TK_BF16 ? 2 : 4;
        int i;
#pragma omp atomic capture
        i = next++;
        while (i < num_items && buf != NULL) {
            int following;
#pragma omp atomic capture
            following = next++;
            const char *q_next = NULL;
            if (following < num_items) {
                const prefill_item *f = &items[following];
                q_next = (const char *)q + ((size_t)(chunk_rows[f->chunk] + f->tile * QT) * q_row_stride +
                                            (size_t)f->kv_head * (num_heads / num_kv_heads) * head_dim) * elem;
            }
            const prefill_item *it = &items[i];
            const int c = it->chunk;
            prefill_item_run(it, out, q, q_row_stride, (const char *)k_cache, (const char *)v_cache,
                             block_table + (size_t)c * table_stride, chunk_rows[c], chunk_starts[c], chunk_lens[c],
                             num_heads, num_kv_heads, head_dim, block_size, scale, dtype, kv_dtype, &w, q_next,
                             (size_t)q_row_stride * elem);
            i = following;
        }
        free(buf);
    }
    free(items);
    return failed;
}
