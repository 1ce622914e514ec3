/* y = x @ w^T, w kept in its GGUF quantized blocks: decode and prefill alike, one
 * function of each row whatever else the call holds.
 *
 * As llama.cpp does (ggml-cpu quants.c, ggml_vec_dot_q4_1_q8_1 / ggml_vec_dot_q8_0_q8_0),
 * each row of x is quantized once per call to blocks of 32 int8 with an fp32 scale (and,
 * for Q4_1's offset term, the block's scaled sum), and every weight block meets it in an
 * int8 dot product. The weights dequantize to exactly what gguf.quants computes:
 *
 *   Q8_0 block, 34 bytes: fp16 d, int8 q[32];            w[i] = d * q[i]
 *   Q4_1 block, 20 bytes: fp16 d, fp16 m, uint8 qs[16];  w[i] = d * nib[i] + m, where
 *                         nib[i] = qs[i] & 15 and nib[i + 16] = qs[i] >> 4 (i < 16)
 *
 * THE FUNCTION (docs/determinism.md). Output y[r, j] is defined as follows, and every
 * path (any row count, any thread count, AVX2 or portable C, with or without AVX-512 in
 * the compiler's flags) computes exactly it, bit for bit:
 *
 *   x's block b of row r: d = amax / 127 (fp32), q[i] = round-half-even(x[i] * (1 / d)),
 *                         s = d * (float)sum(q)
 *   lane[l] for l < 8 starts at +0; for each block b in order:
 *       dot_l  = sum over i in 4l .. 4l+3 of wq[i] * q[i]   (an exact integer)
 *       scale  = dw_b * d_b                                 (one fp32 multiply)
 *       lane_l = fma(scale, (float)dot_l, lane_l)          (one rounding)
 *   Q4_1 only: msum starts at +0; for each block in order msum = msum + (m_b * s_b),
 *       the product rounded, then the sum
 *   y = ((lane0 + lane4) + (lane2 + lane6)) + ((lane1 + lane5) + (lane3 + lane7))
 *       [+ msum for Q4_1]
 *
 * The integers are exact (|dot_l| <= 4 * 128 * 127 for Q8_0, 4 * 15 * 127 for Q4_1),
 * so only the fp32 order matters, and it is fixed per output: no path splits a row's
 * blocks between accumulators or threads. Paths differ in how many outputs they
 * compute at once, which changes speed, not results.
 *
 * Calls tile the outputs: RM rows of x against RN rows of w, RM * RN accumulators in
 * registers, each weight block loaded once per RM rows and each x block once per RN
 * rows: 8 x 1 while eight rows remain (the block's unpacking and scales shared by
 * eight rows), then up to 4 x 2; one row of x (decode) streams two weight rows at a
 * time (one for Q8_0: the LM head; four for the types of blocks of 32 with an offset
 * and the k-quants, RG); with VNNI the other types' tiles take two weight rows against
 * up to eight rows of x (genv), with AVX512-VNNI in one 512-bit vector against up to 16
 * (genz). Rows of x go in chunks of XCHUNK so a chunk's
 * quantized rows stay in L2 while every tile of weights passes them; threads split the
 * weight rows (each output is one thread's). bench/qlinear.py --rows times the shapes;
 * against the fp32 panel path this replaced, SmolLM2's 30 layers at 1-32 rows take the
 * same time, at 64-256 rows 1.17-1.29x as long (2026-12-05, Zen 2).
 *
 *   x [M, K] fp32 contiguous, K % 32 == 0; w [N, K / 32 * block bytes] (GGUF row-major);
 *   y [M, N] fp32 contiguous.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#include "fixed_order.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define QL_AVX2 1
/* VNNI (AVX512-VNNI with AVX512-VL, or AVX-VNNI): one vpdpbusd adds four unsigned-by-
 * signed byte products into each int32 lane, with no 16-bit step that could saturate.
 * The lanes are the same integers as maddubs + madd give, so the function is unchanged;
 * a block's dot product takes one instruction instead of two. Signed weights stored as
 * w + o (unsigned) meet x with the accumulator seeded by -o times the lane's sum of x:
 * sum((w + o) q) - o sum(q) = sum(w q), exact in int32. */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define QL_VNNI 1
#define QL_DPBUSD(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#elif defined(__AVXVNNI__)
#define QL_VNNI 1
#define QL_DPBUSD(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#endif
#endif

enum {
    QK = 32, XCHUNK = 96, TILE_N = 2,
    GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q5_0 = 6, GGML_Q5_1 = 7, GGML_Q8_0 = 8,
    GGML_Q4_K = 12, GGML_Q5_K = 13, GGML_Q6_K = 14,
};

/* One quantized block of x: scale, scale * sum(q) (Q4_1's m term), 32 int8. */
typedef struct {
    float d;
    float s;
    int8_t q[QK];
} xblock;

static inline float half_to_float(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#ifdef QL_AVX2
    return _cvtsh_ss(h);
#else
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
#endif
}

/* llama.cpp's quantize_row_q8_1 with an fp32 scale: d = amax / 127, q = round(x / d) to
 * nearest even (nearbyintf in the default rounding mode; the AVX2 path's round_ps). */
static void quantize_row(const float *x, int64_t nb, xblock *out) {
    for (int64_t b = 0; b < nb; b++) {
        const float *v = x + b * QK;
#ifdef QL_AVX2
        const __m256 sign = _mm256_set1_ps(-0.0f);
        __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8);
        __m256 v2 = _mm256_loadu_ps(v + 16), v3 = _mm256_loadu_ps(v + 24);
        __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                                  _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
        __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(mx, 1), _mm256_castps256_ps128(mx));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        float d = _mm_cvtss_f32(m4) / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        const __m256 mul = _mm256_set1_ps(id);
        const int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
        __m256i i0 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v0, mul), mode));
        __m256i i1 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v1, mul), mode));
        __m256i i2 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v2, mul), mode));
        __m256i i3 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v3, mul), mode));
        __m256i s4 = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
        __m128i s2 = _mm_add_epi32(_mm256_castsi256_si128(s4), _mm256_extracti128_si256(s4, 1));
        s2 = _mm_add_epi32(s2, _mm_shuffle_epi32(s2, 0x4e));
        s2 = _mm_add_epi32(s2, _mm_shuffle_epi32(s2, 0xb1));
        /* packs work per 128-bit lane: the permute puts the 32 bytes back in order */
        __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
        p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)out[b].q, p);
        out[b].d = d;
        out[b].s = d * (float)_mm_cvtsi128_si32(s2);
#else
        float amax = 0.0f;
        for (int i = 0; i < QK; i++) amax = fmaxf(amax, fabsf(v[i]));
        float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        int sum = 0;
        for (int i = 0; i < QK; i++) {
            int q = (int)nearbyintf(v[i] * id);
            out[b].q[i] = (int8_t)q;
            sum += q;
        }
        out[b].d = d;
        out[b].s = d * (float)sum;
#endif
    }
}

/* The tile: y[rm * ldy + jn] for rm < RM rows of x (xq, rows nb blocks apart) and jn < RN
 * rows of w (row_bytes apart). RM and RN are constants after inlining. */
#ifdef QL_AVX2
/* Lane l: the sum of unsigned(a) * signed(b) over bytes 4l .. 4l+3, exact, as fp32. */
static inline __m256 dot_us8(__m256i a, __m256i b) {
#ifdef QL_VNNI
    return _mm256_cvtepi32_ps(QL_DPBUSD(_mm256_setzero_si256(), a, b));
#else
    __m256i p16 = _mm256_maddubs_epi16(a, b);
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
#endif
}

/* Signed weights qw (-128 .. 127) against x block qx, the same lanes: wb = ql_wbias(qw)
 * once per weight block, ql_dot_s per x block. The sign trick: |w| against x with w's
 * sign (|w| <= 128 and |x| <= 127 keep maddubs' pairs inside int16). */
static inline __m256i ql_wbias(__m256i qw) { return _mm256_sign_epi8(qw, qw); }
static inline __m256 ql_dot_s(__m256i wb, __m256i qw, __m256i qx) {
    return dot_us8(wb, _mm256_sign_epi8(qx, qw));
}
#ifdef QL_VNNI
/* -o times each lane's sum of x: the seed that makes dpbusd of x against weights stored
 * plus o (unsigned) the dot product with the weights themselves. */
static inline __m256i ql_negoff(__m256i qx, char o) {
    return _mm256_sub_epi32(_mm256_setzero_si256(),
                            QL_DPBUSD(_mm256_setzero_si256(), _mm256_set1_epi8(o), qx));
}
#endif

/* 16 bytes of nibbles as 32 bytes: low nibbles are elements 0..15, high nibbles 16..31.
 * The bytes in both halves, the upper half's 32-bit lanes shifted right by 4 (a byte's
 * high nibble lands in its low one; what crosses from the next byte is masked off). */
static inline __m256i nibbles16(const uint8_t *qs) {
    __m256i raw = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qs));
    return _mm256_and_si256(_mm256_srlv_epi32(raw, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)),
                            _mm256_set1_epi8(0x0f));
}
static inline __m256i nibbles_q4_1(const uint8_t *blk) { return nibbles16(blk + 4); }

/* One function per (RM, RN), the accumulators arrays of exactly that size with every
 * loop over them unrolled, so gcc keeps them in registers. Per block and weight row the
 * RM scales d_w * d_x come from one 4-wide multiply (dx4: the rows' d values, [nb][4]). */
#define DEF_TILE_Q8_0(RM, RN)                                                                 \
    static void tile_q8_0_##RM##_##RN(const uint8_t *w, int64_t row_bytes, const xblock *xq, \
                                      const float *dx, const float *sx, int64_t nb, float *y, \
                                      int64_t ldy) {                                          \
        (void)sx;                                                                             \
        __m256 acc[RM][RN];                                                                   \
        _Pragma("GCC unroll 4") for (int r = 0; r < RM; r++)                                  \
        _Pragma("GCC unroll 4") for (int c = 0; c < RN; c++) acc[r][c] = _mm256_setzero_ps(); \
        for (int64_t b = 0; b < nb; b++) {                                                    \
            __m128 dx4 = _mm_loadu_ps(dx + b * 4);                                            \
            _Pragma("GCC unroll 4") for (int c = 0; c < RN; c++) {                            \
                const uint8_t *blk = w + c * row_bytes + b * 34;                              \
                __m256i qw = _mm256_loadu_si256((const __m256i *)(blk + 2));                  \
                __m256i aw = ql_wbias(qw);                                                    \
                float s[4];                                                                   \
                _mm_storeu_ps(s, _mm_mul_ps(_mm_set1_ps(half_to_float(blk)), dx4));          \
                _Pragma("GCC unroll 4") for (int r = 0; r < RM; r++) {                        \
                    const xblock *xb = xq + r * nb + b;                                       \
                    __m256i qx = _mm256_loadu_si256((const __m256i *)xb->q);                  \
                    __m256 p = ql_dot_s(aw, qw, qx);                                          \
                    acc[r][c] = _mm256_fmadd_ps(_mm256_broadcast_ss(s + r), p, acc[r][c]);    \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
        _Pragma("GCC unroll 4") for (int r = 0; r < RM; r++)                                  \
        _Pragma("GCC unroll 4") for (int c = 0; c < RN; c++) y[r * ldy + c] = fo_tree8_v(acc[r][c]); \
    }

#define DEF_TILE_Q4_1(RM, RN)                                                                 \
    static void tile_q4_1_##RM##_##RN(const uint8_t *w, int64_t row_bytes, const xblock *xq, \
                                      const float *dx, const float *sx, int64_t nb, float *y, \
                                      int64_t ldy) {                                          \
        __m256 acc[RM][RN];                                                                   \
        __m128 ms[RN];                                                                        \
        _Pragma("GCC unroll 4") for (int c = 0; c < RN; c++) {                                \
            ms[c] = _mm_setzero_ps();                                                         \
            _Pragma("GCC unroll 4") for (int r = 0; r < RM; r++) acc[r][c] = _mm256_setzero_ps(); \
        }                                                                                     \
        for (int64_t b = 0; b < nb; b++) {                                                    \
            __m128 dx4 = _mm_loadu_ps(dx + b * 4), sx4 = _mm_loadu_ps(sx + b * 4);            \
            _Pragma("GCC unroll 4") for (int c = 0; c < RN; c++) {                            \
                const uint8_t *blk = w + c * row_bytes + b * 20;                              \
                __m256i qw = nibbles_q4_1(blk);                                               \
                uint32_t dm32;                                                                \
                memcpy(&dm32, blk, 4);                                                        \
                __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128((int)dm32));                       \
                float s[4];                                                                   \
                _mm_storeu_ps(s, _mm_mul_ps(_mm_permute_ps(dm, 0x00), dx4));                  \
                ms[c] = _mm_add_ps(ms[c], _mm_mul_ps(_mm_permute_ps(dm, 0x55), sx4));         \
                _Pragma("GCC unroll 4") for (int r = 0; r < RM; r++) {                        \
                    __m256i qx = _mm256_loadu_si256((const __m256i *)xq[r * nb + b].q);       \
                    acc[r][c] = _mm256_fmadd_ps(_mm256_broadcast_ss(s + r), dot_us8(qw, qx), acc[r][c]); \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
        _Pragma("GCC unroll 4") for (int c = 0; c < RN; c++) {                                \
            float m[4];                                                                       \
            _mm_storeu_ps(m, ms[c]);                                                          \
            _Pragma("GCC unroll 4") for (int r = 0; r < RM; r++)                              \
                y[r * ldy + c] = fo_tree8_v(acc[r][c]) + m[r];                                   \
        }                                                                                     \
    }

/* One row of x (decode at batch 1): the scale and Q4_1's offset term from one multiply
 * of [d_w, m_w] by the x block's adjacent [d, s]; lane 1 of that product accumulates
 * msum, lane 0 broadcast is the scale (the same two fp32 products as above). */
#define DEF_ROW_Q4_1(RN)                                                                      \
    static void row_q4_1_##RN(const uint8_t *w, int64_t row_bytes, const xblock *xq,         \
                              int64_t nb, float *y) {                                         \
        __m256 acc[RN];                                                                       \
        __m128 ms[RN];                                                                        \
        _Pragma("GCC unroll 4") for (int c = 0; c < RN; c++) acc[c] = _mm256_setzero_ps(),   \
                                                             ms[c] = _mm_setzero_ps();        \
        for (int64_t b = 0; b < nb; b++) {                                                    \
            __m128 xds = _mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)&xq[b].d));        \
            __m256i qx = _mm256_loadu_si256((const __m256i *)xq[b].q);                        \
            _Pragma("GCC unroll 4") for (int c = 0; c < RN; c++) {                            \
                const uint8_t *blk = w + c * row_bytes + b * 20;                              \
                uint32_t dm32;                                                                \
                memcpy(&dm32, blk, 4);                                                        \
                __m128 prod = _mm_mul_ps(_mm_cvtph_ps(_mm_cvtsi32_si128((int)dm32)), xds);     \
                ms[c] = _mm_add_ps(ms[c], prod);                                              \
                acc[c] = _mm256_fmadd_ps(_mm256_broadcastss_ps(prod), dot_us8(nibbles_q4_1(blk), qx), acc[c]); \
            }                                                                                 \
        }                                                                                     \
        _Pragma("GCC unroll 4") for (int c = 0; c < RN; c++)                                  \
            y[c] = fo_tree8_v(acc[c]) + _mm_cvtss_f32(_mm_shuffle_ps(ms[c], ms[c], 1));            \
    }

#define DEF_ROW_Q8_0(RN)                                                                      \
    static void row_q8_0_##RN(const uint8_t *w, int64_t row_bytes, const xblock *xq,         \
                              int64_t nb, float *y) {                                         \
        __m256 acc[RN];                                                                       \
        _Pragma("GCC unroll 4") for (int c = 0; c < RN; c++) acc[c] = _mm256_setzero_ps();   \
        for (int64_t b = 0; b < nb; b++) {                                                    \
            __m256i qx = _mm256_loadu_si256((const __m256i *)xq[b].q);                        \
            _Pragma("GCC unroll 4") for (int c = 0; c < RN; c++) {                            \
                const uint8_t *blk = w + c * row_bytes + b * 34;                              \
                __m256i qw = _mm256_loadu_si256((const __m256i *)(blk + 2));                  \
                __m256 p = ql_dot_s(ql_wbias(qw), qw, qx);                                    \
                acc[c] = _mm256_fmadd_ps(_mm256_set1_ps(half_to_float(blk) * xq[b].d), p, acc[c]); \
            }                                                                                 \
        }                                                                                     \
        _Pragma("GCC unroll 4") for (int c = 0; c < RN; c++) y[c] = fo_tree8_v(acc[c]);            \
    }
/* Eight rows of x against one weight row: the weight block's unpacking and scale work
 * shared by eight rows. dx and sx hold two groups of four rows, nb * 4 floats apart. */
static void tall_q4_1(const uint8_t *w, const xblock *xq, const float *dx, const float *sx,
                      int64_t nb, float *y, int64_t ldy) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    __m128 m0 = _mm_setzero_ps(), m1 = m0;
    const float *dx2 = dx + nb * 4, *sx2 = sx + nb * 4;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * 20;
        __m256i qw = nibbles_q4_1(blk);
        uint32_t dm32;
        memcpy(&dm32, blk, 4);
        __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128((int)dm32));
        __m128 dv = _mm_permute_ps(dm, 0x00), mv = _mm_permute_ps(dm, 0x55);
        float s[8];
        _mm_storeu_ps(s, _mm_mul_ps(dv, _mm_loadu_ps(dx + b * 4)));
        _mm_storeu_ps(s + 4, _mm_mul_ps(dv, _mm_loadu_ps(dx2 + b * 4)));
        m0 = _mm_add_ps(m0, _mm_mul_ps(mv, _mm_loadu_ps(sx + b * 4)));
        m1 = _mm_add_ps(m1, _mm_mul_ps(mv, _mm_loadu_ps(sx2 + b * 4)));
#define T(r, a) a = _mm256_fmadd_ps(_mm256_broadcast_ss(s + r),                              \
                                    dot_us8(qw, _mm256_loadu_si256((const __m256i *)xq[r * nb + b].q)), a);
        T(0, a0) T(1, a1) T(2, a2) T(3, a3) T(4, a4) T(5, a5) T(6, a6) T(7, a7)
#undef T
    }
    float m[8];
    _mm_storeu_ps(m, m0);
    _mm_storeu_ps(m + 4, m1);
    const __m256 a[8] = {a0, a1, a2, a3, a4, a5, a6, a7};
    for (int r = 0; r < 8; r++) y[r * ldy] = fo_tree8_v(a[r]) + m[r];
}
static void tall_q8_0(const uint8_t *w, const xblock *xq, const float *dx, int64_t nb, float *y,
                      int64_t ldy) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    const float *dx2 = dx + nb * 4;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * 34;
        __m256i qw = _mm256_loadu_si256((const __m256i *)(blk + 2));
        __m256i aw = ql_wbias(qw);
        __m128 dv = _mm_set1_ps(half_to_float(blk));
        float s[8];
        _mm_storeu_ps(s, _mm_mul_ps(dv, _mm_loadu_ps(dx + b * 4)));
        _mm_storeu_ps(s + 4, _mm_mul_ps(dv, _mm_loadu_ps(dx2 + b * 4)));
#define T(r, a) a = _mm256_fmadd_ps(_mm256_broadcast_ss(s + r),                              \
                                    ql_dot_s(aw, qw, _mm256_loadu_si256(                     \
                                                 (const __m256i *)xq[r * nb + b].q)), a);
        T(0, a0) T(1, a1) T(2, a2) T(3, a3) T(4, a4) T(5, a5) T(6, a6) T(7, a7)
#undef T
    }
    const __m256 a[8] = {a0, a1, a2, a3, a4, a5, a6, a7};
    for (int r = 0; r < 8; r++) y[r * ldy] = fo_tree8_v(a[r]);
}

DEF_ROW_Q4_1(1) DEF_ROW_Q4_1(2)
DEF_ROW_Q8_0(1) DEF_ROW_Q8_0(2)
#else
/* Portable C: the same function, lane by lane (fmaf is the fused multiply-add). */

static void tile_q8_0(const uint8_t *w, int64_t row_bytes, const xblock *xq, int64_t nb, int RM,
                      int RN, float *y, int64_t ldy) {
    for (int r = 0; r < RM; r++)
        for (int c = 0; c < RN; c++) {
            float lane[8] = {0};
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *blk = w + c * row_bytes + b * 34;
                const int8_t *qw = (const int8_t *)(blk + 2);
                const xblock *xb = xq + r * nb + b;
                float scale = half_to_float(blk) * xb->d;
                for (int l = 0; l < 8; l++) {
                    int dot = 0;
                    for (int i = 4 * l; i < 4 * l + 4; i++) dot += qw[i] * xb->q[i];
                    lane[l] = fmaf(scale, (float)dot, lane[l]);
                }
            }
            y[r * ldy + c] = fo_tree8(lane);
        }
}

static void tile_q4_1(const uint8_t *w, int64_t row_bytes, const xblock *xq, const float *sx,
                      int64_t nb, int RM, int RN, float *y, int64_t ldy) {
    for (int r = 0; r < RM; r++)
        for (int c = 0; c < RN; c++) {
            float lane[8] = {0}, msum = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *blk = w + c * row_bytes + b * 20;
                const xblock *xb = xq + r * nb + b;
                float scale = half_to_float(blk) * xb->d;
                for (int l = 0; l < 8; l++) {
                    int dot = 0;
                    for (int i = 4 * l; i < 4 * l + 4; i++) {
                        int nib = i < 16 ? blk[4 + i] & 15 : blk[4 + i - 16] >> 4;
                        dot += nib * xb->q[i];
                    }
                    lane[l] = fmaf(scale, (float)dot, lane[l]);
                }
                float mt = half_to_float(blk + 2) * sx[b * 4 + r];
                msum = msum + mt;
            }
            y[r * ldy + c] = fo_tree8(lane) + msum;
        }
}
#endif

/* Every (RM, RN) the calls use, each its own function: RM * RN <= 12 accumulators (16
 * vector registers, the rest for operands). */
#ifndef QL_AVX2
#define DEF_TILE_Q8_0(RM, RN)                                                                 \
    static void tile_q8_0_##RM##_##RN(const uint8_t *w, int64_t row_bytes, const xblock *xq, \
                                      const float *dx, const float *sx, int64_t nb, float *y, \
                                      int64_t ldy) {                                          \
        (void)dx, (void)sx;                                                                   \
        tile_q8_0(w, row_bytes, xq, nb, RM, RN, y, ldy);                                      \
    }
#define DEF_TILE_Q4_1(RM, RN)                                                                 \
    static void tile_q4_1_##RM##_##RN(const uint8_t *w, int64_t row_bytes, const xblock *xq, \
                                      const float *dx, const float *sx, int64_t nb, float *y, \
                                      int64_t ldy) {                                          \
        (void)dx;                                                                             \
        tile_q4_1(w, row_bytes, xq, sx, nb, RM, RN, y, ldy);                                  \
    }
#endif
#define TILES(T) T(1, 1) T(1, 2) T(2, 1) T(2, 2) T(3, 1) T(3, 2) T(4, 1) T(4, 2)
#define DEFS(RM, RN) DEF_TILE_Q8_0(RM, RN) DEF_TILE_Q4_1(RM, RN)
TILES(DEFS)
#define CASE8(RM, RN) case RM * 8 + RN: tile_q8_0_##RM##_##RN(w, row_bytes, xq, dx, sx, nb, y, ldy); return;
#define CASE4(RM, RN) case RM * 8 + RN: tile_q4_1_##RM##_##RN(w, row_bytes, xq, dx, sx, nb, y, ldy); return;
static void tile(int32_t qtype, const uint8_t *w, int64_t row_bytes, const xblock *xq,
                 const float *dx, const float *sx, int64_t nb, int rm, int rn, float *y, int64_t ldy) {
#ifdef QL_AVX2
    if (rm == 1) {
        if (qtype == GGML_Q8_0) {
            if (rn == 1) row_q8_0_1(w, row_bytes, xq, nb, y);
            else row_q8_0_2(w, row_bytes, xq, nb, y);
        } else if (rn == 1) row_q4_1_1(w, row_bytes, xq, nb, y);
        else row_q4_1_2(w, row_bytes, xq, nb, y);
        return;
    }
#endif
    if (qtype == GGML_Q8_0) {
        switch (rm * 8 + rn) { TILES(CASE8) }
    } else {
        switch (rm * 8 + rn) { TILES(CASE4) }
    }
}

/* The weight rows a tile takes for rm rows of x: four while a tile's accumulators
 * allow (the chains of FMAs a decode row needs in flight), three for four rows. */


/* Dequantize blocks [nrows, nb] to fp32 rows [nrows, nb * 32] (what q_dequantize gives). */
static void dequant_rows(const uint8_t *w, float *out, int32_t qtype, int64_t nrows, int64_t nb) {
    int64_t bs = qtype == GGML_Q8_0 ? 34 : 20;
    for (int64_t b = 0; b < nrows * nb; b++) {
        const uint8_t *blk = w + b * bs;
        float *o = out + b * QK, d = half_to_float(blk);
        if (qtype == GGML_Q8_0) {
            for (int i = 0; i < QK; i++) o[i] = d * (float)(int8_t)blk[2 + i];
        } else {
            float mw = half_to_float(blk + 2);
            for (int i = 0; i < QK / 2; i++) {
                o[i] = fmaf(d, (float)(blk[4 + i] & 15), mw);
                o[i + QK / 2] = fmaf(d, (float)(blk[4 + i] >> 4), mw);
            }
        }
    }
}


/* ---- The other GGUF types: each weight row unpacked, then one generic kernel ----------
 *
 * Q4_0, Q5_0, Q5_1 (blocks of 32) and the k-quants Q4_K, Q5_K, Q6_K (super-blocks of 256
 * with 6-bit or 8-bit sub-block scales) read in place. Every type is, per block of 32
 * weights, integers wq[i] (|wq| <= 32), a scale for elements 0-15 and one for 16-31 (the
 * same but for Q6_K, whose scales cover 16 weights) and an offset (Q5_1, Q4_K, Q5_K):
 *
 *   Q4_0  18 B: fp16 d, 16 B nibbles            wq = nib - 8,            scale d
 *   Q5_0  22 B: fp16 d, 4 B high bits, 16 B     wq = (nib | hb << 4) - 16, scale d
 *   Q5_1  24 B: fp16 d, fp16 m, 4 B, 16 B       wq = nib | hb << 4,      scale d, offset m
 *   Q4_K 144 B per 256: fp16 d, fp16 dmin, 12 B of 6-bit (sc, m) pairs, 128 B nibbles;
 *         sub-block j: wq = nib, scale d * sc_j, offset -(dmin * m_j)
 *   Q5_K 176 B per 256: Q4_K plus 32 B of fifth bits
 *   Q6_K 210 B per 256: 128 B low nibbles, 64 B high 2-bit pairs, 16 int8 scales, fp16 d;
 *         wq = q6 - 32, scale d * sc per 16 weights
 *
 * (ggml-quants.c's dequantize_row_* give the layouts.) The scales are exact products
 * (an fp16 times an integer of at most 8 bits), so the weight is dw * wq + mw exactly as
 * gguf.quants dequantizes it, and THE FUNCTION is the one above with the scale chosen per
 * lane half: lane_l = fma(dw_{b, l < 4 ? lo : hi} * d_b, (float)dot_l, lane_l), and for
 * types with an offset msum = msum + (mw_b * s_b) in block order, added last. Unpacking
 * a row is integer work and exact products, so it is the same code on every build. */
typedef struct {
    int8_t *q;     /* [nb][32] */
    float *lo, *hi, *mo; /* [nb] each */
} unpacked;

static int generic_type(int32_t t) {
    return t == GGML_Q4_0 || t == GGML_Q5_0 || t == GGML_Q5_1 || t == GGML_Q4_K ||
           t == GGML_Q5_K || t == GGML_Q6_K;
}
static int has_offset(int32_t t) { return t == GGML_Q5_1 || t == GGML_Q4_K || t == GGML_Q5_K; }
/* Weights per block of the file's layout, and its bytes. */
static int block_elems(int32_t t) { return t >= GGML_Q4_K ? 256 : 32; }
static int block_bytes(int32_t t) {
    switch (t) {
    case GGML_Q4_0: return 18;
    case GGML_Q4_1: return 20;
    case GGML_Q5_0: return 22;
    case GGML_Q5_1: return 24;
    case GGML_Q8_0: return 34;
    case GGML_Q4_K: return 144;
    case GGML_Q5_K: return 176;
    case GGML_Q6_K: return 210;
    default: return 0;
    }
}

/* ggml's get_scale_min_k4: the j-th 6-bit (scale, min) pair of a Q4_K / Q5_K block. */
static inline void scale_min_k4(int j, const uint8_t *q, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* One row of nb blocks of 32 (w: the row's bytes) into u. */
static void unpack_row_c(int32_t t, const uint8_t *w, int64_t nb, const unpacked *u) {
    if (t == GGML_Q4_0 || t == GGML_Q5_0 || t == GGML_Q5_1) {
        int bytes = block_bytes(t);
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = w + b * bytes;
            int8_t *q = u->q + b * QK;
            float d = half_to_float(blk);
            u->lo[b] = u->hi[b] = d;
            u->mo[b] = 0.0f;
            if (t == GGML_Q4_0) {
                for (int j = 0; j < 16; j++) {
                    q[j] = (int8_t)((blk[2 + j] & 15) - 8);
                    q[j + 16] = (int8_t)((blk[2 + j] >> 4) - 8);
                }
                continue;
            }
            int off = t == GGML_Q5_0 ? 16 : 0;
            const uint8_t *hb = blk + (t == GGML_Q5_0 ? 2 : 4), *qs = hb + 4;
            uint32_t qh;
            memcpy(&qh, hb, 4);
            if (t == GGML_Q5_1) u->mo[b] = half_to_float(blk + 2);
            for (int j = 0; j < 16; j++) {
                int h0 = ((qh >> j) << 4) & 0x10, h1 = (qh >> (j + 12)) & 0x10;
                q[j] = (int8_t)(((qs[j] & 15) | h0) - off);
                q[j + 16] = (int8_t)(((qs[j] >> 4) | h1) - off);
            }
        }
        return;
    }
    int64_t nsb = nb / 8;
    for (int64_t s = 0; s < nsb; s++) {
        int8_t *q = u->q + s * 256;
        float *lo = u->lo + s * 8, *hi = u->hi + s * 8, *mo = u->mo + s * 8;
        if (t == GGML_Q6_K) {
            const uint8_t *blk = w + s * 210, *ql = blk, *qh = blk + 128;
            const int8_t *sc = (const int8_t *)(blk + 192);
            float d = half_to_float(blk + 208);
            for (int h = 0; h < 2; h++) {
                const uint8_t *l4 = ql + 64 * h, *h2 = qh + 32 * h;
                int8_t *o = q + 128 * h;
                for (int l = 0; l < 32; l++) {
                    o[l] = (int8_t)(((l4[l] & 15) | ((h2[l] & 3) << 4)) - 32);
                    o[l + 32] = (int8_t)(((l4[l + 32] & 15) | (((h2[l] >> 2) & 3) << 4)) - 32);
                    o[l + 64] = (int8_t)(((l4[l] >> 4) | (((h2[l] >> 4) & 3) << 4)) - 32);
                    o[l + 96] = (int8_t)(((l4[l + 32] >> 4) | (((h2[l] >> 6) & 3) << 4)) - 32);
                }
                for (int k = 0; k < 4; k++) {
                    lo[4 * h + k] = d * (float)sc[8 * h + 2 * k];
                    hi[4 * h + k] = d * (float)sc[8 * h + 2 * k + 1];
                    mo[4 * h + k] = 0.0f;
                }
            }
            continue;
        }
        /* Q4_K, Q5_K */
        const int five = t == GGML_Q5_K;
        const uint8_t *blk = w + s * (five ? 176 : 144), *scales = blk + 4;
        const uint8_t *qh = blk + 16, *qs = blk + (five ? 48 : 16);
        float d = half_to_float(blk), dmin = half_to_float(blk + 2);
        for (int j = 0; j < 4; j++) {
            int sc0, m0, sc1, m1;
            scale_min_k4(2 * j, scales, &sc0, &m0);
            scale_min_k4(2 * j + 1, scales, &sc1, &m1);
            lo[2 * j] = hi[2 * j] = d * (float)sc0;
            lo[2 * j + 1] = hi[2 * j + 1] = d * (float)sc1;
            mo[2 * j] = -(dmin * (float)m0);
            mo[2 * j + 1] = -(dmin * (float)m1);
            int8_t *o = q + 64 * j;
            const uint8_t *n = qs + 32 * j;
            for (int l = 0; l < 32; l++) {
                int a = n[l] & 15, c = n[l] >> 4;
                if (five) {
                    a += (qh[l] >> (2 * j)) & 1 ? 16 : 0;
                    c += (qh[l] >> (2 * j + 1)) & 1 ? 16 : 0;
                }
                o[l] = (int8_t)a;
                o[l + 32] = (int8_t)c;
            }
        }
    }
}


#ifdef QL_AVX2
/* llama.cpp's bytes_from_bits_32: byte i is 0xFF where bit i of the 32 bits is set. */
static inline __m256i bits_to_bytes(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                           0x0101010101010101, 0x0000000000000000);
    __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)v), shuf);
    bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    return _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1));
}

/* Q5's fifth bits: 16 added to byte i of nib (a nibble) where bit i of the 32 bits at qh
 * is set. */
static inline __m256i with_fifth_bit(__m256i nib, const uint8_t *qh) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    uint32_t bits;
    memcpy(&bits, qh, 4);
    return _mm256_mask_add_epi8(nib, (__mmask32)bits, nib, _mm256_set1_epi8(0x10));
#else
    return _mm256_or_si256(nib, _mm256_and_si256(bits_to_bytes(qh), _mm256_set1_epi8(0x10)));
#endif
}

/* The same integers as unpack_row_c (exact products for the scales), vectorized. */
static void unpack_row(int32_t t, const uint8_t *w, int64_t nb, const unpacked *u) {
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    if (t == GGML_Q8_0 || t == GGML_Q4_1) { /* the 512-bit tiles' route (gen_rows2z) */
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = w + b * block_bytes(t);
            u->lo[b] = u->hi[b] = half_to_float(blk);
            u->mo[b] = t == GGML_Q4_1 ? half_to_float(blk + 2) : 0.0f;
            _mm256_storeu_si256((__m256i *)(u->q + b * QK),
                                t == GGML_Q8_0 ? _mm256_loadu_si256((const __m256i *)(blk + 2))
                                               : nibbles16(blk + 4));
        }
        return;
    }
    if (t == GGML_Q4_0 || t == GGML_Q5_0 || t == GGML_Q5_1) {
        int bytes = block_bytes(t);
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = w + b * bytes;
            float d = half_to_float(blk);
            u->lo[b] = u->hi[b] = d;
            u->mo[b] = t == GGML_Q5_1 ? half_to_float(blk + 2) : 0.0f;
            const uint8_t *qs = blk + (t == GGML_Q4_0 ? 2 : t == GGML_Q5_0 ? 6 : 8);
            __m256i q = nibbles16(qs);
            if (t == GGML_Q4_0) {
                q = _mm256_sub_epi8(q, _mm256_set1_epi8(8));
            } else {
                q = with_fifth_bit(q, blk + (t == GGML_Q5_0 ? 2 : 4));
                if (t == GGML_Q5_0) q = _mm256_sub_epi8(q, _mm256_set1_epi8(16));
            }
            _mm256_storeu_si256((__m256i *)(u->q + b * QK), q);
        }
        return;
    }
    int64_t nsb = nb / 8;
    for (int64_t s = 0; s < nsb; s++) {
        int8_t *q = u->q + s * 256;
        float *lo = u->lo + s * 8, *hi = u->hi + s * 8, *mo = u->mo + s * 8;
        if (t == GGML_Q6_K) {
            const uint8_t *blk = w + s * 210;
            const int8_t *sc = (const int8_t *)(blk + 192);
            float d = half_to_float(blk + 208);
            const __m256i three = _mm256_set1_epi8(3), m32 = _mm256_set1_epi8(32);
            for (int h = 0; h < 2; h++) {
                __m256i l0 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h));
                __m256i l1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32));
                __m256i hh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
                __m256i h0 = _mm256_slli_epi16(_mm256_and_si256(hh, three), 4);
                __m256i h1 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hh, 2), three), 4);
                __m256i h2 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hh, 4), three), 4);
                __m256i h3 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hh, 6), three), 4);
                int8_t *o = q + 128 * h;
                _mm256_storeu_si256((__m256i *)o,
                                    _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(l0, low4), h0), m32));
                _mm256_storeu_si256((__m256i *)(o + 32),
                                    _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(l1, low4), h1), m32));
                _mm256_storeu_si256(
                    (__m256i *)(o + 64),
                    _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low4), h2), m32));
                _mm256_storeu_si256(
                    (__m256i *)(o + 96),
                    _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low4), h3), m32));
                for (int k = 0; k < 4; k++) {
                    lo[4 * h + k] = d * (float)sc[8 * h + 2 * k];
                    hi[4 * h + k] = d * (float)sc[8 * h + 2 * k + 1];
                    mo[4 * h + k] = 0.0f;
                }
            }
            continue;
        }
        const int five = t == GGML_Q5_K;
        const uint8_t *blk = w + s * (five ? 176 : 144), *scales = blk + 4;
        const uint8_t *qs = blk + (five ? 48 : 16);
        float d = half_to_float(blk), dmin = half_to_float(blk + 2);
        __m256i qh = five ? _mm256_loadu_si256((const __m256i *)(blk + 16)) : _mm256_setzero_si256();
        const __m256i one = _mm256_set1_epi8(1);
        for (int j = 0; j < 4; j++) {
            int sc0, m0, sc1, m1;
            scale_min_k4(2 * j, scales, &sc0, &m0);
            scale_min_k4(2 * j + 1, scales, &sc1, &m1);
            lo[2 * j] = hi[2 * j] = d * (float)sc0;
            lo[2 * j + 1] = hi[2 * j + 1] = d * (float)sc1;
            mo[2 * j] = -(dmin * (float)m0);
            mo[2 * j + 1] = -(dmin * (float)m1);
            __m256i n = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
            __m256i a = _mm256_and_si256(n, low4), c = _mm256_and_si256(_mm256_srli_epi16(n, 4), low4);
            if (five) {
                __m256i b0 = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * j)), one);
                __m256i b1 = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * j + 1)), one);
                a = _mm256_or_si256(a, _mm256_slli_epi16(b0, 4));
                c = _mm256_or_si256(c, _mm256_slli_epi16(b1, 4));
            }
            _mm256_storeu_si256((__m256i *)(q + 64 * j), a);
            _mm256_storeu_si256((__m256i *)(q + 64 * j + 32), c);
        }
    }
}
#else
#define unpack_row unpack_row_c
#endif
#ifdef QL_AVX2
/* RM rows of x (nb blocks apart) against one unpacked weight row. */
#define DEF_GEN(RM)                                                                           \
    static void gen_##RM(const unpacked *u, int offset, const xblock *xq, int64_t nb,         \
                         float *y, int64_t ldy) {                                             \
        __m256 acc[RM];                                                                       \
        float ms[RM];                                                                         \
        _Pragma("GCC unroll 8") for (int r = 0; r < RM; r++) acc[r] = _mm256_setzero_ps(),    \
                                                            ms[r] = 0.0f;                     \
        for (int64_t b = 0; b < nb; b++) {                                                    \
            __m256i qw = _mm256_loadu_si256((const __m256i *)(u->q + b * QK));                \
            __m256i aw = ql_wbias(qw);                                                        \
            __m256 dw = _mm256_setr_m128(_mm_set1_ps(u->lo[b]), _mm_set1_ps(u->hi[b]));      \
            _Pragma("GCC unroll 8") for (int r = 0; r < RM; r++) {                            \
                const xblock *xb = xq + r * nb + b;                                           \
                __m256i qx = _mm256_loadu_si256((const __m256i *)xb->q);                      \
                __m256 p = ql_dot_s(aw, qw, qx);                                              \
                acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(xb->d)), p, acc[r]); \
                if (offset) ms[r] = ms[r] + u->mo[b] * xb->s;                                 \
            }                                                                                 \
        }                                                                                     \
        _Pragma("GCC unroll 8") for (int r = 0; r < RM; r++) {                                \
            float v = fo_tree8_v(acc[r]);                                                     \
            y[r * ldy] = offset ? v + ms[r] : v;                                              \
        }                                                                                     \
    }
#else
#define DEF_GEN(RM)                                                                           \
    static void gen_##RM(const unpacked *u, int offset, const xblock *xq, int64_t nb,         \
                         float *y, int64_t ldy) {                                             \
        for (int r = 0; r < RM; r++) {                                                        \
            float lane[8] = {0}, msum = 0.0f;                                                 \
            for (int64_t b = 0; b < nb; b++) {                                                \
                const xblock *xb = xq + r * nb + b;                                           \
                const int8_t *qw = u->q + b * QK;                                             \
                float slo = u->lo[b] * xb->d, shi = u->hi[b] * xb->d;                         \
                for (int l = 0; l < 8; l++) {                                                 \
                    int dot = 0;                                                              \
                    for (int i = 4 * l; i < 4 * l + 4; i++) dot += qw[i] * xb->q[i];          \
                    lane[l] = fmaf(l < 4 ? slo : shi, (float)dot, lane[l]);                   \
                }                                                                             \
                if (offset) msum = msum + u->mo[b] * xb->s;                                   \
            }                                                                                 \
            float v = fo_tree8(lane);                                                         \
            y[r * ldy] = offset ? v + msum : v;                                               \
        }                                                                                     \
    }
#endif
DEF_GEN(8) DEF_GEN(4) DEF_GEN(2) DEF_GEN(1)


#ifdef QL_AVX2
/* One row of x (decode) against one weight row of the generic types, unpacking in
 * registers: the same function as unpack_row + gen_1 (the same integers, the same scale
 * products per lane half, the same fma per block and lane, msum in block order), without
 * the round trip through the buffers. Unsigned weights (Q5_1, Q4_K, Q5_K) meet x's
 * signed bytes in maddubs directly; signed ones through the sign trick. */
static inline __m256 dot_signed(__m256i qw, __m256i qx) {
    return dot_us8(_mm256_sign_epi8(qw, qw), _mm256_sign_epi8(qx, qw));
}

/* RN weight rows (row_bytes apart) at once: RN independent accumulation chains in flight
 * (each output's own chain is its fixed order; one chain alone waits on its FMAs'
 * latency), x's blocks loaded once for all of them. */
static inline __attribute__((always_inline)) void row_generic_n(
    int32_t t, const uint8_t *w, int64_t row_bytes, const xblock *xq, int64_t nb, float *y,
    const int RN) {
    __m256 acc[4];
    float ms[4];
    for (int c = 0; c < RN; c++) acc[c] = _mm256_setzero_ps(), ms[c] = 0.0f;
    if (t == GGML_Q4_0 || t == GGML_Q5_0 || t == GGML_Q5_1) {
        const int bytes = block_bytes(t);
        const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
        for (int64_t b = 0; b < nb; b++) {
            const xblock *xb = xq + b;
            __m256i qx = _mm256_loadu_si256((const __m256i *)xb->q);
            /* Q4_0 / Q5_0: (u - o) q summed per lane is u q summed minus o times the
             * lane's sum of q (u the unsigned weight, o its offset 8 or 16): the same
             * integers as the signed products, one maddubs without the sign fix-ups,
             * the lane sums shared by the RN rows. */
            __m256i off = _mm256_setzero_si256();
#ifdef QL_VNNI
            /* VNNI: the accumulator starts at -o times the lane sums */
            (void)ones8, (void)ones16;
            if (t != GGML_Q5_1) off = ql_negoff(qx, t == GGML_Q4_0 ? 8 : 16);
#define QL_UDOT(u) _mm256_cvtepi32_ps(QL_DPBUSD(off, u, qx))
#else
            if (t != GGML_Q5_1)
                off = _mm256_slli_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(ones8, qx), ones16),
                                        t == GGML_Q4_0 ? 3 : 4);
#define QL_UDOT(u)                                                                            \
    _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(u, qx), ones16), off))
#endif
            for (int c = 0; c < RN; c++) {
                const uint8_t *blk = w + c * row_bytes + b * bytes;
                __m256 sc = _mm256_set1_ps(half_to_float(blk) * xb->d);
                __m256 p;
                if (t == GGML_Q4_0) {
                    p = QL_UDOT(nibbles16(blk + 2));
                } else if (t == GGML_Q5_0) {
                    p = QL_UDOT(with_fifth_bit(nibbles16(blk + 6), blk + 2));
                } else {
                    p = dot_us8(with_fifth_bit(nibbles16(blk + 8), blk + 4), qx);
                    ms[c] = ms[c] + half_to_float(blk + 2) * xb->s;
                }
                acc[c] = _mm256_fmadd_ps(sc, p, acc[c]);
            }
        }
#undef QL_UDOT
        for (int c = 0; c < RN; c++) {
            float v = fo_tree8_v(acc[c]);
            y[c] = t == GGML_Q5_1 ? v + ms[c] : v;
        }
        return;
    }
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    for (int64_t s = 0; s < nb / 8; s++) {
        const xblock *xs = xq + s * 8;
        if (t == GGML_Q6_K) {
            const __m256i three = _mm256_set1_epi8(3), m32 = _mm256_set1_epi8(32);
            for (int h = 0; h < 2; h++) {
                for (int c = 0; c < RN; c++) {
                    const uint8_t *blk = w + c * row_bytes + s * 210;
                    const int8_t *sc = (const int8_t *)(blk + 192);
                    float d = half_to_float(blk + 208);
                    __m256i l0 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h));
                    __m256i l1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32));
                    __m256i hh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
                    __m256i q[4];
                    q[0] = _mm256_or_si256(_mm256_and_si256(l0, low4),
                                           _mm256_slli_epi16(_mm256_and_si256(hh, three), 4));
                    q[1] = _mm256_or_si256(_mm256_and_si256(l1, low4),
                                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hh, 2), three), 4));
                    q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low4),
                                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hh, 4), three), 4));
                    q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low4),
                                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hh, 6), three), 4));
                    for (int k = 0; k < 4; k++) {
                        const xblock *xb = xs + 4 * h + k;
                        float lo = d * (float)sc[8 * h + 2 * k], hi = d * (float)sc[8 * h + 2 * k + 1];
                        __m256 scv = _mm256_setr_m128(_mm_set1_ps(lo * xb->d), _mm_set1_ps(hi * xb->d));
                        __m256i qx = _mm256_loadu_si256((const __m256i *)xb->q);
                        __m256 p = dot_signed(_mm256_sub_epi8(q[k], m32), qx);
                        acc[c] = _mm256_fmadd_ps(scv, p, acc[c]);
                    }
                }
            }
            continue;
        }
        const int five = t == GGML_Q5_K;
        const __m256i one = _mm256_set1_epi8(1);
        for (int c = 0; c < RN; c++) {
            const uint8_t *blk = w + c * row_bytes + s * (five ? 176 : 144), *scales = blk + 4;
            const uint8_t *qs = blk + (five ? 48 : 16);
            float d = half_to_float(blk), dmin = half_to_float(blk + 2);
            __m256i qh = five ? _mm256_loadu_si256((const __m256i *)(blk + 16)) : _mm256_setzero_si256();
            for (int j = 0; j < 4; j++) {
                int sc0, m0, sc1, m1;
                scale_min_k4(2 * j, scales, &sc0, &m0);
                scale_min_k4(2 * j + 1, scales, &sc1, &m1);
                __m256i n = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
                __m256i a = _mm256_and_si256(n, low4), cc = _mm256_and_si256(_mm256_srli_epi16(n, 4), low4);
                if (five) {
                    a = _mm256_or_si256(a, _mm256_slli_epi16(
                        _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * j)), one), 4));
                    cc = _mm256_or_si256(cc, _mm256_slli_epi16(
                        _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * j + 1)), one), 4));
                }
                const xblock *x0 = xs + 2 * j, *x1 = xs + 2 * j + 1;
                float d0 = d * (float)sc0, d1 = d * (float)sc1;
                acc[c] = _mm256_fmadd_ps(_mm256_set1_ps(d0 * x0->d),
                                         dot_us8(a, _mm256_loadu_si256((const __m256i *)x0->q)), acc[c]);
                ms[c] = ms[c] + -(dmin * (float)m0) * x0->s;
                acc[c] = _mm256_fmadd_ps(_mm256_set1_ps(d1 * x1->d),
                                         dot_us8(cc, _mm256_loadu_si256((const __m256i *)x1->q)), acc[c]);
                ms[c] = ms[c] + -(dmin * (float)m1) * x1->s;
            }
        }
    }
    for (int c = 0; c < RN; c++) {
        float v = fo_tree8_v(acc[c]);
        y[c] = t == GGML_Q6_K ? v : v + ms[c];
    }
}

/* One function per row count and type, so each is compiled with its branches gone. */
#define DEF_ROWG(T, RN)                                                                       \
    static void rowg_##T##_##RN(const uint8_t *w, int64_t rb, const xblock *xq, int64_t nb,  \
                                float *y) {                                                   \
        row_generic_n(GGML_##T, w, rb, xq, nb, y, RN);                                        \
    }
#define DEF_ROWG_ALL(T) DEF_ROWG(T, 1) DEF_ROWG(T, 2) DEF_ROWG(T, 4)
DEF_ROWG_ALL(Q4_0) DEF_ROWG_ALL(Q5_0) DEF_ROWG_ALL(Q5_1)
DEF_ROWG_ALL(Q4_K) DEF_ROWG_ALL(Q5_K) DEF_ROWG_ALL(Q6_K)

#ifndef RG_LEGACY
#define RG_LEGACY 4
#endif
#ifndef RG_K
#define RG_K 4
#endif
/* Weight rows a decode tile takes: four, each x block's lanes and sums shared by them
 * (legacy types at one row: Q5_0 1.13x, Q4_0 1.2x the time, 2026-12-05, Zen 2). */
#define RG(t) ((t) >= GGML_Q4_K ? RG_K : RG_LEGACY)

/* rn (1, 2 or 4) weight rows against one row of x. */
static void row_generic(int32_t t, const uint8_t *w, int64_t rb, const xblock *xq, int64_t nb,
                        float *y, int rn) {
#define CASE_ROWG(T)                                                                          \
    case GGML_##T:                                                                            \
        if (rn == 4) rowg_##T##_4(w, rb, xq, nb, y);                                          \
        else if (rn == 2) rowg_##T##_2(w, rb, xq, nb, y);                                     \
        else rowg_##T##_1(w, rb, xq, nb, y);                                                  \
        return;
    switch (t) {
        CASE_ROWG(Q4_0) CASE_ROWG(Q5_0) CASE_ROWG(Q5_1)
        CASE_ROWG(Q4_K) CASE_ROWG(Q5_K) CASE_ROWG(Q6_K)
    default: return;
    }
#undef CASE_ROWG
}
#endif


#ifdef QL_AVX2
/* Eight or four rows of x against one unpacked weight row of a type with one scale per
 * block (all but Q6_K): the scale products for four rows from one multiply by the rows'
 * d values (dx: groups of four rows, [group][b][4]), the offset term likewise from sx,
 * and unsigned weights (Q5_1, Q4_K, Q5_K) without the sign trick. The same products,
 * FMAs and sums as gen_RM (the function of the header), fewer instructions. */
#define DEF_GEN_U(RM, NAME, SIGNED, OFFSET)                                                   \
    static void genu_##NAME##_##RM(const unpacked *u, const xblock *xq, const float *dx,      \
                                   const float *sx, int64_t nb, float *y, int64_t ldy) {      \
        __m256 acc[RM];                                                                       \
        __m128 ms[RM / 4];                                                                    \
        _Pragma("GCC unroll 8") for (int r = 0; r < RM; r++) acc[r] = _mm256_setzero_ps();    \
        _Pragma("GCC unroll 2") for (int g = 0; g < RM / 4; g++) ms[g] = _mm_setzero_ps();    \
        for (int64_t b = 0; b < nb; b++) {                                                    \
            __m256i qw = _mm256_loadu_si256((const __m256i *)(u->q + b * QK));                \
            __m256i aw = SIGNED ? ql_wbias(qw) : qw;                                          \
            __m128 dv = _mm_set1_ps(u->lo[b]);                                                \
            float sc[RM];                                                                     \
            _Pragma("GCC unroll 2") for (int g = 0; g < RM / 4; g++) {                        \
                _mm_storeu_ps(sc + 4 * g, _mm_mul_ps(dv, _mm_loadu_ps(dx + (g * nb + b) * 4))); \
                if (OFFSET)                                                                   \
                    ms[g] = _mm_add_ps(ms[g], _mm_mul_ps(_mm_set1_ps(u->mo[b]),               \
                                                         _mm_loadu_ps(sx + (g * nb + b) * 4))); \
            }                                                                                 \
            _Pragma("GCC unroll 8") for (int r = 0; r < RM; r++) {                            \
                const xblock *xb = xq + r * nb + b;                                           \
                __m256i qx = _mm256_loadu_si256((const __m256i *)xb->q);                      \
                __m256 p = SIGNED ? ql_dot_s(aw, qw, qx) : dot_us8(aw, qx);                   \
                acc[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(sc + r), p, acc[r]);             \
            }                                                                                 \
        }                                                                                     \
        float m[RM];                                                                          \
        _Pragma("GCC unroll 2") for (int g = 0; g < RM / 4; g++) _mm_storeu_ps(m + 4 * g, ms[g]); \
        _Pragma("GCC unroll 8") for (int r = 0; r < RM; r++) {                                \
            float v = fo_tree8_v(acc[r]);                                                     \
            y[r * ldy] = OFFSET ? v + m[r] : v;                                               \
        }                                                                                     \
    }
DEF_GEN_U(8, s, 1, 0) DEF_GEN_U(4, s, 1, 0) DEF_GEN_U(8, u, 0, 1) DEF_GEN_U(4, u, 0, 1)
#endif

/* rows rows of x against one unpacked weight row: eight at a time, then 4, 2, 1. */
static void gen_rows(int32_t t, const unpacked *u, int offset, const xblock *xq, const float *dx,
                     const float *sx, int64_t nb, int32_t rows, float *y, int64_t ldy) {
    int32_t r = 0;
#ifdef QL_AVX2
    /* dx, sx: the groups of four rows starting at xq's first row (a multiple of four) */
    if (t != GGML_Q6_K) {
        const int uns = offset; /* the types with an offset are the unsigned ones */
        for (; r + 8 <= rows; r += 8) {
            const float *d8 = dx + (int64_t)(r / 4) * nb * 4, *s8 = sx + (int64_t)(r / 4) * nb * 4;
            if (uns) genu_u_8(u, xq + (int64_t)r * nb, d8, s8, nb, y + r * ldy, ldy);
            else genu_s_8(u, xq + (int64_t)r * nb, d8, s8, nb, y + r * ldy, ldy);
        }
        if (r + 4 <= rows) {
            const float *d4 = dx + (int64_t)(r / 4) * nb * 4, *s4 = sx + (int64_t)(r / 4) * nb * 4;
            if (uns) genu_u_4(u, xq + (int64_t)r * nb, d4, s4, nb, y + r * ldy, ldy);
            else genu_s_4(u, xq + (int64_t)r * nb, d4, s4, nb, y + r * ldy, ldy);
            r += 4;
        }
    }
#else
    (void)t, (void)dx, (void)sx;
#endif
    for (; r + 8 <= rows; r += 8) gen_8(u, offset, xq + (int64_t)r * nb, nb, y + r * ldy, ldy);
    if (r + 4 <= rows) gen_4(u, offset, xq + (int64_t)r * nb, nb, y + r * ldy, ldy), r += 4;
    if (r + 2 <= rows) gen_2(u, offset, xq + (int64_t)r * nb, nb, y + r * ldy, ldy), r += 2;
    if (r < rows) gen_1(u, offset, xq + (int64_t)r * nb, nb, y + r * ldy, ldy);
}

#ifdef QL_VNNI
/* Two unpacked weight rows against RM rows of x (VNNI builds): each x block loaded once
 * for both weight rows, halving what a tile reads of x, which from L2 is what bounds the
 * one-row tiles above at 32+ rows (2026-12-06, Xeon with AVX512-VNNI). Signed types'
 * weights are stored + 128 and meet x with the accumulator seeded by ql_negoff(x, 128);
 * unsigned ones (the types with an offset) meet x directly. The scale products are
 * dw * d_x as in genu (one scale) or gen (TWO: Q6_K's lo and hi halves), the offset
 * term as in genu: the same function, other instructions. */
#if defined(__AVX512VL__)
#define GENV_RM 8 /* 32 vector registers: 16 accumulators */
#else
#define GENV_RM 4 /* AVX-VNNI alone: 16 registers */
#endif
#define DEF_GENV(RM, NAME, SIGNED, OFFSET, TWO)                                               \
    static void genv_##NAME##_##RM(const unpacked *u, const xblock *xq, const float *dx,      \
                                   const float *sx, int64_t nb, float *y, int64_t ldy) {      \
        __m256 acc[RM][2];                                                                    \
        __m128 ms[2][RM / 4];                                                                 \
        _Pragma("GCC unroll 8") for (int r = 0; r < RM; r++)                                  \
            acc[r][0] = acc[r][1] = _mm256_setzero_ps();                                      \
        _Pragma("GCC unroll 2") for (int g = 0; g < RM / 4; g++)                              \
            ms[0][g] = ms[1][g] = _mm_setzero_ps();                                           \
        for (int64_t b = 0; b < nb; b++) {                                                    \
            __m256i w[2];                                                                     \
            __m256 dwv[2];                                                                    \
            float s[2][RM];                                                                   \
            _Pragma("GCC unroll 2") for (int c = 0; c < 2; c++) {                             \
                __m256i q = _mm256_loadu_si256((const __m256i *)(u[c].q + b * QK));           \
                w[c] = SIGNED ? _mm256_xor_si256(q, _mm256_set1_epi8((char)0x80)) : q;       \
                if (TWO)                                                                      \
                    dwv[c] = _mm256_setr_m128(_mm_set1_ps(u[c].lo[b]), _mm_set1_ps(u[c].hi[b])); \
                else                                                                          \
                    _Pragma("GCC unroll 2") for (int g = 0; g < RM / 4; g++)                  \
                        _mm_storeu_ps(s[c] + 4 * g, _mm_mul_ps(_mm_set1_ps(u[c].lo[b]),       \
                                                               _mm_loadu_ps(dx + (g * nb + b) * 4))); \
                if (OFFSET)                                                                   \
                    _Pragma("GCC unroll 2") for (int g = 0; g < RM / 4; g++)                  \
                        ms[c][g] = _mm_add_ps(ms[c][g], _mm_mul_ps(_mm_set1_ps(u[c].mo[b]),   \
                                                                   _mm_loadu_ps(sx + (g * nb + b) * 4))); \
            }                                                                                 \
            _Pragma("GCC unroll 8") for (int r = 0; r < RM; r++) {                            \
                __m256i qx = _mm256_loadu_si256((const __m256i *)xq[r * nb + b].q);           \
                __m256i seed = SIGNED ? ql_negoff(qx, (char)0x80) : _mm256_setzero_si256();   \
                _Pragma("GCC unroll 2") for (int c = 0; c < 2; c++) {                         \
                    __m256 p = _mm256_cvtepi32_ps(QL_DPBUSD(seed, w[c], qx));                \
                    __m256 sc = TWO ? _mm256_mul_ps(dwv[c], _mm256_set1_ps(dx[((r / 4) * nb + b) * 4 + r % 4])) \
                                    : _mm256_broadcast_ss(s[c] + r);                          \
                    acc[r][c] = _mm256_fmadd_ps(sc, p, acc[r][c]);                            \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
        _Pragma("GCC unroll 2") for (int c = 0; c < 2; c++) {                                 \
            float m[RM];                                                                      \
            if (OFFSET)                                                                       \
                _Pragma("GCC unroll 2") for (int g = 0; g < RM / 4; g++) _mm_storeu_ps(m + 4 * g, ms[c][g]); \
            _Pragma("GCC unroll 8") for (int r = 0; r < RM; r++) {                            \
                float v = fo_tree8_v(acc[r][c]);                                              \
                y[r * ldy + c] = OFFSET ? v + m[r] : v;                                       \
            }                                                                                 \
        }                                                                                     \
    }
DEF_GENV(4, s, 1, 0, 0) DEF_GENV(4, u, 0, 1, 0) DEF_GENV(4, six, 1, 0, 1)
#if GENV_RM == 8
DEF_GENV(8, s, 1, 0, 0) DEF_GENV(8, u, 0, 1, 0) DEF_GENV(8, six, 1, 0, 1)
#endif
#define GENV_CALL(NAME, RM) genv_##NAME##_##RM
#define GENV(NAME, RM) GENV_CALL(NAME, RM)

/* rows rows of x against two unpacked weight rows u[0], u[1] (outputs y[., 0..1]):
 * GENV_RM rows at a time, then four, then each weight row alone for the rest. */
static void gen_rows2(int32_t t, const unpacked *u, int offset, const xblock *xq, const float *dx,
                      const float *sx, int64_t nb, int32_t rows, float *y, int64_t ldy) {
    int32_t r = 0;
    const int kind = t == GGML_Q6_K ? 2 : offset ? 1 : 0;
    for (; r + GENV_RM <= rows; r += GENV_RM) {
        const float *d = dx + (int64_t)(r / 4) * nb * 4, *s = sx + (int64_t)(r / 4) * nb * 4;
        const xblock *x = xq + (int64_t)r * nb;
        if (kind == 2) GENV(six, GENV_RM)(u, x, d, s, nb, y + r * ldy, ldy);
        else if (kind == 1) GENV(u, GENV_RM)(u, x, d, s, nb, y + r * ldy, ldy);
        else GENV(s, GENV_RM)(u, x, d, s, nb, y + r * ldy, ldy);
    }
#if GENV_RM == 8
    if (r + 4 <= rows) {
        const float *d = dx + (int64_t)(r / 4) * nb * 4, *s = sx + (int64_t)(r / 4) * nb * 4;
        const xblock *x = xq + (int64_t)r * nb;
        if (kind == 2) genv_six_4(u, x, d, s, nb, y + r * ldy, ldy);
        else if (kind == 1) genv_u_4(u, x, d, s, nb, y + r * ldy, ldy);
        else genv_s_4(u, x, d, s, nb, y + r * ldy, ldy);
        r += 4;
    }
#endif
    if (r < rows)
        for (int c = 0; c < 2; c++)
            gen_rows(t, u + c, offset, xq + (int64_t)r * nb, dx + (int64_t)(r / 4) * nb * 4,
                     sx + (int64_t)(r / 4) * nb * 4, nb, rows - r, y + (int64_t)r * ldy + c, ldy);
}
#endif

#if defined(QL_VNNI) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
/* 512-bit tiles (AVX512-VNNI builds): a vector holds the same 8 lanes of two weight rows'
 * outputs for one row of x, so each dot product, conversion and FMA instruction does two
 * outputs' work (this Xeon issues a 512-bit one about as often as a 256-bit one:
 * 0.45 against 0.63 ns a block in a bare loop, 2026-12-06). x goes in biased (q + 128,
 * unsigned; xu), the weights as they are (signed bytes: every unpacked type fits), and
 * each lane's accumulator starts at -128 times the weight lane's sum, so the int32 lanes
 * are sum(w q) exactly; the scale is dw * d_x per lane half (lo for lanes 0-3, hi 4-7),
 * the offset term as in genv. The same function again. */
#define QL_Z 1
typedef struct {
    uint8_t *q;    /* [nb][64]: the two rows' blocks side by side */
    int32_t *seed; /* [nb][16]: -128 * each weight lane's sum */
    float *dw;     /* [nb][16]: lo x4, hi x4 of row 0, then of row 1 */
} zpair;

static void pair_rows(const unpacked *u, int64_t nb, const zpair *z) {
    for (int64_t b = 0; b < nb; b++)
        for (int c = 0; c < 2; c++) {
            __m256i q = _mm256_loadu_si256((const __m256i *)(u[c].q + b * QK));
            _mm256_storeu_si256((__m256i *)(z->q + b * 64 + c * 32), q);
            _mm256_storeu_si256((__m256i *)(z->seed + b * 16 + c * 8), ql_negoff(q, (char)0x80));
            _mm256_storeu_ps(z->dw + b * 16 + c * 8,
                             _mm256_setr_m128(_mm_set1_ps(u[c].lo[b]), _mm_set1_ps(u[c].hi[b])));
        }
}

#define DEF_GENZ(RM, OFFSET)                                                                  \
    static void genz_##RM##_##OFFSET(const zpair *z, const unpacked *u, const uint8_t *xu,    \
                                     const float *dx, const float *sx, int64_t nb, float *y,  \
                                     int64_t ldy) {                                           \
        __m512 acc[RM];                                                                       \
        __m128 ms[2][RM / 4];                                                                 \
        _Pragma("GCC unroll 16") for (int r = 0; r < RM; r++) acc[r] = _mm512_setzero_ps();   \
        _Pragma("GCC unroll 4") for (int g = 0; g < RM / 4; g++)                              \
            ms[0][g] = ms[1][g] = _mm_setzero_ps();                                           \
        for (int64_t b = 0; b < nb; b++) {                                                    \
            const __m512i w = _mm512_loadu_si512(z->q + b * 64);                              \
            const __m512i seed = _mm512_loadu_si512(z->seed + b * 16);                        \
            const __m512 dw = _mm512_loadu_ps(z->dw + b * 16);                                \
            if (OFFSET)                                                                       \
                _Pragma("GCC unroll 2") for (int c = 0; c < 2; c++)                           \
                _Pragma("GCC unroll 4") for (int g = 0; g < RM / 4; g++)                      \
                    ms[c][g] = _mm_add_ps(ms[c][g], _mm_mul_ps(_mm_set1_ps(u[c].mo[b]),       \
                                                               _mm_loadu_ps(sx + (g * nb + b) * 4))); \
            _Pragma("GCC unroll 16") for (int r = 0; r < RM; r++) {                           \
                __m512i x = _mm512_broadcast_i64x4(                                           \
                    _mm256_loadu_si256((const __m256i *)(xu + (r * nb + b) * QK)));          \
                __m512 p = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(seed, x, w));               \
                __m512 sc = _mm512_mul_ps(dw, _mm512_set1_ps(dx[((r / 4) * nb + b) * 4 + r % 4])); \
                acc[r] = _mm512_fmadd_ps(sc, p, acc[r]);                                      \
            }                                                                                 \
        }                                                                                     \
        float m[2][RM];                                                                       \
        if (OFFSET)                                                                           \
            _Pragma("GCC unroll 2") for (int c = 0; c < 2; c++)                               \
            _Pragma("GCC unroll 4") for (int g = 0; g < RM / 4; g++)                          \
                _mm_storeu_ps(m[c] + 4 * g, ms[c][g]);                                        \
        _Pragma("GCC unroll 16") for (int r = 0; r < RM; r++) {                               \
            __m256 lo = _mm512_castps512_ps256(acc[r]);                                       \
            __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r]), 1)); \
            float v0 = fo_tree8_v(lo), v1 = fo_tree8_v(hi);                                   \
            y[r * ldy] = OFFSET ? v0 + m[0][r] : v0;                                          \
            y[r * ldy + 1] = OFFSET ? v1 + m[1][r] : v1;                                      \
        }                                                                                     \
    }
DEF_GENZ(16, 0) DEF_GENZ(16, 1) DEF_GENZ(8, 0) DEF_GENZ(8, 1) DEF_GENZ(4, 0) DEF_GENZ(4, 1)

/* gen_rows2 through the 512-bit tiles: 16, 8 or 4 rows at a time, the rest (under four)
 * each weight row alone. */
static void gen_rows2z(int32_t t, const unpacked *u, const zpair *z, int offset, const xblock *xq,
                       const uint8_t *xu, const float *dx, const float *sx, int64_t nb,
                       int32_t rows, float *y, int64_t ldy) {
    pair_rows(u, nb, z);
    int32_t r = 0;
#define GZ(RM)                                                                                \
    for (; r + RM <= rows; r += RM) {                                                         \
        const float *d = dx + (int64_t)(r / 4) * nb * 4, *s = sx + (int64_t)(r / 4) * nb * 4; \
        const uint8_t *x = xu + (int64_t)r * nb * QK;                                         \
        if (offset) genz_##RM##_1(z, u, x, d, s, nb, y + r * ldy, ldy);                       \
        else genz_##RM##_0(z, u, x, d, s, nb, y + r * ldy, ldy);                              \
    }
    GZ(16) GZ(8) GZ(4)
#undef GZ
    if (r < rows)
        for (int c = 0; c < 2; c++)
            gen_rows(t, u + c, offset, xq + (int64_t)r * nb, dx + (int64_t)(r / 4) * nb * 4,
                     sx + (int64_t)(r / 4) * nb * 4, nb, rows - r, y + (int64_t)r * ldy + c, ldy);
}
#endif

/* How far ahead of the rows it is reading each thread asks for the weights. The
 * hardware prefetcher follows one matrix streamed alone, but not a decode step, which
 * reads four matrices a layer for ~40-160 us each (all four at one row took 10.5 ms a
 * step without this and 3.0-3.2 ms with it, 2026-12-04). */
#ifndef PF_BYTES
#define PF_BYTES 4096
#endif

/* One weight matrix's part of a call: n rows of w (GGML type qtype) into columns of y
 * (ldy apart), for the rows of x already quantized. Called inside the parallel region by
 * every thread (its loops are the region's worksharing). u: this thread's unpack
 * buffers (NULL when they could not be had: the generic types then leave *failed set). */
static void run_part(const uint8_t *w, int32_t qtype, int64_t n, float *y, int64_t ldy,
                     const xblock *xq, const uint8_t *xu, const float *dx, const float *sx,
                     int32_t m, int64_t k, const unpacked *u) {
    (void)xu;
    int64_t nb = k / QK, row_bytes = k / block_elems(qtype) * block_bytes(qtype);
    int paired = 0; /* Q8_0 / Q4_1 through the 512-bit tiles too, at four rows and more */
#ifdef QL_Z
    paired = m >= 4 && xu && u;
#endif
    if (generic_type(qtype) || paired) {
        const int offset = has_offset(qtype) || qtype == GGML_Q4_1;
#ifdef QL_AVX2
        if (m == 1) { /* decode: RG weight rows at a time, unpacked in registers */
            const int rg = RG(qtype);
            int64_t tiles = (n + rg - 1) / rg;
#pragma omp for schedule(static)
            for (int64_t tt = 0; tt < tiles; tt++) {
                int64_t j = tt * rg;
                int cols = n - j < rg ? (int)(n - j) : rg;
                const uint8_t *wr = w + j * row_bytes;
                if ((j + cols) * row_bytes + PF_BYTES <= n * row_bytes)
                    for (int64_t o = 0; o < cols * row_bytes; o += 64)
                        _mm_prefetch((const char *)(wr + PF_BYTES + o), _MM_HINT_T0);
                if (cols == rg) row_generic(qtype, wr, row_bytes, xq, nb, y + j, rg);
                else
                    for (int c = 0; c < cols; c++)
                        row_generic(qtype, wr + c * row_bytes, row_bytes, xq, nb, y + j + c, 1);
            }
            return;
        }
#endif
        for (int32_t r0 = 0; r0 < m; r0 += XCHUNK) {
            int32_t rows = m - r0 < XCHUNK ? m - r0 : XCHUNK;
#ifdef QL_VNNI
            if (rows >= 4) { /* two weight rows at a time (gen_rows2) */
#ifdef QL_Z
                zpair z = {malloc((size_t)(nb * 64)), malloc(sizeof(int32_t) * (size_t)(nb * 16)),
                           malloc(sizeof(float) * (size_t)(nb * 16))};
                const int zok = z.q && z.seed && z.dw && xu;
#endif
#pragma omp for schedule(static)
                for (int64_t jp = 0; jp < (n + 1) / 2; jp++) {
                    if (!u) continue;
                    int64_t j = jp * 2;
                    int cols = n - j < 2 ? 1 : 2;
                    const float *d = dx + (int64_t)(r0 / 4) * nb * 4, *s = sx + (int64_t)(r0 / 4) * nb * 4;
                    for (int c = 0; c < cols; c++) unpack_row(qtype, w + (j + c) * row_bytes, nb, u + c);
#ifdef QL_Z
                    if (cols == 2 && zok)
                        gen_rows2z(qtype, u, &z, offset, xq + (int64_t)r0 * nb,
                                   xu + (int64_t)r0 * nb * QK, d, s, nb, rows,
                                   y + (int64_t)r0 * ldy + j, ldy);
                    else
#endif
                    if (cols == 2)
                        gen_rows2(qtype, u, offset, xq + (int64_t)r0 * nb, d, s, nb, rows,
                                  y + (int64_t)r0 * ldy + j, ldy);
                    else
                        gen_rows(qtype, u, offset, xq + (int64_t)r0 * nb, d, s, nb, rows,
                                 y + (int64_t)r0 * ldy + j, ldy);
                }
#ifdef QL_Z
                free(z.q);
                free(z.seed);
                free(z.dw);
#endif
                continue;
            }
#endif
#pragma omp for schedule(static)
            for (int64_t j = 0; j < n; j++) {
                if (!u) continue;
                const uint8_t *wr = w + j * row_bytes;
#ifdef QL_AVX2
                if (rows < 4 && (j + 1) * row_bytes + PF_BYTES <= n * row_bytes)
                    for (int64_t o = 0; o < row_bytes; o += 64)
                        _mm_prefetch((const char *)(wr + PF_BYTES + o), _MM_HINT_T0);
#endif
                unpack_row(qtype, wr, nb, u);
                gen_rows(qtype, u, offset, xq + (int64_t)r0 * nb, dx + (int64_t)(r0 / 4) * nb * 4,
                         sx + (int64_t)(r0 / 4) * nb * 4, nb, rows, y + (int64_t)r0 * ldy + j, ldy);
            }
        }
        return;
    }
    for (int32_t r0 = 0; r0 < m; r0 += XCHUNK) {
        int32_t rows = m - r0 < XCHUNK ? m - r0 : XCHUNK;
        /* one Q8_0 weight row at a time for one row of x (the LM head at decode):
         * one stream of weights a thread streams faster than two interleaved */
        const int tn = rows == 1 && qtype == GGML_Q8_0 ? 1 : TILE_N;
        int64_t tiles = (n + tn - 1) / tn;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            int64_t j = t * tn;
            int cols = n - j < tn ? (int)(n - j) : tn;
            const uint8_t *wr = w + j * row_bytes;
#ifdef QL_AVX2
            if (rows < 4 && (j + cols) * row_bytes + PF_BYTES <= n * row_bytes)
                for (int64_t o = 0; o < cols * row_bytes; o += 64)
                    _mm_prefetch((const char *)(wr + PF_BYTES + o), _MM_HINT_T0);
#endif
            int32_t r = r0;
#ifdef QL_AVX2
            for (; r + 8 <= r0 + rows; r += 8)
                for (int jj = 0; jj < cols; jj++) {
                    const float *d8 = dx + (int64_t)(r / 4) * nb * 4;
                    float *y8 = y + (int64_t)r * ldy + j + jj;
                    if (qtype == GGML_Q4_1)
                        tall_q4_1(wr + jj * row_bytes, xq + (int64_t)r * nb, d8,
                                  sx + (int64_t)(r / 4) * nb * 4, nb, y8, ldy);
                    else
                        tall_q8_0(wr + jj * row_bytes, xq + (int64_t)r * nb, d8, nb, y8, ldy);
                }
#endif
            for (; r < r0 + rows; r += 4) {
                int rm = r0 + rows - r < 4 ? r0 + rows - r : 4;
                tile(qtype, wr, row_bytes, xq + (int64_t)r * nb, dx + (int64_t)(r / 4) * nb * 4,
                     sx + (int64_t)(r / 4) * nb * 4, nb, rm, cols, y + (int64_t)r * ldy + j, ldy);
            }
        }
    }
}

#ifdef QL_VNNI
#define UNPACK_ROWS 2
#else
#define UNPACK_ROWS 1
#endif

/* A weight stored in parts of different types, one after the other in the output's
 * columns (a fused q/k/v whose v the file stores in another type than q and k):
 * q_linear's qtype QL_PARTS and w pointing at this. */
enum { QL_PARTS = -1, QL_MAX_PARTS = 4 };
typedef struct {
    int32_t n;
    int32_t qtype[QL_MAX_PARTS];
    int64_t rows[QL_MAX_PARTS];
    const uint8_t *w[QL_MAX_PARTS];
} q_parts;

/* Returns 0, -1 when scratch memory cannot be allocated, -2 for a type or shape this
 * kernel does not take. qtype QL_PARTS: w is a q_parts whose rows add up to n. */
int q_linear(const float *x, const uint8_t *w, float *y, int32_t qtype, int32_t m, int64_t n,
             int64_t k, int32_t threads) {
    if (threads < 1) threads = 1;
    q_parts one = {1, {qtype}, {n}, {w}};
    const q_parts *parts = qtype == QL_PARTS ? (const q_parts *)(const void *)w : &one;
    if (parts->n < 1 || parts->n > QL_MAX_PARTS || m < 0 || k % QK) return -2;
    int64_t total = 0;
    int any_generic = 0;
    for (int i = 0; i < parts->n; i++) {
        int32_t t = parts->qtype[i];
        if (!block_bytes(t) || k % block_elems(t) || parts->rows[i] < 0) return -2;
        total += parts->rows[i];
        any_generic |= generic_type(t);
    }
    if (total != n) return -2;
    if (m == 0 || n == 0) return 0;
    int64_t nb = k / QK;
    int failed = 0;
    int64_t groups = (m + 3) / 4;
    xblock *xq = malloc(sizeof(xblock) * (size_t)(nb * m));
    /* each group of four rows' d and s values, [group][b][4] */
    float *dx = calloc((size_t)(groups * nb * 4), sizeof(float));
    float *sx = calloc((size_t)(groups * nb * 4), sizeof(float));
    if (!xq || !dx || !sx) {
        free(xq);
        free(dx);
        free(sx);
        return -1;
    }
    /* x's bytes plus 128 for the 512-bit tiles (NULL: those tiles are not used) */
    uint8_t *xu = NULL;
#ifdef QL_Z
    if (m >= 4) xu = malloc((size_t)(m * nb * QK));
    any_generic = any_generic || m >= 4; /* the unpack buffers serve the 512-bit tiles */
#endif
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int32_t r = 0; r < m; r++) {
            quantize_row(x + (int64_t)r * k, nb, xq + (int64_t)r * nb);
            for (int64_t b = 0; b < nb; b++) {
                dx[((r / 4) * nb + b) * 4 + r % 4] = xq[(int64_t)r * nb + b].d;
                sx[((r / 4) * nb + b) * 4 + r % 4] = xq[(int64_t)r * nb + b].s;
#ifdef QL_Z
                if (xu)
                    _mm256_storeu_si256(
                        (__m256i *)(xu + ((int64_t)r * nb + b) * QK),
                        _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)xq[(int64_t)r * nb + b].q),
                                         _mm256_set1_epi8((char)0x80)));
#endif
            }
        }
        /* each thread unpacks one weight row at a time (two with VNNI) into its own
         * buffers */
        unpacked buf[UNPACK_ROWS] = {{0}}, *u = NULL;
        if (any_generic) {
            int ok = 1;
            for (int i = 0; i < UNPACK_ROWS; i++) {
                buf[i] = (unpacked){malloc((size_t)(nb * QK)), malloc(sizeof(float) * (size_t)nb),
                                    malloc(sizeof(float) * (size_t)nb), malloc(sizeof(float) * (size_t)nb)};
                ok = ok && buf[i].q && buf[i].lo && buf[i].hi && buf[i].mo;
            }
            if (ok) {
                u = buf;
            } else {
#pragma omp atomic write
                failed = 1;
            }
        }
        int64_t col = 0;
        for (int i = 0; i < parts->n; i++) {
            run_part(parts->w[i], parts->qtype[i], parts->rows[i], y + col, n, xq, xu, dx, sx, m,
                     k, u);
            col += parts->rows[i];
        }
        for (int i = 0; i < UNPACK_ROWS; i++) {
            free(buf[i].q);
            free(buf[i].lo);
            free(buf[i].hi);
            free(buf[i].mo);
        }
    }
    free(xq);
    free(xu);
    free(dx);
    free(sx);
    return failed ? -1 : 0;
}

/* w's blocks as fp32, [N, K]: what the kernel multiplies by, for tests to compare with
 * gguf.quants' dequantization exactly. */
int q_dequantize(const uint8_t *w, float *out, int32_t qtype, int64_t n, int64_t k) {
    if (!block_bytes(qtype) || k % block_elems(qtype)) return -2;
    int64_t nb = k / QK;
    if (!generic_type(qtype)) {
        dequant_rows(w, out, qtype, n, nb);
        return 0;
    }
    int64_t row_bytes = k / block_elems(qtype) * block_bytes(qtype);
    unpacked u = {malloc((size_t)(nb * QK)), malloc(sizeof(float) * (size_t)nb),
                  malloc(sizeof(float) * (size_t)nb), malloc(sizeof(float) * (size_t)nb)};
    int rc = u.q && u.lo && u.hi && u.mo ? 0 : -1;
    for (int64_t j = 0; j < n && rc == 0; j++) {
        unpack_row(qtype, w + j * row_bytes, nb, &u);
        for (int64_t b = 0; b < nb; b++)
            for (int i = 0; i < QK; i++) /* dw * wq is exact: one rounding with the offset */
                out[j * k + b * QK + i] =
                    fmaf(i < 16 ? u.lo[b] : u.hi[b], (float)u.q[b * QK + i], u.mo[b]);
    }
    free(u.q);
    free(u.lo);
    free(u.hi);
    free(u.mo);
    return rc;
}
