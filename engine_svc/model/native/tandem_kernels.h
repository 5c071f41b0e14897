/*
 * Helpers shared by the native kernels: one vector type whose width follows the build's
 * ISA flags (8 floats with -mavx2, 16 with -mavx512f), bfloat16 <-> float32 conversion,
 * and exp for softmax and SiLU.
 *
 * Every kernel computes in float32. bfloat16 tensors are read by widening (a bfloat16 is
 * the top half of a float32) and written with round-to-nearest-even, NaN -> 0x7FC0,
 * exactly as torch converts, so a kernel that rounds where torch's bfloat16 ops round
 * gives torch's bits.
 */
#ifndef TANDEM_KERNELS_H
#define TANDEM_KERNELS_H

#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "tandem_api.h" /* TK_F32, TK_BF16 */

#if defined(__AVX512F__)
#define TK_VBYTES 64
#else
#define TK_VBYTES 32
#endif
#define TK_VL (TK_VBYTES / 4) /* floats per vector */

typedef float vf __attribute__((vector_size(TK_VBYTES)));
typedef float vf_u __attribute__((vector_size(TK_VBYTES), aligned(4)));
typedef uint32_t vu __attribute__((vector_size(TK_VBYTES)));
typedef int32_t vi __attribute__((vector_size(TK_VBYTES)));

typedef uint16_t bf16;

static inline float bf16_to_f32(bf16 h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline bf16 f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (bf16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* x rounded to the nearest bfloat16, kept as float32 (what a torch bfloat16 op stores). */
static inline float round_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }

static inline vf vzero(void) { return (vf){0}; }

static inline vf vbcast(float x) {
#if defined(__AVX512F__)
    return (vf)_mm512_set1_ps(x);
#else
    return (vf)_mm256_set1_ps(x);
#endif
}

static inline vf vload(const float *p) { return *(const vf_u *)p; }
static inline void vstore(float *p, vf v) { *(vf_u *)p = v; }

/* TK_VL bfloat16 values -> float32 vector. */
static inline vf vload_bf16(const bf16 *p) {
#if defined(__AVX512F__)
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return (vf)_mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
#else
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return (vf)_mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
#endif
}

/* Round every lane to bfloat16 (nearest even; NaN -> quiet NaN), as float32 bit patterns. */
static inline vu vround_bits(vf v) {
    vu u = (vu)v;
    vu r = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    vu nan = (vu)((u & 0x7fffffffu) > 0x7f800000u); /* all ones where NaN */
    return (r & ~nan) | (0x7fc00000u & nan);
}

static inline vf vround_bf16(vf v) { return (vf)vround_bits(v); }

static inline void vstore_bf16(bf16 *p, vf v) {
    vu hi = vround_bits(v) >> 16;
#if defined(__AVX512F__)
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16((__m512i)hi));
#else
    __m256i packed = _mm256_packus_epi32((__m256i)hi, (__m256i)hi); /* per 128-bit lane: a0..a3 a0..a3 */
    packed = _mm256_permute4x64_epi64(packed, 0x08);                /* low half: a0..a3 a4..a7 */
    _mm_storeu_si128((__m128i *)p, _mm256_castsi256_si128(packed));
#endif
}

/* Load / store TK_VL elements of a tensor of either dtype as float32. */
static inline vf vload_any(const void *base, size_t i, int dtype) {
    return dtype == TK_BF16 ? vload_bf16((const bf16 *)base + i) : vload((const float *)base + i);
}
static inline void vstore_any(void *base, size_t i, vf v, int dtype) {
    if (dtype == TK_BF16)
        vstore_bf16((bf16 *)base + i, v);
    else
        vstore((float *)base + i, v);
}
static inline float load_any(const void *base, size_t i, int dtype) {
    return dtype == TK_BF16 ? bf16_to_f32(((const bf16 *)base)[i]) : ((const float *)base)[i];
}
static inline void store_any(void *base, size_t i, float x, int dtype) {
    if (dtype == TK_BF16)
        ((bf16 *)base)[i] = f32_to_bf16(x);
    else
        ((float *)base)[i] = x;
}

/* exp(x) for x <= 0 as a polynomial the compiler can vectorise (Cephes expf: range
 * reduction by ln 2, degree-5 minimax; relative error ~1e-7 on [-87, 0]). */
static inline float exp_nonpositive(float x) {
    x = x > -87.0f ? x : -87.0f; /* fmaxf, NaN included, without a call into libm */
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union {
        int32_t i;
        float f;
    } two_n;
    two_n.i = ((int32_t)n + 127) << 23;
    return p * two_n.f;
}

/* Vector versions: lane-wise max, floor, select, exp for x <= 0, SiLU, and reductions. */
static inline vf vmax(vf a, vf b) {
#if defined(__AVX512F__)
    return (vf)_mm512_max_ps((__m512)a, (__m512)b);
#else
    return (vf)_mm256_max_ps((__m256)a, (__m256)b);
#endif
}

static inline vf vfloor(vf a) {
#if defined(__AVX512F__)
    return (vf)_mm512_roundscale_ps((__m512)a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
#else
    return (vf)_mm256_round_ps((__m256)a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
#endif
}

/* mask lanes all ones (true) or zero (false), as GCC's vector comparisons give. */
static inline vf vselect(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }

static inline vf vexp_nonpositive(vf x) {
    x = vmax(x, vbcast(-87.0f));
    const vf n = vfloor(x * 1.44269504088896341f + 0.5f);
    vf r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    vf p = vbcast(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const vi two_n = (__builtin_convertvector(n, vi) + 127) << 23;
    return p * (vf)two_n;
}

static inline vf vsilu(vf x) {
    const vi sign = (vi)x & (vi)vbcast(-0.0f);
    const vf e = vexp_nonpositive((vf)((vi)x | (vi)vbcast(-0.0f))); /* exp(-|x|) */
    const vf s = vselect(sign == 0, 1.0f / (1.0f + e), e / (1.0f + e));
    return x * s;
}

static inline float vhsum(vf v) {
    float s = 0.0f;
    for (int l = 0; l < TK_VL; l++) s += v[l];
    return s;
}

/* x * sigmoid(x) = x / (1 + exp(-x)), for any x; exp's argument is kept <= 0. */
static inline float silu(float x) {
    const float e = exp_nonpositive(-fabsf(x)); /* exp(-|x|) */
    const float s = x >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
    return x * s;
}

#endif
