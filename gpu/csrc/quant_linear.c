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
 * time (one for Q8_0: the LM head). Rows of x go in chunks of XCHUNK so a chunk's
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
#endif

enum { QK = 32, GGML_Q4_1 = 3, GGML_Q8_0 = 8, XCHUNK = 96, TILE_N = 2 };

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
    __m256i p16 = _mm256_maddubs_epi16(a, b);
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
}

static inline __m256i nibbles_q4_1(const uint8_t *blk) {
    __m128i raw = _mm_loadu_si128((const __m128i *)(blk + 4));
    /* low nibbles are elements 0..15, high nibbles 16..31 */
    return _mm256_and_si256(
        _mm256_insertf128_si256(_mm256_castsi128_si256(raw), _mm_srli_epi16(raw, 4), 1),
        _mm256_set1_epi8(0x0f));
}

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
                __m256i aw = _mm256_sign_epi8(qw, qw);                                        \
                float s[4];                                                                   \
                _mm_storeu_ps(s, _mm_mul_ps(_mm_set1_ps(half_to_float(blk)), dx4));          \
                _Pragma("GCC unroll 4") for (int r = 0; r < RM; r++) {                        \
                    __m256i qx = _mm256_loadu_si256((const __m256i *)xq[r * nb + b].q);       \
                    __m256 p = dot_us8(aw, _mm256_sign_epi8(qx, qw));                         \
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
                __m256 p = dot_us8(_mm256_sign_epi8(qw, qw), _mm256_sign_epi8(qx, qw));       \
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
        __m256i aw = _mm256_sign_epi8(qw, qw);
        __m128 dv = _mm_set1_ps(half_to_float(blk));
        float s[8];
        _mm_storeu_ps(s, _mm_mul_ps(dv, _mm_loadu_ps(dx + b * 4)));
        _mm_storeu_ps(s + 4, _mm_mul_ps(dv, _mm_loadu_ps(dx2 + b * 4)));
#define T(r, a) a = _mm256_fmadd_ps(_mm256_broadcast_ss(s + r),                              \
                                    dot_us8(aw, _mm256_sign_epi8(_mm256_loadu_si256(         \
                                                    (const __m256i *)xq[r * nb + b].q), qw)), a);
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

/* How far ahead of the rows it is reading each thread asks for the weights. The
 * hardware prefetcher follows one matrix streamed alone, but not a decode step, which
 * reads four matrices a layer for ~40-160 us each (all four at one row took 10.5 ms a
 * step without this and 3.0-3.2 ms with it, 2026-12-04). */
#ifndef PF_BYTES
#define PF_BYTES 4096
#endif

/* Returns 0, -1 when scratch memory cannot be allocated, -2 for a type or shape this
 * kernel does not take. */
int q_linear(const float *x, const uint8_t *w, float *y, int32_t qtype, int32_t m, int64_t n,
             int64_t k, int32_t threads) {
    if (threads < 1) threads = 1;
    if (k % QK || (qtype != GGML_Q8_0 && qtype != GGML_Q4_1) || m < 0) return -2;
    if (m == 0 || n == 0) return 0;
    int64_t nb = k / QK, row_bytes = nb * (qtype == GGML_Q8_0 ? 34 : 20);
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
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int32_t r = 0; r < m; r++) {
            quantize_row(x + (int64_t)r * k, nb, xq + (int64_t)r * nb);
            for (int64_t b = 0; b < nb; b++) {
                dx[((r / 4) * nb + b) * 4 + r % 4] = xq[(int64_t)r * nb + b].d;
                sx[((r / 4) * nb + b) * 4 + r % 4] = xq[(int64_t)r * nb + b].s;
            }
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
                        float *y8 = y + (int64_t)r * n + j + jj;
                        if (qtype == GGML_Q4_1)
                            tall_q4_1(wr + jj * row_bytes, xq + (int64_t)r * nb, d8,
                                      sx + (int64_t)(r / 4) * nb * 4, nb, y8, n);
                        else
                            tall_q8_0(wr + jj * row_bytes, xq + (int64_t)r * nb, d8, nb, y8, n);
                    }
#endif
                for (; r < r0 + rows; r += 4) {
                    int rm = r0 + rows - r < 4 ? r0 + rows - r : 4;
                    tile(qtype, wr, row_bytes, xq + (int64_t)r * nb, dx + (int64_t)(r / 4) * nb * 4,
                         sx + (int64_t)(r / 4) * nb * 4, nb, rm, cols, y + (int64_t)r * n + j, n);
                }
            }
        }
    }
    free(xq);
    free(dx);
    free(sx);
    return 0;
}

/* w's blocks as fp32, [N, K]: what the kernel multiplies by, for tests to compare with
 * gguf.quants' dequantization exactly. */
int q_dequantize(const uint8_t *w, float *out, int32_t qtype, int64_t n, int64_t k) {
    if (k % QK || (qtype != GGML_Q8_0 && qtype != GGML_Q4_1)) return -2;
    dequant_rows(w, out, qtype, n, k / QK);
    return 0;
}
