/* The arithmetic every CPU kernel shares, with its order of operations fixed, so that a
 * result is one function of its inputs on every x86 build (docs/determinism.md).
 *
 * The kernels compile without -ffast-math and with -ffp-contract=off (gpu/kernels/native.py):
 * the compiler may not reassociate a sum, fuse a multiply into an add, or call a vector
 * math library whose width depends on the CPU. What is vectorized is written with
 * intrinsics here, 8 fp32 lanes, and the portable C beside each intrinsic computes the
 * same values lane by lane (fmaf is the same fused multiply-add), so the AVX2 build,
 * an AVX-512 build and a build with no vector extensions give the same bits.
 *
 *   lanes      a sum over i goes to lane i % 8, each lane in order of i
 *   tree       the lanes then add as ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))
 *   exp        exp_fixed: Cody-Waite range reduction and a degree-5 polynomial (Cephes
 *              expf's), every step one rounding; within 2 ulp of expf on [-87, 88]
 *   tanh       tanh_fixed: Cephes tanhf's split, an odd degree-9 polynomial below
 *              |x| = 0.625 and 1 - 2 / (exp_fixed(2|x|) + 1) above, the sign copied;
 *              within 1e-7 of tanhf (absolute). The AVX2 form computes both branches
 *              and picks per lane, each with the same operations as the C.
 */
#ifndef LIFECYCLE_FIXED_ORDER_H
#define LIFECYCLE_FIXED_ORDER_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define FO_AVX2 1
#endif

/* fp16 <-> fp32, the KV cache's storage (gpu/cache/kv_cache.py) and the GGUF scales: exact one
 * way, round-to-nearest-even the other, as F16C's vcvtph2ps / vcvtps2ph (imm 0) and
 * torch's conversion give them (NaN quieted, its upper payload kept; 65520 and above to
 * infinity; subnormals kept). */
static inline float fo_half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t bits;
    if (exp == 0x1f) bits = sign | 0x7f800000 | (man << 13);
    else if (exp != 0) bits = sign | ((exp + 112) << 23) | (man << 13);
    else if (man == 0) bits = sign;
    else { /* subnormal: normalize */
        exp = 113;
        while (!(man & 0x400)) { man <<= 1; exp--; }
        bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
static inline uint16_t fo_float_to_half(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000;
    x &= 0x7fffffff;
    if (x >= 0x7f800000) /* inf, NaN (quieted) */
        return (uint16_t)(sign | 0x7c00 | (x > 0x7f800000 ? 0x200 | ((x >> 13) & 0x3ff) : 0));
    if (x >= 0x477ff000) return (uint16_t)(sign | 0x7c00); /* rounds to 65536 or more */
    uint32_t r, rem, half;
    if (x < 0x38800000) { /* below 2^-14: a subnormal half (or zero) */
        if (x < 0x33000000) return (uint16_t)sign; /* below 2^-25 */
        uint32_t e = x >> 23, m = (x & 0x7fffff) | 0x800000;
        int shift = (int)(126 - e); /* 14 .. 24 */
        r = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    } else {
        r = (x - 0x38000000) >> 13, rem = x & 0x1fff, half = 0x1000;
    }
    if (rem > half || (rem == half && (r & 1))) r++; /* a carry moves into the exponent */
    return (uint16_t)(sign | r);
}

static inline float fo_tree8(const float *l) {
    return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

/* exp(x), the clamp keeping 2^n normal: below -87.3 it is ~1e-38, not 0. */
#define FO_EXP_HI 88.3762626647949f
#define FO_EXP_LO -87.3365447504f
#define FO_LOG2E 1.44269504088896341f
#define FO_LN2_HI 0.693359375f
#define FO_LN2_LO -2.12194440e-4f
#define FO_P0 1.9875691500E-4f
#define FO_P1 1.3981999507E-3f
#define FO_P2 8.3334519073E-3f
#define FO_P3 4.1665795894E-2f
#define FO_P4 1.6666665459E-1f
#define FO_P5 5.0000001201E-1f

static inline float exp_fixed(float x) {
    x = fminf(fmaxf(x, FO_EXP_LO), FO_EXP_HI);
    float n = nearbyintf(x * FO_LOG2E);
    float r = fmaf(n, -FO_LN2_HI, x);
    r = fmaf(n, -FO_LN2_LO, r);
    float p = fmaf(FO_P0, r, FO_P1);
    p = fmaf(p, r, FO_P2);
    p = fmaf(p, r, FO_P3);
    p = fmaf(p, r, FO_P4);
    p = fmaf(p, r, FO_P5);
    float r2 = r * r;
    float y = fmaf(p, r2, r) + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return y * scale;
}

/* Cephes tanhf's polynomial for |x| <= 0.625: x + x^3 P(x^2). */
#define FO_T0 -5.70498872745E-3f
#define FO_T1 2.06390887954E-2f
#define FO_T2 -5.37397155531E-2f
#define FO_T3 1.33314422036E-1f
#define FO_T4 -3.33332819422E-1f
#define FO_TANH_SPLIT 0.625f

static inline float tanh_fixed(float x) {
    float a = fabsf(x);
    if (a > FO_TANH_SPLIT) {
        float e = exp_fixed(2.0f * a);
        return copysignf(1.0f - 2.0f / (e + 1.0f), x);
    }
    float z = x * x;
    float p = fmaf(FO_T0, z, FO_T1);
    p = fmaf(p, z, FO_T2);
    p = fmaf(p, z, FO_T3);
    p = fmaf(p, z, FO_T4);
    return fmaf(p * z, x, x);
}

/* GELU, tanh approximation (torch's gelu(approximate="tanh"), Gemma's activation):
 * 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))). */
#define FO_GELU_K 0.044715f
#define FO_SQRT_2_OVER_PI 0.7978845608028654f

static inline float gelu_tanh_fixed(float x) {
    float y = FO_SQRT_2_OVER_PI * fmaf(FO_GELU_K, (x * x) * x, x);
    return (0.5f * x) * (1.0f + tanh_fixed(y));
}

#ifdef FO_AVX2
static inline float fo_tree8_v(__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The tree of each of eight vectors, as one vector [tree(a0), ..., tree(a7)]. */
static inline __m256 fo_tree8x8(const __m256 *a) {
    __m256 s[4];
    for (int r = 0; r < 4; r++) /* [l0+l4 .. l3+l7 of a_r | the same of a_{r+4}] */
        s[r] = _mm256_add_ps(_mm256_permute2f128_ps(a[r], a[r + 4], 0x20),
                             _mm256_permute2f128_ps(a[r], a[r + 4], 0x31));
    __m256 t0 = _mm256_unpacklo_ps(s[0], s[1]), t1 = _mm256_unpackhi_ps(s[0], s[1]);
    __m256 t2 = _mm256_unpacklo_ps(s[2], s[3]), t3 = _mm256_unpackhi_ps(s[2], s[3]);
    __m256 c0 = _mm256_shuffle_ps(t0, t2, 0x44), c1 = _mm256_shuffle_ps(t0, t2, 0xee);
    __m256 c2 = _mm256_shuffle_ps(t1, t3, 0x44), c3 = _mm256_shuffle_ps(t1, t3, 0xee);
    /* c_k lane r = (l_k + l_{k+4}) of a_r: the tree is (c0 + c2) + (c1 + c3) */
    return _mm256_add_ps(_mm256_add_ps(c0, c2), _mm256_add_ps(c1, c3));
}

static inline __m256 exp_fixed_v(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(FO_EXP_LO)), _mm256_set1_ps(FO_EXP_HI));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(FO_LOG2E)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-FO_LN2_HI), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(-FO_LN2_LO), r);
    __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(FO_P0), r, _mm256_set1_ps(FO_P1));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(FO_P2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(FO_P3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(FO_P4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(FO_P5));
    __m256 r2 = _mm256_mul_ps(r, r);
    __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, r2, r), _mm256_set1_ps(1.0f));
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}

static inline __m256 tanh_fixed_v(__m256 x) {
    const __m256 one = _mm256_set1_ps(1.0f), neg = _mm256_set1_ps(-0.0f);
    __m256 a = _mm256_andnot_ps(neg, x);
    __m256 e = exp_fixed_v(_mm256_mul_ps(_mm256_set1_ps(2.0f), a));
    __m256 big = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, one)));
    big = _mm256_or_ps(big, _mm256_and_ps(x, neg)); /* copysign: big is positive */
    __m256 z = _mm256_mul_ps(x, x);
    __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(FO_T0), z, _mm256_set1_ps(FO_T1));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(FO_T2));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(FO_T3));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(FO_T4));
    __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(p, z), x, x);
    __m256 use_big = _mm256_cmp_ps(a, _mm256_set1_ps(FO_TANH_SPLIT), _CMP_GT_OQ);
    return _mm256_blendv_ps(small, big, use_big);
}

static inline __m256 gelu_tanh_fixed_v(__m256 x) {
    __m256 cube = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
    __m256 y = _mm256_mul_ps(_mm256_set1_ps(FO_SQRT_2_OVER_PI),
                             _mm256_fmadd_ps(_mm256_set1_ps(FO_GELU_K), cube, x));
    __m256 half = _mm256_mul_ps(_mm256_set1_ps(0.5f), x);
    return _mm256_mul_ps(half, _mm256_add_ps(_mm256_set1_ps(1.0f), tanh_fixed_v(y)));
}
#endif

/* sum(x[i] * x[i]) in lanes and tree. */
static inline float fo_sumsq(const float *x, int64_t n) {
    int64_t i = 0;
#ifdef FO_AVX2
    __m256 a = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        a = _mm256_fmadd_ps(v, v, a);
    }
    float l[8];
    _mm256_storeu_ps(l, a);
#else
    float l[8] = {0};
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) l[j] = fmaf(x[i + j], x[i + j], l[j]);
#endif
    for (; i < n; i++) l[i % 8] = fmaf(x[i], x[i], l[i % 8]);
    return fo_tree8(l);
}

/* sum(x[i]) in lanes and tree. */
static inline float fo_sum(const float *x, int64_t n) {
    int64_t i = 0;
#ifdef FO_AVX2
    __m256 a = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) a = _mm256_add_ps(a, _mm256_loadu_ps(x + i));
    float l[8];
    _mm256_storeu_ps(l, a);
#else
    float l[8] = {0};
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) l[j] = l[j] + x[i + j];
#endif
    for (; i < n; i++) l[i % 8] = l[i % 8] + x[i];
    return fo_tree8(l);
}

/* x[i] = exp_fixed(x[i] - sub). */
static inline void fo_exp_sub(float *x, int64_t n, float sub) {
    int64_t i = 0;
#ifdef FO_AVX2
    __m256 s = _mm256_set1_ps(sub);
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, exp_fixed_v(_mm256_sub_ps(_mm256_loadu_ps(x + i), s)));
#endif
    for (; i < n; i++) x[i] = exp_fixed(x[i] - sub);
}

/* out[i] = g[i] / (1 + exp(-g[i])) * u[i]: SwiGLU's gate. */
static inline void fo_swiglu(const float *g, const float *u, float *out, int64_t n) {
    int64_t i = 0;
#ifdef FO_AVX2
    const __m256 one = _mm256_set1_ps(1.0f), neg = _mm256_set1_ps(-0.0f);
    for (; i + 8 <= n; i += 8) {
        __m256 gv = _mm256_loadu_ps(g + i);
        __m256 e = exp_fixed_v(_mm256_xor_ps(gv, neg));
        __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, e));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
    }
#endif
    for (; i < n; i++) out[i] = g[i] / (1.0f + exp_fixed(-g[i])) * u[i];
}

/* out[i] = gelu_tanh(g[i]) * u[i]: GeGLU's gate (Gemma). */
static inline void fo_geglu(const float *g, const float *u, float *out, int64_t n) {
    int64_t i = 0;
#ifdef FO_AVX2
    for (; i + 8 <= n; i += 8) {
        __m256 a = gelu_tanh_fixed_v(_mm256_loadu_ps(g + i));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(a, _mm256_loadu_ps(u + i)));
    }
#endif
    for (; i < n; i++) out[i] = gelu_tanh_fixed(g[i]) * u[i];
}

/* x[i] = cap * tanh(x[i] / cap): soft-capping (Gemma 2's attention scores and logits). */
static inline void fo_softcap(float *x, int64_t n, float cap) {
    int64_t i = 0;
#ifdef FO_AVX2
    __m256 c = _mm256_set1_ps(cap);
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(x + i, _mm256_mul_ps(c, tanh_fixed_v(_mm256_div_ps(_mm256_loadu_ps(x + i), c))));
#endif
    for (; i < n; i++) x[i] = cap * tanh_fixed(x[i] / cap);
}

#endif
